"""`indknn index` re-run on an existing ledger with only some flags (review 66, F3): a flag left out means the
ledger's value, and only the flags actually given are compared with the ledger's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.tuning import TuneRequest, request_differences, request_record

runner = CliRunner()


def _index(store, tmp_path, *flags):
    return runner.invoke(app, ["index", "--store", str(store.path), "--ledger", str(tmp_path / "L"), *flags])


@pytest.mark.heavy
def test_rerun_with_some_flags_keeps_the_ledgers_values(vector_store, tmp_path):
    made = _index(vector_store, tmp_path, "--eps", "4", "--tau", "0.3", "--planned-queries", "100000")
    assert made.exit_code == 0, made.stderr
    for flags in (["--eps", "4"], ["--eps", "4", "--tau", "0.3"], ["--eps", "4", "--planned-queries", "100000"],
                  ["--eps", "4", "--delta", "1e-5", "--sigma2", "0.6"], []):
        again = _index(vector_store, tmp_path, *flags)
        assert again.exit_code == 0, (flags, again.stderr)
        assert json.loads(again.stdout)["records_added"] == 0
    for flags, needle in ((["--eps", "4", "--tau", "0.25"], "tau: 0.3 → 0.25"),
                          (["--eps", "4", "--planned-queries", "1000"], "sigma1"),
                          (["--eps", "4", "--privacy-unit", "user"], "privacy_unit"),
                          (["--eps", "2"], "epsilon"), (["--eps", "4", "--delta", "1e-6"], "delta")):
        changed = _index(vector_store, tmp_path, *flags)
        assert changed.exit_code == 2, (flags, changed.stderr)
        assert "fixed parameters" in changed.stderr and needle in changed.stderr, changed.stderr
        assert changed.stdout == ""


def test_tune_rerun_compares_only_the_flags_given():
    made = request_record(TuneRequest(epsilon=1.0, delta=1e-5, on="public", taus=(0.3, 0.5), planned_queries=100000),
                          extractor="vectors")
    again = TuneRequest(epsilon=1.0, delta=1e-5, on="public", planned_queries=1000)  # defaults for the left-out ones
    assert request_differences(made, again, extractor="vectors", given={"--eps", "--tune"}) == []
    assert request_differences(made, again, extractor="vectors",
                               given={"--eps", "--tune", "--planned-queries"}) == ["--planned-queries"]
    other = TuneRequest(epsilon=2.0, delta=1e-5, on="public")
    assert request_differences(made, other, extractor="vectors", given={"--eps", "--tune"}) == ["--eps"]
