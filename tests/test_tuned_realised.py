"""Realised loss on a privately tuned ledger includes the search (audit 9, F2), and export's user_spent groups
the users the filter keeps (audit 9, F4)."""

from __future__ import annotations

import numpy as np
import pytest
import pyarrow.parquet as pq
from typer.testing import CliRunner

from indknn_cli import tuning
from indknn_cli.cli.app import app
from indknn_cli.export import export_account
from indknn_cli.ledger import BudgetLedger
from indknn_cli.report import build_account_report, realised_loss
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

runner = CliRunner()


def _store(path, n=300, user_ids=None):
    x, y, _ = clustered(n, 16, 3, seed=3)
    st = FeatureStore.create(path, extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                             label_names=["a", "b", "c"])
    st.append("private", x, labels=y, record_ids=[f"r{i:04d}" for i in range(n)], user_ids=user_ids)
    q, _, _ = clustered(30, 16, 3, seed=4)
    st.append("query", q, record_ids=[f"q{i:03d}" for i in range(30)], batch="q1")
    return st


@pytest.mark.heavy
@pytest.mark.parametrize("method", ["exp-mech", "random-search"])
def test_realised_loss_of_a_tuned_ledger_composes_the_search(tmp_path, method):
    st = _store(tmp_path / "s.zarr")
    req = tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=3, taus=(0.3,), sigma2s=(0.5,), n_val=40,
                             mean_runs=2.0, share=0.3, planned_queries=100, method=method)
    build_index(store_path=st.path, ledger_path=tmp_path / "l", params=None, tune=req)
    serve_queries(store_path=st.path, ledger_path=tmp_path / "l", query_batch="q1", seed=1)
    led = BudgetLedger.open(tmp_path / "l")
    t = led.meta["tuning"]
    spent = np.asarray(led.state.spent)
    idle, busy = int(np.argmin(spent)), int(np.argmax(spent))
    assert spent[idle] == 0.0 and spent[busy] > 0.0
    kw = dict(tuning.search_args(t), delta=1e-5)
    assert kw["method"] == method
    for i in (idle, busy):
        d = build_account_report(ledger_path=tmp_path / "l", record_id=str(led.state.record_id[i])).data
        got = d["realised_epsilon_by_conversion"]
        # a record that was never selected still took part in the search: its loss is the search's, not 0
        assert got["rdp"] == tuning.composed_epsilon(budget_serve=float(spent[i]), **kw) >= t["epsilon_tuning"] > 0
        assert got["gdp"] is None  # Gaussian DP does not apply to the composition
        assert got["rdp"] <= d["epsilon"]  # never above the headline
    # the quantiles, the history and the export say the same
    d = build_account_report(ledger_path=tmp_path / "l").data
    q = d["realised_epsilon"]
    assert q["conversion"] == "rdp" and q["min"] >= t["epsilon_tuning"] and q["max"] <= d["epsilon"]
    assert all(p["realised_epsilon_median"] >= t["epsilon_tuning"] for p in d["history"])
    export_account(ledger_path=tmp_path / "l", out=tmp_path / "e.parquet")
    tab = pq.read_table(tmp_path / "e.parquet").to_pydict()
    assert all(v is None for v in tab["realised_epsilon_gdp"])
    assert min(tab["realised_epsilon_rdp"]) >= t["epsilon_tuning"]
    # account --eps E counts the records whose composed figure is above E (review 9: it used serving alone)
    for e in (0.5 * t["epsilon_tuning"], 0.5 * (t["epsilon_tuning"] + d["epsilon"]), 0.99 * d["epsilon"]):
        want = sum(v > e for v in tab["realised_epsilon_rdp"])
        got = build_account_report(ledger_path=tmp_path / "l", eps=e).data["check_eps"]
        assert got["records_realised_above_eps"] == want
    assert build_account_report(ledger_path=tmp_path / "l", eps=0.5 * t["epsilon_tuning"]).data[
        "check_eps"]["records_realised_above_eps"] == len(spent)  # every record took part in the search
    res = runner.invoke(app, ["account", "--ledger", str(tmp_path / "l"), "--record", str(led.state.record_id[idle])])
    assert res.exit_code == 0, res.output
    assert "tuning + serving" in " ".join(res.stdout.split())
    # --conversion gdp was ignored on a tuned ledger, and `--eps E --conversion gdp` passed on the rdp figure
    # (review 42): refused, for the report, its check and the export alike
    for args in (["--conversion", "gdp"], ["--eps", "1", "--conversion", "gdp"], ["--export", str(tmp_path / "x.csv"),
                                                                                  "--conversion", "gdp"]):
        res = runner.invoke(app, ["account", "--ledger", str(tmp_path / "l"), *args])
        assert res.exit_code == 2 and "tuned privately" in res.stderr and res.stdout == "", res.output
    assert not (tmp_path / "x.csv").exists()
    assert runner.invoke(app, ["account", "--ledger", str(tmp_path / "l"), "--conversion", "rdp"]).exit_code == 0
    # many distinct spent values (the grid path) never understate the composed figure
    many = np.linspace(0.0, led.params.budget, 400)
    vals = realised_loss(many, budget=led.params.budget, delta=1e-5, conversion="rdp", tuning=t)
    exact = [tuning.composed_epsilon(budget_serve=float(s), **kw) for s in many[::40]]
    assert np.all(vals[::40] >= np.asarray(exact) - 1e-12) and np.all(np.diff(vals) >= 0)


