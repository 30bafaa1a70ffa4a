"""The Zarr v3 feature store: round trip, append, atomicity, refusals, streamed reads."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from indknn_cli import FORMAT_VERSION
from indknn_cli.errors import BadInputError, LockTimeoutError, StoreError
from indknn_cli.store import ExtractorInfo, FeatureStore, chunk_rows_for, normalize_rows, scan_rows_for

EX = ExtractorInfo("vectors", "precomputed", "passthrough")


def unit(n: int, d: int, seed: int = 0) -> np.ndarray:
    return normalize_rows(np.random.default_rng(seed).standard_normal((n, d)))


def make(tmp_path, *, d=8, chunk_rows=16, name="s.zarr"):
    return FeatureStore.create(tmp_path / name, extractor=EX, dim=d, label_names=["a", "b", "c"],
                               chunk_rows=chunk_rows)


def test_round_trip(tmp_path):
    x = unit(40, 8)
    s = make(tmp_path)
    start, stop = s.append("private", x, labels=np.arange(40) % 3, record_ids=[f"r{i}" for i in range(40)],
                           user_ids=[f"u{i % 7}" for i in range(40)])
    assert (start, stop) == (0, 40)
    r = FeatureStore.open(tmp_path / "s.zarr", mode="r")
    assert r.format_version == FORMAT_VERSION
    assert r.dim == 8 and r.extractor == EX and r.label_names == ["a", "b", "c"] and r.chunk_rows == 16
    assert r.root.attrs["normalized"] is True
    assert r.n_rows("private") == 40 and r.n_rows("public") == 0 and r.n_rows("query") == 0
    np.testing.assert_array_equal(r.read("private", "features"), x)
    np.testing.assert_array_equal(r.read("private", "labels"), np.arange(40) % 3)
    assert r.record_ids("private").tolist() == [f"r{i}" for i in range(40)]
    assert r.read("private", "user_id").tolist()[:8] == ["u0", "u1", "u2", "u3", "u4", "u5", "u6", "u0"]
    assert not r.read("private", "deleted").any()
    with pytest.raises(StoreError):
        r.appender("private")  # read-only


def test_append_keeps_committed_chunks(tmp_path):
    s = make(tmp_path)
    x1, x2 = unit(32, 8, 1), unit(10, 8, 2)
    s.append("private", x1, labels=np.zeros(32), record_ids=[f"a{i}" for i in range(32)])
    chunk0 = tmp_path / "s.zarr" / "private" / "features" / "c" / "0" / "0"
    before = (chunk0.stat().st_ino, chunk0.stat().st_mtime_ns, chunk0.read_bytes())
    s.append("private", x2, labels=np.ones(10), record_ids=[f"b{i}" for i in range(10)])
    after = (chunk0.stat().st_ino, chunk0.stat().st_mtime_ns, chunk0.read_bytes())
    assert before == after  # the full chunk below n_rows was not rewritten
    assert s.n_rows("private") == 42
    np.testing.assert_array_equal(s.read("private", "features"), np.vstack([x1, x2]))


def test_failed_append_leaves_store_as_it_was(tmp_path):
    s = make(tmp_path)
    x = unit(20, 8)
    s.append("private", x, labels=np.zeros(20), record_ids=[f"r{i}" for i in range(20)])
    attrs = dict(s.group("private").attrs)
    app = s.appender("private")
    app.write(unit(30, 8, 5), labels=np.ones(30), record_ids=[f"x{i}" for i in range(30)])
    # abandoned before commit (a crash, an error in a later batch)
    r = FeatureStore.open(tmp_path / "s.zarr")
    assert r.n_rows("private") == 20 and dict(r.group("private").attrs) == attrs
    np.testing.assert_array_equal(r.read("private", "features"), x)
    assert r.record_ids("private").tolist() == [f"r{i}" for i in range(20)]
    # the next append overwrites the uncommitted rows
    y = unit(3, 8, 9)
    assert s.append("private", y, labels=np.full(3, 2), record_ids=["n0", "n1", "n2"]) == (20, 23)
    np.testing.assert_array_equal(s.read("private", "features"), np.vstack([x, y]))
    assert s.read("private", "labels").tolist() == [0] * 20 + [2] * 3


def test_appender_refuses_wrong_width(tmp_path):
    s = make(tmp_path)
    with pytest.raises(BadInputError, match="d=8"):
        s.append("private", unit(2, 5), labels=[0, 0], record_ids=["a", "b"])
    assert s.n_rows("private") == 0


def test_query_batches(tmp_path):
    s = make(tmp_path)
    s.append("query", unit(5, 8), record_ids=list("abcde"), batch="day-1")
    s.append("query", unit(3, 8, 1), record_ids=list("abc"), batch="day-2")
    assert s.query_batch("day-1")[:2] == (0, 5) and s.query_batch("day-2")[:2] == (5, 8)
    assert s.read("query", "batch").tolist() == ["day-1"] * 5 + ["day-2"] * 3
    with pytest.raises(BadInputError):
        s.query_batch("nope")


def test_streamed_read_in_row_chunks(tmp_path):
    s = make(tmp_path, chunk_rows=16)
    x = unit(70, 8)
    s.append("private", x, labels=np.zeros(70), record_ids=[str(i) for i in range(70)])
    chunks = list(s.iter_chunks("private", rows=s.chunk_rows))
    assert [c[0] for c in chunks] == [0, 16, 32, 48, 64]
    assert max(len(c[1]) for c in chunks) == 16
    assert s.scan_rows == 16 * 4096 and [c[0] for c in s.iter_chunks("private")] == [0]  # default: scan steps
    np.testing.assert_array_equal(np.vstack([c[1] for c in chunks]), x)
    assert [len(c) for _, c in s.iter_chunks("private", rows=50)] == [50, 20]


def test_uncommitted_rows_are_invisible_to_streamed_reads(tmp_path):
    s = make(tmp_path)
    s.append("private", unit(10, 8), labels=np.zeros(10), record_ids=[str(i) for i in range(10)])
    s.appender("private").write(unit(10, 8, 3), labels=np.zeros(10), record_ids=[f"x{i}" for i in range(10)])
    assert sum(len(c) for _, c in FeatureStore.open(tmp_path / "s.zarr").iter_chunks()) == 10


def test_refuses_other_format_version(tmp_path):
    make(tmp_path)
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="r+")
    root.attrs["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(StoreError, match="format_version"):
        FeatureStore.open(tmp_path / "s.zarr")


def test_refuses_other_extractor_and_other_d(tmp_path):
    make(tmp_path)
    with pytest.raises(StoreError, match="extractor"):
        FeatureStore.open(tmp_path / "s.zarr", expect_extractor=ExtractorInfo("hog", "hog-28", "x"))
    with pytest.raises(StoreError, match="d=8"):
        FeatureStore.open(tmp_path / "s.zarr", expect_dim=384)
    # the version string alone does not make another extractor
    FeatureStore.open(tmp_path / "s.zarr", expect_extractor=ExtractorInfo("vectors", "precomputed", "other"),
                      expect_dim=8)


def test_refuses_non_store_and_corrupt_store(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="not an indknn feature store"):
        FeatureStore.open(tmp_path / "empty")
    make(tmp_path)
    (tmp_path / "s.zarr" / "zarr.json").write_text("{not json")
    with pytest.raises(StoreError):
        FeatureStore.open(tmp_path / "s.zarr")


def test_create_refuses_non_empty_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("hi")
    with pytest.raises(StoreError):
        FeatureStore.create(tmp_path / "x", extractor=EX, dim=4, label_names=["a"])


def test_write_lock_excludes_a_second_writer(tmp_path):
    s = make(tmp_path)
    other = FeatureStore.open(tmp_path / "s.zarr", mode="a")
    with s.write_lock():
        with pytest.raises(LockTimeoutError):
            with other.write_lock(timeout=0.1):
                pass
    with other.write_lock(timeout=0.1):
        pass


def test_layout_on_disk(tmp_path):
    """What docs/FORMAT.md describes."""
    make(tmp_path)
    root = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())
    assert root["zarr_format"] == 3 and root["node_type"] == "group"
    assert {"format_version", "store_uuid", "dim", "extractor", "label_names", "normalized",
            "chunk_rows", "created"} <= set(root["attributes"])
    for group in ("private", "public", "queries"):
        names = sorted(os.listdir(tmp_path / "s.zarr" / group))
        expected = ["deleted", "features", "labels", "record_id", "user_id", "zarr.json"]
        assert names == sorted(expected + (["batch"] if group == "queries" else [])
                               + (["content_key"] if group == "private" else []))
    feats = json.loads((tmp_path / "s.zarr" / "private" / "features" / "zarr.json").read_text())
    assert feats["data_type"] == "float32" and feats["chunk_grid"]["configuration"]["chunk_shape"] == [16, 8]


def test_chunk_rows_for():
    # ~1 MiB stored chunks, ~32 MiB scan steps (a whole number of chunks)
    assert chunk_rows_for(384) == 512 and chunk_rows_for(64) == 4096 and chunk_rows_for(16) == 16384
    assert scan_rows_for(384, 512) == 16384 and scan_rows_for(768, 256) == 8192 and scan_rows_for(16, 16384) == 65536
    assert scan_rows_for(384, 16384) == 16384  # a chunk as large as a step: one chunk at a time
    assert scan_rows_for(384, 1000) == 16000 and scan_rows_for(8, 100_000) == 100_000
    for d in (1, 8, 384, 768, 4096, 100_000):
        r = chunk_rows_for(d)
        assert r & (r - 1) == 0 and 256 <= r <= 65536
        s = scan_rows_for(d, r)
        assert s % r == 0 and s >= r


def test_small_private_embed_writes_close_to_its_bytes(tmp_path):
    """Issue 21: an embed of 20,000 private rows of d = 64 (5 MiB) writes ≤ 1.2× its row data (the padded
    last chunk is ≤ 1 MiB; with 8 MiB chunks it was 1.46×), and the scan reads it back in one step."""
    from indknn_cli.benchmarks.append import run

    r = run(rows=20000, d=64, role="private")
    assert r["write_amplification"] <= 1.2, r
    s = FeatureStore.create(tmp_path / "t.zarr", extractor=EX, dim=64, label_names=["a"])
    x = np.random.default_rng(0).standard_normal((20000, 64)).astype(np.float32)
    s.append("private", normalize_rows(x), labels=np.zeros(20000, np.int32), record_ids=[str(i) for i in range(20000)])
    steps = [(start, len(b)) for start, b in s.iter_chunks("private")]
    assert steps == [(0, 20000)] and s.chunk_rows == 4096 and s.scan_rows == 65536


@pytest.mark.parametrize("bad,msg", [(np.nan, "NaN"), (np.inf, "infinite"), (0.0, "zero")])
def test_normalize_rows_refuses(bad, msg):
    x = np.ones((3, 4))
    x[1] = 0.0 if bad == 0.0 else x[1]
    if bad != 0.0:
        x[1, 2] = bad
    with pytest.raises(BadInputError, match=msg):
        normalize_rows(x)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(1, 6)),
              elements=st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)))
def test_normalize_rows_is_per_vector(x):
    norms = np.linalg.norm(x, axis=1)
    if (norms < 1e-100).any():  # squares would underflow: a zero vector to normalize_rows
        return
    y = normalize_rows(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(y.astype(np.float64), axis=1), 1.0, rtol=1e-5)
    # each row depends on itself only
    np.testing.assert_allclose(normalize_rows(x[:1]), y[:1])
