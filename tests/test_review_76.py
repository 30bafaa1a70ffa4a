"""Review 76 (2026-11-29, a helper as privacy auditor of c5ac166, `/work/review76`): repair read a quarantined repair
event's own tombstones (ids it retired) as erasures, and erased every row holding an id a quarantined delete event
erased, a new row of an id embedded again and re-admitted too."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore
from .test_review_74 import append, cli, world
from .test_review_75 import damage


def _serve(tmp_path, sp, lp, a, b):
    q = tmp_path / f"q{a}.npy"
    np.save(q, FeatureStore.open(sp).read("private", "features")[a:b])
    assert cli("serve-queries", q, "--store", sp, "--ledger", lp, "--device", "cpu").exit_code == 0


@pytest.mark.heavy
def test_f1_a_quarantined_repair_events_tombstones_are_not_erasures(tmp_path):
    sp, lp = world(tmp_path)
    shutil.copytree(sp, tmp_path / "b.zarr")
    append(sp, [f"r{i:03d}" for i in range(16, 20)])
    _serve(tmp_path, sp, lp, 0, 2)
    shutil.rmtree(sp)
    shutil.copytree(tmp_path / "b.zarr", sp)  # restored from the shorter copy: r016..r019 retired by repair
    assert cli("repair", "--store", sp, "--ledger", lp).exit_code == 0
    r1 = sorted((lp / "events").glob("*.parquet"))[-1]
    append(sp, [f"r{i:03d}" for i in range(16, 20)])  # embedded again, never erased by anyone
    _serve(tmp_path, sp, lp, 16, 18)
    damage(r1)
    assert cli("repair", "--store", sp, "--ledger", lp).exit_code == 0
    st = FeatureStore.open(sp)
    assert [str(x) for x in st.read("private", "record_id")[16:20]] == [f"r{i:03d}" for i in range(16, 20)]
    assert st.read("private", "features")[16:20].any(axis=1).all()
    s = BudgetLedger.open(lp).state
    assert not s.deleted[list(s.record_id).index("r016")]


def test_f2_a_readmitted_id_is_not_erased_without_the_log(tmp_path):
    sp, lp = world(tmp_path)
    _serve(tmp_path, sp, lp, 0, 2)
    assert cli("delete", "--store", sp, "--ledger", lp, "--record", "r005").exit_code == 0
    dele = sorted((lp / "events").glob("*.parquet"))[-1]
    append(sp, ["r005"])  # row 16
    _serve(tmp_path, sp, lp, 16, 17)
    damage(dele)
    (sp / "erased-ids.jsonl").unlink()
    assert cli("repair", "--store", sp, "--ledger", lp).exit_code == 0
    st = FeatureStore.open(sp)
    assert str(st.read("private", "record_id")[16]) == "r005" and st.read("private", "features")[16].any()
