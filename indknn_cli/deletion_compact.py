"""`delete --compact`'s store rewrite and the recovery of an interrupted one (the protocol: deletion.py's doc).

Moved out of deletion.py, which calls :func:`compact` with its test hooks and :func:`recover` before every delete.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from . import ledger_integrity as integrity
from . import object_store
from .compaction_copy import _fsync_tree, _write_compacted_copy
from .errors import LedgerError, LedgerIntegrityError
from .fsio import atomic_write_text, fsync_path
from .ledger import BudgetLedger
from .ledger_snapshot import unpublished_store_uuids
from .store import FeatureStore
from .wording import count

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class LedgerUnreadable(Exception):
    """The ledger exists but cannot be read (truncated or corrupt event, snapshot, CURRENT, ...)."""

    def __init__(self, error: LedgerError):
        super().__init__(str(error))
        self.error = error


# -- recovery of an interrupted compaction ------------------------------------------
def _leftovers(store_path: Path) -> list[Path]:
    """Copies of this store left by a compaction: ``.<name>.compacting-<token>`` and ``.<name>.old-<token>``, the
    token 12 hex digits. Matched on the exact name, never as a glob pattern: a store named ``a[1].zarr`` matched
    another store's copies (``.a1.zarr.old-…``), and a serve removed them (review 28); ``..<name>.compacting-…``,
    once matched too, is the copy of a store named ``.<name>`` (review 29, F3)."""
    parent, name = store_path.parent, store_path.name
    pattern = re.compile(rf"\.{re.escape(name)}\.(?:compacting|old)-[0-9a-f]{{12}}")
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries if pattern.fullmatch(p.name))


def leftover_note(store_path: Path) -> str | None:
    """A note when copies of the store from an interrupted or unfinished compaction are still beside it (they may
    hold erased vectors), for a delete that cannot run the recovery step (its ledger unreadable: review 19)."""
    left = _leftovers(store_path)
    if not left:
        return None
    return (f"incomplete: {count(len(left), 'earlier copy', 'earlier copies')} of the store from a compaction "
            "are still beside it and may hold erased vectors (not removed while the ledger cannot be read); run "
            "`indknn delete --compact` once the ledger is readable (or `indknn repair`)")


def erase_in_leftovers(store_path: Path, record_ids, user_ids) -> int:
    """For a delete that cannot run the recovery step: erase the requested ids in every copy a stopped compaction
    left beside the store: a local folder, or the state folder of a copy in the bucket (`<name>.compacted-<token>`,
    reached since 2026-11-28). They are copies of the same people; the live store's rows are erased by the caller.
    Review 32, F5: the copy kept the vector of a person whose erasure was accepted, and nothing removed it while the
    ledger could not be read. Returns the rows erased; a copy that cannot be opened is left to the note."""
    from . import indexes
    from .indexes.storage import remove_stale_copies
    from .store import FeatureStore

    from .id_text import canonical

    # NFC forms, as the live store's plan compares them (review 56, F2: a copy kept a decomposed id's vector)
    want_r, want_u = {canonical(r) for r in record_ids}, {canonical(u) for u in user_ids}
    erased = 0
    for copy in _leftovers(Path(store_path)):
        try:
            st = FeatureStore.open(copy, mode="a")
            if not st.n_rows("private"):
                continue
            rids, uids = st.read("private", "record_id"), st.read("private", "user_id")
            rows = np.flatnonzero([canonical(r) in want_r or (bool(u) and canonical(u) in want_u)
                                   for r, u in zip(rids, uids)])
            if rows.size:
                st.mark_deleted("private", rows)
                st.erase_rows("private", rows)
                erased += int(rows.size)
                indexes.remove_rows(st, rows)  # the copy's LSH codes / IVF entries too (review 39, F2)
            remove_stale_copies(st.path)  # no index writer runs in a compaction's copy
        except Exception as exc:  # noqa: BLE001 - a copy that cannot be read stays reported by leftover_note
            logging.getLogger(__name__).debug("copy %s not erased: %s", copy, type(exc).__name__)
            continue
    return erased


def recover_store_folder(store_path: Path) -> None:
    """The two-rename swap stopped between its renames: put the old store back (the ledger still binds it)."""
    if store_path.exists():
        return
    olds = [p for p in _leftovers(store_path) if p.name.startswith(f".{store_path.name}.old-")]  # exact names
    # A copy kept by an earlier cleanup (its objects emptied, object_store.remove) can sit beside the real one:
    # the one put back must be a readable store, or the real one would later be removed as a leftover (review 19).
    readable = [p for p in olds if _readable_store(p)]
    if olds:
        os.replace((readable or olds)[-1], store_path)
        fsync_path(store_path.parent)


def _readable_store(folder: Path) -> bool:
    """A store folder with its root metadata, or a state folder whose remote prefix has it (not emptied)."""
    try:
        loc = object_store.location(folder)
        if loc is not None:
            return object_store.exists(loc)
        meta = folder / "zarr.json"
        return meta.is_file() and meta.stat().st_size > 0
    except Exception:  # noqa: BLE001 - unreadable: not the one to put back
        return False


def recover(store: FeatureStore, ledger_path: Path, notes: list | None = None) -> BudgetLedger | None:
    """Bring store and ledger into agreement after an interrupted compaction; remove its leftovers (what cannot be
    removed is added to ``notes``, never raised: a cleanup never blocks the erasure that follows)."""
    ledger = None
    if BudgetLedger.exists(ledger_path):
        try:
            ledger = BudgetLedger.open(ledger_path)
        except LedgerError as exc:  # damaged: the caller still erases (issue 16 §3); no recovery step runs
            raise LedgerUnreadable(exc) from None
        if ledger.meta["store_uuid"] != store.uuid:
            gen = unpublished_store_uuids(ledger_path, ledger.generation).get(store.uuid)
            meta = _snapshot_meta(ledger_path, gen) if gen is not None else {}
            if (meta.get("store_compaction") or {}).get("from_store_uuid") != ledger.meta["store_uuid"]:
                return BudgetLedger.open_for(ledger_path, store)  # raises: another store's ledger
            try:
                mark = integrity.read_mark(store.path)
            except LedgerIntegrityError:
                mark = None
            if not integrity.announced(mark, gen, _file_sha(ledger_path, gen)):
                # the store's mark did not announce that snapshot (audit 10, F1): not rolled forward, nothing
                # changed; the caller erases without the ledger (an erasure never waits on a damaged ledger)
                raise LedgerUnreadable(LedgerIntegrityError(
                    f"{ledger_path}: snapshot-{gen:06d}.parquet names this store, but the store's high-water mark "
                    "never announced it: not a compaction of indknn's (written or edited by hand); the ledger is "
                    "left as it is. `indknn repair` retires every record (no refund)"))
            atomic_write_text(json.dumps({"generation": gen}), ledger_path / "CURRENT")  # roll forward
            ledger = BudgetLedger.open_for(ledger_path, store)
            ledger.mark_path = integrity.mark_path(store.path)
            ledger.publish_generation(gen)  # drops the folded events and the old generation; the mark names gen
    discard_unpublished(store, ledger, notes)
    return ledger


def discard_unpublished(store: FeatureStore, ledger: BudgetLedger | None, notes: list | None = None) -> None:
    """Remove what a compaction that stopped before its publication left: snapshots and answers files past
    ``CURRENT`` and copies of the store beside it (never raised: what cannot be removed goes to ``notes``). Every
    ledger writer runs it under the ledger lock (no compaction runs then): a copy left there carries a mark that
    announces the unpublished snapshot, and the pair could be swapped back in to roll the ledger back (review 27,
    F3)."""
    if ledger is not None:
        for p in ledger.path.glob("*-*.parquet"):  # snapshots/answers written past CURRENT: never published
            stem = p.name.split("-", 1)[1][:-len(".parquet")]
            if p.name.split("-", 1)[0] in ("snapshot", "answers") and stem.isdigit() and int(stem) > ledger.generation:
                p.unlink(missing_ok=True)
    for p in _leftovers(store.path):
        note = object_store.remove(p)  # a state folder: its remote prefix too
        if note is not None and notes is not None:
            notes.append(note)


def _file_sha(ledger_path: Path, generation: int) -> str | None:
    try:
        return integrity.sha256_bytes((ledger_path / f"snapshot-{generation:06d}.parquet").read_bytes())
    except OSError:
        return None


def _snapshot_meta(ledger_path: Path, generation: int) -> dict:
    import pyarrow.parquet as pq

    try:
        return json.loads((pq.read_schema(ledger_path / f"snapshot-{generation:06d}.parquet").metadata or {})[b"indknn"])
    except Exception:  # noqa: BLE001
        return {}


# -- compaction ----------------------------------------------------------------------
def compact(store: FeatureStore, ledger: BudgetLedger | None, *, fault: Callable[[str], None],
            use_exchange: bool, index_hook: Callable[[str], Callable | None]) -> dict:
    """Rewrite the store without deleted rows and fold the ledger into a renumbered snapshot (deletion's module doc).

    ``fault`` is called at each step (tests), ``use_exchange`` allows the atomic folder exchange, ``index_hook``
    finds the candidate index's ``renumber_rows`` (deletion passes its own, which tests can replace)."""
    n = store.n_rows("private")
    flagged = store.read("private", "deleted").astype(bool) if n else np.zeros(0, bool)
    removed = int(flagged.sum())
    out = {"store_rows_removed": removed, "store_rows": n - removed, "store_bytes_written": 0,
           "ledger_events_folded": 0, "store_uuid": store.uuid}
    if removed == 0:
        if ledger is not None:
            out["ledger_events_folded"] = ledger.compact()
        return out
    store.check_key_rows()  # a damaged key array: refused before the copy's folder exists
    keep = np.flatnonzero(~flagged)
    new_row_of = np.full(n, -1, dtype=np.int64)
    new_row_of[keep] = np.arange(keep.size)
    token = uuid.uuid4().hex[:12]
    new_uuid = uuid.uuid4().hex
    tmp = store.path.with_name(f".{store.path.name}.compacting-{token}")
    with _new_store_lock(tmp) as lock_new:
        _write_compacted_copy(store, tmp, keep, new_uuid)
        hook = index_hook("renumber_rows")
        if hook is not None:  # the copy's candidate index, renumbered before the copy becomes the store
            hook(FeatureStore.open(tmp, mode="a"), new_row_of)
        out["store_bytes_written"] = _fsync_tree(tmp)
        lock_new()  # hold the new folder's lock too: after the swap it is the store's lock
        fault("compact-copied")
        gen = None
        if ledger is not None:
            gen = ledger.prepare_renumbered_snapshot(new_row_of=new_row_of, store_uuid=new_uuid, info={
                "time": time.time(), "rows_removed": removed, "token": token})
        if ledger is not None and ledger.mark_path is not None:  # the copy's mark announces snapshot gen too
            integrity.carry_mark(store.path, tmp)
        fault("compact-ledger-prepared")
        garbage = _swap(tmp, store.path, token, fault=fault, use_exchange=use_exchange)
        fault("compact-swapped")
        if ledger is not None:
            out["ledger_events_folded"] = ledger.publish_generation(gen)
        fault("compact-published")
        note = object_store.remove(garbage)  # on object storage: the old prefix's objects too
        if note is not None:  # after the swap and the publish: reported, never raised (the report is printed)
            out["leftover"] = note
    out["store_uuid"] = new_uuid
    return out


@contextlib.contextmanager
def _new_store_lock(folder: Path) -> Iterator[Callable[[], None]]:
    fds: list[int] = []

    def take() -> None:  # the folder and its lock file, as FeatureStore.write_lock takes them
        for path, flags in ((folder, os.O_RDONLY), (folder / FeatureStore.LOCK_NAME, os.O_RDWR | os.O_CREAT)):
            fd = os.open(path, flags, 0o644)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh folder: nobody else can hold it

    try:
        yield take
    finally:
        for fd in fds:
            os.close(fd)


def _swap(new: Path, store_path: Path, token: str, *, fault: Callable[[str], None], use_exchange: bool) -> Path:
    """Put ``new`` at ``store_path``; returns where the old store now is (to be removed)."""
    if use_exchange and _rename_exchange(new, store_path):
        fsync_path(store_path.parent)
        return new
    old = store_path.with_name(f".{store_path.name}.old-{token}")
    os.rename(store_path, old)
    fault("compact-half-swapped")
    os.rename(new, store_path)
    fsync_path(store_path.parent)
    return old


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0
