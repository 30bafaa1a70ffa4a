"""The feature store on object storage (issue 19), against a real S3-compatible server (moto in server
mode, HTTP on 127.0.0.1): embed, index, serve, delete with physical erasure, compact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from indknn_cli import object_store
from indknn_cli.deletion import delete_records
from indknn_cli.embedding import embed_into_store
from indknn_cli.errors import StoreError
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import FeatureStore, normalize_rows, open_store

from .conftest import clustered
from .s3_server import moto_server, new_bucket, raw_objects

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

REPO = Path(__file__).resolve().parents[1]
PARAMS = dict(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100)


@pytest.fixture(scope="module")
def s3():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def _inputs(tmp_path: Path, n: int = 300, d: int = 16):
    x, y, _ = clustered(n, d, 3, seed=1)
    np.savez(tmp_path / "priv.npz", x=x, y=y, ids=np.array([f"r{i:04d}" for i in range(n)]))
    q, _, _ = clustered(20, d, 3, seed=2)
    np.savez(tmp_path / "q.npz", x=q, ids=np.array([f"q{i:02d}" for i in range(20)]))
    return normalize_rows(x)


@pytest.mark.heavy
def test_round_trip_with_physical_erasure(s3, state, tmp_path):
    """embed → index → embed queries → serve → delete (the vector's bytes are in no object of the bucket
    afterwards) → compact (new prefix, old one removed, ledger bound and verified)."""
    bucket = new_bucket(s3)
    url = f"s3://{bucket}/stores/s1"
    x = _inputs(tmp_path)
    res = embed_into_store(tmp_path / "priv.npz", store_path=url, extractor="vectors", label_names=["0", "1", "2"])
    assert res.store == url and res.rows_added == 300
    store = open_store(url)  # the library's one opener of a store, local path or URL
    assert store.remote.url == url and store.remote.options == {"endpoint_url": s3}
    assert store.path == object_store.state_dir(url) and store.path.is_relative_to(state)
    assert np.array_equal(store.read("private", "features"), x)
    lp = tmp_path / "ledger"
    build_index(store_path=url, ledger_path=lp, params=make_params(**PARAMS))
    embed_into_store(tmp_path / "q.npz", store_path=url, role="query", batch="q1")
    out = serve_queries(store_path=store.path, ledger_path=lp, query_batch="q1", seed=3)
    assert len(out.answers) == 20

    victim = x[7].tobytes()
    assert any(victim in body for body in raw_objects(s3, bucket).values())  # the check can see it
    res = delete_records(store_path=url, ledger_path=lp, record_ids=["r0007"])
    assert res.records_erased == 1
    assert not any(victim in body for body in raw_objects(s3, bucket).values())
    assert open_store(url).record_ids()[7] == ""

    res = delete_records(store_path=url, ledger_path=lp, compact=True)
    assert res.compaction["store_rows_removed"] == 1
    after = open_store(url)
    assert after.remote.url.startswith(url + ".compacted-") and after.n_rows() == 299
    keys = raw_objects(s3, bucket)
    # old prefix gone; beside the store's name only its small objects stay (the ledger's high-water mark; a lease
    # while a writer holds it), none of them under the old prefix
    beside = {k for k in keys if k.startswith("stores/s1.indknn-")}
    assert {k.split("@")[0] for k in beside} == {"stores/s1.indknn-mark.json"}  # (raw_objects: key@version)
    assert keys and all(k.startswith(after.remote.url.split("/", 3)[3] + "/") for k in set(keys) - beside)
    assert np.array_equal(after.read("private", "features"), np.delete(x, 7, axis=0))
    # (serving again and `account --verify` after the compaction: test_cli_round_trip, slow)


def test_versioned_bucket_is_refused(s3, state, tmp_path):
    bucket = new_bucket(s3, versioned=True)
    _inputs(tmp_path)
    with pytest.raises(StoreError, match="versioning enabled"):
        embed_into_store(tmp_path / "priv.npz", store_path=f"s3://{bucket}/s", extractor="vectors",
                         label_names=["0", "1", "2"])
    assert raw_objects(s3, bucket) == {}  # nothing written


def test_unreachable_endpoint_is_a_store_error(state, tmp_path, monkeypatch):
    from .s3_server import S3_ENV, free_port

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("INDKNN_STORAGE_OPTIONS", json.dumps({"config_kwargs": {"retries": {"max_attempts": 1}}}))
    with pytest.raises(StoreError, match="cannot reach the object store"):
        open_store("s3://nobucket/s")


def test_storage_options_from_env(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://a:1")
    monkeypatch.setenv("INDKNN_STORAGE_OPTIONS", '{"anon": false}')
    assert object_store.storage_options("s3://b/p") == {"endpoint_url": "http://a:1", "anon": False}
    monkeypatch.setenv("INDKNN_STORAGE_OPTIONS", "[1]")
    with pytest.raises(Exception, match="JSON object"):
        object_store.storage_options("s3://b/p")
    assert not object_store.is_url("/tmp/x") and object_store.is_url("s3://b/p")
    assert object_store.local_path("file:///tmp/x") == Path("/tmp/x")


@pytest.mark.slow
def test_cli_round_trip(s3, state, tmp_path):
    """The commands as a user types them, with an s3:// --store and an LSH index."""
    bucket = new_bucket(s3)
    url = f"s3://{bucket}/st"
    _inputs(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def indknn(*args, stdin=None):
        p = subprocess.run([sys.executable, "-m", "indknn_cli", *args], input=stdin, capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout

    line = indknn("embed", "priv.npz", "--store", url, "--extractor", "vectors", "--label-names", "0,1,2")
    assert json.loads(line)["store"] == url
    indknn("index", "--ledger", "led", "--kind", "lsh", "--eps", "1", "--delta", "1e-5", "--tau", "0.5",
           "--sigma2", "0.5", "--planned-queries", "100", stdin=line)
    answers = indknn("serve-queries", "q.npz", "--store", url, "--ledger", "led", "--batch-id", "b1").splitlines()
    assert len(answers) == 20
    indknn("delete", "--record", "r0003", "--store", url, "--ledger", "led", "--compact")
    indknn("account", "--ledger", "led", "--store", url, "--verify")
    again = indknn("serve-queries", "q.npz", "--store", url, "--ledger", "led", "--batch-id", "b2").splitlines()
    assert len(again) == 20
    assert FeatureStore.open(url).n_rows() == 299


@pytest.mark.heavy
def test_an_erasure_with_an_unreadable_ledger_reaches_a_stopped_compactions_copy_in_the_bucket(s3, state, tmp_path,
                                                                                               monkeypatch):
    """Review 32, F5 (open for object storage until 2026-11-28): a compaction stopped after it copied the store to
    `<name>.compacted-<token>`, then the ledger became unreadable. `delete --record X` erased X in the live prefix
    only; the compaction's copy in the bucket kept X's vector, and nothing removed it while the ledger could not be
    read. The erasure now reaches the copy too (local copies were reached since review 32)."""
    from indknn_cli import deletion

    from .test_delete import Crash, _crash_at

    bucket = new_bucket(s3)
    url = f"s3://{bucket}/stores/s1"
    x = _inputs(tmp_path)
    embed_into_store(tmp_path / "priv.npz", store_path=url, extractor="vectors", label_names=["0", "1", "2"])
    lp = tmp_path / "ledger"
    build_index(store_path=url, ledger_path=lp, params=make_params(**PARAMS))
    delete_records(store_path=url, ledger_path=lp, record_ids=["r0001"])
    _crash_at(monkeypatch, "compact-ledger-prepared")
    with pytest.raises(Crash):
        delete_records(store_path=url, ledger_path=lp, compact=True)
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    victim = x[9].tobytes()
    holding = [k for k, body in raw_objects(s3, bucket).items() if victim in body]
    assert any(".compacted-" in k for k in holding) and any(".compacted-" not in k for k in holding)

    (lp / "CURRENT").write_text("garbage{")  # the ledger unreadable: no recovery step can run
    res = delete_records(store_path=url, ledger_path=lp, record_ids=["r0009"])
    assert res.records_erased == 1 and res.ledger_unreadable
    assert not any(victim in body for body in raw_objects(s3, bucket).values())


@pytest.mark.heavy
def test_verify_against_a_local_copy_of_a_bucket_store_still_sees_the_state_folders_mark(s3, state, tmp_path):
    """Review 50, F2: for a store on object storage the ledger records the store's state folder (its mark, no
    zarr.json), so `account --verify --store LOCAL_COPY` checked the copy's own, older mark alone and passed a
    ledger rolled back to it; and without --store it said "none at the recorded" state folder. The mark at the
    recorded path (which reads the bucket's too) is checked whenever it is this ledger's."""
    import shutil

    import s3fs

    from indknn_cli.ledger_mark import MARK_NAME
    from indknn_cli.ledger_verify import verify_ledger

    bucket = new_bucket(s3)
    url = f"s3://{bucket}/stores/s1"
    _inputs(tmp_path, n=60)
    embed_into_store(tmp_path / "priv.npz", store_path=url, extractor="vectors", label_names=["0", "1", "2"])
    lp = tmp_path / "ledger"
    build_index(store_path=url, ledger_path=lp, params=make_params(**PARAMS))
    embed_into_store(tmp_path / "q.npz", store_path=url, role="query", batch="q1")
    sp = object_store.state_dir(url)
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q1", batch_size=5, seed=3)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3})
    fs.get(f"{bucket}/stores/s1", str(tmp_path / "old.zarr"), recursive=True)  # a backup of the store's objects
    shutil.copy(sp / MARK_NAME, tmp_path / "old.zarr" / MARK_NAME)  # with its mark, as a pair backed up
    shutil.copytree(lp, tmp_path / "L_old")
    embed_into_store(tmp_path / "q.npz", store_path=url, role="query", batch="q2")
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", batch_size=5, seed=4)  # charges after it
    shutil.rmtree(lp)
    shutil.copytree(tmp_path / "L_old", lp)  # the rollback
    v = verify_ledger(lp, store_path=tmp_path / "old.zarr")
    assert not v["verified"] and "rolled back" in v["error"] and str(sp) in v["error"], v
    v = verify_ledger(lp)
    assert not v["verified"] and "rolled back" in v["error"] and "none at the recorded" not in v["error"], v
