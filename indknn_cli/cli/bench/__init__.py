"""`indknn bench`: the papers' experiments side by side with Private-kNN and Linear NoisySGD, and the measurements
of what serving costs (one module per command or small group; each calls one library function)."""

from __future__ import annotations

import typer

from . import audit, papers, scale, speed, user_unit

bench_app = typer.Typer(
    help=(
        "Reproduce the papers' comparisons on data this machine has: Ind-KNN (through the same engine as "
        "serve-queries) against Private-kNN and Linear NoisySGD, with a JSON file of every figure and the exact "
        "configuration (seeds, versions, git commit) and PNG plots in --out. Seeded noise: for experiments "
        "only. stdout: one JSON summary line; tables and progress on stderr."
    ),
    no_args_is_help=True,
)

for _name, _command in (
    ("accuracy-vs-eps", papers.accuracy_vs_eps),
    ("accuracy-vs-queries", papers.accuracy_vs_queries),
    ("retraining", papers.retraining),
    ("min-margin", papers.min_margin),
    ("speed", papers.speed),
    ("tune", papers.tune),
    ("serve-speed", speed.serve_speed_command),
    ("year", scale.year_command),
    ("append", scale.append_command),
    ("stream", scale.stream_command),
    ("startup", speed.startup_command),
    ("index-speed", speed.index_speed_command),
    ("user-unit", user_unit.user_unit_command),
    ("audit", audit.audit_command),
):
    bench_app.command(_name)(_command)
