"""The Parquet budget ledger: per-record spent budgets, append-only events (see docs/FORMAT.md).

Layout of a ledger directory::

    CURRENT                      {"generation": g}  (atomic rename)
    snapshot-<g>.parquet         one row per record ever indexed (tombstones included)
    answers-<g>.parquet          every answer released up to the snapshot
    events/<seq>-<kind>-....parquet   one file per committed event after the snapshot
    LOCK                         flock (with the folder itself): one writer at a time

State = snapshot + events with seq > the snapshot's ``last_event_seq``, replayed
in order. Every file is written to a temporary name, fsync'd, renamed, and the
directory fsync'd: an event exists completely or not at all (SPEC §8 "charge
before release": callers release answers only after :meth:`commit_serve` returns).

Reading a snapshot is :mod:`.ledger_snapshot`'s; what an event's rows do to the state, written or
replayed, is :mod:`.ledger_events`'; the hash chain is :mod:`.ledger_integrity`'s.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import FORMAT_VERSION, accounting
from . import ledger_events, ledger_history, ledger_lock, ledger_pairing, ledger_snapshot
from . import ledger_integrity as integrity
from .errors import LedgerError, LedgerIntegrityError, StorageError, StoreError
from .fsio import atomic_write_text
from .id_text import canonical, index_by_canonical
from .ledger_files import _fault, atomic_write_parquet, atomic_write_parquet_tables
from .ledger_state import ANSWER_SCHEMA, EVENT_SCHEMA, LedgerState, PrivacyParams, _check_finite_columns


class BudgetLedger:
    """A ledger directory bound to one feature store."""

    def __init__(self, path: Path, meta: dict, state: LedgerState, generation: int, last_event_seq: int):
        self.path = path
        self.meta = meta
        self.params = PrivacyParams(**meta["params"])
        self.state = state
        self.generation = generation
        self.last_event_seq = last_event_seq
        self.snapshot_event_seq = int(meta.get("last_event_seq", 0))
        # Hash chain (ledger_integrity): what the next event links to, the newest event's hash (the chain
        # head, recorded by snapshots and in the store's high-water mark) and the hashes of the events read.
        self.snapshot_sha256 = integrity.GENESIS
        self.chain_prev_sha256 = integrity.GENESIS
        self.head_sha256 = integrity.snapshot_head(meta)
        self.event_sha256: dict[int, str] = {}
        self.unchained_events = 0  # events written before chaining existed (accepted, reported by --verify)
        self.mark_path: Path | None = None  # store's high-water mark, rewritten after each commit
        #: () -> {"store_uuid", "version"} of the store now (store_versions.current), recorded by every commit;
        #: set by ledger_integrity.attach after it checked the store against what the ledger last recorded
        self.store_version = None

    # -- opening -----------------------------------------------------------
    exists = staticmethod(ledger_snapshot.ledger_exists)

    @classmethod
    def create(cls, path: str | os.PathLike, *, params: PrivacyParams, store_uuid: str, store_path: str,
               tuning: dict | None = None) -> "BudgetLedger":
        """``tuning``: the record of ``index --tune`` (indknn_cli.tuning.TuningRecord.as_dict()), written in the
        metadata of generation 0 — before the ledger exists, so before any query can be charged."""
        path = Path(path)
        params.validate()
        if tuning is not None and tuning.get("mode") == "private" and params.conversion != "rdp":
            raise LedgerError(f"{path}: a privately tuned ledger composes tuning and serving by RDP; "
                              f"its conversion must be rdp, got {params.conversion!r}")
        if cls.exists(path):
            raise LedgerError(f"{path}: a ledger already exists here")
        path.mkdir(parents=True, exist_ok=True)
        (path / "events").mkdir(exist_ok=True)
        meta = {
            "format_version": FORMAT_VERSION, "ledger_uuid": uuid.uuid4().hex, "store_uuid": store_uuid,
            "store_path": str(store_path), "params": params.as_dict(),
            "created": time.time(), "last_event_seq": 0,
            **({"tuning": dict(tuning)} if tuning is not None else {}),
            # ε of the budget B at the ledger's δ under every conversion, computed once here (the rdp one by
            # dp-accounting, whose import is most of an `account` process's fixed cost); read by `account`
            # when B and δ match (report._guarantee), and covered by the snapshot's hash chain like the rest
            "epsilon_at_budget": {"budget": params.budget, "delta": params.delta,
                                  "by_conversion": accounting.epsilon_by_conversion(budget=params.budget,
                                                                                    delta=params.delta)},
        }
        state = LedgerState.empty()
        ledger = cls(path, meta, state, generation=-1, last_event_seq=0)
        ledger._write_snapshot(generation=0)
        return cls.open(path)

    @classmethod
    def open(cls, path: str | os.PathLike, *, store_uuid: str | None = None, retries: int = 5,
             store_compacted_from: frozenset[str] = frozenset()) -> "BudgetLedger":
        """The ledger at ``path``; with ``store_uuid``, the store it is opened for (refused when the ledger is
        another store's). ``store_compacted_from``: that store's uuids before its compactions
        (:meth:`FeatureStore.compacted_from`; :meth:`open_for` passes both)."""
        path = Path(path)
        if not cls.exists(path):
            raise LedgerError(f"{path}: no budget ledger here (create one with `indknn index`)")
        for attempt in range(retries):
            gen0 = cls._current_generation(path)
            try:
                ledger = cls._load(path)
                if cls._current_generation(path) == ledger.generation:
                    break  # no compaction landed while we read: snapshot + events are consistent
                if attempt == retries - 1:
                    raise LedgerError(f"{path}: ledger files changed while reading (a compaction ran); try again")
                continue
            except LedgerIntegrityError:
                if cls._current_generation(path) == gen0:
                    raise  # no compaction landed while we read: the ledger itself is damaged
                if attempt == retries - 1:
                    raise LedgerError(f"{path}: ledger files changed while reading (a compaction ran); "
                                      "try again") from None
            except FileNotFoundError:  # a concurrent compaction removed files between reads
                if attempt == retries - 1:
                    gen = cls._current_generation(path)
                    if gen == gen0 and not (path / f"snapshot-{gen:06d}.parquet").is_file():
                        # CURRENT named it throughout this read: no compaction ran (one writes its snapshot before
                        # moving CURRENT on, and removes the old one after); "try again" would never clear (review 29)
                        present = sorted(p.name for p in path.glob("snapshot-*.parquet"))
                        raise LedgerIntegrityError(  # damage: exit 1 (README, exit codes)
                            f"{path}: CURRENT names snapshot-{gen:06d}.parquet, which is missing (CURRENT edited, or "
                            "the snapshot removed): the ledger is damaged, not busy; refusing. Snapshots present: "
                            f"{', '.join(present) or 'none'}. `indknn repair` writes CURRENT back to the newest "
                            "one (nobody is retired when the store's high-water mark then agrees; every record when "
                            "the ledger is behind it); with none left, restore the ledger from a backup") from None
                    answers = path / f"answers-{gen:06d}.parquet" if gen is not None else None
                    if gen == gen0 and answers is not None and not answers.is_file():
                        # the snapshot is there and CURRENT never moved: its released answers were removed, which
                        # no compaction does (it writes both before CURRENT moves on); "try again" never clears
                        raise LedgerIntegrityError(
                            f"{answers}: missing (removed by hand or lost): the answers released up to snapshot "
                            f"{gen} are gone, so the ledger is damaged, not busy; refusing it. Restore the ledger "
                            "folder from a backup (one older than the store's high-water mark is refused; "
                            "`indknn repair` then retires every record: no refund); `indknn delete` still erases "
                            "meanwhile") from None
                    raise LedgerError(f"{path}: ledger files changed while reading; try again") from None
                time.sleep(0.05)
        if store_uuid is not None and ledger.meta["store_uuid"] != store_uuid:
            ledger_pairing.refuse_other_store(path, ledger.meta, generation=ledger.generation, store_uuid=store_uuid,
                                              store_compacted_from=store_compacted_from)
        return ledger

    @classmethod
    def open_for(cls, path: str | os.PathLike, store, **kw) -> "BudgetLedger":
        """:meth:`open` for ``store`` (a :class:`FeatureStore`): its uuid, and those it had before compactions."""
        return cls.open(path, store_uuid=store.uuid, store_compacted_from=store.compacted_from(), **kw)

    _current_generation = staticmethod(ledger_snapshot.current_generation)

    @classmethod
    def _load(cls, path: Path) -> "BudgetLedger":
        snap = ledger_snapshot.read_snapshot(path)
        ledger = cls(path, snap.meta, snap.state, snap.generation, int(snap.meta.get("last_event_seq", 0)))
        integrity.check_snapshot(snap.path, snap.meta, ledger.params, snap.answers_bytes)
        ledger.snapshot_sha256 = ledger.chain_prev_sha256 = integrity.sha256_bytes(snap.snap_bytes)
        files = ledger._event_files()
        chained = integrity.snapshot_is_chained(snap.meta)
        for seq, event_path in integrity.events_after_snapshot(path, files, ledger.snapshot_event_seq):
            chained = ledger._apply_event(event_path, seq, chained=chained)
        integrity.check_record_budgets(path, ledger)
        return ledger

    # -- events ------------------------------------------------------------
    def _event_files(self) -> list[tuple[int, Path]]:
        """(seq, path) of every event file, sorted; two files with one sequence number are refused."""
        out = []
        for p in (self.path / "events").glob("*.parquet"):
            if p.name.startswith("."):
                continue
            try:
                out.append((int(p.name.split("-", 1)[0]), p))
            except ValueError:
                raise LedgerError(f"{p}: unexpected file in the ledger's events folder") from None
        out.sort()
        integrity.check_unique_seqs(self.path, out)
        return out

    def _apply_event(self, event_path: Path, seq: int, *, chained: bool) -> bool:
        """Check the event's link in the hash chain, then replay it. Returns whether the chain has started."""
        try:
            data = event_path.read_bytes()
            table = pq.read_table(pa.BufferReader(data))
            info = json.loads((table.schema.metadata or {})[b"indknn_event"])
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise LedgerIntegrityError(f"{event_path}: corrupt or truncated event ({type(exc).__name__}); "
                                       "`indknn repair` brings the ledger back without refund") from None
        if info.get("format_version") != FORMAT_VERSION:
            raise LedgerError(f"{event_path}: event format_version {info.get('format_version')!r}")
        if info.get("ledger_uuid") != self.meta["ledger_uuid"]:
            raise LedgerError(f"{event_path}: event belongs to another ledger")
        sha = integrity.sha256_bytes(data)
        chained = integrity.check_link(event_path, seq, info, prev=self.chain_prev_sha256,
                                       snapshot=self.snapshot_sha256, chained=chained)
        self.unchained_events += not chained
        self._check_record_indices(table)
        self._apply_table(table, info)
        self.last_event_seq = max(self.last_event_seq, seq)
        self.chain_prev_sha256 = self.head_sha256 = self.event_sha256[seq] = sha
        return chained

    def _check_record_indices(self, table: pa.Table) -> None:
        ledger_events.check_record_indices(self.state, table, where=self.path)

    def _apply_table(self, table: pa.Table, info: dict) -> None:
        ledger_events.apply_table(self.state, table, info, c1=self.params.c1)

    def _next_seq(self) -> int:
        files = self._event_files()
        return max([self.last_event_seq, self.snapshot_event_seq] + [seq for seq, _ in files]) + 1

    def commit_event(self, *, event_type: str, columns: dict, info: dict) -> Path:
        """Write one event atomically (tmp → fsync → rename → fsync dir), then apply it in memory."""
        _check_finite_columns(self.path, event_type, columns)
        n = max((len(v) for v in columns.values()), default=0)
        data = {}
        for f in EVENT_SCHEMA:  # lists, numpy arrays or pyarrow arrays (serve-queries builds its columns as arrays)
            vals = columns.get(f.name)
            if vals is None:
                data[f.name] = pa.nulls(n, type=f.type)
            elif isinstance(vals, pa.Array):
                data[f.name] = vals if vals.type == f.type else vals.cast(f.type)
            else:
                data[f.name] = pa.array(vals, type=f.type)
        self._check_record_indices(pa.table({k: data[k] for k in ("kind", "ledger_index", "user_id")}))
        seq = self._next_seq()
        if self.store_version is not None:
            seen = self.store_version()
            if seen is not None:
                info = dict(info, store_seen=seen)
        if event_type == "serve":
            stats = ledger_events.stats_after_serve(self.state, data, self.params)
            if stats:
                info = dict(info, state_after=stats)
        info = dict(info, type=event_type, seq=seq, format_version=FORMAT_VERSION,
                    ledger_uuid=self.meta["ledger_uuid"], time=info.get("time", time.time()),
                    prev_sha256=self.chain_prev_sha256, snapshot_sha256=self.snapshot_sha256)
        schema = EVENT_SCHEMA.with_metadata({b"indknn_event": json.dumps(info).encode()})
        table = pa.Table.from_arrays([data[f.name] for f in EVENT_SCHEMA], schema=schema)
        tag = "".join(ch if ch.isalnum() or ch in "._" else "_" for ch in str(info.get("batch_id") or ""))[:60]
        path = self.path / "events" / f"{seq:08d}-{event_type}{'-' + tag if tag else ''}.parquet"
        _fault("before-event-write")
        sha = atomic_write_parquet(table, path, exclusive=True)  # an event is never replaced
        if len(list((self.path / "events").glob(f"{seq:08d}-*.parquet"))) > 1:  # another name, the same number
            path.unlink(missing_ok=True)
            raise LedgerError(f"{path}: another event with sequence number {seq} was committed (a writer without the "
                              "ledger's lock?); this one was removed and nothing of it was released")
        _fault("event-committed")
        self._apply_table(table, info)
        self.last_event_seq = seq
        self.chain_prev_sha256 = self.head_sha256 = self.event_sha256[seq] = sha
        if self.mark_path is not None:  # after the commit point: a crash here leaves the mark behind, never ahead
            try:
                integrity.write_mark(self.mark_path, self)
            except (StorageError, StoreError) as exc:  # review 67, F4: the event stands, nothing of it released
                raise type(exc)(f"{exc}. Event {seq} is committed (its charges stand) and nothing of it was released; "
                                "the store's high-water mark is one event behind: the next serve-queries, index or "
                                "delete writes it before it releases anything") from None
        return path

    # -- records -------------------------------------------------------------
    def add_records(self, *, record_ids, user_ids, rows, inherit_user_spent: bool = True) -> int:
        """Bring store rows into the ledger with budget B (an `add` event).

        A record id already in the ledger (deleted or retired) keeps the spent
        budget it had (SPEC §8: no fresh budget for a returning id). Under the user
        unit a new record of a known user joins that user's spent.
        """
        s = self.state
        # keyed by the NFC form: an id in another Unicode spelling of one already here (a store from before ids were
        # stored in NFC) is the same record, never a second budget (review 53, F2; review 56, F3: keyed by spelling,
        # a live id's second spelling joined as another live record). Users likewise (id_text)
        index_of = index_by_canonical(s.record_id, deleted=s.deleted, spent=s.spent)
        user_spent: dict[str, float] = {}
        # User unit: every record of a user carries the user's spent, so a new record joins that budget, never a
        # fresh one. Record unit: nothing passes between records (review 71, F2: a new record of a user started at
        # the largest spent of that user's erased records, so an erased record changed which *other* records were
        # eligible, a dependence on it that its own budget never paid for; SPEC §2 step 1, §8).
        inherit_from = np.arange(len(s)) if self.params.privacy_unit == "user" and inherit_user_spent \
            else np.empty(0, np.int64)
        for i in inherit_from:
            u = canonical(s.user_id[i])
            if u:
                user_spent[u] = max(user_spent.get(u, 0.0), float(s.spent[i]))
        li, rid_out, uid_out, row_out, spent_out = [], [], [], [], []
        nxt = len(s)
        for rid, uid, row in zip(record_ids, user_ids, rows):
            uid = uid or ""
            if (key := canonical(rid)) in index_of:
                i = index_of[key]
                if i >= len(s):  # two spellings of one id among the rows joining now (review 57, F2: IndexError)
                    raise LedgerError(
                        f"store row {int(row)} holds a record id another row joining now holds in another Unicode "
                        "spelling (a store written before ids were stored in NFC): one id, one record. `indknn delete "
                        "--record ID` erases both; embed the record again once")
                if s.deleted[i] and s.user_id[i] and canonical(s.user_id[i]) != canonical(uid):
                    continue  # an erased id under another user: stays out (see user_moves; `index` refuses it)
                if not s.deleted[i] and s.row[i] >= 0 and s.row[i] != row:
                    raise LedgerError(  # names no id (a serve's stderr is a job log): audit 6
                        f"store row {int(row)} holds a record id the ledger has live at another row: the store's "
                        "private rows were restored from an older copy or rewritten outside indknn; run `indknn "
                        "repair --ledger LEDGER --store STORE`")
                if not s.deleted[i] and s.row[i] == row:
                    continue
                spent0 = float(s.spent[i])
            else:
                i = nxt
                nxt += 1
                index_of[key] = i
                spent0 = 0.0
            spent0 = max(spent0, user_spent.get(canonical(uid), 0.0))
            li.append(i); rid_out.append(rid); uid_out.append(uid); row_out.append(int(row)); spent_out.append(spent0)
        if not li:
            return 0
        self.commit_event(event_type="add", info={"records": len(li)}, columns={
            "kind": ["add"] * len(li), "ledger_index": li, "record_id": rid_out, "user_id": uid_out,
            "row": row_out, "budget": [self.params.budget] * len(li), "spent_after": spent_out,
        })
        return len(li)

    def user_moves(self, record_ids, user_ids) -> list[str]:
        """Erased record ids that come back under *another* user. Re-adding one would move its tombstone (and
        the spent it carries) away from its first user, whose returning records would then start lower
        (SPEC §8). Such rows never join the ledger; `index` refuses them (operator side)."""
        s = self.state
        index_of = index_by_canonical(s.record_id, deleted=s.deleted, spent=s.spent)
        out = []
        for rid, uid in zip(record_ids, user_ids):
            i = index_of.get(canonical(rid))
            if i is not None and s.deleted[i] and s.user_id[i] and canonical(s.user_id[i]) != canonical(uid):
                out.append(rid)
        return out

    def delete_records(self, ledger_indices, *, rows_to_erase: dict | None = None,
                       erased_rows: dict | None = None) -> int:
        """Tombstone records (one `delete` event): never selectable again, spent kept, never refunded.

        The event keeps each record's id, user, former store row and spent; replay
        sets ``deleted``, ``deleted_at`` and ``row = -1``. Already deleted records
        are skipped. Returns the number of records tombstoned. ``rows_to_erase`` ({"store_uuid", "rows"}): store
        rows whose physical erasure waits for the store's writer lease (``state.rows_to_erase``, review 67, F1).
        ``erased_rows`` ({"store_uuid", "rows"}): every store row the erasure overwrites, in the ledger or not
        (``state.erased_rows``, review 72, F1); the tombstones' former rows when not given.
        """
        s = self.state
        li = np.unique(np.asarray(ledger_indices, dtype=np.int64))
        if li.size and (li[0] < 0 or li[-1] >= len(s)):
            raise LedgerError(f"{self.path}: ledger index {int(li[0] if li[0] < 0 else li[-1])} is outside "
                              f"the {len(s)} records")
        li = li[~s.deleted[li]]
        if li.size == 0 and not (rows_to_erase and rows_to_erase.get("rows")) and \
                not (erased_rows and erased_rows.get("rows")):
            return 0
        info = {"records": int(li.size), **({"rows_to_erase": rows_to_erase} if rows_to_erase else {}),
                **({"erased_rows": {"store_uuid": erased_rows["store_uuid"],
                                    "rows": sorted({int(r) for r in erased_rows["rows"]})}}
                   if erased_rows is not None else {})}
        self.commit_event(event_type="delete", info=info, columns={
            "kind": ["delete"] * li.size, "ledger_index": li.tolist(),
            "record_id": [str(x) for x in s.record_id[li]], "user_id": [str(x or "") for x in s.user_id[li]],
            "row": s.row[li].tolist(), "spent_after": s.spent[li].tolist(),
        })
        return int(li.size)

    def store_row_map(self, n_store_rows: int) -> np.ndarray:
        """ledger index of each store row (−1 where the row is not in the ledger)."""
        out = np.full(n_store_rows, -1, dtype=np.int64)
        s = self.state
        ok = (s.row >= 0) & (s.row < n_store_rows) & ~s.deleted
        out[s.row[ok]] = np.flatnonzero(ok)
        return out

    def answers_for(self, batch_id: str) -> dict[str, list]:
        return self.state.answers_for(batch_id)

    # -- compaction ------------------------------------------------------------
    def _write_snapshot(self, generation: int, *, publish: bool = True) -> None:
        s = self.state
        c1 = self.params.c1 if "params" in self.meta else 0.0
        # the footer carries what `account` reads of every answer (label counts, K_min clamp counts)
        summary = ledger_history.answers_summary(s.answer_tables(), k_min=self.params.k_min)
        schema = ANSWER_SCHEMA.with_metadata({ledger_history.SUMMARY_KEY: json.dumps(summary).encode()})
        answers_sha = atomic_write_parquet_tables(s.answer_tables(), schema,
                                                  self.path / f"answers-{generation:06d}.parquet")
        meta = dict(self.meta, last_event_seq=max(self.last_event_seq, self.snapshot_event_seq),
                    batches=s.batches, history=s.history[-100000:], answers_not_held=int(s.answers_not_held),
                    seeded_not_held=int(s.seeded_not_held),
                    store_seen=s.store_seen, rows_to_erase=s.rows_to_erase, erased_rows=s.erased_rows,
                    **integrity.snapshot_chain_fields(self, answers_sha))
        table = ledger_snapshot.record_table(s, meta, c1=c1)
        sha = atomic_write_parquet(table, self.path / f"snapshot-{generation:06d}.parquet")
        if not publish and self.mark_path is not None:
            # announced in the store's mark before CURRENT switches to it (audit 10, F1): a snapshot the mark
            # never announced is refused (ledger_integrity.check_mark); the mark still names the current one
            integrity.write_mark(self.mark_path, self, announce=(generation, sha))
        self.snapshot_sha256 = self.chain_prev_sha256 = sha
        self.meta = meta
        self.event_sha256 = {}
        if publish:
            atomic_write_text(json.dumps({"generation": generation}), self.path / "CURRENT")

    def compact(self) -> int:
        """Fold all events into a new snapshot (atomic via CURRENT); returns events folded. With a store attached
        (:func:`~.ledger_integrity.attach`: every command does), the store's mark announces the new snapshot first;
        a ledger compacted without its store (a library call on a copy, say) is refused by that store afterwards
        (the mark never announced the snapshot: audit 10, F1)."""
        gen = self.generation + 1
        self._write_snapshot(generation=gen, publish=False)
        return self.publish_generation(gen)

    def publish_generation(self, generation: int) -> int:
        """Switch CURRENT to a written snapshot (the commit point), then drop folded events and old generations.

        Returns the number of event files removed.
        """
        atomic_write_text(json.dumps({"generation": generation}), self.path / "CURRENT")
        folded = 0
        for seq, p in self._event_files():
            if seq <= self.last_event_seq:
                p.unlink(missing_ok=True)
                folded += 1
        for old in list(self.path.glob("snapshot-*.parquet")) + list(self.path.glob("answers-*.parquet")):
            if not old.name.endswith(f"{generation:06d}.parquet"):
                old.unlink(missing_ok=True)
        self.generation = generation
        self.snapshot_event_seq = self.last_event_seq
        if self.mark_path is not None:  # the mark names the new snapshot (an edit of it is caught)
            integrity.write_mark(self.mark_path, self)
        return folded

    def prepare_renumbered_snapshot(self, *, new_row_of: np.ndarray, store_uuid: str, info: dict) -> int:
        """Write, without publishing, snapshot g+1 with store rows renumbered and bound to ``store_uuid``.

        For store compaction (deletion.compact): ``new_row_of[old_row]`` is the
        row in the compacted store (−1: removed). Spent budgets, tombstones and
        answers are carried unchanged. This object then describes generation
        g+1: call :meth:`publish_generation` or discard it.
        """
        s = self.state
        live = (~s.deleted) & (s.row >= 0)
        rows = s.row.copy()
        if live.any():
            old = s.row[live]
            if old.max() >= len(new_row_of) or (new_row_of[old] < 0).any():
                raise LedgerError(f"{self.path}: a live record's store row would be removed by the compaction")
            rows[live] = new_row_of[old]
        s.row = rows
        self.meta = dict(self.meta, store_uuid=store_uuid,
                         store_compaction=dict(info, from_store_uuid=self.meta["store_uuid"]))
        gen = self.generation + 1
        self._write_snapshot(generation=gen, publish=False)
        return gen

    # -- locking (ledger_lock) ----------------------------------------------------
    check_writable = staticmethod(ledger_lock.check_writable)
    write_lock = staticmethod(ledger_lock.write_lock)
