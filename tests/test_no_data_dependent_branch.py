"""SPEC §8 "no noise-free branch": what a query-sender observes (exit code, number of answers, the fields
and, with a fixed seed, the answers themselves) is the same in neighbouring worlds D and D ∪ {x} when x is
never a candidate — in particular when every record of D is retired, where today's main exited 3 for D and
answered for D ∪ {x} (x identified with certainty, at no charge)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

runner = CliRunner()
D = 8


def _world(path, x_priv, y, *, with_x: bool, params):
    """A store + ledger of D (and the outlier x, far from every query, when ``with_x``)."""
    store = FeatureStore.create(path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                                label_names=["a", "b", "c"], chunk_rows=16)
    ids = [f"r{i}" for i in range(len(x_priv))]
    store.append("private", x_priv, labels=y, record_ids=ids, user_ids=[f"u{i}" for i in range(len(ids))])
    if with_x:
        outlier = normalize_rows(-np.ones((1, D), np.float32))  # cosine with every query < 0 < τ: never a candidate
        store.append("private", outlier, labels=np.array([0], np.int32), record_ids=["x"], user_ids=["ux"])
    build_index(store_path=store.path, ledger_path=path / "L", params=params)
    return store


def _positive(rng, n):
    return normalize_rows(np.abs(rng.standard_normal((n, D))).astype(np.float32) + 0.5)


def _observe(res) -> tuple:
    lines = res.stdout.strip().splitlines()
    rows = [json.loads(line) for line in lines]
    return res.exit_code, len(lines), [sorted(r) for r in rows], [(r["label"], r["released_count"]) for r in rows]


def test_all_retired_world_and_its_neighbour_look_the_same_through_the_cli(tmp_path):
    rng = np.random.default_rng(3)
    x_priv = _positive(rng, 12)
    y = rng.integers(0, 3, 12).astype(np.int32)
    params = make_params(epsilon=0.5, delta=1e-5, tau=0.3, sigma2=0.5, sigma1=8.0, k_min=5)
    seen = {}
    for with_x in (False, True):
        root = tmp_path / ("with_x" if with_x else "without_x")
        root.mkdir()
        store = _world(root, x_priv, y, with_x=with_x, params=params)
        # drive every record of D to retirement (each query selects all of D; c1 ≈ B here)
        store.append("query", np.repeat(x_priv, 3, axis=0), record_ids=[f"w{i}" for i in range(36)], batch="warm")
        warm = runner.invoke(app, ["serve-queries", "warm", "--store", str(store.path), "--ledger", str(root / "L"),
                                   "--seed", "7", "--no-reuse"])
        assert warm.exit_code == 0, warm.stderr
        led = BudgetLedger.open(root / "L")
        active = led.state.active_mask(led.params.c1)
        assert active.sum() == (1 if with_x else 0)  # D all retired; x (never selected) still fresh
        store.append("query", _positive(np.random.default_rng(11), 5), record_ids=[f"t{i}" for i in range(5)],
                     batch="today")
        res = runner.invoke(app, ["serve-queries", "today", "--store", str(store.path), "--ledger",
                                  str(root / "L"), "--seed", "8"])
        seen[with_x] = _observe(res)
        assert "records remain active" not in res.stderr and "active" not in res.stderr
    assert seen[False][0] == 0 and seen[False][1] == 5  # today's main: exit 3 and no answer for D
    assert seen[False] == seen[True]  # exit code, answer count, fields and (seeded) answers identical


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 10), n_queries=st.integers(1, 6), retire=st.floats(0.0, 1.0), delete=st.floats(0.0, 0.5),
       seed=st.integers(0, 2**16), reuse=st.booleans())
@pytest.mark.heavy
def test_neighbouring_worlds_give_identical_answers(tmp_path_factory, n, n_queries, retire, delete, seed, reuse):
    """For random small worlds with random spent (some retired) and deletions, serving D and D ∪ {x} with the
    same seed gives the same answers and the same charges to D's records (x is never a candidate)."""
    rng = np.random.default_rng(seed)
    x_priv = _positive(rng, n)
    y = rng.integers(0, 3, n).astype(np.int32)
    params = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, sigma1=6.0, k_min=3)
    spent0 = np.where(rng.random(n) < retire, params.budget, rng.uniform(0, params.budget / 2, n))
    gone = np.flatnonzero(rng.random(n) < delete)
    queries = _positive(rng, n_queries)
    out = {}
    for with_x in (False, True):
        root = tmp_path_factory.mktemp("w")
        store = _world(root, x_priv, y, with_x=with_x, params=params)
        led = BudgetLedger.open(root / "L")
        led.commit_event(event_type="serve", info={"batch_id": "setup"}, columns={
            "kind": ["charge"] * n, "ledger_index": list(range(n)), "spent_after": spent0.tolist(),
            "selected": [1] * n})
        if gone.size:
            from indknn_cli.deletion import delete_records
            delete_records(store_path=store.path, ledger_path=root / "L", record_ids=[f"r{i}" for i in gone])
        store = FeatureStore.open(store.path, mode="a")
        store.append("query", queries, record_ids=[f"q{i}" for i in range(n_queries)], batch="b")
        res = serve_queries(store_path=store.path, ledger_path=root / "L", query_batch="b", seed=seed, reuse=reuse)
        led = BudgetLedger.open(root / "L")
        out[with_x] = ([(a["label"], a["released_count"], sorted(a)) for a in res.answers], led.state.spent[:n].tolist())
        if with_x:
            assert led.state.spent[n] == 0.0  # x never paid
    assert out[False] == out[True]


