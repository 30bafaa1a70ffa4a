"""The base run of the private search: public-coin shards, and each shard's answer emulating serving at full
scale from the shard alone (docs/TUNING.md; the accounting is in tuning.py).

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

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from .errors import BadInputError


# -- public coins -----------------------------------------------------------------------------------------
def _coin(seed_text: str, record_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"indknn-tune:{seed_text}:{record_id}".encode()).digest()[:8], "big")


def shard_split(record_ids, *, n_shards: int, seed_text: str) -> tuple[np.ndarray, np.ndarray]:
    """(shard of each record, validation row of each shard or −1): a record's coin depends on itself only."""
    coins = np.array([_coin(seed_text, str(r)) for r in record_ids], dtype=np.uint64)
    shard = (coins % np.uint64(n_shards)).astype(np.int64)
    rank = coins // np.uint64(n_shards)
    val_row = np.full(n_shards, -1, np.int64)
    order = np.lexsort((np.asarray([str(r) for r in record_ids], dtype=object).astype(str), rank, shard))
    first = np.r_[True, shard[order][1:] != shard[order][:-1]] if order.size else np.zeros(0, bool)
    val_row[shard[order][first]] = order[first]
    return shard, val_row


# -- one base run -------------------------------------------------------------------------------------------
@dataclass
class BaseRunData:
    """The private set as the base run sees it (features in memory: tuning is done once, at index time)."""

    features: np.ndarray
    labels: np.ndarray
    shard: np.ndarray
    val_row: np.ndarray
    n_classes: int
    _kappa: dict = field(default_factory=dict, repr=False)  # (kernel, nu) → per validation query (P rows, exact κ)

    def shard_kappa(self, kernel: str, nu: float | None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each validation query's own-shard P rows and their exact κ (the engine's float64 ``exact_kernel``).

        Computed once per kernel and reused by every run (a τ only thresholds it): O(N) memory in all.
        """
        key = (kernel, nu)
        if key not in self._kappa:
            from .engine import exact_kernel

            out = []
            order = np.argsort(self.shard, kind="stable")
            bounds = np.searchsorted(self.shard[order], np.arange(self.val_row.size + 1))
            for s, v in enumerate(self.val_row):
                if v < 0:
                    continue
                rows = order[bounds[s]:bounds[s + 1]]
                rows = np.sort(rows[rows != v])
                q = np.repeat(self.features[v][None, :], rows.size, axis=0)
                out.append((rows.astype(np.int64), exact_kernel(self.features[rows], q, kernel=kernel, nu=nu)))
            self._kappa[key] = out
        return self._kappa[key]

    @classmethod
    def build(cls, features, labels, record_ids, *, n_shards: int, seed_text: str, n_classes: int) -> "BaseRunData":
        if not (isinstance(n_shards, int) and 1 <= n_shards):
            raise BadInputError(f"--tune-queries must be a positive integer, got {n_shards!r}")
        shard, val_row = shard_split(record_ids, n_shards=n_shards, seed_text=seed_text)
        return cls(np.ascontiguousarray(features, np.float32), np.asarray(labels, np.int64), shard, val_row,
                   n_classes)


def base_run_correct(data: BaseRunData, *, params, run_key: int, device: str = "cpu") -> int:
    """Number of shards whose validation record is answered correctly (not noised; see :func:`base_run`)."""
    from .engine import ArraySource, BudgetView, Candidates, answer_batch

    n = data.features.shape[0]
    vrows = data.val_row[data.val_row >= 0]
    if vrows.size == 0:
        return 0
    row_to_ledger = np.arange(n, dtype=np.int64)
    row_to_ledger[vrows] = -1  # validation records are never candidates
    source = ArraySource(data.features)
    q_shard = data.shard[vrows]
    kappa = dict(zip(q_shard.tolist(), data.shard_kappa(params.kernel, params.nu)))

    def finder(queries, *, row_mask):  # exact κ ≥ τ among the query's own shard only (one query per P record)
        rows, kap = [], []
        for s in finder.shards:
            r, k = kappa[int(s)]
            keep = (k >= params.tau) & row_mask[r]
            rows.append(r[keep]); kap.append(k[keep])
        return Candidates(rows, kap)

    budgets = BudgetView(spent=np.zeros(n), budget=np.full(n, params.budget), deleted=np.zeros(n, bool),
                         times_selected=np.zeros(n, np.int64))
    correct = 0
    # Noise keyed by the *shard* (query index = shard id), never by position: a record added to an empty shard
    # must not shift the noise of the shards after it. Consecutive non-empty shards are answered together.
    breaks = np.flatnonzero(np.diff(q_shard) != 1) + 1
    for grp in np.split(np.arange(vrows.size), breaks):
        for lo in range(0, grp.size, 256):
            sel = grp[lo:lo + 256]
            finder.shards = q_shard[sel]
            answers = answer_batch(data.features[vrows[sel]], source=source, row_to_ledger=row_to_ledger,
                                   row_labels=data.labels, params=params, n_classes=data.n_classes, budgets=budgets,
                                   run_key=run_key, first_index=int(q_shard[sel[0]]), reuse=None, device=device,
                                   candidate_finder=finder)
            correct += int(sum(a.label == int(y) for a, y in zip(answers, data.labels[vrows[sel]])))
    assert np.all(budgets.spent <= budgets.budget), "filter overspent in a tuning run"
    return correct


def score_noise(run_key: int, *, rho_run: float) -> float:
    """N(0, σ_s²), σ_s = 1/sqrt(2ρ): the score's Gaussian noise (sensitivity 1), keyed by the run key."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy=run_key, spawn_key=(2**31,))))
    return float(rng.standard_normal() / math.sqrt(2.0 * rho_run))


# -- the emulated answer ---------------------------------------------------------------------------------
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
