"""The compiled kernels of :mod:`indknn_cli.exact_jit` (numba), in a module of their own so that numba's
on-disk cache finds them again in the next process (functions defined inside a function are compiled anew
by every process). Imported only by ``exact_jit._compile``; read that module's docstring for what these
compute and why the bits are numpy's."""

from __future__ import annotations

import numpy as np

from .jit_common import njit


_jit = njit
_jit_inline = njit(inline="always")  # inlined into its callers (LLVM then vectorises the callers' running sums)


@_jit_inline
def term(x, q, i, cosine):
    if cosine:
        return np.float64(x[i]) * np.float64(q[i])
    dd = np.float64(x[i]) - np.float64(q[i])
    return dd * dd


@_jit
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


@_jit_inline
def leaf4_cos(x0, q0, x1, q1, x2, q2, x3, q3, a, n):
    """``leaf`` of four pairs at once (n ≥ 8), cosine: four independent sets of running sums, so the
    additions of one pair wait on the previous ones less (numpy's 8 sums are one dependent chain per
    SIMD lane); each pair's sums are still its own, in numpy's order. Written out term by term (no helper
    call per term): numba's inlining of one takes seconds to compile, and without it LLVM leaves the
    sums unvectorised."""
    a0 = np.float64(x0[a]) * np.float64(q0[a])
    a1 = np.float64(x0[a + 1]) * np.float64(q0[a + 1])
    a2 = np.float64(x0[a + 2]) * np.float64(q0[a + 2])
    a3 = np.float64(x0[a + 3]) * np.float64(q0[a + 3])
    a4 = np.float64(x0[a + 4]) * np.float64(q0[a + 4])
    a5 = np.float64(x0[a + 5]) * np.float64(q0[a + 5])
    a6 = np.float64(x0[a + 6]) * np.float64(q0[a + 6])
    a7 = np.float64(x0[a + 7]) * np.float64(q0[a + 7])
    b0 = np.float64(x1[a]) * np.float64(q1[a])
    b1 = np.float64(x1[a + 1]) * np.float64(q1[a + 1])
    b2 = np.float64(x1[a + 2]) * np.float64(q1[a + 2])
    b3 = np.float64(x1[a + 3]) * np.float64(q1[a + 3])
    b4 = np.float64(x1[a + 4]) * np.float64(q1[a + 4])
    b5 = np.float64(x1[a + 5]) * np.float64(q1[a + 5])
    b6 = np.float64(x1[a + 6]) * np.float64(q1[a + 6])
    b7 = np.float64(x1[a + 7]) * np.float64(q1[a + 7])
    c0 = np.float64(x2[a]) * np.float64(q2[a])
    c1 = np.float64(x2[a + 1]) * np.float64(q2[a + 1])
    c2 = np.float64(x2[a + 2]) * np.float64(q2[a + 2])
    c3 = np.float64(x2[a + 3]) * np.float64(q2[a + 3])
    c4 = np.float64(x2[a + 4]) * np.float64(q2[a + 4])
    c5 = np.float64(x2[a + 5]) * np.float64(q2[a + 5])
    c6 = np.float64(x2[a + 6]) * np.float64(q2[a + 6])
    c7 = np.float64(x2[a + 7]) * np.float64(q2[a + 7])
    d0 = np.float64(x3[a]) * np.float64(q3[a])
    d1 = np.float64(x3[a + 1]) * np.float64(q3[a + 1])
    d2 = np.float64(x3[a + 2]) * np.float64(q3[a + 2])
    d3 = np.float64(x3[a + 3]) * np.float64(q3[a + 3])
    d4 = np.float64(x3[a + 4]) * np.float64(q3[a + 4])
    d5 = np.float64(x3[a + 5]) * np.float64(q3[a + 5])
    d6 = np.float64(x3[a + 6]) * np.float64(q3[a + 6])
    d7 = np.float64(x3[a + 7]) * np.float64(q3[a + 7])
    i = a + 8
    m = a + n - n % 8
    while i < m:
        a0 += np.float64(x0[i]) * np.float64(q0[i])
        a1 += np.float64(x0[i + 1]) * np.float64(q0[i + 1])
        a2 += np.float64(x0[i + 2]) * np.float64(q0[i + 2])
        a3 += np.float64(x0[i + 3]) * np.float64(q0[i + 3])
        a4 += np.float64(x0[i + 4]) * np.float64(q0[i + 4])
        a5 += np.float64(x0[i + 5]) * np.float64(q0[i + 5])
        a6 += np.float64(x0[i + 6]) * np.float64(q0[i + 6])
        a7 += np.float64(x0[i + 7]) * np.float64(q0[i + 7])
        b0 += np.float64(x1[i]) * np.float64(q1[i])
        b1 += np.float64(x1[i + 1]) * np.float64(q1[i + 1])
        b2 += np.float64(x1[i + 2]) * np.float64(q1[i + 2])
        b3 += np.float64(x1[i + 3]) * np.float64(q1[i + 3])
        b4 += np.float64(x1[i + 4]) * np.float64(q1[i + 4])
        b5 += np.float64(x1[i + 5]) * np.float64(q1[i + 5])
        b6 += np.float64(x1[i + 6]) * np.float64(q1[i + 6])
        b7 += np.float64(x1[i + 7]) * np.float64(q1[i + 7])
        c0 += np.float64(x2[i]) * np.float64(q2[i])
        c1 += np.float64(x2[i + 1]) * np.float64(q2[i + 1])
        c2 += np.float64(x2[i + 2]) * np.float64(q2[i + 2])
        c3 += np.float64(x2[i + 3]) * np.float64(q2[i + 3])
        c4 += np.float64(x2[i + 4]) * np.float64(q2[i + 4])
        c5 += np.float64(x2[i + 5]) * np.float64(q2[i + 5])
        c6 += np.float64(x2[i + 6]) * np.float64(q2[i + 6])
        c7 += np.float64(x2[i + 7]) * np.float64(q2[i + 7])
        d0 += np.float64(x3[i]) * np.float64(q3[i])
        d1 += np.float64(x3[i + 1]) * np.float64(q3[i + 1])
        d2 += np.float64(x3[i + 2]) * np.float64(q3[i + 2])
        d3 += np.float64(x3[i + 3]) * np.float64(q3[i + 3])
        d4 += np.float64(x3[i + 4]) * np.float64(q3[i + 4])
        d5 += np.float64(x3[i + 5]) * np.float64(q3[i + 5])
        d6 += np.float64(x3[i + 6]) * np.float64(q3[i + 6])
        d7 += np.float64(x3[i + 7]) * np.float64(q3[i + 7])
        i += 8
    s0 = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    s1 = ((b0 + b1) + (b2 + b3)) + ((b4 + b5) + (b6 + b7))
    s2 = ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))
    s3 = ((d0 + d1) + (d2 + d3)) + ((d4 + d5) + (d6 + d7))
    while i < a + n:
        s0 += np.float64(x0[i]) * np.float64(q0[i])
        s1 += np.float64(x1[i]) * np.float64(q1[i])
        s2 += np.float64(x2[i]) * np.float64(q2[i])
        s3 += np.float64(x3[i]) * np.float64(q3[i])
        i += 1
    return s0, s1, s2, s3



