"""Issue 16 §3: a damaged or rolled-back ledger is repairable without a refund (`indknn repair`): the longest
verified prefix of events is kept, the rest quarantined, and every record retired (spent = B)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from indknn_cli.ledger import BudgetLedger
from indknn_cli.ledger_verify import verify_ledger
from indknn_cli.serving import build_index, serve_queries
from indknn_cli.store import FeatureStore

from .test_ledger_integrity import _cli, _events, _serve, world  # noqa: F401 (world: the shared fixture)


def _spent_by_id(lp):
    s = BudgetLedger.open(lp).state
    return dict(zip(s.record_id, s.spent))


@pytest.mark.heavy
def test_a_truncated_event_is_repaired_by_retiring_everyone_never_refunding(world, tmp_path):
    sp, lp = world
    before = _spent_by_id(lp)
    B = BudgetLedger.open(lp).params.budget
    ev = _events(lp)
    ev[3].write_bytes(ev[3].read_bytes()[:200])  # truncated middle event: every command refuses the ledger
    assert _serve(sp, lp, "q2").returncode != 0
    dry = _cli("repair", "--store", str(sp), "--ledger", str(lp), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    d = json.loads(dry.stdout)
    assert d["dry_run"] and d["repaired"] and d["quarantined"] == [p.name for p in ev[3:]]
    assert _events(lp) == ev and not (lp / "quarantine").exists()  # the dry run wrote nothing
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["repaired"] and r["quarantined"] == [p.name for p in ev[3:]] and r["records_retired"] > 0
    assert "no budget refunded" in res.stderr
    after = _spent_by_id(lp)
    assert all(after[k] >= before[k] for k in before)  # nothing refunded, whatever the lost events held
    assert all(v == B for v in after.values())  # every record retired
    assert sorted(p.name for p in (lp / "quarantine").rglob("*.parquet")) == sorted(p.name for p in ev[3:])
    assert verify_ledger(lp, store_path=sp)["verified"]
    served = _serve(sp, lp, "q2")  # back in service: answered from noise, nobody charged
    assert served.returncode == 0 and len(served.stdout.splitlines()) == 40
    assert _spent_by_id(lp) == after
    again = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert again.returncode == 0 and json.loads(again.stdout)["repaired"] is False


@pytest.mark.heavy
def test_a_rolled_back_ledger_is_repaired_without_refund(world, tmp_path):
    sp, lp = world
    backup = tmp_path / "backup"
    shutil.copytree(lp, backup)
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", batch_size=8, seed=2)
    latest = _spent_by_id(lp)
    shutil.rmtree(lp)
    shutil.copytree(backup, lp)  # an older copy restored: refused (the store's high-water mark)
    assert _serve(sp, lp, "q3").returncode == 1
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    after = _spent_by_id(lp)
    assert all(after[k] >= latest[k] for k in latest)  # the later charges are not refunded
    assert _serve(sp, lp, "q3").returncode == 0


def test_rows_added_in_lost_events_come_back_retired(world, tmp_path):
    sp, lp = world
    x = FeatureStore.open(sp).read("private", "features", 0, 3)
    st = FeatureStore.open(sp, mode="a")
    st.append("private", x, labels=np.zeros(3, np.int32), record_ids=["late0", "late1", "late2"])
    build_index(store_path=sp, ledger_path=lp, params=None)  # an `add` event brings them in
    newest = _events(lp)[-1]
    newest.unlink()  # that add event is lost: without care, the three would come back with a fresh B
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["store_rows_added_retired"] == 3
    led = BudgetLedger.open(lp)
    spent = dict(zip(led.state.record_id, led.state.spent))
    assert all(spent[f"late{i}"] == led.params.budget for i in range(3))


def test_a_damaged_snapshot_is_refused_with_a_clear_message(world, tmp_path):
    sp, lp = world
    snap = sorted(lp.glob("snapshot-*.parquet"))[-1]
    snap.write_bytes(snap.read_bytes()[:100])
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode in (1, 2) and "snapshot" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.heavy
def test_damaged_ledger_with_a_pending_erasure_then_repair(world):
    """The erasure goes through while the ledger is damaged; repair retires everyone; the next delete writes
    the pending tombstone with the record's spent (= B), never less than it had."""
    sp, lp = world
    before = _spent_by_id(lp)
    ev = _events(lp)
    ev[-1].write_bytes(b"not parquet")
    gone = _cli("delete", "--record", "r5", "--store", str(sp), "--ledger", str(lp))
    assert gone.returncode == 0 and json.loads(gone.stdout)["tombstones_pending"] == 1
    assert _cli("repair", "--store", str(sp), "--ledger", str(lp)).returncode == 0
    done = _cli("delete", "--record", "r6", "--store", str(sp), "--ledger", str(lp))
    assert done.returncode == 0, done.stderr
    led = BudgetLedger.open(lp)
    i = list(led.state.record_id).index("r5")
    assert led.state.deleted[i] and led.state.spent[i] == led.params.budget >= before["r5"]


