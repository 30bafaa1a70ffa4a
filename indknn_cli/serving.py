"""`serve-queries` as a library call: the charged answer loop (`index` is :mod:`indknn_cli.indexing`, re-exported here)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Callable

import numpy as np
import pyarrow as pa

from . import deletion_deferred, gate, indexes, store_twins
from . import ledger_integrity as integrity
from .answers_out import SCHEMA as ANSWERS_SCHEMA
from .answers_out import AnswerRows, ReplayedAnswers
from .engine import (ABSTAIN_LABEL, ABSTAIN_NAME, COUNT_GRID_DECIMALS, AnswerArrays, BudgetView,  # noqa: F401
                     ReusePool, StoreSource, answer_batch, run_key_for)
from .errors import BadInputError
from .indexing import (IndexResult, _roll_forward_pending, build_index, make_params,  # noqa: F401 (re-exported)
                       sync_ledger)
from .ledger import BudgetLedger
from .serve_pipeline import Committer, PassScreen, event_columns, responsive_threads, signals_deferred
from .object_store import local_path
from .store import FeatureStore
from .store_layout import check_private_chunks
from .user_unit import UserBudgetView

log = logging.getLogger(__name__)

DEFAULT_MAX_MEMORY = 2 << 30
#: Fold events into a new snapshot (issue 21: a daily cron's open cost stays flat). Every open reads the
#: snapshot and replays the events after it; an event costs a file read, a hash and a vectorised update
#: (a few ms at any N), a compaction rewrites the snapshot and the answers file. A serve run compacts at its
#: end once AUTO_COMPACT_EVENTS (16) serve events follow the snapshot: a daily cron replays at most ~16
#: events. The count of serve events is public (one per committed part: the queries and --batch-size
#: decide it), so whether a run compacts (its time, and its exit code should the compaction fail) does not
#: depend on the private data; an earlier rule that also weighed the events' bytes did (their charge rows
#: are the records charged: audit 2, P7).
AUTO_COMPACT_EVENTS = 16


def _needs_compaction(ledger: BudgetLedger) -> bool:
    """Whether a serve run should fold the ledger's events now: at least AUTO_COMPACT_EVENTS serve events
    after the snapshot (public figures only). ``INDKNN_AUTO_COMPACT=0`` never (every event file kept for an
    audit of the event log; `delete --compact` still folds them)."""
    if os.environ.get("INDKNN_AUTO_COMPACT", "").strip().lower() in ("0", "off", "no", "false"):
        return False
    serves = sum(1 for _, p in ledger._event_files() if p.name.split("-")[1].split(".")[0] == "serve")
    return serves >= AUTO_COMPACT_EVENTS


# -- serve-queries --------------------------------------------------------------
@dataclass
class ServeResult:
    batch_id: str
    #: The batch's released answers in query order, or None when the caller streamed them through
    #: ``on_committed`` and asked not to keep them (``keep_answers=False``: memory O(one part), issue 21).
    answers: list[dict] | None
    newly_answered: int
    already_answered: int
    seed: int | None
    #: Public figures only (SPEC §8): queries answered through this ledger, all batches, after this run,
    #: and the allowance when ``max_queries`` was given. No count of private records is returned here.
    queries_answered_total: int = 0
    allowance: "gate.Allowance | None" = None
    #: Queries of the batch before its last recorded answer that have none (lost in a repair: an unreadable event,
    #: or answer rows it left out): never answered again. A figure of the ledger's damage, not of the private data.
    not_answered: int = 0


def _answer_rows(table: pa.Table) -> "AnswerRows | list[dict]":
    """Ledger answer rows (ANSWER_SCHEMA) as the released answers, in the order of the table: AnswerRows, as a
    new part's (the ledger keeps the seed as text; one written before check_seed that is past int64 stays a dict)."""
    names = ("batch_id", "query_index", "query_id", "label", "label_name", "released_count")
    try:
        seed = table.column("seed").cast(pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        seed = None
    if seed is not None:
        return AnswerRows(pa.table([table.column(n).cast(ANSWERS_SCHEMA.field(n).type) for n in names] + [seed],
                                   schema=ANSWERS_SCHEMA))
    cols = {n: table.column(n).to_pylist() for n in (*names, "seed")}
    rows = []
    for i in range(table.num_rows):
        row = {k: cols[k][i] for k in names}
        if cols["seed"][i] is not None:
            row["seed"] = int(cols["seed"][i])
        rows.append(row)
    return rows


def _done_parts(done: pa.Table, size: int):
    """The answers already released under a batch id, sorted by query index, in lists of ``size``."""
    done = done.sort_by("query_index")
    for lo in range(0, done.num_rows, size):
        rows = _answer_rows(done.slice(lo, size))
        if isinstance(rows, AnswerRows):
            rows.replayed = True
            yield rows
        else:
            yield ReplayedAnswers(rows)


def serve_queries(
    *,
    store_path: str | os.PathLike,
    ledger_path: str | os.PathLike,
    query_batch: str,
    batch_id: str | None = None,
    seed: int | None = None,
    batch_size: int = 1024,
    device: str = "auto",
    reuse: bool = True,
    max_memory: int = DEFAULT_MAX_MEMORY,
    lock_timeout: float = 60.0,
    on_committed: Callable[[Sequence[dict]], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    candidate_finder_factory: Callable | None = None,
    max_queries: int | str | None = None,
    min_margin: float | None = None,
    keep_answers: bool = True,
) -> ServeResult:
    """Answer the stored query batch ``query_batch``; each part is charged and committed before release.

    ``on_committed(rows)`` is called with each part's answers only after the
    part's ledger event is durable (SPEC §8 "charge before release"). ``rows`` is a sequence of dicts (an
    :class:`~indknn_cli.answers_out.AnswerRows`: ``list(rows)`` for a list, ``rows.table`` for the Arrow table).

    Every query is answered whatever the private state: with no eligible record
    (all retired, deleted or outside τ) a query releases ``argmax(reuse + noise)``
    with ``K_t = max(σ1·z, K_min)``, as for an empty candidate set (SPEC §8 "no
    noise-free branch"). The only refusal that depends on the ledger is the
    public gate ``max_queries`` (see :mod:`indknn_cli.gate`): a positive integer
    T or ``"planned"`` (the ledger's --planned-queries); it refuses the whole
    batch (QueryAllowanceError, exit 3) before anything is charged when the
    queries answered so far plus this batch's new ones would pass T.

    ``keep_answers=False``: the answers reach the caller only through ``on_committed`` (one part at a time,
    answers released before under this batch id in parts of ``batch_size`` first) and ``ServeResult.answers``
    is None: the run holds O(batch_size) answers as Python objects, whatever the batch's size.
    """
    max_queries = gate.parse_max_queries(max_queries)
    min_margin = check_min_margin(min_margin)
    check_seed(seed)
    if batch_size < 1:
        raise BadInputError(f"--batch-size must be ≥ 1, got {batch_size}")
    if max_memory < (16 << 20):
        raise BadInputError(f"--max-memory must be at least 16 MiB, got {max_memory} bytes")
    batch_id = batch_id or query_batch
    store_path = local_path(store_path)
    integrity.refuse_ledger_in_store(store_path, ledger_path)
    store = FeatureStore.open(store_path, mode="r")
    q_start, q_stop, q_sha = store.query_batch(query_batch)
    with BudgetLedger.write_lock(ledger_path, timeout=lock_timeout), \
            integrity.writer_lock(store_path, timeout=lock_timeout):
        # Re-open under the lock: a delete/compaction may have finished while we waited.
        store = FeatureStore.open(store_path, mode="r")
        store.pin_rows("private")  # one row count for the whole run, whatever a concurrent embed commits
        q_start, q_stop, q_sha = store.query_batch(query_batch)
        ledger = BudgetLedger.open_for(ledger_path, store)
        integrity.attach(store, ledger, ledger_path, bind=True, lock_timeout=lock_timeout)
        store_twins.refuse_twin(store, ledger, ledger_path)  # a copied pair served from both (review 42)
        from .deletion_compact import discard_unpublished

        discard_unpublished(store, ledger)  # a stopped compaction's leftovers (review 27, F3)
        _roll_forward_pending(store_path, ledger, lock_timeout)
        params = ledger.params
        done = ledger.state.answers_table_for(batch_id)
        done_rows = np.unique(done.column("query_row").to_numpy())
        _check_batch_id(batch_id, done_rows, q_start, q_stop)
        n_queries = q_stop - q_start
        already = int(done_rows.size)
        # Resume after the last answered query, not after as many as were answered: a repair that lost an
        # unreadable event but kept a later one leaves a gap, and those queries may have been released (audit 9,
        # F3). They are not answered again; with a prefix (the usual case) both are the same.
        todo_start = q_start + already if not already else max(q_start + already, int(done_rows.max()) + 1)
        holes = min(todo_start, q_stop) - q_start - already
        allowance = gate.allowance(answered=queries_answered(ledger), planned_queries=params.planned_queries,
                                   max_queries=max_queries)
        released: list[dict] | None = [] if keep_answers else None

        def release(rows: list[dict]) -> None:
            if released is not None:
                released.extend(rows)
            if on_committed is not None:
                on_committed(rows)

        if todo_start >= q_stop:
            for rows in _done_parts(done, batch_size):
                release(rows)
            return ServeResult(batch_id, released, 0, already, seed, queries_answered(ledger), allowance, holes)
        gate.check(allowance, new_queries=q_stop - todo_start)  # public figures only, before any charge
        check_private_chunks(store)  # a chunk file lost is refused, as a damaged one is (review 73, F16)
        sync_ledger(ledger, store)
        state = ledger.state
        # No branch on whether any record is active (SPEC §8): retired and deleted records are simply never
        # eligible, and a query with no eligible record is answered from reuse votes and noise like any other.
        n_store = store.n_rows("private")
        row_to_ledger = ledger.store_row_map(n_store)
        # Rows flagged deleted in the store (including an interrupted deletion's) are never candidates.
        row_to_ledger[store.read("private", "deleted").astype(bool)] = -1
        # Rows of an accepted but unfinished erasure request (a delete that failed part-way) neither.
        row_to_ledger[store.erase_pending_rows("private")] = -1
        row_to_ledger[deletion_deferred.rows(ledger, store)] = -1  # nor one recorded without the store's lease
        row_labels = store.read("private", "labels").astype(np.int64)
        n_classes = len(store.label_names)
        if params.privacy_unit == "user":  # SPEC §9: the filter runs on users
            budgets = UserBudgetView.from_ledger_state(state, budget=params.budget,
                                                       user_for_missing=params.user_for_missing,
                                                       max_records_per_user=params.max_records_per_user)
            mapped = np.flatnonzero(row_to_ledger >= 0)  # only these (review 71, F1: a ledger of no records, as
            row_to_ledger[mapped[budgets.user_of[row_to_ledger[mapped]] < 0]] = -1  # every row erased: IndexError)
        else:
            budgets = BudgetView(spent=state.spent.copy(), budget=state.budget.copy(),
                                 deleted=state.deleted.copy(), times_selected=np.zeros(len(state), np.int64))
        pool = None
        if reuse:
            pool = _reuse_pool(store, ledger)
        source = StoreSource(store, cache_bytes=max_memory // 2)
        finder = (candidate_finder_factory(store, ledger) if candidate_finder_factory
                  else indexes.load_candidate_finder(store, ledger))
        run_key = run_key_for(seed, batch_id)
        seed_str = None if seed is None else str(seed)
        import pyarrow.compute as pc

        part = int(pc.count_distinct(done.column("part")).as_py()) if done.num_rows else 0
        for rows in _done_parts(done, batch_size):
            release(rows)
        del done
        max_pairs = max(1 << 16, max_memory // 4 // 24)
        if finder is None and device == "cpu":  # the run's size, not one batch's, decides on torch's and numba's
            from . import bf16_screen, candidates  # imports; never the rows stored (audit 10, F2)

            bf16_screen.prepare(q_stop - todo_start, dim=store.dim, batch=batch_size)
            candidates.prepare_compiled(q_stop - todo_start, batch=batch_size, dim=store.dim, kernel=params.kernel)
        if pool is None and type(budgets) is BudgetView:  # the compiled filter's case: record unit, no reuse
            from . import filter_jit

            filter_jit.prepare_run(q_stop - todo_start, batch=batch_size)
        screened = PassScreen(store, source, params=params, device=device, row_to_ledger=row_to_ledger,
                              max_pairs=max_pairs, max_memory=max_memory, batch_size=batch_size, stop=q_stop,
                              enabled=finder is None, row_labels=row_labels)
        committer = Committer(overlap=screened.ahead)  # on a GPU: part k commits while part k+1 is filtered
        # a part that screens itself (its pass dropped) while the next pass is screened ahead at 3/8 of the bound
        # (32 bytes a pair): half the bound, so the two stay within it together
        part_pairs = max_pairs // 2 if screened.ahead else max_pairs
        # the released label names, ABSTAIN_NAME last (the label −1 taken from there)
        label_names = pa.array([label_name(store, c) for c in range(n_classes)] + [ABSTAIN_NAME], pa.string())
        # a short switch interval while three threads run; with a commit thread, Ctrl-C and SIGTERM are raised only
        # between parts, so that none can skip the close that waits for the commit in flight
        with responsive_threads(screened.ahead), signals_deferred(screened.ahead) as interrupted:
            try:
                for lo in range(todo_start, q_stop, batch_size):
                    interrupted()
                    hi = min(q_stop, lo + batch_size)
                    queries = store.read("query", "features", lo, hi)
                    query_ids = store.read("query", "record_id", lo, hi)  # per part: never the whole batch's ids
                    budgets.reset_part()
                    answers = answer_batch(
                        queries, source=source, row_to_ledger=row_to_ledger, row_labels=row_labels, params=params,
                        n_classes=n_classes, budgets=budgets, run_key=run_key, first_index=lo - q_start, reuse=pool,
                        device=device, candidate_finder=finder, max_pairs=part_pairs, min_margin=min_margin,
                        candidates=screened.part(lo, hi),
                    )
                    touched, touched_counts = budgets.part_charges()
                    answers = AnswerArrays.of(answers)  # arrays end to end: no Python object per answer
                    n_ans, n_ch = len(answers), touched.size
                    labels = answers.labels
                    names = label_names.take(np.where(labels == ABSTAIN_LABEL, n_classes, labels))
                    query_id_strs = _id_strings(query_ids)
                    cols = event_columns(n_ch, n_ans, touched=touched, spent_after=budgets.record_spent(touched),
                                         selected=touched_counts, batch_id=batch_id, part=part, first=lo - q_start,
                                         query_ids=query_id_strs, first_row=lo, labels=labels, names=names,
                                         counts=answers.released_counts, seed=seed_str)
                    info = {"batch_id": batch_id, "part": part, "seed": seed_str, "query_batch": query_batch,
                            "query_sha256": q_sha, "answers": n_ans, "charged_records": n_ch,
                            "released_count_grid": 10.0 ** -COUNT_GRID_DECIMALS,
                            **({"min_margin": min_margin,
                                "abstained": int(np.count_nonzero(labels == ABSTAIN_LABEL))}
                               if min_margin is not None else {})}
                    new_rows = AnswerRows(pa.table([
                        cols["batch_id"].slice(n_ch), cols["query_index"].slice(n_ch), query_id_strs,
                        cols["label"].slice(n_ch), names, cols["released_count"].slice(n_ch),
                        pa.repeat(pa.scalar(seed, pa.int64()), n_ans),  # int64: check_seed
                    ], schema=ANSWERS_SCHEMA))

                    def commit(cols=cols, info=info, new_rows=new_rows, done=hi - q_start, part=part):
                        ledger.commit_event(event_type="serve", columns=cols, info=info)
                        release(new_rows)  # only after the event is durable (SPEC §8 "charge before release")
                        # public figures only (the queries and --batch-size decide them); `-v` shows it on stderr,
                        # and `bench serve-speed --device cuda` times the parts by it
                        log.info("part %d released: %d of %d queries", part, done, n_queries)
                        if on_progress is not None:
                            on_progress(done, n_queries)

                    committer.submit(commit)
                    part += 1
                committer.wait()
            finally:
                try:
                    committer.close()
                finally:
                    screened.close()
        if _needs_compaction(ledger):
            ledger.compact()
        total = queries_answered(ledger)
    if allowance is not None:
        allowance = gate.Allowance(allowance.max_queries, allowance.source, total)
    return ServeResult(batch_id, released, q_stop - todo_start, already, seed, total, allowance, holes)


def _id_strings(ids: np.ndarray) -> pa.Array:
    """The stored query ids as released (``str`` of each), as one Arrow string array."""
    try:
        return pa.array(ids, pa.string())  # the ids are stored as strings: the same values, without a loop
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([str(x) for x in ids], pa.string())


def check_seed(seed) -> int | None:
    """--seed: None, or an integer that fits int64 (the answers' ``seed`` column); checked before anything is charged
    (review 30, F2: a larger one failed writing --out after the first part was charged)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < (1 << 63):
        raise BadInputError(f"--seed must be an integer from -2^63 to 2^63-1, got {seed!r}")
    return seed


def check_min_margin(min_margin) -> float | None:
    """--min-margin M: a finite number ≥ 0 (None: always answer)."""
    if min_margin is None:
        return None
    ok = isinstance(min_margin, (int, float)) and not isinstance(min_margin, bool) and math.isfinite(min_margin)
    if not ok or min_margin < 0:
        raise BadInputError(f"--min-margin must be a finite number ≥ 0, got {min_margin!r}")
    return float(min_margin)


def label_name(store: FeatureStore, label: int) -> str:
    """The released label's name; ``abstain`` for ABSTAIN_LABEL (−1), never a class's name."""
    return ABSTAIN_NAME if label == ABSTAIN_LABEL else store.label_names[label]


def _check_batch_id(batch_id: str, done_rows: np.ndarray, q_start: int, q_stop: int) -> None:
    """``done_rows``: the store rows of the answers already released under ``batch_id``."""
    if done_rows.size and (int(done_rows.min()) < q_start or int(done_rows.max()) >= q_stop):
        raise BadInputError(f"batch id {batch_id!r} was already used for other queries; pick a new --batch-id")


def check_batch_id_before_embedding(*, store: FeatureStore, ledger: BudgetLedger, batch_id: str | None) -> None:
    """Refuse a reused ``--batch-id`` *before* a query file is embedded under that name (nothing written).

    A query file given with ``--batch-id X`` is stored as query batch ``X``. When the ledger already holds
    answers under X, they must have come from stored batch X (then the embed is an idempotent no-op, or
    refuses other content itself); otherwise serving would refuse after the new file was already added.
    """
    if not batch_id:
        return
    done_rows = np.asarray(ledger.state.answers_table_for(batch_id).column("query_row").to_numpy(), np.int64)
    if not done_rows.size:
        return
    if batch_id not in store.batches():
        raise BadInputError(f"batch id {batch_id!r} was already used for other queries; pick a new --batch-id")
    q_start, q_stop, _ = store.query_batch(batch_id)
    _check_batch_id(batch_id, done_rows, q_start, q_stop)


def public_allowance(*, ledger_path: str | os.PathLike, max_queries: int | str | None = "planned") -> gate.Allowance:
    """``account --queries-left``: T, queries answered, queries left — public figures only (SPEC §8).

    Read-only (no lock). ``max_queries`` defaults to the ledger's planned T.
    """
    ledger = BudgetLedger.open(ledger_path)
    mq = gate.parse_max_queries("planned" if max_queries is None else max_queries)
    return gate.allowance(answered=queries_answered(ledger), planned_queries=ledger.params.planned_queries,
                          max_queries=mq)


def queries_answered(ledger: BudgetLedger) -> int:
    """Queries answered through this ledger, all batches (public: every answer released is counted, those a
    repair could not recover included)."""
    return ledger.state.answers_released()


def _reuse_pool(store: FeatureStore, ledger: BudgetLedger) -> ReusePool:
    """Released answers so far (in ledger order) with their query vectors from the store."""
    rows = ledger.state.answer_column("query_row", np.int64)
    labels = ledger.state.answer_column("label", np.int64)
    if rows.size == 0:
        return ReusePool.empty(store.dim)
    lo, hi = int(rows.min()), int(rows.max()) + 1
    block = store.read("query", "features", lo, hi)
    return ReusePool(block[rows - lo].astype(np.float32), labels)


#: review 66, F2: `cat q.csv | indknn serve-queries -` was refused without saying how to pipe query data
STDIN_QUERY_HINT = ("; `serve-queries -` reads only that line. To pipe query data (CSV, JSON lines, Parquet, .npy, "
                    "gzip), embed it first: `… | indknn embed - --role query --batch-id NAME | indknn serve-queries -`")


def resolve_query_batch(
    *, store_path: str | os.PathLike, queries: str, batch_id: str | None = None,
    upstream: dict | None = None, reader_options: dict | None = None, device: str = "auto",
    lock_timeout: float = 60.0,
) -> str:
    """Name of the stored query batch to answer.

    ``queries`` is ``-`` (the JSON line of an upstream ``indknn embed --role query``
    in ``upstream``), a file or folder (embedded now with the store's own
    extractor into the store's query group), or the name of a stored batch.
    """
    if queries == "-":
        if upstream and upstream.get("role") == "test":
            raise BadInputError(f"stdin: batch {upstream.get('batch')!r} was embedded with --role test (labelled test "
                                f"rows for `indknn bench --test-store`), not to be served; give its name to serve it "
                                f"anyway")
        names = {str(v) for v in ((upstream or {}).get("batch_id"), (upstream or {}).get("batch")) if v is not None}
        if not upstream or upstream.get("role") != "query" or not names:
            raise BadInputError("stdin: expected the JSON line of `indknn embed --role query`" + STDIN_QUERY_HINT)
        if len(names) > 1:  # review 43, L2: batch_id was taken silently
            raise BadInputError(f"stdin: the JSON line names two batches ({', '.join(sorted(map(repr, names)))} under "
                                "batch_id and batch); embed writes the same name under both")
        return names.pop()
    path = Path(queries)
    if path.exists():
        from .embedding import embed_query_file

        return embed_query_file(path, store_path=store_path, batch=batch_id, device=device,
                                lock_timeout=lock_timeout, **(reader_options or {}))
    store = FeatureStore.open(store_path, mode="r")
    if queries in store.batches():
        return queries
    raise BadInputError(f"{queries}: no such file, folder or stored query batch in {store_path}")


def check_allowance_before_embedding(*, store: FeatureStore, ledger: BudgetLedger, queries: str | os.PathLike,
                                     batch_id: str | None, max_queries, reader_options: dict | None = None) -> None:
    """``--max-queries`` with a query FILE: refuse (exit 3) before the file is embedded into the store.

    The number of rows of the input is public (the query-sender sent them), and so is the number of
    queries answered; the batch is refused whole when its new queries do not all fit (the same rule as
    :func:`serve_queries`): nothing is embedded, answered or charged.
    """
    allowance = gate.allowance(answered=queries_answered(ledger), planned_queries=ledger.params.planned_queries,
                               max_queries=gate.parse_max_queries(max_queries))
    if allowance is None:
        return
    from .extractors import input_kind_of
    from .readers import open_source

    src = open_source(queries, extractor_kind=input_kind_of(store.extractor.name) or "vector",
                      **(reader_options or {}))
    try:
        name = batch_id or "q-" + src.sha256()[:16]
        if name in store.batches():  # embedded before: its stored rows
            start, stop, _ = store.query_batch(name)
            n = stop - start
        else:
            n = src.count()
            if n is None:
                n = sum(len(rb) for rb in src.batches(labels=False))
    finally:
        src.close()
    done = int(np.unique(ledger.state.answers_table_for(name).column("query_row").to_numpy()).size)
    gate.check(allowance, new_queries=n - done)
