"""--verbose on every command (review 48, F3: it added nothing except in serve-queries): the store and ledger used and
where each came from, lock waits, each step's own log line and the time taken; never a record id."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger

runner = CliRunner()
SECRET = "secret-id"  # the prefix of every record id: none may reach stderr


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "p.npz", x=rng.standard_normal((40, 8)).astype("f4"), y=np.array(["a", "b"] * 20),
             ids=np.array([f"{SECRET}-{i}" for i in range(40)]))
    np.save(tmp_path / "q.npy", rng.standard_normal((5, 8)).astype("f4"))
    return tmp_path / "s.zarr", tmp_path / "L"


def _both(args, env=None):
    plain = runner.invoke(app, args, env=env)
    verbose = runner.invoke(app, [*args, "-v"], env=env)
    return plain, verbose


@pytest.mark.heavy
def test_verbose_adds_detail_to_every_command(pair, tmp_path, monkeypatch):
    sp, lp = pair
    monkeypatch.chdir(tmp_path)
    embed = ["embed", str(tmp_path / "p.npz"), "--store", str(sp), "--extractor", "vectors", "--label-names", "a,b"]
    v = runner.invoke(app, [*embed, "-v"])
    assert v.exit_code == 0, v.output
    said = v.stderr
    assert f"store: {sp} (--store)" in said and "extractor vectors" in said and "40 rows written" in said
    assert "indknn embed: finished in" in said and "exit 0" in said
    runs = {
        "index": ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "1", "--tau", "0.2"],
        "account": ["account", "--store", str(sp), "--ledger", str(lp)],
        "delete": ["delete", "--record", f"{SECRET}-3", "--store", str(sp), "--ledger", str(lp), "--dry-run"],
        "repair": ["repair", "--store", str(sp), "--ledger", str(lp), "--dry-run"],
        "serve-queries": ["serve-queries", str(tmp_path / "q.npy"), "--store", str(sp), "--ledger", str(lp),
                          "--device", "cpu", "--seed", "1"],
    }
    for name, args in runs.items():
        plain, verbose = _both(args)
        assert plain.exit_code == verbose.exit_code == 0, (name, plain.output, verbose.output)
        assert plain.stdout.count("\n") == verbose.stdout.count("\n"), name  # stdout carries the same data
        extra = [ln for ln in _lines(verbose.stderr) if ln not in _lines(plain.stderr)]
        assert extra, name
        assert f"store: {sp} (--store)" in verbose.stderr and f"ledger: {lp} (--ledger)" in verbose.stderr, name
        assert SECRET not in verbose.stderr, (name, verbose.stderr)
        # serve-queries keeps its stderr to public figures: no wall time (it depends on the private data)
        assert ("finished in" in verbose.stderr) == (name != "serve-queries"), (name, verbose.stderr)
    _, verbose = _both(runs["index"])
    assert "new records added to the ledger" in verbose.stderr or "0 new records" in verbose.stderr


def test_verbose_says_where_the_paths_came_from_and_a_blank_variable_is_unset(pair, tmp_path, monkeypatch):
    sp, lp = pair
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, ["embed", str(tmp_path / "p.npz"), "--store", str(sp), "--extractor", "vectors",
                               "--label-names", "a,b", "-q"]).exit_code == 0
    r = runner.invoke(app, ["index", "--eps", "1", "-v"], env={"INDKNN_STORE": str(sp), "INDKNN_LEDGER": str(lp)})
    assert r.exit_code == 0, r.output
    assert f"store: {sp} (from $INDKNN_STORE)" in r.stderr and f"ledger: {lp} (from $INDKNN_LEDGER)" in r.stderr
    # review 48, F7: a blank $INDKNN_STORE was taken as a path named by its spaces; unset now, as an empty one
    r = runner.invoke(app, ["account", "-v"], env={"INDKNN_STORE": "   ", "INDKNN_LEDGER": "  "})
    assert r.exit_code == 2
    said = " ".join(r.stderr.split())
    assert "ledger: indknn-ledger (the default ./indknn-ledger; $INDKNN_LEDGER is blank)" in said, said
    assert "no budget ledger" in said and "indknn-ledger" in said


def test_verbose_shows_a_lock_wait(pair, tmp_path):
    sp, lp = pair
    assert runner.invoke(app, ["embed", str(tmp_path / "p.npz"), "--store", str(sp), "--extractor", "vectors",
                               "--label-names", "a,b", "-q"]).exit_code == 0
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "1", "-q"]).exit_code == 0
    with BudgetLedger.write_lock(lp, timeout=5):
        r = runner.invoke(app, ["delete", "--record", f"{SECRET}-1", "--store", str(sp), "--ledger", str(lp),
                                "--lock-timeout", "0.3", "-v"])
    assert r.exit_code != 0
    said = " ".join(r.stderr.split())
    assert "waiting for the lock on" in said and "gave up waiting for the lock" in said, said
    assert "another indknn process holds the ledger lock" in said
    assert f"indknn delete: finished in" in said and f"exit {r.exit_code}" in said


def test_serve_queries_v_prints_no_lock_wait(pair, tmp_path):
    """Review 50, F1: under -v, serve-queries printed how long it waited for another process's lock: as long as that
    run held it (a serve's scoring time depends on its candidates), a figure of the private data on serve's stderr.
    Other commands still show their waits (test_verbose_shows_a_lock_wait)."""
    import threading
    import time

    sp, lp = pair
    assert runner.invoke(app, ["embed", str(tmp_path / "p.npz"), "--store", str(sp), "--extractor", "vectors",
                               "--label-names", "a,b", "-q"]).exit_code == 0
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "1", "-q"]).exit_code == 0
    held, done = threading.Event(), threading.Event()

    def hold():
        with BudgetLedger.write_lock(lp, timeout=5):
            held.set()
            time.sleep(1.0)
        done.set()

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(10)
    r = runner.invoke(app, ["serve-queries", str(tmp_path / "q.npy"), "--store", str(sp), "--ledger", str(lp),
                            "--device", "cpu", "--seed", "1", "--lock-timeout", "30", "-v"])
    assert done.is_set()  # it did wait for the lock
    assert r.exit_code == 0, r.output
    assert "lock" not in r.stderr and "finished in" not in r.stderr, r.stderr
    assert f"store: {sp} (--store)" in r.stderr  # the rest of -v is there
    r = runner.invoke(app, ["break-lease"], env={"INDKNN_STORE": "  "})  # review 50, F4: blank is unset here too
    assert r.exit_code == 2 and "name the remote store" in r.stderr, r.stderr
