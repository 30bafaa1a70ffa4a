"""`indknn account`: the report, the cron checks, data-subject requests; read-only on real ledgers."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from indknn_cli import ledger_integrity as integrity
from indknn_cli.accounting import epsilon_for_budget
from indknn_cli.cli.app import app
from indknn_cli.errors import BadInputError, BudgetExhaustedError, CheckFailedError, LedgerError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.report import REALISED_LABEL, build_account_report, enforce_checks, open_ledger_readonly
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

runner = CliRunner()
PARAMS = dict(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100)
REQUIRED_KEYS = {"budget", "delta", "epsilon", "conversion", "epsilon_by_conversion", "records_active",
                 "records_retired", "records_deleted", "queries_answered", "batches", "spent_max", "spent_median"}
DELETED = [3, 4, 5]  # ledger indices tombstoned by the fixture (user u003..u005's first records)


def _delete(ledger_path, indices, store=None):
    """What `indknn delete` does: erase the store rows, commit a `delete` event (tombstone, spent kept)."""
    with BudgetLedger.write_lock(ledger_path):
        led = BudgetLedger.open(ledger_path)
        if store is not None:
            with store.write_lock():
                store.erase_rows("private", led.state.row[list(indices)])
        led.commit_event(event_type="delete", info={"records": len(indices)}, columns={
            "kind": ["delete"] * len(indices), "ledger_index": list(indices),
            "spent_after": [float(led.state.spent[i]) for i in indices]})


def _make_store(path):
    """The conftest `vector_store` (300 clustered records, 50 users, query batch q1) plus batch q2."""
    x, y, _ = clustered(300, 16, 3, seed=1)
    store = FeatureStore.create(path, extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=64)
    store.append("private", x, labels=y, record_ids=[f"r{i:04d}" for i in range(300)],
                 user_ids=[f"u{i % 50:03d}" for i in range(300)])
    q, _, _ = clustered(40, 16, 3, seed=2)
    store.append("query", q, record_ids=[f"q{i:03d}" for i in range(40)], batch="q1")
    q2, _, _ = clustered(30, 16, 3, seed=5)
    store.append("query", q2, record_ids=[f"p{i:03d}" for i in range(30)], batch="q2")
    return store


@pytest.fixture(scope="module")
def served_template(tmp_path_factory):
    """Built once by the library: index, two query batches (q1 in 3 parts, q2), three tombstones."""
    root = tmp_path_factory.mktemp("served")
    store = _make_store(root / "store.zarr")
    ledger = root / "L"
    build_index(store_path=store.path, ledger_path=ledger, params=make_params(**PARAMS))
    # unseeded (noise from OS entropy): a seeded ledger fails every --eps check (review 73, F0)
    serve_queries(store_path=store.path, ledger_path=ledger, query_batch="q1", batch_size=16)
    _delete(ledger, DELETED, store)
    serve_queries(store_path=store.path, ledger_path=ledger, query_batch="q2", batch_size=64)
    return root


@pytest.fixture
def served(served_template, tmp_path):
    """A private copy of the served ledger (tests may damage or compact it)."""
    shutil.copytree(served_template / "L", tmp_path / "L")
    return tmp_path / "L"


@pytest.fixture
def served_store(served_template):
    return FeatureStore.open(served_template / "store.zarr")


def synthetic_ledger(path, spent_fraction, *, deleted=(), params=None):
    """A ledger with given spent/B per record, made with the BudgetLedger API (no store)."""
    params = params or make_params(**PARAMS)
    led = BudgetLedger.create(path, params=params, store_uuid="synthetic", store_path="(none)")
    n = len(spent_fraction)
    led.add_records(record_ids=[f"r{i}" for i in range(n)], user_ids=[f"u{i % 3}" for i in range(n)],
                    rows=list(range(n)))
    spent = np.minimum(np.asarray(spent_fraction, dtype=np.float64) * params.budget, params.budget)
    charged = np.flatnonzero(spent > 0)
    led.commit_event(event_type="serve", info={"batch_id": "b0", "part": 0, "answers": 1}, columns={
        "kind": ["charge"] * charged.size + ["answer"],
        "ledger_index": charged.tolist() + [None], "spent_after": spent[charged].tolist() + [None],
        "selected": [1] * charged.size + [None], "batch_id": [None] * charged.size + ["b0"],
        "part": [None] * charged.size + [0], "query_index": [None] * charged.size + [0],
        "query_id": [None] * charged.size + ["q0"], "query_row": [None] * charged.size + [0],
        "label": [None] * charged.size + [0], "label_name": [None] * charged.size + ["a"],
        "released_count": [None] * charged.size + [30.0], "seed": [None] * (charged.size + 1),
    })
    if len(deleted):
        led.commit_event(event_type="delete", info={}, columns={
            "kind": ["delete"] * len(deleted), "ledger_index": list(deleted),
            "spent_after": [float(spent[i]) for i in deleted]})
    return path


def tree_hashes(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def account(*args, env=None):
    return runner.invoke(app, ["account", *map(str, args)], env={"INDKNN_WIDTH": "120", **(env or {})})


def account_json(*args, env=None):
    res = account(*args, "--json", env=env)
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1, (res.stdout, res.stderr)
    return res, json.loads(lines[0])


# -- the report -----------------------------------------------------------------------
def test_json_report_matches_the_ledger(served):
    before = tree_hashes(served)
    res, d = account_json("--ledger", served)
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    assert REQUIRED_KEYS <= set(d)
    led = BudgetLedger.open(served)
    s, p = led.state, led.params
    status = s.status(p.c1)
    assert d["records"] == len(s) == 300
    assert d["records_active"] == int(np.sum(status == "active"))
    assert d["records_retired"] == int(np.sum(status == "retired")) > 0
    assert d["records_deleted"] == int(np.sum(status == "deleted")) == len(DELETED)
    assert d["queries_answered"] == 70 and d["batches"] == 2
    assert d["budget"] == p.budget and d["delta"] == p.delta == 1e-5
    assert d["conversion"] == "gdp" and d["epsilon"] == epsilon_for_budget(budget=p.budget, delta=1e-5)
    assert d["epsilon"] <= 1.0
    assert d["epsilon_by_conversion"] == {c: epsilon_for_budget(budget=p.budget, delta=1e-5, conversion=c)
                                          for c in ("gdp", "rdp")}
    assert d["spent_max"] == s.spent.max() <= p.budget
    assert d["spent_median"] == np.quantile(s.spent, 0.5, method="higher")
    q = d["spent_quantiles"]
    assert q["min"] <= q["median"] <= q["p90"] <= q["p99"] <= q["max"] == d["spent_max"]
    re = d["realised_epsilon"]
    assert re["label"] == REALISED_LABEL and re["conversion"] == "gdp"
    assert re["max"] <= d["epsilon"] and re["min"] <= re["median"] <= re["p90"] <= re["p99"] <= re["max"]
    assert sum(d["answers_by_label"].values()) == 70
    assert tree_hashes(served) == before


def test_history_by_batch(served):
    _, d = account_json("--ledger", served)
    h = d["history"]
    assert [r["batch_id"] for r in h] == ["q1", "q2"]
    assert [r["answers"] for r in h] == [40, 30] and [r["parts"] for r in h] == [3, 1]
    assert [r["queries_answered"] for r in h] == [40, 70]
    assert h[0]["records_deleted"] == 0 and h[1]["records_deleted"] == 3
    assert h[0]["records_retired"] <= h[1]["records_retired"] == d["records_retired"]
    assert all(r["records_active"] + r["records_retired"] + r["records_deleted"] == r["records"] for r in h)
    assert all(0 <= r["retired_fraction"] <= 1 and r["conversion"] == "gdp" for r in h)
    assert all(r["realised_epsilon_median"] <= d["epsilon"] for r in h)


def test_history_survives_compaction(served_template, tmp_path):
    root = tmp_path / "world"  # a copy of store and ledger: the compaction announces itself in the store's mark
    shutil.copytree(served_template, root)
    lp, sp = root / "L", root / "store.zarr"
    _, before = account_json("--ledger", lp, "--store", sp)
    led = BudgetLedger.open(lp)
    integrity.attach(FeatureStore.open(sp, mode="r"), led, lp, bind=False)
    led.compact()
    _, after = account_json("--ledger", lp, "--store", sp)
    for key in ("history", "records_active", "records_retired", "records_deleted", "queries_answered",
                "spent_quantiles", "epsilon"):
        assert after[key] == before[key], key


def test_tables_for_people(served):
    res = account("--ledger", served)
    assert res.exit_code == 0 and res.stderr == ""
    out = res.stdout
    for needle in ("Guarantee", "ε (gdp)", "ε (rdp)", "Records", "History by batch", "q1", "q2", "spent / B",
                   REALISED_LABEL, "tombstones"):
        assert needle in out, needle
    assert not out.lstrip().startswith("{")
    assert max(len(line) for line in out.splitlines()) <= 120


def _epsilon_lines_name_their_conversion(text):
    for line in text.splitlines():
        if "ε" in line:
            assert "gdp" in line or "rdp" in line, line


def _epsilon_keys_name_their_conversion(obj):
    if isinstance(obj, dict):
        has_conv = any("conversion" in k for k in obj)
        for k, v in obj.items():
            if "epsilon" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
                assert has_conv, (k, obj)
            if k.endswith("by_conversion"):
                assert set(v) == {"gdp", "rdp"}
            _epsilon_keys_name_their_conversion(v)
    elif isinstance(obj, list):
        for v in obj:
            _epsilon_keys_name_their_conversion(v)


@pytest.mark.parametrize("extra", [[], ["--conversion", "rdp"], ["--delta", "1e-7"], ["--record", "r0010"],
                                   ["--user", "u003"], ["--eps", "0.5"], ["--eps", "2", "--conversion", "rdp"]])
def test_every_epsilon_names_its_conversion(served, extra):
    res = account("--ledger", served, *extra)
    _epsilon_lines_name_their_conversion(res.stdout)
    _epsilon_lines_name_their_conversion(res.stderr)
    res = account("--ledger", served, "--json", *extra)
    _epsilon_keys_name_their_conversion(json.loads(res.stdout))
    _epsilon_lines_name_their_conversion(res.stderr)


def test_conversion_and_delta_options(served):
    _, ref = account_json("--ledger", served)
    res, d = account_json("--ledger", served, "--conversion", "rdp")
    assert d["conversion"] == "rdp" and d["epsilon"] == ref["epsilon_by_conversion"]["rdp"] > ref["epsilon"]
    assert "calibrated with gdp" in res.stderr
    assert d["realised_epsilon"]["conversion"] == "rdp"
    res, d = account_json("--ledger", served, "--delta", "1e-8")
    assert d["delta"] == 1e-8 and d["ledger_delta"] == 1e-5
    assert [g["delta"] for g in d["guarantees"]] == [1e-5, 1e-8]
    assert d["guarantees"][0]["epsilon_by_conversion"] == ref["epsilon_by_conversion"]
    assert d["epsilon"] > ref["epsilon"]  # smaller δ, larger ε


def test_env_fallback_and_store_option(served, served_store, tmp_path):
    res, d = account_json(env={"INDKNN_LEDGER": str(served)})
    assert res.exit_code == 0 and d["records"] == 300
    res, d = account_json("--ledger", served, "--store", served_store.path)
    assert res.exit_code == 0, res.stderr
    assert d["store"]["label_names"] == ["a", "b", "c"] and d["store"]["rows_not_in_ledger"] == 0
    other = FeatureStore.create(tmp_path / "other.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=64)
    res = account("--ledger", served, "--store", other.path)
    assert res.exit_code == 2 and "another feature store" in res.stderr and res.stdout == ""
    res = account("--ledger", served, env={"INDKNN_STORE": str(tmp_path / "missing.zarr")})
    assert res.exit_code == 2 and "missing.zarr" in res.stderr


def test_fresh_ledger_without_answers(vector_store, tmp_path):
    build_index(store_path=vector_store.path, ledger_path=tmp_path / "L", params=make_params(**PARAMS))
    res, d = account_json("--ledger", tmp_path / "L")
    assert res.exit_code == 0
    assert d["queries_answered"] == 0 and d["batches"] == 0 and d["history"] == []
    assert d["records_active"] == 300 and d["spent_max"] == 0.0 and d["realised_epsilon"]["max"] == 0.0
    res = account("--ledger", tmp_path / "L", "--plot", tmp_path / "empty.png")
    assert res.exit_code == 0 and (tmp_path / "empty.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- checks for cron ----------------------------------------------------------------------
def test_eps_check_passes_and_fails(served):
    res, d = account_json("--ledger", served, "--eps", "1")
    assert res.exit_code == 0, res.stderr
    assert d["check_eps"]["passed"] and "check passed" in res.stderr
    res = account("--ledger", served, "--eps", "1")  # off a terminal: one verdict line on stderr, no tables
    assert res.exit_code == 0 and res.stdout == "" and len(res.stderr.strip().splitlines()) == 1

    res, d = account_json("--ledger", served, "--eps", "0.5")
    assert res.exit_code == 4
    chk = d["check_eps"]
    assert not chk["passed"] and chk["excess"] == pytest.approx(d["epsilon"] - 0.5)
    assert f"by {d['epsilon'] - 0.5:.6g}" in res.stderr and "ε(gdp)" in res.stderr
    # informational: how many records' realised loss exceeds E (exact conversion per record)
    led = BudgetLedger.open(served)
    exact = [epsilon_for_budget(budget=float(x), delta=1e-5) for x in led.state.spent]
    assert chk["records_realised_above_eps"] == sum(e > 0.5 for e in exact) > 0
    assert f"{chk['records_realised_above_eps']} records' realised loss ε(gdp, per record, add/remove one record) is above 0.5" in res.stderr

    res = account("--ledger", served, "--eps", "1", "--conversion", "rdp")  # rdp: ε ≈ 1.09 > 1
    assert res.exit_code == 4 and "ε(rdp)" in res.stderr
    res = account("--ledger", served, "--eps", "1", "--delta", "1e-8")  # smaller δ: larger ε
    assert res.exit_code == 4
    res = account("--ledger", served, "--eps", "1.4", "--delta", "1e-8")  # ε(gdp) ≈ 1.392
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("value,code", [("1000", 3), ("297", 3), ("10", 0), ("0", 0), ("0.99", 3), ("0.1", 0),
                                        ("10%", 0), ("100%", 3)])
def test_min_active(served, value, code):
    res, d = account_json("--ledger", served, "--min-active", value)
    assert res.exit_code == code, res.stderr
    chk = d["check_min_active"]
    assert chk["passed"] == (code == 0) and chk["records_active"] == d["records_active"]
    if code:
        assert "active" in res.stderr and value in res.stderr


def test_both_checks_fail_eps_wins(served):
    res, _ = account_json("--ledger", served, "--eps", "0.5", "--min-active", "1000")
    assert res.exit_code == 4
    assert "--eps 0.5" in res.stderr and "--min-active 1000" in res.stderr


def test_checks_in_the_library(tmp_path):
    path = synthetic_ledger(tmp_path / "L", [0.0, 0.5, 1.0, 1.0])
    rep = build_account_report(ledger_path=path, eps=0.3, min_active=3)
    assert [c for c, _ in rep.failures] == [CheckFailedError, BudgetExhaustedError]
    with pytest.raises(CheckFailedError, match="min-active"):
        enforce_checks(rep)
    rep = build_account_report(ledger_path=path, min_active="0.75")
    with pytest.raises(BudgetExhaustedError, match="only 2 records are active"):
        enforce_checks(rep)
    enforce_checks(build_account_report(ledger_path=path, eps=5, min_active=2))


# -- data-subject access requests ------------------------------------------------------------
def test_record_request(served):
    led = BudgetLedger.open(served)
    s, p = led.state, led.params
    i = int(np.argmax(s.times_selected))
    rid = s.record_id[i]
    res, d = account_json("--ledger", served, "--record", rid)
    assert res.exit_code == 0, res.stderr
    r = d  # the record's own figures at the top level (issue 15 §4)
    assert r["record_id"] == rid and r["user_id"] == s.user_id[i]
    assert r["status"] == s.status(p.c1)[i]
    assert r["spent"] == s.spent[i] and r["times_selected"] == s.times_selected[i] > 0
    assert 0 <= r["remaining"] <= p.budget - r["spent"]
    assert r["realised_epsilon_by_conversion"]["gdp"] <= d["epsilon_by_conversion"]["gdp"]
    assert r["realised_epsilon_by_conversion"]["rdp"] <= d["epsilon_by_conversion"]["rdp"]
    assert r["realised_label"] == REALISED_LABEL and r["deleted"] is False and r["deleted_at"] is None
    res = account("--ledger", served, "--record", rid)
    assert res.exit_code == 0 and rid in res.stdout and "times selected" in res.stdout
    assert "History by batch" not in res.stdout


def test_deleted_record_and_user(served):
    led = BudgetLedger.open(served)
    rid = led.state.record_id[DELETED[0]]
    _, d = account_json("--ledger", served, "--record", rid)
    r = d
    assert r["deleted"] is True and r["status"] == "deleted" and r["deleted_at"].startswith("20")
    res = account("--ledger", served, "--record", rid)
    assert "yes, at" in res.stdout

    user = led.state.user_id[DELETED[0]]
    res, d = account_json("--ledger", served, "--user", user)
    assert res.exit_code == 0
    u = d
    mine = np.flatnonzero(led.state.user_id == user)
    assert u["subject"] == "user" and u["user_id"] == user
    assert u["records"] == len(mine) == 6 and u["records_deleted"] == 1
    assert {x["record_id"] for x in u["record_list"]} == set(led.state.record_id[mine])
    res = account("--ledger", served, "--user", user)
    assert res.exit_code == 0 and user in res.stdout and "deleted" in res.stdout


@pytest.mark.parametrize("opt,value", [("--record", "no-such-record"), ("--user", "nobody"), ("--user", "")])
def test_unknown_ids_are_bad_input(served, opt, value):
    before = tree_hashes(served)
    res = account("--ledger", served, opt, value)
    assert res.exit_code == 2 and res.stdout == ""
    assert repr(value) in res.stderr
    assert tree_hashes(served) == before


# -- plot -------------------------------------------------------------------------------------
def test_plot(served, tmp_path):
    out = tmp_path / "account.png"
    res = account("--ledger", served, "--plot", out, "--json")
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert json.loads(res.stdout)["plot"] == str(out)
    assert str(out) in res.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("name", ["plot.txt", "missing-folder/plot.png"])
def test_bad_plot_path(served, tmp_path, name):
    res = account("--ledger", served, "--plot", tmp_path / name)
    assert res.exit_code == 2 and res.stdout == "" and "--plot" in res.stderr
    assert not (tmp_path / name).exists()


# -- bad input, corrupt ledgers: clear errors, nothing modified --------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--delta", "0"], "delta"), (["--delta", "-1e-5"], "delta"), (["--delta", "1"], "delta"),
    (["--delta", "1.5"], "delta"), (["--eps", "0"], "epsilon"), (["--eps", "-1"], "epsilon"),
    (["--eps", "nan"], "epsilon"), (["--conversion", "zcdp"], "conversion"), (["--min-active", "abc"], "min-active"),
    (["--min-active", "-3"], "min-active"), (["--min-active", "1.5"], "min-active"),
])
def test_bad_options(served, args, needle):
    before = tree_hashes(served)
    res = account("--ledger", served, *args)
    assert res.exit_code == 2, res.stderr
    assert needle in res.stderr and res.stdout == ""
    assert tree_hashes(served) == before


def _truncate(p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _set_snapshot_meta(p, **changes):
    t = pq.read_table(p)
    meta = json.loads(t.schema.metadata[b"indknn"])
    meta.update(changes)
    pq.write_table(t.replace_schema_metadata({b"indknn": json.dumps(meta).encode()}), p)


def _set_event_meta(p, **changes):
    t = pq.read_table(p)
    info = json.loads(t.schema.metadata[b"indknn_event"])
    info.update(changes)
    pq.write_table(t.replace_schema_metadata({b"indknn_event": json.dumps(info).encode()}), p)


def _snapshot(path):
    return sorted(path.glob("snapshot-*.parquet"))[-1]


def _event(path):
    return sorted((path / "events").glob("*.parquet"))[-1]


CORRUPTIONS = {
    "current-garbage": (lambda L: (L / "CURRENT").write_text("{not json"), "CURRENT"),
    "current-missing-snapshot": (lambda L: (L / "CURRENT").write_text('{"generation": 42}'), "missing"),
    "snapshot-truncated": (lambda L: _truncate(_snapshot(L)), "truncated"),
    "answers-truncated": (lambda L: _truncate(sorted(L.glob("answers-*.parquet"))[-1]), "truncated"),
    "event-truncated": (lambda L: _truncate(_event(L)), "truncated"),
    "snapshot-format-version": (lambda L: _set_snapshot_meta(_snapshot(L), format_version=2), "format_version"),
    "event-format-version": (lambda L: _set_event_meta(_event(L), format_version=7), "format_version"),
    "event-foreign": (lambda L: _set_event_meta(_event(L), ledger_uuid="0" * 32), "another ledger"),
    "snapshot-meta-not-json": (
        lambda L: pq.write_table(pq.read_table(_snapshot(L)).replace_schema_metadata({b"indknn": b"{oops"}),
                                 _snapshot(L)), "corrupt"),
    "stray-event-file": (lambda L: (L / "events" / "notes.parquet").write_text("x"), "unexpected file"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_ledgers_are_clear_errors(served, kind):
    damage, needle = CORRUPTIONS[kind]
    damage(served)
    before = tree_hashes(served)
    for extra in ([], ["--json"], ["--eps", "1"], ["--record", "r0001"]):
        res = account("--ledger", served, *extra)
        # a truncated file, or a CURRENT that is garbage or names a missing snapshot, is a damaged ledger, exit 1
        # (README; `indknn repair`; CURRENT since review 31); the rest exit 2
        assert res.exit_code == (1 if kind.endswith("-truncated") or kind.startswith("current-") else 2), (
            kind, res.stderr)
        assert needle in res.stderr and res.stdout == ""
        assert "Traceback" not in res.stderr
    assert tree_hashes(served) == before


def test_missing_ledger(tmp_path):
    res = account("--ledger", tmp_path / "nope")
    assert res.exit_code == 2 and "no budget ledger" in res.stderr and res.stdout == ""
    assert not (tmp_path / "nope").exists()


# -- read-only, concurrent with a writer ---------------------------------------------------------
def test_never_writes_and_ignores_a_held_lock(served):
    """Another process holds BudgetLedger.write_lock (as serve-queries does): account still answers."""
    _, ref = account_json("--ledger", served)
    code = textwrap.dedent(f"""
        import sys
        from indknn_cli.ledger import BudgetLedger
        with BudgetLedger.write_lock({str(served)!r}, timeout=5):
            print("locked", flush=True)
            sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(Exception):  # the lock really is held
            with BudgetLedger.write_lock(served, timeout=0):
                pass
        before = tree_hashes(served)
        for extra in ([], ["--eps", "1", "--min-active", "10"], ["--record", "r0007"], ["--eps", "0.1"]):
            res = account("--ledger", served, "--json", *extra)
            assert res.exit_code in (0, 4), res.stderr
            d = json.loads(res.stdout)
            if "--record" in extra:  # a data subject's view: that record only
                assert d["record_id"] == "r0007" and d["epsilon"] == ref["epsilon"]
                continue
            assert d["records_active"] == ref["records_active"] and d["spent_max"] == ref["spent_max"]
        assert tree_hashes(served) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_consistent_read_while_a_writer_compacts(tmp_path, monkeypatch):
    """A compaction between reading the snapshot and listing the events must not yield a mixed state.

    Reader: snapshot g (records spent 0) … writer: event E1 already committed (charges record 0),
    compaction folds E1 into g+1 and deletes it, then E2 charges record 1 … reader lists events: only E2.
    The old-snapshot + E2 state never existed (record 0's charge lost); the reader must read again.
    """
    path = synthetic_ledger(tmp_path / "L", [0.0, 0.0, 0.0])
    BudgetLedger.open(path).compact()
    params = BudgetLedger.open(path).params

    def charge(led, i, spent):
        led.commit_event(event_type="serve", info={"batch_id": f"b{i}", "part": 0, "answers": 0}, columns={
            "kind": ["charge"], "ledger_index": [i], "spent_after": [spent], "selected": [1]})

    charge(BudgetLedger.open(path), 0, params.budget / 2)  # E1, after the snapshot
    original = BudgetLedger._event_files
    armed = {"on": True}

    def racing_event_files(self):
        if armed["on"] and self.generation == 1 and self.last_event_seq == self.snapshot_event_seq:
            armed["on"] = False
            writer = BudgetLedger.open(path)
            writer.compact()                                   # folds E1, deletes its file
            charge(writer, 1, params.budget / 4)               # E2
        return original(self)

    monkeypatch.setattr(BudgetLedger, "_event_files", racing_event_files)
    led = open_ledger_readonly(path)
    assert not armed["on"]  # the race did happen
    assert led.state.spent[0] == params.budget / 2 and led.state.spent[1] == params.budget / 4


