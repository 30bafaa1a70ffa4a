"""The account report: what a ledger guarantees and what each record has spent (read-only).

Everything here only *reads* the ledger: no lock is taken and no file is
written, so `indknn account` is safe to run while `serve-queries` or
`delete` hold the ledger's write lock. A read sees the committed snapshot plus
the events committed before it listed the events folder (SPEC §8 "charge
before release" means every released answer is in some committed event).

Definitions (SPEC §2, §3, §8):

* The **guarantee** is the filter's: every record's total charge stays ≤ B, so
  the ledger certifies (ε, δ) with ε = conversion(B, δ), for the Gaussian-DP
  curve (μ = sqrt(2B)) and for the RDP curve α ↦ α·B. Every ε carries the name
  of the conversion that made it.
* **Realised individual loss** ε_i = conversion(spent_i, δ): descriptive
  (the paper's Figure 3b plots its median), *not* a second guarantee.
* Status: ``deleted`` = tombstone; ``retired`` = not deleted and
  up(spent + c1) > B (it cannot pay the next count charge); ``active``
  otherwise (:meth:`LedgerState.status`).

Rounding is against the user: remaining budget rounded down, every ε rounded
up, quantiles of spent taken as the higher order statistic.
"""

from __future__ import annotations

import datetime as _dt
import math
import logging
import os
from dataclasses import dataclass, field

import numpy as np

from . import FORMAT_VERSION
from .accounting import (CONVERSION_LABEL, CONVERSIONS, _check_conversion, _check_epsilon, check_range,
                         calibrate_budget, epsilon_for_budget)
from . import data_quality, deletion_deferred, ledger_history, ledger_integrity as integrity
from .errors import BadInputError, BudgetExhaustedError, CheckFailedError
from .id_text import canonical, canonical_array
from .ledger_readonly import open_ledger_readonly
from .rounding import given, up
from .wording import count, per_unit
from .report_plot import check_plot_path
from .realised import realised_loss  # noqa: F401 (also imported from here: export, tests)
from .report_wording import (ADJACENCY, OPERATOR_ONLY_NOTE, REALISED_LABEL, SUBJECT_NOTE, USER_LEVEL_NOTE,  # noqa: F401
                             USER_UNIT_NOTE, public_tuning, seeded_note, tuned_conversion_label, unit_figures)

log = logging.getLogger(__name__)  # --verbose: indknn's own INFO lines on stderr

#: The keys of the ledger-wide guarantee, the only ledger-level figures a data-subject view carries.
_GUARANTEE_KEYS = ("ledger", "format_version", "unit", "adjacency", "scope", "budget", "delta", "epsilon", "tuning",
                   "conversion", "conversion_label", "epsilon_by_conversion", "ledger_delta", "ledger_conversion",
                   "target_epsilon", "target_conversion", "guarantees", "next_charge_at_least", "seeded_answers")
