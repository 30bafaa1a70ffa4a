"""Review 60 (2026-11-29, a QA helper on data of its own): a stray quote in a CSV, null user ids in Parquet, an erased
id embedded again under another user."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.errors import BadInputError
from indknn_cli.readers import open_source
from indknn_cli.store import FeatureStore

from .conftest import clustered

runner = CliRunner()


def _rows(path, **kw):
    with open_source(path, extractor_kind="text", **kw) as src:
        return [r for b in src.batches() for r in zip(b.ids or [], b.items)]


def test_a_stray_quote_is_bad_input_not_the_rest_of_the_file_read_as_one_field(tmp_path):
    """F1: `q-0002,"The Acme dividend…` (a quote opened and never closed) made the 18 lines after it one query's
    text, embedded, charged and answered, 17 queries never answered, exit 0."""
    lines = ["id,text"] + [f"q-{i:04d},query text {i}" for i in range(20)]
    lines[3] = 'q-0002,"The Acme dividend rose by 31 cents.'
    path = tmp_path / "q.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInputError, match=r"row 3 \(from line 4\).*never closed"):
        _rows(path, id_column="id")
    # text after a closing quote is refused too; a quoted field with line breaks (legitimate CSV) is read
    path.write_text('id,text\nq1,"a quoted" tail\n')
    with pytest.raises(BadInputError, match="after a closing quote"):
        _rows(path, id_column="id")
    path.write_text('id,text\nq1,"two\nlines"\nq2,"a ""quoted"" word"\n')
    assert _rows(path, id_column="id") == [("q1", "two\nlines"), ("q2", 'a "quoted" word')]


def test_a_label_that_swallowed_the_file_is_not_printed_whole(tmp_path):
    """F1: with more columns the stray quote ran to the label column's end of file, and "unknown label" printed the
    rest of the private file on stderr. The quote is refused now; a long unknown label is shown cut."""
    path = tmp_path / "p.csv"
    secret = " ".join(f"private text {i}" for i in range(200))
    path.write_text(f"id,text,label\nr1,hello,a\nr2,world,{secret}\n")
    res = runner.invoke(app, ["embed", str(path), "--store", str(tmp_path / "s.zarr"), "--extractor", "text",
                              "--label-names", "a,b"])
    assert res.exit_code == 2 and "unknown label" in res.stderr, res.stderr
    assert "private text 150" not in res.stderr and "characters)" in res.stderr
    assert not (tmp_path / "s.zarr").exists()


def _vector_world(tmp_path):
    x, y, _ = clustered(60, 8, 2, seed=3)
    np.savez(tmp_path / "priv.npz", x=x, y=y, ids=np.array([f"r{i:03d}" for i in range(60)]),
             users=np.array([f"u{i % 10}" for i in range(60)]))
    store, ledger = tmp_path / "s.zarr", tmp_path / "L"
    res = runner.invoke(app, ["embed", str(tmp_path / "priv.npz"), "--store", str(store), "--extractor", "vectors",
                              "--label-names", "0,1"])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["index", "--store", str(store), "--ledger", str(ledger), "--eps", "1", "--delta", "1e-5",
                              "--tau", "0.5", "--sigma2", "0.6", "--planned-queries", "50", "--privacy-unit", "user",
                              "--max-records-per-user", "6"])
    assert res.exit_code == 0, res.stderr
    return x, y, store, ledger


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.mark.heavy
def test_an_erased_id_embedded_under_another_user_is_refused_at_embed(tmp_path):
    """F3: `embed` wrote the row ("re-admitted, keeping the budget"), then every `index` refused it (exit 2) and its
    message ("give these rows new record ids") did not say how to get out: the rows were already in the store."""
    x, y, store, ledger = _vector_world(tmp_path)
    res = runner.invoke(app, ["delete", "--store", str(store), "--ledger", str(ledger), "--user", "u5"])
    assert res.exit_code == 0, res.stderr
    np.savez(tmp_path / "back.npz", x=x[5:6], y=y[5:6], ids=np.array(["r005"]), users=np.array(["u9"]))
    before = _digest(store)
    res = runner.invoke(app, ["embed", str(tmp_path / "back.npz"), "--store", str(store)])
    assert res.exit_code == 2, res.stderr
    assert "was erased from this store under another user" in " ".join(res.stderr.split())
    assert _digest(store) == before
    # under its own user it comes back (keeping its user's spent), as before
    np.savez(tmp_path / "same.npz", x=x[5:6], y=y[5:6], ids=np.array(["r005"]), users=np.array(["u5"]))
    res = runner.invoke(app, ["embed", str(tmp_path / "same.npz"), "--store", str(store)])
    assert res.exit_code == 0, res.stderr and "re-admitted" in res.stderr


@pytest.mark.heavy
def test_indexs_refusal_of_a_moved_id_says_how_to_get_out_and_that_way_works(tmp_path):
    """F3 (the backstop, for rows written through the library): the refusal names `indknn delete --record`, and after
    it `index` goes on."""
    x, y, store, ledger = _vector_world(tmp_path)
    assert runner.invoke(app, ["delete", "--store", str(store), "--ledger", str(ledger), "--user", "u5"]).exit_code == 0
    FeatureStore.open(store, mode="a").append("private", x[5:6], labels=y[5:6].astype(np.int32), record_ids=["r005"],
                                              user_ids=["u9"])
    res = runner.invoke(app, ["index", "--store", str(store), "--ledger", str(ledger)])
    assert res.exit_code == 2
    assert "indknn delete --record" in " ".join(res.stderr.split())
    res = runner.invoke(app, ["delete", "--store", str(store), "--ledger", str(ledger), "--record", "r005"])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["index", "--store", str(store), "--ledger", str(ledger)])
    assert res.exit_code == 0, res.stderr


def test_a_null_user_id_in_parquet_reads_as_no_user_like_an_empty_csv_cell(tmp_path):
    """F2: a null user (Parquet, JSON lines) was refused at `embed` ("missing value") while an empty CSV cell was a
    record without a user, decided at `index` (--user-for-missing)."""
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["x", "y", "z"], "user": ["u1", None, "u2"]}),
                   tmp_path / "t.parquet")
    with open_source(tmp_path / "t.parquet", extractor_kind="text", id_column="id", user_column="user") as src:
        users = [u for b in src.batches() for u in b.users]
    assert users == ["u1", "", "u2"]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"id": "a", "text": "x", "user": None}, {"id": "b", "text": "y", "user": "u1"})) + "\n")
    with open_source(tmp_path / "t.jsonl", extractor_kind="text", id_column="id", user_column="user") as src:
        assert [u for b in src.batches() for u in b.users] == ["", "u1"]
    pq.write_table(pa.table({"id": ["a", None], "text": ["x", "y"]}), tmp_path / "ids.parquet")
    with pytest.raises(BadInputError, match="missing value"):  # a record id stays required
        with open_source(tmp_path / "ids.parquet", extractor_kind="text", id_column="id") as src:
            list(src.batches())


def test_a_cap_given_by_max_queries_is_not_called_the_end_of_the_ledger():
    """F4: `--max-queries 5` (or $INDKNN_MAX_QUERIES) with 46 answered said "T is fixed when the ledger is made;
    serving through this ledger is over" while the ledger's planned T had 54 left."""
    from indknn_cli import gate
    from indknn_cli.errors import QueryAllowanceError

    for answered, new in ((46, 20), (2, 20)):
        with pytest.raises(QueryAllowanceError) as info:
            gate.check(gate.allowance(answered=answered, planned_queries=100, max_queries=5), new_queries=new)
        text = str(info.value)
        assert "serving through this ledger is over" not in text and "fixed when the ledger is made" not in text
        assert "--max-queries or $INDKNN_MAX_QUERIES" in text
    with pytest.raises(QueryAllowanceError, match="serving through this ledger is over"):
        gate.check(gate.allowance(answered=100, planned_queries=100, max_queries="planned"), new_queries=1)
    assert "the T given" in gate.allowance(answered=1, planned_queries=100, max_queries=7).as_dict()["figures"]


