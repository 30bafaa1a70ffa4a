"""The batched engine equals a plain one-query-at-a-time reference, exactly (SPEC §5)."""

from __future__ import annotations

import numpy as np
import pytest

from indknn_cli.engine import ArraySource, BudgetView, ReusePool, answer_batch, dot_threshold, exact_kernel
from indknn_cli.ledger import PrivacyParams
from indknn_cli.store import normalize_rows

from .conftest import clustered
from .reference import reference_answers


def params(kernel="cosine", tau=0.3, budget=0.05, sigma1=10.0, sigma2=0.5, nu=None, k_min=5.0):
    return PrivacyParams(epsilon=1.0, delta=1e-5, conversion="gdp", budget=budget, kernel=kernel, tau=tau,
                         sigma1=sigma1, sigma2=sigma2, nu=nu, k_min=k_min, planned_queries=None).validate()


def run_engine(X, y, Q, p, *, batch_size, reuse, run_key=1234, n_classes=3, chunk=37):
    n = len(X)
    budgets = BudgetView(spent=np.zeros(n), budget=np.full(n, p.budget), deleted=np.zeros(n, bool),
                         times_selected=np.zeros(n, np.int64))
    pool = ReusePool.empty(X.shape[1]) if reuse else None
    labels, counts = [], []
    for lo in range(0, len(Q), batch_size):
        ans = answer_batch(Q[lo:lo + batch_size], source=ArraySource(X, rows=chunk),
                           row_to_ledger=np.arange(n), row_labels=y, params=p, n_classes=n_classes,
                           budgets=budgets, run_key=run_key, first_index=lo, reuse=pool, device="cpu")
        labels += [a.label for a in ans]
        counts += [a.released_count for a in ans]
    return labels, counts, budgets.spent


@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.3, None), ("rbf", 0.5, 1.0)])
@pytest.mark.parametrize("reuse", [False, True])
def test_engine_equals_reference_for_any_batch_size(kernel, tau, nu, reuse):
    X, y, _ = clustered(120, 8, 3, seed=5)
    Q, _, _ = clustered(60, 8, 3, seed=6)
    Q[10] = X[3]  # a query equal to a private vector, repeated
    Q[11] = X[3]
    p = params(kernel=kernel, tau=tau, nu=nu, budget=0.02, sigma1=8.0)
    spent_ref = [0.0] * len(X)
    ref_labels, ref_counts = reference_answers(
        X, y, Q, params=p, n_classes=3, spent=spent_ref, budget=[p.budget] * len(X), deleted=[False] * len(X),
        run_key=1234, reuse_pool=[] if reuse else None)
    assert max(spent_ref) > 0  # the stream really charged somebody
    for bs in (1, 7, 256):
        labels, counts, spent = run_engine(X, y, Q, p, batch_size=bs, reuse=reuse)
        assert labels == ref_labels
        assert counts == ref_counts
        assert spent.tolist() == spent_ref  # bit-for-bit
        assert (spent <= p.budget).all()


def test_exhausting_stream_never_overspends_and_retires():
    X, y, _ = clustered(50, 8, 3, seed=7)
    Q = np.repeat(X[:1], 400, axis=0)  # 400 copies of one private vector
    p = params(budget=0.01, sigma1=10.0, k_min=1.0)
    _, _, spent = run_engine(X, y, Q, p, batch_size=64, reuse=False)
    assert (spent <= p.budget).all()
    assert spent[0] > p.budget - p.c1  # record 0 was driven to retirement


def test_empty_candidate_set_still_answers_with_noise():
    X, y, _ = clustered(30, 8, 3, seed=8)
    Q = normalize_rows(-X[:20])  # far from everything at τ = 0.9
    p = params(tau=0.9, sigma1=10.0, k_min=30.0)
    labels, counts, spent = run_engine(X, y, Q, p, batch_size=8, reuse=False, run_key=99)
    assert all(c >= p.k_min for c in counts) and min(counts) == p.k_min  # max(0 + σ1·z, K_min)
    assert (spent == 0).all()
    assert len(set(labels)) > 1  # argmax of pure noise, not a fixed label


def test_rbf_dot_threshold_matches_kernel():
    rng = np.random.default_rng(0)
    x = normalize_rows(rng.standard_normal((1000, 8)))
    q = normalize_rows(rng.standard_normal((1, 8)))
    nu, tau = 1.3, 0.4
    k = exact_kernel(x, np.repeat(q, 1000, 0), kernel="rbf", nu=nu)
    s = (x.astype(float) @ q[0].astype(float))
    thr = dot_threshold(kernel="rbf", tau=tau, nu=nu)
    assert ((k >= tau) == (s >= thr))[np.abs(s - thr) > 1e-9].all()


