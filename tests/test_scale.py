"""Issue 21: incremental ledger state and auto-compaction give exactly the state of a full replay."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from indknn_cli import ledger_integrity as integrity
from indknn_cli import serving
from indknn_cli.ledger import BudgetLedger
from indknn_cli.ledger_history import REALISED_KEY
from indknn_cli.ledger_verify import verify_ledger
from indknn_cli.report import build_account_report
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

DAYS = 6


def _store(path):
    x, y, _ = clustered(300, 16, 3, seed=1)
    store = FeatureStore.create(path, extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=64)
    store.append("private", x, labels=y, record_ids=[f"r{i:04d}" for i in range(300)],
                 user_ids=[f"u{i % 50:03d}" for i in range(300)])
    q, _, _ = clustered(20 * DAYS, 16, 3, seed=2)
    for day in range(DAYS):
        store.append("query", q[20 * day:20 * (day + 1)], record_ids=[f"q{day}-{i}" for i in range(20)],
                     batch=f"day{day}")
    return store


def _run_year(tmp_path, name, monkeypatch, *, events, delete_after=None):
    monkeypatch.setattr(serving, "AUTO_COMPACT_EVENTS", events)
    store = _store(tmp_path / f"{name}.zarr")
    lp = tmp_path / f"{name}-ledger"
    build_index(store_path=store.path, ledger_path=lp,
                params=make_params(epsilon=2.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=20 * DAYS))
    answers = []
    for day in range(DAYS):
        res = serve_queries(store_path=store.path, ledger_path=lp, query_batch=f"day{day}", seed=day, batch_size=8)
        answers.append([(a["label"], a["released_count"]) for a in res.answers])
    return store, lp, answers


def _same_state(a, b, *, skip=("seq", "time")):
    sa, sb = a.state, b.state
    for name in ("spent", "budget", "row", "times_selected", "deleted"):
        assert getattr(sa, name).tobytes() == getattr(sb, name).tobytes(), name
    assert list(sa.record_id) == list(sb.record_id) and list(sa.user_id) == list(sb.user_id)
    assert sa.answers == sb.answers
    assert sa.n_answers() == sb.n_answers() == len(sa.answers["query_index"])
    assert sa.batches == sb.batches
    strip = [{k: v for k, v in h.items() if k not in skip} for h in sa.history]
    assert strip == [{k: v for k, v in h.items() if k not in skip} for h in sb.history]


@pytest.mark.heavy
def test_auto_compaction_keeps_answers_charges_and_chain(tmp_path, monkeypatch):
    _, never, ans_never = _run_year(tmp_path, "never", monkeypatch, events=10**9)
    _, often, ans_often = _run_year(tmp_path, "often", monkeypatch, events=2)
    assert ans_never == ans_often  # bit-identical answers (seeded)
    a, b = BudgetLedger.open(never), BudgetLedger.open(often)
    assert len(a._event_files()) == 3 * DAYS and b.generation > 2 and len(b._event_files()) <= 2
    _same_state(a, b)
    for lp in (never, often):
        out = verify_ledger(lp)
        assert out["verified"], out


def test_compacted_and_cached_history_equal_full_replay(tmp_path, monkeypatch):
    store, lp, _ = _run_year(tmp_path, "full", monkeypatch, events=10**9)
    full = BudgetLedger.open(lp)
    assert len(full._event_files()) == 3 * DAYS
    # replaying without the figures each serve event recorded (state_after): recomputed from the state
    orig = BudgetLedger._apply_table

    def recompute(self, table, info):
        assert "state_after" in info or info.get("type") != "serve"
        return orig(self, table, {k: v for k, v in info.items() if k != "state_after"})

    monkeypatch.setattr(BudgetLedger, "_apply_table", recompute)
    recomputed = BudgetLedger.open(lp)
    # without the cached realised ε (ledger_history), account converts every history point's median again
    report_converted = build_account_report(ledger_path=lp, store_path=store.path).data
    monkeypatch.undo()
    _same_state(full, recomputed, skip=("seq", "time", REALISED_KEY))
    assert all(REALISED_KEY in h for h in full.state.history)
    assert not any(REALISED_KEY in h for h in recomputed.state.history)
    assert [{k: v for k, v in h.items() if k != REALISED_KEY} for h in full.state.history] == \
        recomputed.state.history
    report_full = build_account_report(ledger_path=lp, store_path=store.path).data
    assert report_full == report_converted  # the cached figures are the converted ones, bit for bit
    copy = tmp_path / "copy-ledger"
    shutil.copytree(lp, copy)
    with BudgetLedger.write_lock(copy):
        led = BudgetLedger.open(copy)
        led.compact()
    compacted = BudgetLedger.open(copy)
    assert not compacted._event_files()
    _same_state(full, compacted)
    assert full.state.history == compacted.state.history
    assert compacted.head_sha256 == full.head_sha256
    # one more day served after the compaction continues the same chain and matches serving without it
    serve_queries(store_path=store.path, ledger_path=lp, query_batch="day0", batch_id="again", seed=99)
    assert BudgetLedger.open(lp).state.n_answers() == 20 * DAYS + 20
    report_after = build_account_report(ledger_path=lp, store_path=store.path).data
    assert report_full["history"] != report_after["history"]
    for key in ("spent_median", "batches"):
        assert key in report_full


@pytest.mark.parametrize("conversion", ["gdp", "rdp"])
def test_cached_realised_epsilons_equal_converting_every_point(conversion):
    """ledger_history's cached ε per history point, after its monotone fix and cap, equals
    report.realised_loss converting every point's median (repeats, 0, B and above B included)."""
    from indknn_cli.ledger_history import history_epsilons, realised_median
    from indknn_cli.report import realised_loss

    budget, delta = 0.37, 1e-5
    rng = np.random.default_rng(3)
    medians = np.concatenate([rng.uniform(0, budget, 25), [0.0, budget, budget * 1.5, -0.0], rng.uniform(0, budget, 3)])
    medians = np.concatenate([medians, medians[:6]])  # repeated medians (days without a change)
    hist = [{"spent_median": float(m), REALISED_KEY: realised_median(m, budget=budget, delta=delta,
                                                                       conversion=conversion)} for m in medians]
    cached = history_epsilons(hist, budget=budget, delta=delta, conversion=conversion)
    converted = realised_loss(medians, budget=budget, delta=delta, conversion=conversion)
    assert cached.tolist() == converted.tolist()
    assert len(set(cached.tolist())) > 20
    # another δ, conversion or B than the cached one: no cache (account converts as before)
    other = "rdp" if conversion == "gdp" else "gdp"
    assert history_epsilons(hist, budget=budget, delta=1e-6, conversion=conversion) is None
    assert history_epsilons(hist, budget=budget, delta=delta, conversion=other) is None
    assert history_epsilons(hist, budget=budget * 2, delta=delta, conversion=conversion) is None
    assert history_epsilons(hist[:3] + [{"spent_median": 0.1}], budget=budget, delta=delta,
                            conversion=conversion) is None