def _edit_event(path):
    """Rewrite one event file with one answer's released count changed and its metadata (seq, links) kept: the
    file still opens and still links to its predecessor, only its own bytes differ."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    i = pc.index(t.column("kind"), "answer").as_py()
    assert i >= 0
    counts = t.column("released_count").to_pylist()
    counts[i] = counts[i] + 1000.0
    j = t.schema.get_field_index("released_count")
    t = t.set_column(j, t.schema.field(j), pa.array(counts, t.schema.field(j).type))
    pq.write_table(t, path)


@pytest.mark.heavy
def test_an_edited_middle_event_is_quarantined_not_kept(world):
    """Audit 3, C6: the bisection keeps the longest prefix that opens, and opening checks each event's link to
    the one before, so an edited event opens as the last of a prefix. The next event's link says it was edited:
    repair must quarantine it too (before the fix only the events after it were)."""
    sp, lp = world
    ev = _events(lp)
    _edit_event(ev[3])
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["repaired"] and r["quarantined"] == [p.name for p in ev[3:]], r["quarantined"]
    assert ev[3].name not in {p.name for p in _events(lp)}
    assert verify_ledger(lp, store_path=sp)["verified"]
    assert all(v == BudgetLedger.open(lp).params.budget for v in _spent_by_id(lp).values())
    assert _serve(sp, lp, "q2").returncode == 0


@pytest.mark.heavy
def test_an_edited_last_event_is_quarantined_by_the_high_water_mark(world):
    """Audit 3, C6, the last event: no later event links to it, but the store's high-water mark names its
    sha256. Repair must quarantine it, not keep it in the chain (before the fix: quarantined [])."""
    sp, lp = world
    ev = _events(lp)
    _edit_event(ev[-1])
    assert _serve(sp, lp, "q2").returncode == 1  # refused: the mark saw other bytes committed
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["repaired"] and r["quarantined"] == [ev[-1].name], r["quarantined"]
    assert verify_ledger(lp, store_path=sp)["verified"]
    assert _serve(sp, lp, "q2").returncode == 0


def test_an_edited_link_in_the_last_event_does_not_cost_the_event_before_it(world):
    """Review 10: the last event's own prev_sha256 overwritten. The store's mark shows that file edited, so its
    link vouches for nothing and the intact event before it stays (before: both were quarantined)."""
    import pyarrow.parquet as pq

    sp, lp = world
    ev = _events(lp)
    t = pq.read_table(ev[-1])
    info = json.loads(t.schema.metadata[b"indknn_event"])
    info["prev_sha256"] = "0" * 64
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"indknn_event": json.dumps(info).encode()}),
                   ev[-1])
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["quarantined"] == [ev[-1].name]
    assert r["events_kept_through"] == int(ev[-2].name.split("-")[0])  # the last kept event, not the repair's own
    assert verify_ledger(lp, store_path=sp)["verified"]
