"""The Triton kernels of :mod:`indknn_cli.gpu_fused` (imported only there, and only where Triton is installed).

``screen``: one fp16 product tile (fp32 accumulation on the tensor cores) whose epilogue tests every score
against the level and appends the passing (query, row) pairs to two arrays through one int64 atomic counter;
no score matrix is ever written. ``leaf_sums``: the float64 leaf sums of numpy's pairwise summation of the
terms x·q (or (x − q)²) of each pair, every operation the one numpy makes in the same order
(tests/test_gpu_fused.py runs both in Triton's interpreter against numpy).
"""

from __future__ import annotations

import triton
import triton.language as tl


# Sizes are not specialised on (Triton compiles a variant per "divisible by 16" of each integer otherwise), so
# the variant gpu_fused._probe compiles and checks is the one serving launches (review 17).
@triton.jit(do_not_specialize=["m", "n", "row0", "cap"])
def screen(q_ptr, x_ptr, mask_ptr, m, n, row0, level, out_q, out_r, count_ptr, cap,
           D: tl.constexpr, HAS_MASK: tl.constexpr, SCORES: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Queries [pid0·BM, …) × rows [pid1·BN, …) of ``x_ptr`` (the launch's rows; global row = row0 + local).

    SCORES (the probe only): write the fp32 scores to ``out_q`` as an (m, n) matrix instead of the pairs."""
    pid_m = tl.program_id(0)  # queries fastest: a tile of rows is read once while every query tile passes it
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(q_ptr + rm64[:, None] * D + rk[None, :], mask=(rm[:, None] < m) & (rk[None, :] < D), other=0.0)
        b = tl.load(x_ptr + rn64[None, :] * D + rk[:, None], mask=(rn[None, :] < n) & (rk[:, None] < D), other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    inside = (rm[:, None] < m) & (rn[None, :] < n)
    if SCORES:
        tl.store(out_q + rm64[:, None] * n + rn64[None, :], acc, mask=inside)
    else:
        hit = (acc >= level) & inside
        if HAS_MASK:
            keep = tl.load(mask_ptr + row0 + rn64, mask=rn < n, other=0)
            hit = hit & (keep[None, :] != 0)
        h = hit.to(tl.int32)  # a tile's count fits (BM·BN); the counter and the positions are int64
        total = tl.sum(tl.sum(h, axis=1), axis=0)
        if total > 0:
            base = tl.atomic_add(count_ptr, total.to(tl.int64))
            flat = tl.reshape(h, (BM * BN,))
            pos = base + (tl.cumsum(flat, axis=0) - flat).to(tl.int64)
            zero = tl.zeros((BM, BN), dtype=tl.int32)
            qq = tl.reshape(rm[:, None] + zero, (BM * BN,))
            rr = tl.reshape(rn[None, :] + zero, (BM * BN,)) + row0
            ok = (flat > 0) & (pos < cap)
            tl.store(out_q + pos, qq, mask=ok)
            tl.store(out_r + pos, rr, mask=ok)


@triton.jit(do_not_specialize=["p"])
def leaf_sums(x_ptr, q_ptr, ri_ptr, qi_ptr, p, out_ptr,
              D: tl.constexpr, LEAF: tl.constexpr, NLEAF: tl.constexpr, RBF: tl.constexpr, BP: tl.constexpr):
    """out[p, j] = numpy's sum of leaf j (terms [j·LEAF, (j + 1)·LEAF), LEAF a multiple of 8) of pair p: eight
    running sums started at the first eight terms, each term added in order, then ((r0 + r1) + (r2 + r3)) +
    ((r4 + r5) + (r6 + r7)). Launched with fp-fusion off: every product and sum rounded on its own, as numpy."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BP + tl.arange(0, BP)
    live = offs < p
    ri = tl.load(ri_ptr + offs, mask=live, other=0).to(tl.int64)
    qi = tl.load(qi_ptr + offs, mask=live, other=0).to(tl.int64)
    k8 = tl.arange(0, 8)
    for leaf in tl.static_range(NLEAF):
        xo = x_ptr + ri[:, None] * D + leaf * LEAF + k8[None, :]
        qo = q_ptr + qi[:, None] * D + leaf * LEAF + k8[None, :]
        xv = tl.load(xo, mask=live[:, None], other=0.0).to(tl.float64)
        qv = tl.load(qo, mask=live[:, None], other=0.0).to(tl.float64)
        if RBF:
            t = xv - qv
            r = t * t
        else:
            r = xv * qv
        for j in tl.static_range(1, LEAF // 8):
            xv = tl.load(xo + 8 * j, mask=live[:, None], other=0.0).to(tl.float64)
            qv = tl.load(qo + 8 * j, mask=live[:, None], other=0.0).to(tl.float64)
            if RBF:
                t = xv - qv
                r = r + t * t
            else:
                r = r + xv * qv
        a, b = tl.split(tl.reshape(r, (BP, 4, 2)))  # a = r0, r2, r4, r6; b = r1, r3, r5, r7
        s = a + b
        a, b = tl.split(tl.reshape(s, (BP, 2, 2)))  # a = (r0 + r1), (r4 + r5); b = (r2 + r3), (r6 + r7)
        s = a + b
        a, b = tl.split(s)
        tl.store(out_ptr + offs * NLEAF + leaf, a + b, mask=live)