def test_answers_read_lazily_match_lists(tmp_path, monkeypatch):
    store, lp, _ = _run_year(tmp_path, "lazy", monkeypatch, events=3)
    led = BudgetLedger.open(lp)
    assert led.state._answers_base is not None  # the snapshot's answers stay an Arrow table
    n = led.state.n_answers()
    rows = led.state.answer_column("query_row", np.int64)
    for_day = {f"day{d}": led.answers_for(f"day{d}") for d in range(DAYS)}
    lists = led.state.answers  # materialised
    assert n == len(lists["query_index"]) == 20 * DAYS
    assert rows.tolist() == lists["query_row"]
    for batch, got in for_day.items():
        keep = [i for i, b in enumerate(lists["batch_id"]) if b == batch]
        assert got == {k: [v[i] for i in keep] for k, v in lists.items()}
    assert led.state.answers_table().to_pydict() == lists


def _store_arrays(store, role):
    n = store.n_rows(role)
    names = ("features", "labels", "record_id", "user_id", "deleted") + (("batch",) if role == "query" else
                                                                         ("content_key",))
    return {name: store.read(role, name, 0, n) for name in names}


@pytest.mark.parametrize("role", ["query", "private"])
def test_buffered_appends_store_what_one_write_stores(tmp_path, role):
    x, y, _ = clustered(1000, 16, 3, seed=5)
    kw = dict(extractor=ExtractorInfo("vectors", "none", "1"), dim=16, label_names=["a", "b", "c"], chunk_rows=64)
    one = FeatureStore.create(tmp_path / "one.zarr", **kw)
    many = FeatureStore.create(tmp_path / "many.zarr", **kw)
    many.root.attrs.update({"content_key_salt": one.key_salt})  # the same keyed hash of the same rows
    ids = [f"r{i}" for i in range(1000)]
    users = [f"u{i % 7}" for i in range(1000)]
    for st in (one, many):  # an unaligned start: 30 rows already there
        st.append(role, x[:30], labels=y[:30], record_ids=ids[:30], user_ids=users[:30], batch="a")
    one.append(role, x[30:], labels=y[30:], record_ids=ids[30:], user_ids=users[30:], batch="b")
    app = many.appender(role, batch="b")
    for lo in range(30, 1000, 37):
        hi = min(lo + 37, 1000)
        app.write(x[lo:hi], labels=y[lo:hi], record_ids=ids[lo:hi], user_ids=users[lo:hi])
    assert many.n_rows(role) == 30  # nothing visible before the commit
    app.commit()
    # every row handed to zarr once (no tail-chunk rewrite per write)
    assert app.rows_written == 970 * len(_store_arrays(many, role))
    a, b = _store_arrays(one, role), _store_arrays(many, role)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert a["features"].tobytes() == b["features"].tobytes()
    if role == "query":
        assert one.batches() == many.batches()
    # an abandoned append leaves the store as it was; the next one overwrites its rows
    ab = many.appender(role, batch="c")
    ab.write(x[:100], labels=y[:100], record_ids=ids[:100], user_ids=users[:100])
    assert many.n_rows(role) == 1000
    many.append(role, x[:5], labels=y[:5], record_ids=[f"z{i}" for i in range(5)], batch="d")
    assert many.read(role, "record_id", 1000, 1005).tolist() == [f"z{i}" for i in range(5)]


