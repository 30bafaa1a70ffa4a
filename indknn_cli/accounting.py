"""From (ε, δ) to a per-record Rényi budget B and back (SPEC §3).

A record whose total charge is at most B has been handled by a mechanism that
is (α, α·B)-RDP for every α > 1 (individual Rényi filter, Feldman & Zrnic
2021; Ind-KNN paper Thm 2.6), i.e. it is μ-GDP with μ = sqrt(2B) when every
charge comes from a continuous Gaussian mechanism (individual GDP filter:
Smith & Thakurta 2022; Koskela, Tobaben & Honkela 2023).

Two conversions:

* ``gdp`` (default): the analytic Gaussian mechanism curve (Balle & Wang 2018,
  Thm 8):  δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2),  μ = sqrt(2B).
* ``rdp``: the RDP curve α ↦ α·B converted by dp-accounting's RdpAccountant
  (the conversion of Canonne, Kamath & Steinke 2020).

Rounding is always against the user: a calibrated B is rounded down, an ε is
rounded up, so converting a calibrated B back never exceeds the target ε.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

import numpy as np
from scipy.special import log_ndtr

from .errors import BadInputError

CONVERSIONS = ("gdp", "rdp")
CONVERSION_LABEL = {
    "gdp": "Gaussian-DP (analytic Gaussian curve, μ = sqrt(2B))",
    "rdp": "RDP (α·B, dp-accounting RdpAccountant)",
}


#: Documented ranges of the mechanism's parameters (README "Parameters", docs/FORMAT.md). Every bound keeps
#: the charges 1/(2σ1²) and ‖s‖²/(2σ2²K) finite and representable as float64, and the released K finite JSON.
PARAM_RANGES: dict[str, tuple[float, float]] = {
    "epsilon": (0.01, 100.0),      # a target ε outside this is a typo or meaningless (ε = 100: e^100)
    "delta": (1e-30, 0.1),         # δ must be "cryptographically small" but representable in the conversion
    "sigma1": (1e-4, 1e8),         # count noise; c1 = 1/(2σ1²) ∈ [5e-17, 5e7]
    "sigma2": (1e-4, 1e8),         # vote noise; σ2² neither underflows to 0 (NaN charges) nor overflows
    "k_min": (1.0, 1e6),           # clamp of the released count K_t
    "nu": (1e-6, 1e6),             # RBF bandwidth ν
    "planned_queries": (1, 1e9),   # T for the default σ1 = sqrt(T/(6B))
}


def check_range(name: str, value, *, flag: str | None = None) -> float:
    """``value`` as a float inside PARAM_RANGES[name] (bounds included); else BadInputError naming it."""
    lo, hi = PARAM_RANGES[name]
    label = flag or name
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and lo <= value <= hi
    if not ok:
        raise BadInputError(f"{label} must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def _check_delta(delta: float) -> float:
    if isinstance(delta, bool) or not (isinstance(delta, (int, float)) and 0.0 < float(delta) < 1.0):
        raise BadInputError(f"delta must lie in (0, 1), got {delta!r}")
    return float(delta)


def _check_epsilon(epsilon: float) -> float:
    if isinstance(epsilon, bool) or not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise BadInputError(f"epsilon must be a positive finite number, got {epsilon!r}")
    return float(epsilon)


def _check_conversion(conversion: str) -> str:
    if conversion not in CONVERSIONS:
        raise BadInputError(f"conversion must be one of {', '.join(CONVERSIONS)}, got {conversion!r}")
    return conversion


_GDP_DELTA_ULP = 2.0 ** -50


def gdp_delta(*, epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP (Balle & Wang 2018, Thm 8; Dong, Roth & Su 2022, Cor 2.13)."""
    if mu <= 0:
        return 0.0
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    log_first, log_b = float(log_ndtr(a)), float(log_ndtr(b))
    first, second = math.exp(log_first), math.exp(epsilon + log_b)
    # Rounded up (review 65, F1; review 53, F1): where ε/μ is large (small ε and δ) the two terms nearly cancel, and
    # the float difference came out up to 3e-10 (relative) *below* the true δ, so a calibrated B could exceed the
    # exact solution by ~1e-13 and a printed ε fall below the exact one. Each term is exp(x) of a log term x computed
    # to a few ulps of its parts (ε + log Φ(b) for the second: |ε| + |log Φ(b)|), so its relative error is about
    # that size times 2^-52; (size + 2)·2^-50 of each term covers it fourfold (measured: ≤ 2.2e-15 of the larger),
    # so this float δ is an upper bound of the exact curve (checked against mpmath at 60 digits in
    # tests/test_review_65.py; review 68, F1: the second term's error, which grows with ε, matters at large B and ε).
    margin = (first * (abs(log_first) + 2.0) + second * (epsilon + abs(log_b) + 2.0)) * _GDP_DELTA_ULP
    return max(0.0, first - second) + margin


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]


def _check_budget(budget: float) -> float:
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 0):
        raise BadInputError(f"budget must be a finite number ≥ 0, got {budget!r}")
    return float(budget)


def gdp_epsilon(*, budget: float, delta: float) -> float:
    """Smallest ε with δ(ε) ≤ delta for μ = sqrt(2·budget): the smallest float that passes (rounded up)."""
    delta = _check_delta(delta)
    budget = _check_budget(budget)
    if budget == 0:
        return 0.0
    mu = math.sqrt(2.0 * budget)
    if gdp_delta(epsilon=0.0, mu=mu) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(epsilon=hi, mu=mu) > delta:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            return math.inf
    # δ(ε) decreases in ε: bisect over the float64 bit patterns (ordered like the positive
    # floats) down to adjacent floats, so hi is exactly the smallest float with δ(hi) ≤ delta.
    # That makes the result a deterministic, monotone function of (B, δ); a tolerance-based
    # stop made ε(B) wobble by ~1e-12 (not monotone in B, and calibrate_budget then failed).
    lo_i, hi_i = _float_bits(lo), _float_bits(hi)
    while hi_i - lo_i > 1:
        mid_i = (lo_i + hi_i) // 2
        if gdp_delta(epsilon=_bits_float(mid_i), mu=mu) > delta:
            lo_i = mid_i
        else:
            hi_i = mid_i
    # hi itself is checked feasible; one float more is not necessarily (δ(ε) is monotone only up
    # to rounding noise), so hi is the rounded-up answer.
    return _bits_float(hi_i)


