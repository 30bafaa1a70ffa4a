"""serve-queries end to end: charge before release, idempotency, crashes, locks, exhaustion."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indknn_cli import ledger_files as ledger_mod
from indknn_cli.errors import LedgerError, LockTimeoutError, BadInputError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered, copies_of_pair


def _index(store, tmp_path, **kw):
    p = make_params(epsilon=1.0, delta=1e-5, tau=kw.pop("tau", 0.5), sigma2=0.5,
                    planned_queries=kw.pop("planned_queries", 100), **kw)
    build_index(store_path=store.path, ledger_path=tmp_path / "ledger", params=p)
    return tmp_path / "ledger"


def _state(ledger_path):
    led = BudgetLedger.open(ledger_path)
    return led.state.spent.copy(), led


def test_serve_then_rerun_is_idempotent(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    first = serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", batch_size=16)
    assert first.newly_answered == 40 and len(first.answers) == 40
    spent1, led1 = _state(lp)
    assert spent1.max() > 0 and (spent1 <= led1.params.budget).all()
    events1 = sorted(p.name for p in (lp / "events").iterdir())
    again = serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", batch_size=5)
    assert again.newly_answered == 0 and again.already_answered == 40
    assert [a["label"] for a in again.answers] == [a["label"] for a in first.answers]
    assert [a["released_count"] for a in again.answers] == [a["released_count"] for a in first.answers]
    spent2, _ = _state(lp)
    assert (spent2 == spent1).all()
    assert sorted(p.name for p in (lp / "events").iterdir()) == events1  # nothing written


def test_unseeded_runs_draw_fresh_entropy(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    a = serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", batch_id="a")
    b = serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", batch_id="b")
    assert [x["released_count"] for x in a.answers] != [x["released_count"] for x in b.answers]
    assert all("seed" not in x for x in a.answers)
    led = BudgetLedger.open(lp)
    assert all(s is None for s in led.state.answers["seed"])


def test_seed_is_recorded_in_output_and_event(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    res = serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", seed=7)
    assert all(a["seed"] == 7 for a in res.answers)
    ev = [pq.read_table(p) for p in sorted((lp / "events").glob("*serve*.parquet"))]
    infos = [json.loads(t.schema.metadata[b"indknn_event"]) for t in ev]
    assert infos and all(i["seed"] == "7" for i in infos)


@pytest.mark.heavy
@pytest.mark.parametrize("point", ["before-event-write", "event-written-tmp", "event-committed"])
@pytest.mark.parametrize("fail_on", [1, 3])
def test_fault_injection_never_releases_uncommitted_answers(vector_store, tmp_path, point, fail_on):
    # Uninterrupted reference run on a copy of the same state (same seed → same answers).
    lp = _index(vector_store, tmp_path)
    # a ledger copy serves with its store copy (one store, one ledger), none beside a live original (store_twins)
    (sp, lp), (ref_sp, ref_lp) = copies_of_pair(vector_store.path, lp, tmp_path / "live", tmp_path / "ref")
    ref = serve_queries(store_path=ref_sp, ledger_path=ref_lp, query_batch="q1", seed=11, batch_size=8)

    released: list[dict] = []
    calls = {"n": 0}

    def hook(name):
        if name == point:
            calls["n"] += 1
            if calls["n"] == fail_on:
                raise RuntimeError("injected crash")

    ledger_mod.FAULT_HOOK = hook
    try:
        with pytest.raises(RuntimeError):
            serve_queries(store_path=sp, ledger_path=lp, query_batch="q1", seed=11, batch_size=8,
                          on_committed=released.extend)
    finally:
        ledger_mod.FAULT_HOOK = None
    led = BudgetLedger.open(lp)  # readable after the crash
    committed = set(led.answers_for("q1")["query_index"])
    assert {r["query_index"] for r in released} <= committed  # nothing released without its charge
    assert not list((lp / "events").glob(".*tmp*"))  # no half-written event left visible
    spent_crash = led.state.spent.copy()
    done = serve_queries(store_path=sp, ledger_path=lp, query_batch="q1", seed=11, batch_size=8)
    assert done.already_answered == len(committed)
    assert [a["label"] for a in done.answers] == [a["label"] for a in ref.answers]
    spent_final, _ = _state(lp)
    spent_ref, _ = _state(ref_lp)
    assert (spent_final == spent_ref).all()  # resuming charged exactly the missing queries
    assert (spent_final >= spent_crash).all()


def _serve_subprocess_world(tmp_path, n_private: int, n_queries: int):
    """A store of clustered records with one query batch "big", its ledger, and the serve-queries command line."""
    x, y, _ = clustered(n_private, 32, 4, seed=3)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=32,
                                label_names=list("abcd"))
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(n_private)])
    q, _, _ = clustered(n_queries, 32, 4, seed=4)
    store.append("query", q, record_ids=[f"q{i}" for i in range(n_queries)], batch="big")
    lp = _index(store, tmp_path, planned_queries=n_queries)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "-m", "indknn_cli", "serve-queries", "big", "--store", str(store.path), "--ledger",
           str(lp), "--batch-size", "16", "--seed", "5", "--device", "cpu"]
    return lp, env, cmd


def _first_answers(proc, n: int) -> list[dict]:
    """The first ``n`` answer lines a serve-queries subprocess prints (fewer if it ends first)."""
    lines = []
    for line in proc.stdout:
        lines.append(json.loads(line))
        if len(lines) >= n:
            break
    return lines


@pytest.mark.heavy
def test_sigterm_mid_batch_exits_143_with_every_printed_answer_charged(tmp_path):
    """Review 48, F10: SIGTERM (a `kill`, a systemd stop, `timeout`) killed serve-queries at once: exit 143 and no
    word. Now it ends as Ctrl-C does: "Terminated." on stderr, exit 143, every printed answer in the ledger, no
    traceback; re-running resumes with the same answers."""
    lp, env, cmd = _serve_subprocess_world(tmp_path, 2000, 3000)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    lines = _first_answers(proc, 100)
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=120)
    lines += [json.loads(l) for l in rest.splitlines() if l.strip()]
    assert proc.returncode == 143, err
    assert "Terminated." in err and "Traceback" not in err and "Internal error" not in err, err
    assert 100 <= len(lines) < 3000
    committed = set(BudgetLedger.open(lp).answers_for("big")["query_index"])
    assert {r["query_index"] for r in lines} <= committed  # every printed answer charged (a part committed as the
    # signal came may be unprinted: charged, never released; the re-run prints it from the ledger)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    by_index = {r["query_index"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert len(by_index) == 3000 and all(by_index[r["query_index"]]["label"] == r["label"] for r in lines)


@pytest.mark.heavy
def test_kill_9_mid_batch(tmp_path):
    """A real `kill -9` of a serve-queries subprocess: every printed answer has its committed charge."""
    lp, env, cmd = _serve_subprocess_world(tmp_path, 3000, 4000)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    lines = _first_answers(proc, 200)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rest = proc.stdout.read()
    lines += [json.loads(l) for l in rest.splitlines() if l.strip()]
    assert 200 <= len(lines) < 4000
    led = BudgetLedger.open(lp)
    committed = set(led.answers_for("big")["query_index"])
    assert {r["query_index"] for r in lines} <= committed
    assert (led.state.spent <= led.params.budget).all()
    spent_after_kill = led.state.spent.copy()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    final = [json.loads(l) for l in out.stdout.splitlines()]
    assert [r["query_index"] for r in final] == list(range(4000))
    by_index = {r["query_index"]: r for r in final}
    assert all(by_index[r["query_index"]]["label"] == r["label"] for r in lines)  # same released answers
    led2 = BudgetLedger.open(lp)
    assert (led2.state.spent >= spent_after_kill).all()


def test_second_writer_waits_then_fails_clearly(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    with BudgetLedger.write_lock(lp):
        with pytest.raises(LockTimeoutError, match="lock"):
            serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", lock_timeout=0.2)
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1")


def test_all_records_retired_still_answers_every_query_from_noise(tmp_path):
    """SPEC §8: once every record is retired, serving still answers each query (exit 0 on the CLI) with
    K_t = max(σ1·z, K_min) and argmax(reuse + noise); today's main raised BudgetExhaustedError (exit 3)."""
    x, y, _ = clustered(20, 8, 2, seed=9)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                label_names=["a", "b"])
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(20)])
    q = np.repeat(x[:1], 1, axis=0)
    p = make_params(epsilon=0.5, delta=1e-5, tau=0.01, sigma2=0.5, sigma1=8.0, k_min=1)
    build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p)
    # 120 queries in one batch (the filter charges them one after another, as 120 one-query batches would)
    store.append("query", np.repeat(q, 120, axis=0), record_ids=[f"q{i}" for i in range(120)], batch="b")
    res = serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="b", reuse=False,
                        batch_size=16)
    assert res.newly_answered == 120 and len(res.answers) == 120
    led = BudgetLedger.open(tmp_path / "L")
    assert not led.state.active_mask(led.params.c1).any()  # every record retired ...
    assert (led.state.spent <= led.params.budget).all()
    spent_before = led.state.spent.copy()
    store.append("query", np.repeat(q, 40, axis=0), record_ids=[f"z{i}" for i in range(40)], batch="after")
    res = serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="after", reuse=False)
    assert res.newly_answered == 40  # ... and every query is still answered
    assert all(a["released_count"] >= p.k_min for a in res.answers)
    assert len({a["label"] for a in res.answers}) == 2  # argmax of noise: both labels occur
    led = BudgetLedger.open(tmp_path / "L")
    assert np.array_equal(led.state.spent, spent_before)  # nobody charged


