"""indknn_cli.rounding: privacy figures printed against the user, numbers the user gave printed exactly."""

from __future__ import annotations

import math
import re
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given as hgiven
from hypothesis import settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.rounding import down, given, up

runner = CliRunner()
FLOATS = st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False)


def _digits(text: str) -> int:
    return len(Decimal(text).normalize().as_tuple().digits)


@settings(max_examples=500, deadline=None)
@hgiven(FLOATS, st.integers(1, 10))
def test_up_is_never_below_and_down_never_above_the_value(x, digits):
    u, d = up(x, digits), down(x, digits)
    assert float(u) >= x and float(d) <= x  # what is printed reads back on the right side of the value
    assert _digits(u) <= digits and _digits(d) <= digits
    assert float(u) == x or float(u) <= math.nextafter(x, math.inf) * (1 + 10.0 ** (1 - digits))  # and close to it


@settings(max_examples=300, deadline=None)
@hgiven(st.floats(allow_nan=False, allow_infinity=False))
def test_given_reads_back_as_the_same_float(x):
    assert float(given(x)) == x


def test_closed_forms():
    assert up(1.0921503, 4) == "1.093" and down(1.0921503, 4) == "1.092"  # review 46, F1
    assert up(0.12577704845446647) == "0.125778" and down(0.12577704845446647) == "0.125777"
    assert up(0.1, 3) == "0.1" == down(0.1, 3)  # the float 0.1, not its binary value rounded up to "0.101"
    assert up(9.9996, 4) == "10" and down(9.9996, 4) == "9.999"
    assert given(0.9999999999999455) == "0.9999999999999455" and given(1e-5) == "1e-05" and given(2.0) == "2"
    assert up(None) == "—" and up(0.0) == "0" and up(float("inf")) == "inf"


def _pair(tmp_path, *index_flags):
    """A store of 30 random records and its ledger at ε = 1 (gdp), made through the CLI."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "p.npz", x=rng.standard_normal((30, 8)).astype("f4"), y=np.array(["a", "b"] * 15),
             ids=np.array([f"r{i}" for i in range(30)]))
    sp, lp = tmp_path / "s.zarr", tmp_path / "L"
    assert runner.invoke(app, ["embed", str(tmp_path / "p.npz"), "--store", str(sp), "--extractor", "vectors",
                               "--label-names", "a,b", "-q"]).exit_code == 0
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "1", "--tau", "0.2",
                               *index_flags, "-q"]).exit_code == 0
    return sp, lp


@pytest.mark.heavy
def test_the_eps_check_failure_prints_epsilon_up_and_the_given_figures_exactly(tmp_path):
    """Review 47: the `account --eps` failure printed ε, the excess and B with :.6g (to nearest: below the figure
    for about half of them) and --eps and δ with :g (--eps 0.99999999 shown as 1, above the ε it failed)."""
    sp, lp = _pair(tmp_path, "--delta", "1.234567891e-5", "--planned-queries", "10")
    text = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--eps", "0.99999999"])
    assert text.exit_code == 4 and "--eps 0.99999999 check FAILED" in text.stderr, text.output
    assert "at δ = 1.234567891e-05" in text.stderr
    r = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--eps", "0.99999999", "--json"])
    assert r.exit_code == 4, r.output
    said = " ".join(r.stderr.split())
    m = re.search(r"the ledger.s guarantee ε\(gdp\) = (\S+) at δ = (\S+) .* is above --eps (\S+) by (\S+) \(B = ([^)]+)\)", said)
    assert m, said
    eps, delta, given_eps, by, budget = m.groups()
    assert delta == "1.234567891e-05" and given_eps == "0.99999999"  # exactly as given, not 1.23457e-05 and 1
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.accounting import gdp_epsilon

    b = BudgetLedger.open(lp).params.budget
    true_eps = gdp_epsilon(budget=b, delta=1.234567891e-5)
    assert float(eps) >= true_eps and float(budget) >= b and float(by) >= true_eps - 0.99999999


@pytest.mark.heavy
def test_a_passed_eps_check_never_prints_an_epsilon_above_the_eps_given_and_b_is_rounded_up(tmp_path):
    """Review 50, F7: `account --eps 0.99999999999995` printed "check passed: guarantee ε(gdp) = 1" (ε rounded up
    to 6 digits, above the --eps it passed); F6: index's fixed-parameters refusal printed B to nearest."""
    import math

    from indknn_cli.accounting import gdp_epsilon
    from indknn_cli.ledger import BudgetLedger

    sp, lp = _pair(tmp_path)
    b = BudgetLedger.open(lp).params.budget
    eps = gdp_epsilon(budget=b, delta=1e-5)
    above = math.nextafter(eps, math.inf)
    r = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--eps", repr(above)])
    assert r.exit_code == 0, r.output
    m = re.search(r"check passed: guarantee ε\(gdp\) = (\S+) at", " ".join(r.stderr.split()))
    assert m and eps <= float(m.group(1)) <= above, r.stderr
    r = runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "2", "--tau", "0.2"])
    assert r.exit_code == 2 and f"B={up(b)}," in " ".join(r.stderr.split()), r.stderr
