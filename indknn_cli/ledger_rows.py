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


def compare_rows(state, *, ids: np.ndarray, deleted_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every record the ledger has not deleted: (its ledger index, whether its store row is missing or holds
    another id, whether that row is flagged deleted). ``ids`` and ``deleted_rows``: the store's private columns."""
    li = np.flatnonzero(~state.deleted)
    rows = state.row[li]
    inside = (rows >= 0) & (rows < len(ids))
    other = ~inside
    flagged = np.zeros(li.size, bool)
    r = rows[inside]
    other[inside] = np.asarray(ids, dtype=object)[r] != np.asarray(state.record_id[li[inside]]).astype(object)
    flagged[inside] = np.asarray(deleted_rows, dtype=bool)[r]
    return li, other, flagged


def check_rows_hold_records(ledger, store) -> int:
    """Refuse (LedgerIntegrityError, naming no id) when a live ledger record's store row holds another record id
    or is gone; returns the number of live records compared. Rows flagged deleted or pending erasure are skipped
    (an erasure blanks the id before the next command writes the tombstone)."""
    s = ledger.state
    live = np.flatnonzero((s.row >= 0) & ~s.deleted)
    if live.size == 0:
        return 0
    li, other, flagged = compare_rows(s, ids=store.read("private", "record_id"),
                                      deleted_rows=store.read("private", "deleted"))
    skip = flagged | (s.row[li] < 0) | np.isin(s.row[li], store.erase_pending_rows("private"))
    bad = int((other & ~skip).sum())
    if bad:
        _unless_compacted_meanwhile(store)
        raise LedgerIntegrityError(
            f"{store.path}: {count(bad, 'record')} of the ledger are not at the store rows where it charges them "
            "(the store was restored from an older copy, or its private rows were rewritten outside indknn): "
            "serving would charge one record's spending to another; refusing, nothing charged. Run `indknn "
            "repair --ledger LEDGER --store STORE`: it retires every record at its budget (no refund) and "
            "brings the store's rows in as they are now")
    return int(live.size)


def _unless_compacted_meanwhile(store) -> None:
    """A reader without the locks (``account --verify``) opened the store before a compaction swapped it and read its
    rows after: the rows are the new store's, not an older copy's. ConcurrentChangeError ("run again") then, not
    the advice to repair, which would retire every record (review 27, F7)."""
    from .errors import ConcurrentChangeError
    from .store import FeatureStore

    try:
        now = FeatureStore.open(store.path, mode="r").uuid
    except Exception:  # noqa: BLE001 - unreadable now: the refusal below stands
        return
    if now != store.uuid:
        raise ConcurrentChangeError(f"{store.path}: the store was compacted while it was read; run again")


def check_erased_owners(ledger, store) -> int:
    """Refuse (LedgerIntegrityError, naming no id) when the ledger holds a record id under another user than the one
    the store's erasure log erased it for: a ``repair`` before audit 7 could hand an erased user's tombstone (and
    its spent) to another user, and a compaction since leaves no event row behind to show it (review 15, 2).
    Returns the number of erasure-log entries compared."""
    owner = {str(r): str(u or "") for r, u in zip(ledger.state.record_id, ledger.state.user_id)}
    logged = [(str(r), str(u or "")) for r, u in store.erased_ids() if u]
    moved = {r for r, u in logged if owner.get(r) not in (None, "", u)}
    if moved:
        raise LedgerIntegrityError(
            f"{store.path}: {count(len(moved), 'record id')} the store erased for one user the ledger now holds under "
            "another (a `repair` by a version before audit 7 moved the tombstone): the first user's later records "
            "do not start at what they had spent. Not repairable automatically; see AUDIT_FINDINGS_7.md (review 15, "
            "2) and compare the store's erased-ids.jsonl with `indknn account --export`")
    return len(logged)


def check_erased_rows_blank(store, ledger=None) -> int:
    """Refuse (StoreError, naming no id) when a private row the store erased holds data again: a chunk file restored
    from a backup older than the erasure (the advice for a corrupt chunk) brings its vectors, labels, ids and content
    key back, and only the rows still pending were overwritten again (review 67, F2); with the flags chunk restored
    too, the row is not even flagged (review 68, F2: the erased-ids log names its row). Rows pending erasure are
    skipped (the next command overwrites them). Read chunk by chunk (a corrupt one is the usual StoreError). Returns
    the number of erased rows checked."""
    from . import store_erased_ids
    from .errors import StoreError
    from .record_keys import KEY_ARRAY
    from .store_layout import read_chunks

    n = store.n_rows("private")
    flagged = np.flatnonzero(store.read("private", "deleted").astype(bool))
    logged = np.fromiter((r for r in store_erased_ids.rows_of(store.path, store.uuid) if r < n), np.int64)
    if ledger is not None:  # and the rows the ledger's erasures overwrote (review 72, F1: the log lost)
        in_led = store_erased_ids.in_ledger(ledger, store)
        logged = np.union1d(logged, in_led[in_led < n])
    # flagged rows, and rows the log names whatever their flag (review 68, F2; review 69, F3): not those pending
    rows = np.setdiff1d(np.union1d(flagged, logged), store.erase_pending_rows("private"))
    g = store.group("private")
    names = [x for x in ("labels", "record_id", "user_id", KEY_ARRAY) if x in g]
    bad = 0
    for lo in range(0, int(rows.size), ERASED_CHECK_ROWS):
        part = rows[lo:lo + ERASED_CHECK_ROWS]
        held = np.abs(read_chunks(store.path, "private", "features", lambda: np.asarray(
            g["features"].oindex[part, :]))).sum(axis=1) > 0
        for name in names:
            vals = read_chunks(store.path, "private", name, lambda name=name: np.asarray(g[name].oindex[part]))
            held |= (vals != -1) if name == "labels" else np.array([str(v) != "" for v in vals], dtype=bool)
        bad += int(held.sum())
    if bad:
        raise StoreError(
            f"{store.path}: private rows the store has erased hold data again ({count(bad, 'row')}; a chunk file "
            "restored from a backup taken before their erasure?): serving never selects them, but their data is on "
            "disk. `indknn delete --record ID` with their ids (the store's erased-ids.jsonl) erases them again; "
            "`indknn delete --compact` removes the flagged ones; or restore the chunk from a backup taken after the "
            "erasure")
    return int(rows.size)


#: Erased rows read per step by :func:`check_erased_rows_blank` (bounds its memory: 65,536 × d floats).
ERASED_CHECK_ROWS = 1 << 16
