"""Audit 8 (object storage and the Dask candidate phase): each finding's test fails on the code before its fix.

F2: on object storage an erasure that empties a whole chunk made zarr *delete* the chunk object through a bulk
delete whose per-key errors s3fs ignores (a role without delete permission: S3 answers 200 with AccessDenied per
key), and compaction's removal of the old prefix likewise: `delete` reported success and the vectors stayed.
The bulk delete is made to fail per key (the keys are dropped from the request, which is what S3's answer
amounts to); the store and the server are real (moto).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .conftest import clustered
from .s3_server import new_bucket, raw_objects

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from indknn_cli.store import open_store  # noqa: E402

from .test_object_store import PARAMS, s3, state  # noqa: E402,F401 (the moto server and the state folder fixtures)


def _store(tmp_path: Path, endpoint: str, *, n: int, d: int, users=None, **index):
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import normalize_rows

    x, y, _ = clustered(n, d, 3, seed=1)
    x = normalize_rows(x)
    extra = {} if users is None else {"users": np.asarray(users)}
    np.savez(tmp_path / "p.npz", x=x, y=y, ids=np.array([f"r{i:04d}" for i in range(n)]), **extra)
    url = f"s3://{new_bucket(endpoint)}/s"
    embed_into_store(tmp_path / "p.npz", store_path=url, extractor="vectors", label_names=["0", "1", "2"])
    build_index(store_path=url, ledger_path=tmp_path / "L", params=make_params(**PARAMS), **index)
    return url, x


def _holding(endpoint: str, url: str, vector: np.ndarray) -> list[str]:
    bucket = url.split("/")[2]
    return [k for k, v in raw_objects(endpoint, bucket).items() if vector.astype(np.float32).tobytes() in v]


@pytest.mark.heavy
def test_f2_erasing_a_whole_chunk_writes_it_so_a_refused_delete_cannot_leave_the_vectors(s3, state, tmp_path,
                                                                                         monkeypatch):
    import s3fs

    from indknn_cli.deletion import delete_records

    url, x = _store(tmp_path, s3, n=600, d=384, users=["big"] * 512 + [f"u{i}" for i in range(88)])
    assert open_store(url).chunk_rows == 512  # user "big" owns all of chunk 0

    async def no_delete_permission(self, pathlist, **kw):  # every key refused inside a 200 answer
        return []

    with monkeypatch.context() as mp:
        mp.setattr(s3fs.S3FileSystem, "_bulk_delete", no_delete_permission)
        r = delete_records(store_path=url, ledger_path=tmp_path / "L", user_ids=["big"])
    assert r.records_erased == 512
    st = open_store(url)
    assert not np.any(st.read("private", "features", 0, 512))  # the store reads back zeros
    assert _holding(s3, url, x[0]) == []  # and no object holds the erased vector


@pytest.mark.heavy
def test_f2_a_refused_removal_of_the_old_prefix_empties_it_keeps_its_pointer_and_never_blocks_an_erasure(
        s3, state, tmp_path, monkeypatch):
    """Compaction's removal of the old prefix after a refused bulk delete: the objects left are emptied (a PUT) and
    the state folder naming them is kept, so the next command removes them. Where they can be neither removed nor
    emptied, the erasure is reported incomplete (exit 1), and later erasures still go ahead (review 18: a raised
    error here had blocked every later `delete`)."""
    import s3fs

    from indknn_cli import object_store
    from indknn_cli.deletion import delete_records

    url, x = _store(tmp_path, s3, n=300, d=16)
    real = s3fs.S3FileSystem._bulk_delete

    async def flaky(self, pathlist, **kw):  # the old prefix's first feature chunk refused, the rest deleted
        return await real(self, [p for p in pathlist if not ("features/c/0" in p and ".compacted-" not in p)], **kw)

    with monkeypatch.context() as mp:
        mp.setattr(s3fs.S3FileSystem, "_bulk_delete", flaky)
        r = delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0003"], compact=True)
    assert r.physical_erasure is None and r.records_erased == 1  # emptied: no vector bytes left anywhere
    assert _holding(s3, url, x[10]) == [k for k in _holding(s3, url, x[10]) if ".compacted-" in k]
    bucket = url.split("/")[2]
    left = [k for k in raw_objects(s3, bucket) if k.startswith("s/private/features/c/0")]
    assert left and all(raw_objects(s3, bucket)[k] == b"" for k in left)  # the object is there, empty
    delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=[], compact=True)
    assert not [k for k in raw_objects(s3, bucket) if k.startswith("s/")]  # the next command removed it

    # Neither removed nor emptied (no delete and no put on those keys): reported, and erasure is not blocked.
    current = open_store(url).remote.url.split("/", 3)[3]  # the prefix compaction will leave behind

    def refused(fs, key):
        raise PermissionError("AccessDenied")

    async def flaky_now(self, pathlist, **kw):
        return await real(self, [p for p in pathlist if f"{current}/private/features/c/0" not in p], **kw)

    with monkeypatch.context() as mp:
        mp.setattr(s3fs.S3FileSystem, "_bulk_delete", flaky_now)
        mp.setattr(object_store, "_blank", refused)
        r = delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0020"], compact=True)
        assert r.records_erased == 1 and "neither removed nor emptied" in (r.physical_erasure or "")
        r = delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0030"])  # not blocked
        assert r.records_erased == 1 and "neither removed nor emptied" in (r.physical_erasure or "")
    now = open_store(url).remote.url.split("/", 3)[3]
    assert not [k for k in _holding(s3, url, x[30]) if k.startswith(now + "/")]  # r0030 erased in the current store
    assert [k for k in _holding(s3, url, x[30]) if k.startswith(current + "/")]  # kept only by the reported leftover
    delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=[], compact=True)  # permissions back
    assert _holding(s3, url, x[20]) == [] and _holding(s3, url, x[30]) == []


# -- the Dask candidate phase (workers' side, run here in process) ---------------------------------------------
def _spec_world(tmp_path: Path, kind: str = "flat"):
    from indknn_cli import distributed
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.store import FeatureStore

    from .test_distributed import make_world

    store_path, ledger_path = make_world(tmp_path / "w", kind)
    store = FeatureStore.open(store_path)
    dask = distributed.DaskCandidates(client=None, tasks_per_worker=1)
    dask.workers = lambda: 1
    spec = dask.factory(store, BudgetLedger.open(ledger_path)).spec
    return store_path, store, spec


def test_f4_a_worker_that_sees_an_older_copy_of_the_store_refuses(tmp_path):
    """A worker whose path holds a copy of the store from before the coordinator's last write (same uuid) served
    with it: records added since were never candidates (charged 0) and rows could name other people after a
    restore (audit 8, F4). The coordinator's row count and newest version token travel with the task."""
    import dataclasses
    import shutil

    from indknn_cli import distributed
    from indknn_cli.errors import SchedulerError
    from indknn_cli.store import FeatureStore

    store_path, store, _ = _spec_world(tmp_path)
    old = tmp_path / "old-copy.zarr"
    shutil.copytree(store_path, old)
    x, y, _ = clustered(60, 16, 3, seed=5)
    FeatureStore.open(store_path, mode="a").append("private", x, labels=y, record_ids=[f"n{i}" for i in range(60)])
    from indknn_cli.ledger import BudgetLedger

    dask = distributed.DaskCandidates(client=None, tasks_per_worker=1)
    dask.workers = lambda: 1
    live = FeatureStore.open(store_path)
    spec = dask.factory(live, BudgetLedger.open(tmp_path / "w" / "L")).spec
    q = live.read("query", "features", 0, 5)
    assert distributed.score_range(spec, 0, 360, q) is not None  # the live store: fine
    stale = dataclasses.replace(spec, loc=distributed.StoreLocation(str(old)), run="other-run")
    with pytest.raises(SchedulerError, match="older copy"):
        distributed.score_range(stale, 0, 300, q)


