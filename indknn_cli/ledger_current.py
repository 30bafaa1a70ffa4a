"""What stands at a ledger's ``CURRENT``, looked at before it is read.

``CURRENT`` is a small JSON file (``{"generation": N}``) written by rename. Anything else in its place is damage
that ``indknn repair`` writes back (docs/RELIABILITY.md), and it must be recognised without reading it: a named pipe
blocks a reader forever and a link to a device reads without end, and either would block an erasure (review 43, H1:
a FIFO ``CURRENT`` made ``delete`` hang)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def not_a_file(cur: Path) -> str | None:
    """None when ``cur`` is a regular file (through a link too) or absent; otherwise what is there, in words."""
    try:
        st = os.stat(cur)
    except FileNotFoundError:
        return "a link to nothing" if os.path.islink(cur) else None
    except OSError as exc:
        return "a link that loops" if exc.errno == errno.ELOOP else "something that cannot be looked at"
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "something other than a file"


def stand_in(src: Path, dest: Path) -> None:
    """Put at ``dest`` what stands at ``src`` (not a regular file) without reading it: a link as the same link, a
    named pipe as a new one, anything else as an empty folder (``repair --dry-run``'s copy of the ledger)."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dest)
    elif stat.S_ISFIFO(os.stat(src).st_mode):
        os.mkfifo(dest)
    else:
        os.mkdir(dest)
