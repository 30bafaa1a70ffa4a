"""`serve-queries` as a library call: the charged answer loop (`index` is :mod:`indknn_cli.indexing`, re-exported here)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from . import gate, indexes
from . import ledger_integrity as integrity
from .engine import (ABSTAIN_LABEL, ABSTAIN_NAME, COUNT_GRID_DECIMALS, BudgetView, Candidates,  # noqa: F401
                     ReusePool, StoreSource, answer_batch, run_key_for)
from .errors import BadInputError
from .indexing import (IndexResult, _roll_forward_pending, build_index, make_params,  # noqa: F401 (re-exported)
                       sync_ledger)
from .ledger import BudgetLedger
from .object_store import local_path
from .store import FeatureStore
from .user_unit import UserBudgetView

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


def _answer_rows(table: pa.Table) -> list[dict]:
    """Ledger answer rows (ANSWER_SCHEMA) as the released answers: dicts in the order of the table."""
    cols = {n: table.column(n).to_pylist() for n in
            ("batch_id", "query_index", "query_id", "label", "label_name", "released_count", "seed")}
    rows = []
    for i in range(table.num_rows):
        row = {k: cols[k][i] for k in ("batch_id", "query_index", "query_id", "label", "label_name",
                                         "released_count")}
        if cols["seed"][i] is not None:
            row["seed"] = int(cols["seed"][i])
        rows.append(row)
    return rows


def _done_parts(done: pa.Table, size: int):
    """The answers already released under a batch id, sorted by query index, in lists of ``size``."""
    done = done.sort_by("query_index")
    for lo in range(0, done.num_rows, size):
        yield _answer_rows(done.slice(lo, size))


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
    on_committed: Callable[[list[dict]], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    candidate_finder_factory: Callable | None = None,
    max_queries: int | str | None = None,
    min_margin: float | None = None,
    keep_answers: bool = True,
) -> ServeResult:
    """Answer the stored query batch ``query_batch``; each part is charged and committed before release.

    ``on_committed(rows)`` is called with each part's answers only after the
    part's ledger event is durable (SPEC §8 "charge before release").

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
    if batch_size < 1:
        raise BadInputError(f"--batch-size must be ≥ 1, got {batch_size}")
    if max_memory < (16 << 20):
        raise BadInputError(f"--max-memory must be at least 16 MiB, got {max_memory} bytes")
    batch_id = batch_id or query_batch
    store_path = local_path(store_path)
    store = FeatureStore.open(store_path, mode="r")
    q_start, q_stop, q_sha = store.query_batch(query_batch)
    with BudgetLedger.write_lock(ledger_path, timeout=lock_timeout), \
            integrity.writer_lock(store_path, timeout=lock_timeout):
        # Re-open under the lock: a delete/compaction may have finished while we waited.
        store = FeatureStore.open(store_path, mode="r")
        store.pin_rows("private")  # one row count for the whole run, whatever a concurrent embed commits
        q_start, q_stop, q_sha = store.query_batch(query_batch)
        ledger = BudgetLedger.open(ledger_path, store_uuid=store.uuid)
        integrity.attach(store, ledger, ledger_path, bind=True, lock_timeout=lock_timeout)
        _roll_forward_pending(store_path, ledger, lock_timeout)
        params = ledger.params
        done = ledger.state.answers_table_for(batch_id)
        done_rows = np.unique(done.column("query_row").to_numpy())
        _check_batch_id(batch_id, done_rows, q_start, q_stop)
        n_queries = q_stop - q_start
        already = int(done_rows.size)
        todo_start = q_start + already
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
            return ServeResult(batch_id, released, 0, already, seed, queries_answered(ledger), allowance)
        gate.check(allowance, new_queries=q_stop - todo_start)  # public figures only, before any charge
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
        row_labels = store.read("private", "labels").astype(np.int64)
        n_classes = len(store.label_names)
        if params.privacy_unit == "user":  # SPEC §9: the filter runs on users
            budgets = UserBudgetView.from_ledger_state(state, budget=params.budget,
                                                       user_for_missing=params.user_for_missing,
                                                       max_records_per_user=params.max_records_per_user)
            row_to_ledger[(row_to_ledger >= 0) & (budgets.user_of[np.maximum(row_to_ledger, 0)] < 0)] = -1
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
        if finder is None and device == "cpu":  # the run's size, not one batch's, decides on torch's import
            from . import bf16_screen

            bf16_screen.prepare(q_stop - todo_start, n_store, dim=store.dim, batch=batch_size)
        screened = _PassScreen(store, source, params=params, device=device, row_to_ledger=row_to_ledger,
                               max_pairs=max_pairs, max_memory=max_memory, batch_size=batch_size, stop=q_stop,
                               enabled=finder is None)
        try:
            for lo in range(todo_start, q_stop, batch_size):
                hi = min(q_stop, lo + batch_size)
                queries = store.read("query", "features", lo, hi)
                query_ids = store.read("query", "record_id", lo, hi)  # per part: never the whole batch's ids
                budgets.reset_part()
                answers = answer_batch(
                    queries, source=source, row_to_ledger=row_to_ledger, row_labels=row_labels, params=params,
                    n_classes=n_classes, budgets=budgets, run_key=run_key, first_index=lo - q_start, reuse=pool,
                    device=device, candidate_finder=finder, max_pairs=max_pairs, min_margin=min_margin,
                    candidates=screened.part(lo, hi),
                )
                touched, touched_counts = budgets.part_charges()
                n_ans = len(answers)
                n_ch = touched.size
                labels = [a.label for a in answers]
                names = [label_name(store, x) for x in labels]
                query_id_strs = [str(x) for x in query_ids]
                counts = [a.released_count for a in answers]
                cols = _event_columns(n_ch, n_ans, touched=touched, spent_after=budgets.record_spent(touched),
                                      selected=touched_counts, batch_id=batch_id, part=part, first=lo - q_start,
                                      query_ids=query_id_strs, first_row=lo, labels=labels, names=names, counts=counts,
                                      seed=seed_str)
                ledger.commit_event(event_type="serve", columns=cols, info={
                    "batch_id": batch_id, "part": part, "seed": seed_str, "query_batch": query_batch,
                    "query_sha256": q_sha, "answers": n_ans, "charged_records": n_ch,
                    "released_count_grid": 10.0 ** -COUNT_GRID_DECIMALS,
                    **({"min_margin": min_margin, "abstained": labels.count(ABSTAIN_LABEL)} if min_margin is not None
                       else {}),
                })
                part += 1
                extra = {"seed": seed} if seed is not None else {}
                new_rows = [{"batch_id": batch_id, "query_index": lo - q_start + j, "query_id": query_id_strs[j],
                             "label": labels[j], "label_name": names[j], "released_count": counts[j], **extra}
                            for j in range(n_ans)]
                release(new_rows)
                if on_progress is not None:
                    on_progress(hi - q_start, n_queries)
        finally:
            screened.close()
        if _needs_compaction(ledger):
            ledger.compact()
        total = queries_answered(ledger)
    if allowance is not None:
        allowance = gate.Allowance(allowance.max_queries, allowance.source, total)
    return ServeResult(batch_id, released, n_queries - already, already, seed, total, allowance)


