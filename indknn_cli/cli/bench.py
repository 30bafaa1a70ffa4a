"""`indknn bench`: the papers' experiments side by side with Private-kNN and Linear NoisySGD."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from .common import emit_json, run_library_call, stderr_console

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
PKNN_ACC = typer.Option("pld", "--pknn-accountant", help="Private-kNN accountant: pld or rdp (dp-accounting).")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda for the engine and the feature extractor.")


def _floats(text: Optional[str], what: str) -> Optional[tuple]:
    if text is None:
        return None
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        from ..errors import BadInputError

        raise BadInputError(f"{what}: expected comma-separated numbers, got {text!r}") from None


def _ints(text: Optional[str], what: str) -> Optional[tuple]:
    vals = _floats(text, what)
    return None if vals is None else tuple(int(v) for v in vals)


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


def _run(experiment: str, parsed=lambda: {}, **kw) -> None:
    """``parsed()`` turns the list options into values inside the error mapping (bad input → exit 2)."""
    err = stderr_console()
    from ..benchmarks.runner import run_bench

    summary = run_library_call(lambda: run_bench(experiment, progress=lambda s: err.print(f"[dim]·[/] {escape(s)}"),
                                                 **kw, **parsed()))
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
    err.print(escape(f"wrote {summary['json']} and {len(summary['plots'])} plot(s) in {summary['seconds']:.0f} s"))
    emit_json(summary)


def _common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, queries, n_queries,
            pknn_accountant, device, n_private=None) -> dict:
    return dict(quick=quick, out_dir=out, dataset=dataset, data_dir=data_dir, cache_dir=cache, seed=seed,
                features=features, conversion=conversion, delta=delta, draws=draws, queries=queries,
                n_queries=n_queries, n_private=n_private, pknn_accountant=pknn_accountant, device=device)


@bench_app.command("accuracy-vs-eps")
def accuracy_vs_eps(
    eps: Optional[str] = typer.Option(None, "--eps", help="Comma-separated ε values (default 0.5,1,1.5,2; "
                                      "--quick 0.5,1,2)."),
    quick: bool = QUICK, out: Path = OUT, dataset: str = DATASET, data_dir: Optional[Path] = DATA_DIR,
    cache: Optional[Path] = CACHE, seed: int = SEED, features: str = FEATURES, conversion: str = CONVERSION,
    delta: float = DELTA, draws: Optional[int] = DRAWS, queries: Optional[int] = QUERIES,
    n_queries: Optional[int] = N_QUERIES, n_private: Optional[int] = N_PRIVATE, pknn_accountant: str = PKNN_ACC,
    device: str = DEVICE,
) -> None:
    """Median accuracy over query draws per ε for every method, each tuned on a validation split (paper Fig. 1a, 2)."""
    _run("accuracy-vs-eps", lambda: dict(epsilons=_floats(eps, "--eps")),
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, queries,
                   n_queries, pknn_accountant, device, n_private))


@bench_app.command("accuracy-vs-queries")
def accuracy_vs_queries(
    eps: float = typer.Option(1.0, "--eps", help="The fixed ε."),
    query_grid: Optional[str] = typer.Option(None, "--query-grid", help="Comma-separated T values (those that fit "
                                             "the query pool are run)."),
    quick: bool = QUICK, out: Path = OUT, dataset: str = DATASET, data_dir: Optional[Path] = DATA_DIR,
    cache: Optional[Path] = CACHE, seed: int = SEED, features: str = FEATURES, conversion: str = CONVERSION,
    delta: float = DELTA, draws: Optional[int] = DRAWS, n_queries: Optional[int] = N_QUERIES,
    n_private: Optional[int] = N_PRIVATE, pknn_accountant: str = PKNN_ACC, device: str = DEVICE,
) -> None:
    """Accuracy as the number of queries T grows at fixed ε, with and without prediction reuse (paper Fig. 1b)."""
    _run("accuracy-vs-queries", lambda: dict(query_grid=_ints(query_grid, "--query-grid")), epsilon=eps,
         **_common(quick, out, dataset, data_dir, cache, seed, features, conversion, delta, draws, None,
                   n_queries, pknn_accountant, device, n_private))


@bench_app.command("retraining")
def retraining(
    eps: float = typer.Option(1.0, "--eps", help="Ind-KNN's guarantee and each NoisySGD training's ε."),
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
    eps: Optional[str] = typer.Option(None, "--eps", help="Comma-separated ε values to tune for."),
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



_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@bench_app.command("serve-speed", context_settings=_PASSTHROUGH)
def serve_speed_command(ctx: typer.Context) -> None:
    """Queries/s of serve-queries end to end (flat, cosine, reuse off) at several N and d. `--help` for options."""
    from ..benchmarks.serve_speed import main

    main(list(ctx.args))


@bench_app.command("year", context_settings=_PASSTHROUGH)
def year_command(ctx: typer.Context) -> None:
    """A year of cron into one ledger: last day's serve and account time vs day 10's. `--help` for options."""
    from ..benchmarks.year import main

    main(list(ctx.args))


@bench_app.command("append", context_settings=_PASSTHROUGH)
def append_command(ctx: typer.Context) -> None:
    """Bytes written per byte of query vectors embedded (write amplification). `--help` for options."""
    from ..benchmarks.append import main

    main(list(ctx.args))


@bench_app.command("startup", context_settings=_PASSTHROUGH)
def startup_command(ctx: typer.Context) -> None:
    """`indknn --help` wall time against a bare `python -c pass` (lazy imports). `--help` for options."""
    from ..benchmarks.startup import main

    main(list(ctx.args))


@bench_app.command("index-speed", context_settings=_PASSTHROUGH)
def index_speed_command(ctx: typer.Context) -> None:
    """Queries/s, candidate recall and accuracy per index kind (flat, lsh, ivf). `--help` for options."""
    from ..benchmarks.index_speed import main

    main(list(ctx.args))


@bench_app.command("user-unit", context_settings=_PASSTHROUGH)
def user_unit_command(ctx: typer.Context) -> None:
    """Accuracy and queries/s of the record unit vs the user unit on users of 1–20 records. `--help` for options."""
    from ..benchmarks.user_unit import main

    code = main(list(ctx.args))
    if code:
        raise typer.Exit(code)


@bench_app.command("audit", context_settings=_PASSTHROUGH)
def audit_command(ctx: typer.Context) -> None:
    """Empirical privacy audit: a canary membership-inference ε lower bound vs the certified ε (exit 4 if above)."""
    from ..benchmarks.audit import main

    code = main(list(ctx.args))
    if code:
        raise typer.Exit(code)
