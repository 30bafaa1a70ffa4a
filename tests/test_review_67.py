"""Review 67 (2026-11-29, a helper as attacker of the ledger with file access, `/work/review67`): a crash or a full
store volume between an event's commit and the store's mark, then the cron's re-run, left released answers in an
event the mark never pinned; a ledger backup one event older then passed every check and refunded those charges."""

from __future__ import annotations

import errno
import json
import shutil

import numpy as np
from typer.testing import CliRunner

from indknn_cli import fsio, ledger_mark
from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.ledger_chain import head_seq

from .test_review_54 import D, pair  # noqa: F401 (the fixture)

runner = CliRunner()


def _serve(sp, lp, *args):
    return runner.invoke(app, ["serve-queries", "--store", str(sp), "--ledger", str(lp), "--seed", "1", *args])


def test_a_rerun_after_a_mark_write_failed_pins_the_event_before_releasing_it(pair, monkeypatch):
    """F4: `serve-queries --batch-id b2` committed its event and failed writing `ledger-mark.json` (ENOSPC on the
    store's volume; a kill -9 at that point is the same). The re-run released the event's answers through the
    "already answered" path without moving the mark, and the ledger's backup taken before b2 was then accepted."""
    sp, lp = pair
    rng = np.random.default_rng(67)
    q1, q2 = sp.parent / "q1.npy", sp.parent / "q2.npy"
    np.save(q1, rng.standard_normal((6, D)).astype(np.float32))
    np.save(q2, rng.standard_normal((8, D)).astype(np.float32))
    assert _serve(sp, lp, str(q1), "--batch-id", "b1").exit_code == 0
    backup = sp.parent / "L.nightly"
    shutil.copytree(lp, backup)
    real = ledger_mark.atomic_write_text

    def enospc(text, path):
        if str(path).endswith(ledger_mark.MARK_NAME):
            raise fsio.storage_error(path, OSError(errno.ENOSPC, "No space left on device"))
        return real(text, path)

    monkeypatch.setattr(ledger_mark, "atomic_write_text", enospc)
    res = _serve(sp, lp, str(q2), "--batch-id", "b2")
    assert res.exit_code == 1 and res.stdout == ""  # committed, nothing released
    assert "nothing of it was released" in " ".join(res.stderr.split())
    monkeypatch.setattr(ledger_mark, "atomic_write_text", real)
    mark = json.loads((sp / ledger_mark.MARK_NAME).read_text())
    ledger = BudgetLedger.open(lp)
    assert mark["seq"] == head_seq(ledger) - 1  # one event behind, as the commit protocol allows

    res = _serve(sp, lp, "--batch-id", "b2")  # the cron's re-run: b2's answers leave the process now
    assert res.exit_code == 0, res.stderr
    assert len(res.stdout.splitlines()) == 8
    mark = json.loads((sp / ledger_mark.MARK_NAME).read_text())
    assert mark["seq"] == head_seq(BudgetLedger.open(lp))  # pinned before they were released

    shutil.rmtree(lp)
    shutil.copytree(backup, lp)  # last night's ledger, one event older
    res = _serve(sp, lp, "--batch-id", "b2")
    assert res.exit_code == 1
    assert "rolled back" in " ".join(res.stderr.split())
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert res.exit_code != 0


def test_an_erasure_blanks_again_the_rows_erased_earlier_in_a_chunk_restored_from_a_backup(pair):
    """F2: the advice for a corrupt chunk is to restore its file from a backup; a backup older than an erasure
    brought the erased rows' vectors back, the next erasure overwrote only its own rows, and `account --verify`
    passed. Now `--verify` names such rows and every erasure blanks all rows flagged erased in the chunks it
    rewrites."""
    from indknn_cli.store import FeatureStore

    sp, lp = pair
    chunk = sp / "private" / "features" / "c" / "0" / "0"  # rows 0-15
    backup = chunk.read_bytes()
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"]).exit_code == 0
    assert not FeatureStore.open(sp, mode="r").read("private", "features")[3].any()
    chunk.write_bytes(backup)  # restored from the backup of the night before
    assert FeatureStore.open(sp, mode="r").read("private", "features")[3].any()
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert res.exit_code != 0
    assert "private rows the store has erased hold data again (1 row;" in " ".join((res.stdout + res.stderr).split())
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r005"])
    assert res.exit_code == 0, res.stderr
    features = FeatureStore.open(sp, mode="r").read("private", "features")
    assert not features[3].any() and not features[5].any() and features[4].any()
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert res.exit_code == 0, res.stdout + res.stderr