def test_help_imports_no_heavy_library():
    import os
    import subprocess
    import sys
    from pathlib import Path

    from indknn_cli.benchmarks.startup import HELP_PROBE

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", HELP_PROBE + "import indknn_cli; print('AT=' + indknn_cli.__file__)"],
                         capture_output=True, text=True, check=True, env=env)
    assert f"AT={root}" in out.stdout
    heavy = [x for x in out.stderr.splitlines() if x.startswith("HEAVY=")][-1][len("HEAVY="):]
    assert not {"torch", "zarr", "scipy", "pyarrow", "numpy"} & set(heavy.split(",")), heavy
    assert "Usage" in out.stdout


@pytest.mark.heavy
def test_bench_small_serve_runs_real_processes_on_fresh_copies(monkeypatch, tmp_path):
    """`bench startup`'s small serve times a real serve-queries process (each repeat on a fresh copy: a re-run
    of the same batch would only replay) and a real bare numpy+torch product process; it fails loudly if
    either fails."""
    import os
    from pathlib import Path

    from indknn_cli.benchmarks import startup

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    calls = []
    real_best = startup._best

    def spy(cmd, repeat, before=None):
        calls.append(cmd)
        return real_best(cmd, repeat, before=before)

    monkeypatch.setattr(startup, "_best", spy)
    r = startup.small_serve(n=300, d=8, m=7, repeat=2)
    assert r["n"] == 300 and r["queries"] == 7
    assert r["serve_s"] > 0 and r["bare_numpy_torch_product_s"] > 0
    assert r["serve_vs_bare_product_process"] == round(r["serve_s"] / r["bare_numpy_torch_product_s"], 2)
    assert "serve-queries" in calls[0] and "import torch" in calls[1][2]
    monkeypatch.setattr(startup, "BARE_PRODUCT", "raise SystemExit(3)")
    import pytest

    with pytest.raises(RuntimeError, match="exit 3"):
        startup.small_serve(n=300, d=8, m=7, repeat=1)


