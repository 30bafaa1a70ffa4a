"""Durable local writes, the generic part: temporary name → fsync → rename → fsync of the folder.

A write the file system refuses (disk full, read-only, ...) is a :class:`StorageError` naming the file, and
the temporary file is removed: nothing was renamed into place, the previous state is kept. A leaf module (the
standard library and :mod:`.errors` only): the ledger's commit protocol (:mod:`.ledger_files`), the store, the
object-storage pointer and the answers file all write through it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable

from .errors import StorageError


def fsync_dir(path: Path) -> None:
    """fsync a folder (or file): its entries, after a rename into it. A missing path is an OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or folder (durability of a rewrite); a missing path is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def storage_error(path: Path, exc: OSError) -> StorageError:
    """A refused write (disk full, read-only file system, ...) as a runtime error naming the file."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    err = StorageError(f"{path}: cannot write ({reason}); the file was not replaced, the previous state is kept")
    err.path, err.reason = path, reason
    return err


def atomic_replace(path: Path, write_tmp, *, before_rename: Callable[[], None] | None = None,
                   place: Callable[[Path, Path], None] | None = None):
    """``write_tmp(tmp)`` writes and fsyncs a temporary file beside ``path`` (its return value is returned),
    then rename → fsync directory. A refused write (disk full, read-only, ...) is a StorageError naming
    ``path``, and the temporary file is removed: nothing was renamed into place, the previous state is kept.
    ``before_rename``: called after the write, before the rename (a fault point of the crash tests).
    ``place(tmp, path)``: puts the file in place instead of :func:`os.replace` (the ledger's events: never
    replaced)."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        out = write_tmp(tmp)
        if before_rename is not None:
            before_rename()
        if place is not None:
            place(tmp, path)
        else:
            os.replace(tmp, path)
    except OSError as exc:  # ENOSPC, EROFS, EACCES, EDQUOT, ...: nothing was renamed into place
        raise storage_error(path, exc) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return out


def write_synced(tmp: Path, data, mode: str = "wb") -> None:
    """Write ``data`` to ``tmp`` and fsync it."""
    with open(tmp, mode) as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(text: str, path: Path) -> None:
    atomic_replace(path, lambda tmp: write_synced(tmp, text, "w"))


def atomic_write_bytes(data: bytes, path: Path) -> None:
    atomic_replace(path, lambda tmp: write_synced(tmp, data, "wb"))
