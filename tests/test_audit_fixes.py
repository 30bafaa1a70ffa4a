"""Findings of the independent privacy audit of issues 15/16/17 (D1–D6), each reproduced through the CLI
on real files: a Zarr store, a Parquet ledger and `python -m indknn_cli` subprocesses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", INDKNN_WIDTH="200",
           INDKNN_AUTO_COMPACT="0")
D = 8


def _cli(cwd: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "indknn_cli", *args], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=cwd, input=stdin)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    return proc


def _priv(path: Path, n: int = 20, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    c = np.zeros(D)
    c[0] = 1
    x = c + 0.05 * rng.standard_normal((n, D))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    np.savez(path, x=x.astype(np.float32), y=rng.integers(0, 2, n), ids=np.array([f"r{i}" for i in range(n)]),
             users=np.array([f"u{i % 4}" for i in range(n)]))


def _queries(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    c = np.zeros(D)
    c[0] = 1
    x = c + 0.05 * rng.standard_normal((n, D))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    np.savez(path, x=x.astype(np.float32), ids=np.array([f"q{seed}-{i}" for i in range(n)]))


def _world(tmp: Path, *, users: bool = False, unit: str = "record") -> None:
    """s.zarr + ledger L (ε = 60: records are selected many times before they retire)."""
    _priv(tmp / "priv.npz")
    for k in (1, 2, 3):
        _queries(tmp / f"q{k}.npz", 40, k)
    emb = _ok(_cli(tmp, "embed", "priv.npz", "--store", "s.zarr", "--role", "private", "--extractor", "vectors",
                   "--label-names", "0,1", "-q", *(["--user-column", "users"] if users else [])))
    _ok(_cli(tmp, "index", "--ledger", "L", "--eps", "60", "--tau", "0.5", "--sigma2", "0.5",
             "--planned-queries", "1000", "--privacy-unit", unit, "-q", stdin=emb.stdout))


def _serve(tmp: Path, q: str, batch: str, *extra: str, store: str = "s.zarr", ledger: str = "L"):
    return _cli(tmp, "serve-queries", q, "--store", store, "--ledger", ledger, "--batch-id", batch, "--device", "cpu",
                *extra)


def _unbind(store: Path) -> None:
    """The audit's D1 attack: delete the binding attribute and the high-water mark."""
    (store / "ledger-mark.json").unlink()
    p = store / "zarr.json"
    d = json.loads(p.read_text())
    del d["attributes"]["ledger_binding"]
    p.write_text(json.dumps(d))


def _spent(tmp: Path, ledger: str = "L") -> float:
    return json.loads(_ok(_cli(tmp, "account", "--ledger", ledger, "--json")).stdout)["spent_median"]


# -- D1 -------------------------------------------------------------------------------------------------
@pytest.mark.heavy
def test_d1_removing_the_binding_and_mark_neither_allows_a_rollback_nor_a_second_ledger(tmp_path):
    _world(tmp_path)
    _ok(_serve(tmp_path, "q1.npz", "b1"))
    shutil.copytree(tmp_path / "L", tmp_path / "Lbak")
    shutil.copytree(tmp_path / "s.zarr", tmp_path / "sbak.zarr")
    _ok(_serve(tmp_path, "q2.npz", "b2"))
    shutil.rmtree(tmp_path / "L")
    shutil.copytree(tmp_path / "Lbak", tmp_path / "L")  # rolled back: b2's charges would be refunded
    _unbind(tmp_path / "s.zarr")
    r = _serve(tmp_path, "q3.npz", "b3")
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert "no binding" in " ".join(r.stderr.split()) and "Traceback" not in r.stderr
    # the same ledger is refused by account --store too (rollback evidence gone, the ledger knows it was bound)
    assert _cli(tmp_path, "account", "--ledger", "L", "--store", "s.zarr", "--json").returncode == 1
    # a second ledger for the stripped copy of the store: refused (exit 2), no ledger folder left behind
    _unbind(tmp_path / "sbak.zarr")
    r2 = _cli(tmp_path, "index", "--store", "sbak.zarr", "--ledger", "L2", "--eps", "60", "--tau", "0.5",
              "--sigma2", "0.5", "-q")
    assert r2.returncode == 2, r2.stderr
    assert "binding is gone" in " ".join(r2.stderr.split())
    assert not (tmp_path / "L2").exists()


@pytest.mark.heavy
def test_d1_index_records_the_binding_in_two_places(tmp_path):
    """The root attribute and a trace in the private group: removing the first leaves the second."""
    _world(tmp_path)
    st = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())["attributes"]
    assert st["ledger_binding"]["ledger_uuid"]
    priv = json.loads((tmp_path / "s.zarr" / "private" / "zarr.json").read_text())["attributes"]
    assert priv["ledger_bound"]["ledger_uuid"] == st["ledger_binding"]["ledger_uuid"]