def test_f3_a_dead_coordinators_cached_rows_leave_the_worker_once_idle(tmp_path):
    """A coordinator killed mid-run never releases its ranges: the rows (erased since, perhaps) stayed in the
    worker's memory until another run's first task (audit 8, F3). They now go once the run is idle."""
    import time

    from indknn_cli import distributed

    _, store, spec = _spec_world(tmp_path)
    q = store.read("query", "features", 0, 5)
    distributed.score_range(spec, 0, 300, q)
    assert any(k[0] == spec.run for k in distributed._PARTS)
    assert distributed._sweeper is not None and distributed._sweeper.is_alive()  # sweeping without any coordinator
    assert distributed._sweep_idle(time.monotonic()) == 0  # not idle yet
    assert distributed._sweep_idle(time.monotonic() + distributed.IDLE_SECONDS + 1) >= 1
    assert not any(k[0] == spec.run for k in distributed._PARTS)


def test_f5_the_lsh_and_ivf_scorers_on_a_worker_get_the_pair_bound(tmp_path, monkeypatch):
    """In process the index finders stop at the pair bound (TooManyPairs) before making every pair; on a worker
    they were called without it, so its memory grew with the private pairs (audit 8, F5)."""
    from indknn_cli import distributed
    from indknn_cli.indexes import IvfFinder, LshFinder

    for kind, cls in (("lsh", LshFinder), ("ivf", IvfFinder)):
        _, store, spec = _spec_world(tmp_path / kind, kind)
        seen = []
        real = cls.__call__
        monkeypatch.setattr(cls, "__call__", lambda self, q, row_mask=None, max_pairs=None:
                            seen.append(max_pairs) or real(self, q, row_mask=row_mask, max_pairs=max_pairs))
        distributed.score_range(spec, 0, 300, store.read("query", "features", 0, 5))
        assert seen == [spec.max_pairs], kind


