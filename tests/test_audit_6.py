"""Audit 6: a feature store restored from a backup while its ledger stayed current (AUDIT_FINDINGS_6.md).

The ledger maps each record to a store row by row number. A store restored from an older copy carries its own
older high-water mark, so the ledger-rollback check passed, and the rows appended after the backup, embedded
again in another order, were charged against other records' budgets: one person paid up to 2·B.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np

from indknn_cli import ledger_integrity as integrity
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


def _world(tmp_path):
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


def test_a_restored_store_is_refused_before_anything_is_charged_and_names_no_record(tmp_path):
    _world(tmp_path)
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
    # `account --verify` (a reviewer's check) reports it, and compares every row whatever the mark says
    v = _cli("account", "--ledger", "L", "--store", "s.zarr", "--verify", cwd=tmp_path)
    assert v.returncode == 1 and "NOT verified" in v.stdout and "restored" in v.stdout and "'n0'" not in v.stdout
    # a mark written before it recorded the rows the ledger maps: every row is compared
    mark_file = tmp_path / "s.zarr" / integrity.MARK_NAME
    mark = json.loads(mark_file.read_text())
    assert mark["rows"] == 6  # the backup's: the ledger mapped rows 0-5 when it was taken
    del mark["rows"]
    mark_file.write_text(json.dumps(mark))
    r = _cli("serve-queries", "b3", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
    assert r.returncode == 1 and "restored" in r.stderr and "'n0'" not in r.stderr
    assert _spent(tmp_path) == before


def test_the_ledger_knows_every_row_on_a_normal_serve_so_none_is_read_again(tmp_path):
    """The mark after a commit covers every row the ledger maps: the comparison reads no record id."""
    _world(tmp_path)
    led = BudgetLedger.open(tmp_path / "L")
    assert integrity.read_mark(tmp_path / "s.zarr")["rows"] == integrity.rows_mapped(led) == 8
    v = _ok(_cli("account", "--ledger", "L", "--store", "s.zarr", "--verify", cwd=tmp_path))
    assert "each of the 8 live records sits at a row holding its own record id" in " ".join(v.stdout.split())


def test_repair_after_a_restored_store_refunds_nothing_and_serving_charges_each_person_once(tmp_path):
    _world(tmp_path)
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
