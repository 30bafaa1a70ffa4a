"""Audit 6: a feature store restored from a backup while its ledger stayed current (AUDIT_FINDINGS_6.md).

The ledger maps each record to a store row by row number. A store restored from an older copy carries its own
older high-water mark, so the ledger-rollback check passed, and the rows appended after the backup, embedded
again in another order, were charged against other records' budgets: one person paid up to 2·B. The first fix
(compare ids from the mark's row count on) was bypassed by any commit before the check, by the roll-forward of a
pending erasure, and by generated ids (review 13); the store now keeps a version log that every ledger commit
records (store_versions.py), and these tests run each of those paths.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from indknn_cli import store_versions
from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore

D = 8
A, B = np.eye(D)[0], np.eye(D)[1]


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "indknn_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def _ok(p):
    assert p.returncode == 0, p.stderr
    return p


def _build_world(tmp_path):
    """A bound store and its ledger, a backup of the store, then two people appended and one of them spent."""
    base = np.eye(D)[2:8]
    np.savez(tmp_path / "base.npz", x=base, y=np.zeros(6, int), ids=np.array([f"r{i}" for i in range(6)]))
    _ok(_cli("embed", "base.npz", "--store", "s.zarr", "--extractor", "vectors", "--label-names", "0,1", cwd=tmp_path))
    _ok(_cli("index", "--store", "s.zarr", "--ledger", "L", "--eps", "1", "--tau", "0.9", "--planned-queries", "40",
             cwd=tmp_path))
    np.savez(tmp_path / "q1.npz", x=base[:1])
    _ok(_cli("embed", "q1.npz", "--store", "s.zarr", "--role", "query", "--batch-id", "b1", cwd=tmp_path))
    _ok(_cli("serve-queries", "b1", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))  # binds the store
    shutil.copytree(tmp_path / "s.zarr", tmp_path / "backup.zarr")
    np.savez(tmp_path / "new.npz", x=np.stack([A, B]), y=np.array([1, 0]), ids=np.array(["n0", "n1"]))
    _ok(_cli("embed", "new.npz", "--store", "s.zarr", cwd=tmp_path))
    np.savez(tmp_path / "qa.npz", x=np.tile(A, (40, 1)))
    _ok(_cli("embed", "qa.npz", "--store", "s.zarr", "--role", "query", "--batch-id", "b2", cwd=tmp_path))
    _ok(_cli("serve-queries", "b2", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))  # n0 (vector A) spends B


@pytest.fixture(scope="module")
def _world_template(tmp_path_factory):
    """The world is built once per module (eight CLI processes) and copied into each test's folder."""
    root = tmp_path_factory.mktemp("audit6-world") / "built"
    root.mkdir()
    _build_world(root)
    return root.rename(root.parent / "template")  # its copies are not twins of a live original (store_twins)