def test_f7_the_coordinator_refuses_triples_no_worker_makes():
    """A worker's triples are checked before they are merged: row −1 passed the row mask as the last row, and
    repeated pairs or κ below τ were kept (audit 8, F7)."""
    from indknn_cli import distributed
    from indknn_cli.errors import SchedulerError

    def part(q, r, k):
        return np.array(q, np.int32), np.array(r, np.int64), np.array(k, np.float64)

    distributed.check_part(part([0, 1], [10, 11], [0.5, 0.6]), 0, 64, 2, 0.3)  # a valid part passes
    for bad in (part([0], [-1], [0.5]), part([0], [70], [0.5]), part([0, 0], [10, 10], [0.5, 0.5]),
                part([0], [10], [0.2]), part([2], [10], [0.5]), part([0], [10], [float("nan")])):
        with pytest.raises(SchedulerError, match="no worker of this indknn makes"):
            distributed.check_part(bad, 0, 64, 2, 0.3)
    merged = distributed.merge([part([0], [-1], [0.5])], 1, np.ones(64, bool))
    assert merged.rows[0].size == 0  # merge drops a negative row (numpy read it as the mask's last entry)


@pytest.mark.heavy
def test_f6_an_index_on_object_storage_with_a_scheduler_is_refused_before_anything(s3, state, tmp_path):
    """Workers cannot read an S3 store's LSH/IVF index (it lives in the coordinator's state folder): every such run
    failed on the workers with a KeyError (exit 1); it is now refused up front with what to do (audit 8, F6)."""
    from indknn_cli import distributed
    from indknn_cli.errors import BadInputError
    from indknn_cli.ledger import BudgetLedger

    url, _ = _store(tmp_path, s3, n=200, d=16, kind="lsh", tables=4, bits=3, index_seed=1)
    dask = distributed.DaskCandidates(client=None, tasks_per_worker=1)
    dask.workers = lambda: 1
    with pytest.raises(BadInputError, match="shared file system"):
        dask.factory(open_store(url), BudgetLedger.open(tmp_path / "L"))


