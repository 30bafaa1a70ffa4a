"""The exact, batched Ind-KNN engine (SPEC §2, §4, §5).

Two phases per batch of queries:

1. *Candidates* (independent of budgets, SPEC §5): queries are scored against
   the private features streamed in row chunks with one fp32 matrix product
   (FAISS range_search on the CPU, torch on a GPU; TF32 off). Pairs within a
   safety margin of the threshold are kept and their kernel value recomputed
   exactly in float64 on the CPU from the stored float32 vectors, in
   cache-sized blocks, so the candidate sets and weights do not depend on the
   device, the product's library or the batch size.
2. *Filter* (SPEC §2), query by query in order over the sparse candidates:
   eligibility, noisy count, clipped kernel votes, Gaussian noise, argmax.
   Each query's noise comes from its own generator keyed by (run key, query
   index), so any batch size gives identical answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np

from .ledger import PrivacyParams

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
    if kernel == "cosine":
        return np.multiply(x, q, dtype=np.float64).sum(axis=1)
    diff = np.subtract(x, q, dtype=np.float64)
    return np.exp(-(diff * diff).sum(axis=1) / (nu * nu))


#: Pairs per block of the float64 recompute: the rows gathered for a block (512 × d × 4 bytes each side,
#: and their float64 products) stay in cache; 32,768-pair blocks cost ~8× more in memory traffic.
EXACT_PAIR_BLOCK = 512


def exact_kernel_pairs(x: np.ndarray, xi: np.ndarray, q: np.ndarray, qi: np.ndarray, *, kernel: str,
                       nu: float | None, block: int = EXACT_PAIR_BLOCK) -> np.ndarray:
    """κ(x[xi[p]], q[qi[p]]) for every pair p, bit-identical to ``exact_kernel(x[xi], q[qi])``.

    Each value is one row's reduction, independent of the other rows, so computing the pairs in
    cache-sized blocks changes no bit (tests/test_engine.py checks it on near-τ data).
    """
    out = np.empty(xi.size, dtype=np.float64)
    for lo in range(0, xi.size, block):
        hi = min(xi.size, lo + block)
        out[lo:hi] = exact_kernel(x[xi[lo:hi]], q[qi[lo:hi]], kernel=kernel, nu=nu)
    return out


def noise_generator(run_key: int, query_index: int) -> np.random.Generator:
    """The generator of one query's noise, keyed by (run key, query index) (SPEC §5)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy=run_key, spawn_key=(query_index,))))


class ChunkSource(Protocol):
    def chunks(self) -> Iterator[tuple[int, np.ndarray]]: ...


@dataclass
class ArraySource:
    """Private features already in memory (tests, small stores, cached stores)."""

    features: np.ndarray
    rows: int = 8192

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, self.features.shape[0], self.rows):
            yield start, self.features[start:start + self.rows]


@dataclass
class StoreSource:
    """Private features streamed from the Zarr store; cached when under the memory cap."""

    store: object
    role: str = "private"
    cache_bytes: int = 1 << 30
    _cache: list | None = None
    _on_device: dict = field(default_factory=dict)  # device → [(start, tensor)] resident for the run, or None

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        if self._cache is not None:
            yield from self._cache
            return
        n = self.store.n_rows(self.role)
        fits = n * self.store.dim * 4 <= self.cache_bytes
        cache = [] if fits else None
        for start, block in self.store.iter_chunks(self.role):
            if cache is not None:
                cache.append((start, block))
            yield start, block
        if cache is not None:
            self._cache = cache


