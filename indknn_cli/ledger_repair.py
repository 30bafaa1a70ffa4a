"""`indknn repair`: bring a damaged or rolled-back ledger back into service without refunding anything.

A ledger is refused when an event is truncated or unreadable, the hash chain is broken (an event edited,
removed, copied in or reordered) or the ledger is behind the store's high-water mark (an older copy
restored). Removing the offending file by hand would refund the charges it held. Repair instead:

1. finds the longest prefix of events that opens cleanly (the chain is prefix-monotone: if events up to k
   verify, so does every shorter prefix — a binary search over k), then drops its last event while the next
   event's link or the store's high-water mark contradicts that event's bytes (an edited event);
2. moves every later event file to ``quarantine/<time>/`` (kept for forensics, never replayed);
3. commits one ``repair`` event that sets **every record not deleted to spent = B (retired)** and brings
   every store row the kept ledger does not know into it at spent = B: the quarantined events may have
   charged any record, so every record is assumed to have spent all of its budget;
4. moves the store's high-water mark to the repair event.

Repair costs utility (every current record retires; new records joining later start fresh, as always),
never privacy: no record's spent ever goes down. A damaged or missing snapshot or answers file cannot be
repaired this way (restore the ledger folder from a backup; repair refuses, exit 1, naming the file). A ``CURRENT``
naming a missing snapshot, or not readable at all, is first written back to the newest snapshot of this store's
ledger; event files a repair killed while it probed left in ``.repair-probe-<pid>/`` are put back, and a removed
``events/`` folder is made again; when the ledger then verifies against the store's mark, nothing else is done
(nobody retires). A store restored from a copy older than a compaction the ledger recorded is a wrong pairing
(exit 2): the ledger's rows are numbered for the compacted store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import ledger_integrity as integrity
from . import store_erased_ids, store_versions
from .ledger_history import seeded_answers
from .errors import ConcurrentChangeError, IndknnError, LedgerError, LedgerIntegrityError, LedgerOlderThanStoreError
from .ledger import BudgetLedger
from .ledger_current import not_a_file, stand_in
from .ledger_repair_lost import (answers_in_lost_events, checked_answers, deferred_rows, erased_in_lost_events,
                                 erased_rows_now, ids_in_lost_events, rows_lost_erasures_name)
from .ledger_repair_setup import put_back_probes, put_current_back, write_current_back
from .ledger_rows import check_rows_hold_records, compare_rows
from .store import ERASE_PENDING_ATTR, FeatureStore


@dataclass
class RepairResult:
    ledger: str
    repaired: bool
    reason: str | None = None
    events_kept_through: int | None = None  # the last event kept (the snapshot's when none after it is)
    quarantined: list[str] = field(default_factory=list)
    quarantine_folder: str | None = None
    records_retired: int = 0
    store_rows_added_retired: int = 0
    tombstones_written: int = 0
    answers_recovered: int = 0        # released answers of the quarantined events, written again (still counted)
    answers_left_out: int = 0         # quarantined answer rows repeated or not fitting the store: not written
    unreadable_events: list[str] = field(default_factory=list)  # quarantined events whose answers are unknown
    #: answers the store's high-water mark counted that the repaired ledger does not hold (a rolled-back copy or
    #: unreadable events): released and still counted in queries answered (LedgerState.answers_not_held), but
    #: which queries they answered is lost. None: the mark does not carry a count (written before it did).
    answers_not_recovered: int | None = None
    #: unflagged store rows holding an id the kept ledger has erased (a store restored from a copy older than the
    #: erasure): flagged and erased again here (an id embedded again and not yet served is erased too)
    rows_erased_again: int = 0
    #: store rows whose id belongs to a record of another user (an erased id embedded again under someone else):
    #: kept out of the ledger, as serving and `index` keep them out, so the tombstone stays its user's (audit 7)
    rows_left_out_other_user: int = 0
    #: CURRENT named a missing snapshot and now names this generation (the newest snapshot of this store's ledger)
    current_written_back: int | None = None
    #: event files a repair killed while it probed had left in ``.repair-probe-<pid>/``, put back into events/
    events_put_back: list[str] = field(default_factory=list)
    dry_run: bool = False

    def as_dict(self) -> dict:
        if self.repaired and (self.current_written_back is not None or self.events_put_back) and not (
                self.records_retired or self.store_rows_added_retired or self.quarantined):
            cost = ("none: " + ("CURRENT written back" if self.current_written_back is not None else
                                "a killed repair's event files put back") +
                    ", and the ledger then verified against the store's high-water mark")
        else:
            cost = "utility only: every record not deleted is retired (spent = B); no spent budget goes down"
        return {**self.__dict__, "cost": cost, "operator_only": OPERATOR_ONLY_REPAIR}  # exact counts: review 65, F6


OPERATOR_ONLY_REPAIR = ("operator-only: records_retired, store_rows_added_retired, tombstones_written, "
                        "rows_erased_again, rows_left_out_other_user and the answer counts are exact figures of the "
                        "private data; for the data holder, never for query-senders")


def _event_files(path: Path) -> list[tuple[int, Path]]:
    out = []
    for p in (path / "events").glob("*.parquet"):
        if p.name.startswith("."):
            continue
        head = p.name.split("-", 1)[0]
        out.append((int(head) if head.isdigit() else -1, p))
    return sorted(out, key=lambda t: (t[0], t[1].name))


def _opens(path: Path, store_uuid: str) -> BudgetLedger | None:
    try:
        return BudgetLedger.open(path, store_uuid=store_uuid)
    except LedgerError:
        return None


def _why_not(path: Path, store_uuid: str) -> str:
    """Why the ledger at ``path`` does not open (its snapshot alone, events moved aside)."""
    try:
        BudgetLedger.open(path, store_uuid=store_uuid)
    except LedgerError as exc:
        return str(exc)
    return "it opens"  # pragma: no cover - only called after a failed open


def _longest_good_prefix(path: Path, files: list[tuple[int, Path]], store_uuid: str) -> tuple[int, int, str]:
    """Number of leading event files with which the ledger opens, the sequence number the snapshot folds
    through and the ledger's uuid; moves files aside while it probes."""
    aside = path / f".repair-probe-{os.getpid()}"
    aside.mkdir()
    try:
        for _, p in files:
            os.replace(p, aside / p.name)
        base = _opens(path, store_uuid)
        if base is None:
            why = _why_not(path, store_uuid)
            if "restore the ledger folder" in why.lower():  # the reason already says what to do
                raise LedgerIntegrityError(f"repair cannot rebuild a snapshot or its answers file: {why}")
            raise LedgerIntegrityError(f"{path}: the snapshot CURRENT names does not open without any event ({why}); "
                                       "repair cannot rebuild a snapshot or its answers file: restore the ledger "
                                       "folder from a backup, then run repair (`indknn delete` still erases "
                                       "meanwhile)")
        lo, hi = 0, len(files)  # prefix lo opens; find the largest
        present = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            for _, p in files[present:mid]:
                os.replace(aside / p.name, p)
            for _, p in files[mid:present]:
                os.replace(p, aside / p.name)
            present = mid
            if _opens(path, store_uuid) is not None:
                lo = mid
            else:
                hi = mid - 1
        for _, p in files[present:lo]:
            os.replace(aside / p.name, p)
        for _, p in files[lo:present]:
            os.replace(p, aside / p.name)
        return lo, int(base.snapshot_event_seq), str(base.meta["ledger_uuid"])
    finally:
        for p in aside.iterdir():  # whatever is still aside goes back; the caller quarantines it
            os.replace(p, path / "events" / p.name)
        aside.rmdir()


