"""Review 72 (2026-11-29, a helper as auditor of ledger integrity and erasure, `/work/review72`): an erased row
restored from a backup with its chunks came back into the ledger and was selected again when the store's erased-ids
log was lost too (removed, emptied, or restored from the same backup): that unsealed file was the only thing that
told a restored row from a new one. The ledger now keeps the store rows its erasures overwrote (``erased_rows``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore

from .test_review_54 import pair  # noqa: F401 (the fixture)
from .test_object_store import s3  # noqa: F401 (the moto server fixture)
from .test_review_68 import _chunks, r003_restored_stays_out

runner = CliRunner()


def _restore(sp, backup, log: str) -> None:
    for p in _chunks(sp):  # the backup as it was: chunks written since (all-False flags had none) go
        if p not in backup:
            p.unlink()
    for p, b in backup.items():
        p.write_bytes(b)
    if log == "removed":
        (sp / "erased-ids.jsonl").unlink()
    else:
        (sp / "erased-ids.jsonl").write_text("")


@pytest.mark.parametrize("log", ["removed", "emptied"])
def test_an_erased_row_restored_with_its_chunks_stays_out_when_the_erased_ids_log_is_lost(pair, log):  # noqa: F811
    sp, lp = pair
    backup = {p: p.read_bytes() for p in _chunks(sp)}
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"]).exit_code == 0
    _restore(sp, backup, log)
    r003_restored_stays_out(sp, lp, queries=10)


def test_the_ledger_keeps_its_erased_rows_across_a_compaction_of_the_ledger_and_a_repair(pair):  # noqa: F811
    """The list is carried by the ledger's snapshot (`delete --compact` compacts the ledger too) and by `repair`;
    a store compaction renumbers the rows and voids it."""
    sp, lp = pair
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"]).exit_code == 0
    led = BudgetLedger.open(lp)
    uuid = FeatureStore.open(sp, mode="r").uuid
    assert led.state.erased_rows == {"store_uuid": uuid, "rows": [3]}
    led.compact()
    assert BudgetLedger.open(lp).state.erased_rows == {"store_uuid": uuid, "rows": [3]}
    res = runner.invoke(app, ["repair", "--store", str(sp), "--ledger", str(lp)])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert BudgetLedger.open(lp).state.erased_rows["rows"] == [3]
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r005", "--compact"])
    assert res.exit_code == 0, res.stdout + res.stderr
    st = FeatureStore.open(sp, mode="r")
    e = BudgetLedger.open(lp).state.erased_rows
    assert e is None or e["store_uuid"] != st.uuid or not e["rows"]  # the old numbering's rows do not apply
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert res.exit_code == 0, res.stdout + res.stderr


@pytest.mark.heavy
@pytest.mark.parametrize("loss", ["event-removed", "ledger-from-backup"])
def test_f2_a_deferred_erasure_survives_the_loss_of_its_ledger_event_and_a_repair(s3, tmp_path, monkeypatch, loss):
    """F2: an erasure recorded while another machine held the store's writer lease lived only in the ledger's event;
    with that event lost (removed, or the ledger restored from an older copy) `repair` exited 0, the record stayed
    live (retired at B) and its row was never overwritten. The store's mark keeps a copy that repair reads."""
    import shutil

    from indknn_cli import store_lease
    from indknn_cli.store import open_store

    from .test_review_67_lease import X, _plant_foreign_lease, _row_of_x, _world

    url = _world(tmp_path, s3, monkeypatch)
    led = tmp_path / "L"
    row = _row_of_x(url)
    r = runner.invoke(app, ["serve-queries", "--batch-id", "day1", "--store", url, "--ledger", str(led)])
    assert r.exit_code == 0, r.output
    shutil.copytree(led, tmp_path / "L.bak")
    _plant_foreign_lease(url)
    r = runner.invoke(app, ["delete", "--record", X, "--store", url, "--ledger", str(led), "--lock-timeout", "0.5"])
    assert r.exit_code == 1, r.output
    if loss == "event-removed":
        sorted((led / "events").glob("*.parquet"))[-1].unlink()
    else:
        shutil.rmtree(led)
        shutil.copytree(tmp_path / "L.bak", led)
    r = runner.invoke(app, ["repair", "--ledger", str(led), "--store", url, "--lock-timeout", "0.5"])
    assert r.exit_code == 0, r.output
    st = BudgetLedger.open(led).state
    assert bool(st.deleted[list(st.record_id).index(X)])  # tombstoned again, from the mark's copy
    assert store_lease.break_lease(url, token="deadbeef")
    (tmp_path / "none.txt").write_text("")
    r = runner.invoke(app, ["delete", "--ids-file", str(tmp_path / "none.txt"), "--store", url, "--ledger", str(led)])
    assert r.exit_code == 0, r.output
    assert open_store(url).read("private", "record_id")[row] == ""  # the accepted erasure carried out
    r = runner.invoke(app, ["account", "--ledger", str(led), "--store", url, "--verify"])
    assert r.exit_code == 0, r.output
