"""The float64 recompute of candidate pairs, compiled (numba), bit for bit numpy's (issue 21).

:func:`indknn_cli.candidates.exact_kernel_pairs` defines κ of a pair as numpy computes it: the d float64
products (cosine) or squared differences (RBF) of the two float32 rows, each exact or correctly rounded,
summed by numpy's per-row reduction, which is the pairwise summation of ``numpy/_core/src/umath/
loops_utils.h.src`` (``@TYPE@_pairwise_sum``): fewer than 8 terms are added in order from 0.0; up to 128
(``PW_BLOCKSIZE``) go into 8 running sums ``r[j] += a[i + j]``, combined as
``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``, then the remainder added in order; longer runs are
split at ``n2 = n // 2 − (n // 2) mod 8`` and the two halves' sums added.

This module runs the same operations in the same order, compiled, reading the float32 rows in place: no
gathered float64 copies, no temporary products. IEEE arithmetic without reassociation or contraction
(numba's default: no fastmath) rounds every step as numpy does, so the sums are the same bits; the SLP
vectoriser only packs the 8 independent running sums into SIMD lanes, which changes no rounding.
:func:`agrees_with_numpy` checks this on the running machine before the compiled path is used
(``candidates.exact_kernel_pairs``), and tests/test_exact_jit.py pins it on random, near-cancelling and
extreme-magnitude data, so a numpy that changed its summation would disable the compiled path, not change
a candidate.
"""

from __future__ import annotations

import os
import sys
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
        if "numba" not in sys.modules:
            # Pack the 8 independent running sums into SIMD lanes (numba leaves LLVM's SLP vectoriser off by
            # default); it reorders no addition. A caller's own setting wins.
            os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")
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

    @jit(nogil=True)
    def pair_sums(x, xi, q, qi, ops, cosine, out):
        stack = np.empty(64)  # depth ≤ log2(d / 128) + 2
        k = ops.shape[0]
        for p in range(xi.shape[0]):
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
            out[p] = stack[0]

    return {"pair_sums": pair_sums}


def available() -> bool:
    """Whether the compiled path can run here (numba importable)."""
    return _compile() is not None


def pair_sums(x: np.ndarray, xi: np.ndarray, q: np.ndarray, qi: np.ndarray, *, kernel: str) -> np.ndarray:
    """Σ_k x[xi[p], k]·q[qi[p], k] (cosine) or Σ_k (x[xi[p], k] − q[qi[p], k])² (RBF) for every pair p,
    in float64, summed as numpy sums a row. ``x`` and ``q``: C-contiguous float32 or float64 rows."""
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
    kernels["pair_sums"](x, xi, q, qi, pairwise_plan(x.shape[1]), kernel == "cosine", out)
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
    q = np.concatenate([x[:8] + 1e-7 * rng.standard_normal((8, d)), -x[8:16], rng.standard_normal((8, d))])
    return x.astype(dtype), q.astype(dtype)


def agrees_with_numpy(d: int, *, kernel: str, x_dtype=np.float32, q_dtype=np.float32) -> bool:
    """Whether the compiled sums equal numpy's on probe data of width ``d`` (checked once per process per
    width, kernel and dtypes). False when numba is missing."""
    key = (int(d), kernel, np.dtype(x_dtype).str, np.dtype(q_dtype).str)
    if key not in _agrees:
        ok = False
        if available():
            x, _ = _probe(int(d), x_dtype)
            _, q = _probe(int(d), q_dtype)
            xi = np.repeat(np.arange(x.shape[0]), q.shape[0])
            qi = np.tile(np.arange(q.shape[0]), x.shape[0])
            got = pair_sums(x, xi, q, qi, kernel=kernel)
            want = _numpy_sums(x, xi, q, qi, kernel=kernel)
            ok = bool(np.array_equal(got.view(np.int64), want.view(np.int64)))
        _agrees[key] = ok
    return _agrees[key]
