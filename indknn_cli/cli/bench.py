"""`indknn bench`: the papers' experiments side by side with Private-kNN and Linear NoisySGD."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..wording import count
from .common import (check_device, deprecated_alias, emit_json, progress_bar, run_library_call, stderr_console,
                     verbosity)

bench_app = typer.Typer(
    help=(
        "Reproduce the papers' comparisons on data this machine has: Ind-KNN (through the same engine as "
        "serve-queries) against Private-kNN and Linear NoisySGD, with a JSON file of every figure and the exact "
        "configuration (seeds, versions, git commit) and PNG plots in --out. Seeded noise: for experiments "
        "only. stdout: one JSON summary line; tables and progress on stderr."
    ),
    no_args_is_help=True,
)

QUICK = typer.Option(False, "--quick", help="Fewer draws, fewer ε and smaller grids: a few minutes on 2 cores.")
OUT = typer.Option(Path("bench_out"), "--out", help="Folder for the JSON results and PNG plots.")
DATASET = typer.Option("ag_news", "--dataset", help="ag_news, mnist, or the path of an indknn feature store.")
DATA_DIR = typer.Option(None, "--data-dir", help="Folder holding ag_news/ and mnist/ (else $INDKNN_DATA, "
                        "else ../shared/data next to the repository).")
CACHE = typer.Option(None, "--cache", help="Feature cache folder (else $INDKNN_CACHE, else ~/.cache/indknn).")
SEED = typer.Option(0, "--seed", help="Seed of the split, the query draws and all noise (recorded in the JSON).")
FEATURES = typer.Option("hog", "--features", help="MNIST features: hog or pixels.")
CONVERSION = typer.Option("gdp", "--conversion", help="Ind-KNN's (ε, δ) → budget conversion: gdp or rdp.")
DELTA = typer.Option(1e-5, "--delta", help="δ of every method.")
DRAWS = typer.Option(None, "--draws", help="Query draws (median reported; default 5, --quick 3).")
QUERIES = typer.Option(None, "--queries", help="Queries per draw T (default min(1000, query pool)).")
N_QUERIES = typer.Option(None, "--n-queries", help="Size of the query pool split off the data.")
N_PRIVATE = typer.Option(None, "--n-private", help="Keep a seeded random subset of this many private records "
                         "(default: all; --quick caps at 20,000).")
TEST_STORE = typer.Option(None, "--test-store", help="Score on this store's labelled test rows (`indknn embed "
                          "FILE --role test --label-column ...`) instead of queries carved out of the data; their "
                          "labels score answers only. Same extractor and label names as --dataset.")
PKNN_ACC = typer.Option("pld", "--pknn-accountant", help="Private-kNN accountant: pld or rdp (dp-accounting).")
DEVICE = typer.Option("cpu", "--device", callback=check_device, help="cpu or cuda for the engine and the feature extractor.")


def _floats(text: Optional[str], what: str) -> Optional[tuple]:
    from ..errors import BadInputError

    if text is None:
        return None
    try:
        vals = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise BadInputError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not vals:  # `--eps ""` ran with no ε at all (review 38)
        raise BadInputError(f"{what}: no number given ({text!r})")
    bad = [v for v in vals if not math.isfinite(v)]
    if bad:
        raise BadInputError(f"{what}: {bad[0]!r} is not a finite number")
    return vals


def _ints(text: Optional[str], what: str) -> Optional[tuple]:
    """Comma-separated positive whole numbers (1e4 allowed): `--n -5`, `--n 2.5` and `--n 0` ran and printed junk
    rows, `--n 1e99` or `nan` ended in "Internal error" (review 38, F7)."""
    from ..errors import BadInputError

    vals = _floats(text, what)
    if vals is None:
        return None
    bad = [v for v in vals if v < 1 or v != int(v) or v > 2**40]
    if bad:
        raise BadInputError(f"{what}: {bad[0]:g} is not a positive whole number (at most 2^40)")
    return tuple(int(v) for v in vals)


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
    from ..benchmarks.runner import run_bench

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


@bench_app.command("accuracy-vs-eps")
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
) -> None:
    """Median accuracy over query draws per ε for every method, each tuned on a validation split (paper Fig. 1a, 2),
    next to Ind-KNN tuned privately at the same total ε, and the majority-class floor."""
    _run("accuracy-vs-eps", lambda: dict(epsilons=_floats(eps, "--eps")), private_tuning=private_tuning,
         oracle_grid=oracle, tune_share=tune_share, tune_runs=tune_runs, tune_queries=tune_queries,
         tune_method=tune_method, **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, queries,
                   n_queries, pknn_accountant, device, n_private, test_store))


@bench_app.command("accuracy-vs-queries")
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
    _run("accuracy-vs-queries", lambda: dict(query_grid=_ints(query_grid, "--query-grid")), epsilon=eps,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, None,
                   n_queries, pknn_accountant, device, n_private, test_store))


@bench_app.command("retraining")
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
    _run("retraining", lambda: dict(retrain_every=_ints(retrain_every, "--retrain-every")), epsilon=eps,
         deletions_per_change=deletions,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, None, queries,
                   n_queries, "pld", device, n_private))


@bench_app.command("min-margin")
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
    _run("min-margin", lambda: dict(margins=_floats(margins, "--margins")), epsilon=eps,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, queries,
                   n_queries, "pld", device, n_private, test_store))


@bench_app.command("speed")
def speed(
    n: Optional[str] = typer.Option(None, "--n", help="Comma-separated private-set sizes N (default 1e4,1e5,1e6)."),
    d: Optional[str] = typer.Option(None, "--d", help="Comma-separated dimensions (default 384)."),
    queries: Optional[int] = typer.Option(None, "--queries", help="Queries timed per configuration (default 512)."),
    quick: bool = QUICK, out: Path = OUT, seed: int = SEED, device: str = DEVICE,
) -> None:
    """Queries per second of the engine on synthetic clustered unit vectors."""
    _run("speed", lambda: dict(speed_n=_ints(n, "--n"), speed_d=_ints(d, "--d")), dataset=None, quick=quick,
         out_dir=out, seed=seed, device=device, speed_queries=queries)


@bench_app.command("tune")
def tune(
    eps: Optional[str] = typer.Option(None, "--eps", help="Comma-separated ε values to tune for (by --conversion; per "
                                      "record, add/remove one record)."),
    quick: bool = QUICK, out: Path = OUT, dataset: str = DATASET, data_dir: Optional[Path] = DATA_DIR,
    cache: Optional[Path] = CACHE, seed: int = SEED, features: str = FEATURES, conversion: str = CONVERSION,
    delta: float = DELTA, queries: Optional[int] = typer.Option(None, "--queries", help="Planned queries T "
                                                                "(sets σ1 = sqrt(T/6B))."),
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
    if unaccounted_private_tuning:
        from ..benchmarks.runner import UNACCOUNTED_PRIVATE_TUNING

        stderr_console().print(f"[yellow]{escape(UNACCOUNTED_PRIVATE_TUNING)}[/]", soft_wrap=True)
    _run("tune", lambda: dict(epsilons=_floats(eps, "--eps")), unaccounted_private_tuning=unaccounted_private_tuning,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, None, queries,
                   n_queries, "pld", device, n_private))



def _argv(**opts) -> list[str]:
    """Typer-checked options → the argv of a benchmark module's own parser (None: left at its default)."""
    argv: list[str] = []
    for name, value in opts.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _module_main(main, argv: list[str]):
    """Run a benchmark module's main; under --quiet its own stderr lines (progress, tables) are dropped."""
    import contextlib
    import os

    from .common import verbosity

    if verbosity() > 0:
        return main(argv)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        return main(argv)  # an error still reaches run_library_call, which prints it after the redirect


