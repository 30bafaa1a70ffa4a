"""The ledger's records against the store's rows: every live record's row must still hold that record.

The ledger finds a record's vector by its store row number. This module checks, before `index` or
`serve-queries` brings new rows into the ledger (and for `account --verify`), that those rows still hold the
records the ledger charges there (audit 6, F1: a store restored from an older copy charged one person's
spending to another). Used by :mod:`indknn_cli.indexing`, :mod:`indknn_cli.ledger_repair` and
:mod:`indknn_cli.ledger_verify`.
"""

from __future__ import annotations

import numpy as np

from .errors import LedgerIntegrityError
from .ledger_integrity import read_mark
from .wording import count


def check_rows_hold_records(ledger, store, *, n_rows: int, deleted_rows: np.ndarray, every_row: bool = False) -> int:
    """Refuse (LedgerIntegrityError) when a live ledger record's store row holds another record, or is gone.

    The ledger finds a record's vector by its row number. A store restored from an older copy while the ledger
    stayed current brought back its own older high-water mark, so the rollback check passed; the rows appended
    after the copy, embedded again in another order, were then charged against other records' budgets, and one
    person paid up to 2·B (audit 6, F1). The mark records how many rows the ledger mapped when it was written
    (``rows``): those rows were in the store then, so any copy of the store taken since holds them as well,
    and only the rows from there on are compared, record id against record id: none on a serve of a store
    the ledger already knew, and every row of a store whose mark predates the field. Rows flagged deleted or
    pending erasure are never candidates and are skipped (an erasure blanks the id). The message names no id.
    ``every_row`` (``account --verify``) compares every row whatever the mark says. Returns the rows compared.
    """
    mark = None if every_row else read_mark(store.path)
    start = mark.get("rows") if isinstance(mark, dict) and mark.get("ledger_uuid") == ledger.meta["ledger_uuid"] else 0
    start = start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else 0
    s = ledger.state
    live = np.flatnonzero((s.row >= start) & ~s.deleted)
    if live.size == 0:
        return 0
    rows = s.row[live]
    inside = rows < n_rows
    bad = int((~inside).sum())
    r_in, li_in = rows[inside], live[inside]
    if r_in.size:
        lo = int(r_in.min())
        ids = np.asarray(store.read("private", "record_id", lo, n_rows)).astype(object)[r_in - lo]
        skip = deleted_rows[r_in] | np.isin(r_in, store.erase_pending_rows("private"))
        bad += int(((ids != np.asarray(s.record_id[li_in]).astype(object)) & ~skip).sum())
    if bad:
        raise LedgerIntegrityError(
            f"{store.path}: {count(bad, 'record')} of the ledger are not at the store rows where it charges them "
            "(the store was restored from an older copy, or its private rows were rewritten outside indknn): "
            "serving would charge one record's spending to another; refusing, nothing charged. Run `indknn "
            "repair --ledger LEDGER --store STORE`: it retires every record at its budget (no refund) and "
            "brings the store's rows in as they are now")
    return int(live.size)
