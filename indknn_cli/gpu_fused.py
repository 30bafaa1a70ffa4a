"""The GPU candidate phase in two fused kernels (issue 21): no score matrix, one synchronisation per pass.

:mod:`indknn_cli.gpu_screen` screens with ``torch.mm`` (an fp16 score matrix of queries × rows written to the
device's memory), then compares, counts and ``nonzero``-s it, step by step, and recomputes κ of the passed
pairs in float64 with some thirty elementwise launches. On an H200 that was 176 ms of a 16,384-query pass
against 1,000,000 rows for the screen and 48 ms for the recompute (`bench/gpu_profile.py`, 2026-11-27), where
the bare product takes 23 ms. Here, when Triton is installed and the store's rows are on the device:

1. **Screen** (``gpu_fused_kernels.screen``). Each tile of the product (fp16 inputs rounded as
   gpu_screen's, fp32 accumulation on the tensor cores) compares its fp32 scores with the level in
   registers and appends its passing (query, row) pairs, and only those, to two arrays of a fixed size
   ``max_pass`` (a public figure: the caller's pair bound) through one int64 counter. The counter counts
   every passing pair, stored or not: more than ``max_pass`` raises TooManyPairs (the caller halves the
   batch; the same answers), so the device holds no more than the bound, whatever the private data.
   The level is the largest float32 ≤ s − 1.25·M, M = :func:`gpu_screen.fp16_screen_margin` (inputs'
   rounding and the accumulation; the scores are not rounded to fp16 here). What M assumes of the kernel's
   accumulation is checked on the device before first use (:func:`_probe`), as gpu_screen does for torch's.
2. **Recompute** (``gpu_fused_kernels.leaf_sums``). One kernel reads each passed pair's float32 rows and
   takes the float64 terms and numpy's running sums of each leaf of numpy's pairwise summation
   (``exact_jit.pairwise_plan``), launched with floating-point contraction off, so every product and sum
   is rounded on its own as numpy's are; :func:`gpu_screen.leaf_tree` adds the leaves in the plan's order.
   Only plans of equal leaves that are multiples of 8 long (d = 384, 768, …) take it.

The pairs come out in the order the tiles finished (atomics), then are tested against τ and sorted by
query and row (:meth:`gpu_screen.GpuScreen.collect`), so the candidates and κ are gpu_screen's and the
CPU's, bit for bit (tests/test_gpu_fused.py in Triton's interpreter, tests/test_cuda.py on a GPU). A
device, d or store this path does not take (no Triton, rows not resident, a failed probe, a compile error
at the first launch) stays on gpu_screen's path, with the same answers.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np

from . import gpu_screen

BM, BN, BK, WARPS, STAGES = 128, 128, 64, 8, 3
#: Pairs per program of the recompute.
BP = 64
#: CUDA's limit on a grid's second dimension (the row tiles of one launch).
MAX_GRID_Y = 65535
#: Device bytes of one launch's fp16 copy of rows.
LAUNCH_BYTES = 1 << 30

#: Largest pair bound of one pass: positions and the arrays' length stay int32 (a larger bound is clamped to
#: it; more passing pairs than that raise TooManyPairs, the batch halves, the same answers).
MAX_CAP = 2**31 - 1

_lock = threading.Lock()
_usable: dict[tuple[str, int], bool] = {}
#: Held while a kernel is launched (and, the first time, compiled): the pass screened ahead and a part screening
#: itself may launch at once, and Triton's compile is not known to be safe from two threads (review 17).
_launch_lock = threading.Lock()


def _kernels():
    from . import gpu_fused_kernels

    return gpu_fused_kernels


def wanted(dev) -> bool:
    """Whether to try this path on ``dev``: a CUDA device, Triton importable, ``INDKNN_GPU_FUSED`` not "0"."""
    if getattr(dev, "type", None) != "cuda" or os.environ.get("INDKNN_GPU_FUSED", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def leaf_shape(dim: int) -> tuple[int, int] | None:
    """(leaf length, leaves) when numpy's plan for ``dim`` terms is equal leaves, multiples of 8, tiling the
    row in order; else None."""
    plan = gpu_screen.pairwise_plan(dim)
    n = gpu_screen._uniform_leaves(plan)
    if n is None or n % 8:
        return None
    return n, int((plan[:, 0] >= 0).sum())


def usable(dev, dim: int) -> bool:
    """Whether both kernels run on ``dev`` at width ``dim`` as the path assumes (:func:`_probe`; cached)."""
    key = (str(dev), int(dim))
    with _lock:
        if key not in _usable:
            try:
                _usable[key] = leaf_shape(dim) is not None and _probe(dev, dim)
            except Exception:  # a compile or launch failure: gpu_screen's path gives the same candidates
                _usable[key] = False
        return _usable[key]


def _launch_screen(q16, x16, *, row0: int, level: float, mask, out_q, out_r, count, cap: int, scores=False):
    k = _kernels()
    m, d = q16.shape
    n = x16.shape[0]
    grid = (triton_cdiv(m, BM), triton_cdiv(n, BN))
    with _launch_lock:
        k.screen[grid](q16, x16, mask if mask is not None else count, m, n, row0, level, out_q, out_r, count, cap,
                       D=d, HAS_MASK=mask is not None, SCORES=scores, BM=BM, BN=BN, BK=BK,
                       num_warps=WARPS, num_stages=STAGES, enable_fp_fusion=False)


def triton_cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def leaf_pair_sums(x_t, ri, q_t, qi, *, kernel: str, plan: np.ndarray):
    """:func:`gpu_screen.pair_sums` in one kernel: the float64 sums of the pairs (x_t[ri], q_t[qi]) in numpy's
    order, bit for bit (``ri``, ``qi`` int32 or int64 device tensors; x_t, q_t float32, contiguous)."""
    import torch

    d = x_t.shape[1]
    leaf, leaves = leaf_shape(d)
    p = int(ri.shape[0])
    out = torch.empty((p, leaves), dtype=torch.float64, device=x_t.device)
    if p:
        with _launch_lock:
            _kernels().leaf_sums[(triton_cdiv(p, BP),)](x_t, q_t, ri, qi, p, out, D=d, LEAF=leaf, NLEAF=leaves,
                                                         RBF=kernel != "cosine", BP=BP, enable_fp_fusion=False)
    return gpu_screen.leaf_tree(out, plan)


def fused_level(gs) -> float:
    """The level the fused screen compares fp32 scores with: the largest float32 ≤ s − SAFETY·M."""
    return gpu_screen._round_down_f32(gs.threshold - gpu_screen.SAFETY * gs.fp16_margin)


def find_pass(gs, x_t, *, max_pass: int):
    """(qi, rows, sums) device tensors of the pairs of ``gs``'s queries and the resident rows ``x_t`` (row 0
    first) with κ ≥ τ (RBF: the sums' conservative limit; κ is the host's in collect), unsorted; TooManyPairs
    when more than ``max_pass`` pairs pass the screen (nothing past it is kept)."""
    import torch

    from .candidates import TooManyPairs

    if x_t.dtype != torch.float32 or not x_t.is_contiguous():
        raise TypeError(f"find_pass needs contiguous float32 rows, got {x_t.dtype}")
    dev = gs.dev
    cap = max(1, min(int(max_pass), MAX_CAP))
    out_q = torch.empty(cap, dtype=torch.int32, device=dev)
    out_r = torch.empty(cap, dtype=torch.int32, device=dev)
    count = torch.zeros(1, dtype=torch.int64, device=dev)
    mask = None if gs.mask_t is None else gs.mask_t.view(torch.uint8)
    level = fused_level(gs)
    rows_per_launch = min(MAX_GRID_Y * BN, max(BN, LAUNCH_BYTES // (2 * gs.dim)))
    for lo in range(0, x_t.shape[0], rows_per_launch):
        x16 = x_t[lo:lo + rows_per_launch].to(torch.float16).contiguous()
        _launch_screen(gs.q_s, x16, row0=lo, level=level, mask=mask, out_q=out_q, out_r=out_r, count=count,
                       cap=cap)
        del x16
    total = int(count.item())
    if total > cap:
        raise TooManyPairs()
    qi, rows = out_q[:total], out_r[:total]
    if gs.before_t is not None:
        keep = rows.long() < gs.before_t[qi.long()]
        qi, rows = qi[keep], rows[keep]
    # The recompute in gpu_screen's slices (RECOMPUTE_BYTES of device memory each): the float64 leaf sums are held
    # for one slice at a time, whatever the pairs passed (review 17).
    return gs.exact_pairs(x_t, qi, rows, 0, sums_of=leaf_pair_sums)


def _probe(dev, dim: int) -> bool:
    """The kernels on ``dev`` do what the path assumes: every fp32 score of unit vectors (a quarter with products
    of one sign, components in fp16's subnormal range) within γ·Σ|x̃q̃| of the exact sum of the fp16-rounded
    products (gpu_screen's bound on the accumulation); the pairs appended are exactly those whose score reaches
    the level, once each; the leaf sums are gpu_screen.pair_sums's bits, cosine and RBF."""
    import torch

    if not gpu_screen.fp16_usable(dev, dim):  # the fp16 rounding of the inputs (and torch's product) checked
        return False
    rng = np.random.default_rng(7)
    rows, queries = 520, 130
    x = rng.standard_normal((rows, dim))
    q = rng.standard_normal((queries, dim))
    x[: rows // 4] = np.abs(x[: rows // 4])
    q[: queries // 4] = np.abs(q[: queries // 4])
    x[rows // 4: rows // 2, ::3] *= 1e-4
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    x32 = torch.from_numpy(x.astype(np.float32)).to(dev)
    q32 = torch.from_numpy(q.astype(np.float32)).to(dev)
    x16, q16 = x32.to(torch.float16), q32.to(torch.float16)
    scores = torch.empty((queries, rows), dtype=torch.float32, device=dev)
    count = torch.zeros(1, dtype=torch.int64, device=dev)
    _launch_screen(q16, x16, row0=0, level=0.0, mask=None, out_q=scores, out_r=scores, count=count, cap=0,
                   scores=True)
    xr, qr = x16.double().cpu().numpy(), q16.double().cpu().numpy()
    exact = qr @ xr.T
    absum = np.abs(qr) @ np.abs(xr).T
    gamma = dim * gpu_screen.U_ACC / (1.0 - dim * gpu_screen.U_ACC)
    got = scores.double().cpu().numpy()
    if not (np.all(np.isfinite(got)) and np.all(np.abs(got - exact) <= gamma * absum + 1e-12)):
        return False
    # The pairs: a level with a few percent of the scores above it, against the scores the kernel computed.
    level = float(np.float32(np.quantile(got, 0.97)))
    cap = queries * rows
    out_q = torch.empty(cap, dtype=torch.int32, device=dev)
    out_r = torch.empty(cap, dtype=torch.int32, device=dev)
    count.zero_()
    _launch_screen(q16, x16, row0=0, level=level, mask=None, out_q=out_q, out_r=out_r, count=count, cap=cap)
    if not _same_pairs(out_q, out_r, count, np.argwhere(got >= level)):
        return False
    # With a row mask (the variant serve-queries launches), the rows in two launches (the second from row 333:
    # row0 > 0 offsets both the mask and the rows written).
    keep = np.arange(rows) % 3 != 1
    mask_t = torch.from_numpy(keep.astype(np.uint8)).to(dev)
    count.zero_()
    for lo, hi in ((0, 333), (333, rows)):
        _launch_screen(q16, x16[lo:hi].contiguous(), row0=lo, level=level, mask=mask_t, out_q=out_q, out_r=out_r,
                       count=count, cap=cap)
    if not _same_pairs(out_q, out_r, count, np.argwhere((got >= level) & keep[None, :])):
        return False
    ri = torch.from_numpy(rng.integers(0, rows, 4093).astype(np.int32)).to(dev)  # a last program part empty
    qi = torch.from_numpy(rng.integers(0, queries, 4093).astype(np.int32)).to(dev)
    plan = gpu_screen.pairwise_plan(dim)
    for kernel in ("cosine", "rbf"):
        a = leaf_pair_sums(x32, ri, q32, qi, kernel=kernel, plan=plan).cpu().numpy()
        b = gpu_screen.pair_sums(x32, ri.long(), q32, qi.long(), kernel=kernel, plan=plan).cpu().numpy()
        if not np.array_equal(a.view(np.int64), b.view(np.int64)):
            return False
    return bool(math.isfinite(level))


def _same_pairs(out_q, out_r, count, want: np.ndarray) -> bool:
    total = int(count.item())
    pairs = np.stack([out_q[:total].cpu().numpy(), out_r[:total].cpu().numpy()], axis=1).astype(np.int64)
    return total == len(want) and np.array_equal(pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))], want)


def mark_unusable(dev, dim: int) -> None:
    """After a failure of the fused path on ``dev`` (a compile error of a later variant, say): gpu_screen's path
    for the rest of the process."""
    with _lock:
        _usable[(str(dev), int(dim))] = False
