"""serve-queries' pipeline around the engine (issue 21): passes screened ahead, events built from arrays, commits
overlapped with the next part's filter.

serve-queries answers a stored batch in parts of ``--batch-size`` queries, each filtered, charged, committed
and only then released (SPEC §8). What this module changes is only when work happens, never what is released
or charged, nor its order:

- :class:`PassScreen`: the candidates of several parts from one pass over the store (candidates do not depend
  on budgets); on a GPU the next pass is screened in a thread while this pass's parts are filtered.
- :class:`Committer`: on a GPU, part k's event is written (and its answers released after it is durable) in a
  thread while part k+1 is filtered in memory; commits stay in order, one in flight, and a failed commit stops
  the run before anything later is released (part k+1's charges then exist only in memory, unreleased).
- :func:`event_columns`: a serve event's columns as pyarrow arrays (no Python list per charge).

tests/test_serve_pass.py pins that answers and ledger are those of the plain part-by-part loop.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import numpy as np
import pyarrow as pa

from .engine import Candidates

log = logging.getLogger(__name__)


def event_columns(n_ch, n_ans, *, touched, spent_after, selected, batch_id, part, first, query_ids, first_row,
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


#: Queries screened in one pass over a store that does not fit the feature cache (see PassScreen), and the
#: fewest rows a screen step of the pass may see.
PASS_QUERIES = 16384
PASS_MIN_ROWS = 1024


class PassScreen:
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
                 enabled, row_labels=None):
        self.store, self.source, self.params, self.device = store, source, params, device
        self.row_to_ledger, self.max_pairs, self.stop = row_to_ledger, max_pairs, stop
        self.row_labels = row_labels
        # At most PASS_QUERIES queries; few enough that the screen still sees PASS_MIN_ROWS rows per step
        # (find_candidates screens max_pairs // queries rows at a time) and that the pass's queries and their
        # copies (float32, FAISS's index, a float64 cast: 16 bytes per value) stay within an eighth of
        # --max-memory. All public figures: the batch size, d and --max-memory.
        cap = min(PASS_QUERIES, max_pairs // PASS_MIN_ROWS, max_memory // 8 // (16 * store.dim))
        self.span = max(batch_size, cap // batch_size * batch_size)
        # On a GPU the next pass is screened while this one's parts are filtered and committed (one pass ahead,
        # in a thread: the screen waits on the device, the filter runs compiled without the GIL).
        self.ahead = enabled and on_gpu(device)
        if self.ahead:  # two passes held at once, each pair with its ledger index and label (32 bytes, not the
            # bound's 24): each pass gets 3/8 of the bound, so their pairs together stay within it (audit
            # 2026-11-27); the device's own steps are sized by its memory (gpu_screen.step_bytes)
            self.max_pairs = max(1, max_pairs * 3 // 8)
        self.enabled = enabled and ((not source.fits_cache() and self.span > batch_size) or self.ahead)
        self.lo = self.hi = -1
        self.cands = None
        self._pool = None
        self._next = None  # (lo, hi, future) of the pass being screened ahead

    def _find(self, lo: int, hi: int) -> Candidates | None:
        from .candidates import TooManyPairs, find_candidates

        queries = np.ascontiguousarray(self.store.read("query", "features", lo, hi), np.float32)
        try:
            cands = find_candidates(queries, self.source, kernel=self.params.kernel, tau=self.params.tau,
                                   nu=self.params.nu, device=self.device, row_mask=self.row_to_ledger >= 0,
                                   max_pairs=self.max_pairs)
        except TooManyPairs:
            return None
        if self.ahead and self.row_labels is not None and hasattr(cands, "gather"):
            cands.gather(self.row_to_ledger, self.row_labels)  # in this thread, not the filter's
        return cands

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
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="indknn-screen-ahead")
                nxt = min(self.stop, self.hi + self.span)
                self._next = (self.hi, nxt, self._pool.submit(self._find, self.hi, nxt))
        if self.cands is None:
            return None
        a, b = lo - self.lo, hi - self.lo
        return self.cands.slice(a, b)

    def close(self) -> None:
        """Stop screening ahead (waits for a pass in progress)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._next = None


def on_gpu(device: str) -> bool:
    """Whether find_candidates runs on a CUDA device for this ``--device`` (auto: torch sees one)."""
    if device == "cpu":
        return False
    from .candidates import _import_torch

    return device in ("cuda", "auto") and _import_torch().cuda.is_available()


