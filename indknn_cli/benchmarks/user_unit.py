"""Record unit vs user unit (SPEC §9): accuracy and throughput on data with several records per user.

    indknn bench user-unit --dataset ag_news --eps 0.5,1,2 --draws 3 --out bench_out/user_unit

AG News test split (MiniLM features, cached by `bench`), split at random (seeded) into private records and
queries; the private records are grouped into users of 1–20 records at random (sizes uniform on 1..20).
Per ε, Ind-KNN runs through the serving engine (`engine.answer_batch`) with the record unit (a per-record
`BudgetView`) and the user unit (a per-user `UserBudgetView`, all of a user's records, and the k most
similar per query). Prints one JSON line with the table; a table on stderr; `--out` also writes a PNG.

The guarantees differ: the record unit's ε is per record (a user with m records is protected far less),
the user unit's ε is per user with all their records. The comparison is of the accuracy each costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..engine import ArraySource, BudgetView, answer_batch
from ..ledger_state import LedgerState
from ..serving import make_params, run_key_for
from ..user_unit import UserBudgetView


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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="indknn bench user-unit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="ag_news")
    ap.add_argument("--eps", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--max-records", type=int, default=20, help="users have 1..N records (uniform)")
    ap.add_argument("--k", type=int, default=3, help="--max-records-per-user of the capped user-unit row")
    ap.add_argument("--tau", type=float, default=0.25)
    ap.add_argument("--sigma2", type=float, default=0.6)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from .data import load_dataset

    ds = load_dataset(a.dataset)
    rows = []

    def split(draw: int):
        """The draw's generator (users are drawn from it next) and its query and private rows."""
        rng = np.random.default_rng(a.seed * 1000 + draw)
        perm = rng.permutation(len(ds.x))
        return rng, perm[:a.queries], perm[a.queries:]

    majority = []  # per draw: the private rows' most common label, as a constant answer (the floor to beat)
    for draw in range(a.draws):
        _, qi, pi = split(draw)
        top = int(np.bincount(ds.y[pi], minlength=len(ds.label_names)).argmax())
        majority.append(float((ds.y[qi] == top).mean()))
    print(f"majority class (constant)  acc {np.median(majority):.3f}", file=sys.stderr)
    for eps in a.eps:
        for unit, k in (("record", None), ("user", None), ("user", a.k)):
            accs, qps = [], []
            for draw in range(a.draws):
                rng, qi, pi = split(draw)
                users = assign_users(len(pi), max_records=a.max_records, rng=rng)
                params = make_params(epsilon=eps, delta=a.delta, tau=a.tau, sigma2=a.sigma2,
                                     planned_queries=a.queries, k_min=30, privacy_unit=unit,
                                     max_records_per_user=k)
                pred, secs = run_once(ds.x[pi], ds.y[pi], users, ds.x[qi], params=params,
                                      n_classes=len(ds.label_names), unit=unit, k=k, seed=a.seed + draw)
                accs.append(float((pred == ds.y[qi]).mean()))
                qps.append(a.queries / secs)
            name = "record" if unit == "record" else f"user (k={k})" if k else "user (all records)"
            rows.append({"epsilon": eps, "unit": unit, "variant": name, "max_records_per_user": k,
                         "accuracy_median": float(np.median(accs)), "accuracies": accs,
                         "queries_per_s_median": float(np.median(qps)),
                         "adjacency": f"add/remove one {unit}", "conversion": "gdp"})
            print(f"ε={eps:g} (gdp, per {unit}, add/remove one {unit}) {name:20s} acc {np.median(accs):.3f}  "
                  f"{np.median(qps):7.0f} q/s", file=sys.stderr)
    summary = {"experiment": "user-unit", "dataset": a.dataset, "private": len(ds.x) - a.queries,
               "queries": a.queries, "users_records": f"1..{a.max_records} uniform", "tau": a.tau,
               "sigma2": a.sigma2, "delta": a.delta, "draws": a.draws, "rows": rows,
               "majority_class": {"method": "majority class (constant)", "accuracy_median": float(np.median(majority)),
                                  "accuracies": majority},
               "note": "record-unit ε is per record; user-unit ε is per user with all their records"}
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "user_unit.json").write_text(json.dumps(summary, indent=1))
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name in dict.fromkeys(r["variant"] for r in rows):
            sel = [r for r in rows if r["variant"] == name]
            line, = ax.plot([r["epsilon"] for r in sel], [r["accuracy_median"] for r in sel], marker="o", label=name)
            ax.fill_between([r["epsilon"] for r in sel], [min(r["accuracies"]) for r in sel],
                            [max(r["accuracies"]) for r in sel], color=line.get_color(), alpha=0.15, linewidth=0)
        eps = sorted({r["epsilon"] for r in rows})
        ax.axhline(float(np.median(majority)), color="grey", linestyle=":", label="majority class")
        ax.fill_between([eps[0], eps[-1]], min(majority), max(majority), color="grey", alpha=0.12, linewidth=0)
        ax.set_xlabel("ε (gdp, δ = %g; per record or per user, add/remove one of them)" % a.delta)
        ax.set_ylabel("median accuracy (%d draws)" % a.draws)
        ax.set_title("AG News, users of 1–%d records (bands: min–max over draws)" % a.max_records, fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.out / "user_unit.png", dpi=120)
    print(json.dumps(summary))
    return 0