QUANTILES = (("min", 0.0), ("median", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
# -- conversions -----------------------------------------------------------------
def _quantiles(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {name: None for name, _ in QUANTILES}
    qs = np.quantile(values, [q for _, q in QUANTILES], method="higher")  # order statistics, rounded up
    return {name: float(v) for (name, _), v in zip(QUANTILES, qs)}


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _iso(t: float | None) -> str | None:
    if t is None or not math.isfinite(t):
        return None
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="seconds")


# -- options -----------------------------------------------------------------------
def parse_min_active(value) -> tuple[str, float] | None:
    """'50' → ('count', 50); '0.1' or '10%' → ('fraction', 0.1) of the records not deleted."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        if text.endswith("%"):
            frac = float(text[:-1]) / 100.0
            kind = "fraction"
        elif text.lstrip("+").isdigit():
            return ("count", float(int(text)))
        else:
            frac = float(text)
            kind = "fraction"
    except ValueError:
        raise BadInputError(f"--min-active must be a count (e.g. 500) or a fraction (e.g. 0.1 or 10%), "
                            f"got {value!r}") from None
    if not (math.isfinite(frac) and 0.0 <= frac <= 1.0):
        raise BadInputError(f"--min-active fraction must lie in [0, 1], got {value!r}")
    return (kind, frac)


# -- the report ----------------------------------------------------------------------
@dataclass
class AccountReport:
    """``data`` is the JSON object of ``account --json``; the rest feeds tables and plots."""

    data: dict
    history_points: list[dict] = field(default_factory=list)   # one per committed serve event
    spent_fraction: np.ndarray | None = None                   # spent_i / B, for the histogram
    failures: list[tuple[type, str]] = field(default_factory=list)


def _guarantee(budget: float, delta: float, cached: dict | None = None, params=None) -> dict:
    """ε of ``budget`` at ``delta`` under every conversion; ``cached``: the ledger's ``epsilon_at_budget`` (the same
    figures computed by the same function at `index`), used where its B and δ are these and its ε under the
    ledger's own conversion is within the ledger's target ε (as the calibration of B guarantees); else computed."""
    known = {}
    if isinstance(cached, dict) and cached.get("budget") == budget and cached.get("delta") == delta:
        known = {c: float(v) for c, v in (cached.get("by_conversion") or {}).items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0}
        if params is not None and not (params.conversion in known and known[params.conversion] <= params.epsilon):
            known = {}
    return {"delta": delta, "epsilon_by_conversion": {
        c: _finite(known[c] if c in known else epsilon_for_budget(budget=budget, delta=delta, conversion=c))
        for c in CONVERSIONS}}


class _Status:
    """``LedgerState.status(c1)[i]`` for single records: deleted, else active, else retired."""

    def __init__(self, active: np.ndarray, deleted: np.ndarray):
        self.active, self.deleted = active, deleted

    def __getitem__(self, i: int) -> str:
        return "deleted" if self.deleted[i] else ("active" if self.active[i] else "retired")


def _subject_record(ledger, i: int, *, status: _Status, budget: float, delta: float, c1: float) -> dict:
    s = ledger.state
    spent = float(s.spent[i])
    remaining = max(0.0, math.nextafter(budget - spent, -math.inf)) if budget > spent else 0.0
    realised = {c: _finite(float(realised_loss([spent], budget=budget, delta=delta, conversion=c,
                                               tuning=ledger.meta.get("tuning"))[0]))
                for c in CONVERSIONS}
    deleted = bool(s.deleted[i])
    return {
        "record_id": str(s.record_id[i]), "user_id": str(s.user_id[i] or ""), "status": str(status[i]),
        "spent": spent, "budget": float(s.budget[i]), "remaining": remaining,
        "next_charge_at_least": c1, "times_selected": int(s.times_selected[i]),
        "realised_epsilon_by_conversion": realised, "realised_label": REALISED_LABEL,
        # review 53, F3: under the user unit a record's realised ε is its user's (it carries the user's spent)
        "realised_epsilon_unit": per_unit(ledger.params.privacy_unit),
        "deleted": deleted, "deleted_at": _iso(float(s.deleted_at[i])) if deleted else None,
        "last_change": _iso(float(s.last_change[i])),
    }


def _user_unit_figures(spent_records: np.ndarray, *, budget: float, delta: float) -> dict:
    """User unit: the user's own spent (the largest over their records, tombstones included) and realised ε."""
    spent = float(np.max(spent_records))
    remaining = max(0.0, math.nextafter(budget - spent, -math.inf)) if budget > spent else 0.0
    realised = {c: _finite(float(realised_loss([spent], budget=budget, delta=delta, conversion=c)[0]))
                for c in CONVERSIONS}
    return {"user_level": USER_UNIT_NOTE, "spent": spent, "remaining": remaining,
            "realised_epsilon_by_conversion": realised}


def _history(ledger, *, budget: float, delta: float, conversion: str, total_answers: int) -> list[dict]:
    """One point per committed serve event (LedgerState.history), oldest first.

    Cumulative answers are counted back from the current total, so a history
    that compaction truncated still ends at the right figure.
    """
    hist = list(ledger.state.history)
    if not hist:
        return []
    tuning = ledger.meta.get("tuning")
    tuned = bool(tuning) and tuning.get("mode") == "private"  # the cache converts serving's spent alone
    medians = None if tuned else ledger_history.history_epsilons(hist, budget=budget, delta=delta,
                                                                 conversion=conversion)
    if medians is None:  # events written before the cache, or another conversion or δ than the ledger's
        medians = realised_loss([float(h.get("spent_median", 0.0)) for h in hist], budget=budget, delta=delta,
                                conversion=conversion, tuning=tuning)
    after = total_answers
    points: list[dict] = []
    for h, med in zip(reversed(hist), reversed(medians)):
        records = int(h.get("records", 0))
        active = int(h.get("records_active", 0))
        deleted = int(h.get("records_deleted", 0))
        retired = max(0, records - active - deleted)
        points.append({
            "seq": h.get("seq"), "time": _iso(h.get("time")), "batch_id": h.get("batch_id"), "part": h.get("part"),
            "answers": int(h.get("answers", 0)), "queries_answered": max(0, after), "records": records,
            "records_active": active, "records_retired": retired, "records_deleted": deleted,
            "retired_fraction": retired / records if records else 0.0,
            "spent_median": float(h.get("spent_median", 0.0)), "realised_epsilon_median": _finite(float(med)),
            "conversion": conversion,
        })
        after -= int(h.get("answers", 0))
    points.reverse()
    return points


def _by_batch(points: list[dict]) -> list[dict]:
    """The state after each batch: the last event of each run of one batch id, answers summed."""
    out: list[dict] = []
    for p in points:
        if out and out[-1]["batch_id"] == p["batch_id"]:
            answers = out[-1]["answers"] + p["answers"]
            parts = out[-1]["parts"] + 1
            out[-1] = dict(p, answers=answers, parts=parts)
        else:
            out.append(dict(p, parts=1))
    for row in out:
        row.pop("part", None)
        row.pop("seq", None)
    return out


def build_account_report(
    *, ledger_path: str | os.PathLike, store_path: str | os.PathLike | None = None, delta: float | None = None,
    conversion: str | None = None, eps: float | None = None, min_active=None, record_id: str | None = None,
    user_id: str | None = None, plot_path: str | os.PathLike | None = None,
) -> AccountReport:
    """Read the ledger (never writing to it) and build the account report.

    Checks (``eps``, ``min_active``) are evaluated and recorded in
    ``report.failures``; :func:`enforce_checks` raises them, so the caller can
    print the report first.
    """
    # ids as `embed` stores them: trimmed (review 38, F3), in NFC (review 53, F2), against every stored spelling
    record_id = None if record_id is None else canonical(str(record_id).strip())
    user_id = None if user_id is None else canonical(str(user_id).strip())
    # validate every option before reading anything
    for flag, value in (("--record", record_id), ("--user", user_id)):
        if value == "":  # before: "record id '' is not in the ledger", which read like a lookup that ran
            raise BadInputError(f"{flag} '': an empty id was given (ids are trimmed of surrounding spaces, as embed "
                                "stores them)")
    if record_id is not None and user_id is not None:
        raise BadInputError(f"give --record or --user, not both (got --record {record_id!r} --user {user_id!r})")
    if record_id is not None or user_id is not None:
        ledger_wide = [name for name, v in (("--eps", eps), ("--min-active", min_active), ("--plot", plot_path))
                       if v is not None]
        if ledger_wide:
            raise BadInputError(f"{'--record' if record_id is not None else '--user'} is one data subject's view "
                                f"and shows no figures of other records; {', '.join(ledger_wide)} "
                                "(ledger-wide) cannot be combined with it")
    if delta is not None:  # review 65, F3: the range `index` takes; (0, 1) let `--delta 0.5 --eps 0.001` pass (exit 0)
        delta = check_range("delta", delta, flag="--delta")
    if conversion is not None:
        conversion = _check_conversion(conversion)
    if eps is not None:
        eps = _check_epsilon(eps)
    min_spec = parse_min_active(min_active)
    plot = check_plot_path(plot_path) if plot_path is not None else None

    store_uuid, compacted_from = None, frozenset()
    store = None
    store_check = None
    if store_path is not None:
        from .store import FeatureStore

        store = FeatureStore.open(store_path, mode="r")
        store_uuid, compacted_from = store.uuid, store.compacted_from()
        mark = integrity.read_mark(store.path)  # before the ledger (no lock held): see ledger_integrity
    else:  # the store the ledger records, when it is reachable (a rolled-back ledger is caught there too)
        checked, checked_uuid, note = integrity.recorded_store(ledger_path)
        if checked is not None:
            from .store import FeatureStore

            checked_store = FeatureStore.open(checked, mode="r")
            if checked_store.uuid != checked_uuid:
                checked, note = None, f"unchecked against the store: {checked} is another store now"
            else:
                mark = integrity.read_mark(checked_store.path)
        store_check = {"checked": checked is not None, "note": note}
    ledger = open_ledger_readonly(ledger_path, store_uuid=store_uuid, store_compacted_from=compacted_from)
    log.info("ledger %s read: snapshot generation %d, events up to %d", ledger_path, ledger.generation,
             ledger.last_event_seq)
    if store is not None:  # one store, one ledger; a ledger behind the store's high-water mark is refused
        integrity.check_binding(store, ledger, ledger_path, mark=mark)
    elif store_check["checked"]:
        integrity.check_binding(checked_store, ledger, ledger_path, mark=mark)
    params = ledger.params
    s = ledger.state
    n = len(s)
    c1 = params.c1
    budget = float(max([params.budget] + ([float(np.max(s.budget))] if n else [])))  # every record's B: the max
    ledger_delta = float(params.delta)
    use_delta = ledger_delta if delta is None else delta
    use_conv = conversion or params.conversion
    # LedgerState.status, without materialising a million status strings
    active = s.active_mask(c1) if n else np.zeros(0, bool)
    status = _Status(active, np.asarray(s.deleted, dtype=bool))
    n_deleted = int(np.count_nonzero(s.deleted))
    n_active = int(np.count_nonzero(active))
    n_retired = n - n_active - n_deleted

    n_clamp_answers, n_at_k_min = ledger_history.answer_clamp_counts(s, params.k_min)
    cached = ledger.meta.get("epsilon_at_budget")
    guarantees = [_guarantee(budget, ledger_delta, cached, params)]
    if use_delta != ledger_delta:
        guarantees.append(_guarantee(budget, use_delta, cached, params))
    headline = guarantees[-1]["epsilon_by_conversion"]
    # index --tune private (docs/TUNING.md): the guarantee is the search composed with serving's α·B by RDP;
    # the Gaussian-DP curve does not apply to the composition (the selection is not a Gaussian mechanism).
    from .tuning import headline as tuning_headline

    tuning_share = tuning_headline(ledger.meta.get("tuning"), budget=budget, delta=use_delta)
    if tuning_share is not None:
        if conversion == "gdp":  # before: ignored, and `--eps E --conversion gdp` checked the rdp figure (review 42)
            raise BadInputError("--conversion gdp: this ledger was tuned privately (index --tune private); its "
                                "guarantee composes the search with serving by RDP, and the Gaussian-DP curve does "
                                "not apply to the search: give --conversion rdp, or leave it out")
        tuning_share.update(epsilon_serving_alone=headline["rdp"], **unit_figures(params.privacy_unit))  # rev. 73 F8
        headline = {"gdp": None, "rdp": _finite(tuning_share["epsilon_total"])}
        for g in guarantees:
            g["epsilon_by_conversion"] = {"gdp": None, "rdp": _finite(tuning_headline(
                ledger.meta["tuning"], budget=budget, delta=g["delta"])["epsilon_total"])}
        use_conv = "rdp"
    epsilon = headline[use_conv]

    spent = np.asarray(s.spent, dtype=np.float64)
    spent_q = _quantiles(spent)
    q_names = [k for k, _ in QUANTILES]
    if n:
        real_vals = realised_loss([spent_q[k] for k in q_names], budget=budget, delta=use_delta,
                                  conversion=use_conv, tuning=ledger.meta.get("tuning"))
        realised_q = {k: _finite(float(v)) for k, v in zip(q_names, real_vals)}
    else:
        realised_q = {k: None for k in q_names}
    # every answer released, those a repair could not recover included (review 60, F7: account said 10 while the gate
    # and serve counted 20; a compliance reviewer reads this figure)
    total_answers = s.answers_released()
    by_label = ledger_history.answer_label_counts(s)  # first-seen order, as before

    # the history's cumulative figures count the answers its events hold (review 62, F5: counted back from a total
    # with a repair's unrecovered answers, its points before the lost events were too high)
    points = _history(ledger, budget=budget, delta=use_delta, conversion=use_conv, total_answers=s.n_answers())
    data: dict = {
        "ledger": str(ledger_path),
        "format_version": FORMAT_VERSION,
        **unit_figures(getattr(params, "privacy_unit", "record")),
        "budget": budget,
        "delta": use_delta,
        "epsilon": _finite(epsilon),
        "conversion": use_conv,
        "conversion_label": (CONVERSION_LABEL[use_conv] if tuning_share is None
                             else tuned_conversion_label(tuning_share)),
        "epsilon_by_conversion": headline,
        "ledger_delta": ledger_delta,
        "ledger_conversion": params.conversion,
        "target_epsilon": params.epsilon,
        "target_conversion": params.conversion,
        "guarantees": guarantees,
        **({"tuning": tuning_share} if tuning_share is not None else {}),
        **public_tuning(ledger.meta.get("tuning")),  # --tune public (review 73, F7: account said nothing)
        "next_charge_at_least": c1,
        "seeded_answers": (seeded := ledger_history.seeded_answers(s)),  # a void guarantee (review 73, F0)
        "records": n,
        "records_active": n_active,
        "records_retired": n_retired,
        "records_deleted": n_deleted,
        "queries_answered": total_answers,
        "answers_not_held": int(s.answers_not_held),  # released, in events a repair could not recover
        "batches": len(s.batches),
        "answers_by_label": by_label,
        "operator_only": OPERATOR_ONLY_NOTE,
        # operator-only: answers released at the K_min clamp (noise-only answers are likely there)
        "answers_at_k_min": data_quality.clamp_share(answers=n_clamp_answers, at_k_min=n_at_k_min, k_min=params.k_min),
        "spent_min": spent_q["min"], "spent_median": spent_q["median"], "spent_p90": spent_q["p90"],
        "spent_p99": spent_q["p99"], "spent_max": spent_q["max"],
        "spent_quantiles": spent_q,
        "spent_fraction_quantiles": {k: (None if v is None else v / budget) for k, v in spent_q.items()},
        "realised_epsilon": {"label": REALISED_LABEL, "conversion": use_conv, "delta": use_delta,
                             **{k: v for k, v in unit_figures(getattr(params, "privacy_unit", "record")).items()
                                if k != "scope"},
                             # quantiles over the ledger's records: under the user unit a user with m records is
                             # counted m times (review 37 note)
                             "over": "records", **realised_q},
        "history": _by_batch(points),
    }
    failures: list[tuple[type, str]] = []
    if store_check is not None:
        data["store_check"] = store_check
    if store is not None:
        n_rows = store.n_rows("private")
        row_map = ledger.store_row_map(n_rows)
        store_deleted = store.read("private", "deleted").astype(bool) if n_rows else np.zeros(0, bool)
        deferred = deletion_deferred.rows(ledger, store)  # erased under a held lease: not new (review 70, F4)
        (not_in := (row_map < 0) & ~store_deleted)[deferred] = False
        data["store"] = {
            "path": str(store_path), "store_uuid": store.uuid, "label_names": list(store.label_names),
            "private_rows": n_rows,
            "rows_not_in_ledger": int(np.count_nonzero(not_in)),
            **({"rows_erasure_deferred": int(deferred.size)} if deferred.size else {}),
        }

    if eps is not None:
        over = 0
        if n:
            top = realised_q["max"]
            if top is not None and top > eps:
                if tuning_share is not None:  # tuned: ε_i composes the search with spent_i (realised.py)
                    over = int(np.count_nonzero(realised_loss(spent, budget=budget, delta=use_delta,
                                                              conversion=use_conv,
                                                              tuning=ledger.meta.get("tuning")) > eps))
                else:
                    try:
                        # ε(s) is non-decreasing in s: ε_i > E ⟺ spent_i > the largest s with ε(s) ≤ E
                        threshold = calibrate_budget(epsilon=eps, delta=use_delta, conversion=use_conv)
                    except BadInputError:
                        threshold = 0.0
                    over = int(np.count_nonzero(np.minimum(spent, budget) > threshold))
        passed = epsilon is not None and math.isfinite(epsilon) and epsilon <= eps
        data["check_eps"] = {
            "eps": eps, "delta": use_delta, "conversion": use_conv, "epsilon": _finite(epsilon),
            "passed": passed and not seeded, "seeded_answers": seeded, "records_realised_above_eps": over,
            "excess": None if passed or epsilon is None else (epsilon - eps if math.isfinite(epsilon) else None),
            "realised_label": REALISED_LABEL}
        failures += [(CheckFailedError, seeded_note(seeded))] if seeded else []
        if not passed:
            # rounded against the user (review 47): the ε and the excess up, the figures given exactly
            shown = "inf" if epsilon is None else up(epsilon)
            by = "an unbounded amount" if epsilon is None else up(epsilon - eps)
            failures.append((CheckFailedError, f"the ledger's guarantee ε({use_conv}) = {shown} at δ = "
                             f"{given(use_delta)} ({data.get('unit', 'record')} unit, "
                             f"{data.get('adjacency', ADJACENCY)}) is above "
                             f"--eps {given(eps)} by {by} (B = {up(budget)})"))
    if min_spec is not None:
        kind, value = min_spec
        alive = n - n_deleted
        # a positive fraction always needs at least one active record (a ledger of tombstones fails)
        required = int(value) if kind == "count" else (max(1, int(math.ceil(value * alive))) if value > 0 else 0)
        passed = n_active >= required
        data["check_min_active"] = {"min_active": str(min_active), "kind": kind, "required": required,
                                    "records_active": n_active, "passed": passed}
        if not passed:
            what = (f"{value:g} of the {count(alive, 'record')} not deleted" if kind == "fraction" else "the minimum")
            failures.append((BudgetExhaustedError,
                             f"only {count(n_active, 'record')} {'is' if n_active == 1 else 'are'} active, fewer than --min-active {min_active} "
                             f"({required}, {what})"))

    # A data subject's view (--record / --user): their own figures at the top level, the ledger's guarantee,
    # and nothing computed from other people's records (no counts, quantiles, history or checks).
    base = {k: data[k] for k in _GUARANTEE_KEYS if k in data}
    if record_id is not None:
        hits = np.flatnonzero(canonical_array(s.record_id) == record_id) if n else np.empty(0, np.int64)
        if hits.size == 0:
            # review 55, F9: an access request for a row the store holds but the ledger does not (not indexed yet, or
            # left out of a user-unit ledger for want of a user id) read as "not held"
            raise BadInputError(f"record id {record_id!r} is not in the ledger {ledger_path}: it has never been used "
                                "to answer a query. The store may still hold it (a row `index` has not brought in "
                                "yet, or one a user-unit ledger leaves out for want of a user id): `indknn delete "
                                "--dry-run --record ID` says, and `indknn delete` erases it")
        rec = _subject_record(ledger, int(hits[-1]), status=status, budget=budget, delta=use_delta, c1=c1)
        data = {**base, "subject": "record", **rec, "operator_only": SUBJECT_NOTE}
    if user_id is not None:
        hits = np.flatnonzero(canonical_array(s.user_id) == user_id) if n else np.empty(0, np.int64)
        if hits.size == 0 or not user_id:
            raise BadInputError(f"user id {user_id!r} has no records in the ledger {ledger_path}")
        recs = [_subject_record(ledger, int(i), status=status, budget=budget, delta=use_delta, c1=c1) for i in hits]
        counts = {k: sum(r["status"] == k for r in recs) for k in ("active", "retired", "deleted")}
        data = {
            **base, "subject": "user", "user_id": user_id, "records": len(recs),
            **{f"records_{k}": v for k, v in counts.items()},
            "times_selected": int(np.sum(s.times_selected[hits])),
            "user_level": USER_LEVEL_NOTE,
            **(_user_unit_figures(s.spent[hits], budget=budget, delta=use_delta)
               if data["unit"] == "user" else {}),
            "realised_label": REALISED_LABEL,
            "deleted": all(r["deleted"] for r in recs),
            "record_list": recs,
            "operator_only": SUBJECT_NOTE,
        }

    report = AccountReport(data=data, history_points=points,
                           spent_fraction=(np.minimum(spent, budget) / budget) if budget > 0 else spent,
                           failures=failures)
    if plot is not None:
        from .answers_out import refuse_output_over

        # like --out and --export (review 39: `--plot L/events/x.png` was written there), the store the ledger
        # records included when --store is not given (review 40, M9); nothing is written before this point
        refuse_output_over(plot, option="--plot", folders=[("the ledger's folder", ledger_path),
                                                           ("the store's folder", store_path),
                                                           ("the store's folder", ledger.meta.get("store_path"))])
        from .report_plot import plot_account_report  # matplotlib imported only then

        plot_account_report(report, plot)
        data["plot"] = str(plot)
    return report


def enforce_checks(report: AccountReport) -> None:
    """Raise the first failed check (--eps → CheckFailedError, --min-active → BudgetExhaustedError).

    When both fail the --eps failure wins (exit 4) and its message names both.
    """
    if not report.failures:
        return
    cls, msg = report.failures[0]
    if len(report.failures) > 1:
        msg = msg + "; also: " + "; ".join(m for _, m in report.failures[1:])
    raise cls(msg)
