"""Baselines of `bench` (SPEC §6): Private-kNN accounting and sampling, Linear NoisySGD, references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from indknn_cli.baselines import (HISTOGRAM_SENSITIVITY, PrivateKNN, knn_predict, opacus_epsilon,
                                  poisson_subsample_mask, private_knn_epsilon, private_knn_noise_multiplier,
                                  private_knn_predict, train_linear_noisy_sgd, train_logistic_regression)
from indknn_cli.errors import BadInputError

from .conftest import clustered


# -- Private-kNN accounting ------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_noise_multiplier_meets_target_and_is_nearly_tight(accountant):
    s = private_knn_noise_multiplier(epsilon=1.0, delta=1e-5, sampling_rate=0.1, queries=100, accountant=accountant)
    eps = private_knn_epsilon(noise_multiplier=s, delta=1e-5, sampling_rate=0.1, queries=100, accountant=accountant)
    assert eps <= 1.0
    # 3% less noise would already overspend: the calibration is not wastefully loose
    assert private_knn_epsilon(noise_multiplier=0.97 * s, delta=1e-5, sampling_rate=0.1, queries=100,
                               accountant=accountant) > 1.0


def test_noise_multiplier_grows_with_queries_and_shrinks_with_epsilon():
    kw = dict(delta=1e-5, sampling_rate=0.1, accountant="pld")
    by_t = [private_knn_noise_multiplier(epsilon=1.0, queries=t, **kw) for t in (10, 100, 1000)]
    assert by_t[0] < by_t[1] < by_t[2]
    by_eps = [private_knn_noise_multiplier(epsilon=e, queries=100, **kw) for e in (0.5, 1.0, 2.0)]
    assert by_eps[0] > by_eps[1] > by_eps[2]


def test_subsampling_amplifies_and_sensitivity_is_sqrt2():
    full = PrivateKNN.calibrated(sampling_rate=1.0, k=10, epsilon=1.0, delta=1e-5, queries=50, accountant="pld")
    sub = PrivateKNN.calibrated(sampling_rate=0.05, k=10, epsilon=1.0, delta=1e-5, queries=50, accountant="pld")
    assert sub.noise_multiplier < full.noise_multiplier
    assert sub.noise_std == pytest.approx(sub.noise_multiplier * math.sqrt(2.0))
    assert HISTOGRAM_SENSITIVITY == pytest.approx(math.sqrt(2.0))
    assert sub.accounted_epsilon() <= 1.0
    assert sub.as_dict()["accountant"] == "dp-accounting pld"


@pytest.mark.parametrize("kw", [dict(epsilon=0.0), dict(epsilon=math.inf), dict(delta=1.0), dict(sampling_rate=0.0),
                                dict(sampling_rate=1.5), dict(queries=0), dict(accountant="moments")])
def test_noise_multiplier_rejects_bad_arguments(kw):
    args = dict(epsilon=1.0, delta=1e-5, sampling_rate=0.1, queries=10, accountant="pld") | kw
    with pytest.raises(BadInputError):
        private_knn_noise_multiplier(**args)


# -- Private-kNN sampling and prediction ----------------------------------------------
def test_poisson_subsampling_is_bernoulli_per_record():
    rng = np.random.default_rng(0)
    n, rows, rate = 2000, 400, 0.1
    mask = poisson_subsample_mask(n, rate=rate, rng=rng, size=rows)
    sizes = mask.sum(axis=1)
    # Subsample sizes vary like Binomial(n, γ) — not a fixed-size sample.
    assert abs(sizes.mean() - n * rate) < 4 * math.sqrt(n * rate * (1 - rate) / rows)
    assert sizes.std() == pytest.approx(math.sqrt(n * rate * (1 - rate)), rel=0.2)
    # Each record is in each subsample independently with probability γ.
    per_record = mask.mean(axis=0)
    assert abs(per_record.mean() - rate) < 0.005
    assert per_record.std() == pytest.approx(math.sqrt(rate * (1 - rate) / rows), rel=0.15)
    # Independence across records: inclusion of record 0 does not predict record 1.
    a, b = mask[:, 0], mask[:, 1]
    assert abs(np.mean(a & b) - np.mean(a) * np.mean(b)) < 0.03


def test_private_knn_is_topk_in_the_subsample_plus_gaussian_noise():
    x, y, _ = clustered(300, 8, 3, seed=4)
    q, _, _ = clustered(20, 8, 3, seed=5)
    rate, k, std = 0.3, 7, 2.5
    got = private_knn_predict(q, features=x, labels=y, n_classes=3, sampling_rate=rate, k=k, noise_std=std,
                              rng=np.random.default_rng(11), batch=8)
    rng = np.random.default_rng(11)
    want = []
    for lo in range(0, 20, 8):
        qb = q[lo:lo + 8]
        mask = rng.random((qb.shape[0], 300)) < rate
        hist = np.zeros((qb.shape[0], 3))
        for t in range(qb.shape[0]):
            rows = np.flatnonzero(mask[t])
            scores = x[rows].astype(np.float32) @ qb[t].astype(np.float32)
            top = rows[np.argsort(-scores, kind="stable")[:k]]
            hist[t] = np.bincount(y[top], minlength=3)
        want.extend(np.argmax(hist + std * rng.standard_normal(hist.shape), axis=1))
    assert got.tolist() == [int(v) for v in want]


def test_private_knn_empty_subsample_still_releases_noisy_argmax():
    x, y, _ = clustered(50, 8, 3, seed=1)
    pred = private_knn_predict(x[:200], features=x, labels=y, n_classes=3, sampling_rate=1e-9, k=5,
                               noise_std=1.0, rng=np.random.default_rng(0))
    assert set(pred.tolist()) == {0, 1, 2}  # pure noise: every label shows up


def test_private_knn_refuses_more_queries_than_calibrated():
    x, y, _ = clustered(50, 8, 3, seed=1)
    m = PrivateKNN.calibrated(sampling_rate=0.5, k=5, epsilon=1.0, delta=1e-5, queries=3, accountant="pld")
    with pytest.raises(BadInputError):
        m.predict(x[:4], features=x, labels=y, n_classes=3, rng=np.random.default_rng(0))


def test_knn_and_logistic_regression_references():
    x, y, _ = clustered(400, 16, 4, seed=2)
    q, qy, _ = clustered(100, 16, 4, seed=2)  # same seed: same centres
    assert knn_predict(x[:5], features=x, labels=y, n_classes=4, k=1).tolist() == y[:5].tolist()
    assert (knn_predict(q, features=x, labels=y, n_classes=4, k=10) == qy).mean() > 0.9
    lr = train_logistic_regression(x, y, n_classes=4, l2=1e-3, max_iter=30)
    assert (lr.predict(q) == qy).mean() > 0.9


# -- Linear NoisySGD ---------------------------------------------------------------------
def test_noisy_sgd_one_epoch_opacus_epsilon_within_target():
    x, y, _ = clustered(300, 16, 3, seed=3)
    res = train_linear_noisy_sgd(x, y, n_classes=3, epsilon=2.0, delta=1e-5, lr=2.0, epochs=1, batch_size=64,
                                 seed=1, accountant="rdp")
    assert res.epsilon <= 2.0
    assert res.noise_multiplier > 0 and res.steps == math.ceil(300 / 64)
    assert res.sample_rate == pytest.approx(1 / math.ceil(300 / 64))
    assert res.model.weight.shape == (3, 16)
    again = train_linear_noisy_sgd(x, y, n_classes=3, epsilon=2.0, delta=1e-5, lr=2.0, epochs=1, batch_size=64,
                                   seed=1, accountant="rdp")
    np.testing.assert_array_equal(res.model.weight, again.model.weight)  # seeded: reproducible


def test_noisy_sgd_learns_and_nonprivate_mode_has_no_accountant():
    x, y, _ = clustered(600, 16, 3, seed=6)
    res = train_linear_noisy_sgd(x, y, n_classes=3, epsilon=None, delta=1e-5, lr=1.0, epochs=3, batch_size=64)
    assert res.epsilon == math.inf and res.noise_multiplier == 0.0
    assert (res.model.predict(x) == y).mean() > 0.9
    with pytest.raises(BadInputError):
        train_linear_noisy_sgd(x, y, n_classes=3, epsilon=-1.0, delta=1e-5, lr=1.0)


def test_opacus_epsilon_composes_retrainings():
    one = opacus_epsilon(noise_multiplier=1.5, sample_rate=0.05, steps=200, delta=1e-5, accountant="rdp")
    five = opacus_epsilon(noise_multiplier=1.5, sample_rate=0.05, steps=1000, delta=1e-5, accountant="rdp")
    assert 0 < one < five < 5 * one
