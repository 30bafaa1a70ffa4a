"""`indknn index` and `indknn serve-queries` through the CLI: streams, exit codes, output audit."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from indknn_cli import ledger_files as ledger_mod
from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger

runner = CliRunner()


def _index(store, tmp_path, *extra):
    res = runner.invoke(app, ["index", "--store", str(store.path), "--ledger", str(tmp_path / "L"), "--eps", "1",
                              "--delta", "1e-5", "--tau", "0.5", "--sigma2", "0.5", "--planned-queries", "100",
                              *extra])
    return res


def test_index_prints_one_json_line(vector_store, tmp_path):
    res = _index(vector_store, tmp_path)
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    info = json.loads(lines[0])
    assert info["records"] == 300 and info["conversion"] == "gdp"
    assert info["budget"] == pytest.approx(0.0359257, rel=1e-5) and info["epsilon"] <= 1.0
    again = _index(vector_store, tmp_path)  # safe to re-run
    assert again.exit_code == 0 and json.loads(again.stdout)["records_added"] == 0
    changed = _index(vector_store, tmp_path, "--kernel", "rbf")
    assert changed.exit_code == 2 and "fixed parameters" in changed.stderr


def test_index_reads_store_from_upstream_json_line(vector_store, tmp_path):
    line = json.dumps({"store": str(vector_store.path), "role": "private", "rows_added": 300, "d": 16})
    res = runner.invoke(app, ["index", "--ledger", str(tmp_path / "L"), "--eps", "2", "--tau", "0.5"],
                        input=line + "\n")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["store"] == str(vector_store.path)


def test_env_fallbacks(vector_store, tmp_path, monkeypatch):
    monkeypatch.setenv("INDKNN_STORE", str(vector_store.path))
    monkeypatch.setenv("INDKNN_LEDGER", str(tmp_path / "envL"))
    res = runner.invoke(app, ["index", "--eps", "1", "--tau", "0.5"])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["serve-queries", "q1", "--seed", "1"])
    assert res.exit_code == 0, res.stderr
    assert len(res.stdout.splitlines()) == 40


@pytest.mark.parametrize("bad,needle", [
    (["--eps", "0"], "epsilon"), (["--eps", "-1"], "epsilon"), (["--eps", "1", "--delta", "1"], "delta"),
    (["--eps", "1", "--delta", "0"], "delta"), (["--eps", "1", "--tau", "1.5"], "tau"),
    (["--eps", "1", "--tau", "0"], "tau"), (["--eps", "1", "--sigma2", "0"], "sigma2"),
    (["--eps", "1", "--kernel", "poly"], "kernel"), (["--eps", "1", "--conversion", "zcdp"], "conversion"),
    (["--eps", "1", "--sigma1", "0.5"], "sigma1"),
])
def test_index_bad_parameters_write_nothing(vector_store, tmp_path, bad, needle):
    res = runner.invoke(app, ["index", "--store", str(vector_store.path), "--ledger", str(tmp_path / "L"), *bad])
    assert res.exit_code == 2
    assert needle in res.stderr and res.stdout == ""
    assert not (tmp_path / "L").exists()


def test_serve_to_parquet_and_jsonl(vector_store, tmp_path):
    assert _index(vector_store, tmp_path).exit_code == 0
    out = tmp_path / "answers.parquet"
    res = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger",
                              str(tmp_path / "L"), "--out", str(out), "--batch-id", "day-1"])
    assert res.exit_code == 0, res.stderr
    assert res.stdout == ""
    t = pq.read_table(out)
    assert t.num_rows == 40
    assert set(t.column_names) == {"batch_id", "query_index", "query_id", "label", "label_name", "released_count",
                                   "seed"}
    again = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger",
                                str(tmp_path / "L"), "--batch-id", "day-1"])
    assert again.exit_code == 0 and "already answered" in again.stderr
    rows = [json.loads(l) for l in again.stdout.splitlines()]
    assert [r["label"] for r in rows] == t.column("label").to_pylist()


def test_missing_ledger_and_unknown_batch(vector_store, tmp_path):
    res = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger",
                              str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no budget ledger" in res.stderr
    _index(vector_store, tmp_path)
    res = runner.invoke(app, ["serve-queries", "no-such-batch", "--store", str(vector_store.path), "--ledger",
                              str(tmp_path / "L")])
    assert res.exit_code == 2 and "no such file" in res.stderr


def test_exhausted_records_still_answer_with_exit_0(tmp_path):
    """SPEC §8: every record retired is not a reason to refuse (that refusal is a noise-free function of
    the private data); the second batch is answered from noise and reuse, exit 0."""
    from indknn_cli.store import ExtractorInfo, FeatureStore

    from .conftest import clustered

    x, y, _ = clustered(20, 8, 1, seed=3, spread=0.1)  # one tight cluster: every query selects everybody
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                label_names=["a"])
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(20)])
    store.append("query", x[:5], record_ids=[f"q{i}" for i in range(5)], batch="q1")
    res = runner.invoke(app, ["index", "--store", str(store.path), "--ledger", str(tmp_path / "L"),
                              "--eps", "0.3", "--tau", "0.5", "--sigma1", "12", "--k-min", "1"])
    assert res.exit_code == 0, res.stderr
    first = runner.invoke(app, ["serve-queries", "q1", "--store", str(store.path), "--ledger", str(tmp_path / "L"),
                                "--batch-id", "b0"])
    assert first.exit_code == 0 and len(first.stdout.splitlines()) == 5
    second = runner.invoke(app, ["serve-queries", "q1", "--store", str(store.path), "--ledger",
                                 str(tmp_path / "L"), "--batch-id", "b1"])
    assert second.exit_code == 0, second.stderr
    assert len(second.stdout.splitlines()) == 5 and "active" not in second.stderr


def test_output_audit_no_private_data_anywhere(vector_store, tmp_path, caplog):
    """stdout, stderr, debug logs, the output file and a forced crash carry nothing private."""
    _index(vector_store, tmp_path)
    x = vector_store.read("private", "features")
    secrets_ = [f"r{i:04d}" for i in range(300)] + [f"u{i:03d}" for i in range(50)]
    secrets_ += [f"{v:.5f}" for v in x[:20].ravel()] + [repr(float(v))[:9] for v in x[:20].ravel()]
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "a.parquet"
    res = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger",
                              str(tmp_path / "L"), "--batch-id", "audit"])
    res_file = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger",
                                   str(tmp_path / "L"), "--batch-id", "audit2", "--out", str(out)])

    def boom(point):
        if point == "event-committed":
            raise RuntimeError(f"forced crash near record {x[0, 0]!r}")

    ledger_mod.FAULT_HOOK = boom
    try:
        crash = runner.invoke(app, ["serve-queries", "q1", "--store", str(vector_store.path), "--ledger",
                                    str(tmp_path / "L"), "--batch-id", "audit3"])
    finally:
        ledger_mod.FAULT_HOOK = None
    assert crash.exit_code == 1 and "Internal error: RuntimeError" in crash.stderr
    text = "\n".join([res.stdout, res.stderr, res_file.stdout, res_file.stderr, crash.stdout, crash.stderr,
                      caplog.text, str(pq.read_table(out).to_pydict()), out.read_bytes().decode("latin-1")])
    for s in secrets_:
        assert s not in text
    for line in res.stdout.splitlines():
        assert set(json.loads(line)) == {"batch_id", "query_index", "query_id", "label", "label_name",
                                         "released_count"}
    led = BudgetLedger.open(tmp_path / "L")  # the crash came after the commit: its charges are kept
    assert len(led.answers_for("audit3")["label"]) > 0
