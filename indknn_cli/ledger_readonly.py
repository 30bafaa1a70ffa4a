"""Opening a ledger for reading only (`account`, `export`, `verify`): no lock, no writes, a consistent state."""

from __future__ import annotations

import os
import time
from pathlib import Path

from .errors import LedgerError, LedgerIntegrityError


def _read_generation(path: Path) -> int | None:
    from .ledger_snapshot import current_generation

    return current_generation(path)  # CURRENT looked at before it is read (a named pipe would block)


def open_ledger_readonly(path: str | os.PathLike, *, store_uuid: str | None = None, retries: int = 40,
                         store_compacted_from: frozenset[str] = frozenset()):
    """Open a ledger for reading only: no lock, no writes, a consistent state.

    ``BudgetLedger.open`` reads CURRENT → snapshot → events. A compaction that
    runs in between (new snapshot, CURRENT switched, folded events deleted)
    could leave a reader with the old snapshot and only the *later* events: a
    state that never existed. Compaction deletes events only after switching
    CURRENT, so if CURRENT names the same generation after the read as the one
    that was read, no event was deleted during the read; otherwise read again.
    """
    from .ledger import BudgetLedger

    path = Path(path)
    if not BudgetLedger.exists(path):
        raise LedgerError(f"{path}: no budget ledger here (create one with `indknn index`)")
    for _ in range(retries):
        try:
            ledger = BudgetLedger.open(path, store_uuid=store_uuid, retries=1,
                                       store_compacted_from=store_compacted_from)
        except LedgerError as exc:
            if "changed while reading" not in str(exc):
                raise
            gen = _read_generation(path)
            if gen is not None and not (path / f"snapshot-{gen:06d}.parquet").is_file():
                time.sleep(0.05)
                if _read_generation(path) == gen:
                    raise LedgerIntegrityError(
                        f"{path}: CURRENT names snapshot-{gen:06d}.parquet, which is missing (corrupt ledger)"
                    ) from None
            time.sleep(0.05)
            continue
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # e.g. unreadable JSON metadata or parameters: ledger.py only maps Parquet errors
            raise LedgerError(f"{path}: corrupt ledger metadata ({type(exc).__name__})") from None
        if _read_generation(path) == ledger.generation:
            return ledger
        time.sleep(0.01)  # compacted while we read: read again
    raise LedgerError(f"{path}: the ledger kept changing while reading; try again")
