"""A store and its ledger copied, and both copies used (review 42, M3): each copy's mark vouched for its own ledger,
so every record could spend its budget once in each copy. A twin at the ledger's recorded store path is refused by
serve-queries and index (exit 2, nothing written); delete still erases and says the other copy holds the rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.deletion import delete_records
from indknn_cli.errors import LedgerError
from indknn_cli.serving import build_index, serve_queries
from indknn_cli.store import FeatureStore

from .conftest import clustered, served_pair

runner = CliRunner()


_pair = served_pair


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.heavy
def test_a_copied_pair_is_refused_while_the_original_is_there_and_delete_still_erases(tmp_path):
    sa, la = _pair(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    sb, lb = tmp_path / "b" / "s.zarr", tmp_path / "b" / "L"
    before = _tree(tmp_path / "b")
    with pytest.raises(LedgerError, match=r"another copy of this store .* is at .*a/s\.zarr"):
        serve_queries(store_path=sb, ledger_path=lb, query_batch="q2", seed=2)
    with pytest.raises(LedgerError, match="another copy of this store"):
        build_index(store_path=sb, ledger_path=lb, params=None)
    # the CLI, with a query FILE: refused before the file is embedded
    qfile = tmp_path / "q.npy"
    np.save(qfile, clustered(4, 16, 3, seed=8)[0])
    res = runner.invoke(app, ["serve-queries", str(qfile), "--store", str(sb), "--ledger", str(lb)])
    assert res.exit_code == 2 and "another copy of this store" in res.stderr and res.stdout == "", res.output
    assert _tree(tmp_path / "b") == before
    # the original serves as before
    serve_queries(store_path=sa, ledger_path=la, query_batch="q2", seed=2)
    # an erasure in the copy is never blocked; the result says the other copy still holds the rows (exit 1)
    res = delete_records(store_path=sb, ledger_path=lb, record_ids=["r007"])
    assert res.records_erased == 1 and "another copy of this store" in (res.physical_erasure or "")
    assert "r007" not in [str(r) for r in FeatureStore.open(sb, mode="r").read("private", "record_id")]
    res = runner.invoke(app, ["delete", "--store", str(sb), "--ledger", str(lb), "--record", "r008"])
    assert res.exit_code == 1 and str(sa) in " ".join(res.stderr.split()), res.output
    # the original removed (renamed): the copy is the pair now
    (tmp_path / "a").rename(tmp_path / "a-old")
    shutil.rmtree(tmp_path / "a-old")
    serve_queries(store_path=sb, ledger_path=lb, query_batch="q2", seed=2)


def test_a_moved_pair_serves(tmp_path):
    _pair(tmp_path / "a")
    (tmp_path / "a").rename(tmp_path / "m")
    out = serve_queries(store_path=tmp_path / "m" / "s.zarr", ledger_path=tmp_path / "m" / "L", query_batch="q2",
                        seed=2)
    assert out.newly_answered == 10
    res = runner.invoke(app, ["account", "--ledger", str(tmp_path / "m" / "L"), "--store", str(tmp_path / "m" / "s.zarr"),
                              "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["queries_answered"] == 20, res.output
