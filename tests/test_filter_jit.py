"""The compiled filter and the batch's noise drawn at once give the Python loop's answers and charges, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indknn_cli import engine, filter_jit, noise_jit
from indknn_cli.engine import BudgetView, Candidates, answer_batch
from indknn_cli.ledger_state import PrivacyParams


def test_noise_drawn_at_once_is_each_querys_generator():
    for key in (0, 5, (1 << 128) - 1, 0xDEADBEEF << 64, 123456789):
        for first in (0, 17, (1 << 32) - 40):
            got = noise_jit.draw(key, first, 40, 11)
            for t in range(40):
                rng = engine.noise_generator(key, first + t)
                want = np.concatenate([[rng.standard_normal()], rng.standard_normal(10)])  # answer_one's order
                assert np.array_equal(got[t].view(np.int64), want.view(np.int64)), (key, first, t)


def test_noise_rare_ziggurat_paths():
    """Enough draws that the ziggurat's tail (idx 0) and wedge paths run many times."""
    key = 0x0123456789ABCDEF0123456789ABCDEF
    got = noise_jit._draw_compiled(key, 3, 4, 20000)
    assert np.array_equal(got.view(np.int64), noise_jit.draw_numpy(key, 3, 4, 20000).view(np.int64))
    assert np.abs(got).max() > 3.6541528853610087  # a tail draw (beyond the ziggurat's base strip)


def test_seed_states_are_numpys_seed_sequence():
    idx = np.array([0, 1, 2, 1000, 2**31, 2**32 - 1])
    for key in (0, 1, 2**64, 2**127 + 3, (1 << 128) - 1):
        want = np.stack([np.random.SeedSequence(entropy=key, spawn_key=(int(i),)).generate_state(4, np.uint64)
                         for i in idx])
        assert np.array_equal(noise_jit.seed_states(key, idx), want)
    with pytest.raises(ValueError, match="2\\^32"):
        noise_jit.seed_states(1, np.array([2**32]))


def test_draw_falls_back_past_two_to_the_32():
    got = noise_jit.draw(9, 2**32 - 2, 4, 3)  # indices 2^32 − 2 … 2^32 + 1: numpy's generators
    assert np.array_equal(got, noise_jit.draw_numpy(9, 2**32 - 2, 4, 3))


def _params(sigma1, sigma2, k_min, n_budget):
    return PrivacyParams(epsilon=1.0, delta=1e-5, conversion="x", budget=n_budget, kernel="cosine", tau=0.5,
                         sigma1=sigma1, sigma2=sigma2, nu=None, k_min=k_min, planned_queries=None)


def _world(seed, *, m, n, classes, budget, sigma1, sigma2, k_min):
    rng = np.random.default_rng(seed)
    params = _params(sigma1, sigma2, k_min, budget)
    spent = np.where(rng.random(n) < 0.3, budget * rng.random(n), 0.0)
    spent[rng.random(n) < 0.1] = budget  # retired
    near = rng.random(n) < 0.2
    spent[near] = np.nextafter(budget - params.c1, -np.inf) - rng.random(near.sum()) * 1e-15  # at the edge
    deleted = rng.random(n) < 0.05
    row_to_ledger = rng.permutation(n).astype(np.int64)
    labels = rng.integers(0, classes, n).astype(np.int64)
    rows, kap = [], []
    for _ in range(m):
        k = int(rng.integers(0, min(n, 40)))
        r = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        rows.append(r)
        kap.append(0.5 + 0.5 * rng.random(k))
    cands = Candidates(rows, kap)
    budgets = BudgetView(spent=spent, budget=np.full(n, budget), deleted=deleted, times_selected=np.zeros(n, np.int64))
    return params, cands, budgets, row_to_ledger, labels


def _serve(world, *, classes, compiled, batch, min_margin=None, monkeypatch):
    params, cands, budgets, row_to_ledger, labels = world
    budgets = BudgetView(budgets.spent.copy(), budgets.budget.copy(), budgets.deleted.copy(),
                         budgets.times_selected.copy())
    monkeypatch.setattr(filter_jit, "FILTER_MIN_QUERIES", 1 if compiled else 10**9)
    monkeypatch.setattr(filter_jit, "FILTER_MIN_QUERIES_COLD", 1 if compiled else 10**9)
    m = len(cands.rows)
    out, parts = [], []
    for lo in range(0, m, batch):
        budgets.reset_part()
        part = cands.slice(lo, min(m, lo + batch))
        out += answer_batch(np.zeros((len(part), 2), np.float32), source=None, row_to_ledger=row_to_ledger,
                            row_labels=labels, params=params, n_classes=classes, budgets=budgets, run_key=77,
                            first_index=lo, candidates=part, min_margin=min_margin)
        parts.append(budgets.part_charges())
    return out, budgets, parts


