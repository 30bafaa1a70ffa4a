"""An erasure recorded while the store's writer lease is held by another machine (review 67, F1).

A store on object storage is written only under its writer lease (:mod:`.store_lease`). One left in the bucket by a
machine that is gone (a crashed coordinator) made ``indknn delete`` exit 1 with nothing recorded, while
``serve-queries`` of a query batch embedded in advance, which needs only the ledger's locks, went on selecting and
charging the person who asked to be erased. The ledger is local, and its ledger-writer lease is another object, so
``delete`` now records the request there when the store's lease cannot be had (:func:`record`): one ``delete`` event
with the records' tombstones and, in its info, the store rows still to overwrite (``rows_to_erase``, carried by the
ledger state and its snapshots). From that commit on the records are never candidates (the ledger's tombstones) and
their rows are never brought back into the ledger (:func:`rows`, read by ``sync_ledger`` and ``serve-queries``); the
command then exits 1 saying so. The store is not written at all.

The next writer that holds the store's lease and the ledger's locks overwrites those rows: ``indknn delete`` (any
ids, or an empty ``--ids-file``) through :func:`indknn_cli.deletion.complete_pending`, and ``serve-queries`` /
``index`` through :func:`indknn_cli.deletion.roll_forward_pending` when the lease is free at once (the same steps as
any unfinished erasure: flag, overwrite, candidate index). A row flagged deleted in the store is no longer pending;
after a compaction (a new store uuid) the entry no longer applies.
"""

from __future__ import annotations

import numpy as np

from . import ledger_integrity as integrity
from .deletion_plan import _enforce_strict, _plan
from .errors import (BadInputError, ConcurrentChangeError, LedgerError, LedgerIntegrityError, LockTimeoutError,
                     StoreError)
from .ledger import BudgetLedger
from .store import FeatureStore
from .wording import count


def rows(ledger: BudgetLedger | None, store: FeatureStore) -> np.ndarray:
    """Store rows of ``store`` whose erasure the ledger recorded without the store's lease, not yet flagged deleted."""
    e = getattr(ledger.state, "rows_to_erase", None) if ledger is not None else None
    if not isinstance(e, dict) or e.get("store_uuid") != store.uuid or not e.get("rows"):
        return np.empty(0, np.int64)
    n = store.n_rows("private")
    r = np.asarray(sorted({int(x) for x in e["rows"] if 0 <= int(x) < n}), np.int64)
    if r.size:
        r = r[~store.read("private", "deleted").astype(bool)[r]]
    return r


def pending_in(ledger_path, store: FeatureStore) -> bool:
    """Whether the ledger at ``ledger_path`` (read without its lock) names rows of ``store`` still to erase."""
    try:
        return bool(rows(BudgetLedger.open_for(ledger_path, store), store).size)
    except (LedgerError, LedgerIntegrityError, BadInputError):
        return False  # no ledger, or one damaged: nothing in it can be finished (repair carries it: review 70, F1)
    except Exception:  # noqa: BLE001 - a ledger mid-commit, a passing read error: the locked path decides
        return True  # (review 70, F4)


def record(store_path, ledger_path, record_ids, user_ids, *, strict: bool, lease_error: LockTimeoutError):
    """Under the ledger's locks (the caller's), the store's writer lease refused: commit the request's tombstones and
    the rows still to erase, then raise LockTimeoutError (exit 1) saying so. When the ledger cannot take the request
    (unreadable, rolled back, another store's), the lease's refusal is raised as it was: nothing was written."""
    store = FeatureStore.open(store_path, mode="r")
    try:
        ledger = BudgetLedger.open_for(ledger_path, store)
        integrity.attach(store, ledger, ledger_path, bind=False)
    except (LedgerError, LedgerIntegrityError, ConcurrentChangeError, StoreError) as exc:
        raise LockTimeoutError(f"{lease_error} (the request could not be recorded in the ledger either: {exc})") \
            from None
    plan = _plan(store, ledger, record_ids, user_ids, erased_rows=rows(ledger, store))  # asked again: already deleted
    _enforce_strict(plan, strict)
    todo = np.setdiff1d(plan.rows, np.flatnonzero(store.read("private", "deleted").astype(bool)))
    ledger.delete_records(plan.ledger_idx, rows_to_erase={"store_uuid": store.uuid, "rows": [int(r) for r in todo]}
                          if todo.size else None,  # the rows waiting join erased_rows once overwritten
                          erased_rows={"store_uuid": store.uuid, "rows": np.setdiff1d(plan.rows, todo)})
    waits = str(lease_error).replace("; nothing was written. Run again when it is done.", ".")
    raise LockTimeoutError(
        f"The erasure request is recorded in the ledger ({count(len(plan.record_ids), 'record')}; never selected "
        f"again), but the physical erasure of {count(int(todo.size), 'store row')} waits for the store's writer "
        f"lease: {waits.rstrip('.')}. The next `indknn delete` (any ids) that gets the lease finishes it (as does a "
        "serve-queries or index run that finds the lease free)")