@pytest.mark.heavy
def test_f5_past_the_bound_the_coordinator_cancels_and_the_halves_give_the_in_process_answers(tmp_path, monkeypatch):
    """The coordinator's running sum (tasks taken as they complete, the rest cancelled past the pair bound): the
    batch then halves, and answers, spent and selections equal the in-process run's (review 18 ran this first)."""
    import logging

    from distributed import LocalCluster

    from indknn_cli import distributed, serving
    from indknn_cli.engine import TooManyPairs
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import FeatureStore

    from .test_distributed import EXTRACTOR

    def world(path: Path):
        path.mkdir()
        x, y, _ = clustered(2048, 16, 3, seed=1)
        store = FeatureStore.create(path / "s.zarr", extractor=EXTRACTOR, dim=16, label_names=["a", "b", "c"],
                                    chunk_rows=64)
        store.append("private", x, labels=y, record_ids=[f"r{i:04d}" for i in range(2048)])
        q, _, _ = clustered(256, 16, 3, seed=2)
        store.append("query", q, record_ids=[f"q{i:03d}" for i in range(256)], batch="q1")
        build_index(store_path=store.path, ledger_path=path / "L",
                    params=make_params(epsilon=2.0, delta=1e-5, tau=0.01, sigma2=0.5, planned_queries=600))
        return store.path, path / "L"

    def run(path: Path, serve):
        sp, lp = world(path)
        r = serve(store_path=sp, ledger_path=lp, query_batch="q1", seed=7, batch_size=256, max_memory=16 << 20)
        st = BudgetLedger.open(lp).state
        return [(a["query_id"], a["label"], a["released_count"]) for a in r.answers], st.spent.tobytes(), \
            st.times_selected.tolist()

    raised = []
    real = distributed.DaskFinder._gather

    def spy(self, futures, m):
        try:
            return real(self, futures, m)
        except TooManyPairs:
            raised.append(m)
            raise

    monkeypatch.setattr(distributed.DaskFinder, "_gather", spy)
    want = run(tmp_path / "here", serving.serve_queries)
    with LocalCluster(n_workers=2, processes=False, threads_per_worker=1, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, distributed.session(cluster.scheduler_address) as serve:
        got = run(tmp_path / "dask", serve)
    assert raised  # the bound was passed on the Dask path, and the batch halved
    assert len(got[0]) == 256 and got == want


def _compact_leaving_the_old_prefix(url: str, tmp_path: Path, monkeypatch, *, record: str, listing_fails: bool):
    """delete --compact of ``record`` while the old prefix can be neither removed nor emptied (or not even listed)."""
    import s3fs

    from indknn_cli import object_store
    from indknn_cli.deletion import delete_records

    current = open_store(url).remote.url.split("/", 3)[3]
    real_bulk = s3fs.S3FileSystem._bulk_delete
    real_fs = object_store.filesystem

    async def refused_delete(self, pathlist, **kw):
        return await real_bulk(self, [p for p in pathlist if f"/{current}/" not in f"/{p}"], **kw)

    class NoListing:  # the filesystem of the old prefix, whose listing is refused
        def __init__(self, fs):
            self.fs = fs

        def __getattr__(self, name):
            return getattr(self.fs, name)

        def find(self, path, *a, **kw):
            raise PermissionError("AccessDenied")

    removing = []
    real_remove = object_store.remove

    def remove(folder):  # the listing is refused to the cleanup only (the compaction's copy still reads the prefix)
        removing.append(1)
        try:
            return real_remove(folder)
        finally:
            removing.pop()

    def fs_of(loc):
        fs = real_fs(loc)
        refused = listing_fails and removing and loc.url.rstrip("/").endswith(f"/{current}")
        return NoListing(fs) if refused else fs

    def refused_put(fs, key):
        raise PermissionError("AccessDenied")

    with monkeypatch.context() as mp:
        mp.setattr(s3fs.S3FileSystem, "_bulk_delete", refused_delete)
        mp.setattr(object_store, "filesystem", fs_of)
        mp.setattr(object_store, "remove", remove)
        mp.setattr(object_store, "_blank", refused_put)
        return delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=[record], compact=True)


