"""`indknn bench serve-speed`, `index-speed` and `startup`: what serving costs against its floors."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..common import check_device, emit_json, run_library_call, say
from .options import N_SIZES, ints


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
    from ...benchmarks.serve_speed import run_grid

    def call() -> None:
        for line in run_grid(sizes=ints(n, "--n"), dims=ints(d, "--d"), queries=queries, tau=tau,
                             batch_size=batch_size, device=device, scheduler=scheduler,
                             workers=ints(workers, "--workers") if scheduler else (1, 2, 4)):
            emit_json(line)

    run_library_call(call)


def index_speed_command(
    n: str = typer.Option("100000,1000000", "--n", help=N_SIZES + " Synthetic rows, d = --d."),
    d: int = typer.Option(384, "--d", min=2, help="Dimension of the synthetic vectors."),
    queries: int = typer.Option(1000, "--queries", min=1, help="Queries timed per index kind."),
    batch_size: int = typer.Option(1024, "--batch-size", min=1, help="Queries scored together (as serve-queries "
                                   "--batch-size)."),
    tau: float = typer.Option(0.6, "--tau", help="Synthetic cosine τ (a record's own sub-cluster)."),
    ag: bool = typer.Option(True, "--ag/--no-ag", help="Also run on AG News MiniLM features (6,600 private / "
                            "1,000 queries; needs the data set and the cached features)."),
    ag_tau: float = typer.Option(0.25, "--ag-tau", help="τ on AG News."),
    latency_queries: int = typer.Option(8, "--latency-queries", min=1, help="Queries timed one at a time "
                                        "(latency)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON to this file."),
) -> None:
    """Queries/s, candidate recall and accuracy per index kind (flat, lsh, ivf)."""
    from ...benchmarks.index_speed import run

    emit_json(run_library_call(lambda: run(sizes=ints(n, "--n"), d=d, queries=queries, batch_size=batch_size,
                                           tau=tau, ag=ag, ag_tau=ag_tau, latency_queries=latency_queries,
                                           out=out, progress=say)))


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
    from ...benchmarks.startup import run

    emit_json(run_library_call(lambda: run(repeat=repeat, small_n=small_n, small_d=small_d,
                                           small_queries=small_queries)))