def test_ledger_of_another_store_is_refused(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    other = FeatureStore.create(tmp_path / "other.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"])
    x, y, _ = clustered(10, 16, 3, seed=1)
    other.append("private", x, labels=y, record_ids=[f"o{i}" for i in range(10)])
    other.append("query", x[:2], record_ids=["a", "b"], batch="q")
    with pytest.raises(LedgerError, match="another feature store"):
        serve_queries(store_path=other.path, ledger_path=lp, query_batch="q")


def test_batch_id_reused_for_other_queries_is_refused(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", batch_id="day-1")
    x, _, _ = clustered(5, 16, 3, seed=12)
    vector_store.append("query", x, record_ids=[f"n{i}" for i in range(5)], batch="q2")
    with pytest.raises(BadInputError, match="already used"):
        serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q2", batch_id="day-1")


def test_new_records_join_with_full_budget_and_old_keep_spent(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1")
    spent_before, led = _state(lp)
    x, y, _ = clustered(10, 16, 3, seed=13)
    vector_store.append("private", x, labels=y, record_ids=[f"new{i}" for i in range(10)])
    res = build_index(store_path=vector_store.path, ledger_path=lp, params=None)
    assert res.records_added == 10 and res.records == 310
    spent_after, _ = _state(lp)
    assert (spent_after[:300] == spent_before).all() and (spent_after[300:] == 0).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["random", "repeat", "boundary", "mixed"]), n=st.integers(1, 300),
       seed=st.integers(0, 2**31), kernel=st.sampled_from(["cosine", "rbf"]))
