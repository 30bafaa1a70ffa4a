"""One call per `indknn bench` sub-command: data → experiment → JSON + PNG files → summary."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

from ..errors import BadInputError, PrivacyRefusedError
from . import experiments
from .config import BenchConfig
from .data import attach_test_store, load_dataset, make_split
from .figures import make_plots
from .report import environment, write_json

SEEDING = {
    "note": "seeded noise: experiments only (SPEC §8); real answers draw noise from OS entropy",
    "split": "numpy SeedSequence(seed, spawn_key=(0x5B117,))",
    "query_draws": "numpy SeedSequence(seed, spawn_key=(crc32('<tag>:<T>:<draw>'),))",
    "ind_knn": "serving.run_key_for(seed, '<tag>:<ε>:<T>:<draw>') → engine.noise_generator(run key, query index), "
               "as serve-queries --seed; a fresh budget state per draw",
    "private_knn": "numpy SeedSequence(seed, spawn_key=(crc32('pknn:<ε>:<T>:<draw>'),)) for subsamples and noise",
    "linear_noisysgd": "torch.Generator(seed·1000 + draw) for Poisson batches, (… + 1) for Opacus noise",
}
EXPERIMENTS = ("accuracy-vs-eps", "accuracy-vs-queries", "retraining", "speed", "tune", "min-margin")
TUNED_ON_PRIVATE = ("Each method was tuned on a validation split carved from the private side: tuning reads "
                    "private records without accounting (the papers' protocol); a deployment tunes on public data.")
TUNED_ON_PUBLIC = "Each method was tuned on a validation split of the store's labelled public rows."
TUNED_PRIVATELY = ("Ind-KNN alone, tuned privately (index --tune private), the search's cost inside the total ε; "
                   "the best grid point row reads the reported queries' labels: a yardstick, not a method.")
#: What --unaccounted-private-tuning means (printed on stderr and recorded in the JSON when it is given).
UNACCOUNTED_PRIVATE_TUNING = (
    "--unaccounted-private-tuning: this store has no labelled public rows, so τ and σ2 are tuned on a validation "
    "split carved from its private records. The tuned values are a statistic of private data that no budget "
    "accounts for: the (ε, δ) guarantee of a ledger indexed with them does not cover what they reveal.")
NO_PUBLIC_TUNING = (
    "bench tune is refused on {store}: the store has no labelled public rows (at least 20, `indknn embed FILE "
    "--role public --label-column ...`), so it would tune τ and σ2 on private records, a statistic no budget "
    "accounts for (SPEC §8). Add public rows, tune on a public dataset (--dataset ag_news or mnist), or pass "
    "--unaccounted-private-tuning to accept the unaccounted leak.")


def _stem(experiment: str, dataset: str | None) -> str:
    name = "synthetic" if dataset is None else re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(dataset).name or dataset)
    return f"{experiment.replace('-', '_')}_{name}"


def run_bench(experiment: str, *, dataset: str | None = "ag_news", data_dir: Path | None = None,
              cache_dir: Path | None = None, out_dir: Path = Path("bench_out"), quick: bool = False, seed: int = 0,
              features: str = "hog", n_queries: int | None = None, n_private: int | None = None,
              epsilon: float = 1.0, unaccounted_private_tuning: bool = False, test_store: Path | None = None,
              progress: Callable[[str], None] = lambda s: None, **overrides) -> dict:
    """Run one experiment and write ``<out>/<experiment>_<dataset>.json`` and its PNG plots.

    ``overrides`` replace fields of :class:`BenchConfig` (``epsilons``, ``draws``, ``queries``, …).
    Returns the summary printed on stdout (paths, table, seconds).
    """
    if experiment not in EXPERIMENTS:
        raise BadInputError(f"experiment must be one of {', '.join(EXPERIMENTS)}, got {experiment!r}")
    t0 = time.perf_counter()
    cfg = BenchConfig.make(quick=quick, seed=seed, **overrides)
    _validate(cfg, epsilon)
    env = environment()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():  # failed with "File exists" after the whole run (review 38)
        raise BadInputError(f"--out {out_dir} is a file; give a folder for the JSON and the plots")
    stem = _stem(experiment, None if experiment == "speed" else dataset)
    partial_path = out_dir / f"{stem}.partial.json"

    def partial(rows: list) -> None:
        """Each finished step's rows, at once: an interrupted bench keeps what it measured."""
        write_json(partial_path, {"experiment": experiment, "dataset": dataset, "complete": False, "seed": seed,
                                  "config": cfg.as_dict(), "results": rows, "environment": env,
                                  "seconds_so_far": time.perf_counter() - t0})

    if experiment == "speed":
        result = experiments.speed(cfg, progress=progress, partial=partial)
    else:
        progress(f"loading {dataset} (features are computed once and cached block by block)")
        ds = load_dataset(dataset, data_dir=data_dir, cache_dir=cache_dir, features=features, device=cfg.device,
                          progress=progress)
        if test_store is not None:
            ds = attach_test_store(ds, Path(test_store))
            progress(f"scoring on the {ds.info['test_rows']} labelled test rows of {test_store}")
        split = make_split(ds, seed=seed, n_queries=n_queries, n_private=n_private,
                           max_private=cfg.max_private)
        is_store = dataset not in ("ag_news", "mnist")
        if experiment == "tune" and is_store and ds.public_rows is None and not unaccounted_private_tuning:
            raise PrivacyRefusedError(NO_PUBLIC_TUNING.format(store=dataset))
        try:
            if experiment == "accuracy-vs-eps":
                result = experiments.accuracy_vs_eps(ds, split, cfg, progress=progress, partial=partial)
            elif experiment == "accuracy-vs-queries":
                result = experiments.accuracy_vs_queries(ds, split, cfg, epsilon=epsilon, progress=progress,
                                                         partial=partial)
            elif experiment == "retraining":
                result = experiments.retraining(ds, split, cfg, epsilon=epsilon, progress=progress,
                                                partial=partial)
            elif experiment == "min-margin":
                from .abstain import min_margin_curve

                result = min_margin_curve(ds, split, cfg, epsilon=epsilon, progress=progress)
            else:
                result = experiments.tune(ds, split, cfg, progress=progress)
        except ValueError as exc:  # sizes that do not fit the data
            if isinstance(exc, BadInputError):
                raise
            raise BadInputError(str(exc)) from None
    if experiment in ("accuracy-vs-eps", "accuracy-vs-queries", "retraining", "min-margin"):
        result["tuned_on"] = (TUNED_ON_PUBLIC if ds.public_rows is not None else TUNED_ON_PRIVATE) \
            if cfg.baselines or experiment != "accuracy-vs-eps" else TUNED_PRIVATELY  # review 73, F10
        result["table"]["note"] = (result["table"].get("note", "") + " " + result["tuned_on"]).strip()
    if experiment == "tune" and is_store and ds.public_rows is None:
        result["unaccounted_private_tuning"] = UNACCOUNTED_PRIVATE_TUNING
    result["environment"] = env
    result["quick"] = quick
    result["seeding"] = SEEDING
    plots = make_plots(result, out_dir, stem)
    result["plots"] = [str(p) for p in plots]
    seconds = time.perf_counter() - t0
    result["wall_seconds"] = seconds
    path = write_json(out_dir / f"{stem}.json", result)
    partial_path.unlink(missing_ok=True)  # the complete file replaces the partial one
    summary = {"experiment": experiment, "dataset": dataset if experiment != "speed" else "synthetic",
               "quick": quick, "seed": seed, "json": str(path), "plots": [str(p) for p in plots],
               "table": result["table"], "seconds": round(seconds, 1)}
    if test_store is not None:
        summary["test_store"] = str(test_store)
    for key in ("tuned_on", "unaccounted_private_tuning", "majority_class"):
        if key in result:
            summary[key] = result[key]
    if experiment == "tune":
        summary["warning"] = result["warning"]
    return summary