def _prev_link(path: Path, seq: int) -> str | None:
    """The ``prev_sha256`` that event file ``path`` (which should be event ``seq``) records, or None when it
    cannot be read or names another event."""

    import pyarrow.parquet as pq

    try:
        info = json.loads((pq.read_schema(path).metadata or {})[b"indknn_event"])
    except Exception:  # noqa: BLE001 - a damaged file vouches for nothing
        return None
    link = info.get("prev_sha256") if isinstance(info, dict) and info.get("seq") == seq else None
    return link if isinstance(link, str) else None


def _linked_prefix(files: list[tuple[int, Path]], keep: int, snap_seq: int, mark: dict | None) -> int:
    """Shorten the verified prefix while its last event is contradicted by what vouches for it (audit 3, C6).

    Opening checks each event's link to the one before, so nothing in the prefix vouches for its *last*
    event: an edited last event opens cleanly. Two things outside the prefix do: the next event file's
    ``prev_sha256`` (when it can be read) and the store's high-water mark (when it points at that event).
    If either disagrees with the event's bytes, the event was edited and goes to quarantine with the rest;
    the event before it is then checked against the edited file's link in the same way. An event nothing
    vouches for (the next file unreadable, the mark elsewhere) is kept, as before. Events the snapshot
    folded are vouched for by the snapshot and never looked at."""
    def marked(seq: int) -> str | None:
        m = mark if mark is not None and isinstance(mark.get("sha256"), str) else None
        return m["sha256"] if m is not None and m.get("seq") == seq else None

    while keep > 0 and files[keep - 1][0] > snap_seq:
        seq, p = files[keep - 1]
        want = None
        if keep < len(files):
            nxt = files[keep][1]
            # the next file vouches only if the mark does not show it edited itself (its own link may be the edit)
            seen = marked(seq + 1)
            if seen is None or seen == integrity.sha256_bytes(nxt.read_bytes()):
                want = _prev_link(nxt, seq + 1)
        if want is None:
            want = marked(seq)
        if want is None or want == integrity.sha256_bytes(p.read_bytes()):
            break
        keep -= 1
    return keep