def _assert_same(a, b, *, parts=True):
    (ans_a, bud_a, parts_a), (ans_b, bud_b, parts_b) = a, b
    assert [x.label for x in ans_a] == [x.label for x in ans_b]
    assert np.array_equal(np.array([x.released_count for x in ans_a]).view(np.int64),
                          np.array([x.released_count for x in ans_b]).view(np.int64))
    assert np.array_equal(np.array([x.margin for x in ans_a]), np.array([x.margin for x in ans_b]), equal_nan=True)
    assert np.array_equal(bud_a.spent.view(np.int64), bud_b.spent.view(np.int64))
    assert np.array_equal(bud_a.times_selected, bud_b.times_selected)
    assert not parts or len(parts_a) == len(parts_b)
    for (ia, ca), (ib, cb) in zip(parts_a, parts_b) if parts else ():
        assert np.array_equal(ia, ib) and np.array_equal(ca, cb)


@pytest.mark.parametrize("classes", [1, 2, 10])
@pytest.mark.parametrize("seed", range(4))
def test_compiled_filter_equals_the_query_loop(seed, classes, monkeypatch):
    kw = dict(m=300, n=500, classes=classes, budget=0.05 + seed * 0.4, sigma1=3.0 + seed, sigma2=0.6 + 0.3 * seed,
              k_min=[0.25, 1.0, 3.0, 0.5][seed])
    world = _world(seed, **kw)
    want = _serve(world, classes=classes, compiled=False, batch=300, min_margin=0.5, monkeypatch=monkeypatch)
    got = _serve(world, classes=classes, compiled=True, batch=300, min_margin=0.5, monkeypatch=monkeypatch)
    _assert_same(want, got)
    assert any(x.label == engine.ABSTAIN_LABEL for x in want[0]) or classes == 1
    assert want[1].times_selected.sum() > 0
    # and across batch sizes (the noise keyed by query index)
    _assert_same(want, _serve(world, classes=classes, compiled=True, batch=7, min_margin=0.5, monkeypatch=monkeypatch),
                 parts=False)


# k_min within the range the ledger accepts (accounting.PARAM_RANGES: ≥ 1); below it a released count of 0 made
# the charge 0/0 (a RuntimeWarning in every run of this test), which no ledger can reach.
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), budget=st.floats(0.001, 3.0), sigma1=st.floats(0.5, 40.0),
       sigma2=st.floats(0.05, 5.0), k_min=st.floats(1.0, 5.0), classes=st.integers(1, 12))
def test_compiled_filter_property(seed, budget, sigma1, sigma2, k_min, classes):
    world = _world(seed, m=60, n=120, classes=classes, budget=budget, sigma1=sigma1, sigma2=sigma2, k_min=k_min)
    with pytest.MonkeyPatch.context() as mp:
        want = _serve(world, classes=classes, compiled=False, batch=60, monkeypatch=mp)
        got = _serve(world, classes=classes, compiled=True, batch=60, monkeypatch=mp)
    _assert_same(want, got)


def test_size_rule_reads_the_batch_size_only(monkeypatch):
    assert not filter_jit.wanted(10)
    assert filter_jit.wanted(filter_jit.FILTER_MIN_QUERIES_COLD)
    assert not filter_jit.usable(np.array([[1e300, 0.0]]), max_candidates=10, sigma1=1.0)
    assert filter_jit.usable(np.array([[3.0, 0.0]]), max_candidates=10**6, sigma1=50.0)


