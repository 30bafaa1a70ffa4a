"""`index` as a library call: the ledger's parameters (make_params), its records (sync_ledger) and build_index.

serving.py re-exports these names; `serve-queries` calls :func:`sync_ledger` and :func:`_roll_forward_pending`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Collection

import numpy as np

from . import accounting, data_quality, deletion_deferred, indexes, rounding, store_erased_ids, store_twins
from . import ledger_integrity as integrity
from .errors import BadInputError, LedgerError
from .ledger import BudgetLedger, PrivacyParams
from .ledger_files import refuse_foreign_folder
from .object_store import local_path
from .store import FeatureStore
from .user_unit import user_keys
from .wording import count, per_unit

if TYPE_CHECKING:  # the annotation only: tuning imports this module
    from . import tuning

log = logging.getLogger(__name__)  # --verbose: indknn's own INFO lines on stderr


# -- index -------------------------------------------------------------------
@dataclass
class IndexResult:
    store: str
    ledger: str
    records: int
    records_added: int
    created: bool
    params: PrivacyParams
    kind: str = "flat"
    extra: dict = field(default_factory=dict)
    tuning: dict | None = None  # the ledger's tuning record (index --tune), if any

    def as_dict(self) -> dict:
        p = self.params
        from . import tuning as _tuning

        share = _tuning.headline(self.tuning, budget=p.budget, delta=p.delta)
        eps = (share["epsilon_total"] if share is not None
               else accounting.epsilon_for_budget(budget=p.budget, delta=p.delta, conversion=p.conversion))
        return {
            "store": self.store, "ledger": self.ledger, "kind": self.kind, "created": self.created,
            "records": self.records, "records_added": self.records_added,
            "budget": p.budget, "epsilon": eps,
            **({"tuning": {**self.tuning, "headline": share}} if self.tuning is not None else {}),
            "delta": p.delta, "conversion": p.conversion, "kernel": p.kernel, "tau": p.tau,
            "sigma1": p.sigma1, "sigma2": p.sigma2, "k_min": p.k_min, "unit": p.privacy_unit,  # what the ε is for (SPEC §8)
            "adjacency": f"add/remove one {p.privacy_unit}",
            **({"max_records_per_user": p.max_records_per_user, "user_for_missing": p.user_for_missing}
               if p.privacy_unit == "user" else {}),
            **self.extra,
        }


def make_params(
    *, epsilon: float, delta: float, conversion: str = "gdp", kernel: str = "cosine", tau: float,
    sigma2: float, sigma1: float | None = None, planned_queries: int | None = None,
    nu: float | None = None, k_min: float = 30.0, privacy_unit: str = "record",
    max_records_per_user: int | None = None, user_for_missing: str = "refuse",
) -> PrivacyParams:
    """Calibrate B from (ε, δ) and fill in σ1 = sqrt(T/(6B)) when only T is given.

    Every parameter must be finite and inside its documented range (``accounting.PARAM_RANGES``):
    checked before any calibration, so nothing is computed from (or written with) a poisoned value.
    """
    accounting.check_range("epsilon", epsilon)
    accounting.check_range("delta", delta)
    for name, value in (("sigma2", sigma2), ("k_min", k_min), ("sigma1", sigma1), ("nu", nu)):
        if value is not None:
            accounting.check_range(name, value)
    if planned_queries is not None:
        if isinstance(planned_queries, bool) or not isinstance(planned_queries, numbers.Integral):
            raise BadInputError(f"planned_queries must be an integer, got {planned_queries!r}")
        planned_queries = int(planned_queries)
        accounting.check_range("planned_queries", planned_queries)
    if privacy_unit == "record" and user_for_missing == "record":  # was ignored without a word (review 69, F6)
        raise BadInputError("--user-for-missing record needs --privacy-unit user (under the record unit every record "
                            "is its own unit already): leave it out, or give --privacy-unit user")
    budget = accounting.calibrate_budget(epsilon=epsilon, delta=delta, conversion=conversion)
    if sigma1 is None:
        sigma1 = accounting.default_sigma1(planned_queries=planned_queries or 1000, budget=budget)
    if kernel == "rbf" and nu is None:
        nu = math.exp(1.5)  # paper default ν = e^1.5
    return PrivacyParams(epsilon=float(epsilon), delta=float(delta), conversion=conversion, budget=budget,
                         kernel=kernel, tau=float(tau), sigma1=float(sigma1), sigma2=float(sigma2),
                         nu=None if nu is None else float(nu), k_min=float(k_min),
                         planned_queries=planned_queries, privacy_unit=privacy_unit,
                         max_records_per_user=max_records_per_user, user_for_missing=user_for_missing).validate()


def sync_ledger(ledger: BudgetLedger, store: FeatureStore) -> int:
    """Bring private store rows that the ledger does not know into it (budget B, no refunds).

    The caller has checked that the store is a later state of the one the ledger last recorded
    (:func:`indknn_cli.ledger_integrity.attach`, :mod:`indknn_cli.store_versions`): row numbers mean what they meant.
    """
    n = store.n_rows("private")
    known = ledger.store_row_map(n) >= 0
    deleted_rows = store.read("private", "deleted").astype(bool) if n else np.zeros(0, bool)
    deleted_rows[store.erase_pending_rows("private")] = True  # an erasure not finished: never brought back in
    deleted_rows[deletion_deferred.rows(ledger, store)] = True  # nor one recorded without the store's lease
    new_rows = np.flatnonzero(~known & ~deleted_rows)
    if new_rows.size:
        # Only the new rows' identifiers, read run by run (appended rows sit at the end): a serve of a store
        # the ledger already knows reads none (at N = 1M the two string columns took 0.7 s per serve; issue 21)
        ids = _read_rows(store, "record_id", new_rows)
        users = _read_rows(store, "user_id", new_rows)
        back = store_erased_ids.resurrected(store, new_rows, ledger)  # erased, restored from a backup: never again
        if back.any():
            new_rows, ids, users = new_rows[~back], ids[~back], users[~back]
        p = ledger.params
        if p.privacy_unit == "user":
            # A record without a user id cannot be charged to anybody: under --user-for-missing refuse it stays
            # out of the ledger (never a candidate); `index` refuses such rows with their count (operator side).
            keys = user_keys(users, ids, user_for_missing=p.user_for_missing)
            keep = np.array([k is not None for k in keys], dtype=bool)
            new_rows, ids, users = new_rows[keep], ids[keep], users[keep]
    indexes.add_rows(store, new_rows)  # candidate index (lsh/ivf): encode new rows incrementally
    if new_rows.size == 0:
        return 0
    return ledger.add_records(record_ids=[str(i) for i in ids], user_ids=[str(u) for u in users],
                              rows=new_rows.tolist())


def _read_rows(store: FeatureStore, name: str, rows: np.ndarray, *, max_runs: int = 64) -> np.ndarray:
    """``store.read("private", name)[rows]`` for sorted ``rows``, reading only their contiguous runs (the whole
    span from the first to the last when they are scattered over more than ``max_runs`` runs)."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    if breaks.size >= max_runs:
        lo = int(rows[0])
        return store.read("private", name, lo, int(rows[-1]) + 1)[rows - lo]
    return np.concatenate([store.read("private", name, int(run[0]), int(run[-1]) + 1)
                           for run in np.split(rows, breaks)])


