"""The store's high-water mark of its ledger (``<store>/ledger-mark.json``; ledger_integrity's "Binding and
high-water mark"): where the ledger's head and snapshot were at the last commit, what a compaction announces before it
publishes a snapshot (audit 10, F1), and the check every ledger writer and ``account --verify`` make against it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import ledger_history, ledger_mark_remote
from .errors import ConcurrentChangeError, LedgerIntegrityError
from .fsio import atomic_write_text
from .ledger_chain import LOCAL_COPY, _short, check_seal, head_seq, sealed_mark, snapshot_head
from .ledger_mark_remote import FROM_BUCKET

MARK_NAME = "ledger-mark.json"
#: Set by :func:`read_mark` on the mark of a store on object storage whose bucket copy is missing.
BUCKET_MISSING = "_bucket_mark_missing"


def mark_path(store_path: str | os.PathLike) -> Path:
    return Path(store_path) / MARK_NAME


def read_mark(store_path) -> dict | None:
    """The store's high-water mark: the state folder's, or for a store on object storage the further of it and the
    bucket's copy (:mod:`.ledger_mark_remote`)."""
    local, remote = _read_local_mark(store_path), ledger_mark_remote.read(store_path)
    m = ledger_mark_remote.furthest(local, remote, store_path=store_path)
    if m is not None and remote is None and ledger_mark_remote.is_remote(store_path):
        m = {**m, BUCKET_MISSING: True}  # check_mark refuses it for a bound store (review 27, F4)
    return m


def _read_local_mark(store_path) -> dict | None:
    p = mark_path(store_path)
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LedgerIntegrityError(f"{p}: the ledger's high-water mark is unreadable ({type(exc).__name__})") from None
    if not (isinstance(m, dict) and isinstance(m.get("seq"), int)):
        raise LedgerIntegrityError(f"{p}: the ledger's high-water mark is corrupt")
    check_seal(m, p)
    return m


def write_mark(path: Path, ledger, *, announce: tuple[int, str] | None = None) -> None:
    """The store's high-water mark: the chain head and the current snapshot (generation and file sha256).

    The snapshot's own hash matters when no event follows it (right after a compaction): an edited snapshot
    is then caught by the mark, since no event links to it yet. ``announce`` = (generation, sha256) of a snapshot
    written but not yet published: a compaction announces it here *before* it switches ``CURRENT``, and
    :func:`check_mark` accepts a ledger past the mark's generation only at that announced snapshot (audit 10, F1:
    a snapshot written by hand at the next generation number was accepted, which refunded every charge).
    """
    fields = {"ledger_uuid": ledger.meta["ledger_uuid"], "seq": head_seq(ledger),
              "sha256": ledger.head_sha256, "generation": int(ledger.generation),
              "snapshot_sha256": ledger.snapshot_sha256, "time": time.time(),
              # answers released through the ledger up to the head: what `repair` compares
              # with what a damaged or rolled-back ledger still holds (audit 3, review 2)
              "answers": int(ledger.state.answers_released()),
              # and how many of them carry their seed: a rollback must not hide them (review 74, F3)
              "seeded": int(ledger_history.seeded_answers(ledger.state))}
    if announce is not None:
        fields.update(next_generation=int(announce[0]), next_snapshot_sha256=str(announce[1]))
    erase = getattr(ledger.state, "rows_to_erase", None)
    if isinstance(erase, dict) and erase.get("rows"):  # an erasure deferred under a held store lease lives only in the
        # ledger: a copy here lets `repair` finish it after a rollback lost its event (review 72, F2)
        fields["rows_to_erase"] = {"store_uuid": erase.get("store_uuid"), "rows": [int(r) for r in erase["rows"]]}
    atomic_write_text(json.dumps(sealed_mark(fields, copy=LOCAL_COPY)), Path(path))
    # a store on object storage: the bucket's copy too, sealed with copy="bucket" (review 30, F1)
    ledger_mark_remote.write(Path(path).parent, fields)



def announced(mark: dict | None, generation: int, snapshot_sha256: str | None) -> bool:
    """Whether the mark announces the snapshot ``generation`` with this file hash (:func:`write_mark`'s
    ``announce``): the only way a ledger may be one generation past the store's mark."""
    return (isinstance(mark, dict) and mark.get("next_generation") == generation
            and isinstance(snapshot_sha256, str) and mark.get("next_snapshot_sha256") == snapshot_sha256)


def carry_mark(from_store, to_store) -> None:
    """Copy the store's local mark into another store folder (a compaction's copy, just before it becomes the
    store: the copy then carries the announcement of the ledger's next snapshot)."""
    src = mark_path(from_store)
    if src.is_file():
        atomic_write_text(src.read_text(), mark_path(to_store))


def _sha_at(ledger, seq: int) -> str | None:
    if seq in ledger.event_sha256:
        return ledger.event_sha256[seq]
    if seq == ledger.snapshot_event_seq:
        return snapshot_head(ledger.meta)
    return None  # folded into an older snapshot: only the order can be checked


_UNREAD = object()


def _published_since(store_path, ledger) -> bool:
    """For a caller without the ledger lock, whose mark was read before the ledger: a compaction may have published
    the ledger's snapshot in between (announced in a mark this caller never saw, then named by the one now). True
    when the store's mark now names or announces exactly that snapshot; a mark already past it means the ledger
    moved on again while it was read (ConcurrentChangeError: run again)."""
    try:
        now = read_mark(store_path)
    except LedgerIntegrityError:
        return False
    if not isinstance(now, dict) or now.get("ledger_uuid") != ledger.meta["ledger_uuid"]:
        return False
    if announced(now, ledger.generation, ledger.snapshot_sha256) or (
            now.get("generation") == ledger.generation and now.get("snapshot_sha256") == ledger.snapshot_sha256):
        return True
    if isinstance(now.get("generation"), int) and now["generation"] > ledger.generation:
        raise ConcurrentChangeError(f"{ledger.path}: the ledger was compacted while it was read; run again")
    return False


