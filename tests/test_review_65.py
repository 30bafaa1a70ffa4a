"""Review 65 (2026-11-29, a helper as privacy auditor recomputing every figure, `/work/review65`): labels and ranges
around figures that were right (no figure was wrong): `account --delta` outside `index`'s range passed the `--eps`
check; δ ≥ 1/N taken without a word; a tuned ledger's composition labelled as the untuned curve; `repair`'s exact
counts without the operator-only label."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli import tuning
from indknn_cli.cli.app import app
from indknn_cli.serving import build_index

from .test_review_54 import pair  # noqa: F401 (the fixture)
from .test_tuned_realised import _store

runner = CliRunner()


@pytest.mark.parametrize("delta", ["0.5", "1e-40"])
def test_account_refuses_a_delta_outside_the_range_index_takes(pair, delta):
    """F3: `account --delta 0.5 --eps 0.001` exited 0 (ε(gdp) = 0 at δ = 0.5): the cron's compliance gate passed
    any promise; `--delta 1e-40` was taken though `index` refuses δ < 1e-30."""
    sp, lp = pair
    res = runner.invoke(app, ["account", "--ledger", str(lp), "--delta", delta, "--eps", "0.001"])
    assert res.exit_code == 2, res.stdout
    assert "--delta must be a finite number in [1e-30, 0.1]" in " ".join(res.stderr.split())
    res = runner.invoke(app, ["account", "--ledger", str(lp), "--delta", "1e-6", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["delta"] == 1e-6


def test_index_warns_the_operator_when_delta_is_at_least_one_over_n(tmp_path):
    """F2: `index --delta 0.1` on 2,000 records was taken without a word; at δ ≥ 1/N, publishing one record whole
    with probability δ meets the guarantee too. 160 records: δ = 0.01 warns, δ = 1e-5 does not."""
    for delta, warned in (("0.01", True), ("1e-5", False)):
        st = _store(tmp_path / f"s{delta}.zarr", n=160)
        res = runner.invoke(app, ["index", "--store", str(st.path), "--ledger", str(tmp_path / f"L{delta}"),
                                  "--eps", "1", "--delta", delta, "--tau", "0.3", "--sigma2", "0.5",
                                  "--planned-queries", "50"])
        assert res.exit_code == 0, res.stderr
        said = "is at least 1/N for the 160 records" in " ".join(res.stderr.split())
        assert said == warned, res.stderr


@pytest.mark.heavy
def test_a_tuned_ledgers_conversion_label_names_the_composition(tmp_path):
    """F4: the JSON `conversion_label` of a privately tuned ledger said "RDP (α·B, ...)", the untuned curve, beside
    an ε that composes the search with serving; the text legend the same, and a gdp line for an empty column."""
    st = _store(tmp_path / "s.zarr")
    req = tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=3, taus=(0.3,), sigma2s=(0.5,), n_val=40,
                             mean_runs=2.0, share=0.3, planned_queries=100, method="exp-mech")
    build_index(store_path=st.path, ledger_path=tmp_path / "l", params=None, tune=req)
    res = runner.invoke(app, ["account", "--ledger", str(tmp_path / "l"), "--json"])
    assert res.exit_code == 0, res.stderr
    label = json.loads(res.stdout)["conversion_label"]
    assert label.startswith("RDP composition of the tuning search (ZCDpEvent") and "α·B" in label
    res = runner.invoke(app, ["account", "--ledger", str(tmp_path / "l")], env={"INDKNN_WIDTH": "400"})
    out = " ".join(res.stdout.split())
    assert "rdp: RDP composition of the tuning search" in out and "gdp: not applicable to the composition" in out
    assert "Gaussian-DP (analytic" not in out


def test_repair_marks_its_exact_counts_operator_only(pair):
    """F6: `repair` printed records_retired and the other exact counts of the private data without the
    operator-only label that `index`, `delete` and `account` carry (SPEC §8)."""
    sp, lp = pair
    q = sp.parent / "q.npy"
    np.save(q, np.eye(4, dtype=np.float32))
    assert runner.invoke(app, ["serve-queries", "--store", str(sp), "--ledger", str(lp), str(q),
                               "--seed", "1"]).exit_code == 0
    event = sorted((lp / "events").glob("*.parquet"))[0]
    b = bytearray(event.read_bytes())
    b[len(b) // 2] ^= 0xFF
    event.write_bytes(bytes(b))
    res = runner.invoke(app, ["repair", "--store", str(sp), "--ledger", str(lp)])
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["records_retired"] > 0 and "records_retired" in d["operator_only"]
    assert d["operator_only"].startswith("operator-only:")
    assert "[OPERATOR ONLY]" in res.stderr


@pytest.mark.parametrize("eps,delta", [(0.05, 1e-10), (0.01, 1e-30), (0.011, 1e-30), (0.1, 1e-3), (0.2, 1e-2),
                                       (0.2, 1e-3), (1.0, 1e-5), (5.0, 1e-8), (20.0, 1e-2), (100.0, 1e-30)])
def test_the_gdp_calibration_is_rounded_against_the_user_exactly(eps, delta):
    """F1 (and review 53, F1): the float δ(ε) cancelled where ε/μ is large; B came out up to 8.2e-14 above the exact
    solution and the printed ε up to 7.9e-14 below the exact ε of B. Checked with the 60-digit curve: the exact δ at
    the calibrated B is ≤ δ, and the exact δ at the printed ε of that B is ≤ δ (the printed ε is certified)."""
    import mpmath

    from indknn_cli.accounting import calibrate_budget, epsilon_for_budget

    mpmath.mp.dps = 60

    def exact_delta(e, budget):
        mu = mpmath.sqrt(2 * mpmath.mpf(budget))
        e = mpmath.mpf(e)
        return mpmath.ncdf(-e / mu + mu / 2) - mpmath.exp(e) * mpmath.ncdf(-e / mu - mu / 2)

    budget = calibrate_budget(epsilon=eps, delta=delta, conversion="gdp")
    assert exact_delta(eps, budget) <= delta
    printed = epsilon_for_budget(budget=budget, delta=delta, conversion="gdp")
    assert printed <= eps
    assert exact_delta(printed, budget) <= delta


def test_the_gdp_calibration_is_rounded_against_the_user_over_the_documented_range():
    """F1 over ε ∈ [0.01, 100] × δ ∈ [1e-30, 0.1] (the ranges `index` takes): 99 cells."""
    for eps in (0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 100.0):
        for delta in (1e-30, 1e-20, 1e-12, 1e-10, 1e-8, 1e-5, 1e-3, 1e-2, 0.1):
            test_the_gdp_calibration_is_rounded_against_the_user_exactly(eps, delta)


def test_a_gdp_ledger_calibrated_on_the_earlier_curve_still_opens(monkeypatch):
    """F1's fix moves the float curve up by ~1e-14 of a term: a B calibrated before it converts to an ε a hair above
    its target (at ε = 0.05, δ = 1e-10). Such a ledger is not an edited one: it still opens; a B raised by 1e-9
    is still refused."""
    import math

    from scipy.special import log_ndtr

    from indknn_cli import accounting
    from indknn_cli.ledger_integrity import budget_matches

    def earlier(*, epsilon, mu):
        if mu <= 0:
            return 0.0
        first = math.exp(float(log_ndtr(-epsilon / mu + mu / 2.0)))
        return max(0.0, first - math.exp(epsilon + float(log_ndtr(-epsilon / mu - mu / 2.0))))

    with monkeypatch.context() as m:
        m.setattr(accounting, "gdp_delta", earlier)
        old = accounting.calibrate_budget(epsilon=0.05, delta=1e-10, conversion="gdp")
    now = accounting.calibrate_budget(epsilon=0.05, delta=1e-10, conversion="gdp")
    assert now < old  # the fix lowers B here
    assert accounting.epsilon_for_budget(budget=old, delta=1e-10, conversion="gdp") > 0.05

    class P:
        epsilon, delta, conversion = 0.05, 1e-10, "gdp"

    assert budget_matches(old, P) and budget_matches(now, P)
    assert not budget_matches(old * (1 + 2e-9), P)
