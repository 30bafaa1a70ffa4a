"""The exact, batched Ind-KNN engine (SPEC §2, §4, §5).

Two phases per batch of queries:

1. *Candidates* (independent of budgets, SPEC §5; :mod:`indknn_cli.candidates`, whose names are
   re-exported here): an fp32 screen of the queries against the private features streamed in row
   chunks, then κ recomputed exactly in float64 for the screened pairs, so the candidate sets and
   weights do not depend on the device, the product's library or the batch size.
2. *Filter* (SPEC §2), query by query in order over the sparse candidates:
   eligibility, noisy count, clipped kernel votes, Gaussian noise, argmax.
   Each query's noise comes from its own generator keyed by (run key, query
   index), so any batch size gives identical answers.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Callable

import numpy as np

from .candidates import (EXACT_PAIR_BLOCK, ArraySource, Candidates, ChunkSource, StoreSource, TooManyPairs,
                         _import_torch, dot_threshold, exact_kernel, exact_kernel_pairs, find_candidates,
                         screening_margin)
from .ledger_state import PrivacyParams

#: The candidate phase lives in candidates.py; its names stay importable from here (callers and tests use both).
__all__ = ["EXACT_PAIR_BLOCK", "ArraySource", "Candidates", "ChunkSource", "StoreSource", "TooManyPairs", "_import_torch",
           "dot_threshold", "exact_kernel", "exact_kernel_pairs", "find_candidates", "screening_margin",
           "noise_generator", "BudgetView", "COUNT_GRID_DECIMALS", "release_count", "ABSTAIN_LABEL", "ABSTAIN_NAME",
           "QueryAnswer", "noisy_margin", "answer_one", "release_answer", "ReusePool", "answer_batch"]


def run_key_for(seed: int | None, batch_id: str) -> int:
    """OS entropy for real answers; a seed (experiments only) is mixed with the batch id."""
    if seed is None:
        return secrets.randbits(128)
    digest = hashlib.sha256(f"indknn-seed:{seed}:{batch_id}".encode()).digest()
    return int.from_bytes(digest[:16], "big")


def noise_generator(run_key: int, query_index: int) -> np.random.Generator:
    """The generator of one query's noise, keyed by (run key, query index) (SPEC §5)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy=run_key, spawn_key=(query_index,))))


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


class AnswerArrays(Sequence):
    """A batch's answers as three arrays (the compiled filter's output, issue 21): a sequence of QueryAnswer made
    one at a time on demand, so a serve of 8,192 queries per part builds no Python object per answer unless a
    caller asks for one. ``labels`` already carry the abstentions (ABSTAIN_LABEL)."""

    __slots__ = ("labels", "released_counts", "margins")

    def __init__(self, labels: np.ndarray, released_counts: np.ndarray, margins: np.ndarray):
        self.labels = np.asarray(labels, np.int64)
        self.released_counts = np.asarray(released_counts, np.float64)
        self.margins = np.asarray(margins, np.float64)
        if not self.labels.shape == self.released_counts.shape == self.margins.shape:
            raise ValueError("labels, released counts and margins must have one entry per query")

    @classmethod
    def of(cls, answers: "Sequence[QueryAnswer]") -> "AnswerArrays":
        """``answers`` (a list of QueryAnswer, or AnswerArrays as they are) as arrays."""
        if isinstance(answers, AnswerArrays):
            return answers
        return cls(np.fromiter((a.label for a in answers), np.int64, len(answers)),
                   np.fromiter((a.released_count for a in answers), np.float64, len(answers)),
                   np.fromiter((math.nan if a.margin is None else a.margin for a in answers), np.float64,
                               len(answers)))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return AnswerArrays(self.labels[i], self.released_counts[i], self.margins[i])
        return QueryAnswer(label=int(self.labels[i]), released_count=float(self.released_counts[i]),
                           margin=float(self.margins[i]))

    def __add__(self, other):
        if isinstance(other, AnswerArrays):  # the halves of a batch past the pair bound, in order
            return AnswerArrays(np.concatenate([self.labels, other.labels]),
                                np.concatenate([self.released_counts, other.released_counts]),
                                np.concatenate([self.margins, other.margins]))
        if isinstance(other, list):
            return list(self) + other
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, list):
            return other + list(self)
        return NotImplemented

    def __eq__(self, other):
        if isinstance(other, (list, tuple, AnswerArrays)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"AnswerArrays({len(self)} answers)"


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
    candidates: Candidates | None = None,
) -> list[QueryAnswer]:
    """Answer a batch of queries in order; mutates ``budgets`` (and ``reuse``).

    ``min_margin`` M (serve-queries --min-margin): an answer whose noisy margin (QueryAnswer.margin) is below
    M gets ``label = ABSTAIN_LABEL``; it is post-processing of the same noise (no draw, no charge changes)
    and an abstention joins the reuse pool without a vote (it released no label).

    ``candidate_finder(queries, row_mask=...)`` replaces the exact flat scan
    (hashing / IVF kinds); it must return exact κ ≥ τ candidates.
    ``candidates``: the batch's candidates found beforehand (exact κ ≥ τ over the same rows and mask);
    ``first_index`` is the run-wide index of the batch's first query (noise key).
    With ``reuse``, each answered query joins the pool before the next one.
    """
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    m = queries.shape[0]
    if candidates is not None:  # screened beforehand (serving._PassScreen): the same exact κ ≥ τ sets
        if len(candidates) != m:
            raise ValueError(f"candidates for {len(candidates)} queries given with {m} queries")
        cands = candidates
    elif max_pairs is not None and m > 1:
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
        if getattr(candidate_finder, "accepts_max_pairs", False):  # the LSH/IVF finders: same bound as flat
            return candidate_finder(queries, row_mask=row_to_ledger >= 0, max_pairs=max_pairs)
        return candidate_finder(queries, row_mask=row_to_ledger >= 0)
    return find_candidates(queries, source, kernel=params.kernel, tau=params.tau, nu=params.nu, device=device,
                           row_mask=row_to_ledger >= 0, max_pairs=max_pairs)


def _answer_with_candidates(queries, cands, *, row_to_ledger, row_labels, params, n_classes, budgets, run_key,
                            first_index, reuse, device, on_query, min_margin=None) -> list[QueryAnswer]:
    m = queries.shape[0]
    if reuse is None and on_query is None and type(budgets) is BudgetView:
        from . import filter_jit

        if filter_jit.wanted(m):  # the same steps compiled, the batch's noise drawn at once: the same bits
            compiled = filter_jit.answer_batch_compiled(
                cands, row_to_ledger=row_to_ledger, row_labels=row_labels, params=params, n_classes=n_classes,
                budgets=budgets, run_key=run_key, first_index=first_index, min_margin=min_margin)
            if compiled is not None:
                return compiled
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
