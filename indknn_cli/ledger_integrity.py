"""Tamper evidence of the budget ledger and its binding to one feature store (issue 16 §2, issue 15 §2).

SPEC §8: "One store, one ledger [...] The ledger is append-only and tamper-evident; a
damaged or rolled-back ledger is refused". Three mechanisms, all checked whenever a
ledger is opened (:meth:`BudgetLedger.open`) or bound to its store (:func:`attach`):

Hash chain
    Every event's metadata records its ``seq``, ``prev_sha256`` (sha256 of the bytes
    of the previous event file, or of the snapshot file for the first event after a
    snapshot) and ``snapshot_sha256`` (the snapshot it builds on). A snapshot records
    the chain head it folded (``chain_head_seq``, ``chain_head_sha256``: the newest
    event's hash, carried over from the previous snapshot when no event was folded)
    and ``answers_sha256`` (its answers file). Opening verifies: no two event files
    share a sequence number, the events after the snapshot are exactly
    ``last_event_seq + 1, + 2, ...``, every event's ``seq`` is its file name's, every
    link matches. Events written before chaining existed (no ``prev_sha256``) are
    accepted only after an unchained snapshot and before the first chained event.

Budgets
    ``params.budget`` must be the calibration of the ledger's own (ε, δ, conversion)
    and every record's ``budget`` must equal ``params.budget``.

Binding and high-water mark
    The store's root attribute ``ledger_binding`` names the ledger's uuid (and its
    path, for messages); the ledger's metadata names the store's uuid. The file
    ``ledger-mark.json`` in the store folder holds the ledger's high-water mark:
    the newest event's ``seq`` and ``sha256``, rewritten after every commit by the
    ledger lock holder. A ledger whose chain ends before the mark (an older copy
    restored, its newest events removed), or whose event at the mark's ``seq`` has
    another hash, is refused. The mark is a plain file rather than a zarr attribute
    because zarr rewrites a group's whole ``zarr.json`` on every attribute update,
    which ``embed`` does under the store lock only.

The chain's primitives live in :mod:`.ledger_chain`, the mark in :mod:`.ledger_mark`; their names are importable
from here.

These are tamper *evidence* against edits, removals, copies and rollbacks by
operators and tools that do not recompute sha256 chains; someone who rewrites the
whole chain and the mark consistently is outside this model (docs/RELIABILITY.md).

Failures raise :class:`LedgerIntegrityError` (exit 1); a store bound to another
ledger raises :class:`LedgerError` (exit 2). Messages name files, sequence numbers
and hashes, never a record id.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from pathlib import Path

import numpy as np

from . import locking, object_store, store_lease, store_versions
from .accounting import epsilon_for_budget
from .errors import BadInputError, LedgerError, LedgerIntegrityError, LockTimeoutError, StorageError
from .fsio import fsync_path
# the chain and the mark have modules of their own; their names stay importable from here, where the whole scheme is
from .ledger_chain import (CHAIN_VERSION, GENESIS, _short, check_link, check_unique_seqs,  # noqa: F401
                           events_after_snapshot, head_seq, sha256_bytes, snapshot_chain_fields, snapshot_head,
                           snapshot_is_chained)
from .ledger_mark import (_UNREAD, MARK_NAME, _read_local_mark, announced, carry_mark, check_mark,  # noqa: F401
                          mark_path, read_mark, write_mark)
from .ledger_snapshot import current_generation
from .wording import count, per_unit

BINDING_ATTR = "ledger_binding"
#: Lock file in the store folder that every ledger writer of the store holds (whichever copy of the ledger).
WRITER_LOCK_NAME = ".indknn-ledger-writer.lock"
BUDGET_REL_TOL = 1e-9       # B must be the largest budget certifying ε up to this relative step
EARLIER_CURVE_TOL = 1e-10   # ... and certify ε up to this (gdp ledgers made before review 65, F1's rounding)


@functools.lru_cache(maxsize=256)
def _certifies(budget: float, epsilon: float, delta: float, conversion: str) -> bool:
    """The calibration's own test: B converts to at most the target ε (accounting.calibrate_budget)."""
    try:
        return epsilon_for_budget(budget=budget, delta=delta, conversion=conversion) <= epsilon
    except (BadInputError, TypeError, ValueError, OverflowError):
        return False


