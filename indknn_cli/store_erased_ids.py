"""The store's log of erased ids (``erased-ids.jsonl`` in the store folder).

Ids of erased private rows, one JSON line each, appended (fsync'd) *before* the row is overwritten: the erasure
blanks the id in the store, and a ledger rolled back past the erasure's tombstone would otherwise hold no trace of an
id added and erased in the lost events; `repair` tombstones these at B so a returning id never starts afresh, and
`embed` refuses an erased id under another user (SPEC §8; AUDIT_FINDINGS_2.md P4; review 60, F3). Ids only, never
vectors or labels.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .fsio import fsync_path
from .store_layout import read_chunks

NAME = "erased-ids.jsonl"


def append(store, rows: np.ndarray) -> None:
    """Log the ids of private ``rows`` of ``store`` (a FeatureStore) before they are overwritten."""
    # the chunks holding these rows only: one corrupt chunk of *other* records' ids made every erasure fail
    # after its tombstone was committed (review 54, F3)
    rows = np.asarray(rows, np.int64)
    rids, uids = (read_chunks(store.path, "private", name, lambda name=name: np.asarray(
        store.group("private")[name].oindex[rows])) for name in ("record_id", "user_id"))
    # the row too (review 68, F2): a chunk of flags restored from an older backup brings an erased row back
    # unflagged, and only its (row, id) tells it from the same id embedded again later under a new row
    # (rows are numbered per store: a compaction renumbers them under a new store uuid)
    lines = "".join(json.dumps({"record_id": str(r), "user_id": str(u or ""), "row": int(row),
                                "store_uuid": str(store.uuid)}) + "\n"
                    for row, r, u in zip(rows.tolist(), rids, uids) if str(r))
    if not lines:
        return
    path = Path(store.path) / NAME
    with open(path, "a+", encoding="utf-8") as f:
        if f.tell() > 0:  # a line torn by a crash mid-append would swallow this one's first line (review 69, F1)
            f.seek(f.tell() - 1)
            torn = f.read(1) != "\n"
            f.seek(0, os.SEEK_END)
            if torn:
                lines = "\n" + lines
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(store.path)


def _entries(store_path: str | os.PathLike):
    """The log's entries as dicts with a record id (a line torn by a crash mid-append is skipped: its erasure had not
    started)."""
    try:
        text = (Path(store_path) / NAME).read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and "record_id" in d:
            yield d


def read(store_path: str | os.PathLike) -> list[tuple[str, str]]:
    """(record id, user id) of every private row erased since the log existed."""
    return [(str(d["record_id"]), str(d.get("user_id") or "")) for d in _entries(store_path)]


def rows_of(store_path: str | os.PathLike, store_uuid: str) -> dict[int, str]:
    """{store row: record id} of the logged erasures of this store's numbering (``store_uuid``: a compaction
    renumbers the rows under a new uuid) that name their row (lines written since 2026-11-29)."""
    return {int(d["row"]): str(d["record_id"]) for d in _entries(store_path)
            if isinstance(d.get("row"), int) and not isinstance(d.get("row"), bool)
            and d.get("store_uuid") == store_uuid}


def in_ledger(ledger, store) -> np.ndarray:
    """Rows of ``store`` (this numbering) that ``ledger``'s erasures overwrote (``state.erased_rows``, review 72, F1:
    the ledger is tamper-evident where this log is not: the log removed or restored with the chunks let the record
    come back)."""
    e = getattr(getattr(ledger, "state", None), "erased_rows", None)
    if not isinstance(e, dict) or e.get("store_uuid") != store.uuid or not e.get("rows"):
        return np.empty(0, np.int64)
    return np.asarray(sorted({int(r) for r in e["rows"]}), np.int64)


def resurrected(store, rows: np.ndarray, ledger=None) -> np.ndarray:
    """Which of the private ``rows`` are rows erased earlier: the log names them for this store's numbering. Rows are
    never reused (an append goes past the last row), so such a row holding anything is a chunk restored from a backup
    taken before the erasure, its flags with it (review 68, F2), whatever id it holds now (review 69, F3: a record-id
    chunk not restored left it under the id ""). Serving, `index` and private tuning never take them;
    `account --verify` names them; `indknn delete --record ID` erases them again. With ``ledger``, the rows its
    erasures overwrote too (:func:`in_ledger`)."""
    logged = rows_of(store.path, store.uuid) if len(rows) else {}
    erased = np.union1d(np.fromiter(logged, np.int64, len(logged)),
                        in_ledger(ledger, store) if ledger is not None and len(rows) else np.empty(0, np.int64))
    if not erased.size:
        return np.zeros(len(rows), dtype=bool)
    return np.isin(np.asarray(rows, np.int64), erased)
