"""The one commit protocol of every ledger file: temporary name → fsync → rename → fsync of the folder.

The generic steps are :mod:`.fsio`'s; here, what only the ledger needs: its Parquet files, events never
replaced, the crash tests' fault hook, and the check of a folder before a ledger is created there.

A write the file system refuses (disk full, read-only, ...) is a :class:`StorageError` naming the file, and
the temporary file is removed: nothing was renamed into place, the previous state is kept. ``FAULT_HOOK``
lets the crash tests stop a commit between its steps.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from . import fsio
from .errors import BadInputError, LedgerError
from .ledger_chain import sha256_bytes


#: Test hook: called with a fault-point name at each step of a commit.
FAULT_HOOK: Callable[[str], None] | None = None


def _fault(point: str) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(point)


#: link(2) refused by the file system itself (no hard links there): checked, then renamed instead.
_NO_LINK = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def _place_new(tmp: Path, path: Path) -> None:
    """Put ``tmp`` at ``path`` only if nothing is there: an event file is never replaced (audit 2026-11-27: a
    late writer's rename must not overwrite the event another writer committed under the same name)."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        if not path.exists():
            os.replace(tmp, path)
            return
    raise LedgerError(f"{path}: an event with this name is already committed (another writer ran without the "
                      "ledger's lock?); this one was not written and nothing of it was released")


def _atomic_replace(path: Path, write_tmp, *, fault: str | None = None, exclusive: bool = False):
    """The one commit protocol of every ledger file (:func:`.fsio.atomic_replace`), with the crash tests' fault
    point ``fault`` before the rename. ``exclusive``: ``path`` must not exist yet (LedgerError if it does;
    :func:`_place_new`)."""
    return fsio.atomic_replace(path, write_tmp, before_rename=None if fault is None else lambda: _fault(fault),
                               place=_place_new if exclusive else None)


def atomic_write_parquet(table: pa.Table, path: Path, *, exclusive: bool = False) -> str:
    """temp name → fsync → rename → fsync directory. Returns the sha256 of the file's bytes (hash chain).
    ``exclusive`` (events): refused with LedgerError where ``path`` already exists, never replaced."""
    sink = pa.BufferOutputStream()
    # Dictionary encoding for the string columns only (kind, batch id, label names: few distinct values); a
    # serve event's numeric columns (a million charges at N = 10^6) gain nothing from it and wrote 1.5× slower.
    pq.write_table(table, sink, use_dictionary=[f.name for f in table.schema if pa.types.is_string(f.type)])
    data = memoryview(sink.getvalue())
    _atomic_replace(path, lambda tmp: fsio.write_synced(tmp, data), fault="event-written-tmp", exclusive=exclusive)
    return sha256_bytes(data)


#: Rows per row group of an answers file written by :func:`atomic_write_parquet_tables`.
ANSWERS_ROW_GROUP_ROWS = 1 << 17


def atomic_write_parquet_tables(tables, schema: pa.Schema, path: Path, *,
                                row_group_rows: int = ANSWERS_ROW_GROUP_ROWS) -> str:
    """:func:`atomic_write_parquet` for a table given in parts (``tables``, each of ``schema``): row groups of
    about ``row_group_rows`` rows are appended to the temporary file one by one, so memory holds one row group,
    never the whole table or file (issue 21: a run of 2,000,000 answers ends with a compaction). The sha256 is
    read back from the written file before the rename."""
    import hashlib

    def write(tmp: Path) -> str:
        with pq.ParquetWriter(tmp, schema) as writer:
            pending, rows = [], 0
            for t in tables:
                if t.num_rows:
                    pending.append(t)
                    rows += t.num_rows
                if rows >= row_group_rows:
                    writer.write_table(pa.concat_tables(pending).combine_chunks())
                    pending, rows = [], 0
            if pending:
                writer.write_table(pa.concat_tables(pending).combine_chunks())
        h = hashlib.sha256()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()

    return _atomic_replace(path, write, fault="event-written-tmp")


_LEDGER_NAMES = re.compile(r"LOCK|events|quarantine|(snapshot|answers)-\d{6}\.parquet|\..*")


def refuse_foreign_folder(path: Path) -> None:
    """Before a new ledger is created at ``path``: a folder that already holds files no ledger writes (a data
    folder, a home directory given as --ledger by mistake) is refused (BadInputError, exit 2), nothing written;
    indknn would otherwise have added its files among them and later `repair`'s quarantine could move them. A
    missing or empty folder, or one holding only a ledger's own names (a creation that stopped), is fine."""
    if not path.is_dir():
        return
    try:
        foreign = sorted(p.name for p in path.iterdir() if not _LEDGER_NAMES.fullmatch(p.name))
    except OSError:
        return  # unreadable: the lock that follows reports it
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise BadInputError(f"--ledger {path}: the folder holds files that are not a ledger's ({shown}) and no "
                            "ledger (no CURRENT); give a new or empty folder for the ledger")
