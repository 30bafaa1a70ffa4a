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

That is :func:`emulated_correct` (a 0/1 answer per shard), the search's score until 2026-11-27. The search now scores
with :func:`emulated_expected`: the shard's *chance* of being answered right, with serving's vote noise modelled
(the margin share read from the label agreement of the shard's pairs within τ), which a shard's own one or two
candidates cannot show (docs/TUNING.md, "What a shard computes"). Since 2026-11-29 it also reads the query's
full-scale count from the share of the shard's pairs within τ instead of S × its own hits (``count="pairs"``).

Privacy does not rest on any of this: the score is a sum of per-shard terms in [0, 1], and one record changes at
most its own shard's term, whatever the shard computes (tuning.py), so the score's sensitivity is 1.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from .errors import BadInputError


# -- public coins -----------------------------------------------------------------------------------------
def _coin(seed_text: str, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"indknn-tune:{seed_text}:{key}".encode()).digest()[:8], "big")


def content_keys(features, labels) -> list[str]:
    """The key of rows given as vectors (:func:`record_keys.vector_keys`): sha256 of each vector and its label.

    Never the record id (an id may depend on other records: audit 4, F1) and, for a store, never the stored
    vector of a batch-embedded row (its bytes depend on its batch: audit 5, F1): ``index`` reads the key ``embed``
    recorded from the row's own input (:mod:`.record_keys`). Two records with the same key share a coin, hence a
    shard and a rank; either one as the validation record gives the shard the same term."""
    from .record_keys import vector_keys

    return vector_keys(features, labels)


def shard_split(keys, *, n_shards: int, seed_text: str) -> tuple[np.ndarray, np.ndarray]:
    """(shard of each record, validation row of each shard or −1) from each record's own key
    (:func:`content_keys`): a record's coin depends on itself only."""
    coins = np.array([_coin(seed_text, str(r)) for r in keys], dtype=np.uint64)
    shard = (coins % np.uint64(n_shards)).astype(np.int64)
    rank = coins // np.uint64(n_shards)
    val_row = np.full(n_shards, -1, np.int64)
    order = np.lexsort((np.asarray([str(r) for r in keys], dtype=object).astype(str), rank, shard))
    first = np.r_[True, shard[order][1:] != shard[order][:-1]] if order.size else np.zeros(0, bool)
    val_row[shard[order][first]] = order[first]
    return shard, val_row


#: At most this many records of a shard estimate how often a record is selected (their pairs; memory m² a shard).
PAIR_MEMBERS = 64


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

    def shard_pairs(self, kernel: str, nu: float | None) -> list[np.ndarray]:
        """Per validation query, the exact κ between every two of its shard's first :data:`PAIR_MEMBERS` records
        (the validation record, then the P rows in :meth:`shard_kappa`'s order). Reads only that shard's records."""
        key = ("pairs", kernel, nu)
        if key not in self._kappa:
            from .engine import exact_kernel

            out = []
            for v, (rows, _) in zip(self.val_row[self.val_row >= 0], self.shard_kappa(kernel, nu)):
                members = np.r_[v, rows][:PAIR_MEMBERS]
                m = members.size
                ii, jj = np.repeat(np.arange(m), m), np.tile(np.arange(m), m)
                out.append(exact_kernel(self.features[members[ii]], self.features[members[jj]], kernel=kernel,
                                        nu=nu).reshape(m, m))
            self._kappa[key] = out
        return self._kappa[key]

    @classmethod
    def build(cls, features, labels, *, n_shards: int, seed_text: str, n_classes: int,
              keys=None) -> "BaseRunData":
        """The shards of one search; each record's coin hashes its own key: ``keys`` (one per row, what ``embed``
        recorded from its input: :mod:`.record_keys`), or, None, its vector and label (:func:`content_keys`)."""
        if not (isinstance(n_shards, int) and 1 <= n_shards):
            raise BadInputError(f"--tune-queries must be a positive integer, got {n_shards!r}")
        if keys is None:
            keys = content_keys(features, labels)
        elif len(keys) != np.asarray(labels).shape[0]:
            raise BadInputError(f"tuning: {len(keys)} record keys for {np.asarray(labels).shape[0]} rows")
        shard, val_row = shard_split(keys, n_shards=n_shards, seed_text=seed_text)
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