def check_mark(store_path, ledger, *, required: bool, mark=_UNREAD) -> dict | None:
    """The ledger must reach the store's high-water mark with the same event there. Returns the mark.

    A caller without the ledger lock passes ``mark`` = :func:`read_mark` taken *before* it opened
    the ledger: the mark is written after each commit, so it can then only be behind what it read.
    """
    m = read_mark(store_path) if mark is _UNREAD else mark
    if m is not None and m.get(FROM_BUCKET) and m.get("ledger_uuid") != ledger.meta["ledger_uuid"]:
        if required:
            # A bound store's bucket mark is its ledger's from `index`'s first commit on: another ledger's there was
            # copied over it (a plain object copy of a mark indknn sealed), which switched the bucket's check off
            # and let a copy of the ledger elsewhere charge every record a second time (review 29, F1).
            raise LedgerIntegrityError(
                f"{store_path}: the store is bound to this ledger ({ledger.meta['ledger_uuid']}), but the bucket's "
                f"copy of its high-water mark belongs to ledger {m.get('ledger_uuid')} (replaced?): a copy of the "
                "ledger elsewhere could not be told from this one; refusing. `indknn repair` retires every record "
                "(no refund) and writes it again")
        # not bound yet (`index` of a store made again under an old name): that ledger's mark is stale (review 25)
        m = _read_local_mark(store_path)
    p = mark_path(store_path)
    if m is None:
        if required:
            raise LedgerIntegrityError(f"{p}: the store is bound to this ledger but its high-water mark is "
                                       "missing (removed?); refusing: a rollback could not be detected")
        return None
    if m.get("ledger_uuid") != ledger.meta["ledger_uuid"]:
        raise LedgerIntegrityError(f"{p}: the high-water mark belongs to ledger {m.get('ledger_uuid')}, not to "
                                   f"{ledger.path} ({ledger.meta['ledger_uuid']}); refusing")
    if required and m.get(BUCKET_MISSING):
        raise LedgerIntegrityError(
            f"{store_path}: the store is bound to this ledger, but the bucket's copy of its high-water mark is missing "
            "(removed?): a copy of the ledger elsewhere could not be told from this one; refusing. `indknn repair` "
            "retires every record (no refund) and writes it again")
    g = m.get("generation")
    # a mark's head hash is null only for a ledger whose head has none (an unchained snapshot and no event after it)
    head_ok = isinstance(m.get("sha256"), str) or (m.get("sha256") is None and isinstance(m.get("seq"), int)
                                                   and _sha_at(ledger, m["seq"]) is None)
    if not (isinstance(g, int) and not isinstance(g, bool) and head_ok and isinstance(m.get("snapshot_sha256"), str)):
        # every mark written since 2026-11-24 has all three; one without them would skip the checks below
        # (audit 10: a mark edited by hand, with no hash to compute)
        raise LedgerIntegrityError(f"{p}: the ledger's high-water mark lacks its snapshot generation or a hash "
                                   "(edited by hand, or written by an indknn before 2026-11-24); refusing: a "
                                   "rollback could not be detected. `indknn repair` retires every record (no refund)")
    if ledger.generation < g:
        raise LedgerIntegrityError(
            f"{ledger.path}: the ledger is at snapshot generation {ledger.generation}, but the store "
            f"{store_path} saw generation {g}: the ledger was rolled back (an older copy restored), which would "
            "refund charges; refusing it")
    if ledger.generation == g and m.get("snapshot_sha256") != ledger.snapshot_sha256:
        raise LedgerIntegrityError(
            f"{ledger.path}: snapshot-{g:06d}.parquet has sha256 {_short(ledger.snapshot_sha256)}, the "
            f"store {store_path} saw {_short(m.get('snapshot_sha256'))} written: the snapshot was edited; "
            "refusing it")
    if ledger.generation > g and not announced(m, ledger.generation, ledger.snapshot_sha256) and not (
            mark is not _UNREAD and _published_since(store_path, ledger)):
        raise LedgerIntegrityError(
            f"{ledger.path}: the ledger is at snapshot generation {ledger.generation} (sha256 "
            f"{_short(ledger.snapshot_sha256)}), but the store {store_path} saw generation {g}, and no "
            "compaction announced that snapshot: it was written outside indknn (a forged or swapped snapshot "
            "can refund every charge); refusing it. `indknn repair` retires every record (no refund: "
            "docs/RELIABILITY.md)")
    head = head_seq(ledger)
    if head < m["seq"]:
        raise LedgerIntegrityError(
            f"{ledger.path}: the ledger ends at event {head}, but the store {store_path} saw event {m['seq']} "
            "committed: the ledger was rolled back (an older copy restored, or its newest events removed), which "
            "would refund charges; refusing it"
        )
    have = _sha_at(ledger, m["seq"])
    if have is not None and have != m.get("sha256"):
        raise LedgerIntegrityError(
            f"{ledger.path}: event {m['seq']} has sha256 {_short(have)}, the store {store_path} saw "
            f"{_short(m['sha256'])} committed there: the ledger's history was replaced; refusing it"
        )
    return m
