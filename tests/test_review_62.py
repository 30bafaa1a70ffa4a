"""Review 62 (2026-11-29, a helper as privacy auditor of this session's erasure changes): a removal of the candidate
index that failed half way reported the erasure done; an index of another numbering kept the erased rows' codes; an
earlier erasure stuck on a write error blocked every new request."""

from __future__ import annotations

import errno

import numpy as np
import pytest
import zarr
from typer.testing import CliRunner

from indknn_cli import indexes
from indknn_cli.cli.app import app
from indknn_cli.errors import StorageError
from indknn_cli.indexes import storage
from indknn_cli.store import FeatureStore

from .test_review_54 import pair  # noqa: F401 (the fixture)

runner = CliRunner()


def _lsh(sp):
    indexes.build(FeatureStore.open(sp, mode="a"), kind="lsh", tables=4, bits=3, seed=7)
    return np.asarray(zarr.open_group(str(sp / "index"), mode="r")["codes"][3])


@pytest.mark.heavy
def test_a_removal_that_fails_half_way_keeps_the_erasure_pending_and_the_next_command_finishes_it(pair, monkeypatch):
    """F1: the index could not be updated (ENOSPC), so the erasure removed it; its removal failed part way (EIO,
    swallowed by rmtree), `.index-old-*` kept the erased row's codes, and `delete` exited 0."""
    sp, lp = pair
    assert _lsh(sp).any()

    def enospc(store, rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "_overwrite", enospc)
    real = storage.shutil.rmtree
    monkeypatch.setattr(storage.shutil, "rmtree", lambda p, ignore_errors=False: None)  # EIO, swallowed
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"])
    assert res.exit_code == 1, res.stderr
    assert "cannot be removed" in " ".join(res.stderr.split())
    st = FeatureStore.open(sp, mode="r")
    assert 3 in st.erase_pending_rows("private").tolist()  # never selected; tried again
    assert str(st.read("private", "record_id")[3]) == ""  # the row itself is overwritten
    monkeypatch.setattr(storage.shutil, "rmtree", real)
    q = sp.parent / "q.npy"
    np.save(q, np.eye(4, dtype=np.float32))
    res = runner.invoke(app, ["serve-queries", "--store", str(sp), "--ledger", str(lp), str(q), "--seed", "1"])
    assert res.exit_code == 0, res.stderr  # it finishes the erasure first
    assert not list(sp.glob(".index-*")) and not (sp / "index").exists()
    assert not FeatureStore.open(sp, mode="r").erase_pending_rows("private").size


def test_an_index_of_another_numbering_is_removed_by_an_erasure_not_skipped(pair):
    """F2: an index whose store_uuid is not the store's (a compaction stopped before renumbering it) was skipped as
    "nothing to do": the erased row's codes stayed."""
    sp, lp = pair
    _lsh(sp)
    zarr.open_group(str(sp / "index"), mode="r+").attrs.update({"store_uuid": "0" * 32})
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"])
    assert res.exit_code == 0, res.stderr
    assert not (sp / "index").exists() and not list(sp.glob(".index-*"))


@pytest.mark.heavy
def test_an_earlier_erasure_stuck_on_a_write_error_never_blocks_a_new_one(pair, monkeypatch):
    """F3: finishing an earlier erasure failed with a write error (EIO on one chunk, lasting): every new request
    exited 1 "nothing of this request was written", never recorded, its vectors intact."""
    sp, lp = pair
    real = FeatureStore.erase_rows

    def failing(self, role, rows):
        if 5 in np.asarray(rows).tolist():  # the chunk holding row 5 cannot be written, persistently
            raise StorageError(f"{self.path}/private/features/c/0: cannot write (Input/output error)")
        return real(self, role, rows)

    monkeypatch.setattr(FeatureStore, "erase_rows", failing)
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r005"])
    assert res.exit_code == 1
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r150"])
    assert res.exit_code == 1 and "This request's erasure went on" in " ".join(res.stderr.split()), res.stderr
    st = FeatureStore.open(sp, mode="r")
    assert float(np.abs(st.group("private")["features"][150]).sum()) == 0.0  # erased
    assert st.erase_pending_rows("private").tolist() == [5]  # the stuck one stays pending, never selected
    monkeypatch.setattr(FeatureStore, "erase_rows", real)
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r151"])
    assert res.exit_code == 0, res.stderr  # the storage is back: the earlier one is finished too
    assert not FeatureStore.open(sp, mode="r").erase_pending_rows("private").size
