"""Review 32's open LOW items (2026-11-28): ledger files removed or left behind by hand or by a killed repair.

Each was a dead end before: a message that never cleared ("try again"), a repair that failed on its own folder,
or a repair that retired everyone for what a killed repair of its own had left. None may refund a budget or block
an erasure; each test checks both."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from indknn_cli.deletion import delete_records
from indknn_cli.errors import ConcurrentChangeError, LedgerError, LedgerIntegrityError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.ledger_readonly import open_ledger_readonly
from indknn_cli.ledger_repair import repair_ledger
from indknn_cli.ledger_verify import verify_ledger
from indknn_cli.store import FeatureStore

from .test_audit_10 import _repair_cli, _world


def _spent(lp: Path) -> dict:
    led = BudgetLedger.open(lp)
    return dict(zip(led.state.record_id, led.state.spent))


def _erases(sp: Path, lp: Path, rid: str) -> bool:
    delete_records(store_path=sp, ledger_path=lp, record_ids=[rid])
    st = FeatureStore.open(sp, mode="r")
    ids = [str(x) for x in st.read("private", "record_id")]
    return rid not in ids


def test_a_missing_answers_file_is_damage_not_busy_and_repair_says_so(tmp_path):
    """answers-<g>.parquet removed: every reader said "the ledger kept changing while reading; try again" (exit 2),
    which never cleared. It is damage (exit 1) naming the file; repair names it too instead of "the snapshot itself
    is damaged"; delete still erases."""
    sp, lp = _world(tmp_path)
    (lp / "answers-000001.parquet").unlink()
    for read in (lambda: open_ledger_readonly(lp), lambda: BudgetLedger.open(lp)):
        with pytest.raises(LedgerIntegrityError, match=r"answers-000001\.parquet: missing"):
            read()
    with pytest.raises(LedgerIntegrityError, match=r"answers-000001\.parquet: missing") as exc:
        repair_ledger(ledger_path=lp, store_path=sp)
    assert "snapshot itself" not in str(exc.value)
    assert not (lp / "quarantine").exists() and not list(lp.glob(".repair-probe-*"))
    assert _erases(sp, lp, "r050")


def test_repair_recreates_a_removed_events_folder_and_refunds_nothing(tmp_path):
    """events/ removed: the ledger is behind the store's mark (a rollback), and repair failed writing its own event
    into the missing folder. It recreates it and retires every record."""
    sp, lp = _world(tmp_path)
    before = _spent(lp)
    shutil.rmtree(lp / "events")
    res = repair_ledger(ledger_path=lp, store_path=sp)
    assert res.repaired and res.records_retired > 0
    led = BudgetLedger.open(lp)
    assert all(s >= before[r] for r, s in zip(led.state.record_id, led.state.spent))
    assert (led.state.spent[~led.state.deleted] >= led.params.budget).all()
    assert verify_ledger(ledger_path=lp, store_path=sp)["verified"]
    assert _erases(sp, lp, "r050")


def test_repair_writes_back_a_garbage_current_and_retires_nobody_when_the_mark_agrees(tmp_path):
    """CURRENT not JSON: repair said "the snapshot itself is damaged" and stopped. Garbage is treated as a missing
    snapshot's name: written back to the newest snapshot of this store's ledger, which the mark then vouches for."""
    sp, lp = _world(tmp_path)
    before = _spent(lp)
    (lp / "CURRENT").write_bytes(b"garbage{\xff")
    dry = repair_ledger(ledger_path=lp, store_path=sp, dry_run=True)
    assert dry.current_written_back == 1 and (lp / "CURRENT").read_bytes() == b"garbage{\xff"
    res = repair_ledger(ledger_path=lp, store_path=sp)
    assert res.repaired and res.current_written_back == 1 and res.records_retired == 0
    assert res.as_dict()["cost"].startswith("none")
    assert (Path(res.quarantine_folder) / "CURRENT").read_bytes() == b"garbage{\xff"
    assert _spent(lp) == before
    assert verify_ledger(ledger_path=lp, store_path=sp)["verified"]


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["folder", "broken link", "named pipe", "link to a device"])
def test_a_current_that_is_not_a_file_is_damage_and_repair_writes_it_back(tmp_path, kind):
    """CURRENT a folder (or a link to nothing): every command said "no budget ledger here (create one with
    `indknn index`)", and repair said the same and stopped (review 40, left). It is damage (exit 1, "run repair");
    repair keeps it under quarantine/ and writes CURRENT back; nobody retires when the mark agrees; delete erases
    throughout."""
    if kind not in ("named pipe", "link to a device"):
        _not_a_file_case(tmp_path, kind)
        return
    # a regression would block on the pipe (or read the device) forever: run it in a child and fail on a timeout
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_not_a_file_case, args=(tmp_path, kind))
    child.start()
    child.join(timeout=300)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"CURRENT as {kind}: a command read it and blocked (review 43, H1)")
    assert child.exitcode == 0, f"the case failed in its child process (exit {child.exitcode}; its output above)"