# -- the emulated answer with serving's vote noise at full scale ---------------------------------------------
#: Positions of the shard's query among the T planned queries: midpoints of this many equal slices of [0, 1].
POSITIONS = 16


def flip_probability(a, n_classes: int):
    """Chance that N(0, σ2²K) vote noise moves the argmax off the noiseless answer, for a margin share Δπ
    uniform on [0, 1]: ``a`` = W / (σ2·sqrt(2K)) with W the total vote weight (a margin share uniform on [0, m]
    is ``a·m``). Two classes: ∫₀¹ Φ̄(a·x) dx = Φ̄(a) + (φ(0) − φ(a))/a (½ at a = 0); scaled by 2(n−1)/n so
    that no votes leave 1/n of the answers right."""
    from scipy.special import ndtr

    a = np.asarray(a, np.float64)
    phi0 = 1.0 / math.sqrt(2.0 * math.pi)
    with np.errstate(divide="ignore", invalid="ignore"):
        f2 = np.where(a > 1e-12, ndtr(-a) + (phi0 - phi0 * np.exp(-0.5 * a * a)) / a, 0.5)
    return f2 * (2.0 * (n_classes - 1) / n_classes)


def margin_share_bound(near: np.ndarray, labels: np.ndarray) -> float:
    """Upper end m of the margin share Δπ (taken uniform on [0, m]) from the label agreement of a shard's pairs
    within τ: ``near`` the m×m "κ ≥ τ" matrix of the shard's first members, ``labels`` theirs.

    With class shares π in a neighbourhood, two of its records agree with chance a = Σπ_c²; for two classes
    a = ½(1 + Δπ²), so Δ̄ = sqrt(max(0, 2a − 1)) estimates the margin share, and [0, min(1, 2Δ̄)] has mean Δ̄.
    Mixed neighbourhoods (low τ) thus get small margins that serving's vote noise flips, which a shard's own
    one or two candidates never show. No pair within τ: m = 1 (no knowledge, the flat prior)."""
    offd = near & ~np.eye(near.shape[0], dtype=bool)
    pairs = int(offd.sum())
    if pairs == 0:
        return 1.0
    agree = float((offd & (labels[:, None] == labels[None, :])).sum()) / pairs
    return min(1.0, 2.0 * math.sqrt(max(0.0, 2.0 * agree - 1.0)))


#: Each shard's chance c enters the score as c ** SHARPEN (docs/TUNING.md, "Sharpening"): any map of [0, 1] into
#: [0, 1] keeps the sensitivity at 1, and this one weights the shards serving answers with near certainty, where the
#: top grid points differ, so their scores differ by more than their accuracies do. Chosen on AG News split 0 and
#: MNIST (powers 1, 2, 4, 8, 16) and checked on AG News splits 1 and 2.
SHARPEN = 4.0

#: Where a shard reads the query's full-scale count from: "pairs" (the share of the shard's pairs within τ, since
#: 2026-11-29) or "query" (the query's own hits × S, before). :func:`emulated_expected`.
COUNTS = ("pairs", "query")
COUNT = "pairs"


