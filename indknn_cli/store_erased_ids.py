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
    lines = "".join(json.dumps({"record_id": str(r), "user_id": str(u or "")}) + "\n"
                    for r, u in zip(rids, uids) if str(r))
    if not lines:
        return
    path = Path(store.path) / NAME
    with open(path, "a", encoding="utf-8") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(store.path)


def read(store_path: str | os.PathLike) -> list[tuple[str, str]]:
    """(record id, user id) of every private row erased since the log existed."""
    out = []
    try:
        text = (Path(store_path) / NAME).read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            d = json.loads(line)
            out.append((str(d["record_id"]), str(d.get("user_id") or "")))
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a crash mid-append: its erasure had not started
    return out
