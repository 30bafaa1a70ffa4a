"""Issue 21: a store larger than the feature cache is read once per pass of parts, not once per part, and
the answers and the ledger are those of the part-by-part run (serve_pipeline.PassScreen)."""

from __future__ import annotations

import numpy as np
import pytest

from indknn_cli import candidates, serve_pipeline, serving, store_scan
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

MEM = 16 << 20  # --max-memory's floor: an 8 MiB feature cache, which the store below (9.8 MB) does not fit
N, D, Q = 38_400, 64, 150


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("pass") / "s.zarr"
    x, y, _ = clustered(N + Q, D, 4, seed=3, spread=1.5)  # queries around the same centres: ~73 candidates each
    x, y, q = x[:N], y[:N], x[N:]
    store = FeatureStore.create(path, extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                                label_names=["a", "b", "c", "d"])
    store.append("private", x, labels=y, record_ids=[f"r{i:05d}" for i in range(N)])
    store.append("query", q, record_ids=[f"q{i}" for i in range(Q)], batch="b")
    assert N * D * 4 > MEM // 2
    return path


def _serve(tmp_path, big_store, name, monkeypatch, *, reuse=True, max_memory=MEM):
    import shutil

    sp = tmp_path / f"{name}.zarr"
    shutil.copytree(big_store, sp)
    lp = tmp_path / f"{name}-ledger"
    build_index(store_path=sp, ledger_path=lp,
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.55, sigma2=0.5, planned_queries=Q))
    passes = []
    real = store_scan.scan_features

    def counting(store, role="private", rows=None, **kw):
        if role == "private":
            passes.append(role)
        return real(store, role, rows, **kw)

    monkeypatch.setattr(store_scan, "scan_features", counting)  # what StoreSource reads the store with
    res = serve_queries(store_path=sp, ledger_path=lp, query_batch="b", seed=5, batch_size=20, device="cpu",
                        reuse=reuse, max_memory=max_memory)
    monkeypatch.setattr(store_scan, "scan_features", real)
    led = BudgetLedger.open(lp)
    return res.answers, led.state, len(passes)


def _same(a, b):
    (ans_a, st_a, _), (ans_b, st_b, _) = a, b
    assert ans_a == ans_b
    for name in ("spent", "times_selected", "budget", "deleted"):
        assert getattr(st_a, name).tobytes() == getattr(st_b, name).tobytes(), name
    assert st_a.answers == st_b.answers


@pytest.mark.heavy
@pytest.mark.parametrize("reuse", [True, False])
def test_one_pass_for_all_parts_same_answers_and_ledger(tmp_path, big_store, monkeypatch, reuse):
    grouped = _serve(tmp_path, big_store, "g", monkeypatch, reuse=reuse)
    monkeypatch.setattr(serve_pipeline, "PASS_QUERIES", 0)  # every part screens itself
    per_part = _serve(tmp_path, big_store, "p", monkeypatch, reuse=reuse)
    _same(grouped, per_part)
    assert sum(a["released_count"] > 0 for a in grouped[0]) == Q
    assert (grouped[1].spent > 0).sum() > Q  # records were charged
    assert per_part[2] == 8  # 150 queries in parts of 20, each part reading the store
    assert grouped[2] == 1


def test_passes_of_pass_queries(tmp_path, big_store, monkeypatch):
    monkeypatch.setattr(serve_pipeline, "PASS_QUERIES", 64)  # 60 queries (3 parts of 20) per pass
    grouped = _serve(tmp_path, big_store, "g", monkeypatch)
    monkeypatch.setattr(serve_pipeline, "PASS_QUERIES", 0)
    _same(grouped, _serve(tmp_path, big_store, "p", monkeypatch))
    assert grouped[2] == 3  # ceil(150 / 60)


def _spy_parts(monkeypatch):
    given = []
    real = serve_pipeline.PassScreen.part

    def part(self, lo, hi):
        got = real(self, lo, hi)
        given.append(got is not None)
        return got

    monkeypatch.setattr(serve_pipeline.PassScreen, "part", part)
    return given