# -- property: report counts and realised loss on random ledgers ----------------------------------
@given(fractions=st.lists(st.one_of(st.just(0.0), st.just(1.0), st.floats(min_value=0.0, max_value=1.0)),
                          min_size=1, max_size=40),
       deleted=st.sets(st.integers(min_value=0, max_value=39), max_size=5),
       conversion=st.sampled_from(["gdp", "rdp"]))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
def test_report_invariants_on_random_ledgers(tmp_path_factory, fractions, deleted, conversion):
    path = tmp_path_factory.mktemp("prop") / "L"
    deleted = sorted(i for i in deleted if i < len(fractions))
    synthetic_ledger(path, fractions, deleted=deleted)
    rep = build_account_report(ledger_path=path, conversion=conversion, eps=0.5)
    d = rep.data
    led = BudgetLedger.open(path)
    status = led.state.status(led.params.c1)
    assert d["records_active"] == int(np.sum(status == "active"))
    assert d["records_retired"] == int(np.sum(status == "retired"))
    assert d["records_deleted"] == len(deleted) == int(np.sum(status == "deleted"))
    assert d["spent_max"] <= d["budget"]
    assert d["realised_epsilon"]["max"] <= d["epsilon"]
    exact = [epsilon_for_budget(budget=float(x), delta=1e-5, conversion=conversion) for x in led.state.spent]
    assert d["check_eps"]["records_realised_above_eps"] == sum(e > 0.5 for e in exact)
    for i in range(len(fractions)):
        rec = build_account_report(ledger_path=path, record_id=f"r{i}").data
        assert rec["status"] == status[i]
        for c in ("gdp", "rdp"):
            assert rec["realised_epsilon_by_conversion"][c] <= d["epsilon_by_conversion"][c]
        assert math.isclose(rec["remaining"] + rec["spent"], d["budget"], rel_tol=1e-12) or rec["remaining"] == 0
        assert rec["remaining"] <= d["budget"] - rec["spent"]


