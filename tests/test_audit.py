"""The empirical privacy audit (indknn_cli/audit.py): closed forms, a correct mechanism passes, broken ones fail."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli import audit as audit_module
from indknn_cli.audit import (AuditConfig, audit_params, clopper_pearson_upper, epsilon_lower_bound,
                              indknn_mechanism, run_audit)
from indknn_cli.cli.app import app
from indknn_cli.errors import BadInputError

runner = CliRunner()


# -- closed forms ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 10, 500])
@pytest.mark.parametrize("beta", [0.025, 0.05])
def test_clopper_pearson_with_no_success_is_one_minus_beta_root(n, beta):
    # k = 0: P(Bin(n, p) = 0) = (1 − p)^n = beta  ⇒  p⁺ = 1 − beta^(1/n)
    assert clopper_pearson_upper(0, n, beta=beta) == pytest.approx(1.0 - beta ** (1.0 / n), rel=1e-9)


def test_clopper_pearson_is_above_the_rate_and_capped():
    assert clopper_pearson_upper(30, 100, beta=0.025) > 0.3
    assert clopper_pearson_upper(100, 100, beta=0.025) == 1.0
    with pytest.raises(BadInputError, match="k=5"):
        clopper_pearson_upper(5, 4, beta=0.05)
    with pytest.raises(BadInputError, match="n=0"):
        clopper_pearson_upper(0, 0, beta=0.05)


def test_perfect_test_bound_closed_form():
    # no errors in 1000 + 1000 trials: FPR⁺ = FNR⁺ = 1 − (α/2)^(1/1000), ε_lb = log((1 − δ − FNR⁺)/FPR⁺)
    u = 1.0 - 0.025 ** (1.0 / 1000)
    got = epsilon_lower_bound(false_positives=0, negatives=1000, false_negatives=0, positives=1000, delta=1e-5)
    assert got["epsilon_lower_bound"] == pytest.approx(math.log((1.0 - 1e-5 - u) / u), rel=1e-9)


def test_a_coin_flip_test_bounds_nothing():
    got = epsilon_lower_bound(false_positives=500, negatives=1000, false_negatives=500, positives=1000, delta=1e-5)
    assert got["epsilon_lower_bound"] == 0.0


def test_audit_params_keep_the_count_charge_within_budget():
    p = audit_params(AuditConfig(epsilon=1.0))
    assert p.c1 <= p.budget and p.c1 >= 0.97 * p.budget


# -- the product's mechanism passes; broken mechanisms are caught ----------------------------
def test_indknn_lower_bound_stays_below_the_certificate():
    res = run_audit(AuditConfig(epsilon=2.0, trials=600, seed=11))
    assert res.passed and res.epsilon_lower_bound <= res.certified_epsilon
    assert res.certified_epsilon == pytest.approx(2.0, abs=1e-6) and res.conversion == "gdp"
    assert res.conversion_label.startswith("Gaussian-DP")
    # the attack does find signal (a non-trivial test), it just cannot beat the certificate
    assert 0.0 < res.epsilon_lower_bound


def _with_params(mechanism, **changes):
    def run(features, labels, queries, params, n_classes, run_key):
        return mechanism(features, labels, queries, dataclasses.replace(params, **changes), n_classes, run_key)

    return run


def _exact_counts(features, labels, queries, params, n_classes, run_key):
    """A broken release: the true candidate count, no noise at all."""
    kappa = queries.astype(np.float64) @ features.astype(np.float64).T
    counts = (kappa >= params.tau).sum(axis=1).astype(np.float64)
    return np.zeros(len(queries), np.int64), counts


@pytest.mark.parametrize("broken", ["no-noise", "sigma1/20"])
def test_a_leaking_mechanism_is_caught(broken):
    """The audit can fail: the accountant certifies ε = 1, the mechanism leaks far more."""
    if broken == "no-noise":
        mech = _exact_counts
    else:  # count noise 20× too small, and a budget that never retires anyone
        base = audit_params(AuditConfig(epsilon=1.0))
        mech = _with_params(indknn_mechanism(), sigma1=base.sigma1 / 20.0, budget=1e6)
    res = run_audit(AuditConfig(epsilon=1.0, trials=400, seed=5), mechanism=mech)
    assert not res.passed, res.as_dict()
    assert res.epsilon_lower_bound > res.certified_epsilon


def test_seeded_audits_repeat_and_unseeded_ones_draw_fresh_noise(monkeypatch):
    cfg = AuditConfig(trials=40, seed=3)
    a, b = run_audit(cfg), run_audit(cfg)
    assert a.as_dict() == b.as_dict()
    drawn = []
    real = audit_module.secrets.randbits
    monkeypatch.setattr(audit_module.secrets, "randbits", lambda k: drawn.append(k) or real(k))
    c = run_audit(AuditConfig(trials=40))
    assert c.config["seed"] is None
    assert drawn.count(128) == 2 * 40  # one OS-entropy run key per trial, in both worlds


def test_bad_config_is_refused():
    with pytest.raises(BadInputError, match="trials"):
        run_audit(AuditConfig(trials=5))
    with pytest.raises(BadInputError, match="count_share"):
        run_audit(AuditConfig(count_share=1.5))


def test_cli_prints_one_json_line_naming_the_conversion():
    res = runner.invoke(app, ["bench", "audit", "--trials", "60", "--seed", "2", "--conversion", "rdp"])
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["conversion"] == "rdp" and "RDP" in out["conversion_label"]
    assert out["epsilon_lower_bound"] <= out["certified_epsilon"] <= 2.0
    assert out["noise"] == "seeded (experiment)"
    assert "ε lower bound" in res.stderr and "ε(rdp)" in res.stderr
    # every ε printed names its unit and adjacency (SPEC §8; review 31, QA: the audit's did not)
    assert out["unit"] == "record" and out["adjacency"] == "add/remove one record"
    assert "per record (add/remove one record adjacency)" in res.stderr