def test_a_store_in_the_cache_is_screened_part_by_part(tmp_path, big_store, monkeypatch):
    given = _spy_parts(monkeypatch)
    ans, _state, passes = _serve(tmp_path, big_store, "c", monkeypatch, max_memory=64 << 20)
    assert passes == 1  # read once, then cached: nothing to group
    assert given == [False] * 8  # every part screened itself
    assert len(ans) == Q


def test_the_pass_is_bounded_by_the_pair_bound(tmp_path, big_store, monkeypatch):
    """--max-memory 16 MiB: 174,762 pairs, so a pass of at most 170 queries (the screen then still sees 1,024
    rows a step); with --batch-size 20 that is 160 queries, all 150 in one pass."""
    given = _spy_parts(monkeypatch)
    _ans, _state, passes = _serve(tmp_path, big_store, "b", monkeypatch)
    assert passes == 1 and given == [True] * 8
    monkeypatch.setattr(serve_pipeline, "PASS_MIN_ROWS", 10_000)  # 17 queries a pass: under one part, so no pass
    given.clear()
    _ans, _state, passes = _serve(tmp_path, big_store, "b2", monkeypatch)
    assert given == [False] * 8 and passes == 8


def test_a_pass_over_the_pair_bound_falls_back_to_parts(tmp_path, big_store, monkeypatch):
    real = candidates.find_candidates

    def bounded(queries, source, **kw):
        if queries.shape[0] > 20:  # the pass (150 queries), not a part
            raise candidates.TooManyPairs()
        return real(queries, source, **kw)

    monkeypatch.setattr(candidates, "find_candidates", bounded)
    fallback = _serve(tmp_path, big_store, "f", monkeypatch)
    monkeypatch.undo()
    monkeypatch.setattr(serve_pipeline, "PASS_QUERIES", 0)
    _same(fallback, _serve(tmp_path, big_store, "p", monkeypatch))
    assert fallback[2] == 8


