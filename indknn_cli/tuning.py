"""Private choice of (τ, σ2) at a stated cost (issue 18; docs/TUNING.md has the derivation).

The search's cost is accounted with dp-accounting only (:mod:`indknn_cli.tuning_accounting`): the exponential
mechanism over the whole grid (``--tune-method exp-mech``, the default; one ``ZCDpEvent``), or the random
search of Papernot & Steinke, "Hyperparameter tuning with Rényi differential privacy" (ICLR 2022,
arXiv:2110.03620), ``RepeatAndSelectDpEvent(event, mean, shape)`` (``--tune-method random-search``), each
composed with serving in ``dp_accounting.rdp.RdpAccountant``.

**One base run** for a candidate θ = (τ, σ2), with per-run cost ρ (in the ledger's ρ units):

* public coin (a hash of the tuning seed and the record's own vector and label, so a record's coin depends on
  itself only; not its id, which ``embed`` may derive from the row's position: audit 4, F1):
  every private record gets a shard s ∈ [0, S) and a rank u; in each shard the record with the smallest u is
  the shard's *validation record*, the others are its *P* records;
* each shard answers its validation record's vector as serving would at full scale, emulated from the shard's
  own records and public figures only (:mod:`indknn_cli.tuning_base`: candidates κ ≥ τ among its P records
  stand for S times as many, with the serving budget B_serve, σ1, K_min and the depletion of T planned queries);
* score = the sum over shards of (the chance that serving answers the shard's validation record right) ** 4
  (:func:`indknn_cli.tuning_base.emulated_expected`: serving's vote noise modelled with a margin share from the
  label agreement of the shard's pairs within τ; each term in [0, 1]) + N(0, σ_s²), σ_s = 1/sqrt(2ρ).
  (:func:`~indknn_cli.tuning_base.emulated_correct`, the count of shards whose one emulated answer is right, was
  the score before 2026-11-27; it is kept for ``bench/tuning_emulation_check.py``, docs/TUNING.md.)

Why this is (α, α·ρ)-RDP for every record: a record's coin puts it in one shard, and whatever a shard computes
reads only that shard's records and noise keyed by the shard's index. Adding or removing one record therefore
changes at most its own shard's term (it may also replace the shard's validation record); each term lies in
[0, 1], so the score moves by at most 1 for any fixed noise, and the Gaussian noise on it gives ρ = 1/(2σ_s²)
(Rényi divergence is jointly quasi-convex, so mixing over the shards' noise does not raise it):
``dp_accounting.ZCDpEvent(rho=ρ)``. The shard's own Ind-KNN answer needs no budget of its own for this; it
uses B_serve because that is what serving will use. (:func:`base_run_correct` answers the shard over its P records with the engine instead, no emulation;
kept for tests and comparison.) The price of shards: each shard is ~N/S records, so its answer is a noisy
stand-in for the full-scale one, and S trades that against the score's resolution (docs/TUNING.md).

**Selection** (``exp-mech``): every grid point is scored on the same shards with the same shard noise (a
common run key, so the comparison between points is not blurred by independent draws); the index of the
largest score + Gumbel(b), b = 1/sqrt(2ρ), is released, nothing else (no score). For fixed shard noise each of
the scores moves by at most 1, so the selection is ρ-zCDP (tuning_accounting's docstring); mixing over the
shard noise keeps it so, as above. (``random-search``): K runs, K ~ truncated negative binomial (shape η ≥ 0,
mean m) or Poisson (mean m; K = 0 gives the public default θ); each run draws θ uniformly from the grid
(data-independent); the θ with the largest noisy score is kept. Only the chosen θ and its noisy score are
released — never the other runs' scores (the theorem covers the best run's output only).

**Composition**: the tuning's RDP curve plus serving's α·B_serve, converted at δ by the RdpAccountant
(Canonne, Kamath & Steinke 2020): B_serve is the largest value (bisection, rounded down) whose composed ε
is ≤ the target, verified once more at the end.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Collection, Sequence

import numpy as np

from . import rounding, store_erased_ids
from .errors import BadInputError
from .record_keys import stored_keys
from .tuning_accounting import (EXP_MECH, METHODS, ORDERS, POISSON, RANDOM_SEARCH,  # noqa: F401 (re-exported)
                                _accountant, _bisect_largest, _positive, check_method, check_shape, composed_epsilon,
                                draw_runs, exp_mech_select, gumbel_scale, rho_for_share, score_noise_std,
                                search_args, search_kwargs, serving_budget, tuning_epsilon, tuning_event)
from .tuning_grid import (DEFAULT_SIGMA2S, DEFAULT_TAUS, DEFAULT_TUNE_METHOD, DEFAULT_TUNE_QUERIES,  # noqa: F401
                          DEFAULT_TUNE_RUNS, DEFAULT_TUNE_SHAPE, DEFAULT_TUNE_SHARE, REFERENCE_BUDGET_PER_QUERY,
                          budget_relative_sigma2s, default_share, default_taus)

TUNING_FORMAT = 1


# -- validation ---------------------------------------------------------------------------------------
def check_grid(taus, sigma2s) -> list[tuple[float, float]]:
    taus, sigma2s = list(taus), list(sigma2s)
    if not taus or not sigma2s:
        raise BadInputError(f"the tuning grid needs at least one τ and one σ2, got τ={taus!r} σ2={sigma2s!r}")
    for t in taus:
        if not (isinstance(t, (int, float)) and 0.0 < t < 1.0):
            raise BadInputError(f"every tuning τ must lie in (0, 1), got {t!r}")
    from .accounting import check_range

    for s in sigma2s:
        check_range("sigma2", s, flag="tuning σ2")
    return [(float(t), float(s)) for t in taus for s in sigma2s]


def tuning_grid(*, taus, sigma2s, budget: float, planned_queries: int | None) -> list[tuple[float, float]]:
    """The (τ, σ2) grid of a search: ``sigma2s`` as given, or (None) the default scaled to the ledger's B and T."""
    if sigma2s is None:
        sigma2s = budget_relative_sigma2s(budget=budget, planned_queries=planned_queries)
    return check_grid(taus, sigma2s)