def _tuned_rerun(ledger_path, store: FeatureStore, tune, given=None) -> str:
    """``index --tune`` on a ledger that exists: the creation's own command again (a re-run pipeline, or a second
    run started while the first tuned) adds new records and tunes nothing; any other --tune request is refused."""
    from . import tuning as _tuning

    existing = BudgetLedger.open_for(ledger_path, store)
    tuned = existing.meta.get("tuning") or {}
    differ = _tuning.request_differences(tuned.get("request"), tune, extractor=store.extractor.name,
                                            given=given)
    if differ:
        raise LedgerError(f"{ledger_path}: the ledger already exists; --tune chooses τ and σ2 once, when the "
                          "ledger is created (its parameters and budget cannot change afterwards), and this "
                          f"--tune request differs from the one that created it ({', '.join(differ[:4])}). To add "
                          f"new records, run `indknn index --ledger {ledger_path}` without --eps and --tune")
    return (f"the ledger was tuned when it was created (τ={existing.params.tau:g}, "
            f"σ2={existing.params.sigma2:g}) with these --tune options: nothing was tuned again")


def build_index(
    *, store_path: str | os.PathLike, ledger_path: str | os.PathLike, params: PrivacyParams | None,
    kind: str | None = None, lock_timeout: float = 60.0, tables: int | None = None, bits: int | None = None,
    index_seed: int | None = None, nlist: int | None = None, nprobe: int | None = None,
    train_on: str | os.PathLike | None = None, tune: "tuning.TuneRequest | None" = None,
    given: dict | None = None, tune_given: "Collection[str] | None" = None,
) -> IndexResult:
    """Create the ledger (or add the store's new records to it, keeping every spent budget).

    ``kind``: flat (exact), lsh or ivf (see :mod:`indknn_cli.indexes`); None keeps the
    store's current candidate index. hnsw, and IVF centroids trained on private
    vectors, are refused (PrivacyRefusedError): a record's candidate membership
    would depend on other private records, breaking the filter's guarantee (SPEC §4).

    ``tune`` (index --tune, docs/TUNING.md): choose (τ, σ2) first — privately, at a cost composed into the
    guarantee, or free on labelled public rows — then create the ledger with the chosen parameters and the
    tuning record in its metadata. Only when the ledger does not exist yet (tuning is once, at creation).

    ``given`` (the CLI: field → (flag, value) of the privacy flags typed) and ``tune_given`` (the flags typed): on an
    existing ledger only these are compared with the ledger's, a flag left out meaning the ledger's value; without
    them (a library caller) the whole ``params`` / ``tune`` request is compared.
    """
    indexes.check_kind(kind)
    if tune is not None:
        if params is not None:
            raise BadInputError("give the serving parameters through the tuning request, not both")
        tune.check()
    store_path = local_path(store_path)  # an s3:// URL: the store's state folder (object_store.py)
    integrity.refuse_ledger_in_store(store_path, ledger_path)  # before anything is written
    store = FeatureStore.open(store_path, mode="r")
    if store.n_rows("private") == 0:
        raise BadInputError(f"{store_path}: the store has no private records to index")

    if not BudgetLedger.exists(ledger_path):
        refuse_foreign_folder(Path(ledger_path))  # before the search and the lock, which writes LOCK there
        if params is None and tune is None:  # before the locks, whose files a refusal left behind (review 38)
            raise BadInputError("creating a ledger needs --eps (the target ε; --delta, --tau and --sigma2 have "
                                "defaults: indknn index -h)")
    record = None
    rerun_note = None
    folder_was_there = Path(ledger_path).exists()  # before any lock, which creates the ledger folder
    with contextlib.ExitStack() as held:
        ledger_locked = False
        if tune is not None and BudgetLedger.exists(ledger_path):
            rerun_note, tune = _tuned_rerun(ledger_path, store, tune, tune_given), None
        if tune is not None:
            integrity.refuse_second_ledger(store, ledger_path)  # refused before the search, not after (audit 5, F3)
            # held from the search through the ledger's creation (review 47): two simultaneous first `index --tune`
            # runs each tuned on the same private data, and the first to create the ledger kept its result
            held.enter_context(BudgetLedger.write_lock(ledger_path, timeout=lock_timeout))
            ledger_locked = True
            if BudgetLedger.exists(ledger_path):  # created by another run while this one waited for the lock
                rerun_note, tune = _tuned_rerun(ledger_path, store, tune, tune_given), None
            else:
                from . import tuning as _tuning

                rec, params = _tuning.run_tuning(store, tune)
                record = {**rec.as_dict(), "request": _tuning.request_record(tune, extractor=store.extractor.name)}

        existing_ledger = BudgetLedger.exists(ledger_path)
        # an existing ledger's own parameters, not this run's defaults (review 66), opened once for both uses
        run_params = BudgetLedger.open_for(ledger_path, store).params if existing_ledger else params
        warnings = _unit_checks(store, run_params, creating=not existing_ledger)
        # Refusals and IVF training (public data only) happen before anything is written; τ and the kernel calibrate
        # an IVF's nprobe
        plan = indexes.plan_index(store, kind=kind, tables=tables, bits=bits, seed=index_seed, nlist=nlist,
                                  nprobe=nprobe, train_on=train_on, params=run_params)
        created = False
        if not BudgetLedger.exists(ledger_path):  # before the lock, which would create the ledger folder
            integrity.refuse_second_ledger(store, ledger_path)
        if not ledger_locked:
            held.enter_context(BudgetLedger.write_lock(ledger_path, timeout=lock_timeout))
        with integrity.writer_lock(store_path, timeout=lock_timeout):
            # read again under the locks: another `index` may have created and bound the ledger while this one waited,
            # and the store read before would show no binding (a false "binding removed": review 31, QA)
            store = FeatureStore.open(store_path, mode="r")
            if BudgetLedger.exists(ledger_path):
                ledger = BudgetLedger.open_for(ledger_path, store)
                if record is not None:  # created while we tuned: the tuning result is dropped, never applied
                    raise LedgerError(f"{ledger_path}: another process created the ledger while this one tuned")
                integrity.attach(store, ledger, ledger_path, bind=True, lock_timeout=lock_timeout)
                store_twins.refuse_twin(store, ledger, ledger_path)  # a copied pair used from both copies (review 42)
                typed_eps = (given or {}).get("epsilon")  # the CLI's re-run: --eps and the flags typed, no params
                if params is not None:
                    differences = (_given_differences(params.epsilon, given, ledger.params) if given is not None
                                   else _differences(params, ledger.params))
                elif typed_eps is not None:
                    differences = _given_differences(typed_eps[1], {k: v for k, v in given.items() if k != "epsilon"},
                                                     ledger.params)
                else:
                    differences = []
                if differences:
                    raise LedgerError(
                        f"{ledger_path}: the ledger already exists with fixed parameters "
                        f"(ε={ledger.params.epsilon} at δ={ledger.params.delta} ({ledger.params.conversion}, "
                        f"{per_unit(ledger.params.privacy_unit)}), B={rounding.up(ledger.params.budget)}, "
                        f"τ={ledger.params.tau}, σ2={ledger.params.sigma2}); they cannot change after creation, and "
                        f"this run's differ (the ledger's → this run's; a flag left out keeps the ledger's value): "
                        f"{'; '.join(differences)}. To "
                        f"add new records, run `indknn index --ledger {ledger_path}` without --eps and the other "
                        "privacy flags"
                    )
                if params is None and typed_eps is None:
                    _check_given(given, ledger.params, ledger_path)
            else:
                if params is None:
                    raise BadInputError("creating a ledger needs --eps (the target ε; --delta, --tau and --sigma2 have "
                                        "defaults: indknn index -h)")
                integrity.refuse_second_ledger(store, ledger_path)  # one store, one ledger (SPEC §8)
                ledger = BudgetLedger.create(ledger_path, params=params, store_uuid=store.uuid,
                                             store_path=str(Path(store_path).resolve()), tuning=record)
                try:
                    integrity.attach(store, ledger, ledger_path, bind=True, lock_timeout=lock_timeout)
                except BaseException:
                    if not folder_was_there:
                        _discard_unbound(ledger_path, store_path, ledger)
                    raise
                created = True
                log.info("ledger %s created (uuid %s) and bound to the store (uuid %s)", ledger_path,
                         ledger.meta["ledger_uuid"], store.uuid)
            from .deletion_compact import discard_unpublished

            discard_unpublished(store, ledger)  # a stopped compaction's leftovers (review 27, F3)
            _roll_forward_pending(store_path, ledger, lock_timeout)
            n_priv = store.n_rows("private")
            moves = ledger.user_moves([str(r) for r in store.read("private", "record_id")],
                                      [str(u or "") for u in store.read("private", "user_id")]) if n_priv else []
            if moves:
                raise BadInputError(f"{count(len(moves), 'private row')} reuse{'s' if len(moves) == 1 else ''} an erased "
                                    f"record id under another user (first: {moves[0]!r}); an erased id keeps its user. These rows "
                                    "are in the store, not in the ledger (never selected): erase them with `indknn "
                                    "delete --record ID`, then embed them again under new record ids")
            added = sync_ledger(ledger, store)
            log.info("%s added to the ledger (operator-only count)", count(added, "new record"))
            if created:
                ledger.compact()
    index_info = indexes.apply_plan(store, plan, lock_timeout=max(lock_timeout, 300.0))
    log.info("candidate index: %s", plan.kind)
    # operator-only (index's stderr, never serve's); only when the ledger is made or grows, not on every cron re-run
    sparse = data_quality.neighbour_warning(store, ledger.params) if created or added else None
    warnings = warnings + ([sparse] if sparse else [])
    small = data_quality.tuning_size_warning(records=len(ledger.state), tuning=record) if created else None
    if created or added:
        users = ledger.params.privacy_unit == "user"
        big_delta = data_quality.delta_warning(subjects=_subjects(ledger, users), delta=float(ledger.params.delta),
                                               unit="user" if users else "record")
        warnings = warnings + ([big_delta] if big_delta else [])
    warnings = warnings + ([small] if small else []) + ([rerun_note] if rerun_note else [])
    if created and store.label_names_source in (None, "unrecorded"):
        warnings.append("the store does not record where its class names came from (it was created before indknn "
                        "recorded that, or by a library call that did not say): the guarantee assumes the class list was declared in advance, never read "
                        "from the private rows (every answer is one of these names)")
    return IndexResult(store=str(store_path), ledger=str(ledger_path), records=len(ledger.state),
                       records_added=added, created=created, params=ledger.params, kind=plan.kind,
                       extra={"index": index_info, **({"warnings": warnings} if warnings else {})},
                       tuning=ledger.meta.get("tuning"))