def _event_columns(n_ch, n_ans, *, touched, spent_after, selected, batch_id, part, first, query_ids, first_row,
                   labels, names, counts, seed) -> dict:
    """A serve event's columns as pyarrow arrays: ``n_ch`` charge rows (ledger index, spent after, times
    selected) then ``n_ans`` answer rows, each column null where its kind has no value (the event schema)."""
    def tail(values, typ):  # null for the charge rows, then the answers' values
        values = values if isinstance(values, pa.Array) else pa.array(values, type=typ)
        return pa.concat_arrays([pa.nulls(n_ch, typ), values])

    def head(values, typ):  # the charge rows' values, then null for the answers
        return pa.concat_arrays([pa.array(values, type=typ), pa.nulls(n_ans, typ)])

    return {
        "kind": pa.concat_arrays([pa.repeat("charge", n_ch), pa.repeat("answer", n_ans)]).cast(pa.string()),
        "ledger_index": head(np.asarray(touched, np.int64), pa.int64()),
        "spent_after": head(np.asarray(spent_after, np.float64), pa.float64()),
        "selected": head(np.asarray(selected, np.int64), pa.int64()),
        "batch_id": tail(pa.repeat(batch_id, n_ans).cast(pa.string()), pa.string()),
        "part": tail(np.full(n_ans, part, np.int64), pa.int64()),
        "query_index": tail(np.arange(first, first + n_ans, dtype=np.int64), pa.int64()),
        "query_id": tail(query_ids, pa.string()),
        "query_row": tail(np.arange(first_row, first_row + n_ans, dtype=np.int64), pa.int64()),
        "label": tail(np.asarray(labels, np.int32), pa.int32()),
        "label_name": tail(names, pa.string()),
        "released_count": tail(np.asarray(counts, np.float64), pa.float64()),
        "seed": tail(pa.nulls(n_ans, pa.string()) if seed is None else pa.repeat(seed, n_ans).cast(pa.string()),
                     pa.string()),
    }


#: Queries screened in one pass over a store that does not fit the feature cache (see _PassScreen), and the
#: fewest rows a screen step of the pass may see.
PASS_QUERIES = 16384
PASS_MIN_ROWS = 1024


