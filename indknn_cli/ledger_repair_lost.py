"""What the events `indknn repair` quarantines still tell: the ids they added or deleted, the answers they released.

Split out of :mod:`indknn_cli.ledger_repair`. A quarantined event is not verified, so nothing read here is trusted
further than a check against the store allows: ids only keep a returning record from a fresh budget, answers are
written again by the repair event only where they fit a stored query batch (:func:`checked_answers`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .store import FeatureStore


def ids_in_lost_events(paths: list[Path]) -> list[tuple[str, str]]:
    """(record id, user id) of every add/delete row in the quarantined events that can still be read."""
    import pyarrow.parquet as pq

    out = []
    for p in paths:
        try:
            t = pq.read_table(p, columns=["kind", "record_id", "user_id"])
        except Exception:  # noqa: BLE001 - the damaged event itself: nothing can be read from it
            continue
        for kind, rid, uid in zip(*(t.column(c).to_pylist() for c in ("kind", "record_id", "user_id"))):
            if kind in ("add", "delete") and rid:
                out.append((str(rid), str(uid or "")))
    return out


def answers_in_lost_events(paths: list[Path]) -> tuple["object", list[str]]:
    """The answer rows of the quarantined events that can still be read (a pyarrow table in the event schema,
    or None) and the names of those that cannot. Those answers were released: the repair event writes them
    again, so queries answered (the public --max-queries gate) never goes down, a re-run batch returns them
    instead of answering them again with fresh noise, and reuse keeps them (audit 9, F3)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from .ledger_state import ANSWER_SCHEMA

    parts, unreadable = [], []
    for p in paths:
        try:
            t = pq.read_table(p)
            t = t.filter(pc.equal(t.column("kind"), "answer").fill_null(False))
            parts.append(pa.table({f.name: t.column(f.name).cast(f.type) for f in ANSWER_SCHEMA}))
        except Exception:  # noqa: BLE001 - the damaged event itself: its answers cannot be known
            unreadable.append(p.name)
    parts = [t for t in parts if t.num_rows]
    return (pa.concat_tables(parts) if parts else None), unreadable


def checked_answers(table, store: FeatureStore, have: set) -> tuple["object", int]:
    """The recovered answer rows that fit the store (a stored batch, the row inside it, query_index = row −
    batch start, a label of the class list or the abstention, its name, a finite count), each (batch, query)
    once and none the kept events already hold; and how many rows were left out. A quarantined file is not
    verified, so nothing in it is trusted further than that (review 9)."""
    import math

    from .engine import ABSTAIN_LABEL, ABSTAIN_NAME

    names = list(store.label_names)
    stored = store.batches()
    batches = {}
    keep, seen = [], set(have)
    cols = table.to_pydict()
    for i, (b, qi, row, lab, name, cnt) in enumerate(zip(cols["batch_id"], cols["query_index"], cols["query_row"],
                                                       cols["label"], cols["label_name"],
                                                       cols["released_count"])):
        if b is None or qi is None or row is None or lab is None or cnt is None or (b, qi) in seen:
            continue
        if b not in batches:
            batches[b] = store.query_batch(b)[:2] if b in stored else None
        span = batches[b]
        if span is None or not (span[0] <= row < span[1]) or qi != row - span[0] or not math.isfinite(cnt):
            continue
        if not ((lab == ABSTAIN_LABEL and name == ABSTAIN_NAME) or (0 <= lab < len(names) and name == names[lab])):
            continue
        seen.add((b, qi))
        keep.append(i)
    return (table.take(keep) if keep else None), table.num_rows - len(keep)


def _event_info(p: Path) -> dict | None:
    """A quarantined event's metadata (its info), or None when it cannot be read (the damaged event itself)."""
    import json

    import pyarrow.parquet as pq

    try:
        info = json.loads((pq.read_schema(p).metadata or {}).get(b"indknn_event", b"{}"))
    except Exception:  # noqa: BLE001 - the damaged event itself
        return None
    return info if isinstance(info, dict) else None


def _listed_rows(entry, store_uuid: str) -> list[int]:
    """The rows of a ``{"store_uuid", "rows"}`` entry (``rows_to_erase``, ``erased_rows`` and their resets) when it
    is of this store's numbering; whole numbers only (these files are not verified)."""
    if not (isinstance(entry, dict) and entry.get("store_uuid") == store_uuid and isinstance(entry.get("rows"), list)):
        return []
    return [int(r) for r in entry["rows"] if isinstance(r, int) and not isinstance(r, bool)]


