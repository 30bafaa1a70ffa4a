"""Regression tests of the second privacy audit (AUDIT_FINDINGS_2.md). Each failed before its fix."""

from __future__ import annotations

import numpy as np

from indknn_cli import tuning

from .conftest import clustered


# -- P1: the private tuning's number of shards must not depend on the number of private records ------------------
def _noiseless_scores(monkeypatch, x, y, ids, req):
    """Run private tuning and return the un-noised score of every run (and the shard counts it used)."""
    import indknn_cli.tuning as tmod

    from indknn_cli.tuning_base import emulated_correct as real

    seen: list = []

    def spy(data, *, params, run_key, n_shards, planned_queries):
        s = real(data, params=params, run_key=run_key, n_shards=n_shards, planned_queries=planned_queries)
        seen.append((n_shards, s))
        return s

    monkeypatch.setattr(tmod, "emulated_correct", spy)
    tuning.private_tune_arrays(x, y, ids, n_classes=3, req=req)
    return seen


def test_private_tuning_score_moves_by_at_most_one_when_a_record_joins_a_small_store(monkeypatch):
    """The search's ρ per run assumes the score moves by ≤ 1 when one record is added or removed. With fewer
    private records N than --tune-queries S, S was clamped to N: adding one record changed S, re-dealt every
    record's shard and moved the score by many (an unaccounted cost, released through the chosen θ)."""
    x, y, _ = clustered(61, 16, 3, seed=5, spread=0.6)
    ids = np.array([f"r{i:04d}" for i in range(61)], dtype=object)
    req = tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=3, taus=(0.2, 0.5), sigma2s=(0.3, 1.0), n_val=200,
                             mean_runs=6.0, share=0.3, planned_queries=50)
    d = _noiseless_scores(monkeypatch, x[:60], y[:60], ids[:60], req)     # D: 60 records
    d1 = _noiseless_scores(monkeypatch, x, y, ids, req)                   # D ∪ {x}: 61 records
    assert len(d) == len(d1) and d  # the same (data-independent) runs
    assert {s for s, _ in d} == {s for s, _ in d1} == {200}, "the number of shards must be the public --tune-queries"
    assert max(abs(a - b) for (_, a), (_, b) in zip(d, d1)) <= 1
