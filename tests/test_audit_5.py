"""Audit 5, F2 and F3 (F1, the coin, is tests/test_record_keys.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from indknn_cli import tuning
from indknn_cli.errors import LedgerError
from indknn_cli.indexing import build_index, make_params
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered


def _store(tmp_path, n=300):
    x, y, _ = clustered(n, 8, 3, seed=6)
    s = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                            label_names=["a", "b", "c"], label_names_source="declared")
    s.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(n)])
    return tmp_path / "s.zarr"


def test_f3_a_second_ledger_is_refused_before_the_private_search_runs(tmp_path, monkeypatch):
    sp = _store(tmp_path)
    build_index(store_path=sp, ledger_path=tmp_path / "L1", params=make_params(epsilon=1.0, delta=1e-5, tau=0.5,
                                                                                    sigma2=0.5))

    def search(*a, **k):
        raise AssertionError("the private search ran before the refusal")

    monkeypatch.setattr(tuning, "run_tuning", search)
    req = tuning.TuneRequest(epsilon=1.0, delta=1e-5, seed=1, n_val=50, planned_queries=100)
    with pytest.raises(LedgerError, match="bound to the ledger"):
        build_index(store_path=sp, ledger_path=tmp_path / "L2", params=None, tune=req)
    assert not (tmp_path / "L2").exists()


@pytest.mark.heavy
def test_f2_a_seeded_private_search_warns_that_its_choice_has_no_privacy(tmp_path):
    sp = _store(tmp_path)
    base = [sys.executable, "-m", "indknn_cli", "index", "--store", str(sp), "--eps", "1", "--tune", "private",
            "--tune-queries", "50", "--planned-queries", "100", "--tune-taus", "0.5", "--tune-sigma2s", "0.5"]
    seeded = subprocess.run(base + ["--ledger", str(tmp_path / "L"), "--tune-seed", "7"], capture_output=True,
                            text=True, timeout=300)
    assert seeded.returncode == 0, seeded.stderr
    err = " ".join(seeded.stderr.split())
    assert "seeded private search (--tune-seed 7)" in err and "no privacy" in err and "seeded private" not in seeded.stdout
    (tmp_path / "other").mkdir()
    sp2 = _store(tmp_path / "other")
    unseeded = subprocess.run(base[:5] + [str(sp2)] + base[6:] + ["--ledger", str(tmp_path / "L2")],
                              capture_output=True, text=True, timeout=300)
    assert unseeded.returncode == 0, unseeded.stderr
    assert "seeded private" not in unseeded.stderr
    # account flags it too, in the text report and in --json
    acc = [sys.executable, "-m", "indknn_cli", "account", "--ledger"]
    text = subprocess.run(acc + [str(tmp_path / "L")], capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and "the search was seeded" in " ".join(text.stdout.split()), text.stderr
    import json

    js = json.loads(subprocess.run(acc + [str(tmp_path / "L"), "--json"], capture_output=True, text=True,
                                   timeout=300).stdout)
    js2 = json.loads(subprocess.run(acc + [str(tmp_path / "L2"), "--json"], capture_output=True, text=True,
                                    timeout=300).stdout)
    assert js["tuning"]["seeded"] is True and js2["tuning"]["seeded"] is False
    assert "was seeded" not in subprocess.run(acc + [str(tmp_path / "L2")], capture_output=True, text=True,
                                              timeout=300).stdout