def test_csr_candidates_give_the_same_answers(monkeypatch):
    """The GPU path's candidates (one array each, CsrCandidates) and their slices: the lists' answers."""
    from indknn_cli.candidates import CsrCandidates

    world = _world(11, m=200, n=300, classes=4, budget=0.4, sigma1=4.0, sigma2=0.8, k_min=1.0)
    params, cands, budgets, row_to_ledger, labels = world
    bounds = np.concatenate([[0], np.cumsum([r.size for r in cands.rows])]).astype(np.int64)
    csr = CsrCandidates(bounds, np.concatenate(cands.rows), np.concatenate(cands.kappa))
    part = csr.slice(50, 120)
    assert len(part) == 70 and all(np.array_equal(a, b) for a, b in zip(part.rows, cands.rows[50:120]))
    want = _serve(world, classes=4, compiled=True, batch=64, monkeypatch=monkeypatch)
    got = _serve((params, csr, budgets, row_to_ledger, labels), classes=4, compiled=True, batch=64,
                 monkeypatch=monkeypatch)
    _assert_same(want, got)
    csr.gather(row_to_ledger, labels)  # the ledger indices and labels read beforehand (serve_pipeline's thread)
    assert csr.slice(3, 9).gathered[2].size == csr.slice(3, 9).flat_rows.size
    _assert_same(want, _serve((params, csr, budgets, row_to_ledger, labels), classes=4, compiled=True, batch=64,
                              monkeypatch=monkeypatch))


def test_a_compile_failure_falls_back_to_the_loop(monkeypatch):
    """numba imports but cannot compile the kernel here (audit 2026-11-27): the batch is answered by the Python
    loop, the same answers and charges, instead of the run failing; later batches skip the compiled filter."""
    from indknn_cli import filter_jit_kernels

    world = _world(5, m=80, n=150, classes=3, budget=0.3, sigma1=4.0, sigma2=0.8, k_min=1.0)
    want = _serve(world, classes=3, compiled=False, batch=80, monkeypatch=monkeypatch)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("numba: lowering failed (test)")

    monkeypatch.setattr(filter_jit_kernels, "filter_batch", broken)
    monkeypatch.setattr(filter_jit, "_kernels", None)  # loaded again (the broken kernel), restored after the test
    _assert_same(want, _serve(world, classes=3, compiled=True, batch=40, monkeypatch=monkeypatch), parts=False)
    assert calls == [1] and filter_jit._kernels is False


@pytest.mark.heavy
def test_a_long_run_of_small_batches_takes_the_compiled_filter_with_the_same_answers(tmp_path, monkeypatch):
    """A run of at least FILTER_MIN_QUERIES_COLD queries in batches of FILTER_MIN_QUERIES or more loads the compiled
    filter up front (its batches each below the cold threshold used the Python loop: a third of a 50,000-query
    serve at N = 5,000); the answers and the ledger are those of the loop."""
    import shutil

    from indknn_cli.benchmarks.serve_speed import make_store
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import serve_queries

    make_store(tmp_path, 400, 16, 4096, 0.5)
    shutil.copytree(tmp_path / "L", tmp_path / "L0")
    mark = (tmp_path / "s.zarr" / "ledger-mark.json").read_bytes()
    calls, prepared = [], []
    orig = filter_jit.answer_batch_compiled
    monkeypatch.setattr(filter_jit, "answer_batch_compiled", lambda *a, **k: calls.append(1) or orig(*a, **k))
    orig_prepare = filter_jit.prepare_run
    monkeypatch.setattr(filter_jit, "prepare_run", lambda n, *, batch: prepared.append((n, batch)) or orig_prepare(
        n, batch=batch))
    loaded, orig_load = [], filter_jit._load
    monkeypatch.setattr(filter_jit, "_load", lambda: loaded.append(1) or orig_load())  # seen (numba may already
    # be imported by an earlier test in this process, so sys.modules alone cannot tell)

    def run(ledger):
        res = serve_queries(store_path=tmp_path / "s.zarr", ledger_path=ledger, query_batch="bench", seed=3,
                            batch_size=512, device="cpu", reuse=False)
        return [(a["label"], a["released_count"]) for a in res.answers], BudgetLedger.open(ledger).state.spent

    compiled, spent_c = run(tmp_path / "L")
    assert prepared == [(4096, 512)] and loaded  # the run's size decides, before the first batch
    assert len(calls) == 8  # then every batch of 512 (each below FILTER_MIN_QUERIES_COLD) took the compiled filter
    monkeypatch.undo()
    assert filter_jit.wanted(512)  # numba loaded: every batch of 512 takes the compiled filter
    (tmp_path / "s.zarr" / "ledger-mark.json").write_bytes(mark)
    monkeypatch.setattr(filter_jit, "wanted", lambda m: False)  # the Python loop
    loop, spent_l = run(tmp_path / "L0")
    assert compiled == loop and np.array_equal(spent_c, spent_l)