N_SIZES = "Comma-separated private-set sizes N (1e6 or 1000000)."


@bench_app.command("serve-speed")
def serve_speed_command(
    n: str = typer.Option("50000", "--n", help=N_SIZES),
    d: str = typer.Option("768", "--d", help="Comma-separated dimensions d."),
    queries: int = typer.Option(20000, "--queries", min=1, help="Stored queries served per configuration."),
    tau: float = typer.Option(0.54, "--tau", help="Cosine threshold τ of the synthetic clustered store (0.54: "
                              "~200 candidates per query at N = 50,000, d = 768)."),
    batch_size: int = typer.Option(1024, "--batch-size", min=1, help="Queries scored and committed together."),
    device: str = typer.Option("cpu", "--device", callback=check_device, help="Device of the serve-queries process: auto, cpu or cuda "
                               "(the matmul, candidate and FAISS timings run on the CPU)."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Candidate phase on Dask: local (a LocalCluster of worker processes per --workers count) or a scheduler ADDRESS; compared with the in-process run in the same run."),
    workers: str = typer.Option("1,2,4", "--workers", help="Comma-separated worker counts for --scheduler local."),
) -> None:
    """serve-queries against the bare fp32 matmul of the same products, and its candidate phase against FAISS
    range_search, in one run (CPU-second ratios serve_vs_matmul, candidates_vs_matmul, candidates_vs_faiss;
    cosine, reuse off, synthetic clustered store). stdout: one JSON line per N × d. With --scheduler: the
    in-process run and one line per worker count (queries/s, ratio, coordinator's share)."""
    from ..benchmarks.serve_speed import main

    def call():
        return _module_main(main, _argv(n=list(_ints(n, "--n")), d=list(_ints(d, "--d")), queries=queries,
                                        tau=tau, batch_size=batch_size, device=device, scheduler=scheduler,
                                        workers=list(_ints(workers, "--workers")) if scheduler else None))

    run_library_call(call)


@bench_app.command("year")
def year_command(
    days: int = typer.Option(60, "--days", min=17, help="Days of cron, one query batch a day (≥ 17: days 8-12, "
                             "'day 10', are compared with the last five, apart; 365 for the issue's year)."),
    queries: int = typer.Option(200, "--queries", min=1, help="Queries per day."),
    n: int = typer.Option(5000, "--n", min=1, help="Private records N of the synthetic clustered store."),
    d: int = typer.Option(64, "--d", min=2, help="Dimension of the synthetic vectors."),
    tau: float = typer.Option(0.5, "--tau", help="Cosine threshold τ."),
    eps: float = typer.Option(100.0, "--eps", help="ε of the ledger (gdp, per record, add/remove one record; large, "
                                    "so that records stay active all year)."),
    reuse: bool = typer.Option(False, "--reuse/--no-reuse", help="Serve with prediction reuse on."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Build the store and ledger in this new folder and keep "
                                        "them (default: a temporary folder, removed)."),
    processes: bool = typer.Option(False, "--processes", help="Time whole `indknn serve-queries` and `indknn "
                                   "account` processes on the compared days (default: the calls in this process)."),
) -> None:
    """A year of cron into one ledger: the last days' serve and account seconds against day 10's (target ratio
    ≤ 1.2). stdout: one JSON line (seconds per day, ratios, event files). Fixed seed: for measurement only."""
    from ..benchmarks.year import main

    run_library_call(lambda: _module_main(main, _argv(days=days, queries=queries, n=n, d=d, tau=tau, eps=eps,
                                                      keep=keep) + (["--reuse"] if reuse else [])
                                          + (["--processes"] if processes else [])))


@bench_app.command("append")
def append_command(
    rows: int = typer.Option(20000, "--rows", min=1, help="Vectors embedded: as a query batch (from a .npy file, "
                             "256 rows at a time as serve-queries reads a query file) and as labelled private rows "
                             "(from a Parquet file)."),
    d: int = typer.Option(64, "--d", min=2, help="Dimension of the vectors."),
    role: str = typer.Option("both", "--role", help="query, private or both."),
) -> None:
    """Write amplification of an append: bytes this process wrote (every write(2), chunks and metadata) per byte
    of row data embedded (target ≤ 1.2), for queries and for private rows. stdout: one JSON line per role."""
    from ..benchmarks.append import main

    def call() -> None:
        if role not in ("query", "private", "both"):
            from ..errors import BadInputError

            raise BadInputError(f"--role: expected query, private or both, got {role!r}")
        _module_main(main, _argv(rows=rows, d=d, role=role))

    run_library_call(call)


@bench_app.command("stream")
def stream_command(
    queries: int = typer.Option(2_000_000, "--queries", min=1, help="Queries in the one query file (the issue's "
                                "2,000,000; about 20 min per run on 2 cores: try 200000 first)."),
    n: int = typer.Option(10_000, "--n", min=1, help="Private records N of the synthetic clustered store."),
    d: int = typer.Option(64, "--d", min=2, help="Dimension of the synthetic vectors."),
    tau: float = typer.Option(0.5, "--tau", help="Cosine threshold τ."),
    batch_size: int = typer.Option(1024, "--batch-size", min=1, help="serve-queries --batch-size of both runs."),
    fmt: str = typer.Option("npy", "--format", help="Query file format: npy or parquet (a list column 'vector')."),
    device: str = typer.Option("cpu", "--device", callback=check_device, help="serve-queries --device of both runs."),
    reuse: bool = typer.Option(False, "--reuse/--no-reuse", help="Serve with prediction reuse on (quadratic in "
                               "the run's queries)."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Build everything in this new folder and keep it "
                                        "(default: a temporary folder, removed)."),
) -> None:
    """A query file served in one `serve-queries` process (streamed: embedded, then answered) against the same
    queries already stored: peak RSS of each process (target ≤ 2 GB streamed) and the ratio of their wall times
    (target ≤ 1.3), answers and ledgers compared. stdout: one JSON line. Fixed seed: for measurement only."""
    from ..benchmarks.stream import main

    def call():
        if fmt not in ("npy", "parquet"):
            from ..errors import BadInputError

            raise BadInputError(f"--format must be npy or parquet, got {fmt!r}")
        return _module_main(main, _argv(queries=queries, n=n, d=d, tau=tau, batch_size=batch_size, format=fmt,
                                        device=device, keep=keep) + (["--reuse"] if reuse else []))

    run_library_call(call)


@bench_app.command("startup")
def startup_command(
    repeat: int = typer.Option(5, "--repeat", min=1, help="Runs of each command; the best wall time (seconds) "
                               "is reported."),
    small_n: int = typer.Option(10000, "--small-n", min=1, help="Private rows N of the small serve."),
    small_d: int = typer.Option(384, "--small-d", min=2, help="Dimension of the small serve's vectors."),
    small_queries: int = typer.Option(100, "--small-queries", min=1, help="Stored queries the small serve answers."),
) -> None:
    """Fixed cost of a process: `indknn --help` wall time against a bare `python -c pass` (and which heavy
    libraries `--help` imported: none expected), and a whole `serve-queries` process answering 100 stored
    queries at N = 10,000 against a bare Python process that imports numpy and torch, loads the same vectors
    and forms the same product (issue 21: ≤ 0.3 s and ≤ 3×). stdout: one JSON line."""
    from ..benchmarks.startup import main

    run_library_call(lambda: _module_main(main, _argv(repeat=repeat, small_n=small_n, small_d=small_d,
                                                      small_queries=small_queries)))


@bench_app.command("index-speed")
def index_speed_command(
    n: str = typer.Option("100000,1000000", "--n", help=N_SIZES + " Synthetic rows, d = --d."),
    d: int = typer.Option(384, "--d", min=2, help="Dimension of the synthetic vectors."),
    queries: int = typer.Option(1000, "--queries", min=1, help="Queries timed per index kind."),
    batch_size: int = typer.Option(1024, "--batch-size", min=1, help="Queries scored together (as serve-queries "
                                   "--batch-size)."),
    batch: Optional[int] = typer.Option(None, "--batch", hidden=True, help="Deprecated spelling of --batch-size."),
    tau: float = typer.Option(0.6, "--tau", help="Synthetic cosine τ (a record's own sub-cluster)."),
    ag: bool = typer.Option(True, "--ag/--no-ag", help="Also run on AG News MiniLM features (6,600 private / "
                            "1,000 queries; needs the data set and the cached features)."),
    ag_tau: float = typer.Option(0.25, "--ag-tau", help="τ on AG News."),
    latency_queries: int = typer.Option(8, "--latency-queries", min=1, help="Queries timed one at a time "
                                        "(latency)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON to this file."),
) -> None:
    """Queries/s, candidate recall and accuracy per index kind (flat, lsh, ivf)."""
    from ..benchmarks.index_speed import main

    size = batch_size if batch is None else deprecated_alias(None if batch_size == 1024 else batch_size, batch,
                                                             new="--batch-size", old="--batch")
    run_library_call(lambda: _module_main(main, _argv(n=list(_ints(n, "--n")), d=d, queries=queries,
                                                      batch_size=size, tau=tau, ag=ag, ag_tau=ag_tau,
                                                      latency_queries=latency_queries, out=out)))


@bench_app.command("user-unit")
def user_unit_command(
    dataset: str = typer.Option("ag_news", "--dataset", help="ag_news (MiniLM features cached by `bench`), mnist, or "
                                "the path of an indknn feature store."),
    eps: str = typer.Option("0.5,1,2", "--eps", help="Comma-separated ε values (gdp; per record or per user)."),
    draws: int = typer.Option(3, "--draws", min=1, help="Random splits per ε (median reported)."),
    queries: int = typer.Option(1000, "--queries", min=1, help="Queries per draw, split off the data set."),
    max_records: int = typer.Option(20, "--max-records", min=1, help="Users have 1..N records (uniform)."),
    k: int = typer.Option(3, "--k", min=1, help="--max-records-per-user of the capped user-unit row."),
    tau: float = typer.Option(0.25, "--tau", help="Cosine threshold τ."),
    sigma2: float = typer.Option(0.6, "--sigma2", help="Vote noise σ2."),
    delta: float = typer.Option(1e-5, "--delta", help="δ of every guarantee."),
    seed: int = typer.Option(0, "--seed", help="Seed of the splits, the users and the noise."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder: also write user_unit.json and user_unit.png."),
) -> None:
    """Accuracy and queries/s of the record unit vs the user unit (all records, and the k most similar) on users
    of 1–N records. stdout: one JSON line; a line per row on stderr."""
    from ..benchmarks.user_unit import main

    code = run_library_call(lambda: _module_main(main, _argv(dataset=dataset, eps=list(_floats(eps, "--eps")),
                                                             draws=draws, queries=queries, max_records=max_records,
                                                             k=k, tau=tau, sigma2=sigma2, delta=delta, seed=seed,
                                                             out=out)))
    if code:
        raise typer.Exit(code)


@bench_app.command("audit")
def audit_command(
    eps: float = typer.Option(2.0, "--eps", "--epsilon", help="Certified ε of the audited ledger (by --conversion, per "
                              "record, add/remove one record; --epsilon: old name)."),
    delta: float = typer.Option(1e-5, "--delta", help="δ of the certificate."),
    conversion: str = typer.Option("gdp", "--conversion", help="gdp or rdp: how B is calibrated from (ε, δ)."),
    trials: int = typer.Option(2000, "--trials", help="Trials per world (with and without the canary); ≥ 20, "
                               "half calibrate the test, half evaluate it."),
    queries: int = typer.Option(3, "--queries", help="Queries aimed at the canary in each trial (≥ 1)."),
    background: int = typer.Option(40, "--background", help="Records of another label at the canary's location."),
    far: int = typer.Option(60, "--far", help="Records elsewhere (never candidates)."),
    dim: int = typer.Option(8, "--dim", help="Dimension of the synthetic vectors (≥ 2)."),
    tau: float = typer.Option(0.5, "--tau", help="Cosine threshold τ."),
    sigma2: float = typer.Option(0.5, "--sigma2", help="Vote noise σ2."),
    count_share: float = typer.Option(0.98, "--count-share", help="One count charge 1/(2σ1²) as a share of B, "
                                      "in (0, 1]."),
    k_min: float = typer.Option(1.0, "--k-min", help="Clamp K_min of the released count."),
    alpha: float = typer.Option(0.05, "--alpha", help="The lower bound holds with confidence 1 − α."),
    reuse: bool = typer.Option(True, "--reuse/--no-reuse", help="Prediction reuse on (as serve-queries)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Experiments only: fixed noise seed (default: OS "
                                       "entropy; recorded in the output)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON object to this file."),
) -> None:
    """Empirical privacy audit: a canary membership-inference ε lower bound (Clopper–Pearson) vs the certified ε.

    stdout: one JSON object. Exit 0 when the lower bound does not exceed the certified ε, 4 when it does (an
    implementation leak), 2 for bad input.
    """
    from ..benchmarks.audit import main

    argv = _argv(epsilon=eps, delta=delta, conversion=conversion, trials=trials, queries=queries,
                 background=background, far=far, dim=dim, tau=tau, sigma2=sigma2, count_share=count_share,
                 k_min=k_min, alpha=alpha, seed=seed, out=out) + ["--reuse", "true" if reuse else "false"]
    code = run_library_call(lambda: _module_main(main, argv))
    if code:
        raise typer.Exit(code)