def test_memory_bound_splits_batches_without_changing_answers():
    X, y, _ = clustered(200, 8, 3, seed=21)
    Q, _, _ = clustered(64, 8, 3, seed=22)
    p = params(tau=0.1)
    n = len(X)

    def go(max_pairs):
        b = BudgetView(spent=np.zeros(n), budget=np.full(n, p.budget), deleted=np.zeros(n, bool),
                       times_selected=np.zeros(n, np.int64))
        ans = answer_batch(Q, source=ArraySource(X, rows=50), row_to_ledger=np.arange(n), row_labels=y, params=p,
                           n_classes=3, budgets=b, run_key=5, first_index=0, reuse=ReusePool.empty(8),
                           device="cpu", max_pairs=max_pairs)
        return [a.label for a in ans], [a.released_count for a in ans], b.spent

    unbounded = go(None)
    bounded = go(300)  # far fewer than the ~64×100 pairs: forces repeated halving
    assert unbounded[0] == bounded[0] and unbounded[1] == bounded[1]
    assert (unbounded[2] == bounded[2]).all()


def test_released_counts_lie_on_the_grid_and_drive_the_charges():
    """SPEC §8: K_t is released rounded to 1e-2 (no low-order-bit side channel) and the rounded value is
    the one the charges use. Fails on an engine that releases all 53 bits of |C_t| + σ1·z."""
    X, y, _ = clustered(120, 8, 3, seed=5)
    Q, _, _ = clustered(80, 8, 3, seed=6)
    p = params(budget=0.05, sigma1=7.3, k_min=1.0)
    labels, counts, spent = run_engine(X, y, Q, p, batch_size=16, reuse=False)
    assert any(c > p.k_min for c in counts)
    for c in counts:
        assert c == round(c * 100) / 100, c  # exactly the float nearest to an integer / 100
    assert any(c != int(c) for c in counts)  # a grid of 1e-2, not integers only
    # the charge of a single vote at K_t is w²/(2σ2²K_t) with the *released* K_t: replay one query
    from indknn_cli.engine import release_count
    assert release_count(12.344999, k_min=1.0) == 12.34 and release_count(0.3, k_min=5.0) == 5.0
    with pytest.raises(ValueError):
        release_count(float("nan"), k_min=1.0)


def _near_tau_rows(q: np.ndarray, thr: float, n: int, rng) -> np.ndarray:
    """Unit float32 rows whose dot with the unit query q lies within ~1e-6 of ``thr`` (both sides)."""
    d = q.size
    perp = rng.standard_normal((n, d))
    perp -= np.outer(perp @ q, q)
    perp /= np.linalg.norm(perp, axis=1, keepdims=True)
    c = thr + rng.uniform(-2e-6, 2e-6, n)
    x = c[:, None] * q[None, :] + np.sqrt(1.0 - c * c)[:, None] * perp
    return normalize_rows(x).astype(np.float32)


def _old_exact_candidates(X, Q, *, kernel, tau, nu, row_mask):
    """The pre-block path: every pair's rows gathered, cast to float64, multiplied, summed per row."""
    rows_out, kap_out = [], []
    x64 = X.astype(np.float64)
    for q in Q:
        q64 = np.repeat(q.astype(np.float64)[None, :], len(X), axis=0)
        if kernel == "cosine":
            kap = (x64 * q64).sum(axis=1)
        else:
            diff = x64 - q64
            kap = np.exp(-(diff * diff).sum(axis=1) / (nu * nu))
        ok = (kap >= tau) & row_mask
        rows_out.append(np.flatnonzero(ok))
        kap_out.append(kap[ok])
    return rows_out, kap_out


@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.54, None), ("rbf", 0.6, 1.3)])
def test_blocked_exact_candidates_equal_the_old_per_pair_path_near_tau(kernel, tau, nu):
    """find_candidates (cache-sized float64 blocks, one sort per batch) gives bit for bit the κ and the sets
    of the old per-pair exact path, on rows placed within the fp32 screening margin of τ (both sides)."""
    from indknn_cli.engine import find_candidates

    rng = np.random.default_rng(11)
    d = 96
    Q = normalize_rows(rng.standard_normal((24, d))).astype(np.float32)
    thr = dot_threshold(kernel=kernel, tau=tau, nu=nu)
    X = np.concatenate([_near_tau_rows(Q[t % len(Q)].astype(np.float64), thr, 40, rng) for t in range(30)]
                       + [normalize_rows(rng.standard_normal((300, d))).astype(np.float32)])
    X = X[rng.permutation(len(X))]
    mask = rng.random(len(X)) > 0.1
    ref_rows, ref_kap = _old_exact_candidates(X, Q, kernel=kernel, tau=tau, nu=nu, row_mask=mask)
    assert sum(r.size for r in ref_rows) > 200  # near-τ rows really are candidates …
    below = 0
    for t, q in enumerate(Q):  # … and as many just below τ were screened in and rejected exactly
        k = exact_kernel(X, np.repeat(q[None, :], len(X), axis=0), kernel=kernel, nu=nu)
        below += int(((k < tau) & (k > tau - 1e-5)).sum())
    assert below > 200
    for chunk, batch, block in ((37, 24, 512), (1000, 7, 3), (4096, 1, 512), (333, 5, 1), (4096, 24, 128)):
        for lo in range(0, len(Q), batch):
            c = find_candidates(Q[lo:lo + batch], ArraySource(X, rows=chunk), kernel=kernel, tau=tau, nu=nu,
                                device="cpu", row_mask=mask, max_pairs_block=block)
            for t in range(len(c.rows)):
                assert c.rows[t].tolist() == ref_rows[lo + t].tolist()
                assert c.kappa[t].tolist() == ref_kap[lo + t].tolist()  # bit-identical float64


