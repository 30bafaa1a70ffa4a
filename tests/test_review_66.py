"""Review 66 (2026-11-29, a helper as QA engineer on data of its own, `/work/review66`): texts longer than the text
model reads were cut without a word."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.store import FeatureStore

runner = CliRunner()


@pytest.mark.heavy
def test_embed_warns_about_texts_longer_than_the_model_reads(tmp_path):
    """F9: all-MiniLM-L6-v2 reads the first 256 word pieces; two texts differing only after them got bit-identical
    vectors, with no warning for private records or queries."""
    base = " ".join(f"word{i}" for i in range(400))
    src = tmp_path / "long.csv"
    with open(src, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "label", "text"])
        w.writerows([("a", "World", base + " quantum computing"), ("b", "Sports", base + " stock markets"),
                     ("c", "World", "a short text"), ("d", "Sports", "x" * 200)])
    res = runner.invoke(app, ["embed", str(src), "--store", str(tmp_path / "s.zarr"), "--extractor", "text",
                              "--label-names", "World,Sports"], env={"HF_HUB_OFFLINE": "1"})
    assert res.exit_code == 0, res.stderr
    err = " ".join(res.stderr.split())
    assert "2 texts longer than the text model reads (256 word pieces) (rows 1, 2)" in err
    x = FeatureStore.open(tmp_path / "s.zarr", mode="r").read("private", "features")
    assert np.array_equal(x[0], x[1])  # what the warning is about