def test_ledger_errors_are_typed(tmp_path):
    with pytest.raises(LedgerError):
        build_account_report(ledger_path=tmp_path / "none")
    path = synthetic_ledger(tmp_path / "L", [0.1])
    with pytest.raises(BadInputError):
        build_account_report(ledger_path=path, record_id="r9")


def test_ledger_without_records_and_all_tombstones(tmp_path):
    empty = tmp_path / "E"
    BudgetLedger.create(empty, params=make_params(**PARAMS), store_uuid="x", store_path="(none)")
    rep = build_account_report(ledger_path=empty, eps=1, plot_path=tmp_path / "e.png")
    assert rep.data["records"] == 0 and rep.data["spent_max"] is None and rep.failures == []
    assert (tmp_path / "e.png").is_file()
    gone = synthetic_ledger(tmp_path / "G", [0.2, 0.4], deleted=[0, 1])
    rep = build_account_report(ledger_path=gone, min_active="0.1")  # no active record left: fails
    assert rep.data["records_deleted"] == 2
    with pytest.raises(BudgetExhaustedError):
        enforce_checks(rep)
    enforce_checks(build_account_report(ledger_path=gone, min_active="0"))


# -- issue 15 §3/§4: honest subject views -------------------------------------------------------------------
AGGREGATE_KEYS = {"records_active", "records_retired", "spent_quantiles", "spent_fraction_quantiles", "spent_median",
                  "spent_max", "realised_epsilon", "history", "queries_answered", "answers_by_label", "batches",
                  "check_eps", "check_min_active", "store", "record", "user"}


