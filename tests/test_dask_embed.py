"""`embed --scheduler`: rows embedded on the workers of a real Dask LocalCluster (2 processes), written into
chunk-aligned regions, committed by the coordinator; the store is bit-identical to an in-process embed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli import dask_embed
from indknn_cli.cli.app import app
from indknn_cli.embedding import embed_into_store
from indknn_cli.errors import BadInputError, SchedulerError
from indknn_cli.extractors import get_extractor
from indknn_cli.store import FeatureStore, normalize_rows

from .conftest import clustered

distributed = pytest.importorskip("distributed")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=50) as c:
        yield c.scheduler_address


def _store_files(root: Path) -> dict[str, bytes]:
    """Every file of a store but its root zarr.json (store_uuid and creation time differ by design)."""
    out = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
           if p.is_file() and p != root / "zarr.json" and not p.name.startswith(".")}
    if "private/zarr.json" in out:  # the version log holds random tokens (store_versions.py): keep their count
        meta = json.loads(out["private/zarr.json"])
        meta["attributes"]["versions"] = len(meta["attributes"].get("versions", []))
        out["private/zarr.json"] = json.dumps(meta, sort_keys=True).encode()
    return out


def _pair(tmp_path: Path, n: int = 1000, d: int = 16):
    """Two empty-but-for-37-rows stores with 64-row chunks (the 38th row starts mid-chunk), and the input."""
    x, y, _ = clustered(n, d, 3, seed=5)
    np.savez(tmp_path / "in.npz", x=x, y=y, ids=np.array([f"r{i:05d}" for i in range(n)]))
    pre, py, _ = clustered(37, d, 3, seed=6)
    stores = []
    for name in ("inproc", "dask"):
        st = FeatureStore.create(tmp_path / name, extractor=get_extractor("vectors").info, dim=d,
                                 label_names=["0", "1", "2"], chunk_rows=64)
        if stores:  # one content-key salt for both (a random draw per store), so their keys are comparable
            st.root.attrs.update({"content_key_salt": stores[0].key_salt})
        st.append("private", pre, labels=py, record_ids=[f"p{i}" for i in range(37)])
        stores.append(st)
    return x, stores


def _partitions_of(monkeypatch, rows: int) -> None:
    """Every DaskFeatureWriter of the test sends partitions of ``rows`` rows (the tests' stores are small)."""
    orig_init = dask_embed.DaskFeatureWriter.__init__

    def init(self, client, ex, *, device, partition_rows=None):
        orig_init(self, client, ex, device=device, partition_rows=rows)

    monkeypatch.setattr(dask_embed.DaskFeatureWriter, "__init__", init)


def test_embed_on_workers_is_bit_identical(cluster, tmp_path):
    x, (a, b) = _pair(tmp_path)
    ra = embed_into_store(tmp_path / "in.npz", store_path=a.path, batch_rows=50)
    rb = embed_into_store(tmp_path / "in.npz", store_path=b.path, batch_rows=50, scheduler=cluster)
    assert ra.as_dict() == {**rb.as_dict(), "store": ra.store} and rb.rows_added == 1000
    q, _, _ = clustered(30, 16, 3, seed=7)
    np.savez(tmp_path / "q.npz", x=q)
    embed_into_store(tmp_path / "q.npz", store_path=a.path, role="query", batch="qb", batch_rows=8)
    embed_into_store(tmp_path / "q.npz", store_path=b.path, role="query", batch="qb", batch_rows=8, scheduler=cluster)
    fa, fb = _store_files(a.path), _store_files(b.path)
    assert len(fa) > 20 and fa.keys() == fb.keys()
    assert [k for k in fa if fa[k] != fb[k]] == []
    assert np.array_equal(FeatureStore.open(b.path).read("private", "features")[37:], normalize_rows(x))
    assert FeatureStore.open(b.path).batches() == FeatureStore.open(a.path).batches()  # same vectors' sha256


def test_failing_worker_leaves_the_store_as_it_was(cluster, tmp_path):
    """A NaN row in a late partition: found on a worker (the coordinator does not look at vectors here), the
    error names the input row, nothing is committed and the committed rows' files are unchanged."""
    x, (_, b) = _pair(tmp_path)
    x[900, 3] = np.nan
    np.savez(tmp_path / "bad.npz", x=x, y=np.zeros(len(x), int), ids=np.array([f"r{i:05d}" for i in range(len(x))]))
    before = _store_files(b.path)
    committed = {name: b.read("private", name) for name in ("features", "labels", "record_id", "user_id")}
    with pytest.raises(BadInputError, match="row 901"):
        embed_into_store(tmp_path / "bad.npz", store_path=b.path, batch_rows=50, scheduler=cluster)
    st = FeatureStore.open(b.path)
    assert st.n_rows() == 37 and _store_files(b.path)["private/zarr.json"] == before["private/zarr.json"]
    for name, values in committed.items():  # rows past n_rows were written (invisible), committed ones kept
        assert np.array_equal(st.read("private", name), values)


@pytest.mark.heavy
def test_unreachable_scheduler_is_exit_1(tmp_path, monkeypatch):
    from .s3_server import free_port

    monkeypatch.setattr(dask_embed, "CONNECT_TIMEOUT_S", 2)
    x, (_, b) = _pair(tmp_path, n=50)
    address = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(SchedulerError, match="cannot reach the Dask scheduler"):
        embed_into_store(tmp_path / "in.npz", store_path=b.path, scheduler=address)
    monkeypatch.setenv("INDKNN_SCHEDULER", address)
    res = CliRunner().invoke(app, ["embed", str(tmp_path / "in.npz"), "--store", str(b.path)])
    assert res.exit_code == 1 and "cannot reach the Dask scheduler" in res.output
    assert FeatureStore.open(b.path).n_rows() == 37


def test_a_blank_scheduler_variable_embeds_in_process_as_serve_does(tmp_path, monkeypatch):
    """`INDKNN_SCHEDULER="  "` is unset for `embed` as for `serve-queries` (one resolve_scheduler for both): before,
    embed took the blanks for an address and refused (exit 2) what serve-queries answered in process."""
    x, (_, b) = _pair(tmp_path, n=50)
    monkeypatch.setenv("INDKNN_SCHEDULER", "  ")
    res = CliRunner().invoke(app, ["embed", str(tmp_path / "in.npz"), "--store", str(b.path)])
    assert res.exit_code == 0, res.output
    assert FeatureStore.open(b.path).n_rows() == 37 + 50


@pytest.mark.slow
def test_embed_on_workers_into_s3(cluster, tmp_path, monkeypatch):
    """The workers write straight into the bucket (the store's remote URL and options travel with the task;
    here the credentials are in the options, as the workers were started before the server's variables)."""
    from indknn_cli import object_store

    from .s3_server import S3_ENV, moto_server, new_bucket

    pytest.importorskip("s3fs")
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    x, _ = _pair(tmp_path, n=400)
    with moto_server() as endpoint:
        url = f"s3://{new_bucket(endpoint)}/st"
        opts = {"endpoint_url": endpoint, "key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"]}
        st = FeatureStore.create(object_store.local_path(url, storage_options=opts), extractor=get_extractor("vectors").info, dim=16, label_names=["0", "1", "2"],
                                 chunk_rows=64)
        embed_into_store(tmp_path / "in.npz", store_path=st.path, batch_rows=50, scheduler=cluster)
        assert np.array_equal(FeatureStore.open(url).read("private", "features"), normalize_rows(x))