class Committer:
    """Runs each part's ``commit`` (write the event, then release its answers) in order: inline, or with
    ``overlap`` in one thread, one commit in flight, so that the caller filters the next part meanwhile.

    The caller holds the ledger's lock around the whole run, so no commit may outlive it (audit 2026-11-27):
    :meth:`wait` and :meth:`close` wait for the commit in flight to finish even through Ctrl-C (the
    interrupt is raised once it has), and :meth:`close` marks the committer abandoned, after which a commit
    that has not started writes and releases nothing (:meth:`guard`, run before each commit in the thread).
    A commit that has written its event releases its answers while the lock is still held."""

    def __init__(self, overlap: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="indknn-commit") if overlap else None
        self._pending = None
        self._abandoned = threading.Event()
        self._running = threading.Lock()  # held by the commit thread from its guard to the end of its commit

    def guard(self) -> None:
        """Raise (nothing written or released from here on) once the run has left its lock."""
        if self._abandoned.is_set():
            raise CommitAbandoned("serve-queries stopped: this part's commit was abandoned before it was written")

    def submit(self, commit) -> None:
        """``commit()`` now (inline) or after the previous one (overlap); a previous failure is raised here."""
        if self._pool is None:
            commit()
            return
        self.wait()
        self._pending = self._pool.submit(self._run, commit)

    def _run(self, commit) -> None:
        """In the commit thread: the guard and the commit under ``_running``, which :meth:`close` takes once
        before it returns, so no commit is past its guard once the run lets go of its lock (whatever an
        interrupt did to ``_pending``, e.g. one landing inside ``submit``)."""
        with self._running:
            self.guard()
            commit()

    def wait(self) -> None:
        """Until the commit in flight is done; its exception, if any, is raised."""
        if self._pending is None:
            return
        _finish(self._pending)
        pending, self._pending = self._pending, None
        pending.result()

    def close(self) -> None:
        """Abandon commits not yet started and wait for the one in flight (through Ctrl-C). Called when the run
        ends, normally or not, before the ledger's lock is released. A failure of that last commit is logged (on
        the normal path :meth:`wait` raised it); a Ctrl-C while closing is raised once nothing runs."""
        with _signals_held() as held:
            self._abandoned.set()
            if self._pool is not None:
                pending, self._pending = self._pending, None
                try:
                    if pending is not None:
                        held += _finish(pending, raise_held=False)
                        exc = None if pending.cancelled() else pending.exception()
                        if exc is not None and not isinstance(exc, CommitAbandoned):
                            log.warning("the commit in flight also failed: %s: %s", type(exc).__name__, exc)
                    self._running.acquire()  # a commit that passed its guard has finished (none can start now)
                    self._running.release()
                finally:
                    self._pool.shutdown(wait=False, cancel_futures=True)  # nothing is running or queued any more
                    self._pool = None
        if held:  # Ctrl-C while closing: raised now that nothing runs
            raise _as_exception(held[0])


class CommitAbandoned(RuntimeError):
    """A commit reached its guard after its run had stopped (never raised to a caller while a lock is held)."""


def _finish(future, *, raise_held: bool = True) -> list:
    """Wait until ``future`` is done; Ctrl-C arriving meanwhile is held (the thread waited for writes the
    ledger under the caller's lock) and, with ``raise_held``, raised once it is done; else returned."""
    with _signals_held() as held:
        while not future.done():
            try:
                futures_wait([future], timeout=1.0)
            except BaseException as exc:  # noqa: BLE001 - another handler's exception: re-raised once done
                held.append(exc)
    if held and raise_held:
        raise _as_exception(held[0])
    return held


def _as_exception(entry) -> BaseException:
    """What :func:`_signals_held` recorded, as the exception to raise: an exception as it was, SIGTERM as
    :class:`Terminated` (exit 143), SIGINT as KeyboardInterrupt."""
    import signal

    from .errors import Terminated

    if isinstance(entry, BaseException):
        return entry
    return Terminated() if entry == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def signals_deferred(enabled: bool):
    """With ``enabled``, Ctrl-C and SIGTERM inside the block are recorded and raised at the next ``check()`` (the
    callable it yields) or when the block ends normally, never between two bytecodes. serve-queries holds them
    for its whole overlapped run: a second Ctrl-C landing after the first was raised but before
    :meth:`Committer.close` held signals escaped the close and let the ledger's lock go with a commit still
    writing (a window found after review 52). A run that ends by an exception keeps that exception."""
    if not enabled:
        yield lambda: None
        return
    with _signals_held() as held:
        def check() -> None:
            if held:
                raise _as_exception(held[0])

        yield check
    if held:  # landed after the last check: raised now that the handlers are back
        raise _as_exception(held[0])


@contextlib.contextmanager
def _signals_held():
    """SIGINT recorded instead of raised inside the block (main thread only; elsewhere signals never arrive):
    the list it yields holds one entry per Ctrl-C; the caller raises after it has finished waiting. SIGTERM too when
    a Python handler takes it (the CLI's, which raises :class:`Terminated`); under the default it kills at once."""
    import signal

    held: list = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    record = lambda signum, frame: held.append(signum)  # noqa: E731
    try:
        old, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    except (ValueError, TypeError):  # an embedding interpreter without signal handling
        yield held
        return
    try:  # both restored whatever lands while they are set (review 51, F3: a SIGTERM between the two calls left
        # Ctrl-C recorded and never raised for the rest of the run)
        try:
            if callable(old_term):
                signal.signal(signal.SIGTERM, record)
            signal.signal(signal.SIGINT, record)
        except (ValueError, TypeError):
            pass
        yield held
    finally:  # None: the previous handler was not set from Python (restored as the default)
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGINT, signal.SIG_DFL if old is None else old)
            if callable(old_term):
                signal.signal(signal.SIGTERM, old_term)


#: Python's thread switch interval while a GPU serve runs its three threads (the default is 5 ms): the screen's
#: thread issues thousands of short device calls per pass, each needing the interpreter lock back from the
#: filter's or the commit's Python work; waiting up to 5 ms each time left the device idle.
SWITCH_INTERVAL_S = 0.0002


@contextlib.contextmanager
def responsive_threads(enabled: bool):
    """The switch interval at SWITCH_INTERVAL_S inside the block (when ``enabled``), restored after."""
    if not enabled:
        yield
        return
    old = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(old)