def _subjects(ledger: BudgetLedger, users: bool) -> int:
    """Records (or users, each record without a user its own) not erased: the N of δ ≥ 1/N (operator only)."""
    live = ~np.asarray(ledger.state.deleted, dtype=bool)
    if not users:
        return int(live.sum())
    ids = [str(u or "") for u in np.asarray(ledger.state.user_id, dtype=object)[live]]
    return len({u for u in ids if u}) + sum(1 for u in ids if not u)


def _roll_forward_pending(store_path, ledger: BudgetLedger, lock_timeout: float) -> None:
    """Tombstones of an erasure recorded while the ledger was unreadable, written first (deletion.py)."""
    from .deletion import roll_forward_pending

    roll_forward_pending(store_path, ledger, lock_timeout=lock_timeout)


def _unit_checks(store: FeatureStore, params: PrivacyParams | None, *, creating: bool = True) -> list[str]:
    """User unit: at creation, refuse records without a user id (with their count) unless each may be its own
    user; on an existing ledger such rows (arrived later) are never candidates, as serve-queries treats them, and
    a warning counts them (review 44, L2: one such row refused the whole re-run, so no other new record joined).
    Record unit on a store that has user ids: a warning (a person with many records is protected per record)."""
    if params is None:
        return []
    users = store.read("private", "user_id")
    deleted = store.read("private", "deleted").astype(bool)
    has_user = np.array([bool(u) for u in users], dtype=bool) & ~deleted
    if params.privacy_unit == "user":
        missing = int((~has_user & ~deleted).sum())
        if missing and params.user_for_missing != "record":
            if not creating:
                return [f"{count(missing, 'private row')} of the store {'has' if missing == 1 else 'have'} no user "
                        "id: under the user unit (--user-for-missing refuse) they stay out of the ledger (never "
                        "candidates); to serve them, delete them and embed them again with a user id (--user-column)"]
            raise BadInputError(f"--privacy-unit user: {missing} private rows have no user id; give them one "
                                "(embed --user-column) or pass --user-for-missing record (each its own user)")
        return []
    if has_user.any():  # review 55, F4: on an existing ledger --privacy-unit user is refused: never advise it there
        return ["the store has user ids but the privacy unit is record: a person with several records is "
                "protected per record, not as a person; " + (
                    "consider --privacy-unit user (with --tau and --sigma2: --tune is per record)" if creating else
                    "the unit is fixed when the ledger is made (per-user protection needs a new store and ledger "
                    "made with --privacy-unit user)")]
    return []


