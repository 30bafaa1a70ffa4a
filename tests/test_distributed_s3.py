"""`serve-queries --scheduler` on a store in object storage (issue 19): the Dask workers re-open the store
from its URL (real S3 server: moto in server mode) and the answers and ledger equal the in-process engine's."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("distributed")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from indknn_cli import distributed  # noqa: E402
from indknn_cli.embedding import embed_into_store  # noqa: E402
from indknn_cli.ledger import BudgetLedger  # noqa: E402
from indknn_cli.serving import build_index, make_params, serve_queries  # noqa: E402
from indknn_cli.store import open_store  # noqa: E402

from .s3_server import moto_server, new_bucket  # noqa: E402
from .conftest import clustered  # noqa: E402


def _world(tmp: Path, url: str, x, y, q) -> Path:
    np.savez(tmp / "priv.npz", x=x, y=y, ids=np.array([f"r{i:04d}" for i in range(len(x))]))
    np.savez(tmp / "q.npz", x=q, ids=np.array([f"q{i:02d}" for i in range(len(q))]))
    embed_into_store(tmp / "priv.npz", store_path=url, extractor="vectors", label_names=["0", "1", "2"])
    lp = tmp / "L"
    build_index(store_path=url, ledger_path=lp, params=make_params(epsilon=0.3, delta=1e-5, tau=0.3, sigma2=0.5,
                                                                     planned_queries=60))
    embed_into_store(tmp / "q.npz", store_path=url, role="query", batch="q1")
    return lp


@pytest.mark.heavy
def test_scheduler_on_an_s3_store_equals_in_process(tmp_path, monkeypatch):
    from distributed import LocalCluster

    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    x, y, _ = clustered(300, 16, 3, seed=1)
    q, _, _ = clustered(30, 16, 3, seed=2)
    q[4] = x[9]
    with moto_server() as endpoint:
        urls = [f"s3://{new_bucket(endpoint)}/s" for _ in range(2)]
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        la, lb = _world(tmp_path / "a", urls[0], x, y, q), _world(tmp_path / "b", urls[1], x, y, q)
        want = serve_queries(store_path=urls[0], ledger_path=la, query_batch="q1", seed=7, batch_size=8)
        # Workers started inside the server's context inherit its endpoint and credentials.
        with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                          silence_logs=logging.ERROR) as cluster:
            got = distributed.serve_queries(scheduler=cluster.scheduler_address, store_path=urls[1],
                                            ledger_path=lb, query_batch="q1", seed=7, batch_size=8)
        assert open_store(urls[1]).remote.url == urls[1]
    key = lambda res: [(a["query_id"], a["label"], a["released_count"]) for a in res.answers]  # noqa: E731
    assert len(want.answers) == 30 and key(got) == key(want)
    sa, sb = BudgetLedger.open(la).state, BudgetLedger.open(lb).state
    assert sa.spent.tobytes() == sb.spent.tobytes() and float(sa.spent.max()) > 0
