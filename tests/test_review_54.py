"""Review 54 (2026-11-29): erasure beside a corrupt chunk, control characters in paths, $INDKNN_WIDTH, a ledger folder
whose CURRENT was removed, lock files that are not files, a ledger restored from before a store compaction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import build_index, make_params
from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

runner = CliRunner()
N, D, CHUNK = 160, 4, 16  # id and label chunks: 4 × CHUNK rows
ROOT = Path(__file__).resolve().parents[1]


def _indknn(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "indknn_cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300)


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(5)
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                             label_names=["a", "b"], chunk_rows=CHUNK)
    st.append("private", normalize_rows(rng.standard_normal((N, D))), labels=(np.arange(N) % 2).astype(np.int32),
              record_ids=[f"r{i:03d}" for i in range(N)])
    build_index(store_path=st.path, ledger_path=tmp_path / "L",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=50))
    return st.path, tmp_path / "L"


def _flip(path: Path) -> bytes:
    before = path.read_bytes()
    b = bytearray(before)
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(bytes(b))
    return before


@pytest.mark.heavy
def test_a_corrupt_chunk_of_other_records_ids_does_not_stop_an_erasure(pair):
    """F3: the erasure read every record's id (to log the erased ones), so one corrupt chunk of ids anywhere failed
    it with exit 2 "bad input" after the tombstone was committed, and every later erasure the same way."""
    sp, lp = pair
    _flip(sp / "private" / "record_id" / "c" / "2")  # rows 128–159
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r003")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["records_erased"] == 1
    assert "Task was destroyed" not in res.stderr
    st = FeatureStore.open(sp, mode="r")
    assert float(np.abs(st.group("private")["features"][3]).sum()) == 0.0
    assert not st.erase_pending_rows("private").size


@pytest.mark.heavy
def test_a_corrupt_chunk_of_the_erased_row_says_the_erasure_is_recorded_and_delete_finishes_it(pair):
    sp, lp = pair
    chunk = sp / "private" / "labels" / "c" / "0"  # rows 0–63
    before = _flip(chunk)
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r003")
    assert res.returncode == 1, res.stderr
    assert "The erasure was recorded but not finished" in res.stderr and "corrupt" in res.stderr
    assert "Task was destroyed" not in res.stderr and "Traceback" not in res.stderr
    s = BudgetLedger.open(lp).state
    assert s.deleted[list(s.record_id).index("r003")]  # the tombstone: never selected again, nothing refunded
    chunk.write_bytes(before)  # the chunk file restored from a backup of this store
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r020")
    assert res.returncode == 0, res.stderr
    st = FeatureStore.open(sp, mode="r")
    assert float(np.abs(st.group("private")["features"][3]).sum()) == 0.0 and str(st.read("private", "record_id")[3]) == ""
    assert not st.erase_pending_rows("private").size


@pytest.mark.parametrize("var,option", [("INDKNN_STORE", "$INDKNN_STORE"), ("INDKNN_LEDGER", "$INDKNN_LEDGER")])
def test_a_path_ending_in_a_carriage_return_is_refused_not_a_second_store_and_ledger(pair, tmp_path, var, option):
    """F4: an environment file with CRLF line ends made a second store and ledger beside the real pair (2·B)."""
    sp, lp = pair
    env = {"INDKNN_STORE": str(sp), "INDKNN_LEDGER": str(lp), var: (str(sp) if var == "INDKNN_STORE" else str(lp)) + "\r"}
    res = runner.invoke(app, ["index", "--eps", "1", "--tau", "0.5", "--planned-queries", "50"], env=env)
    assert res.exit_code == 2 and option in res.stderr and "U+000D" in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["L", "s.zarr"]


def test_out_with_a_newline_is_refused(pair, tmp_path):
    sp, lp = pair
    res = runner.invoke(app, ["account", "--ledger", str(lp), "--export", str(tmp_path / "e\r.parquet")])
    assert res.exit_code == 2 and "U+000D" in res.stderr, res.stderr


@pytest.mark.parametrize("width", ["abc", "0", "1.5"])
def test_an_odd_indknn_width_is_ignored(pair, width):
    """F2: `INDKNN_WIDTH=abc` ended every command in a double traceback (after `delete` had erased); 0 dropped every
    stderr line."""
    sp, lp = pair
    res = _indknn("account", "--ledger", str(lp) + "-missing", env={"INDKNN_WIDTH": width})
    assert res.returncode == 2 and "no budget ledger here" in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.heavy
def test_a_ledger_restored_from_before_a_compaction_is_called_rolled_back_exit_1(pair, tmp_path):
    """F7: the ledger folder alone restored from a backup taken before `delete --compact` was "another feature store"
    (naming the very store given), exit 2, for serve and verify alike."""
    import shutil

    sp, lp = pair
    backup = tmp_path / "Lbak"
    shutil.copytree(lp, backup)
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r040", "--compact"])
    assert res.exit_code == 0, res.stderr
    shutil.rmtree(lp)
    shutil.copytree(backup, lp)
    FeatureStore.open(sp, mode="r+").append("query", np.ones((2, D), np.float32) / 2, record_ids=["q0", "q1"],
                                            batch="b")
    for args in (["serve-queries", "--store", str(sp), "--ledger", str(lp), "--batch", "b"],
                 ["account", "--store", str(sp), "--ledger", str(lp), "--verify"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.stderr)
        text = " ".join(res.stderr.split())
        assert "rolled back" in text and "before a `delete --compact`" in text and "another feature store" not in text
    # an erasure still goes on
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r041"])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["repair", "--store", str(sp), "--ledger", str(lp)])
    assert res.exit_code == 1 and "repair` cannot bring it back" in " ".join(res.stderr.split()), res.stderr
    assert "another feature store" not in res.stderr


@pytest.mark.heavy
def test_a_removed_current_is_named_damage_and_repair_writes_it_back(pair):
    """F1: a ledger folder whose CURRENT was removed was "no budget ledger here (create one with `indknn index`)", exit
    2, for every command, `repair` included; now exit 1 naming the damage, and `repair` writes CURRENT back (nobody
    retired: the store's mark agrees)."""
    sp, lp = pair
    FeatureStore.open(sp, mode="r+").append("query", np.ones((2, D), np.float32) / 2, record_ids=["q0", "q1"],
                                            batch="b")
    spent = BudgetLedger.open(lp).state.spent.copy()
    (lp / "CURRENT").unlink()
    for args in (["serve-queries", "--store", str(sp), "--ledger", str(lp), "--batch", "b"],
                 ["account", "--ledger", str(lp), "--store", str(sp), "--verify"],
                 ["index", "--store", str(sp), "--ledger", str(lp)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 1 and "CURRENT is missing" in " ".join(res.stderr.split()), (args, res.stderr)
    assert not (lp / "CURRENT").exists()
    res = runner.invoke(app, ["repair", "--store", str(sp), "--ledger", str(lp)])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["records_retired"] == 0
    led = BudgetLedger.open(lp)
    assert np.array_equal(led.state.spent, spent)
    res = runner.invoke(app, ["serve-queries", "--store", str(sp), "--ledger", str(lp), "--batch", "b"])
    assert res.exit_code == 0, res.stderr


def test_a_ledger_creation_that_stopped_before_current_is_still_no_ledger(tmp_path):
    """A lone first snapshot without CURRENT (an `index` stopped while creating) stays "no ledger": the re-run
    creates it."""
    from indknn_cli.ledger_snapshot import current_missing

    (tmp_path / "L").mkdir()
    (tmp_path / "L" / "snapshot-000000.parquet").write_bytes(b"x")
    assert not BudgetLedger.exists(tmp_path / "L") and not current_missing(tmp_path / "L")
    (tmp_path / "L" / "events").mkdir()
    (tmp_path / "L" / "events" / "00000001-add.parquet").write_bytes(b"x")
    assert BudgetLedger.exists(tmp_path / "L") and current_missing(tmp_path / "L")


@pytest.mark.heavy
@pytest.mark.parametrize("where,make", [("L/LOCK", "folder"), ("L/LOCK", "dangling link"),
                                        ("s.zarr/.indknn-ledger-writer.lock", "folder"),
                                        ("s.zarr/.indknn-store.lock", "dangling link")])
def test_a_lock_file_that_is_not_a_file_is_set_aside_and_never_blocks_an_erasure(pair, tmp_path, where, make):
    """F6: a lock path holding a folder or a dangling link stopped every writer with "is the ledger on a read-only
    file system?" (or "keeps disappearing"), `repair` too; in the store's folder `delete` was blocked outright."""
    sp, lp = pair
    target = tmp_path / where
    if target.exists() or target.is_symlink():
        target.unlink()
    if make == "folder":
        target.mkdir()
    else:
        target.symlink_to(tmp_path / "nowhere" / "x")
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r030"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["records_erased"] == 1 and "cannot be read" not in res.stderr
    assert target.is_file() and not target.is_symlink()
    assert [p.name for p in target.parent.glob(target.name + ".not-a-file-*")]  # what stood there, kept
    s = BudgetLedger.open(lp).state
    assert s.deleted[list(s.record_id).index("r030")]


@pytest.mark.heavy
def test_repair_writes_current_back_only_to_a_snapshot_the_mark_vouches_for(pair):
    """F5: with a garbage CURRENT, a stray copy of the snapshot under the next number was adopted as the newest: the
    repair then failed on its missing answers file (rc 1, CURRENT still garbage), or took a forged base snapshot."""
    import shutil

    sp, lp = pair
    gen = json.loads((lp / "CURRENT").read_text())["generation"]
    shutil.copy(lp / f"snapshot-{gen:06d}.parquet", lp / f"snapshot-{gen + 1:06d}.parquet")
    (lp / "CURRENT").write_text("garbage")
    res = runner.invoke(app, ["repair", "--store", str(sp), "--ledger", str(lp)])
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["records_retired"] == 0 and out["current_written_back"] == gen
    assert json.loads((lp / "CURRENT").read_text())["generation"] == gen


def test_setting_a_lock_path_aside_never_moves_a_live_lock_file(tmp_path, monkeypatch):
    """Review 56, F1: a process that had looked at the path (a folder) and then renamed it could move aside the fresh
    lock file another process had made and locked meanwhile; both held "the lock". Now the look is taken again under
    a flock before the rename: the second process waits for the first's lock instead."""
    import threading

    from indknn_cli import locking
    from indknn_cli.errors import LockTimeoutError

    lock = tmp_path / "WRITER_LOCK"
    lock.mkdir()
    real, looked, go = locking._regular_or_absent, threading.Event(), threading.Event()

    def paused(path):  # B: looks (a folder), then waits while A takes the lock
        out = real(path)
        if threading.current_thread().name == "B":
            looked.set()
            go.wait(10)
        return out

    monkeypatch.setattr(locking, "_regular_or_absent", paused)
    seen = {}

    def b():
        try:
            with locking.exclusive_file(lock, timeout=0.5, on_timeout=lambda: LockTimeoutError("busy")):
                seen["b"] = "held"
        except LockTimeoutError:
            seen["b"] = "waited"

    tb = threading.Thread(target=b, name="B")
    tb.start()
    assert looked.wait(10)
    with locking.exclusive_file(lock, timeout=5, on_timeout=lambda: LockTimeoutError("busy")):
        assert lock.is_file()
        go.set()
        tb.join(10)
        assert seen["b"] == "waited"  # B never took a second "lock" while A held this one
        assert lock.is_file() and len(list(tmp_path.glob("WRITER_LOCK.not-a-file-*"))) == 1


@pytest.mark.heavy
def test_an_index_that_cannot_be_updated_is_not_blamed_on_a_store_chunk(pair, monkeypatch):
    """Review 56, F4: a candidate index failing after the rows were overwritten was reported as rows that "could not be
    overwritten" and a store chunk to restore."""
    from indknn_cli import deletion
    from indknn_cli.errors import StoreError

    sp, lp = pair

    def broken(store, rows):
        raise StoreError(f"{store.path}: the candidate index cannot be read (test)")

    monkeypatch.setattr(deletion, "_index_hook", lambda name: broken)
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"], env={"INDKNN_WIDTH": "400"})
    assert res.exit_code == 1, res.stderr
    assert "The records are erased" in res.stderr and "could not be overwritten" not in res.stderr
    st = FeatureStore.open(sp, mode="r")
    assert str(st.read("private", "record_id")[3]) == ""


@pytest.mark.heavy
def test_a_corrupt_chunk_of_other_rows_flags_does_not_stop_an_erasure(pair):
    """Review 56, F6: `delete` read every row's erased flag to plan, so one corrupt chunk of flags for rows 0–63
    stopped the erasure of row 150 (exit 2, nothing recorded)."""
    sp, lp = pair
    r = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r001"])
    assert r.exit_code == 0, r.stderr  # the flags array now has a chunk for rows 0–63
    _flip(sp / "private" / "deleted" / "c" / "0")
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r150")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["records_erased"] == 1
    st = FeatureStore.open(sp, mode="r")
    assert str(np.asarray(st.group("private")["record_id"][150])) == ""


def test_a_ledger_folder_that_cannot_be_reached_never_blocks_an_erasure(pair, monkeypatch):
    """Review 56 (observation): a --ledger under a folder that cannot be searched raised a raw PermissionError from
    the ledger lock, before `delete`'s erase-from-the-store fallback: the record stayed stored (exit 1)."""
    from indknn_cli import locking

    sp, lp = pair

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(locking, "missing_folders", denied)
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"])
    assert res.exit_code in (0, 1), res.stderr
    out = json.loads(res.stdout)
    assert out["records_erased"] == 1 and "Permission denied" in (out.get("ledger_unreadable") or "")
    assert str(FeatureStore.open(sp, mode="r").read("private", "record_id")[3]) == ""


@pytest.mark.heavy
def test_an_erasure_stuck_on_a_corrupt_flags_chunk_never_blocks_the_next_one(pair):
    """Review 57, F3/F4: the first request whose row sits in a corrupt flags chunk ends "recorded but not finished";
    every later `delete`, for rows in healthy chunks too, then failed (exit 2) before its own request was recorded,
    and the stuck record's ledger tombstone was never written (`account --record` said "active")."""
    sp, lp = pair
    r = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r001"])
    assert r.exit_code == 0, r.stderr
    _flip(sp / "private" / "deleted" / "c" / "0")  # flags of rows 0–63
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r005")
    assert res.returncode == 1 and "recorded but not finished" in res.stderr, res.stderr
    s = BudgetLedger.open(lp).state
    assert s.deleted[list(s.record_id).index("r005")]  # tombstoned: never selected, "deleted" to account
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r150")
    assert res.returncode == 1 and "This request's erasure went on" in res.stderr, res.stderr
    st = FeatureStore.open(sp, mode="r")
    assert str(np.asarray(st.group("private")["record_id"][150])) == ""  # erased
    assert st.erase_pending_rows("private").tolist() == [5]  # the stuck one stays pending
    s = BudgetLedger.open(lp).state
    assert s.deleted[list(s.record_id).index("r150")]


@pytest.mark.heavy
def test_repair_treats_an_unfinished_erasure_as_gone(pair):
    """Review 58, F1: an erasure stuck on a corrupt flags chunk (pending, tombstoned), then the event holding the
    tombstone damaged and the flags chunk restored from a backup (row not flagged): `repair` kept the record live."""
    sp, lp = pair
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r001"]).exit_code == 0
    flags = sp / "private" / "deleted" / "c" / "0"
    backup = _flip(flags)
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r005")
    assert res.returncode == 1 and "recorded but not finished" in res.stderr, res.stderr
    _flip(sorted((lp / "events").iterdir())[-1])  # the event holding r005's tombstone
    flags.write_bytes(backup)
    res = runner.invoke(app, ["repair", "--store", str(sp), "--ledger", str(lp)])
    assert res.exit_code == 0, res.stderr
    s = BudgetLedger.open(lp).state
    live = [i for i, r in enumerate(s.record_id) if r == "r005" and not s.deleted[i]]
    assert not live  # never a live record again
