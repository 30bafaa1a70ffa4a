"""The candidate phase on a CUDA GPU (issue 21): an fp16 screen and the exact float64 recompute, on the device.

:func:`indknn_cli.candidates.find_candidates` needs, per query, the rows with κ(x, q) ≥ τ and κ in float64
exactly as numpy computes it on the CPU (so answers are bit for bit the same on any device). On a GPU:

1. **Screen.** The queries and rows rounded to fp16 are multiplied on the tensor cores (fp32 accumulation,
   fp16 scores) and every pair whose score reaches the threshold s less a rigorous margin is kept
   (:func:`fp16_screen_margin`). Which superset the screen passes changes only how many pairs step 2
   recomputes, never a candidate.
2. **Recompute.** κ of every kept pair is recomputed in float64 on the device in numpy's order
   (:func:`numpy_order_sums`: the float64 products of the float32 values, exact, summed by numpy's
   pairwise summation as :mod:`indknn_cli.exact_jit` does on the CPU), tested against τ, and only the
   candidates (query, row, κ) come back to the host, sorted by query then row.

The margin (a bound on |ŝ − x·q|, ŝ the fp32 sum of the fp16-rounded products before the output's rounding).
Let u = 2^-11 (fp16's unit roundoff for normal values), σ = 2^-25 (half the spacing of fp16's subnormals: a
component below 2^-14 is rounded with an absolute error ≤ σ), B = ‖x‖·‖q‖.
1. Rounding the inputs: |x̃_i| ≤ (1 + u)|x_i| + σ, |x̃_i − x_i| ≤ u|x_i| + σ, likewise for q, so
   Σ_i |x̃_i q̃_i − x_i q_i| ≤ E1 := (2u + u²)B + σ(1 + u)√d(‖x‖ + ‖q‖) + dσ² (Cauchy–Schwarz; ‖·‖₁ ≤ √d‖·‖).
2. The products x̃_i q̃_i (11 × 11 significant bits) are exact in fp32. Their sum by the tensor cores is not
   specified as IEEE fp32 (the order, the blocking and the rounding of the accumulator are the hardware's);
   the bound takes any order with a relative error of at most u_acc = 2^-20 per addition (16 times fp32's
   unit roundoff), γ = d·u_acc/(1 − d·u_acc), so the error is ≤ E2 := γ·Σ|x̃_i q̃_i| ≤ γ(B + E1) (Higham,
   *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5).
3. The fp16 output is a monotone rounding of ŝ: comparing it with a level that fp16 represents exactly and
   that is ≤ s − M keeps every pair with ŝ ≥ s − M, so the level is the largest fp16 value ≤ s − 1.25·M
   (the factor leaves room for one more rounding than assumed), M = E1 + E2 + 2^-100.
For unit vectors at d = 384, M ≈ 0.0014. Rows are unit vectors (the store holds them L2-normalised in float32);
‖x‖ ≤ 1 + 2^-10 and ‖q‖ is the batch's largest query norm in float64 raised by 2^-10. Queries longer than
MAX_QUERY_NORM are left to the fp32 screen.

What the bound assumes of the device is checked before the screen is first used on it (:func:`_probe`):
fp32 → fp16 conversion to nearest even with subnormals (compared with numpy's), and every score of a product
of unit vectors (a quarter with products of one sign, components down to the subnormal range) within
γ·Σ|x̃q̃| + the output's rounding of the exact sum of the rounded inputs' products. A device that fails takes
the fp32 screen (TF32 off, :func:`indknn_cli.candidates.screening_margin`), still with the recompute here.

Memory is bounded whatever the private data: the rows are screened in steps of ``m × rows`` pairs at most
(:func:`step_rows`: every pair of a step passing the screen fits :func:`step_bytes`, an eighth of the device), and the recompute takes
the passed pairs RECOMPUTE_BYTES at a time. The float64 ``exp`` of the RBF kernel is taken on the host
(numpy's, as the CPU path), after a conservative test of the sums on the device.

tests/test_gpu_screen.py runs every function here on torch's CPU device (the same operations) against numpy
and the CPU path; tests/test_cuda.py compares a whole serve on the GPU with the CPU, where a GPU is present.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from .exact_jit import pairwise_plan

U_FP16 = 2.0**-11
U_ACC = 2.0**-20
SIGMA_SUB = 2.0**-25
TINY = 2.0**-100
SAFETY = 1.25
NORM_SLACK = 1.0 + 2.0**-10
MAX_QUERY_NORM = 2.0
#: Device bytes a screen step may hold: its fp16 scores, its mask and, should every pair pass, their indices
#: (2 + 1 + 16 bytes per pair of the step); the step's rows follow from the batch size (public).
GPU_STEP_BYTES = 6 << 30
#: Device bytes of one recompute slice: gathered float32 rows and queries and the float64 terms (16·d per pair).
RECOMPUTE_BYTES = 3 << 30


def fp16_screen_margin(*, dim: int, norm_x: float, norm_q: float) -> float:
    """M: a bound on |fp16 screen score − exact x·q| for ‖x‖ ≤ ``norm_x``, ‖q‖ ≤ ``norm_q`` (docstring 1–3)."""
    if not isinstance(dim, int) or dim < 1 or dim * U_ACC >= 0.5:
        raise ValueError(f"dim must be an integer in [1, 2^19), got {dim!r}")
    for name, v in (("norm_x", norm_x), ("norm_q", norm_q)):
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{name} must be finite and ≥ 0, got {v!r}")
    u, s = U_FP16, SIGMA_SUB
    b = norm_x * norm_q
    e1 = (2.0 * u + u * u) * b + s * (1.0 + u) * math.sqrt(dim) * (norm_x + norm_q) + dim * s * s
    gamma = dim * U_ACC / (1.0 - dim * U_ACC)
    return e1 + gamma * (b + e1) + TINY


def step_bytes(dev) -> int:
    """Device bytes a screen step may hold: an eighth of the device's memory, within [1 GiB, 16 GiB]
    (GPU_STEP_BYTES off a CUDA device). The device's size, a public figure."""
    if getattr(dev, "type", None) != "cuda":
        return GPU_STEP_BYTES
    import torch

    total = torch.cuda.get_device_properties(dev).total_memory
    return int(min(16 << 30, max(1 << 30, total // 8)))


#: Device bytes per pair of a step: its fp16 score, mask and comparison temporaries (STEP_PAIR_BYTES_COUNTED),
#: or, when nothing counts the passing pairs first, every pair passing with its indices and their copies
#: (STEP_PAIR_BYTES_ALL: 73 measured by the audit of 2026-11-27, rounded up).
STEP_PAIR_BYTES_COUNTED = 8
STEP_PAIR_BYTES_ALL = 96


def step_rows(m: int, total_rows: int, *, budget: int = GPU_STEP_BYTES, per_pair: int = STEP_PAIR_BYTES_ALL) -> int:
    """Rows per screen step for ``m`` queries: ``budget`` bytes over ``per_pair`` bytes per pair, whole 1,024s."""
    rows = budget // (per_pair * max(m, 1)) // 1024 * 1024
    return int(max(1024, min(rows, max(total_rows, 1))))


def recompute_slice(dim: int) -> int:
    """Pairs per recompute slice at width ``dim``."""
    return int(max(1024, RECOMPUTE_BYTES // (16 * max(dim, 1))))


def _uniform_leaves(plan: np.ndarray) -> int | None:
    """n when every leaf of the plan sums n ≥ 8 terms and the leaves tile [0, d) in order (d = 384: four of 96),
    so that one set of operations on a (P, leaves, n) view sums them all at once; else None."""
    leaves = plan[plan[:, 0] >= 0]
    if not leaves.size:
        return None
    n = int(leaves[0, 1])
    ok = n >= 8 and bool(np.all(leaves[:, 1] == n)) and bool(np.array_equal(leaves[:, 0], np.arange(len(leaves)) * n))
    return n if ok else None


def _leaf_sums(view):
    """numpy's sum of ``n ≥ 8`` terms along the last axis of ``view`` (8 running sums, their tree, the rest
    in order), every leading index at once."""
    n = view.shape[-1]
    r = view[..., 0:8].clone()
    end = n - n % 8
    for i in range(8, end, 8):
        r += view[..., i:i + 8]
    s = ((r[..., 0] + r[..., 1]) + (r[..., 2] + r[..., 3])) + ((r[..., 4] + r[..., 5]) + (r[..., 6] + r[..., 7]))
    for i in range(end, n):
        s = s + view[..., i]
    return s


def leaf_tree(leaf, plan: np.ndarray):
    """numpy's sums from the (P, leaves) sums of a plan's uniform leaves (:func:`_uniform_leaves`): the plan's
    tree adds them in its order, then the reduction's identity 0.0 is added (−0.0 → +0.0)."""
    stack = []
    k = 0
    for a, _n in plan.tolist():
        if a < 0:
            right = stack.pop()
            stack.append(stack.pop() + right)
        else:
            stack.append(leaf[:, k])
            k += 1
    return stack[0] + 0.0


def numpy_order_sums(terms, plan: np.ndarray):
    """Row sums of a (P, d) float64 tensor in numpy's pairwise order (``exact_jit.pairwise_plan(d)``): each
    addition a separate elementwise IEEE operation, so the bits are numpy's ``terms.sum(axis=1)``. Leaves of
    one length that tile the row (d = 384, 768, …) are summed together (about a quarter of the kernel
    launches); then the plan's tree adds them in its order."""
    import torch

    stack = []
    p = terms.shape[0]
    n_uniform = _uniform_leaves(plan)
    if n_uniform is not None:
        n_leaves = int((plan[:, 0] >= 0).sum())
        return leaf_tree(_leaf_sums(terms[:, :n_leaves * n_uniform].reshape(p, n_leaves, n_uniform)), plan)
    for a, n in plan.tolist():
        if a < 0:
            right = stack.pop()
            stack.append(stack.pop() + right)
            continue
        if n < 8:
            s = torch.zeros(p, dtype=torch.float64, device=terms.device)
            for i in range(a, a + n):
                s = s + terms[:, i]
        else:
            s = _leaf_sums(terms[:, a:a + n])
        stack.append(s)
    if not stack:
        return torch.zeros(p, dtype=torch.float64, device=terms.device)
    return stack[0] + 0.0  # numpy's reduction adds the sum to its identity 0.0 (−0.0 → +0.0)


def pair_sums(x_t, ri, q_t, qi, *, kernel: str, plan: np.ndarray):
    """The float64 sums κ is made of (Σ x·q, or Σ (x − q)² for RBF) of the pairs (x_t[ri[p]], q_t[qi[p]]),
    float32 tensors on one device, in numpy's order: bit for bit ``candidates.exact_sums`` of the same rows."""
    import torch

    terms = x_t.index_select(0, ri).to(torch.float64)
    qg = q_t.index_select(0, qi)
    if kernel == "cosine":
        terms.mul_(qg)  # float64 × float32 in float64: the exact product
    else:
        terms.sub_(qg)
        terms.mul_(terms)
    del qg
    return numpy_order_sums(terms, plan)


def rbf_sum_limit(*, tau: float, nu: float) -> float:
    """A sum Σ(x − q)² above this has exp(−sum/ν²) < τ whatever the rounding: −ν² ln τ, widened by 2^-30
    relatively and by ν²·2^-40/τ absolutely (exp's rounding near 1 is absolute, ~2^-53: with τ close to 1 a
    relative slack alone dropped pairs the CPU keeps; audit, 2026-11-27)."""
    return (-(nu * nu) * math.log(tau)) * (1.0 + 2.0**-30) + (nu * nu) * 2.0**-40 / tau + 2.0**-60


_lock = threading.Lock()
_probed: dict[tuple[str, int], bool] = {}


def fp16_usable(device, dim: int) -> bool:
    """Whether the fp16 screen's assumptions hold on ``device`` at width ``dim`` (:func:`_probe`; cached)."""
    key = (str(device), int(dim))
    with _lock:
        if key not in _probed:
            try:
                _probed[key] = _probe(device, dim)
            except Exception:  # whatever failed, the fp32 screen gives the same candidates
                _probed[key] = False
        return _probed[key]


def _probe(device, dim: int) -> bool:
    import torch

    rng = np.random.default_rng(5)
    # Conversion: finite float32 values of every magnitude fp16 holds, subnormals included, and ties.
    v = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.uniform(-9, 4, 4096),
                        (np.arange(1, 1025) * 2.0**-25).astype(np.float64)]).astype(np.float32)
    got = torch.from_numpy(v).to(device).to(torch.float16).cpu().numpy()
    if not np.array_equal(got.view(np.uint16), v.astype(np.float16).view(np.uint16)):
        return False
    rows, queries = 1040, 260
    x = rng.standard_normal((rows, dim))
    q = rng.standard_normal((queries, dim))
    x[: rows // 4] = np.abs(x[: rows // 4])
    q[: queries // 4] = np.abs(q[: queries // 4])
    x[rows // 4: rows // 2, ::3] *= 1e-4  # components down in fp16's subnormal range
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    x16 = torch.from_numpy(x.astype(np.float32)).to(device).to(torch.float16)
    q16 = torch.from_numpy(q.astype(np.float32)).to(device).to(torch.float16)
    with _exact_matmul(torch):
        s = torch.mm(q16, x16.T)
    if s.dtype != torch.float16 or tuple(s.shape) != (queries, rows):
        return False
    xr, qr = x16.double().cpu().numpy(), q16.double().cpu().numpy()
    exact = qr @ xr.T  # exact products of fp16 values, float64 sums (error ~1e-16)
    absum = np.abs(qr) @ np.abs(xr).T
    gamma = dim * U_ACC / (1.0 - dim * U_ACC)
    bound = gamma * absum + U_FP16 * (np.abs(exact) + gamma * absum) + 2.0**-24 + 1e-12
    got = s.double().cpu().numpy()
    return bool(np.all(np.isfinite(got)) and np.all(np.abs(got - exact) <= bound))


#: Held from setting the (process-wide) cuBLAS flags through the product to restoring them: two threads
#: screening at once (the pass screened ahead and the reuse pool's screen) would otherwise let one thread's
#: restore re-enable reduced-precision reductions under the other's product (audit, 2026-11-27).
_FLAGS_LOCK = threading.RLock()


class _exact_matmul:
    """No reduced-precision reductions and no TF32 in the products inside the block (restored after); one
    thread at a time (_FLAGS_LOCK)."""

    def __init__(self, torch):
        self.m = torch.backends.cuda.matmul

    def __enter__(self):
        _FLAGS_LOCK.acquire()
        m = self.m
        self.old = (m.allow_tf32, m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction)
        m.allow_tf32 = False
        m.allow_fp16_reduced_precision_reduction = False
        m.allow_bf16_reduced_precision_reduction = False

    def __exit__(self, *exc):
        m = self.m
        try:
            m.allow_tf32, m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = self.old
        finally:
            _FLAGS_LOCK.release()


def _round_down_f16(value: float) -> float:
    f = np.float16(value)
    while float(f) > value:
        f = np.nextafter(f, np.float16(-np.inf))
    return float(f)


def _round_down_f32(value: float) -> float:
    f = np.float32(value)
    return float(f if float(f) <= value else np.nextafter(f, np.float32(-np.inf)))


class GpuScreen:
    """One batch's queries on a device, screened and recomputed against blocks of rows (:meth:`block`)."""

    def __init__(self, queries: np.ndarray, dev, *, kernel: str, tau: float, nu: float | None, threshold: float,
                 fp32_margin: float, row_mask: np.ndarray | None, strictly_before: np.ndarray | None,
                 fp16: bool | None = None):
        import torch

        self.torch, self.dev = torch, dev
        self.kernel, self.tau, self.nu = kernel, float(tau), nu
        q32 = np.ascontiguousarray(queries, dtype=np.float32)
        self.m, self.dim = q32.shape
        self.q_t = torch.from_numpy(q32).to(dev)
        self.plan = pairwise_plan(self.dim)
        q_norm = math.sqrt(float(np.einsum("ij,ij->i", q32, q32, dtype=np.float64).max())) if self.m else 0.0
        if fp16 is None:
            fp16 = fp16_usable(dev, self.dim)
        self.fp16 = bool(fp16 and math.isfinite(q_norm) and q_norm <= MAX_QUERY_NORM)
        self.threshold = float(threshold)
        if self.fp16:
            self.fp16_margin = fp16_screen_margin(dim=self.dim, norm_x=NORM_SLACK, norm_q=NORM_SLACK * q_norm)
            margin = SAFETY * self.fp16_margin
            self.level = torch.tensor(_round_down_f16(threshold - margin), dtype=torch.float16, device=dev)
            self.q_s = self.q_t.to(torch.float16)
        else:
            self.level = torch.tensor(_round_down_f32(threshold - fp32_margin), dtype=torch.float32, device=dev)
            self.q_s = self.q_t
        self.mask_t = None if row_mask is None else torch.from_numpy(np.ascontiguousarray(row_mask, bool)).to(dev)
        self.before_t = (None if strictly_before is None
                         else torch.from_numpy(np.asarray(strictly_before, np.int64)).to(dev))
        self.slice = recompute_slice(self.dim)
        self.limit = None if kernel == "cosine" else rbf_sum_limit(tau=tau, nu=nu)

    def block(self, start: int, x_t, *, max_pass: int | None = None):
        """(query, row, sums) of the rows ``x_t`` (float32 on the device, first row ``start``): every pair
        with κ ≥ τ (cosine: exactly those, κ = sums; RBF: a superset, by the sums' conservative limit, whose
        κ and test the host takes), as device tensors (int64, int64, float64)."""
        torch = self.torch
        with _exact_matmul(torch):
            s = torch.mm(self.q_s, (x_t.to(torch.float16) if self.fp16 else x_t).T)
        hit = s >= self.level
        del s
        if max_pass is not None and int(hit.sum()) > max_pass:  # counted before any pair array is made:
            from .candidates import TooManyPairs                 # the device holds at most max_pass pairs

            raise TooManyPairs()
        qi, ri = torch.nonzero(hit, as_tuple=True)
        del hit
        rows = ri + start
        if self.mask_t is not None or self.before_t is not None:
            keep = torch.ones(rows.shape[0], dtype=torch.bool, device=self.dev)
            if self.mask_t is not None:
                keep &= self.mask_t[rows]
            if self.before_t is not None:
                keep &= rows < self.before_t[qi]
            qi, ri = qi[keep], ri[keep]
        return self.exact_pairs(x_t, qi, ri, start)

    def exact_pairs(self, x_t, qi, ri, start: int, *, sums_of=None):
        """The passed pairs (qi, ri: rows of ``x_t``, whose first row is ``start``) recomputed RECOMPUTE_BYTES at a
        time (``sums_of``: :func:`pair_sums`, or a function with its arguments and bits), and kept where the exact
        test passes: (query, row + start, sums) int64, int64, float64 device tensors."""
        torch = self.torch
        sums_of = pair_sums if sums_of is None else sums_of
        out_q, out_r, out_s = [], [], []
        for lo in range(0, int(qi.shape[0]), self.slice):
            sq, sr = qi[lo:lo + self.slice], ri[lo:lo + self.slice]
            sums = sums_of(x_t, sr, self.q_t, sq, kernel=self.kernel, plan=self.plan)
            ok = sums >= self.tau if self.limit is None else sums <= self.limit
            out_q.append(sq[ok].long())
            out_r.append(sr[ok].long() + start)
            out_s.append(sums[ok])
        if not out_q:
            empty = torch.empty(0, dtype=torch.int64, device=self.dev)
            return empty, empty, torch.empty(0, dtype=torch.float64, device=self.dev)
        return torch.cat(out_q), torch.cat(out_r), torch.cat(out_s)

    def collect(self, parts_q, parts_r, parts_s):
        """The blocks' pairs on the host, sorted by query then row: (qi, rows, κ) numpy arrays, κ ≥ τ."""
        torch = self.torch
        if parts_q:
            qi, rows, sums = torch.cat(parts_q), torch.cat(parts_r), torch.cat(parts_s)
        else:
            qi = rows = torch.empty(0, dtype=torch.int64, device=self.dev)
            sums = torch.empty(0, dtype=torch.float64, device=self.dev)
        order = torch.sort(rows, stable=True).indices  # by row, then (stably) by query
        order = order[torch.sort(qi[order], stable=True).indices]
        qi, rows, sums = qi[order].cpu().numpy(), rows[order].cpu().numpy(), sums[order].cpu().numpy()
        if self.limit is None:
            return qi, rows, sums
        kap = np.exp(-sums / (self.nu * self.nu))  # the host's exp, as the CPU path (candidates.exact_kernel)
        ok = kap >= self.tau
        return qi[ok], rows[ok], kap[ok]
