"""The public serving gate: how many more queries may be answered (SPEC §8 "decisions to stop serving use
public information only").

Whether to serve must never depend on the private data except through charged noise: an exact count of
active records (``account --min-active``) is a noise-free statistic of the private set, and a cron job that
stops serving when it falls below a threshold tells every query-sender the moment the last records retire.
The gate here reads only public figures: the number of queries already answered through the ledger (every
query-sender can count the answers) and a planned total T (a parameter fixed at ``index``, or given by the
operator). Nothing in this module reads a budget, a spent value or a record.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BadInputError, QueryAllowanceError
from .wording import count


@dataclass(frozen=True)
class Allowance:
    """Public figures only: T, queries answered so far, queries left (never negative)."""

    max_queries: int
    source: str  # "planned" (the ledger's --planned-queries) or "given" (--max-queries N)
    answered: int

    @property
    def left(self) -> int:
        return max(self.max_queries - self.answered, 0)

    def as_dict(self) -> dict:
        return {"max_queries": self.max_queries, "max_queries_source": self.source,
                "queries_answered": self.answered, "queries_left": self.left,
                "figures": "public (queries answered and " + ("the planned T" if self.source == "planned" else
                                                              "the T given") + "; no private data)"}


def parse_max_queries(value: str | int | None) -> int | str | None:
    """``None`` (no gate), ``"planned"`` (the ledger's T) or a positive integer; anything else is refused."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        if text == "planned":
            return "planned"
        try:
            n = int(text)
        except ValueError:
            raise BadInputError(f"--max-queries (or $INDKNN_MAX_QUERIES) must be a positive integer or 'planned', got {value!r}") from None
    if n < 1:
        raise BadInputError(f"--max-queries (or $INDKNN_MAX_QUERIES) must be a positive integer or 'planned', got {value!r}")
    return n


def allowance(*, answered: int, planned_queries: int | None, max_queries: int | str | None) -> Allowance | None:
    """The allowance for ``max_queries`` (parsed by :func:`parse_max_queries`); None when there is no gate."""
    if max_queries is None:
        return None
    if max_queries == "planned":
        if not planned_queries:
            raise BadInputError("--max-queries planned: this ledger was created with --sigma1 and no "
                                "--planned-queries; give --max-queries N")
        return Allowance(int(planned_queries), "planned", int(answered))
    return Allowance(int(max_queries), "given", int(answered))


def check(gate: Allowance | None, *, new_queries: int) -> None:
    """Raise QueryAllowanceError (exit 3) when answering ``new_queries`` more would pass T. Public only."""
    if gate is None or new_queries <= 0:
        return
    if gate.answered + new_queries > gate.max_queries:
        # review 55, F2: "reached" while 200 of 1,000 were left read as "stop the service" (exit 3's row)
        what = ("query allowance used up" if gate.left <= 0 else
                f"this batch would pass the query allowance ({gate.left} of T may still be answered)")
        if gate.source == "planned":
            then = ("T is fixed when the ledger is made; serving through this ledger is over" if gate.left <= 0 else
                    f"split the file into batches of at most {gate.left} queries (T is fixed when the ledger is made)")
        else:  # review 60, F4: an operator's own cap; the ledger's planned T may still have room
            then = (f"the cap {gate.max_queries} was given by --max-queries or $INDKNN_MAX_QUERIES, not the ledger "
                    "(`indknn account --queries-left` shows the ledger's planned T)" if gate.left <= 0 else
                    f"split the file into batches of at most {gate.left} queries, or raise the cap given by "
                    "--max-queries or $INDKNN_MAX_QUERIES")
        source = "the ledger's planned T" if gate.source == "planned" else "--max-queries or $INDKNN_MAX_QUERIES"
        raise QueryAllowanceError(
            f"{what}: {count(gate.answered, 'query')} answered of T = {gate.max_queries} ({source}); this batch "
            f"has {count(new_queries, 'new query')}. Nothing was answered or charged; {then}."
        )
