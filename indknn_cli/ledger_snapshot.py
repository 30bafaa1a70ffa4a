"""A ledger's snapshot files: reading generation g, the record table written for it, leftovers past CURRENT.

A snapshot is ``snapshot-<g>.parquet`` (one row per record ever indexed, the ledger's metadata in its footer)
beside ``answers-<g>.parquet`` (every answer released up to it); ``CURRENT`` names the generation in use
(docs/FORMAT.md). Checking the snapshot against the hash chain is :mod:`.ledger_integrity`'s job; replaying
the events after it is :mod:`.ledger_events`'.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import FORMAT_VERSION, ledger_history
from .errors import LedgerError, LedgerIntegrityError
from .ledger_chain import snapshot_is_chained
from .ledger_current import not_a_file
from .ledger_state import RECORD_SCHEMA, LedgerState, PrivacyParams

__all__ = ["Snapshot", "current_generation", "read_snapshot", "record_table", "unpublished_store_uuids"]


@dataclass
class Snapshot:
    """What :func:`read_snapshot` read: the generation, its metadata and state, and the files' bytes."""

    generation: int
    path: Path
    meta: dict
    state: LedgerState
    snap_bytes: bytes
    answers_bytes: bytes


def ledger_exists(path: str | os.PathLike) -> bool:
    """A ledger is here when anything named CURRENT is: a folder or a broken link in its place is a damaged
    ledger (opening it says so; `indknn repair` writes it back), never "no ledger", which would let `index`
    make a second one beside the store's snapshots (review 40, left). So is a folder whose CURRENT is gone but
    that holds the ledger's events or a later snapshot (review 54, F1: "no ledger here, create one with
    `indknn index`", exit 2, and `repair` refused it too); a lone first snapshot is a creation that stopped."""
    path = Path(path)
    return os.path.lexists(path / "CURRENT") or current_missing(path)


def current_missing(path: Path) -> bool:
    """Whether ``path`` is a used ledger whose CURRENT is gone: an event file, or a snapshot past the first, without
    anything named CURRENT (removed by hand, by a sync tool, a backup restored in part)."""
    path = Path(path)
    try:  # a folder that cannot be searched: not this check's to say (review 56: it raised where `exists` did not)
        if os.path.lexists(path / "CURRENT") or not os.path.isdir(path):
            return False
        if any(path.glob("events/[0-9]*.parquet")):
            return True
        return any(p.name != "snapshot-000000.parquet" for p in path.glob("snapshot-[0-9]*.parquet"))
    except OSError:
        return False


