"""`indknn bench user-unit`: the record unit against the user unit on users of several records."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..common import deprecated_alias, emit_json, given_on_command_line, run_library_call, say
from .options import floats


def user_unit_command(
    ctx: typer.Context,
    dataset: str = typer.Option("ag_news", "--dataset", help="ag_news (MiniLM features cached by `bench`), mnist, or "
                                "the path of an indknn feature store."),
    eps: str = typer.Option("0.5,1,2", "--eps", help="Comma-separated ε values (gdp; per record or per user)."),
    draws: int = typer.Option(3, "--draws", min=1, help="Random splits per ε (median reported)."),
    queries: int = typer.Option(1000, "--queries", min=1, help="Queries per draw, split off the data set."),
    user_size_max: int = typer.Option(20, "--user-size-max", min=1, help="Size N of the largest synthetic user: "
                                      "each user is given 1..N of the data set's records (uniform sizes)."),
    max_records: Optional[int] = typer.Option(None, "--max-records", min=1, hidden=True,
                                              help="Deprecated spelling of --user-size-max."),
    max_records_per_user: int = typer.Option(3, "--max-records-per-user", min=1, help="The capped user-unit row: "
                                             "only a user's k most similar records count per query (as index "
                                             "--max-records-per-user)."),
    k: Optional[int] = typer.Option(None, "--k", min=1, hidden=True,
                                    help="Deprecated spelling of --max-records-per-user."),
    tau: float = typer.Option(0.25, "--tau", help="Cosine threshold τ."),
    sigma2: float = typer.Option(0.6, "--sigma2", help="Vote noise σ2."),
    delta: float = typer.Option(1e-5, "--delta", help="δ of every guarantee."),
    seed: int = typer.Option(0, "--seed", help="Seed of the splits, the users and the noise."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder: also write user_unit.json and user_unit.png."),
) -> None:
    """Accuracy and queries/s of the record unit vs the user unit (all records, and the k most similar:
    --max-records-per-user k) on synthetic users of 1–N records (--user-size-max N). stdout: one JSON line; a line per row on stderr."""
    from ...benchmarks.user_unit import run

    user_size_max = deprecated_alias(user_size_max, max_records, new="--user-size-max", old="--max-records",
                                     typed=given_on_command_line(ctx, "user_size_max"))
    max_records_per_user = deprecated_alias(max_records_per_user, k, new="--max-records-per-user", old="--k",
                                            typed=given_on_command_line(ctx, "max_records_per_user"))

    emit_json(run_library_call(lambda: run(dataset=dataset, eps=floats(eps, "--eps"), draws=draws, queries=queries,
                                           user_size_max=user_size_max, max_records_per_user=max_records_per_user,
                                           tau=tau, sigma2=sigma2, delta=delta, seed=seed, out=out, progress=say)))
