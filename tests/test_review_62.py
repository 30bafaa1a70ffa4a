"""Review 62 (2026-11-29, a helper as privacy auditor of this session's erasure changes): a removal of the candidate
index that failed half way reported the erasure done; an index of another numbering kept the erased rows' codes; an
earlier erasure stuck on a write error blocked every new request."""

from __future__ import annotations

import errno
import logging

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
    monkeypatch.setattr(storage, "write_index", enospc)  # the rebuild in place (review 62, F4) fails the same way
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


def test_an_index_of_another_numbering_is_rebuilt_by_an_erasure_not_skipped(pair):
    """F2: an index whose store_uuid is not the store's (a compaction stopped before renumbering it) was skipped as
    "nothing to do": the erased row's codes stayed. It is encoded again for this store (F4), row 3 left out."""
    sp, lp = pair
    _lsh(sp)
    zarr.open_group(str(sp / "index"), mode="r+").attrs.update({"store_uuid": "0" * 32})
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"])
    assert res.exit_code == 0, res.stderr
    assert not list(sp.glob(".index-*"))
    group = zarr.open_group(str(sp / "index"), mode="r")
    assert group.attrs["store_uuid"] == FeatureStore.open(sp, mode="r").uuid
    assert bool(group["erased"][3]) and not np.asarray(group["codes"][3]).any()


def _delete_r003_with_overwrite_failing(sp, lp, monkeypatch, caplog):
    def enospc(store, rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "_overwrite", enospc)  # a transient error: the disk has room again for the rebuild
    with caplog.at_level(logging.WARNING, logger="indknn_cli"):
        res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"])
    assert res.exit_code == 0, res.stderr
    assert not list(sp.glob(".index-*"))
    assert not FeatureStore.open(sp, mode="r").erase_pending_rows("private").size
    return " ".join(caplog.text.split())


@pytest.mark.parametrize("kind", ["lsh", "ivf"])
def test_an_index_an_erasure_could_not_update_is_rebuilt_from_its_public_structure_not_removed(
        pair, monkeypatch, caplog, kind):
    """F4: any failure to update the index during an erasure (a transient ENOSPC too) removed it, and serving used
    the exact scan for everyone until `index` ran. The structure is public, so the erasure encodes every row again
    with it; the erased row gets the sentinel, the others what they had."""
    sp, lp = pair
    st = FeatureStore.open(sp, mode="a")
    if kind == "lsh":
        indexes.build(st, kind="lsh", tables=4, bits=3, seed=7)
    else:
        public = np.random.default_rng(9).standard_normal((64, st.dim)).astype(np.float32)
        st.append("public", public / np.linalg.norm(public, axis=1, keepdims=True),
                  record_ids=[f"p{i}" for i in range(64)])
        indexes.build(st, kind="ivf", nlist=4, seed=3)
    name = "codes" if kind == "lsh" else "lists"
    before_meta = indexes.read_meta(sp)
    before = np.asarray(zarr.open_group(str(sp / "index"), mode="r")[name][:])
    text = _delete_r003_with_overwrite_failing(sp, lp, monkeypatch, caplog)
    assert "encoded again from the store with its own public structure" in text
    group = zarr.open_group(str(sp / "index"), mode="r")
    after = np.asarray(group[name][:])
    assert (not after[3].any()) if kind == "lsh" else after[3] == -1
    assert np.array_equal(np.delete(after, 3, axis=0), np.delete(before, 3, axis=0))
    assert np.asarray(group["erased"][:]).tolist() == [i == 3 for i in range(after.shape[0])]
    meta = indexes.read_meta(sp)
    assert {k: meta[k] for k in ("kind", "seed")} == {k: before_meta[k] for k in ("kind", "seed")}


def test_an_index_whose_structure_does_not_match_its_hash_is_removed_not_rebuilt(pair, monkeypatch, caplog):
    """F4's limit: hyperplanes that differ from the hash recorded at build (edited or damaged without a checksum
    error) are not reused to encode the private rows; the index is removed as before."""
    sp, lp = pair
    _lsh(sp)
    group = zarr.open_group(str(sp / "index"), mode="r+")
    group["hyperplanes"][0, 0] = float(group["hyperplanes"][0, 0]) + 1.0
    text = _delete_r003_with_overwrite_failing(sp, lp, monkeypatch, caplog)
    assert "so it was removed with the erased rows' codes" in text
    assert not (sp / "index").exists()


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
