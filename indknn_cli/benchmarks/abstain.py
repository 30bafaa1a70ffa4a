"""`bench min-margin`: coverage and accuracy on answered queries of `serve-queries --min-margin M` (issue 18).

Ind-KNN is tuned on the validation split as in every other experiment, then each query draw is served at ε
with the engine (the same code as serve-queries). Without reuse an abstention is pure post-processing of the
released noisy votes, so one run per draw gives every M: an answer is kept iff its noisy margin
(top-1 − top-2) / (σ2·sqrt(K_t)) ≥ M. With prediction reuse an abstention gives no reuse vote and changes later
answers, so each M is served on its own (``min_margin=M``), as serve-queries does.

Charges never depend on M (the margin reads released noise only); the figures here are the data holder's.
"""

from __future__ import annotations

import time

import numpy as np

from ..engine import ABSTAIN_LABEL
from ..serving import check_min_margin, make_params
from .config import BenchConfig
from .progress import say
from .data import Dataset, Split
from .experiments import PROTOCOL, dataset_info, eps_at, majority_class, prepare, privacy_note, query_draws
from .methods import PrecomputedFinder, kernel_matrix, run_indknn, tune_indknn


def _point(labels: np.ndarray, truth: np.ndarray, answered: np.ndarray) -> tuple[float, float]:
    """(coverage, accuracy on the answered queries; nan when none is answered)."""
    cov = float(answered.mean()) if answered.size else float("nan")
    acc = float((labels[answered] == truth[answered]).mean()) if answered.any() else float("nan")
    return cov, acc


def _stats(vals: list[float]) -> dict:
    v = np.asarray(vals, np.float64)
    v = v[~np.isnan(v)]
    if not v.size:
        return {"median": None, "min": None, "max": None, "values": [None] * len(vals)}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
            "values": [None if np.isnan(x) else float(x) for x in vals]}


def min_margin_curve(ds: Dataset, split: Split, cfg: BenchConfig, *, epsilon: float = 1.0,
                     progress=lambda s: None) -> dict:
    """Coverage and accuracy-on-answered per M in ``cfg.margins`` at ``epsilon``, with and without reuse."""
    t_start = time.perf_counter()
    margins = [check_min_margin(float(m)) for m in cfg.margins]
    p = prepare(ds, split, cfg)
    draws = query_draws(p.pool_x.shape[0], p.T, cfg.draws, cfg.seed)
    progress(f"tuning Ind-KNN at {eps_at(epsilon, cfg.conversion)} on {p.val.q_x.shape[0]} validation queries")
    ti = tune_indknn(p.val, epsilons=(epsilon,), delta=cfg.delta, conversion=cfg.conversion, queries=p.T,
                     seed=cfg.seed, sigma2_grid=cfg.sigma2_grid, tau_offsets=cfg.tau_offsets, draws=cfg.tune_draws)
    ch = ti["chosen"][float(epsilon)]
    params = make_params(epsilon=epsilon, delta=cfg.delta, conversion=cfg.conversion, tau=ch["tau"],
                         sigma2=ch["sigma2"], planned_queries=p.T)
    points = {(m, reuse): ([], []) for m in margins for reuse in (False, True)}
    for d, idx in enumerate(draws):
        truth = p.pool_y[idx]
        kmat = kernel_matrix(p.pool_x[idx], p.priv_x)  # exact κ once per draw, for every run below
        run = run_indknn(p.priv_x, p.priv_y, p.pool_x[idx], params=params, n_classes=p.ds.n_classes, seed=cfg.seed,
                         tag=f"margin:{epsilon}:{p.T}:{d}", device=cfg.device,
                         candidate_finder=PrecomputedFinder(kmat, params.tau))
        for m in margins:  # no reuse: post-processing of one run
            cov, acc = _point(run.labels, truth, run.margins >= m)
            points[(m, False)][0].append(cov)
            points[(m, False)][1].append(acc)
        for m in margins:  # reuse: abstentions change later reuse votes, so one run per M
            r = run_indknn(p.priv_x, p.priv_y, p.pool_x[idx], params=params, n_classes=p.ds.n_classes,
                           seed=cfg.seed, tag=f"margin-reuse:{epsilon}:{p.T}:{d}", reuse=True, device=cfg.device,
                           min_margin=m, candidate_finder=PrecomputedFinder(kmat, params.tau))
            cov, acc = _point(r.labels, truth, r.labels != ABSTAIN_LABEL)
            points[(m, True)][0].append(cov)
            points[(m, True)][1].append(acc)
        say(progress, f"draw {d + 1}/{len(draws)} served", done=d + 1, total=len(draws))
    rows = []
    for (m, reuse), (covs, accs) in points.items():
        rows.append({"min_margin": m, "reuse": reuse, "coverage": _stats(covs), "accuracy_answered": _stats(accs)})
    maj = majority_class(p, draws)

    def cell(v):
        return None if v is None else round(v, 4)

    table = {"title": f"--min-margin at ε={epsilon:g}: coverage / accuracy on answered (median of {cfg.draws} "
                      f"draws)",
             "columns": ["M", "coverage", "accuracy answered", "coverage (reuse)", "accuracy answered (reuse)"],
             "rows": [[f"{m:g}"] + [cell(r[k]["median"]) for reuse in (False, True)
                                    for r in rows if r["min_margin"] == m and r["reuse"] == reuse
                                    for k in ("coverage", "accuracy_answered")] for m in margins]
             + [[maj["method"], 1.0, round(maj["accuracy_median"], 4), 1.0, round(maj["accuracy_median"], 4)]],
             "note": privacy_note(cfg, p.T) + " Abstentions are free: the margin is post-processing of the charged "
                     "noisy votes; the charges are the same for every M."}
    return {"experiment": "min-margin", "dataset": dataset_info(p), "config": cfg.as_dict(), "epsilon": epsilon,
            "protocol": PROTOCOL, "indknn_params": params.as_dict(), "tuning": {"indknn": ti}, "results": rows,
            "majority_class": maj, "table": table, "seconds": {"total": time.perf_counter() - t_start}}


def plot(result: dict, out_dir, stem: str) -> list:
    """Accuracy on answered queries against coverage, one point per M (bands: min–max over draws)."""
    from .report import plot_lines

    series, bands = {}, {}
    for reuse, name in ((False, "answered, no reuse"), (True, "answered, reuse")):
        pts = sorted((r["coverage"]["median"], r["accuracy_answered"]["median"], r["accuracy_answered"]["min"],
                      r["accuracy_answered"]["max"]) for r in result["results"]
                     if r["reuse"] == reuse and r["coverage"]["median"] is not None
                     and r["accuracy_answered"]["median"] is not None)
        if pts:
            series[name] = ([q[0] for q in pts], [q[1] for q in pts])
            bands[name] = ([q[2] for q in pts], [q[3] for q in pts])
    maj = result["majority_class"]
    margins = ", ".join(f"{m:g}" for m in result["config"]["margins"])
    d = result["dataset"]
    return [plot_lines(out_dir / f"{stem}.png", series=series, bands=bands,
                       hlines={f"majority class ({maj['label_name']})": maj["accuracy_median"]},
                       hbands={f"majority class ({maj['label_name']})": (maj["accuracy_min"], maj["accuracy_max"])},
                       xlabel=f"coverage (share of queries answered), M ∈ {{{margins}}} right to left",
                       ylabel="accuracy on answered queries (band: min–max over draws)",
                       title=f"serve-queries --min-margin at ε={result['epsilon']:g} (gdp, per record, add/remove "
                             f"one record)\n{d['name']} "
                             f"({d['extractor']}, {d['split']['private']} private)")]
