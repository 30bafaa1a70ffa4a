"""An output path that exists must be a regular file (review 44, H1).

Every file indknn writes for the user (``serve-queries --out``, ``account --export``, ``account --plot``, bench's
JSON) is written to a temporary file beside it and renamed into place, so a reader never sees half of it. A rename
replaces whatever has the name: ``--out /dev/null`` run as root turned the machine's ``/dev/null`` into a Parquet
file and exited 0, and a named pipe that a consumer was reading from was replaced (its reader never got the
answers). Such a path is refused before anything is read, charged or written. A symbolic link is followed: a link
to a device or a pipe is refused too; a link to a regular file is replaced by the new file, as before.
"""

from __future__ import annotations

import os
import stat

from .errors import BadInputError

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"))


def refuse_not_a_file(path: str | os.PathLike, *, option: str) -> None:
    """BadInputError (exit 2) when ``path`` exists (links followed) and is a device, a named pipe or a socket."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # absent (or unreachable): the caller's own checks say what is wrong with it
    for test, kind in _KINDS:
        if test(mode):
            raise BadInputError(f"{option} {os.fspath(path)} is {kind}, not a file: indknn writes a new file and "
                                "renames it into place, which would replace it; give the path of a file (without "
                                "--out, serve-queries prints its answers on stdout as JSON lines)")
