"""The compared methods as benchmark runners, and their tuning on validation data.

Ind-KNN runs through the engine `serve-queries` uses
(:func:`indknn_cli.engine.answer_batch` with an ``ArraySource``, a fresh
``BudgetView`` per query draw and ``make_params`` from serving), not a copy.
Tuning only ever sees a validation split (or public data), never the reported
queries.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .. import accounting
from ..baselines import PrivateKNN, knn_predict, train_linear_noisy_sgd, train_logistic_regression
from ..engine import ArraySource, BudgetView, Candidates, ReusePool, answer_batch
from ..serving import make_params, run_key_for

STAGE1_TAUS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # supplementary §3: τ ∈ {0.05, …, 0.95}


# -- Ind-KNN through the engine --------------------------------------------------------
@dataclass
class IndKnnRun:
    labels: np.ndarray
    released_counts: np.ndarray
    spent: np.ndarray
    budget: float
    seconds: float
    active_after: int
    checkpoints: list = field(default_factory=list)   # (queries answered, median realised spent)
    margins: np.ndarray | None = None                 # noisy (top-1 − top-2) / (σ2·sqrt(K_t)) per query


def run_indknn(private_x: np.ndarray, private_y: np.ndarray, queries: np.ndarray, *, params, n_classes: int,
               seed: int, tag: str, reuse: bool = False, batch_size: int = 256, device: str = "cpu",
               candidate_finder=None, segment: int | None = None, on_segment=None,
               min_margin: float | None = None) -> IndKnnRun:
    """Answer ``queries`` in order with a fresh budget state (one query draw).

    The run key is ``run_key_for(seed, tag)`` — what ``serve-queries --seed``
    uses — so every (seed, tag) gives its own reproducible noise.
    ``on_segment(budgets, answered)`` is called after every ``segment``
    queries (the retraining experiment deletes records there).
    """
    n = private_x.shape[0]
    budgets = BudgetView(spent=np.zeros(n), budget=np.full(n, params.budget), deleted=np.zeros(n, bool),
                         times_selected=np.zeros(n, np.int64))
    source = ArraySource(np.ascontiguousarray(private_x, dtype=np.float32))
    row_to_ledger = np.arange(n, dtype=np.int64)
    labels = np.asarray(private_y, dtype=np.int64)
    pool = ReusePool.empty(private_x.shape[1]) if reuse else None
    key = run_key_for(seed, tag)
    out, counts, margins = [], [], []
    t0 = time.perf_counter()
    m = queries.shape[0]
    seg = segment or max(m, 1)
    for s_lo in range(0, m, seg):
        s_hi = min(m, s_lo + seg)
        for lo in range(s_lo, s_hi, batch_size):
            hi = min(s_hi, lo + batch_size)
            ans = answer_batch(queries[lo:hi], source=source, row_to_ledger=row_to_ledger, row_labels=labels,
                               params=params, n_classes=n_classes, budgets=budgets, run_key=key, first_index=lo,
                               reuse=pool, device=device, candidate_finder=candidate_finder, min_margin=min_margin)
            out.extend(a.label for a in ans)
            counts.extend(a.released_count for a in ans)
            margins.extend(a.margin for a in ans)
        if segment is not None and on_segment is not None:
            on_segment(budgets, s_hi)
    seconds = time.perf_counter() - t0
    active = int(((~budgets.deleted) & (np.nextafter(budgets.spent + params.c1, np.inf) <= budgets.budget)).sum())
    return IndKnnRun(np.asarray(out, np.int64), np.asarray(counts), budgets.spent, params.budget, seconds, active,
                     margins=np.asarray(margins, np.float64))


class PrecomputedFinder:
    """Candidate finder from an exact float64 kernel matrix [queries, rows] (tuning only).

    Returns the same κ ≥ τ candidate sets the flat scan finds; lets one
    validation kernel matrix serve a whole (σ2, τ) grid.
    """

    def __init__(self, kernel: np.ndarray, tau: float):
        self.kernel = kernel
        self.tau = tau
        self.offset = 0

    def __call__(self, queries: np.ndarray, *, row_mask: np.ndarray) -> Candidates:
        m = queries.shape[0]
        block = self.kernel[self.offset:self.offset + m]
        self.offset += m
        rows, kap = [], []
        for t in range(m):
            r = np.flatnonzero((block[t] >= self.tau) & row_mask)
            rows.append(r.astype(np.int64))
            kap.append(block[t, r])
        return Candidates(rows, kap)


def kernel_matrix(q: np.ndarray, x: np.ndarray, *, kernel: str = "cosine", nu: float | None = None) -> np.ndarray:
    """Exact float64 κ(x_j, q_i) for unit vectors."""
    dots = np.asarray(q, np.float64) @ np.asarray(x, np.float64).T
    if kernel == "cosine":
        return dots
    return np.exp(-(2.0 - 2.0 * dots) / (nu * nu))


def nonprivate_indknn(kmat: np.ndarray, ref_y: np.ndarray, n_classes: int, tau: float) -> tuple[np.ndarray, float]:
    """Noise-free kernel vote over κ ≥ τ (Ind-KNN's ε = ∞ reference). Returns (labels, mean |C|)."""
    w = np.where(kmat >= tau, kmat, 0.0)
    onehot = np.eye(n_classes)[ref_y]
    votes = w @ onehot
    # No neighbour: the noise-free rule has no answer; count it as a miss (label −1).
    labels = np.where(votes.max(axis=1) > 0, votes.argmax(axis=1), -1)
    return labels, float((kmat >= tau).sum(axis=1).mean())


# -- tuning ----------------------------------------------------------------------------
@dataclass
class ValData:
    ref_x: np.ndarray
    ref_y: np.ndarray
    q_x: np.ndarray
    q_y: np.ndarray
    n_classes: int
    _kmat: np.ndarray | None = None

    @property
    def kmat(self) -> np.ndarray:
        if self._kmat is None:
            self._kmat = kernel_matrix(self.q_x, self.ref_x)
        return self._kmat


def tune_tau_stage1(val: ValData, *, taus=STAGE1_TAUS, tolerance: float = 0.005) -> dict:
    """Stage 1: non-private Ind-KNN on validation data for each τ; τ* = the smallest τ within
    ``tolerance`` of the best accuracy (more neighbours resist the noise better)."""
    rows = []
    for tau in taus:
        labels, mean_n = nonprivate_indknn(val.kmat, val.ref_y, val.n_classes, tau)
        rows.append({"tau": float(tau), "accuracy": float((labels == val.q_y).mean()), "mean_neighbours": mean_n,
                     "no_neighbour_rate": float((labels < 0).mean())})
    best = max(r["accuracy"] for r in rows)
    tau_star = min(r["tau"] for r in rows if r["accuracy"] >= best - tolerance)
    kap = val.kmat
    top = np.sort(kap, axis=1)[:, ::-1]
    stats = {f"kappa_rank{r}_median": float(np.median(top[:, r - 1])) for r in (1, 10, 50, 200) if r <= top.shape[1]}
    return {"tau_star": tau_star, "sweep": rows, "kernel_weight_stats": stats}


def indknn_val_accuracy(val: ValData, *, epsilon: float, delta: float, conversion: str, tau: float, sigma2: float,
                        queries: int, seed: int, draws: int, reuse: bool = False) -> float:
    params = make_params(epsilon=epsilon, delta=delta, conversion=conversion, tau=tau, sigma2=sigma2,
                         planned_queries=queries)
    accs = []
    for d in range(draws):
        finder = PrecomputedFinder(val.kmat, tau)
        run = run_indknn(val.ref_x, val.ref_y, val.q_x, params=params, n_classes=val.n_classes, seed=seed,
                         tag=f"tune:{epsilon}:{tau}:{sigma2}:{d}", reuse=reuse, batch_size=val.q_x.shape[0],
                         candidate_finder=finder)
        accs.append(float((run.labels == val.q_y).mean()))
    return float(np.mean(accs))


def tune_indknn(val: ValData, *, epsilons, delta: float, conversion: str, queries: int, seed: int,
                sigma2_grid, tau_offsets, draws: int = 1, stage1: dict | None = None) -> dict:
    """Supplementary §3, two stages: τ* from stage 1, then a (σ2, τ) grid with τ ∈ τ* + offsets, per ε."""
    stage1 = stage1 or tune_tau_stage1(val)
    tau_star = stage1["tau_star"]
    taus = sorted({round(min(0.99, max(0.01, tau_star + o)), 4) for o in tau_offsets})
    chosen, grids = {}, {}
    for eps in epsilons:
        grid = []
        for tau in taus:
            for s2 in sigma2_grid:
                acc = indknn_val_accuracy(val, epsilon=eps, delta=delta, conversion=conversion, tau=tau,
                                          sigma2=s2, queries=queries, seed=seed, draws=draws)
                grid.append({"tau": tau, "sigma2": float(s2), "val_accuracy": acc})
        best = max(grid, key=lambda g: (g["val_accuracy"], -abs(g["tau"] - tau_star)))
        chosen[float(eps)] = {"tau": best["tau"], "sigma2": best["sigma2"], "val_accuracy": best["val_accuracy"]}
        grids[float(eps)] = grid
    return {"stage1": stage1, "taus": taus, "sigma2_grid": [float(s) for s in sigma2_grid], "chosen": chosen,
            "grids": grids, "queries": queries, "conversion": conversion,
            "budget": {float(e): accounting.calibrate_budget(epsilon=e, delta=delta, conversion=conversion)
                       for e in epsilons}}


def tune_private_knn(val: ValData, *, epsilon: float, delta: float, queries: int, seed: int, rates, ks,
                     accountant: str, draws: int = 1) -> dict:
    """Grid over (γ, k) on validation data; noise calibrated for ``queries`` answers at (ε, δ)."""
    grid = []
    n = val.ref_x.shape[0]
    for g in rates:
        model = None
        for k in ks:
            if k > max(1, g * n):
                continue
            model = PrivateKNN.calibrated(sampling_rate=g, k=k, epsilon=epsilon, delta=delta,
                                          queries=max(queries, val.q_x.shape[0]), accountant=accountant)
            accs = []
            for d in range(draws):
                rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(7, d)))
                pred = model.predict(val.q_x, features=val.ref_x, labels=val.ref_y, n_classes=val.n_classes, rng=rng)
                accs.append(float((pred == val.q_y).mean()))
            grid.append({"sampling_rate": float(g), "k": int(k), "noise_multiplier": model.noise_multiplier,
                         "val_accuracy": float(np.mean(accs))})
    best = max(grid, key=lambda r: r["val_accuracy"])
    return {"chosen": {"sampling_rate": best["sampling_rate"], "k": best["k"], "val_accuracy": best["val_accuracy"]},
            "grid": grid}


