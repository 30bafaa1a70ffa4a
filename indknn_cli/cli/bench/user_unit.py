"""`indknn bench user-unit`: the record unit against the user unit on users of several records."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..common import emit_json, run_library_call, say
from .options import floats


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
    from ...benchmarks.user_unit import run

    emit_json(run_library_call(lambda: run(dataset=dataset, eps=floats(eps, "--eps"), draws=draws, queries=queries,
                                           max_records=max_records, k=k, tau=tau, sigma2=sigma2, delta=delta,
                                           seed=seed, out=out, progress=say)))
