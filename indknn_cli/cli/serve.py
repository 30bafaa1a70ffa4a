"""`indknn serve-queries`: answer a query batch; every answer is charged and committed before release."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import BadInputError, LedgerError
from ..ledger import BudgetLedger
from ..ledger_integrity import check_binding, read_mark
from ..serving import resolve_query_batch, serve_queries, write_answers_parquet
from ..store import FeatureStore
from .common import (emit_json, parse_size, read_json_line_from_stdin, resolve_ledger, resolve_store,
                     run_library_call, stderr_console)


def _preflight(*, queries: str, store_path: Path, ledger_path: Path, out: Optional[Path], batch_size: int,
               max_memory: int) -> None:
    """Refusals that need no answer, before anything is written: a query FILE is embedded into the store
    before the library call, and the library's ledger lock would create a missing ledger folder."""
    if batch_size < 1:
        raise BadInputError(f"--batch-size must be ≥ 1, got {batch_size}")
    if max_memory < (16 << 20):
        raise BadInputError(f"--max-memory must be at least 16 MiB, got {max_memory} bytes")
    if out is not None and not out.parent.is_dir():  # else the answers would be charged, then not written
        raise BadInputError(f"--out: folder {out.parent} does not exist")
    if not BudgetLedger.exists(ledger_path):
        raise LedgerError(f"{ledger_path}: no budget ledger here (create one with `indknn index`)")
    BudgetLedger.check_writable(ledger_path)
    if queries != "-" and Path(queries).exists():  # a file to embed: the ledger must fit the store first
        store = FeatureStore.open(store_path, mode="r")
        mark = read_mark(store.path)  # before the ledger: no lock is held here
        check_binding(store, BudgetLedger.open(ledger_path, store_uuid=store.uuid), ledger_path, mark=mark)


def serve_command(
    queries: str = typer.Argument(..., help="Query file/folder (embedded with the store's extractor), a stored query batch name, or - for the JSON line of `indknn embed --role query`."),
    store: Optional[Path] = typer.Option(None, "--store", help="Feature store (else $INDKNN_STORE, ./indknn-store.zarr)."),
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="Ledger folder (else $INDKNN_LEDGER, ./indknn-ledger)."),
    batch_id: Optional[str] = typer.Option(None, "--batch-id", help="Idempotency key: re-running a batch id returns its released answers and charges nothing. Default: the query batch name (a hash of the query file)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write answers to this Parquet file instead of JSON lines on stdout."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Experiments only: fixed noise seed (recorded in output and ledger). Default: OS entropy."),
    batch_size: int = typer.Option(1024, "--batch-size", help="Queries scored and committed together (never changes answers)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    no_reuse: bool = typer.Option(False, "--no-reuse", help="Switch off prediction reuse (SPEC §4)."),
    max_memory: str = typer.Option("2G", "--max-memory", help="Memory bound for cached features and scores."),
    lock_timeout: float = typer.Option(60.0, "--lock-timeout", help="Seconds to wait for the ledger lock."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Text column of a raw query file."),
    id_column: Optional[str] = typer.Option(None, "--id-column", help="Query id column of a raw query file."),
    image_column: Optional[str] = typer.Option(None, "--image-column"),
    vector_column: Optional[str] = typer.Option(None, "--vector-column"),
) -> None:
    """Answer queries with Ind-KNN. stdout: one JSON line per answer (query id, label, released count K)."""
    err = stderr_console()
    store_path = resolve_store(store)
    ledger_path = resolve_ledger(ledger)

    def emit(rows):
        if out is None:
            for r in rows:
                emit_json(r)

    def call():
        upstream = read_json_line_from_stdin() if queries == "-" else None
        sp = Path(upstream["store"]) if upstream and store is None and "store" in upstream else store_path
        _preflight(queries=queries, store_path=sp, ledger_path=ledger_path, out=out, batch_size=batch_size,
                   max_memory=parse_size(max_memory))
        opts = {k: v for k, v in dict(text_column=text_column, id_column=id_column, image_column=image_column,
                                       vector_column=vector_column).items() if v is not None}
        name = resolve_query_batch(store_path=sp, queries=queries, batch_id=batch_id, upstream=upstream,
                                   reader_options=opts, device=device)
        return serve_queries(store_path=sp, ledger_path=ledger_path, query_batch=name, batch_id=batch_id,
                             seed=seed, batch_size=batch_size, device=device, reuse=not no_reuse,
                             max_memory=parse_size(max_memory), lock_timeout=lock_timeout, on_committed=emit)

    result = run_library_call(call)
    if out is not None:
        run_library_call(lambda: write_answers_parquet(result.answers, out))
    if result.already_answered and not result.newly_answered:
        err.print(f"batch {result.batch_id!r} was already answered: returned its {result.already_answered} "
                  "released answers; nothing charged, no new noise")
    else:
        err.print(f"batch {result.batch_id!r}: answered {result.newly_answered} queries"
                  f"{f' (resumed after {result.already_answered})' if result.already_answered else ''}; "
                  f"{result.records_active} records remain active")
    if seed is not None:
        err.print(f"[yellow]seeded run (--seed {seed}): for experiments only, not for real answers[/]")
