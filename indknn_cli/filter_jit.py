"""SPEC §2's filter for a whole batch, compiled (issue 21): the same answers and charges as the query loop.

:func:`indknn_cli.engine.answer_one` runs per query in Python with numpy (tens of µs each); at GPU speed the
loop, and building each query's noise generator, cost more than finding the candidates. For the record unit
without reuse this module runs the same steps compiled (:mod:`indknn_cli.filter_jit_kernels`: every
operation of answer_one and release_answer in the same order, float64 IEEE arithmetic without fastmath, numpy's
``maximum``/``minimum``/``bincount``/``argmax``/``partition`` spelled out with their tie and NaN rules) over a
batch's candidates in one array (CSR), with the batch's noise drawn up front (:mod:`indknn_cli.noise_jit`,
numpy's generators' bits). What differs from the loop is only where Python's ``round`` meets numpy's
``rint``: they agree (both to nearest even) while |noisy count · 100| < 2^52, which :func:`usable` checks
before the batch from public bounds (the candidate count per query is at most the rows stored).

Which path a batch takes reads only public figures (its size, whether reuse is on, the privacy unit) and
never changes a bit of the answers or the ledger: tests/test_filter_jit.py compares both on random worlds
with retirements, rounding edges and deleted records, across batch sizes.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

#: Batches of at least FILTER_MIN_QUERIES queries take the compiled filter once numba is loaded (the CPU's
#: compiled recompute loads it for large batches), and of at least FILTER_MIN_QUERIES_COLD otherwise (numba's
#: import, ~0.3 s, against ~30 µs per query of the Python loop). The batch size only: a public figure.
FILTER_MIN_QUERIES = 256
FILTER_MIN_QUERIES_COLD = 4096

_lock = threading.Lock()
_kernels = None


def _load():
    global _kernels
    with _lock:
        if _kernels is None:
            try:
                from . import filter_jit_kernels

                _kernels = filter_jit_kernels
            except Exception:
                _kernels = False
        return _kernels or None


def _disable() -> None:
    """No compiled filter in this process from now on (a compile failed on this machine)."""
    global _kernels
    with _lock:
        _kernels = False


def prepare_run(run_queries: int, *, batch: int) -> None:
    """A run of ``run_queries`` queries in batches of ``batch`` (public figures): load the compiled filter up front
    when the run as a whole pays for numba's import (at least FILTER_MIN_QUERIES_COLD queries) and its batches are
    large enough to take it (FILTER_MIN_QUERIES): 49 batches of 1,024 queries at N = 5,000 otherwise ran the Python
    loop, a third of the serve. Speed only: both paths give the same bits."""
    if run_queries >= FILTER_MIN_QUERIES_COLD and min(batch, run_queries) >= FILTER_MIN_QUERIES:
        _load()


def wanted(m: int) -> bool:
    """Whether a batch of ``m`` queries takes the compiled filter (size rule only)."""
    if m < FILTER_MIN_QUERIES:
        return False
    return "numba" in sys.modules or m >= FILTER_MIN_QUERIES_COLD


def usable(normals: np.ndarray, *, max_candidates: int, sigma1: float) -> bool:
    """Whether Python's round and numpy's rint agree on every noisy count of the batch (see the docstring)."""
    if not normals.size:
        return True
    bound = (float(max_candidates) + abs(float(sigma1)) * float(np.abs(normals[:, 0]).max())) * 100.0
    return bool(np.isfinite(bound) and bound < 2.0**52)


def answer_batch_compiled(cands, *, row_to_ledger, row_labels, params, n_classes, budgets, run_key, first_index,
                          min_margin=None):
    """The batch's answers (engine.AnswerArrays: a sequence of QueryAnswer, abstentions applied), charging ``budgets`` in place; None when
    the compiled path is not available here (numba missing, or its draws differ from numpy's): the caller
    then runs the Python loop, which gives the same answers."""
    from . import noise_jit
    from .engine import ABSTAIN_LABEL, AnswerArrays

    from .candidates import CsrCandidates

    kernels = _load()
    m = len(cands)
    if kernels is None or not noise_jit.agrees_with_numpy(1 + n_classes):
        return None
    for arr, dtype in ((budgets.spent, np.float64), (budgets.budget, np.float64), (budgets.times_selected, np.int64),
                       (budgets.selected_in_part, np.int64)):
        if arr is not None and (arr.dtype != dtype or not arr.flags.c_contiguous or not arr.flags.writeable):
            return None  # charged in place: only the arrays the loop itself would write
    normals = noise_jit.draw(run_key, first_index, m, 1 + n_classes)
    if not usable(normals, max_candidates=row_to_ledger.shape[0], sigma1=params.sigma1):
        return None
    if isinstance(cands, CsrCandidates):  # the GPU path's arrays, as they are
        bounds = np.asarray(cands.bounds, np.int64)
        rows = np.asarray(cands.flat_rows, np.int64)
        kappa = np.asarray(cands.flat_kappa, np.float64)
    else:
        sizes = np.fromiter((r.size for r in cands.rows), dtype=np.int64, count=m)
        bounds = np.zeros(m + 1, np.int64)
        np.cumsum(sizes, out=bounds[1:])
        rows = np.concatenate(cands.rows).astype(np.int64, copy=False) if m else np.empty(0, np.int64)
        kappa = np.concatenate(cands.kappa).astype(np.float64, copy=False) if m else np.empty(0, np.float64)
    pre = getattr(cands, "gathered", None)
    if pre is not None and pre[0] is row_to_ledger and pre[1] is row_labels:  # read by the screen's thread
        ledger, labels_of = pre[2], pre[3]
    else:  # gathered once, in order: the loop reads them in turn
        ledger = np.asarray(row_to_ledger, np.int64).take(rows)
        labels_of = np.asarray(row_labels, np.int64).take(rows)
    if labels_of.size and (int(labels_of.min()) < 0 or int(labels_of.max()) >= n_classes):
        return None  # a label outside the classes: the Python loop raises on it, as it always has
    limit = np.where(np.asarray(budgets.deleted, np.bool_), -np.inf, budgets.budget)
    selected = np.zeros(budgets.spent.shape[0], np.int64)
    labels = np.empty(m, np.int64)
    counts = np.empty(m, np.float64)
    margins = np.empty(m, np.float64)
    try:
        kernels.filter_batch(bounds, ledger, labels_of, kappa, budgets.spent, limit, selected, float(params.c1),
                             float(params.sigma1), float(params.sigma2), float(params.k_min),
                             2.0 * params.sigma2 * params.sigma2, normals, labels, counts, margins)
    except Exception:  # noqa: BLE001 - numba's compile on the first call (the kernels raise nothing once running)
        if selected.any():  # a charge was made (spent and selected are written together): never answer twice
            raise
        _disable()     # nothing was charged yet: the caller's Python loop gives the same answers
        return None
    budgets.times_selected += selected
    if budgets.selected_in_part is not None:
        budgets.selected_in_part += selected
    if min_margin is not None:  # post-processing of the released noisy votes (no draw, no charge)
        labels[margins < min_margin] = ABSTAIN_LABEL
    return AnswerArrays(labels, counts, margins)