@pytest.mark.heavy
def test_account_counts_the_answers_a_repair_could_not_recover_as_the_gate_does(tmp_path):
    """F7: after a serve event was lost and `repair` ran, `account` said 10 queries answered (what the ledger holds)
    while the public gate and serve counted 20 (every answer released): the compliance figure was understated."""
    x, y, store, ledger = _vector_world(tmp_path)
    for b in ("b1", "b2"):
        np.savez(tmp_path / f"{b}.npz", x=x[:10] + 0.01 * (b == "b2"))
        res = runner.invoke(app, ["serve-queries", str(tmp_path / f"{b}.npz"), "--store", str(store), "--ledger",
                                  str(ledger), "--batch-id", b])
        assert res.exit_code == 0, res.stderr
    lost = sorted((ledger / "events").glob("*serve*"))[-1]
    lost.rename(tmp_path / lost.name)  # the newest serve event lost: the ledger rolled back
    res = runner.invoke(app, ["repair", "--store", str(store), "--ledger", str(ledger)])
    assert res.exit_code == 0, res.stderr
    gate = json.loads(runner.invoke(app, ["account", "--ledger", str(ledger), "--queries-left"]).stdout)
    res = runner.invoke(app, ["account", "--ledger", str(ledger), "--json"])
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)
    assert gate["queries_answered"] == 20
    assert d["queries_answered"] == 20 and d["answers_not_held"] == 10
    res = runner.invoke(app, ["account", "--ledger", str(ledger)], env={"INDKNN_WIDTH": "300"})
    assert "a repair could not recover" in res.stdout