@pytest.mark.heavy
def test_review_19_a_prefix_that_cannot_be_listed_is_reported_and_blocks_no_erasure(s3, state, tmp_path,
                                                                                      monkeypatch):
    from indknn_cli.deletion import delete_records

    url, x = _store(tmp_path, s3, n=300, d=16)
    r = _compact_leaving_the_old_prefix(url, tmp_path, monkeypatch, record="r0003", listing_fails=True)
    assert r.records_erased == 1 and "could not be listed" in (r.physical_erasure or "")
    r = delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0010"])  # not blocked
    assert r.records_erased == 1
    delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=[], compact=True)
    assert _holding(s3, url, x[3]) == [] and _holding(s3, url, x[10]) == []


@pytest.mark.heavy
def test_review_19_leftovers_are_reported_when_the_ledger_cannot_be_read(s3, state, tmp_path, monkeypatch):
    """With the ledger damaged the recovery step does not run: copies left by a compaction, which may hold erased
    vectors, were not reported (the erasure said nothing of them)."""
    from indknn_cli.deletion import delete_records

    url, x = _store(tmp_path, s3, n=300, d=16)
    r = _compact_leaving_the_old_prefix(url, tmp_path, monkeypatch, record="r0003", listing_fails=False)
    assert "neither removed nor emptied" in (r.physical_erasure or "")
    (tmp_path / "L" / "CURRENT").write_text("{not json")  # the ledger damaged
    r = delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0040"])
    assert r.records_erased == 1 and "earlier copy" in (r.physical_erasure or "")


def test_review_19_an_emptied_store_root_is_no_store(s3, state, tmp_path):
    """A failed first `embed` whose objects could only be emptied left a zero-byte zarr.json: the URL was then
    refused as an unreadable group; it is free for a new store."""
    import fsspec

    from indknn_cli import object_store

    url = f"s3://{new_bucket(s3)}/s"
    loc = object_store.RemoteLocation(url=url, name=url, options=object_store.storage_options(url))
    fs, _ = fsspec.core.url_to_fs(url, **loc.options)
    fs.pipe(url + "/zarr.json", b"")
    assert not object_store.exists(loc)
    fs.pipe(url + "/zarr.json", b"{}")
    fs.invalidate_cache()
    assert object_store.exists(loc)


def test_review_19_the_swap_is_undone_with_the_readable_copy_not_a_kept_emptied_one(tmp_path):
    """A crash between the two renames of the swap leaves the store's folder missing; with a copy kept by an
    earlier cleanup (emptied) beside the real one, the last by name was put back (review 19)."""
    from indknn_cli.deletion_compact import recover_store_folder
    from indknn_cli.store import ExtractorInfo, FeatureStore

    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=4,
                                label_names=["a", "b"])
    uuid = store.uuid
    (tmp_path / "s.zarr").rename(tmp_path / ".s.zarr.old-aaaaaaaaaaaa")  # the real store, mid-swap (tokens: 12 hex)
    kept = tmp_path / ".s.zarr.old-ffffffffffff"  # an emptied copy an earlier cleanup kept (sorts last)
    kept.mkdir()
    (kept / "zarr.json").write_bytes(b"")
    recover_store_folder(tmp_path / "s.zarr")
    assert FeatureStore.open(tmp_path / "s.zarr").uuid == uuid


def _embed_more(tmp_path: Path, url: str, *, start: int, n: int, d: int, seed: int):
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.store import normalize_rows

    x, y, _ = clustered(n, d, 3, seed=seed)
    x = normalize_rows(x)
    f = tmp_path / f"more-{start}.npz"
    np.savez(f, x=x, y=y, ids=np.array([f"m{start + i:05d}" for i in range(n)]))
    return f, x