def _grid_rule(sigma2s) -> str:
    return "given" if sigma2s is not None else (
        f"budget-relative: {', '.join(f'{s:g}' for s in DEFAULT_SIGMA2S)} × sqrt({REFERENCE_BUDGET_PER_QUERY:g}·T/B)")


# -- the base run (tuning_base.py) ------------------------------------------------------------------------
from .tuning_base import (SHARPEN, BaseRunData, _coin, base_run_correct,  # noqa: E402,F401 (re-exported)
                          content_keys, emulated_correct, emulated_expected, flip_probability, score_noise,
                          shard_split)


#: The search's shard score and its name in the ledger's tuning record (docs/TUNING.md, "What a shard computes").
emulated_score = emulated_expected
EMULATION = f"expected chance ** {SHARPEN:g}, margin share from label agreement, count from the shard's pairs"


# -- the search -----------------------------------------------------------------------------------------------
@dataclass
class TuningRecord:
    """What the ledger records (metadata ``tuning``): public or released quantities only."""

    mode: str                      # "private" (accounted) or "public" (labelled public rows, free)
    chosen_tau: float
    chosen_sigma2: float
    grid: list
    seed: str | None               # None: OS entropy
    runs_drawn: int | None = None  # K (random search); exp-mech: 1 (one selection over the whole grid)
    thetas_tried: list = field(default_factory=list)   # random search: its data-independent order; exp-mech: grid
    chosen_run: int | None = None
    chosen_noisy_score: float | None = None  # random search only: exp-mech releases the index alone
    validation_queries: int | None = None  # S (shards)
    rho_run: float | None = None
    mean_runs: float | None = None
    shape: float | str | None = None
    share: float | None = None
    epsilon_tuning: float | None = None     # search alone, RDP, at the ledger's δ
    budget_serve: float | None = None
    epsilon_total: float | None = None      # composed, RDP
    conversion: str = "rdp"
    default_used: bool = False
    score_noise_std: float | None = None
    public_accuracy: float | None = None
    sigma2_grid: str | None = None          # "budget-relative" (default grid scaled to B, T) or "given"
    tau_grid: str | None = None             # "prior for <extractor> features", "broad (...)" or "given"
    method: str | None = None               # private: exp-mech or random-search (tuning_accounting)
    emulation: str | None = None            # private: the shard score (EMULATION); None: written before it was named
    format: int = TUNING_FORMAT

    def as_dict(self) -> dict:
        d = asdict(self)
        if d["shape"] == POISSON:
            d["shape"] = "poisson"
        return d


