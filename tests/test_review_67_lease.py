"""Review 67, F1: a store writer lease left in the bucket by another machine (a crashed coordinator) made
`indknn delete --record X` exit 1 with nothing recorded, while `serve-queries` of a query batch embedded in advance
(which needs no store writer lease) kept selecting and charging X. Now the erasure is recorded in the ledger (the
ledger is local; its ledger-writer lease is another object) and X is never selected again; the physical overwrite of
X's row waits for the lease and the next `indknn delete` holding it finishes it. Real moto server.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from .conftest import clustered
from .s3_server import new_bucket

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from indknn_cli.cli.app import app  # noqa: E402
from indknn_cli.ledger import BudgetLedger  # noqa: E402
from indknn_cli.store import open_store  # noqa: E402

from .test_object_store import s3  # noqa: E402,F401 (the moto server fixture)

runner = CliRunner()
X = "r0008"


def _world(tmp_path: Path, endpoint: str, monkeypatch) -> str:
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import normalize_rows

    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    x, y, _ = clustered(60, 8, 2, seed=1)
    np.savez(tmp_path / "p.npz", x=normalize_rows(x), y=y, ids=np.array([f"r{i:04d}" for i in range(60)]))
    q = x[:40] + 0.01  # queries beside the private rows: X is a neighbour of its own query
    for name, part in (("day1", q[:20]), ("day2", q[20:] * 0 + q[8])):
        np.savez(tmp_path / f"{name}.npz", x=part, ids=np.array([f"{name}-{i}" for i in range(len(part))]))
    url = f"s3://{new_bucket(endpoint)}/p/store"
    embed_into_store(tmp_path / "p.npz", store_path=url, extractor="vectors", label_names=["0", "1"])
    for name in ("day1", "day2"):  # day2: tomorrow's batch, embedded in advance
        embed_into_store(tmp_path / f"{name}.npz", store_path=url, role="query", batch=name)
    build_index(store_path=url, ledger_path=tmp_path / "L",
                params=make_params(epsilon=5.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100))
    return url


def _plant_foreign_lease(url: str) -> str:
    from indknn_cli import object_store, store_lease

    st = open_store(url)
    lease = store_lease.lease_url(st.remote)
    object_store.filesystem(st.remote).pipe_file(lease, json.dumps(
        {"token": "deadbeef", "machine": "m2", "host": "otherhost", "boot": "x", "pid": 1, "since": 0}).encode())
    return lease


def _times_selected(ledger: Path) -> int:
    s = BudgetLedger.open(ledger).state
    return int(s.times_selected[list(s.record_id).index(X)])


def _row_of_x(url: str) -> int:
    return int(np.flatnonzero(open_store(url).read("private", "record_id") == X)[0])


@pytest.mark.heavy
def test_f1_a_foreign_writer_lease_records_the_erasure_and_serving_never_selects_it_again(s3, tmp_path, monkeypatch):
    url = _world(tmp_path, s3, monkeypatch)
    led = tmp_path / "L"
    row = _row_of_x(url)
    before = _times_selected(led)
    _plant_foreign_lease(url)
    r = runner.invoke(app, ["delete", "--record", X, "--store", url, "--ledger", str(led), "--lock-timeout", "0.5"])
    assert r.exit_code == 1, r.output
    msg = " ".join(r.output.split())
    assert "recorded" in msg and "never selected again" in msg and "otherhost" in msg and "break-lease" in msg
    assert "nothing was written" not in msg
    a = runner.invoke(app, ["account", "--ledger", str(led), "--store", url, "--record", X, "--json"])
    assert a.exit_code == 0, a.output
    assert json.loads(a.stdout)["deleted"] is True
    # the store row is untouched (nothing written without the lease) ...
    assert open_store(url).read("private", "record_id")[row] == X
    # ... and a stored batch served now never selects X
    s = runner.invoke(app, ["serve-queries", "--batch-id", "day2", "--store", url, "--ledger", str(led),
                            "--lock-timeout", "0.5"])
    assert s.exit_code == 0, s.output
    assert _times_selected(led) == before
    state = BudgetLedger.open(led).state
    assert X not in {str(r) for r, d in zip(state.record_id, state.deleted) if not d}  # never re-added
    v = runner.invoke(app, ["account", "--ledger", str(led), "--store", url, "--verify"])
    assert v.exit_code == 0, v.output


@pytest.mark.heavy
@pytest.mark.parametrize("next_ids", ["other-id", "empty-ids-file", "serve"])
def test_f1_the_next_delete_holding_the_lease_overwrites_the_row_in_the_bucket(s3, tmp_path, monkeypatch, next_ids):
    from indknn_cli import store_lease

    url = _world(tmp_path, s3, monkeypatch)
    led = tmp_path / "L"
    row = _row_of_x(url)
    lease = _plant_foreign_lease(url)
    r = runner.invoke(app, ["delete", "--record", X, "--store", url, "--ledger", str(led), "--lock-timeout", "0.5"])
    assert r.exit_code == 1, r.output
    assert store_lease.break_lease(url, token="deadbeef")["removed"] == lease
    (tmp_path / "none.txt").write_text("")
    ids = ["--record", "r0011"] if next_ids == "other-id" else ["--ids-file", str(tmp_path / "none.txt")]
    r = runner.invoke(app, ["delete", *ids, "--store", url, "--ledger", str(led)] if next_ids != "serve" else
                      ["serve-queries", "--batch-id", "day2", "--store", url, "--ledger", str(led)])
    assert r.exit_code == 0, r.output
    st = open_store(url)  # read back from the bucket
    assert st.read("private", "record_id")[row] == ""
    assert not np.any(st.read("private", "features")[row])
    assert bool(st.read("private", "deleted")[row])
    assert st.erase_pending_rows("private").size == 0