@pytest.fixture
def world(tmp_path, _world_template):
    shutil.copytree(_world_template, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _restore_and_reembed(tmp_path):
    shutil.rmtree(tmp_path / "s.zarr")
    shutil.copytree(tmp_path / "backup.zarr", tmp_path / "s.zarr")
    np.savez(tmp_path / "new2.npz", x=np.stack([B, A]), y=np.array([0, 1]), ids=np.array(["n1", "n0"]))
    _ok(_cli("embed", "new2.npz", "--store", "s.zarr", cwd=tmp_path))  # the same two people, in the other order
    np.savez(tmp_path / "qa3.npz", x=np.tile(A, (40, 1)) + 1e-3)
    _ok(_cli("embed", "qa3.npz", "--store", "s.zarr", "--role", "query", "--batch-id", "b3", cwd=tmp_path))


def _spent(tmp_path):
    s = BudgetLedger.open(tmp_path / "L").state
    return {str(r): float(x) for r, x in zip(s.record_id, s.spent)}


def _vector_a_paid(tmp_path) -> float:
    """What the person with vector A has paid over all ledger records that were charged at a row holding A."""
    led = BudgetLedger.open(tmp_path / "L")
    return float(led.state.spent[list(led.state.record_id).index("n0")])


@pytest.mark.heavy
def test_a_restored_store_is_refused_before_anything_is_charged_and_names_no_record(tmp_path, world):
    budget = BudgetLedger.open(tmp_path / "L").params.budget
    before = _spent(tmp_path)
    assert before["n0"] > 0.9 * budget and before["n1"] == 0.0
    _restore_and_reembed(tmp_path)
    ledger_files = {p.name: p.read_bytes() for p in (tmp_path / "L").iterdir() if p.is_file() and p.name != "LOCK"}
    p = _cli("serve-queries", "b3", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
    # Before the fix: exit 0, and n1's record (now at the row holding vector A) paid B for person n0 again.
    assert p.returncode == 1, (p.returncode, p.stderr, _spent(tmp_path))
    assert p.stdout == ""
    assert "restored" in p.stderr and "repair" in p.stderr
    for rid in ("n0", "n1", "r0"):
        assert f"'{rid}'" not in p.stderr
    assert _spent(tmp_path) == before
    after = {p.name: p.read_bytes() for p in (tmp_path / "L").iterdir() if p.is_file() and p.name != "LOCK"}
    assert after == ledger_files  # nothing committed
    # `index` (which also brings new rows into the ledger) refuses it the same way
    q = _cli("index", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
    assert q.returncode == 1 and "restored" in q.stderr and "'n0'" not in q.stderr
    # `account --verify` (a reviewer's check) reports it
    v = _cli("account", "--ledger", "L", "--store", "s.zarr", "--verify", cwd=tmp_path)
    assert v.returncode == 1 and "NOT verified" in v.stdout and "restored" in v.stdout and "'n0'" not in v.stdout


@pytest.mark.heavy
def test_repair_after_a_restored_store_refunds_nothing_and_serving_charges_each_person_once(tmp_path, world):
    budget = BudgetLedger.open(tmp_path / "L").params.budget
    _restore_and_reembed(tmp_path)
    rep = _cli("repair", "--ledger", "L", "--store", "s.zarr", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    out = json.loads(rep.stdout.splitlines()[-1])
    assert out["repaired"] is True
    _ok(_cli("serve-queries", "b3", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    led = BudgetLedger.open(tmp_path / "L")
    s = led.state
    ids = FeatureStore.open(tmp_path / "s.zarr", mode="r").read("private", "record_id")
    live = np.flatnonzero((s.row >= 0) & ~s.deleted)
    # every live record sits at a row holding its own id
    assert all(str(ids[s.row[i]]) == str(s.record_id[i]) for i in live)
    # nobody's spent went down, and nobody is above B
    assert float(s.spent.max()) <= budget
    assert _vector_a_paid(tmp_path) >= 0.9 * budget


@pytest.mark.heavy
def test_a_normal_day_passes_and_verify_compares_every_row(tmp_path, world):
    v = _ok(_cli("account", "--ledger", "L", "--store", "s.zarr", "--verify", cwd=tmp_path))
    assert "each of the 8 live records sits at a row holding its own record id" in " ".join(v.stdout.split())
    led = BudgetLedger.open(tmp_path / "L")
    st = FeatureStore.open(tmp_path / "s.zarr", mode="r")
    assert led.state.store_seen["version"] == store_versions.versions(st)[-1]


def _refused_then_repaired(tmp_path, budget, *, batch="b3"):
    p = _cli("serve-queries", batch, "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
    assert p.returncode == 1 and "restored from an older copy" in p.stderr, (p.returncode, p.stderr)
    assert p.stdout == ""
    rep = _ok(_cli("repair", "--ledger", "L", "--store", "s.zarr", cwd=tmp_path))
    assert json.loads(rep.stdout.splitlines()[-1])["repaired"] is True
    _ok(_cli("serve-queries", batch, "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    assert float(BudgetLedger.open(tmp_path / "L").state.spent.max()) <= budget


@pytest.mark.heavy
def test_a_delete_before_the_serve_does_not_let_the_restored_store_through(tmp_path, world):
    """Review 13, 1: an erasure (or a nightly `delete --compact`) committed against the restored store before the
    next serve moved the mark past the unchecked rows, and the serve charged person A a second B."""
    budget = BudgetLedger.open(tmp_path / "L").params.budget
    _restore_and_reembed(tmp_path)
    before = _spent(tmp_path)
    d = _cli("delete", "--record", "r3", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
    assert d.returncode == 0 and "cannot be read" in d.stderr  # an erasure is never blocked: tombstone pending
    c = _cli("delete", "--compact", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
    assert c.returncode == 1 and "restored from an older copy" in c.stderr
    assert _spent(tmp_path) == before  # nothing charged, nothing refunded
    _refused_then_repaired(tmp_path, budget)


@pytest.mark.heavy
def test_a_pending_erasure_is_not_rolled_forward_onto_a_restored_store(tmp_path, world):
    """Review 13, 2: the serve's roll-forward of a pending erasure mapped the pending row to a ledger record by row
    number, tombstoning n0 instead of n1 and committing before any check."""
    budget = BudgetLedger.open(tmp_path / "L").params.budget
    _restore_and_reembed(tmp_path)
    _ok(_cli("delete", "--record", "n1", "--store", "s.zarr", "--ledger", "typo", cwd=tmp_path))  # pending
    before = _spent(tmp_path)
    p = _cli("serve-queries", "b3", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
    assert p.returncode == 1 and "restored from an older copy" in p.stderr
    assert _spent(tmp_path) == before and not BudgetLedger.open(tmp_path / "L").state.deleted.any()
    _refused_then_repaired(tmp_path, budget)


@pytest.mark.heavy
def test_generated_ids_do_not_hide_a_restored_store(tmp_path):
    """Review 13, 3: ids that embed generates from row positions repeat in a re-embedded store, so comparing ids
    let the restored store through."""
    base = np.eye(D)[2:8]
    np.savez(tmp_path / "base.npz", x=base, y=np.zeros(6, int))
    _ok(_cli("embed", "base.npz", "--store", "s.zarr", "--extractor", "vectors", "--label-names", "0,1",
             "--id-column", "", cwd=tmp_path))
    _ok(_cli("index", "--store", "s.zarr", "--ledger", "L", "--eps", "1", "--tau", "0.9", "--planned-queries", "40",
             cwd=tmp_path))
    shutil.copytree(tmp_path / "s.zarr", tmp_path / "backup.zarr")
    np.savez(tmp_path / "new.npz", x=np.stack([A, B]), y=np.array([1, 0]))
    _ok(_cli("embed", "new.npz", "--store", "s.zarr", "--id-column", "", cwd=tmp_path))
    np.savez(tmp_path / "qa.npz", x=np.tile(A, (40, 1)))
    _ok(_cli("embed", "qa.npz", "--store", "s.zarr", "--role", "query", "--batch-id", "b2", cwd=tmp_path))
    _ok(_cli("serve-queries", "b2", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    budget = BudgetLedger.open(tmp_path / "L").params.budget
    shutil.rmtree(tmp_path / "s.zarr")
    shutil.copytree(tmp_path / "backup.zarr", tmp_path / "s.zarr")
    np.savez(tmp_path / "new2.npz", x=np.stack([B, A]), y=np.array([0, 1]))
    _ok(_cli("embed", "new2.npz", "--store", "s.zarr", "--id-column", "", cwd=tmp_path))
    np.savez(tmp_path / "qa3.npz", x=np.tile(A, (40, 1)) + 1e-3)
    _ok(_cli("embed", "qa3.npz", "--store", "s.zarr", "--role", "query", "--batch-id", "b3", cwd=tmp_path))
    before = _spent(tmp_path)
    assert before["private-00000007"] == 0.0 and before["private-00000006"] > 0.9 * budget
    v = _cli("account", "--ledger", "L", "--store", "s.zarr", "--verify", cwd=tmp_path)
    assert v.returncode == 1 and "restored from an older copy" in v.stdout
    _refused_then_repaired(tmp_path, budget)


@pytest.mark.heavy
def test_a_store_restored_from_before_an_erasure_is_refused_and_repair_erases_again(tmp_path, world):
    """Review 13, 5: a store restored from a copy taken before an erasure brought the erased record back as a
    candidate (charged, its vector served from)."""
    shutil.rmtree(tmp_path / "backup.zarr")
    shutil.copytree(tmp_path / "s.zarr", tmp_path / "backup.zarr")
    _ok(_cli("delete", "--record", "r3", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    shutil.rmtree(tmp_path / "s.zarr")
    shutil.copytree(tmp_path / "backup.zarr", tmp_path / "s.zarr")
    np.savez(tmp_path / "q3.npz", x=np.tile(np.eye(D)[5], (5, 1)))  # r3's vector
    _ok(_cli("embed", "q3.npz", "--store", "s.zarr", "--role", "query", "--batch-id", "b4", cwd=tmp_path))
    budget = BudgetLedger.open(tmp_path / "L").params.budget
    _refused_then_repaired(tmp_path, budget, batch="b4")
    st = FeatureStore.open(tmp_path / "s.zarr", mode="r")
    assert st.read("private", "deleted")[3] and not np.any(st.read("private", "features")[3])
    s = BudgetLedger.open(tmp_path / "L").state
    assert s.deleted[list(s.record_id).index("r3")]


@pytest.mark.heavy
def test_repair_records_the_re_erasure_so_a_second_restore_is_refused(tmp_path, world):
    """Review 14, 1: repair committed before it erased the rows again, recording the restored copy's own version;
    the same copy restored once more then passed every check and the erased record was served again."""
    shutil.rmtree(tmp_path / "backup.zarr")
    shutil.copytree(tmp_path / "s.zarr", tmp_path / "backup.zarr")
    _ok(_cli("delete", "--record", "r3", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    for _ in range(2):
        shutil.rmtree(tmp_path / "s.zarr")
        shutil.copytree(tmp_path / "backup.zarr", tmp_path / "s.zarr")
        p = _cli("serve-queries", "b2", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
        assert p.returncode == 1 and "restored from an older copy" in p.stderr
        rep = _ok(_cli("repair", "--ledger", "L", "--store", "s.zarr", cwd=tmp_path))
        assert json.loads(rep.stdout.splitlines()[-1])["rows_erased_again"] == 1 and "erased again" in rep.stderr
    s = BudgetLedger.open(tmp_path / "L").state
    assert s.deleted[list(s.record_id).index("r3")]


@pytest.mark.heavy
def test_repair_after_a_ledger_rollback_keeps_a_record_embedded_again_after_its_erasure(tmp_path, world):
    """Review 14, 3: a re-admission (erased, then embedded again with consent) lost by a ledger rollback was erased
    by repair; the store's own erasure log shows the id was erased in this store, so its new row stays."""
    _ok(_cli("delete", "--record", "r3", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    shutil.copytree(tmp_path / "L", tmp_path / "L.bak", ignore=shutil.ignore_patterns("LOCK"))
    np.savez(tmp_path / "r3.npz", x=np.eye(D)[5][None], y=np.array([0]), ids=np.array(["r3"]))
    assert "re-admitted" in _ok(_cli("embed", "r3.npz", "--store", "s.zarr", cwd=tmp_path)).stderr
    _ok(_cli("index", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    shutil.rmtree(tmp_path / "L")
    shutil.copytree(tmp_path / "L.bak", tmp_path / "L")  # the ledger rolled back past the re-admission
    rep = _ok(_cli("repair", "--ledger", "L", "--store", "s.zarr", cwd=tmp_path))
    assert json.loads(rep.stdout.splitlines()[-1])["rows_erased_again"] == 0
    st = FeatureStore.open(tmp_path / "s.zarr", mode="r")
    assert not st.read("private", "deleted")[8] and np.any(st.read("private", "features")[8])