def _run_key(seed: int | None, tag: str) -> int:
    from .engine import run_key_for

    return run_key_for(seed, tag)


def private_tune(
    *, features, labels, n_classes: int, epsilon: float, delta: float, share: float, mean_runs: float,
    shape, taus, sigma2s, n_val: int, kernel: str, nu: float | None, k_min: float, sigma1: float | None,
    planned_queries: int | None, seed: int | None = None, device: str = "cpu", tau_rule: str | None = None,
    method: str = DEFAULT_TUNE_METHOD, keys=None,
) -> tuple[TuningRecord, "object"]:
    """Accounted search; returns (record, PrivacyParams for serving with B = B_serve, conversion rdp).

    ``sigma2s`` None: the budget-relative default grid for B_serve and T (:mod:`indknn_cli.tuning_grid`), fixed
    from public figures before any record is read."""
    from .accounting import check_range, default_sigma1
    from .ledger_state import PrivacyParams, count_charge

    check_range("epsilon", epsilon)
    check_range("delta", delta)
    search = search_kwargs(method=method, mean_runs=mean_runs, shape=shape)  # exp-mech: no number of runs
    method, mean_runs, shape = search["method"], search["mean_runs"], search["shape"]
    rho = rho_for_share(epsilon=epsilon, delta=delta, share=share, **search)
    b_serve = serving_budget(epsilon=epsilon, delta=delta, rho_run=rho, **search)
    grid = tuning_grid(taus=taus, sigma2s=sigma2s, budget=b_serve, planned_queries=planned_queries)
    if sigma1 is None:
        sigma1 = default_sigma1(planned_queries=planned_queries or 1000, budget=b_serve)
    check_range("sigma1", sigma1)
    if count_charge(sigma1) > b_serve:
        raise BadInputError(f"sigma1={sigma1:g}: one count charge 1/(2σ1²) exceeds the serving budget "
                            f"B={rounding.up(b_serve)}; raise --sigma1 or --planned-queries, or lower the --tune-share")
    seed_text = "entropy:" + str(_run_key(None, "tune")) if seed is None else f"seed:{seed}"
    data = BaseRunData.build(features, labels, n_shards=n_val, seed_text=seed_text, n_classes=n_classes, keys=keys)
    master = np.random.default_rng(_run_key(seed, "tune:search"))

    def params_at(g: int):
        tau, s2 = grid[g]
        # A shard answers as serving will (per-record budget B_serve): its privacy comes from the selection's
        # noise alone (sensitivity 1 whatever each shard computes; module docstring), not from this budget.
        return PrivacyParams(epsilon=epsilon, delta=delta, conversion="rdp", budget=b_serve, kernel=kernel, tau=tau,
                             sigma1=sigma1, sigma2=s2, nu=nu, k_min=k_min, planned_queries=planned_queries).validate()

    def score_of(g: int, key: int) -> float:
        return float(emulated_score(data, params=params_at(g), run_key=key, n_shards=n_val,
                                    planned_queries=planned_queries or 1000))

    noisy_best = None
    if method == EXP_MECH:
        key = _run_key(seed, "tune:exp-mech")  # one shard noise for every grid point (common random numbers)
        picks = list(range(len(grid)))
        best = exp_mech_select([score_of(g, key) for g in picks], rho=rho, rng=master)
        k = 1
    else:
        k = draw_runs(mean_runs=mean_runs, shape=shape, rng=master)
        picks = [int(master.integers(len(grid))) for _ in range(k)]  # random search: data-independent
        best, best_score = None, -math.inf
        for j, g in enumerate(picks):
            key = _run_key(seed, f"tune:run:{j}")
            score = score_of(g, key) + score_noise(key, rho_run=rho)
            if score > best_score:
                best, best_score = j, score
        noisy_best = None if best is None else float(best_score)
    default_used = best is None  # Poisson K = 0: the public default (the grid's first point)
    tau, s2 = grid[picks[best]] if best is not None else grid[0]
    record = TuningRecord(
        mode="private", chosen_tau=tau, chosen_sigma2=s2, grid=[list(g) for g in grid],
        sigma2_grid=_grid_rule(sigma2s), tau_grid=tau_rule, method=method,
        seed=None if seed is None else str(seed), runs_drawn=k, thetas_tried=[list(grid[g]) for g in picks],
        chosen_run=None if method == EXP_MECH else best, chosen_noisy_score=noisy_best,
        validation_queries=int(n_val), rho_run=rho, mean_runs=None if mean_runs is None else float(mean_runs),
        shape=shape, share=float(share),  # S: public
        epsilon_tuning=tuning_epsilon(rho_run=rho, delta=delta, **search), budget_serve=b_serve,
        epsilon_total=composed_epsilon(rho_run=rho, budget_serve=b_serve, delta=delta, **search),
        default_used=default_used, score_noise_std=score_noise_std(rho=rho, method=method), emulation=EMULATION,
    )
    if record.epsilon_total > epsilon:  # verified with the accountant (never overshoot)
        raise AssertionError("composed ε above the target")
    params = PrivacyParams(epsilon=float(epsilon), delta=float(delta), conversion="rdp", budget=b_serve,
                           kernel=kernel, tau=tau, sigma1=float(sigma1), sigma2=s2, nu=nu, k_min=float(k_min),
                           planned_queries=planned_queries).validate()
    return record, params