def test_record_json_is_the_records_own_figures_only(served):
    led = BudgetLedger.open(served)
    i = int(np.argmax(led.state.times_selected))
    rid = led.state.record_id[i]
    res, d = account_json("--ledger", served, "--record", rid)
    assert res.exit_code == 0, res.stderr
    assert d["subject"] == "record" and d["record_id"] == rid and d["spent"] == led.state.spent[i]
    assert d["times_selected"] == led.state.times_selected[i] and "realised_epsilon_by_conversion" in d
    assert not AGGREGATE_KEYS & set(d), AGGREGATE_KEYS & set(d)  # nothing about other people's records
    assert d["unit"] == "record" and d["adjacency"] == "add/remove one record"
    res, d = account_json("--ledger", served, "--user", led.state.user_id[i])
    assert not (AGGREGATE_KEYS - {"records_active", "records_retired"}) & set(d)
    for extra in (["--eps", "1"], ["--min-active", "10"]):  # ledger-wide checks are not part of a subject's view
        res = account("--ledger", served, "--record", rid, *extra)
        assert res.exit_code == 2 and res.stdout == "" and extra[0] in res.stderr


def test_user_view_has_no_user_level_epsilon_and_says_why(served):
    led = BudgetLedger.open(served)
    user = led.state.user_id[DELETED[0]]
    res, d = account_json("--ledger", served, "--user", user)
    assert not [k for k in d if "user_epsilon" in k or k == "spent_total"]
    assert "guarantee is per record" in d["user_level"] and d["adjacency"] == "add/remove one record"
    res = account("--ledger", served, "--user", user)
    text = " ".join(res.stdout.split())
    assert res.exit_code == 0 and "user-level loss" not in text and "records composed" not in text
    assert "no user-level figure" in text and "add/remove one record" in text