@_jit_inline
def leaf4_rbf(x0, q0, x1, q1, x2, q2, x3, q3, a, n):
    """:func:`leaf4_cos` for RBF: the squared differences."""
    e = np.float64(x0[a]) - np.float64(q0[a])
    a0 = e * e
    e = np.float64(x0[a + 1]) - np.float64(q0[a + 1])
    a1 = e * e
    e = np.float64(x0[a + 2]) - np.float64(q0[a + 2])
    a2 = e * e
    e = np.float64(x0[a + 3]) - np.float64(q0[a + 3])
    a3 = e * e
    e = np.float64(x0[a + 4]) - np.float64(q0[a + 4])
    a4 = e * e
    e = np.float64(x0[a + 5]) - np.float64(q0[a + 5])
    a5 = e * e
    e = np.float64(x0[a + 6]) - np.float64(q0[a + 6])
    a6 = e * e
    e = np.float64(x0[a + 7]) - np.float64(q0[a + 7])
    a7 = e * e
    e = np.float64(x1[a]) - np.float64(q1[a])
    b0 = e * e
    e = np.float64(x1[a + 1]) - np.float64(q1[a + 1])
    b1 = e * e
    e = np.float64(x1[a + 2]) - np.float64(q1[a + 2])
    b2 = e * e
    e = np.float64(x1[a + 3]) - np.float64(q1[a + 3])
    b3 = e * e
    e = np.float64(x1[a + 4]) - np.float64(q1[a + 4])
    b4 = e * e
    e = np.float64(x1[a + 5]) - np.float64(q1[a + 5])
    b5 = e * e
    e = np.float64(x1[a + 6]) - np.float64(q1[a + 6])
    b6 = e * e
    e = np.float64(x1[a + 7]) - np.float64(q1[a + 7])
    b7 = e * e
    e = np.float64(x2[a]) - np.float64(q2[a])
    c0 = e * e
    e = np.float64(x2[a + 1]) - np.float64(q2[a + 1])
    c1 = e * e
    e = np.float64(x2[a + 2]) - np.float64(q2[a + 2])
    c2 = e * e
    e = np.float64(x2[a + 3]) - np.float64(q2[a + 3])
    c3 = e * e
    e = np.float64(x2[a + 4]) - np.float64(q2[a + 4])
    c4 = e * e
    e = np.float64(x2[a + 5]) - np.float64(q2[a + 5])
    c5 = e * e
    e = np.float64(x2[a + 6]) - np.float64(q2[a + 6])
    c6 = e * e
    e = np.float64(x2[a + 7]) - np.float64(q2[a + 7])
    c7 = e * e
    e = np.float64(x3[a]) - np.float64(q3[a])
    d0 = e * e
    e = np.float64(x3[a + 1]) - np.float64(q3[a + 1])
    d1 = e * e
    e = np.float64(x3[a + 2]) - np.float64(q3[a + 2])
    d2 = e * e
    e = np.float64(x3[a + 3]) - np.float64(q3[a + 3])
    d3 = e * e
    e = np.float64(x3[a + 4]) - np.float64(q3[a + 4])
    d4 = e * e
    e = np.float64(x3[a + 5]) - np.float64(q3[a + 5])
    d5 = e * e
    e = np.float64(x3[a + 6]) - np.float64(q3[a + 6])
    d6 = e * e
    e = np.float64(x3[a + 7]) - np.float64(q3[a + 7])
    d7 = e * e
    i = a + 8
    m = a + n - n % 8
    while i < m:
        e = np.float64(x0[i]) - np.float64(q0[i])
        a0 += e * e
        e = np.float64(x0[i + 1]) - np.float64(q0[i + 1])
        a1 += e * e
        e = np.float64(x0[i + 2]) - np.float64(q0[i + 2])
        a2 += e * e
        e = np.float64(x0[i + 3]) - np.float64(q0[i + 3])
        a3 += e * e
        e = np.float64(x0[i + 4]) - np.float64(q0[i + 4])
        a4 += e * e
        e = np.float64(x0[i + 5]) - np.float64(q0[i + 5])
        a5 += e * e
        e = np.float64(x0[i + 6]) - np.float64(q0[i + 6])
        a6 += e * e
        e = np.float64(x0[i + 7]) - np.float64(q0[i + 7])
        a7 += e * e
        e = np.float64(x1[i]) - np.float64(q1[i])
        b0 += e * e
        e = np.float64(x1[i + 1]) - np.float64(q1[i + 1])
        b1 += e * e
        e = np.float64(x1[i + 2]) - np.float64(q1[i + 2])
        b2 += e * e
        e = np.float64(x1[i + 3]) - np.float64(q1[i + 3])
        b3 += e * e
        e = np.float64(x1[i + 4]) - np.float64(q1[i + 4])
        b4 += e * e
        e = np.float64(x1[i + 5]) - np.float64(q1[i + 5])
        b5 += e * e
        e = np.float64(x1[i + 6]) - np.float64(q1[i + 6])
        b6 += e * e
        e = np.float64(x1[i + 7]) - np.float64(q1[i + 7])
        b7 += e * e
        e = np.float64(x2[i]) - np.float64(q2[i])
        c0 += e * e
        e = np.float64(x2[i + 1]) - np.float64(q2[i + 1])
        c1 += e * e
        e = np.float64(x2[i + 2]) - np.float64(q2[i + 2])
        c2 += e * e
        e = np.float64(x2[i + 3]) - np.float64(q2[i + 3])
        c3 += e * e
        e = np.float64(x2[i + 4]) - np.float64(q2[i + 4])
        c4 += e * e
        e = np.float64(x2[i + 5]) - np.float64(q2[i + 5])
        c5 += e * e
        e = np.float64(x2[i + 6]) - np.float64(q2[i + 6])
        c6 += e * e
        e = np.float64(x2[i + 7]) - np.float64(q2[i + 7])
        c7 += e * e
        e = np.float64(x3[i]) - np.float64(q3[i])
        d0 += e * e
        e = np.float64(x3[i + 1]) - np.float64(q3[i + 1])
        d1 += e * e
        e = np.float64(x3[i + 2]) - np.float64(q3[i + 2])
        d2 += e * e
        e = np.float64(x3[i + 3]) - np.float64(q3[i + 3])
        d3 += e * e
        e = np.float64(x3[i + 4]) - np.float64(q3[i + 4])
        d4 += e * e
        e = np.float64(x3[i + 5]) - np.float64(q3[i + 5])
        d5 += e * e
        e = np.float64(x3[i + 6]) - np.float64(q3[i + 6])
        d6 += e * e
        e = np.float64(x3[i + 7]) - np.float64(q3[i + 7])
        d7 += e * e
        i += 8
    s0 = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    s1 = ((b0 + b1) + (b2 + b3)) + ((b4 + b5) + (b6 + b7))
    s2 = ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))
    s3 = ((d0 + d1) + (d2 + d3)) + ((d4 + d5) + (d6 + d7))
    while i < a + n:
        e = np.float64(x0[i]) - np.float64(q0[i])
        s0 += e * e
        e = np.float64(x1[i]) - np.float64(q1[i])
        s1 += e * e
        e = np.float64(x2[i]) - np.float64(q2[i])
        s2 += e * e
        e = np.float64(x3[i]) - np.float64(q3[i])
        s3 += e * e
        i += 1
    return s0, s1, s2, s3


@_jit
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
                if cosine:
                    v0, v1, v2, v3 = leaf4_cos(x0, q0, x1, q1, x2, q2, x3, q3, a, ops[j, 1])
                else:
                    v0, v1, v2, v3 = leaf4_rbf(x0, q0, x1, q1, x2, q2, x3, q3, a, ops[j, 1])
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
