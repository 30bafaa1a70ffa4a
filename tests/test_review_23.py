"""Review 23 (a privacy audit of the object-storage writers and the Dask embed): each test fails before its fix.

F2: two coordinators of one store on S3 (machine B given copies of A's state folder and ledger, as the refusal
after a compaction told the operator to do) both served, each charging the same records against its own copy of
the ledger: 110 records reached 2·B. Real moto server; two state folders stand for two machines.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from .conftest import clustered
from .s3_server import new_bucket

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from indknn_cli.store import open_store  # noqa: E402

from .test_object_store import s3  # noqa: E402,F401 (the moto server fixture)


def _two_machines(tmp_path: Path, endpoint: str, monkeypatch, *, before_index=None):
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import normalize_rows

    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateA"))
    x, y, _ = clustered(200, 16, 3, seed=1)
    np.savez(tmp_path / "p.npz", x=normalize_rows(x), y=y, ids=np.array([f"r{i:04d}" for i in range(200)]))
    q, _, _ = clustered(300, 16, 3, seed=2)
    for name, part in (("q1", q[:150]), ("q2", q[150:])):
        np.savez(tmp_path / f"{name}.npz", x=part, ids=np.array([f"{name}-{i}" for i in range(len(part))]))
    url = f"s3://{new_bucket(endpoint)}/s"
    embed_into_store(tmp_path / "p.npz", store_path=url, extractor="vectors", label_names=["0", "1", "2"])
    for name in ("q1", "q2"):
        embed_into_store(tmp_path / f"{name}.npz", store_path=url, role="query", batch=name)
    if before_index is not None:
        before_index(url)
    build_index(store_path=url, ledger_path=tmp_path / "LA",
                params=make_params(epsilon=0.3, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=50))
    shutil.copytree(tmp_path / "stateA", tmp_path / "stateB")  # machine B: copies of A's state folder and ledger
    shutil.copytree(tmp_path / "LA", tmp_path / "LB")
    return url


@pytest.mark.heavy
def test_f2_a_second_coordinator_with_copies_of_the_state_folder_and_ledger_is_refused_after_the_first_commits(
        s3, tmp_path, monkeypatch):
    from indknn_cli.errors import LedgerIntegrityError
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import serve_queries

    url = _two_machines(tmp_path, s3, monkeypatch)
    a = serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1")
    assert a.newly_answered == 150
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    before = {p.name: p.read_bytes() for p in (tmp_path / "LB").rglob("*") if p.is_file()}
    with pytest.raises(LedgerIntegrityError, match="rolled back"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2")
    after = {p.name: p.read_bytes() for p in (tmp_path / "LB").rglob("*") if p.is_file() and p.name != ".lock"}
    assert {k: v for k, v in before.items() if k != ".lock"} == after  # B's copy charged nothing
    sa = BudgetLedger.open(tmp_path / "LA").state.spent
    assert float(sa.max()) <= float(BudgetLedger.open(tmp_path / "LA").params.budget) * (1 + 1e-12)

    # A, the one history, goes on
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateA"))
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q2").newly_answered == 150


@pytest.mark.heavy
def test_f2_two_copies_that_each_committed_the_same_number_of_events_are_refused_as_two_histories(
        s3, tmp_path, monkeypatch):
    """B committed its own event at the same sequence number while A's state folder was not told (A's bucket mark
    then names B's event): A's copy is refused as another history, not served."""
    from indknn_cli import ledger_mark_remote
    from indknn_cli.errors import LedgerIntegrityError
    from indknn_cli.serving import serve_queries

    url = _two_machines(tmp_path, s3, monkeypatch)
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2")
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateA"))
    from indknn_cli.object_store import local_path
    remote = ledger_mark_remote.read(local_path(url))
    local = json.loads((local_path(url) / "ledger-mark.json").read_text())
    assert remote["seq"] > local["seq"]
    with pytest.raises(LedgerIntegrityError, match="rolled back"):  # A's copy is behind the bucket's mark
        serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1")
    # the same number of events on both sides, different events: two histories
    with pytest.raises(LedgerIntegrityError, match="two copies of the ledger committed"):
        ledger_mark_remote.furthest({**remote, "sha256": "0" * 64}, remote, store_path="s")


@pytest.mark.heavy
def test_f2_a_ledger_writer_on_another_machine_holds_the_ledger_writer_lease(s3, tmp_path, monkeypatch):
    """While one machine commits to the store's ledger, another machine's serve waits, then is refused naming
    the ledger-writer lease; nothing is charged. The lease is released when the run ends."""
    from indknn_cli import object_store, store_lease
    from indknn_cli.errors import LockTimeoutError
    from indknn_cli.serving import serve_queries

    url = _two_machines(tmp_path, s3, monkeypatch)
    st = open_store(url)
    fs = object_store.filesystem(st.remote)
    lease = store_lease.lease_url(st.remote, store_lease.LEDGER_SUFFIX)
    fs.pipe_file(lease, json.dumps({"token": "t-a", "machine": "machine-a", "host": "node-a", "pid": 7,
                                    "since": "2026-11-28T01:00:00Z"}).encode())
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    with pytest.raises(LockTimeoutError, match="ledger-writer lease"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2", lock_timeout=0.5)
    assert store_lease.break_lease(url, token="t-a")["removed"] == lease
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2").newly_answered == 150
    assert not fs.exists(lease)


# F1: a Dask embed's partition still running when its coordinator is gone (killed; or, as here, a drain that ran
# past its bound: the lock is released the same way) wrote its chunks over the next writer's committed rows.
@pytest.mark.heavy
def test_f1_a_partition_left_running_after_its_run_ended_cannot_write_over_the_next_writers_rows(tmp_path,
                                                                                                  monkeypatch):
    import time

    distributed = pytest.importorskip("distributed")
    from indknn_cli import dask_embed, dask_fence
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.errors import SchedulerError
    from indknn_cli.extractors import get_extractor
    from indknn_cli.store import FeatureStore, normalize_rows

    from .test_dask_embed import _partitions_of

    d = 16
    marks = tmp_path / "marks"
    marks.mkdir()
    orig = dask_embed.embed_partition

    def slow_or_failing(target, role, info, device, dim, chunk, lo, *rest):
        if lo != 37:
            raise RuntimeError("boom")
        time.sleep(3)  # still embedding when the run ends and the next writer commits
        try:
            out = orig(target, role, info, device, dim, chunk, lo, *rest)
        except Exception as exc:
            (marks / "fenced").write_text(type(exc).__name__)
            raise
        (marks / "written").touch()
        return out

    monkeypatch.setattr(dask_embed, "embed_partition", slow_or_failing)
    _partitions_of(monkeypatch, 128)
    monkeypatch.setattr(dask_embed, "DRAIN_SECONDS", 0.5)
    monkeypatch.setattr(dask_fence, "GRACE_SECONDS", 0.5)

    st = FeatureStore.create(tmp_path / "s.zarr", extractor=get_extractor("vectors").info, dim=d,
                             label_names=["0", "1"], chunk_rows=64)
    rng = np.random.default_rng(3)
    pre = normalize_rows(rng.standard_normal((37, d)))
    st.append("private", pre, labels=np.zeros(37, np.int32), record_ids=[f"p{i}" for i in range(37)])
    a = normalize_rows(rng.standard_normal((256, d)))
    b = normalize_rows(rng.standard_normal((200, d)))
    np.savez(tmp_path / "a.npz", x=a, y=np.zeros(256, int), ids=np.array([f"a{i}" for i in range(256)]))
    np.savez(tmp_path / "b.npz", x=b, y=np.ones(200, int), ids=np.array([f"b{i}" for i in range(200)]))
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0",
                                  silence_logs=50) as c:
        with pytest.raises(SchedulerError, match="did not finish"):  # the lock is released, a partition runs on
            embed_into_store(tmp_path / "a.npz", store_path=st.path, batch_rows=64, scheduler=c.scheduler_address)
        res = embed_into_store(tmp_path / "b.npz", store_path=st.path)  # the next writer, at rows 37..236
        assert res.rows_added == 200
        deadline = time.monotonic() + 30
        while not any(marks.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert (marks / "fenced").read_text() == "Fenced" and not (marks / "written").exists()
    st = FeatureStore.open(tmp_path / "s.zarr")
    assert st.n_rows() == 237 and list(st.record_ids()[37:]) == [f"b{i}" for i in range(200)]
    assert np.array_equal(st.read("private", "features")[37:], b.astype(np.float32))  # B's own vectors
    assert not (tmp_path / "s.zarr" / dask_fence.LOCAL_NAME).exists()


@pytest.mark.heavy
def test_f2_review_25_a_failed_bucket_mark_keeps_the_ledger_writer_lease_so_a_copy_cannot_commit(
        s3, tmp_path, monkeypatch):
    """A's commit lands but its bucket mark cannot be written (the bucket's mark stays behind A's ledger): B's copy
    then passed the bucket's mark, answered the batch and charged its own copy; A's later repair released A's
    answers too: the same queries twice, up to 2·B (review 25). The ledger-writer lease now stays in the bucket
    until a writer of A's machine commits again: B is refused meanwhile, and after it, as behind."""
    from indknn_cli import ledger_mark_remote, object_store, store_lease
    from indknn_cli.errors import LedgerIntegrityError, LockTimeoutError, StoreError
    from indknn_cli.serving import serve_queries

    url = _two_machines(tmp_path, s3, monkeypatch)
    real = ledger_mark_remote._where

    class Unwritable:  # reads as the bucket does; writes fail
        def __init__(self, fs):
            self.fs = fs

        def cat_file(self, *a, **k):
            return self.fs.cat_file(*a, **k)

        def pipe_file(self, *a, **k):
            raise OSError("bucket unreachable")

    monkeypatch.setattr(ledger_mark_remote, "_where", lambda p: (Unwritable(real(p)[0]), real(p)[1]))
    with pytest.raises(StoreError, match="ledger-writer lease stays"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1")
    monkeypatch.setattr(ledger_mark_remote, "_where", real)
    st = open_store(url)
    lease = store_lease.lease_url(st.remote, store_lease.LEDGER_SUFFIX)
    assert object_store.filesystem(st.remote).exists(lease)

    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    with pytest.raises(LockTimeoutError, match="ledger-writer lease"):  # B's copy cannot commit
        serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2", lock_timeout=0.5)
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateA"))  # A's next writer takes its lease over
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q2").newly_answered == 150
    assert not object_store.filesystem(st.remote).exists(lease)
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    with pytest.raises(LedgerIntegrityError, match="rolled back"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2")


@pytest.mark.heavy
def test_f2_review_25_a_stale_bucket_mark_of_another_ledger_does_not_refuse_the_stores_own(s3, tmp_path, monkeypatch):
    """A store removed and made again under the same name left its old ledger's mark in the bucket: every index and
    serve of the new store was refused (only `repair`, retiring everyone, got out). A bucket mark of a ledger other
    than the one checked is now ignored (the binding says which ledger the store has)."""
    from indknn_cli import object_store
    from indknn_cli.ledger_mark_remote import SUFFIX
    from indknn_cli.serving import serve_queries
    from indknn_cli.store_lease import lease_url

    def stale_mark(url):  # the earlier store's ledger's mark, left in the bucket before this store's `index`
        st = open_store(url)
        object_store.filesystem(st.remote).pipe_file(lease_url(st.remote, SUFFIX), json.dumps(_sealed_mark()).encode())

    url = _two_machines(tmp_path, s3, monkeypatch, before_index=stale_mark)
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1").newly_answered == 150


def _sealed_mark(**fields) -> dict:
    from indknn_cli.ledger_chain import SEAL, mark_seal

    mark = {"ledger_uuid": "an-earlier-store", "seq": 99, "sha256": "0" * 64, "generation": 3,
            "snapshot_sha256": "1" * 64, **fields}
    mark[SEAL] = mark_seal(mark)  # as indknn wrote it (sealed since review 27)
    return mark


@pytest.mark.heavy
def test_f1_review_29_another_ledgers_bucket_mark_copied_over_a_bound_stores_is_refused(s3, tmp_path, monkeypatch):
    """Review 29, F1: B (copies of A's state folder and ledger) is refused once A has committed, by the bucket's
    mark; copying any other ledger's sealed mark over it (a plain object copy, no hash to compute) made check_mark
    drop the bucket's mark as stale, and B answered and charged its copy: records paid up to 2·B. A bound store's
    bucket mark naming another ledger is now refused like a missing one; `repair` writes it again."""
    from indknn_cli import object_store
    from indknn_cli.errors import LedgerIntegrityError
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.ledger_mark_remote import SUFFIX
    from indknn_cli.ledger_repair import repair_ledger
    from indknn_cli.serving import serve_queries
    from indknn_cli.store_lease import lease_url

    url = _two_machines(tmp_path, s3, monkeypatch)
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1").newly_answered == 150
    st = open_store(url)
    fs, key = object_store.filesystem(st.remote), lease_url(st.remote, SUFFIX)
    fs.pipe_file(key, json.dumps(_sealed_mark(ledger_uuid="the-other-stores-ledger")).encode())
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    with pytest.raises(LedgerIntegrityError, match="belongs to ledger the-other-stores-ledger"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2")
    assert BudgetLedger.open(tmp_path / "LB").state.spent.max() == 0  # B charged nothing
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateA"))
    with pytest.raises(LedgerIntegrityError, match="belongs to ledger the-other-stores-ledger"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q2")
    spent = BudgetLedger.open(tmp_path / "LA").state.spent.copy()
    repair_ledger(ledger_path=tmp_path / "LA", store_path=url)  # retires everyone, refunds nothing, marks again
    after = BudgetLedger.open(tmp_path / "LA")
    assert (after.state.spent >= spent).all()
    assert json.loads(fs.cat_file(key))["ledger_uuid"] == after.meta["ledger_uuid"]
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q2").newly_answered == 150


@pytest.mark.heavy
def test_f1_review_25_a_run_whose_first_partition_was_never_sent_leaves_no_stamp(tmp_path, monkeypatch):
    """The stamp is written just before the first partition is submitted; a submit that raised left it behind (the
    drain had no partition to wait for), and the next writer in another process waited the fence's grace."""
    distributed = pytest.importorskip("distributed")
    from indknn_cli import dask_fence
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.extractors import get_extractor
    from indknn_cli.store import FeatureStore, normalize_rows

    st = FeatureStore.create(tmp_path / "s.zarr", extractor=get_extractor("vectors").info, dim=8,
                             label_names=["0", "1"], chunk_rows=64)
    x = normalize_rows(np.random.default_rng(1).standard_normal((300, 8)))
    np.savez(tmp_path / "a.npz", x=x, y=np.zeros(300, int), ids=np.array([f"a{i}" for i in range(300)]))
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                                  silence_logs=50) as c:
        def refused(*a, **k):
            assert (tmp_path / "s.zarr" / dask_fence.LOCAL_NAME).exists()  # stamped just before
            raise RuntimeError("scheduler went away")

        monkeypatch.setattr(distributed.Client, "submit", refused)
        with pytest.raises(Exception):
            embed_into_store(tmp_path / "a.npz", store_path=st.path, scheduler=c.scheduler_address)
    assert not (tmp_path / "s.zarr" / dask_fence.LOCAL_NAME).exists()
    assert FeatureStore.open(st.path).n_rows() == 0


@pytest.mark.heavy
def test_f1_review_30_the_state_folders_mark_copied_into_the_bucket_does_not_let_a_copy_serve(s3, tmp_path,
                                                                                             monkeypatch):
    """Review 30, F1: B (copies of A's state folder and ledger) is refused once A has committed; but the state
    folder's ledger-mark.json was the same bytes as the bucket's mark, so B held an older version of the bucket's
    object: copied over it by hand (no hash to compute), the bucket named B's position again, B's ledger reached it,
    and B answered and charged its copy (2·B across the two). The bucket's mark now says copy="bucket" inside its
    seal and the state folder's copy="local": the copied one is refused, for B and for A, until `repair`."""
    from indknn_cli import ledger_mark_remote
    from indknn_cli.errors import LedgerIntegrityError
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.ledger_repair import repair_ledger
    from indknn_cli.object_store import local_path
    from indknn_cli.serving import serve_queries

    url = _two_machines(tmp_path, s3, monkeypatch)
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1").newly_answered == 150
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    state_b = local_path(url)
    with pytest.raises(LedgerIntegrityError, match="rolled back"):  # as before: B is behind the bucket's mark
        serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2")
    fs, key = ledger_mark_remote._where(state_b)
    bucket_before = fs.cat_file(key)
    fs.pipe_file(key, (state_b / "ledger-mark.json").read_bytes())  # B's own mark, unchanged, over the bucket's
    with pytest.raises(LedgerIntegrityError, match="state folder's ledger-mark.json"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2")
    assert BudgetLedger.open(tmp_path / "LB").state.spent.max() == 0  # B charged nothing
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateA"))
    spent = BudgetLedger.open(tmp_path / "LA").state.spent.copy()
    with pytest.raises(LedgerIntegrityError, match="state folder's ledger-mark.json"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q2")
    assert json.loads(bucket_before)["copy"] == "bucket" and json.loads(fs.cat_file(key))["copy"] == "local"
    repair_ledger(ledger_path=tmp_path / "LA", store_path=url)  # retires everyone, refunds nothing, marks again
    assert (BudgetLedger.open(tmp_path / "LA").state.spent >= spent).all()
    assert json.loads(fs.cat_file(key))["copy"] == "bucket"
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q2").newly_answered == 150


@pytest.mark.heavy
def test_review_30_marks_written_before_the_copy_field_still_serve_and_are_rewritten_with_it(s3, tmp_path,
                                                                                             monkeypatch):
    """A store whose two marks an indknn before the fix wrote (sealed, no ``copy``) serves as before; its next
    commit writes both with their copy."""
    from indknn_cli import ledger_mark_remote
    from indknn_cli.ledger_chain import SEAL, mark_seal
    from indknn_cli.object_store import local_path
    from indknn_cli.serving import serve_queries

    url = _two_machines(tmp_path, s3, monkeypatch)
    state = local_path(url)
    fs, key = ledger_mark_remote._where(state)
    old = {k: v for k, v in json.loads((state / "ledger-mark.json").read_text()).items() if k not in (SEAL, "copy")}
    old[SEAL] = mark_seal(old)
    (state / "ledger-mark.json").write_text(json.dumps(old))
    fs.pipe_file(key, json.dumps(old).encode())
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1").newly_answered == 150
    assert json.loads((state / "ledger-mark.json").read_text())["copy"] == "local"
    assert json.loads(fs.cat_file(key))["copy"] == "bucket"


@pytest.mark.heavy
def test_review_31_a_state_folder_naming_another_store_than_its_data_is_refused(s3, tmp_path, monkeypatch):
    """Review 31, F1/F2: remote.json's name alone says where the store's leases and the bucket's mark are, its url
    where the data is. B (copies of A's state folder and ledger) copied the bucket's mark to `s2.indknn-mark.json`
    while its copy was current, and after A committed edited its name to `…/s2` (url unchanged): B then found "its"
    mark and lease under s2 and served beside A, 1.999999998·B; the same edit let `embed` append under A's writer
    lease. The url must now be the name or a compaction of it."""
    from indknn_cli import ledger_mark_remote
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.errors import StoreError
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.object_store import local_path
    from indknn_cli.serving import serve_queries

    url = _two_machines(tmp_path, s3, monkeypatch)
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    state_b = local_path(url)
    fs, key = ledger_mark_remote._where(state_b)
    fs.copy(key, key.replace("/s.indknn-mark.json", "/s2.indknn-mark.json"))  # while B's copy is current
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateA"))
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1").newly_answered == 150
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
    (state_b / "remote.json").write_text(json.dumps({"name": url + "2", "url": url}))
    with pytest.raises(StoreError, match="neither that prefix nor a compaction of it"):
        serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2")
    with pytest.raises(StoreError, match="neither that prefix nor a compaction of it"):
        embed_into_store(tmp_path / "q1.npz", store_path=url, role="query", batch="b-appends")
    assert BudgetLedger.open(tmp_path / "LB").state.spent.max() == 0  # B charged nothing
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateA"))
    assert "b-appends" not in open_store(url).batches()
    assert serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q2").newly_answered == 150


def test_review_31_a_compactions_prefix_is_no_stores_name(tmp_path, monkeypatch):
    """With name = url = `<name>.compacted-<token>` (a state folder edited to the compaction's own prefix, or the
    store opened by that URL), one prefix of data had a second name, so a second set of leases and marks. Reading
    by that URL still works (Dask workers do); no lease or mark is ever looked up under it."""
    from indknn_cli.errors import StoreError
    from indknn_cli.object_store import RemoteLocation, location, write_pointer
    from indknn_cli.store_lease import LEDGER_SUFFIX, lease_url

    compacted = "s3://bkt/s.compacted-0123456789ab"
    with pytest.raises(StoreError, match="not a store's name"):
        lease_url(RemoteLocation(url=compacted, name=compacted, options={}), LEDGER_SUFFIX)
    assert lease_url(RemoteLocation(url=compacted, name="s3a://bkt/s/", options={})) == "s3://bkt/s.indknn-writer.json"
    write_pointer(tmp_path, name="s3://bkt/s", url="s3://bkt/s2")
    with pytest.raises(StoreError, match="neither that prefix"):
        location(tmp_path)
    write_pointer(tmp_path, name="s3://bkt/s", url=compacted)
    assert location(tmp_path).url == compacted


@pytest.mark.heavy
def test_review_31_an_index_refused_by_a_stale_state_folder_mark_in_the_bucket_leaves_no_ledger(s3, tmp_path,
                                                                                                 monkeypatch):
    """A store removed by hand whose bucket mark was a state folder's copy (copy = "local"), made again under its
    name: `index` was refused, as it should be, but left its new ledger folder, and the message sent the operator to
    `repair`, which retired every new record. The refusal now says to remove the old object, and no ledger is left."""
    from indknn_cli import object_store
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.errors import LedgerIntegrityError
    from indknn_cli.ledger_mark_remote import SUFFIX
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import normalize_rows
    from indknn_cli.store_lease import lease_url

    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    x, y, _ = clustered(60, 8, 2, seed=1)
    np.savez(tmp_path / "p.npz", x=normalize_rows(x), y=y, ids=np.array([f"r{i}" for i in range(60)]))
    url = f"s3://{new_bucket(s3)}/s"
    embed_into_store(tmp_path / "p.npz", store_path=url, extractor="vectors", label_names=["0", "1"])
    st = open_store(url)
    fs, key = object_store.filesystem(st.remote), lease_url(st.remote, SUFFIX)
    fs.pipe_file(key, json.dumps(_sealed_mark(copy="local")).encode())  # the old store's, left behind
    params = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=50)
    with pytest.raises(LedgerIntegrityError, match="remove this object by hand"):
        build_index(store_path=url, ledger_path=tmp_path / "L", params=params)
    assert not (tmp_path / "L").exists()
    fs.rm_file(key)
    assert build_index(store_path=url, ledger_path=tmp_path / "L", params=params).created