def test_untuned_ledger_realised_loss_is_unchanged(tmp_path):
    st = _store(tmp_path / "s.zarr")
    build_index(store_path=st.path, ledger_path=tmp_path / "l",
                params=make_params(epsilon=2.0, delta=1e-5, conversion="gdp", tau=0.3, sigma2=0.5))
    d = build_account_report(ledger_path=tmp_path / "l", record_id="r0000").data
    assert d["realised_epsilon_by_conversion"] == {"gdp": 0.0, "rdp": 0.0}


def test_export_user_spent_keeps_records_without_a_user_apart(tmp_path):
    """--user-for-missing record: each record without a user id is its own user; export must not pool them."""
    users = [f"u{i % 10}" if i < 200 else "" for i in range(300)]
    st = _store(tmp_path / "s.zarr", user_ids=users)
    build_index(store_path=st.path, ledger_path=tmp_path / "l",
                params=make_params(epsilon=2.0, delta=1e-5, conversion="gdp", tau=0.3, sigma2=0.5,
                                   privacy_unit="user", user_for_missing="record"))
    serve_queries(store_path=st.path, ledger_path=tmp_path / "l", query_batch="q1", seed=1)
    export_account(ledger_path=tmp_path / "l", out=tmp_path / "e.parquet")
    tab = pq.read_table(tmp_path / "e.parquet").to_pydict()
    spent = np.asarray(tab["spent"])
    user_spent = np.asarray(tab["user_spent"])
    own = np.array([u is None for u in tab["user_id"]])
    assert own.sum() == 100 and (spent[own] > 0).any() and (spent[own] == 0).any()
    assert np.array_equal(user_spent[own], spent[own])  # each is its own user
    for u in {u for u in tab["user_id"] if u}:
        m = np.array([x == u for x in tab["user_id"]])
        assert np.all(user_spent[m] == spent[m].max())


def test_tuning_a_private_set_too_small_for_its_shards_warns_the_operator(tmp_path):
    """Review 42, M2: 20 records tuned over 500 shards exited 0 without a word. index's warnings (operator only)
    now say so, naming N and S; enough records per shard, no warning."""
    for n, shards, warned in ((60, 40, True), (60, 10, False)):
        st = _store(tmp_path / f"s{n}-{shards}.zarr", n=n)
        req = tuning.TuneRequest(epsilon=1.0, delta=1e-5, seed=3, taus=(0.3,), sigma2s=(0.5,), n_val=shards,
                                 share=0.2, planned_queries=100)
        res = build_index(store_path=st.path, ledger_path=tmp_path / f"l{n}-{shards}", params=None, tune=req)
        said = [w for w in res.extra.get("warnings", []) if "--tune private split" in w]
        assert bool(said) == warned, res.extra
        if warned:
            assert f"{n} private records into S = {shards} validation shards" in said[0]


@pytest.mark.heavy
def test_verify_of_a_tuned_ledger_compares_b_with_the_serving_budget(tmp_path):
    """Review 55, F12: `account --verify` described a tuned ledger's B as "the calibration of ε=2 (to 1e-9)", its JSON
    `calibrated_budget` the untuned one (30 % above B here): a correct ledger looked off to a compliance reviewer."""
    import json

    st = _store(tmp_path / "s.zarr")
    req = tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=3, taus=(0.3,), sigma2s=(0.5,), n_val=40,
                             mean_runs=2.0, share=0.3, planned_queries=100, method="exp-mech")
    build_index(store_path=st.path, ledger_path=tmp_path / "l", params=None, tune=req)
    res = runner.invoke(app, ["account", "--ledger", str(tmp_path / "l"), "--store", str(st.path), "--verify",
                              "--json"])
    assert res.exit_code == 0, res.stderr
    b = json.loads(res.stdout)["budgets"]
    led = BudgetLedger.open(tmp_path / "l")
    assert b["calibrated_budget"] == b["budget"] == led.params.budget and b["bit_identical"]
    assert b["tuning_epsilon"] == led.meta["tuning"]["epsilon_tuning"] > 0
    res = runner.invoke(app, ["account", "--ledger", str(tmp_path / "l"), "--store", str(st.path), "--verify"],
                        env={"INDKNN_WIDTH": "400"})
    assert "what serving is left after private tuning's ε(rdp)=" in res.stdout + res.stderr
    assert "(bit-identical)" in res.stdout + res.stderr
