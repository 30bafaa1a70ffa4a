"""`indknn serve-queries`: answer a query batch; every answer is charged and committed before release."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..wording import count
from .common import (check_lock_timeout, emit_json_lines, parse_size, read_json_line_from_stdin, resolve_ledger,
                     resolve_store, run_library_call, stderr_console)
from .common import check_device, deprecated_alias, progress_bar, stdout_closed


def _load() -> None:
    """Import the library (numpy, pyarrow, zarr, scipy, ...) when the command runs, not at `indknn --help`: the
    names are this module's globals, declared here."""
    global check_min_margin, check_seed, resolve_query_batch, serve_queries, AnswerRows, AnswersWriter, \
        scheduler_session, resolve_scheduler, ABSTAIN_LABEL, preflight, queries_or_stored_batch, \
        batch_size_or_none, retry_on_store_change, STDIN_QUERY_HINT
    from ..serving import STDIN_QUERY_HINT, check_min_margin, check_seed, resolve_query_batch, serve_queries
    from ..serve_request import batch_size_or_none, preflight, queries_or_stored_batch, retry_on_store_change
    from ..answers_out import AnswerRows, AnswersWriter
    from ..distributed import session as scheduler_session
    from ..scheduler_address import resolve_scheduler
    from ..engine import ABSTAIN_LABEL


