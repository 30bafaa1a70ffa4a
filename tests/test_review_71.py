"""Review 71 (2026-11-29, a helper as privacy auditor of what query-senders see, `/work/review71`):
F1, a user-unit ledger created with no record (every store row erased before `index`) made `serve-queries` exit 1
with an internal IndexError where one user more answered every query; F2, under the record unit a new record of a
user started at the largest spent of that user's erased records, so an erased record changed what other records
released, uncharged."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app

runner = CliRunner()


def _world(root, n):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    np.savez(root / "p.npz", x=x, y=np.array(list("ab"))[np.arange(n) % 2], ids=np.array([f"r{i}" for i in range(n)]),
             users=np.array([f"u{i}" for i in range(n)]))
    q = rng.standard_normal((3, 8)).astype(np.float32)
    np.save(root / "q.npy", q / np.linalg.norm(q, axis=1, keepdims=True))
    s, L = str(root / "s.zarr"), str(root / "L")
    assert runner.invoke(app, ["embed", str(root / "p.npz"), "--store", s, "--role", "private", "--extractor",
                               "vectors", "--label-names", "a,b"]).exit_code == 0
    assert runner.invoke(app, ["delete", "--store", s, "--ledger", L, "--record", "r0"]).exit_code == 0
    assert runner.invoke(app, ["index", "--store", s, "--ledger", L, "--eps", "1", "--delta", "1e-5", "--tau", "0.5",
                               "--sigma2", "0.5", "--planned-queries", "100", "--privacy-unit", "user"]).exit_code == 0
    return runner.invoke(app, ["serve-queries", str(root / "q.npy"), "--store", s, "--ledger", L, "--seed", "3",
                               "--batch-id", "b1", "--device", "cpu"])


@pytest.mark.heavy
def test_user_unit_ledger_without_records_answers_like_one_with_a_record(tmp_path):
    (tmp_path / "A").mkdir(); (tmp_path / "B").mkdir()
    a, b = _world(tmp_path / "A", 1), _world(tmp_path / "B", 2)
    assert b.exit_code == 0
    assert a.exit_code == b.exit_code  # before: 1 (Internal error: IndexError) against 0
    assert len(a.stdout.splitlines()) == len(b.stdout.splitlines()) == 3


def _day2(root, with_old: bool):
    d = 16
    rng = np.random.default_rng(7)
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
    a, c = basis[0], basis[1]
    others = np.repeat(basis[2:6], 8, axis=0) + 0.01 * rng.standard_normal((32, d)).astype(np.float32)
    new = c + 0.05 * rng.standard_normal((40, d)).astype(np.float32)
    x = np.vstack([others, a[None]]) if with_old else others
    ids = [f"o{i}" for i in range(32)] + (["r_old"] if with_old else [])
    users = [f"v{i % 8}" for i in range(32)] + (["u"] if with_old else [])
    np.savez(root / "p.npz", x=x, y=np.array(list("abc"))[np.arange(len(x)) % 3], ids=np.array(ids),
             users=np.array(users))
    np.savez(root / "p2.npz", x=new, y=np.array(["a"] * 40), ids=np.array([f"n{i}" for i in range(40)]),
             users=np.array(["u"] * 40))
    np.save(root / "q1.npy", a[None]); np.save(root / "q2.npy", np.repeat(c[None], 5, axis=0))
    s, L = str(root / "s.zarr"), str(root / "L")
    ok = lambda args: runner.invoke(app, args).exit_code == 0  # noqa: E731
    assert ok(["embed", str(root / "p.npz"), "--store", s, "--role", "private", "--extractor", "vectors",
               "--label-names", "a,b,c"])
    assert ok(["index", "--store", s, "--ledger", L, "--eps", "1", "--delta", "1e-5", "--tau", "0.5", "--sigma2",
               "0.5", "--sigma1", "5", "--k-min", "1"])
    assert ok(["serve-queries", str(root / "q1.npy"), "--store", s, "--ledger", L, "--batch-id", "day1", "--device",
               "cpu", "--seed", "1"])
    assert ok(["delete", "--store", s, "--ledger", L, "--record", "r_old"])
    assert ok(["embed", str(root / "p2.npz"), "--store", s, "--role", "private", "--extractor", "vectors"])
    res = runner.invoke(app, ["serve-queries", str(root / "q2.npy"), "--store", s, "--ledger", L, "--batch-id",
                              "day2", "--device", "cpu", "--seed", "2"])
    assert res.exit_code == 0
    return [json.loads(line)["released_count"] for line in res.stdout.splitlines() if line.startswith("{")]


@pytest.mark.heavy
def test_an_erased_record_does_not_change_what_other_records_of_its_user_release(tmp_path):
    (tmp_path / "D0").mkdir(); (tmp_path / "D1").mkdir()
    # the same noise (seed, batch id) and the same 40 new records: only r_old's presence differs
    assert _day2(tmp_path / "D0", False) == _day2(tmp_path / "D1", True)  # before: [35.87, …] against [1.0, …]