def repair_ledger(*, ledger_path: str | os.PathLike, store_path: str | os.PathLike, dry_run: bool = False,
                  lock_timeout: float = 60.0) -> RepairResult:
    """Repair the ledger bound to ``store_path`` (see the module doc). ``dry_run`` works on a copy."""
    from .object_store import local_path

    ledger_path, store_path = Path(ledger_path), local_path(store_path)  # an s3:// URL: its state folder
    if not BudgetLedger.exists(ledger_path):
        raise LedgerError(f"{ledger_path}: no budget ledger here")
    FeatureStore.open(store_path, mode="r")  # a missing store is bad input (exit 2), before any lock file is made
    with BudgetLedger.write_lock(ledger_path, timeout=lock_timeout), \
            integrity.writer_lock(store_path, timeout=lock_timeout):
        store = FeatureStore.open(store_path, mode="r")
        with (tempfile.TemporaryDirectory() if dry_run else contextlib.nullcontext()) as tmp:
            path = ledger_path
            if dry_run:
                path = Path(tmp) / "ledger"
                cur = ledger_path / "CURRENT"
                odd = not_a_file(cur) is not None  # copytree would fail on it or block reading it (a named pipe)
                skip = ("LOCK", "CURRENT") if odd else ("LOCK",)
                shutil.copytree(ledger_path, path, ignore=shutil.ignore_patterns(*skip))
                if odd:
                    stand_in(cur, path / "CURRENT")  # what is there, without reading it
            try:
                res = _repair_at(path, store, ledger_path=ledger_path, dry_run=dry_run, lock_timeout=lock_timeout)
            except IndknnError as exc:
                if not dry_run:
                    raise
                # the copy's temporary path means nothing to the operator: name their ledger (review 40, left)
                raise type(exc)(str(exc).replace(str(path), str(ledger_path))) from None
            if dry_run and res.reason:
                res.reason = res.reason.replace(str(path), str(ledger_path))
            return res


