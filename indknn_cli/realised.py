"""Realised individual loss ε_i of a ledger's records (SPEC §3; descriptive, not a second guarantee).

ε_i is the conversion of record i's spent (its own filter's charges) at δ, rounded up, and never shown above the
guarantee. On a privately tuned ledger every record also took part in the search, so ε_i composes the search with
spent_i by RDP, as the headline does (docs/TUNING.md "`account`"; audit 9, F2).
"""

from __future__ import annotations

import numpy as np

from .accounting import epsilon_for_budget, realised_epsilons

#: Above this many distinct spent values the realised loss is looked up on
#: accounting.realised_epsilons' grid (rounded up) instead of converted exactly.
EXACT_CONVERSION_LIMIT = 256


#: Grid of the realised loss of a privately tuned ledger above EXACT_CONVERSION_LIMIT distinct values (each point
#: is one dp-accounting composition, ~6 ms).
TUNED_GRID_POINTS = 257


def realised_loss(spent, *, budget: float, delta: float, conversion: str, tuning: dict | None = None) -> np.ndarray:
    """ε_i = conversion(min(spent_i, B), δ), rounded up (SPEC §3 "individual loss").

    A privately tuned ledger (``tuning``: its metadata record, mode private): every record took part in the
    search as well, so ε_i composes the search with spent_i by RDP, as the headline does
    (``tuning.composed_epsilon``; audit 9, F2), and the Gaussian-DP conversion does not apply (NaN: shown as
    null / "—").

    Up to EXACT_CONVERSION_LIMIT distinct values are converted exactly;
    more are looked up on the grid of :func:`accounting.realised_epsilons`
    (the next grid point above: never understated, never above ε(B)).
    """
    s = np.clip(np.asarray(spent, dtype=np.float64), 0.0, budget)
    if s.size == 0:
        return s.copy()
    tuned = bool(tuning) and tuning.get("mode") == "private"
    if tuned and conversion != "rdp":
        return np.full(s.shape, np.nan)

    if tuned:
        from .tuning_accounting import composed_epsilon, search_args

        search = search_args(tuning)

    def eps_at(b: float) -> float:
        if tuned:
            return composed_epsilon(budget_serve=b, delta=delta, **search)
        return epsilon_for_budget(budget=b, delta=delta, conversion=conversion)

    uniq, inv = np.unique(s, return_inverse=True)
    if uniq.size > EXACT_CONVERSION_LIMIT:
        return realised_epsilons(s, budget=budget, delta=delta, conversion=conversion, epsilon_at=eps_at,
                                 **({"grid_points": TUNED_GRID_POINTS} if tuned else {}))
    vals = np.array([eps_at(float(u)) for u in uniq])
    # The true ε(s) is non-decreasing in s and ε(B) is the guarantee; the computed one is monotone only
    # up to ~1e-13 rounding noise. Enforce both, so no realised figure ever shows above the guarantee.
    cap = eps_at(float(budget))
    vals = np.minimum(np.maximum.accumulate(vals), cap)
    return vals[inv.reshape(s.shape)]