def rows_to_erase_in_lost_events(paths: list[Path], store_uuid: str) -> list[int]:
    """Store rows of ``store_uuid`` whose erasure a quarantined event recorded without the store's writer lease
    (``rows_to_erase`` in its info: :mod:`.deletion_deferred`), from the events whose metadata can still be read.
    Review 70, F1: a repair that quarantined that event forgot the request, and the row was never overwritten."""
    out: set[int] = set()
    for p in paths:
        info = _event_info(p) or {}
        out.update(_listed_rows(info.get("rows_to_erase") or info.get("rows_to_erase_reset"), store_uuid))
    return sorted(out)


def deferred_rows(led, store, moved, quarantine, flagged: np.ndarray, mark: dict | None) -> np.ndarray:
    """Rows of an erasure recorded without the store's writer lease (:mod:`.deletion_deferred`), in the kept ledger,
    in a quarantined event or in the store's mark (a rollback: review 72, F2), not yet flagged in the store."""
    from .deletion_deferred import rows as kept_rows

    lost = rows_to_erase_in_lost_events([quarantine / p.name for p in moved], store.uuid)
    if (mark or {}).get("ledger_uuid") == led.meta["ledger_uuid"]:
        lost = list(lost) + _listed_rows(mark.get("rows_to_erase"), store.uuid)
    rows = np.union1d(kept_rows(led, store), np.asarray([r for r in lost if 0 <= r < flagged.size], np.int64))
    return rows[~flagged[rows]] if rows.size else rows.astype(np.int64)


def erased_rows_now(led, store, back: np.ndarray, n_store: int) -> dict:
    """The ledger's ``erased_rows`` as they hold for the store a repair accepts: those below its end (a store
    restored from a shorter copy appends new people past it: review 74, F1), the rows flagged deleted, and the rows
    the repair erases again."""
    from .store_erased_ids import in_ledger

    kept = in_ledger(led, store)
    flagged = np.flatnonzero(store.read("private", "deleted").astype(bool)) if n_store else np.empty(0, np.int64)
    rows = np.union1d(np.union1d(kept[kept < n_store], flagged), np.asarray(back, np.int64))
    return {"store_uuid": store.uuid, "rows": [int(r) for r in rows]}


def erased_in_lost_events(paths: list[Path], store_uuid: str) -> tuple[set[str], dict[int, str], list[int]]:
    """What the readable quarantined ``delete`` events erased: the record ids they tombstoned, {store row: id} of
    their tombstones (this numbering), and the rows their ``erased_rows`` name (no id: rows erased outside the
    ledger too); a quarantined repair's own ``erased_rows_reset`` likewise. Repair carries these erasures even where
    the kept ledger holds the id live (review 75, F4: with the store's rows restored from an older copy the record
    stayed live and its vector in the store). A repair's own tombstones are not erasures (review 76, F1: ids it
    retired came back embedded again and were erased). Only the direction that erases more is taken from these
    unverified files."""
    import pyarrow.parquet as pq

    ids: set[str] = set()
    by_row: dict[int, str] = {}
    rows: set[int] = set()
    for p in paths:
        info = _event_info(p)
        if info is None or info.get("type") not in ("delete", "repair"):
            continue
        try:
            t = pq.read_table(p, columns=["kind", "record_id", "row"])
        except Exception:  # noqa: BLE001 - the damaged event itself
            continue
        rows.update(_listed_rows(info.get("erased_rows" if info["type"] == "delete" else "erased_rows_reset"),
                                 store_uuid))
        if info["type"] != "delete":
            continue
        same = isinstance(info.get("store_seen"), dict) and info["store_seen"].get("store_uuid") == store_uuid
        for kind, rid, row in zip(*(t.column(c).to_pylist() for c in ("kind", "record_id", "row"))):
            if kind == "delete" and rid:
                ids.add(str(rid))
                if same and row is not None and row >= 0:
                    by_row[int(row)] = str(rid)
    return ids, by_row, sorted(rows)


def rows_lost_erasures_name(state, ids, by_row: dict[int, str], rows, lost_live: np.ndarray,
                            n_store: int) -> np.ndarray:
    """Store rows to erase again for the quarantined erasures (:func:`erased_in_lost_events`): the rows of their
    tombstones and the kept ledger's rows of the records they tombstoned, each only while it still holds that id or
    nothing (review 76, F2: an id erased and embedded again at a new row kept its new row only by this), and the rows
    of their ``erased_rows`` lists below the store's end."""
    pairs = list(by_row.items()) + [(int(state.row[i]), str(state.record_id[i]))
                                    for i in np.flatnonzero(lost_live) if state.row[i] >= 0]
    named = [r for r, rid in pairs if 0 <= r < n_store and str(ids[r]) in (rid, "")]
    return np.union1d(np.asarray([r for r in rows if 0 <= r < n_store], np.int64),
                      np.asarray(named, np.int64)).astype(np.int64)