def test_pass_candidates_equal_part_candidates(big_store):
    store = FeatureStore.open(big_store, mode="r")
    q = store.read("query", "features").astype(np.float32)
    src = candidates.StoreSource(store, cache_bytes=MEM // 2)
    mask = np.ones(N, bool)
    mask[::7] = False
    kw = dict(kernel="cosine", tau=0.55, nu=None, device="cpu", row_mask=mask)
    whole = candidates.find_candidates(q, src, **kw)
    for lo in range(0, Q, 20):
        part = candidates.find_candidates(q[lo:lo + 20], src, **kw)
        for t in range(len(part.rows)):
            assert np.array_equal(part.rows[t], whole.rows[lo + t])
            assert part.kappa[t].tobytes() == whole.kappa[lo + t].tobytes()
    assert sum(r.size for r in whole.rows) > 20 * Q


@pytest.mark.parametrize("rows", [[5], [0, 1, 2, 3], [3, 4, 9, 10, 11, 37999], list(range(0, N, 7))])
def test_sync_reads_the_identifiers_of_exactly_the_new_rows(big_store, rows):
    from indknn_cli.indexing import _read_rows

    store = FeatureStore.open(big_store, mode="r")
    rows = np.asarray(rows, dtype=np.int64)
    whole = store.read("private", "record_id")
    got = _read_rows(store, "record_id", rows)
    assert list(got) == list(whole[rows])


@pytest.mark.heavy
@pytest.mark.parametrize("reuse", [True, False])
def test_screening_the_next_pass_ahead_gives_the_same_answers_and_ledger(tmp_path, big_store, monkeypatch, reuse):
    """On a GPU the next pass is screened in a thread while this one's parts commit (serve_pipeline.PassScreen.ahead);
    forced here on the CPU, with passes of 3 parts: the same answers and ledger as part by part."""
    monkeypatch.setattr(serve_pipeline, "PASS_QUERIES", 64)
    monkeypatch.setattr(serve_pipeline, "on_gpu", lambda device: True)
    started = []
    real_submit = None

    import concurrent.futures as cf

    real_submit = cf.ThreadPoolExecutor.submit

    def submit(self, fn, *a, **kw):
        if getattr(fn, "__name__", "") == "_find":
            started.append(a[:2])
        return real_submit(self, fn, *a, **kw)

    monkeypatch.setattr(cf.ThreadPoolExecutor, "submit", submit)
    ahead = _serve(tmp_path, big_store, "a", monkeypatch, reuse=reuse)
    monkeypatch.setattr(serve_pipeline, "on_gpu", lambda device: False)
    monkeypatch.setattr(serve_pipeline, "PASS_QUERIES", 0)
    _same(ahead, _serve(tmp_path, big_store, "p", monkeypatch, reuse=reuse))
    assert started == [(60, 120), (120, 150)]  # passes after the first were screened ahead


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_commit_releases_nothing_after_it(tmp_path, big_store, monkeypatch, overlap):
    """With commits overlapped (GPU) or inline: the second part's event fails to write; the first part's
    answers were released, nothing later is, and the error reaches the caller."""
    import shutil

    monkeypatch.setattr(serve_pipeline, "on_gpu", lambda device: overlap)
    sp, lp = tmp_path / "f.zarr", tmp_path / "f-ledger"
    shutil.copytree(big_store, sp)
    build_index(store_path=sp, ledger_path=lp,
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.55, sigma2=0.5, planned_queries=Q))
    real = BudgetLedger.commit_event
    calls = []

    def failing(self, **kw):
        calls.append(kw["event_type"])
        if kw["event_type"] == "serve" and calls.count("serve") == 2:
            raise OSError("disk full (test)")
        return real(self, **kw)

    monkeypatch.setattr(BudgetLedger, "commit_event", failing)
    released = []
    with pytest.raises(OSError, match="disk full"):
        serve_queries(store_path=sp, ledger_path=lp, query_batch="b", seed=5, batch_size=20, device="cpu",
                      reuse=False, max_memory=MEM, on_committed=released.extend)
    assert [r["query_index"] for r in released] == list(range(20))
    monkeypatch.setattr(BudgetLedger, "commit_event", real)
    assert BudgetLedger.open(lp).state.n_answers() == 20


def test_two_passes_held_ahead_stay_within_the_pair_bound(monkeypatch):
    """Screening ahead holds two passes at once, each pair with its ledger index and label (32 bytes against the
    bound's 24 per pair): together they stay within what --max-memory allows one pass (audit 2026-11-27)."""
    from types import SimpleNamespace

    monkeypatch.setattr(serve_pipeline, "on_gpu", lambda device: True)
    max_pairs = (2 << 30) // 4 // 24
    screen = serve_pipeline.PassScreen(SimpleNamespace(dim=384), SimpleNamespace(fits_cache=lambda: False),
                                       params=None, device="cuda", row_to_ledger=np.zeros(4, np.int64),
                                       max_pairs=max_pairs, max_memory=2 << 30, batch_size=8192, stop=10**6,
                                       enabled=True)
    assert screen.ahead and 2 * screen.max_pairs * 32 <= max_pairs * 24
    assert screen.span == 16384  # the pass's length is unchanged (the device's steps are sized by its memory)
    monkeypatch.setattr(serve_pipeline, "on_gpu", lambda device: False)
    plain = serve_pipeline.PassScreen(SimpleNamespace(dim=384), SimpleNamespace(fits_cache=lambda: False),
                                      params=None, device="cpu", row_to_ledger=np.zeros(4, np.int64),
                                      max_pairs=max_pairs, max_memory=2 << 30, batch_size=1024, stop=10**6,
                                      enabled=True)
    assert not plain.ahead and plain.max_pairs == max_pairs
