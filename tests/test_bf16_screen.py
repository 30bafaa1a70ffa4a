"""Issue 21: the bf16 screen (bf16_screen) passes a superset of the candidates, so the candidates, their κ and
the answers are those of the fp32 screen, on data placed at the threshold; its margin's closed form; its
scan (numba and numpy) and the threshold's rounding; the switch (INDKNN_SCREEN, the probe)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indknn_cli import bf16_screen, candidates
from indknn_cli.candidates import ArraySource, dot_threshold, exact_kernel, find_candidates

torch = pytest.importorskip("torch")

U = 2.0**-8


def _needs_bf16(dim: int) -> None:
    """Skip where torch's bf16 product fails the probe at ``dim`` (the bf16 screen is then never used there)."""
    if not bf16_screen._probe(dim):
        pytest.skip(f"torch's bf16 product on this machine fails the probe at d = {dim}")


def test_margin_closed_form():
    d = 384
    gamma = d * 2.0**-24 / (1 - d * 2.0**-24)
    a = (2 * U + U * U) + gamma * (1 + U) ** 2 + 2.0**-100
    assert bf16_screen.bf16_screen_margin(dim=d, norm_product=1.0) == pytest.approx((1 + U) * a + U, rel=1e-15)
    assert 0.0117 < bf16_screen.bf16_screen_margin(dim=d, norm_product=1.0) < 0.0118
    assert bf16_screen.bf16_screen_margin(dim=d, norm_product=2.0) > 2 * 0.0117  # scales with B
    with pytest.raises(ValueError, match="dim must be an integer.*0"):
        bf16_screen.bf16_screen_margin(dim=0, norm_product=1.0)
    with pytest.raises(ValueError, match="norm_product must be finite.*nan"):
        bf16_screen.bf16_screen_margin(dim=8, norm_product=float("nan"))


@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 1100), seed=st.integers(0, 2**31 - 1), same_sign=st.booleans())
def test_bf16_scores_stay_within_the_margin(d, seed, same_sign):
    _needs_bf16(d)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((40, d))
    q = rng.standard_normal((30, d))
    if same_sign:
        x, q = np.abs(x), np.abs(q)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    s = torch.mm(torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(q).to(torch.bfloat16).T)
    exact = x.astype(np.float64) @ q.astype(np.float64).T
    norms = np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * np.linalg.norm(q.astype(np.float64), axis=1)
    m = bf16_screen.bf16_screen_margin(dim=d, norm_product=float(norms.max()))
    assert np.abs(s.to(torch.float64).numpy() - exact).max() <= m


def test_round_down_bf16():
    for v in [0.59, -0.59, 0.5, 1.0, 1e-30, -1e-30, 0.0, 0.123456789, -3.3, 2.0**-126, 2.0**-133]:
        bits = bf16_screen._round_down_bf16(v, torch)
        got = float(torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16).to(torch.float64))
        assert got <= v
        # the next bf16 value up is above v: the largest bf16 value not above v
        nxt = bits + 1 if bits >= 0 else (bits - 1 if bits != -32768 else 1)
        up = float(torch.tensor([nxt], dtype=torch.int16).view(torch.bfloat16).to(torch.float64))
        assert up > v or (bits == -32768 and up > 0)


@pytest.mark.parametrize("ordered,level", [(True, 0.3), (False, -0.2), (False, 0.0)])
def test_scan_kernel_and_numpy_agree(ordered, level):
    rng = np.random.default_rng(1)
    vals = (rng.standard_normal((97, 211)) * 0.3).astype(np.float32)
    vals[3, 5], vals[4, 6] = -0.0, 0.0
    s = torch.from_numpy(vals).to(torch.bfloat16)
    bits = bf16_screen._round_down_bf16(level, torch)
    assert (bits > 0) == ordered
    key = bits if ordered else bf16_screen._order_key(bits)
    want = np.argwhere(s.to(torch.float64).numpy() >= float(
        torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16).to(torch.float64)))  # (row, col), row order
    sv = s.view(torch.int16).numpy()
    qi, ri = bf16_screen._scan_numpy(sv, key, ordered)
    assert np.array_equal(np.stack([ri, qi], 1), want)
    kernel = bf16_screen._scan_kernel()
    if kernel is None:
        pytest.skip("numba missing: numpy's scan only")
    for cap in (0, 3, 10**6):  # short buffers: the count is still exact and the caller scans again
        qo, ro = np.empty(cap, np.int32), np.empty(cap, np.int32)
        n = kernel(sv, key, ordered, qo, ro)
        assert n == len(want)
        if cap >= n:
            assert np.array_equal(np.stack([ro[:n], qo[:n]], 1), want)


