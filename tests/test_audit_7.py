"""Audit 7 (AUDIT_FINDINGS_7.md): `repair` moved an erased user's tombstone to another user.

An erased record id that comes back under *another* user stays out of the ledger (`add_records`) and `index`
refuses it (`user_moves`): re-adding it would move the tombstone, and the spent it carries, away from its first
user. `repair` brought every unmapped store row into the ledger with an `add` row, that one included, and replay
gave the tombstone to the new user: the erased user then had no record left, and under the user unit the
person came back with a fresh budget and was charged up to 2·B in all.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore
from tests.test_audit_6 import _cli, _ok

D = 16


def _records(tmp_path, user):
    s = BudgetLedger.open(tmp_path / "L").state
    return {str(r): (float(x), bool(d)) for r, u, x, d in zip(s.record_id, s.user_id, s.spent, s.deleted)
            if str(u or "") == user}


def _alice_spends_then_her_erased_id_returns_under_bob(tmp_path, rid, v, rng) -> tuple[float, float]:
    """120 queries at alice's vector spend her record ``rid`` to about B; it is erased, then embedded again under
    bob (through the library: `embed` refuses it; the row stays out of the ledger). Returns (what she had paid, B)."""
    np.savez(tmp_path / "q1.npz", x=np.tile(v, (120, 1)) + 1e-3 * rng.standard_normal((120, D)))
    _ok(_cli("serve-queries", "q1.npz", "--store", "s.zarr", "--ledger", "L", "-q", cwd=tmp_path))
    budget = BudgetLedger.open(tmp_path / "L").params.budget
    paid = _records(tmp_path, "alice")[rid][0]
    assert paid > 0.9 * budget
    _ok(_cli("delete", "--record", rid, "--store", "s.zarr", "--ledger", "L", "-q", cwd=tmp_path))
    np.savez(tmp_path / "back.npz", x=v[None, :], y=[0], ids=np.array([rid]), users=np.array(["bob"]))
    p = _cli("embed", "back.npz", "--store", "s.zarr", "-q", cwd=tmp_path)
    assert p.returncode == 2 and "keeps its user" in p.stderr  # embed refuses it since review 60, F3
    # written through the library instead (a store written outside `embed`, or before that check)
    FeatureStore.open(tmp_path / "s.zarr", mode="a").append("private", v[None, :].astype(np.float32),
                                                            labels=np.zeros(1, np.int32), record_ids=[rid],
                                                            user_ids=["bob"])
    return paid, budget


@pytest.mark.heavy
@pytest.mark.parametrize("unit", ["user", "record"])
def test_repair_keeps_an_erased_users_tombstone_when_its_id_comes_back_under_another_user(tmp_path, unit):
    rng = np.random.default_rng(0)
    v = np.eye(D)[0]
    x = rng.standard_normal((12, D))
    x[1] = v
    users = [f"u{i}" for i in range(12)]
    users[1] = "alice"
    np.savez(tmp_path / "priv.npz", x=x, y=rng.integers(0, 2, 12), ids=np.array([f"r{i}" for i in range(12)]),
             users=np.array(users))
    _ok(_cli("embed", "priv.npz", "--store", "s.zarr", "--extractor", "vectors", "--label-names", "0,1", "-q",
             cwd=tmp_path))
    _ok(_cli("index", "--store", "s.zarr", "--ledger", "L", "--eps", "1", "--privacy-unit", unit, "--tau", "0.9",
             "--planned-queries", "120", "-q", cwd=tmp_path))
    paid, budget = _alice_spends_then_her_erased_id_returns_under_bob(tmp_path, "r1", v, rng)
    np.savez(tmp_path / "q2.npz", x=rng.standard_normal((5, D)))
    _ok(_cli("serve-queries", "q2.npz", "--store", "s.zarr", "--ledger", "L", "-q", cwd=tmp_path))
    # ordinary damage: a crash leaves the newest event half written; repair
    events = sorted(os.listdir(tmp_path / "L" / "events"))
    newest = tmp_path / "L" / "events" / events[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    _ok(_cli("repair", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    assert _records(tmp_path, "alice").get("r1", (0.0, False)) == (pytest.approx(paid), True)  # still alice's
    assert "r1" not in _records(tmp_path, "bob")
    # alice comes back with a new record: it starts at what she had spent, never afresh
    np.savez(tmp_path / "alice2.npz", x=v[None, :], y=[0], ids=np.array(["a2"]), users=np.array(["alice"]))
    _ok(_cli("embed", "alice2.npz", "--store", "s.zarr", "-q", cwd=tmp_path))
    np.savez(tmp_path / "q3.npz", x=np.tile(v, (120, 1)) + 1e-3 * rng.standard_normal((120, D)))
    _ok(_cli("serve-queries", "q3.npz", "--store", "s.zarr", "--ledger", "L", "-q", cwd=tmp_path))
    alice = _records(tmp_path, "alice")
    assert alice["a2"][0] >= paid - 1e-12
    # what serving charged her new record on top of what she had spent stays within one budget
    assert alice["a2"][0] <= budget + 1e-12


def test_an_add_row_that_gives_a_record_to_another_user_is_refused_when_written_and_when_replayed(tmp_path):
    """The ledger's own guard: whatever writes it (repair, or a hand-made event file), an `add` row on an existing
    record with another user is refused, and nothing of the event is applied."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from indknn_cli.errors import LedgerError
    from indknn_cli.indexing import make_params

    led = BudgetLedger.create(tmp_path / "L", params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=1.0,
                                                                 planned_queries=100),
                              store_uuid="synthetic", store_path="(none)")
    led.add_records(record_ids=["r0", "r1"], user_ids=["alice", "carol"], rows=[0, 1])
    led.delete_records([0])
    moved = {"kind": ["add"], "ledger_index": [0], "record_id": ["r0"], "user_id": ["bob"], "row": [2],
             "budget": [led.params.budget], "spent_after": [0.0]}
    with pytest.raises(LedgerError, match="another user"):
        led.commit_event(event_type="add", info={"records": 1}, columns=moved)
    assert BudgetLedger.open(tmp_path / "L").state.user_id[0] == "alice"
    # the same row slipped in by hand (an event file copied from a ledger written without the guard) is refused
    # on replay: the ledger does not open, and repair (tested above) takes over
    led.add_records(record_ids=["r0"], user_ids=["alice"], rows=[2])  # the same user: allowed
    newest = sorted((tmp_path / "L" / "events").glob("*.parquet"))[-1]
    t = pq.read_table(newest)
    t = t.set_column(t.schema.get_field_index("user_id"), "user_id",
                     pa.array(["bob"] * t.num_rows, type=t.schema.field("user_id").type))
    shutil.copy(newest, tmp_path / "orig.parquet")
    pq.write_table(t, newest)
    with pytest.raises(LedgerError, match="another user"):
        BudgetLedger.open(tmp_path / "L")


