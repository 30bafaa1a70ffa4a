from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("INDKNN_WIDTH", "120")  # fixed rich width: stable output asserts

from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows  # noqa: E402


def clustered(n: int, d: int, classes: int, *, seed: int, spread: float = 0.35):
    """Unit vectors around `classes` random centres; labels = centre index."""
    rng = np.random.default_rng(seed)
    centres = normalize_rows(rng.standard_normal((classes, d)))
    y = rng.integers(0, classes, n)
    x = centres[y] + spread * rng.standard_normal((n, d)) / np.sqrt(d)
    return normalize_rows(x), y.astype(np.int32), centres


def queries_at_level(x: np.ndarray, *, level: float, count: int, seed: int, spread: int = 3) -> np.ndarray:
    """Unit queries whose dot product with a private row of ``x`` sits at ``level``, offset by
    (k mod ``spread`` − ``spread`` // 2)·1e-7 for the k-th: a screen's edge."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        base = x[rng.integers(len(x))].astype(np.float64)
        other = rng.standard_normal(x.shape[1])
        other -= other.dot(base) * base
        other /= np.linalg.norm(other)
        lvl = level + (k % spread - spread // 2) * 1e-7
        out.append(lvl * base + np.sqrt(max(0.0, 1 - lvl * lvl)) * other)
    return np.asarray(out, dtype=np.float32)


@pytest.fixture
def vector_store(tmp_path):
    """A store of 300 clustered private vectors (d=16, 3 classes) and a 40-query batch `q1`."""
    x, y, centres = clustered(300, 16, 3, seed=1)
    store = FeatureStore.create(tmp_path / "store.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=64)
    store.append("private", x, labels=y, record_ids=[f"r{i:04d}" for i in range(300)],
                 user_ids=[f"u{i % 50:03d}" for i in range(300)])
    q, _, _ = clustered(40, 16, 3, seed=2)
    store.append("query", q, record_ids=[f"q{i:03d}" for i in range(40)], batch="q1")
    return store