def budget_matches(budget: float, params) -> bool:
    """Whether B is the calibration of the ledger's own (ε, δ, conversion).

    ``calibrate_budget`` returns (by bisection to 1e-13) the largest B whose ε(B) ≤ ε. Re-running it
    costs ~45 conversions (2 s for RDP) on every open, so this checks the same two facts directly: B
    certifies ε, and B·(1 + 1e-9) does not (B is that largest value up to 1e-9 relative). A raised B
    fails the first test, a lowered one the second. ``account --verify`` also recomputes the
    calibration and reports whether it is bit-identical.
    """
    try:
        b, eps, delta, conv = float(budget), float(params.epsilon), float(params.delta), str(params.conversion)
    except (TypeError, ValueError):
        return False
    if not (math.isfinite(b) and b > 0):
        return False
    # ε(B) ≤ ε to 1e-10: a gdp ledger calibrated before δ(ε) was rounded up (review 65, F1) converts to an ε up to
    # ~1e-11 (relative) above its target with today's curve; it is the same ledger, not an edited B
    return (_certifies(b, eps * (1.0 + EARLIER_CURVE_TOL), delta, conv)
            and not _certifies(b * (1.0 + BUDGET_REL_TOL), eps, delta, conv))


@functools.lru_cache(maxsize=64)
def _tuned_certifies(budget: float, rho_run: float, mean_runs, shape, method: str, epsilon: float,
                     delta: float) -> bool:
    from .tuning_accounting import composed_epsilon

    try:
        return composed_epsilon(rho_run=rho_run, mean_runs=mean_runs, shape=shape, budget_serve=budget,
                                delta=delta, method=method) <= epsilon
    except (BadInputError, TypeError, ValueError, OverflowError):
        return False


def tuned_budget_matches(budget: float, params, tuning: dict) -> bool:
    """A ledger made by `index --tune private`: B is B_serve, the largest budget whose composition with the
    recorded search (dp-accounting, RDP) certifies the ledger's ε — the same two-sided test as
    :func:`budget_matches`, on the composed curve (docs/TUNING.md)."""
    try:
        b, eps, delta = float(budget), float(params.epsilon), float(params.delta)
        from .tuning_accounting import search_args

        a = search_args(tuning)
        key = (a["rho_run"], a["mean_runs"], a["shape"], a["method"])
    except (KeyError, TypeError, ValueError, BadInputError):
        return False
    if not (math.isfinite(b) and b > 0) or float(tuning.get("budget_serve", -1)) != b:
        return False
    return (_tuned_certifies(b, *key, eps, delta)
            and not _tuned_certifies(b * (1.0 + BUDGET_REL_TOL), *key, eps, delta))


def check_snapshot(snap_path: Path, meta: dict, params, answers_bytes: bytes) -> None:
    tuning = meta.get("tuning") if isinstance(meta.get("tuning"), dict) else None
    if tuning is not None and tuning.get("mode") == "private":
        if not tuned_budget_matches(params.budget, params, tuning):
            raise LedgerIntegrityError(
                f"{snap_path}: params.budget B={params.budget!r} is not the serving budget of the recorded "
                f"private tuning composed to ε={params.epsilon!r}, δ={params.delta!r} (rdp, "
                f"{per_unit(getattr(params, 'privacy_unit', 'record'))}); the ledger's "
                "parameters or its tuning record were edited; refusing it")
    elif not budget_matches(params.budget, params):
        certifies = _certifies(float(params.budget), float(params.epsilon), float(params.delta), str(params.conversion))
        raise LedgerIntegrityError(
            f"{snap_path}: params.budget B={params.budget!r} is not the calibration of the ledger's own "
            f"ε={params.epsilon!r}, δ={params.delta!r} ({params.conversion}, "
            f"{per_unit(getattr(params, 'privacy_unit', 'record'))}): B "
            f"{'is below the largest budget that certifies' if certifies else 'does not certify'} that ε; "
            "the ledger's parameters were edited; refusing it"
        )
    want = meta.get("answers_sha256")
    if snapshot_is_chained(meta) and want != sha256_bytes(answers_bytes):
        raise LedgerIntegrityError(f"{snap_path.with_name(snap_path.name.replace('snapshot-', 'answers-'))}: "
                                   f"sha256 {_short(sha256_bytes(answers_bytes))} is not the {_short(want)} its "
                                   "snapshot recorded (released answers edited or replaced); refusing the ledger")


