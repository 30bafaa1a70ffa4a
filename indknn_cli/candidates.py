"""The candidate phase of the Ind-KNN engine (SPEC §5): rows with κ(x, q) ≥ τ per query, κ exact in float64.

Queries are scored against the private features streamed in row chunks with one fp32 matrix product
(FAISS ``range_search`` on the CPU, :mod:`indknn_cli.faiss_screen`; torch on a GPU; TF32 off). Pairs within a safety margin of the
threshold are kept and their kernel value recomputed exactly in float64 on the CPU from the stored float32
vectors (:func:`exact_kernel`, one numpy per-row reduction per pair; for large batches the same operations
compiled, :mod:`indknn_cli.exact_jit`), so the candidate sets and weights do not depend on the device, the
product's library, the chunking or the batch size. The budget-dependent
filter that reads these candidates is :mod:`indknn_cli.engine`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from . import bf16_screen
from .chunk_sources import ArraySource, ChunkSource, StoreSource, _read_ahead, _source_rows  # noqa: F401 (re-exported)
from .faiss_screen import _FAISS_LOCK, _openblas_coretype, import_faiss  # noqa: F401 (re-exported)
from .faiss_screen import _passive_openmp, _query_index, _screen_cpu


#: fp32 screening margin on a dot product of unit vectors: |fl(x·q) − x·q| ≤ d·u (u = 2^-24).
def screening_margin(dim: int) -> float:
    return max(1e-4, 4.0 * dim * 2.0**-24)


def dot_threshold(*, kernel: str, tau: float, nu: float | None) -> float:
    """The dot-product level s with κ ≥ τ ⟺ x·q ≥ s for unit vectors.

    RBF: ‖x − q‖² = 2 − 2 x·q, so exp(−‖x−q‖²/ν²) ≥ τ ⟺ x·q ≥ 1 + ν² ln(τ) / 2.
    """
    if kernel == "cosine":
        return tau
    return 1.0 + (nu * nu) * math.log(tau) / 2.0


def exact_kernel(x: np.ndarray, q: np.ndarray, *, kernel: str, nu: float | None) -> np.ndarray:
    """κ of row pairs in float64 (row i of x with row i of q). Deterministic per row.

    Cosine: the products of the float64-cast values (exact for float32 inputs) summed by numpy's
    per-row reduction; RBF: exp(−Σ(x − q)²/ν²) likewise. The ufuncs cast inside their loops
    (``dtype=float64``), which gives the same values as casting the operands first, without the copies.
    """
    sums = exact_sums(x, q, kernel=kernel)
    return sums if kernel == "cosine" else np.exp(-sums / (nu * nu))


def exact_sums(x: np.ndarray, q: np.ndarray, *, kernel: str) -> np.ndarray:
    """The float64 row sums κ is made of: Σ x·q (cosine) or Σ (x − q)² (RBF), numpy's per-row reduction.
    The reference the compiled path (exact_jit) is checked against before use."""
    if kernel == "cosine":
        return np.multiply(x, q, dtype=np.float64).sum(axis=1)
    diff = np.subtract(x, q, dtype=np.float64)
    return (diff * diff).sum(axis=1)


#: Pairs per block of the float64 recompute: a block's float64 products (128 × d × 8 bytes, 786 KB at
#: d = 768) are reduced while still in cache; 128 measured fastest of 32–512 at d = 768 (README, issue 21).
EXACT_PAIR_BLOCK = 128


def exact_kernel_pairs(x: np.ndarray, xi: np.ndarray, q: np.ndarray, qi: np.ndarray, *, kernel: str,
                       nu: float | None, block: int = EXACT_PAIR_BLOCK, compiled: bool = False) -> np.ndarray:
    """κ(x[xi[p]], q[qi[p]]) for every pair p, bit-identical to ``exact_kernel(x[xi], q[qi])``.

    Each value is one row's reduction (numpy's, over the d float64 products of that pair, as in
    :func:`exact_kernel`), independent of the other rows, so the order and grouping of the pairs change no
    bit. The pairs are taken in row order (``xi`` non-decreasing: the CPU screen gives them so; otherwise a
    stable sort): each row of ``x`` is read once and repeated for its pairs, the queries are cast to
    float64 once and gathered, and the products of about ``block`` pairs at a time are formed in place and
    reduced while in cache. tests/test_engine.py pins the values against the per-pair path on near-τ data.

    ``compiled``: the same sums from :mod:`indknn_cli.exact_jit` (numba; the same operations in the same
    order, reading the float32 rows in place), where it reproduces numpy's bits on this machine
    (:func:`~indknn_cli.exact_jit.agrees_with_numpy`); otherwise, or without numba, numpy's path.
    """
    n = xi.size
    out = np.empty(n, dtype=np.float64)
    if n == 0:
        return out
    if compiled and x.ndim == 2 and x.dtype in (np.float32, np.float64) and q.dtype in (np.float32, np.float64):
        from . import exact_jit

        if exact_jit.agrees_with_numpy(x.shape[1], kernel=kernel, x_dtype=x.dtype, q_dtype=q.dtype):
            try:
                kap = exact_jit.pair_sums(x, xi, q, qi, kernel=kernel)
            except Exception:  # whatever failed, numpy's path below gives the same numbers (or the same error
                kap = None     # for a caller's mistake), so nothing here depends on whether pairs were found
            if kap is not None:
                return kap if kernel == "cosine" else np.exp(-kap / (nu * nu))
    xi = np.asarray(xi, dtype=np.int64)
    qi = np.asarray(qi, dtype=np.int64)
    order = None
    if n > 1 and not bool((xi[1:] >= xi[:-1]).all()):
        order = np.argsort(xi, kind="stable")
        xi, qi = xi[order], qi[order]
    q64 = np.asarray(q, dtype=np.float64)
    r0 = int(xi[0])
    counts = np.bincount(xi - r0)  # pairs per row r0, r0 + 1, …
    ends = np.cumsum(counts)
    starts = ends - counts
    # Row ranges [a, b) holding about ``block`` pairs each (a row with more pairs is one range by itself).
    cuts = np.unique(np.concatenate([np.searchsorted(starts, np.arange(0, n, block), side="right") - 1,
                                     [counts.size]]))
    kap = np.empty(n, dtype=np.float64)
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        lo, hi = int(starts[a]), int(ends[b - 1])
        if hi == lo:
            continue
        g = q64.take(qi[lo:hi], axis=0)  # float64 copies of the queries, overwritten in place
        rows = np.repeat(x[r0 + a:r0 + b], counts[a:b], axis=0)
        if kernel == "cosine":
            np.multiply(rows, g, out=g)
        else:
            np.subtract(rows, g, out=g)
            np.multiply(g, g, out=g)
        g.sum(axis=1, out=kap[lo:hi])
    if kernel != "cosine":
        kap = np.exp(-kap / (nu * nu))
    if order is None:
        return kap
    out[order] = kap
    return out


#: A batch recomputes κ with the compiled path (exact_jit) when it has at least COMPILED_MIN_QUERIES queries
#: and numba is loaded, or at least COMPILED_COLD_QUERIES (numba's import and the kernels' load, ~0.45 s, then
#: happen here); numpy's path otherwise. The compiled path saves ~1 µs per candidate pair: a cron batch of 1,000
#: queries lost 0.6 s per process to the import (README, issue 21). serve-queries loads it at a run's start when
#: the run's queries reach COMPILED_COLD_QUERIES (:func:`prepare_compiled`). Public figures only: the query
#: counts, never the number of rows stored, which one record moves (audit 10, F2: a rule on queries × rows put
#: the import's lump at one exact row count). Speed only: both paths give the same bits.
COMPILED_MIN_QUERIES = 256
COMPILED_COLD_QUERIES = 2048


def use_compiled(m: int, *, dim: int, kernel: str) -> bool:
    """Whether a batch of ``m`` queries takes the compiled recompute.

    When it does, numba's import, the probe against numpy and any compile happen here, at the batch's start,
    whatever its candidates and the rows stored: whether they happen (their memory and seconds) does not depend on
    the private data."""
    if m < COMPILED_MIN_QUERIES or ("numba" not in sys.modules and m < COMPILED_COLD_QUERIES):
        return False
    from . import exact_jit

    exact_jit.agrees_with_numpy(dim, kernel=kernel, x_dtype=np.float32, q_dtype=np.float32)
    return True


def prepare_compiled(total_queries: int, *, batch: int, dim: int, kernel: str) -> None:
    """At a run's start (serve-queries): load the compiled recompute when the run's queries reach
    COMPILED_COLD_QUERIES in batches that take it (public figures only)."""
    if total_queries >= COMPILED_COLD_QUERIES and min(batch, total_queries) >= COMPILED_MIN_QUERIES:
        use_compiled(COMPILED_COLD_QUERIES, dim=dim, kernel=kernel)


def _import_torch():
    _passive_openmp("torch")
    import torch

    return torch


class _Cpu:
    """``--device cpu`` without importing torch (the CPU screen is FAISS's)."""

    type = "cpu"


def _torch_device(device: str):
    torch = _import_torch()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        from .errors import BadInputError

        raise BadInputError("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)


def _resident_blocks(source, dev) -> list | None:
    """A store's features kept on the GPU for the whole run (one tensor), when they fit in half its free memory.

    The first batch copies them once; later batches skip the Zarr read and the host-to-device copy.
    Only for ``StoreSource`` (the store cannot change while serve-queries holds its locks). The values
    are the same float32 numbers, so candidates and answers are unchanged (tests/test_cuda.py).
    """
    if dev.type != "cuda" or not isinstance(source, StoreSource):
        return None
    key = str(dev)
    if key not in source._on_device:
        import torch

        need = source.store.n_rows(source.role) * source.store.dim * 4
        free, _total = torch.cuda.mem_get_info(dev)
        blocks = None
        if need <= free // 2:
            # One device tensor of every row (the screen's steps then span chunks: fewer, larger products).
            n = int(source.store.n_rows(source.role))
            whole = torch.empty((n, int(source.store.dim)), dtype=torch.float32, device=dev)
            end = 0
            for start, block in source.chunks():
                if block.shape[0]:
                    whole[start:start + block.shape[0]].copy_(torch.from_numpy(np.ascontiguousarray(block, np.float32)))
                    end = max(end, start + block.shape[0])
            blocks = [(0, whole[:end])] if end else []
            source._cache = None  # the host copy is never read again this run
        source._on_device[key] = blocks
    return source._on_device[key]


def _sub_blocks(blocks, rows: int):
    """(start, block, tensor) steps cut into pieces of at most ``rows`` rows (the same rows, in order)."""
    for start, block, x_t in blocks:
        k = block.shape[0] if x_t is None else x_t.shape[0]
        if k <= rows:
            yield start, block, x_t
            continue
        for lo in range(0, k, rows):
            yield (start + lo, None if block is None else block[lo:lo + rows],
                   None if x_t is None else x_t[lo:lo + rows])


class TooManyPairs(Exception):
    """Internal: a batch's candidate pairs would exceed the memory bound; split the batch."""


@dataclass
class Candidates:
    """Sparse candidate lists of a batch of queries: rows and exact κ per query."""

    rows: list[np.ndarray]
    kappa: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.rows)

    def slice(self, a: int, b: int) -> "Candidates":
        """The candidates of queries a … b−1."""
        return Candidates(self.rows[a:b], self.kappa[a:b])


class CsrCandidates(Candidates):
    """The same, held as one array of rows and one of κ (query t's: ``bounds[t]:bounds[t + 1]``), as the GPU
    path returns them: the compiled filter reads the arrays as they are; ``rows`` and ``kappa`` (one slice per
    query) are made on first use."""

    def __init__(self, bounds: np.ndarray, rows: np.ndarray, kappa: np.ndarray):
        self.bounds, self.flat_rows, self.flat_kappa = bounds, rows, kappa
        self._lists = None
        self.gathered = None  # (row_to_ledger, row_labels, their values at flat_rows) once gather() ran

    def gather(self, row_to_ledger: np.ndarray, row_labels: np.ndarray) -> None:
        """Each candidate's ledger index and label, read once (the compiled filter uses them when it is given
        these same two arrays)."""
        self.gathered = (row_to_ledger, row_labels, np.asarray(row_to_ledger, np.int64).take(self.flat_rows),
                         np.asarray(row_labels, np.int64).take(self.flat_rows))

    def _split(self):
        if self._lists is None:
            b = self.bounds.tolist()
            self._lists = ([self.flat_rows[b[t]:b[t + 1]] for t in range(len(b) - 1)],
                           [self.flat_kappa[b[t]:b[t + 1]] for t in range(len(b) - 1)])
        return self._lists

    @property
    def rows(self):  # noqa: D102
        return self._split()[0]

    @property
    def kappa(self):  # noqa: D102
        return self._split()[1]

    def __len__(self) -> int:
        return self.bounds.shape[0] - 1

    def slice(self, a: int, b: int) -> "CsrCandidates":
        lo, hi = int(self.bounds[a]), int(self.bounds[b])
        part = CsrCandidates(self.bounds[a:b + 1] - lo, self.flat_rows[lo:hi], self.flat_kappa[lo:hi])
        if self.gathered is not None:
            r2l, lab, led, labs = self.gathered
            part.gathered = (r2l, lab, led[lo:hi], labs[lo:hi])
        return part


def find_candidates(
    queries: np.ndarray,
    source: ChunkSource,
    *,
    kernel: str,
    tau: float,
    nu: float | None,
    device: str = "auto",
    row_mask: np.ndarray | None = None,
    max_pairs_block: int = EXACT_PAIR_BLOCK,
    strictly_before: np.ndarray | None = None,
    max_pairs: int | None = None,
) -> Candidates:
    """Rows with κ(x_row, q) ≥ τ for each query, κ recomputed exactly in float64.

    ``row_mask`` (bool per source row) drops rows that may never be candidates
    (deleted, not in the ledger); ``strictly_before[t]`` keeps only rows < that
    value for query t (prediction reuse within a run). With ``max_pairs``, a
    batch of several queries whose candidates exceed it raises TooManyPairs.
    """
    if device == "cpu":
        dev, torch = _Cpu(), None
    else:
        torch = _import_torch()
        dev = _torch_device(device)
    m, d = queries.shape
    thr = dot_threshold(kernel=kernel, tau=tau, nu=nu)
    screen = thr - screening_margin(d)
    if dev.type == "cuda" and screen > -1.0:  # screen and exact recompute on the device (gpu_screen)
        return _find_on_gpu(queries, source, dev, kernel=kernel, tau=tau, nu=nu, threshold=thr,
                            row_mask=row_mask, strictly_before=strictly_before, max_pairs=max_pairs)
    q_np = np.ascontiguousarray(queries, dtype=np.float32)
    q_t = torch.from_numpy(q_np).to(dev) if dev.type != "cpu" else None
    # The CPU screen: bf16 on CPUs that multiply it in hardware, for large batches (bf16_screen; its own
    # rigorous margin), else FAISS's fp32 range search. Chosen from the batch size and the rows stored.
    bf16 = None
    if dev.type == "cpu" and screen > -1.0 and bf16_screen.wanted(m, dim=d):
        bf16 = bf16_screen.Bf16Screen(q_np, thr, fp32_level=screen)
        bf16 = bf16 if bf16.usable else None
        # A batch halved by the pair bound (its size, but whether it is halved follows the rows) may fall below the
        # bf16 screen's minimum and take FAISS's: loaded with the first bf16 batch, so that whether FAISS loads (its
        # time, its log lines) never follows the rows (review 31, F1)
        import_faiss()
    q_index = _query_index(q_np) if dev.type == "cpu" and screen > -1.0 and bf16 is None else None
    # The recompute: compiled (exact_jit, reads the float32 queries in place) for large batches
    # (use_compiled); numpy's path (queries cast once per batch, exact, and gathered per pair) otherwise,
    # which spares a small cron batch numba's import. Same bits either way.
    compiled = use_compiled(m, dim=d, kernel=kernel)  # before a private row is read
    q_exact = q_np if compiled else np.asarray(queries, dtype=np.float64)
    parts_q: list[np.ndarray] = []
    parts_rows: list[np.ndarray] = []
    parts_kap: list[np.ndarray] = []
    total_pairs = 0
    resident = _resident_blocks(source, dev)
    blocks = ((start, None, x_t) for start, x_t in resident) if resident is not None else (
        (start, block, None) for start, block in source.chunks())
    if max_pairs is not None and m > 1:
        # Screen at most max_pairs // m rows at a time: a screen's own pair arrays (m × rows at worst, every
        # row a candidate) then stay within the bound checked below, whatever the private data (audit 2, P3).
        blocks = _sub_blocks(blocks, max(1, max_pairs // m))
    for start, block, x_t in blocks:
        if x_t is None and block.shape[0] == 0:
            continue
        if screen <= -1.0:  # threshold below every possible dot product: all rows
            k = block.shape[0] if x_t is None else x_t.shape[0]
            qi, ri = np.tile(np.arange(m), k), np.repeat(np.arange(k), m)  # in row order
        elif bf16 is not None:
            qi, ri = bf16.pairs(block)
        elif dev.type == "cpu":
            qi, ri = _screen_cpu(q_index, block, screen)
        else:
            if x_t is None:
                x_t = torch.from_numpy(np.ascontiguousarray(block, dtype=np.float32)).to(dev)
            scores = q_t @ x_t.T
            qi, ri = torch.nonzero(scores >= screen, as_tuple=True)
            qi = qi.cpu().numpy()
            ri = ri.cpu().numpy()
            del scores
        if qi.size == 0:
            continue
        rows = ri.astype(np.int64) + start
        keep = np.ones(rows.size, dtype=bool)
        if row_mask is not None:
            keep &= row_mask[rows]
        if strictly_before is not None:
            keep &= rows < strictly_before[qi]
        qi, ri, rows = qi[keep], ri[keep], rows[keep]
        if block is None:  # resident on the device: one gather of the rows this chunk needs
            uniq, ri = np.unique(ri, return_inverse=True)
            block = x_t[torch.from_numpy(uniq).to(dev)].cpu().numpy()
        kap = exact_kernel_pairs(block, ri, q_exact, qi, kernel=kernel, nu=nu, block=max_pairs_block,
                                 compiled=compiled)
        ok = kap >= tau
        qi, rows, kap = qi[ok], rows[ok], kap[ok]
        if qi.size == 0:
            continue
        total_pairs += qi.size
        if max_pairs is not None and m > 1 and total_pairs > max_pairs:
            raise TooManyPairs()
        parts_q.append(qi); parts_rows.append(rows); parts_kap.append(kap)
    # One sort per batch: by query, then by row (a (query, row) pair occurs once).
    qi = np.concatenate(parts_q) if parts_q else np.empty(0, np.int64)
    rows = np.concatenate(parts_rows) if parts_rows else np.empty(0, np.int64)
    kap = np.concatenate(parts_kap) if parts_kap else np.empty(0, np.float64)
    order = np.lexsort((rows, qi))
    qi, rows, kap = qi[order], rows[order], kap[order]
    bounds = np.searchsorted(qi, np.arange(m + 1))
    return Candidates([rows[bounds[t]:bounds[t + 1]] for t in range(m)],
                      [kap[bounds[t]:bounds[t + 1]] for t in range(m)])




def _find_on_gpu(queries, source, dev, *, kernel, tau, nu, threshold, row_mask, strictly_before, max_pairs,
                 fp16=None, fused=None) -> Candidates:
    """find_candidates on a CUDA device (:mod:`indknn_cli.gpu_screen`): the same candidates and κ, bit for bit.

    The store's rows stay on the device for the run where they fit (_resident_blocks), else each chunk is
    copied; they are screened ``gpu_screen.step_rows`` at a time (device memory bounded by the batch size,
    whatever the data), and only the candidates come back. ``max_pairs`` bounds the host's share as on the
    CPU (TooManyPairs: the caller halves the batch)."""
    import torch

    from . import gpu_screen

    m, d = queries.shape
    gs = gpu_screen.GpuScreen(queries, dev, kernel=kernel, tau=tau, nu=nu, threshold=threshold,
                              fp32_margin=screening_margin(d), row_mask=row_mask, strictly_before=strictly_before,
                              fp16=fp16)
    resident = _resident_blocks(source, dev)
    rows_total = _source_rows(source)
    # With a pair bound, each step counts its passing pairs before making any (TooManyPairs past the bound):
    # the device then holds the step's scores and mask (sized by the batch, public) and at most max_pairs
    # pairs. Without one, the step is sized for every pair passing.
    counted = max_pairs is not None and m > 1
    from . import gpu_fused

    forced = fused is True  # (tests) a failure of the fused path is raised, not covered by gpu_screen's path
    if fused is None:  # the fused kernels (gpu_fused): rows resident as one tensor, a pair bound, fp16 usable
        fused = (counted and gs.fp16 and resident is not None and len(resident) == 1 and resident[0][0] == 0
                 and resident[0][1].shape[0] < 2**31 and gpu_fused.wanted(dev) and gpu_fused.usable(dev, d))
    if fused:
        if resident is None:  # every row in one tensor (tests on torch's CPU device, in Triton's interpreter)
            resident = [(0, torch.from_numpy(np.ascontiguousarray(
                np.concatenate([b for _s, b in source.chunks()]), dtype=np.float32)).to(dev))]
        try:
            qi, rows, sums = gpu_fused.find_pass(gs, resident[0][1],
                                                 max_pass=max_pairs if counted else m * rows_total)
        except Exception as exc:  # nothing is charged or released here: gpu_screen's path, the same candidates
            if forced or isinstance(exc, TooManyPairs):
                raise
            gpu_fused.mark_unusable(dev, d)
        else:
            qi, rows, kap = gs.collect([qi], [rows], [sums])
            return CsrCandidates(np.searchsorted(qi, np.arange(m + 1)).astype(np.int64), rows, kap)
    blocks = resident if resident is not None else (
        (start, torch.from_numpy(np.ascontiguousarray(block, dtype=np.float32)).to(dev))
        for start, block in source.chunks() if block.shape[0])
    per_pair = gpu_screen.STEP_PAIR_BYTES_COUNTED if counted else gpu_screen.STEP_PAIR_BYTES_ALL
    step = gpu_screen.step_rows(m, rows_total if rows_total is not None else 1 << 30,
                                budget=gpu_screen.step_bytes(dev), per_pair=per_pair)
    parts_q, parts_r, parts_s = [], [], []
    total = 0
    for start, x_t in blocks:
        for lo in range(0, x_t.shape[0], step):
            qi, rows, sums = gs.block(start + lo, x_t[lo:lo + step],
                                      max_pass=(max_pairs - total) if counted else None)
            total += int(qi.shape[0])
            if max_pairs is not None and m > 1 and total > max_pairs:
                raise TooManyPairs()
            if qi.shape[0]:
                parts_q.append(qi); parts_r.append(rows); parts_s.append(sums)
    qi, rows, kap = gs.collect(parts_q, parts_r, parts_s)
    return CsrCandidates(np.searchsorted(qi, np.arange(m + 1)).astype(np.int64), rows, kap)
