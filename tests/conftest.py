from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("INDKNN_WIDTH", "120")  # fixed rich width: stable output asserts

from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows  # noqa: E402


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A test that runs `indknn_cli.cli.app.main()` in this process installs its SIGTERM handler and, once the command
    is over, ignores SIGTERM and Ctrl-C (review 55, F8): put the handlers back for the tests that follow."""
    import signal

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in old.items():
        if h is not None and signal.getsignal(s) != h:
            signal.signal(s, h)


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


def threshold_world(kernel: str, tau: float, nu, *, rows: int, queries: int, chunk: int, d: int = 96):
    """Clustered rows (a chunked ArraySource), queries around them, 20 private rows as queries and ``queries``
    placed at the kernel's dot threshold, and a row mask dropping every 7th row: (q, source, mask, threshold)."""
    from indknn_cli.candidates import ArraySource, dot_threshold

    x, _, _ = clustered(rows, d, 4, seed=3)
    thr = dot_threshold(kernel=kernel, tau=tau, nu=nu)
    q, _, _ = clustered(queries, d, 4, seed=4)
    at = queries_at_level(x, level=thr, count=queries, seed=5, spread=5)
    q = np.concatenate([q, x[:20], at]).astype(np.float32)
    mask = np.ones(len(x), bool)
    mask[::7] = False
    return q, ArraySource(x, rows=chunk), mask, thr


def reuse_world():
    """800 rows and 200 of them as queries, each query's rows limited to those before row index + 300 (the
    reuse pool's ``strictly_before``): (x, q, limit)."""
    x, _, _ = clustered(800, 32, 3, seed=6)
    return x, x[:200] + 0.0, np.arange(len(x))[:200] + 300


def one_way_rounding_world():
    """Rows of k components a = 0.0625 + 2^-15 − 2^-24, each rounded down to 0.0625 in fp16, and τ the exact x·x
    of row 40: a screen without its margin loses (query 10, row 40). (x, q, τ)."""
    a = np.float32(0.0625 + 2.0**-15 - 2.0**-24)
    x = np.zeros((137, 256), np.float32)
    for i, k in enumerate(range(120, 257)):
        x[i, :k] = a
    return x, x[30:50].copy(), float(x[40].astype(np.float64) @ x[40].astype(np.float64))


def assert_same_candidates(a, b):
    """Two Candidates equal: rows, and κ bit for bit, query by query."""
    assert len(a.rows) == len(b.rows)
    for t in range(len(a.rows)):
        assert np.array_equal(a.rows[t], b.rows[t]), t
        assert np.array_equal(a.kappa[t].view(np.int64), b.kappa[t].view(np.int64)), t


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


def copies_of_pair(store, ledger, *roots):
    """Copies of a store and its ledger for tests that serve the same pair several ways and compare: the pair moves
    (``mv``) to the first root and is copied from there into the others, so that nothing is left at the path the
    ledger records (a copied pair is refused while its original is still there: store_twins, review 42). Returns
    [(store, ledger)] per root, the store's and ledger's folder names kept."""
    import shutil
    from pathlib import Path

    store, ledger = Path(store), Path(ledger)
    first = Path(roots[0])
    first.mkdir(parents=True, exist_ok=True)
    out = [(first / store.name, first / ledger.name)]
    shutil.move(store, out[0][0])
    shutil.move(ledger, out[0][1])
    for root in roots[1:]:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out[0][0], root / store.name)
        shutil.copytree(out[0][1], root / ledger.name)
        out.append((root / store.name, root / ledger.name))
    return out


@contextlib.contextmanager
def original_set_aside(store):
    """For a reference run on a copy of a live pair: the original store is moved aside (renamed) for the run and
    put back after, so the copy is not served beside a live original (refused: store_twins, review 42)."""
    from pathlib import Path

    store = Path(store)
    aside = store.with_name(store.name + ".aside")
    store.rename(aside)
    try:
        yield
    finally:
        aside.rename(store)


def served_pair(root: Path) -> tuple[Path, Path]:
    """A store of 120 clustered records (d = 16) with query batches q1 and q2 (10 each), its ledger, q1 served."""
    from indknn_cli.serving import build_index, make_params, serve_queries

    x, y, _ = clustered(120, 16, 3, seed=5)
    st = FeatureStore.create(root / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                             label_names=["a", "b", "c"])
    st.append("private", x, labels=y, record_ids=[f"r{i:03d}" for i in range(120)])
    for name, seed in (("q1", 6), ("q2", 7)):
        q, _, _ = clustered(10, 16, 3, seed=seed)
        st.append("query", q, record_ids=[f"{name}-{i}" for i in range(10)], batch=name)
    build_index(store_path=st.path, ledger_path=root / "L",
                params=make_params(epsilon=1, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=50))
    serve_queries(store_path=st.path, ledger_path=root / "L", query_batch="q1", seed=1)
    return root / "s.zarr", root / "L"
