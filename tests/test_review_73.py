"""Review 73 (2026-11-29, a helper as first-time user and cron QA, `/work/review73`): an input column named `user` was
ignored without a word (`--user-column` had no default where `--id-column` defaults to `id`), so a later
`delete --user` matched nothing and exited 0."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.store import FeatureStore

runner = CliRunner()


def _jsonl(path, n=6, d=4):
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"x-{i}", "user": "bob" if i == 2 else f"u{i}", "label": "ab"[i % 2],
                                "vector": rng.standard_normal(d).tolist()}) + "\n")
    return str(path)


@pytest.mark.heavy
def test_a_user_column_is_read_by_default_and_delete_user_erases_it(tmp_path):
    s = str(tmp_path / "s.zarr")
    r = runner.invoke(app, ["embed", _jsonl(tmp_path / "u.jsonl"), "--store", s, "--extractor", "vectors",
                            "--label-names", "a,b"])
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(s, mode="r")
    assert [str(u) for u in st.read("private", "user_id")] == ["u0", "u1", "bob", "u3", "u4", "u5"]
    r = runner.invoke(app, ["index", "--store", s, "--ledger", str(tmp_path / "L"), "--eps", "1", "--tau", "0.5"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["delete", "--user", "bob", "--store", s, "--ledger", str(tmp_path / "L")])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["records_erased"] == 1 and out["users_not_found"] == [], out
    st = FeatureStore.open(s, mode="r")
    assert st.read("private", "deleted")[2] and not st.read("private", "features")[2].any()


def test_user_column_empty_reads_no_user_ids(tmp_path):
    s = str(tmp_path / "s.zarr")
    r = runner.invoke(app, ["embed", _jsonl(tmp_path / "u.jsonl"), "--store", s, "--extractor", "vectors",
                            "--label-names", "a,b", "--user-column", ""])
    assert r.exit_code == 0, r.output
    assert {str(u) for u in FeatureStore.open(s, mode="r").read("private", "user_id")} == {""}
