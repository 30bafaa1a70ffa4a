"""The experiments of `indknn bench` (paper §4, Figures 1–4, Tables 1–3).

Each function takes a :class:`Dataset`, a :class:`Split` and a
:class:`BenchConfig` and returns one JSON-ready dict with every figure, the
exact configuration and the table `bench` prints. Noise is seeded (experiments
only, SPEC §8) and the seeds are in the output.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import accounting, rounding
from ..baselines import PrivateKNN, knn_predict, opacus_epsilon, train_linear_noisy_sgd, train_logistic_regression
from ..serving import make_params
from ..wording import count
from .config import BenchConfig
from .progress import say
from .data import Dataset, Split, synthetic_dataset
from .methods import (ValData, accuracy, kernel_matrix, nonprivate_indknn, run_indknn, tune_indknn, tune_knn,
                      tune_logreg, tune_noisy_sgd, tune_private_knn, tune_tau_stage1)

Progress = Callable[[str], None]
#: Called with the result rows so far after each step (ε, T, Q or configuration) of an experiment.
Partial = Callable[[list], None]
PROTOCOL = ("Hyper-parameters of every method are tuned on a validation split carved from the private side "
            "(validation queries asked of the remaining private records), never on the reported queries. "
            "Tuning reads private records without accounting, as the paper's protocol does; in a deployment "
            "tune on public or validation data. Each query draw starts from a fresh budget state.")


@dataclass
class Prepared:
    ds: Dataset
    split: Split
    priv_x: np.ndarray
    priv_y: np.ndarray
    pool_x: np.ndarray
    pool_y: np.ndarray
    val: ValData
    T: int


def prepare(ds: Dataset, split: Split, cfg: BenchConfig) -> Prepared:
    T = cfg.queries or min(1000, split.query_pool.size)
    if T > split.query_pool.size:
        raise ValueError(f"T={T} queries per draw but the query pool has {split.query_pool.size}")
    val = ValData(ds.x[split.val_reference], ds.y[split.val_reference], ds.x[split.val_queries],
                  ds.y[split.val_queries], ds.n_classes)
    return Prepared(ds, split, ds.x[split.private], ds.y[split.private], ds.x[split.query_pool],
                    ds.y[split.query_pool], val, T)


def _seed_of(seed: int, *parts) -> np.random.SeedSequence:
    tag = ":".join(str(p) for p in parts)
    return np.random.SeedSequence(entropy=seed, spawn_key=(zlib.crc32(tag.encode()),))


def query_draws(pool_n: int, T: int, draws: int, seed: int, tag: str = "draw") -> list[np.ndarray]:
    """``draws`` seeded samples of T pool rows without replacement (a permutation when T = pool)."""
    return [np.random.default_rng(_seed_of(seed, tag, T, d)).choice(pool_n, size=T, replace=False)
            for d in range(draws)]


def _summary(accs: list[float]) -> dict:
    return {"accuracy_median": float(np.median(accs)), "accuracies": [float(a) for a in accs],
            "accuracy_min": float(min(accs)), "accuracy_max": float(max(accs))}


def dataset_info(p: Prepared) -> dict:
    return {"name": p.ds.name, "extractor": p.ds.extractor, "source": p.ds.source, "dim": int(p.ds.x.shape[1]),
            "n_classes": p.ds.n_classes, "label_names": p.ds.label_names, "split": p.split.sizes(),
            "split_seed": p.split.seed, "queries_per_draw": p.T, **p.ds.info}


#: Every ε the benchmarks print: unit and adjacency (SPEC §8; the audit's D6). All methods here are record-level
#: under add/remove of one record (Ind-KNN's record unit, dp-accounting's and Opacus's default relation).
UNIT = {"unit": "record", "adjacency": "add/remove one record"}
UNIT_TEXT = "per record, adjacency add/remove one record (under replace-one the Gaussian-DP μ doubles)"
#: The short form for progress lines (stderr) and table headers.
UNIT_SHORT = "per record, add/remove one record"


def eps_at(eps: float, how: str) -> str:
    """``ε=1 (gdp, per record, add/remove one record)``: an ε as the progress lines print it (SPEC §8)."""
    return f"ε={float(eps):g} ({how}, {UNIT_SHORT})"


def _indknn_row(p: Prepared, cfg: BenchConfig, *, eps: float, tau: float, sigma2: float, T: int,
                draws: list[np.ndarray], reuse: bool, tag: str) -> dict:
    params = make_params(epsilon=eps, delta=cfg.delta, conversion=cfg.conversion, tau=tau, sigma2=sigma2,
                         planned_queries=T)
    accs, secs, med_sel, active = [], 0.0, [], []
    for d, idx in enumerate(draws):
        run = run_indknn(p.priv_x, p.priv_y, p.pool_x[idx], params=params, n_classes=p.ds.n_classes,
                         seed=cfg.seed, tag=f"{tag}:{eps}:{T}:{d}", reuse=reuse, device=cfg.device)
        accs.append(accuracy(run.labels, p.pool_y[idx]))
        secs += run.seconds
        med_sel.append(float(np.median(run.released_counts)))
        active.append(run.active_after)
    return {"method": "ind-knn+reuse" if reuse else "ind-knn", "epsilon": eps, "delta": cfg.delta,
            "privacy": f"ε by {accounting.CONVERSION_LABEL[cfg.conversion]}, {UNIT_TEXT}", "conversion": cfg.conversion,
            **UNIT,
            "hyper": {"tau": tau, "sigma2": sigma2, "sigma1": params.sigma1, "budget_B": params.budget,
                      "k_min": params.k_min, "planned_queries": T, "kernel": params.kernel},
            "median_released_count": float(np.median(med_sel)), "active_records_after": active,
            "seconds_per_query": secs / (len(draws) * T), "seed": cfg.seed, **_summary(accs)}


def _pknn_row(p: Prepared, cfg: BenchConfig, *, eps: float, rate: float, k: int, T: int,
              draws: list[np.ndarray]) -> dict:
    model = PrivateKNN.calibrated(sampling_rate=rate, k=k, epsilon=eps, delta=cfg.delta, queries=T,
                                  accountant=cfg.pknn_accountant)
    accs, t0 = [], time.perf_counter()
    for d, idx in enumerate(draws):
        rng = np.random.default_rng(_seed_of(cfg.seed, "pknn", eps, T, d))
        pred = model.predict(p.pool_x[idx], features=p.priv_x, labels=p.priv_y, n_classes=p.ds.n_classes, rng=rng)
        accs.append(accuracy(pred, p.pool_y[idx]))
    return {"method": "private-knn", "epsilon": eps, "delta": cfg.delta,
            "privacy": f"ε by dp-accounting {cfg.pknn_accountant.upper()} (T-fold Poisson-subsampled Gaussian), "
                       f"{UNIT_TEXT}", "conversion": f"dp-accounting {cfg.pknn_accountant}", **UNIT,
            "accounted_epsilon": model.accounted_epsilon(), "hyper": model.as_dict(),
            "seconds_per_query": (time.perf_counter() - t0) / (len(draws) * T), "seed": cfg.seed, **_summary(accs)}


def _sgd_models(p: Prepared, cfg: BenchConfig, *, eps: float | None, lr: float, n: int) -> list:
    return [train_linear_noisy_sgd(p.priv_x, p.priv_y, n_classes=p.ds.n_classes, epsilon=eps, delta=cfg.delta,
                                   lr=lr, epochs=cfg.sgd_epochs, seed=cfg.seed * 1000 + d,
                                   accountant=cfg.sgd_accountant) for d in range(n)]


def _sgd_row(p: Prepared, cfg: BenchConfig, *, eps: float, lr: float, models: list, draws: list) -> dict:
    accs = [accuracy(m.model.predict(p.pool_x[idx]), p.pool_y[idx]) for m, idx in zip(models, draws)]
    return {"method": "linear-noisysgd", "epsilon": eps, "delta": cfg.delta,
            "privacy": f"ε by Opacus {cfg.sgd_accountant.upper()} accountant, {UNIT_TEXT}",
            "conversion": f"opacus {cfg.sgd_accountant}", **UNIT,
            "accounted_epsilon": max(m.epsilon for m in models), "hyper": {**models[0].as_dict(), "lr": lr},
            "train_seconds": float(np.median([m.seconds for m in models])), "seed": cfg.seed, **_summary(accs)}


def _nonprivate_rows(p: Prepared, cfg: BenchConfig, draws, tuning: dict, progress: Progress) -> list[dict]:
    progress("non-private references (k-NN, Ind-KNN without noise, logistic regression)")
    tuning["knn"] = tune_knn(p.val)
    tuning["logreg"] = tune_logreg(p.val)
    k, l2 = tuning["knn"]["chosen"]["k"], tuning["logreg"]["chosen"]["l2"]
    tau = tuning["indknn"]["stage1"]["tau_star"]
    lr_model = train_logistic_regression(p.priv_x, p.priv_y, n_classes=p.ds.n_classes, l2=l2)
    rows = {"knn": [], "ind-knn": [], "logreg": []}
    for idx in draws:
        q, y = p.pool_x[idx], p.pool_y[idx]
        rows["knn"].append(accuracy(knn_predict(q, features=p.priv_x, labels=p.priv_y, n_classes=p.ds.n_classes,
                                                k=k), y))
        rows["ind-knn"].append(accuracy(nonprivate_indknn(kernel_matrix(q, p.priv_x), p.priv_y, p.ds.n_classes,
                                                          tau)[0], y))
        rows["logreg"].append(accuracy(lr_model.predict(q), y))
    hyper = {"knn": {"k": k}, "ind-knn": {"tau": tau}, "logreg": {"l2": l2}}
    names = {"knn": "knn (non-private)", "ind-knn": "ind-knn (non-private)", "logreg": "logistic regression"}
    return [{"method": names[m], "epsilon": math.inf, "hyper": hyper[m], **_summary(a)} for m, a in rows.items()]


def accuracy_vs_eps(ds: Dataset, split: Split, cfg: BenchConfig, progress: Progress = lambda s: None,
                    partial: Partial = lambda rows: None) -> dict:
    """Median accuracy over query draws per ε (paper Figures 1a, 2; Table 2), each method tuned on validation."""
    t_start = time.perf_counter()
    p = prepare(ds, split, cfg)
    draws = query_draws(p.pool_x.shape[0], p.T, cfg.draws, cfg.seed)
    tuning: dict = {}
    timing: dict = {}
    if cfg.baselines:
        progress(f"tuning Ind-KNN on {p.val.q_x.shape[0]} validation queries ({count(len(cfg.epsilons), 'ε value')}, "
                 f"{cfg.conversion}, {UNIT_SHORT})")
        t0 = time.perf_counter()
        tuning["indknn"] = tune_indknn(p.val, epsilons=cfg.epsilons, delta=cfg.delta, conversion=cfg.conversion,
                                       queries=p.T, seed=cfg.seed, sigma2_grid=cfg.sigma2_grid,
                                       tau_offsets=cfg.tau_offsets, draws=cfg.tune_draws)
        timing["tune_indknn"] = time.perf_counter() - t0
    rows = []
    kcache: dict = {}  # exact κ of each query draw, shared by the privately tuned and oracle rows of every ε
    for i_eps, eps in enumerate(cfg.epsilons):
        if cfg.baselines:
            rows += _baseline_rows(p, cfg, eps=eps, draws=draws, tuning=tuning, timing=timing, progress=progress,
                                   i_eps=i_eps)
        if cfg.private_tuning:
            from .private_tuning import private_rows

            t0 = time.perf_counter()
            rows += private_rows(p, cfg, eps=eps, draws=draws, progress=progress, kcache=kcache)
            timing[f"private_tuning_eps{eps}"] = time.perf_counter() - t0
        partial(rows)
    if cfg.baselines:
        rows += _nonprivate_rows(p, cfg, draws, tuning, progress)
    timing["total"] = time.perf_counter() - t_start
    maj = majority_class(p, draws)
    note = (privacy_note(cfg, p.T) if cfg.baselines else  # review 73, F10: named gdp and the others' accountants
            f"δ={cfg.delta:g}, T={p.T} queries per draw, median of {cfg.draws} draws. Every ε: {UNIT_TEXT}.") + (
        "" if not cfg.private_tuning else
        " Ind-KNN tuned privately: `index --tune private`'s search on the private side, its RDP cost composed with "
        "serving into the same total ε" + (" (the other rows are tuned non-privately on a validation split)."
                                           if cfg.baselines else "; no other method was run (--no-baselines)."))
    return {"experiment": "accuracy-vs-eps", "dataset": dataset_info(p), "config": cfg.as_dict(),
            "protocol": PROTOCOL if cfg.baselines else None, "results": rows, "tuning": tuning, "seconds": timing,
            "majority_class": maj,
            "table": eps_table(rows, cfg.epsilons, note=note, majority=maj)}


def _baseline_rows(p: Prepared, cfg: BenchConfig, *, eps: float, draws: list, tuning: dict, timing: dict,
                   progress: Progress, i_eps: int) -> list[dict]:
    """Ind-KNN (tuned non-privately, with and without reuse), Private-kNN and Linear NoisySGD at one ε."""
    rows = []
    ch = tuning["indknn"]["chosen"][float(eps)]
    say(progress, f"{eps_at(eps, 'each method by its own accountant')}: Ind-KNN τ={ch['tau']}, "
        f"σ2={ch['sigma2']}; tuning Private-kNN and NoisySGD",
        done=i_eps, total=len(cfg.epsilons))
    t0 = time.perf_counter()
    tp = tune_private_knn(p.val, epsilon=eps, delta=cfg.delta, queries=p.T, seed=cfg.seed,
                          rates=cfg.pknn_rates, ks=cfg.pknn_ks, accountant=cfg.pknn_accountant)
    ts = tune_noisy_sgd(p.val, epsilon=eps, delta=cfg.delta, seed=cfg.seed, lrs=cfg.sgd_lrs,
                        epochs=cfg.sgd_epochs)
    tuning.setdefault("private_knn", {})[float(eps)] = tp
    tuning.setdefault("noisy_sgd", {})[float(eps)] = ts
    timing[f"tune_baselines_eps{eps}"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for reuse in (False, True):
        rows.append(_indknn_row(p, cfg, eps=eps, tau=ch["tau"], sigma2=ch["sigma2"], T=p.T, draws=draws,
                                reuse=reuse, tag="report"))
    rows.append(_pknn_row(p, cfg, eps=eps, rate=tp["chosen"]["sampling_rate"], k=tp["chosen"]["k"], T=p.T,
                          draws=draws))
    models = _sgd_models(p, cfg, eps=eps, lr=ts["chosen"]["lr"], n=len(draws))
    rows.append(_sgd_row(p, cfg, eps=eps, lr=ts["chosen"]["lr"], models=models, draws=draws))
    timing[f"report_eps{eps}"] = time.perf_counter() - t0
    say(progress, f"{eps_at(eps, 'each method by its own accountant')}: "
        + ", ".join(f"{r['method']} {r['accuracy_median']:.3f}" for r in rows),
        done=i_eps + 1, total=len(cfg.epsilons))
    return rows


def majority_class(p: Prepared, draws: list[np.ndarray]) -> dict:
    """Always answering the private side's most frequent label: the floor every accuracy is read against."""
    label = int(np.bincount(p.priv_y, minlength=p.ds.n_classes).argmax())
    accs = [accuracy(np.full(idx.size, label), p.pool_y[idx]) for idx in draws]
    return {"method": "majority class (constant)", "label": label, "label_name": p.ds.label_names[label],
            **_summary(accs)}


