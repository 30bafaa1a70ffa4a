"""`indknn index`: create the budget ledger for a store (or bring new records into it)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import BadInputError
from ..tuning_grid import (BROAD_TAUS, DEFAULT_SIGMA2S, DEFAULT_TAUS, DEFAULT_TUNE_METHOD, DEFAULT_TUNE_QUERIES, DEFAULT_TUNE_RUNS, REFERENCE_BUDGET_PER_QUERY,
                           DEFAULT_TUNE_SHAPE, DEFAULT_TUNE_SHARE, RANDOM_SEARCH_TUNE_SHARE)
from .. import rounding
from ..wording import count
from .common import (check_lock_timeout, emit_json, env_value, given_on_command_line, parse_number_list,
                     read_json_line_from_stdin, stdin_is_pipe,
                     resolve_ledger, resolve_store, run_library_call, stderr_console)


def _load() -> None:
    """Import the library (numpy, pyarrow, zarr, scipy, ...) when the command runs, not at `indknn --help`: the
    names are this module's globals, declared here."""
    global build_index, make_params, SEEDED_NOTE, TuneRequest, check_shape, check_tune_options, ledger_exists
    from ..ledger_snapshot import ledger_exists
    from ..serving import build_index, make_params
    from ..tuning import SEEDED_NOTE, TuneRequest, check_shape, check_tune_options


#: Privacy flags of `index` and the ledger field each sets (checked on a re-run without --eps: review 38, F4).
_PRIVACY_FLAGS = {"delta": "--delta", "conversion": "--conversion", "kernel": "--kernel", "tau": "--tau",
                  "sigma2": "--sigma2", "sigma1": "--sigma1", "planned_queries": "--planned-queries", "nu": "--nu",
                  "k_min": "--k-min", "privacy_unit": "--privacy-unit",
                  "max_records_per_user": "--max-records-per-user", "user_for_missing": "--user-for-missing"}


