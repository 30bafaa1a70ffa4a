"""A store and its ledger copied, and both copies served (review 42, M3).

Each copy of a store carries its own high-water mark, so each copy's ledger verifies against it, and every record
could spend its budget once in each copy: two budgets per record, which no file of either copy shows. A store copied
on another machine cannot be seen from here; one copied on this machine can: the ledger records the path of the store
it was made for (``store_path`` in its metadata), and when a writer runs with the store elsewhere while a store of the
same uuid is still at that path, the pair has a twin. ``serve-queries`` and ``index`` refuse (exit 2) until one copy
is removed or renamed; ``delete`` still erases (an erasure is never blocked) and says where the other copy is.
A pair moved with ``mv``, or copied with the original then removed, has no twin at the recorded path.

Not seen (review 43, M1/M2): copies of which none is at the recorded path (``cp -a A B; mv A C`` leaves B and C,
both served), and, from the original's side, any copy (``delete`` in the original cannot name the copy that still
holds the rows). Seeing those needs a record kept outside both copies (a per-machine registry of where each store
uuid was last written), which indknn does not keep. Nor a store copied before its first `index` (review 51,
F4): each copy can then be indexed with a ledger of its own, whose recorded path is that copy; indexing the same
rows twice is the operator's act, as embedding them into two stores would be.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import LedgerError


def twin_of(store, ledger) -> Path | None:
    """The recorded path of ``ledger``'s store when another copy of ``store`` is there: a store with ``store``'s uuid,
    or one bound to ``ledger``'s uuid (the original compacted since the copy was made: compaction gives a store a new
    uuid, review 50 F5), and it is not ``store`` itself; None otherwise (no recorded path, a relative one, nothing
    there, another store there)."""
    from .store import FeatureStore

    if getattr(store, "remote", None) is not None:  # one store in a bucket, seen through local state folders: its
        return None  # copies on several machines are the bucket's mark's job (docs/OBJECT_STORAGE.md)
    try:
        there = recorded_elsewhere(ledger, store.path)
        if there is None or not (there / "zarr.json").is_file():
            return None
        other = FeatureStore.open(there, mode="r")
    except Exception:  # noqa: BLE001 - unreadable or half-written: not a live copy to report
        return None
    if other.uuid == store.uuid:
        return there
    from .ledger_integrity import binding_of

    bound = binding_of(other) or {}
    return there if bound.get("ledger_uuid") == ledger.meta.get("ledger_uuid") else None


def recorded_elsewhere(ledger, here) -> Path | None:
    """The path of ``ledger``'s store as the ledger records it, when it is absolute, a folder is there and it is not
    the folder ``here``; else None. Where :func:`twin_of` and `account --verify` look for another copy."""
    recorded = str(ledger.meta.get("store_path") or "")
    if not recorded or not os.path.isabs(recorded) or not Path(recorded).is_dir():
        return None
    try:
        if Path(recorded).resolve() == Path(here).resolve() or os.path.samefile(recorded, here):
            return None
    except OSError:
        return None
    return Path(recorded)


def refuse_twin(store, ledger, ledger_path) -> None:
    """Before a writer charges or adds records: a live twin of this store at the ledger's recorded path → exit 2."""
    there = twin_of(store, ledger)
    if there is not None:
        raise LedgerError(
            f"{store.path}: another copy of this store (uuid {store.uuid}, or bound to the same ledger) is at {there}, "
            "the path the ledger "
            f"{ledger_path} was made for: the store and its ledger were copied, and serving from both copies would "
            "let every record spend its budget once in each. Keep one pair: remove or rename the other copy (a pair "
            "moved with `mv`, or copied and the original removed, is fine); `indknn delete` still erases in either")