def test_an_unknown_label_names_its_row_and_empty_texts_and_label_less_classes_are_named(tmp_path):
    """F6: "unknown label 'NA'" named no row (a 100k-row file searched by hand); F8: a declared label with no record
    was left out of the thin-labels warning, and the empty-text warning named no row."""
    path = tmp_path / "na.csv"
    path.write_text("id,text,label\n" + "".join(f"r{i},text {i},a\n" for i in range(6)) + "r6,more,NA\n")
    res = runner.invoke(app, ["embed", str(path), "--store", str(tmp_path / "s.zarr"), "--label-names", "a,b"])
    assert res.exit_code == 2 and "row 7: unknown label 'NA'" in res.stderr, res.stderr
    path.write_text("id,text,label\n" + "".join(f"r{i},text {i},a\n" for i in range(6)) + "r6,  ,a\n")
    res = runner.invoke(app, ["embed", str(path), "--store", str(tmp_path / "s.zarr"), "--label-names", "a,b"],
                        env={"INDKNN_WIDTH": "300"})
    assert res.exit_code == 0, res.stderr
    err = " ".join(res.stderr.split())
    assert "1 empty text (row 7;" in err and "'b' (0 records)" in err, err


def test_a_boolean_is_not_an_epsilon():
    """Review 61 (validation): `calibrate_budget(epsilon=True)` calibrated for ε = 1 (bool is an int subclass)."""
    from indknn_cli.accounting import calibrate_budget

    with pytest.raises(BadInputError, match="epsilon must be a positive finite number, got True"):
        calibrate_budget(epsilon=True, delta=1e-5)


def test_a_bad_dask_duration_in_the_environment_is_named_not_an_import_failure(monkeypatch):
    """Review 61: `INDKNN_DASK_DRAIN_SECONDS=abc` made `import indknn_cli.dask_embed` fail with a bare ValueError."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", "import indknn_cli.dask_embed, indknn_cli.dask_fence"], cwd=root,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "INDKNN_DASK_DRAIN_SECONDS": "abc",
                              "INDKNN_DASK_FENCE_SECONDS": "x"}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    from indknn_cli import dask_embed, dask_fence

    monkeypatch.setenv("INDKNN_DASK_DRAIN_SECONDS", "abc")
    with pytest.raises(BadInputError, match=r"\$INDKNN_DASK_DRAIN_SECONDS must be a number of seconds.*'abc'"):
        dask_embed._drain_seconds()
    monkeypatch.setenv("INDKNN_DASK_FENCE_SECONDS", "-1")
    with pytest.raises(BadInputError, match="INDKNN_DASK_FENCE_SECONDS"):
        dask_fence.grace_seconds()
    monkeypatch.setenv("INDKNN_DASK_FENCE_SECONDS", "2.5")
    assert dask_fence.grace_seconds() == 2.5


def test_account_verbose_names_where_the_store_came_from_as_every_command_does(tmp_path):
    """F5: `account -v` said "store: S (--store or $INDKNN_STORE)" for a store taken from $INDKNN_STORE."""
    env = {"INDKNN_STORE": str(tmp_path / "nowhere.zarr"), "INDKNN_LEDGER": str(tmp_path / "L"), "INDKNN_WIDTH": "300"}
    res = runner.invoke(app, ["account", "-v"], env=env)
    assert "nowhere.zarr (from $INDKNN_STORE)" in res.stderr, res.stderr
    res = runner.invoke(app, ["account", "-v", "--store", str(tmp_path / "given.zarr")], env=env)
    assert "given.zarr (--store)" in res.stderr, res.stderr