@lru_cache(maxsize=4096)
def rdp_epsilon(*, budget: float, delta: float) -> float:
    """ε at δ of the RDP curve α ↦ α·budget, via dp-accounting (rounded up)."""
    delta = _check_delta(delta)
    budget = _check_budget(budget)
    if budget == 0:
        return 0.0
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    orders = np.concatenate([np.linspace(1.01, 8, 700), np.linspace(8.05, 64, 560),
                             np.geomspace(64.5, 1e5, 300)])
    accountant = RdpAccountant(orders=list(orders))
    # The curve α ↦ α·B is that of a Gaussian mechanism of noise multiplier σ = 1/sqrt(2B)
    # (RDP α/(2σ²)); composing it as ρ-zCDP with ρ = B gives the same RDP values without
    # forming σ² (which overflows for a tiny B: 1/(2·1e-311) is not a float).
    accountant.compose(dp_accounting.ZCDpEvent(rho=float(budget)))
    return math.nextafter(float(accountant.get_epsilon(delta)), math.inf)


def rdp_epsilon_closed_form(*, budget: float, delta: float) -> float:
    """The paper's bound min_α αB + log(1/δ)/(α−1) = B + 2·sqrt(B·log(1/δ))."""
    return budget + 2.0 * math.sqrt(budget * math.log(1.0 / delta))


def epsilon_for_budget(*, budget: float, delta: float, conversion: str = "gdp") -> float:
    """The ε (rounded up) that a per-record budget B certifies at δ."""
    _check_conversion(conversion)
    if conversion == "gdp":
        return gdp_epsilon(budget=budget, delta=delta)
    return rdp_epsilon(budget=float(budget), delta=float(delta))


def bisect_largest(ok, *, hi0: float, rel_tol: float, too_large: str) -> float:
    """Largest x > 0 with ``ok(x)`` for ``ok`` monotone decreasing, to ``rel_tol``; returns a value that was
    checked (``ok(lo)`` held), or 0.0. Doubling from ``hi0`` first; past 1e9 raises ``too_large``."""
    lo, hi = 0.0, hi0
    while ok(hi):
        lo, hi = hi, hi * 2.0
        if hi > 1e9:
            raise BadInputError(too_large)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo <= rel_tol * max(hi, 1e-300):
            break
    return lo


def calibrate_budget(*, epsilon: float, delta: float, conversion: str = "gdp") -> float:
    """Largest B (rounded down) whose conversion gives ε ≤ epsilon at delta."""
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    _check_conversion(conversion)

    def ok(b: float) -> bool:
        return epsilon_for_budget(budget=b, delta=delta, conversion=conversion) <= epsilon

    lo = bisect_largest(ok, hi0=1.0, rel_tol=1e-13, too_large=f"epsilon={epsilon} is too large to calibrate")
    # lo is a budget that was checked: ok(lo) holds. (Stepping below it is not safe: the computed
    # ε(B) is monotone in B only up to floating-point noise, ~1e-13 relative, so a smaller B can
    # convert to a hair more ε and fail the check.)
    budget = lo
    if budget <= 0 or not ok(budget):
        raise BadInputError(f"no positive budget certifies epsilon={epsilon} at delta={delta}")
    return budget


def epsilon_by_conversion(*, budget: float, delta: float) -> dict[str, float]:
    return {c: epsilon_for_budget(budget=budget, delta=delta, conversion=c) for c in CONVERSIONS}


def realised_epsilons(spent: np.ndarray, *, budget: float, delta: float, conversion: str = "gdp",
                      grid_points: int = 2049, epsilon_at=None) -> np.ndarray:
    """Realised individual loss ε_i (the conversion applied to spent_i), rounded up.

    A descriptive figure, not a second guarantee (SPEC §8). Evaluated on a grid
    of spent values in [0, B] and looked up at the next grid point above, so it
    never understates the loss and never exceeds ε(B). ``epsilon_at(spent)`` replaces the conversion (a privately
    tuned ledger: the search composed with the spent, ``tuning.composed_epsilon``); it must be non-decreasing.
    """
    spent = np.clip(np.asarray(spent, dtype=np.float64), 0.0, budget)
    if spent.size == 0:
        return spent.copy()
    grid = np.linspace(0.0, budget, grid_points)
    grid[-1] = budget
    if epsilon_at is None:
        def epsilon_at(b: float) -> float:
            return epsilon_for_budget(budget=b, delta=delta, conversion=conversion)
    eps_grid = np.array([epsilon_at(float(g)) for g in grid])
    eps_grid = np.maximum.accumulate(eps_grid)
    idx = np.searchsorted(grid, spent, side="left")
    return eps_grid[np.minimum(idx, grid_points - 1)]


def default_sigma1(*, planned_queries: int, budget: float) -> float:
    """The paper's σ1 = sqrt(T / (6B)) (a heuristic; the filter is the guarantee, SPEC §7)."""
    if planned_queries <= 0:
        raise BadInputError(f"planned queries must be positive, got {planned_queries}")
    return math.sqrt(planned_queries / (6.0 * budget))
