"""Exclusive flock locks that survive their lock file being removed or replaced (issue 16 §1).

A lock on a file opened by path protects nothing once the file is unlinked:
the next process creates a new file at the path and locks *that*. Two measures:

* the folder itself is locked (an ``O_RDONLY`` descriptor of the directory):
  removing a file inside it cannot release it;
* the lock file (kept so that older indknn versions, which lock only the file,
  still exclude us) is checked after ``flock``: the descriptor must name the
  file now at the path (same ``st_dev`` and ``st_ino``); if the path is gone or
  names another file, the descriptor is closed and the lock taken again.

The same check applies to the folder: a folder swapped at its path (store
compaction renames a new folder into place) is locked again at the new inode.
Every lock is taken in a fixed order (folder, then file), waiting at most until
one deadline.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterator


log = logging.getLogger(__name__)


class _Expired(Exception):
    pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def _lock_one(path: Path, deadline: float, *, directory: bool) -> int:
    """flock ``path`` (a folder, or a file created if missing); a descriptor that still names ``path``."""
    while True:
        if directory:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        else:
            _set_aside_if_not_a_file(path, deadline)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            waited = None
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if waited is None:  # --verbose: a cron job that seems stuck is waiting for another process
                        waited = time.monotonic()
                        log.info("waiting for the lock on %s (another process holds it; at most %.0f s more)",
                                 path, max(0.0, deadline - waited))
                    if time.monotonic() >= deadline:
                        log.info("gave up waiting for the lock on %s", path)
                        raise _Expired() from None
                    time.sleep(0.05)
            if waited is not None:
                log.info("took the lock on %s after %.1f s", path, time.monotonic() - waited)
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # locked a file no longer at the path: take the lock again
        if time.monotonic() >= deadline:
            raise _Expired()


def _set_aside_if_not_a_file(path: Path, deadline: float) -> None:
    """A lock file's path holding anything but a regular file (a folder, a link, a named pipe: made by hand or by a
    sync tool) is renamed aside, beside it, and a fresh lock file is made. It stopped every writer with "cannot open
    the lock (Is a directory); is the ledger on a read-only file system?" or "the ledger folder keeps disappearing"
    (a dangling link), `repair` the same, and in the store's folder it blocked `delete` outright (review 54, F6). A
    lock file holds nothing; what stood there is kept under its new name.

    The look and the rename run under a flock of a sibling file (``.<name>.set-aside``), and the look is taken again
    there: without it, a process that had looked could rename aside the fresh lock file another process had made
    and locked meanwhile, and both would hold "the lock" (review 56, F1). A regular file is never renamed, so a
    process that finds one (no lock of this kind taken) cannot be disturbed."""
    import fcntl
    import stat

    if _regular_or_absent(path):
        return
    guard = path.with_name(f".{path.name}.set-aside")
    try:
        fd = os.open(guard, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        from .errors import StorageError

        raise StorageError(f"{path} is not a file (a folder or a link stands there) and {guard} cannot be made to set "
                           f"it aside ({exc.strerror}); remove {path} by hand") from None
    try:
        while True:  # held for a look and a rename only; waited for within the lock's own deadline (review 57, F6)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise _Expired() from None
                time.sleep(0.05)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode):  # another process set it aside and made the lock file meanwhile
            return
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode)
                else "not a regular file")
        aside = path.with_name(f"{path.name}.not-a-file-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}")
        try:
            os.rename(path, aside)
        except OSError as exc:
            from .errors import StorageError

            raise StorageError(f"{path} is {kind}, not indknn's lock file, and cannot be renamed aside "
                               f"({exc.strerror}); remove it by hand") from None
    finally:
        os.close(fd)
    log.warning("%s was %s, not indknn's lock file: renamed to %s and a new lock file made", path, kind, aside.name)


def _regular_or_absent(path: Path) -> bool:
    import stat

    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True


@contextlib.contextmanager
def exclusive(folder: Path, lock_file: Path, *, timeout: float,
              on_timeout: Callable[[], Exception]) -> Iterator[None]:
    """Hold flock on ``folder`` and on ``lock_file`` (in that order) for the ``with`` block."""
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    try:
        try:
            fds.append(_lock_one(Path(folder), deadline, directory=True))
            fds.append(_lock_one(Path(lock_file), deadline, directory=False))
        except _Expired:
            raise on_timeout() from None
        yield
    finally:
        for fd in reversed(fds):
            os.close(fd)



@contextlib.contextmanager
def exclusive_file(lock_file: Path, *, timeout: float, on_timeout: Callable[[], Exception]) -> Iterator[None]:
    """Hold flock on ``lock_file`` alone (created if missing; the descriptor must still name the file at the
    path). For locks taken while the folder lock of :func:`exclusive` is held by the same process: flock on
    the folder through a second descriptor would wait for ourselves."""
    try:
        fd = _lock_one(Path(lock_file), time.monotonic() + timeout, directory=False)
    except _Expired:
        raise on_timeout() from None
    try:
        yield
    finally:
        os.close(fd)


def missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its ancestors that do not exist yet, deepest first (what ``mkdir -p`` would create)."""
    out: list[Path] = []
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def remove_unused(created: list[Path], lock_file: Path) -> None:
    """A refused or read-only run leaves nothing behind: when the folders in ``created`` (deepest first) hold
    nothing but ``lock_file``, remove it and them. Called with the lock still held; a waiter that then finds
    the folder gone takes the lock again on a new one (:func:`_lock_one` checks the path)."""
    if not created:
        return
    try:
        if {e.name for e in os.scandir(created[0])} - {Path(lock_file).name}:
            return
        Path(lock_file).unlink(missing_ok=True)
        for p in created:
            p.rmdir()
    except OSError:  # someone else wrote there meanwhile: keep what is there
        pass
