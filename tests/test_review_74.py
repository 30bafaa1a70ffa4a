"""Review 74 (2026-11-29, a helper as privacy auditor of this session's diff `7a7d6e3..32ec9b9`, `/work/review74`):
the ledger's erased_rows and rows_to_erase outlived a store restored from a shorter copy (new people appended at
those row numbers were never admitted, or erased unasked); the replay fallback for old delete events counted a
deferred erasure's rows as overwritten; seeded answers lost in a rollback were forgotten; a lost user_id chunk was
not refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.indexing import build_index, make_params
from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore
from indknn_cli.store_layout import ExtractorInfo, normalize_rows

runner = CliRunner()
D, CHUNK = 8, 16


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def world(root: Path, n: int = 16, users=None, **kw):
    rng = np.random.default_rng(5)
    st = FeatureStore.create(root / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                             label_names=["a", "b"], chunk_rows=CHUNK)
    st.append("private", normalize_rows(rng.standard_normal((n, D))), labels=(np.arange(n) % 2).astype(np.int32),
              record_ids=[f"r{i:03d}" for i in range(n)], user_ids=users)
    build_index(store_path=st.path, ledger_path=root / "L",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=50, **kw))
    return st.path, root / "L"


def append(sp, ids, users=None, seed=9):
    rng = np.random.default_rng(seed)
    st = FeatureStore.open(sp, mode="a")
    with st.write_lock(timeout=5):
        st.append("private", normalize_rows(rng.standard_normal((len(ids), D))),
                  labels=(np.arange(len(ids)) % 2).astype(np.int32), record_ids=ids, user_ids=users)


@pytest.mark.parametrize("deferred", [False, True])
def test_f1_f5_rows_past_a_restored_stores_end_are_new_rows(tmp_path, deferred):
    """F1: erased row 20, the store restored from a 16-row copy, repaired, 8 new people appended (n004 at row 20):
    n004 was never admitted and `--verify` failed for good. F5: the same with the erasure deferred under a held
    lease and finished: the next serve erased n004, unasked."""
    from indknn_cli import deletion_deferred
    from indknn_cli.errors import LockTimeoutError

    sp, lp = world(tmp_path)
    shutil.copytree(sp, tmp_path / "backup.zarr")
    append(sp, [f"r{i:03d}" for i in range(16, 24)])
    q = tmp_path / "q.npy"
    np.save(q, FeatureStore.open(sp).read("private", "features")[:2])
    assert cli("serve-queries", q, "--store", sp, "--ledger", lp, "--device", "cpu").exit_code == 0
    if deferred:  # what `delete` does when another machine holds an S3 store's writer lease
        with pytest.raises(LockTimeoutError):
            deletion_deferred.record(sp, lp, ["r020"], [], strict=False, lease_error=LockTimeoutError("held"))
        (tmp_path / "none.txt").write_text("")
        assert cli("delete", "--ids-file", tmp_path / "none.txt", "--store", sp, "--ledger", lp).exit_code == 0
    else:
        assert cli("delete", "--store", sp, "--ledger", lp, "--record", "r020").exit_code == 0
    assert str(FeatureStore.open(sp).read("private", "record_id")[20]) == ""
    shutil.rmtree(sp)
    shutil.copytree(tmp_path / "backup.zarr", sp)
    r = cli("repair", "--store", sp, "--ledger", lp)
    assert r.exit_code == 0, r.output
    append(sp, [f"n{i:03d}" for i in range(8)], seed=11)  # new people: rows 16-23, n004 at row 20
    np.save(q, FeatureStore.open(sp).read("private", "features")[20:22])  # a new batch, on n004's vector
    r = cli("serve-queries", q, "--store", sp, "--ledger", lp, "--device", "cpu")
    assert r.exit_code == 0 and "already answered" not in r.stderr, r.output
    st = FeatureStore.open(sp)
    assert str(st.read("private", "record_id")[20]) == "n004" and not st.read("private", "deleted")[20]
    assert "n004" in [str(x) for x in BudgetLedger.open(lp).state.record_id]
    r = cli("account", "--store", sp, "--ledger", lp, "--verify")
    assert r.exit_code == 0, r.output


def test_f2_an_old_deferred_delete_events_waiting_rows_are_not_counted_as_overwritten(tmp_path):
    """F2: the replay fallback for delete events written before erased_rows took a deferred erasure's rows (still
    waiting for the lease) as overwritten, and `--verify` then failed on a healthy store."""
    import pyarrow as pa

    from indknn_cli.ledger_events import apply_table
    from indknn_cli.ledger_state import EVENT_SCHEMA

    sp, lp = world(tmp_path)
    led = BudgetLedger.open(lp)
    uuid = FeatureStore.open(sp).uuid
    cols = {"kind": ["delete", "delete"], "ledger_index": [3, 7], "row": [3, 7], "spent_after": [0.0, 0.0]}
    table = pa.table({f.name: pa.array(cols.get(f.name, [None, None]), type=f.type) for f in EVENT_SCHEMA})
    info = {"type": "delete", "store_seen": {"store_uuid": uuid, "version": "v"},  # as 7a7d6e3 wrote it
            "rows_to_erase": {"store_uuid": uuid, "rows": [7]}}
    apply_table(led.state, table, info, c1=led.params.c1)
    assert led.state.erased_rows == {"store_uuid": uuid, "rows": [3]}


def test_f3_a_rollback_does_not_hide_seeded_answers(tmp_path):
    """F3: the newest event (a seeded batch) removed and `repair` run: `account --eps` passed without a word of the
    seeded answers, which the mark had seen released. The mark counts them; repair keeps the lost ones."""
    sp, lp = world(tmp_path)
    q = tmp_path / "q.npy"
    np.save(q, FeatureStore.open(sp).read("private", "features")[:3])
    assert cli("serve-queries", q, "--store", sp, "--ledger", lp, "--batch-id", "b1", "--device", "cpu").exit_code == 0
    r = cli("serve-queries", q, "--store", sp, "--ledger", lp, "--seed", "2", "--batch-id", "b3", "--device", "cpu")
    assert r.exit_code == 0, r.output
    sorted((lp / "events").glob("*.parquet"))[-1].unlink()
    r = cli("repair", "--store", sp, "--ledger", lp)
    assert r.exit_code == 0, r.output
    r = cli("account", "--store", sp, "--ledger", lp, "--eps", "100")
    assert r.exit_code == 4 and "fixed --seed" in " ".join(r.output.split()), r.output


def test_f4_a_lost_user_id_chunk_is_refused_on_a_dense_store(tmp_path):
    """F4: under --privacy-unit user --user-for-missing record, a lost private/user_id chunk read back as "" for
    16 rows of one user: each became its own privacy unit (her budget ×16), `--verify` passed and `delete --user`
    erased nothing. A store made now writes every chunk as a file, so an absent one of any private array is refused."""
    rng = np.random.default_rng(1)
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                             label_names=["a", "b"], chunk_rows=CHUNK)  # user_id chunks: 64 rows
    assert st.dense_chunks
    st.append("private", normalize_rows(rng.standard_normal((64, D))), labels=(np.arange(64) % 2).astype(np.int32),
              record_ids=[f"r{i:03d}" for i in range(64)], user_ids=[""] * 64)  # no user ids: all-"" chunks
    sp, lp = st.path, tmp_path / "L"
    build_index(store_path=sp, ledger_path=lp, params=make_params(
        epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=50, privacy_unit="user",
        user_for_missing="record"))
    assert (sp / "private" / "user_id" / "c" / "0").exists()  # a chunk of "" only is a file too
    append(sp, [f"alice{i:02d}" for i in range(16)], users=["alice"] * 16)  # rows 64-79: user_id chunk 1
    assert cli("account", "--store", sp, "--ledger", lp, "--verify").exit_code == 0
    (sp / "private" / "user_id" / "c" / "1").unlink()  # lost in a partial copy or restore
    q = tmp_path / "q.npy"
    np.save(q, FeatureStore.open(sp).read("private", "features")[64:66])
    r = cli("serve-queries", q, "--store", sp, "--ledger", lp, "--device", "cpu")
    assert r.exit_code == 2 and "private/user_id" in " ".join(r.output.split()), r.output
    assert not [x for x in BudgetLedger.open(lp).state.record_id if str(x).startswith("alice")]
    r = cli("account", "--store", sp, "--ledger", lp, "--verify")
    assert r.exit_code != 0 and "private/user_id" in " ".join(r.output.split()), r.output
