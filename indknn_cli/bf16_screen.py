"""The bfloat16 screen: the candidate phase's product in bf16 on CPUs that multiply bf16 in hardware (issue 21).

The candidate phase (:func:`indknn_cli.candidates.find_candidates`) needs, per query, a superset of the rows
whose dot product with it reaches the threshold s (κ ≥ τ ⟺ x·q ≥ s for unit vectors), and then recomputes
κ of every pair in that superset exactly in float64. Which superset the screen passes changes only how many
pairs are recomputed, never a candidate or an answer. On a CPU with AMX-BF16 or AVX512-BF16 a bf16 product
with fp32 accumulation runs several times faster than the fp32 one (``indknn bench serve-speed`` prints
both, ``bf16_matmul``), so the screen multiplies the queries and rows rounded to bf16 and keeps every pair
whose bf16 score is within a rigorous margin of s.

The margin (a bound on |ŝ − x·q|, ŝ the bf16 score, x·q the exact real dot product of the float32 vectors).
Let u = 2^-8 (bf16's unit roundoff: 8 significant bits, round to nearest even), u' = 2^-24 (fp32's),
γ_d = d·u'/(1 − d·u'), B = ‖x‖·‖q‖.
1. Rounding the inputs: x̃_i = x_i(1 + α_i), q̃_i = q_i(1 + β_i), |α_i|, |β_i| ≤ u, so
   |x̃_i q̃_i − x_i q_i| ≤ (2u + u²)|x_i q_i| and Σ_i |x_i q_i| ≤ B (Cauchy–Schwarz).
2. The products x̃_i q̃_i have 16 significant bits and are exact in fp32; their fp32 sum in any order
   (any blocking of the product) is within γ_d·Σ|x̃_i q̃_i| ≤ γ_d(1 + u)²B of their exact sum (Higham,
   *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1, eq. 3.5).
   Subnormals flushed to zero (AMX does) add at most 2d·2^-126, absorbed in a constant 2^-100.
   Steps 1–2: A = (2u + u²)B + γ_d(1 + u)²B + 2^-100.
3. Rounding the fp32 sum S to the bf16 output: |ŝ − S| ≤ u|S| ≤ u(|x·q| + A) ≤ u(B + A).
So |ŝ − x·q| ≤ (1 + u)A + uB =: M (about 3u·B = 0.0118 for unit vectors; :func:`bf16_screen_margin`), and a
pair with x·q ≥ s has ŝ ≥ s − M. The screen keeps ŝ ≥ s − 1.25·M (the factor leaves room for one more
rounding than assumed), compared against the largest bf16 value not above it. The rows are unit vectors
(the store holds them L2-normalised in float32, ``store.normalize_rows``; the fp32 screen's margin assumes
the same), ‖x‖ within ~d·2^-24 of 1; ‖q‖ is the batch's largest query norm, computed in float64; each is
raised by 2^-10, so B = (1 + 2^-10)²·max ‖q‖.

What the bound assumes of the library is checked on this machine before the screen is first used
(:func:`_probe`): that fp32 → bf16 rounds to nearest even (65,536 bit patterns, a quarter of them exact
ties), and that every score of two products (256 rows × 64 queries on the calling thread; 1,041 × 512 on
a worker of the screen's pool, which multiplies on one thread and may take other kernels), a quarter of
them with products of one sign, lies within γ_d·Σ|x̃q̃| + u|S| of the exact sum of the rounded inputs'
products (fp32 accumulation, one rounding at the end). A library that fails leaves every batch on FAISS's
fp32 screen. Queries longer than MAX_QUERY_NORM (2; serve-queries sends unit vectors) are left to it too.
The scores are scanned by :mod:`indknn_cli.bf16_scan_kernels` (numba) as int16 bit patterns, or by numpy
where numba is missing: the same pairs either way (a failed compile falls back to numpy too). The margin band passes several times the candidates, so
each passed pair then takes the fp32 screen's own test (its fp32 dot product, any summation order, against
the threshold less ``candidates.screening_margin``; :meth:`Bf16Screen._refine`) before the exact recompute:
a superset of the candidates still, about as many pairs as FAISS's screen passes (numba's and numpy's fp32
dots add in different orders and may pass slightly different supersets; the candidates are the same).

Used by the CPU screen when the CPU has the instructions (or ``INDKNN_SCREEN=bf16``; ``INDKNN_SCREEN=fp32``
turns it off) and a batch is large enough to repay torch's import (:func:`rule`: the batch size, the number
of rows stored and d, public figures; :func:`prepare` lets serve-queries judge by the run's query count).
tests/test_bf16_screen.py pins that the candidates equal the fp32 screen's and brute force's on data placed
at the threshold, on rounding that runs one way (lost without the margin), across many tiles and workers,
and for queries far from unit length; and a whole serve's answers and ledger under either screen.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading

import numpy as np

from .faiss_screen import _passive_openmp, cpu_flags
from .threads import ProcessPool, usable_cores

U_BF16 = 2.0**-8
U_FP32 = 2.0**-24
#: Absorbs flushed subnormals (≤ 2d·2^-126 for any d this tool accepts).
TINY = 2.0**-100
#: The screen keeps pairs with ŝ ≥ s − SAFETY·M.
SAFETY = 1.25
#: Each norm is raised by this factor before it enters B (module docstring).
NORM_SLACK = 1.0 + 2.0**-10

#: Batches below these sizes stay on FAISS's fp32 screen. Whether a batch takes the bf16 screen, and torch's import
#: (1.4–1.7 s here), are decided on public figures only: a run (serve-queries: all its queries) or a batch of at
#: least BF16_COLD_QUERIES queries, in batches of at least BF16_MIN_QUERIES, on a CPU with bf16 instructions.
#: Never on the number of rows stored, which one record moves: a rule on queries × rows × d put the import's
#: 1.35 s at 17,896 rows (audit 10, F2), and once torch was loaded, FAISS's import (0.4 s) at the row count where
#: the rule changed screens (review 27). A small store then takes the bf16 screen for large batches too (its
#: products are cheap either way). The figures never read which rows lie near a query.
BF16_MIN_QUERIES = 256
BF16_COLD_QUERIES = 2048

#: Bytes of bf16 scores per product (rows × queries × 2): small enough to be scanned from cache.
TILE_BYTES = 4 << 20
#: Pairs the scan's first buffers hold (they grow when a tile passes more).
SCAN_BUFFER = 1 << 14
#: Pairs per numpy fp32 dot call where numba is missing (bounds its gathered copies: 2 × 65,536 × d floats).
REFINE_SLICE = 1 << 16
#: Queries longer than this are left to the fp32 screen (the bound holds, but bf16's range and the scan
#: are made for unit vectors; serve-queries sends unit vectors).
MAX_QUERY_NORM = 2.0


def bf16_screen_margin(*, dim: int, norm_product: float) -> float:
    """M: a bound on |bf16 score − exact x·q| for ‖x‖·‖q‖ ≤ ``norm_product`` (module docstring, steps 1–3)."""
    if not isinstance(dim, int) or dim < 1 or dim * U_FP32 >= 0.5:
        raise ValueError(f"dim must be an integer in [1, 2^23), got {dim!r}")
    if not (math.isfinite(norm_product) and norm_product >= 0.0):
        raise ValueError(f"norm_product must be finite and ≥ 0, got {norm_product!r}")
    u, b = U_BF16, float(norm_product)
    gamma = dim * U_FP32 / (1.0 - dim * U_FP32)
    a = (2.0 * u + u * u) * b + gamma * (1.0 + u) ** 2 * b + TINY
    return (1.0 + u) * a + u * b


SETTINGS = ("auto", "bf16", "fp32")


def _setting() -> str:
    return os.environ.get("INDKNN_SCREEN", "").strip().lower()


def _mode() -> str:
    raw = _setting()
    return raw if raw in ("bf16", "fp32") else "auto"  # anything else: auto (a setting never raises mid-serve)


def check_setting() -> None:
    """Refuse an ``INDKNN_SCREEN`` that is not blank, ``auto``, ``bf16`` or ``fp32`` (a misspelt ``fp23`` would
    otherwise leave the screen on "auto" without a word). Called by ``serve-queries`` before anything is read or
    written; :func:`_mode` itself stays forgiving, so a setting never raises mid-serve."""
    raw = _setting()
    if raw and raw not in SETTINGS:
        raise ValueError(f"INDKNN_SCREEN must be one of {', '.join(SETTINGS)} (or unset), "
                         f"got {os.environ['INDKNN_SCREEN']!r}")


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (Linux feature flags amx_bf16 or avx512_bf16); read once
    per process (every batch asks)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def rule(m: int, *, torch_loaded: bool) -> bool:
    """The size and setting rule of :func:`wanted`, without the probe: ``INDKNN_SCREEN`` forces the screen
    on or off; by default :func:`loads`. No row count is read: a choice between the two screens by queries × rows
    × d put a step in time (FAISS's import, 0.4 s) at one exact row count (review 27)."""
    mode = _mode()
    if mode != "auto":
        return mode == "bf16"
    return loads(m, torch_loaded=torch_loaded)


def loads(m: int, *, torch_loaded: bool) -> bool:
    """Whether a batch (or a run) of ``m`` queries may use the screen at all, torch's import included: public
    figures only (the query count, the CPU), never the rows stored (audit 10, F2)."""
    return m >= BF16_MIN_QUERIES and (torch_loaded or m >= BF16_COLD_QUERIES) and cpu_has_bf16()


def wanted(m: int, *, dim: int) -> bool:
    """Whether a batch of ``m`` queries takes the bf16 screen: :func:`rule`, and the library passes the probe
    (:func:`_probe`, which imports torch). Both read the query count only: whether torch is imported and which
    screen is taken do not depend on the number of rows."""
    return rule(m, torch_loaded="torch" in sys.modules) and _probe(dim)


def prepare(total_queries: int, *, dim: int, batch: int) -> bool:
    """At a run's start: load torch and run the probe when the run's queries in all (not one batch) reach
    BF16_COLD_QUERIES in batches of at least BF16_MIN_QUERIES (:func:`run_rule`): serve-queries, 20,000 queries
    in batches of 1,024. Whether torch was loaded for the screen (each batch of BF16_MIN_QUERIES or more then takes it).
    Public figures only: the run's query count, its batch size and d; never the rows stored (audit 10, F2)."""
    return run_rule(total_queries, batch=batch) and _probe(dim)


def run_rule(total_queries: int, *, batch: int) -> bool:
    """The size and setting rule of :func:`prepare`, without the probe."""
    mode = _mode()
    if mode != "auto":
        return mode == "bf16"
    return loads(total_queries, torch_loaded=False) and min(batch, total_queries) >= BF16_MIN_QUERIES


_lock = threading.Lock()
_probed: dict[int, bool] = {}


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _import_torch():
    _passive_openmp("torch")
    import torch

    return torch


def _probe(dim: int) -> bool:
    """Whether torch's bf16 conversion and product on this machine do what the bound assumes at width ``dim``
    (:func:`_probe_once`). Cached per width; any failure means no (FAISS's screen)."""
    with _lock:
        if dim not in _probed:
            try:
                _probed[dim] = _probe_once(dim)
            except Exception:  # torch missing or broken: the fp32 screen gives the same candidates
                _probed[dim] = False
        return _probed[dim]


def _probe_once(dim: int) -> bool:
    """Step 1 (fp32 → bf16 rounds to nearest even) on bit patterns with ties, and steps 2–3 on products
    of two shapes, one on the calling thread and one (a screen's tile of many queries and a short tail)
    on a worker of the screen's pool, whose one-thread products may take other kernels."""
    torch = _import_torch()
    if not _conversion_rounds_to_nearest_even(torch):
        return False
    if not _product_within_bound(torch, dim, rows=256, queries=64, seed=1):
        return False
    pool = _pool.get(usable_cores())[0]
    return bool(pool.submit(_product_within_bound, torch, dim, rows=1041, queries=512, seed=2).result())


def _conversion_rounds_to_nearest_even(torch) -> bool:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    bits[::4] = (bits[::4] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exact ties
    bits = bits[(bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)]  # finite only
    bits = bits[((bits & np.uint32(0x7FFFFFFF)) + np.uint32(0x8000)) < np.uint32(0x7F7F8000)]  # no overflow to inf
    want = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    got = torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return bool(np.array_equal(got, want))


def _product_within_bound(torch, dim: int, *, rows: int, queries: int, seed: int) -> bool:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((queries, dim))
    x = np.concatenate([rng.standard_normal((rows - rows // 4, dim)), np.abs(rng.standard_normal((rows // 4, dim)))])
    q[: queries // 4] = np.abs(q[: queries // 4])  # same-sign products: the largest sums
    x[-1] = 1.0
    q[-1] = 1.0
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    qb = torch.from_numpy(q.astype(np.float32)).to(torch.bfloat16)
    xb = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    s = torch.mm(xb, qb.T)
    if s.dtype != torch.bfloat16 or tuple(s.shape) != (x.shape[0], q.shape[0]):
        return False
    xr, qr = xb.to(torch.float64).numpy(), qb.to(torch.float64).numpy()
    exact = xr @ qr.T  # products of bf16 values are exact in float64; the sums' error is ~1e-16
    absum = np.abs(xr) @ np.abs(qr).T
    gamma = dim * U_FP32 / (1.0 - dim * U_FP32)
    bound = gamma * absum + U_BF16 * (np.abs(exact) + gamma * absum) + 1e-12
    got = s.to(torch.float64).numpy()
    return bool(np.all(np.isfinite(got)) and np.all(np.abs(got - exact) <= bound))


def _round_down_bf16(value: float, torch) -> int:
    """int16 bit pattern of the largest bf16 value ≤ ``value`` (finite)."""
    b = torch.tensor([value], dtype=torch.float32).to(torch.bfloat16)
    while float(b.to(torch.float64)) > value:  # round to nearest went up: one step toward −∞
        bits = int(b.view(torch.int16).item())
        bits = bits - 1 if bits > 0 else (bits + 1 if bits < 0 else -32767)  # +0 → the smallest negative
        b = torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16)
    return int(b.view(torch.int16).item())


def _order_key(bits: int) -> int:
    """The scan's order key of a bf16 bit pattern (int16): v for v ≥ 0, −(v + 32768) for v < 0."""
    return bits if bits >= 0 else -(bits + 32768)


_compiled = None


def _kernels():
    """:mod:`indknn_cli.bf16_scan_kernels` (numba), or None where numba cannot be imported (numpy then)."""
    global _compiled
    with _lock:
        if _compiled is None:
            try:
                from . import bf16_scan_kernels

                _compiled = bf16_scan_kernels
            except Exception:
                _compiled = False
        return _compiled or None


def _scan_kernel():
    """numba's scan, or None (numpy's scan then: the same pairs)."""
    kernels = _kernels()
    return kernels.scan_ge if kernels else None


def _refine_kernel():
    """numba's fp32 pair dots, or None (numpy's einsum then)."""
    kernels = _kernels()
    return kernels.dots_at_least if kernels else None


def _round_down_f32(value: float) -> float:
    """The largest float32 value ≤ ``value``: comparing an fp32 dot with it keeps every dot ≥ ``value``."""
    f = np.float32(value)
    return float(f if float(f) <= value else np.nextafter(f, np.float32(-np.inf)))


def _scan_numpy(s: np.ndarray, key_t: int, ordered: bool) -> tuple[np.ndarray, np.ndarray]:
    """The same pairs as the compiled scan: (query, row) with key ≥ ``key_t``, in row order."""
    if ordered:
        hit = s >= key_t
    else:
        v = s.astype(np.int32)
        hit = np.where(v >= 0, v, -(v + 32768)) >= key_t
    ri, qi = np.nonzero(hit)
    return qi.astype(np.int64), ri.astype(np.int64)


def _one_torch_thread() -> None:
    """This worker's products on one thread (the workers share the cores). ATen sets a thread up on its
    first call (applying any process-wide ``torch.set_num_threads``), so that comes first; then this
    thread's own OpenMP setting (threadpoolctl: ``omp_set_num_threads`` is per thread), leaving torch's
    process-wide default, the caller's threads and threads started later as they were."""
    _import_torch().get_num_threads()
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="openmp")


_pool = ProcessPool("indknn-bf16", initializer=_one_torch_thread)


class Bf16Screen:
    """The queries of one batch rounded to bf16, screened against chunks of rows (:meth:`pairs`)."""

    def __init__(self, queries: np.ndarray, threshold: float, *, fp32_level: float | None = None):
        self._torch = torch = _import_torch()
        self._q32 = np.ascontiguousarray(queries, dtype=np.float32)
        self.fp32_level = fp32_level
        q = torch.from_numpy(self._q32)
        self.m, self.dim = int(q.shape[0]), int(q.shape[1])
        self.threshold = float(threshold)
        self._q = q.to(torch.bfloat16)
        # B = ‖x‖·‖q‖ ≤ NORM_SLACK² · max ‖q‖ (rows are unit vectors, see the module docstring); the norm
        # in float64 (no underflow or overflow for float32 values). Queries over MAX_QUERY_NORM (serve-queries
        # sends unit vectors) are not screened here: usable is False and the caller takes the fp32 screen.
        q32 = q.numpy()
        q_norm = math.sqrt(float(np.einsum("ij,ij->i", q32, q32, dtype=np.float64).max())) if self.m else 0.0
        self.usable = math.isfinite(q_norm) and q_norm <= MAX_QUERY_NORM
        if not self.usable:
            return
        self.margin = SAFETY * bf16_screen_margin(dim=self.dim, norm_product=NORM_SLACK * NORM_SLACK * q_norm)
        t_bits = _round_down_bf16(self.threshold - self.margin, torch)
        self._ordered = t_bits > 0  # a positive level: int16 order is the scores' order among passers
        self._key_t = t_bits if self._ordered else _order_key(t_bits)
        self._tile_rows = max(16, TILE_BYTES // (2 * max(self.m, 1)))
        self._scan = _scan_kernel()
        self._workers = usable_cores()

    def pairs(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query, row) pairs of ``block`` (float32 rows) whose bf16 score is within SAFETY·M of the
        threshold or above, grouped by row in row order: a superset of the pairs with x·q ≥ threshold.

        The tiles are cut into contiguous runs, one per core, each run's products on one torch thread and
        its scan beside them (a scan on one thread after each two-thread product left a core idle: 0.46–0.53 s
        against 0.64–0.83 s for 2,048 queries × 262,144 rows, d = 384, in a scratch measurement on the
        2-core Xeon); the runs' pairs are joined in row order."""
        torch = self._torch
        x32 = np.ascontiguousarray(block, dtype=np.float32)
        xb = torch.from_numpy(x32).to(torch.bfloat16)
        starts = list(range(0, xb.shape[0], self._tile_rows))
        k = min(self._workers, len(starts))
        if k <= 1:
            return self._run(x32, xb, starts)
        cuts = np.linspace(0, len(starts), k + 1).astype(np.int64).tolist()
        pool = _pool.get(self._workers)[0]
        futures = [pool.submit(self._run, x32, xb, starts[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        parts = [f.result() for f in futures]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _run(self, x32: np.ndarray, xb, starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The pairs of the tiles starting at ``starts`` (consecutive), in row order."""
        torch = self._torch
        parts_q, parts_r = [], []
        buf = (np.empty(SCAN_BUFFER, np.int32), np.empty(SCAN_BUFFER, np.int32))
        for a in starts:
            s = torch.mm(xb[a:a + self._tile_rows], self._q.T).view(torch.int16).numpy()
            (qi, ri), buf = self._scan_tile(s, buf)
            if qi.size and self.fp32_level is not None:
                qi, ri = self._refine(x32, qi, ri + a)
                ri -= a
            if qi.size:
                parts_q.append(qi)
                parts_r.append(ri + a)
        if not parts_q:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(parts_q), np.concatenate(parts_r)

    def _refine(self, x32: np.ndarray, qi: np.ndarray, ri: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pairs whose fp32 dot product (any summation order) reaches ``fp32_level``: the fp32 screen's own
        test (its level is the threshold less ``candidates.screening_margin``), applied to the bf16 screen's
        pairs. The margin band passes several times the candidates (at 50,000 × 768, 957 pairs per query
        against 234 candidates), and an fp32 dot costs a fraction of the exact float64 recompute each would
        otherwise take; what passes is a superset of the candidates, as the fp32 screen's is."""
        keep = np.empty(qi.size, dtype=np.bool_)
        level = np.float32(_round_down_f32(self.fp32_level))
        dots = _refine_kernel()
        try:
            if dots is None:
                raise RuntimeError("numba missing")
            dots(x32, ri, self._q32, qi, level, keep)
        except Exception:  # no numba, or its compile failed: numpy's fp32 dots (another order, also a superset)
            for lo in range(0, qi.size, REFINE_SLICE):  # gathered copies of at most REFINE_SLICE pairs
                sl = slice(lo, lo + REFINE_SLICE)
                np.greater_equal(np.einsum("ij,ij->i", x32[ri[sl]], self._q32[qi[sl]]), level, out=keep[sl])
        return qi[keep], ri[keep]

    def _scan_tile(self, s: np.ndarray, buf):
        """The tile's pairs and the (possibly grown) scan buffers."""
        if self._scan is None:
            return _scan_numpy(s, self._key_t, self._ordered), buf
        try:
            n = self._scan(s, self._key_t, self._ordered, buf[0], buf[1])
            if n > buf[0].size:  # the buffers were short: grow them and scan the tile again
                buf = (np.empty(max(n, 2 * buf[0].size), np.int32), np.empty(max(n, 2 * buf[0].size), np.int32))
                n = self._scan(s, self._key_t, self._ordered, buf[0], buf[1])
        except Exception:  # numba's compile failed on first use: numpy's scan gives the same pairs
            return _scan_numpy(s, self._key_t, self._ordered), buf
        return (buf[0][:n].astype(np.int64), buf[1][:n].astype(np.int64)), buf