def _not_a_file_case(tmp_path, kind):
    sp, lp = _world(tmp_path)
    before = _spent(lp)
    (lp / "CURRENT").unlink()
    if kind == "folder":
        (lp / "CURRENT").mkdir()
    elif kind == "named pipe":  # read, it blocks forever: delete hung (review 43, H1)
        os.mkfifo(lp / "CURRENT")
    elif kind == "link to a device":  # read, it never ends
        (lp / "CURRENT").symlink_to("/dev/zero")
    else:
        (lp / "CURRENT").symlink_to(tmp_path / "nowhere")
    assert BudgetLedger.exists(lp)  # a damaged ledger is still a ledger: `index` must not make a new one here
    # an erasure goes through first, the ledger unreadable (its tombstone pending), and nothing reads CURRENT
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r051"])
    assert "r051" not in [str(x) for x in FeatureStore.open(sp, mode="r").read("private", "record_id")]
    for read in (lambda: open_ledger_readonly(lp), lambda: BudgetLedger.open(lp)):
        with pytest.raises(LedgerIntegrityError, match=r"CURRENT: not a file.*indknn repair"):
            read()
    assert not verify_ledger(ledger_path=lp, store_path=sp)["verified"]
    dry = repair_ledger(ledger_path=lp, store_path=sp, dry_run=True)
    assert dry.current_written_back == 1 and (lp / "CURRENT").is_symlink() == ("link" in kind)
    assert dry.reason.startswith(f"{lp}/CURRENT: not a file")  # the operator's ledger, not the dry run's copy
    res = repair_ledger(ledger_path=lp, store_path=sp)
    assert res.repaired and res.current_written_back == 1 and res.records_retired == 0
    assert (Path(res.quarantine_folder) / "CURRENT.not-a-file").is_symlink() == ("link" in kind)
    assert (lp / "CURRENT").is_file() and not (lp / "CURRENT").is_symlink()
    spent = _spent(lp)
    assert all(spent[r] == before[r] for r in before if r != "r051")  # nobody refunded, nobody retired
    assert verify_ledger(ledger_path=lp, store_path=sp)["verified"]
    assert _erases(sp, lp, "r050")


def test_a_current_folder_goes_back_when_the_repair_fails(tmp_path):
    """No snapshot of this store's ledger left: repair refuses (exit 1) and leaves the folder CURRENT where it was."""
    sp, lp = _world(tmp_path)
    (lp / "CURRENT").unlink()
    (lp / "CURRENT").mkdir()
    for snap in lp.glob("snapshot-*.parquet"):
        snap.unlink()
    for dry_run in (True, False):
        with pytest.raises(LedgerIntegrityError, match="no other snapshot"):
            repair_ledger(ledger_path=lp, store_path=sp, dry_run=dry_run)
    assert (lp / "CURRENT").is_dir()
    assert _erases(sp, lp, "r050")


@pytest.mark.heavy
def test_a_killed_repairs_probe_folder_is_put_back_and_nobody_retires(tmp_path):
    """A repair killed while it probed left event files in .repair-probe-<pid>/; the ledger then looked rolled back,
    and the next repair retired every record and never looked there. It now puts them back first (nobody retires
    when the ledger then verifies); a name events/ already holds is never overwritten."""
    sp, lp = _world(tmp_path)
    before = _spent(lp)
    last = sorted((lp / "events").glob("*.parquet"))[-1]
    probe = lp / ".repair-probe-99999"
    probe.mkdir()
    shutil.move(str(last), probe / last.name)
    assert not verify_ledger(ledger_path=lp, store_path=sp)["verified"]  # behind the mark: looks rolled back
    r = _repair_cli(sp, lp)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["events_put_back"] == [last.name] and out["records_retired"] == 0, r.stderr
    assert "put them back into events/" in r.stderr and out["cost"].startswith("none")
    assert not probe.exists() and last.is_file() and _spent(lp) == before
    assert verify_ledger(ledger_path=lp, store_path=sp)["verified"]

    probe.mkdir()  # a stale copy of a name events/ still holds: kept aside, never put over the live file
    (probe / last.name).write_bytes(b"stale")
    (probe / "notes.txt").write_text("not an event")  # nor is a file that is no event moved into events/ (review 40)
    res = repair_ledger(ledger_path=lp, store_path=sp)
    assert not res.repaired and res.events_put_back == [] and not probe.exists()
    assert last.read_bytes() != b"stale" and list((lp / "quarantine").rglob(last.name))
    assert not (lp / "events" / "notes.txt").exists() and list((lp / "quarantine").rglob("notes.txt"))