# -- D2 -------------------------------------------------------------------------------------------------
@pytest.mark.heavy
@pytest.mark.parametrize("unit", ["record", "user"])
def test_d2_an_id_readded_after_a_pending_erasure_joins_its_old_spent_and_serving_goes_on(tmp_path, unit):
    _world(tmp_path, users=True, unit=unit)
    _ok(_serve(tmp_path, "q1.npz", "b1"))
    spent0 = json.loads(_ok(_cli(tmp_path, "account", "--ledger", "L", "--record", "r5", "--json")).stdout)["spent"]
    assert spent0 > 0
    newest = sorted((tmp_path / "L" / "events").glob("*.parquet"))[-1]
    held = tmp_path / "held.parquet"
    newest.rename(held)  # the ledger is unreadable: the erasure is recorded as pending
    _ok(_cli(tmp_path, "delete", "--record", "r5", "--store", "s.zarr", "--ledger", "L", "-q"))
    held.rename(newest)
    x = np.zeros((1, D), np.float32)
    x[0, 0] = 1
    np.savez(tmp_path / "r5.npz", x=x, y=np.array([1]), ids=np.array(["r5"]), users=np.array(["u1"]))
    _ok(_cli(tmp_path, "embed", "r5.npz", "--store", "s.zarr", "--role", "private", "--extractor", "vectors",
             "--user-column", "users", "-q"))
    r = _serve(tmp_path, "q2.npz", "b2")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 40
    assert "r5" not in r.stderr
    rec = json.loads(_ok(_cli(tmp_path, "account", "--ledger", "L", "--record", "r5", "--json")).stdout)
    assert rec["spent"] >= spent0  # the re-added id carries the erased one's spent: no refund


# -- D4 -------------------------------------------------------------------------------------------------
@pytest.mark.heavy
def test_d4_a_batch_refused_by_max_queries_is_not_embedded(tmp_path):
    _world(tmp_path)
    _ok(_serve(tmp_path, "q1.npz", "b1"))
    before = json.loads((tmp_path / "s.zarr" / "queries" / "zarr.json").read_text())["attributes"]
    r = _serve(tmp_path, "q2.npz", "b2", "--max-queries", "60")  # 40 answered + 40 new > 60: refused whole
    assert r.returncode == 3 and r.stdout == "", r.stderr
    assert "20 of T may still be answered" in " ".join(r.stderr.split())
    after = json.loads((tmp_path / "s.zarr" / "queries" / "zarr.json").read_text())["attributes"]
    assert after == before and after["n_rows"] == 40
    _ok(_serve(tmp_path, "q2.npz", "b2", "--max-queries", "80"))  # fits exactly: answered


# -- D3 -------------------------------------------------------------------------------------------------
@pytest.mark.heavy
def test_d3_account_without_store_checks_the_recorded_store_or_says_it_did_not(tmp_path):
    _world(tmp_path)
    _ok(_serve(tmp_path, "q1.npz", "b1"))
    shutil.copytree(tmp_path / "L", tmp_path / "Lbak")
    _ok(_serve(tmp_path, "q2.npz", "b2"))
    shutil.rmtree(tmp_path / "L")
    (tmp_path / "Lbak").rename(tmp_path / "L")  # rolled back
    r = _cli(tmp_path, "account", "--ledger", "L", "--json")
    assert r.returncode == 1 and "rolled back" in " ".join(r.stderr.split()), (r.returncode, r.stderr)
    assert _cli(tmp_path, "account", "--ledger", "L", "--record", "r0", "--json").returncode == 1
    (tmp_path / "s.zarr").rename(tmp_path / "elsewhere.zarr")  # the recorded store is out of reach
    r = _ok(_cli(tmp_path, "account", "--ledger", "L", "--json"))
    assert "unchecked against the store" in " ".join(r.stderr.split())
    assert json.loads(r.stdout)["store_check"]["checked"] is False


# -- a refused index leaves no ledger folder ---------------------------------------------------------------
@pytest.mark.heavy
def test_a_refused_index_leaves_no_half_created_ledger_folder(tmp_path):
    _priv(tmp_path / "priv.npz")
    _ok(_cli(tmp_path, "embed", "priv.npz", "--store", "s.zarr", "--role", "private", "--extractor", "vectors",
             "--label-names", "0,1", "-q"))
    before = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())
    # refused inside the ledger lock (the lock creates the folder): no public rows to tune on
    r = _cli(tmp_path, "index", "--store", "s.zarr", "--ledger", "sub/L", "--eps", "1", "--tune", "public", "-q")
    assert r.returncode == 2 and "no public rows" in r.stderr, r.stderr
    assert not (tmp_path / "sub").exists() and json.loads((tmp_path / "s.zarr" / "zarr.json").read_text()) == before
    # refused before the lock: a parameter out of range
    r = _cli(tmp_path, "index", "--store", "s.zarr", "--ledger", "L", "--eps", "1e308", "-q")
    assert r.returncode == 2 and not (tmp_path / "L").exists()
    assert not (tmp_path / "s.zarr" / "ledger-mark.json").exists()