def public_tune(*, features, labels, record_ids, n_classes: int, params_for, grid, seed: int | None = None,
                val_fraction: float = 0.2, device: str = "cpu",
                sigma2_grid: str | None = None, tau_grid: str | None = None) -> tuple[TuningRecord, "object"]:
    """Free tuning on labelled public rows: exhaustive grid, exact accuracy, no privacy cost.

    A public-coin ``val_fraction`` of the public rows are queries, answered in order by the engine over the
    rest with the serving budget (``params_for(tau, sigma2)``), as serving would. No private row is read.
    """
    from .engine import ArraySource, BudgetView, answer_batch

    labels = np.asarray(labels, np.int64)
    if labels.size == 0 or (labels < 0).any():
        raise BadInputError("tuning on public rows needs labelled public rows (every public row with a label)")
    seed_text = "entropy:" + str(_run_key(None, "tune")) if seed is None else f"seed:{seed}"
    u = np.array([_coin(seed_text, str(r)) for r in record_ids], dtype=np.uint64) / float(2**64)
    is_val = u < val_fraction
    if is_val.sum() == 0 or (~is_val).sum() == 0:
        raise BadInputError(f"too few labelled public rows ({labels.size}) to split for tuning")
    x = np.ascontiguousarray(features, np.float32)
    ref, q = x[~is_val], x[is_val]
    best, best_acc = None, -1.0
    for g, (tau, s2) in enumerate(grid):
        p = params_for(tau, s2)
        n = ref.shape[0]
        budgets = BudgetView(spent=np.zeros(n), budget=np.full(n, p.budget), deleted=np.zeros(n, bool),
                             times_selected=np.zeros(n, np.int64))
        ans = answer_batch(q, source=ArraySource(ref), row_to_ledger=np.arange(n, dtype=np.int64),
                           row_labels=labels[~is_val], params=p, n_classes=n_classes, budgets=budgets,
                           run_key=_run_key(seed, f"tune:public:{g}"), first_index=0, reuse=None, device=device)
        acc = float(np.mean([a.label == int(y) for a, y in zip(ans, labels[is_val])]))
        if acc > best_acc:
            best, best_acc = g, acc
    tau, s2 = grid[best]
    record = TuningRecord(mode="public", chosen_tau=tau, chosen_sigma2=s2, grid=[list(g) for g in grid],
                          seed=None if seed is None else str(seed), validation_queries=int(is_val.sum()),
                          public_accuracy=best_acc, epsilon_tuning=0.0, conversion=params_for(tau, s2).conversion,
                          sigma2_grid=sigma2_grid, tau_grid=tau_grid)
    return record, params_for(tau, s2)


# -- what account shows -----------------------------------------------------------------------------------------
#: Said wherever a seeded private search is reported (index, account; audit 5, F2).
SEEDED_NOTE = ("whoever knows the seed (--tune-seed, recorded in the ledger) can recompute the search's noise, so "
               "the chosen τ and σ2 have no privacy against them")


