"""Accuracy sanity on real data (slow): AG News, MiniLM features, 6,600 private / 1,000 queries, ε = 2.

Runs the real chain (embed → index → serve-queries) through the library. The issue's
reference: accuracy near 0.85 (non-private 50-NN ≈ 0.90). Not a timed test.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
import pytest

from indknn_cli.embedding import embed_into_store
from indknn_cli.serving import build_index, make_params, serve_queries

DATA = Path(os.environ.get("INDKNN_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
AG = DATA / "ag_news" / "test.csv"
NAMES = {"1": "World", "2": "Sports", "3": "Business", "4": "Sci/Tech"}


@pytest.mark.slow
@pytest.mark.skipif(not AG.exists(), reason=f"{AG} not present")
def test_ag_news_accuracy_near_paper(tmp_path):
    rows = list(csv.DictReader(AG.open(encoding="utf-8")))
    perm = np.random.default_rng(0).permutation(len(rows))
    private, queries = [rows[i] for i in perm[:6600]], [rows[i] for i in perm[6600:7600]]
    for name, part in (("private.csv", private), ("queries.csv", queries)):
        with open(tmp_path / name, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["id", "text", "label"])
            for i, r in enumerate(part):
                w.writerow([f"{name[0]}{i}", f"{r['title']}. {r['description']}", NAMES[r["label"]]])
    store = tmp_path / "s.zarr"
    embed_into_store(tmp_path / "private.csv", store_path=store, role="private", extractor="text",
                     text_column="text", label_column="label", id_column="id",
                     label_names=["Business", "Sci/Tech", "Sports", "World"])
    embed_into_store(tmp_path / "queries.csv", store_path=store, role="query", text_column="text",
                     id_column="id", batch="test")
    params = make_params(epsilon=2.0, delta=1e-5, tau=0.25, sigma2=0.6, planned_queries=1000)
    build_index(store_path=store, ledger_path=tmp_path / "L", params=params)
    res = serve_queries(store_path=store, ledger_path=tmp_path / "L", query_batch="test", seed=0)
    truth = {f"q{i}": NAMES[r["label"]] for i, r in enumerate(queries)}
    acc = np.mean([truth[a["query_id"]] == a["label_name"] for a in res.answers])
    print(f"AG News Ind-KNN accuracy at eps=2 (gdp): {acc:.3f}")
    assert acc >= 0.82
