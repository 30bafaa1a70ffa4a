"""Shared parts of the candidate indexes: constants, exact decisions (signs, top-k), the finder base
and the thread pool that runs many small products (see :mod:`indknn_cli.indexes`)."""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import numpy as np

from .. import candidates as _candidates
from ..candidates import exact_kernel_pairs
from ..engine import EXACT_PAIR_BLOCK, Candidates, TooManyPairs, dot_threshold, exact_kernel, screening_margin
from ..store import FeatureStore
from ..threads import ProcessPool, usable_cores

INDEX_GROUP = "index"
INDEX_FORMAT_VERSION = 1
LOCK_NAME = ".indknn-index.lock"
KINDS = ("flat", "lsh", "ivf")
DEFAULT_TABLES = 30   # paper: L = 10–30
DEFAULT_BITS = 9      # paper: b = 8 (CIFAR-10), 9 (AG News)
MAX_BITS = 32
KMEANS_NITER = 20
MAX_NLIST_DEFAULT = 4096
MIN_POINTS_PER_LIST = 39  # faiss's own warning level for k-means training
ENCODE_ROWS = 32768
PAIR_BLOCK = 1 << 15
#: Bytes of one screen step's fp32 score matrix in the LSH/IVF finders (queries × rows × 4).
SCREEN_BYTES = 32 << 20
#: A training vector with cosine ≥ this to a private record is a (near-)copy of it: refused in a --train-on
#: file; the store's own public/query rows are refused when at least PRIVATE_OVERLAP_LIMIT of them are (a few
#: duplicates, a query equal to a record, are expected there).
NEAR_DUPLICATE_COSINE = 1.0 - 1e-6
PRIVATE_OVERLAP_LIMIT = 0.10

_WHY = ("a record's candidate membership would then depend on the other private records, which breaks "
        "the individual filter's guarantee (SPEC §2 step 1 and §4: membership may depend only on the "
        "record, the query and public data)")
REFUSED_KINDS = {
    "hnsw": "--kind hnsw is refused: an HNSW graph is built from the private vectors themselves, so whether a "
            f"record is reached from a query depends on which other records are in the graph; {_WHY}. "
            "Use --kind lsh (data-independent hash tables), --kind ivf (centroids trained on public vectors) "
            "or flat.",
    "pca": "--kind pca is refused: a PCA fitted to the private vectors is a statistic of the private set; "
           f"{_WHY}. Reduce dimension with a public extractor instead.",
    "pq": "--kind pq is refused: product-quantisation codebooks trained on the private vectors make every "
          f"record's code depend on the others; {_WHY}. Use --kind ivf with public centroids or --kind lsh.",
    "ivfpq": "--kind ivfpq is refused: its PQ codebooks would be trained on the private vectors; "
             f"{_WHY}. Use --kind ivf (exact vectors in lists, centroids from public data).",
}