def _repair_at(path: Path, store: FeatureStore, *, ledger_path: Path, dry_run: bool,
               lock_timeout: float = 60.0) -> RepairResult:
    """The repair itself, on ``path`` (the ledger, or its copy under --dry-run); both locks are held."""
    events = path / "events"
    if events.is_symlink():  # repair would move another folder's files, and write its event there (review 39)
        raise LedgerIntegrityError(
            f"{ledger_path}/events is a symbolic link (to {os.readlink(events)}): repair moves and writes "
            "event files only in the ledger's own folder; put the ledger's events folder itself there, "
            "then run repair")
    if events.exists() and not events.is_dir():  # a file in its place (review 39, F3): kept, not lost
        folder = path / "quarantine" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(events, folder / "events.not-a-folder")
    put_back = put_back_probes(path)  # a repair killed while it probed (under this lock: nobody else's)
    events.mkdir(exist_ok=True)  # removed by hand: the repair event goes there
    reason = _refusal(path, store)
    if reason is None:
        return RepairResult(ledger=str(ledger_path), repaired=bool(put_back), dry_run=dry_run,
                            events_put_back=put_back)
    back, kept_in = write_current_back(path, store, shown_path=ledger_path)
    try:
        if back is not None:
            after = _refusal(path, store)
            if after is None:  # CURRENT was all that was wrong: the mark vouches for the rest, nobody retires
                return RepairResult(ledger=str(ledger_path), repaired=True, reason=reason, dry_run=dry_run,
                                    current_written_back=back, events_put_back=put_back,
                                    quarantine_folder=None if dry_run else str(ledger_path / kept_in))
            reason = f"{reason}; with CURRENT written back to generation {back}: {after}"
        res = _repair(path, store, reason, dry_run=dry_run, shown_path=ledger_path, lock_timeout=lock_timeout)
        res.events_put_back = put_back
    except BaseException:
        # the repair failed: CURRENT as it was, so the ledger is in the state repair found (a damaged ledger
        # never blocks an erasure; one pointed at a snapshot that then failed could: review 32, F1)
        if back is not None:
            put_current_back(path, generation=back, kept_in=kept_in)
        raise
    res.current_written_back = back
    return res


def _refusal(path: Path, store: FeatureStore) -> str | None:
    """Why the ledger at ``path`` is refused for ``store`` (None: it verifies). A ledger of another store, or a
    store bound to another ledger, is a wrong pairing, not damage: raised, never "repaired" into this store. So is
    a store older than a compaction the ledger recorded: repair holds both locks, so no compaction runs now."""
    try:
        led = BudgetLedger.open_for(path, store)
        integrity.check_binding(store, led, path)
        store_versions.check(store, led)  # a store restored from an older copy (audit 6)
        check_rows_hold_records(led, store)
        return None
    except LedgerOlderThanStoreError:
        # its rows are numbered for the store before the compaction: repair cannot pair them (review 54, F7)
        raise LedgerOlderThanStoreError(
            f"{path}: this ledger is older than the feature store: it was written for the store before a `delete "
            "--compact` it never saw (its folder restored from a backup taken before that compaction). `indknn "
            "repair` cannot bring it back: its rows are numbered for the store before that compaction. Restore the "
            "ledger folder from a backup taken after it; without one this store cannot be served through this "
            "ledger (nothing is refunded, and `indknn delete` still erases)") from None
    except ConcurrentChangeError:
        c = BudgetLedger.open(path).meta.get("store_compaction") or {}
        raise LedgerError(
            f"{store.path}: this store is a copy taken before the compaction the ledger recorded (token "
            f"{c.get('token')}; the store's uuid is the one it replaced): the ledger's rows are numbered for the "
            "compacted store, so repair cannot pair them with this copy. Restore the store from a copy taken after "
            "that compaction; `indknn delete` erases from this copy alone meanwhile") from None
    except LedgerIntegrityError as exc:
        return str(exc)
    except LedgerError as exc:
        if "another feature store" in str(exc) or "bound to the ledger" in str(exc):
            raise
        return str(exc)


