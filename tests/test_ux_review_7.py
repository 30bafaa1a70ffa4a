"""Findings of the seventh usability review (a helper run as a new user; summarised in AUDIT_FINDINGS_6.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore

D = 8


def _cli(*args, cwd, stdin=None):
    return subprocess.run([sys.executable, "-m", "indknn_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, input=stdin)


def _ok(p):
    assert p.returncode == 0, p.stderr
    return p


def _bound_store(tmp_path, n=6):
    x = np.random.default_rng(0).standard_normal((n, D))
    np.savez(tmp_path / "base.npz", x=x, y=np.arange(n) % 2, ids=np.array([f"t{i}" for i in range(n)]),
             users=np.array([f"u{i // 2}" for i in range(n)]))
    _ok(_cli("embed", "base.npz", "--store", "s.zarr", "--extractor", "vectors", "--label-names", "0,1", cwd=tmp_path))
    _ok(_cli("index", "--store", "s.zarr", "--ledger", "L", "--eps", "1", "--tau", "0.5", "--planned-queries", "40",
             cwd=tmp_path))  # binds the store


def _record(tmp_path, rid):
    return json.loads(_ok(_cli("account", "--store", "s.zarr", "--ledger", "L", "--record", rid, "--json",
                               cwd=tmp_path)).stdout)


@pytest.mark.heavy
def test_delete_with_a_mistyped_ledger_erases_and_leaves_the_tombstone_pending(tmp_path):
    """Finding 1: `delete` with a --ledger that holds no ledger erased a bound store's row with no tombstone and no
    pending request: `account` showed the record active, `repair` found nothing, `delete --compact` was blocked."""
    _bound_store(tmp_path)
    p = _cli("delete", "--record", "t4", "--store", "s.zarr", "--ledger", "typo", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "cannot be read" in p.stderr and "bound to the ledger" in " ".join(p.stderr.split())
    assert not (tmp_path / "typo").exists()
    st = FeatureStore.open(tmp_path / "s.zarr", mode="r")
    assert st.erase_pending_rows("private").tolist() == [4]  # before: [] (nothing would write the tombstone)
    assert not np.any(st.read("private", "features")[4])
    # the next delete that reads the bound ledger writes the tombstone, and compaction goes on
    c = _cli("delete", "--compact", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path)
    assert c.returncode == 0, c.stderr
    assert _record(tmp_path, "t4")["deleted"] is True
    assert FeatureStore.open(tmp_path / "s.zarr", mode="r").n_rows("private") == 5
    assert BudgetLedger.open(tmp_path / "L").state.deleted.sum() == 1


@pytest.mark.heavy
def test_a_rerun_import_with_if_exists_skip_does_not_bring_back_an_erased_record(tmp_path):
    """Finding 2: the nightly `embed --if-exists skip` re-added a record erased the day before, with no word."""
    _bound_store(tmp_path)
    _ok(_cli("delete", "--record", "t4", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))
    p = _ok(_cli("embed", "base.npz", "--store", "s.zarr", "--if-exists", "skip", cwd=tmp_path))
    out = json.loads(p.stdout)
    assert out["rows_added"] == 0 and out["rows_skipped"] == 6  # before: 1 added (t4 back)
    assert "1 row skipped: their ids were erased" in " ".join(p.stderr.split())
    st = FeatureStore.open(tmp_path / "s.zarr", mode="r")
    assert "t4" not in set(st.record_ids("private").tolist())
    # re-admitting on purpose (relabelling: delete, then embed the same id) still works, and says so
    # under its own user (u2): an erased id keeps its user, so without it the row is refused (review 60, F3; `index`
    # refused it before)
    np.savez(tmp_path / "t4.npz", x=np.ones((1, D)), y=np.array([1]), ids=np.array(["t4"]))
    assert _cli("embed", "t4.npz", "--store", "s.zarr", cwd=tmp_path).returncode == 2
    np.savez(tmp_path / "t4.npz", x=np.ones((1, D)), y=np.array([1]), ids=np.array(["t4"]), users=np.array(["u2"]))
    q = _ok(_cli("embed", "t4.npz", "--store", "s.zarr", cwd=tmp_path))
    assert json.loads(q.stdout)["rows_added"] == 1 and "re-admitted" in q.stderr
    _ok(_cli("index", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path))


def test_index_after_a_failed_embed_in_a_pipe_says_that_no_line_arrived(tmp_path):
    """Finding 3: `embed … | index` whose embed failed made index say "not an indknn feature store" about the
    default store it fell back to."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "INDKNN_STORE"}
    py = f"{sys.executable} -m indknn_cli"
    p = subprocess.run(f"{py} embed missing.csv --store s.zarr | {py} index --ledger L --eps 1 --tau 0.5",
                       shell=True, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "no line from `indknn embed` arrived on stdin" in " ".join(p.stderr.split())
    assert "indknn-store.zarr" not in p.stderr  # review 44: a default store the user never named
    assert not (tmp_path / "L").exists() and not (tmp_path / "indknn-store.zarr").exists()


@pytest.mark.heavy
def test_quiet_silences_a_passed_eps_check_but_not_a_failed_one(tmp_path):
    """Finding 4: `account --eps X -q` printed its passed verdict on stderr, so cron mailed it every night."""
    _bound_store(tmp_path)
    ok = _cli("account", "--ledger", "L", "--eps", "1", "-q", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stderr == "" and ok.stdout == ""
    loud = _cli("account", "--ledger", "L", "--eps", "1", cwd=tmp_path)
    assert loud.returncode == 0 and "check passed" in loud.stderr
    bad = _cli("account", "--ledger", "L", "--eps", "0.5", "-q", cwd=tmp_path)
    assert bad.returncode == 4 and "FAILED" in bad.stderr


@pytest.mark.heavy
def test_an_empty_ids_file_is_a_day_without_requests(tmp_path):
    """Finding 5: `… | indknn delete --ids-file - --strict` on a day with no erasure request exited 2."""
    _bound_store(tmp_path)
    before = {p: p.read_bytes() for p in (tmp_path / "L").rglob("*") if p.is_file() and p.name != "LOCK"}
    p = _cli("delete", "--ids-file", "-", "--strict", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path, stdin="")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["records_erased"] == 0
    assert {p: p.read_bytes() for p in (tmp_path / "L").rglob("*") if p.is_file() and p.name != "LOCK"} == before
    # no ids at all (no file either) is still a usage error, and a missing store is still named
    assert _cli("delete", "--store", "s.zarr", "--ledger", "L", cwd=tmp_path).returncode == 2
    q = _cli("delete", "--ids-file", "-", "--store", "nope.zarr", "--ledger", "L", cwd=tmp_path, stdin="")
    assert q.returncode == 2 and "nope.zarr" in q.stderr


@pytest.mark.heavy
def test_a_subjects_view_says_its_figures_are_exact_and_for_operator_and_subject_only(tmp_path):
    """Finding 6: `account --record/--user` printed exact figures (times selected, spent) with no operator-only
    label, and the calibration line an ε without unit or adjacency."""
    _bound_store(tmp_path)
    for opt, value in (("--record", "t1"), ("--user", "u0")):
        js = json.loads(_ok(_cli("account", "--store", "s.zarr", "--ledger", "L", opt, value, "--json",
                                 cwd=tmp_path)).stdout)
        assert js["operator_only"].startswith("operator-only") and "times_selected" in js["operator_only"]
        text = " ".join(_ok(_cli("account", "--store", "s.zarr", "--ledger", "L", opt, value, cwd=tmp_path)).stdout.split())
        assert "[OPERATOR ONLY] spent, remaining" in text
        assert "[OPERATOR ONLY] operator-only" not in text  # the note is not prefixed twice
        assert "the ledger was calibrated for ε(gdp) = 1 at δ = 1e-05, add/remove one record" in text