def serve_command(
    queries: Optional[str] = typer.Argument(None, show_default=False, help="Query file/folder (embedded with the store's extractor), a stored query batch name, or - for the JSON line of `indknn embed --role query`. Omitted: the stored batch named by --batch-id."),
    store: Optional[str] = typer.Option(None, "--store", help="Feature store: a folder or an s3:// URL (else $INDKNN_STORE, ./indknn-store.zarr)."),
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="Ledger folder (else $INDKNN_LEDGER, ./indknn-ledger)."),
    batch_id: Optional[str] = typer.Option(None, "--batch-id", help="The batch's name: a query file is stored under it (as `embed --role query --batch-id` does), and it is the idempotency key: re-running a batch id returns its released answers and charges nothing. Without QUERIES: serve the stored batch of that name. Default: the query batch name (a hash of the query file)."),
    batch: Optional[str] = typer.Option(None, "--batch", hidden=True, help="Deprecated spelling of --batch-id."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write answers to this Parquet file instead of JSON lines on stdout."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Experiments only: fixed noise seed (recorded in output and ledger). Default: OS entropy."),
    batch_size: int = typer.Option(1024, "--batch-size", help="Queries scored and committed together (never changes answers)."),
    device: str = typer.Option("auto", "--device", callback=check_device, help="auto, cpu or cuda."),
    no_reuse: bool = typer.Option(False, "--no-reuse", help="Switch off prediction reuse (SPEC §4)."),
    max_memory: str = typer.Option("2G", "--max-memory", help="Memory bound for cached features and scores: bytes, or a number with K, M, G or T (powers of 1024; KiB/KB read the same), e.g. 512M or 2G; at least 16M."),
    lock_timeout: float = typer.Option(60.0, "--lock-timeout", help="Seconds to wait for the ledger lock (and for the store's lock when a query file is embedded first)."),
    max_queries: Optional[str] = typer.Option(None, "--max-queries", envvar="INDKNN_MAX_QUERIES", help="Public gate for cron: refuse the whole batch (exit 3, nothing answered or charged; a query file is not embedded, unless a concurrent serve used up the allowance while it was: it then stays stored, named by its batch id) when the queries answered through this ledger plus this batch's would pass N; 'planned' = the ledger's --planned-queries. Reads public figures only. Else $INDKNN_MAX_QUERIES; default: no gate."),
    min_margin: Optional[float] = typer.Option(None, "--min-margin", help="Abstain (label -1, label_name \"abstain\") when the noisy top-1 minus top-2 vote is below M·σ2·sqrt(K_t): post-processing of the released noise, so charges are unchanged. Abstentions give no reuse vote."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Text column of a raw query file (default: text)."),
    id_column: Optional[str] = typer.Option(None, "--id-column", help="Query id column of a raw query file (default: id when the file has such a column, else generated ids query-00000000; \"\" always generates). Answers carry these ids."),
    image_column: Optional[str] = typer.Option(None, "--image-column", help="Image path column of a raw query table (default: path; relative to the table's folder)."),
    vector_column: Optional[str] = typer.Option(None, "--vector-column", help="List column of precomputed query vectors in Parquet / JSON lines (default: vector)."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", envvar="INDKNN_SCHEDULER", help="Dask scheduler ADDRESS (tcp://host:8786): the candidate phase runs on its workers, which read the store from the same path; the filter and the ledger stay here. Answers are those of the in-process engine. Else $INDKNN_SCHEDULER; default: in process."),
    scheduler_timeout: float = typer.Option(10.0, "--scheduler-timeout", envvar="INDKNN_SCHEDULER_TIMEOUT", help="Seconds to wait for the scheduler (unreachable: exit 1, nothing written)."),
) -> None:
    """Answer queries with Ind-KNN. stdout: one JSON line per answer (query id, label, released count K).

    Every query is answered, whatever the state of the private records: when none is eligible (all retired or
    deleted) a query is answered from reuse votes and noise, exactly like a query with no neighbour. The only
    ledger-dependent refusal is the public gate --max-queries. Exit codes: 0 answered; 1 runtime error;
    2 bad input (nothing written); 3 --max-queries allowance reached (nothing answered or charged).
    """
    batch_id = deprecated_alias(batch_id, batch, new="--batch-id", old="--batch")
    _load()
    queries = run_library_call(lambda: queries_or_stored_batch(queries, batch_id))
    err = stderr_console()
    store_path = run_library_call(lambda: resolve_store(store))
    ledger_path = resolve_ledger(ledger)

    bar: list = []  # the progress bar's update function (a no-op off a terminal), set once the batch is known

    sink: list = []  # the --out writer of the current attempt

    printed: list = [0, 0]  # answer lines this command has written to stdout (retry guard below), and replayed ones
    returned: list = [0, 0]  # answers returned by this attempt, and abstentions among them (--min-margin)

    def emit(rows):  # called once per committed part: its answers go out now, nothing is kept
        returned[0] += len(rows)
        returned[1] += (rows.abstained() if isinstance(rows, AnswerRows)
                        else sum(1 for r in rows if r.get("label") == ABSTAIN_LABEL))
        if bar:
            bar[0](advance=len(rows))
        if sink:
            sink[0].write(rows)
        else:
            try:
                emit_json_lines(rows)
            except BrokenPipeError:  # `| head -1` (review 66, F10): this part is committed, charged and released
                again = len(rows) if getattr(rows, "replayed", False) else 0  # or released earlier (review 73, F3)
                raise stdout_closed(released=printed[0] - printed[1] + len(rows) - again,
                                    replayed=printed[1] + again, batch=batch_name[0] if batch_name else batch_id,
                                    batch_id_given=batch_id is not None) from None
            printed[0] += len(rows)
            printed[1] += len(rows) if getattr(rows, "replayed", False) else 0

    upstream_line: list = []
    batch_name: list = []  # the batch's name once known (--batch-id, else the query batch's), for stdout_closed

    def call():
        check_lock_timeout(lock_timeout)
        # --out is rewritten whole by each attempt, so only answers already on stdout stop a retry
        return retry_on_store_change(call_once, may_retry=lambda: not printed[0], on_retry=lambda: err.print(
            "the store changed while this command waited; re-opening"))  # no word on erasures (audit 9, S2)

    def call_once():
        returned[:] = [0, 0]
        if queries == "-" and not upstream_line:
            upstream_line.append(read_json_line_from_stdin(hint=STDIN_QUERY_HINT))
        upstream = upstream_line[0] if queries == "-" else None
        sp = (resolve_store(upstream["store"], source="the upstream embed's JSON line on stdin")
              if upstream and store is None and "store" in upstream else store_path)
        check_min_margin(min_margin)  # before a query file is embedded (nothing written on bad input)
        check_seed(seed)
        preflight(queries=queries, store_path=sp, ledger_path=ledger_path, out=out, batch_size=batch_size,
                   max_memory=parse_size(max_memory), batch_id=batch_id, max_queries=max_queries,
                   reader_options=_reader_options())
        # The scheduler (--scheduler / $INDKNN_SCHEDULER) is reached before a query file is embedded.
        with scheduler_session(resolve_scheduler(scheduler), connect_timeout=scheduler_timeout) as serve:
            return answer(serve, sp, upstream)

    def _reader_options() -> dict:
        return {k: v for k, v in dict(text_column=text_column, id_column=id_column, image_column=image_column,
                                       vector_column=vector_column).items() if v is not None}

    def answer(serve, sp, upstream):
        opts = _reader_options()
        name = resolve_query_batch(store_path=sp, queries=queries, batch_id=batch_id, upstream=upstream,
                                   reader_options=opts, device=device, lock_timeout=lock_timeout)
        batch_name[:] = [batch_id or name]
        if batch_id is not None and name != batch_id:  # review 73, F15: two names, without a word
            err.print(escape(f"note: query batch {name!r} is answered under --batch-id {batch_id!r}: a batch id of its "
                             "own answers its queries again, with fresh noise, charged (leave --batch-id out to "
                             "re-print the answers released under its own name)"), soft_wrap=True)
        # --out: answers appended as each part commits to a hidden temporary file, renamed onto --out when the
        # run ends (answers_out.py); a failed run leaves --out as it was. Answers held: one part's.
        with progress_bar("answering", total=batch_size_or_none(sp, name)) as update, \
                (AnswersWriter(out) if out is not None else contextlib.nullcontext()) as writer:
            bar[:] = [update]
            sink[:] = [writer] if writer is not None else []
            return serve(store_path=sp, ledger_path=ledger_path, query_batch=name, batch_id=batch_id, seed=seed,
                         batch_size=batch_size, device=device, reuse=not no_reuse, max_memory=parse_size(max_memory),
                         lock_timeout=lock_timeout, on_committed=emit, max_queries=max_queries, min_margin=min_margin,
                         keep_answers=False)

    result = run_library_call(call)
    if result.already_answered and not result.newly_answered:
        err.print(escape(f"batch {result.batch_id!r} was already answered: returned its "
                         f"{count(result.already_answered, 'released answer')}; nothing charged, no new noise"
                         + ("; they are returned as released, whatever this run's --min-margin (it applies to new "
                            "answers only)" if min_margin is not None else "")))
    else:
        # Public figures only (SPEC §8): this message may reach whoever reads the job's output.
        left = (f"; {result.allowance.left} of T = {result.allowance.max_queries} left"
                if result.allowance is not None else "")
        err.print(escape(f"batch {result.batch_id!r}: answered {count(result.newly_answered, 'query')}"
                         f"{f' (resumed after {result.already_answered})' if result.already_answered else ''}; "
                         f"{result.queries_answered_total} answered through this ledger{left}"))
    if min_margin is not None and returned[0] and result.newly_answered:
        # Abstentions are post-processing of the released noisy votes: every one is in the answers printed.
        earlier = (f"; {result.already_answered} of them released by an earlier run, as released then"
                   if result.already_answered else "")
        err.print(escape(f"--min-margin {min_margin:g}: {count(returned[1], 'answer')} of {returned[0]} returned "
                         f"abstained (label -1); coverage {1 - returned[1] / returned[0]:.1%}{earlier}"))
    if result.not_answered:
        # The ledger's damage, not the private data: which events a repair could not read.
        err.print(escape(f"batch {result.batch_id!r}: {count(result.not_answered, 'query', 'queries')} before its "
                         "last recorded answer have no answer (lost in a ledger repair: an unreadable event, or "
                         "answer rows it left out) and are not answered again"))
    if seed is not None:
        err.print(f"[yellow]seeded run (--seed {seed}): for experiments only, not for real answers: the seed is "
                  "printed with each answer, so their noise can be recomputed; `account` flags this ledger and "
                  "its --eps check fails[/]")
