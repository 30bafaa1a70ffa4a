"""Audit 8 (object storage and the Dask candidate phase): each finding's test fails on the code before its fix.

F2: on object storage an erasure that empties a whole chunk made zarr *delete* the chunk object through a bulk
delete whose per-key errors s3fs ignores (a role without delete permission: S3 answers 200 with AccessDenied per
key), and compaction's removal of the old prefix likewise: `delete` reported success and the vectors stayed.
The bulk delete is made to fail per key (the keys are dropped from the request, which is what S3's answer
amounts to); the store and the server are real (moto).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from .conftest import clustered
from .s3_server import moto_server, new_bucket, raw_objects

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

PARAMS = dict(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100)


@pytest.fixture(scope="module")
def s3():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def _store(tmp_path: Path, endpoint: str, *, n: int, d: int, users=None):
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import normalize_rows

    x, y, _ = clustered(n, d, 3, seed=1)
    x = normalize_rows(x)
    extra = {} if users is None else {"users": np.asarray(users)}
    np.savez(tmp_path / "p.npz", x=x, y=y, ids=np.array([f"r{i:04d}" for i in range(n)]), **extra)
    url = f"s3://{new_bucket(endpoint)}/s"
    embed_into_store(tmp_path / "p.npz", store_path=url, extractor="vectors", label_names=["0", "1", "2"])
    build_index(store_path=url, ledger_path=tmp_path / "L", params=make_params(**PARAMS))
    return url, x


def _holding(endpoint: str, url: str, vector: np.ndarray) -> list[str]:
    bucket = url.split("/")[2]
    return [k for k, v in raw_objects(endpoint, bucket).items() if vector.astype(np.float32).tobytes() in v]


def test_f2_erasing_a_whole_chunk_writes_it_so_a_refused_delete_cannot_leave_the_vectors(s3, state, tmp_path,
                                                                                         monkeypatch):
    import s3fs

    from indknn_cli import object_store
    from indknn_cli.deletion import delete_records

    url, x = _store(tmp_path, s3, n=600, d=384, users=["big"] * 512 + [f"u{i}" for i in range(88)])
    assert object_store.open_store(url).chunk_rows == 512  # user "big" owns all of chunk 0

    async def no_delete_permission(self, pathlist, **kw):  # every key refused inside a 200 answer
        return []

    with monkeypatch.context() as mp:
        mp.setattr(s3fs.S3FileSystem, "_bulk_delete", no_delete_permission)
        r = delete_records(store_path=url, ledger_path=tmp_path / "L", user_ids=["big"])
    assert r.records_erased == 512
    st = object_store.open_store(url)
    assert not np.any(st.read("private", "features", 0, 512))  # the store reads back zeros
    assert _holding(s3, url, x[0]) == []  # and no object holds the erased vector


def test_f2_a_failed_removal_of_the_old_prefix_is_an_error_that_keeps_its_pointer(s3, state, tmp_path,
                                                                                   monkeypatch):
    import s3fs

    from indknn_cli import object_store
    from indknn_cli.deletion import delete_records
    from indknn_cli.errors import StoreError

    url, x = _store(tmp_path, s3, n=300, d=16)
    real = s3fs.S3FileSystem._bulk_delete

    async def flaky(self, pathlist, **kw):  # the old prefix's first feature chunk refused, the rest deleted
        return await real(self, [p for p in pathlist if not ("features/c/0" in p and ".compacted-" not in p)], **kw)

    with monkeypatch.context() as mp, pytest.raises(StoreError, match="could not be removed"):
        mp.setattr(s3fs.S3FileSystem, "_bulk_delete", flaky)
        delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0003"], compact=True)
    assert _holding(s3, url, x[10])  # the old prefix's chunk is still there, and still named by a state folder:
    delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0010"], compact=True)
    assert _holding(s3, url, x[10]) == []  # the next command removes it (and r0010 is erased in the store)
    st = object_store.open_store(url)
    assert st.n_rows("private") == 298
