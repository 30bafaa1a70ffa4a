"""Audit 4, S1: serve-queries re-opens after a ConcurrentChangeError, and a retry first re-emits the batch's
released answers. The Dask candidate phase can raise it mid-run, after parts were committed and printed: the
retry then printed those answers a second time. Now a retry happens only while nothing went to stdout; otherwise
the command exits 1 and a re-run finishes the batch (every answer once)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from indknn_cli import serving
from indknn_cli.cli.app import app
from indknn_cli.errors import ConcurrentChangeError

runner = CliRunner()


def test_a_change_after_answers_were_printed_is_not_retried_into_duplicates(vector_store, tmp_path, monkeypatch):
    store, ledger = str(vector_store.path), str(tmp_path / "L")
    res = runner.invoke(app, ["index", "--store", store, "--ledger", ledger, "--eps", "1", "--tau", "0.5", "-q"])
    assert res.exit_code == 0, res.output
    real = serving.serve_queries
    calls = []

    def flaky(**kw):  # the first attempt: the candidate index "changes" after the first part is out
        calls.append(1)
        if len(calls) > 1:
            return real(**kw)
        inner = kw["on_committed"]

        def once(rows):
            inner(rows)
            raise ConcurrentChangeError("the store's candidate index changed under the run; run serve-queries again")
        return real(**{**kw, "on_committed": once})

    monkeypatch.setattr(serving, "serve_queries", flaky)
    args = ["serve-queries", "q1", "--store", store, "--ledger", ledger, "--batch-size", "8", "--device", "cpu"]
    first = runner.invoke(app, args)
    lines = [json.loads(x)["query_index"] for x in first.stdout.splitlines()]
    assert first.exit_code == 1 and "run serve-queries again" in first.stderr
    assert lines == list(range(8)) and len(calls) == 1  # printed once, not re-emitted by a retry
    monkeypatch.setattr(serving, "serve_queries", real)
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert [json.loads(x)["query_index"] for x in again.stdout.splitlines()] == list(range(40))


def test_a_change_before_anything_was_printed_is_still_retried(vector_store, tmp_path, monkeypatch):
    store, ledger = str(vector_store.path), str(tmp_path / "L")
    assert runner.invoke(app, ["index", "--store", store, "--ledger", ledger, "--eps", "1", "--tau", "0.5",
                               "-q"]).exit_code == 0
    real = serving.serve_queries
    calls = []

    def flaky(**kw):
        calls.append(1)
        if len(calls) == 1:
            raise ConcurrentChangeError("renumbered while waiting")
        return real(**kw)

    monkeypatch.setattr(serving, "serve_queries", flaky)
    res = runner.invoke(app, ["serve-queries", "q1", "--store", store, "--ledger", ledger, "--device", "cpu"])
    assert res.exit_code == 0 and len(calls) == 2 and "re-opening" in res.stderr
    assert len(res.stdout.splitlines()) == 40
