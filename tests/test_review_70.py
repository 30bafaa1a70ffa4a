"""Review 70 (2026-11-29, a helper as privacy auditor of the erasure deferred under a store writer lease held
elsewhere, `/work/review70`): `repair` forgot such an erasure when it quarantined its event (the record came back
live, its row never overwritten), and with the lease still held it failed after waiting 60 s for it."""
from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import open_store

from .test_object_store import s3  # noqa: F401
from .test_review_67_lease import X, _plant_foreign_lease, _row_of_x, _world

runner = CliRunner()

@pytest.mark.heavy
def test_repair_keeps_an_erasure_deferred_in_a_quarantined_event(s3, tmp_path, monkeypatch):
    from indknn_cli import store_lease
    url = _world(tmp_path, s3, monkeypatch)
    led = tmp_path / "L"
    row = _row_of_x(url)
    s = runner.invoke(app, ["serve-queries", "--batch-id", "day1", "--store", url, "--ledger", str(led)])
    assert s.exit_code == 0, s.output
    before = sorted(p.name for p in (led / "events").iterdir())
    _plant_foreign_lease(url)
    r = runner.invoke(app, ["delete", "--record", X, "--store", url, "--ledger", str(led), "--lock-timeout", "0.5"])
    assert r.exit_code == 1, r.output
    serve_ev = [n for n in before if n.endswith(".parquet")]
    # bit rot in the earlier serve event (not the delete event)
    p = led / "events" / serve_ev[-1]
    b = bytearray(p.read_bytes()); b[len(b) // 2] ^= 0xFF; p.write_bytes(bytes(b))
    assert store_lease.break_lease(url, token="deadbeef")
    rep = runner.invoke(app, ["repair", "--ledger", str(led), "--store", url])
    assert rep.exit_code == 0, rep.output
    st = BudgetLedger.open(led).state
    i = list(st.record_id).index(X)
    (tmp_path / "none.txt").write_text("")
    d = runner.invoke(app, ["delete", "--ids-file", str(tmp_path / "none.txt"), "--store", url, "--ledger", str(led)])
    so = open_store(url)
    assert so.read("private", "record_id")[row] == "", "accepted erasure never carried out after repair"
    assert d.exit_code == 0, d.output
    assert bool(st.deleted[i])  # a tombstone again, never a live (retired) record


@pytest.mark.heavy
def test_repair_with_the_lease_still_held_keeps_the_deferred_erasure_and_does_not_wait(s3, tmp_path, monkeypatch):
    url = _world(tmp_path, s3, monkeypatch)
    led = tmp_path / "L"
    _plant_foreign_lease(url)
    r = runner.invoke(app, ["delete", "--record", X, "--store", url, "--ledger", str(led), "--lock-timeout", "0.5"])
    assert r.exit_code == 1, r.output
    s = runner.invoke(app, ["serve-queries", "--batch-id", "day1", "--store", url, "--ledger", str(led),
                            "--lock-timeout", "0.5"])
    assert s.exit_code == 0, s.output
    ev = sorted((led / "events").glob("*.parquet"))
    p = ev[-1]; b = bytearray(p.read_bytes()); b[len(b) // 2] ^= 0xFF; p.write_bytes(bytes(b))
    t = time.time()
    rep = runner.invoke(app, ["repair", "--ledger", str(led), "--store", url])
    assert rep.exit_code == 0, rep.output
    st = BudgetLedger.open(led).state
    i = list(st.record_id).index(X)
    assert rep.exit_code == 0
    assert bool(st.deleted[i]) and time.time() - t < 30