def emulated_expected(data, *, params, run_key: int, n_shards: int, planned_queries: int,
                      margin_prior: str = "agreement", sharpen: float = SHARPEN, count: str = COUNT) -> float:
    """Sum over shards of the chance that serving at full scale answers the shard's validation record right.

    As in :func:`emulated_correct`, the query's count is K̂ = max(S·|C_s| + σ1·z, K_min) and its candidates have
    been selected u·T·p times before it, each time paying c1 + κ̄²/(2σ2²K_rec); but the selection rate p is the
    share of *all the shard's pairs* within τ and K_rec = max(S·|P_s|·p, K_min) (the count of the queries that
    select such a record), not the query's own c/|P_s|: that estimate from one or two candidates is so noisy
    that the budget's death threshold turned its noise into depletion serving does not have. With w_i the
    candidates' clipped weights, the *noiseless* full-scale answer is the argmax of S·Σ w_i e_{y_i}. Serving adds N(0, σ2²K) per class, and that noise is what the shard cannot show: its own
    vote margin is a sample of one or two records, far wider than serving's margin relative to its noise. So
    the noise enters through :func:`flip_probability` of a = m·S·Σw_i / (σ2·sqrt(2K̂)) (serving's signal to noise
    for a neighbourhood of that size and weight, the margin share uniform on [0, m], m from the label agreement of
    the shard's pairs within τ: :func:`margin_share_bound`), and the shard's term is (1 − f) when the noiseless
    answer is right and f/(n−1) when it is wrong (1/n with no candidate), averaged over the query's position u
    (:data:`POSITIONS` slices instead of a draw), then raised to the power ``sharpen`` (:data:`SHARPEN`; 1 gives the
    chance itself). This is the search's score (docs/TUNING.md); ``margin_prior="flat"`` is the earlier m = 1,
    kept for the diagnostic.

    ``count="pairs"`` (:data:`COUNT`, the search's since 2026-11-29): the full-scale count is read from the shard's
    pairs, not from the query's own hits: K = S·|P_s|·p with p the share of the shard's pairs within τ, the vote
    weight K·w̄ with w̄ = min(κ̄, σ2·sqrt(2K̂r)) (κ̄ the pairs' mean κ), and the vote noise flips the answer with
    f(m·K·w̄ / (σ2·sqrt(2K̂))). The query's own candidates say only which class the noiseless answer is; with none,
    it is right with chance ½ + m/4 (the plurality share (1 + Δ̄)/2 of the margin model; no pair within τ: 1/n).
    S·|C_s| (``count="query"``, before) conditions the count on the query's one or two sampled hits: a shard with
    none scored 1/n although at full scale the query has candidates, and one with a hit at a high τ stood for S
    candidates where serving has few, so the search preferred a lower τ than serving does (docs/TUNING.md, "The
    count from the shard's pairs").

    Each term lies in [0, 1] (so does its power) and reads only the shard's records and public figures (S, T, B, σ1, σ2, τ, K_min),
    so the sum moves by at most 1 when one record is added or removed (docs/TUNING.md "Why one run costs ρ").
    """
    if count not in COUNTS:
        raise ValueError(f"count={count!r}: expected one of {COUNTS}")
    from .engine import noise_generator

    vrows = data.val_row[data.val_row >= 0]
    if vrows.size == 0:
        return 0.0
    S, T, B = float(n_shards), float(planned_queries), float(params.budget)
    c1 = 1.0 / (2.0 * params.sigma1 * params.sigma1)
    s2, n_cls = float(params.sigma2), int(data.n_classes)
    u = (np.arange(POSITIONS) + 0.5) / POSITIONS
    total = 0.0
    pairs = data.shard_pairs(params.kernel, params.nu)
    for j, (v, s, (rows, kap)) in enumerate(zip(vrows, data.shard[vrows], data.shard_kappa(params.kernel, params.nu))):
        rng = noise_generator(run_key, int(s))  # keyed by the shard, as the engine keys by query index
        sel = kap >= params.tau
        c = int(sel.sum())
        if count == "pairs":
            total += _unit(_pairs_chance(data, pairs[j], v, rows, kap[sel], data.labels[rows[sel]], rng=rng, S=S, T=T,
                                         B=B, c1=c1, params=params, u=u, margin_prior=margin_prior), n_cls) ** sharpen
            continue
        if c == 0:
            total += (1.0 / n_cls) ** sharpen
            continue
        k = kap[sel]
        k_hat = np.maximum(S * c + params.sigma1 * rng.standard_normal(POSITIONS), params.k_min)
        # How often a record is selected over the T queries: the share p of the shard's pairs within τ (its
        # m(m−1) ordered pairs, not only the query's m − 1, whose noise the death threshold would turn into
        # spurious depletion), and the count of the queries that select it, K_rec = max(S·|P_s|·p, K_min).
        _, p_rec, share = _neighbourhood(data, pairs[j], v, rows, tau=params.tau, margin_prior=margin_prior)
        k_rec = max(S * rows.size * p_rec, params.k_min)
        spent = u * T * p_rec * (c1 + float(np.mean(k * k)) / (2.0 * s2 * s2 * k_rec))
        r = np.maximum(0.0, B - spent)
        w = np.minimum(k[None, :], s2 * np.sqrt(2.0 * k_hat * r)[:, None])  # [positions, candidates]
        onehot = np.eye(n_cls)[data.labels[rows[sel]]]
        votes = w @ onehot
        right = np.argmax(votes, axis=1) == int(data.labels[v])
        f = flip_probability(share * S * w.sum(axis=1) / (s2 * np.sqrt(2.0 * k_hat)), n_cls)
        total += _unit(float(np.mean(np.where(right, 1.0 - f, f / max(n_cls - 1, 1)))), n_cls) ** sharpen
    return total