def check_record_budgets(path: Path, ledger) -> None:
    b = ledger.state.budget
    bad = b != ledger.params.budget
    if bad.any():
        vals = np.unique(b[bad])
        raise LedgerIntegrityError(
            f"{path}: {count(int(bad.sum()), 'record')} {'carries' if int(bad.sum()) == 1 else 'carry'} a budget "
            f"other than the ledger's B={ledger.params.budget!r} "
            f"(e.g. {float(vals[-1])!r}): the ledger was edited; refusing it"
        )


# -- binding and high-water mark -------------------------------------------------------------
def binding_of(store) -> dict | None:
    b = dict(store.root.attrs).get(BINDING_ATTR)
    return b if isinstance(b, dict) else None


def _bound_elsewhere(store, binding: dict, ledger_path, what: str) -> LedgerError:
    return LedgerError(
        f"{store.path}: this store is bound to the ledger {binding.get('ledger_path')} (ledger uuid "
        f"{binding.get('ledger_uuid')}); {ledger_path} {what}. One store, one ledger: a second ledger would give "
        "every record a fresh budget. Use the bound ledger (a copy of it works too); a new budget for the same "
        "people needs a new store"
    )


#: Second trace of the binding, in the private group's attributes (written by :func:`_bind`, copied by a
#: store compaction): removing the root attribute and the mark leaves this one, so a new ledger is refused.
TRACE_ATTR = "ledger_bound"


def binding_trace(store) -> dict | None:
    try:
        t = dict(store.group("private").attrs).get(TRACE_ATTR)
    except KeyError:
        return None
    return t if isinstance(t, dict) else None


def refuse_ledger_in_store(store_path, ledger_path) -> None:
    """A ledger folder that is the store's folder or inside it → BadInputError (exit 2), before anything is written.

    A compaction of the store (``delete --compact``) builds a new store folder and replaces the old one: a ledger
    kept inside went with it (every snapshot gone, every spent budget lost, nothing for `repair` to rebuild), and a
    ledger *at* the store's folder mixed their files and locks (review 31, QA). ``store_path``: the store's folder (a
    store on object storage: its state folder, which a compaction replaces the same way)."""
    store = Path(store_path).resolve()
    ledger = Path(ledger_path).resolve()
    if ledger == store or store in ledger.parents:
        where = "is the store's folder" if ledger == store else f"is inside the store's folder {store}"
        raise BadInputError(
            f"--ledger {ledger_path} {where}: a compaction of the store (delete --compact) replaces that folder and "
            "would take the ledger's files with it; keep the ledger beside the store, not in it (an existing one: "
            "move the folder with `mv`, never copy it, and pass its new path)")


def refuse_second_ledger(store, ledger_path) -> None:
    """Before creating a ledger: a store bound to a ledger gets no other (exit 2, names the bound ledger).

    A store without the root binding that still shows it was bound (the high-water mark file, or the
    binding's trace in the private group) had its binding removed: refused too (D1 of the privacy audit).
    """
    b = binding_of(store)
    if b is not None:
        raise _bound_elsewhere(store, b, ledger_path, "holds no ledger, and no new one is created for it")
    trace = binding_trace(store)
    if trace is not None or mark_path(store.path).exists():
        raise LedgerError(
            f"{store.path}: this store was bound to a ledger"
            f"{' (uuid ' + str(trace.get('ledger_uuid')) + ')' if trace else ''} but its binding is gone "
            f"(the root attribute {BINDING_ATTR!r} was removed or edited); {ledger_path} is not created. One store, "
            "one ledger: a new ledger would give every record a fresh budget. Use the bound ledger; a new budget "
            "for the same people needs a new store")


