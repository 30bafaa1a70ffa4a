"""index --tune (issue 18): private (τ, σ2) search accounted by dp-accounting, composed with serving by RDP."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from indknn_cli import tuning
from indknn_cli.cli.app import app
from indknn_cli.errors import BadInputError, LedgerError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.report import build_account_report
from indknn_cli.serving import build_index, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

runner = CliRunner()
FAST = dict(taus=(0.3, 0.6), sigma2s=(0.5, 1.0), n_val=40, mean_runs=3.0, share=0.3, planned_queries=100)


def _req(**kw):
    return tuning.TuneRequest(**{**dict(epsilon=2.0, delta=1e-5, seed=7), **FAST, **kw})


# -- accounting -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("mean", [1.5, 2.0, 3.0, 10.0, 30.0, 100.0])
def test_the_number_of_runs_is_sampled_with_a_mean_no_larger_than_the_one_accounted(shape, mean):
    """Review 44, L1: K was drawn from the TNB at dp-accounting's γ (the lower end of its bisection), whose mean
    is up to ~4e-10 above the mean the bound is evaluated at, so the composed ε sat ~1e-10 above its target. The
    sampled γ is now ≥ the accountant's (its log(1/γ) term rounds against the user) and its mean ≤ the accounted
    mean (the log(mean) term too), and no further from it than a relative 1e-8."""
    from dp_accounting.rdp.rdp_privacy_accountant import (_gamma_truncated_negative_binomial,
                                                          _truncated_negative_binomial_mean)

    from indknn_cli.tuning_accounting import sampling_gamma

    gamma = sampling_gamma(shape=shape, mean_runs=mean)
    assert gamma >= _gamma_truncated_negative_binomial(shape, mean)
    sampled_mean = _truncated_negative_binomial_mean(gamma, shape)
    assert sampled_mean <= mean and (mean - sampled_mean) / mean < 1e-8


@pytest.mark.parametrize("shape,mean", [(1e9, 2.0), (1e6, 1.001), (2.0, 1 + 1e-9), (0.5, 1 + 1e-8)])
def test_extreme_shapes_and_means_near_one_draw_quickly_at_the_accounted_mean(shape, mean):
    """Review 45: at η = 1e9 the doubling step overshot γ (K drawn at a mean 9 % below the accounted one: safe, but
    a utility loss); at a mean close to 1 with η > 0, rejection sampling of K ≥ 1 accepted with probability
    1 − γ^η ≈ 8e-10 and `index --tune` hung under the ledger's lock. A bounded bisection, and inversion there."""
    import signal

    from dp_accounting.rdp.rdp_privacy_accountant import _truncated_negative_binomial_mean

    from indknn_cli.tuning_accounting import draw_runs, sampling_gamma

    gamma = sampling_gamma(shape=shape, mean_runs=mean)
    got = _truncated_negative_binomial_mean(gamma, shape)
    assert got <= mean and (mean - got) / mean < 1e-4

    def _hung(*_):
        raise TimeoutError("draw_runs did not return")

    old = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(30)
    try:
        rng = np.random.default_rng(1)
        ks = [tuning.draw_runs(mean_runs=mean, shape=shape, rng=rng) for _ in range(50)]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert min(ks) >= 1 and draw_runs is tuning.draw_runs


@pytest.mark.parametrize("shape", [0.0, 1.0, 2.5, "poisson"])
def test_tuning_cost_is_dp_accountings_figure(shape):
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    rho, mean, delta = 3e-3, 7.0, 1e-6
    acc = RdpAccountant(orders=list(tuning.ORDERS))
    sh = math.inf if shape == "poisson" else shape
    acc.compose(dp_event.RepeatAndSelectDpEvent(event=dp_event.ZCDpEvent(rho=rho), mean=mean, shape=sh))
    ref = acc.get_epsilon(delta)
    got = tuning.tuning_epsilon(rho_run=rho, mean_runs=mean, shape=shape, delta=delta, method="random-search")
    assert got == math.nextafter(ref, math.inf)
    # composed with serving: the same accountant with ZCDpEvent(B) added
    acc.compose(dp_event.ZCDpEvent(rho=0.01))
    assert tuning.composed_epsilon(rho_run=rho, mean_runs=mean, shape=shape, budget_serve=0.01,
                                   delta=delta, method="random-search") == math.nextafter(acc.get_epsilon(delta), math.inf)
    # repeat-and-select costs more than one run, never less
    acc1 = RdpAccountant(orders=list(tuning.ORDERS))
    acc1.compose(dp_event.ZCDpEvent(rho=rho))
    assert got > acc1.get_epsilon(delta)


@pytest.mark.heavy
@pytest.mark.parametrize("epsilon", [0.5, 2.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-9])
@pytest.mark.parametrize("mean,shape", [(2.0, 1.0), (10.0, "poisson"), (10.0, 0.0)])
def test_composed_epsilon_never_exceeds_the_target(epsilon, delta, mean, shape):
    rs = dict(mean_runs=mean, shape=shape, method="random-search")
    rho = tuning.rho_for_share(epsilon=epsilon, delta=delta, share=0.25, **rs)
    assert tuning.tuning_epsilon(rho_run=rho, delta=delta, **rs) <= 0.25 * epsilon
    b = tuning.serving_budget(epsilon=epsilon, delta=delta, rho_run=rho, **rs)
    kw = dict(rho_run=rho, delta=delta, **rs)
    assert tuning.composed_epsilon(budget_serve=b, **kw) <= epsilon
    assert tuning.composed_epsilon(budget_serve=b * (1 + 1e-6), **kw) > epsilon * (1 - 1e-5)  # tight, not wasteful


def test_exp_mech_cost_is_dp_accountings_zcdp_figure():
    """--tune-method exp-mech: the selection is one ZCDpEvent(ρ), ρ = 1/(2b²) for Gumbel scale b (ε-bounded range
    with ε = 2/b, Durfee & Rogers 2019; ε-BR is ε²/8-zCDP, Cesar & Rogers 2021), composed in the same accountant."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    rho, delta = 3e-3, 1e-6
    acc = RdpAccountant(orders=list(tuning.ORDERS))
    acc.compose(dp_event.ZCDpEvent(rho=rho))
    assert tuning.tuning_epsilon(rho_run=rho, delta=delta, method="exp-mech") == math.nextafter(
        acc.get_epsilon(delta), math.inf)
    acc.compose(dp_event.ZCDpEvent(rho=0.01))
    assert tuning.composed_epsilon(rho_run=rho, budget_serve=0.01, delta=delta, method="exp-mech") == \
        math.nextafter(acc.get_epsilon(delta), math.inf)
    b = tuning.gumbel_scale(rho)
    eps_br = 2.0 / b  # the exponential mechanism exp(u/b) with sensitivity 1
    assert eps_br ** 2 / 8.0 == pytest.approx(rho, rel=1e-12)
    # one selection over the whole grid costs less than a random search of mean 10 runs at the same ρ
    assert tuning.tuning_epsilon(rho_run=rho, delta=delta, method="exp-mech") < \
        tuning.tuning_epsilon(rho_run=rho, mean_runs=10.0, shape=0.0, delta=delta, method="random-search")


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-9])
@pytest.mark.parametrize("share", [0.05, 0.2, 0.5])
def test_exp_mech_composed_epsilon_never_exceeds_the_target(epsilon, delta, share):
    kw = dict(delta=delta, method="exp-mech")
    rho = tuning.rho_for_share(epsilon=epsilon, share=share, **kw)
    assert tuning.tuning_epsilon(rho_run=rho, **kw) <= share * epsilon
    b = tuning.serving_budget(epsilon=epsilon, rho_run=rho, **kw)
    assert tuning.composed_epsilon(rho_run=rho, budget_serve=b, **kw) <= epsilon
    assert tuning.composed_epsilon(rho_run=rho, budget_serve=b * (1 + 1e-6), **kw) > epsilon * (1 - 1e-5)


def test_exp_mech_select_draws_from_the_exponential_mechanism():
    """Closed form: P[g] ∝ exp(score_g / b). Scores (0, b·ln 2, b·ln 4) → 1/7, 2/7, 4/7; reproducible under its rng."""
    rho = 0.02
    b = tuning.gumbel_scale(rho)
    scores = [0.0, b * math.log(2.0), b * math.log(4.0)]
    rng = np.random.default_rng(5)
    picks = np.bincount([tuning.exp_mech_select(scores, rho=rho, rng=rng) for _ in range(21000)], minlength=3)
    assert np.allclose(picks / picks.sum(), [1 / 7, 2 / 7, 4 / 7], atol=0.012)
    a = [tuning.exp_mech_select(scores, rho=rho, rng=np.random.default_rng(9)) for _ in range(3)]
    assert len(set(a)) == 1
    with pytest.raises(ValueError):
        tuning.exp_mech_select([], rho=rho, rng=rng)
    with pytest.raises(BadInputError, match="tune-method"):
        tuning.check_method("grid")


def test_an_epsilon_the_accountant_cannot_evaluate_is_refused_not_a_traceback():
    """dp-accounting's repeat-and-select hits a math domain error for tiny ρ: a clear refusal, never a crash."""
    with pytest.raises(BadInputError, match="no positive per-run budget"):
        tuning.rho_for_share(epsilon=0.01, delta=1e-30, share=0.01, mean_runs=10.0, shape="poisson",
                             method="random-search")


