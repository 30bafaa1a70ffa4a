"""Which feature store a ledger is opened for: a ledger of another store, a store compacted while a command ran or
left mid-compaction, or a ledger older than the store's compaction (restored from a backup), each refused in its
own words (split from ledger.py)."""

from __future__ import annotations

import time
from pathlib import Path

from .errors import ConcurrentChangeError, LedgerError, LedgerOlderThanStoreError
from .ledger_snapshot import unpublished_store_uuids


def _when(t) -> str:
    """A ledger time as UTC, for messages."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))
    except (TypeError, ValueError, OverflowError):
        return "time unknown"


def refuse_other_store(path: Path, meta: dict, *, generation: int, store_uuid: str,
                       store_compacted_from: frozenset[str]) -> None:
    """Raise for a ledger (``meta``, at ``generation``) opened for a store whose uuid is not the ledger's."""
    compaction = meta.get("store_compaction") or {}
    if compaction.get("from_store_uuid") == store_uuid:
        raise ConcurrentChangeError(
            f"{path}: the feature store was compacted (rows renumbered) while this command ran; nothing was "
            f"written; run the command again. If this repeats, the store is a copy taken before that "
            f"compaction ({_when(compaction.get('time'))}, token {compaction.get('token')}), whose rows the "
            "ledger no longer matches: restore the store from a copy taken after it (`indknn delete` "
            "erases from the store alone meanwhile)")
    if store_uuid in unpublished_store_uuids(path, generation):
        raise LedgerError(f"{path}: the ledger does not match the feature store: an `indknn delete "
                          "--compact` was interrupted; run `indknn delete --compact` to finish it")
    if meta["store_uuid"] in store_compacted_from:
        # review 54, F7: the ledger was written for this very store before a compaction it never saw (a
        # ledger folder restored from a backup taken before `delete --compact`): rolled back, not a wrong
        # pairing; it was called "another feature store" (naming the store given), exit 2
        raise LedgerOlderThanStoreError(
            f"{path}: this ledger is older than the feature store: it was written for the store before a "
            f"`delete --compact` (store uuid {meta['store_uuid']}, now {store_uuid}) and knows "
            "nothing of it, so it was rolled back (its folder restored from a backup taken before that "
            "compaction), which would refund the charges made since; refusing. Restore the ledger folder "
            "from a backup taken after the compaction (the store's high-water mark refuses an older one); "
            "`indknn delete` still erases meanwhile")
    raise LedgerError(
        f"{path}: this ledger belongs to another feature store ({meta['store_path']}); "
        "use the ledger created for this store"
    )
