"""Progress of a bench run: a message per step, and a step count where the experiment knows one.

A ``progress`` callback is any ``callable(message)``. One that also has a ``step(done, total)`` attribute
(the CLI's progress bar on a terminal) is told how far the current phase has got; plain callbacks
(``print``, ``list.append``, tests) keep receiving messages only.
"""

from __future__ import annotations

from typing import Callable


def say(progress: Callable[[str], None], message: str, *, done: int | None = None,
        total: int | None = None) -> None:
    """Report ``message``; with ``done``/``total``, also the phase's position to a callback that takes it."""
    step = getattr(progress, "step", None)
    if step is not None and done is not None:
        step(done, total)
    progress(message)