def _discard_unbound(ledger_path, store_path, ledger) -> None:
    """A ledger this `index` just made in a folder that did not exist, refused before the store names it (its
    binding or its mark): removed, so that a refused `index` leaves no ledger behind (review 31: one was left, and
    `repair` on it retired every new record). Kept when anything of the store already names it."""
    import shutil

    uuid = ledger.meta["ledger_uuid"]
    try:
        b = integrity.binding_of(FeatureStore.open(store_path, mode="r"))
        local = integrity._read_local_mark(store_path)
    except Exception:  # noqa: BLE001 - unsure what the store holds: keep the ledger
        return
    if (b or {}).get("ledger_uuid") != uuid and (local or {}).get("ledger_uuid") != uuid:
        shutil.rmtree(ledger_path, ignore_errors=True)


def _check_given(given: dict | None, params: PrivacyParams, ledger_path) -> None:
    """Re-running `index` on an existing ledger without --eps: a privacy flag given with another value than the
    ledger's (``given``: field → (flag, value)) is refused, not silently dropped (review 38, F4: `--privacy-unit
    user --tau 0.9` exited 0 and the ledger stayed record-level at τ = 0.2, though `index`'s own warning suggested
    that flag). The same value is fine: a re-run with the creation's flags adds new records."""
    for name, (flag, value) in (given or {}).items():
        have = getattr(params, name)
        same = (math.isclose(float(value), float(have)) if isinstance(value, float) and have is not None
                else value == have)
        if not same:
            raise BadInputError(
                f"{flag} {value} differs from the ledger's {have} ({ledger_path}): a ledger's parameters are fixed "
                f"when it is created ({per_unit(params.privacy_unit)}); re-running index only adds new records, so "
                f"leave {flag} out, or create a new store and ledger for other parameters")