def test_public_gate_max_queries_and_queries_left(vector_store, tmp_path):
    """The cron gate reads public figures only: queries answered against T. `serve-queries --max-queries`
    refuses a batch that would pass T (exit 3, nothing charged); `account --queries-left` prints T, answered
    and left, exit 3 when none is left."""
    lp = str(tmp_path / "L")
    res = runner.invoke(app, ["index", "--store", str(vector_store.path), "--ledger", lp, "--eps", "1",
                              "--tau", "0.5", "--sigma2", "0.5", "--planned-queries", "60"])
    assert res.exit_code == 0, res.stderr
    left = runner.invoke(app, ["account", "--ledger", lp, "--queries-left"])
    assert left.exit_code == 0 and json.loads(left.stdout) == {
        "max_queries": 60, "max_queries_source": "planned", "queries_answered": 0, "queries_left": 60,
        "figures": "public (queries answered and the planned T; no private data)"}
    ok = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger", lp,
                             "--max-queries", "planned"])
    assert ok.exit_code == 0 and len(ok.stdout.splitlines()) == 40
    assert "20 of T = 60 left" in ok.stderr
    store = FeatureStore.open(vector_store.path, mode="a")
    store.append("query", np.asarray(store.read("query", "features", 0, 30)), record_ids=[f"n{i}" for i in range(30)],
                 batch="q2")
    spent = BudgetLedger.open(lp).state.spent.copy()
    refused = runner.invoke(app, ["serve-queries", "q2", "--store", str(vector_store.path), "--ledger", lp],
                            env={"INDKNN_MAX_QUERIES": "planned"})
    assert refused.exit_code == 3 and refused.stdout == "" and "allowance" in refused.stderr
    assert np.array_equal(BudgetLedger.open(lp).state.spent, spent)  # nothing charged
    again = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger", lp,
                                "--max-queries", "40"])  # an answered batch is returned, never refused
    assert again.exit_code == 0 and len(again.stdout.splitlines()) == 40
    left = runner.invoke(app, ["account", "--ledger", lp, "--queries-left", "--max-queries", "40"])
    assert left.exit_code == 3 and json.loads(left.stdout)["queries_left"] == 0
    bad = runner.invoke(app, ["serve-queries", "q2", "--store", str(vector_store.path), "--ledger", lp,
                              "--max-queries", "0"])
    assert bad.exit_code == 2 and "--max-queries" in bad.stderr


def test_reused_batch_id_is_refused_before_the_query_file_is_embedded(vector_store, tmp_path):
    """Issue 16 §4: a refused --batch-id reuse must not embed the new query file (exit 2 = nothing written).
    Today's main embedded it as query batch X, then refused."""
    lp = str(tmp_path / "L")
    assert runner.invoke(app, ["index", "--store", str(vector_store.path), "--ledger", lp, "--eps", "1",
                               "--tau", "0.5"]).exit_code == 0
    first = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger", lp,
                                "--batch-id", "day-1"])
    assert first.exit_code == 0
    rows_before = FeatureStore.open(vector_store.path).n_rows("query")
    np.save(tmp_path / "new.npy", _positive(np.random.default_rng(0), 7)[:, :1].repeat(16, axis=1))
    res = runner.invoke(app, ["serve-queries", str(tmp_path / "new.npy"), "--store", str(vector_store.path),
                              "--ledger", lp, "--batch-id", "day-1"])
    assert res.exit_code == 2 and "already used" in res.stderr
    store = FeatureStore.open(vector_store.path)
    assert store.n_rows("query") == rows_before and "day-1" not in store.batches()


def test_waiting_through_a_compaction_is_transient_not_bad_input(vector_store, tmp_path):
    """Issue 16 §4: a writer that waited through `delete --compact` was told exit 2 (bad input); it is a
    transient condition (exit 1, nothing written), and serve-queries re-opens and goes on by itself."""
    from indknn_cli.deletion import delete_records
    from indknn_cli.errors import EXIT_RUNTIME, ConcurrentChangeError

    lp = tmp_path / "L"
    assert runner.invoke(app, ["index", "--store", str(vector_store.path), "--ledger", str(lp), "--eps", "1",
                               "--tau", "0.5"]).exit_code == 0
    stale = FeatureStore.open(vector_store.path, mode="a")  # opened before the compaction
    delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0001"], compact=True)
    try:
        with stale.write_lock(timeout=5):
            raise AssertionError("a stale store must not be written")
    except ConcurrentChangeError as exc:
        assert exc.exit_code == EXIT_RUNTIME
    res = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger", str(lp)])
    assert res.exit_code == 0 and len(res.stdout.splitlines()) == 40


