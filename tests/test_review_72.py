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