def bound_era(ledger) -> bool:
    """Whether the ledger was written by an indknn that binds store and ledger: its snapshot or one of its
    events is hash-chained (chaining and binding came together). Such a ledger is bound to its store by
    the first index or serve that writes it, so it never legitimately meets an unbound store again — unless
    it was never written at all (a ledger just created: no event, no record)."""
    chained_events = len(ledger.event_sha256) - ledger.unchained_events
    return snapshot_is_chained(ledger.meta) or chained_events > 0


def _never_written(ledger) -> bool:
    return head_seq(ledger) == 0 and len(ledger.state) == 0


@contextlib.contextmanager
def writer_lock(store_path, *, timeout: float):
    """Held by every ledger writer of a store (serve, index, delete, repair) inside its ledger lock.

    The ledger lock is per ledger folder, so two *copies* of one ledger could each take their own and
    commit concurrently: both pass the high-water-mark check, one copy's charges then live only in the
    copy that is later refused (a fork). This lock, in the store folder, makes every writer of the store
    wait for the others, so the second one sees the first one's mark and is refused. For a store on object
    storage, whose state folder is per machine, the bucket's ledger-writer lease does the same across machines
    (review 23, F2), and the mark has a copy in the bucket (:mod:`.ledger_mark_remote`).
    """
    path = Path(store_path) / WRITER_LOCK_NAME
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(locking.exclusive_file(path, timeout=timeout, on_timeout=lambda: LockTimeoutError(
            f"{store_path}: another indknn process writes this store's ledger (waited {timeout:g} s); "
            "retry later or raise --lock-timeout")))
    except OSError as exc:
        raise StorageError(f"{path}: cannot open the store's ledger-writer lock ({exc.strerror}); "
                           "is the store on a read-only file system?") from None
    with stack:
        loc = object_store.location(store_path)
        if loc is not None:  # a store on object storage: the ledger writers of every machine (review 23, F2)
            stack.enter_context(store_lease.hold(loc, timeout=timeout, suffix=store_lease.LEDGER_SUFFIX))
        yield


def check_binding(store, ledger, ledger_path, *, mark=_UNREAD) -> dict:
    """A store bound to another ledger → LedgerError (exit 2); a rolled-back ledger → LedgerIntegrityError.

    Without the ledger lock, pass ``mark`` read before opening the ledger (see :func:`check_mark`).
    """
    b = binding_of(store)
    if b is not None and b.get("ledger_uuid") != ledger.meta["ledger_uuid"]:
        raise _bound_elsewhere(store, b, ledger_path, f"is another ledger ({ledger.meta['ledger_uuid']})")
    if not bound_era(ledger) and not _never_written(ledger):
        # review 27, F2: a snapshot rewritten without its chain fields (every spent 0), the events, the binding, its
        # trace and the mark removed, was accepted as a ledger from before chaining; no hash had to be computed
        raise LedgerIntegrityError(
            f"{ledger_path}: the ledger carries no hash chain (written by an indknn before 2026-11-24, or its chain "
            "fields removed): nothing could show it edited or rolled back; refusing. `indknn repair` retires every "
            "record (no refund), starts its chain and binds the store")
    if b is None and bound_era(ledger) and not _never_written(ledger):
        raise LedgerIntegrityError(
            f"{store.path}: the store carries no binding to a ledger, but {ledger_path} (uuid "
            f"{ledger.meta['ledger_uuid']}) was written bound to a store (its events are hash-chained): the store's "
            f"binding attribute {BINDING_ATTR!r} was removed, or this is another copy of the store; a rollback "
            "could not be detected: refusing")
    mark = check_mark(store.path, ledger, required=b is not None, mark=mark)
    return {"bound": b is not None, "binding": b, "mark": mark}


def attach(store, ledger, ledger_path, *, bind: bool, lock_timeout: float = 60.0, locked_store=None) -> None:
    """Check the binding and the mark; bind an unbound store (``bind``); keep the mark current from now on.

    The caller holds the ledger lock (and, when ``bind`` is False, may hold the store lock).
    """
    mark = check_binding(store, ledger, ledger_path)["mark"]
    store_versions.check(store, ledger)  # a store restored from an older copy is refused (audit 6, F1)
    if bind and (binding_of(store) is None or binding_trace(store) is None):
        _bind(store.path, ledger, ledger_path, lock_timeout, locked_store=locked_store)
    ledger.mark_path = mark_path(store.path)
    ledger.store_version = lambda: store_versions.current(store)
    catch_up_mark(ledger, mark)