def test_account_reads_no_answers_column_of_a_compacted_snapshot(tmp_path, monkeypatch):
    """Issue 21 (a year of cron, `account` flat): a compaction writes the label counts and K_min clamp counts of
    every answer into the answers file's footer; `account` then parses no column of the snapshot's answers and
    prints the figures it computed from the columns before."""
    from indknn_cli import data_quality, ledger_history
    from indknn_cli.report import build_account_report

    store, lp, _ = _run_year(tmp_path, "summ", monkeypatch, events=4)
    # one more batch, not compacted: the report adds the events' answers to the snapshot's summary
    monkeypatch.setattr(serving, "AUTO_COMPACT_EVENTS", 10**9)
    q, _, _ = clustered(20, 16, 3, seed=9)
    store.append("query", q, record_ids=[f"x{i}" for i in range(20)], batch="extra")
    serve_queries(store_path=store.path, ledger_path=lp, query_batch="extra", seed=99, batch_size=8)
    led = BudgetLedger.open(lp)
    src = led.state._answers_src
    assert src is not None and src.summary is not None and src.num_rows == 20 * DAYS
    assert len(led._event_files()) > 0 and led.state.n_answers() == 20 * DAYS + 20
    full = led.state.answers_table()
    import pyarrow.compute as pc

    vc = pc.value_counts(full.column("label_name"))
    expect_labels = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
    k = full.column("released_count").to_numpy()
    k = k[np.isfinite(k)]
    expect_clamp = data_quality.clamp_share(answers=int(k.size), at_k_min=int(np.count_nonzero(k <= led.params.k_min)),
                                            k_min=led.params.k_min)
    assert expect_clamp["answers"] == 20 * DAYS + 20

    def no_parse(self, columns=None):
        raise AssertionError("the snapshot's answers were parsed")

    real_read = ledger_history.LazyAnswers._read
    monkeypatch.setattr(ledger_history.LazyAnswers, "_read", no_parse)
    rep = build_account_report(ledger_path=lp, store_path=store.path).data
    monkeypatch.setattr(ledger_history.LazyAnswers, "_read", real_read)  # verify recounts the columns
    assert rep["answers_by_label"] == expect_labels and list(rep["answers_by_label"]) == list(expect_labels)
    assert rep["answers_at_k_min"] == expect_clamp
    assert rep["queries_answered"] == 20 * DAYS + 20
    out = verify_ledger(lp)
    assert out["verified"], out


def test_answers_summary_that_disagrees_with_the_footer_is_ignored():
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from indknn_cli import ledger_history
    from indknn_cli.ledger_state import ANSWER_SCHEMA

    t = pa.table({n: pa.array([None] * 3, ANSWER_SCHEMA.field(n).type) for n in ANSWER_SCHEMA.names},
                 schema=ANSWER_SCHEMA)
    for rows, kept in ((3, True), (2, False)):
        summ = {"rows": rows, "label_counts": [["a", rows]], "k_min": 1.0, "released_finite": 0, "at_k_min": 0}
        sink = pa.BufferOutputStream()
        pq.write_table(t.replace_schema_metadata({ledger_history.SUMMARY_KEY: json.dumps(summ).encode()}), sink)
        lazy = ledger_history.LazyAnswers(sink.getvalue().to_pybytes())
        assert (lazy.summary is not None) == kept and lazy.num_rows == 3


