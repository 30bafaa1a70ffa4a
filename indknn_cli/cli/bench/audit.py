"""`indknn bench audit`: an empirical ε lower bound against the certified ε."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ...errors import EXIT_CHECK_FAILED
from ..common import deprecated_alias, emit_json, given_on_command_line, progress_bar, run_library_call, say


def audit_command(
    ctx: typer.Context,
    eps: float = typer.Option(2.0, "--eps", help="Certified ε of the audited ledger (by --conversion, per record, "
                              "add/remove one record)."),
    epsilon: Optional[float] = typer.Option(None, "--epsilon", hidden=True, help="Deprecated spelling of --eps."),
    delta: float = typer.Option(1e-5, "--delta", help="δ of the certificate."),
    conversion: str = typer.Option("gdp", "--conversion", help="gdp or rdp: how B is calibrated from (ε, δ)."),
    trials: int = typer.Option(2000, "--trials", help="Trials per world (with and without the canary); ≥ 20, "
                               "half calibrate the test, half evaluate it."),
    queries: int = typer.Option(3, "--queries", help="Queries aimed at the canary in each trial (≥ 1)."),
    background: int = typer.Option(40, "--background", help="Records of another label at the canary's location."),
    far: int = typer.Option(60, "--far", help="Records elsewhere (never candidates)."),
    d: int = typer.Option(8, "--d", help="Dimension of the synthetic vectors (≥ 2)."),
    dim: Optional[int] = typer.Option(None, "--dim", hidden=True, help="Deprecated spelling of --d."),
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
    from ...benchmarks.audit import run

    eps = deprecated_alias(eps, epsilon, new="--eps", old="--epsilon", typed=given_on_command_line(ctx, "eps"))
    d = deprecated_alias(d, dim, new="--d", old="--dim", typed=given_on_command_line(ctx, "d"))

    with progress_bar("audit: trials") as update:  # on a terminal only (cron mail gets no progress lines)
        result = run_library_call(lambda: run(
            epsilon=eps, delta=delta, conversion=conversion, trials=trials, queries=queries, background=background,
            far=far, dim=d, tau=tau, sigma2=sigma2, count_share=count_share, k_min=k_min, alpha=alpha,
            reuse=reuse, seed=seed, out=out, progress=lambda done, total: update(completed=done, total=total)))
    emit_json(result)
    say(f"ε lower bound {result['epsilon_lower_bound']:.3f} (confidence {result['confidence']:.0%}) vs certified "
        f"ε({result['conversion']}) = {result['certified_epsilon']:.3f} at δ = {result['delta']:g}, per "
        f"{result['unit']} ({result['adjacency']} adjacency): "
        f"{'consistent' if result['passed'] else 'LEAK: the lower bound exceeds the certificate'}")
    if not result["passed"]:
        raise typer.Exit(EXIT_CHECK_FAILED)