# -- exact decisions ---------------------------------------------------------------
def _exact_dots(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Correctly rounded dot products of one float32 vector with float32 rows ``w``.

    A float32×float32 product is exact in float64 (48 ≤ 53 significand bits)
    and ``math.fsum`` rounds the exact sum once, so the sign and the order of
    the results are those of the true dot products.
    """
    prods = np.asarray(w, np.float32).astype(np.float64) * np.asarray(x, np.float32).astype(np.float64)
    return np.array([math.fsum(row) for row in prods], dtype=np.float64)


U32, U64 = 2.0**-24, 2.0**-53


def _guard(x: np.ndarray, w: np.ndarray, *, u: float) -> np.ndarray:
    """Per-row bound on |fl(x·w) − x·w| for any summation order and FMA use, with unit roundoff u:
    γ_d ‖x‖ max‖w‖, γ_d = d·u / (1 − d·u) (Higham, Accuracy and Stability, Thm 3.1 + Cauchy–Schwarz), ×2."""
    d = x.shape[1]
    x64 = x.astype(np.float64)
    wmax = float(np.sqrt((w.astype(np.float64) ** 2).sum(axis=1)).max()) if w.size else 0.0
    gamma = d * u / (1.0 - d * u)
    return 2.0 * gamma * np.sqrt((x64 * x64).sum(axis=1)) * wmax + 1e-300


def _top_k_candidates(scores: np.ndarray, k: int, guard: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top k by ``scores`` (unordered) and the rows where the top k is not certain under ``guard``.

    Entries outside U = {j : s_j ≥ s_(k) − 2g} have true value < s_(k) − g ≤ the true
    value of each of the top k by s, so the true top k lies in U; it is certain when |U| = k.
    """
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    kth = np.take_along_axis(scores, part, axis=1).min(axis=1).astype(np.float64)
    crowded = (scores >= (kth - 2.0 * guard)[:, None]).sum(axis=1) > k
    return part, crowded


def _top_k(x: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest x_i·w_j per row, exactly (ties → lowest index), sorted ascending.

    A cascade: fp32 BLAS; rows not certain under its error bound again in float64; entries still
    too close to call in exact arithmetic (:func:`_exact_dots`). Each stage only decides what its
    bound makes certain, so the result is a function of the vectors alone.
    """
    m, total = x.shape[0], w.shape[0]
    if k >= total:
        return np.broadcast_to(np.arange(total), (m, total)).copy()
    part, crowded = _top_k_candidates(x @ w.T, k, _guard(x, w, u=U32))
    rows = np.flatnonzero(crowded)
    if rows.size:
        x64 = x[rows].astype(np.float64)
        s64 = x64 @ w.astype(np.float64).T
        g64 = _guard(x64, w, u=U64)
        sub, crowded64 = _top_k_candidates(s64, k, g64)
        for r in np.flatnonzero(crowded64):
            u_set = np.flatnonzero(s64[r] >= s64[r, sub[r]].min() - 2.0 * g64[r])
            ex = _exact_dots(x[rows[r]], w[u_set])
            sub[r] = u_set[np.lexsort((u_set, -ex))[:k]]
        part[rows] = sub
    return np.sort(part, axis=1)


def _signs(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[x_i·w_j ≥ 0] exactly (the same fp32 → float64 → exact cascade as :func:`_top_k`)."""
    proj = x @ w.T
    bits = proj >= 0.0
    rows = np.flatnonzero((np.abs(proj) <= _guard(x, w, u=U32)[:, None]).any(axis=1))
    if rows.size:
        x64 = x[rows].astype(np.float64)
        p64 = x64 @ w.astype(np.float64).T
        sub = p64 >= 0.0
        for i, j in zip(*np.nonzero(np.abs(p64) <= _guard(x64, w, u=U64)[:, None])):
            sub[i, j] = _exact_dots(x[rows[i]], w[j:j + 1])[0] >= 0.0
        bits[rows] = sub
    return bits


# -- finder helpers ---------------------------------------------------------------------
def _read_private(store: FeatureStore, n: int) -> np.ndarray:
    x = np.empty((n, store.dim), np.float32)
    for start, block in store.iter_chunks("private"):
        stop = min(n, start + block.shape[0])
        if stop > start:
            x[start:stop] = block[:stop - start]
    return x


def _collect(m: int, qi: np.ndarray, rows: np.ndarray, kap: np.ndarray) -> Candidates:
    order = np.lexsort((rows, qi))
    qi, rows, kap = qi[order], rows[order], kap[order]
    bounds = np.searchsorted(qi, np.arange(m + 1))
    return Candidates([rows[bounds[t]:bounds[t + 1]].astype(np.int64) for t in range(m)],
                      [kap[bounds[t]:bounds[t + 1]] for t in range(m)])


class _FinderBase:
    kind = "?"
    #: engine._candidates passes serving's pair bound (from --max-memory) to finders that take it
    accepts_max_pairs = True

    @staticmethod
    def _check_pairs(m: int, screened: int, max_pairs: int | None) -> None:
        """Past the bound, stop before the exact pass materialises the pairs: the caller answers the batch's
        halves (same answers, SPEC §5). Otherwise running out of memory, hence the exit code and the number
        of answers, would depend on how many private records lie near the queries (AUDIT_FINDINGS_2.md P3)."""
        if max_pairs is not None and m > 1 and screened > max_pairs:
            raise TooManyPairs()

    def _pairs(self, m: int, max_pairs: int | None) -> "_PairCount":
        """The running count of one call's screened pairs, checked after every screen step (see _screen)."""
        return _PairCount(m=m, max_pairs=max_pairs, check=self._check_pairs)

    def __init__(self, *, kernel: str, tau: float, nu: float | None, dim: int):
        self.kernel, self.tau, self.nu = kernel, float(tau), nu
        self.screen = dot_threshold(kernel=kernel, tau=tau, nu=nu) - screening_margin(dim)
        self.last: dict = {}

    def _exact(self, m, queries, qi, rows, vectors, vec_idx) -> Candidates:
        """κ in float64 (engine.exact_kernel, as the flat scan) and the exact test κ ≥ τ."""
        order = np.lexsort((rows, qi))
        qi, rows, vec_idx = qi[order], rows[order], vec_idx[order]
        bounds = np.searchsorted(qi, np.arange(m + 1))
        kap = np.empty(qi.size, np.float64)

        def exact_one(t):
            # One query against its rows: q broadcasts, so every value is bit-identical to the flat scan's
            # exact_kernel(x_rows, q_rows) (same elementwise products, same per-row reduction).
            for lo in range(bounds[t], bounds[t + 1], EXACT_PAIR_BLOCK):  # cache-sized blocks
                hi = min(bounds[t + 1], lo + EXACT_PAIR_BLOCK)
                kap[lo:hi] = exact_kernel(vectors[vec_idx[lo:hi]], queries[t:t + 1], kernel=self.kernel, nu=self.nu)

        if _candidates.use_compiled(m, dim=vectors.shape[1], kernel=self.kernel):
            # a large batch: the compiled recompute, the same bits (probed whether or not pairs were screened)
            kap = exact_kernel_pairs(vectors, vec_idx, queries, qi, kernel=self.kernel, nu=self.nu, compiled=True)
        else:
            _parallel_blocks(np.flatnonzero(bounds[1:] > bounds[:-1]).tolist(), exact_one)
        ok = kap >= self.tau
        self.last["candidate_pairs"] = int(ok.sum())
        qi, rows, kap = qi[ok], rows[ok], kap[ok]
        bounds = np.searchsorted(qi, np.arange(m + 1))
        return Candidates([rows[bounds[t]:bounds[t + 1]].astype(np.int64) for t in range(m)],
                          [kap[bounds[t]:bounds[t + 1]] for t in range(m)])

    def _screen(self, q: np.ndarray, rows: Callable[[int, int], np.ndarray], n: int,
                count: "_PairCount") -> tuple[np.ndarray, np.ndarray]:
        """(query, row) pairs among the ``n`` rows ``rows(lo, hi)`` whose fp32 dot product passes the screen.

        The rows are read, multiplied and thresholded a step at a time: a step's score matrix stays within
        SCREEN_BYTES and its pairs within the call's pair bound (max_pairs // m rows per step, as the flat
        scan does), and the running count is checked after each step. A bucket or list holding many private
        records therefore never forms more than one bounded step before the bound stops the call."""
        if n == 0 or q.shape[0] == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        step = max(1, min(n, SCREEN_BYTES // (4 * q.shape[0]), count.rows_per_step()))
        out_q, out_r = [], []
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            a, b = np.nonzero(q @ rows(lo, hi).T >= self.screen)
            count.add(a.size)
            out_q.append(a)
            out_r.append(b.astype(np.int64) + lo)
        return _cat(out_q, np.int64), _cat(out_r, np.int64)


class _PairCount:
    """Screened pairs of one finder call, shared by its worker threads; past ``max_pairs`` (m > 1) the next
    ``add`` raises TooManyPairs (through the finder's ``_check_pairs``)."""

    def __init__(self, *, m: int, max_pairs: int | None, check: Callable[[int, int, int | None], None]):
        import threading

        self.m, self.max_pairs, self.check = m, max_pairs, check
        self.total = 0
        self._lock = threading.Lock()

    def rows_per_step(self) -> int:
        """Rows per screen step so that one step's pairs (≤ queries × rows) stay within the bound."""
        if self.max_pairs is None or self.m <= 1:
            return 1 << 62
        return max(1, self.max_pairs // self.m)

    def add(self, n: int) -> None:
        with self._lock:
            self.total += int(n)
            total = self.total
        self.check(self.m, total, self.max_pairs)


_POOL: dict = {}
_INDEX_POOL = ProcessPool("indknn-index")


def _blas_one_thread():
    """A context holding BLAS to one thread (threadpoolctl ships with scikit-learn); the controller,
    which scans the loaded libraries, is built once."""
    if "controller" not in _POOL:
        try:
            from threadpoolctl import ThreadpoolController

            _POOL["controller"] = ThreadpoolController()
        except ImportError:  # pragma: no cover
            _POOL["controller"] = None
    ctl = _POOL["controller"]
    return ctl.limit(limits=1, user_api="blas") if ctl is not None else contextlib.nullcontext()


def _parallel_blocks(tasks: list, work: Callable) -> list:
    """Run ``work(task)`` over many small matrix products: BLAS held to one thread per product (its own
    threading costs more than a small product under load) and the tasks spread over the CPU cores.
    Results come back in task order, so the output never depends on the scheduling."""
    workers = usable_cores()  # the process's CPU affinity, at most 8 (threads.py)
    if len(tasks) < 4 * workers:
        return [work(t) for t in tasks]
    executor, workers = _INDEX_POOL.get(workers)  # made once per process, again in a forked child
    chunks = [tasks[i::workers] for i in range(workers)]
    with _blas_one_thread():
        parts = list(executor.map(lambda c: [work(t) for t in c], chunks))
    out = [None] * len(tasks)
    for i, part in enumerate(parts):
        out[i::workers] = part
    return out


def _allowed(row_mask: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """The engine's row mask at ``rows``; rows past it (committed after the caller read the store) are out."""
    if row_mask is None:
        return np.ones(rows.size, bool)
    inside = rows < row_mask.size
    out = np.zeros(rows.size, bool)
    out[inside] = row_mask[rows[inside]]
    return out


def _cat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