def privacy_note(cfg: BenchConfig, T: int) -> str:
    return (f"δ={cfg.delta:g}, T={T} queries per draw, median of {cfg.draws} draws. ε of Ind-KNN: "
            f"{accounting.CONVERSION_LABEL[cfg.conversion]}; Private-kNN: dp-accounting "
            f"{cfg.pknn_accountant.upper()}; Linear NoisySGD: Opacus {cfg.sgd_accountant.upper()} accountant. "
            f"Every ε: {UNIT_TEXT}.")


#: How the table names the rows tuned non-privately when a privately tuned row stands next to them.
TABLE_LABEL = {"ind-knn": "ind-knn (tuned non-privately)", "ind-knn+reuse": "ind-knn+reuse (tuned non-privately)"}


def eps_table(rows: list[dict], epsilons, note: str = "", majority: dict | None = None) -> dict:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cols = [f"ε={e:g}" for e in epsilons] + ["ε=∞"]
    private = any(r["method"].endswith("(tuned privately)") for r in rows)
    out = []
    for m in methods:
        cells = []
        for e in list(epsilons) + [math.inf]:
            r = next((r for r in rows if r["method"] == m and r["epsilon"] == e), None)
            cells.append(None if r is None else round(r["accuracy_median"], 4))
        out.append([TABLE_LABEL.get(m, m) if private else m] + cells)
    if majority is not None:
        out.append([majority["method"]] + [round(majority["accuracy_median"], 4)] * (len(cols)))
    return {"title": "median accuracy", "columns": ["method"] + cols, "rows": out, "note": note}