def tune_noisy_sgd(val: ValData, *, epsilon: float | None, delta: float, seed: int, lrs, epochs: int) -> dict:
    grid = []
    for lr in lrs:
        res = train_linear_noisy_sgd(val.ref_x, val.ref_y, n_classes=val.n_classes, epsilon=epsilon, delta=delta,
                                     lr=lr, epochs=epochs, seed=seed)
        grid.append({"lr": float(lr), "val_accuracy": float((res.model.predict(val.q_x) == val.q_y).mean()),
                     "epsilon": res.epsilon})
    best = max(grid, key=lambda r: r["val_accuracy"])
    return {"chosen": {"lr": best["lr"], "val_accuracy": best["val_accuracy"]}, "grid": grid}


def tune_knn(val: ValData, *, ks=(1, 5, 10, 20, 50, 100, 200)) -> dict:
    grid = []
    for k in ks:
        if k > val.ref_x.shape[0]:
            continue
        pred = knn_predict(val.q_x, features=val.ref_x, labels=val.ref_y, n_classes=val.n_classes, k=k)
        grid.append({"k": int(k), "val_accuracy": float((pred == val.q_y).mean())})
    best = max(grid, key=lambda r: r["val_accuracy"])
    return {"chosen": {"k": best["k"], "val_accuracy": best["val_accuracy"]}, "grid": grid}


def tune_logreg(val: ValData, *, l2s=(1e-5, 1e-4, 1e-3, 1e-2)) -> dict:
    grid = []
    for l2 in l2s:
        m = train_logistic_regression(val.ref_x, val.ref_y, n_classes=val.n_classes, l2=l2)
        grid.append({"l2": float(l2), "val_accuracy": float((m.predict(val.q_x) == val.q_y).mean())})
    best = max(grid, key=lambda r: r["val_accuracy"])
    return {"chosen": {"l2": best["l2"], "val_accuracy": best["val_accuracy"]}, "grid": grid}


def accuracy(pred: np.ndarray, truth: np.ndarray) -> float:
    return float((np.asarray(pred) == np.asarray(truth)).mean()) if len(truth) else math.nan
