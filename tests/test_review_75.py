"""Review 75 (2026-11-29, a helper as privacy auditor of review 74's fixes, `/work/review75`): repair read the
quarantined events' erasures only for ids the kept ledger no longer knew; with a readable delete event quarantined and
the store's private rows restored from an older copy, the erased record stayed live and its vector in the store."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore

from .test_review_74 import cli, world


def damage(ev) -> None:
    """An event file edited (its time moved by 1 ms): its hash chain breaks there, the file stays readable."""
    t = pq.read_table(ev)
    meta = dict(t.schema.metadata)
    info = json.loads(meta[b"indknn_event"])
    info["time"] = info.get("time", 0) + 1e-3
    meta[b"indknn_event"] = json.dumps(info).encode()
    pq.write_table(t.replace_schema_metadata(meta), ev)


@pytest.mark.parametrize("log", ["restored", "kept"])
def test_f4_an_erasure_in_a_quarantined_event_is_carried_by_repair(tmp_path, log):
    sp, lp = world(tmp_path)
    q = tmp_path / "q.npy"
    np.save(q, FeatureStore.open(sp).read("private", "features")[:2])
    assert cli("serve-queries", q, "--store", sp, "--ledger", lp, "--device", "cpu").exit_code == 0
    shutil.copytree(sp, tmp_path / "b.zarr")  # a copy of the store with r005 live
    assert cli("delete", "--store", sp, "--ledger", lp, "--record", "r005").exit_code == 0
    damage(sorted((lp / "events").glob("*.parquet"))[-1])  # the delete event edited, still readable
    shutil.rmtree(sp / "private")  # the store's private rows restored from the copy
    shutil.copytree(tmp_path / "b.zarr" / "private", sp / "private")
    if log == "restored":  # the copy had no erased-ids log
        (sp / "erased-ids.jsonl").unlink(missing_ok=True)
    r = cli("repair", "--store", sp, "--ledger", lp)
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(sp)
    assert str(st.read("private", "record_id")[5]) == "" and not st.read("private", "features")[5].any()
    led = BudgetLedger.open(lp)
    assert bool(led.state.deleted[list(led.state.record_id).index("r005")])
    v = cli("account", "--store", sp, "--ledger", lp, "--verify")
    assert v.exit_code == 0, v.output
