"""Findings of today's independent privacy audit, each reproduced and fixed (each test failed before its fix).

F1 an edited snapshot right after a compaction refunded budget unnoticed; F2 two copies of one ledger served
at once forked it (one copy's charges lost); F3 repair dropped the tombstones of records added and erased in
the lost events (a returning id started afresh); F4 repair kept records whose store rows were erased as live,
blocking their user's later erasures and every compaction; F5 (user unit) a tombstoned record id re-added
under another user took its spent away from the first user.
"""

from __future__ import annotations

import glob

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from indknn_cli import deletion, indexes, ledger_repair, serving
from indknn_cli.errors import IndknnError, LedgerIntegrityError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered


def _world(root, *, n=20, users=None, **params):
    x, y, _ = clustered(n, 4, 2, seed=1)
    st = FeatureStore.create(root / "store.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=4,
                             label_names=["a", "b"], chunk_rows=64)
    st.append("private", x, labels=y, record_ids=[f"r{i:03d}" for i in range(n)],
              user_ids=users if users is not None else [""] * n)
    for b in range(6):
        st.append("query", x[np.arange(5) % n], record_ids=[f"q{b}_{i}" for i in range(5)], batch=f"b{b}")
    p = {**dict(epsilon=2.0, delta=1e-5, tau=0.01, sigma2=2.0, sigma1=3.0), **params}
    serving.build_index(store_path=root / "store.zarr", ledger_path=root / "led", params=serving.make_params(**p))
    return x, y


def _serve(root, batch, led="led", **kw):
    return serving.serve_queries(store_path=root / "store.zarr", ledger_path=root / led, query_batch=batch,
                                 device="cpu", **kw)


def _spent(root, led="led"):
    s = BudgetLedger.open(root / led).state
    return {str(r): (float(v), bool(d)) for r, v, d in zip(s.record_id, s.spent, s.deleted)}


def _add(root, x, y, rids, uids):
    st = FeatureStore.open(root / "store.zarr", mode="a")
    st.append("private", x, labels=y, record_ids=rids, user_ids=uids)
    serving.build_index(store_path=root / "store.zarr", ledger_path=root / "led", params=None)


def test_f1_an_edited_snapshot_after_compaction_is_refused(tmp_path):
    _world(tmp_path, n=6, epsilon=8.0)
    _serve(tmp_path, "b0"); _serve(tmp_path, "b1")
    deletion.delete_records(store_path=tmp_path / "store.zarr", ledger_path=tmp_path / "led", record_ids=["r005"],
                            compact=True)
    assert not glob.glob(str(tmp_path / "led" / "events" / "*.parquet"))  # no event links to the snapshot
    snap = sorted((tmp_path / "led").glob("snapshot-*.parquet"))[-1]
    t = pq.read_table(snap)
    cols = {n: t.column(n) for n in t.column_names}
    cols["spent"] = pa.array(np.zeros(len(t)), pa.float64())  # every record refunded
    pq.write_table(pa.table(cols, schema=t.schema).replace_schema_metadata(t.schema.metadata), snap)
    with pytest.raises(LedgerIntegrityError, match="snapshot was edited"):
        _serve(tmp_path, "b2")


def test_f2_two_copies_of_one_ledger_cannot_both_commit(tmp_path):
    import shutil

    _world(tmp_path, n=6, epsilon=8.0)
    _serve(tmp_path, "b0")
    shutil.copytree(tmp_path / "led", tmp_path / "led2")
    inner = {}

    def factory(store, ledger):  # runs inside A's locks, after A checked the mark: serve through the copy
        if not inner:
            try:
                _serve(tmp_path, "b1", led="led2", lock_timeout=0.5)
                inner["copy"] = "served"
            except IndknnError as exc:
                inner["copy"] = type(exc).__name__
        return indexes.load_candidate_finder(store, ledger)

    _serve(tmp_path, "b2", candidate_finder_factory=factory)
    assert inner["copy"] == "LockTimeoutError"  # before: "served", and its charges were later lost
    with pytest.raises(LedgerIntegrityError, match="rolled back"):
        _serve(tmp_path, "b3", led="led2")  # the copy is behind now: refused, never a fork
    _serve(tmp_path, "b3")


