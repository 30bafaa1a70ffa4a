"""Repair keeps the released answers of the events it quarantines (audit 9, F3): queries answered (the public
--max-queries gate) does not go down by what could still be read, and a re-run batch never answers a released
query again with fresh noise."""

from __future__ import annotations

import json

import pytest

from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import public_allowance

from .test_ledger_integrity import _cli, _events, _serve, world  # noqa: F401 (world: the shared fixture)


def _answers(lp):
    t = BudgetLedger.open(lp).state.answers_table_for("q1").to_pydict()
    return {q: (lab, c) for q, lab, c in zip(t["query_index"], t["label"], t["released_count"])}


@pytest.mark.heavy
def test_repair_keeps_readable_answers_and_never_answers_a_released_query_again(world):
    sp, lp = world  # q1: 40 queries in 5 serve events of 8 (seq 2..6; the add is in the snapshot)
    released = _answers(lp)
    assert sorted(released) == list(range(40))
    ev = _events(lp)
    ev[2].write_bytes(ev[2].read_bytes()[:200])  # the third serve event (queries 16–23) cannot be read
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["answers_recovered"] == 16 and r["unreadable_events"] == [ev[2].name]
    err = " ".join(res.stderr.split())
    assert "16 released answers" in err and ev[2].name in err and "--max-queries" in err
    kept = _answers(lp)
    assert sorted(kept) == list(range(16)) + list(range(24, 40))
    assert all(kept[q] == released[q] for q in kept)  # the same answers, not re-drawn
    assert public_allowance(ledger_path=lp).answered == 40  # 32 held + 8 not recovered (16 before this fix)
    again = _serve(sp, lp, "q1")  # a re-run returns what is recorded and answers nothing again
    assert again.returncode == 0, again.stderr
    lines = [json.loads(x) for x in again.stdout.splitlines()]
    assert sorted(a["query_index"] for a in lines) == sorted(kept)
    assert _answers(lp) == kept and public_allowance(ledger_path=lp).answered == 40
    # audit 3, S4: the query-sender is told why 8 of 40 have no line (a figure of the damage, not of the data)
    assert "8 queries before its last recorded answer have no answer" in " ".join(again.stderr.split())


@pytest.mark.heavy
def test_recovered_answers_are_checked_and_counted_once(world):
    """Review 9: a stray copy of a quarantined event is not written twice; an answer row that does not fit the
    store (a label outside the class list) is left out, and serving with reuse goes on."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    sp, lp = world
    released = _answers(lp)
    ev = _events(lp)  # serve events of queries 0–7, 8–15, 16–23, 24–31, 32–39
    shutil.copy(ev[3], lp / "events" / "00000099-serve-q1.parquet")  # a file manager's copy, after the others
    t = pq.read_table(ev[4])
    labels = t.column("label").to_pylist()
    first = t.column("kind").to_pylist().index("answer")
    labels[first] = 7  # 3 classes: no such label (the row for query 32)
    pq.write_table(t.set_column(t.schema.get_field_index("label"), "label", pa.array(labels, pa.int32())), ev[4])
    ev[1].write_bytes(ev[1].read_bytes()[:200])  # queries 8–15 cannot be read
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["answers_recovered"] == 23 and r["answers_left_out"] == 9  # 8 repeated + 1 that does not fit
    kept = _answers(lp)
    assert sorted(kept) == list(range(8)) + [q for q in range(16, 40) if q != 32]
    assert all(kept[q] == released[q] for q in kept)
    served = _serve(sp, lp, "q2")  # reuse reads the recovered answers: no internal error
    assert served.returncode == 0, served.stderr
    assert len(served.stdout.splitlines()) == 40


@pytest.mark.heavy
def test_a_batch_resumed_after_a_gap_counts_only_its_new_answers(world):
    sp, lp = world
    ev = _events(lp)
    ev[4].unlink()  # the last serve event (32–39) is lost without a trace
    ev[1].write_bytes(ev[1].read_bytes()[:200])  # and 8–15 cannot be read
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["answers_recovered"] == 16  # 16–31
    again = _serve(sp, lp, "q1")
    assert again.returncode == 0, again.stderr
    assert sorted(json.loads(x)["query_index"] for x in again.stdout.splitlines()) == \
        list(range(8)) + list(range(16, 40))  # the gap 8–15 is never answered again
    assert "answered 8 queries" in " ".join(again.stderr.split())  # not 16 (40 − the 24 recorded)
    assert "8 queries before its last recorded answer have no answer" in " ".join(again.stderr.split())
    first = _serve(sp, lp, "q2")  # an undamaged batch says nothing of the kind
    assert first.returncode == 0 and "have no answer" not in first.stderr


@pytest.mark.heavy
def test_repair_names_the_answers_a_rolled_back_copy_no_longer_counts(world, tmp_path):
    """Review 9, item 2: a restored older copy has no quarantined files; the store's high-water mark counted the
    answers released since, and repair says how many are no longer counted."""
    import shutil

    from indknn_cli.serving import serve_queries

    sp, lp = world
    backup = tmp_path / "backup"
    shutil.copytree(lp, backup)
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", batch_size=8, seed=2)  # 40 more released
    shutil.rmtree(lp)
    shutil.copytree(backup, lp)
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["answers_not_recovered"] == 40
    err = " ".join(res.stderr.split())
    assert "counted 40 more answers than the repaired ledger holds" in err and "new --batch-id" in err
    assert public_allowance(ledger_path=lp).answered == 80  # 40 held + 40 not recovered: never goes down
    compacted = _cli("delete", "--store", str(sp), "--ledger", str(lp), "--compact")  # through a snapshot too
    assert compacted.returncode == 0, compacted.stderr
    assert public_allowance(ledger_path=lp).answered == 80
    again = _cli("repair", "--store", str(sp), "--ledger", str(lp))  # nothing to repair: counted once
    assert again.returncode == 0 and json.loads(again.stdout)["repaired"] is False
    assert public_allowance(ledger_path=lp).answered == 80


def test_repair_counts_the_answers_of_an_unreadable_event_as_not_counted(world):
    sp, lp = world
    ev = _events(lp)
    ev[2].write_bytes(ev[2].read_bytes()[:200])  # queries 16–23; 24–39 are recovered
    res = _cli("repair", "--store", str(sp), "--ledger", str(lp))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["answers_recovered"] == 16 and r["answers_not_recovered"] == 8
    assert public_allowance(ledger_path=lp).answered == 40  # 32 held + 8 not recovered
