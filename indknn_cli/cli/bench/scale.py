"""`indknn bench year`, `append` and `stream`: costs that must stay flat as a store and its ledger grow."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..common import check_device, emit_json, run_library_call


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
    from ...benchmarks.year import run

    emit_json(run_library_call(lambda: run(days=days, queries=queries, n=n, d=d, tau=tau, reuse=reuse, eps=eps,
                                           keep=keep, processes=processes)))


def append_command(
    rows: int = typer.Option(20000, "--rows", min=1, help="Vectors embedded: as a query batch (from a .npy file, "
                             "256 rows at a time as serve-queries reads a query file) and as labelled private rows "
                             "(from a Parquet file)."),
    d: int = typer.Option(64, "--d", min=2, help="Dimension of the vectors."),
    role: str = typer.Option("both", "--role", help="query, private or both."),
) -> None:
    """Write amplification of an append: bytes this process wrote (every write(2), chunks and metadata) per byte
    of row data embedded (target ≤ 1.2), for queries and for private rows. stdout: one JSON line per role."""
    from ...benchmarks.append import roles, run

    def call() -> None:
        for one in roles(role):
            emit_json(run(rows=rows, d=d, role=one))

    run_library_call(call)


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
    from ...benchmarks.stream import run

    emit_json(run_library_call(lambda: run(queries=queries, n=n, d=d, tau=tau, reuse=reuse, batch_size=batch_size,
                                           fmt=fmt, device=device, keep=keep)))
