"""Review 68 (2026-11-29, a helper as privacy auditor of this session's diff, `/work/review68`): an erased row whose
chunks (its flags among them) were restored from an older backup came back unflagged, passed `--verify` and was
brought into the ledger and selected again; `--verify` read erased rows whole and raised an internal error on a
corrupt chunk."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore

from .test_review_54 import _flip, pair  # noqa: F401 (the fixture)

runner = CliRunner()


def _chunks(sp, first_row_chunk="0"):
    """Every private array's chunk files holding rows 0-15 (the fixture's chunks are 16 rows)."""
    out = []
    for arr in (sp / "private").iterdir():
        if arr.is_dir() and (arr / "c").is_dir():
            out += [p for p in (arr / "c").rglob("*") if p.is_file() and p.relative_to(arr / "c").parts[0] == "0"]
    return out


def test_an_erased_row_restored_with_its_flags_is_never_brought_back_into_the_ledger(pair):
    """F2: with every chunk of rows 0-15 (flags included) restored from a backup older than the erasure of r003,
    the row was unflagged again: `serve-queries` brought r003 back into the ledger at its old spent and selected it.
    It stays out of the ledger now; `--verify` names it; `delete --record r003` erases it again."""
    sp, lp = pair
    backup = {p: p.read_bytes() for p in _chunks(sp)}
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"]).exit_code == 0
    for p in _chunks(sp):  # the backup as it was: chunks written since (all-False flags had none) go
        if p not in backup:
            p.unlink()
    for p, b in backup.items():
        p.write_bytes(b)
    r003_restored_stays_out(sp, lp)


def r003_restored_stays_out(sp, lp, queries: int = 4) -> None:
    """r003 (erased, its row 3 restored unflagged from a backup) is never brought back nor selected by a serve of
    queries on its vector; `--verify` names the row; `delete --record r003` erases it again and `--verify` passes."""
    st = FeatureStore.open(sp, mode="r")
    assert not st.read("private", "deleted")[3] and str(st.read("private", "record_id")[3]) == "r003"
    q = sp.parent / "q.npy"
    np.save(q, np.tile(st.read("private", "features")[3], (queries, 1)))  # queries right on r003's vector
    res = runner.invoke(app, ["serve-queries", "--store", str(sp), "--ledger", str(lp), str(q), "--seed", "1"])
    assert res.exit_code == 0, res.stderr
    state = BudgetLedger.open(lp).state
    mine = [i for i, r in enumerate(state.record_id) if str(r) == "r003"]
    assert mine and all(state.deleted[i] for i in mine)  # only its tombstone: never brought back
    assert sum(int(state.times_selected[i]) for i in mine) == 0
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert res.exit_code != 0
    assert "hold data again (1 row;" in " ".join((res.stdout + res.stderr).split())
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"])
    assert res.exit_code == 0, res.stderr
    st = FeatureStore.open(sp, mode="r")
    assert st.read("private", "deleted")[3] and not st.read("private", "features")[3].any()
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert res.exit_code == 0, res.stdout + res.stderr


def test_verify_names_a_corrupt_chunk_holding_an_erased_row_as_a_corrupt_chunk(pair):
    """F5: the erased-rows check read the arrays directly: a corrupt features chunk was "Internal error: ValueError"."""
    sp, lp = pair
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"]).exit_code == 0
    _flip(sp / "private" / "features" / "c" / "0" / "0")
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify", "--json"])
    assert res.exit_code != 0
    text = " ".join((res.stdout + res.stderr).split())
    assert "Internal error" not in text and "corrupt" in text


def test_verify_checks_the_content_key_of_erased_rows(pair):
    """F3: a restored content_key chunk (a keyed hash of the erased record's input) passed `--verify`."""
    sp, lp = pair
    keys = sp / "private" / "content_key"
    if not keys.is_dir():  # stores made before keys were recorded have none to check
        return
    backup = {p: p.read_bytes() for p in (keys / "c").rglob("*") if p.is_file()}
    st = FeatureStore.open(sp, mode="r")
    if not str(st.group("private")["content_key"][3]):
        return
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"]).exit_code == 0
    for p, b in backup.items():
        p.write_bytes(b)
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify", "--json"])
    assert res.exit_code != 0
    assert "hold data again" in json.dumps(res.stdout) + res.stderr


def test_an_index_rebuilt_in_place_keeps_its_own_erased_rows_out(pair, monkeypatch):
    """F4: the in-place rebuild (review 62, F4) read only the store's flags; with the flags chunk restored from an
    older backup it encoded an erased row again, where the old index held the sentinel."""
    import errno

    import zarr

    from indknn_cli import indexes
    from indknn_cli.indexes import storage

    sp, lp = pair
    indexes.build(FeatureStore.open(sp, mode="a"), kind="lsh", tables=4, bits=3, seed=7)
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"]).exit_code == 0
    flags = zarr.open_group(str(sp / "private"), mode="r+")["deleted"]
    flags[3] = False  # as a flags chunk restored from before the erasure

    def enospc(store, rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "_overwrite", enospc)
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r005"]).exit_code == 0
    group = zarr.open_group(str(sp / "index"), mode="r")
    assert bool(group["erased"][3]) and not np.asarray(group["codes"][3]).any()
    assert bool(group["erased"][5]) and not np.asarray(group["codes"][5]).any()