def test_share_too_large_or_nonsense_is_refused_naming_the_value():
    with pytest.raises(BadInputError, match="tune-share"):
        tuning.rho_for_share(epsilon=1.0, delta=1e-5, share=1.5, mean_runs=5, shape=1, method="random-search")
    with pytest.raises(BadInputError, match="tune-shape"):
        tuning.check_shape("geometric")
    with pytest.raises(BadInputError, match="tune-runs"):
        tuning.tuning_event(rho_run=1e-3, mean_runs=0.5, shape=1.0, method="random-search")
    with pytest.raises(TypeError):  # the method is never implied: a caller that forgets it is refused
        tuning.tuning_epsilon(rho_run=1e-3, mean_runs=10.0, shape=0.0, delta=1e-5)


@pytest.mark.parametrize("shape", [0.0, 1.0, 3.0, "poisson"])
def test_number_of_runs_has_the_accounted_mean(shape):
    rng = np.random.default_rng(0)
    k = np.array([tuning.draw_runs(mean_runs=6.0, shape=shape, rng=rng) for _ in range(6000)])
    assert abs(k.mean() - 6.0) < 0.35
    if shape != "poisson":
        assert k.min() >= 1


def test_shard_coins_depend_on_the_record_only():
    ids = [f"r{i}" for i in range(500)]
    shard, val = tuning.shard_split(ids, n_shards=20, seed_text="seed:1")
    shard2, val2 = tuning.shard_split(ids[:250] + ids[251:], n_shards=20, seed_text="seed:1")
    assert np.array_equal(np.delete(shard, 250), shard2)
    changed = [s for s in range(20) if (val[s] if val[s] < 250 else val[s] - 1) != val2[s] and val[s] != 250]
    assert changed == []  # removing one record changes at most its own shard's validation record
    for s in range(20):
        members = np.flatnonzero(shard == s)
        assert val[s] in members


# -- the default σ2 grid: budget-relative ------------------------------------------------------------------------
def test_default_sigma2_grid_scales_with_sqrt_planned_queries_over_budget():
    from indknn_cli.tuning_grid import DEFAULT_SIGMA2S, REFERENCE_BUDGET_PER_QUERY, budget_relative_sigma2s

    # at the reference budget per query the grid is the base grid; 4× the budget per query halves every σ2
    assert budget_relative_sigma2s(budget=REFERENCE_BUDGET_PER_QUERY * 1000, planned_queries=1000) == DEFAULT_SIGMA2S
    assert budget_relative_sigma2s(budget=REFERENCE_BUDGET_PER_QUERY * 250, planned_queries=250) == DEFAULT_SIGMA2S
    assert budget_relative_sigma2s(budget=4 * REFERENCE_BUDGET_PER_QUERY * 1000,
                                   planned_queries=1000) == (0.25, 0.4, 0.6)
    # None / 0 planned queries read as serving's default 1,000
    assert budget_relative_sigma2s(budget=0.05, planned_queries=None) == budget_relative_sigma2s(
        budget=0.05, planned_queries=1000)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(BadInputError, match=repr(bad)):
            budget_relative_sigma2s(budget=bad, planned_queries=1000)
    with pytest.raises(BadInputError, match="-3"):
        budget_relative_sigma2s(budget=0.05, planned_queries=-3)
    assert budget_relative_sigma2s(budget=np.float64(0.05), planned_queries=np.int64(1000)) == \
        budget_relative_sigma2s(budget=0.05, planned_queries=1000)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_private_search_grid_is_fixed_by_public_figures_only(epsilon):
    """The default grid is the same for two unrelated private sets: it reads ε, δ, T and the search's settings."""
    from indknn_cli.tuning_grid import budget_relative_sigma2s

    grids = []
    for seed in (1, 2):
        x, y, _ = clustered(120 + 40 * seed, 8, 3, seed=seed)
        rec, params = tuning.private_tune_arrays(
            x, y, n_classes=3,
            req=tuning.TuneRequest(epsilon=epsilon, delta=1e-5, seed=seed, taus=(0.3,), n_val=20, mean_runs=2.0,
                                   planned_queries=400))
        assert rec.sigma2_grid.startswith("budget-relative")
        assert [g[1] for g in rec.grid] == list(budget_relative_sigma2s(budget=rec.budget_serve, planned_queries=400))
        assert params.sigma2 in [g[1] for g in rec.grid]
        grids.append(rec.grid)
    assert grids[0] == grids[1]
    given, _ = tuning.private_tune_arrays(x, y, n_classes=3,
                                          req=tuning.TuneRequest(epsilon=epsilon, delta=1e-5, seed=1, taus=(0.3,),
                                                                 sigma2s=(0.7,), n_val=20, mean_runs=2.0))
    assert given.grid == [[0.3, 0.7]] and given.sigma2_grid == "given"


# -- the default τ grid: a public prior on the extractor ---------------------------------------------------------
def test_default_tau_grid_is_the_extractors_prior_and_maps_to_rbf():
    from indknn_cli.tuning_grid import BROAD_TAUS, TAU_PRIORS, default_taus

    assert default_taus(extractor="text", kernel="cosine") == (TAU_PRIORS["text"], "prior for text features")
    assert default_taus(extractor="hog:hog-28-9", kernel="cosine")[0] == (0.6, 0.65, 0.7, 0.75, 0.8)
    assert default_taus(extractor="pixels", kernel="cosine")[0] == (0.5, 0.55, 0.6, 0.65, 0.7)
    for other in ("vectors", "image", None, ""):
        taus, rule = default_taus(extractor=other, kernel="cosine")
        assert taus == BROAD_TAUS and rule.startswith("broad") and "--tune-taus" in rule
    # RBF on unit vectors: κ = exp(−‖x − q‖²/ν²) = exp(−(2 − 2·cos)/ν²), so the mapped grid selects the same pairs
    nu = math.exp(1.5)
    taus, rule = default_taus(extractor="text", kernel="rbf", nu=nu)
    assert "RBF" in rule and all(0 < t < 1 for t in taus) and list(taus) == sorted(taus)
    for c, t in zip(TAU_PRIORS["text"], taus):
        assert t == pytest.approx(math.exp(-(2 - 2 * c) / nu**2), rel=1e-5)
    rng = np.random.default_rng(0)
    x, q = rng.standard_normal((400, 8)), rng.standard_normal((1, 8))
    x /= np.linalg.norm(x, axis=1, keepdims=True); q /= np.linalg.norm(q)
    cos, rbf = x @ q[0], np.exp(-((x - q) ** 2).sum(1) / nu**2)
    for c, t in zip(TAU_PRIORS["text"], taus):
        away = np.abs(cos - c) > 1e-4  # the 6-digit rounding of the mapped τ moves the boundary by < 1e-5
        assert np.array_equal((cos >= c)[away], (rbf >= t)[away])
    with pytest.raises(BadInputError, match="nu"):
        default_taus(extractor="text", kernel="rbf", nu=0.0)