def accuracy_vs_queries(ds: Dataset, split: Split, cfg: BenchConfig, epsilon: float = 1.0,
                        progress: Progress = lambda s: None, partial: Partial = lambda rows: None) -> dict:
    """Accuracy as T grows at fixed ε (paper Figure 1b), Ind-KNN with and without prediction reuse."""
    t_start = time.perf_counter()
    p = prepare(ds, split, cfg)
    grid = [T for T in cfg.query_grid if T <= p.pool_x.shape[0]]
    if not grid:
        raise ValueError(f"no T in {cfg.query_grid} fits the query pool of {p.pool_x.shape[0]}")
    t_tune = min(p.T, p.val.q_x.shape[0])
    progress(f"tuning at {eps_at(epsilon, cfg.conversion)}, T={t_tune} on the validation split")
    ti = tune_indknn(p.val, epsilons=(epsilon,), delta=cfg.delta, conversion=cfg.conversion, queries=t_tune,
                     seed=cfg.seed, sigma2_grid=cfg.sigma2_grid, tau_offsets=cfg.tau_offsets, draws=cfg.tune_draws)
    tp = tune_private_knn(p.val, epsilon=epsilon, delta=cfg.delta, queries=t_tune, seed=cfg.seed,
                          rates=cfg.pknn_rates, ks=cfg.pknn_ks, accountant=cfg.pknn_accountant)
    ts = tune_noisy_sgd(p.val, epsilon=epsilon, delta=cfg.delta, seed=cfg.seed, lrs=cfg.sgd_lrs,
                        epochs=cfg.sgd_epochs)
    ch = ti["chosen"][float(epsilon)]
    models = _sgd_models(p, cfg, eps=epsilon, lr=ts["chosen"]["lr"], n=cfg.draws)
    rows = []
    for i_t, T in enumerate(grid):
        draws = query_draws(p.pool_x.shape[0], T, cfg.draws, cfg.seed, tag="queries")
        for reuse in (False, True):
            rows.append({"queries": T, **_indknn_row(p, cfg, eps=epsilon, tau=ch["tau"], sigma2=ch["sigma2"], T=T,
                                                     draws=draws, reuse=reuse, tag="queries")})
        rows.append({"queries": T, **_pknn_row(p, cfg, eps=epsilon, rate=tp["chosen"]["sampling_rate"],
                                               k=tp["chosen"]["k"], T=T, draws=draws)})
        rows.append({"queries": T, **_sgd_row(p, cfg, eps=epsilon, lr=ts["chosen"]["lr"], models=models,
                                              draws=draws)})
        say(progress, f"T={T}: " + ", ".join(f"{r['method']} {r['accuracy_median']:.3f}" for r in rows[-4:]),
            done=i_t + 1, total=len(grid))
        partial(rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    maj = majority_class(p, query_draws(p.pool_x.shape[0], max(grid), cfg.draws, cfg.seed, tag="queries"))
    table = {"title": f"median accuracy at ε={epsilon:g}", "columns": ["method"] + [f"T={T}" for T in grid],
             "rows": [[m] + [round(next(r["accuracy_median"] for r in rows if r["method"] == m and r["queries"] == T),
                                   4) for T in grid] for m in methods]
             + [[maj["method"]] + [round(maj["accuracy_median"], 4)] * len(grid)],
             "note": privacy_note(cfg, "varies")}
    return {"experiment": "accuracy-vs-queries", "dataset": dataset_info(p), "config": cfg.as_dict(),
            "epsilon": epsilon, "protocol": PROTOCOL + " Hyper-parameters (σ2, τ, γ, k, lr) are tuned once at "
            f"T={t_tune}; σ1 = sqrt(T/(6B)) and Private-kNN's noise are recalibrated for every T.",
            "results": rows, "tuning": {"indknn": ti, "private_knn": tp, "noisy_sgd": ts}, "table": table,
            "majority_class": maj,
            "seconds": {"total": time.perf_counter() - t_start}}


def retraining(ds: Dataset, split: Split, cfg: BenchConfig, epsilon: float = 1.0,
               progress: Progress = lambda s: None, partial: Partial = lambda rows: None) -> dict:
    """Data changes every Q queries (paper Table 1 / Figure 3): Ind-KNN deletes records at no retraining
    cost; Linear NoisySGD retrains on every change and its privacy loss composes over the trainings."""
    t_start = time.perf_counter()
    p = prepare(ds, split, cfg)
    T = p.T
    ti = tune_indknn(p.val, epsilons=(epsilon,), delta=cfg.delta, conversion=cfg.conversion, queries=T,
                     seed=cfg.seed, sigma2_grid=cfg.sigma2_grid, tau_offsets=cfg.tau_offsets, draws=cfg.tune_draws)
    ts = tune_noisy_sgd(p.val, epsilon=epsilon, delta=cfg.delta, seed=cfg.seed, lrs=cfg.sgd_lrs,
                        epochs=cfg.sgd_epochs)
    ch = ti["chosen"][float(epsilon)]
    params = make_params(epsilon=epsilon, delta=cfg.delta, conversion=cfg.conversion, tau=ch["tau"],
                         sigma2=ch["sigma2"], planned_queries=T)
    idx = query_draws(p.pool_x.shape[0], T, 1, cfg.seed, tag="retrain")[0]
    q, y = p.pool_x[idx], p.pool_y[idx]
    progress(f"timing {count(cfg.timing_repeats, 'NoisySGD training')} on {count(int(p.priv_x.shape[0]), 'record')}")
    models = _sgd_models(p, cfg, eps=epsilon, lr=ts["chosen"]["lr"], n=cfg.timing_repeats)
    train_s = float(np.median([m.seconds for m in models]))
    t0 = time.perf_counter()
    sgd_pred = models[0].model.predict(q)
    sgd_predict_s = (time.perf_counter() - t0) / T
    sgd_acc = accuracy(sgd_pred, y)
    rows, curves = [], {}
    for Q in [Q for Q in cfg.retrain_every if Q <= T]:
        rng = np.random.default_rng(_seed_of(cfg.seed, "delete", Q))
        marks: list = []

        def on_segment(budgets, answered, rng=rng, marks=marks):
            alive = np.flatnonzero(~budgets.deleted)
            budgets.deleted[rng.choice(alive, size=min(cfg.deletions_per_change, alive.size), replace=False)] = True
            sel = budgets.spent[budgets.spent > 0]
            marks.append((answered, float(np.median(budgets.spent)), float(np.median(sel)) if sel.size else 0.0))

        run = run_indknn(p.priv_x, p.priv_y, q, params=params, n_classes=p.ds.n_classes, seed=cfg.seed,
                         tag=f"retrain:{Q}", segment=Q, on_segment=on_segment, device=cfg.device)
        changes = math.ceil(T / Q)  # a model per Q queries: the first training and a retrain per change
        steps = models[0].steps * changes
        sgd_eps = opacus_epsilon(noise_multiplier=models[0].noise_multiplier, sample_rate=models[0].sample_rate,
                                 steps=steps, delta=cfg.delta, accountant=cfg.sgd_accountant)
        real = accounting.realised_epsilons(np.array([m[1] for m in marks] + [m[2] for m in marks]),
                                            budget=params.budget, delta=cfg.delta, conversion=cfg.conversion,
                                            grid_points=257)
        curves[Q] = {"queries": [m[0] for m in marks],
                     "noisysgd_epsilon": [opacus_epsilon(noise_multiplier=models[0].noise_multiplier,
                                                         sample_rate=models[0].sample_rate,
                                                         steps=models[0].steps * math.ceil(a / Q), delta=cfg.delta,
                                                         accountant=cfg.sgd_accountant) for a, *_ in marks],
                     "indknn_median_realised_epsilon_all": real[:len(marks)].tolist(),
                     "indknn_median_realised_epsilon_selected": real[len(marks):].tolist()}
        rows.append({"retrain_every": Q, "changes": changes, "deleted_per_change": cfg.deletions_per_change,
                     "indknn_seconds_per_query": run.seconds / T, "indknn_accuracy": accuracy(run.labels, y),
                     "indknn_epsilon_guarantee": params.epsilon,
                     "noisysgd_seconds_per_query": (changes * train_s) / T + sgd_predict_s,
                     "noisysgd_epsilon_total": sgd_eps, "noisysgd_accuracy_first_model": sgd_acc,
                     "indknn_conversion": cfg.conversion,
                     "noisysgd_accountant": f"Opacus {cfg.sgd_accountant.upper()}, composed over the trainings",
                     **UNIT})
        progress(f"Q={Q}: Ind-KNN {rows[-1]['indknn_seconds_per_query']:.2e} s/query, ε({cfg.conversion}) "
                 f"{params.epsilon:g}; NoisySGD {rows[-1]['noisysgd_seconds_per_query']:.2e} s/query, "
                 f"ε(Opacus {cfg.sgd_accountant.upper()}, composed) {rounding.up(sgd_eps, 3)}; {UNIT_SHORT}")
        partial(rows)
    table = {"title": f"retraining every Q queries (T={T}; ε={epsilon:g} = Ind-KNN guarantee = each training's ε)",
             "columns": ["Q", "Ind-KNN s/query", f"Ind-KNN ε guarantee ({cfg.conversion})",
                         "Ind-KNN median realised ε*", "NoisySGD s/query",
                         f"NoisySGD ε (Opacus {cfg.sgd_accountant.upper()}, composed)"],
             "rows": [[r["retrain_every"], f"{r['indknn_seconds_per_query']:.2e}", f"{r['indknn_epsilon_guarantee']:g}",
                       f"{curves[r['retrain_every']]['indknn_median_realised_epsilon_selected'][-1]:.3f}",
                       f"{r['noisysgd_seconds_per_query']:.2e}", f"{r['noisysgd_epsilon_total']:.3f}"]
                      for r in rows],
             "note": f"* realised individual loss (descriptive, not a guarantee) of records selected at least once, "
                     f"{accounting.CONVERSION_LABEL[cfg.conversion]}; every ε {UNIT_TEXT}"}
    return {"experiment": "retraining", "dataset": dataset_info(p), "config": cfg.as_dict(), "epsilon": epsilon,
            "protocol": PROTOCOL + " NoisySGD's amortised time = (trainings × median measured training time + "
            "prediction time) / T; its ε composes all trainings (Opacus accountant). Ind-KNN's time includes its "
            "deletions; its guarantee is fixed, the realised individual ε is descriptive.",
            "noisysgd": {"train_seconds_median": train_s, **models[0].as_dict()}, "indknn_params": params.as_dict(),
            "results": rows, "privacy_curves": curves, "table": table,
            "seconds": {"total": time.perf_counter() - t_start}}


def speed(cfg: BenchConfig, progress: Progress = lambda s: None, classes: int = 100, tau: float = 0.5,
          partial: Partial = lambda rows: None) -> dict:
    """Queries per second of the engine (flat kind) on synthetic clustered unit vectors."""
    rows = []
    for d in cfg.speed_d:
        for n in cfg.speed_n:
            ds = synthetic_dataset(n=n + cfg.speed_queries, d=d, classes=classes, seed=cfg.seed)
            params = make_params(epsilon=1.0, delta=cfg.delta, conversion=cfg.conversion, tau=tau, sigma2=0.4,
                                 planned_queries=cfg.speed_queries)
            run = run_indknn(ds.x[:n], ds.y[:n], ds.x[n:], params=params, n_classes=classes, seed=cfg.seed,
                             tag=f"speed:{n}:{d}", device=cfg.device)
            rows.append({"kind": "flat", "n": n, "d": d, "queries": cfg.speed_queries,
                         "queries_per_second": cfg.speed_queries / run.seconds, "seconds": run.seconds,
                         "median_released_count": float(np.median(run.released_counts))})
            progress(f"flat N={n} d={d}: {rows[-1]['queries_per_second']:.1f} queries/s")
            partial(rows)
    table = {"title": "engine throughput (flat, exact)", "columns": ["kind", "N", "d", "queries/s", "median K"],
             "rows": [[r["kind"], r["n"], r["d"], f"{r['queries_per_second']:.1f}", f"{r['median_released_count']:.0f}"]
                      for r in rows],
             "note": f"{cfg.speed_queries} queries per configuration, {classes} clusters, τ={tau}; "
                     "median K = released noisy neighbour count (≈ selected records per query)"}
    return {"experiment": "speed", "config": cfg.as_dict(), "synthetic": {"classes": classes, "tau": tau,
            "spread": 0.35}, "results": rows, "table": table}


def tune(ds: Dataset, split: Split, cfg: BenchConfig, progress: Progress = lambda s: None) -> dict:
    """The supplementary's two-stage (σ2, τ) search on validation (or public) data only."""
    t_start = time.perf_counter()
    p = prepare(ds, split, cfg)
    progress(f"stage 1: non-private kernel weights of {p.val.q_x.shape[0]} validation queries")
    stage1 = tune_tau_stage1(p.val)
    progress(f"stage 1: τ* = {stage1['tau_star']}; stage 2: (σ2, τ) grid for ε ∈ {list(cfg.epsilons)} "
             f"({cfg.conversion}, {UNIT_SHORT})")
    res = tune_indknn(p.val, epsilons=cfg.epsilons, delta=cfg.delta, conversion=cfg.conversion, queries=p.T,
                      seed=cfg.seed, sigma2_grid=cfg.sigma2_grid, tau_offsets=cfg.tau_offsets, draws=cfg.tune_draws,
                      stage1=stage1)
    table = {"title": f"chosen Ind-KNN hyper-parameters (T={p.T}, δ={cfg.delta:g}, {cfg.conversion}, {UNIT_SHORT})",
             "columns": [f"ε ({cfg.conversion})", "τ", "σ2", "validation accuracy", "B"],
             "rows": [[f"{e:g}", f"{c['tau']:g}", f"{c['sigma2']:g}", round(c["val_accuracy"], 4), rounding.up(res['budget'][e], 4)]
                      for e, c in res["chosen"].items()]}
    return {"experiment": "tune", "dataset": dataset_info(p), "config": cfg.as_dict(),
            "conversion": cfg.conversion, **UNIT,
            "data_used": ("validation split: "
                          + ("the store's labelled public rows" if ds.public_rows is not None else
                             "carved from the private side (stand-in for public/validation data)")),
            "warning": "Run the tuner on public or validation data only: tuned values computed from private "
                       "records leak information that no budget accounts for (SPEC §8).",
            "result": res, "table": table, "seconds": {"total": time.perf_counter() - t_start}}