def _validate(cfg: BenchConfig, epsilon: float) -> None:
    for e in tuple(cfg.epsilons) + (epsilon,):
        if not (isinstance(e, (int, float)) and 0 < e < 100):
            raise BadInputError(f"ε values must lie in (0, 100), got {e!r}")
    if not (0 < cfg.delta < 1):
        raise BadInputError(f"--delta must lie in (0, 1), got {cfg.delta}")
    if cfg.draws < 1:
        raise BadInputError(f"--draws must be ≥ 1, got {cfg.draws}")
    if not cfg.baselines and not cfg.private_tuning:  # nothing but the majority class would be left
        raise BadInputError("--no-baselines leaves only the privately tuned rows: give it without "
                            "--no-private-tuning")
    if cfg.queries is not None and cfg.queries < 1:
        raise BadInputError(f"--queries must be ≥ 1, got {cfg.queries}")
    if cfg.conversion not in ("gdp", "rdp"):
        raise BadInputError(f"--conversion must be gdp or rdp, got {cfg.conversion!r}")
    if cfg.pknn_accountant not in ("rdp", "pld"):
        raise BadInputError(f"--pknn-accountant must be rdp or pld, got {cfg.pknn_accountant!r}")
    if cfg.tune_share is not None:  # refused only after the baselines' tuning before (review 38)
        from ..tuning_accounting import _positive

        _positive("--tune-share", cfg.tune_share, hi=0.9)
