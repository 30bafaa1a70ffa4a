"""Audit 4, F1: the private search's public coin must depend on the record alone.

``embed`` generates a record id from the row's position when the input has no id column
(``private-00000042``). The coin used to hash that id, so leaving one person out of an id-less input renamed
every later record, re-dealt their shards and moved the un-noised score by up to 36 (sensitivity 1 assumed).
The test goes through the real path: ``indknn embed`` of a ``.npz`` without ids, then ``index --tune private``'s
``run_tuning`` with one random-search run at one grid point, so the chosen run's noisy score differs between D
and D − {x} by exactly the un-noised score's change (the same seed draws the same noise). The exponential
mechanism releases no score, but it scores on the same shards (``BaseRunData.build``, the same coin)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from indknn_cli import tuning
from indknn_cli.store import FeatureStore

from .conftest import clustered


def _store_without_ids(tmp_path, tag, x, y, salt=None):
    """``salt``: D's content-key salt for D − {x} (a random draw of the mechanism, coupled as the seed is)."""
    src = tmp_path / f"{tag}.npz"
    np.savez(src, x=x.astype(np.float32), y=y.astype(np.int64))  # no ids: embed generates them from the row
    store = tmp_path / f"{tag}.zarr"
    if salt is not None:
        from indknn_cli.extractors import get_extractor

        st = FeatureStore.create(store, extractor=get_extractor("vectors").info, dim=x.shape[1],
                                 label_names=["0", "1", "2"], label_names_source="declared")
        st.root.attrs.update({"content_key_salt": salt})
    res = subprocess.run([sys.executable, "-m", "indknn_cli", "embed", str(src), "--store", str(store), "--role",
                          "private", "--extractor", "vectors", "--label-names", "0,1,2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return FeatureStore.open(store, mode="r")


@pytest.mark.heavy
@pytest.mark.parametrize("seed", [1, 2])
def test_one_record_left_out_of_an_id_less_input_moves_the_score_by_at_most_one(tmp_path, seed):
    x, y, _ = clustered(1200, 16, 3, seed=7)
    d = _store_without_ids(tmp_path, "d", x, y)
    keep = np.arange(1200) != 10  # the person at input row 10 opts out: every later generated id shifts
    d_minus = _store_without_ids(tmp_path, "dm", x[keep], y[keep], salt=d.key_salt)
    assert list(d_minus.read("private", "record_id")[10:11]) == list(d.read("private", "record_id")[10:11])
    scores = []
    for store in (d, d_minus):
        for tau in (0.3, 0.5, 0.7):
            req = tuning.TuneRequest(epsilon=1.0, delta=1e-5, seed=seed, taus=(tau,), sigma2s=(0.6,), n_val=300,
                                     mean_runs=1.0, planned_queries=1000, method="random-search")
            rec, _ = tuning.run_tuning(store, req)
            assert rec.runs_drawn == 1 and rec.chosen_run == 0
            scores.append(rec.chosen_noisy_score)
    full, minus = scores[:3], scores[3:]
    assert max(abs(a - b) for a, b in zip(full, minus)) <= 1.0 + 1e-9, (full, minus)


def test_content_keys_read_the_vector_and_the_label_only():
    x, y, _ = clustered(50, 8, 3, seed=1)
    keys = tuning.content_keys(x, y)
    assert keys == tuning.content_keys(x.copy(), y.copy()) and len(set(keys)) == 50
    y2 = y.copy()
    y2[0] = (y2[0] + 1) % 3
    assert tuning.content_keys(x, y2)[0] != keys[0] and tuning.content_keys(x, y2)[1:] == keys[1:]
    assert tuning.content_keys(x[1:], y[1:]) == keys[1:]  # no record's key depends on another's
