"""The compiled float64 recompute (indknn_cli/exact_jit.py) gives numpy's bits, and the engine falls back to
numpy's path wherever it would not (issue 21)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indknn_cli import candidates, exact_jit
from indknn_cli.candidates import ArraySource, exact_kernel_pairs, find_candidates
from indknn_cli.store import normalize_rows

pytestmark = pytest.mark.skipif(not exact_jit.available(), reason="numba is not installed")


def _numpy(x, xi, q, qi, kernel):
    if kernel == "cosine":
        return np.multiply(x[xi], q[qi], dtype=np.float64).sum(axis=1)
    diff = np.subtract(x[xi], q[qi], dtype=np.float64)
    return (diff * diff).sum(axis=1)


def test_the_plan_is_numpys_pairwise_split():
    """Closed forms of numpy's split (PW_BLOCKSIZE 128, halves rounded down to a multiple of 8)."""
    assert exact_jit.pairwise_plan(0).tolist() == [[0, 0]]
    assert exact_jit.pairwise_plan(5).tolist() == [[0, 5]]
    assert exact_jit.pairwise_plan(128).tolist() == [[0, 128]]
    assert exact_jit.pairwise_plan(129).tolist() == [[0, 64], [64, 65], [-1, 0]]
    # 384 = 192 + 192 = (96 + 96) + (96 + 96)
    assert exact_jit.pairwise_plan(384).tolist() == [[0, 96], [96, 96], [-1, 0], [192, 96], [288, 96], [-1, 0],
                                                    [-1, 0]]
    for d in (1, 100, 257, 768, 1000, 4097):
        plan = exact_jit.pairwise_plan(d)
        leaves = plan[plan[:, 0] >= 0]
        assert leaves[0, 0] == 0 and (leaves[1:, 0] == np.cumsum(leaves[:, 1])[:-1]).all()
        assert leaves[:, 1].sum() == d and (leaves[:, 1] <= 128).all()
        assert (plan[:, 0] < 0).sum() == len(leaves) - 1
    with pytest.raises(ValueError, match="-1"):
        exact_jit.pairwise_plan(-1)


@pytest.mark.heavy
@pytest.mark.parametrize("kernel", ["cosine", "rbf"])
def test_compiled_sums_are_numpys_bits_at_every_width(kernel):
    """Every width 1…300 (all leaf shapes: fewer than 8 terms, 8-sum blocks with remainders, one split) and
    the common embedding widths; unsorted and repeated pairs; float32 and float64 operands."""
    rng = np.random.default_rng(7)
    for d in list(range(1, 301)) + [383, 384, 385, 512, 768, 1000, 1024, 1536]:
        x = normalize_rows(rng.standard_normal((30, d))).astype(np.float32)
        q = normalize_rows(rng.standard_normal((12, d))).astype(np.float32)
        xi = rng.integers(0, 30, 201)  # groups of four and a remainder pair
        qi = rng.integers(0, 12, 201)
        got = exact_jit.pair_sums(x, xi, q, qi, kernel=kernel)
        assert np.array_equal(got.view(np.int64), _numpy(x, xi, q, qi, kernel).view(np.int64)), d
    x64 = x.astype(np.float64) * 3.0
    got = exact_jit.pair_sums(x64, xi, q, qi, kernel=kernel)
    assert got.tolist() == _numpy(x64, xi, q, qi, kernel).tolist()


magnitudes = st.integers(-70, 70)


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 700), seed=st.integers(0, 2**32 - 1), spread=magnitudes,
       kernel=st.sampled_from(["cosine", "rbf"]), cancel=st.booleans())
