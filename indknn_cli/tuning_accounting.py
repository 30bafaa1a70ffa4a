"""The privacy cost of the private search (``index --tune private``), with dp-accounting only.

Two ways to select θ = (τ, σ2) from the grid, each a DpEvent of dp-accounting composed with serving's
α·B_serve (``ZCDpEvent(B_serve)``) in its ``RdpAccountant``; B_serve is the largest budget (bisection, rounded
down) whose composed ε is ≤ the target at δ, verified once more at the end.

* ``exp-mech`` (the default): every grid point is scored once on the same shards (sensitivity 1 per score,
  docs/TUNING.md "Why one run costs ρ") and the argmax of score + Gumbel(b) is released, nothing else. That is
  the exponential mechanism P[θ] ∝ exp(u(θ)/b) (Gumbel-max trick), which is ε-bounded-range with ε = 2Δ/b
  (Durfee & Rogers, "Practical differentially private top-k selection with pay-what-you-get composition",
  NeurIPS 2019, Lemma 4.2 and Def. 4.1: the log-ratio of two outputs' probabilities moves by at most 2Δ/b), and an
  ε-bounded-range mechanism is ε²/8-zCDP (Cesar & Rogers, "Bounding, concentrating, and truncating: unifying
  privacy loss composition for data analytics", ALT 2021, Lemma 3.2). With Δ = 1: ρ = 1/(2b²), i.e.
  ``ZCDpEvent(rho=ρ)`` with b = 1/sqrt(2ρ), the same ρ as one Gaussian-noised score of σ_s = b. dp-accounting has
  no exponential-mechanism event; this one-line conversion is the only privacy maths written here.
* ``random-search``: Papernot & Steinke, "Hyperparameter tuning with Rényi differential privacy" (ICLR 2022):
  K runs, K from a truncated negative binomial or Poisson distribution, each a random grid point with a
  Gaussian-noised score, the best kept: ``RepeatAndSelectDpEvent(ZCDpEvent(ρ_run), mean, shape)`` (its
  ``_compute_rdp_repeat_and_select``: Theorem 2 and Theorem 6 of the paper).

Every function here takes ``method`` as a required keyword: a caller that forgets it is refused rather than
accounted as the other method. Either way every record pays the search's RDP curve once; the ledger records ``method``, ``rho_run`` (ρ of one
scoring: of the whole selection under exp-mech) and, for random search, ``mean_runs`` and ``shape``.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import BadInputError

#: Rényi orders of every figure here. Fewer than accounting.rdp_epsilon's 1560: dp-accounting's
#: repeat-and-select is quadratic in the number of orders (its monotonicity pass). ε at δ is a minimum over
#: the orders given, each a valid bound, so any grid gives an upper bound; a different grid (dp-accounting's
#: default orders, say) gives a slightly different one (docs/TUNING.md, "Accounting").
ORDERS = tuple(float(a) for a in np.concatenate([np.linspace(1.02, 8, 80), np.linspace(8.25, 64, 60),
                                                  np.geomspace(66, 1e5, 40)]))
POISSON = math.inf


#: How the search selects θ: the exponential mechanism over the whole grid (default), or random search.
EXP_MECH = "exp-mech"
RANDOM_SEARCH = "random-search"
METHODS = (EXP_MECH, RANDOM_SEARCH)


def check_method(method) -> str:
    if method not in METHODS:
        raise BadInputError(f"--tune-method must be one of {', '.join(METHODS)}, got {method!r}")
    return method


# -- validation ---------------------------------------------------------------------------------------
def _positive(name: str, value, *, lo: float = 0.0, hi: float = math.inf, lo_open: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        raise BadInputError(f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def check_shape(shape) -> float:
    """η ≥ 0 (0: logarithmic, 1: geometric, inf: Poisson)."""
    if isinstance(shape, str):
        if shape.strip().lower() == "poisson":
            return POISSON
        try:
            shape = float(shape)
        except ValueError:
            raise BadInputError(f"--tune-shape must be a number ≥ 0 or 'poisson', got {shape!r}") from None
    return _positive("--tune-shape (η)", shape, lo=0.0, lo_open=False)


# -- the search's event ---------------------------------------------------------------------------------
def tuning_event(*, rho_run: float, method: str, mean_runs: float | None = None, shape=None):
    """The whole search as a DpEvent.

    ``exp-mech``: ``ZCDpEvent(rho=ρ)``: one exponential-mechanism selection over the grid, ρ = 1/(2b²) (module
    docstring). ``random-search``: ``RepeatAndSelectDpEvent(ZCDpEvent(ρ_run), mean, shape)``; ``ZCDpEvent(ρ)``
    is (α, α·ρ)-RDP at every α, one base run. dp-accounting's RepeatAndSelectDpEvent: "the total number of runs
    is randomized ... Poisson (shape=infinity), Geometric (shape=1), Logarithmic (shape=0), or Truncated
    Negative binomial (0<shape<infinity)".
    """
    from dp_accounting import dp_event

    rho_run = _positive("ρ_run", rho_run)
    if check_method(method) == EXP_MECH:
        return dp_event.ZCDpEvent(rho=rho_run)
    mean_runs = _positive("--tune-runs (mean number of runs)", mean_runs, lo=1.0, hi=1e4, lo_open=False)
    shape = check_shape(shape)
    return dp_event.RepeatAndSelectDpEvent(event=dp_event.ZCDpEvent(rho=rho_run), mean=mean_runs,
                                                shape=shape)


def search_kwargs(*, method: str, mean_runs: float | None = None, shape=None) -> dict:
    """``method``, ``mean_runs`` and ``shape`` as the functions here take them: None for exp-mech (no number of
    runs), checked values for random search."""
    if check_method(method) == EXP_MECH:
        return {"method": method, "mean_runs": None, "shape": None}
    return {"method": method, "mean_runs": float(mean_runs), "shape": check_shape(shape)}


def search_args(tuning: dict) -> dict:
    """The keyword arguments of :func:`tuning_event` for a ledger's tuning record (its metadata ``tuning``).
    Records written before ``method`` existed are random searches."""
    return {"rho_run": float(tuning["rho_run"]),
            **search_kwargs(method=tuning.get("method", RANDOM_SEARCH), mean_runs=tuning.get("mean_runs"),
                            shape=tuning.get("shape"))}


def _accountant(*events):
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(orders=list(ORDERS))
    for ev in events:
        acc.compose(ev)
    return acc


def tuning_epsilon(*, rho_run: float, delta: float, method: str, mean_runs: float | None = None,
                   shape=None) -> float:
    """ε at δ of the search alone (RDP, dp-accounting RdpAccountant), rounded up."""
    acc = _accountant(tuning_event(rho_run=rho_run, mean_runs=mean_runs, shape=shape, method=method))
    return math.nextafter(float(acc.get_epsilon(delta)), math.inf)


def composed_epsilon(*, rho_run: float, budget_serve: float, delta: float, method: str,
                     mean_runs: float | None = None, shape=None) -> float:
    """ε at δ of tuning then serving: the search's RDP curve + α·B_serve (``ZCDpEvent(B_serve)``), rounded up."""
    from dp_accounting import dp_event

    events = [tuning_event(rho_run=rho_run, mean_runs=mean_runs, shape=shape, method=method)]
    if budget_serve > 0:
        events.append(dp_event.ZCDpEvent(rho=float(budget_serve)))
    return math.nextafter(float(_accountant(*events).get_epsilon(delta)), math.inf)