def test_f3_records_added_and_erased_in_lost_events_keep_a_tombstone(tmp_path):
    x, y = _world(tmp_path)
    _serve(tmp_path, "b0")
    _add(tmp_path, x[:1], y[:1], ["rNEW"], [""])
    first_lost = sorted((tmp_path / "led" / "events").glob("*.parquet"))[-1]
    _serve(tmp_path, "b1"); _serve(tmp_path, "b2")
    deletion.delete_records(store_path=tmp_path / "store.zarr", ledger_path=tmp_path / "led", record_ids=["rNEW"])
    had = _spent(tmp_path)["rNEW"][0]
    assert had > 0
    with open(first_lost, "r+b") as fh:
        fh.truncate(100)
    ledger_repair.repair_ledger(ledger_path=tmp_path / "led", store_path=tmp_path / "store.zarr")
    assert _spent(tmp_path)["rNEW"] == (BudgetLedger.open(tmp_path / "led").params.budget, True)
    _add(tmp_path, x[:1], y[:1], ["rNEW"], [""])  # the id comes back: never with a fresh budget
    assert _spent(tmp_path)["rNEW"][0] >= had


def test_f4_repair_tombstones_erased_rows_so_erasure_and_compaction_go_on(tmp_path):
    _world(tmp_path, users=[f"u{i % 5}" for i in range(20)])
    _serve(tmp_path, "b0")
    deletion.delete_records(store_path=tmp_path / "store.zarr", ledger_path=tmp_path / "led", record_ids=["r001"])
    ev = sorted((tmp_path / "led" / "events").glob("*delete*.parquet"))[-1]
    with open(ev, "r+b") as fh:
        fh.truncate(50)
    ledger_repair.repair_ledger(ledger_path=tmp_path / "led", store_path=tmp_path / "store.zarr")
    assert _spent(tmp_path)["r001"][1]  # tombstoned at repair
    r = deletion.delete_records(store_path=tmp_path / "store.zarr", ledger_path=tmp_path / "led", user_ids=["u1"])
    assert r.records_erased == 3  # r006, r011, r016: their user's erasure is not blocked
    deletion.delete_records(store_path=tmp_path / "store.zarr", ledger_path=tmp_path / "led", compact=True)


def test_f5_an_erased_id_cannot_move_to_another_user(tmp_path):
    from indknn_cli.errors import BadInputError

    x, y = _world(tmp_path, users=[f"u{i % 4}" for i in range(20)], privacy_unit="user")
    _serve(tmp_path, "b0")
    deletion.delete_records(store_path=tmp_path / "store.zarr", ledger_path=tmp_path / "led", user_ids=["u2"])
    s = BudgetLedger.open(tmp_path / "led").state
    u2 = float(s.spent[s.user_id == "u2"].max())
    assert u2 > 0
    with pytest.raises(BadInputError, match="erased record id under another user"):
        _add(tmp_path, x[2:3], y[2:3], ["r002"], ["uZ"])  # r002 was u2's
    _serve(tmp_path, "b1")  # serving skips that row (never a candidate), no refusal
    s = BudgetLedger.open(tmp_path / "led").state
    assert s.user_id[list(s.record_id).index("r002")] == "u2" and s.deleted[list(s.record_id).index("r002")]
    st = FeatureStore.open(tmp_path / "store.zarr", mode="a")
    st.append("private", x[:1], labels=y[:1], record_ids=["rX2"], user_ids=["u2"])
    _serve(tmp_path, "b2")
    s = BudgetLedger.open(tmp_path / "led").state
    assert s.spent[list(s.record_id).index("rX2")] >= u2  # u2 returns with u2's spent, not a fresh budget
