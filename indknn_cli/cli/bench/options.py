"""Options and list parsing shared by the `indknn bench` commands."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from ..common import check_device

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


def floats(text: Optional[str], what: str) -> Optional[tuple]:
    from ...errors import BadInputError

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


def ints(text: Optional[str], what: str) -> Optional[tuple]:
    """Comma-separated positive whole numbers (1e4 allowed): `--n -5`, `--n 2.5` and `--n 0` ran and printed junk
    rows, `--n 1e99` or `nan` ended in "Internal error" (review 38, F7)."""
    from ...errors import BadInputError

    vals = floats(text, what)
    if vals is None:
        return None
    bad = [v for v in vals if v < 1 or v != int(v) or v > 2**40]
    if bad:
        raise BadInputError(f"{what}: {bad[0]:g} is not a positive whole number (at most 2^40)")
    return tuple(int(v) for v in vals)


N_SIZES = "Comma-separated private-set sizes N (1e6 or 1000000)."