def catch_up_mark(ledger, mark: dict | None) -> None:
    """Write the store's mark at the ledger's head when it is behind (the caller holds the ledger locks and checked
    the mark: :func:`check_mark`), before anything is released.

    Review 67, F4: the mark is written after each event's commit, so a crash (kill -9, a cron timeout) or a full
    store volume between the two leaves it one event behind, which :func:`check_mark` accepts: nothing of that event
    had been released. The cron's re-run then released the event's answers through the "already answered" path,
    which commits nothing, so the mark stayed behind; a ledger backup one event older (or the newest event file
    removed) then passed every check and refunded those charges. Every ledger writer (serve, index, delete) now
    brings the mark up first; when it cannot be written, the command stops with nothing released."""
    if mark is None or ledger.mark_path is None:
        return
    behind = head_seq(ledger) > int(mark["seq"]) or int(ledger.generation) > int(mark["generation"])
    if behind:
        write_mark(ledger.mark_path, ledger)


def bind(store_path, ledger, ledger_path, *, lock_timeout: float = 60.0) -> None:
    """Bind an unbound store to ``ledger`` (``repair`` after it retired every record of a ledger from before binding)."""
    _bind(store_path, ledger, ledger_path, lock_timeout)


def _bind(store_path, ledger, ledger_path, lock_timeout: float, *, locked_store=None) -> None:
    """Bind the store (root attribute, mark, and the trace in the private group). ``locked_store``: the
    caller's own store object, opened for writing with its write lock held (delete)."""
    from .store import FeatureStore

    st = locked_store if locked_store is not None else FeatureStore.open(store_path, mode="a")
    with (contextlib.nullcontext() if locked_store is not None else st.write_lock(timeout=lock_timeout)):
        b = binding_of(st)
        if b is not None and b.get("ledger_uuid") != ledger.meta["ledger_uuid"]:  # bound by another process
            raise _bound_elsewhere(st, b, ledger_path, f"is another ledger ({ledger.meta['ledger_uuid']})")
        if b is None:
            write_mark(mark_path(store_path), ledger)  # first: a bound store always has a mark
            b = {"ledger_uuid": ledger.meta["ledger_uuid"], "ledger_path": str(Path(ledger_path).resolve()),
                 "bound_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            st.root.attrs.update({BINDING_ATTR: b})
            fsync_path(Path(store_path) / "zarr.json")
        if binding_trace(st) is None:  # also for stores bound before the trace existed
            st.group("private").attrs.update({TRACE_ATTR: dict(b)})
            fsync_path(Path(store_path) / "private" / "zarr.json")
        fsync_path(Path(store_path))


def recorded_store(ledger_path) -> tuple[Path | None, str | None, str]:
    """The store the ledger records (path, uuid) from its current snapshot's metadata, without replaying it,
    and a note. ``account`` without ``--store`` checks the binding and the high-water mark against it when
    it is reachable (the audit's D3); the path is None (and the note says why) when it is not."""
    import pyarrow.parquet as pq

    gen = current_generation(Path(ledger_path))  # looks at CURRENT before reading it (a named pipe would block)
    if gen is None:
        return None, None, "unchecked against the store: the ledger does not name one"
    try:
        meta = json.loads((pq.read_schema(Path(ledger_path) / f"snapshot-{gen:06d}.parquet").metadata or {})[b"indknn"])
        path, uuid_ = Path(str(meta["store_path"])), str(meta["store_uuid"])
    except Exception:  # noqa: BLE001 - the full open reports a damaged ledger
        return None, None, "unchecked against the store: the ledger does not name one"
    if not (path / "zarr.json").is_file():
        return None, uuid_, f"unchecked against the store: none at the recorded {path}"
    return path, uuid_, f"checked against the store at the recorded {path}"