@pytest.mark.slow
def test_text_on_workers_is_bit_identical(cluster, tmp_path):
    """The text model on the workers: each reader batch embedded in one call there, as in process."""
    import csv

    with open(REPO / "sample_data" / "ag_news_private.csv") as f:
        rows = list(csv.DictReader(f))[:300]
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ex = get_extractor("text")
    salt = None
    for name in ("inproc", "dask"):
        st = FeatureStore.create(tmp_path / name, extractor=ex.info, dim=ex.dim,
                                 label_names=sorted({r["label"] for r in rows}), chunk_rows=64)
        if salt is not None:  # one content-key salt for both, so their key chunks are comparable
            st.root.attrs.update({"content_key_salt": salt})
        salt = st.key_salt
    embed_into_store(tmp_path / "t.csv", store_path=tmp_path / "inproc", batch_rows=40)
    embed_into_store(tmp_path / "t.csv", store_path=tmp_path / "dask", batch_rows=40, scheduler=cluster)
    fa, fb = _store_files(tmp_path / "inproc"), _store_files(tmp_path / "dask")
    assert fa.keys() == fb.keys() and [k for k in fa if fa[k] != fb[k]] == []
    assert json.loads(fa["private/zarr.json"])["attributes"]["n_rows"] == 300


@pytest.mark.heavy
def test_a_failure_waits_for_running_partitions_before_the_lock_is_released(tmp_path, monkeypatch):
    """A partition fails while others run: Dask's cancel does not stop a running task, which went on writing rows
    into the store after `embed` had failed and released the store's lock (and, on S3, the writer lease), where the
    next writer's rows at the same uncommitted row numbers would be overwritten. `embed` now returns only once no
    partition is running (review 20 of audit 8). In-process workers (threads) so that the task can be slowed."""
    import time

    marks = tmp_path / "finished"  # files, not a list: the task is pickled even for in-process workers
    marks.mkdir()
    orig = dask_embed.embed_partition

    def slow_or_failing(target, role, info, device, dim, chunk, lo, *rest):
        if lo == 37:
            raise RuntimeError("boom")
        time.sleep(1.5)
        out = orig(target, role, info, device, dim, chunk, lo, *rest)
        (marks / str(lo)).touch()
        return out

    monkeypatch.setattr(dask_embed, "embed_partition", slow_or_failing)
    _partitions_of(monkeypatch, 64)
    x, (_, b) = _pair(tmp_path, n=256)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0",
                                  silence_logs=50) as c:
        with pytest.raises(SchedulerError, match="nothing was committed"):
            embed_into_store(tmp_path / "in.npz", store_path=b.path, batch_rows=64, scheduler=c.scheduler_address)
        finished = sorted(int(p.name) for p in marks.iterdir())
        assert finished == [101, 165, 229], f"embed returned while partitions were still writing: {finished}"
    assert FeatureStore.open(b.path).n_rows() == 37


@pytest.mark.heavy
def test_a_drain_that_outlasts_its_bound_says_so(tmp_path, monkeypatch):
    """The wait for running partitions after a failure is bounded (INDKNN_DASK_DRAIN_SECONDS): past it, embed says
    that workers may still be writing, rather than holding the store's lock forever (review 21)."""
    import time

    def slow_or_failing(target, role, info, device, dim, chunk, lo, *rest):
        if lo == 37:
            raise RuntimeError("boom")
        time.sleep(4)
        return []

    monkeypatch.setattr(dask_embed, "embed_partition", slow_or_failing)
    _partitions_of(monkeypatch, 64)
    monkeypatch.setattr(dask_embed, "DRAIN_SECONDS", 0.5)
    x, (_, b) = _pair(tmp_path, n=128)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0",
                                  silence_logs=50) as c:
        with pytest.raises(SchedulerError, match="did not finish within 0 s of a failure"):
            embed_into_store(tmp_path / "in.npz", store_path=b.path, batch_rows=64, scheduler=c.scheduler_address)
    assert FeatureStore.open(b.path).n_rows() == 37