def _neighbourhood(data, kappa_pairs, v, rows, *, tau: float, margin_prior: str) -> tuple[np.ndarray, float, float]:
    """What a shard's pairs say of its neighbourhood at τ: the ordered pairs within τ (the m×m mask, diagonal off),
    their share p of the m(m−1) pairs (how often a record is selected), and the margin share's upper end m from their
    label agreement (:func:`margin_share_bound`; 1 under the flat prior). Reads the shard's own members only."""
    near = kappa_pairs >= tau
    m = near.shape[0]
    offd = near & ~np.eye(m, dtype=bool)
    p_rec = float(offd.sum()) / max(m * (m - 1), 1)
    share = margin_share_bound(near, data.labels[np.r_[v, rows][:m]]) if margin_prior == "agreement" else 1.0
    return offd, p_rec, share


def _pairs_chance(data, kappa_pairs, v, rows, k_sel, y_sel, *, rng, S, T, B, c1, params, u, margin_prior) -> float:
    """One shard's chance under ``count="pairs"`` (:func:`emulated_expected`): the count, the depletion and the
    vote noise from the shard's pairs within τ; the query's own candidates ``k_sel`` (labels ``y_sel``) give the
    noiseless answer's class, and with none it is right with chance ½ + m/4. In [0, 1]; reads the shard only."""
    s2, n_cls = float(params.sigma2), int(data.n_classes)
    z = rng.standard_normal(POSITIONS)
    if n_cls < 2:
        return 1.0  # one class: every answer is right (and f/(n − 1) would be 0/0)
    offd, p_rec, share = _neighbourhood(data, kappa_pairs, v, rows, tau=params.tau, margin_prior=margin_prior)
    if not offd.any():
        return 1.0 / n_cls  # no pair within τ: nothing is known of the neighbourhood
    kp = kappa_pairs[offd]
    k_full = S * rows.size * p_rec
    k_rec = max(k_full, params.k_min)
    k_hat = np.maximum(k_full + params.sigma1 * z, params.k_min)
    spent = u * T * p_rec * (c1 + float(np.mean(kp * kp)) / (2.0 * s2 * s2 * k_rec))
    cap = s2 * np.sqrt(2.0 * k_hat * np.maximum(0.0, B - spent))  # a spent record's largest vote weight
    f = flip_probability(share * k_full * np.minimum(float(np.mean(kp)), cap) / (s2 * np.sqrt(2.0 * k_hat)), n_cls)
    if k_sel.size:
        votes = np.minimum(k_sel[None, :], cap[:, None]) @ np.eye(n_cls)[y_sel]
        right = (np.argmax(votes, axis=1) == int(data.labels[v])).astype(np.float64)
    else:
        right = min(1.0, 0.5 + share / 4.0)
    return float(np.mean(right * (1.0 - f) + (1.0 - right) * f / (n_cls - 1)))


def _unit(chance: float, n_classes: int) -> float:
    """A shard's chance, kept in [0, 1] whatever produced it (a value that is not a finite number reads as the
    guess 1/n): the score's sensitivity rests on every term lying in one unit interval (docs/TUNING.md, "Why one
    run costs ρ"), so that is enforced here rather than trusted to the emulation's arithmetic (review 78, F1: one
    class made a term 0/0)."""
    if not math.isfinite(chance):
        return 1.0 / max(int(n_classes), 1)
    return min(1.0, max(0.0, float(chance)))