def _bisect_largest(ok, *, hi0: float) -> float:
    """Largest x in (0, ...) with ok(x), ok monotone decreasing; returns a value that was checked (or 0).

    A value the accountant cannot evaluate (dp-accounting's repeat-and-select raises a math domain error when
    a tiny ρ underflows, e.g. ε = 0.01 at δ = 1e-30) counts as not ok: never certified, so never chosen."""
    from .accounting import bisect_largest

    def certified(x: float) -> bool:
        try:
            return ok(x)
        except (ValueError, OverflowError, ZeroDivisionError):
            return False

    return bisect_largest(certified, hi0=hi0, rel_tol=1e-12, too_large="the target ε is too large to calibrate")


def rho_for_share(*, epsilon: float, delta: float, share: float, method: str, mean_runs: float | None = None,
                  shape=None) -> float:
    """Largest ρ_run (rounded down) whose search alone costs ε_tune ≤ share·ε at δ."""
    share = _positive("--tune-share", share, hi=0.9)
    target = share * epsilon
    rho = _bisect_largest(lambda r: tuning_epsilon(rho_run=r, mean_runs=mean_runs, shape=shape, delta=delta,
                                                   method=method) <= target, hi0=1e-3)
    if rho <= 0:
        runs = "" if method == EXP_MECH else f" with mean {mean_runs:g} runs"
        raise BadInputError(f"--tune-share {share:g} of ε={epsilon:g} leaves no positive per-run budget at "
                            f"δ={delta:g}{runs}; raise the share" + ("" if method == EXP_MECH else
                                                                     " or lower --tune-runs"))
    return rho


def serving_budget(*, epsilon: float, delta: float, rho_run: float, method: str, mean_runs: float | None = None,
                   shape=None) -> float:
    """Largest B_serve (rounded down, never overshooting) with composed ε(δ) ≤ epsilon; verified."""
    def ok(b: float) -> bool:
        return composed_epsilon(rho_run=rho_run, mean_runs=mean_runs, shape=shape, budget_serve=b,
                                delta=delta, method=method) <= epsilon

    try:
        within = ok(0.0)
    except (ValueError, OverflowError, ZeroDivisionError):
        within = False
    if not within:
        raise BadInputError(f"the tuning alone costs more than ε={epsilon:g} at δ={delta:g}")
    b = _bisect_largest(ok, hi0=1e-3)
    if b <= 0 or not ok(b):
        raise BadInputError(f"no positive serving budget is left of ε={epsilon:g} at δ={delta:g} after tuning")
    return b