def test_a_run_reads_one_private_row_count_whatever_embed_commits(vector_store):
    """Issue 16 §4 (a serve beside an embed died with IndexError): serving pins the private row count once
    under the lock, so arrays read later agree in length even when an embed commits rows in between."""
    reader = FeatureStore.open(vector_store.path, mode="r")
    n = reader.pin_rows("private")
    writer = FeatureStore.open(vector_store.path, mode="a")
    with writer.write_lock(timeout=5):
        writer.append("private", _positive(np.random.default_rng(1), 5).repeat(2, axis=1),
                      labels=np.zeros(5, np.int32), record_ids=[f"new{i}" for i in range(5)])
    assert FeatureStore.open(vector_store.path).n_rows("private") == n + 5
    assert len(reader.read("private", "deleted")) == len(reader.read("private", "labels")) == n
    assert sum(len(b) for _, b in reader.iter_chunks("private")) == n


_HALVING_RUN = r"""
import json, sys
import numpy as np
from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows
from indknn_cli.serving import build_index, make_params
from indknn_cli.cli.app import app
root, near = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
e0 = np.zeros(16, np.float32); e0[0] = 1
def around(n):
    return normalize_rows(e0 + 0.05 * rng.standard_normal((n, 16)).astype(np.float32) / 4).astype(np.float32)
q, rows = around(2048), around(700)
far = normalize_rows(-np.abs(rng.standard_normal((300, 16))).astype(np.float32) - 0.5 * e0).astype(np.float32)
x = np.concatenate([rows[:near], far])
s = FeatureStore.create(root + "/s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                        label_names=["a", "b", "c"], chunk_rows=256)
s.append("private", x, labels=(np.arange(len(x)) % 3).astype(np.int32), record_ids=[f"r{i}" for i in range(len(x))],
         user_ids=[f"u{i}" for i in range(len(x))])
s.append("query", q, record_ids=[f"q{i}" for i in range(len(q))], batch="q1")
build_index(store_path=s.path, ledger_path=root + "/L",
            params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.3, planned_queries=5000, k_min=5))
before = "faiss" in sys.modules
try:
    app(["serve-queries", "q1", "--store", root + "/s.zarr", "--ledger", root + "/L", "--seed", "3",
         "--batch-size", "256", "--max-memory", "16M", "--no-reuse", "-v"])
except SystemExit as e:
    print(json.dumps({"exit": e.code, "faiss_before": before, "faiss_after": "faiss" in sys.modules}), file=sys.stderr)
"""


@pytest.mark.heavy
def test_a_batch_halved_by_one_more_record_changes_nothing_on_stderr_under_v(tmp_path):
    """Review 31, F1: 682 records within τ of every query (D) against 683 (D ∪ {x}), 256-query batches at
    --max-memory 16M (a bound of 682.7 pairs a query): only D ∪ {x}'s batches were halved, to 128 queries, below
    the bf16 screen's minimum, so only there FAISS was imported, and `-v` (the root logger at INFO) printed its
    eight loading lines: one record seen on stderr. Now FAISS loads at the start of every run that may take the bf16
    screen, and -v shows indknn's lines only: stderr is the same in both worlds."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), INDKNN_WIDTH="200")
    seen = {}
    for near in (682, 683):
        root = tmp_path / str(near)
        root.mkdir()
        r = subprocess.run([sys.executable, "-c", _HALVING_RUN, str(root), str(near)], capture_output=True,
                           text=True, env=env, timeout=600)
        *lines, status = r.stderr.strip().splitlines()
        status = json.loads(status)
        assert status["exit"] == 0 and len(r.stdout.splitlines()) == 2048, r.stderr[-2000:]
        lines = [ln.replace(str(root), "ROOT") for ln in lines]  # -v names the store and ledger: each world's folder
        seen[near] = (lines, status["faiss_after"])
    assert not any("faiss" in line.lower() for line in seen[682][0] + seen[683][0])
    assert seen[682] == seen[683]


def test_v_prints_indknns_log_lines_only(capsys):
    """Review 31, F1: -v set the root logger to INFO, so any library's INFO line (FAISS's loader, imported in a
    branch that one record could flip) reached serve's stderr. Only indknn's own lines show now."""
    import logging

    from indknn_cli.cli.common import set_verbosity

    try:
        set_verbosity(verbose=True)
        logging.getLogger("faiss.loader").info("Loading faiss with AVX512 support.")
        logging.getLogger("indknn_cli.serving").info("part %d released: %d of %d queries", 1, 5, 5)
        err = capsys.readouterr().err
        assert "indknn_cli.serving: part 1 released: 5 of 5 queries" in err and "faiss" not in err
        set_verbosity()  # the next invocation without -v
        logging.getLogger("indknn_cli.serving").info("part %d released: %d of %d queries", 2, 5, 5)
        assert "part 2" not in capsys.readouterr().err
    finally:
        set_verbosity()