@pytest.mark.heavy
def test_repair_of_a_store_restored_from_before_a_compaction_says_so_and_delete_still_erases(tmp_path):
    """The store restored from a copy taken before a completed `delete --compact`: every reader, repair included,
    said "the store was compacted while this command ran; run again", which never cleared. Readers now say what it
    may be; repair, which holds both locks, says what it is (exit 2); delete erases from the copy alone."""
    sp, lp = _world(tmp_path)
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r002"])
    backup = tmp_path / "backup.zarr"
    shutil.copytree(sp, backup)
    delete_records(store_path=sp, ledger_path=lp, compact=True)
    shutil.rmtree(sp)
    shutil.copytree(backup, sp)
    with pytest.raises(ConcurrentChangeError, match="If this repeats, the store is a copy taken before that compac"):
        BudgetLedger.open(lp, store_uuid=FeatureStore.open(sp, mode="r").uuid)
    before = sorted(p.name for p in lp.rglob("*"))
    with pytest.raises(LedgerError, match="a copy taken before the compaction the ledger recorded"):
        repair_ledger(ledger_path=lp, store_path=sp)
    assert sorted(p.name for p in lp.rglob("*")) == before
    r = _repair_cli(sp, lp)
    assert r.returncode == 2 and "Restore the store from a copy taken after that compaction" in r.stderr
    assert _erases(sp, lp, "r050")
    st = FeatureStore.open(sp, mode="r")
    assert np.asarray(st.read("private", "deleted")).astype(bool).sum() >= 2


@pytest.mark.heavy
def test_an_erasure_in_a_stopped_compactions_copy_reaches_the_copys_index_codes(tmp_path, monkeypatch):
    """Review 39, F2: with the ledger unreadable, `delete` erased the request's row in a stopped compaction's copy
    (review 32, F5) but the copy's LSH codes of that row stayed (and `erased` false). The copy's index rows are now
    overwritten as the live index's are, and a killed index writer's folders in the copy removed."""
    from indknn_cli import deletion, indexes

    from .test_delete import Crash, _crash_at

    sp, lp = _world(tmp_path)
    indexes.build(FeatureStore.open(sp, mode="a"), kind="lsh", tables=4, bits=6, seed=1)
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r001"])
    _crash_at(monkeypatch, "compact-ledger-prepared")
    with pytest.raises(Crash):
        delete_records(store_path=sp, ledger_path=lp, compact=True)
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    copy_path = next(p for p in sp.parent.iterdir() if p.name.startswith(f".{sp.name}.compacting-"))
    shutil.copytree(copy_path / "index", copy_path / ".index-build-0123abcd")  # a killed build inside the copy
    copy = FeatureStore.open(copy_path)
    row = list(copy.read("private", "record_id")).index("r050")
    codes = lambda: np.asarray(zarr.open_group(str(copy_path / "index"), mode="r")["codes"][row])  # noqa: E731
    assert codes().any()
    (lp / "CURRENT").write_text("{not json")
    res = delete_records(store_path=sp, ledger_path=lp, record_ids=["r050"])
    assert res.records_erased == 1
    assert not codes().any() and zarr.open_group(str(copy_path / "index"), mode="r")["erased"][row]
    assert not (copy_path / ".index-build-0123abcd").exists()


def test_repair_keeps_a_file_in_place_of_events_and_refuses_a_linked_events_folder(tmp_path):
    """Review 39, F3/F4: a regular file named `events` made repair fail with "File exists"; an `events` symbolic
    link to another ledger's folder let repair move that ledger's event files into this one's quarantine and write
    its own event there. The file is kept under quarantine/ (every record then retires: no refund); the link is
    refused (exit 1) and the other ledger left as it was."""
    sp, lp = _world(tmp_path)
    other = tmp_path / "other-events"
    shutil.copytree(lp / "events", other)
    before = sorted(p.name for p in other.iterdir())
    shutil.rmtree(lp / "events")
    (lp / "events").symlink_to(other)
    with pytest.raises(LedgerIntegrityError, match="events is a symbolic link"):
        repair_ledger(ledger_path=lp, store_path=sp)
    assert sorted(p.name for p in other.iterdir()) == before and not (lp / "quarantine").exists()

    (lp / "events").unlink()
    (lp / "events").write_text("not a folder")
    res = repair_ledger(ledger_path=lp, store_path=sp)
    assert res.repaired and res.records_retired > 0
    assert list((lp / "quarantine").rglob("events.not-a-folder"))
    assert verify_ledger(ledger_path=lp, store_path=sp)["verified"]


def test_account_outputs_never_land_in_the_recorded_store_and_export_checks_the_store_given(tmp_path):
    """Review 40, M8/M9: `account --plot s.zarr/p.png` without --store wrote into the store the ledger records
    (only a given --store was checked); `account --store COPY --export` of a copied store and ledger checked the
    recorded original instead of COPY and said "rolled back"."""
    from typer.testing import CliRunner

    from indknn_cli.cli.app import app

    runner = CliRunner()
    sp, lp = _world(tmp_path / "a")
    r = runner.invoke(app, ["account", "--ledger", str(lp), "--plot", str(sp / "p.png")])
    assert r.exit_code == 2 and "inside the store's folder" in r.stderr and not (sp / "p.png").exists()
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r003"])  # the original moves on after the copy
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    from indknn_cli.serving import serve_queries

    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=4)
    r = runner.invoke(app, ["account", "--ledger", str(tmp_path / "b" / "L"), "--store", str(tmp_path / "b" / "s.zarr"),
                            "--export", str(tmp_path / "e.csv")])
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "e.csv").is_file()