def test_bench_peak_rss_is_the_child_own_not_the_parents_high_water_mark(tmp_path):
    """`bench stream` / `serve-speed` report a child's own peak (VmHWM at its exit): wait4's ru_maxrss of a
    child includes the bench's own high-water mark (fork copies it, execve folds it in), so a bench that held
    400 MB reported ≥ 400 MB for every child."""
    import os
    import subprocess
    from pathlib import Path

    from indknn_cli.benchmarks.peak_rss import indknn_command, read_peak_mb

    big = np.ones(400 << 20, dtype=np.uint8)  # this process's high-water mark ≥ 400 MB
    assert big.sum() == 400 << 20
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root)
    p = subprocess.Popen(indknn_command(["--help"], tmp_path / "peak"), stdout=subprocess.DEVNULL, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    own = read_peak_mb(tmp_path / "peak")
    assert own is not None and 5 < own < 300, own
    assert ru.ru_maxrss / 1024 >= 400  # what the bench printed before


def test_an_edited_answers_summary_is_refused_and_an_absent_one_reads_the_columns(tmp_path, monkeypatch):
    """The footer summary is trusted because the answers file's sha256 is in the snapshot's hash chain: a summary
    edited to other label counts (rows kept consistent) makes the ledger refuse to open; a file without one
    (written before it) is counted from its columns."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from indknn_cli import ledger_history
    from indknn_cli.errors import LedgerIntegrityError

    store, lp, _ = _run_year(tmp_path, "edit", monkeypatch, events=4)
    led = BudgetLedger.open(lp)
    path = lp / f"answers-{led.generation:06d}.parquet"
    table = pq.read_table(path)
    summ = json.loads(table.schema.metadata[ledger_history.SUMMARY_KEY])
    expect = dict(summ["label_counts"])
    summ["label_counts"] = [[name, 0] for name, _ in summ["label_counts"]]
    pq.write_table(table.replace_schema_metadata({ledger_history.SUMMARY_KEY: json.dumps(summ).encode()}), path)
    with pytest.raises(LedgerIntegrityError):
        BudgetLedger.open(lp)
    bare = table.replace_schema_metadata(None)
    sink = pa.BufferOutputStream()
    pq.write_table(bare, sink)
    src = ledger_history.LazyAnswers(sink.getvalue().to_pybytes())
    assert src.summary is None

    class _State:
        _answers_src, _answers_parts = src, []

    assert ledger_history.answer_label_counts(_State()) == expect
    assert ledger_history.answer_clamp_counts(_State(), led.params.k_min) == (summ["released_finite"], summ["at_k_min"])
    for bad in ({"rows": 120, "label_counts": [["a", "x"]]}, {"rows": 120, "label_counts": [["a", 500]]},
                {"rows": 120, "label_counts": [], "k_min": 30.0, "released_finite": 5, "at_k_min": 9}, [1, 2]):
        assert not ledger_history._valid_summary(bad, 120)


@pytest.mark.heavy
def test_verify_recounts_the_answers_summary(tmp_path, monkeypatch):
    """`account --verify` counts the snapshot's answers again and compares them with the footer summary that
    `account` prints instead: a summary written wrong (its hash then agreeing with it) fails verification."""
    from indknn_cli import ledger_history

    store, lp, _ = _run_year(tmp_path, "ok", monkeypatch, events=4)
    out = verify_ledger(lp, store_path=store.path)
    assert out["verified"] and out["answers_summary"] == "checked", out
    real = ledger_history.answers_summary

    def wrong(tables, *, k_min):
        s = real(tables, k_min=k_min)
        s["label_counts"] = [[name, n + (1 if i == 0 else -1 if i == 1 else 0)]
                             for i, (name, n) in enumerate(s["label_counts"])]
        return s

    monkeypatch.setattr(ledger_history, "answers_summary", wrong)
    store2, lp2, _ = _run_year(tmp_path, "bad", monkeypatch, events=4)
    out = verify_ledger(lp2, store_path=store2.path)
    assert not out["verified"] and "do not match its rows" in out["error"], out
