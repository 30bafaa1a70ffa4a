"""`indknn serve-queries … | head -1` (review 66, F10): a reader that closes stdout early gets exit 1 with a message
saying how many answers were released and how to print them again; no traceback, no "Exception ignored" line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app

from .test_bad_inputs import tree_digest

runner = CliRunner()


@pytest.mark.heavy
def test_reader_closing_stdout_early(vector_store, tmp_path):
    ledger = tmp_path / "L"
    made = runner.invoke(app, ["index", "--store", str(vector_store.path), "--ledger", str(ledger), "--eps", "1",
                               "--tau", "0.5"])
    assert made.exit_code == 0, made.stderr
    cmd = [sys.executable, "-m", "indknn_cli", "serve-queries", "q1", "--store", str(vector_store.path),
           "--ledger", str(ledger), "--batch-id", "pipe1", "--batch-size", "1", "--seed", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert json.loads(first)["query_id"] == "q000"
    assert rc == 1, err
    assert "stdout was closed" in err and "--batch-id pipe1" in err and "without charging" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err and "Broken pipe" not in err, err
    again = subprocess.run(cmd, capture_output=True, env=dict(os.environ), timeout=120)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.decode().splitlines()
    assert len(lines) == 40 and lines[0].encode() == first.rstrip(b"\n")
    # the batch answered: a reader closing early now sees answers printed again, and is not told of charges
    # (review 73, F3: it said "1024 answers of this run were released (charged and committed)")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    assert proc.stdout.readline() == first
    proc.stdout.close()
    err = " ".join(proc.stderr.read().decode().split())
    assert proc.wait(timeout=120) == 1, err
    assert "released by an earlier run (printed again, nothing charged)" in err and "charged and committed" not in err


@pytest.mark.heavy
@pytest.mark.parametrize("arg,data,needle", [
    ("-", b"id,text\nq1,hello\n", "embed it first"), ("/dev/stdin", b"id,text\nq1,hello\n", "give - instead"),
    ("-", b'{"id": "q1", "vector": [1, 0]}\n', "embed it first")])  # JSON lines: the last line is an object
def test_raw_query_data_on_stdin_says_how_to_pipe_it(vector_store, tmp_path, arg, data, needle):
    """review 66, F2: `cat q.csv | indknn serve-queries -` and `serve-queries /dev/stdin < q.csv` were refused without
    a word on how to pipe query data (through `embed - --role query`)."""
    made = runner.invoke(app, ["index", "--store", str(vector_store.path), "--ledger", str(tmp_path / "L"), "--eps",
                               "1", "--tau", "0.5"])
    assert made.exit_code == 0, made.stderr
    cmd = [sys.executable, "-m", "indknn_cli", "serve-queries", arg, "--store", str(vector_store.path),
           "--ledger", str(tmp_path / "L")]
    before = tree_digest(tmp_path)
    res = subprocess.run(cmd, input=data, capture_output=True, env=dict(os.environ), timeout=120)
    assert tree_digest(tmp_path) == before  # nothing written
    err = res.stderr.decode()
    assert res.returncode == 2 and res.stdout == b"", err
    assert needle in err and "indknn embed - --role query --batch-id NAME | indknn serve-queries -" in err, err
