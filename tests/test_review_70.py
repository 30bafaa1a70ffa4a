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


@pytest.mark.heavy
def test_f4_dry_run_and_account_read_a_deferred_erasure_as_erased(s3, tmp_path, monkeypatch):
    """Review 70, F4: with an erasure deferred under another machine's lease, `delete --dry-run` of the same id listed
    it as to be erased again and counted no pending row, and `account` counted its row as a new record not yet in
    the ledger."""
    import json

    url = _world(tmp_path, s3, monkeypatch)
    led = tmp_path / "L"
    _plant_foreign_lease(url)
    r = runner.invoke(app, ["delete", "--record", X, "--store", url, "--ledger", str(led), "--lock-timeout", "0.5"])
    assert r.exit_code == 1, r.output
    d = runner.invoke(app, ["delete", "--record", X, "--store", url, "--ledger", str(led), "--dry-run"])
    assert d.exit_code == 0, d.output
    out = json.loads(d.stdout)
    assert out["records_to_erase"] == 0 and X in out["already_deleted"], out
    assert out["pending_completed"] == 1, out
    a = runner.invoke(app, ["account", "--ledger", str(led), "--store", url, "--json"])
    assert a.exit_code == 0, a.output
    store = json.loads(a.stdout)["store"]
    assert store["rows_not_in_ledger"] == 0 and store["rows_erasure_deferred"] == 1, store


def test_f4_pending_in_takes_the_locked_path_when_the_ledger_cannot_be_read_for_a_passing_reason(tmp_path,
                                                                                                   monkeypatch):
    """Review 70, F4: a transient read error (a ledger mid-commit, a network error) made `pending_in` say "nothing
    waits", so an empty --ids-file exited "nothing to do" without looking under the lock; a damaged or absent ledger
    still says nothing waits (there is nothing it could finish)."""
    import numpy as np

    from indknn_cli import deletion_deferred
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.errors import LedgerError
    from indknn_cli.store import FeatureStore, normalize_rows

    from .conftest import clustered

    x, y, _ = clustered(20, 8, 2, seed=1)
    np.savez(tmp_path / "p.npz", x=normalize_rows(x), y=y, ids=np.array([f"r{i}" for i in range(20)]))
    embed_into_store(tmp_path / "p.npz", store_path=tmp_path / "s.zarr", extractor="vectors", label_names=["0", "1"])
    store = FeatureStore.open(tmp_path / "s.zarr", mode="r")
    assert deletion_deferred.pending_in(tmp_path / "no-ledger", store) is False

    def boom(exc):
        def open_for(*a, **k):
            raise exc
        return open_for

    monkeypatch.setattr(BudgetLedger, "open_for", boom(OSError("connection reset")))
    assert deletion_deferred.pending_in(tmp_path / "L", store) is True
    monkeypatch.setattr(BudgetLedger, "open_for", boom(LedgerError("damaged")))
    assert deletion_deferred.pending_in(tmp_path / "L", store) is False