@pytest.mark.heavy
@pytest.mark.parametrize("damage", ["rollback", "lost-event"])
def test_repair_keeps_the_tombstone_when_the_kept_ledger_never_saw_the_erased_id(tmp_path, damage):
    """Review 15, 1: the ledger is rolled back to a copy made before alice joined (or the event before her add is
    torn), so the kept ledger does not know her erased id; the store's erasure log and the quarantined events
    still name her as its owner, so bob's row with that id stays out and her tombstone is written."""
    import shutil

    rng = np.random.default_rng(0)
    v = np.eye(D)[0]
    x = rng.standard_normal((11, D))
    x[:, 0] = 0
    np.savez(tmp_path / "priv.npz", x=x, y=rng.integers(0, 2, 11), ids=np.array([f"r{i}" for i in range(11)]),
             users=np.array([f"u{i}" for i in range(11)]))
    _ok(_cli("embed", "priv.npz", "--store", "s.zarr", "--extractor", "vectors", "--label-names", "0,1", "-q",
             cwd=tmp_path))
    _ok(_cli("index", "--store", "s.zarr", "--ledger", "L", "--eps", "1", "--privacy-unit", "user", "--tau", "0.9",
             "--planned-queries", "120", "-q", cwd=tmp_path))
    np.savez(tmp_path / "q0.npz", x=rng.standard_normal((3, D)))
    _ok(_cli("serve-queries", "q0.npz", "--store", "s.zarr", "--ledger", "L", "-q", cwd=tmp_path))
    shutil.copytree(tmp_path / "L", tmp_path / "L_backup")
    before = sorted(os.listdir(tmp_path / "L" / "events"))
    np.savez(tmp_path / "alice.npz", x=v[None, :], y=[0], ids=np.array(["ra"]), users=np.array(["alice"]))
    _ok(_cli("embed", "alice.npz", "--store", "s.zarr", "-q", cwd=tmp_path))
    paid, _ = _alice_spends_then_her_erased_id_returns_under_bob(tmp_path, "ra", v, rng)
    if damage == "rollback":
        shutil.rmtree(tmp_path / "L")
        shutil.copytree(tmp_path / "L_backup", tmp_path / "L")
    else:
        torn = tmp_path / "L" / "events" / before[-1]
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    p = _ok(_cli("repair", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    assert "another user" in p.stderr
    assert _records(tmp_path, "alice").get("ra", (0.0, False))[1] is True
    assert "ra" not in _records(tmp_path, "bob")
    np.savez(tmp_path / "alice2.npz", x=v[None, :], y=[0], ids=np.array(["a2"]), users=np.array(["alice"]))
    _ok(_cli("embed", "alice2.npz", "--store", "s.zarr", "-q", cwd=tmp_path))
    np.savez(tmp_path / "q4.npz", x=np.tile(v, (120, 1)) + 1e-3 * rng.standard_normal((120, D)))
    _ok(_cli("serve-queries", "q4.npz", "--store", "s.zarr", "--ledger", "L", "-q", cwd=tmp_path))
    # her tombstone was written at B by repair (lost history: no refund), and her new record starts there
    assert _records(tmp_path, "alice")["a2"][0] >= paid - 1e-12


@pytest.mark.heavy
def test_verify_reports_an_erased_id_held_by_another_user(tmp_path):
    """Review 15, 2: a ledger in which an earlier version's repair moved an erased user's record to another user
    (compacted since, so no event row shows it) is reported by `account --verify` (exit 1, no id named); the store's
    erasure log is the evidence. Simulated by an erasure-log line naming another user for a live record."""
    import json

    np.savez(tmp_path / "p.npz", x=np.eye(D)[:4], y=[0, 1, 0, 1], ids=np.array(["r0", "r1", "r2", "r3"]),
             users=np.array(["u0", "u1", "u2", "u3"]))
    _ok(_cli("embed", "p.npz", "--store", "s.zarr", "--extractor", "vectors", "--label-names", "0,1", "-q",
             cwd=tmp_path))
    _ok(_cli("index", "--store", "s.zarr", "--ledger", "L", "--eps", "1", "-q", cwd=tmp_path))
    _ok(_cli("delete", "--record", "r0", "--store", "s.zarr", "--ledger", "L", "-q", cwd=tmp_path))
    assert _cli("account", "--ledger", "L", "--store", "s.zarr", "--verify", cwd=tmp_path).returncode == 0
    with open(tmp_path / "s.zarr" / "erased-ids.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"record_id": "r1", "user_id": "alice"}) + "\n")
    p = _cli("account", "--ledger", "L", "--store", "s.zarr", "--verify", cwd=tmp_path)
    assert p.returncode == 1 and "holds under another" in (p.stdout + p.stderr)
    assert "r1" not in p.stdout + p.stderr and "alice" not in p.stdout + p.stderr
