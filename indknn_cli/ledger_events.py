"""How one event's rows change a ledger's state (docs/FORMAT.md, "Events").

Pure functions over :class:`~.ledger_state.LedgerState` and an event's Arrow table, shared by writing an
event (:meth:`.ledger.BudgetLedger.commit_event`) and replaying it (:meth:`.ledger.BudgetLedger.open`), so
that a committed event and its replay give the same state:

- :func:`check_record_indices` refuses charge or delete rows that name no record, and add rows that give an
  existing record to another user (before an event is written, and again when one is replayed): a null index is
  never applied to another record, and a tombstone's spent never leaves its user (audit 7, F1);
- :func:`apply_table` replays an event: spent only grows, tombstones are kept, answers are appended;
- :func:`stats_after_serve` gives the history figures of the state a serve event leads to, recorded in
  the event (``state_after``) so that replay needs no O(N) median per event.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import ledger_history
from .errors import LedgerError, LedgerIntegrityError
from .id_text import canonical
from .ledger_state import LedgerState, PrivacyParams

__all__ = ["KINDS", "apply_table", "check_record_indices", "kind_codes", "kind_mask", "ledger_indices",
           "stats_after_serve"]


#: The row kinds of an event table (:func:`kind_codes` numbers them in this order).
KINDS = ("add", "charge", "delete", "answer")


def kind_codes(kinds) -> np.ndarray:
    """An event table's ``kind`` column (or the column itself) as int8 codes into KINDS, −1 for null or any other
    value: one pass of pyarrow over the strings, then every kind's mask is a comparison of small integers (a serve
    event of a million rows compared its strings seven times, a fifth of its commit; issue 21)."""
    col = kinds.column("kind") if isinstance(kinds, pa.Table) else kinds
    if not pa.types.is_string(col.type):  # large strings, a dictionary, an all-null column
        col = col.cast(pa.string())
    codes = pc.index_in(col, value_set=pa.array(KINDS, pa.string()))
    return np.asarray(pc.fill_null(codes, -1).to_numpy(zero_copy_only=False), dtype=np.int8)


def kind_mask(table: pa.Table, kind: str, codes: np.ndarray | None = None) -> np.ndarray:
    """Rows of an event table of this kind (``codes``: the table's :func:`kind_codes`, when already taken)."""
    return (kind_codes(table) if codes is None else codes) == KINDS.index(kind)


def ledger_indices(table: pa.Table) -> np.ndarray:
    """An event table's ledger_index column as int64, −1 where null."""
    return np.asarray(pc.fill_null(table.column("ledger_index"), -1).to_numpy(zero_copy_only=False), np.int64)


def check_record_indices(state: LedgerState, table: pa.Table, *, where: Path) -> None:
    """Refuse (LedgerError) charge or delete rows whose ledger index is null or names no record, and add rows
    that give an existing record to another user: before an event is written and when one is replayed."""
    idx = ledger_indices(table)
    codes = kind_codes(table)
    adds = kind_mask(table, "add", codes)
    known = max(len(state), int(idx[adds].max()) + 1 if adds.any() else 0)  # records this event adds too
    # An add row never gives an existing record to another user: that would move its spent (a tombstone's
    # included) away from the person it belongs to (SPEC §8; audit 7, F1).
    old = adds & (idx >= 0) & (idx < len(state))
    if old.any():
        li = idx[old].astype(np.int64)
        users = np.asarray(table.column("user_id").to_pylist(), dtype=object)[old] if "user_id" in \
            table.column_names else np.full(int(old.sum()), None, object)
        was = state.user_id[li]
        # compared as NFC (id_text): a user id in another Unicode spelling is the same person (review 57, F1: a ledger
        # from before NFC, its user back in NFC, was refused at every serve, and repair did not help)
        moved = [k for k in range(li.size) if was[k] and canonical(was[k]) != canonical(users[k])]
        if moved:
            raise LedgerIntegrityError(
                f"{where}: an add row gives record {int(li[moved[0]])} of this ledger to another user; nothing "
                "applied. Run `indknn repair --ledger LEDGER --store STORE`")
    for name in ("charge", "delete"):
        bad = kind_mask(table, name, codes) & ((idx < 0) | (idx >= known))
        if bad.any():
            first = int(idx[bad][0])
            raise LedgerError(f"{where}: a {name} row names no record of this ledger "
                              f"(ledger_index {None if first < 0 else first}); nothing applied")


def _grow(s: LedgerState, n_new: int) -> None:
    """Room for ``n_new`` records past the last one (filled in by their add rows)."""
    s.record_id = np.concatenate([s.record_id, np.empty(n_new, object)])
    s.user_id = np.concatenate([s.user_id, np.empty(n_new, object)])
    s.row = np.concatenate([s.row, np.full(n_new, -1, np.int64)])
    s.budget = np.concatenate([s.budget, np.zeros(n_new)])
    s.spent = np.concatenate([s.spent, np.zeros(n_new)])
    s.times_selected = np.concatenate([s.times_selected, np.zeros(n_new, np.int64)])
    s.deleted = np.concatenate([s.deleted, np.zeros(n_new, bool)])
    s.deleted_at = np.concatenate([s.deleted_at, np.full(n_new, np.nan)])
    s.last_change = np.concatenate([s.last_change, np.zeros(n_new)])


def apply_table(s: LedgerState, table: pa.Table, info: dict, *, c1: float) -> None:
    """Replay one event's rows into ``s`` (rows checked beforehand by :func:`check_record_indices`)."""
    t = info.get("time", time.time())
    idx = ledger_indices(table)
    codes = kind_codes(table)
    add = kind_mask(table, "add", codes)
    if add.any():
        sub = table.filter(pa.array(add))
        li = sub.column("ledger_index").to_numpy()
        n_new = int(li.max()) + 1 - len(s) if len(li) else 0
        if n_new > 0:
            _grow(s, n_new)
        s.record_id[li] = sub.column("record_id").to_pylist()
        s.user_id[li] = sub.column("user_id").to_pylist()
        s.row[li] = sub.column("row").to_numpy()
        s.budget[li] = sub.column("budget").to_numpy()
        s.spent[li] = np.maximum(s.spent[li], sub.column("spent_after").to_numpy())
        s.deleted[li] = False
        s.last_change[li] = t
    charge = kind_mask(table, "charge", codes)
    if charge.any():
        li = idx[charge].astype(np.int64)
        after = table.column("spent_after").to_numpy(zero_copy_only=False)[charge]
        sel = table.column("selected").to_numpy(zero_copy_only=False)[charge].astype(np.int64)
        s.spent[li] = np.maximum(s.spent[li], after)  # spent only grows
        np.add.at(s.times_selected, li, sel)
        s.last_change[li] = t
    dele = kind_mask(table, "delete", codes)
    if dele.any():
        li = idx[dele].astype(np.int64)
        after = table.column("spent_after").to_numpy(zero_copy_only=False)[dele]
        s.spent[li] = np.maximum(s.spent[li], after)
        s.deleted[li] = True
        s.row[li] = -1
        s.deleted_at[li] = t
        s.last_change[li] = t
    ans = kind_mask(table, "answer", codes)
    n_answers = int(ans.sum())
    if n_answers:
        s.extend_answers(table.filter(pa.array(ans)))
    if isinstance(info.get("store_seen"), dict):  # the store's version at this commit (store_versions.py)
        s.store_seen = info["store_seen"]
    erase = info.get("rows_to_erase")
    if isinstance(erase, dict) and erase.get("rows"):  # an erasure whose store rows wait for the writer lease
        merge_rows(s, "rows_to_erase", erase)
    erased = info.get("erased_rows")
    if info.get("type") == "delete" and "erased_rows" not in info and dele.any() \
            and isinstance(info.get("store_seen"), dict):
        # delete events written before the list: the tombstones' former rows, in the numbering the commit recorded,
        # but those of a deferred erasure (still to overwrite: they join once overwritten; review 74, F2)
        waiting = set((info.get("rows_to_erase") or {}).get("rows") or [])
        erased = {"store_uuid": info["store_seen"].get("store_uuid"),
                  "rows": [int(r) for r in table.column("row").to_numpy(zero_copy_only=False)[dele]
                           if r >= 0 and int(r) not in waiting]}
    if isinstance(erased, dict) and erased.get("store_uuid") and erased.get("rows"):
        merge_rows(s, "erased_rows", erased)
    if info.get("type") == "repair":
        s.answers_not_held += int(info.get("answers_not_recovered") or 0)
        s.seeded_not_held += int(info.get("seeded_not_recovered") or 0)
        # the lists as they hold for the store repair accepted (review 74, F1/F5: a store restored from a shorter
        # copy appends new people at row numbers the lists named: they were never admitted, or erased unasked)
        for name in ("erased_rows", "rows_to_erase"):
            if isinstance(info.get(f"{name}_reset"), dict):
                setattr(s, name, info[f"{name}_reset"])
    if info.get("type") == "serve":
        s.add_batch(info.get("batch_id"))
        stats = info.get("state_after")
        if not ledger_history.has_stats(stats):
            stats = ledger_history.history_stats(s, c1)  # events written before state_after
        s.history.append(ledger_history.history_entry(info, stats, time=t, answers=n_answers))


def merge_rows(s: LedgerState, name: str, add: dict) -> None:
    """Union ``add`` ({"store_uuid", "rows"}) into the state's ``name`` list of the same store uuid; another uuid (a
    compaction renumbered the rows) replaces it."""
    cur, uuid = getattr(s, name), add.get("store_uuid")
    cache = getattr(s, "_row_sets", None)
    if cache is None:
        cache = {}
        setattr(s, "_row_sets", cache)
    held = cache.get(name)
    if held is None or held[0] is not cur or cur.get("store_uuid") != uuid:
        # a list of this state's own and its set: a merge costs its new rows only (review 74, F6: re-sorting the
        # whole list per event made replay quadratic in delete events)
        same = isinstance(cur, dict) and cur.get("store_uuid") == uuid
        cur = {"store_uuid": uuid, "rows": [int(r) for r in cur.get("rows", [])] if same else []}
        setattr(s, name, cur)
        held = cache[name] = (cur, set(cur["rows"]))
    for r in add["rows"]:
        if (r := int(r)) not in held[1]:
            held[1].add(r)
            cur["rows"].append(r)


def stats_after_serve(s: LedgerState, columns: dict, params: PrivacyParams) -> dict:
    """The history figures of the state a serve event leads to, computed before it is written.

    ``columns``: the event's pyarrow arrays. Equal to what replay computed before ``state_after`` existed
    (a serve event only raises spent and counts selections); ``{}`` for an event with other row kinds.
    """
    codes = kind_codes(columns["kind"])
    charge = codes == KINDS.index("charge")
    if not np.all(charge | (codes == KINDS.index("answer"))):
        return {}
    li = ledger_indices(pa.table({"ledger_index": columns["ledger_index"]}))[charge]
    after = columns["spent_after"].to_numpy(zero_copy_only=False)[charge]
    spent = s.spent.copy()
    if li.size:
        idx = np.asarray(li, dtype=np.int64)
        spent[idx] = np.maximum(spent[idx], np.asarray(after, dtype=np.float64))
    view = LedgerState(s.record_id, s.user_id, s.row, s.budget, spent, s.times_selected, s.deleted,
                       s.deleted_at, s.last_change)
    return ledger_history.with_realised(ledger_history.history_stats(view, params.c1), params)
