"""Empirical privacy audit: a canary, membership inference on released answers, an ε lower bound.

The certified ε of a ledger is a proof; this module is a *test* that could
catch a broken implementation. It follows the auditing recipe of Jagielski,
Ullman & Oprea 2020 ("Auditing differentially private machine learning: how
private is private SGD?", NeurIPS) and Nasr, Song, Thakurta, Papernot & Carlini
2021 ("Adversary instantiation: lower bounds for differentially private machine
learning", IEEE S&P):

1. Two neighbouring datasets: ``D`` (background records) and ``D' = D ∪ {canary}``.
2. A *trial* is one whole life of a fresh ledger: every record starts with
   spent 0 and budget B, the mechanism answers ``queries`` queries aimed at the
   canary (each equal to the canary's vector), noise from a fresh run key. Only
   what the product releases is kept: the label ``a_t`` and the noisy count
   ``K_t`` of each query. Trials on ``D`` are the negatives, trials on ``D'``
   the positives.
3. The attack (membership inference) scores each trial with one of a few
   statistics of the released answers (the first count ``K_1``, the sum of the
   counts, the number of answers equal to the canary's label). The first half of
   the trials (*calibration*) chooses the statistic, the direction and the
   threshold; the second half (*evaluation*) is used once, to count false
   positives (``D``-trials flagged) and false negatives (``D'``-trials missed).
4. Any (ε, δ)-DP mechanism satisfies, for every test,
   ``FPR + e^ε·FNR ≥ 1 − δ`` and ``FNR + e^ε·FPR ≥ 1 − δ`` (Kairouz, Oh &
   Viswanath 2015, Thm 2.1). With Clopper–Pearson upper confidence bounds
   ``FPR⁺`` and ``FNR⁺`` (each at level 1 − α/2, so both hold with probability
   ≥ 1 − α), ``ε_lb = max(log((1 − δ − FNR⁺)/FPR⁺), log((1 − δ − FPR⁺)/FNR⁺), 0)``
   is a lower bound on the mechanism's true ε at δ with confidence 1 − α.
5. It is compared with the certified ε of the budget B:
   :func:`accounting.epsilon_for_budget` with the named conversion (``gdp``:
   Gaussian-DP, μ = sqrt(2B); ``rdp``: the RDP curve α·B).

``ε_lb > certified ε`` (beyond the 1 − α confidence) means the implementation
leaks more than it claims. ``ε_lb ≤ certified ε`` is what a correct one gives;
with a few thousand trials ``ε_lb`` stays well below ε because the tails that
cost ε at a small δ are rarely sampled.

Default set-up: the canary (label 1) sits among ``background`` records of
label 0 at its own location, so the count differs by exactly one between the
worlds and is never clamped (``K_min`` = 1); σ1 is chosen so that one count
charge uses ``count_share`` of B. The first release is then a Gaussian
mechanism of sensitivity 1 carrying almost the whole budget — the strongest
case for the attacker — and everybody retires after it.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
from scipy.stats import beta as beta_dist

from . import accounting
from .engine import ArraySource, BudgetView, ReusePool, answer_batch
from .errors import BadInputError
from .ledger_state import PrivacyParams

#: A mechanism: (features, labels, queries, params, n_classes, run_key) → (released labels, released counts).
Mechanism = Callable[[np.ndarray, np.ndarray, np.ndarray, PrivacyParams, int, int], tuple[np.ndarray, np.ndarray]]

STATISTICS = ("count_first", "count_sum", "canary_label")
REFERENCES = (
    "Jagielski, Ullman & Oprea 2020, Auditing differentially private machine learning: how private is private SGD?",
    "Nasr, Song, Thakurta, Papernot & Carlini 2021, Adversary instantiation: lower bounds for DP machine learning",
    "Kairouz, Oh & Viswanath 2015, The composition theorem for differential privacy (hypothesis-testing view)",
)


# -- statistics --------------------------------------------------------------------
def clopper_pearson_upper(k: int, n: int, *, beta: float) -> float:
    """One-sided upper confidence bound (level 1 − beta) on a binomial rate with k successes in n trials."""
    if n <= 0:
        raise BadInputError(f"need at least one trial, got n={n}")
    if not (0 <= k <= n):
        raise BadInputError(f"k must lie in [0, n], got k={k}, n={n}")
    if not (0.0 < beta < 1.0):
        raise BadInputError(f"beta must lie in (0, 1), got {beta}")
    if k == n:
        return 1.0
    return float(beta_dist.ppf(1.0 - beta, k + 1, n - k))


def epsilon_lower_bound(*, false_positives: int, negatives: int, false_negatives: int, positives: int,
                        delta: float, alpha: float = 0.05) -> dict:
    """ε lower bound from a test's errors (Kairouz et al. 2015 region, Clopper–Pearson at 1 − α overall).

    Returns the bound with its ingredients (empirical rates and their upper bounds).
    """
    if not (0.0 <= delta < 1.0):
        raise BadInputError(f"delta must lie in [0, 1), got {delta}")
    if not (0.0 < alpha < 1.0):
        raise BadInputError(f"alpha must lie in (0, 1), got {alpha}")
    fpr_u = clopper_pearson_upper(false_positives, negatives, beta=alpha / 2.0)
    fnr_u = clopper_pearson_upper(false_negatives, positives, beta=alpha / 2.0)
    cands = [0.0]
    if fpr_u > 0 and 1.0 - delta - fnr_u > 0:
        cands.append(math.log((1.0 - delta - fnr_u) / fpr_u))
    if fnr_u > 0 and 1.0 - delta - fpr_u > 0:
        cands.append(math.log((1.0 - delta - fpr_u) / fnr_u))
    return {"epsilon_lower_bound": max(cands), "fpr": false_positives / negatives,
            "fnr": false_negatives / positives, "fpr_upper": fpr_u, "fnr_upper": fnr_u}


def _scores(labels: np.ndarray, counts: np.ndarray, canary_label: int) -> dict[str, np.ndarray]:
    """Per trial (rows): the candidate statistics of the released answers."""
    return {"count_first": counts[:, 0], "count_sum": counts.sum(axis=1),
            "canary_label": (labels == canary_label).sum(axis=1).astype(np.float64)}


def _errors(neg: np.ndarray, pos: np.ndarray, threshold: float, direction: str) -> tuple[int, int]:
    """(false positives, false negatives) of 'member iff score ≥ thr' (direction ge) or '≤ thr' (le)."""
    if direction == "ge":
        return int((neg >= threshold).sum()), int((pos < threshold).sum())
    return int((neg <= threshold).sum()), int((pos > threshold).sum())


def choose_test(neg: dict[str, np.ndarray], pos: dict[str, np.ndarray], *, delta: float, alpha: float,
                statistics: Sequence[str] = STATISTICS) -> tuple[str, float, str]:
    """On the calibration split: the (statistic, threshold, direction) with the largest ε_lb there."""
    best = (-1.0, statistics[0], math.inf, "ge")
    for name in statistics:
        values = np.unique(np.concatenate([neg[name], pos[name]]))
        if values.size > 400:  # thresholds at quantiles: enough resolution, bounded cost
            values = np.unique(np.quantile(values, np.linspace(0, 1, 400)))
        for thr in values:
            for direction in ("ge", "le"):
                fp, fn = _errors(neg[name], pos[name], float(thr), direction)
                lb = epsilon_lower_bound(false_positives=fp, negatives=neg[name].size, false_negatives=fn,
                                         positives=pos[name].size, delta=delta, alpha=alpha)["epsilon_lower_bound"]
                if lb > best[0]:
                    best = (lb, name, float(thr), direction)
    return best[1], best[2], best[3]


# -- the mechanism under audit ------------------------------------------------------------
def indknn_mechanism(reuse: bool = True, device: str = "cpu") -> Mechanism:
    """The product's mechanism: :func:`engine.answer_batch` on a fresh budget state (one ledger's life)."""

    def run(features, labels, queries, params, n_classes, run_key):
        n = features.shape[0]
        budgets = BudgetView(spent=np.zeros(n), budget=np.full(n, params.budget), deleted=np.zeros(n, bool),
                             times_selected=np.zeros(n, np.int64))
        pool = ReusePool.empty(features.shape[1]) if reuse else None
        answers = answer_batch(queries, source=ArraySource(features), row_to_ledger=np.arange(n, dtype=np.int64),
                               row_labels=labels.astype(np.int64), params=params, n_classes=n_classes,
                               budgets=budgets, run_key=run_key, first_index=0, reuse=pool, device=device)
        if (budgets.spent > budgets.budget).any():  # the filter's promise, checked on every trial
            raise AssertionError("a record was charged past its budget during the audit")
        return (np.array([a.label for a in answers], np.int64),
                np.array([a.released_count for a in answers], np.float64))

    return run


# -- the audit ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuditConfig:
    epsilon: float = 2.0
    delta: float = 1e-5
    conversion: str = "gdp"
    trials: int = 2000            # per world (with and without the canary)
    queries: int = 3              # queries aimed at the canary in each trial
    background: int = 40          # records of another label at the canary's location
    far: int = 60                 # records elsewhere (never candidates)
    dim: int = 8
    tau: float = 0.5
    sigma2: float = 0.5
    count_share: float = 0.98     # one count charge 1/(2σ1²) = count_share · B
    k_min: float = 1.0
    alpha: float = 0.05           # 1 − α: confidence of the lower bound
    reuse: bool = True
    seed: int | None = None       # None: OS entropy (run keys from `secrets`); an int: reproducible experiment

    def validate(self) -> "AuditConfig":
        if self.trials < 20:
            raise BadInputError(f"trials must be ≥ 20 per world (half calibrate, half evaluate), got {self.trials}")
        if self.queries < 1 or self.background < 0 or self.far < 0 or self.dim < 2:
            raise BadInputError("queries ≥ 1, background ≥ 0, far ≥ 0 and dim ≥ 2 are required")
        if not (0.0 < self.count_share <= 1.0):
            raise BadInputError(f"count_share must lie in (0, 1], got {self.count_share}")
        return self


@dataclass
class AuditResult:
    epsilon_lower_bound: float
    certified_epsilon: float
    conversion: str
    conversion_label: str
    delta: float
    budget: float
    confidence: float
    trials_per_world: int
    evaluation_trials_per_world: int
    statistic: str
    threshold: float
    direction: str
    fpr: float
    fnr: float
    fpr_upper: float
    fnr_upper: float
    params: dict
    config: dict
    references: list[str] = field(default_factory=lambda: list(REFERENCES))
    #: what both ε are stated for (SPEC §8): the canary is one record, in D' and not in D
    unit: str = "record"
    adjacency: str = "add/remove one record"

    @property
    def passed(self) -> bool:
        """The measured lower bound does not contradict the certificate."""
        return self.epsilon_lower_bound <= self.certified_epsilon

    def as_dict(self) -> dict:
        return dict(asdict(self), passed=self.passed)


def audit_params(config: AuditConfig) -> PrivacyParams:
    """The mechanism's parameters: B calibrated from (ε, δ); σ1 with 1/(2σ1²) = count_share · B (rounded so c1 ≤ B)."""
    budget = accounting.calibrate_budget(epsilon=config.epsilon, delta=config.delta, conversion=config.conversion)
    sigma1 = 1.0 / math.sqrt(2.0 * config.count_share * budget) * (1.0 + 1e-9)  # c1 rounds up: stay ≤ B
    return PrivacyParams(epsilon=config.epsilon, delta=config.delta, conversion=config.conversion, budget=budget,
                         kernel="cosine", tau=config.tau, sigma1=sigma1, sigma2=config.sigma2, nu=None,
                         k_min=config.k_min, planned_queries=config.queries).validate()


