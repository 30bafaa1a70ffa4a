"""Output of `indknn bench`: environment record, JSON files and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ..output_files import atomic_output, refuse_not_a_file

PACKAGES = ("indknn", "numpy", "scipy", "torch", "opacus", "dp-accounting", "sentence-transformers",
            "scikit-image", "zarr", "pyarrow", "matplotlib")


def environment() -> dict:
    """Package versions, Python, platform, CPU count and the git commit (when in a checkout)."""
    from importlib import metadata

    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            versions[p] = None
    repo = Path(__file__).resolve().parents[2]
    commit, dirty = None, None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        if commit:
            status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                                    timeout=10).stdout
            dirty = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    import torch

    return {"versions": versions, "python": sys.version.split()[0], "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "git_commit": commit,
            "git_dirty": dirty, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _clean(obj):
    """JSON-safe: float keys to strings, inf/nan to strings, numpy scalars to Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        try:
            obj = obj.item()
        except (ValueError, AttributeError):
            obj = obj.tolist()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    return obj


def write_json(path: Path, obj: dict) -> Path:
    path = Path(path)
    refuse_not_a_file(path, option="bench's JSON file")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path, option="bench's JSON file", mode="w") as f:  # random O_EXCL name (review 45, F1)
        json.dump(_clean(obj), f, indent=1, ensure_ascii=False)
        f.write("\n")
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


STYLE = {"ind-knn": ("tab:red", "o"), "ind-knn+reuse": ("tab:orange", "s"), "private-knn": ("tab:blue", "^"),
         "linear-noisysgd": ("tab:green", "D"), "ind-knn (tuned privately)": ("tab:purple", "v"),
         "ind-knn (tuned non-privately)": ("tab:red", "o"), "ind-knn best grid point (oracle, B_serve)": ("tab:gray", "x"),
         "answered, no reuse": ("tab:red", "o"), "answered, reuse": ("tab:orange", "s")}


def plot_lines(path: Path, *, series: dict[str, tuple], xlabel: str, ylabel: str, title: str,
               hlines: dict[str, float | tuple] | None = None, logx: bool = False, logy: bool = False,
               bands: dict[str, tuple[list, list]] | None = None,
               hbands: dict[str, tuple[float, float]] | None = None) -> Path:
    """One line per series {name: (x, y)} or {name: (x, y, low, high)}; ``hlines`` {name: y or (y, low, high)}
    as references (non-private accuracies), each in its own colour and dash pattern.

    The spread over query draws (min–max) is a shaded band: from a series' own low/high, or ``bands``
    {name: (low, high)}; for a reference from its tuple or ``hbands`` {name: (low, high)}, so two references
    of nearly equal value still show their ranges.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 4.2), dpi=120)
    for name, values in series.items():
        xs, ys = values[0], values[1]
        band = (values[2], values[3]) if len(values) == 4 else (bands or {}).get(name)
        color, marker = STYLE.get(name, STYLE.get(name.split(" ")[0], (None, "o")))
        line, = ax.plot(xs, ys, marker=marker, color=color, label=name)
        if band is not None:
            ax.fill_between(xs, band[0], band[1], color=line.get_color(), alpha=0.15, linewidth=0)
    linestyles = ("--", ":", "-.", (0, (5, 1)), (0, (1, 1)))
    markers = ("D", "s", "^", "v", "P", "X")
    xs_all = [float(x) for values in series.values() for x in values[0]]
    for i, (name, ref) in enumerate((hlines or {}).items()):
        y, band = (ref[0], tuple(ref[1:3])) if isinstance(ref, tuple) else (ref, (hbands or {}).get(name))
        color = f"C{(i + 5) % 10}"
        style = linestyles[i % len(linestyles)]
        ax.axhline(y, linestyle=style, linewidth=1.2, color=color)
        # one legend entry with the line's dash and the marker's shape (the marker is drawn below)
        ax.plot([], [], linestyle=style, linewidth=1.2, color=color, marker=markers[i % len(markers)], markersize=5,
                label=f"{name} ({y:.3f})")
        if band and len(band) == 2 and band[1] > band[0]:
            ax.axhspan(band[0], band[1], color=color, alpha=0.10, linewidth=0)
        if xs_all:  # each reference also as its own marker right of the data: two nearly equal ones stay apart
            lo_x, hi_x = min(xs_all), max(xs_all)
            x = (hi_x * (1.12 ** (i + 1)) if logx and lo_x > 0 else hi_x + 0.05 * (i + 1) * ((hi_x - lo_x) or 1.0))
            err = None
            if band and len(band) == 2 and band[1] >= band[0]:
                err = [[max(0.0, y - band[0])], [max(0.0, band[1] - y)]]
            ax.errorbar([x], [y], yerr=err, marker=markers[i % len(markers)], color=color, markersize=5,
                        capsize=2, linewidth=1)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    # a long axis label (every ε names its accountant, unit and adjacency) is wrapped: tight_layout cannot shrink
    # text, and one line cut off the label's end ("…, add/remove one rec") at the figure's edge
    ax.set_xlabel(textwrap.fill(xlabel, 80), fontsize=8)
    ax.set_ylabel(textwrap.fill(ylabel, 60), fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_grid(path: Path, *, grid: list[dict], title: str) -> Path:
    """Heat map of validation accuracy over the (σ2, τ) grid of the tuner."""
    import numpy as np

    plt = _plt()
    taus = sorted({g["tau"] for g in grid})
    s2s = sorted({g["sigma2"] for g in grid})
    z = np.full((len(taus), len(s2s)), np.nan)
    for g in grid:
        z[taus.index(g["tau"]), s2s.index(g["sigma2"])] = g["val_accuracy"]
    fig, ax = plt.subplots(figsize=(6.0, 4.2), dpi=120)
    im = ax.imshow(z, aspect="auto", origin="lower", cmap="viridis")
    ax.set_xticks(range(len(s2s)), [f"{s:g}" for s in s2s])
    ax.set_yticks(range(len(taus)), [f"{t:g}" for t in taus])
    ax.set_xlabel("σ2")
    ax.set_ylabel("τ")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="validation accuracy")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
