"""The compiled part of :mod:`indknn_cli.noise_jit` (numba): numpy's PCG64 and ziggurat normal, per query.

Imported only by ``noise_jit._load``; read that module's docstring for what these reproduce. Every integer
constant is a ``np.uint64`` (numba, like numpy, turns uint64 mixed with a signed integer into a float).
"""

from __future__ import annotations

import numpy as np
from numba.np.random._constants import fi_double, ki_double, wi_double, ziggurat_nor_inv_r, ziggurat_nor_r

from .jit_common import njit

FI = np.asarray(fi_double, dtype=np.float64)
KI = np.asarray(ki_double, dtype=np.uint64)
WI = np.asarray(wi_double, dtype=np.float64)
NOR_R = float(ziggurat_nor_r)
NOR_INV_R = float(ziggurat_nor_inv_r)

_MUL_HI = np.uint64(2549297995355413924)  # PCG_DEFAULT_MULTIPLIER_128, high and low words
_MUL_LO = np.uint64(4865540595714422341)
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)


_jit = njit


@_jit
def _mulhi(a, b):
    """High 64 bits of the 128-bit product of two uint64."""
    a0, a1 = a & _M32, a >> _S32
    b0, b1 = b & _M32, b >> _S32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _S32) + (p01 & _M32) + (p10 & _M32)
    return p11 + (p01 >> _S32) + (p10 >> _S32) + (mid >> _S32)


@_jit
def _step(sh, sl, ih, il):
    """state · multiplier + inc, mod 2^128."""
    lo = sl * _MUL_LO
    hi = sh * _MUL_LO + sl * _MUL_HI + _mulhi(sl, _MUL_LO)
    lo2 = lo + il
    carry = _ONE if lo2 < lo else _ZERO
    return hi + ih + carry, lo2


@_jit
def _next64(st):
    """pcg64_next64 on st = [state hi, state lo, inc hi, inc lo]: step, then XSL-RR of the new state."""
    h, lo = _step(st[0], st[1], st[2], st[3])
    st[0] = h
    st[1] = lo
    x = h ^ lo
    r = h >> np.uint64(58)
    return (x >> r) | (x << ((np.uint64(64) - r) & np.uint64(63)))


@_jit
def _next_double(st):
    return np.float64(_next64(st) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@_jit
def _normal(st):
    """numpy's random_standard_normal (ziggurat)."""
    while True:
        r = _next64(st)
        idx = np.int64(r & np.uint64(0xFF))
        r = r >> np.uint64(8)
        sign = r & _ONE
        rabs = (r >> _ONE) & np.uint64(0x000FFFFFFFFFFFFF)
        x = np.float64(rabs) * WI[idx]
        if sign == _ONE:
            x = -x
        if rabs < KI[idx]:
            return x
        if idx == 0:
            while True:
                xx = -NOR_INV_R * np.log1p(-_next_double(st))
                yy = -np.log1p(-_next_double(st))
                if yy + yy > xx * xx:
                    if ((rabs >> np.uint64(8)) & _ONE) == _ONE:
                        return -(NOR_R + xx)
                    return NOR_R + xx
        else:
            if (FI[idx - 1] - FI[idx]) * _next_double(st) + FI[idx] < np.exp(-0.5 * x * x):
                return x


@_jit
def normals(states, out):
    """Row t of ``out`` gets out.shape[1] normals of the PCG64 seeded with states[t] (SeedSequence's four
    uint64 words: seed = (w0, w1), initseq = (w2, w3), high word first; pcg64_set_seed)."""
    st = np.empty(4, dtype=np.uint64)
    for t in range(states.shape[0]):
        ih = (states[t, 2] << _ONE) | (states[t, 3] >> np.uint64(63))  # inc = (initseq << 1) | 1
        il = (states[t, 3] << _ONE) | _ONE
        h, lo = _step(_ZERO, _ZERO, ih, il)  # srandom: state = 0, step, state += seed, step
        lo2 = lo + states[t, 1]
        carry = _ONE if lo2 < lo else _ZERO
        h = h + states[t, 0] + carry
        h, lo = _step(h, lo2, ih, il)
        st[0] = h
        st[1] = lo
        st[2] = ih
        st[3] = il
        for j in range(out.shape[1]):
            out[t, j] = _normal(st)
