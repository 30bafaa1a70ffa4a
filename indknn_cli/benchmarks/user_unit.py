"""Record unit vs user unit (SPEC §9): accuracy and throughput on data with several records per user.

    indknn bench user-unit --dataset ag_news --eps 0.5,1,2 --draws 3 --out bench_out/user_unit

AG News test split (MiniLM features, cached by `bench`), split at random (seeded) into private records and
queries; the private records are grouped into users of 1–20 records at random (sizes uniform on 1..20).
Per ε, Ind-KNN runs through the serving engine (`engine.answer_batch`) with the record unit (a per-record
`BudgetView`) and the user unit (a per-user `UserBudgetView`, all of a user's records, and the k most
similar per query). Returns one dict with the table (a line per row through ``progress``); ``out`` also
gets the JSON and a PNG.

The guarantees differ: the record unit's ε is per record (a user with m records is protected far less),
the user unit's ε is per user with all their records. The comparison is of the accuracy each costs.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..engine import ArraySource, BudgetView, answer_batch
from ..ledger_state import LedgerState
from ..serving import make_params, run_key_for
from ..user_unit import UserBudgetView

log = logging.getLogger(__name__)


def assign_users(n: int, *, max_records: int, rng: np.random.Generator) -> np.ndarray:
    """User ids for n records: users of 1..max_records records (uniform sizes), records shuffled."""
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(rng.integers(1, max_records + 1)))
    users = np.repeat(np.arange(len(sizes)), sizes)[:n]
    return np.array([f"u{u}" for u in rng.permutation(users)], dtype=object)


def _user_view(users: np.ndarray, *, budget: float, k: int | None) -> UserBudgetView:
    n = len(users)
    state = LedgerState(np.array([f"r{i}" for i in range(n)], object), users, np.arange(n), np.full(n, budget),
                        np.zeros(n), np.zeros(n, np.int64), np.zeros(n, bool), np.full(n, np.nan), np.zeros(n))
    return UserBudgetView.from_ledger_state(state, budget=budget, user_for_missing="refuse", max_records_per_user=k)


def run_once(x, y, users, q, *, params, n_classes, unit: str, k: int | None, seed: int, batch_size: int = 256):
    n = len(x)
    if unit == "record":
        budgets = BudgetView(spent=np.zeros(n), budget=np.full(n, params.budget), deleted=np.zeros(n, bool),
                             times_selected=np.zeros(n, np.int64))
    else:
        budgets = _user_view(users, budget=params.budget, k=k)
    source = ArraySource(np.ascontiguousarray(x, dtype=np.float32))
    key = run_key_for(seed, f"user-unit-{unit}-{k}")
    labels = []
    t0 = time.perf_counter()
    for lo in range(0, len(q), batch_size):
        ans = answer_batch(q[lo:lo + batch_size], source=source, row_to_ledger=np.arange(n), row_labels=y,
                           params=params, n_classes=n_classes, budgets=budgets, run_key=key, first_index=lo,
                           reuse=None, device="cpu")
        labels += [a.label for a in ans]
    return np.asarray(labels), time.perf_counter() - t0


def run(*, dataset: str, eps: Sequence[float], draws: int, queries: int, user_size_max: int,
        max_records_per_user: int, tau: float, sigma2: float, delta: float, seed: int, out: Path | None = None,
        progress: Callable[[str], None] = log.info) -> dict:
    """The record unit, the user unit and the user unit capped at ``max_records_per_user`` records per ε in ``eps``
    (median over ``draws`` random splits of ``queries`` queries; users of 1..``user_size_max`` records); the keywords
    are the CLI's flags. ``progress(text)``: a line per row. ``out``: a folder that also gets user_unit.json and
    user_unit.png."""
    max_records, k = user_size_max, max_records_per_user
    from .data import load_dataset

    ds = load_dataset(dataset)
    rows = []

    def split(draw: int):
        """The draw's generator (users are drawn from it next) and its query and private rows."""
        rng = np.random.default_rng(seed * 1000 + draw)
        perm = rng.permutation(len(ds.x))
        return rng, perm[:queries], perm[queries:]

    majority = []  # per draw: the private rows' most common label, as a constant answer (the floor to beat)
    for draw in range(draws):
        _, qi, pi = split(draw)
        top = int(np.bincount(ds.y[pi], minlength=len(ds.label_names)).argmax())
        majority.append(float((ds.y[qi] == top).mean()))
    progress(f"majority class (constant)  acc {np.median(majority):.3f}")
    for epsilon in eps:
        for unit, cap in (("record", None), ("user", None), ("user", k)):
            accs, qps = [], []
            for draw in range(draws):
                rng, qi, pi = split(draw)
                users = assign_users(len(pi), max_records=max_records, rng=rng)
                params = make_params(epsilon=epsilon, delta=delta, tau=tau, sigma2=sigma2,
                                     planned_queries=queries, k_min=30, privacy_unit=unit,
                                     max_records_per_user=cap)
                pred, secs = run_once(ds.x[pi], ds.y[pi], users, ds.x[qi], params=params,
                                      n_classes=len(ds.label_names), unit=unit, k=cap, seed=seed + draw)
                accs.append(float((pred == ds.y[qi]).mean()))
                qps.append(queries / secs)
            name = "record" if unit == "record" else f"user (k={cap})" if cap else "user (all records)"
            rows.append({"epsilon": epsilon, "unit": unit, "variant": name, "max_records_per_user": cap,
                         "accuracy_median": float(np.median(accs)), "accuracies": accs,
                         "queries_per_s_median": float(np.median(qps)),
                         "adjacency": f"add/remove one {unit}", "conversion": "gdp"})
            progress(f"ε={epsilon:g} (gdp, per {unit}, add/remove one {unit}) {name:20s} acc "
                     f"{np.median(accs):.3f}  {np.median(qps):7.0f} q/s")
    summary = {"experiment": "user-unit", "dataset": dataset, "private": len(ds.x) - queries,
               "queries": queries, "users_records": f"1..{max_records} uniform", "tau": tau,
               "sigma2": sigma2, "delta": delta, "draws": draws, "rows": rows,
               "majority_class": {"method": "majority class (constant)", "accuracy_median": float(np.median(majority)),
                                  "accuracies": majority},
               "note": "record-unit ε is per record; user-unit ε is per user with all their records"}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "user_unit.json").write_text(json.dumps(summary, indent=1))
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name in dict.fromkeys(r["variant"] for r in rows):
            sel = [r for r in rows if r["variant"] == name]
            line, = ax.plot([r["epsilon"] for r in sel], [r["accuracy_median"] for r in sel], marker="o", label=name)
            ax.fill_between([r["epsilon"] for r in sel], [min(r["accuracies"]) for r in sel],
                            [max(r["accuracies"]) for r in sel], color=line.get_color(), alpha=0.15, linewidth=0)
        xs = sorted({r["epsilon"] for r in rows})
        ax.axhline(float(np.median(majority)), color="grey", linestyle=":", label="majority class")
        ax.fill_between([xs[0], xs[-1]], min(majority), max(majority), color="grey", alpha=0.12, linewidth=0)
        ax.set_xlabel("ε (gdp, δ = %g; per record or per user, add/remove one of them)" % delta)
        ax.set_ylabel("median accuracy (%d draws)" % draws)
        ax.set_title("AG News, users of 1–%d records (bands: min–max over draws)" % max_records, fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "user_unit.png", dpi=120)
    return summary