def current_generation(path: Path) -> int | None:
    """The generation CURRENT names, or None where it is missing or unreadable (or not a file: never read)."""
    if not_a_file(path / "CURRENT") is not None:
        return None
    try:
        return int(json.loads((path / "CURRENT").read_text())["generation"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_snapshot(path: Path) -> Snapshot:
    """Read the snapshot CURRENT names (FileNotFoundError passes through: a compaction may have removed it)."""
    cur = path / "CURRENT"
    if current_missing(path):
        present = sorted(p.name for p in path.glob("snapshot-*.parquet"))
        raise LedgerIntegrityError(
            f"{path}/CURRENT is missing (removed by hand, by a sync tool, or a backup restored in part) while the "
            f"ledger's files are there (snapshots: {', '.join(present) or 'none'}): the ledger is damaged; `indknn "
            "repair` writes CURRENT back to the newest snapshot of this store's ledger (nobody is retired when the "
            "store's high-water mark then agrees); `indknn delete` still erases meanwhile")
    kind = not_a_file(cur)  # looked at, never read: a named pipe would block (review 43, H1)
    if kind is not None:
        raise LedgerIntegrityError(
            f"{path}/CURRENT: not a file ({kind} in its place): the ledger is damaged; `indknn repair` keeps it "
            "under quarantine/ and writes CURRENT back to the newest snapshot (nobody is retired when the store's "
            "high-water mark then agrees)")
    try:
        current = json.loads(cur.read_text())
        generation = int(current["generation"])
    except (ValueError, KeyError, TypeError):
        raise LedgerIntegrityError(f"{path}/CURRENT: corrupt (not the JSON pointer indknn writes)") from None
    snap_path = path / f"snapshot-{generation:06d}.parquet"
    try:
        snap_bytes = snap_path.read_bytes()
        answers_bytes = (path / f"answers-{generation:06d}.parquet").read_bytes()
        snap = pq.read_table(pa.BufferReader(snap_bytes))
        answers = ledger_history.LazyAnswers(answers_bytes, where=f"{path}/answers-{generation:06d}.parquet")
    except FileNotFoundError:
        raise
    except Exception as exc:
        # not repairable in place (repair rebuilds from the snapshot; audit 10, F3): say what does work
        raise LedgerIntegrityError(f"{snap_path}: corrupt or truncated Parquet ({type(exc).__name__}); restore "
                                   "the ledger folder from a backup, then run `indknn repair` (it retires every "
                                   "record: no refund); `indknn delete` still erases meanwhile") from None
    raw_meta = (snap.schema.metadata or {}).get(b"indknn")
    if raw_meta is None:
        raise LedgerError(f"{snap_path}: not an indknn ledger snapshot (no metadata)")
    try:
        meta = json.loads(raw_meta)
        version = meta.get("format_version")
    except (ValueError, AttributeError):
        raise LedgerError(f"{snap_path}: ledger metadata is corrupt (not what indknn writes)") from None
    if version != FORMAT_VERSION:  # before the fields: a newer format may have other ones
        raise LedgerError(f"{path}: ledger format_version {version!r}, this indknn reads {FORMAT_VERSION}")
    try:
        PrivacyParams(**meta["params"])
    except (ValueError, KeyError, TypeError):
        raise LedgerError(f"{snap_path}: ledger metadata is corrupt (not what indknn writes)") from None
    if snap.schema.remove_metadata() != RECORD_SCHEMA:
        raise LedgerError(f"{snap_path}: unexpected columns (foreign or corrupt ledger)")
    if not snapshot_is_chained(meta):  # its answers file's sha256 is not checked: read the columns
        answers.distrust_summary()
    state = LedgerState(
        record_id=np.asarray(snap.column("record_id").to_numpy(zero_copy_only=False), dtype=object),
        user_id=np.asarray(snap.column("user_id").to_numpy(zero_copy_only=False), dtype=object),
        row=snap.column("row").to_numpy().astype(np.int64),
        budget=snap.column("budget").to_numpy().astype(np.float64),
        spent=snap.column("spent").to_numpy().astype(np.float64),
        times_selected=snap.column("times_selected").to_numpy().astype(np.int64),
        deleted=snap.column("deleted").to_numpy(zero_copy_only=False).astype(bool),
        deleted_at=snap.column("deleted_at").to_numpy(zero_copy_only=False).astype(np.float64),
        last_change=snap.column("last_change").to_numpy().astype(np.float64),
    )
    state._answers_src = answers if answers.num_rows else None
    state.batches = list(meta.get("batches", []))
    state.history = list(meta.get("history", []))
    state.answers_not_held = int(meta.get("answers_not_held", 0))
    state.seeded_not_held = int(meta.get("seeded_not_held", 0))
    seen = meta.get("store_seen")
    state.store_seen = seen if isinstance(seen, dict) else None
    erase = meta.get("rows_to_erase")
    state.rows_to_erase = erase if isinstance(erase, dict) else None
    erased = meta.get("erased_rows")
    state.erased_rows = erased if isinstance(erased, dict) else None
    return Snapshot(generation, snap_path, meta, state, snap_bytes, answers_bytes)


def record_table(s: LedgerState, meta: dict, *, c1: float) -> pa.Table:
    """The snapshot's record table for state ``s``, ``meta`` in its footer."""
    return pa.table({
        "record_id": pa.array(list(s.record_id), pa.string()),
        "user_id": pa.array(list(s.user_id), pa.string()),
        "row": pa.array(s.row, pa.int64()), "budget": pa.array(s.budget, pa.float64()),
        "spent": pa.array(s.spent, pa.float64()),
        "times_selected": pa.array(s.times_selected, pa.int64()),
        "status": pa.array(list(s.status(c1)) if len(s) else [], pa.string()),
        "deleted": pa.array(s.deleted, pa.bool_()), "deleted_at": pa.array(s.deleted_at, pa.float64()),
        "last_change": pa.array(s.last_change, pa.float64()),
    }, schema=RECORD_SCHEMA).replace_schema_metadata({b"indknn": json.dumps(meta).encode()})


def unpublished_store_uuids(path: Path, generation: int) -> dict[str, int]:
    """store_uuid → generation of snapshots written past CURRENT's (an interrupted store compaction)."""
    out: dict[str, int] = {}
    for p in Path(path).glob("snapshot-*.parquet"):
        stem = p.name[len("snapshot-"):-len(".parquet")]
        if not stem.isdigit() or int(stem) <= generation:
            continue
        try:
            meta = json.loads((pq.read_schema(p).metadata or {})[b"indknn"])
            out[str(meta["store_uuid"])] = int(stem)
        except Exception:  # noqa: BLE001 - a torn leftover is no candidate
            continue
    return out
