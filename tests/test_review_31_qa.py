"""Review 31's QA pass (a helper run as an ML engineer on unseen, hostile input; AUDIT_FINDINGS_10.md): each test
fails before its fix."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore

runner = CliRunner()
D = 8
INDEX = ["--eps", "1", "--tau", "0.2", "--sigma2", "0.6", "--planned-queries", "100"]


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _store(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "p.npz", x=rng.standard_normal((60, D)).astype("f4"), y=np.array(["a", "b"] * 30),
             ids=np.array([f"r{i}" for i in range(60)]))
    np.save(tmp_path / "q.npy", rng.standard_normal((20, D)).astype("f4"))
    sp = tmp_path / "s.zarr"
    r = runner.invoke(app, ["embed", str(tmp_path / "p.npz"), "--store", str(sp), "--extractor", "vectors",
                            "--label-names", "a,b", "-q"])
    assert r.exit_code == 0, r.stderr
    return sp


@pytest.mark.heavy
def test_a_ledger_at_or_inside_the_store_folder_is_refused_before_anything_is_written(tmp_path):
    """`--ledger s.zarr/ledger` was accepted by index and serve, and `delete --compact` then replaced the store's
    folder and the ledger's snapshots with it: every spent budget lost, nothing for repair to rebuild. `--ledger
    s.zarr` wrote ledger files into the store and then failed with "another indknn process is writing"."""
    sp = _store(tmp_path)
    before = _files(sp)
    for inside in (sp, sp / "ledger"):
        r = runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(inside), *INDEX])
        assert r.exit_code == 2 and "store's folder" in r.stderr, r.stderr
        assert _files(sp) == before
    # a ledger moved into the store by hand (or made before this check): the compaction is refused, the erasure
    # asked for with it goes through (review 32: `delete --record X --compact` erased nothing), exit 2
    lp = tmp_path / "L"
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), *INDEX]).exit_code == 0
    assert runner.invoke(app, ["serve-queries", str(tmp_path / "q.npy"), "--store", str(sp), "--ledger", str(lp),
                               "-q"]).exit_code == 0
    lp.rename(sp / "ledger")
    snapshots = sorted(p.name for p in (sp / "ledger").glob("snapshot-*.parquet"))
    r = runner.invoke(app, ["delete", "--record", "r1", "--compact", "--store", str(sp), "--ledger", str(sp / "ledger")])
    assert r.exit_code == 2 and "--compact was refused, the erasure went through" in r.stderr, r.stderr
    assert json.loads(r.stdout)["records_erased"] == 1 and "inside the store's folder" in r.stderr
    assert FeatureStore.open(sp).read("private", "deleted").sum() == 1
    assert sorted(p.name for p in (sp / "ledger").glob("snapshot-*.parquet")) == snapshots  # nothing compacted
    r = runner.invoke(app, ["delete", "--compact", "--store", str(sp), "--ledger", str(sp / "ledger")])
    assert r.exit_code == 2 and "inside the store's folder" in r.stderr
    r = runner.invoke(app, ["serve-queries", str(tmp_path / "q.npy"), "--store", str(sp), "--ledger",
                            str(sp / "ledger"), "--batch-id", "again"])
    assert r.exit_code == 2 and "again" not in FeatureStore.open(sp).batches()  # refused before the embed
    r = runner.invoke(app, ["delete", "--record", "r2", "--store", str(sp), "--ledger", str(sp / "ledger")])
    assert r.exit_code == 0, r.stderr  # an erasure is never blocked
    assert FeatureStore.open(sp).read("private", "deleted").sum() == 2


def test_an_out_path_that_cannot_be_written_is_refused_before_anything_is_charged(tmp_path):
    """`--out outdir` (a folder) or `--out /proc/x.parquet` failed only when the answers were published: the batch
    was embedded and charged, and no answer delivered."""
    sp = _store(tmp_path)
    lp = tmp_path / "L"
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), *INDEX]).exit_code == 0
    (tmp_path / "outdir").mkdir()
    (tmp_path / "afile").write_text("x")
    for out, says in ((tmp_path / "outdir", "is a folder"), (tmp_path / "afile" / "x.parquet", "is a file"),
                      (tmp_path / "answers.csv", "writes a Parquet file"),  # it wrote Parquet under .csv
                      (Path("/proc/x.parquet"), "is in /dev or /proc")):
        r = runner.invoke(app, ["serve-queries", str(tmp_path / "q.npy"), "--store", str(sp), "--ledger", str(lp),
                                "--out", str(out)])
        assert r.exit_code == 2 and says in r.stderr, (out, r.stderr)
    assert BudgetLedger.open(lp).state.answers_released() == 0 and FeatureStore.open(sp).n_rows("query") == 0


@pytest.mark.heavy
def test_index_waiting_for_another_index_that_created_the_ledger_is_not_a_false_tamper_alarm(tmp_path, monkeypatch):
    """Two `index` runs at once (an overlapping cron): the second read the store before the first bound it, then
    found the ledger and refused it as "the store's binding attribute was removed … a rollback could not be
    detected" (exit 1, 3 of 3 times). It now reads the store again under the locks and adds to the ledger."""
    from indknn_cli import indexing

    sp = _store(tmp_path)
    lp = tmp_path / "L"
    real = indexing.BudgetLedger.write_lock
    ran = []

    @contextlib.contextmanager
    def other_index_first(*a, **k):  # the other cron run takes the locks first and finishes
        if not ran:
            ran.append(subprocess.run([sys.executable, "-m", "indknn_cli", "index", "--store", str(sp), "--ledger",
                                       str(lp), *INDEX, "-q"], capture_output=True, text=True, timeout=300))
        with real(*a, **k):
            yield

    monkeypatch.setattr(indexing.BudgetLedger, "write_lock", other_index_first)
    r = runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), *INDEX])
    assert ran[0].returncode == 0, ran[0].stderr
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["created"] is False


def test_a_number_past_float_range_in_json_lines_names_its_row(tmp_path):
    """A JSON-lines vector holding 10^400 was "Internal error: OverflowError" (exit 1) in embed and serve."""
    sp = _store(tmp_path)
    before = _files(sp)
    big = "1" + "0" * 400
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "j0", "vector": [0.5] * D, "label": "a"}) + "\n"
                                      + f'{{"id":"j1","vector":[{big}{",0" * (D - 1)}],"label":"a"}}\n')
    r = runner.invoke(app, ["embed", str(tmp_path / "p.jsonl"), "--store", str(sp)])
    assert r.exit_code == 2 and "row 2, column 'vector': a number is too large" in r.stderr, r.stderr
    assert _files(sp) == before
    r = runner.invoke(app, ["embed", str(tmp_path / "p.jsonl"), "--store", str(sp), "--batch-size", "0"])
    assert r.exit_code == 2 and "--batch-size" in r.stderr and _files(sp) == before


def test_a_finite_vector_past_float32s_range_is_stored_by_its_direction(tmp_path):
    """1e300 (finite float64) was refused as "NaN or infinite values" (it overflowed on the cast to float32). A
    vector's direction is all that is stored (every row is L2-normalised): such a row is scaled first; the others
    are stored bit for bit as before."""
    from indknn_cli.store import normalize_rows

    x = np.random.default_rng(1).standard_normal((6, D))
    x[2, 3], x[4] = 1e300, 1e-300 * x[4]
    np.savez(tmp_path / "big.npz", x=x, y=np.array(["a", "b"] * 3), ids=np.array([f"b{i}" for i in range(6)]))
    r = runner.invoke(app, ["embed", str(tmp_path / "big.npz"), "--store", str(tmp_path / "b.zarr"), "--extractor",
                            "vectors", "--label-names", "a,b", "-q"])
    assert r.exit_code == 0, r.stderr
    got = FeatureStore.open(tmp_path / "b.zarr").read("private", "features")
    want = np.zeros(D, np.float32)
    want[3] = 1.0
    assert np.array_equal(got[2], want)
    assert np.allclose(got[4], normalize_rows(x[4:5] * 1e300)[0], atol=1e-7)
    ok = [0, 1, 3, 5]
    assert np.array_equal(got[ok], normalize_rows(x[ok].astype(np.float32)))
    assert np.allclose(normalize_rows(np.array([[1e300, 1e300]])), [[2 ** -0.5, 2 ** -0.5]])


def test_every_epsilon_that_account_verify_and_index_print_names_its_unit_and_adjacency(tmp_path):
    """Review 32's sweep: `account --eps` (its failure and its realised-loss line), `account --verify` (its text and
    JSON) and `index`'s fixed-parameters refusal printed an ε without the unit or the adjacency (SPEC §8)."""
    sp = _store(tmp_path)
    lp = tmp_path / "L"
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), *INDEX]).exit_code == 0
    r = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--eps", "0.5", "--json"])
    assert r.exit_code == 4 and "(record unit, add/remove one record) is above --eps 0.5" in r.stderr, r.stderr
    assert "realised loss ε(gdp, per record, add/remove one record)" in r.stderr
    r = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert r.exit_code == 0 and "(gdp, per record, add/remove one record)" in r.stdout + r.stderr
    r = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify", "--json"])
    budgets = json.loads(r.stdout)["budgets"]
    assert budgets["unit"] == "record" and budgets["adjacency"] == "add/remove one record"
    r = runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "2"])
    assert r.exit_code == 2 and "(gdp, per record, add/remove one record)" in r.stderr, r.stderr


@pytest.mark.heavy
def test_an_erasure_goes_through_whatever_the_ledger_path_holds(tmp_path):
    """Review 32 (erasure sweep): `delete --record` erased nothing when --ledger was a plain file (its lock could not
    be made), the store's own folder (a delete waited on its own lock, then said another process was writing), or a
    ledger the store's binding did not name (exit 2). Each now erases from the store alone, tombstone pending, as for
    a damaged ledger."""
    from indknn_cli.ledger_integrity import BINDING_ATTR

    sp = _store(tmp_path)
    lp = tmp_path / "L"
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), *INDEX]).exit_code == 0
    (tmp_path / "plain").write_text("not a ledger")
    other = tmp_path / "other"  # another store's ledger (was: exit 2, nothing erased)
    other.mkdir()
    osp = _store(other)
    assert runner.invoke(app, ["index", "--store", str(osp), "--ledger", str(other / "L"), *INDEX]).exit_code == 0
    st = FeatureStore.open(sp, mode="a")
    cases = [("r1", tmp_path / "plain"), ("r2", sp), ("r4", other / "L")]
    for rid, ledger in cases:
        r = runner.invoke(app, ["delete", "--record", rid, "--store", str(sp), "--ledger", str(ledger),
                                "--lock-timeout", "2"])
        assert r.exit_code == 0 and json.loads(r.stdout)["records_erased"] == 1, (ledger, r.stderr)
    st.root.attrs.update({BINDING_ATTR: dict(st.root.attrs[BINDING_ATTR], ledger_uuid="0" * 32)})
    r = runner.invoke(app, ["delete", "--record", "r3", "--store", str(sp), "--ledger", str(lp)])
    assert r.exit_code == 0 and json.loads(r.stdout)["records_erased"] == 1, r.stderr
    store = FeatureStore.open(sp)
    rows = [1, 2, 3, 4]  # r1 … r4 (their ids are blanked by the erasure)
    assert store.read("private", "deleted")[rows].all() and not store.read("private", "features")[rows].any()
    assert runner.invoke(app, ["delete", "--compact", "--store", str(sp), "--ledger", str(sp)]).exit_code == 2


@pytest.mark.heavy
def test_a_pending_erasure_list_that_is_not_row_numbers_does_not_stop_erasures(tmp_path):
    """Review 32 (erasure sweep, F7): `erase_pending` in private/zarr.json holding a non-integer made every command,
    erasures included, fail with "Internal error: ValueError". It is read as every flagged row now."""
    from indknn_cli.store import ERASE_PENDING_ATTR

    sp = _store(tmp_path)
    lp = tmp_path / "L"
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), *INDEX]).exit_code == 0
    assert runner.invoke(app, ["delete", "--record", "r1", "--store", str(sp), "--ledger", str(lp)]).exit_code == 0
    FeatureStore.open(sp, mode="a").group("private").attrs.update({ERASE_PENDING_ATTR: ["x", {"y": 1}]})
    assert list(FeatureStore.open(sp).erase_pending_rows()) == [1]
    r = runner.invoke(app, ["delete", "--record", "r2", "--store", str(sp), "--ledger", str(lp)])
    assert r.exit_code == 0 and json.loads(r.stdout)["records_erased"] == 1, r.stderr
    store = FeatureStore.open(sp)
    assert store.read("private", "deleted")[[1, 2]].all() and not store.erase_pending_rows().size