def test_store_extractor_picks_the_tau_prior_and_the_ledger_records_it(tmp_path):
    """index --tune without --tune-taus reads the store's extractor (public), never the data; given τ: "given"."""
    from indknn_cli.tuning_grid import TAU_PRIORS

    x, y, _ = clustered(300, 16, 3, seed=5)
    for name in ("hog", "vectors"):
        store = FeatureStore.create(tmp_path / f"{name}.zarr", extractor=ExtractorInfo(name, "m", "1"), dim=16,
                                    label_names=["a", "b", "c"])
        store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(300)])
        req = tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=1, n_val=30, mean_runs=2.0, planned_queries=100)
        res = build_index(store_path=store.path, ledger_path=tmp_path / f"l-{name}", params=None, tune=req)
        t = BudgetLedger.open(tmp_path / f"l-{name}").meta["tuning"]
        want = TAU_PRIORS["hog"] if name == "hog" else tuning.default_taus(extractor=name)[0]
        assert sorted({g[0] for g in t["grid"]}) == list(want)
        assert t["tau_grid"] == ("prior for hog features" if name == "hog" else tuning.default_taus(extractor=name)[1])
        assert res.params.tau in want
    rec, _ = tuning.private_tune_arrays(x, y, n_classes=3,
                                        req=tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=1, taus=(0.3,), n_val=20,
                                                               mean_runs=2.0, extractor="hog"))
    assert rec.tau_grid == "given" and {g[0] for g in rec.grid} == {0.3}


