"""Review 55 (2026-11-29): two first-time users following the README (an engineer wiring cron, a compliance reviewer).
Messages that misled or gave no next step; the tuned-ledger verify line is in tests/test_tuned_realised.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli import gate
from indknn_cli.cli.app import app
from indknn_cli.errors import QueryAllowanceError
from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

runner = CliRunner()
WIDE = {"INDKNN_WIDTH": "400"}


def test_a_batch_that_would_pass_the_allowance_is_not_called_the_allowance_reached():
    """F2: 800 of 1,000 answered and a 300-query file: "query allowance reached", exit 3, read as "stop serving"."""
    with pytest.raises(QueryAllowanceError) as e:
        gate.check(gate.Allowance(1000, "planned", 800), new_queries=300)
    msg = str(e.value)
    assert "reached" not in msg and "would pass" in msg and "200" in msg and "at most 200 queries" in msg
    with pytest.raises(QueryAllowanceError) as e:
        gate.check(gate.Allowance(1000, "planned", 1000), new_queries=5)
    assert "used up" in str(e.value) and "serving through this ledger is over" in str(e.value)


@pytest.fixture
def pair(tmp_path):
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=4,
                             label_names=["a", "b"], chunk_rows=16)
    st.append("private", normalize_rows(np.random.default_rng(1).standard_normal((40, 4))),
              labels=(np.arange(40) % 2).astype(np.int32), record_ids=[f"r{i:03d}" for i in range(40)],
              user_ids=[f"u{i % 8}" for i in range(40)])
    res = runner.invoke(app, ["index", "--store", str(st.path), "--ledger", str(tmp_path / "L"), "--eps", "1",
                              "--tau", "0.5", "--planned-queries", "500"])
    assert res.exit_code == 0, res.stderr
    assert "consider --privacy-unit user" in res.stderr  # at creation the advice can be followed
    return st.path, tmp_path / "L"


def test_the_index_rerun_refusal_names_what_differs(pair):
    """F7: a re-run with the creation's --eps and --tau but not its --planned-queries listed values all equal to those
    typed; the difference (σ1, from --planned-queries' default) was not named."""
    sp, lp = pair
    # since review 66, F3 a flag left out keeps the ledger's value: this re-run adds nothing and passes
    res = runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "1", "--tau", "0.5"], env=WIDE)
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "1", "--tau", "0.5",
                              "--planned-queries", "5000"], env=WIDE)
    assert res.exit_code == 2
    assert "this run's differ" in res.stderr and "sigma1 (from --sigma1 or --planned-queries)" in res.stderr
    assert "epsilon:" not in res.stderr  # ε is the same: not listed


def test_an_index_rerun_never_advises_a_unit_it_would_refuse(pair):
    """F4: every re-run warned "consider --privacy-unit user", which an existing ledger refuses."""
    sp, lp = pair
    FeatureStore.open(sp, mode="r+").append("private", normalize_rows(np.ones((1, 4))), labels=np.zeros(1, np.int32),
                                            record_ids=["r999"], user_ids=["u1"])
    res = runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp)], env=WIDE)
    assert res.exit_code == 0, res.stderr
    assert "consider --privacy-unit user" not in res.stderr + res.stdout
    assert "the unit is fixed when the ledger is made" in res.stderr


def test_an_access_request_for_an_id_outside_the_ledger_says_where_to_look(pair):
    """F9: "record id 'nu-0' is not in the ledger" while the store held the person's row."""
    sp, lp = pair
    res = runner.invoke(app, ["account", "--ledger", str(lp), "--record", "nu-0"], env=WIDE)
    assert res.exit_code == 2
    assert "never been used to answer a query" in res.stderr and "indknn delete --dry-run" in res.stderr


def test_strict_delete_of_a_quoted_id_names_the_quotes(pair):
    """F10: `cut -d,` on a quoted CSV passes '"ag-00009"': the refusal gave no hint."""
    sp, lp = pair
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", '"r001"', "--strict"],
                        env=WIDE)
    assert res.exit_code == 2 and "is in quotes" in res.stderr, res.stderr


def test_the_distribution_names_its_unit(pair):
    """F11: the distribution's realised ε row and the history's median carried no unit or adjacency."""
    sp, lp = pair
    res = runner.invoke(app, ["account", "--ledger", str(lp), "--store", str(sp)], env=WIDE)
    assert res.exit_code == 0, res.stderr
    assert "per record, add/remove one record, in this table and in the history's median below" in res.stdout
