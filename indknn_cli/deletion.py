"""`indknn delete`: physical erasure behind ledger tombstones, and compaction (issue 6, SPEC §8).

Erasure
-------
A deleted record's feature vector, label, record id and user id are
overwritten in the store (:meth:`FeatureStore.erase_rows`: every touched chunk
is rewritten whole, zarr's LocalStore replaces the chunk file atomically, then
fsync). The ledger keeps a tombstone (id, user, spent, deleted at): enough to
refuse a fresh budget, nothing of the data. Released answers never named any
record, so nothing else has to change.

Order of operations (the ledger lock, then the store lock, held throughout;
``serve-queries`` holds the ledger lock for its whole run, so a deletion lands
between two runs — a running batch finishes with the old state, the next sees
the deletion, no query ever sees half of it):

1. store: the private group's attribute ``erase_pending`` := the rows, then
   ``deleted[rows] := True`` (both fsync'd). An intent mark only: nothing is
   erased yet and the ledger still decides selection. Flagging first matters:
   ``serving.sync_ledger`` never (re)adds a store row flagged deleted, so a crash
   in steps 2–4 cannot bring a tombstoned record back as a fresh row.
2. ledger: one ``delete`` event (fsync, rename, fsync dir) — *the commit
   point*. From here on the record is never a candidate
   (``BudgetLedger.store_row_map`` skips tombstones).
3. store: ``erase_rows`` (features := 0, label := −1, ids := "").
4. candidate indexes: ``indexes.remove_rows(store, rows)`` when the module
   ``indknn_cli.indexes`` exists and has it (hook for LSH buckets / IVF lists).
5. store: ``erase_pending`` := [].

A crash anywhere leaves ``erase_pending`` set; the next ``indknn delete`` (any
ids, or ``--compact`` alone) rolls it forward first (:func:`complete_pending`):
an accepted erasure request is finished, never undone.

A ledger that cannot be read (a truncated event, ...) does not block erasure
(issue 16 §3, :func:`deletion_unledgered.erase_without_ledger`): steps 1 and 3–4 run on the rows
the store names and ``erase_pending`` stays set, so the tombstones (step 2) are
written by the next delete that can read the ledger.

A store writer lease held by another machine (object storage) does not block it either (review 67, F1,
:mod:`deletion_deferred`): the tombstones and the rows still to overwrite are committed to the ledger, exit 1; the
next writer holding the lease rolls them forward with the store's ``erase_pending`` (:func:`complete_pending`).

Compaction (``--compact``)
--------------------------
Rewrites the store without its deleted rows and folds the ledger's events into a
snapshot whose ``row`` column is renumbered, preserving every spent budget and
every tombstone. Two folders cannot be replaced in one atomic step, so the
renumbered store gets a *new* ``store_uuid`` and the ledger is bound to store
uuids: at every instant either both sides agree or the ledger refuses to open
with the store (``LedgerError``) — never the wrong rows for a record.

1. copy: the new store is written to ``.<store>.compacting-<token>`` beside the
   store (private rows kept in order, public and query groups copied
   byte for byte, new ``store_uuid``), every file fsync'd.
2. ledger: snapshot g+1 written (renumbered rows, new store uuid) but not
   published: CURRENT still names g.
3. swap: ``renameat2(RENAME_EXCHANGE)`` of the two folders (atomic; two
   renames via ``.<store>.old-<token>`` where the file system lacks it).
4. publish: CURRENT := g+1 — the commit point; folded events and generation g
   removed.
5. the old folder is removed. (Between 1 and 2 the copy's candidate index is
   renumbered by ``indexes.renumber_rows`` when that hook exists.)

Recovery (:func:`indknn_cli.deletion_compact.recover`, run by every non-dry-run delete before anything
else): before 3 the store and CURRENT agree — leftovers are removed (roll
back); after 3 the store carries the new uuid and snapshot g+1 names it — g+1
is published (roll forward); in the middle of the two-rename fallback the
store folder is missing — the old one is renamed back. Until then
``serve-queries`` refuses with a message naming ``indknn delete --compact``.

Additions and returning ids
---------------------------
``embed`` appends rows; ``index`` or the next ``serve-queries`` brings them into
the ledger (``sync_ledger`` → ``BudgetLedger.add_records``). A record id whose
ledger record is tombstoned (or retired) keeps its spent budget (under the user
unit a new record of a known user joins that user's spent; under the record unit
another record id starts afresh: review 71, F2). Because
erasure blanks the record id in the store, the id is free for ``embed`` again
(``--if-exists`` only concerns ids of *live* store rows: ``error`` refuses,
``skip`` keeps the existing row with its spent budget — neither gives a fresh
budget). Relabelling = delete, then embed the same id with the new label: the
new row inherits the old spent budget.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from . import ledger_integrity as integrity
from . import deletion_deferred, object_store, store_twins
from .deletion_compact import LedgerUnreadable as _LedgerUnreadable
from .deletion_compact import compact as _compact_store
from .deletion_compact import recover as _recover
from .deletion_compact import leftover_note as _leftover_note
from .deletion_compact import recover_store_folder as _recover_store_folder
from .deletion_plan import DeleteResult, _enforce_strict, _plan, _Plan
from .deletion_plan import read_ids  # noqa: F401 (its home before the split: library callers)
from .deletion_unledgered import (IndexNotUpdated as _IndexNotUpdated, RowsNotOverwritten as _RowsNotOverwritten,
                                  erase_without_ledger, open_readable, refuse_missing_bound_ledger, set_pending)
from .errors import (BadInputError, ConcurrentChangeError, LedgerError, LedgerIntegrityError, LockTimeoutError,
                     StorageError, StoreError)
from .id_text import canonical
from .ledger import BudgetLedger
from .store import ERASE_PENDING_ATTR, FeatureStore
from .wording import count

log = logging.getLogger(__name__)  # --verbose: indknn's own INFO lines on stderr

#: Test hook: called with a step name at each step of a deletion / compaction.
FAULT_HOOK: Callable[[str], None] | None = None
#: Tests set this to False to exercise the two-rename fallback of the folder swap.
USE_RENAME_EXCHANGE = True
PENDING_ATTR = ERASE_PENDING_ATTR


def _fault(point: str) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(point)


def _index_hook(name: str) -> Callable | None:
    """``indknn_cli.indexes.<name>`` when the candidate-index module provides it, else None.

    Contract: ``remove_rows(store, rows)`` drops the store rows ``rows`` (already
    erased) from every persisted candidate index of ``store``;
    ``renumber_rows(store, new_row_of)`` is called on the compacted *copy*
    (``store`` = the new folder, new ``store_uuid``, before it replaces the
    store) with ``new_row_of[old] = new`` (−1 for removed rows); other entries of
    the store folder (e.g. ``<store>/index``) were copied there as they were.
    Without that hook the copied index keeps the old rows and uuid, and
    ``indexes.open_finder`` refuses it until ``indknn index`` re-encodes it. Both
    run under the ledger and store locks; a ``remove_rows`` exception leaves
    ``erase_pending`` set, so the next delete retries.
    """
    try:
        from . import indexes  # type: ignore[attr-defined]
    except ImportError:
        return None
    fn = getattr(indexes, name, None)
    return fn if callable(fn) else None


# -- the library call ------------------------------------------------------------
def delete_records(
    *,
    store_path: str | os.PathLike,
    ledger_path: str | os.PathLike,
    record_ids: Iterable[str] = (),
    user_ids: Iterable[str] = (),
    dry_run: bool = False,
    finish_pending: bool = False,  # ids read from files: none is a day without requests (exit 0), which still
                                   # finishes a recorded, unfinished erasure
    strict: bool = False,
    compact: bool = False,
    lock_timeout: float = 60.0,
) -> DeleteResult:
    """Erase records (by record id and/or user id); optionally compact store and ledger.

    Unknown ids are reported in the result; with ``strict`` they raise
    ``BadInputError`` before anything is written. ``dry_run`` takes no lock and
    writes nothing.
    """
    # ids as `embed` stores them: surrounding whitespace trimmed (review 38, F3: `--record ' sp1 '` was unknown), in
    # Unicode NFC (review 53, F2: "José" typed decomposed erased nothing, or only one spelling's records)
    record_ids = list(dict.fromkeys(canonical(str(r).strip()) for r in record_ids))
    user_ids = list(dict.fromkeys(canonical(str(u).strip()) for u in user_ids))
    if any(not r.strip() for r in record_ids + user_ids):
        raise BadInputError("an empty record or user id was given")
    if not record_ids and not user_ids and not compact and not finish_pending:
        raise BadInputError("nothing to delete: give --record, --user, --ids-file or --users-file (or --compact)")
    store_path, ledger_path = object_store.local_path(store_path), Path(ledger_path)
    compact_refused = None
    if compact:  # the compaction replaces the store's folder, a ledger inside with it; an erasure still goes on
        try:
            integrity.refuse_ledger_in_store(store_path, ledger_path)
        except BadInputError as exc:
            if not (record_ids or user_ids):
                raise
            compact, compact_refused = False, str(exc)  # reported with the result (review 31: it erased nothing)
    if finish_pending and not (record_ids or user_ids or compact) and \
            not (st := FeatureStore.open(store_path, mode="r")).erase_pending_rows("private").size and \
            not deletion_deferred.pending_in(ledger_path, st):  # nor one recorded without the store's lease
        # a day without erasure requests (empty --ids-file): nothing to do, the store checked (UX review 7)
        return DeleteResult(records_erased=0, users=[], ids_not_found=[], users_not_found=[], already_deleted=[],
                            record_ids=[], bytes_rewritten=0, dry_run=dry_run)

    store = None
    if dry_run or strict:  # a lock-free look first: --dry-run and --strict refusals write nothing at all
        try:
            store = FeatureStore.open(store_path, mode="r")
        except StoreError:
            from .deletion_compact import _leftovers

            if not _leftovers(Path(store_path)):
                raise
            if dry_run:
                raise StoreError(f"{store_path}: a compaction of this store stopped mid-swap (its copies are beside "
                                 "the store's name); --dry-run writes nothing, so it cannot finish it: run `indknn "
                                 "delete` without --dry-run (it finishes the compaction first, then erases)") from None
            # --strict mid-swap (review 32, F8): the locked path recovers the store folder first, then refuses an
            # unknown id as the look would
    if store is not None:
        try:
            ledger = open_readable(ledger_path, store)
        except (_LedgerUnreadable, LedgerError, ConcurrentChangeError) as exc:
            if not (record_ids or user_ids):
                raise (exc.error if isinstance(exc, _LedgerUnreadable) else exc) from None
            ledger = None  # the store alone says which rows the ids name (see deletion_unledgered)
        # rows whose erasure the ledger recorded under another machine's store lease: the real run finishes them
        # first, so their ids are already deleted and the rows count as pending (review 70, F4)
        deferred = deletion_deferred.rows(ledger, store)
        plan = _plan(store, ledger, record_ids, user_ids, erased_rows=deferred)
        _enforce_strict(plan, strict)
        if dry_run:
            compaction = None
            if compact:
                flagged = int(store.read("private", "deleted").astype(bool).sum())
                compaction = {"store_rows_removed": flagged + int(plan.rows.size),
                              "store_rows": store.n_rows("private") - flagged - int(plan.rows.size)}
            return DeleteResult(records_erased=len(plan.record_ids), users=plan.users, ids_not_found=plan.not_found,
                                users_not_found=plan.users_not_found, already_deleted=plan.already_deleted,
                                users_already_deleted=plan.users_already_deleted,
                                record_ids=plan.record_ids, bytes_rewritten=0, dry_run=True,
                                # read as every command reads it (a damaged list: review 58, F4, an internal error)
                                pending_completed=int(np.union1d(store.erase_pending_rows("private"),
                                                                 deferred).size),
                                compaction=compaction)

    # A ledger that cannot even be locked (a plain file, a read-only folder) or that is the store's own folder (its
    # lock is the store's: a delete waited on itself) never blocks an erasure either: the store alone (review 32)
    no_ledger = None
    held = contextlib.ExitStack()
    if Path(ledger_path).resolve() == Path(store_path).resolve():
        no_ledger = (f"--ledger {ledger_path} is the store's folder: no ledger is read or written there (pass the "
                     "ledger's own folder)")
    else:
        try:
            held.enter_context(BudgetLedger.write_lock(ledger_path, timeout=lock_timeout))
        except StorageError as exc:
            if not (record_ids or user_ids):
                raise
            no_ledger = str(exc)
    if no_ledger is not None and not (record_ids or user_ids):
        raise BadInputError(no_ledger)
    with held:
        _recover_store_folder(store_path)
        # A bucket versioned after the store was made never blocks an erasure (AUDIT_FINDINGS_2.md P9): the
        # request is recorded and the current chunks overwritten; what the old versions keep is reported.
        store = FeatureStore.open(store_path, mode="a", allow_versioned=True)
        status = object_store.versioning(store.remote) if store.remote is not None else None
        note = None if status is None else object_store.versioned_erasure_note(store.remote, status)
        if note is not None and not (record_ids or user_ids):  # --compact alone: refused as any other write
            object_store.refuse_versioned(store.remote)
        with integrity.writer_lock(store_path, timeout=lock_timeout), contextlib.ExitStack() as store_held:
            try:
                store_held.enter_context(store.write_lock(timeout=lock_timeout))
            except LockTimeoutError as exc:  # the writer lease held elsewhere (a crashed coordinator): the request
                # is recorded in the ledger all the same, never selected again (review 67, F1); exit 1
                if store.remote is None or no_ledger is not None or not (record_ids or user_ids):
                    raise
                deletion_deferred.record(store_path, ledger_path, record_ids, user_ids, strict=strict,
                                         lease_error=exc)
            cleanup: list = []
            recovered = False
            try:
                if no_ledger is not None:
                    raise _LedgerUnreadable(LedgerError(no_ledger))
                ledger = _recover(store, ledger_path, cleanup)
                recovered = True  # its leftovers step ran (cleanup holds what it could not remove)
                if ledger is None:
                    refuse_missing_bound_ledger(store, ledger_path)
                if ledger is not None:  # one store, one ledger; a rolled-back ledger is refused (ledger_integrity)
                    try:
                        integrity.attach(store, ledger, ledger_path, bind=True, locked_store=store)
                    except LedgerIntegrityError as exc:  # damaged or rolled back: never blocks an erasure
                        raise _LedgerUnreadable(exc) from None
            except (_LedgerUnreadable, LedgerError, ConcurrentChangeError) as exc:
                # damaged, rolled back, another store's or bound elsewhere, or a ledger of a store compacted since
                # (the store restored from a backup taken before the compaction: "run again" never cleared; under
                # these locks nothing else changes it): the erasure goes on from the store alone (review 32)
                error = exc.error if isinstance(exc, _LedgerUnreadable) else exc
                if not (record_ids or user_ids):  # --compact alone needs the ledger: refused, nothing written
                    raise error from None
                why = str(error) if not isinstance(error, ConcurrentChangeError) else (
                    f"{ledger_path}: the ledger's rows are those of a compaction of this store that it no longer "
                    "matches (the store restored from a copy older than a compaction?)")
                res = erase_without_ledger(store, record_ids, user_ids, strict=strict, compact=compact, reason=why,
                                           erase=lambda st, rows: _erase_steps(st, rows, tombstone=None))
                left = None if recovered else _leftover_note(store.path)  # not run: its leftovers are reported
                if left is not None:  # a local copy, or the state folder of a copy in the bucket
                    from .deletion_compact import erase_in_leftovers

                    in_copies = erase_in_leftovers(store.path, record_ids, user_ids)
                    if in_copies:  # review 32, F5: the request's rows in those copies too
                        left += f" ({count(in_copies, 'row')} of this request erased in them as well)"
                notes = ([note] if note else []) + cleanup + ([left] if left else [])
                res.physical_erasure = "; ".join(notes) if notes else None
                if compact_refused is not None:
                    res.compaction = {"refused": compact_refused}
                return res
            stuck, stuck_error = np.empty(0, np.int64), None
            try:
                pending = complete_pending(store, ledger)
            except (StoreError, StorageError) as exc:  # review 57, F3 (a corrupt chunk) and review 62, F3 (a write
                # error: EIO, ENOSPC): an earlier erasure that cannot be finished blocked every later request before
                # it was recorded; it stays pending (never selected) and this one is recorded and goes on
                pending, stuck, stuck_error = 0, store.erase_pending_rows("private"), exc
            plan = _plan(store, ledger, record_ids, user_ids)
            _enforce_strict(plan, strict)
            log.info("erasing %s of the store (operator-only count)", count(int(plan.rows.size), "row"))
            written = _execute(store, ledger, plan, still_pending=stuck)
            if stuck_error is not None:
                how = ("once that chunk reads again (its file restored from a backup of this store taken since its "
                       "last compaction)" if isinstance(stuck_error, StoreError)
                       else "once the storage error above is cleared")
                raise StorageError(
                    f"{stuck_error} This request's erasure went on ({count(len(plan.record_ids), 'record')}); an "
                    f"earlier one of {count(int(stuck.size), 'row')} is recorded but not finished (never selected "
                    f"again): {how}, `indknn delete` finishes it")
            if compact:
                log.info("compacting: rewriting the store without deleted rows, folding the ledger into a snapshot")
            compaction = _compact(store, ledger) if compact else None
            if compaction and compaction.get("leftover"):
                cleanup.append(compaction["leftover"])
            twin = store_twins.twin_of(store, ledger) if ledger is not None else None
            if twin is not None and (record_ids or user_ids):  # review 42, M3: the rows live on in that copy
                cleanup.append(f"incomplete: another copy of this store (uuid {store.uuid}, or compacted since under a new one) is at {twin} "
                               "and still holds these rows: run the same delete there, or remove that copy")
            if cleanup:  # objects of an earlier copy that may keep vectors: reported with the result (exit 1)
                note = "; ".join(([note] if note else []) + cleanup)
    if compact_refused is not None:
        compaction = {"refused": compact_refused}
    return DeleteResult(records_erased=len(plan.record_ids), users=plan.users, ids_not_found=plan.not_found,
                        users_not_found=plan.users_not_found, already_deleted=plan.already_deleted,
                        users_already_deleted=plan.users_already_deleted,
                        record_ids=plan.record_ids, bytes_rewritten=written, dry_run=False,
                        pending_completed=pending, compaction=compaction, physical_erasure=note)


# -- executing (under both locks) ---------------------------------------------------
def _execute(store: FeatureStore, ledger: BudgetLedger | None, plan: _Plan,
             still_pending: np.ndarray = np.empty(0, np.int64)) -> int:
    """``still_pending``: rows of an earlier erasure that could not be finished; they stay pending throughout."""
    rows = plan.rows
    if rows.size:
        set_pending(store, np.union1d(still_pending, rows))  # a failure here changed nothing: StorageError says so
    try:
        return _execute_recorded(store, ledger, plan, still_pending=still_pending)
    except _IndexNotUpdated as exc:
        raise StorageError(str(exc)) from None
    except _RowsNotOverwritten as exc:  # a corrupt chunk of the rows being erased (review 54, F3: exit 2, "bad
        # input", after the tombstone was committed and the rows flagged)
        raise StorageError(
            f"{exc} The erasure was recorded but not finished: the records are never selected again (the store's "
            "erase-pending rows are written, the ledger's tombstones when it could be reached); their rows could not "
            "be overwritten. Once "
            "that chunk reads again (its file restored from a backup of this store taken since its last compaction: "
            "docs/RELIABILITY.md), `indknn "
            "delete` (any ids) finishes the erasure") from None
    except (StorageError, OSError) as exc:
        if not rows.size:
            raise
        # The request is recorded (erase_pending): serving never selects these rows again,
        # and the next `indknn delete` rolls the erasure forward. Say so, not "nothing changed".
        where = getattr(exc, "path", None) or getattr(exc, "filename", None) or store.path
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__
        raise StorageError(
            f"{where}: cannot write ({reason}). The erasure was recorded but not finished: the "
            "records are never selected again; run `indknn delete` again (any ids, or --compact) "
            "to finish it"
        ) from None


def _execute_recorded(store: FeatureStore, ledger: BudgetLedger | None, plan: _Plan,
                      still_pending: np.ndarray = np.empty(0, np.int64)) -> int:
    def tombstone() -> None:
        if ledger is not None and (plan.ledger_idx.size or plan.rows.size):  # the rows too (review 72, F1)
            ledger.delete_records(plan.ledger_idx, erased_rows={"store_uuid": store.uuid, "rows": plan.rows})

    if not plan.rows.size:  # ledger records whose store rows are gone already: their tombstones only
        tombstone()
        return 0
    written = _erase_steps(store, plan.rows, tombstone=tombstone)
    set_pending(store, still_pending)  # 5. done (an earlier erasure that could not be finished stays)
    return written


def _erase_steps(store: FeatureStore, rows: np.ndarray, *, tombstone: Callable[[], None] | None) -> int:
    """Steps 1–4 of every erasure of the live store (a request, and the roll-forward of an unfinished one), the rows
    already recorded in ``erase_pending``: 1. flag, 2. ``tombstone()`` (the ledger's commit point; None without a
    ledger), 3. overwrite, 4. the candidate index. A corrupt chunk of the rows' own flags or arrays is
    :class:`_RowsNotOverwritten` (raised after the tombstone: review 57, F4), an index that can be neither updated nor
    removed :class:`_IndexNotUpdated`. Returns the bytes rewritten."""
    flags_error = None
    try:
        store.mark_deleted("private", rows)  # 1. intent (sync_ledger never re-adds a flagged or pending row)
    except StoreError as exc:  # a corrupt chunk of flags: the request is recorded (erase-pending) all the same,
        flags_error = exc      # and the ledger's tombstones are written below (review 57, F4)
    _fault("flagged")
    if tombstone is not None:
        tombstone()  # 2. the commit point: never a candidate again
        _fault("ledger-committed")
    if flags_error is not None:
        raise _RowsNotOverwritten(str(flags_error))
    try:
        written = store.erase_rows("private", rows)  # 3. physical erasure
    except StoreError as exc:  # only this step's: an index that cannot be read (step 4) is not a store chunk
        raise _RowsNotOverwritten(str(exc)) from None  # (review 56, F4)
    _fault("erased")
    hook = _index_hook("remove_rows")
    if hook is not None:
        try:
            hook(store, rows)  # 4. candidate indexes (one that cannot be updated is removed: review 58, F3)
        except Exception as exc:  # noqa: BLE001 - review 56, F4: not a store chunk; the rows are overwritten already;
            # review 57, F8: a corrupt index chunk is zarr's ValueError ("Internal error" before)
            what = str(exc) if isinstance(exc, StoreError) else f"{store.path}: the candidate index cannot be read " \
                f"or written ({type(exc).__name__}: a corrupt index file?)."
            raise _IndexNotUpdated(
                f"{what} The records are erased (their rows overwritten, never selected again), but the candidate "
                "index could not be updated; `indknn delete` (any ids) tries again") from None
    return written


def roll_forward_pending(store_path, ledger: BudgetLedger, *, lock_timeout: float = 60.0) -> int:
    """Serving and `index`: finish an erasure recorded while the ledger was unreadable, before anything else.

    The caller holds the ledger lock and the ledger-writer lock; the store lock is taken here (the same
    order as `delete`). The pending rows get their tombstones first, so a record id re-added since then
    joins its old spent (no refund) instead of being refused as "already active" (the audit's D2). Rows of an
    erasure recorded without the store's lease (:mod:`.deletion_deferred`) are overwritten when the lease is free
    at once; otherwise they wait (never candidates meanwhile) and the command goes on.
    """
    current = FeatureStore.open(store_path, mode="r")
    if current.erase_pending_rows("private").size == 0:
        if not deletion_deferred.rows(ledger, current).size:
            return 0
        store = FeatureStore.open(store_path, mode="a")
        try:
            with store.write_lock(timeout=0):
                return complete_pending(store, ledger)
        except LockTimeoutError as exc:
            log.info("an erasure recorded earlier waits for the store's writer lease: %s", exc)
            return 0
    store = FeatureStore.open(store_path, mode="a")
    with store.write_lock(timeout=lock_timeout):
        return complete_pending(store, ledger)


def complete_pending(store: FeatureStore, ledger: BudgetLedger | None) -> int:
    """Roll forward a deletion that was interrupted (rows in ``erase_pending``): the same steps as a request
    (:func:`_erase_steps`), the tombstones found by the ledger's own ``row`` column. Caller holds both locks. A chunk
    that cannot be read leaves the rows pending and raises StoreError (the tombstones written first). Rows the ledger
    recorded without the store's writer lease (:func:`deletion_deferred.rows`) are rolled forward with them."""
    deferred = deletion_deferred.rows(ledger, store)
    if not store.group("private").attrs.get(PENDING_ATTR) and not deferred.size:
        return 0
    n = store.n_rows("private")
    pending = np.union1d(store.erase_pending_rows("private"), deferred)
    if deferred.size:
        set_pending(store, pending)  # the store's own record of the intent first, as for a request
    if pending.size:
        def tombstone() -> None:
            if ledger is not None:
                li = ledger.store_row_map(n)[pending]
                ledger.delete_records(li[li >= 0], erased_rows={"store_uuid": store.uuid, "rows": pending})

        try:
            _erase_steps(store, pending, tombstone=tombstone)
        except (_RowsNotOverwritten, _IndexNotUpdated) as exc:  # an earlier erasure stays pending (review 57, F3)
            raise StoreError(f"{exc} (an earlier erasure, of {count(int(pending.size), 'row')})") from None
    set_pending(store, np.empty(0, np.int64))
    return int(pending.size)


def _compact(store: FeatureStore, ledger: BudgetLedger | None) -> dict:
    """The compaction (deletion_compact.compact) with this module's test hooks, read at call time."""
    return _compact_store(store, ledger, fault=_fault, use_exchange=USE_RENAME_EXCHANGE, index_hook=_index_hook)
