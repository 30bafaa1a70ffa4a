"""faiss_screen: a chunk screened by FAISS on several threads (one OpenMP thread each) gives the pairs of one
call, in the same order (issue 21)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from indknn_cli import faiss_screen
from indknn_cli.candidates import ArraySource, find_candidates

from .conftest import clustered


@pytest.mark.parametrize("threads", [2, 3])
def test_split_screen_equals_one_call(monkeypatch, threads):
    x = clustered(9000, 32, 4, seed=5, spread=1.2)[0].astype(np.float32)
    q = x[:200] + np.float32(0.01)
    index = faiss_screen._query_index(np.ascontiguousarray(q))
    want = faiss_screen._screen_one(index, x, 0.5)
    monkeypatch.setattr(faiss_screen, "_screen_threads", lambda: threads)
    monkeypatch.setattr(faiss_screen, "SCREEN_SPLIT_MIN_PRODUCTS", 1000)
    seen = []
    real = faiss_screen._screen_one

    def spy(idx, block, screen):
        seen.append((threading.current_thread().name, block.shape[0]))
        return real(idx, block, screen)

    monkeypatch.setattr(faiss_screen, "_screen_one", spy)
    got = faiss_screen._screen_cpu(index, x, 0.5)
    assert len(seen) == threads and all(name.startswith("indknn-screen") for name, _ in seen)
    assert sum(n for _, n in seen) == 9000
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert want[0].size > 1000 and np.all(np.diff(got[1]) >= 0)


def test_workers_run_one_openmp_thread_and_the_caller_keeps_its_own():
    faiss = faiss_screen.import_faiss()
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(3)
    try:
        pool = faiss_screen._screen_executor(2)
        assert [f.result() for f in [pool.submit(faiss.omp_get_max_threads) for _ in range(4)]] == [1] * 4
        assert faiss.omp_get_max_threads() == 3
    finally:
        faiss.omp_set_num_threads(before)


def test_short_chunks_are_one_call(monkeypatch):
    monkeypatch.setattr(faiss_screen, "_screen_threads", lambda: 4)
    calls = []
    monkeypatch.setattr(faiss_screen, "_screen_one", lambda *a: calls.append(a[1].shape[0]) or
                        (np.empty(0, np.int64), np.empty(0, np.int64)))
    index = faiss_screen._query_index(np.ones((1024, 4), np.float32))
    rows = 2 * faiss_screen.SCREEN_SPLIT_MIN_PRODUCTS // 1024  # two pieces' worth against 1,024 queries
    faiss_screen._screen_cpu(index, np.zeros((rows - 1, 4), np.float32), 0.5)
    assert calls == [rows - 1]
    calls.clear()
    faiss_screen._screen_cpu(index, np.zeros((rows, 4), np.float32), 0.5)
    assert calls == [rows // 2, rows // 2]


def test_candidates_through_the_split_screen(monkeypatch):
    x, _y, _ = clustered(12000, 24, 3, seed=9, spread=1.2)
    q = clustered(12100, 24, 3, seed=9, spread=1.2)[0][12000:].astype(np.float32)
    kw = dict(kernel="cosine", tau=0.5, nu=None, device="cpu")
    monkeypatch.setattr(faiss_screen, "_screen_threads", lambda: 1)
    want = find_candidates(q, ArraySource(x.astype(np.float32), rows=6000), **kw)
    monkeypatch.setattr(faiss_screen, "_screen_threads", lambda: 2)
    monkeypatch.setattr(faiss_screen, "SCREEN_SPLIT_MIN_PRODUCTS", 1000)
    names = []
    real = faiss_screen._screen_one
    monkeypatch.setattr(faiss_screen, "_screen_one",
                        lambda *a: names.append(threading.current_thread().name) or real(*a))
    got = find_candidates(q, ArraySource(x.astype(np.float32), rows=6000), **kw)
    assert len(names) == 4 and all(n.startswith("indknn-screen") for n in names)  # 2 chunks × 2 threads
    for t in range(100):
        assert np.array_equal(got.rows[t], want.rows[t]) and got.kappa[t].tobytes() == want.kappa[t].tobytes()
    assert sum(r.size for r in got.rows) > 100
