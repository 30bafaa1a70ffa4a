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
import hashlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from . import store_versions
from .accounting import epsilon_for_budget
from .errors import BadInputError, LedgerError, LedgerIntegrityError, LockTimeoutError, StorageError
from .wording import count

GENESIS = "0" * 64          # the chain head of a ledger without events
CHAIN_VERSION = 1           # snapshot metadata "chain": events after it must be chained
BINDING_ATTR = "ledger_binding"
MARK_NAME = "ledger-mark.json"
#: Lock file in the store folder that every ledger writer of the store holds (whichever copy of the ledger).
WRITER_LOCK_NAME = ".indknn-ledger-writer.lock"
BUDGET_REL_TOL = 1e-9       # B must be the largest budget certifying ε up to this relative step


def sha256_bytes(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _short(h: str | None) -> str:
    return f"{h[:12]}…" if isinstance(h, str) else repr(h)


# -- snapshots ------------------------------------------------------------------------
def snapshot_is_chained(meta: dict) -> bool:
    return meta.get("chain") == CHAIN_VERSION


def snapshot_head(meta: dict) -> str | None:
    """The chain head a snapshot folded; GENESIS for a ledger without events; None: unknown (legacy)."""
    if snapshot_is_chained(meta):
        return meta.get("chain_head_sha256")
    return GENESIS if int(meta.get("last_event_seq", 0)) == 0 else None


def head_seq(ledger) -> int:
    return max(ledger.last_event_seq, ledger.snapshot_event_seq)


def snapshot_chain_fields(ledger, answers_sha256: str) -> dict:
    """Metadata a new snapshot records: the chain head it folds, and its answers file's hash."""
    return {"chain": CHAIN_VERSION, "chain_head_seq": head_seq(ledger), "chain_head_sha256": ledger.head_sha256,
            "answers_sha256": answers_sha256}


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
    return _certifies(b, eps, delta, conv) and not _certifies(b * (1.0 + BUDGET_REL_TOL), eps, delta, conv)


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
                f"private tuning composed to ε={params.epsilon!r}, δ={params.delta!r} (rdp); the ledger's "
                "parameters or its tuning record were edited; refusing it")
    elif not budget_matches(params.budget, params):
        certifies = _certifies(float(params.budget), float(params.epsilon), float(params.delta), str(params.conversion))
        raise LedgerIntegrityError(
            f"{snap_path}: params.budget B={params.budget!r} is not the calibration of the ledger's own "
            f"ε={params.epsilon!r}, δ={params.delta!r} ({params.conversion}): B "
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


# -- events ------------------------------------------------------------------------------
def check_unique_seqs(path: Path, files: list[tuple[int, Path]]) -> None:
    for (s1, p1), (s2, p2) in zip(files, files[1:]):
        if s1 == s2:
            raise LedgerIntegrityError(f"{path}/events: {p1.name} and {p2.name} share sequence number {s1} "
                                       "(two writers, or an event copied in); refusing the ledger")


def events_after_snapshot(path: Path, files: list[tuple[int, Path]], snap_seq: int) -> list[tuple[int, Path]]:
    """The events to replay: exactly snap_seq+1, snap_seq+2, ... (a gap is a removed event)."""
    after = [(s, p) for s, p in files if s > snap_seq]
    for k, (s, p) in enumerate(after):
        if s != snap_seq + 1 + k:
            raise LedgerIntegrityError(
                f"{path}/events: event {snap_seq + 1 + k} is missing (the snapshot ends at event {snap_seq}, "
                f"the next file is {p.name}); a removed event would refund its charges: refusing the ledger"
            )
    return after


def check_link(event_path: Path, seq: int, info: dict, *, prev: str, snapshot: str, chained: bool) -> bool:
    """Check one event's place in the chain; returns whether the chain has started (chained events seen)."""
    if info.get("seq") != seq:
        raise LedgerIntegrityError(f"{event_path}: the file name says event {seq}, its metadata event "
                                   f"{info.get('seq')!r} (renamed, reordered or copied in); refusing the ledger")
    if "prev_sha256" not in info:
        if chained:
            raise LedgerIntegrityError(f"{event_path}: event {seq} carries no hash link but the ledger's chain "
                                       "has started (an old event copied in?); refusing the ledger")
        return False
    if info.get("snapshot_sha256") != snapshot:
        raise LedgerIntegrityError(f"{event_path}: event {seq} builds on snapshot sha256 "
                                   f"{_short(info.get('snapshot_sha256'))}, this ledger's snapshot is "
                                   f"{_short(snapshot)} (copied in from another state, or the snapshot was edited); "
                                   "refusing the ledger")
    if info.get("prev_sha256") != prev:
        raise LedgerIntegrityError(f"{event_path}: event {seq} links to sha256 {_short(info.get('prev_sha256'))}, "
                                   f"but its predecessor's is {_short(prev)}: an event was edited, removed, "
                                   "reordered or copied in; refusing the ledger")
    return True


# -- binding and high-water mark -------------------------------------------------------------
def mark_path(store_path: str | os.PathLike) -> Path:
    return Path(store_path) / MARK_NAME


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


def read_mark(store_path) -> dict | None:
    """The store's high-water mark: the state folder's, or for a store on object storage the further of it and the
    bucket's copy (:mod:`.ledger_mark_remote`)."""
    from . import ledger_mark_remote

    return ledger_mark_remote.furthest(_read_local_mark(store_path), ledger_mark_remote.read(store_path),
                                       store_path=store_path)


def _read_local_mark(store_path) -> dict | None:
    p = mark_path(store_path)
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LedgerIntegrityError(f"{p}: the ledger's high-water mark is unreadable ({type(exc).__name__})") from None
    if not (isinstance(m, dict) and isinstance(m.get("seq"), int)):
        raise LedgerIntegrityError(f"{p}: the ledger's high-water mark is corrupt")
    return m


def write_mark(path: Path, ledger, *, announce: tuple[int, str] | None = None) -> None:
    """The store's high-water mark: the chain head and the current snapshot (generation and file sha256).

    The snapshot's own hash matters when no event follows it (right after a compaction): an edited snapshot
    is then caught by the mark, since no event links to it yet. ``announce`` = (generation, sha256) of a snapshot
    written but not yet published: a compaction announces it here *before* it switches ``CURRENT``, and
    :func:`check_mark` accepts a ledger past the mark's generation only at that announced snapshot (audit 10, F1:
    a snapshot written by hand at the next generation number was accepted, which refunded every charge).
    """
    from . import ledger_mark_remote
    from .ledger_files import atomic_write_text

    fields = {"ledger_uuid": ledger.meta["ledger_uuid"], "seq": head_seq(ledger),
              "sha256": ledger.head_sha256, "generation": int(ledger.generation),
              "snapshot_sha256": ledger.snapshot_sha256, "time": time.time(),
              # answers released through the ledger up to the head: what `repair` compares
              # with what a damaged or rolled-back ledger still holds (audit 3, review 2)
              "answers": int(ledger.state.answers_released())}
    if announce is not None:
        fields.update(next_generation=int(announce[0]), next_snapshot_sha256=str(announce[1]))
    body = json.dumps(fields)
    atomic_write_text(body, Path(path))
    ledger_mark_remote.write(Path(path).parent, body)  # a store on object storage: the bucket's copy too


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
    from . import store_lease
    from .locking import exclusive_file
    from .object_store import location

    path = Path(store_path) / WRITER_LOCK_NAME
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(exclusive_file(path, timeout=timeout, on_timeout=lambda: LockTimeoutError(
            f"{store_path}: another indknn process writes this store's ledger (waited {timeout:g} s); "
            "retry later or raise --lock-timeout")))
    except OSError as exc:
        raise StorageError(f"{path}: cannot open the store's ledger-writer lock ({exc.strerror}); "
                           "is the store on a read-only file system?") from None
    with stack:
        loc = location(store_path)
        if loc is not None:  # a store on object storage: the ledger writers of every machine (review 23, F2)
            stack.enter_context(store_lease.hold(loc, timeout=timeout, suffix=store_lease.LEDGER_SUFFIX))
        yield


def announced(mark: dict | None, generation: int, snapshot_sha256: str | None) -> bool:
    """Whether the mark announces the snapshot ``generation`` with this file hash (:func:`write_mark`'s
    ``announce``): the only way a ledger may be one generation past the store's mark."""
    return (isinstance(mark, dict) and mark.get("next_generation") == generation
            and isinstance(snapshot_sha256, str) and mark.get("next_snapshot_sha256") == snapshot_sha256)


def carry_mark(from_store, to_store) -> None:
    """Copy the store's local mark into another store folder (a compaction's copy, just before it becomes the
    store: the copy then carries the announcement of the ledger's next snapshot)."""
    from .ledger_files import atomic_write_text

    src = mark_path(from_store)
    if src.is_file():
        atomic_write_text(src.read_text(), mark_path(to_store))


def _sha_at(ledger, seq: int) -> str | None:
    if seq in ledger.event_sha256:
        return ledger.event_sha256[seq]
    if seq == ledger.snapshot_event_seq:
        return snapshot_head(ledger.meta)
    return None  # folded into an older snapshot: only the order can be checked


_UNREAD = object()


def _published_since(store_path, ledger) -> bool:
    """For a caller without the ledger lock, whose mark was read before the ledger: a compaction may have published
    the ledger's snapshot in between (announced in a mark this caller never saw, then named by the one now). True
    when the store's mark now names or announces exactly that snapshot; a mark already past it means the ledger
    moved on again while it was read (ConcurrentChangeError: run again)."""
    from .errors import ConcurrentChangeError

    try:
        now = read_mark(store_path)
    except LedgerIntegrityError:
        return False
    if not isinstance(now, dict) or now.get("ledger_uuid") != ledger.meta["ledger_uuid"]:
        return False
    if announced(now, ledger.generation, ledger.snapshot_sha256) or (
            now.get("generation") == ledger.generation and now.get("snapshot_sha256") == ledger.snapshot_sha256):
        return True
    if isinstance(now.get("generation"), int) and now["generation"] > ledger.generation:
        raise ConcurrentChangeError(f"{ledger.path}: the ledger was compacted while it was read; run again")
    return False


def check_mark(store_path, ledger, *, required: bool, mark=_UNREAD) -> dict | None:
    """The ledger must reach the store's high-water mark with the same event there. Returns the mark.

    A caller without the ledger lock passes ``mark`` = :func:`read_mark` taken *before* it opened
    the ledger: the mark is written after each commit, so it can then only be behind what it read.
    """
    m = read_mark(store_path) if mark is _UNREAD else mark
    from .ledger_mark_remote import FROM_BUCKET

    if m is not None and m.get(FROM_BUCKET) and m.get("ledger_uuid") != ledger.meta["ledger_uuid"]:
        m = _read_local_mark(store_path)  # another ledger's mark left in the bucket: stale (ledger_mark_remote)
    p = mark_path(store_path)
    if m is None:
        if required:
            raise LedgerIntegrityError(f"{p}: the store is bound to this ledger but its high-water mark is "
                                       "missing (removed?); refusing: a rollback could not be detected")
        return None
    if m.get("ledger_uuid") != ledger.meta["ledger_uuid"]:
        raise LedgerIntegrityError(f"{p}: the high-water mark belongs to ledger {m.get('ledger_uuid')}, not to "
                                   f"{ledger.path} ({ledger.meta['ledger_uuid']}); refusing")
    g = m.get("generation")
    if not (isinstance(g, int) and not isinstance(g, bool) and isinstance(m.get("sha256"), str)
            and isinstance(m.get("snapshot_sha256"), str)):
        # every mark written since 2026-11-24 has all three; one without them would skip the checks below
        # (audit 10: a mark edited by hand, with no hash to compute)
        raise LedgerIntegrityError(f"{p}: the ledger's high-water mark lacks its snapshot generation or a hash "
                                   "(edited by hand, or written by an indknn before 2026-11-24); refusing: a "
                                   "rollback could not be detected. `indknn repair` retires every record (no refund)")
    if ledger.generation < g:
        raise LedgerIntegrityError(
            f"{ledger.path}: the ledger is at snapshot generation {ledger.generation}, but the store "
            f"{store_path} saw generation {g}: the ledger was rolled back (an older copy restored), which would "
            "refund charges; refusing it")
    if ledger.generation == g and m.get("snapshot_sha256") != ledger.snapshot_sha256:
        raise LedgerIntegrityError(
            f"{ledger.path}: snapshot-{g:06d}.parquet has sha256 {_short(ledger.snapshot_sha256)}, the "
            f"store {store_path} saw {_short(m.get('snapshot_sha256'))} written: the snapshot was edited; "
            "refusing it")
    if ledger.generation > g and not announced(m, ledger.generation, ledger.snapshot_sha256) and not (
            mark is not _UNREAD and _published_since(store_path, ledger)):
        raise LedgerIntegrityError(
            f"{ledger.path}: the ledger is at snapshot generation {ledger.generation} (sha256 "
            f"{_short(ledger.snapshot_sha256)}), but the store {store_path} saw generation {g}, and no "
            "compaction announced that snapshot: it was written outside indknn (a forged or swapped snapshot "
            "can refund every charge); refusing it. `indknn repair` retires every record (no refund: "
            "docs/RELIABILITY.md)")
    head = head_seq(ledger)
    if head < m["seq"]:
        raise LedgerIntegrityError(
            f"{ledger.path}: the ledger ends at event {head}, but the store {store_path} saw event {m['seq']} "
            "committed: the ledger was rolled back (an older copy restored, or its newest events removed), which "
            "would refund charges; refusing it"
        )
    have = _sha_at(ledger, m["seq"])
    if have is not None and have != m["sha256"]:
        raise LedgerIntegrityError(
            f"{ledger.path}: event {m['seq']} has sha256 {_short(have)}, the store {store_path} saw "
            f"{_short(m['sha256'])} committed there: the ledger's history was replaced; refusing it"
        )
    return m


def check_binding(store, ledger, ledger_path, *, mark=_UNREAD) -> dict:
    """A store bound to another ledger → LedgerError (exit 2); a rolled-back ledger → LedgerIntegrityError.

    Without the ledger lock, pass ``mark`` read before opening the ledger (see :func:`check_mark`).
    """
    b = binding_of(store)
    if b is not None and b.get("ledger_uuid") != ledger.meta["ledger_uuid"]:
        raise _bound_elsewhere(store, b, ledger_path, f"is another ledger ({ledger.meta['ledger_uuid']})")
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
    check_binding(store, ledger, ledger_path)
    store_versions.check(store, ledger)  # a store restored from an older copy is refused (audit 6, F1)
    if bind and (binding_of(store) is None or binding_trace(store) is None):
        _bind(store.path, ledger, ledger_path, lock_timeout, locked_store=locked_store)
    ledger.mark_path = mark_path(store.path)
    ledger.store_version = lambda: store_versions.current(store)


def _bind(store_path, ledger, ledger_path, lock_timeout: float, *, locked_store=None) -> None:
    """Bind the store (root attribute, mark, and the trace in the private group). ``locked_store``: the
    caller's own store object, opened for writing with its write lock held (delete)."""
    from .store import FeatureStore, _fsync_path

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
            _fsync_path(Path(store_path) / "zarr.json")
        if binding_trace(st) is None:  # also for stores bound before the trace existed
            st.group("private").attrs.update({TRACE_ATTR: dict(b)})
            _fsync_path(Path(store_path) / "private" / "zarr.json")
        _fsync_path(Path(store_path))


def recorded_store(ledger_path) -> tuple[Path | None, str | None, str]:
    """The store the ledger records (path, uuid) from its current snapshot's metadata, without replaying it,
    and a note. ``account`` without ``--store`` checks the binding and the high-water mark against it when
    it is reachable (the audit's D3); the path is None (and the note says why) when it is not."""
    import pyarrow.parquet as pq

    try:
        gen = int(json.loads((Path(ledger_path) / "CURRENT").read_text())["generation"])
        meta = json.loads((pq.read_schema(Path(ledger_path) / f"snapshot-{gen:06d}.parquet").metadata or {})[b"indknn"])
        path, uuid_ = Path(str(meta["store_path"])), str(meta["store_uuid"])
    except Exception:  # noqa: BLE001 - the full open reports a damaged ledger
        return None, None, "unchecked against the store: the ledger does not name one"
    if not (path / "zarr.json").is_file():
        return None, uuid_, f"unchecked against the store: none at the recorded {path}"
    return path, uuid_, f"checked against the store at the recorded {path}"
