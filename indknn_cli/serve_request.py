"""The checks and the retry around one `serve-queries` request, before and beside :func:`serving.serve_queries`:
the refusals that need no answer, made before a query file is embedded into the store (nothing written on a
refusal), and the re-open after a concurrent store compaction. The CLI parses, calls these and prints."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, TypeVar

from . import bf16_screen, gate
from .answers_out import check_out_path, refuse_output_over
from .errors import BadInputError, ConcurrentChangeError, LedgerError
from .ledger import BudgetLedger
from .ledger_integrity import check_binding, read_mark, refuse_ledger_in_store
from .object_store import local_path
from .readers_base import check_batch_id
from .serving import check_allowance_before_embedding, check_batch_id_before_embedding
from .store import FeatureStore
from .store_twins import refuse_twin

T = TypeVar("T")


def preflight(*, queries: str, store_path: Path, ledger_path: Path, out: Optional[Path], batch_size: int,
               max_memory: int, batch_id: Optional[str], max_queries, reader_options: dict) -> None:
    """Refusals that need no answer, before anything is written: a query FILE is embedded into the store
    before the library call, and the library's ledger lock would create a missing ledger folder."""
    if batch_size < 1:
        raise BadInputError(f"--batch-size must be ≥ 1, got {batch_size}")
    try:
        bf16_screen.check_setting()
    except ValueError as exc:
        raise BadInputError(str(exc)) from None
    if max_memory < (16 << 20):
        raise BadInputError(f"--max-memory must be at least 16 MiB, got {max_memory} bytes")
    if out is not None:  # else the answers would be charged, then not written
        check_out_path(out)
        refuse_output_over(out, option="--out", folders=[("the ledger's folder", ledger_path),
                                                         ("the store's folder", local_path(store_path))],
                           files=[("the query file being read", None if queries == "-" else queries)])
    refuse_ledger_in_store(local_path(store_path), ledger_path)
    if not BudgetLedger.exists(ledger_path):
        raise LedgerError(f"{ledger_path}: no budget ledger here (create one with `indknn index`)")
    BudgetLedger.check_writable(ledger_path)
    max_queries = gate.parse_max_queries(max_queries)
    if queries != "-" and Path(queries).exists():  # a file to embed: the ledger must fit the store first
        store = FeatureStore.open(store_path, mode="r")
        mark = read_mark(store.path)  # before the ledger: no lock is held here
        led = BudgetLedger.open_for(ledger_path, store)
        check_binding(store, led, ledger_path, mark=mark)
        refuse_twin(store, led, ledger_path)  # before the file is embedded (nothing written on a refusal)
        # Refusals that would come after the embed, checked before it (nothing written): a reused
        # --batch-id, and a public allowance that is already used up.
        check_batch_id_before_embedding(store=store, ledger=led, batch_id=batch_id)
        check_allowance_before_embedding(store=store, ledger=led, queries=queries, batch_id=batch_id,
                                         max_queries=max_queries, reader_options=reader_options)


def queries_or_stored_batch(queries: Optional[str], batch_id: Optional[str]) -> str:
    """QUERIES as given; omitted, the stored batch --batch-id names (one name for a stored batch in `embed --role
    query` and here: review 42, M4)."""
    for flag, value, want in (("QUERIES", queries, "a query file or folder, a stored batch name, or -"),
                              ("--batch-id", batch_id, "a name")):
        if value is not None and not value.strip():  # "" read as "." (the working folder): review 43, L1
            raise BadInputError(f"{flag} is empty: give {want}")
    if batch_id is not None:
        check_batch_id(batch_id)
    if queries is not None:
        return queries
    if batch_id is None:
        raise BadInputError("give QUERIES (a query file or folder, a stored batch name, or - for embed's JSON line), "
                            "or --batch-id NAME of a batch stored by `indknn embed --role query --batch-id NAME`")
    if batch_id == "-":
        raise BadInputError("--batch-id '-' without QUERIES: '-' means embed's JSON line on stdin; give it as QUERIES "
                            "(serve-queries -), or name a stored batch")
    if Path(batch_id).exists():  # that would embed a file: say which one is meant
        raise BadInputError(f"--batch-id {batch_id!r} without QUERIES names a stored batch, and a file or folder of "
                            "that name is here: give it as QUERIES to embed it, or run from another folder")
    return batch_id


def batch_size_or_none(store_path: Path, name) -> Optional[int]:
    """Queries in the batch, for the progress bar's total (None when it cannot be read cheaply)."""
    try:
        start, stop, _ = FeatureStore.open(store_path, mode="r").query_batch(str(name))
        return int(stop - start)
    except Exception:  # noqa: BLE001 - a bar without a total; serve_queries reports real problems
        return None


def retry_on_store_change(call_once: Callable[[], T], *, may_retry: Callable[[], bool],
                          on_retry: Callable[[], None], attempts: int = 3) -> T:
    """``call_once()``, again (at most ``attempts`` times in all) when a `delete --compact` that finished while it
    waited for a lock renumbered the store (ConcurrentChangeError: nothing was written; a transient condition, so
    exit 1 when it persists, not bad input). ``may_retry()`` false: raised at once (answers already went out, which
    a retry would emit twice: audit 4, S1)."""
    for attempt in range(attempts):
        try:
            return call_once()
        except ConcurrentChangeError:
            if attempt == attempts - 1 or not may_retry():
                raise
            on_retry()
    raise AssertionError("unreachable")