@pytest.mark.heavy
def test_f1_a_second_machine_waits_for_the_first_machines_write_to_end(s3, state, tmp_path):
    """Two machines (two state roots; the second a real `indknn embed` process) appending to one S3 prefix: the
    second used to write while the first held its store lock (a local flock), interleaving chunk writes; it now
    waits on the bucket's writer lease until the first is done, and every id keeps its own vector (audit 8, F1)."""
    import os
    import subprocess
    import sys
    import time

    from indknn_cli import object_store, store_lease

    url, x = _store(tmp_path, s3, n=300, d=16)
    first = open_store(url, mode="a")
    f, more = _embed_more(tmp_path, url, start=0, n=40, d=16, seed=5)
    env = {**os.environ, "INDKNN_STATE_DIR": str(tmp_path / "machine-b"), "PYTHONPATH": str(REPO)}
    lease = store_lease.lease_url(first.remote)
    with first.write_lock(timeout=5):
        holder = json.loads(object_store.filesystem(first.remote).cat_file(lease))
        second = subprocess.Popen([sys.executable, "-m", "indknn_cli", "embed", str(f), "--store", url],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 12
        while second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert second.poll() is None, f"the second machine wrote while the first held the store: {second.stderr.read()}"
        assert holder["machine"] == store_lease.machine_id()
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    st = open_store(url)
    assert st.n_rows() == 340 and list(st.record_ids()[300:]) == [f"m{i:05d}" for i in range(40)]
    assert np.array_equal(st.read("private", "features")[300:], more)
    assert not object_store.filesystem(st.remote).exists(lease)  # released


@pytest.mark.heavy
def test_f1_after_a_compaction_another_machine_cannot_start_a_second_store_under_the_old_name(
        s3, state, tmp_path, monkeypatch):
    """A compaction moves the data to `<name>.compacted-<token>`, known only to the compacting machine's state
    folder: another machine's `embed` into `<name>` then created a second store there, whose people an erasure on
    the first machine could not find (review 20 of audit 8). It is refused, nothing written."""
    from indknn_cli import object_store
    from indknn_cli.deletion import delete_records
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.errors import StoreError

    url, x = _store(tmp_path, s3, n=120, d=16)
    delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0003"], compact=True)
    bucket = url.split("/")[2]
    before = raw_objects(s3, bucket)
    f, _ = _embed_more(tmp_path, url, start=0, n=20, d=16, seed=4)
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "machine-b"))
    with pytest.raises(StoreError, match="a compaction moved this store"):
        embed_into_store(f, store_path=url, extractor="vectors", label_names=["0", "1", "2"])
    assert raw_objects(s3, bucket) == before


@pytest.mark.heavy
def test_f1_a_lease_left_by_a_dead_process_here_is_taken_over_one_from_another_machine_is_refused(
        s3, state, tmp_path, monkeypatch):
    """A lease whose holder died: this machine's own (its machine id, no process holding the local lease lock) is
    replaced at once; another machine's stays, and a write is refused naming the object and its holder, with
    nothing written (audit 8, F1)."""
    from indknn_cli import object_store, store_lease
    from indknn_cli.errors import LockTimeoutError

    url, x = _store(tmp_path, s3, n=120, d=16)
    st = open_store(url, mode="a")
    fs = object_store.filesystem(st.remote)
    lease = store_lease.lease_url(st.remote)
    import socket

    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fs.pipe_file(lease, json.dumps({"token": "dead", "machine": store_lease.machine_id(), "host": socket.gethostname(),
                                    "boot": store_lease.boot_id(), "pid": int(gone.stdout)}).encode())
    with st.write_lock(timeout=2):  # taken over at once
        assert json.loads(fs.cat_file(lease))["token"] != "dead"
    assert not fs.exists(lease)

    fs.pipe_file(lease, json.dumps({"token": "elsewhere", "machine": "another", "host": "node-7", "pid": 42,
                                    "since": "2026-11-27T10:00:00Z"}).encode())
    before = {k: v for k, v in raw_objects(s3, url.split("/")[2]).items() if not k.endswith(".indknn-writer.json")}
    with pytest.raises(LockTimeoutError, match="node-7") as err:
        with st.write_lock(timeout=0.5):
            st.append("private", x[:3], labels=np.zeros(3, np.int32), record_ids=["z1", "z2", "z3"])
    assert lease in str(err.value)
    after = {k: v for k, v in raw_objects(s3, url.split("/")[2]).items() if not k.endswith(".indknn-writer.json")}
    assert after == before and json.loads(fs.cat_file(lease))["token"] == "elsewhere"  # theirs is kept
    from indknn_cli.deletion import delete_records
    with pytest.raises(LockTimeoutError, match="delete the object"):  # recorded in the ledger (review 67, F1)
        delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0001"], lock_timeout=0.5)
    fs.rm_file(lease)  # the documented way out once that machine is known to be gone
    res = delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0001"])
    assert res.already_deleted == ["r0001"] and res.pending_completed == 1  # the rows overwritten now