class _PassScreen:
    """Candidates of several parts from one pass over the store, when the store does not fit the cache.

    A store larger than the feature cache (``--max-memory``'s half) is read again for every part of
    ``--batch-size`` queries (1M × 384: 1.5 GB per 1,024 queries; issue 21). Candidates depend only on the
    queries, the stored vectors, τ and the run's fixed row mask (deleted rows, rows outside the ledger), never
    on budgets, so the parts of up to PASS_QUERIES queries are screened together and each part then filters,
    charges and commits its own slice, in order, as before: the same candidates (each query's are found
    exactly, whatever the other queries), the same answers and ledger (tests/test_serve_pass.py). The pass's
    pairs are held to the same ``max_pairs`` bound as a part's; past it the pass is dropped and each part
    screens itself (and halves as it always has). Only the flat scan (an LSH/IVF finder reads its own lists).
    """

    def __init__(self, store, source, *, params, device, row_to_ledger, max_pairs, max_memory, batch_size, stop,
                 enabled):
        self.store, self.source, self.params, self.device = store, source, params, device
        self.row_to_ledger, self.max_pairs, self.stop = row_to_ledger, max_pairs, stop
        # At most PASS_QUERIES queries; few enough that the screen still sees PASS_MIN_ROWS rows per step
        # (find_candidates screens max_pairs // queries rows at a time) and that the pass's queries and their
        # copies (float32, FAISS's index, a float64 cast: 16 bytes per value) stay within an eighth of
        # --max-memory. All public figures: the batch size, d and --max-memory.
        cap = min(PASS_QUERIES, max_pairs // PASS_MIN_ROWS, max_memory // 8 // (16 * store.dim))
        self.span = max(batch_size, cap // batch_size * batch_size)
        # On a GPU the next pass is screened while this one's parts are filtered and committed (one pass ahead,
        # in a thread: the screen waits on the device, the filter runs compiled without the GIL).
        self.ahead = enabled and _on_gpu(device)
        self.enabled = enabled and ((not source.fits_cache() and self.span > batch_size) or self.ahead)
        self.lo = self.hi = -1
        self.cands = None
        self._pool = None
        self._next = None  # (lo, hi, future) of the pass being screened ahead

    def _find(self, lo: int, hi: int) -> Candidates | None:
        from .candidates import TooManyPairs, find_candidates

        queries = np.ascontiguousarray(self.store.read("query", "features", lo, hi), np.float32)
        try:
            return find_candidates(queries, self.source, kernel=self.params.kernel, tau=self.params.tau,
                                   nu=self.params.nu, device=self.device, row_mask=self.row_to_ledger >= 0,
                                   max_pairs=self.max_pairs)
        except TooManyPairs:
            return None

    def part(self, lo: int, hi: int) -> Candidates | None:
        """The candidates of stored queries [lo, hi), or None (the part screens itself)."""
        if not self.enabled:
            return None
        if not (self.lo <= lo and hi <= self.hi):
            self.cands = None  # the previous pass's pairs go before this pass's are found
            if self._next is not None and self._next[0] == lo:
                self.lo, self.hi, fut = self._next
                self._next = None
                self.cands = fut.result()
            else:
                self.lo, self.hi = lo, min(self.stop, lo + self.span)
                self.cands = self._find(self.lo, self.hi)
            if self.ahead and self.hi < self.stop and self._next is None:
                if self._pool is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="indknn-screen-ahead")
                nxt = min(self.stop, self.hi + self.span)
                self._next = (self.hi, nxt, self._pool.submit(self._find, self.hi, nxt))
        if self.cands is None:
            return None
        a, b = lo - self.lo, hi - self.lo
        return Candidates(self.cands.rows[a:b], self.cands.kappa[a:b])

    def close(self) -> None:
        """Stop screening ahead (waits for a pass in progress)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._next = None


def _on_gpu(device: str) -> bool:
    """Whether find_candidates runs on a CUDA device for this ``--device`` (auto: torch sees one)."""
    if device == "cpu":
        return False
    from .candidates import _import_torch

    return device in ("cuda", "auto") and _import_torch().cuda.is_available()


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
    """Queries answered through this ledger, all batches (public: every answer released is counted)."""
    return ledger.state.n_answers()


def _reuse_pool(store: FeatureStore, ledger: BudgetLedger) -> ReusePool:
    """Released answers so far (in ledger order) with their query vectors from the store."""
    rows = ledger.state.answer_column("query_row", np.int64)
    labels = ledger.state.answer_column("label", np.int64)
    if rows.size == 0:
        return ReusePool.empty(store.dim)
    lo, hi = int(rows.min()), int(rows.max()) + 1
    block = store.read("query", "features", lo, hi)
    return ReusePool(block[rows - lo].astype(np.float32), labels)


def resolve_query_batch(
    *, store_path: str | os.PathLike, queries: str, batch_id: str | None = None,
    upstream: dict | None = None, reader_options: dict | None = None, device: str = "auto",
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
        if not upstream or upstream.get("role") != "query" or "batch" not in upstream:
            raise BadInputError("stdin: expected the JSON line of `indknn embed --role query`")
        return str(upstream["batch"])
    path = Path(queries)
    if path.exists():
        from .embedding import embed_query_file

        return embed_query_file(path, store_path=store_path, batch=batch_id, device=device,
                                **(reader_options or {}))
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
