"""Inputs that `embed` and `serve-queries` read through a temporary file: stdin spooled (every source is read
twice), a gzip-compressed file decompressed; and the sweep of those a killed process left behind.

The temporary files are named ``indknn-(stdin|gunzip)-<pid>-…`` in ``$TMPDIR``: they hold the input's rows, private
ones included, so the next reader removes those of processes that are gone (kill -9, or SIGTERM from cron or
systemd, skip the cleanup: review 40, M5); a live process's file is never taken.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO

from .errors import BadInputError


def sweep_stale_temporaries() -> int:
    """Remove the spooled stdin and decompressed inputs of indknn processes that are gone (kill -9, or SIGTERM from
    cron or systemd, skip the cleanup): they hold the input's rows, private ones included (review 40, M5). Named
    ``indknn-(stdin|gunzip)-<pid>-…`` so a live process's file is never taken."""
    import re

    removed = 0
    pattern = re.compile(r"indknn-(?:stdin|gunzip)-(\d+)-.*")
    try:
        entries = list(Path(tempfile.gettempdir()).iterdir())
    except OSError:
        return 0
    for p in entries:
        m = pattern.fullmatch(p.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or another user's: PermissionError below)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, ValueError):
            continue
        try:
            p.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def spool_stdin(stream: BinaryIO | None = None) -> Path:
    stream = stream if stream is not None else sys.stdin.buffer
    sweep_stale_temporaries()
    fd, name = tempfile.mkstemp(prefix=f"indknn-stdin-{os.getpid()}-")
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(stream, out, 1 << 20)
    return Path(name)


def gunzip(path: Path, display: str) -> Path:
    """A gzip-compressed input decompressed to a temporary file (decompression streams in O(1) memory; the file takes
    the decompressed size on disk, and the reader then reads it as it would the plain file; the caller removes it).
    A file that is not gzip or is cut short is bad input naming it, and no temporary file is left."""
    import gzip
    import zlib

    sweep_stale_temporaries()
    fd, name = tempfile.mkstemp(prefix=f"indknn-gunzip-{os.getpid()}-")
    try:
        with os.fdopen(fd, "wb") as out, gzip.open(path, "rb") as src:
            shutil.copyfileobj(src, out, 1 << 20)
    except (OSError, EOFError, zlib.error) as exc:
        Path(name).unlink(missing_ok=True)
        why = "corrupt compressed data" if isinstance(exc, zlib.error) else type(exc).__name__
        raise BadInputError(f"{display}: not a readable gzip file ({why})") from None
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)
