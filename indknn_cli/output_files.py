"""An output path that exists must be a regular file (review 44, H1).

Every file indknn writes for the user (``serve-queries --out``, ``account --export``, ``account --plot``, bench's
JSON) is written to a temporary file beside it and renamed into place, so a reader never sees half of it. A rename
replaces whatever has the name: ``--out /dev/null`` run as root turned the machine's ``/dev/null`` into a Parquet
file and exited 0, and a named pipe that a consumer was reading from was replaced (its reader never got the
answers). Such a path is refused before anything is read, charged or written. A symbolic link is followed: a link
to a device or a pipe is refused too; a link to a regular file is replaced by the new file, as before. A path in
``/dev`` or ``/proc`` (``--out /dev/stdout``: a link to ``/proc/self/fd/1``, a regular file when stdout is redirected
to one) is refused as well: the rename replaced the link in ``/dev`` itself (review 45, F2).

:func:`atomic_output` is the one way these files are written: a temporary file made with ``O_EXCL`` under a random
name beside the target (never a predictable ``NAME.tmp``, which a link left there turned into a write through the
link: `account --export` wrote over the ledger's snapshot; review 45, F1), written through its descriptor, fsync'd,
checked again and renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from pathlib import Path

from .errors import BadInputError

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"))


_SYSTEM_FOLDERS = (Path("/dev"), Path("/proc"))


_SHARED_MEMORY = Path("/dev/shm")  # a tmpfs folder of ordinary files, where users do write


def _in_system_folder(p: Path) -> bool:
    if p == _SHARED_MEMORY or _SHARED_MEMORY in p.parents:
        return False
    return any(p == f or f in p.parents for f in _SYSTEM_FOLDERS)


#: C0 and C1 control characters: never part of a path a person typed (review 54, F4: an environment file saved with
#: CRLF line ends made $INDKNN_STORE "/srv/s.zarr\r", and embed + index then created a second store and ledger beside
#: the real pair: a fresh budget B for the same people).
_CONTROL_IN_PATH = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def refuse_control_characters(path: str | os.PathLike, *, option: str) -> None:
    """BadInputError (exit 2) when ``path`` holds a control character (a carriage return, a newline, a tab)."""
    text = os.fspath(path)
    if isinstance(text, str) and (m := _CONTROL_IN_PATH.search(text)):
        raise BadInputError(f"{option} {text!r} holds the control character U+{ord(m.group()):04X}: a path with a "
                            "carriage return or a newline is almost always a line end read with it (an environment "
                            "file saved with CRLF line ends); remove it")


def refuse_not_a_file(path: str | os.PathLike, *, option: str) -> None:
    """BadInputError (exit 2) when ``path`` holds a control character, or exists (links followed) and is a folder, a
    device, a named pipe or a socket, or names something in /dev or /proc (itself, or the folder it is in, links
    resolved)."""
    refuse_control_characters(path, option=option)
    hint = " (without --out, serve-queries prints its answers on stdout as JSON lines)" if option == "--out" else ""
    p = Path(os.path.abspath(path))
    if _in_system_folder(p.parent) or _in_system_folder(Path(os.path.realpath(p.parent))) \
            or _in_system_folder(Path(os.path.realpath(p))):
        raise BadInputError(f"{option} {os.fspath(path)} is in /dev or /proc, not a file of yours: indknn writes a new "
                            f"file and renames it into place, which would replace what is there; give the path of a "
                            f"file{hint}")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # absent (or unreachable): the caller's own checks say what is wrong with it
    if stat.S_ISDIR(mode):  # the rename would fail only after the work, naming the temporary file (review 48, F2)
        raise BadInputError(f"{option} {os.fspath(path)} is a folder; give the path of a file{hint}")
    for test, kind in _KINDS:
        if test(mode):
            raise BadInputError(f"{option} {os.fspath(path)} is {kind}, not a file: indknn writes a new file and "
                                f"renames it into place, which would replace it; give the path of a file{hint}")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, option: str, mode: str = "wb"):
    """Yield a file object open on a new temporary file beside ``path`` (``O_EXCL``, random name); on success it is
    fsync'd, ``path`` is checked again (:func:`refuse_not_a_file`: it may have become a pipe meanwhile) and the file
    renamed over it; on failure it is removed and ``path`` is left as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            os.fchmod(fh.fileno(), 0o666 & ~_umask())  # as open() would make it (mkstemp makes 0600)
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        refuse_not_a_file(path, option=option)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_output_file(path: str | os.PathLike, *, option: str) -> None:
    """Before any work: ``path`` must be writable as a new file (:func:`refuse_not_a_file`, and its folder must exist),
    else BadInputError (exit 2). bench audit's ``--out`` was written with ``write_text`` after the run: through a link
    onto a ledger's snapshot, into a named pipe (a hang), or failing only at the end (review 48, F1)."""
    refuse_not_a_file(path, option=option)
    parent = Path(os.path.abspath(path)).parent
    if not parent.is_dir():
        raise BadInputError(f"{option} {os.fspath(path)}: folder {parent} does not exist")


def write_text_file(path: str | os.PathLike, text: str, *, option: str) -> None:
    """``text`` written to ``path`` through :func:`atomic_output` (a link at ``path`` is replaced, never written
    through)."""
    with atomic_output(path, option=option, mode="w") as fh:
        fh.write(text)