def headline(tuning: dict | None, *, budget: float, delta: float) -> dict | None:
    """The tuning share of a ledger's guarantee at ``delta`` (RDP composition), or None without private tuning."""
    if not tuning or tuning.get("mode") != "private":
        return None
    kw = dict(search_args(tuning), delta=delta)
    event = ("the exponential mechanism over the grid, dp-accounting ZCDpEvent" if kw["method"] == EXP_MECH else
             "random search, dp-accounting RepeatAndSelectDpEvent, Papernot & Steinke 2022")
    return {
        "mode": "private", "conversion": "rdp", "method": kw["method"],
        "epsilon_tuning": tuning_epsilon(**kw),
        "epsilon_total": composed_epsilon(budget_serve=budget, **kw),
        "chosen": {"tau": tuning["chosen_tau"], "sigma2": tuning["chosen_sigma2"]},
        "runs_drawn": tuning.get("runs_drawn"), "mean_runs": tuning.get("mean_runs"), "shape": tuning.get("shape"),
        "rho_run": tuning["rho_run"], "validation_queries": tuning.get("validation_queries"),
        # audit 5, F2: the recorded seed recomputes the search's coins and noise
        "seeded": tuning.get("seed") is not None,
        "note": (f"the guarantee composes the tuning search ({event}) with serving's α·B by RDP; every record "
                 "carries the tuning share" + (f"; the search was seeded: {SEEDED_NOTE}"
                                               if tuning.get("seed") is not None else "")),
    }


# -- at index time ------------------------------------------------------------------------------------------------
@dataclass
class TuneRequest:
    """``index --tune``: what to tune and the serving parameters that are not tuned."""

    epsilon: float
    delta: float
    on: str = "private"            # private (accounted) | public (labelled public rows, free)
    share: float | None = None     # fraction of ε the search may cost (private); None: tuning_grid.default_share
    mean_runs: float = DEFAULT_TUNE_RUNS
    shape: float | str = DEFAULT_TUNE_SHAPE  # η: 0 logarithmic (default), 1 geometric, "poisson"
    taus: tuple | None = None      # None: the prior of the store's extractor (tuning_grid.default_taus)
    sigma2s: tuple | None = None   # None: the budget-relative default (tuning_grid.budget_relative_sigma2s)
    n_val: int = DEFAULT_TUNE_QUERIES        # S: validation queries (shards)
    method: str = DEFAULT_TUNE_METHOD        # private: exp-mech (default) or random-search
    seed: int | None = None        # experiments only; default OS entropy
    conversion: str = "rdp"        # public mode only (private tuning composes by RDP)
    kernel: str = "cosine"
    nu: float | None = None
    k_min: float = 30.0
    sigma1: float | None = None
    planned_queries: int | None = None
    device: str = "cpu"
    extractor: str | None = None   # the store's extractor name (public): picks the default τ prior

    def __post_init__(self):
        if self.share is None:  # the method's own default (30 % exp-mech, 20 % random search)
            self.share = default_share(self.method)

    def resolved_nu(self) -> float | None:
        """ν as serving will use it: the given one, else the paper's e^1.5 for the RBF kernel (none for cosine)."""
        return self.nu if self.nu is not None or self.kernel != "rbf" else math.exp(1.5)

    def tau_grid(self) -> tuple[tuple, str]:
        """(τ grid, rule): ``taus`` as given, else the extractor's prior (``tuning_grid.default_taus``)."""
        if self.taus is not None:
            return tuple(self.taus), "given"
        return default_taus(extractor=self.extractor, kernel=self.kernel, nu=self.resolved_nu())

    def check(self) -> "TuneRequest":
        if self.on not in ("private", "public"):
            raise BadInputError(f"--tune must be private or public, got {self.on!r}")
        if self.on == "private" and self.conversion != "rdp":
            raise BadInputError(f"--tune private composes the search with serving by RDP: --conversion must be "
                                f"rdp, got {self.conversion!r} (the selection is not a Gaussian mechanism)")
        check_grid(self.tau_grid()[0], DEFAULT_SIGMA2S if self.sigma2s is None else self.sigma2s)
        check_shape(self.shape)
        check_method(self.method)
        _positive("--tune-runs", self.mean_runs, lo=1.0, hi=1e4, lo_open=False)
        _positive("--tune-share", self.share, hi=0.9)
        if isinstance(self.n_val, bool) or not isinstance(self.n_val, int) or not 1 <= self.n_val <= 10**7:
            raise BadInputError(f"--tune-queries must be an integer in [1, 10000000], got {self.n_val!r}")
        return self


