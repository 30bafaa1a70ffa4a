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

from .test_review_54 import pair  # noqa: F401 (the fixture)

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


@pytest.mark.heavy
def test_f0_account_flags_a_ledger_with_seeded_answers_and_its_eps_check_fails(vector_store, tmp_path):
    """F0: `serve-queries --seed N` on a real ledger prints the seed with every answer, so anyone can recompute the
    noise (the reviewer recovered the exact count near each query); `account` still showed ε = 1 and `account --eps 1`
    passed. It now says so, and the check fails, also after the ledger is compacted (the answers file's footer)."""
    from indknn_cli.ledger import BudgetLedger

    s, lp = str(vector_store.path), str(tmp_path / "L")
    assert runner.invoke(app, ["index", "--store", s, "--ledger", lp, "--eps", "1", "--tau", "0.5"]).exit_code == 0
    r = runner.invoke(app, ["serve-queries", "q1", "--store", s, "--ledger", lp, "--batch-id", "b0"])
    assert r.exit_code == 0, r.output
    ok = runner.invoke(app, ["account", "--ledger", lp, "--eps", "1", "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["seeded_answers"] == 0, ok.output
    r = runner.invoke(app, ["serve-queries", "q1", "--store", s, "--ledger", lp, "--batch-id", "b1", "--seed", "3"])
    assert r.exit_code == 0, r.output
    for compacted in (False, True):
        if compacted:  # the answers move into the snapshot's answers file, counted in its footer
            r = runner.invoke(app, ["delete", "--compact", "--store", s, "--ledger", lp])
            assert r.exit_code == 0, r.output
            assert BudgetLedger.open(lp).state._answers_src.summary["seeded"] == 40
        a = runner.invoke(app, ["account", "--ledger", lp])
        assert a.exit_code == 0 and "released with a fixed --seed" in " ".join(a.stdout.split()), a.output
        c = runner.invoke(app, ["account", "--ledger", lp, "--eps", "1", "--json"])
        assert c.exit_code != 0, c.output
        assert json.loads(c.stdout)["seeded_answers"] == 40 and "fixed --seed" in " ".join(c.stderr.split())
    v = runner.invoke(app, ["account", "--ledger", lp, "--store", s, "--verify"])
    assert v.exit_code == 0, v.output  # the footer's count is checked against the rows


def test_f16_a_missing_chunk_fails_verify_and_a_chunk_of_erased_rows_does_not(pair):  # noqa: F811
    """F16: a private chunk file removed (a partial restore, a failed copy) read back as zeros and labels -1:
    `serve-queries` answered without its records and `account --verify` passed. A chunk every row of which was erased
    may be absent (zarr stores no chunk of fill values only): that one is not refused."""
    sp, lp = pair
    ids = [f"r{i:03d}" for i in range(16)]  # rows 0-15: the first chunk
    r = runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp),
                            *sum((["--record", i] for i in ids), [])])
    assert r.exit_code == 0, r.output
    (sp / "private" / "features" / "c" / "0" / "0").unlink()  # erased rows only: an absent chunk is theirs
    v = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert v.exit_code == 0, v.output
    chunk = sp / "private" / "features" / "c" / "1" / "0"  # rows 16-31, live
    chunk.unlink()
    v = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"])
    assert v.exit_code != 0 and "is missing" in " ".join(v.output.split()), v.output


def test_f13_labels_are_compared_in_nfc(tmp_path):
    """F13: a label written decomposed (macOS tools, some exports) against --label-names typed composed was refused
    as "unknown label 'Café'; the store's labels are ['Café', 'Tea']"; labels are compared in NFC, as ids are."""
    nfc, nfd = "Caf\u00e9", "Cafe\u0301"
    p = tmp_path / "u.jsonl"
    p.write_text(json.dumps({"id": "a1", "label": nfd, "vector": [1, 2, 3]}) + "\n"
                 + json.dumps({"id": "a2", "label": "Tea", "vector": [3, 2, 1]}) + "\n")
    s = str(tmp_path / "s.zarr")
    r = runner.invoke(app, ["embed", str(p), "--store", s, "--extractor", "vectors", "--label-names", f"{nfc},Tea"])
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(s, mode="r")
    assert list(st.read("private", "labels")) == [0, 1] and list(st.label_names) == [nfc, "Tea"]


@pytest.mark.heavy
def test_f15_a_stored_batch_answered_under_another_batch_id_says_so(vector_store, tmp_path):
    """F15: `serve-queries q1 --batch-id b2` answered q1's queries again, charged, without a word on the two names."""
    s, lp = str(vector_store.path), str(tmp_path / "L")
    assert runner.invoke(app, ["index", "--store", s, "--ledger", lp, "--eps", "1", "--tau", "0.5"]).exit_code == 0
    r = runner.invoke(app, ["serve-queries", "q1", "--store", s, "--ledger", lp, "--batch-id", "b2"])
    assert r.exit_code == 0, r.output
    assert "query batch 'q1' is answered under --batch-id 'b2'" in " ".join(r.stderr.split())
    r = runner.invoke(app, ["serve-queries", "q1", "--store", s, "--ledger", lp])
    assert r.exit_code == 0 and "answered under" not in r.stderr
