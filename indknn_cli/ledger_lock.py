"""The ledger's writer lock, and the early check that a ledger folder can be written (nothing written)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from . import ledger_snapshot, locking
from .errors import LockTimeoutError, StorageError


def check_writable(path: str | os.PathLike) -> None:
    """Refuse early (StorageError) when the ledger's lock cannot be opened for writing; writes nothing."""
    path = Path(path)
    try:
        fd = os.open(path / "LOCK", os.O_RDWR)
    except FileNotFoundError:
        return  # created by the first writer; the folder itself is checked there
    except OSError as exc:
        raise StorageError(f"{path}: cannot open the ledger lock for writing ({exc.strerror}); "
                           "is the ledger on a read-only file system?") from None
    os.close(fd)
    for folder in (path, path / "events"):  # review 64, F2: a writable LOCK in a folder that is not writable
        # passed, the query file was embedded, then the event write failed (access(2): nothing written)
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise StorageError(f"{folder}: the ledger's folder cannot be written (permissions, or a read-only "
                               "file system); nothing was written")


@contextlib.contextmanager
def write_lock(path: str | os.PathLike, *, timeout: float = 60.0) -> Iterator[None]:
    """One writer at a time: flock on the ledger folder and on ``LOCK`` (:mod:`.locking`: removing or
    replacing ``LOCK`` releases nothing); waits up to ``timeout`` seconds."""
    path = Path(path)

    def expired() -> LockTimeoutError:
        return LockTimeoutError(f"{path}: another indknn process holds the ledger lock (waited {timeout:g} s); "
                                "retry later or raise --lock-timeout")
    for attempt in range(5):  # a folder another run created, then removed unused (locking.remove_unused)
        stack = contextlib.ExitStack()
        try:
            # inside the try: a parent that cannot be searched raised a raw PermissionError, before `delete`'s
            # erase-from-the-store fallback for a ledger it cannot reach (review 56, observation)
            created = locking.missing_folders(path)
            path.mkdir(parents=True, exist_ok=True)
            stack.enter_context(locking.exclusive(path, path / "LOCK", timeout=timeout, on_timeout=expired))
            break
        except FileNotFoundError:
            if attempt == 4:
                raise StorageError(f"{path}: the ledger folder keeps disappearing") from None
        except OSError as exc:  # a read-only file system or no permission: an I/O failure, not bad input
            raise StorageError(f"{path}: cannot open the ledger lock for writing ({exc.strerror}); "
                               "is the ledger on a read-only file system?") from None
    with stack:
        try:
            yield
        finally:  # no ledger written in folders this lock created (a refusal, a ledger-less delete): remove them
            if not ledger_snapshot.ledger_exists(path):
                locking.remove_unused(created, path / "LOCK")