def check_tune_options(*, tune: str | None, given: Sequence[str], eps: float | None, method: str,
                       privacy_unit: str, max_records_per_user: int | None,
                       user_for_missing: str = "refuse") -> None:
    """`index`'s rules between the --tune options (a library caller builds a request the CLI would refuse
    otherwise). ``given``: the flags the user set, in the order to name them: the ``--tune-*`` options set away from
    their defaults, and ``--tau``/``--sigma2`` typed."""
    tune_flags = [f for f in given if f.startswith("--tune-")]
    if tune is None:
        if tune_flags:  # silently ignored before (review 16, F3)
            raise BadInputError(f"{tune_flags[0]} applies to --tune private (or public): give --tune, or leave "
                                f"{tune_flags[0]} out")
        return
    for flag, grid in (("--tau", "--tune-taus"), ("--sigma2", "--tune-sigma2s")):
        if flag in given:  # dropped without a word before (review 38, F4)
            raise BadInputError(f"{flag} is what --tune chooses: leave it out (or give the grid to choose from with "
                                f"{grid})")
    if eps is None:
        raise BadInputError("--tune needs --eps (the total ε, tuning included)")
    if privacy_unit == "record" and max_records_per_user is None and user_for_missing != "refuse":
        raise BadInputError(f"--user-for-missing {user_for_missing} needs --privacy-unit user, which --tune does not "
                            "offer yet (its ledger is per record): leave --user-for-missing out")  # review 69, F6
    if privacy_unit != "record" or max_records_per_user is not None:
        # the tuning's base run and its accounting are per record; never downgrade a user-unit request
        raise BadInputError(f"--tune is not available with --privacy-unit {privacy_unit} yet: give --tau and "
                            "--sigma2 (chosen on public data) for a user-unit ledger")
    if tune == "private":
        check_method(method)  # an unknown method is named before anything else is said of it
    else:  # review 63: --tune-share, --tune-runs, --tune-shape and --tune-queries were ignored without a word
        private_only = [f for f in given if f in ("--tune-method", "--tune-share", "--tune-runs", "--tune-shape",
                                                  "--tune-queries")]
        if private_only:
            raise BadInputError(f"{private_only[0]} applies to --tune private (the {tune!r} tuning tries every grid "
                                "point on labelled public rows, free)")
    if tune == "private" and method != "random-search" and ("--tune-runs" in given or "--tune-shape" in given):
        raise BadInputError("--tune-runs and --tune-shape set the random search's number of runs; --tune-method "
                            f"{method} selects once over the whole grid (give --tune-method random-search, or leave "
                            "them out)")


def request_record(req: TuneRequest, *, extractor: str) -> dict:
    """``req`` as the ledger's tuning record keeps it (``tuning.request``; JSON types, the device left out): a re-run
    of `index --tune` with the same options is then recognised as a re-run, not refused (review 44)."""
    import dataclasses
    import json

    d = asdict(dataclasses.replace(req, extractor=req.extractor or extractor))
    d.pop("device")
    if d["shape"] == POISSON:
        d["shape"] = "poisson"
    return json.loads(json.dumps(d))


def request_differences(recorded: dict | None, req: TuneRequest, *, extractor: str,
                        given: Collection[str] | None = None) -> list[str]:
    """The options of ``req`` that differ from the ledger's recorded request; one explanation when none is recorded.
    ``given``: the flags typed (the CLI); the others are not compared, a flag left out meaning the recorded value
    (review 66, F3). --eps, --tune and the store's extractor are always compared."""
    now = request_record(req, extractor=extractor)
    if not isinstance(recorded, dict):
        return ["it records none: made before indknn recorded the request, or without --tune"]
    always = ("epsilon", "on", "extractor")
    return [_REQUEST_FLAGS.get(k, k) for k in now if recorded.get(k, object()) != now[k]
            and (given is None or k in always or _REQUEST_FLAGS.get(k) in given)]


