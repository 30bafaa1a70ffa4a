"""A batch's Gaussian noise, drawn at once, bit for bit the per-query generators' (issue 21).

Each query's noise comes from its own generator, keyed by (run key, query index) (SPEC §5;
:func:`indknn_cli.engine.noise_generator`: numpy's ``PCG64(SeedSequence(entropy=run_key,
spawn_key=(index,)))``, ``standard_normal``). Building one such generator in Python costs ~20 µs, as much as
a GPU spends answering a query. The draws do not depend on budgets, so a batch's are drawn up front here,
with numpy's own algorithms:

- ``SeedSequence`` (``numpy/random/bit_generator.pyx``: ``hashmix``, ``mix``, ``mix_entropy``,
  ``generate_state``) in uint32 arithmetic, vectorised over the batch's query indices;
- ``PCG64``'s seeding and ``next64`` (``numpy/random/src/pcg64``: 128-bit LCG step with the default
  multiplier, XSL-RR output), and numpy's ziggurat ``random_standard_normal``
  (``numpy/random/src/distributions/distributions.c``) with numba's copy of numpy's tables
  (``numba.np.random._constants``, which numba keeps for its own numpy-identical generators), compiled.

Before the compiled draws are used, :func:`agrees_with_numpy` compares them with numpy's generators on
probe keys and indices (the ziggurat's rare tail and wedge paths included, by drawing enough); any
difference, or numba missing, leaves the caller on numpy's per-query generators (same numbers, slower).
tests/test_filter_jit.py pins the bits over many keys, indices and draws.
"""

from __future__ import annotations

import threading

import numpy as np

_M32 = 0xFFFFFFFF
INIT_A, MULT_A = 0x43B0D7E5, 0x931E8875
INIT_B, MULT_B = 0x8B51F9DD, 0x58F38DED
MIX_MULT_L, MIX_MULT_R = 0xCA01F9DD, 0x4973F715
XSHIFT = 16
POOL_SIZE = 4


def _words(value: int) -> list[int]:
    """numpy's ``_coerce_to_uint32_array`` of a non-negative int: 32-bit words, least significant first."""
    if value < 0:
        raise ValueError(f"run key must be non-negative, got {value!r}")
    out = []
    while True:
        out.append(value & _M32)
        value >>= 32
        if value == 0:
            return out


def seed_states(run_key: int, indices: np.ndarray) -> np.ndarray:
    """``SeedSequence(entropy=run_key, spawn_key=(i,)).generate_state(4, np.uint64)`` for each i (< 2^32), as an
    (n, 4) uint64 array."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() > _M32):
        raise ValueError("query indices must lie in [0, 2^32)")
    run = _words(int(run_key))
    if len(run) < POOL_SIZE:
        run = run + [0] * (POOL_SIZE - len(run))
    n = idx.size
    u32 = np.uint32
    entropy = [np.full(n, w, dtype=u32) for w in run] + [idx.astype(u32)]
    with np.errstate(over="ignore"):
        hash_const = [u32(INIT_A)]

        def hashmix(value):
            value = value ^ hash_const[0]
            hash_const[0] = u32(hash_const[0] * u32(MULT_A))
            value = value * hash_const[0]
            return value ^ (value >> u32(XSHIFT))

        def mix(x, y):
            r = u32(MIX_MULT_L) * x - u32(MIX_MULT_R) * y
            return r ^ (r >> u32(XSHIFT))

        mixer = [hashmix(entropy[i]) if i < len(entropy) else hashmix(np.zeros(n, u32)) for i in range(POOL_SIZE)]
        for i_src in range(POOL_SIZE):
            for i_dst in range(POOL_SIZE):
                if i_src != i_dst:
                    mixer[i_dst] = mix(mixer[i_dst], hashmix(mixer[i_src]))
        for i_src in range(POOL_SIZE, len(entropy)):
            for i_dst in range(POOL_SIZE):
                mixer[i_dst] = mix(mixer[i_dst], hashmix(entropy[i_src]))
        hc = u32(INIT_B)
        words = []
        for i_dst in range(8):
            v = mixer[i_dst % POOL_SIZE] ^ hc
            hc = u32(hc * u32(MULT_B))
            v = v * hc
            words.append(v ^ (v >> u32(XSHIFT)))
    lo = np.stack(words[0::2], axis=1).astype(np.uint64)
    hi = np.stack(words[1::2], axis=1).astype(np.uint64)
    return lo | (hi << np.uint64(32))


_lock = threading.Lock()
_kernels = None
_agrees: dict[int, bool] = {}


def _load():
    """The compiled kernels (:mod:`indknn_cli.noise_jit_kernels`), or None when numba cannot be imported."""
    global _kernels
    with _lock:
        if _kernels is None:
            try:
                from . import noise_jit_kernels

                _kernels = noise_jit_kernels
            except Exception:
                _kernels = False
        return _kernels or None


def _draw_compiled(run_key: int, first_index: int, m: int, count: int) -> np.ndarray:
    kernels = _load()
    states = seed_states(run_key, np.arange(first_index, first_index + m, dtype=np.int64))
    out = np.empty((m, count), dtype=np.float64)
    kernels.normals(states, out)
    return out


def draw_numpy(run_key: int, first_index: int, m: int, count: int) -> np.ndarray:
    """The reference: each query's generator (engine.noise_generator), ``count`` standard normals."""
    from .engine import noise_generator

    out = np.empty((m, count), dtype=np.float64)
    for t in range(m):
        out[t] = noise_generator(run_key, first_index + t).standard_normal(count)
    return out


def agrees_with_numpy(count: int) -> bool:
    """Whether the compiled draws equal numpy's generators here (probe keys, indices and 4,096 draws per
    generator, so the ziggurat's rare paths run); cached per ``count``. False where numba is missing."""
    with _lock:
        if count in _agrees:
            return _agrees[count]
    ok = False
    try:
        if _load() is not None:
            ok = True
            for key, first in ((0, 0), (1, 7), ((1 << 128) - 1, 1000), (0x1234 << 70, (1 << 32) - 3)):
                m = 3 if first + 3 <= (1 << 32) else 2
                if not np.array_equal(_draw_compiled(key, first, m, count).view(np.int64),
                                      draw_numpy(key, first, m, count).view(np.int64)):
                    ok = False
            long_key = 0x9E3779B97F4A7C15F39CC0605CEDC834
            if not np.array_equal(_draw_compiled(long_key, 5, 2, 4096).view(np.int64),
                                  draw_numpy(long_key, 5, 2, 4096).view(np.int64)):
                ok = False
    except Exception:
        ok = False
    with _lock:
        _agrees[count] = ok
    return ok


def draw(run_key: int, first_index: int, m: int, count: int) -> np.ndarray:
    """(m, count) standard normals: row t is ``noise_generator(run_key, first_index + t).standard_normal(count)``,
    the compiled way where it agrees with numpy here, else numpy's."""
    if m and first_index + m - 1 <= _M32 and agrees_with_numpy(count):
        try:
            return _draw_compiled(run_key, first_index, m, count)
        except Exception:
            pass
    return draw_numpy(run_key, first_index, m, count)