def _passive_openmp(module: str) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` before torch or faiss loads its OpenMP runtime, unless the caller set a
    policy: threads that spin after each matrix product would otherwise hold a core while the float64
    recompute and the filter run on one thread (CPU seconds, and other processes on a shared machine, pay
    for the spinning)."""
    import os
    import sys

    if module not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
    if device == "cuda" and not torch.cuda.is_available():
        from .errors import BadInputError

        raise BadInputError("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)


def _resident_blocks(source, dev) -> list | None:
    """A store's feature chunks kept on the GPU for the whole run, when they fit in half its free memory.

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
            blocks = [(start, torch.from_numpy(np.ascontiguousarray(block, dtype=np.float32)).to(dev))
                      for start, block in source.chunks() if block.shape[0]]
            source._cache = None  # the host copy is never read again this run
        source._on_device[key] = blocks
    return source._on_device[key]


def _screen_cpu(queries: np.ndarray, block: np.ndarray, screen: float) -> tuple[np.ndarray, np.ndarray]:
    """(query, row) pairs of one chunk whose fp32 dot product exceeds ``screen``, on the CPU.

    FAISS ``range_search`` over a flat inner-product index of the chunk: its blocked product and the
    threshold test run in one pass, with no score matrix kept, and a CPU serve never imports torch (about
    as fast as torch's product + ``nonzero`` here; the process start-up is shorter). Any fp32 summation
    order is within the screening margin, and every screened pair's κ is then recomputed exactly, so the
    candidates do not depend on this choice.
    """
    _passive_openmp("faiss")
    import faiss

    index = faiss.IndexFlatIP(block.shape[1])
    index.add(np.ascontiguousarray(block, dtype=np.float32))
    lims, _scores, ids = index.range_search(queries, float(screen))
    qi = np.repeat(np.arange(queries.shape[0], dtype=np.int64), np.diff(lims).astype(np.int64))
    return qi, ids.astype(np.int64, copy=False)


class TooManyPairs(Exception):
    """Internal: a batch's candidate pairs would exceed the memory bound; split the batch."""


@dataclass
class Candidates:
    """Sparse candidate lists of a batch of queries: rows and exact κ per query."""

    rows: list[np.ndarray]
    kappa: list[np.ndarray]


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
    q_np = np.ascontiguousarray(queries, dtype=np.float32)
    q_t = torch.from_numpy(q_np).to(dev) if dev.type != "cpu" else None
    parts_q: list[np.ndarray] = []
    parts_rows: list[np.ndarray] = []
    parts_kap: list[np.ndarray] = []
    total_pairs = 0
    resident = _resident_blocks(source, dev)
    blocks = ((start, None, x_t) for start, x_t in resident) if resident is not None else (
        (start, block, None) for start, block in source.chunks())
    for start, block, x_t in blocks:
        if x_t is None and block.shape[0] == 0:
            continue
        if screen <= -1.0:  # threshold below every possible dot product: all rows
            k = block.shape[0] if x_t is None else x_t.shape[0]
            qi, ri = np.repeat(np.arange(m), k), np.tile(np.arange(k), m)
        elif dev.type == "cpu":
            qi, ri = _screen_cpu(q_np, block, screen)
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
        kap = exact_kernel_pairs(block, ri, queries, qi, kernel=kernel, nu=nu, block=max_pairs_block)
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


@dataclass
class BudgetView:
    """The mutable budget state the filter reads and charges (arrays by ledger index)."""

    spent: np.ndarray
    budget: np.ndarray
    deleted: np.ndarray
    times_selected: np.ndarray
    selected_in_part: np.ndarray | None = None  # times selected since reset_part(), by ledger index

    def reset_part(self) -> None:
        self.selected_in_part = np.zeros(self.spent.shape[0], dtype=np.int64)

    def part_charges(self) -> tuple[np.ndarray, np.ndarray]:
        """(ledger indices charged since reset_part(), times selected each)."""
        if self.selected_in_part is None:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        idx = np.flatnonzero(self.selected_in_part)
        return idx, self.selected_in_part[idx]

    def record_spent(self, ledger_idx: np.ndarray) -> np.ndarray:
        return self.spent[ledger_idx]

    def answer_one(self, **kw) -> "QueryAnswer":
        return answer_one(budgets=self, **kw)


#: Released counts K_t lie on this grid (SPEC §8). The low-order bits of a
#: floating-point Gaussian sample can reveal the exact value it was added to
#: (Mironov 2012, "On significance of the least significant bits for
#: differential privacy"; Jin et al. 2022, "Are we there yet? Timing and
#: floating-point attacks on differential privacy systems"). Rounding to a
#: fixed grid makes the release a function of an integer only; the rounded
#: value is the one used downstream (vote noise scale, charges), so the
#: accounting is exact for what is released.
COUNT_GRID_DECIMALS = 2


def release_count(noisy: float, *, k_min: float) -> float:
    """``max(round(|C_t| + σ1·z, 2 decimals), K_min)``: the released K_t (SPEC §2 step 2, §8).

    The rounded value is ``n / 100`` for an integer ``n`` (the float nearest to it),
    so nothing below the grid carries information. K_min is a public constant.
    """
    if not math.isfinite(noisy):
        raise ValueError(f"noisy count is not finite: {noisy!r}")
    scale = 10 ** COUNT_GRID_DECIMALS
    return max(round(noisy * scale) / scale, float(k_min))


#: The label value of an abstention (``serve-queries --min-margin``): not a class; its label_name is ABSTAIN_NAME.
ABSTAIN_LABEL = -1
ABSTAIN_NAME = "abstain"


@dataclass
class QueryAnswer:
    label: int
    released_count: float
    #: (noisy top-1 − noisy top-2 vote) / (σ2·sqrt(K_t)), from the same noisy vote vector the argmax reads
    #: (post-processing of the charged release; never released itself, only compared with --min-margin).
    margin: float | None = None


def noisy_margin(votes: np.ndarray, *, scale: float) -> float:
    """(top-1 − top-2) of the *noisy* votes over the noise scale σ2·sqrt(K_t); +inf with one class."""
    if votes.size < 2:
        return math.inf
    top2 = np.partition(votes, votes.size - 2)[-2:]
    return float((top2[1] - top2[0]) / scale)


def answer_one(
    *,
    cand_ledger_idx: np.ndarray,
    cand_kappa: np.ndarray,
    cand_labels: np.ndarray,
    reuse_votes: np.ndarray,
    params: PrivacyParams,
    n_classes: int,
    budgets: BudgetView,
    rng: np.random.Generator,
) -> QueryAnswer:
    """SPEC §2 for one query over its candidates (rounding against the user, §8)."""
    c1 = params.c1
    sp = budgets.spent[cand_ledger_idx]
    bud = budgets.budget[cand_ledger_idx]
    eligible = (~budgets.deleted[cand_ledger_idx]) & (np.nextafter(sp + c1, np.inf) <= bud)
    sel = cand_ledger_idx[eligible]
    kap = cand_kappa[eligible]
    lab = cand_labels[eligible]
    # Step 2: noisy count, clamped; every selected record pays c1 (rounded up).
    z = rng.standard_normal()
    k_t = release_count(sel.size + params.sigma1 * z, k_min=params.k_min)
    sp = np.nextafter(sp[eligible] + c1, np.inf)
    bud = bud[eligible]
    # Step 3: clip the vote against what is left, charge w²/(2σ2²K) rounded up.
    remaining = np.maximum(np.nextafter(bud - sp, -np.inf), 0.0)
    cap = params.sigma2 * np.sqrt(2.0 * k_t * remaining) * (1.0 - 1e-9)
    w = np.minimum(kap, cap)
    cost = np.nextafter(w * w / (2.0 * params.sigma2 * params.sigma2 * k_t) * (1.0 + 1e-12), np.inf)
    new = np.nextafter(sp + cost, np.inf)
    over = new > bud
    if over.any():  # rounding edge: vote with weight 0 (cost 0) rather than overspend
        w = np.where(over, 0.0, w)
        new = np.where(over, sp, new)
    budgets.spent[sel] = new
    budgets.times_selected[sel] += 1
    if budgets.selected_in_part is not None:
        budgets.selected_in_part[sel] += 1  # sel holds distinct indices
    # Step 4-5: kernel-weighted votes + reuse + N(0, σ2² K) per class; argmax.
    votes = np.bincount(lab, weights=w, minlength=n_classes).astype(np.float64) + reuse_votes
    return release_answer(votes, k_t=k_t, params=params, rng=rng)


def release_answer(votes: np.ndarray, *, k_t: float, params: PrivacyParams, rng: np.random.Generator) -> QueryAnswer:
    """SPEC §2 steps 4–5, shared by the record and the user unit: add N(0, σ2²·K_t) per class (the draws
    after the count's), release the argmax and K_t; the margin is read from the same noisy votes."""
    scale = params.sigma2 * math.sqrt(k_t)
    votes = votes + scale * rng.standard_normal(votes.size)
    return QueryAnswer(label=int(np.argmax(votes)), released_count=float(k_t), margin=noisy_margin(votes, scale=scale))


@dataclass
class ReusePool:
    """Released (query vector, label) pairs: public data, used for free votes (SPEC §4)."""

    vectors: np.ndarray
    labels: np.ndarray

    @classmethod
    def empty(cls, dim: int) -> "ReusePool":
        return cls(np.empty((0, dim), np.float32), np.empty(0, np.int64))

    def extend(self, vectors: np.ndarray, labels: np.ndarray) -> None:
        self.vectors = np.concatenate([self.vectors, np.asarray(vectors, np.float32)])
        self.labels = np.concatenate([self.labels, np.asarray(labels, np.int64)])


def answer_batch(
    queries: np.ndarray,
    *,
    source: ChunkSource,
    row_to_ledger: np.ndarray,
    row_labels: np.ndarray,
    params: PrivacyParams,
    n_classes: int,
    budgets: BudgetView,
    run_key: int,
    first_index: int,
    reuse: ReusePool | None = None,
    device: str = "auto",
    on_query: Callable[[int], None] | None = None,
    candidate_finder: Callable[..., Candidates] | None = None,
    max_pairs: int | None = None,
    min_margin: float | None = None,
) -> list[QueryAnswer]:
    """Answer a batch of queries in order; mutates ``budgets`` (and ``reuse``).

    ``min_margin`` M (serve-queries --min-margin): an answer whose noisy margin (QueryAnswer.margin) is below
    M gets ``label = ABSTAIN_LABEL``; it is post-processing of the same noise (no draw, no charge changes)
    and an abstention joins the reuse pool without a vote (it released no label).

    ``candidate_finder(queries, row_mask=...)`` replaces the exact flat scan
    (hashing / IVF kinds); it must return exact κ ≥ τ candidates.
    ``first_index`` is the run-wide index of the batch's first query (noise key).
    With ``reuse``, each answered query joins the pool before the next one.
    """
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    m = queries.shape[0]
    if max_pairs is not None and m > 1:
        try:
            cands = _candidates(queries, source, params, device, row_to_ledger, candidate_finder, max_pairs)
        except TooManyPairs:  # memory bound: answer the halves in order (same answers, SPEC §5)
            half = m // 2
            kw = dict(source=source, row_to_ledger=row_to_ledger, row_labels=row_labels, params=params,
                      n_classes=n_classes, budgets=budgets, run_key=run_key, reuse=reuse, device=device,
                      on_query=on_query, candidate_finder=candidate_finder, max_pairs=max_pairs,
                      min_margin=min_margin)
            return (answer_batch(queries[:half], first_index=first_index, **kw)
                    + answer_batch(queries[half:], first_index=first_index + half, **kw))
    else:
        cands = _candidates(queries, source, params, device, row_to_ledger, candidate_finder, None)
    return _answer_with_candidates(queries, cands, row_to_ledger=row_to_ledger, row_labels=row_labels,
                                   params=params, n_classes=n_classes, budgets=budgets, run_key=run_key,
                                   first_index=first_index, reuse=reuse, device=device, on_query=on_query,
                                   min_margin=min_margin)


def _candidates(queries, source, params, device, row_to_ledger, candidate_finder, max_pairs) -> Candidates:
    if candidate_finder is not None:
        return candidate_finder(queries, row_mask=row_to_ledger >= 0)
    return find_candidates(queries, source, kernel=params.kernel, tau=params.tau, nu=params.nu, device=device,
                           row_mask=row_to_ledger >= 0, max_pairs=max_pairs)


def _answer_with_candidates(queries, cands, *, row_to_ledger, row_labels, params, n_classes, budgets, run_key,
                            first_index, reuse, device, on_query, min_margin=None) -> list[QueryAnswer]:
    m = queries.shape[0]
    pool_cands = None
    n_pool0 = 0
    if reuse is not None:
        n_pool0 = reuse.vectors.shape[0]
        # Pool = released answers before this batch + this batch's earlier queries.
        pool_vectors = np.concatenate([reuse.vectors, queries])
        limit = n_pool0 + np.arange(m)
        pool_cands = find_candidates(queries, ArraySource(pool_vectors), kernel=params.kernel, tau=params.tau,
                                     nu=params.nu, device=device, strictly_before=limit)
    answers: list[QueryAnswer] = []
    batch_labels = np.empty(m, dtype=np.int64)
    for t in range(m):
        rows = cands.rows[t]
        reuse_votes = np.zeros(n_classes)
        if pool_cands is not None and pool_cands.rows[t].size:
            prow = pool_cands.rows[t]
            old = prow < n_pool0
            plab = np.empty(prow.size, np.int64)
            plab[old] = reuse.labels[prow[old]]
            plab[~old] = batch_labels[prow[~old] - n_pool0]
            kap_pool = pool_cands.kappa[t]
            voted = plab >= 0  # an abstention released no label: it gives no reuse vote
            if not voted.all():
                plab, kap_pool = plab[voted], kap_pool[voted]
            reuse_votes = np.bincount(plab, weights=kap_pool, minlength=n_classes).astype(np.float64)
        ans = budgets.answer_one(  # the record unit (SPEC §2) or, for a UserBudgetView, the user unit (§9)
            cand_ledger_idx=row_to_ledger[rows], cand_kappa=cands.kappa[t],
            cand_labels=row_labels[rows].astype(np.int64), reuse_votes=reuse_votes, params=params,
            n_classes=n_classes, rng=noise_generator(run_key, first_index + t),
        )
        if min_margin is not None and ans.margin < min_margin:
            ans.label = ABSTAIN_LABEL
        batch_labels[t] = ans.label
        answers.append(ans)
        if on_query is not None:
            on_query(t)
    if reuse is not None:
        reuse.extend(queries, batch_labels)
    return answers
