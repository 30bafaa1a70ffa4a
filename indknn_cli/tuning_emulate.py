"""The base run's answer for one shard: serving at full scale, emulated from the shard alone (docs/TUNING.md).

A shard is a 1/S public-coin sample of the private set, and its one validation query is the only query its P
records ever see. Answering that query with Ind-KNN over the shard as it stands (≈ N/S records, one query,
no record ever spent) rewards what serving punishes: at full scale a small σ2 makes every vote expensive and
the records near busy regions run dry within the first queries, a low τ selects every record for many more
queries, and neither is visible with one query over a few records. So each shard *emulates* the query as
serving would answer it, from the shard's own records and public figures only (S, T, B, σ1, σ2, τ, K_min):

* count: K̂ = max(S·|C_s| + N(0, σ1²), K_min) (the shard's candidates stand for S times as many);
* position: the query sits at a uniform point u of the T planned queries (noise of the shard);
* depletion: each candidate has been selected ≈ u·T·p̂ times, p̂ = |C_s| / |P_s| (the share of records within τ
  of this neighbourhood), paying c1 + κ̄²/(2σ2²K̂) each time (κ̄ their mean κ), so r = max(0, B − that);
* votes: S·Σ_{i∈C_s} min(κ_i, σ2·sqrt(2·K̂·r)) e_{y_i} + N(0, σ2²·K̂) per class; the answer is the argmax.

Privacy does not rest on any of this: the score counts shards answered correctly, and one record changes at
most its own shard's answer, whatever the shard computes (tuning.py), so the count's sensitivity is 1.
"""

from __future__ import annotations

import numpy as np


def emulated_correct(data, *, params, run_key: int, n_shards: int, planned_queries: int) -> int:
    """Number of shards whose validation record the emulated full-scale answer gets right (not noised)."""
    from .engine import noise_generator

    vrows = data.val_row[data.val_row >= 0]
    if vrows.size == 0:
        return 0
    S, T = float(n_shards), float(planned_queries)
    c1 = 1.0 / (2.0 * params.sigma1 * params.sigma1)
    s2 = params.sigma2
    correct = 0
    for v, s, (rows, kap) in zip(vrows, data.shard[vrows], data.shard_kappa(params.kernel, params.nu)):
        rng = noise_generator(run_key, int(s))  # keyed by the shard, as the engine keys by query index
        z1, u = rng.standard_normal(), rng.uniform()
        sel = kap >= params.tau
        c = int(sel.sum())
        k_hat = max(S * c + params.sigma1 * z1, params.k_min)
        votes = np.zeros(data.n_classes)
        if c:
            k = kap[sel]
            p_hat = c / max(rows.size, 1)
            spent = u * T * p_hat * (c1 + float(np.mean(k * k)) / (2.0 * s2 * s2 * k_hat))
            r = max(0.0, params.budget - spent)
            w = np.minimum(k, s2 * np.sqrt(2.0 * k_hat * r))
            votes += S * np.bincount(data.labels[rows[sel]], weights=w, minlength=data.n_classes)
        votes += s2 * np.sqrt(k_hat) * rng.standard_normal(data.n_classes)
        correct += int(int(np.argmax(votes)) == int(data.labels[v]))
    return correct
