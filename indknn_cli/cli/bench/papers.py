"""`indknn bench` for the papers' experiments: Ind-KNN side by side with Private-kNN and Linear NoisySGD."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ...wording import count
from ..common import deprecated_alias, emit_json, progress_bar, run_library_call, stderr_console, verbosity
from .options import (CACHE, CONVERSION, DATA_DIR, DATASET, DELTA, DEVICE, DRAWS, FEATURES, N_PRIVATE, N_QUERIES,
                      OUT, PKNN_ACC, QUERIES, QUICK, SEED, TEST_STORE, floats, ints)


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


class _Progress:
    """Bench progress on stderr: on a terminal a rich bar (the phase's message as its label, its step count
    when the experiment knows one); off a terminal one line per message (nothing under --quiet)."""

    def __init__(self, err, update):
        self.err, self.update = err, update
        self.bar = err.is_terminal and verbosity() > 0

    def __call__(self, message: str) -> None:
        if self.bar:
            text = message if len(message) <= 60 else message[:59] + "…"
            self.update(description=text)
        else:
            self.err.print(f"[dim]·[/] {escape(message)}")

    def step(self, done: int, total: int | None) -> None:
        self.update(completed=done, total=total)


def _run(experiment: str, parsed=lambda: {}, **kw) -> None:
    """``parsed()`` turns the list options into values inside the error mapping (bad input → exit 2)."""
    err = stderr_console()
    from ...benchmarks.runner import run_bench

    with progress_bar(experiment) as update:
        summary = run_library_call(lambda: run_bench(experiment, progress=_Progress(err, update), **kw, **parsed()))
    t = summary["table"]
    table = Table(title=escape(f"{experiment} — {summary['dataset']} — {t['title']}"), title_justify="left")
    for i, c in enumerate(t["columns"]):
        table.add_column(escape(str(c)), justify="left" if i == 0 else "right")
    for row in t["rows"]:
        table.add_row(*[escape(_cell(v)) for v in row])
    err.print(table)
    if t.get("note"):
        err.print(escape(t["note"]))
    if summary.get("warning"):
        err.print(f"[yellow]{escape(summary['warning'])}[/]")
    err.print(escape(f"wrote {summary['json']} and {count(len(summary['plots']), 'plot')} in "
                     f"{summary['seconds']:.0f} s"))
    emit_json(summary)


def _common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, queries, n_queries,
            pknn_accountant, device, n_private=None, test_store=None) -> dict:
    return dict(quick=quick, out_dir=out, dataset=dataset, data_dir=data_dir, cache_dir=cache, seed=seed,
                features=features, conversion=conversion, delta=delta, draws=draws, queries=queries,
                n_queries=n_queries, n_private=n_private, pknn_accountant=pknn_accountant, device=device,
                test_store=test_store)


def accuracy_vs_eps(
    eps: Optional[str] = typer.Option(None, "--eps", help="Comma-separated ε values (default 0.5,1,1.5,2; "
                                      "--quick 0.5,1,2), per record, add/remove one record; each method by its "
                                      "own accountant, Ind-KNN by --conversion."),
    quick: bool = QUICK, out: Path = OUT, dataset: str = DATASET, data_dir: Optional[Path] = DATA_DIR,
    cache: Optional[Path] = CACHE, seed: int = SEED, features: str = FEATURES, conversion: str = CONVERSION,
    delta: float = DELTA, draws: Optional[int] = DRAWS, queries: Optional[int] = QUERIES,
    n_queries: Optional[int] = N_QUERIES, n_private: Optional[int] = N_PRIVATE, pknn_accountant: str = PKNN_ACC,
    device: str = DEVICE, test_store: Optional[Path] = TEST_STORE,
    private_tuning: bool = typer.Option(True, "--private-tuning/--no-private-tuning", help="Add the row 'ind-knn "
                                        "(tuned privately)': index --tune private's search and serving composed into "
                                        "the same total ε (RDP), re-tuned for every query draw."),
    oracle: bool = typer.Option(True, "--oracle/--no-oracle", help="Also serve every point of the tuning grid at "
                                "the tuned ledger's B_serve and report the best (a yardstick, not a method)."),
    tune_share: Optional[float] = typer.Option(None, "--tune-share", help="As index --tune-share (default: index's)."),
    tune_runs: Optional[float] = typer.Option(None, "--tune-runs", help="As index --tune-runs (default: index's)."),
    tune_queries: Optional[int] = typer.Option(None, "--tune-queries", help="As index --tune-queries (default: "
                                               "index's)."),
    tune_method: Optional[str] = typer.Option(None, "--tune-method", help="As index --tune-method (default: "
                                              "index's, exp-mech)."),
    tune_taus: Optional[str] = typer.Option(None, "--tune-taus", help="As index --tune-taus: the τ grid of the "
                                            "private tuning (default: index's prior for the data set's extractor)."),
    tune_sigma2s: Optional[str] = typer.Option(None, "--tune-sigma2s", help="As index --tune-sigma2s (default: "
                                               "index's budget-relative grid)."),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="--no-baselines: only Ind-KNN tuned "
                                   "privately (and the best grid point unless --no-oracle) beside the majority "
                                   "class, on the same split, draws and seed; no other method is tuned or served."),
) -> None:
    """Median accuracy over query draws per ε for every method, each tuned on a validation split (paper Fig. 1a, 2),
    next to Ind-KNN tuned privately at the same total ε, and the majority-class floor."""
    _run("accuracy-vs-eps", lambda: dict(epsilons=floats(eps, "--eps"),
                                         tune_taus=floats(tune_taus, "--tune-taus", distinct=True),
                                         tune_sigma2s=floats(tune_sigma2s, "--tune-sigma2s", distinct=True)),
         private_tuning=private_tuning, baselines=baselines,
         oracle_grid=oracle, tune_share=tune_share, tune_runs=tune_runs, tune_queries=tune_queries,
         tune_method=tune_method, **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, queries,
                   n_queries, pknn_accountant, device, n_private, test_store))


def accuracy_vs_queries(
    eps: float = typer.Option(1.0, "--eps", help="The fixed ε (per record, add/remove one record; "
                                      "Ind-KNN by --conversion)."),
    query_grid: Optional[str] = typer.Option(None, "--query-grid", help="Comma-separated T values (those that fit "
                                             "the query pool are run)."),
    quick: bool = QUICK, out: Path = OUT, dataset: str = DATASET, data_dir: Optional[Path] = DATA_DIR,
    cache: Optional[Path] = CACHE, seed: int = SEED, features: str = FEATURES, conversion: str = CONVERSION,
    delta: float = DELTA, draws: Optional[int] = DRAWS, n_queries: Optional[int] = N_QUERIES,
    n_private: Optional[int] = N_PRIVATE, pknn_accountant: str = PKNN_ACC, device: str = DEVICE,
    test_store: Optional[Path] = TEST_STORE,
) -> None:
    """Accuracy as the number of queries T grows at fixed ε, with and without prediction reuse (paper Fig. 1b)."""
    _run("accuracy-vs-queries", lambda: dict(query_grid=ints(query_grid, "--query-grid")), epsilon=eps,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, None,
                   n_queries, pknn_accountant, device, n_private, test_store))


def retraining(
    eps: float = typer.Option(1.0, "--eps", help="Ind-KNN's guarantee (by --conversion) and each NoisySGD "
                                      "training's ε (Opacus), per record, add/remove one record."),
    retrain_every: Optional[str] = typer.Option(None, "--retrain-every", help="Comma-separated Q values: the data "
                                                "changes every Q queries."),
    deletions: Optional[int] = typer.Option(None, "--deletions", help="Records deleted at each change (default 10)."),
    quick: bool = QUICK, out: Path = OUT, dataset: str = DATASET, data_dir: Optional[Path] = DATA_DIR,
    cache: Optional[Path] = CACHE, seed: int = SEED, features: str = FEATURES, conversion: str = CONVERSION,
    delta: float = DELTA, queries: Optional[int] = QUERIES, n_queries: Optional[int] = N_QUERIES,
    n_private: Optional[int] = N_PRIVATE, device: str = DEVICE,
) -> None:
    """Amortised seconds per query and privacy cost when the data changes every Q queries (paper Table 1, Fig. 3)."""
    _run("retraining", lambda: dict(retrain_every=ints(retrain_every, "--retrain-every")), epsilon=eps,
         deletions_per_change=deletions,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, None, queries,
                   n_queries, "pld", device, n_private))


def min_margin(
    eps: float = typer.Option(1.0, "--eps", help="The fixed ε of Ind-KNN (per record, add/remove one "
                                      "record; by --conversion)."),
    margins: Optional[str] = typer.Option(None, "--margins", help="Comma-separated M of serve-queries --min-margin "
                                          "(default 0,0.5,1,2,3)."),
    quick: bool = QUICK, out: Path = OUT, dataset: str = DATASET, data_dir: Optional[Path] = DATA_DIR,
    cache: Optional[Path] = CACHE, seed: int = SEED, features: str = FEATURES, conversion: str = CONVERSION,
    delta: float = DELTA, draws: Optional[int] = DRAWS, queries: Optional[int] = QUERIES,
    n_queries: Optional[int] = N_QUERIES, n_private: Optional[int] = N_PRIVATE, device: str = DEVICE,
    test_store: Optional[Path] = TEST_STORE,
) -> None:
    """Coverage and accuracy on answered queries of serve-queries --min-margin M, with and without reuse."""
    _run("min-margin", lambda: dict(margins=floats(margins, "--margins")), epsilon=eps,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, queries,
                   n_queries, "pld", device, n_private, test_store))


def speed(
    n: Optional[str] = typer.Option(None, "--n", help="Comma-separated private-set sizes N (default 1e4,1e5,1e6)."),
    d: Optional[str] = typer.Option(None, "--d", help="Comma-separated dimensions (default 384)."),
    queries: Optional[int] = typer.Option(None, "--queries", help="Queries timed per configuration (default 512)."),
    quick: bool = QUICK, out: Path = OUT, seed: int = SEED, device: str = DEVICE,
) -> None:
    """Queries per second of the engine on synthetic clustered unit vectors."""
    _run("speed", lambda: dict(speed_n=ints(n, "--n"), speed_d=ints(d, "--d")), dataset=None, quick=quick,
         out_dir=out, seed=seed, device=device, speed_queries=queries)


def tune(
    eps: Optional[str] = typer.Option(None, "--eps", help="Comma-separated ε values to tune for (by --conversion; per "
                                      "record, add/remove one record)."),
    quick: bool = QUICK, out: Path = OUT, dataset: str = DATASET, data_dir: Optional[Path] = DATA_DIR,
    cache: Optional[Path] = CACHE, seed: int = SEED, features: str = FEATURES, conversion: str = CONVERSION,
    delta: float = DELTA,
    planned_queries: Optional[int] = typer.Option(None, "--planned-queries", min=1, help="Planned queries T (sets "
                                                  "σ1 = sqrt(T/6B), as index --planned-queries; default min(1000, "
                                                  "query pool))."),
    queries: Optional[int] = typer.Option(None, "--queries", min=1, hidden=True,
                                          help="Deprecated spelling of --planned-queries."),
    n_queries: Optional[int] = N_QUERIES, n_private: Optional[int] = N_PRIVATE, device: str = DEVICE,
    unaccounted_private_tuning: bool = typer.Option(
        False, "--unaccounted-private-tuning",
        help="On a store without labelled public rows, tune on a validation split of its private records anyway: "
             "the tuned τ and σ2 then leak information about private records that no budget accounts for."),
) -> None:
    """Choose Ind-KNN's (σ2, τ) by the supplementary's two-stage search.

    MUST run on public or validation data: a store's labelled public rows when it has them, or a public
    dataset (ag_news, mnist). On a store without public rows it is refused unless
    --unaccounted-private-tuning is given. Values tuned on private records leak information no budget
    accounts for.
    """
    planned_queries = deprecated_alias(planned_queries, queries, new="--planned-queries", old="--queries")
    if unaccounted_private_tuning:
        from ...benchmarks.runner import UNACCOUNTED_PRIVATE_TUNING

        stderr_console().print(f"[yellow]{escape(UNACCOUNTED_PRIVATE_TUNING)}[/]", soft_wrap=True)
    _run("tune", lambda: dict(epsilons=floats(eps, "--eps")), unaccounted_private_tuning=unaccounted_private_tuning,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, None, planned_queries,
                   n_queries, "pld", device, n_private))