@pytest.mark.parametrize("opt", ["--record", "--user"])
def test_subject_views_keep_their_bracketed_label(served, opt):
    """Rich markup must not swallow "[realised individual loss (descriptive, not a guarantee)]" (issue 15 §4)."""
    led = BudgetLedger.open(served)
    value = led.state.record_id[10] if opt == "--record" else led.state.user_id[10]
    res = account("--ledger", served, opt, value)
    assert res.exit_code == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert f"[{REALISED_LABEL}]" in text
    assert "adjacency: add/remove one record" in text


def test_bracketed_ids_are_printed_verbatim(tmp_path):
    params = make_params(**PARAMS)
    led = BudgetLedger.create(tmp_path / "L", params=params, store_uuid="synthetic", store_path="(none)")
    led.add_records(record_ids=["r[bold]1[/bold]", "r[n, d]"], user_ids=["u[x]", "u[x]"], rows=[0, 1])
    res = account("--ledger", tmp_path / "L", "--record", "r[n, d]")
    assert res.exit_code == 0 and "Record r[n, d]" in res.stdout
    res = account("--ledger", tmp_path / "L", "--user", "u[x]")
    assert res.exit_code == 0 and "User u[x]" in res.stdout and "r[bold]1[/bold]" in res.stdout


def test_account_json_states_unit_and_adjacency(served):
    _, d = account_json("--ledger", served)
    assert d["unit"] == "record" and d["adjacency"] == "add/remove one record"
    assert "replace-one" in d["scope"] and "μ doubles" in d["scope"]
    res = account("--ledger", served)
    assert "adjacency: add/remove one record" in " ".join(res.stdout.split())
    res = runner.invoke(app, ["account", "--help"], env={"INDKNN_WIDTH": "200"})
    assert "add/remove" in res.stdout and "no user-level ε" in " ".join(res.stdout.split())


