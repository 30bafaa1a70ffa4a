"""Repair keeps the released answers of the events it quarantines (audit 9, F3): queries answered (the public
--max-queries gate) does not go down by what could still be read, and a re-run batch never answers a released
query again with fresh noise."""

from __future__ import annotations

import json

from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import public_allowance

from .test_ledger_integrity import _cli, _events, _serve, world  # noqa: F401 (world: the shared fixture)


def _answers(lp):
    t = BudgetLedger.open(lp).state.answers_table_for("q1").to_pydict()
    return {q: (lab, c) for q, lab, c in zip(t["query_index"], t["label"], t["released_count"])}


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
    assert public_allowance(ledger_path=lp).answered == 32  # 16 before this fix
    again = _serve(sp, lp, "q1")  # a re-run returns what is recorded and answers nothing again
    assert again.returncode == 0, again.stderr
    lines = [json.loads(x) for x in again.stdout.splitlines()]
    assert sorted(a["query_index"] for a in lines) == sorted(kept)
    assert _answers(lp) == kept and public_allowance(ledger_path=lp).answered == 32
