"""An erasure when the ledger cannot be read (issue 16 §3): the store alone names the rows, the request is
recorded in the store's ``erase_pending`` rows, and the next ``indknn delete`` that reads the ledger writes the
tombstones. Also the store's pending list itself (:func:`set_pending`), which every erasure writes first.

The erasure's steps (``erase``: :func:`deletion._erase_steps`, with its test hooks) are passed in by :mod:`deletion`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from . import ledger_integrity as integrity
from .deletion_compact import LedgerUnreadable as _LedgerUnreadable
from .deletion_plan import DeleteResult, _enforce_strict, _plan
from .errors import LedgerError, StorageError
from .fsio import fsync_path
from .ledger import BudgetLedger
from .store import ERASE_PENDING_ATTR, GROUP_OF_ROLE, FeatureStore
from .wording import count


class RowsNotOverwritten(Exception):
    """Step 1 or 3 of an erasure met a chunk it cannot read (corrupt): the erasure is recorded, not finished."""


class IndexNotUpdated(Exception):
    """Step 4 (the candidate index) failed after the rows were overwritten."""


def set_pending(store: FeatureStore, rows: np.ndarray) -> None:
    g = store.group("private")
    g.attrs.update({ERASE_PENDING_ATTR: [int(r) for r in rows]})
    fsync_path(store.path / GROUP_OF_ROLE["private"] / "zarr.json")
    fsync_path(store.path / GROUP_OF_ROLE["private"])


def refuse_missing_bound_ledger(store: FeatureStore, ledger_path: Path) -> None:
    """No ledger at ``ledger_path``, but the store is bound to one (``--ledger`` forgotten or mistyped, or the
    ledger lost): the erasure goes ahead as with an unreadable ledger, its rows kept in ``erase_pending`` so
    the next command that reads the bound ledger writes their tombstones (UX review 7, finding 1: the rows
    were erased with no tombstone and no pending request, so `account` showed the record active and
    compaction was blocked for good)."""
    try:
        integrity.refuse_second_ledger(store, ledger_path)  # the store is bound, or shows it was
    except LedgerError as exc:
        raise _LedgerUnreadable(exc) from None


def open_readable(ledger_path: Path, store: FeatureStore) -> BudgetLedger | None:
    """The store's ledger (None when there is none); _LedgerUnreadable when it exists but cannot be read.

    A readable ledger of *another* store raises LedgerError (a wrong pairing, not damage); with ids to erase the
    caller then erases from the store alone, as for a damaged ledger (review 32).
    """
    if not BudgetLedger.exists(ledger_path):
        return None
    try:
        ledger = BudgetLedger.open(ledger_path)
    except LedgerError as exc:
        raise _LedgerUnreadable(exc) from None
    if ledger.meta["store_uuid"] != store.uuid:
        return BudgetLedger.open_for(ledger_path, store)  # raises with the right message
    return ledger


def erase_without_ledger(store: FeatureStore, record_ids: list[str], user_ids: list[str], *, strict: bool,
                         compact: bool, reason: str, erase: Callable[[FeatureStore, np.ndarray], int]) -> DeleteResult:
    """Issue 16 §3: an erasure request is never blocked by a damaged ledger. Caller holds both locks.

    The store alone names the rows (live rows whose record or user id matches; ids already tombstoned
    cannot be told from unknown ones). The rows join ``erase_pending`` (the request is recorded: serving
    never selects them again), are flagged deleted and physically erased. ``erase_pending`` is *kept*:
    the next ``indknn delete`` that can read the ledger writes their tombstones (:func:`deletion.complete_pending`
    maps the rows to ledger records by the ledger's own ``row`` column) and only then clears it.
    Compaction needs the ledger and is skipped.
    """
    plan = _plan(store, None, record_ids, user_ids)
    _enforce_strict(plan, strict)
    earlier = np.setdiff1d(store.erase_pending_rows("private"), plan.rows).astype(np.int64)
    rows = np.union1d(earlier, plan.rows).astype(np.int64)
    written, stuck = 0, None
    if rows.size:
        set_pending(store, rows)  # 1. the request is recorded before anything else changes
        # This request first, then an earlier unfinished one: a chunk of the earlier rows that cannot be read stops
        # only them (review 58, F2: it stopped every later erasure, exit 2, with this request's rows not overwritten)
        for part, own in ((plan.rows, True), (earlier, False)):
            if not part.size:
                continue
            try:
                written += erase(store, part)  # deletion._erase_steps, without a ledger's tombstone
            except RowsNotOverwritten as exc:
                if own:
                    raise StorageError(f"{exc} The erasure was recorded but not finished: the records are never "
                                       "selected again (the store's erase-pending rows are written); their rows "
                                       "could not be overwritten. Once that chunk reads again (its file restored "
                                       "from a backup of this store taken since its last compaction: "
                                       "docs/RELIABILITY.md), `indknn delete` (any "
                                       "ids) finishes the erasure") from None
                stuck = exc
            except IndexNotUpdated as exc:
                raise StorageError(str(exc)) from None
    if stuck is not None:
        raise StorageError(
            f"{stuck} This request's erasure went on ({count(len(plan.record_ids), 'record')}, the ledger unread: "
            f"{reason}); an earlier one of {count(int(earlier.size), 'row')} is recorded but not finished (never "
            "selected again): once that chunk reads again (its file restored from a backup of this store taken since "
            "its last compaction), `indknn "
            "delete` finishes it")
    return DeleteResult(records_erased=len(plan.record_ids), users=plan.users, ids_not_found=plan.not_found,
                        users_not_found=plan.users_not_found, already_deleted=plan.already_deleted,
                        users_already_deleted=plan.users_already_deleted,
                        record_ids=plan.record_ids, bytes_rewritten=written, dry_run=False,
                        compaction={"skipped": "the ledger cannot be read"} if compact else None,
                        ledger_unreadable=reason, tombstones_pending=int(rows.size))