def test_compiled_sums_equal_numpy_on_wide_and_cancelling_values(d, seed, spread, kernel, cancel):
    """Property: terms spanning many binades (so every addition rounds), or pairs that nearly cancel (a
    query that is a row's negation or a tiny perturbation of it), sum to numpy's bits."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, d)) * np.exp2(rng.integers(-abs(spread), abs(spread) + 1, (6, d))))
    x = x.astype(np.float32)
    q = (-x if kernel == "cosine" else x + np.float32(1e-6) * x) if cancel else rng.standard_normal((6, d))
    q = q.astype(np.float32)
    xi = rng.integers(0, 6, 42)
    qi = rng.integers(0, 6, 42)
    got = exact_jit.pair_sums(x, xi, q, qi, kernel=kernel)
    want = _numpy(x, xi, q, qi, kernel)
    assert got.tolist() == want.tolist()


def test_bad_arguments_are_refused_before_the_compiled_loop_reads_memory():
    x = np.ones((3, 8), np.float32)
    with pytest.raises(IndexError):
        exact_jit.pair_sums(x, np.array([3]), x, np.array([0]), kernel="cosine")
    with pytest.raises(IndexError):
        exact_jit.pair_sums(x, np.array([0]), x, np.array([-1]), kernel="cosine")
    with pytest.raises(ValueError, match="widths"):
        exact_jit.pair_sums(x, np.array([0]), np.ones((3, 9), np.float32), np.array([0]), kernel="cosine")
    with pytest.raises(ValueError, match="'laplace'"):
        exact_jit.pair_sums(x, np.array([0]), x, np.array([0]), kernel="laplace")
    with pytest.raises(ValueError, match="int32"):
        exact_jit.pair_sums(x.astype(np.int32), np.array([0]), x, np.array([0]), kernel="cosine")
    assert exact_jit.pair_sums(x, np.array([], int), x, np.array([], int), kernel="cosine").size == 0


@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.3, None), ("rbf", 0.5, 1.6)])
def test_a_large_batch_takes_the_compiled_path_and_gets_the_same_candidates(kernel, tau, nu, monkeypatch):
    """find_candidates with a batch of COMPILED_MIN_QUERIES queries or more uses exact_jit (counted), and its
    candidate rows and κ are bit for bit those of numpy's path (the same batch with the path forced off)."""
    monkeypatch.setattr(candidates, "COMPILED_COLD_QUERIES", 0)  # a batch this small takes it too
    rng = np.random.default_rng(3)
    d = 40
    X = normalize_rows(rng.standard_normal((3000, d))).astype(np.float32)
    Q = normalize_rows(X[rng.integers(0, 3000, 300)] + 0.6 * rng.standard_normal((300, d))).astype(np.float32)
    assert exact_jit.agrees_with_numpy(d, kernel=kernel)  # the probe's own calls are not counted below
    calls = []
    real = exact_jit.pair_sums
    monkeypatch.setattr(exact_jit, "pair_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = find_candidates(Q, ArraySource(X, rows=700), kernel=kernel, tau=tau, nu=nu, device="cpu")
    assert calls, "a batch of 300 queries should take the compiled path"
    monkeypatch.setattr(candidates, "COMPILED_MIN_QUERIES", 10**9)
    calls.clear()
    want = find_candidates(Q, ArraySource(X, rows=700), kernel=kernel, tau=tau, nu=nu, device="cpu")
    assert not calls
    assert sum(len(r) for r in want.rows) > 3000
    for t in range(len(Q)):
        assert got.rows[t].tolist() == want.rows[t].tolist()
        assert got.kappa[t].tolist() == want.kappa[t].tolist()


def test_a_compiled_path_that_disagrees_with_numpy_is_not_used(monkeypatch):
    """If the compiled sums ever differ from numpy's on this machine (a numpy that changed its summation),
    the probe catches it and exact_kernel_pairs keeps numpy's numbers."""
    real = exact_jit.pair_sums

    def off_by_one_ulp(*a, **k):
        return np.nextafter(real(*a, **k), np.inf)

    monkeypatch.setattr(exact_jit, "pair_sums", off_by_one_ulp)
    monkeypatch.setattr(exact_jit, "_agrees", {})
    rng = np.random.default_rng(1)
    X = normalize_rows(rng.standard_normal((50, 24))).astype(np.float32)
    xi = rng.integers(0, 50, 300)
    qi = rng.integers(0, 50, 300)
    assert not exact_jit.agrees_with_numpy(24, kernel="cosine")
    got = exact_kernel_pairs(X, xi, X, qi, kernel="cosine", nu=None, compiled=True)
    assert got.tolist() == exact_kernel_pairs(X, xi, X, qi, kernel="cosine", nu=None).tolist()
    assert got.tolist() != off_by_one_ulp(X, xi, X, qi, kernel="cosine").tolist()


@pytest.mark.parametrize("kind", ["lsh", "ivf"])
def test_index_finders_take_the_compiled_path_for_large_batches_with_the_same_candidates(tmp_path, kind,
                                                                                        monkeypatch):
    """LSH and IVF (covering settings) answer a 300-query batch through exact_jit, with the flat scan's numpy
    candidates bit for bit."""
    from indknn_cli import indexes

    from .conftest import clustered
    from .test_indexes import make_store

    x, y, _ = clustered(400, 12, 3, seed=11)
    q, _, _ = clustered(300, 12, 3, seed=12)
    pub, _, _ = clustered(300, 12, 3, seed=13)
    store = make_store(tmp_path / "s.zarr", x, y, public=pub)
    monkeypatch.setattr(candidates, "COMPILED_COLD_QUERIES", 0)
    opts = dict(tables=48, bits=1, seed=5) if kind == "lsh" else dict(nlist=8, nprobe=8, seed=5)
    indexes.build(store, kind=kind, **opts)
    finder = indexes.open_finder(store, kernel="cosine", tau=0.3, nu=None)
    assert exact_jit.agrees_with_numpy(12, kernel="cosine", x_dtype=np.float32)
    calls = []
    real = exact_jit.pair_sums
    monkeypatch.setattr(exact_jit, "pair_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = finder(q)
    assert calls
    monkeypatch.setattr(candidates, "COMPILED_MIN_QUERIES", 10**9)
    flat = find_candidates(q, ArraySource(x), kernel="cosine", tau=0.3, nu=None, device="cpu")
    assert sum(len(r) for r in flat.rows) > 1000
    for t in range(len(q)):
        assert got.rows[t].tolist() == flat.rows[t].tolist()
        assert got.kappa[t].tolist() == flat.kappa[t].tolist()


def test_a_call_cut_across_threads_gives_the_same_bits():
    """A large call's runs of pairs on several threads (each pair summed by itself) equal one thread's."""
    rng = np.random.default_rng(9)
    x = normalize_rows(rng.standard_normal((500, 20))).astype(np.float32)
    q = normalize_rows(rng.standard_normal((70, 20))).astype(np.float32)
    n = 4 * exact_jit.PAIRS_PER_THREAD + 123
    xi = rng.integers(0, 500, n)
    qi = rng.integers(0, 70, n)
    for kernel in ("cosine", "rbf"):
        one = exact_jit.pair_sums(x, xi, q, qi, kernel=kernel, threads=1)
        for threads in (2, 3, 8):
            assert exact_jit.pair_sums(x, xi, q, qi, kernel=kernel, threads=threads).tolist() == one.tolist()
        assert one.tolist() == _numpy(x, xi, q, qi, kernel).tolist()


def test_a_negative_zero_sum_is_numpys_positive_zero():
    """numpy's reduction adds the pairwise sum to its identity 0.0, so products that are all −0.0 sum to +0.0
    (at every width: one leaf, 8-sum leaves, split runs); the compiled path gives the same sign."""
    for d in (3, 8, 16, 200):
        x = np.full((2, d), -0.0, np.float32)
        x[1] = 0.5
        q = np.zeros((2, d), np.float32)
        q[1] = -0.0
        xi, qi = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
        for kernel in ("cosine", "rbf"):
            got = exact_jit.pair_sums(x, xi, q, qi, kernel=kernel)
            assert got.view(np.int64).tolist() == _numpy(x, xi, q, qi, kernel).view(np.int64).tolist(), (d, kernel)


def test_concurrent_callers_of_every_size_get_numpys_numbers_and_no_error():
    """Several threads (as Dask worker threads do) calling at once, small calls and calls cut across the
    shared pool mixed: every result is numpy's, nothing raises."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(4)
    x = normalize_rows(rng.standard_normal((400, 16))).astype(np.float32)
    sizes = [10, 3 * exact_jit.PAIRS_PER_THREAD, 500, 5 * exact_jit.PAIRS_PER_THREAD + 7, 1, 70000, 2, 9000]
    work = [(rng.integers(0, 400, n), rng.integers(0, 400, n)) for n in sizes]
    want = [exact_kernel_pairs(x, xi, x, qi, kernel="cosine", nu=None) for xi, qi in work]
    with ThreadPoolExecutor(len(work)) as pool:
        for _round in range(5):
            got = list(pool.map(lambda w: exact_kernel_pairs(x, w[0], x, w[1], kernel="cosine", nu=None,
                                                             compiled=True), work))
            assert [g.tolist() for g in got] == [w.tolist() for w in want]


def _child_sums(x, xi, out_queue):
    out_queue.put(exact_jit.pair_sums(x, xi, x, xi[::-1].copy(), kernel="cosine", threads=2).tolist())


def test_a_forked_child_gets_a_pool_of_its_own():
    """A child forked after the parent's pool started would otherwise wait forever on the parent's threads."""
    import multiprocessing

    rng = np.random.default_rng(6)
    x = normalize_rows(rng.standard_normal((300, 12))).astype(np.float32)
    xi = rng.integers(0, 300, 3 * exact_jit.PAIRS_PER_THREAD)
    want = exact_jit.pair_sums(x, xi, x, xi[::-1].copy(), kernel="cosine", threads=2)  # the parent's pool
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_sums, args=(x, xi, queue))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got == want.tolist()


def test_a_failing_compiled_path_falls_back_to_numpy_and_raises_nothing(monkeypatch):
    """Whether the recompute runs at all depends on the private data (no screened pair, no call), so a
    failure of the compiled path (a damaged numba cache, say) must not surface: numpy's numbers instead."""
    rng = np.random.default_rng(2)
    X = normalize_rows(rng.standard_normal((60, 32))).astype(np.float32)
    xi = rng.integers(0, 60, 500)
    qi = rng.integers(0, 60, 500)
    want = exact_kernel_pairs(X, xi, X, qi, kernel="rbf", nu=1.2)

    def broken(*a, **k):
        raise RuntimeError("damaged cache index")

    monkeypatch.setattr(exact_jit, "pair_sums", broken)
    monkeypatch.setitem(exact_jit._agrees, (32, "rbf", "<f4", "<f4"), True)  # the probe had passed
    assert exact_kernel_pairs(X, xi, X, qi, kernel="rbf", nu=1.2, compiled=True).tolist() == want.tolist()
    monkeypatch.setattr(exact_jit, "_agrees", {})
    assert exact_jit.agrees_with_numpy(32, kernel="rbf") is False
    assert exact_kernel_pairs(X, xi, X, qi, kernel="rbf", nu=1.2, compiled=True).tolist() == want.tolist()


_CACHE_PROBE = r"""
import json
from indknn_cli import exact_jit, exact_jit_kernels
assert exact_jit.agrees_with_numpy(24, kernel="cosine")
s = exact_jit_kernels.pair_sums.stats
print(json.dumps({"hits": sum(s.cache_hits.values()), "misses": sum(s.cache_misses.values())}))
"""


@pytest.mark.heavy
def test_the_next_process_loads_the_kernels_from_numbas_cache_instead_of_compiling():
    """The kernels live at module level (exact_jit_kernels), so numba's on-disk cache serves the next process:
    kernels defined inside a function were compiled anew by every process (seconds per serve-queries run)."""
    import json
    import subprocess
    import sys

    runs = [json.loads(subprocess.run([sys.executable, "-c", _CACHE_PROBE], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[1]["hits"] >= 1 and runs[1]["misses"] == 0, runs


_SMALL_BATCH = r"""
import json, sys
import numpy as np
from indknn_cli.candidates import ArraySource, find_candidates
rng = np.random.default_rng(0)
x = rng.standard_normal((int(sys.argv[1]), 32)).astype(np.float32)
x /= np.linalg.norm(x, axis=1, keepdims=True)
q = rng.standard_normal((int(sys.argv[3]), 32)).astype(np.float32)
q /= np.linalg.norm(q, axis=1, keepdims=True)
find_candidates(q, ArraySource(x), kernel="cosine", tau=float(sys.argv[2]), nu=None, device="cpu")
print(json.dumps("numba" in sys.modules))
"""


@pytest.mark.heavy
def test_whether_numba_is_loaded_depends_on_the_query_count_only():
    """1,000 queries (the year-of-cron bench's day) stay on numpy's path: numba's import and load would add
    ~0.6 s to each such process and save almost nothing; 2,048 queries load it. Never the rows stored: a rule
    on queries × rows loaded it for 1,000 queries against 40,000 rows and not against 5,000, so one record added
    at that threshold moved the run's time by the import (audit 10, F2)."""
    import json
    import subprocess
    import sys

    def loads_numba(rows, queries, tau=0.3):
        out = subprocess.run([sys.executable, "-c", _SMALL_BATCH, str(rows), str(tau), str(queries)],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert loads_numba(5000, 1000) is False and loads_numba(40000, 1000) is False
    assert loads_numba(300, 2048) is True and loads_numba(40000, 2048) is True
    # nor whether any row lies near the queries
    assert loads_numba(40000, 2048, tau=0.9999) is True
    kw = dict(dim=32, kernel="cosine")
    assert not candidates.use_compiled(255, **kw)
    assert candidates.use_compiled(2048, **kw) and candidates.use_compiled(256, **kw)  # numba is loaded here now


def test_a_bad_thread_setting_is_ignored_not_raised(monkeypatch):
    """INDKNN_EXACT_THREADS is read in the middle of a serve, only when pairs were found: a bad value must
    not raise there (an error would then depend on the private data)."""
    default = exact_jit.default_threads()
    for bad in ("auto", "-2", "0", "1.5", " "):
        monkeypatch.setenv("INDKNN_EXACT_THREADS", bad)
        assert exact_jit.default_threads() == default
    monkeypatch.setenv("INDKNN_EXACT_THREADS", "3")
    assert exact_jit.default_threads() == 3


def test_read_only_rows_take_the_checked_kernel_not_a_fresh_compile():
    """A read-only (memory-mapped) block is handed to the kernel as a writable copy: the one numba type the
    probe compiled and checked, not a new compile outside the lock."""
    rng = np.random.default_rng(8)
    x = normalize_rows(rng.standard_normal((40, 24))).astype(np.float32)
    exact_jit.pair_sums(x, np.arange(5), x, np.arange(5), kernel="cosine")
    from indknn_cli import exact_jit_kernels

    before = len(exact_jit_kernels.pair_sums.signatures)
    ro = x.copy()
    ro.setflags(write=False)
    xi = rng.integers(0, 40, 99)
    got = exact_jit.pair_sums(ro, xi, ro, xi[::-1].copy(), kernel="cosine")
    assert len(exact_jit_kernels.pair_sums.signatures) == before
    assert got.tolist() == _numpy(x, xi, x, xi[::-1], "cosine").tolist()


def test_the_compile_lock_follows_no_symbolic_link(tmp_path, monkeypatch):
    """The lock file is opened without following a link planted at its name (no file is created or opened at
    the link's target), in the user's own cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "indknn"
    folder.mkdir()
    target = tmp_path / "elsewhere"
    (folder / "numba-compile.lock").symlink_to(target)
    with exact_jit._compile_lock():
        pass
    assert not target.exists()
    (folder / "numba-compile.lock").unlink()
    with exact_jit._compile_lock() as locked:
        assert locked is True
    assert (folder / "numba-compile.lock").is_file()
