"""Audit 4, F2: a generated record id is never handed out twice, compaction or not.

``embed`` numbers the rows of an id-less input ``private-NNNNNNNN``. It used to number them by the rows the group
holds now, so after ``delete --compact`` (which removes rows) a new person got the erased person's id; ``index``
then took the new row for the returning id, revived its tombstone and made the new person start fully spent, and
``account --record``, ``--export`` and a later erasure by that id pointed at the wrong person."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore

from .conftest import clustered


def _cli(*args):
    res = subprocess.run([sys.executable, "-m", "indknn_cli", *map(str, args)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, (args, res.stderr)
    return res


@pytest.mark.heavy
def test_an_erased_generated_id_is_not_given_to_a_new_record_after_compaction(tmp_path):
    x, y, _ = clustered(53, 16, 3, seed=3)
    np.savez(tmp_path / "a.npz", x=x[:50].astype(np.float32), y=y[:50].astype(np.int64))  # no ids
    np.savez(tmp_path / "b.npz", x=x[50:].astype(np.float32), y=y[50:].astype(np.int64))
    st, led = tmp_path / "s.zarr", tmp_path / "L"
    _cli("embed", tmp_path / "a.npz", "--store", st, "--role", "private", "--extractor", "vectors",
         "--label-names", "0,1,2")
    _cli("index", "--store", st, "--ledger", led, "--eps", "1", "--tau", "0.3")
    _cli("delete", "--store", st, "--ledger", led, "--record", "private-00000049", "--compact")
    _cli("delete", "--store", st, "--ledger", led, "--record", "private-00000010", "--compact")
    _cli("embed", tmp_path / "b.npz", "--store", st, "--role", "private")
    _cli("index", "--store", st, "--ledger", led)
    ids = list(FeatureStore.open(st, mode="r").record_ids("private"))
    new = ids[-3:]
    assert new == ["private-00000050", "private-00000051", "private-00000052"], new
    assert len(set(ids)) == len(ids) == 51
    s = BudgetLedger.open(led).state
    by_id = dict(zip(s.record_id, zip(s.deleted, s.spent)))
    assert by_id["private-00000049"][0] and by_id["private-00000010"][0]  # the tombstones stay tombstones
    assert all(by_id[r] == (False, 0.0) for r in new)  # the new people start afresh
    out = json.loads(_cli("account", "--ledger", led, "--record", "private-00000049", "--json").stdout)
    assert "deleted" in json.dumps(out)
