"""The float64 recompute of candidate pairs, compiled (numba), bit for bit numpy's (issue 21).

:func:`indknn_cli.candidates.exact_kernel_pairs` defines κ of a pair as numpy computes it: the d float64
products (cosine) or squared differences (RBF) of the two float32 rows, each exact or correctly rounded,
summed by numpy's per-row reduction, which is the pairwise summation of ``numpy/_core/src/umath/
loops_utils.h.src`` (``@TYPE@_pairwise_sum``): fewer than 8 terms are added in order from 0.0; up to 128
(``PW_BLOCKSIZE``) go into 8 running sums ``r[j] += a[i + j]``, combined as
``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``, then the remainder added in order; longer runs are
split at ``n2 = n // 2 − (n // 2) mod 8`` and the two halves' sums added.

This module runs the same operations in the same order, compiled, reading the float32 rows in place: no
gathered float64 copies, no temporary products; four pairs at a time, so that one pair's additions need
not wait on its previous ones (each pair's sums are still its own). IEEE arithmetic without reassociation
or contraction (numba's default: no fastmath) rounds every step as numpy does, so the sums are the same
bits, and the result is added to 0.0 as numpy's reduction adds it to its identity (a −0.0 sum becomes
+0.0). Before the compiled path is used for a width, kernel and dtypes, :func:`agrees_with_numpy`
compares it with numpy on probe data on the running machine; any difference or failure there leaves
``candidates.exact_kernel_pairs`` on numpy's path (same numbers, slower), so a numpy that changed its
summation, or a broken numba, changes no candidate and raises nothing. tests/test_exact_jit.py pins the
bits on random, near-cancelling, signed-zero and extreme-magnitude data.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

#: numpy's PW_BLOCKSIZE: runs up to this length are summed with 8 running sums.
PW_BLOCKSIZE = 128

_lock = threading.Lock()
_kernels: dict | None = None
_agrees: dict = {}


def pairwise_plan(d: int) -> np.ndarray:
    """numpy's pairwise split of ``d`` terms as a postorder program: a row (a, n) pushes the sum of terms
    a … a+n−1 (n ≤ 128, one leaf), a row (−1, 0) replaces the two values on top of the stack by their sum."""
    if d < 0:
        raise ValueError(f"d must be non-negative, got {d!r}")
    ops: list[tuple[int, int]] = []
    todo: list[tuple[int, int, bool]] = [(0, d, False)]
    while todo:  # iterative postorder (numpy recurses: left half, right half, add)
        a, n, expanded = todo.pop()
        if expanded:
            ops.append((-1, 0))
        elif n <= PW_BLOCKSIZE:
            ops.append((a, n))
        else:
            n2 = n // 2
            n2 -= n2 % 8
            todo += [(a, n, True), (a + n2, n - n2, False), (a, n2, False)]
    return np.array(ops, dtype=np.int64).reshape(-1, 2)


def _compile() -> dict | None:
    """The compiled kernels, or None when numba cannot be imported."""
    global _kernels
    with _lock:
        if _kernels is not None:
            return _kernels or None
        try:
            import numba
        except Exception:  # not installed, or a broken install: numpy's path is the same numbers
            _kernels = {}
            return None
        _kernels = _build(numba)
        return _kernels


def _build(numba) -> dict:
    def jit(**kw):
        def wrap(fn):
            try:
                return numba.njit(cache=True, **kw)(fn)
            except Exception:  # no writable cache location: compile per process instead
                return numba.njit(**kw)(fn)
        return wrap

    @jit(nogil=True, inline="always")
    def term(x, q, i, cosine):
        if cosine:
            return np.float64(x[i]) * np.float64(q[i])
        dd = np.float64(x[i]) - np.float64(q[i])
        return dd * dd

    @jit(nogil=True, inline="always")
    def leaf(x, q, a, n, cosine):
        if n < 8:
            res = 0.0
            for i in range(a, a + n):
                res += term(x, q, i, cosine)
            return res
        r0 = term(x, q, a, cosine)
        r1 = term(x, q, a + 1, cosine)
        r2 = term(x, q, a + 2, cosine)
        r3 = term(x, q, a + 3, cosine)
        r4 = term(x, q, a + 4, cosine)
        r5 = term(x, q, a + 5, cosine)
        r6 = term(x, q, a + 6, cosine)
        r7 = term(x, q, a + 7, cosine)
        i = a + 8
        m = a + n - n % 8
        while i < m:
            r0 += term(x, q, i, cosine)
            r1 += term(x, q, i + 1, cosine)
            r2 += term(x, q, i + 2, cosine)
            r3 += term(x, q, i + 3, cosine)
            r4 += term(x, q, i + 4, cosine)
            r5 += term(x, q, i + 5, cosine)
            r6 += term(x, q, i + 6, cosine)
            r7 += term(x, q, i + 7, cosine)
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < a + n:
            res += term(x, q, i, cosine)
            i += 1
        return res

    @jit(nogil=True, inline="always")
    def leaf4(x0, q0, x1, q1, x2, q2, x3, q3, a, n, cosine):
        """``leaf`` of four pairs at once (n ≥ 8): four independent sets of running sums, so the additions
        of one pair wait on the previous ones less (numpy's 8 sums are one dependent chain per SIMD lane);
        each pair's sums are still its own, in numpy's order."""
        a0 = term(x0, q0, a, cosine)
        a1 = term(x0, q0, a + 1, cosine)
        a2 = term(x0, q0, a + 2, cosine)
        a3 = term(x0, q0, a + 3, cosine)
        a4 = term(x0, q0, a + 4, cosine)
        a5 = term(x0, q0, a + 5, cosine)
        a6 = term(x0, q0, a + 6, cosine)
        a7 = term(x0, q0, a + 7, cosine)
        b0 = term(x1, q1, a, cosine)
        b1 = term(x1, q1, a + 1, cosine)
        b2 = term(x1, q1, a + 2, cosine)
        b3 = term(x1, q1, a + 3, cosine)
        b4 = term(x1, q1, a + 4, cosine)
        b5 = term(x1, q1, a + 5, cosine)
        b6 = term(x1, q1, a + 6, cosine)
        b7 = term(x1, q1, a + 7, cosine)
        c0 = term(x2, q2, a, cosine)
        c1 = term(x2, q2, a + 1, cosine)
        c2 = term(x2, q2, a + 2, cosine)
        c3 = term(x2, q2, a + 3, cosine)
        c4 = term(x2, q2, a + 4, cosine)
        c5 = term(x2, q2, a + 5, cosine)
        c6 = term(x2, q2, a + 6, cosine)
        c7 = term(x2, q2, a + 7, cosine)
        d0 = term(x3, q3, a, cosine)
        d1 = term(x3, q3, a + 1, cosine)
        d2 = term(x3, q3, a + 2, cosine)
        d3 = term(x3, q3, a + 3, cosine)
        d4 = term(x3, q3, a + 4, cosine)
        d5 = term(x3, q3, a + 5, cosine)
        d6 = term(x3, q3, a + 6, cosine)
        d7 = term(x3, q3, a + 7, cosine)
        i = a + 8
        m = a + n - n % 8
        while i < m:
            a0 += term(x0, q0, i, cosine)
            a1 += term(x0, q0, i + 1, cosine)
            a2 += term(x0, q0, i + 2, cosine)
            a3 += term(x0, q0, i + 3, cosine)
            a4 += term(x0, q0, i + 4, cosine)
            a5 += term(x0, q0, i + 5, cosine)
            a6 += term(x0, q0, i + 6, cosine)
            a7 += term(x0, q0, i + 7, cosine)
            b0 += term(x1, q1, i, cosine)
            b1 += term(x1, q1, i + 1, cosine)
            b2 += term(x1, q1, i + 2, cosine)
            b3 += term(x1, q1, i + 3, cosine)
            b4 += term(x1, q1, i + 4, cosine)
            b5 += term(x1, q1, i + 5, cosine)
            b6 += term(x1, q1, i + 6, cosine)
            b7 += term(x1, q1, i + 7, cosine)
            c0 += term(x2, q2, i, cosine)
            c1 += term(x2, q2, i + 1, cosine)
            c2 += term(x2, q2, i + 2, cosine)
            c3 += term(x2, q2, i + 3, cosine)
            c4 += term(x2, q2, i + 4, cosine)
            c5 += term(x2, q2, i + 5, cosine)
            c6 += term(x2, q2, i + 6, cosine)
            c7 += term(x2, q2, i + 7, cosine)
            d0 += term(x3, q3, i, cosine)
            d1 += term(x3, q3, i + 1, cosine)
            d2 += term(x3, q3, i + 2, cosine)
            d3 += term(x3, q3, i + 3, cosine)
            d4 += term(x3, q3, i + 4, cosine)
            d5 += term(x3, q3, i + 5, cosine)
            d6 += term(x3, q3, i + 6, cosine)
            d7 += term(x3, q3, i + 7, cosine)
            i += 8
        s0 = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
        s1 = ((b0 + b1) + (b2 + b3)) + ((b4 + b5) + (b6 + b7))
        s2 = ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))
        s3 = ((d0 + d1) + (d2 + d3)) + ((d4 + d5) + (d6 + d7))
        while i < a + n:
            s0 += term(x0, q0, i, cosine)
            s1 += term(x1, q1, i, cosine)
            s2 += term(x2, q2, i, cosine)
            s3 += term(x3, q3, i, cosine)
            i += 1
        return s0, s1, s2, s3

    @jit(nogil=True)
    def pair_sums(x, xi, q, qi, ops, cosine, out):
        k = ops.shape[0]
        n = xi.shape[0]
        # Four pairs at a time where every leaf has 8 or more terms (d ≥ 8), one at a time otherwise.
        four = 0 if x.shape[1] < 8 else n - n % 4
        st = np.empty((4, 64))
        for p in range(0, four, 4):
            x0 = x[xi[p]]
            q0 = q[qi[p]]
            x1 = x[xi[p + 1]]
            q1 = q[qi[p + 1]]
            x2 = x[xi[p + 2]]
            q2 = q[qi[p + 2]]
            x3 = x[xi[p + 3]]
            q3 = q[qi[p + 3]]
            top = 0
            for j in range(k):
                a = ops[j, 0]
                if a < 0:
                    top -= 1
                    for w in range(4):
                        st[w, top - 1] = st[w, top - 1] + st[w, top]
                else:
                    v0, v1, v2, v3 = leaf4(x0, q0, x1, q1, x2, q2, x3, q3, a, ops[j, 1], cosine)
                    st[0, top] = v0
                    st[1, top] = v1
                    st[2, top] = v2
                    st[3, top] = v3
                    top += 1
            out[p] = 0.0 + st[0, 0]  # numpy's reduction adds the sum to its identity, 0.0 (−0.0 → 0.0)
            out[p + 1] = 0.0 + st[1, 0]
            out[p + 2] = 0.0 + st[2, 0]
            out[p + 3] = 0.0 + st[3, 0]
        stack = np.empty(64)  # depth ≤ log2(d / 128) + 2
        for p in range(four, n):
            xr = x[xi[p]]
            qr = q[qi[p]]
            top = 0
            for j in range(k):
                a = ops[j, 0]
                if a < 0:
                    top -= 1
                    stack[top - 1] = stack[top - 1] + stack[top]
                else:
                    stack[top] = leaf(xr, qr, a, ops[j, 1], cosine)
                    top += 1
            out[p] = 0.0 + stack[0]

    return {"pair_sums": pair_sums}


def available() -> bool:
    """Whether the compiled path can run here (numba importable)."""
    return _compile() is not None


#: Pairs per thread below which a call stays on one thread (a thread's start costs more than it saves).
PAIRS_PER_THREAD = 32768
_pool: dict = {}


def default_threads() -> int:
    """Threads for a large call: the cores this process may run on, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def _executor():
    """The process's one pool of :func:`default_threads` workers, made once (again in a forked child, whose
    copy of the parent's threads is dead); never replaced while a caller may hold it."""
    with _lock:
        if _pool.get("pid") != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            _pool.update(pid=os.getpid(), workers=default_threads(),
                         executor=ThreadPoolExecutor(default_threads(), thread_name_prefix="indknn-exact"))
        return _pool["executor"], _pool["workers"]


def pair_sums(x: np.ndarray, xi: np.ndarray, q: np.ndarray, qi: np.ndarray, *, kernel: str,
              threads: int | None = None) -> np.ndarray:
    """Σ_k x[xi[p], k]·q[qi[p], k] (cosine) or Σ_k (x[xi[p], k] − q[qi[p], k])² (RBF) for every pair p,
    in float64, summed as numpy sums a row. ``x`` and ``q``: C-contiguous float32 or float64 rows.

    A large call is cut into contiguous runs of pairs summed on ``threads`` threads (default
    :func:`default_threads`; the compiled loop releases the GIL). Each pair's sum is its own, so the cut
    changes no bit; it shortens the wall time, not the CPU seconds."""
    kernels = _compile()
    if kernels is None:
        raise RuntimeError("numba is not available")
    if kernel not in ("cosine", "rbf"):
        raise ValueError(f"kernel must be 'cosine' or 'rbf', got {kernel!r}")
    x = np.ascontiguousarray(x)
    q = np.ascontiguousarray(q)
    if x.dtype not in (np.float32, np.float64) or q.dtype not in (np.float32, np.float64):
        raise ValueError(f"rows must be float32 or float64, got {x.dtype} and {q.dtype}")
    if x.shape[1] != q.shape[1]:
        raise ValueError(f"rows of different widths: {x.shape[1]} and {q.shape[1]}")
    xi = np.ascontiguousarray(xi, dtype=np.int64)
    qi = np.ascontiguousarray(qi, dtype=np.int64)
    if xi.shape != qi.shape or xi.ndim != 1:
        raise ValueError(f"xi and qi must be 1-d of one length, got {xi.shape} and {qi.shape}")
    out = np.empty(xi.size, dtype=np.float64)
    if xi.size == 0:
        return out
    # Out-of-range indices would read outside the arrays (the compiled loop does not check): check here.
    if int(xi.min()) < 0 or int(xi.max()) >= x.shape[0] or int(qi.min()) < 0 or int(qi.max()) >= q.shape[0]:
        raise IndexError("pair index out of range")
    plan = pairwise_plan(x.shape[1])
    cosine = kernel == "cosine"
    n = xi.size
    threads = default_threads() if threads is None else int(threads)
    parts = max(1, min(threads, n // PAIRS_PER_THREAD))
    if parts == 1:
        kernels["pair_sums"](x, xi, q, qi, plan, cosine, out)
        return out
    pool, workers = _executor()
    parts = min(parts, workers)
    cuts = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
    futures = [pool.submit(kernels["pair_sums"], x, xi[a:b], q, qi[a:b], plan, cosine, out[a:b])
               for a, b in zip(cuts[:-1], cuts[1:])]
    for f in futures:
        f.result()
    return out


def _numpy_sums(x, xi, q, qi, *, kernel):
    xr = np.asarray(x)[xi]
    qr = np.asarray(q)[qi]
    if kernel == "cosine":
        return np.multiply(xr, qr, dtype=np.float64).sum(axis=1)
    diff = np.subtract(xr, qr, dtype=np.float64)
    return (diff * diff).sum(axis=1)


def _probe(d: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Rows that exercise rounding: unit vectors, near-cancelling pairs, wide magnitudes (fixed seed)."""
    rng = np.random.default_rng(20261126 + d)
    x = rng.standard_normal((24, d))
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    x[8:12] *= np.exp2(rng.integers(-60, 60, size=(4, d)))
    x[22] = 0.0  # signed zeros: −0.0 products and differences sum to +0.0 in numpy's reduction
    x[23] = -0.0
    q = np.concatenate([x[:8] + 1e-7 * rng.standard_normal((8, d)), -x[8:16], rng.standard_normal((8, d))])
    q[23] = 0.0
    return x.astype(dtype), q.astype(dtype)


@contextlib.contextmanager
def _compile_lock():
    """One process at a time compiles or loads the kernels (numba's on-disk cache takes no lock of its own:
    two processes writing it at once could leave an index naming the other's code)."""
    import fcntl
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"indknn-numba-{os.getuid()}.lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield  # no lock file possible: the probe below still guards the numbers
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def agrees_with_numpy(d: int, *, kernel: str, x_dtype=np.float32, q_dtype=np.float32) -> bool:
    """Whether the compiled sums equal numpy's on probe data of width ``d`` (checked once per process per
    width, kernel and dtypes; the check is also the kernels' compilation for those types). False when numba
    is missing or anything in compiling, loading or running the kernels fails: the caller then takes
    numpy's path, which gives the same numbers, so no error reaches the caller from here.

    While it compiles, ``NUMBA_SLP_VECTORIZE=1`` (unless the caller set it) lets LLVM pack the 8 running
    sums into SIMD lanes, a lane per sum, no addition reordered; numba leaves it off by default because it
    has miscompiled other code (numba PR #8852), which is one more reason every compiled kernel is checked
    against numpy here before use. The variable is removed again afterwards."""
    key = (int(d), kernel, np.dtype(x_dtype).str, np.dtype(q_dtype).str)
    if key in _agrees:
        return _agrees[key]
    ok = False
    try:
        with _compile_lock():
            set_slp = "NUMBA_SLP_VECTORIZE" not in os.environ
            if set_slp:
                os.environ["NUMBA_SLP_VECTORIZE"] = "1"
            try:
                if available():
                    x, _ = _probe(int(d), x_dtype)
                    _, q = _probe(int(d), q_dtype)
                    xi = np.repeat(np.arange(x.shape[0]), q.shape[0])
                    qi = np.tile(np.arange(q.shape[0]), x.shape[0])
                    got = pair_sums(x, xi, q, qi, kernel=kernel, threads=1)
                    want = _numpy_sums(x, xi, q, qi, kernel=kernel)
                    ok = bool(np.array_equal(got.view(np.int64), want.view(np.int64)))
            finally:
                if set_slp:
                    os.environ.pop("NUMBA_SLP_VECTORIZE", None)
    except Exception:  # a broken numba, a damaged cache, …: numpy's path
        ok = False
    _agrees[key] = ok
    return ok