# -- the search on a store ----------------------------------------------------------------------------------
@pytest.fixture
def tune_store(tmp_path):
    x, y, _ = clustered(600, 16, 3, seed=3)
    store = FeatureStore.create(tmp_path / "store.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=128)
    store.append("private", x, labels=y, record_ids=[f"r{i:04d}" for i in range(600)])
    q, _, _ = clustered(30, 16, 3, seed=4)
    store.append("query", q, record_ids=[f"q{i:03d}" for i in range(30)], batch="q1")
    return store


def test_reproducible_under_seed(tune_store):
    store = FeatureStore.open(tune_store.path, mode="r")
    a, pa_ = tuning.run_tuning(store, _req())
    b, pb = tuning.run_tuning(store, _req())
    assert a.as_dict() == b.as_dict() and pa_ == pb
    data = tuning.BaseRunData.build(store.read("private", "features"), store.read("private", "labels"),
                                    n_shards=40, seed_text="seed:7",
                                    n_classes=3)
    key = tuning._run_key(7, "tune:run:0")
    s1 = tuning.base_run_correct(data, params=pa_, run_key=key) + tuning.score_noise(key, rho_run=a.rho_run)
    s2 = tuning.base_run_correct(data, params=pa_, run_key=key) + tuning.score_noise(key, rho_run=a.rho_run)
    assert s1 == s2
    c = tuning.run_tuning(store, _req(seed=8, mean_runs=8.0)).__getitem__(0)
    assert c.as_dict() != a.as_dict()


def test_base_run_scores_track_accuracy(tune_store):
    """A generous per-run budget: the (unnoised) score prefers a sensible τ to one with no neighbours."""
    from indknn_cli.ledger import PrivacyParams

    store = FeatureStore.open(tune_store.path, mode="r")
    data = tuning.BaseRunData.build(store.read("private", "features"), store.read("private", "labels"),
                                    n_shards=40, seed_text="seed:1",
                                    n_classes=3)
    def p(tau):
        return PrivacyParams(epsilon=8, delta=1e-5, conversion="rdp", budget=5.0, kernel="cosine", tau=tau,
                             sigma1=3.0, sigma2=0.05, nu=None, k_min=1.0, planned_queries=None)
    good = tuning.base_run_correct(data, params=p(0.3), run_key=1)
    none = tuning.base_run_correct(data, params=p(0.99), run_key=1)
    assert good >= 30 and good > none + 10


@pytest.mark.parametrize("emulation", ["emulated_correct", "emulated_expected"])
@pytest.mark.parametrize("n_shards", [7, 40, 900])  # 900 > records: empty shards must not shift other shards' noise
def test_emulated_base_run_moves_by_at_most_one_when_a_record_leaves(tune_store, n_shards, emulation):
    """The score's sensitivity: removing any one record (P or validation) changes the count by at most 1, for
    the search's count of correct shards and for emulated_expected (per-shard chances in [0, 1], selection rates
    from the shard's pairs)."""
    from indknn_cli import tuning_base
    from indknn_cli.ledger import PrivacyParams

    emulate = getattr(tuning_base, emulation)
    store = FeatureStore.open(tune_store.path, mode="r")
    x, y = store.read("private", "features"), store.read("private", "labels")
    ids = store.read("private", "record_id")
    p = PrivacyParams(epsilon=2, delta=1e-5, conversion="rdp", budget=0.05, kernel="cosine", tau=0.3, sigma1=20.0,
                      sigma2=0.3, nu=None, k_min=5.0, planned_queries=100).validate()

    def score(keep):
        data = tuning.BaseRunData.build(x[keep], y[keep], n_shards=n_shards, seed_text="seed:3",
                                        n_classes=3)
        return emulate(data, params=p, run_key=11, n_shards=n_shards, planned_queries=100)

    full = score(np.ones(len(ids), bool))
    _, val = tuning.shard_split(tuning.content_keys(x, y), n_shards=n_shards, seed_text="seed:3")
    leave = list(val[val >= 0][:6]) + [0, 1, 2, 299, 599]  # validation records and P records
    moved = []
    for r in leave:
        keep = np.ones(len(ids), bool)
        keep[r] = False
        moved.append(abs(score(keep) - full))
        assert moved[-1] <= (1 if emulation == "emulated_correct" else 1.0 + 1e-9), r
    if emulation == "emulated_expected":
        assert max(moved) > 0  # the score does read the records


def test_count_from_the_shards_pairs_not_from_the_querys_own_hits():
    """count="pairs" (the search's default): a query with no sampled candidate in a neighbourhood whose pairs are
    within τ is no longer a guess (count="query" scored it 1/n exactly, although at full scale it has candidates),
    and a single hit where the shard's pairs are rarely within τ no longer stands for S candidates (vote noise then
    flips it more). Both terms stay in [0, 1]."""
    from indknn_cli.ledger import PrivacyParams
    from indknn_cli.tuning_base import COUNT, emulated_expected

    assert COUNT == "pairs" and "count from the shard's pairs" in tuning.EMULATION
    rng = np.random.default_rng(0)
    p = PrivacyParams(epsilon=2, delta=1e-5, conversion="rdp", budget=0.5, kernel="cosine", tau=0.5, sigma1=5.0,
                      sigma2=0.5, nu=None, k_min=1.0, planned_queries=20).validate()

    def val_of(x, y):  # one shard holding every record: its validation record has the lowest coin (by content)
        data = tuning.BaseRunData.build(x, y, n_shards=1, seed_text="seed:9", n_classes=3)
        return data, int(data.val_row[0])

    def chance(data, count):
        return emulated_expected(data, params=p, run_key=4, n_shards=1, planned_queries=20, sharpen=1.0, count=count)

    # (a) a tight one-class cluster of 12 and one far record, scaled until its coin makes it the validation record
    cluster = np.eye(8)[0] + 0.05 * rng.standard_normal((12, 8))
    y = np.zeros(13, np.int64)
    for k in range(200):
        x = np.vstack([cluster, (1.0 + 0.01 * k) * np.eye(8)[3][None, :]]).astype(np.float32)
        data, v = val_of(x, y)
        if v == 12:
            break
    assert v == 12
    assert chance(data, "query") == pytest.approx(1.0 / 3)                   # no candidate: a guess
    assert 1.0 / 3 < chance(data, "pairs") <= 1.0                           # the neighbourhood answers it

    # (b) records spread apart (pairs rarely within τ), and a near twin of the validation record, of its label
    spread = np.eye(16)[:14] + 0.01 * rng.standard_normal((14, 16))
    y = (np.arange(15) % 3).astype(np.int64)
    _, v = val_of(spread.astype(np.float32), y[:14])
    y[14] = y[v]
    for k in range(200):
        x = np.vstack([spread, (1.0 + 0.01 * k) * spread[v][None, :] + 0.001]).astype(np.float32)
        data, v2 = val_of(x, y)
        if v2 in (v, 14):
            break
    assert v2 in (v, 14)                                                     # the pair holds the validation record
    q, pr = chance(data, "query"), chance(data, "pairs")
    assert 0 <= pr < q <= 1                                                  # one hit no longer stands for S records


@pytest.mark.parametrize("count", ["pairs", "query"])
def test_a_one_class_store_keeps_every_term_in_the_unit_interval(count):
    """Review 78, F1: with one class the chance's wrong-answer share f/(n − 1) was 0/0, so every shard with a pair
    within τ scored NaN; adding one record then turned a released choice into an error. Each term is now kept in
    [0, 1] (one class: every answer is right), and the search runs with and without the extra record."""
    from indknn_cli.benchmarks.private_tuning import tune_request
    from indknn_cli.ledger import PrivacyParams
    from indknn_cli.benchmarks.config import BenchConfig

    rng = np.random.default_rng(1)
    x = (np.eye(6)[0] + 0.1 * rng.standard_normal((60, 6))).astype(np.float32)
    y = np.zeros(60, np.int64)
    p = PrivacyParams(epsilon=2, delta=1e-5, conversion="rdp", budget=0.05, kernel="cosine", tau=0.5, sigma1=20.0,
                      sigma2=0.5, nu=None, k_min=5.0, planned_queries=100).validate()
    for xs, ys in ((x, y), (np.vstack([x, x[:1]]), np.r_[y, 0])):  # and with a twin of one record added
        data = tuning.BaseRunData.build(xs, ys, n_shards=6, seed_text="seed:2", n_classes=1)
        score = tuning.emulated_expected(data, params=p, run_key=3, n_shards=6, planned_queries=100, count=count)
        assert math.isfinite(score) and 0.0 <= score <= 6.0
    if count == "pairs":  # the search's default: it selects on one-class data, before and after the extra record
        cfg = BenchConfig.make(quick=True, seed=0, epsilons=(2.0,), draws=1)
        cfg.tune_taus, cfg.tune_queries = (0.3, 0.6), 6
        for xs, ys in ((x, y), (np.vstack([x, x[:1]]), np.r_[y, 0])):
            rec, _ = tuning.private_tune_arrays(xs, ys, n_classes=1, req=tune_request(cfg, eps=2.0, T=100, seed=4))
            assert [rec.chosen_tau, rec.chosen_sigma2] in rec.grid


def test_emulated_base_run_punishes_a_sigma2_that_runs_budgets_dry(tune_store):
    """At full scale a tiny σ2 spends each record within a few queries; the emulation sees it (one query would not)."""
    from indknn_cli.ledger import PrivacyParams
    from indknn_cli.tuning_base import emulated_correct

    store = FeatureStore.open(tune_store.path, mode="r")
    data = tuning.BaseRunData.build(store.read("private", "features"), store.read("private", "labels"),
                                    n_shards=60, seed_text="seed:1", n_classes=3)

    def correct(s2, budget):
        p = PrivacyParams(epsilon=1, delta=1e-5, conversion="rdp", budget=budget, kernel="cosine", tau=0.3,
                          sigma1=30.0, sigma2=s2, nu=None, k_min=10.0, planned_queries=300).validate()
        return np.mean([emulated_correct(data, params=p, run_key=k, n_shards=60, planned_queries=300)
                        for k in range(5)])

    assert correct(0.02, 1.0) < correct(0.5, 1.0) - 10  # the budget is gone before most queries
    assert correct(0.02, 1e4) >= correct(0.5, 1e4) - 2  # a budget that lasts: a small σ2 costs nothing


def _tune_data(store, n_shards, seed_text="seed:1"):
    return tuning.BaseRunData.build(store.read("private", "features"), store.read("private", "labels"),
                                    n_shards=n_shards, seed_text=seed_text,
                                    n_classes=3)


def test_expected_emulation_reproducible_under_its_run_key(tune_store):
    from indknn_cli.ledger import PrivacyParams

    store = FeatureStore.open(tune_store.path, mode="r")
    p = PrivacyParams(epsilon=1, delta=1e-5, conversion="rdp", budget=0.05, kernel="cosine", tau=0.3, sigma1=20.0,
                      sigma2=0.5, nu=None, k_min=5.0, planned_queries=100).validate()
    a = [tuning.emulated_expected(_tune_data(store, 40), params=p, run_key=k, n_shards=40, planned_queries=100)
         for k in (5, 5, 6)]
    assert a[0] == a[1] and 0 <= a[0] <= 40
    assert a[2] != a[0]  # the count's noise is keyed by the run


def test_expected_emulation_sees_serving_noise_and_depletion(tune_store):
    """What the shard alone cannot show: at full scale a larger σ2 flips more answers when budgets last (the
    indicator emulation barely sees it, its one- or two-record margins being far wider than serving's), and a
    σ2 small enough to run budgets dry within the planned queries still scores low."""
    from indknn_cli.ledger import PrivacyParams

    store = FeatureStore.open(tune_store.path, mode="r")
    data = _tune_data(store, 60)

    def score(s2, budget, fn=tuning.emulated_expected):
        p = PrivacyParams(epsilon=1, delta=1e-5, conversion="rdp", budget=budget, kernel="cosine", tau=0.3,
                          sigma1=30.0, sigma2=s2, nu=None, k_min=10.0, planned_queries=300).validate()
        return np.mean([fn(data, params=p, run_key=k, n_shards=60, planned_queries=300) for k in range(3)])

    assert score(0.3, 1e4) > score(3.0, 1e4) + 3  # a budget that lasts: less noise, more right answers
    assert score(0.02, 1.0) < score(0.5, 1.0) - 10  # the budget is gone before most queries
    assert tuning.flip_probability(0.0, 4) == pytest.approx(0.75)  # no votes: 1/n of the answers right
    assert tuning.flip_probability(1e6, 4) < 1e-5


@pytest.mark.parametrize("method", ["exp-mech", "random-search"])
def test_index_tune_records_the_choice_before_any_charge(tune_store, tmp_path, method):
    ledger_path = tmp_path / "ledger"
    res = build_index(store_path=tune_store.path, ledger_path=ledger_path, params=None, tune=_req(method=method))
    led = BudgetLedger.open(ledger_path)
    t = led.meta["tuning"]
    # the chosen θ is recorded and is what the ledger serves with
    assert (t["chosen_tau"], t["chosen_sigma2"]) == (led.params.tau, led.params.sigma2)
    assert [t["chosen_tau"], t["chosen_sigma2"]] in t["thetas_tried"] or t["default_used"]
    assert t["method"] == method and t["seed"] == "7"
    if method == "exp-mech":  # every grid point scored; only the chosen index is released, no score
        assert t["thetas_tried"] == t["grid"] and t["runs_drawn"] == 1 and t["chosen_noisy_score"] is None
        assert t["mean_runs"] is None and t["shape"] is None
    else:
        assert t["runs_drawn"] == len(t["thetas_tried"])
    assert led.params.conversion == "rdp" and led.params.budget == t["budget_serve"]
    assert t["epsilon_total"] <= 2.0 and t["epsilon_tuning"] <= 0.3 * 2.0
    assert not any("score" in k and k not in ("chosen_noisy_score", "score_noise_std") for k in t)  # no other run's score
    assert res.as_dict()["epsilon"] <= 2.0
    # the record is in the metadata of the snapshot that created the ledger (generation 0, no event yet):
    # no query can be charged on a ledger that does not carry it
    gen0 = [p for p in ledger_path.glob("snapshot-*.parquet")]
    meta = json.loads(pq.read_schema(gen0[0]).metadata[b"indknn"])
    assert meta["tuning"] == t
    served = serve_queries(store_path=tune_store.path, ledger_path=ledger_path, query_batch="q1", seed=1)
    assert len(served.answers) == 30
    assert BudgetLedger.open(ledger_path).meta["tuning"] == t  # survives compaction


def test_failed_tuning_leaves_no_ledger_and_nothing_to_charge(tune_store, tmp_path, monkeypatch):
    ledger_path = tmp_path / "ledger"

    def boom(store, req):
        raise BadInputError("tuning failed")
    monkeypatch.setattr(tuning, "run_tuning", boom)
    with pytest.raises(BadInputError):
        build_index(store_path=tune_store.path, ledger_path=ledger_path, params=None, tune=_req())
    assert not BudgetLedger.exists(ledger_path)
    with pytest.raises(LedgerError):
        serve_queries(store_path=tune_store.path, ledger_path=ledger_path, query_batch="q1", seed=1)


def test_tune_refused_on_an_existing_ledger_and_with_gdp(tune_store, tmp_path):
    ledger_path = tmp_path / "ledger"
    first = build_index(store_path=tune_store.path, ledger_path=ledger_path, params=None, tune=_req())
    # the same request again is a re-run (review 44): nothing is tuned again
    again = build_index(store_path=tune_store.path, ledger_path=ledger_path, params=None, tune=_req())
    assert not again.created and again.tuning == first.tuning and again.params == first.params
    with pytest.raises(LedgerError, match="once"):
        build_index(store_path=tune_store.path, ledger_path=ledger_path, params=None, tune=_req(share=0.25))
    with pytest.raises(BadInputError, match="rdp"):
        build_index(store_path=tune_store.path, ledger_path=tmp_path / "l2", params=None,
                    tune=_req(conversion="gdp"))


@pytest.mark.parametrize("method", ["exp-mech", "random-search"])
def test_account_shows_the_tuning_share(tune_store, tmp_path, method):
    ledger_path = tmp_path / "ledger"
    build_index(store_path=tune_store.path, ledger_path=ledger_path, params=None, tune=_req(method=method))
    d = build_account_report(ledger_path=ledger_path).data
    t = d["tuning"]
    assert d["conversion"] == "rdp" and d["epsilon"] == t["epsilon_total"] <= 2.0
    assert d["epsilon_by_conversion"]["gdp"] is None
    assert t["epsilon_tuning"] < d["epsilon"] and t["epsilon_serving_alone"] < d["epsilon"]
    assert (t["conversion"], t["unit"], t["adjacency"]) == ("rdp", "record", "add/remove one record")  # rev. 73 F8
    res = runner.invoke(app, ["account", "--ledger", str(ledger_path)], env={"INDKNN_WIDTH": "200"})
    assert res.exit_code == 0, res.output
    assert "of which tuning" in res.stdout and "rdp" in res.stdout
    if method == "random-search":
        assert "operator only" in " ".join(res.stdout.split())  # the run count K is not covered (audit 2, P6)
    else:
        assert "by the exponential mechanism" in " ".join(res.stdout.split()) and d["tuning"]["method"] == method
    res = runner.invoke(app, ["account", "--ledger", str(ledger_path), "--eps", "2", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["check_eps"]["passed"]
    assert "runs_drawn" in json.loads(res.stdout)["operator_only"]  # audit 2, P6


def test_public_tuning_is_free(tmp_path):
    x, y, _ = clustered(400, 16, 3, seed=5)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=128)
    store.append("private", x[:200], labels=y[:200], record_ids=[f"r{i}" for i in range(200)])
    store.append("public", x[200:], labels=y[200:], record_ids=[f"p{i}" for i in range(200)])
    res = build_index(store_path=store.path, ledger_path=tmp_path / "l", params=None,
                      tune=_req(on="public", conversion="gdp"))
    led = BudgetLedger.open(tmp_path / "l")
    assert led.meta["tuning"]["mode"] == "public" and led.meta["tuning"]["epsilon_tuning"] == 0.0
    from indknn_cli.accounting import calibrate_budget

    assert led.params.budget == calibrate_budget(epsilon=2.0, delta=1e-5, conversion="gdp")  # nothing paid
    d = build_account_report(ledger_path=tmp_path / "l").data
    assert d.get("tuning") is None
    assert res.as_dict()["tuning"]["public_accuracy"] > 0.5
    # review 73, F7: account says how τ and σ2 were chosen, and that it cost nothing
    pub = d["tuned_on_public_rows"]
    assert pub["epsilon_tuning"] == 0.0 and pub["chosen"]["tau"] == led.meta["tuning"]["chosen_tau"]
    r = CliRunner().invoke(app, ["account", "--ledger", str(tmp_path / "l")])
    assert r.exit_code == 0 and "no privacy cost" in " ".join(r.stdout.split()), r.output


def test_cli_index_tune(tune_store, tmp_path):
    import shutil

    fresh = shutil.copytree(tune_store.path, tmp_path / "fresh.zarr")  # unbound: for the default-grid case below
    res = runner.invoke(app, ["index", "--store", str(tune_store.path), "--ledger", str(tmp_path / "l"),
                              "--eps", "2", "--tune", "private", "--tune-taus", "0.3,0.6", "--tune-sigma2s", "0.5",
                              "--tune-queries", "30", "--tune-runs", "2", "--tune-share", "0.3",
                              "--planned-queries", "100", "--tune-seed", "3", "--tune-method", "random-search"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["conversion"] == "rdp" and out["tuning"]["mode"] == "private" and out["epsilon"] <= 2.0
    assert "runs_drawn" in out["operator_only"]  # audit 2, P6: the JSON says so too
    assert "tuned privately" in res.stderr and "RDP" in res.stderr
    assert "operator-only" in " ".join(res.stderr.split())  # the run count K (audit 2, P6)
    res = runner.invoke(app, ["index", "--store", str(tune_store.path), "--ledger", str(tmp_path / "l2"),
                              "--eps", "2", "--tune", "private", "--conversion", "gdp"])
    assert res.exit_code == 2 and "rdp" in res.stderr
    # the default selection has no number of runs: --tune-runs is refused, not silently ignored
    res = runner.invoke(app, ["index", "--store", str(fresh), "--ledger", str(tmp_path / "l4"), "--eps", "2",
                              "--tune", "private", "--tune-runs", "3"])
    assert res.exit_code == 2 and "--tune-method random-search" in " ".join(res.stderr.split())
    assert not (tmp_path / "l4").exists()
    res = runner.invoke(app, ["index", "--store", str(fresh), "--ledger", str(tmp_path / "l5"), "--eps", "2",
                              "--tune", "private", "--tune-method", "grid"])
    assert res.exit_code == 2 and "tune-method" in res.stderr and not (tmp_path / "l5").exists()
    res = runner.invoke(app, ["index", "--store", str(fresh), "--ledger", str(tmp_path / "l6"), "--eps", "2",
                              "--tune", "private", "--tune-method", "grid", "--tune-runs", "3"])
    assert res.exit_code == 2 and "must be one of" in res.stderr  # the unknown method is what is named
    res = runner.invoke(app, ["index", "--store", str(fresh), "--ledger", str(tmp_path / "l7"), "--eps", "2",
                              "--tune", "public", "--tune-method", "random-search"])
    assert res.exit_code == 2 and "--tune private" in res.stderr and not (tmp_path / "l7").exists()
    # without --tune-sigma2s the ledger records the budget-relative default grid, scaled to its own B and T
    from indknn_cli.tuning_grid import budget_relative_sigma2s

    res = runner.invoke(app, ["index", "--store", str(fresh), "--ledger", str(tmp_path / "l3"),
                              "--eps", "2", "--tune", "private", "--tune-taus", "0.3", "--tune-queries", "30",
                              "--planned-queries", "100", "--tune-seed", "3"])
    assert res.exit_code == 0, res.output
    t = BudgetLedger.open(tmp_path / "l3").meta["tuning"]
    assert [g[1] for g in t["grid"]] == list(budget_relative_sigma2s(budget=t["budget_serve"], planned_queries=100))
    assert t["sigma2_grid"].startswith("budget-relative")
    assert "budget-relative" in " ".join(runner.invoke(app, ["index", "--help"]).stdout.split())


def test_the_default_share_is_the_methods_own(tune_store, tmp_path):
    """Review 80, F8: the default share became 30 % for the exponential mechanism, measured there; random search
    keeps the 20 % it was measured at. F4: `--tune-share` is "given" when typed, whatever its value, so `--tune
    public --tune-share 0.3` is refused like any other value (it passed silently when 0.3 was the default)."""
    from indknn_cli.tuning_grid import DEFAULT_TUNE_SHARE, RANDOM_SEARCH_TUNE_SHARE

    assert (DEFAULT_TUNE_SHARE, RANDOM_SEARCH_TUNE_SHARE) == (0.3, 0.2)
    assert tuning.TuneRequest(epsilon=1, delta=1e-5).share == 0.3
    assert tuning.TuneRequest(epsilon=1, delta=1e-5, method="random-search").share == 0.2
    assert tuning.TuneRequest(epsilon=1, delta=1e-5, method="random-search", share=0.4).share == 0.4
    base = ["index", "--eps", "2", "--tune", "private", "--tune-taus", "0.3", "--tune-sigma2s", "0.5",
            "--tune-queries", "30", "--planned-queries", "100"]
    for method, want in (("exp-mech", 0.3), ("random-search", 0.2)):
        led, store = tmp_path / method, _own_store(tune_store, tmp_path / f"{method}.zarr")
        res = runner.invoke(app, base + ["--store", str(store), "--ledger", str(led), "--tune-method", method])
        assert res.exit_code == 0, res.output
        assert BudgetLedger.open(led).meta["tuning"]["share"] == want
    res = runner.invoke(app, ["index", "--store", str(_own_store(tune_store, tmp_path / "pub.zarr")), "--ledger",
                              str(tmp_path / "pub"), "--eps", "2", "--tune", "public", "--tune-share",
                              str(DEFAULT_TUNE_SHARE)])
    assert res.exit_code == 2 and "--tune-share" in res.stderr and not (tmp_path / "pub").exists()


def test_many_shards_at_a_large_eps_do_not_overflow_the_noise_warning(tune_store, tmp_path):
    """Review 79, F1: the "close to a random pick" warning computed exp(0.05·S·sqrt(2ρ)), which overflowed from about
    4,300 shards at ε = 100 (both in range): index exited 1 with an internal error after the ledger was made and the
    search charged. The exponent is compared with ln 1.5 now."""
    led = tmp_path / "l"
    res = runner.invoke(app, ["index", "--store", str(tune_store.path), "--ledger", str(led), "--eps", "100",
                              "--tune", "private", "--tune-taus", "0.3", "--tune-sigma2s", "0.5",
                              "--tune-queries", "6000", "--planned-queries", "100"])
    assert res.exit_code == 0, res.output
    assert BudgetLedger.open(led).meta["tuning"]["validation_queries"] == 6000
    assert "close to a random pick" not in res.stderr


# -- serve-queries --min-margin ---------------------------------------------------------------------------------
def test_the_creations_tune_command_run_again_adds_records_and_tunes_nothing(tune_store, tmp_path):
    """Review 44 (QA, L1): the README's `embed … | index --tune private …` run a second time (cron, or a pasted
    pipeline) was refused (exit 2), though `index --tau T` run again with the creation's value adds new records
    (exit 0). The same --tune options again: nothing is tuned or charged, new records join; other options: refused."""
    led = tmp_path / "l"
    cmd = ["index", "--store", str(tune_store.path), "--ledger", str(led), "--eps", "2", "--tune", "private",
           "--tune-taus", "0.3,0.6", "--tune-sigma2s", "0.5", "--tune-queries", "30", "--planned-queries", "100"]
    res = runner.invoke(app, cmd)
    assert res.exit_code == 0, res.output
    first = BudgetLedger.open(led)
    assert first.meta["tuning"]["request"]["share"] == tuning.DEFAULT_TUNE_SHARE and "device" not in first.meta["tuning"]["request"]
    x, y, _ = clustered(5, 16, 3, seed=9)
    FeatureStore.open(tune_store.path, mode="a").append("private", x, labels=y,
                                                        record_ids=[f"new{i}" for i in range(5)])
    res = runner.invoke(app, cmd)  # no --tune-seed: a second search would draw other coins and noise
    assert res.exit_code == 0, res.output
    assert "nothing was tuned again" in " ".join(res.stderr.split())
    again = BudgetLedger.open(led)
    assert again.meta["tuning"] == first.meta["tuning"] and again.params == first.params
    assert len(again.state) == len(first.state) + 5 and float(np.max(again.state.spent)) == 0.0
    before = sorted((p.name, p.read_bytes()) for p in led.rglob("*") if p.is_file() and p.name != "LOCK")
    for flag, value in (("--tune-share", "0.45"), ("--tune-method", "random-search"), ("--tune-taus", "0.3"),
                        ("--eps", "1")):
        other = list(cmd)
        if flag in other:
            other[other.index(flag) + 1] = value
        else:
            other += [flag, value]
        res = runner.invoke(app, other)
        assert res.exit_code != 0 and "differs from the one that created it" in " ".join(res.stderr.split()), \
            (flag, res.output)
    assert sorted((p.name, p.read_bytes()) for p in led.rglob("*") if p.is_file() and p.name != "LOCK") == before


def _own_store(store, dest):
    import shutil

    shutil.copytree(store.path, dest)  # an unbound copy (made before any index)
    return dest


def test_min_margin_abstains_without_changing_answers_or_charges(tune_store, tmp_path):
    from indknn_cli.serving import make_params

    params = make_params(epsilon=2.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100)
    runs = {}
    for name, mm in (("plain", None), ("margin", 1.0)):
        led = tmp_path / name
        sp = _own_store(tune_store, tmp_path / f"{name}.zarr")  # one store, one ledger
        build_index(store_path=sp, ledger_path=led, params=params)
        r = serve_queries(store_path=sp, ledger_path=led, query_batch="q1", seed=5, reuse=False,
                          min_margin=mm)
        runs[name] = (r.answers, BudgetLedger.open(led).state.spent.copy(), BudgetLedger.open(led))
    plain, margin = runs["plain"][0], runs["margin"][0]
    assert np.array_equal(runs["plain"][1], runs["margin"][1])  # charges unchanged
    abst = [m for m in margin if m["label"] == -1]
    assert abst and all(m["label_name"] == "abstain" for m in abst) and len(abst) < len(margin)
    for p, m in zip(plain, margin):  # an answer is either the same label or an abstention
        assert m["released_count"] == p["released_count"]
        assert m["label"] in (p["label"], -1)
    assert runs["margin"][2].state.answers["label"].count(-1) == len(abst)  # ledger answer rows too


def test_min_margin_with_reuse_same_answers_for_any_batch_size(tune_store, tmp_path):
    from indknn_cli.serving import make_params

    params = make_params(epsilon=2.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100)
    out = []
    for bs in (30, 7):
        led = tmp_path / f"l{bs}"
        sp = _own_store(tune_store, tmp_path / f"l{bs}.zarr")  # one store, one ledger
        build_index(store_path=sp, ledger_path=led, params=params)
        r = serve_queries(store_path=sp, ledger_path=led, query_batch="q1", seed=5, batch_size=bs,
                          min_margin=0.8)
        out.append([(a["label"], a["released_count"]) for a in r.answers])
    assert out[0] == out[1] and any(lab == -1 for lab, _ in out[0])


def test_min_margin_refuses_nonsense():
    from indknn_cli.serving import check_min_margin

    for bad in (-1.0, math.nan, math.inf, True):
        with pytest.raises(BadInputError, match="min-margin"):
            check_min_margin(bad)


def test_cli_min_margin(tune_store, tmp_path):
    from indknn_cli.serving import make_params

    build_index(store_path=tune_store.path, ledger_path=tmp_path / "l",
                params=make_params(epsilon=2.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    res = runner.invoke(app, ["serve-queries", "q1", "--store", str(tune_store.path), "--ledger", str(tmp_path / "l"),
                              "--seed", "5", "--min-margin", "1.0"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.strip().splitlines()]
    assert len(rows) == 30 and any(r["label"] == -1 and r["label_name"] == "abstain" for r in rows)
    abstained = sum(r["label"] == -1 for r in rows)  # issue 18: the run reports its coverage
    assert (f"--min-margin 1: {abstained} answer{'s' if abstained != 1 else ''} of 30 returned abstained "
            f"(label -1); coverage {1 - abstained / 30:.1%}") in " ".join(res.stderr.split())
    again = runner.invoke(app, ["serve-queries", "q1", "--store", str(tune_store.path), "--ledger",
                                str(tmp_path / "l"), "--seed", "5", "--min-margin", "5"])
    assert again.exit_code == 0 and "coverage" not in again.stderr  # nothing new: no figure for this margin
    res = runner.invoke(app, ["serve-queries", "q1", "--store", str(tune_store.path), "--ledger", str(tmp_path / "l"),
                              "--batch-id", "other", "--min-margin", "-1"])
    assert res.exit_code == 2 and "min-margin" in res.stderr


def _tiny_bench_world(n_private: int):
    """A prepared-bench stand-in (private rows, 40 pool queries, T = 20), its config and two query draws."""
    from types import SimpleNamespace

    from indknn_cli.benchmarks.config import BenchConfig

    x, y, _ = clustered(n_private, 16, 3, seed=5)
    q, qy, _ = clustered(40, 16, 3, seed=6)
    p = SimpleNamespace(split=SimpleNamespace(private=np.arange(n_private)), priv_x=x, priv_y=y, pool_x=q,
                        pool_y=qy, ds=SimpleNamespace(n_classes=3, extractor="synthetic"), T=20)
    return p, BenchConfig.make(quick=False, seed=0, draws=2), [np.arange(20), np.arange(20, 40)]


def test_emulation_check_prints_both_emulations_beside_serving():
    """The diagnostic (bench/tuning_emulation_check.py): one row per grid point, fractions in [0, 1], serving reused."""
    from indknn_cli.benchmarks.emulation_check import emulation_table

    p, cfg, draws = _tiny_bench_world(400)
    cfg.tune_taus, cfg.tune_sigma2s, cfg.tune_queries = (0.3, 0.6), (0.5, 1.0), 40
    t = emulation_table(p, cfg, eps=2.0, draws=draws, keys=1)
    assert [(r["tau"], r["sigma2"]) for r in t["rows"]] == [(0.3, 0.5), (0.3, 1.0), (0.6, 0.5), (0.6, 1.0)]
    for r in t["rows"]:
        assert 0 <= r["emulated"] <= 1 and 0 <= r["expected"] <= 1 and 0 <= r["serving"] <= 1
    again = emulation_table(p, cfg, eps=2.0, draws=draws, keys=1, serving=t["serving"])
    assert again["rows"] == t["rows"]


def test_chosen_point_accuracy_averages_served_choices_below_the_best_grid_point():
    """bench/private_tuning_seeds.py's function: each seed's choice served on every draw; mean ≤ best point."""
    from indknn_cli.benchmarks.private_tuning import chosen_point_accuracy
    from indknn_cli.tuning_grid import budget_relative_sigma2s

    p, cfg, draws = _tiny_bench_world(300)
    cfg.tune_taus, cfg.tune_queries, cfg.tune_runs = (0.3, 0.6), 30, 3.0
    out = chosen_point_accuracy(p, cfg, eps=2.0, draws=draws, tuning_seeds=[1, 2, 3])
    assert out["tuning_seeds"] == 3 and out["sigma2_grid"].startswith("budget-relative")
    from indknn_cli.tuning_grid import DEFAULT_TUNE_SHARE

    rho = tuning.rho_for_share(epsilon=2.0, delta=cfg.delta, share=DEFAULT_TUNE_SHARE, method="exp-mech")  # index's
    b = tuning.serving_budget(epsilon=2.0, delta=cfg.delta, rho_run=rho, method="exp-mech")
    assert sorted({g[1] for g in out["grid"]}) == sorted(budget_relative_sigma2s(budget=b, planned_queries=20))
    assert 0 < out["chosen_mean"] <= out["best_grid_point"] <= 1
    fixed = chosen_point_accuracy(p, cfg, eps=2.0, draws=draws, tuning_seeds=[1, 2], sigma2s=(0.5, 1.0))
    assert {g[1] for g in fixed["grid"]} == {0.5, 1.0} and fixed["sigma2_grid"] == "given"


def test_choice_distribution_is_the_searchs_own_softmax(monkeypatch):
    """bench's exact expectation of the exponential mechanism's choice: the probabilities equal the softmax of the
    very scores ``private_tune`` handed to its selection (captured there), with the search's own Gumbel scale; the
    rebuild refuses a record whose choice its scores do not reproduce, and a random-search record or no seed."""
    from indknn_cli.benchmarks.private_tuning import choice_distribution, chosen_point_accuracy, tune_request
    from indknn_cli.tuning_accounting import gumbel_scale

    p, cfg, draws = _tiny_bench_world(300)
    cfg.tune_taus, cfg.tune_queries = (0.3, 0.45, 0.6), 30
    seen = []
    real = tuning.exp_mech_select

    def capture(scores, *, rho, rng):
        seen.append(np.asarray(scores, np.float64).copy())
        return real(scores, rho=rho, rng=rng)

    for seed in (5, 6, 7):
        seen.clear()
        monkeypatch.setattr(tuning, "exp_mech_select", capture)
        rec, params = tuning.private_tune_arrays(p.priv_x, p.priv_y, n_classes=p.ds.n_classes,
                                                 req=tune_request(cfg, eps=2.0, T=p.T, seed=seed,
                                                                  extractor=p.ds.extractor))
        monkeypatch.setattr(tuning, "exp_mech_select", real)
        assert len(seen) == 1 and np.ptp(seen[0]) > 0           # the search's own scores, not all equal
        z = (seen[0] - seen[0].max()) / gumbel_scale(rec.rho_run)
        want = np.exp(z) / np.exp(z).sum()
        dist = choice_distribution(p, rec=rec, params=params, seed=seed)
        assert dist.shape == want.shape and np.allclose(dist, want, rtol=1e-12, atol=1e-15)
    wrong = dataclasses.replace(rec, chosen_tau=[t for t, _ in rec.grid if t != rec.chosen_tau][0])
    with pytest.raises(AssertionError, match="do not reproduce"):
        choice_distribution(p, rec=wrong, params=params, seed=seed)
    with pytest.raises(ValueError, match="exp-mech"):
        choice_distribution(p, rec=dataclasses.replace(rec, method=tuning.RANDOM_SEARCH), params=params, seed=seed)
    with pytest.raises(ValueError, match="seed"):
        choice_distribution(p, rec=rec, params=params, seed=None)
    out = chosen_point_accuracy(p, cfg, eps=2.0, draws=draws, tuning_seeds=[1, 2, 3])
    assert out["expected_se"] is not None and 0 < out["expected_mean"] <= out["best_grid_point"]


def test_margin_share_bound_closed_forms():
    """m = min(1, 2·sqrt(2a − 1)) from the label agreement a of the ordered pairs within τ (a = Σπ² for class
    shares π: two classes at shares π, 1 − π give a = ½(1 + Δπ²))."""
    from indknn_cli.tuning_base import margin_share_bound

    near = np.ones((4, 4), bool)
    assert margin_share_bound(near, np.array([0, 0, 0, 0])) == 1.0            # one class: a = 1
    assert margin_share_bound(near, np.array([0, 0, 1, 1])) == 0.0            # a = 4/12 < ½: no margin
    assert margin_share_bound(near, np.array([0, 0, 0, 1])) == pytest.approx(0.0)  # a = 6/12
    five = np.ones((5, 5), bool)  # a = (4·3 + 1·0)/20 = 0.6 → Δ̄ = sqrt(0.2), m = 2·sqrt(0.2)
    assert margin_share_bound(five, np.array([0, 0, 0, 0, 1])) == pytest.approx(2 * np.sqrt(0.2))
    assert margin_share_bound(np.eye(3, dtype=bool), np.array([0, 1, 2])) == 1.0  # no pair within τ: flat prior


def test_a_mixed_neighbourhood_is_flipped_more_by_serving_noise(tune_store):
    """The label-agreement prior lowers a shard's chance where its pairs disagree, and more so for a larger σ2;
    the flat prior (margin share uniform on [0, 1]) is its upper bound."""
    from indknn_cli.ledger import PrivacyParams

    store = FeatureStore.open(tune_store.path, mode="r")
    data = _tune_data(store, 60)

    def score(s2, prior):
        p = PrivacyParams(epsilon=1, delta=1e-5, conversion="rdp", budget=1e4, kernel="cosine", tau=0.3,
                          sigma1=30.0, sigma2=s2, nu=None, k_min=10.0, planned_queries=300).validate()
        return np.mean([tuning.emulated_expected(data, params=p, run_key=k, n_shards=60, planned_queries=300,
                                                 margin_prior=prior) for k in range(3)])

    for s2 in (0.3, 3.0):
        assert score(s2, "agreement") <= score(s2, "flat") + 1e-9
    assert score(3.0, "flat") - score(3.0, "agreement") > score(0.3, "flat") - score(0.3, "agreement")


def test_the_search_scores_with_the_named_emulation(monkeypatch):
    """private_tune calls tuning.emulated_score once per grid point and names it in the ledger's record."""
    import indknn_cli.tuning as tmod

    from .conftest import clustered

    calls = []
    real = tmod.emulated_score

    def spy(data, **kw):
        calls.append(kw["params"].sigma2)
        return real(data, **kw)

    monkeypatch.setattr(tmod, "emulated_score", spy)
    x, y, _ = clustered(80, 16, 3, seed=2, spread=0.6)
    req = tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=1, taus=(0.2, 0.5), sigma2s=(0.3, 1.0), n_val=50,
                             planned_queries=50)
    rec, _ = tuning.private_tune_arrays(x, y, n_classes=3, req=req)
    assert len(calls) == 4 and rec.emulation == tmod.EMULATION
    assert tmod.emulated_score is not tmod.emulated_correct


def test_selection_ceiling_closed_forms():
    from indknn_cli.benchmarks.private_tuning import selection_ceiling
    from indknn_cli.tuning_accounting import gumbel_scale

    assert selection_ceiling([0.8, 0.8, 0.8], shards=500, rho=1e-3) == pytest.approx(0.8)
    assert selection_ceiling([0.9, 0.5], shards=10**6, rho=1e-3) == pytest.approx(0.9)
    b = gumbel_scale(1e-3)  # two points b·ln 2 / S apart: chosen 2/3 and 1/3 of the time
    hi, lo = 0.8 + b * np.log(2) / 500, 0.8
    assert selection_ceiling([hi, lo], shards=500, rho=1e-3) == pytest.approx((2 * hi + lo) / 3)


def test_sharpening_keeps_each_term_in_zero_one(tune_store):
    """c ** SHARPEN ≤ c for every shard's chance c in [0, 1]: the sharpened score is at most the sum of chances and
    at least 0, and sharpen = 1 is the chance itself (the sensitivity test above runs the default)."""
    from indknn_cli.ledger import PrivacyParams
    from indknn_cli.tuning_base import SHARPEN

    store = FeatureStore.open(tune_store.path, mode="r")
    data = _tune_data(store, 40)
    p = PrivacyParams(epsilon=1, delta=1e-5, conversion="rdp", budget=0.05, kernel="cosine", tau=0.3, sigma1=20.0,
                      sigma2=0.5, nu=None, k_min=5.0, planned_queries=100).validate()
    one = tuning.emulated_expected(data, params=p, run_key=3, n_shards=40, planned_queries=100, sharpen=1.0)
    sharp = tuning.emulated_expected(data, params=p, run_key=3, n_shards=40, planned_queries=100)
    assert SHARPEN > 1 and 0 <= sharp < one <= 40
    assert f"** {SHARPEN:g}" in tuning.EMULATION


@pytest.mark.heavy
def test_two_first_tuned_index_runs_at_once_tune_once_and_both_succeed(tune_store, tmp_path, monkeypatch):
    """Review 47 (suspected, confirmed): the ledger lock was held during the search and let go before the ledger was
    created, so a second `index --tune` started while the first tuned searched again on the same private data (two
    runs of the mechanism, one accounted), and the first to create the ledger kept its result. The lock is held
    from the search through creation now: the second run finds the ledger made and is the creation's re-run."""
    import threading
    import time

    real, calls, started = tuning.run_tuning, [], threading.Event()

    def slow(store, req):
        calls.append(threading.current_thread().name)
        started.set()
        time.sleep(1.0)  # the second run starts and waits for the lock meanwhile
        return real(store, req)

    monkeypatch.setattr(tuning, "run_tuning", slow)
    lp, results = tmp_path / "L", {}

    def run():
        try:
            results[threading.current_thread().name] = build_index(store_path=tune_store.path, ledger_path=lp,
                                                                   params=None, tune=_req())
        except Exception as exc:  # noqa: BLE001 - what each run ended with is the assertion
            results[threading.current_thread().name] = exc

    first = threading.Thread(target=run, name="first")
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=run, name="second")
    second.start()
    first.join(120)
    second.join(120)
    assert calls == ["first"], (calls, results)  # one search
    assert not isinstance(results["first"], Exception) and results["first"].created, results
    assert not isinstance(results["second"], Exception), results["second"]
    assert not results["second"].created and results["second"].params == results["first"].params
    assert any("nothing was tuned again" in w for w in results["second"].extra.get("warnings", []))
    assert BudgetLedger.open(lp).meta["tuning"]["chosen_tau"] == results["first"].tuning["chosen_tau"]