def _given_differences(epsilon: float, given: dict, b: PrivacyParams) -> list[str]:
    """`index --eps …` on an existing ledger: what differs between the flags actually given (``given``: field →
    (flag, value); --eps always) and the ledger's ``b``, as :func:`_differences` words it. A flag left out means the
    ledger's value (review 66, F3: `index --eps 4` on a ledger made with `--eps 4 --tau 0.3` was refused, τ 0.3 →
    the default 0.25). σ1 follows --sigma1, else --planned-queries with the ledger's B (the paper's sqrt(T/(6B)))."""
    out = [f"epsilon: {b.epsilon!r} → {float(epsilon)!r}"] if float(epsilon) != b.epsilon else []
    for name, (_flag, value) in given.items():
        if name == "sigma1":
            continue
        have = getattr(b, name)
        same = (math.isclose(float(value), float(have)) if isinstance(value, float) and have is not None
                else value == have)
        if not same:
            out.append(f"{name}: {have!r} → {value!r}")
    if "sigma1" in given or "planned_queries" in given:
        sigma1 = (float(given["sigma1"][1]) if "sigma1" in given
                  else accounting.default_sigma1(planned_queries=int(given["planned_queries"][1]), budget=b.budget))
        if not math.isclose(sigma1, b.sigma1):
            out.append(f"sigma1 (from --sigma1 or --planned-queries): {b.sigma1!r} → {sigma1!r}")
    return out


def _differences(a: PrivacyParams, b: PrivacyParams) -> list[str]:
    """What differs between this run's parameters ``a`` and the ledger's ``b``, as "name: ledger's → this run's"
    (review 55, F7: the refusal listed the ledger's values, all equal to those typed; the difference was a default
    of a flag left out, e.g. --planned-queries or --privacy-unit)."""
    keys = ("epsilon", "delta", "conversion", "kernel", "tau", "sigma2", "k_min", "privacy_unit",
            "max_records_per_user", "user_for_missing")
    out = [f"{k}: {getattr(b, k)!r} → {getattr(a, k)!r}" for k in keys if getattr(a, k) != getattr(b, k)]
    if not math.isclose(a.sigma1, b.sigma1):
        out.append(f"sigma1 (from --sigma1 or --planned-queries): {b.sigma1!r} → {a.sigma1!r}")
    return out
