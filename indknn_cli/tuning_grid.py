"""Defaults of `index --tune` (no heavy imports: the CLI shows them in `--help`). docs/TUNING.md explains them.

τ grid: cosine thresholds for sentence-embedding features (all-MiniLM-L6-v2 and its kind), where unrelated
texts score about 0–0.1 and same-topic texts 0.1–0.5: a public prior on the extractor, not on the private data.

σ2 grid: *budget-relative*. A record selected in n of the T planned queries pays about n·κ²/(2σ2²K) of its
budget B (SPEC §2 step 3), and with K candidates per query over N records n ≈ T·K/N, so the budget lasts
when σ2² ≳ T·κ²/(2·N·B): the σ2 at which depletion sets in scales with sqrt(T/B). The default grid is
therefore :data:`DEFAULT_SIGMA2S` at the reference budget per planned query :data:`REFERENCE_BUDGET_PER_QUERY`
and is scaled by sqrt(REFERENCE_BUDGET_PER_QUERY · T / B) for the ledger's own B and T — public figures, fixed
before the search reads any record. N and κ are private and stay in the grid's spread. A grid given with
``--tune-sigma2s`` is used as given.

Number of runs: logarithmic distribution (η = 0) with mean 10: at the same share it costs less per run than the
geometric one (dp-accounting's RepeatAndSelectDpEvent), so more runs fit.
"""

import math
import numbers

from .errors import BadInputError

DEFAULT_TAUS = (0.1, 0.15, 0.2, 0.25, 0.3)
#: σ2 grid at the reference budget per planned query (below); scaled for other (B, T) by ``budget_relative_sigma2s``.
DEFAULT_SIGMA2S = (0.5, 0.8, 1.2)
#: B / T at which DEFAULT_SIGMA2S applies unscaled: B_serve = 0.0229 of a privately tuned ε = 1, δ = 1e-5 ledger
#: (20 % share) over T = 1,000 planned queries, where σ2 = 0.8 lasts on AG News (docs/TUNING.md).
REFERENCE_BUDGET_PER_QUERY = 2.29e-5
DEFAULT_TUNE_SHARE = 0.2
DEFAULT_TUNE_RUNS = 10.0
DEFAULT_TUNE_SHAPE = 0.0
DEFAULT_TUNE_QUERIES = 500
DEFAULT_PLANNED_QUERIES = 1000


def budget_relative_sigma2s(*, budget: float, planned_queries: int | None,
                            base: tuple = DEFAULT_SIGMA2S) -> tuple[float, ...]:
    """The default σ2 grid for a per-record budget B over T planned queries: base · sqrt(ref · T / B), 3 digits.

    ``budget`` and ``planned_queries`` are the ledger's public parameters (never a figure of the data).
    """
    if isinstance(budget, bool) or not (isinstance(budget, numbers.Real) and math.isfinite(budget) and budget > 0):
        raise BadInputError(f"budget must be a finite number > 0, got {budget!r}")
    t = planned_queries or DEFAULT_PLANNED_QUERIES  # as serving's defaults read it (0 or None: 1,000)
    if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 1:
        raise BadInputError(f"planned_queries must be an integer ≥ 1, got {planned_queries!r}")
    factor = math.sqrt(REFERENCE_BUDGET_PER_QUERY * int(t) / float(budget))
    return tuple(float(f"{s * factor:.3g}") for s in base)
