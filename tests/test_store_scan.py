"""store_scan: the chunk files read straight into reused buffers give zarr's values bit for bit, and a changed
chunk is refused as zarr's read refuses it (issue 21)."""

from __future__ import annotations

import numpy as np
import pytest

from indknn_cli import store_scan
from indknn_cli.candidates import StoreSource, find_candidates
from indknn_cli.errors import StoreError
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

N, D, CR = 1000, 24, 64  # 16 chunks, the last one 40 rows (padded on disk)


@pytest.fixture
def store(tmp_path):
    x, y, _ = clustered(N, D, 3, seed=7)
    s = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                            label_names=["a", "b", "c"], chunk_rows=CR)
    s.append("private", x[:700], labels=y[:700], record_ids=[f"r{i}" for i in range(700)])
    s.append("private", x[700:], labels=y[700:], record_ids=[f"r{i}" for i in range(700, N)])
    return FeatureStore.open(s.path, mode="r")


def _zarr_steps(store, rows):
    return [(s, b.copy()) for s, b in store.iter_chunks("private", rows=rows)]


def _fast_steps(store, rows, reuse=True):
    return [(s, b.copy()) for s, b in store_scan.scan_features(store, "private", rows=rows, reuse=reuse)]


def _same(a, b):
    assert [s for s, _ in a] == [s for s, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype == np.float32 and x.shape == y.shape and x.tobytes() == y.tobytes()


def test_the_stores_own_layout_takes_the_fast_path(store):
    assert store_scan._fast_layout(store, "private") is not None


@pytest.mark.parametrize("rows", [CR, 3 * CR, 8 * CR, 20 * CR])
@pytest.mark.parametrize("reuse", [True, False])
def test_bit_identical_to_zarr(store, rows, reuse, monkeypatch):
    want = _zarr_steps(store, rows)
    calls = []
    real = FeatureStore.iter_chunks
    monkeypatch.setattr(FeatureStore, "iter_chunks", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = _fast_steps(store, rows, reuse)
    _same(got, want)
    assert calls == []  # read from the chunk files, not through zarr
    assert sum(b.shape[0] for _, b in got) == N


def test_reused_buffers_hold_until_the_block_after_next(store):
    """Through the read-ahead thread, as the screen reads them: when block i + 1 arrives the thread is already
    reading block i + 2, and block i must still be intact (a ring of two buffers would overwrite it)."""
    import time

    src = StoreSource(store, cache_bytes=8 * CR * D * 4)  # over the cache: the ring of buffers
    want = [b for _, b in _zarr_steps(store, CR)]
    prev = None
    for i, (_start, block) in enumerate(src.chunks()):
        time.sleep(0.02)  # let the read-ahead of the next block land
        if prev is not None:
            assert prev.tobytes() == want[i - 1].tobytes()
        assert block.tobytes() == want[i].tobytes()
        prev = block
    assert i == len(want) - 1


def test_unaligned_steps_are_read_by_zarr(store):
    _same(_fast_steps(store, 100), _zarr_steps(store, 100))


def test_a_changed_chunk_is_refused(store):
    path = store.path / "private" / "features" / "c" / "3" / "0"
    raw = bytearray(path.read_bytes())
    raw[17] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="checksum"):
        _zarr_steps(store, 4 * CR)
    with pytest.raises(StoreError, match="checksum"):
        _fast_steps(store, 4 * CR)


def test_a_truncated_chunk_is_refused_by_zarr(store):
    path = store.path / "private" / "features" / "c" / "5" / "0"
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(StoreError):
        _fast_steps(store, 4 * CR)


def test_a_missing_chunk_reads_as_zarr_reads_it(store):
    (store.path / "private" / "features" / "c" / "2" / "0").unlink()
    want = _zarr_steps(store, 4 * CR)
    _same(_fast_steps(store, 4 * CR), want)


def test_candidates_through_reused_buffers(store):
    """A store over the cache is screened from the ring of buffers: the same candidates as from memory."""
    q = clustered(30, D, 3, seed=7)[0][:30].astype(np.float32)
    x = np.concatenate([b for _, b in _zarr_steps(store, CR)])
    from indknn_cli.candidates import ArraySource

    small = StoreSource(store, cache_bytes=8 * CR * D * 4)  # 8 chunks' cache: the store does not fit
    assert small.step_rows() == CR
    kw = dict(kernel="cosine", tau=0.5, nu=None, device="cpu")
    a = find_candidates(q, small, **kw)
    b = find_candidates(q, ArraySource(x, rows=CR), **kw)
    assert small._cache is None
    for t in range(30):
        assert np.array_equal(a.rows[t], b.rows[t]) and a.kappa[t].tobytes() == b.kappa[t].tobytes()
    assert sum(r.size for r in a.rows) > 30