@pytest.mark.heavy
def test_no_record_ever_exceeds_its_budget(tmp_path_factory, kind, n, seed, kernel):
    tmp = tmp_path_factory.mktemp("prop")
    rng = np.random.default_rng(seed)
    x, y, _ = clustered(60, 8, 3, seed=seed % 1000)
    store = FeatureStore.create(tmp / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                label_names=["a", "b", "c"])
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(60)])
    if kind == "random":
        q = rng.standard_normal((n, 8))
    elif kind == "repeat":
        q = np.repeat(x[rng.integers(0, 60, 1)], n, axis=0)
    elif kind == "boundary":  # queries whose cosine with record 0 is exactly around τ
        q = np.repeat(x[:1], n, axis=0)
    else:
        q = np.concatenate([np.repeat(x[:2], n // 2 + 1, axis=0), rng.standard_normal((n, 8))])[:n]
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    store.append("query", q.astype(np.float32), record_ids=[f"q{i}" for i in range(len(q))], batch="b")
    tau = 0.999 if kind == "boundary" else 0.3
    p = make_params(epsilon=float(rng.uniform(0.2, 3)), delta=1e-5, kernel=kernel, tau=tau,
                    sigma2=float(rng.uniform(0.05, 2)), planned_queries=int(rng.integers(4, 100)),
                    nu=float(rng.uniform(0.3, 5)) if kernel == "rbf" else None, k_min=float(rng.integers(1, 40)))
    build_index(store_path=store.path, ledger_path=tmp / "L", params=p)
    serve_queries(store_path=store.path, ledger_path=tmp / "L", query_batch="b",
                  batch_size=int(rng.integers(1, 64)), seed=seed)
    led = BudgetLedger.open(tmp / "L")
    assert (led.state.spent <= led.params.budget).all()
    assert (led.state.spent >= 0).all()
