"""A child `indknn` process's own peak resident memory (VmHWM), measured from inside it.

``ru_maxrss`` of a child (``wait4``, ``RUSAGE_CHILDREN``) is no measure of the child alone on Linux: a
forked child starts with its parent's memory high-water mark, and ``execve`` folds the old address
space's mark into the process's ``maxrss``, so every child of a bench that held 700 MB reports at least
700 MB. The new address space's own mark, ``VmHWM`` in ``/proc/self/status``, starts at zero after
``execve``; :func:`indknn_command` runs the CLI under a few lines of Python that write it to a file at exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

_WRAPPER = (
    "import atexit, runpy, sys\n"
    "out = sys.argv[1]\n"
    "def _peak():\n"
    "    with open('/proc/self/status') as fh:\n"
    "        kb = [line.split()[1] for line in fh if line.startswith('VmHWM:')]\n"
    "    with open(out, 'w') as fh:\n"
    "        fh.write(kb[0] if kb else '')\n"
    "atexit.register(_peak)\n"
    "sys.argv = ['indknn'] + sys.argv[2:]\n"
    "runpy.run_module('indknn_cli', run_name='__main__', alter_sys=True)\n"
)


def indknn_command(args: list[str], peak_file: Path) -> list[str]:
    """The argv of ``indknn ARGS`` (this Python) that writes its own peak RSS (kB) to ``peak_file`` at exit."""
    return [sys.executable, "-c", _WRAPPER, str(peak_file), *args]


def read_peak_mb(peak_file: Path) -> float | None:
    """The peak RSS in MB written by a process started with :func:`indknn_command` (None if it wrote none)."""
    try:
        text = Path(peak_file).read_text().strip()
    except OSError:
        return None
    return round(int(text) / 1024, 1) if text else None
