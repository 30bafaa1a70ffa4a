"""Options and list parsing shared by the `indknn bench` commands."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..common import check_device, parse_number_list

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
QUERIES = typer.Option(None, "--queries", help="Queries served per draw T, also the planned queries T of "
                       "σ1 = sqrt(T/6B) (default min(1000, query pool)).")
N_QUERIES = typer.Option(None, "--n-queries", help="Size of the query pool split off the data.")
N_PRIVATE = typer.Option(None, "--n-private", help="Keep a seeded random subset of this many private records "
                         "(default: all; --quick caps at 20,000).")
TEST_STORE = typer.Option(None, "--test-store", help="Score on this store's labelled test rows (`indknn embed "
                          "FILE --role test --label-column ...`) instead of queries carved out of the data; their "
                          "labels score answers only. Same extractor and label names as --dataset.")
PKNN_ACC = typer.Option("pld", "--pknn-accountant", help="Private-kNN accountant: pld or rdp (dp-accounting).")
DEVICE = typer.Option("cpu", "--device", callback=check_device, help="auto, cpu or cuda: the device of the engine "
                      "and the feature extractor.")


def floats(text: Optional[str], what: str, *, distinct: bool = False) -> Optional[tuple]:
    """A comma-separated list of finite numbers (None when the option was not given); empty items refused
    (:func:`~indknn_cli.cli.common.parse_number_list`, the one parser of these lists)."""
    return None if text is None else parse_number_list(text, flag=what, distinct=distinct)


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