def audit_datasets(config: AuditConfig, rng: np.random.Generator):
    """(features of D, labels of D, canary vector, canary label); D' = D + the canary as its last row."""
    d = config.dim
    canary = np.zeros(d)
    canary[0] = 1.0
    near = canary + 0.05 * rng.standard_normal((config.background, d))
    far = rng.standard_normal((config.far, d))
    far[:, 0] = -np.abs(far[:, 0]) - 1.0  # on the other side: κ(x, canary) < 0 < τ
    x = np.concatenate([near, far]) if config.far else near
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    y = np.concatenate([np.zeros(config.background, np.int64), rng.integers(0, 3, config.far)])
    return x, y, canary.astype(np.float32), 1


def _run_key(seed: int | None, world: str, trial: int) -> int:
    if seed is None:
        return secrets.randbits(128)  # production noise source: OS entropy
    digest = hashlib.sha256(f"indknn-audit:{seed}:{world}:{trial}".encode()).digest()
    return int.from_bytes(digest[:16], "big")


def run_audit(config: AuditConfig = AuditConfig(), *, mechanism: Mechanism | None = None,
              on_progress: Callable[[int, int], None] | None = None) -> AuditResult:
    """Run ``config.trials`` trials per world, pick the test on half of them, bound ε on the other half."""
    config.validate()
    params = audit_params(config)
    mech = mechanism or indknn_mechanism(reuse=config.reuse)
    rng = np.random.default_rng(config.seed if config.seed is not None else secrets.randbits(64))
    x, y, canary, canary_label = audit_datasets(config, rng)
    x_in = np.concatenate([x, canary[None, :]])
    y_in = np.concatenate([y, [canary_label]])
    queries = np.repeat(canary[None, :], config.queries, axis=0)
    n_classes = 3
    out = {}
    for world, (fx, fy) in (("without", (x, y)), ("with", (x_in, y_in))):
        labels = np.empty((config.trials, config.queries), np.int64)
        counts = np.empty((config.trials, config.queries), np.float64)
        for t in range(config.trials):
            labels[t], counts[t] = mech(fx, fy, queries, params, n_classes, _run_key(config.seed, world, t))
            if on_progress is not None:
                on_progress(t + 1 + (config.trials if world == "with" else 0), 2 * config.trials)
        out[world] = _scores(labels, counts, canary_label)
    half = config.trials // 2
    cal_neg = {k: v[:half] for k, v in out["without"].items()}
    cal_pos = {k: v[:half] for k, v in out["with"].items()}
    stat, thr, direction = choose_test(cal_neg, cal_pos, delta=config.delta, alpha=config.alpha)
    neg, pos = out["without"][stat][half:], out["with"][stat][half:]
    fp, fn = _errors(neg, pos, thr, direction)
    bound = epsilon_lower_bound(false_positives=fp, negatives=neg.size, false_negatives=fn, positives=pos.size,
                                delta=config.delta, alpha=config.alpha)
    certified = accounting.epsilon_for_budget(budget=params.budget, delta=config.delta, conversion=config.conversion)
    return AuditResult(
        epsilon_lower_bound=bound["epsilon_lower_bound"], certified_epsilon=certified, conversion=config.conversion,
        conversion_label=accounting.CONVERSION_LABEL[config.conversion], delta=config.delta, budget=params.budget,
        confidence=1.0 - config.alpha, trials_per_world=config.trials, evaluation_trials_per_world=int(neg.size),
        statistic=stat, threshold=thr, direction=direction, fpr=bound["fpr"], fnr=bound["fnr"],
        fpr_upper=bound["fpr_upper"], fnr_upper=bound["fnr_upper"], params=params.as_dict(), config=asdict(config),
    )
