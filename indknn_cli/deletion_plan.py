"""Which records and store rows an erasure request names, and what `indknn delete` reports (read only).

Split out of :mod:`indknn_cli.deletion` (which executes the plan under the ledger and store locks): the plan
reads the ledger's state and the store's ids and names, for each requested record or user id, the live ledger
records to tombstone, the store rows to erase (rows not yet in the ledger included), and what was unknown or
already erased. Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from .errors import BadInputError, StoreError
from .id_text import canonical
from .ledger import BudgetLedger
from .store import FeatureStore
from .store_layout import read_chunks
from .wording import count


# -- results ---------------------------------------------------------------------
OPERATOR_ONLY_DELETE = ("operator-only: the ids, users and counts above are exact figures of the private data "
                        "(for the data holder and the people who asked for their erasure, never for query-senders)")


@dataclass
class DeleteResult:
    records_erased: int
    users: list[str]
    ids_not_found: list[str]
    users_not_found: list[str]
    already_deleted: list[str]
    record_ids: list[str]
    bytes_rewritten: int
    dry_run: bool
    pending_completed: int = 0
    compaction: dict | None = None
    ledger_unreadable: str | None = None     # the ledger could not be read: vectors erased, tombstones pending
    tombstones_pending: int = 0
    #: "incomplete: ..." when the store's bucket is versioned: the erasure is recorded and the current chunks
    #: overwritten, but earlier object versions keep the vectors (the CLI exits 1)
    physical_erasure: str | None = None
    #: users all of whose records were erased before this run (review 42: a second `delete --user U` named U nowhere)
    users_already_deleted: list[str] = field(default_factory=list)


    def as_dict(self) -> dict:
        out = {
            "records_erased": self.records_erased, "users": self.users, "ids_not_found": self.ids_not_found,
            "users_not_found": self.users_not_found, "already_deleted": self.already_deleted,
            "users_already_deleted": self.users_already_deleted,
            "record_ids": self.record_ids, "bytes_rewritten": self.bytes_rewritten, "dry_run": self.dry_run,
            "pending_completed": self.pending_completed,
        }
        if self.dry_run:  # nothing was erased; what would be is named so (review 73, F6: a script reading
            out = {"records_erased": 0, "records_to_erase": self.records_erased,  # records_erased counted it)
                   **{k: v for k, v in out.items() if k != "records_erased"}}
        if self.compaction is not None:
            out["compaction"] = self.compaction
        if self.ledger_unreadable is not None:
            out["ledger_unreadable"] = self.ledger_unreadable
            out["tombstones_pending"] = self.tombstones_pending
        if self.physical_erasure is not None:
            out["physical_erasure"] = self.physical_erasure
        out["operator_only"] = OPERATOR_ONLY_DELETE  # review 46, F8: exact ids and counts of the private data
        return out


@dataclass
class _Plan:
    ledger_idx: np.ndarray                   # live ledger records to tombstone
    rows: np.ndarray                         # store rows to erase
    record_ids: list[str]
    users: list[str]
    not_found: list[str] = field(default_factory=list)
    users_not_found: list[str] = field(default_factory=list)
    already_deleted: list[str] = field(default_factory=list)
    users_already_deleted: list[str] = field(default_factory=list)


def read_ids(lines: Iterable[str]) -> list[str]:
    """One id per line; surrounding white space stripped, blank lines skipped; a UTF-8 byte-order mark at the start
    dropped (a file saved by Excel or Notepad: its first id was "not found", its erasure silently skipped: review 40)."""
    out = []
    for i, line in enumerate(lines):
        s = (line.lstrip("\ufeff") if i == 0 else line).strip()
        if s:
            out.append(s)
    return out



def _enforce_strict(plan: _Plan, strict: bool) -> None:
    if not strict or not (plan.not_found or plan.users_not_found):
        return
    missing = [f"record {r!r}" for r in plan.not_found] + [f"user {u!r}" for u in plan.users_not_found]
    more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
    quoted = [i for i in plan.not_found + plan.users_not_found if len(i) > 1 and i[0] == i[-1] and i[0] in "\"'"]
    hint = (f"; {quoted[0]!r} is in quotes: a CSV column cut with `cut -d,` keeps them (take the ids with a CSV "
            "reader, e.g. python -c 'import csv,sys; [print(r[0]) for r in csv.reader(sys.stdin)]')"
            if quoted else "")  # review 55, F10
    raise BadInputError(f"--strict: {count(len(missing), 'unknown id')}: {', '.join(missing[:5])}{more}; "
                        f"nothing was deleted{hint}")


# -- planning (read only) ---------------------------------------------------------
def _flags(store: FeatureStore, n: int) -> np.ndarray:
    """The private rows' erased flags; a chunk of them that cannot be read (corrupt) reads as "not flagged". One
    corrupt chunk of *other* rows' flags stopped every erasure before anything was recorded (review 56, F6). Safe
    for a plan: an unflagged row outside the ledger is erased only when its own id is asked for, and erasing a row
    rewrites only the chunks that hold it (a corrupt one then ends the erasure "recorded but not finished")."""
    try:
        return store.read("private", "deleted").astype(bool) if n else np.zeros(0, bool)
    except StoreError:
        pass
    arr = store.group("private")["deleted"]
    step = int(arr.chunks[0])
    out = np.zeros(n, bool)
    for lo in range(0, n, step):
        try:
            out[lo:min(n, lo + step)] = np.asarray(arr[lo:min(n, lo + step)], dtype=bool)
        except Exception:  # noqa: BLE001 - zarr/numcodecs raise ValueError, RuntimeError... for a bad chunk
            continue
    return out


def _plan(store: FeatureStore, ledger: BudgetLedger | None, record_ids: list[str], user_ids: list[str], *,
          erased_rows: np.ndarray | None = None) -> _Plan:
    """Which ledger records and store rows the ids name. Reads only. ``erased_rows``: rows whose erasure the ledger
    already recorded, still to be overwritten (``deletion_deferred.rows``): read as erased, as the store's flags are."""
    n = store.n_rows("private")
    flagged = _flags(store, n)
    if erased_rows is not None and erased_rows.size:
        flagged = flagged.copy()
        flagged[erased_rows] = True
    row_map = ledger.store_row_map(n) if ledger is not None else np.full(n, -1, np.int64)
    # rows that are in the store but not (yet) in the ledger: erased in the store only
    unindexed = np.flatnonzero((row_map < 0) & ~flagged)
    un_ids: dict[str, list[int]] = {}
    un_users: dict[str, list[int]] = {}
    un_user_of: dict[int, str] = {}
    if unindexed.size:
        lo, hi = int(unindexed[0]), int(unindexed[-1]) + 1
        ids = store.read("private", "record_id", lo, hi)[unindexed - lo]
        users = store.read("private", "user_id", lo, hi)[unindexed - lo]
        for r, rid, uid in zip(unindexed.tolist(), ids, users):  # keyed by the NFC form (id_text: review 53, F2)
            un_ids.setdefault(canonical(rid), []).append(r)
            un_user_of[r] = str(uid)
            if str(uid):
                un_users.setdefault(canonical(uid), []).append(r)

    s = ledger.state if ledger is not None else None
    li: set[int] = set()
    rows: set[int] = set()
    plan = _Plan(np.empty(0, np.int64), np.empty(0, np.int64), [], [])
    if record_ids:
        # every spelling of an id (a store from before ids were stored in NFC may hold another form beside it)
        index_of: dict[str, list[int]] = {}
        for i, rid in enumerate(s.record_id if s is not None else []):
            index_of.setdefault(canonical(rid), []).append(i)
        for rid in record_ids:
            mine = index_of.get(rid, [])
            live = [i for i in mine if not s.deleted[i]]
            extra = un_ids.get(rid, [])
            rows.update(extra)
            li.update(live)
            if mine and not live and not extra:
                plan.already_deleted.append(rid)
            elif not mine and not extra:
                plan.not_found.append(rid)
    if user_ids:
        by_user: dict[str, list[int]] = {}
        if s is not None:
            wanted = set(user_ids)
            for i, u in enumerate(s.user_id):
                if u and (key := canonical(u)) in wanted:
                    by_user.setdefault(key, []).append(i)
        for uid in user_ids:
            mine = by_user.get(uid, [])
            extra = un_users.get(uid, [])
            if not mine and not extra:
                plan.users_not_found.append(uid)
            elif not extra and all(s.deleted[i] for i in mine):
                plan.users_already_deleted.append(uid)
            li.update(i for i in mine if not s.deleted[i])
            rows.update(extra)

    plan.ledger_idx = np.array(sorted(li), dtype=np.int64)
    led_rows = s.row[plan.ledger_idx] if plan.ledger_idx.size else np.empty(0, np.int64)
    rows.update(int(r) for r in led_rows if r >= 0)
    plan.rows = np.array(sorted(rows), dtype=np.int64)
    # the ledger and the store must agree on which record a row holds before anything is erased
    check = led_rows >= 0
    if check.any():
        got = read_chunks(store.path, "private", "record_id", lambda: np.asarray(
            store.group("private")["record_id"].oindex[led_rows[check]])).astype(object)
        want = s.record_id[plan.ledger_idx[check]]
        bad = np.flatnonzero(got != want)
        if bad.size:
            raise StoreError(f"{store.path}: store row {int(led_rows[check][bad[0]])} holds record "
                             f"{got[bad[0]]!r}, the ledger expects {want[bad[0]]!r}; nothing was deleted")
    names = [str(x) for x in s.record_id[plan.ledger_idx]] if plan.ledger_idx.size else []
    led_row_set = {int(r) for r in led_rows}
    un_rows = [r for r in plan.rows.tolist() if r not in led_row_set]
    if un_rows:
        rid_of = {r: rid for rid, rs in un_ids.items() for r in rs}
        names += [rid_of[r] for r in un_rows]
    plan.record_ids = names
    users = {str(u) for u in (s.user_id[plan.ledger_idx] if plan.ledger_idx.size else []) if u}
    users.update(un_user_of[r] for r in un_rows if un_user_of.get(r))
    plan.users = sorted(users)
    return plan
