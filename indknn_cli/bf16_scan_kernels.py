"""The compiled threshold scan of :mod:`indknn_cli.bf16_screen` (numba), in a module of its own so that
numba's on-disk cache finds it again in the next process. Imported only by ``bf16_screen._scan_kernel``;
read that module's docstring for what is scanned and why the pairs are a superset of the candidates."""

from __future__ import annotations

import numpy as np

from .jit_common import njit


_jit = njit


#: Scores tested together before any is looked at one by one (an OR over 64 int16 lanes vectorises).
LANES = 64


@_jit
def _emit(line, r, j, end, key_t, ordered, qi_out, ri_out, n):
    """Append the passing entries of line[j:end] (row ``r``) from position ``n``; the new count."""
    cap = qi_out.shape[0]
    for k in range(j, end):
        v = np.int32(line[k])
        if (v if ordered else (v if v >= 0 else -(v + 32768))) >= key_t:
            if n < cap:
                qi_out[n] = k
                ri_out[n] = r
            n += 1
    return n


@_jit
def _scan_ordered(s, key_t, qi_out, ri_out):
    rows, cols = s.shape
    n = 0
    full = cols - cols % LANES
    for r in range(rows):
        line = s[r]
        for j in range(0, full, LANES):
            hit = False
            for k in range(j, j + LANES):  # fixed length, no branch: LLVM vectorises the OR
                hit |= line[k] >= key_t
            if hit:
                n = _emit(line, r, j, j + LANES, key_t, True, qi_out, ri_out, n)
        if full < cols:
            n = _emit(line, r, full, cols, key_t, True, qi_out, ri_out, n)
    return n


@_jit
def _scan_keyed(s, key_t, qi_out, ri_out):
    rows, cols = s.shape
    n = 0
    for r in range(rows):
        n = _emit(s[r], r, 0, cols, key_t, False, qi_out, ri_out, n)
    return n


@_jit
def scan_ge(s, key_t, ordered, qi_out, ri_out):
    """(column, row) of every entry of ``s`` whose order key is ≥ ``key_t``, row by row, in order.

    ``s``: int16 (rows × queries), the bit patterns of bfloat16 scores. ``ordered``: the threshold is > 0,
    so a score's bits compared as int16 order it (negative scores have the sign bit, hence a negative
    int16); otherwise every score is mapped to the key k(v) = v for v ≥ 0, −(v + 32768) for v < 0, which
    orders all finite bfloat16 values (−0.0 and +0.0 both at 0). Returns how many entries pass; only the
    first ``len(qi_out)`` are written (the caller grows its buffers and scans again)."""
    if ordered:
        return _scan_ordered(s, key_t, qi_out, ri_out)
    return _scan_keyed(s, key_t, qi_out, ri_out)


#: As ``_jit``, with fp32 sums free to be reordered and fused (reassoc, contract: the fp32 screen's margin bounds any
#: summation order, and a fused multiply-add rounds once instead of twice).
_jit_fp32 = njit(fastmath={"reassoc", "contract"})


@_jit_fp32
def dots_at_least(x, xi, q, qi, level, keep):
    """keep[p] = (fp32 dot of x[xi[p]] and q[qi[p]]) ≥ level, for every pair p (float32 rows)."""
    d = x.shape[1]
    for p in range(xi.shape[0]):
        a = x[xi[p]]
        b = q[qi[p]]
        s = np.float32(0.0)
        for j in range(d):
            s += a[j] * b[j]
        keep[p] = s >= level