def test_f1_a_store_at_a_buckets_root_is_refused_at_creation(s3, state, tmp_path):
    """A store at a bucket's root has no place beside its prefix for the writer lease (nor for a compaction's
    copy, which would name another bucket): creating one is refused with what to do, nothing written."""
    from indknn_cli import object_store, store_lease
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.errors import BadInputError

    bucket = new_bucket(s3)
    loc = object_store.RemoteLocation(url=f"s3://{bucket}", name=f"s3://{bucket}")
    assert store_lease.lease_url(loc) == f"s3://{bucket}/indknn-writer.json"  # an older store there: inside
    f, _ = _embed_more(tmp_path, f"s3://{bucket}", start=0, n=30, d=8, seed=2)
    with pytest.raises(BadInputError, match="NAME"):
        embed_into_store(f, store_path=f"s3://{bucket}/", extractor="vectors", label_names=["0", "1", "2"])
    assert raw_objects(s3, bucket) == {}


@pytest.mark.heavy
def test_f1_a_cloned_machine_id_does_not_take_over_a_live_holders_lease(s3, state, tmp_path, monkeypatch):
    """A state root copied with its machine-id (a cloned image, a restored backup) on a host of the same name: its
    writer took the live holder's lease as a dead process's and both wrote at once (review 21). A lease is taken
    over only when its process is gone on this boot of this machine."""
    import shutil

    from indknn_cli import object_store, store_lease
    from indknn_cli.errors import LockTimeoutError

    url, x = _store(tmp_path, s3, n=120, d=16)
    first = open_store(url, mode="a")
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy(state / "machine-id", clone / "machine-id")
    with first.write_lock(timeout=5):
        monkeypatch.setenv("INDKNN_STATE_DIR", str(clone))
        second = open_store(url, mode="a")
        with pytest.raises(LockTimeoutError, match="writer lease"):
            with second.write_lock(timeout=0.6):
                pass
        monkeypatch.setenv("INDKNN_STATE_DIR", str(state))
        assert json.loads(object_store.filesystem(first.remote).cat_file(store_lease.lease_url(first.remote)))[
            "pid"] == __import__("os").getpid()


@pytest.mark.heavy
def test_f1_a_name_with_pattern_characters_still_finds_the_compacted_copy(s3, state, tmp_path):
    """The check for a compaction's copy globbed `<name>.compacted-*`: a name holding `[1]` matched nothing and a
    second store started under the old name (review 21). Names are now compared as listed."""
    import s3fs

    from indknn_cli.embedding import embed_into_store
    from indknn_cli.errors import StoreError

    bucket = new_bucket(s3)
    s3fs.S3FileSystem(endpoint_url=s3).pipe_file(f"{bucket}/run[1].compacted-abc/zarr.json", b"{}")
    f, _ = _embed_more(tmp_path, f"s3://{bucket}/run[1]", start=0, n=20, d=8, seed=4)
    with pytest.raises(StoreError, match="a compaction moved this store"):
        embed_into_store(f, store_path=f"s3://{bucket}/run[1]", extractor="vectors", label_names=["0", "1", "2"])