def _repair(path: Path, store: FeatureStore, reason: str, *, dry_run: bool, shown_path: Path,
            lock_timeout: float = 60.0) -> RepairResult:
    try:
        mark = integrity.read_mark(store.path)
    except LedgerIntegrityError:
        mark = None
    mark = mark if isinstance(mark, dict) else None
    marked = (mark or {}).get("answers")
    files = _event_files(path)
    bad_names = [p for s, p in files if s < 0]
    files = [(s, p) for s, p in files if s >= 0]
    keep, snap_seq, ledger_uuid = _longest_good_prefix(path, files, store.uuid)
    keep = _linked_prefix(files, keep, snap_seq, mark if (mark or {}).get("ledger_uuid") == ledger_uuid else None)
    quarantine = path / "quarantine" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = [p for _, p in files[keep:]] + bad_names
    if moved:
        quarantine.mkdir(parents=True, exist_ok=True)
        for p in moved:
            os.replace(p, quarantine / p.name)
    led = BudgetLedger.open_for(path, store)
    b = integrity.binding_of(store)
    if b is not None and b.get("ledger_uuid") != led.meta["ledger_uuid"]:
        raise LedgerError(f"{store.path}: bound to ledger {b.get('ledger_uuid')}, not {led.meta['ledger_uuid']}")
    s = led.state
    B = led.params.budget
    n_store = store.n_rows("private")
    deleted_rows = store.read("private", "deleted").astype(bool) if n_store else np.zeros(0, bool)
    # an accepted erasure not finished is as gone as a flagged row: tombstoned, never added back (review 58, F1: its
    # tombstone in a quarantined event and its flag lost, repair kept the record live)
    deleted_rows[store.erase_pending_rows("private")] = True
    # and one recorded while the store's writer lease was held elsewhere, in a kept or a quarantined event (review 70,
    # F1: forgotten when quarantined, the record came back live and its row was never overwritten; F2: taken for a
    # row restored from a backup, its re-erasure waited 60 s for the lease and the repair failed)
    deferred = deferred_rows(led, store, moved, quarantine, deleted_rows, mark)
    deleted_rows[deferred] = True
    ids = store.read("private", "record_id")
    users = store.read("private", "user_id")
    # Records the kept ledger holds live whose store row is gone (erased in a lost event, or by a delete run while
    # the ledger was unreadable) or that a readable lost event erased: tombstoned at B, their erasure goes on.
    gone = np.zeros(len(s), bool)
    li, other, flagged = compare_rows(s, ids=ids, deleted_rows=deleted_rows)
    gone[li] = other | flagged
    quarantined = [quarantine / p.name for p in moved]  # their erasures count, kept-live ids too (review 75, F4)
    lost_ids_del, lost_by_row, lost_rows = erased_in_lost_events(quarantined, store.uuid)
    gone |= (lost_live := ~s.deleted & np.array([str(r) in lost_ids_del for r in s.record_id], bool))
    lost_rows = rows_lost_erasures_name(s, ids, lost_by_row, lost_rows, lost_live, n_store)
    live = np.flatnonzero(~s.deleted & ~gone & (s.spent < B))
    row_map = led.store_row_map(n_store)
    known = row_map >= 0
    known[known] = ~gone[row_map[known]]  # a row mapped to a gone record holds another one (a restored store)
    new_rows = np.flatnonzero(~known & ~deleted_rows)
    # A gone record whose id the store now holds at another row (a restored store, rows embedded again in
    # another order) is mapped there at spent = B by `add` below, not tombstoned (audit 6, F1).
    # Rows holding an id the kept ledger erased that the store's own erasure log does not name: a store restored
    # from a copy older than the erasure brought the record back; so do rows its erasures overwrote (review 72,
    # F1: the log lost with them). They are erased again below, never brought into the ledger (audit 6 review).
    # An id the store's log names was erased in this store and embedded again since (a re-admission the kept
    # ledger lost in a rollback): kept, brought in retired like any other row (review 14).
    lost_ids, store_erased = ids_in_lost_events(quarantined), store.erased_ids()  # each read once
    logged = {rid for rid, _ in store_erased}
    erased_ids = {str(r) for r in s.record_id[s.deleted]} - logged
    back = np.union1d([r for r in new_rows if str(ids[r]) in erased_ids], np.intersect1d(
        new_rows, np.union1d(store_erased_ids.in_ledger(led, store), lost_rows))).astype(np.int64)
    new_rows = np.setdiff1d(new_rows, back)
    # A row whose id the kept ledger holds under another (non-empty) user stays out of the ledger, as `add_records`
    # keeps it out and `index` refuses it: an `add` would move the record, its tombstone and its spent, to the new
    # user, and the first user would come back afresh (audit 7, F1). Ids the kept ledger lost (a rollback, lost
    # events) keep their first owner from the readable quarantined events and the store's erasure log (review 15, 1).
    owner = {str(r): str(u or "") for r, u in zip(s.record_id, s.user_id)}
    for rid, uid in lost_ids + store_erased:
        owner.setdefault(str(rid), str(uid or ""))
    other_user = np.asarray([r for r in new_rows if owner.get(str(ids[r])) not in (None, "", str(users[r] or ""))],
                            np.int64)
    new_rows = np.setdiff1d(new_rows, other_user)
    held = {str(ids[r]) for r in new_rows}
    tomb = np.asarray([i for i in np.flatnonzero(gone) if str(s.record_id[i]) not in held], np.int64)
    index_of = {rid: i for i, rid in enumerate(s.record_id)}
    add_li, add_rid, add_uid, add_row, nxt = [], [], [], [], len(s)

    def add(rid: str, uid: str, row: int) -> int:
        nonlocal nxt
        if rid in index_of:
            i = index_of[rid]
        else:
            i = index_of[rid] = nxt
            nxt += 1
        add_li.append(i); add_rid.append(rid); add_uid.append(uid); add_row.append(row)
        return i

    for r in new_rows:
        add(str(ids[r]), str(users[r] or ""), int(r))
    # Ids the lost events added (readable events after the damaged one still name them): records added and
    # erased there must keep a tombstone at B, or a returning id (or user) would start afresh (SPEC §8).
    live_ids = {str(ids[r]) for r in new_rows}
    lost_tombs = []
    for rid, uid in lost_ids:
        if rid not in index_of and rid not in live_ids:
            lost_tombs.append(add(rid, uid, -1))
    # Ids the store erased that the kept ledger does not know: added and erased in events that are gone (a
    # rollback removes them; no quarantined file names them). The erasure blanked them in the store, its log
    # kept them (FeatureStore.erased_ids): tombstoned at B like the others.
    for rid, uid in store_erased:
        if rid not in index_of and rid not in live_ids:
            lost_tombs.append(add(rid, uid, -1))
    tomb = np.concatenate([tomb, np.asarray(lost_tombs, np.int64)]).astype(np.int64)
    index_rid = dict(zip(add_li, add_rid))
    lost_answers, unreadable = answers_in_lost_events(quarantined)
    refused = 0
    if lost_answers is not None:  # never twice, and only rows that fit the store (checked_answers)
        have = {(b, int(q)) for b, q in zip(s.answer_column("batch_id", object), s.answer_column("query_index",
                                                                                                   np.int64))}
        lost_answers, refused = checked_answers(lost_answers, store, have)
    nans = 0 if lost_answers is None else lost_answers.num_rows
    # Released answers the mark counted that neither the kept events nor the recovered rows hold: they stay
    # counted (state.answers_not_held), so queries answered never goes down (review 9, item 2).
    after = s.answers_released() + nans
    not_recovered = (max(0, int(marked) - after)
                     if isinstance(marked, int) and not isinstance(marked, bool) else None)
    seeded = (mark or {}).get("seeded")  # likewise the seeded ones (review 74, F3: a rollback hid them from account)
    seeded_lost = (max(0, seeded - seeded_answers(s) - (0 if lost_answers is None else int(
        lost_answers.num_rows - lost_answers.column("seed").null_count)))
        if isinstance(seeded, int) and not isinstance(seeded, bool) else 0)
    if not dry_run:
        led.mark_path = integrity.mark_path(store.path)  # the mark moves to the repair event
    led.store_version = lambda: store_versions.current(store)  # the repair event records the store as it is now
    na, nc, nt = len(add_li), int(live.size), int(tomb.size)
    columns = {
        "kind": ["add"] * na + ["charge"] * nc + ["delete"] * nt,
        "ledger_index": add_li + live.tolist() + tomb.tolist(),
        "record_id": add_rid + [None] * nc + [str(s.record_id[i]) if i < len(s) else index_rid[int(i)]
                                              for i in tomb],
        "user_id": add_uid + [None] * (nc + nt),
        "row": add_row + [None] * nc + [-1] * nt,
        "budget": [B] * na + [None] * (nc + nt),
        "spent_after": [B] * (na + nc + nt),
        "selected": [None] * na + [0] * nc + [None] * nt,
    }
    if nans:
        import pyarrow as pa

        from .ledger_state import ANSWER_SCHEMA, EVENT_SCHEMA

        m = na + nc + nt
        for f in EVENT_SCHEMA:
            head = pa.array(columns.get(f.name, [None] * m), type=f.type)
            tail = (lost_answers.column(f.name).combine_chunks() if f.name in ANSWER_SCHEMA.names
                    else pa.array(["answer"] * nans if f.name == "kind" else [None] * nans, type=f.type))
            columns[f.name] = pa.concat_arrays([head, tail.cast(f.type)])
    # Rows erased again are flagged (a new store version) and recorded as a pending erasure *before* the repair
    # event, which then records a version the restored copy lacks: an interrupted re-erasure is finished by the
    # next command, and the copy restored again is refused (review 14, 1). The store lock is taken first.
    wst = FeatureStore.open(store.path, mode="a") if back.size and not dry_run else None
    with wst.write_lock(timeout=lock_timeout) if wst is not None else contextlib.nullcontext():
        if wst is not None:
            pending_before = [int(r) for r in wst.erase_pending_rows("private")]
            wst.group("private").attrs.update({ERASE_PENDING_ATTR: sorted(set(pending_before) | set(back.tolist()))})
            wst.mark_deleted("private", back)
        led.commit_event(event_type="repair", info={
            "rows_to_erase_reset": {"store_uuid": store.uuid, "rows": deferred.tolist()},
            "erased_rows_reset": erased_rows_now(led, store, back, n_store),
            "reason": reason[:500], "quarantined": [p.name for p in moved], "records_retired": nc,
            "store_rows_added_retired": len(new_rows), "tombstones_written": nt, "answers_recovered": nans,
            "answers_left_out": refused, "unreadable_events": unreadable,
            "answers_not_recovered": not_recovered or 0, "rows_erased_again": int(back.size),
            "seeded_not_recovered": seeded_lost,
            "rows_left_out_other_user": int(other_user.size)}, columns=columns)
        if wst is not None:
            wst.erase_rows("private", back)
            from . import indexes

            indexes.remove_rows(wst, back)  # their LSH codes / IVF entries too (review 14, 2)
            wst.group("private").attrs.update({ERASE_PENDING_ATTR: pending_before})
    if not dry_run and integrity.binding_of(FeatureStore.open(store.path, mode="r")) is None:
        # a ledger from before binding and chaining (or one stripped of them: review 27, F2), every record now
        # retired: bound here, so that from now on the mark guards it
        integrity.bind(store.path, led, shown_path, lock_timeout=lock_timeout)
    return RepairResult(ledger=str(shown_path), repaired=True, reason=reason,
                        events_kept_through=files[keep - 1][0] if keep else snap_seq,
                        quarantined=[p.name for p in moved],
                        quarantine_folder=None if dry_run or not moved else str(quarantine),
                        records_retired=nc, store_rows_added_retired=len(new_rows), tombstones_written=nt,
                        answers_recovered=nans, answers_left_out=refused, unreadable_events=unreadable,
                        answers_not_recovered=not_recovered, rows_erased_again=int(back.size),
                        rows_left_out_other_user=int(other_user.size), dry_run=dry_run)