# -- the exponential mechanism's noise --------------------------------------------------------------------------
def gumbel_scale(rho: float) -> float:
    """b = 1/sqrt(2ρ): the Gumbel scale whose argmax selection is ρ-zCDP for scores of sensitivity 1."""
    return 1.0 / math.sqrt(2.0 * _positive("ρ", rho))


def score_noise_std(*, rho: float, method: str) -> float:
    """Standard deviation of the noise on one score: Gumbel(b) under exp-mech (π·b/√6), N(0, 1/(2ρ)) per run
    under random search. A function of ρ alone (public)."""
    if check_method(method) == EXP_MECH:
        return math.pi * gumbel_scale(rho) / math.sqrt(6.0)
    return 1.0 / math.sqrt(2.0 * _positive("ρ", rho))


def exp_mech_select(scores, *, rho: float, rng: np.random.Generator) -> int:
    """argmax of score + Gumbel(b), b = :func:`gumbel_scale`: the exponential mechanism P[g] ∝ exp(score_g / b).
    Only the index is released (never a noisy score)."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or not np.all(np.isfinite(s)):
        raise ValueError("exp_mech_select needs a non-empty vector of finite scores")
    return int(np.argmax(s + rng.gumbel(loc=0.0, scale=gumbel_scale(rho), size=s.size)))


# -- the number of runs -----------------------------------------------------------------------------------
def sampling_gamma(*, shape: float, mean_runs: float) -> float:
    """γ of the TNB(η, γ) that :func:`draw_runs` samples, for ``shape`` η ∈ [0, ∞) and mean ``mean_runs``.

    dp-accounting inverts the mean by bisection and returns the lower end, γ_acc; its Theorem-2 bound
    (``_compute_rdp_repeat_and_select``: ε̂-term + (1+η)·log(1/γ_acc)/λ̂ + log(mean)/(λ−1)) is evaluated at γ_acc and
    ``mean``. The TNB at γ_acc has a mean up to ~4e-10 *above* ``mean`` (review 44, L1: the composed ε then sat
    ~1e-10 over its target). Sampling at the smallest γ ≥ γ_acc whose mean is ≤ ``mean`` makes both terms round
    against the user: log(1/γ_acc) ≥ log(1/γ) and log(mean) ≥ log(E[K])."""
    from dp_accounting.rdp.rdp_privacy_accountant import (_gamma_truncated_negative_binomial,
                                                          _truncated_negative_binomial_mean)

    def too_high(g: float) -> bool:
        return g < 1.0 and _truncated_negative_binomial_mean(g, shape) > mean_runs

    gamma = _gamma_truncated_negative_binomial(shape, mean_runs)
    lo, step = gamma, gamma * 1e-12
    while too_high(gamma):  # doubling steps up to a γ whose mean is ≤ the target
        lo, gamma = gamma, min(1.0, gamma + step)
        step *= 2.0
    for _ in range(200):  # then back down towards it (review 45, F4: at η = 1e9 the doubling overshot the mean by 9 %)
        if gamma - lo <= gamma * 1e-13:
            break
        mid = (lo + gamma) / 2.0
        if too_high(mid):
            lo = mid
        else:
            gamma = mid
    return gamma


def draw_runs(*, mean_runs: float, shape: float, rng: np.random.Generator) -> int:
    """K from the distribution dp-accounting accounts for (Papernot & Steinke 2022, §2).

    Truncated negative binomial TNB(η, γ): P[K=k] ∝ C(k+η−1, k)·(1−γ)^k, k ≥ 1 (η = 0: logarithmic
    P[K=k] ∝ (1−γ)^k / k); γ from the mean as the accountant maps it, nudged up so that the sampled mean is ≤
    ``mean`` (:func:`sampling_gamma`; the bound uses ``mean``). Poisson: K ~ Poisson(mean), K = 0 possible.
    """
    shape = check_shape(shape)
    if shape == POISSON:
        return int(rng.poisson(mean_runs))
    gamma = sampling_gamma(shape=shape, mean_runs=mean_runs)
    if gamma >= 1.0:
        return 1
    if shape == 0:
        return int(rng.logseries(1.0 - gamma))
    if -math.expm1(shape * math.log(gamma)) >= 1e-3:  # P[NB ≥ 1] = 1 − γ^η: rejection needs few draws
        while True:  # NB(η, γ) conditioned on K ≥ 1
            k = int(rng.negative_binomial(shape, gamma))
            if k >= 1:
                return k
    # a mean close to 1: rejection would draw ~1/(1 − γ^η) times (review 45, F5: 8e-10 at --tune-runs 1.000000001
    # --tune-shape 2, a hang under the ledger's lock). Inversion of P[K=k | K ≥ 1] ∝ C(k+η−1, k)·(1−γ)^k, whose sum
    # over k ≥ 1 is γ^−η − 1.
    q = 1.0 - gamma
    u = rng.random() * math.expm1(-shape * math.log(gamma))
    k, term = 1, shape * q
    while u > term and term > 0.0:
        u -= term
        term *= (k + shape) / (k + 1) * q
        k += 1
    return k


