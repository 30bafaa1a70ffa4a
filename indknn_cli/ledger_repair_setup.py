"""What `indknn repair` puts back before it judges a ledger: a ``CURRENT`` that names a missing snapshot (or is
not readable) written back to the newest snapshot of this store's ledger, and the event files a repair killed while
it probed left aside. Neither retires anyone; the caller then checks the ledger against the store's high-water mark
(a ledger behind it is repaired by retiring every record: no refund)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from . import ledger_integrity as integrity
from .errors import LedgerIntegrityError
from .fsio import atomic_write_bytes, atomic_write_text
from .ledger_current import not_a_file
from .ledger_snapshot import current_missing
from .store import FeatureStore


def write_current_back(path: Path, store: FeatureStore, *, shown_path: Path) -> tuple[int | None, Path | None]:
    """When CURRENT names a snapshot that is missing (edited, or the snapshot removed: review 29), point it at the
    newest snapshot present that is this store's (and, for a bound store, its ledger's), and return that generation
    and where the old CURRENT is kept (relative to ``path``, under ``quarantine/``); (None, None) when CURRENT is
    fine. A stopped compaction's unpublished snapshot names the renumbered store and is passed over (review 32, F1:
    pointed at it, every later command, erasures included, was told to "run again"). The caller checks the ledger
    against the store's mark again (a ledger older than the mark is repaired by retiring every record: no refund)
    and puts CURRENT back if the repair fails."""
    cur = path / "CURRENT"
    not_file = not_a_file(cur) is not None  # a folder, a broken link, a named pipe, ... in its place: never read
    gen, named = None, "no snapshot (it is not the JSON pointer indknn writes)"  # garbage: as a missing one
    missing = current_missing(path)  # gone, the ledger's files left (review 54, F1)
    if missing:
        named = "nothing (it is missing)"
    elif not not_file:
        try:
            gen = int(json.loads(cur.read_text())["generation"])
            named = f"snapshot-{gen:06d}.parquet, which is missing"
        except FileNotFoundError:
            return None, None  # no CURRENT at all: not a ledger (refused before this)
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            pass
    if gen is not None and (path / f"snapshot-{gen:06d}.parquet").is_file():
        return None, None
    present = sorted(int(m.group(1)) for p in path.glob("snapshot-*.parquet")
                     if (m := re.fullmatch(r"snapshot-(\d{6})\.parquet", p.name)) and belongs(p, store))
    present = _vouched(path, store, present)
    if not present:
        raise LedgerIntegrityError(
            f"{shown_path}: CURRENT names {named}, and no other snapshot of this "
            "store's ledger is left: "
            "repair cannot rebuild the records' spent budgets; restore the ledger folder from a backup (one older "
            "than the store's high-water mark is refused), then run repair")
    folder = Path("quarantine") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (path / folder).mkdir(parents=True, exist_ok=True)
    if not_file:  # kept as it was (moved, not copied: a file cannot be written over it, and it is never read)
        os.replace(cur, path / folder / NOT_A_FILE)
    elif missing:  # nothing to keep: a note, so that a failed repair leaves CURRENT missing again
        (path / folder / WAS_MISSING).write_text("CURRENT was missing when repair ran\n")
    else:
        shutil.copy2(cur, path / folder / "CURRENT")
    atomic_write_text(json.dumps({"generation": present[-1]}), cur)
    return present[-1], folder


def _vouched(path: Path, store: FeatureStore, present: list[int]) -> list[int]:
    """The generations CURRENT may be written back to: with a high-water mark of this ledger in the store, those up
    to the mark's generation, and the one it announces (a compaction's next snapshot) only with the announced
    sha256. A snapshot file past them (a stray copy, one written by hand) was adopted as the newest: the repair then
    failed on its missing answers file, or took a forged base snapshot (review 54, F5). Without a mark, all."""
    try:
        mark = integrity.read_mark(store.path)
    except Exception:  # noqa: BLE001 - an unreadable or sealed-wrong mark vouches for nothing: as without one
        return present
    if not isinstance(mark, dict) or not isinstance(mark.get("generation"), int):
        return present
    kept = [g for g in present if g <= mark["generation"]]
    nxt = mark.get("next_generation")
    if isinstance(nxt, int) and nxt in present and nxt > mark["generation"]:
        snap = path / f"snapshot-{nxt:06d}.parquet"
        if integrity.sha256_bytes(snap.read_bytes()) == mark.get("next_snapshot_sha256"):
            kept.append(nxt)
    return sorted(kept)


#: Where :func:`write_current_back` keeps a CURRENT that was not a regular file (ledger_current.not_a_file), and the
#: note it leaves when there was none.
NOT_A_FILE = "CURRENT.not-a-file"
WAS_MISSING = "CURRENT.was-missing"


def put_current_back(path: Path, *, generation: int, kept_in: Path) -> None:
    """Undo :func:`write_current_back` after a repair that failed (so the ledger is in the state repair found: one
    pointed at a snapshot that then failed could block an erasure, review 32, F1), unless CURRENT changed since."""
    cur = path / "CURRENT"
    if not cur.is_file() or cur.read_bytes() != json.dumps({"generation": generation}).encode():
        return
    kept = path / kept_in
    if (kept / WAS_MISSING).is_file():
        cur.unlink()
    elif os.path.lexists(kept / NOT_A_FILE):
        cur.unlink()
        os.replace(kept / NOT_A_FILE, cur)
    else:
        atomic_write_bytes((kept / "CURRENT").read_bytes(), cur)


#: What an event file is named (a probe folder moves only those; review 40: a notes.txt went into events/).
_EVENT_NAME = re.compile(r"\d{8}-[^/]*\.parquet")


def put_back_probes(path: Path) -> list[str]:
    """Event files a repair killed while it probed left in ``.repair-probe-<pid>/`` go back to ``events/`` (the
    caller holds the ledger lock, so no live repair owns them); a name ``events/`` already holds stays beside the
    quarantine. Returns the names put back."""
    put = []
    for aside in sorted(path.glob(".repair-probe-*")):
        if not aside.is_dir() or aside.is_symlink():
            continue
        (path / "events").mkdir(exist_ok=True)
        for p in sorted(aside.iterdir()):
            target = path / "events" / p.name
            if p.is_file() and not p.is_symlink() and _EVENT_NAME.fullmatch(p.name) and not target.exists():
                os.replace(p, target)
                put.append(p.name)
            else:  # never overwrite an event; keep the copy for forensics
                folder = path / "quarantine" / f"{aside.name.lstrip('.')}"
                folder.mkdir(parents=True, exist_ok=True)
                os.replace(p, folder / p.name)
        aside.rmdir()
    return put


def belongs(snapshot: Path, store: FeatureStore) -> bool:
    """Whether a snapshot file names ``store`` (its uuid) and, when the store is bound, the bound ledger."""
    import pyarrow.parquet as pq

    try:
        meta = json.loads((pq.read_schema(snapshot).metadata or {})[b"indknn"])
    except Exception:  # noqa: BLE001 - unreadable: not a snapshot to point CURRENT at
        return False
    bound = (integrity.binding_of(store) or {}).get("ledger_uuid")
    return meta.get("store_uuid") == store.uuid and (bound is None or meta.get("ledger_uuid") == bound)
