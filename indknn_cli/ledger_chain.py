"""The ledger's hash chain (issue 16 §2): file hashes, the chain head a snapshot folds, and the checks on the events
that follow a snapshot (one sequence number per file, no gap, every link). :mod:`.ledger_integrity` describes the
whole scheme; :mod:`.ledger_mark` holds the store's high-water mark."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import LedgerIntegrityError

GENESIS = "0" * 64          # the chain head of a ledger without events
CHAIN_VERSION = 1           # snapshot metadata "chain": events after it must be chained


def sha256_bytes(data) -> str:
    return hashlib.sha256(data).hexdigest()


#: The key under which a high-water mark carries the sha256 of its own other fields (review 27, F1).
SEAL = "mark_sha256"


def mark_seal(fields: dict) -> str:
    """sha256 of a mark's fields (canonical JSON: sorted keys, no spaces), its own seal and keys starting with "_"
    (added when it is read) left out. A mark edited by hand (an earlier event's number and hash, readable in the next
    event's link) then needs a hash computed to pass (review 27, F1), like every other file of the ledger."""
    body = {k: v for k, v in fields.items() if k != SEAL and not k.startswith("_")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


#: The ``copy`` field of a mark: which of its two places it was written to (review 30, F1).
LOCAL_COPY, BUCKET_COPY = "local", "bucket"


def sealed_mark(fields: dict, *, copy: str) -> dict:
    """A mark as written to one place: its fields, which copy it is (``copy``: :data:`LOCAL_COPY` for the state
    folder's ``ledger-mark.json``, :data:`BUCKET_COPY` for the bucket's), and the sha256 of both. The copy is inside
    the seal: the state folder's mark put in the bucket by hand reads as what it is, and turning it into a bucket
    copy needs a hash computed (review 30, F1: the two were the same bytes, so a copied state folder held an older
    version of the bucket's object, and restoring it let the copy serve a second time)."""
    out = {k: v for k, v in fields.items() if k != SEAL and not k.startswith("_")}
    out["copy"] = copy
    out[SEAL] = mark_seal(out)
    return out


def check_seal(m: dict, where) -> None:
    """Refuse a mark whose seal is missing or does not match its fields (LedgerIntegrityError)."""
    if m.get(SEAL) != mark_seal(m):
        raise LedgerIntegrityError(
            f"{where}: the ledger's high-water mark does not match its own sha256 (edited by hand, or written by an "
            "indknn before 2026-11-28); refusing: a rollback could not be detected. `indknn repair` retires every "
            "record (no refund)")


def _short(h: str | None) -> str:
    return f"{h[:12]}…" if isinstance(h, str) else repr(h)


# -- snapshots ------------------------------------------------------------------------
def snapshot_is_chained(meta: dict) -> bool:
    return meta.get("chain") == CHAIN_VERSION


def snapshot_head(meta: dict) -> str | None:
    """The chain head a snapshot folded; GENESIS for a ledger without events; None: unknown (legacy)."""
    if snapshot_is_chained(meta):
        return meta.get("chain_head_sha256")
    return GENESIS if int(meta.get("last_event_seq", 0)) == 0 else None


def head_seq(ledger) -> int:
    return max(ledger.last_event_seq, ledger.snapshot_event_seq)


def snapshot_chain_fields(ledger, answers_sha256: str) -> dict:
    """Metadata a new snapshot records: the chain head it folds, and its answers file's hash."""
    return {"chain": CHAIN_VERSION, "chain_head_seq": head_seq(ledger), "chain_head_sha256": ledger.head_sha256,
            "answers_sha256": answers_sha256}


# -- events ------------------------------------------------------------------------------
def check_unique_seqs(path: Path, files: list[tuple[int, Path]]) -> None:
    for (s1, p1), (s2, p2) in zip(files, files[1:]):
        if s1 == s2:
            raise LedgerIntegrityError(f"{path}/events: {p1.name} and {p2.name} share sequence number {s1} "
                                       "(two writers, or an event copied in); refusing the ledger")


def events_after_snapshot(path: Path, files: list[tuple[int, Path]], snap_seq: int) -> list[tuple[int, Path]]:
    """The events to replay: exactly snap_seq+1, snap_seq+2, ... (a gap is a removed event)."""
    after = [(s, p) for s, p in files if s > snap_seq]
    for k, (s, p) in enumerate(after):
        if s != snap_seq + 1 + k:
            raise LedgerIntegrityError(
                f"{path}/events: event {snap_seq + 1 + k} is missing (the snapshot ends at event {snap_seq}, "
                f"the next file is {p.name}); a removed event would refund its charges: refusing the ledger"
            )
    return after


def check_link(event_path: Path, seq: int, info: dict, *, prev: str, snapshot: str, chained: bool) -> bool:
    """Check one event's place in the chain; returns whether the chain has started (chained events seen)."""
    if info.get("seq") != seq:
        raise LedgerIntegrityError(f"{event_path}: the file name says event {seq}, its metadata event "
                                   f"{info.get('seq')!r} (renamed, reordered or copied in); refusing the ledger")
    if "prev_sha256" not in info:
        if chained:
            raise LedgerIntegrityError(f"{event_path}: event {seq} carries no hash link but the ledger's chain "
                                       "has started (an old event copied in?); refusing the ledger")
        return False
    if info.get("snapshot_sha256") != snapshot:
        raise LedgerIntegrityError(f"{event_path}: event {seq} builds on snapshot sha256 "
                                   f"{_short(info.get('snapshot_sha256'))}, this ledger's snapshot is "
                                   f"{_short(snapshot)} (copied in from another state, or the snapshot was edited); "
                                   "refusing the ledger")
    if info.get("prev_sha256") != prev:
        raise LedgerIntegrityError(f"{event_path}: event {seq} links to sha256 {_short(info.get('prev_sha256'))}, "
                                   f"but its predecessor's is {_short(prev)}: an event was edited, removed, "
                                   "reordered or copied in; refusing the ledger")
    return True
