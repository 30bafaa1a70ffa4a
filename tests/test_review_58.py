"""Review 58's left items (2026-11-29): a candidate index that cannot be updated no longer holds an erasure (and
everything after it) pending; an earlier erasure stuck on a corrupt chunk no longer blocks a new one when the ledger
cannot be read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import zarr
from typer.testing import CliRunner

from indknn_cli import indexes
from indknn_cli.cli.app import app
from indknn_cli.store import FeatureStore

from .test_review_54 import _flip, _indknn, pair  # noqa: F401 (the fixture)

runner = CliRunner()


def _lsh(sp):
    indexes.build(FeatureStore.open(sp, mode="a"), kind="lsh", tables=4, bits=3, seed=7)
    codes = sorted(p for p in (sp / "index" / "codes" / "c").rglob("*") if p.is_file())
    assert codes
    return codes


@pytest.mark.heavy
def test_an_index_that_cannot_be_updated_is_rebuilt_by_the_erasure_not_left_blocking(pair):
    """F3: a corrupt LSH codes chunk ended the erasure "recorded but not finished" (exit 1), its rows pending, and
    every `serve-queries` and `index` (which finish it first) exited 1 until someone removed the index by hand; the
    erased rows' codes stayed on disk. Since review 62, F4 the erasure encodes the index again from its public
    hyperplanes (it removed it before, and serving used the exact scan until `index` ran)."""
    sp, lp = pair
    chunks = _lsh(sp)
    before = np.asarray(zarr.open_group(str(sp / "index"), mode="r")["codes"][:])
    for chunk in chunks:
        _flip(chunk)
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r003")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["records_erased"] == 1
    assert "could not be updated for an erasure" in res.stderr and "encoded again" in res.stderr
    assert not list(sp.glob(".index-*"))
    group = zarr.open_group(str(sp / "index"), mode="r")
    codes, erased = np.asarray(group["codes"][:]), np.asarray(group["erased"][:])
    assert not codes[3].any() and erased.tolist() == [i == 3 for i in range(len(erased))]
    assert np.array_equal(np.delete(codes, 3, axis=0), np.delete(before, 3, axis=0))  # the same public structure
    st = FeatureStore.open(sp, mode="r")
    assert not st.erase_pending_rows("private").size and str(st.read("private", "record_id")[3]) == ""
    qs = sp.parent / "q.npy"  # serving goes on through the index
    np.save(qs, np.eye(4, dtype=np.float32))
    res = _indknn("serve-queries", "--store", sp, "--ledger", lp, qs, "--seed", "1")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 4
    assert indexes.read_meta(sp)["kind"] == "lsh"


def test_an_index_without_its_metadata_is_removed_by_an_erasure(pair):
    """F3 (the same path): an index folder whose zarr.json was lost was skipped as "no index", so the erased rows'
    LSH codes stayed on disk."""
    sp, lp = pair
    _lsh(sp)
    (sp / "index" / "zarr.json").unlink()
    res = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"])
    assert res.exit_code == 0, res.stderr
    assert not (sp / "index").exists()


@pytest.mark.heavy
def test_an_earlier_stuck_erasure_never_blocks_a_new_one_when_the_ledger_cannot_be_read(pair):
    """F2: with the ledger unreadable, an earlier erasure stuck on a corrupt flags chunk made every new request exit
    2 with its own row (in a healthy chunk) recorded pending but never overwritten."""
    sp, lp = pair
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r001"]).exit_code == 0
    _flip(sp / "private" / "deleted" / "c" / "0")  # flags of rows 0–63
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r005")
    assert res.returncode == 1 and "recorded but not finished" in res.stderr, res.stderr
    shutil.move(lp / "CURRENT", lp.parent / "CURRENT.aside")  # the ledger cannot be read now
    res = _indknn("delete", "--store", sp, "--ledger", lp, "--record", "r150")
    assert res.returncode == 1, res.stderr
    assert "This request's erasure went on" in res.stderr and "recorded but not finished" in res.stderr
    assert "Traceback" not in res.stderr
    st = FeatureStore.open(sp, mode="r")
    assert str(np.asarray(st.group("private")["record_id"][150])) == ""  # overwritten
    assert float(np.abs(st.group("private")["features"][150]).sum()) == 0.0
    assert sorted(st.erase_pending_rows("private").tolist()) == [5, 150]  # both kept for their tombstones