def _old_exact_kernel_pairs(x, xi, q, qi, *, kernel, nu, block=512):
    """The library's recompute before it read the pairs in row order: each block of pairs gathers both rows
    (kept here as the reference the row-ordered path must equal bit for bit)."""
    out = np.empty(xi.size, dtype=np.float64)
    for lo in range(0, xi.size, block):
        hi = min(xi.size, lo + block)
        out[lo:hi] = exact_kernel(x[xi[lo:hi]], q[qi[lo:hi]], kernel=kernel, nu=nu)
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.54, None), ("rbf", 0.6, 1.3)])
@pytest.mark.parametrize("d", [96, 97, 768])
def test_row_ordered_recompute_equals_the_per_pair_gather_bit_for_bit(kernel, tau, nu, d):
    """exact_kernel_pairs (rows read once in row order, queries cast once and gathered, products reduced
    in place) gives every pair the κ of the per-pair gather path, bit for bit: pairs in row order (the CPU
    screen's), in query order and shuffled (the GPU screen's, sorted inside), a row with more pairs than a
    block, repeated pairs, any block size; near-τ rows so that the last bits decide κ ≥ τ."""
    from indknn_cli.engine import exact_kernel_pairs

    rng = np.random.default_rng(d)
    Q = normalize_rows(rng.standard_normal((40, d))).astype(np.float32)
    thr = dot_threshold(kernel=kernel, tau=tau, nu=nu)
    X = np.concatenate([_near_tau_rows(Q[t].astype(np.float64), thr, 15, rng) for t in range(40)]
                       + [normalize_rows(rng.standard_normal((200, d))).astype(np.float32)])
    near = np.arange(600)  # row 15t + j lies within ~1e-6 of the threshold for query t
    xi = np.concatenate([near, rng.integers(0, len(X), 3000), np.full(300, 7), np.arange(len(X))])
    qi = np.concatenate([near // 15, rng.integers(0, len(Q), 3000), rng.integers(0, len(Q), 300),
                         np.arange(len(X)) % len(Q)])
    want = _old_exact_kernel_pairs(X, xi, Q, qi, kernel=kernel, nu=nu)
    assert ((want >= tau) & (want < tau + 1e-5)).sum() > 200 and ((want < tau) & (want > tau - 1e-5)).sum() > 200
    by_row = np.argsort(xi, kind="stable")
    by_query = np.lexsort((xi, qi))
    shuffled = rng.permutation(xi.size)
    for order in (by_row, by_query, shuffled):
        for block in (1, 7, 128, 512, 100000):
            for q in (Q, Q.astype(np.float64)):  # the engine passes the batch cast once to float64
                got = exact_kernel_pairs(X, xi[order], q, qi[order], kernel=kernel, nu=nu, block=block)
                assert got.tolist() == want[order].tolist()
        for q in (Q, Q.astype(np.float64)):  # the compiled path (exact_jit, numba), float32 queries in place
            got = exact_kernel_pairs(X, xi[order], q, qi[order], kernel=kernel, nu=nu, compiled=True)
            assert got.tolist() == want[order].tolist()
    assert exact_kernel_pairs(X, xi[:0], Q, qi[:0], kernel=kernel, nu=nu).size == 0


def test_every_row_a_candidate_path_keeps_exact_kappa():
    """A threshold below every dot product (RBF with a wide ν) screens in every (query, row) pair, in row
    order; κ is still the per-pair exact value, whatever the chunk and batch."""
    from indknn_cli.engine import find_candidates

    rng = np.random.default_rng(5)
    X = normalize_rows(rng.standard_normal((90, 33))).astype(np.float32)
    Q = normalize_rows(rng.standard_normal((11, 33))).astype(np.float32)
    assert dot_threshold(kernel="rbf", tau=0.3, nu=3.0) < -1.0
    ref_rows, ref_kap = _old_exact_candidates(X, Q, kernel="rbf", tau=0.3, nu=3.0, row_mask=np.ones(90, bool))
    assert all(r.size == 90 for r in ref_rows)
    for chunk, batch in ((90, 11), (17, 4), (1, 1)):
        for lo in range(0, len(Q), batch):
            c = find_candidates(Q[lo:lo + batch], ArraySource(X, rows=chunk), kernel="rbf", tau=0.3, nu=3.0,
                                device="cpu")
            for t in range(len(c.rows)):
                assert c.rows[t].tolist() == ref_rows[lo + t].tolist()
                assert c.kappa[t].tolist() == ref_kap[lo + t].tolist()