def _near_threshold(m, d, thr, *, per_query=60, spread=0.03, seed=0):
    """Queries and rows whose dot products with them lie within ±spread of thr (most inside the margin)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((m, d))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    rows = []
    for t in range(m):
        v = rng.standard_normal((per_query, d))
        v -= (v @ q[t])[:, None] * q[t]
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        a = np.clip(thr + rng.uniform(-spread, spread, per_query), -1, 1)
        rows.append(a[:, None] * q[t] + np.sqrt(1 - a * a)[:, None] * v)
    x = np.concatenate(rows + [rng.standard_normal((500, d))])
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return q.astype(np.float32), x[rng.permutation(len(x))].astype(np.float32)


def _brute(q, x, *, kernel, tau, nu):
    out = []
    for t in range(q.shape[0]):
        kap = exact_kernel(x, np.repeat(q[t:t + 1], x.shape[0], 0), kernel=kernel, nu=nu)
        keep = np.flatnonzero(kap >= tau)
        out.append((keep, kap[keep]))
    return out


@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.59, None), ("cosine", 0.2, None),
                                           ("rbf", 0.5, 1.3)])  # rbf: dot threshold 1 + ν² ln τ / 2 < 0
def test_bf16_candidates_equal_fp32_and_brute_force(monkeypatch, kernel, tau, nu):
    _needs_bf16(96)
    thr = dot_threshold(kernel=kernel, tau=tau, nu=nu)
    q, x = _near_threshold(24, 96, thr)
    src = ArraySource(x, rows=700)
    monkeypatch.setenv("INDKNN_SCREEN", "fp32")
    fp32 = find_candidates(q, src, kernel=kernel, tau=tau, nu=nu, device="cpu")
    monkeypatch.setenv("INDKNN_SCREEN", "bf16")
    screens = []
    real = bf16_screen.Bf16Screen

    def spy(*a, **k):
        screens.append(real(*a, **k))
        return screens[-1]

    monkeypatch.setattr(bf16_screen, "Bf16Screen", spy)
    bf16 = find_candidates(q, src, kernel=kernel, tau=tau, nu=nu, device="cpu")
    assert screens, "the bf16 screen was not used"
    brute = _brute(q, x, kernel=kernel, tau=tau, nu=nu)
    for t in range(q.shape[0]):
        assert np.array_equal(bf16.rows[t], fp32.rows[t]) and np.array_equal(bf16.rows[t], brute[t][0])
        assert bf16.kappa[t].tobytes() == fp32.kappa[t].tobytes() == brute[t][1].tobytes()
    assert sum(r.size for r in bf16.rows) > 100


def test_the_margin_catches_rounding_that_runs_one_way(monkeypatch):
    """Rows and a query whose every shared coordinate loses 0.99·2^-8 of itself in bf16: the bf16 score
    (251/256) falls 0.0077·s below the exact one (0.98807), two bf16 steps below τ. The margin keeps them;
    without it they are lost."""
    _needs_bf16(320)
    d, k, e, a = 320, 251, 0.99 * 2.0**-8, 1 / 16
    q = np.zeros((1, d))
    q[0, :k] = a * (1 + e)  # each rounds down to 1/16 in bf16; ‖q‖ ≈ 0.994
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(20):
        x = np.zeros(d)
        x[:k] = a * (1 + e)
        rest = rng.uniform(0.5, 1.5, d - k)
        x[k:] = rest * math.sqrt(1 - k * (a * (1 + e)) ** 2) / np.linalg.norm(rest)
        rows.append(x)
    x = np.concatenate([np.array(rows), rng.standard_normal((300, d)) / math.sqrt(d)]).astype(np.float32)
    x[20:] /= np.linalg.norm(x[20:], axis=1, keepdims=True)
    q = q.astype(np.float32)
    exact = x.astype(np.float64) @ q[0].astype(np.float64)
    tau = float(exact[:20].min()) - 1e-6  # just under the 20 rows' dot products: they are candidates
    monkeypatch.setenv("INDKNN_SCREEN", "bf16")
    got = find_candidates(q, ArraySource(x), kernel="cosine", tau=tau, nu=None, device="cpu")
    assert got.rows[0].tolist() == np.flatnonzero(exact >= tau).tolist() and got.rows[0].size >= 20
    monkeypatch.setattr(bf16_screen, "SAFETY", 0.0)
    bare = find_candidates(q, ArraySource(x), kernel="cosine", tau=tau, nu=None, device="cpu")
    assert bare.rows[0].size < got.rows[0].size


def test_switch(monkeypatch):
    monkeypatch.setenv("INDKNN_SCREEN", "fp32")
    assert not bf16_screen.wanted(10**6, dim=384)
    monkeypatch.setenv("INDKNN_SCREEN", "bf16")
    assert bf16_screen.rule(1, torch_loaded=False)  # forced on, whatever the size or the CPU
    assert bf16_screen.wanted(1, dim=384) == bf16_screen._probe(384)
    for raw in ("auto", "", "nonsense"):
        monkeypatch.setenv("INDKNN_SCREEN", raw)
        assert not bf16_screen.wanted(100, dim=384)  # too few queries for torch's import
        assert bf16_screen.rule(4096, torch_loaded=False) == bf16_screen.cpu_has_bf16()
    # A library that fails the probe leaves the batch on the fp32 screen, with the same candidates.
    monkeypatch.setenv("INDKNN_SCREEN", "bf16")
    monkeypatch.setattr(bf16_screen, "_probed", {})
    monkeypatch.setattr(bf16_screen, "_probe_once", lambda dim: False)
    assert not bf16_screen.wanted(4096, dim=384)
    q, x = _near_threshold(4, 32, 0.5)
    got = find_candidates(q, ArraySource(x), kernel="cosine", tau=0.5, nu=None, device="cpu")
    assert [r.tolist() for r in got.rows] == [b[0].tolist() for b in _brute(q, x, kernel="cosine", tau=0.5, nu=None)]


def test_probe_rejects_a_product_rounded_mid_sum(monkeypatch):
    """A library that rounded its partial sums to bf16 would be caught by the probe."""
    _needs_bf16(384)
    real_mm = torch.mm

    def rounding_mm(a, b):
        half = a.shape[1] // 2
        p1 = real_mm(a[:, :half], b[:half]).to(torch.bfloat16).to(torch.float32)
        p2 = real_mm(a[:, half:], b[half:]).to(torch.bfloat16).to(torch.float32)
        return (p1 + p2).to(torch.bfloat16)

    monkeypatch.setattr(torch, "mm", rounding_mm)
    assert not bf16_screen._probe_once(384)
    monkeypatch.setattr(torch, "mm", real_mm)
    assert bf16_screen._probe_once(384)
    assert math.isfinite(bf16_screen.bf16_screen_margin(dim=384, norm_product=1.0))


def test_serve_answers_and_ledger_equal_under_either_screen(tmp_path, monkeypatch):
    """A whole serve-queries run (record unit, reuse on) with the bf16 screen forced gives the fp32 screen's
    answers and ledger, bit for bit."""
    _needs_bf16(48)
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import build_index, make_params, serve_queries
    from indknn_cli.store import ExtractorInfo, FeatureStore

    from .conftest import clustered

    n, d, m = 3000, 48, 120
    x, y, _ = clustered(n + m, d, 4, seed=11, spread=1.5)
    results = {}
    for mode in ("fp32", "bf16"):
        sp, lp = tmp_path / f"{mode}.zarr", tmp_path / f"{mode}-ledger"
        store = FeatureStore.create(sp, extractor=ExtractorInfo("vectors", "none", "1"), dim=d,
                                    label_names=["a", "b", "c", "d"])
        store.append("private", x[:n], labels=y[:n], record_ids=[f"r{i}" for i in range(n)])
        store.append("query", x[n:], record_ids=[f"q{i}" for i in range(m)], batch="b")
        build_index(store_path=sp, ledger_path=lp,
                    params=make_params(epsilon=1.0, delta=1e-5, tau=0.55, sigma2=0.5, planned_queries=m))
        monkeypatch.setenv("INDKNN_SCREEN", mode)
        used = []
        real = bf16_screen.Bf16Screen
        monkeypatch.setattr(bf16_screen, "Bf16Screen", lambda *a, **k: used.append(1) or real(*a, **k))
        res = serve_queries(store_path=sp, ledger_path=lp, query_batch="b", seed=5, batch_size=40, device="cpu")
        monkeypatch.setattr(bf16_screen, "Bf16Screen", real)
        assert bool(used) == (mode == "bf16")
        results[mode] = (res.answers, BudgetLedger.open(lp).state)
    (a1, s1), (a2, s2) = results["fp32"], results["bf16"]
    assert a1 == a2 and sum(a["released_count"] > 0 for a in a1) > m // 2
    for name in ("spent", "times_selected", "budget", "deleted"):
        assert getattr(s1, name).tobytes() == getattr(s2, name).tobytes(), name
    assert (s1.spent > 0).sum() > m


def test_many_tiles_across_workers_and_grown_buffers(monkeypatch):
    """Small tiles cut across two workers, scan buffers that must grow: the same candidates and κ as the
    fp32 screen and brute force (the tile offsets, the runs' order and the rescan all matter here)."""
    _needs_bf16(64)
    q, x = _near_threshold(40, 64, 0.3, per_query=40, spread=0.2, seed=4)
    src = ArraySource(x, rows=1000)
    monkeypatch.setenv("INDKNN_SCREEN", "fp32")
    fp32 = find_candidates(q, src, kernel="cosine", tau=0.3, nu=None, device="cpu")
    monkeypatch.setenv("INDKNN_SCREEN", "bf16")
    monkeypatch.setattr(bf16_screen, "TILE_BYTES", 2 * 40 * 37)  # 37 rows a tile: 28 tiles per 1,000-row chunk
    monkeypatch.setattr(bf16_screen, "SCAN_BUFFER", 3)
    monkeypatch.setattr(bf16_screen, "usable_cores", lambda **k: 2)
    gets = []
    real_get = bf16_screen._pool.get
    monkeypatch.setattr(bf16_screen._pool, "get", lambda w: gets.append(w) or real_get(w))
    got = find_candidates(q, src, kernel="cosine", tau=0.3, nu=None, device="cpu")
    assert gets, "the tiles were not cut across the pool"
    brute = _brute(q, x, kernel="cosine", tau=0.3, nu=None)
    for t in range(q.shape[0]):
        assert np.array_equal(got.rows[t], fp32.rows[t]) and np.array_equal(got.rows[t], brute[t][0])
        assert got.kappa[t].tobytes() == fp32.kappa[t].tobytes()
    assert sum(r.size for r in got.rows) > 500


@pytest.mark.parametrize("scale", [2.0**-84, 1.0, 3.0, 2.0**60])
def test_query_norms_far_from_one(monkeypatch, scale):
    """Queries are not unit vectors: tiny ones (whose fp32 sum of squares would underflow) keep their margin,
    long ones are left to the fp32 screen; the candidates are brute force's either way."""
    _needs_bf16(32)
    q, x = _near_threshold(6, 32, 0.5, seed=5)
    q = (q * np.float32(scale)).astype(np.float32)
    tau = 0.5 * scale
    monkeypatch.setenv("INDKNN_SCREEN", "bf16")
    screens = []
    real = bf16_screen.Bf16Screen
    monkeypatch.setattr(bf16_screen, "Bf16Screen", lambda *a, **k: screens.append(real(*a, **k)) or screens[-1])
    got = find_candidates(q, ArraySource(x), kernel="cosine", tau=tau, nu=None, device="cpu")
    assert screens and screens[0].usable == (scale <= bf16_screen.MAX_QUERY_NORM)
    brute = _brute(q, x, kernel="cosine", tau=tau, nu=None)
    assert [r.tolist() for r in got.rows] == [b[0].tolist() for b in brute]
    assert sum(r.size for r in got.rows) > 20


def test_the_margin_band_is_refined_in_fp32_before_the_exact_recompute(monkeypatch):
    """The bf16 margin band passes several times the candidates; the fp32 test at the fp32 screen's own level
    leaves about as many pairs for the exact recompute as FAISS's screen does, and the same candidates."""
    _needs_bf16(64)
    q, x = _near_threshold(30, 64, 0.5, per_query=80, spread=0.05, seed=9)
    src = ArraySource(x, rows=900)
    counted = []
    real = candidates.exact_kernel_pairs
    monkeypatch.setattr(candidates, "exact_kernel_pairs", lambda x_, xi, *a, **k: counted.append(xi.size) or real(x_, xi, *a, **k))
    runs = {}
    for mode, refine in (("fp32", True), ("bf16", True), ("bf16", False)):
        monkeypatch.setenv("INDKNN_SCREEN", mode)
        if not refine:
            real_screen = bf16_screen.Bf16Screen
            monkeypatch.setattr(bf16_screen, "Bf16Screen", lambda qq, thr, **k: real_screen(qq, thr))
        counted.clear()
        got = find_candidates(q, src, kernel="cosine", tau=0.5, nu=None, device="cpu")
        runs[(mode, refine)] = (sum(counted), [r.tolist() for r in got.rows])
    (n32, c32), (n16, c16), (nraw, craw) = runs[("fp32", True)], runs[("bf16", True)], runs[("bf16", False)]
    assert c32 == c16 == craw
    assert n16 <= n32 + 5 and nraw > 1.25 * n16


@pytest.mark.parametrize("numba_path", [True, False])
@pytest.mark.parametrize("d", [768, 4096])
def test_refine_keeps_pairs_whose_fp32_dot_falls_below_the_threshold(monkeypatch, numba_path, d):
    """Pairs whose fp32 dot (a query of norm 2, positive components) comes out below their exact dot, with
    the threshold set to exactly that exact dot: the refine keeps every one (its level is the threshold
    less screening_margin); at the threshold itself it would lose about half."""
    rng = np.random.default_rng(d)
    x = rng.uniform(0.5, 1.5, (300, d))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    q = rng.uniform(0.5, 1.5, (1, d))
    q = (2 * q / np.linalg.norm(q)).astype(np.float32)
    exact = x.astype(np.float64) @ q[0].astype(np.float64)
    fp32 = np.einsum("ij,j->i", x, q[0])  # one fp32 order; any order is within the margin
    below = np.flatnonzero(fp32.astype(np.float64) < exact)
    assert below.size > 20
    if not numba_path:
        monkeypatch.setattr(bf16_screen, "_refine_kernel", lambda: None)
    for t in range(0, x.shape[0], 3):
        thr = float(exact[t])
        screen = bf16_screen.Bf16Screen(q, thr, fp32_level=thr - candidates.screening_margin(d))
        ri = np.arange(x.shape[0], dtype=np.int64)
        qi, kept = screen._refine(x, np.zeros_like(ri), ri)
        assert set(np.flatnonzero(exact >= thr)) <= set(kept.tolist())
    # Sensitivity: with the level at the threshold itself, some of these pairs are lost (each path adds in
    # its own order, so every row is tried, not only those whose einsum dot fell below).
    lost = 0
    for t in range(x.shape[0]):
        thr = float(exact[t])
        screen = bf16_screen.Bf16Screen(q, thr, fp32_level=thr)
        ri = np.arange(x.shape[0], dtype=np.int64)
        _, kept = screen._refine(x, np.zeros_like(ri), ri)
        lost += t not in set(kept.tolist())
    assert lost > 0


def test_prepare_reads_the_run_and_its_batches(monkeypatch):
    """serve-queries loads torch for the bf16 screen when the run repays the import and its batches will take
    the screen, not for a long run of batches too small to (whatever the CPU, for the rule's part)."""
    monkeypatch.delenv("INDKNN_SCREEN", raising=False)
    monkeypatch.setattr(bf16_screen, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(bf16_screen, "_probe", lambda dim: True)
    assert bf16_screen.prepare(20_000, dim=768, batch=1024)
    assert bf16_screen.prepare(2_000_000, dim=64, batch=1024)  # loaded; each batch then decides (below)
    # once loaded, every batch of 256 queries or more takes it, whatever the rows stored (review 27)
    assert bf16_screen.rule(1024, torch_loaded=True)
    assert not bf16_screen.rule(255, torch_loaded=True)
    assert not bf16_screen.prepare(1_000, dim=384, batch=1024)  # a cron day: the import never repaid
    assert not bf16_screen.prepare(20_000, dim=768, batch=128)  # batches too small to take the screen
    monkeypatch.setattr(bf16_screen, "cpu_has_bf16", lambda: False)
    assert not bf16_screen.prepare(20_000, dim=768, batch=1024)
