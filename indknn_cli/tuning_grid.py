"""Defaults of `index --tune` (no heavy imports: the CLI shows them in `--help`). docs/TUNING.md explains them.

τ grid: a public prior on the *extractor* (the store's ``extractor`` attribute, fixed before any record is read),
never on the private data. Each prior is placed where the share of records within τ of a query runs from about a
quarter down to 1.5 % (halving at each step), measured on public data with that extractor (docs/TUNING.md
"Defaults"): text (all-MiniLM-L6-v2 and its kind; unrelated texts score about 0–0.1, same-topic 0.1–0.5) 0.1–0.3,
HOG 0.6–0.8, raw pixels 0.5–0.7. Other extractors (``vectors``, ``image``) have no prior and get a broad grid over
the cosine range; pass ``--tune-taus`` for them. With the RBF kernel the cosine prior is mapped through
κ = exp(−(2 − 2·cos)/ν²), exact for the store's unit vectors.

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

#: τ priors (cosine) per extractor name: a query's share of records within τ ≈ 27 %, 14 %, 7 %, 3.3 %, 1.5 %
#: (text: AG News with all-MiniLM-L6-v2; hog and pixels: MNIST; docs/TUNING.md "Defaults").
TAU_PRIORS = {"text": (0.1, 0.15, 0.2, 0.25, 0.3), "hog": (0.6, 0.65, 0.7, 0.75, 0.8),
              "pixels": (0.5, 0.55, 0.6, 0.65, 0.7)}
#: cosine grid for an extractor without a prior: the whole useful range, coarsely.
BROAD_TAUS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_TAUS = TAU_PRIORS["text"]  # the prior of the default extractor (text)
#: σ2 grid at the reference budget per planned query (below); scaled for other (B, T) by ``budget_relative_sigma2s``.
DEFAULT_SIGMA2S = (0.5, 0.8, 1.2)
#: B / T at which DEFAULT_SIGMA2S applies unscaled: B_serve = 0.0229 of a privately tuned ε = 1, δ = 1e-5 ledger
#: (random search with a 20 % share, the defaults when it was set) over T = 1,000 planned queries, where σ2 = 0.8
#: lasts on AG News (docs/TUNING.md). A fixed public constant: the grid follows each ledger's own B_serve and T.
REFERENCE_BUDGET_PER_QUERY = 2.29e-5
#: The exponential mechanism's share of ε (30 % since 2026-11-29, 20 % before: in exact expectation 30 % chose
#: better at ε ≤ 1 on AG News and MNIST HOG and within 0.15 points at ε = 1.5–2 on AG News; docs/TUNING.md, "The
#: search's share"). Random search keeps 20 %: measured there, a larger share did no better (review 80, F8).
DEFAULT_TUNE_SHARE = 0.3
RANDOM_SEARCH_TUNE_SHARE = 0.2
DEFAULT_TUNE_RUNS = 10.0
DEFAULT_TUNE_SHAPE = 0.0
DEFAULT_TUNE_QUERIES = 500
#: How the search selects θ (tuning_accounting.METHODS): the exponential mechanism over the whole grid.
DEFAULT_TUNE_METHOD = "exp-mech"
DEFAULT_PLANNED_QUERIES = 1000


def default_share(method: str | None) -> float:
    """The search's share of ε when ``--tune-share`` is not given: 20 % for random search, else 30 %."""
    return RANDOM_SEARCH_TUNE_SHARE if method == "random-search" else DEFAULT_TUNE_SHARE


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


def default_taus(*, extractor: str | None, kernel: str = "cosine", nu: float | None = None) -> tuple[tuple, str]:
    """(τ grid, rule) for ``--tune`` without ``--tune-taus``: the prior of the extractor ``extractor`` (its name, or
    ``name:model``; a public attribute of the store), else :data:`BROAD_TAUS`; mapped to RBF κ when ``kernel`` is rbf.

    The rule is recorded in the ledger's tuning record beside the grid."""
    name = str(extractor or "").split(":", 1)[0]
    base = TAU_PRIORS.get(name)
    rule = (f"prior for {name} features" if base is not None
            else f"broad (no τ prior for extractor {name or 'unknown'!r}; give --tune-taus)")
    base = base if base is not None else BROAD_TAUS
    if kernel == "rbf":
        if isinstance(nu, bool) or not (isinstance(nu, numbers.Real) and math.isfinite(nu) and nu > 0):
            raise BadInputError(f"nu must be a finite number > 0 for the RBF kernel, got {nu!r}")
        # unit vectors: ‖x − q‖² = 2 − 2·cos, and κ = exp(−‖x − q‖²/ν²) is increasing in cos
        return (tuple(float(f"{math.exp(-(2.0 - 2.0 * c) / (nu * nu)):.6g}") for c in base),
                rule + ", mapped to RBF κ = exp(−(2 − 2·cos)/ν²)")
    return tuple(base), rule