_REQUEST_FLAGS = {"epsilon": "--eps", "delta": "--delta", "on": "--tune", "share": "--tune-share",
                  "mean_runs": "--tune-runs", "shape": "--tune-shape", "taus": "--tune-taus", "sigma2s": "--tune-sigma2s",
                  "n_val": "--tune-queries", "method": "--tune-method", "seed": "--tune-seed",
                  "conversion": "--conversion", "kernel": "--kernel", "nu": "--nu", "k_min": "--k-min",
                  "sigma1": "--sigma1", "planned_queries": "--planned-queries", "extractor": "the store's extractor"}


def run_tuning(store, req: TuneRequest) -> tuple[TuningRecord, "object"]:
    """Tune on ``store`` (a FeatureStore) as ``req`` says; returns (record for the ledger, serving params)."""
    if req.extractor is None:  # the store's extractor picks the τ prior (a public attribute, not the data)
        import dataclasses

        req = dataclasses.replace(req, extractor=store.extractor.name)
    req.check()
    nu = req.resolved_nu()
    taus, tau_rule = req.tau_grid()
    if req.on == "public":
        from .indexing import make_params

        n_pub = store.n_rows("public")
        if n_pub == 0:
            raise BadInputError("--tune public: the store has no public rows (embed labelled public data with "
                                "--role public, or use --tune private)")

        def params_for(tau, s2):
            return make_params(epsilon=req.epsilon, delta=req.delta, conversion=req.conversion, kernel=req.kernel,
                               tau=tau, sigma2=s2, sigma1=req.sigma1, planned_queries=req.planned_queries, nu=nu,
                               k_min=req.k_min)

        budget = params_for(float(taus[0]), 1.0).budget  # B from (ε, δ, conversion) alone, not from σ2
        grid = tuning_grid(taus=taus, sigma2s=req.sigma2s, budget=budget, planned_queries=req.planned_queries)
        return public_tune(features=store.read("public", "features"), labels=store.read("public", "labels"),
                           record_ids=store.read("public", "record_id"), n_classes=len(store.label_names),
                           params_for=params_for, grid=grid, seed=req.seed, device=req.device,
                           sigma2_grid=_grid_rule(req.sigma2s), tau_grid=tau_rule)
    keep = ~store.read("private", "deleted").astype(bool)
    keep[store.erase_pending_rows("private")] = False
    keep &= ~store_erased_ids.resurrected(store, np.arange(keep.size))  # review 69, F3
    rows = np.flatnonzero(keep)
    features, labels = store.read("private", "features")[rows], store.read("private", "labels")[rows]
    keys = stored_keys(keys=store.content_keys(rows), features=features, labels=labels,
                       extractor=store.extractor.name, where=store.where)
    return private_tune_arrays(features, labels, n_classes=len(store.label_names), req=req, keys=keys)


def private_tune_arrays(features, labels, *, n_classes: int, req: TuneRequest, keys=None):
    """``--tune private`` on in-memory rows (index and bench both call this): (record, serving params).

    The number of shards S is the public ``req.n_val``, never clamped to the number of records: an S that
    depends on N re-deals every record's shard when one record joins, and the score's sensitivity is then
    not 1 (AUDIT_FINDINGS_2.md P1). With fewer records than S, some shards are empty and score nothing. For the
    same reason the shards are dealt by each record's own key, never by its id or row (audit 4, F1): ``keys`` as
    ``embed`` recorded them from each row's input (:mod:`.record_keys`; a batch-embedded vector's bytes depend on
    its batch: audit 5, F1), or, None, each row's vector and label (rows given as vectors)."""
    req.check()
    nu = req.resolved_nu()
    taus, tau_rule = req.tau_grid()
    return private_tune(
        features=features, labels=labels, n_classes=n_classes, epsilon=req.epsilon,
        delta=req.delta, share=req.share, mean_runs=req.mean_runs, shape=req.shape,
        taus=taus, sigma2s=req.sigma2s, n_val=req.n_val, kernel=req.kernel,
        nu=nu, k_min=req.k_min, sigma1=req.sigma1, planned_queries=req.planned_queries, seed=req.seed,
        device=req.device, tau_rule=tau_rule, method=req.method, keys=keys)
