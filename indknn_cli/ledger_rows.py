"""The ledger's records against the store's rows: every live record's row must still hold that record's id.

A reviewer's and `repair`'s check (``account --verify``; audit 6): it reads every private record id, so serving
does not run it. What keeps serving from charging rows of a store restored from an older copy is the store's
version log (:mod:`indknn_cli.store_versions`), which also covers ids that ``embed`` generates from row positions
(a re-embedded store repeats them, so comparing ids cannot tell).
"""

from __future__ import annotations

import numpy as np

from .errors import LedgerIntegrityError
from .wording import count


def check_rows_hold_records(ledger, store) -> int:
    """Refuse (LedgerIntegrityError, naming no id) when a live ledger record's store row holds another record id
    or is gone; returns the number of live records compared. Rows flagged deleted or pending erasure are skipped
    (an erasure blanks the id before the next command writes the tombstone)."""
    n_rows = store.n_rows("private")
    s = ledger.state
    live = np.flatnonzero((s.row >= 0) & ~s.deleted)
    if live.size == 0:
        return 0
    rows = s.row[live]
    inside = rows < n_rows
    bad = int((~inside).sum())
    r_in, li_in = rows[inside], live[inside]
    if r_in.size:
        ids = np.asarray(store.read("private", "record_id")).astype(object)[r_in]
        skip = (np.asarray(store.read("private", "deleted")).astype(bool)[r_in]
                | np.isin(r_in, store.erase_pending_rows("private")))
        bad += int(((ids != np.asarray(s.record_id[li_in]).astype(object)) & ~skip).sum())
    if bad:
        raise LedgerIntegrityError(
            f"{store.path}: {count(bad, 'record')} of the ledger are not at the store rows where it charges them "
            "(the store was restored from an older copy, or its private rows were rewritten outside indknn): "
            "serving would charge one record's spending to another; refusing, nothing charged. Run `indknn "
            "repair --ledger LEDGER --store STORE`: it retires every record at its budget (no refund) and "
            "brings the store's rows in as they are now")
    return int(live.size)
