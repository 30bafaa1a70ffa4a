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
