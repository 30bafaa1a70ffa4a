"""Numbers as they are printed: privacy figures rounded against the user (SPEC §8).

An ε, a spent amount or a budget B is never shown below its value (``up``), what remains of a budget never above it
(``down``), and a number the user gave is shown exactly (``given``). Pure functions, no imports beyond the standard
library: ``account``, ``index``, the report's ``--eps`` check and the plot share them (review 47: a few lines still
printed ``:.6g``/``:g``, which rounds to nearest).
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal


def up(x, digits: int = 6) -> str:
    """``x`` to ``digits`` significant digits, rounded up (review 46, F1: ε(rdp) 1.0921503 was printed 1.092)."""
    return _sig(x, digits, up=True)


def down(x, digits: int = 6) -> str:
    """``x`` to ``digits`` significant digits, rounded down."""
    return _sig(x, digits, up=False)


def given(x) -> str:
    """A number the user gave, exactly: the shortest decimal that reads back as the same float (``--eps
    0.9999999999999455`` was shown as 1: review 46, F9)."""
    s = repr(float(x))
    return s[:-2] if s.endswith(".0") else s


def _sig(x, digits: int, *, up: bool) -> str:
    if x is None:
        return "—"
    x = float(x)
    if x == 0 or x != x or x in (float("inf"), float("-inf")):
        return format(x, "g")
    if len(Decimal(repr(x)).normalize().as_tuple().digits) <= digits:
        # the shortest decimal that reads back as this very float fits: print it (0.1 is the float 0.1; rounding its
        # binary value 0.1000000000000000055… up gave "0.101", a figure nobody had: review 47)
        return format(x, f".{digits}g")
    d = Decimal(x)  # exact: the binary value is rounded as a Decimal
    q = d.quantize(Decimal(1).scaleb(d.adjusted() - digits + 1), rounding=ROUND_CEILING if up else ROUND_FLOOR)
    return format(float(q), f".{digits}g")  # q has ≤ digits significant digits (a carry, 9.9995 → 10.00, fewer)