def test_account_uses_the_ledgers_cached_guarantee_and_skips_dp_accounting(tmp_path):
    """Issue 21 (fixed cost per process): `index` records ε of B at δ under every conversion; `account` prints
    the same figures without importing dp-accounting (1.2 s of a 1.8 s `account` process here)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from indknn_cli.accounting import epsilon_by_conversion
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

    x = normalize_rows(np.random.default_rng(0).standard_normal((50, 8))).astype(np.float32)
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                             label_names=["a", "b"])
    st.append("private", x, labels=(np.arange(50) % 2).astype(np.int32), record_ids=[f"r{i}" for i in range(50)])
    build_index(store_path=st.path, ledger_path=tmp_path / "L",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=10))
    led = BudgetLedger.open(tmp_path / "L")
    cached = led.meta["epsilon_at_budget"]
    expect = epsilon_by_conversion(budget=led.params.budget, delta=led.params.delta)
    assert cached == {"budget": led.params.budget, "delta": led.params.delta, "by_conversion": expect}
    probe = ("import json, sys\nfrom indknn_cli.report import build_account_report\n"
             "r = build_account_report(ledger_path=sys.argv[1], store_path=sys.argv[2]).data\n"
             "print(json.dumps({'dp': 'dp_accounting' in sys.modules, 'g': r['guarantees']}))\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = json.loads(subprocess.run([sys.executable, "-c", probe, str(tmp_path / "L"), str(st.path)], env=env,
                                    capture_output=True, text=True, check=True).stdout)
    assert out["dp"] is False
    assert out["g"][0]["epsilon_by_conversion"] == expect
    # another δ than the ledger's: computed (dp-accounting), not taken from the cache
    from indknn_cli.report import _guarantee

    other = _guarantee(led.params.budget, 1e-6, cached)
    assert other["epsilon_by_conversion"] == epsilon_by_conversion(budget=led.params.budget, delta=1e-6)
    assert other["epsilon_by_conversion"]["rdp"] != expect["rdp"]


def test_a_cached_guarantee_above_the_ledgers_epsilon_is_recomputed():
    from indknn_cli.accounting import calibrate_budget, epsilon_by_conversion
    from indknn_cli.ledger_state import PrivacyParams
    from indknn_cli.report import _guarantee

    b = calibrate_budget(epsilon=1.0, delta=1e-5, conversion="gdp")
    p = PrivacyParams(epsilon=1.0, delta=1e-5, conversion="gdp", budget=b, kernel="cosine", tau=0.5, sigma1=5.0,
                      sigma2=0.6, nu=None, k_min=3.0, planned_queries=10)
    true = epsilon_by_conversion(budget=b, delta=1e-5)
    edited = {"budget": b, "delta": 1e-5, "by_conversion": {"gdp": 0.01, "rdp": 0.02}}
    assert _guarantee(b, 1e-5, edited, p)["epsilon_by_conversion"] == {"gdp": 0.01, "rdp": 0.02}  # plausible: used
    above = {"budget": b, "delta": 1e-5, "by_conversion": {"gdp": 7.0, "rdp": 0.02}}
    assert _guarantee(b, 1e-5, above, p)["epsilon_by_conversion"] == true