def index_command(
    ctx: typer.Context,
    store: Optional[str] = typer.Option(None, "--store", help="Feature store: a folder or an s3:// URL (else the JSON line of `indknn embed` on stdin, $INDKNN_STORE, ./indknn-store.zarr)."),
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="Ledger folder (else $INDKNN_LEDGER, ./indknn-ledger)."),
    eps: Optional[float] = typer.Option(None, "--eps", help="Target ε of every record's guarantee."),
    delta: float = typer.Option(1e-5, "--delta", help="Target δ."),
    conversion: Optional[str] = typer.Option(None, "--conversion", help="gdp (analytic Gaussian, default) or rdp (default and required with --tune private)."),
    kernel: str = typer.Option("cosine", "--kernel", help="cosine or rbf."),
    tau: float = typer.Option(0.25, "--tau", help="Kernel threshold τ (tune on public/validation data: `indknn bench tune`)."),
    sigma2: float = typer.Option(0.6, "--sigma2", help="Vote noise scale σ2."),
    sigma1: Optional[float] = typer.Option(None, "--sigma1", help="Count noise σ1 (default sqrt(T/(6B)) from --planned-queries)."),
    planned_queries: int = typer.Option(1000, "--planned-queries", help="T for the paper's σ1 = sqrt(T/(6B))."),
    nu: Optional[float] = typer.Option(None, "--nu", help="RBF bandwidth ν (default e^1.5)."),
    k_min: float = typer.Option(30.0, "--k-min", help="Clamp K_min of the released count."),
    kind: Optional[str] = typer.Option(None, "--kind", help="Candidate search: flat (exact scan), lsh (random-hyperplane hash tables, the paper's Ind-KNN-Hash), ivf (inverted lists, centroids trained on public vectors only); hnsw is refused. Default: keep the store's current index (flat when none)."),
    tables: Optional[int] = typer.Option(None, "--tables", help="lsh: number of hash tables L (default 30)."),
    bits: Optional[int] = typer.Option(None, "--bits", help="lsh: hyperplanes per table b (default 9; paper: 8 CIFAR-10, 9 AG News)."),
    index_seed: Optional[int] = typer.Option(None, "--index-seed", help="lsh/ivf: seed of the hyperplanes / k-means (default: fresh entropy, recorded with the index)."),
    nlist: Optional[int] = typer.Option(None, "--nlist", help="ivf: number of lists (default: a power of two with ≥ 39 public training vectors per list)."),
    nprobe: Optional[int] = typer.Option(None, "--nprobe", help="ivf: lists probed per query (default: the smallest giving candidate recall ≥ 0.95 measured on the public training vectors; nprobe = nlist is exact search). Can be changed later without retraining."),
    train_on: Optional[str] = typer.Option(None, "--train-on", help="ivf: public vectors for the centroids: public, query, or a .npy/.npz file of [n, d] vectors (default: the store's public rows, else its query rows). Trusted to be public data; private vectors, and a file with any vector (near-)identical to a private record, are refused."),
    lock_timeout: float = typer.Option(60.0, "--lock-timeout", help="Seconds to wait for the ledger lock."),
    privacy_unit: str = typer.Option("record", "--privacy-unit", help="record (default) or user: whose budget the filter keeps. With user, a person's records share one budget B and the guarantee is for adding or removing one user with all their records (SPEC §9)."),
    max_records_per_user: Optional[int] = typer.Option(None, "--max-records-per-user", help="user unit: only a user's k most similar records (largest κ) count per query (default: all)."),
    user_for_missing: str = typer.Option("refuse", "--user-for-missing", help="user unit: rows without a user id are refused (refuse, default) or each is its own user (record)."),
    tune: Optional[str] = typer.Option(None, "--tune", help="Choose τ and σ2 when creating the ledger (docs/TUNING.md): private = a private selection on the private records (--tune-method), its cost composed into the ε target by RDP and recorded in the ledger; public = on the store's labelled public rows, free. --tau/--sigma2 are then refused (give --tune-taus/--tune-sigma2s)."),
    tune_share: Optional[float] = typer.Option(None, "--tune-share", help=f"--tune private: fraction of --eps the search may cost (RDP, at --delta). Default {DEFAULT_TUNE_SHARE:g} for exp-mech, {RANDOM_SEARCH_TUNE_SHARE:g} for random-search."),
    tune_method: str = typer.Option(DEFAULT_TUNE_METHOD, "--tune-method", help="--tune private: exp-mech (default: every grid point scored, the best chosen by the exponential mechanism, one zCDP event) or random-search (Papernot & Steinke: a random number of runs at random grid points, dp-accounting RepeatAndSelectDpEvent)."),
    tune_runs: Optional[float] = typer.Option(None, "--tune-runs", help=f"--tune-method random-search: mean number of runs K (default {DEFAULT_TUNE_RUNS:g})."),
    tune_shape: Optional[str] = typer.Option(None, "--tune-shape", help=f"--tune-method random-search: distribution of K: η ≥ 0 of the truncated negative binomial (0 logarithmic, the default {DEFAULT_TUNE_SHAPE:g}; 1 geometric) or 'poisson'."),
    tune_taus: Optional[str] = typer.Option(None, "--tune-taus", help="Comma-separated τ grid. Default: a public prior on the store's extractor (text " + ",".join(map(str, DEFAULT_TAUS)) + "; hog, pixels: see docs/TUNING.md; others a broad grid " + ",".join(map(str, BROAD_TAUS)) + "), mapped to κ for --kernel rbf."),
    tune_sigma2s: Optional[str] = typer.Option(None, "--tune-sigma2s", help=f"Comma-separated σ2 grid. Default: budget-relative, {','.join(map(str, DEFAULT_SIGMA2S))} × sqrt({REFERENCE_BUDGET_PER_QUERY:g}·T/B) for the ledger's B and planned queries T (public figures; docs/TUNING.md)."),
    tune_queries: int = typer.Option(DEFAULT_TUNE_QUERIES, "--tune-queries", help="--tune private: validation queries S per run (the private set is split in S shards by a public coin)."),
    tune_seed: Optional[int] = typer.Option(None, "--tune-seed", help="Experiments only: fixed seed of the tuning's coins and noise (recorded). Default: OS entropy."),
) -> None:
    """Create the ledger with B calibrated from (ε, δ); re-running adds new records, keeping spent budgets."""
    _load()
    def call():
        check_lock_timeout(lock_timeout)
        store_path = resolve_store(store) if store is not None else None
        if store_path is None:
            upstream = read_json_line_from_stdin()
            store_path = (resolve_store(upstream["store"], source="the upstream embed's JSON line on stdin")
                          if upstream and "store" in upstream else resolve_store(None))
            if (upstream is None and stdin_is_pipe() and not env_value("INDKNN_STORE")
                    and not (Path(store_path) / "zarr.json").is_file()):
                # `embed … | index` whose embed failed: say so, not "not an indknn feature store" (UX review 7)
                # (review 44: "there is no store at indknn-store.zarr" sent the reader after a default never named)
                raise BadInputError("no line from `indknn embed` arrived on stdin: the command before the pipe "
                                    "failed or printed nothing (its message is above); nothing was indexed. Without a "
                                    "pipe, give --store")
        params = None
        if planned_queries < 1:  # make_params would take 0 for "not given" and use 1000
            raise BadInputError(f"--planned-queries must be ≥ 1, got {planned_queries}")
        given = [flag for flag, on in (("--tune-share", tune_share is not None),
                                       ("--tune-method", tune_method != DEFAULT_TUNE_METHOD),
                                       ("--tune-runs", tune_runs is not None), ("--tune-shape", tune_shape is not None),
                                       ("--tune-taus", tune_taus is not None),
                                       ("--tune-sigma2s", tune_sigma2s is not None),
                                       ("--tune-queries", tune_queries != DEFAULT_TUNE_QUERIES),
                                       ("--tune-seed", tune_seed is not None),
                                       ("--tau", given_on_command_line(ctx, "tau")),
                                       ("--sigma2", given_on_command_line(ctx, "sigma2"))) if on]
        check_tune_options(tune=tune, given=given, eps=eps, method=tune_method, privacy_unit=privacy_unit,
                           max_records_per_user=max_records_per_user, user_for_missing=user_for_missing)
        if tune is not None:
            req = TuneRequest(epsilon=eps, delta=delta, on=tune, share=tune_share, method=tune_method,
                              mean_runs=DEFAULT_TUNE_RUNS if tune_runs is None else tune_runs,
                              shape=check_shape(DEFAULT_TUNE_SHAPE if tune_shape is None else tune_shape), taus=None if tune_taus is None else parse_number_list(tune_taus, flag="--tune-taus", distinct=True),
                              sigma2s=None if tune_sigma2s is None else parse_number_list(tune_sigma2s, flag="--tune-sigma2s", distinct=True), n_val=tune_queries, seed=tune_seed,
                              conversion=conversion or ("rdp" if tune == "private" else "gdp"), kernel=kernel,
                              nu=nu, k_min=k_min, sigma1=sigma1, planned_queries=planned_queries)
            return build_index(store_path=store_path, ledger_path=resolve_ledger(ledger), params=None, kind=kind,
                               lock_timeout=lock_timeout, tables=tables, bits=bits, index_seed=index_seed,
                               nlist=nlist, nprobe=nprobe, train_on=train_on, tune=req,
                               tune_given={p.opts[0] for p in ctx.command.params
                                           if p.opts and given_on_command_line(ctx, p.name)})
        ledger_path = resolve_ledger(ledger)
        # an existing ledger: the flags typed are compared with its own values (a flag left out keeps the ledger's),
        # not made into new parameters first, whose defaults were checked and worded (review 69, F4: a same-valued
        # --max-records-per-user refused as "needs --privacy-unit user", a message quoting the default δ's B)
        rerun = eps is not None and ledger_exists(ledger_path)
        if eps is not None and not rerun:
            params = make_params(epsilon=eps, delta=delta, conversion=conversion or "gdp", kernel=kernel, tau=tau,
                                 sigma2=sigma2, sigma1=sigma1, planned_queries=planned_queries, nu=nu, k_min=k_min,
                                 privacy_unit=privacy_unit, max_records_per_user=max_records_per_user,
                                 user_for_missing=user_for_missing)
        values = dict(delta=delta, conversion=conversion, kernel=kernel, tau=tau, sigma2=sigma2, sigma1=sigma1,
                      planned_queries=planned_queries, nu=nu, k_min=k_min, privacy_unit=privacy_unit,
                      max_records_per_user=max_records_per_user, user_for_missing=user_for_missing)
        given = {f: (flag, values[f]) for f, flag in _PRIVACY_FLAGS.items()
                 if given_on_command_line(ctx, f)}
        if rerun:
            given["epsilon"] = ("--eps", float(eps))
        return build_index(store_path=store_path, ledger_path=ledger_path, params=params, kind=kind,
                           lock_timeout=lock_timeout, tables=tables, bits=bits, index_seed=index_seed, nlist=nlist,
                           nprobe=nprobe, train_on=train_on, given=given)

    result = run_library_call(call)
    tuned = result.tuning or {}
    if tuned.get("mode") == "private" and result.created:
        stderr_console().print(escape(
            f"tuned privately: τ={tuned['chosen_tau']:g}, σ2={tuned['chosen_sigma2']:g} "
            + (f"by the exponential mechanism over {count(len(tuned['grid']), 'grid point')}; "
               if tuned.get("method") == "exp-mech" else
               f"after {tuned['runs_drawn']} runs (the run count is operator-only: the guarantee covers the chosen "
               "τ, σ2 and its noisy score); ") +
            f"the search costs ε={rounding.up(tuned['epsilon_tuning'], 4)} of the total ε={rounding.up(tuned['epsilon_total'], 4)} "
            f"at δ={rounding.given(delta)} (RDP, record unit, add/remove one record); serving B={rounding.up(result.params.budget)}"))
    if tuned.get("mode") == "private" and result.created and tuned.get("method") == "exp-mech":
        # public figures only (ε, share, S): how much a better grid point is preferred (review 16, F1)
        # compared as a log: the exponent grows with S and ε, and exp() overflowed past ~255,000 shards at ε = 1
        # after the ledger was made (review 79, F1)
        log_odds = 0.05 * tuned["validation_queries"] * math.sqrt(2.0 * tuned["rho_run"])
        if log_odds < math.log(1.5):
            odds = math.exp(log_odds)
            stderr_console().print(escape(
                f"warning: at this ε the search's noise is large against its {tuned['validation_queries']} shards: a "
                f"grid point right on 5 % more of them is chosen only {odds:.2f}× as often as another, so the choice "
                "is close to a random pick from the grid; prefer --tau/--sigma2 chosen on public data, --tune public, "
                "or a larger --tune-share"), style="yellow")
    if tuned.get("mode") == "private" and result.created and tuned.get("seed") is not None:
        # audit 5, F2: the seed is in the ledger, and with it the search's coins and noise can be recomputed
        stderr_console().print(escape(
            f"warning: seeded private search (--tune-seed {tuned['seed']}): {SEEDED_NOTE}; for experiments only, "
            "not for real data"), style="yellow")
    elif tuned.get("mode") == "public" and result.created:
        stderr_console().print(escape(
            f"tuned on the store's labelled public rows (free, no private record read): τ={tuned['chosen_tau']:g}, "
            f"σ2={tuned['chosen_sigma2']:g} (validation accuracy {tuned['public_accuracy']:.3f})"))
    for w in result.extra.get("warnings", []):
        stderr_console().print(f"[yellow]warning:[/] {escape(w)}")
    # SPEC §8: `records`/`records_added` (and a tuning record's figures) are exact figures of the private data
    emit_json({**result.as_dict(), "operator_only": OPERATOR_ONLY_NOTE})


OPERATOR_ONLY_NOTE = ("operator-only: records and records_added are exact counts of the private records (and "
                      "warnings name private figures); under --tune-method random-search, tuning.runs_drawn, "
                      "thetas_tried and chosen_run are not covered by the tuning guarantee (it covers the chosen τ, "
                      "σ2 and its noisy score; under exp-mech every tuning field is public or the chosen τ, σ2); for "
                      "the data holder, never for query-senders")
