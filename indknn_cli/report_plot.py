"""`account --plot`: retired fraction and median realised loss against queries answered, spent/B histogram.

Operator figures (exact, from the private state): for the data holder only, never for query-senders.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import BadInputError
from .rounding import given, up

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_plot_path(path: str | os.PathLike) -> Path:
    """``--plot``'s file: a known suffix in an existing folder (checked before anything is read or written)."""
    p = Path(path)
    if p.suffix.lower() not in PLOT_SUFFIXES:
        raise BadInputError(f"--plot {path}: use a file name ending in {', '.join(PLOT_SUFFIXES)}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise BadInputError(f"--plot {path}: folder {parent} does not exist")
    return p


def plot_account_report(report, path: str | os.PathLike) -> Path:
    """Retired fraction and median realised loss against queries answered, and a histogram of spent/B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = check_plot_path(path)
    d = report.data
    pts = report.history_points
    x = [0] + [p["queries_answered"] for p in pts]
    retired = [0.0] + [p["retired_fraction"] for p in pts]
    med = [0.0] + [p["realised_epsilon_median"] or 0.0 for p in pts]
    conv = d["conversion"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(x, retired, marker="." if len(x) < 60 else None)
    axes[0].set_xlabel("queries answered")
    axes[0].set_ylabel("retired fraction of records")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("retired records")
    axes[1].plot(x, med, marker="." if len(x) < 60 else None, color="tab:orange")
    axes[1].axhline(d["epsilon"] or 0.0, ls="--", color="grey", label=f"guarantee ε = {up(d['epsilon'], 4)} ({conv}, per {d['unit']}, {d['adjacency']})")
    axes[1].set_xlabel("queries answered")
    axes[1].set_ylabel(f"median realised ε ({conv}, δ = {given(d['delta'])}, per {d['unit']})")
    axes[1].set_title("realised individual loss\n(descriptive, not a guarantee)")
    axes[1].set_ylim(0, 1.1 * max([d["epsilon"] or 0.0] + med + [1e-12]))
    axes[1].legend(loc="center right", fontsize=8)
    frac = report.spent_fraction if report.spent_fraction is not None else np.zeros(0)
    axes[2].hist(frac, bins=50, range=(0.0, 1.0), color="tab:green")
    axes[2].set_xlabel("spent / B")
    axes[2].set_ylabel("records")
    axes[2].set_title(f"spent budget (B = {up(d['budget'], 4)}, {d['records']} records)")
    fig.suptitle("operator only: exact figures of the private data, never for query-senders", fontsize=9, color="firebrick")  # review 46, F8
    fig.tight_layout()
    from .output_files import atomic_output

    try:
        with atomic_output(path, option="--plot") as fh:  # a random O_EXCL name (review 45, F1)
            fig.savefig(fh, format=path.suffix.lower().lstrip("."))
    finally:
        plt.close(fig)
    return path
