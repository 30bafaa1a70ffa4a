"""The ledger's high-water mark of a store on object storage, kept in the bucket too (review 23, F2).

The mark (:mod:`.ledger_integrity`: the chain head, the snapshot, the answers released) lives in the store's
state folder, on the coordinator's disk. Two machines given copies of one state folder and ledger (the refusal
after a compaction says to copy the state folder) each had their own mark, so both could serve with their own
copy of the ledger and every record could be charged B on each: 2·B. A copy of the mark therefore sits beside the
store's prefix, ``<store name>.indknn-mark.json`` (``s3://bucket/indknn-mark.json`` for a store at a bucket's
root), written after the local one at every commit; the ledger must reach the furthest of the two. The ledger
writers of a remote store also hold the store's ledger-writer lease (:mod:`.store_lease`), so two machines never
commit at once: whichever commits first moves the bucket's mark, and the other copy is then refused as behind
(or, at the same event number, as another history). The two copies are not the same bytes: each says which it is
(``copy``: "local" or "bucket", inside its seal), so the state folder's mark, which a copy of the state folder holds
an older version of, cannot be put back in the bucket to let that copy pass (review 30, F1).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import object_store, store_lease
from .errors import LedgerIntegrityError, StoreError
from .ledger_chain import BUCKET_COPY, LOCAL_COPY, check_seal, sealed_mark

SUFFIX = ".indknn-mark.json"
#: Set on a mark :func:`furthest` took from the bucket. Such a mark of a ledger other than the one checked is a
#: stale one (a store removed and made again under the same name leaves it behind) and is ignored: which ledger a
#: store belongs to is the binding's to say (check_binding refuses any other ledger first); the bucket's mark only
#: orders the copies of that one ledger (review 25).
FROM_BUCKET = "from_bucket"


def _where(store_path):
    """(filesystem, URL) of the bucket's mark for a remote store's state folder; None for a local store."""
    loc = object_store.location(Path(store_path))
    if loc is None:
        return None
    return object_store.filesystem(loc), store_lease.lease_url(loc, SUFFIX)


def is_remote(store_path) -> bool:
    """Whether the store named by its folder lives on object storage (and so has a bucket copy of its mark)."""
    return object_store.location(Path(store_path)) is not None


def read(store_path) -> dict | None:
    """The bucket's mark (None for a local store, or when none was written yet)."""
    where = _where(store_path)
    if where is None:
        return None
    fs, url = where
    try:
        raw = fs.cat_file(url)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp: endpoint down, no permission
        raise StoreError(f"cannot read the ledger's high-water mark in the bucket {url} "
                         f"({type(exc).__name__})") from None
    try:
        m = json.loads(raw)
    except ValueError:
        raise LedgerIntegrityError(f"{url}: the ledger's high-water mark in the bucket is unreadable") from None
    if not (isinstance(m, dict) and isinstance(m.get("seq"), int)):
        raise LedgerIntegrityError(f"{url}: the ledger's high-water mark in the bucket is corrupt")
    check_seal(m, url)  # an edit (another ledger's uuid, an earlier event) needs a hash computed (review 27, F4)
    if m.get("copy") == LOCAL_COPY:
        # The state folder's mark, put in the bucket by hand: a copy of the state folder elsewhere holds an older
        # version of it, and restoring that one let the copy's ledger pass and charge every record again (review
        # 30, F1). Marks written here by indknn since 2026-11-28 say copy="bucket", inside their seal.
        raise LedgerIntegrityError(
            f"{url}: the bucket's copy of the ledger's high-water mark is a state folder's ledger-mark.json (copied "
            "into the bucket by hand?): a copy of the state folder and ledger elsewhere could then pass as this "
            "store's one ledger and charge every record again; refusing. Run every ledger writer of a store from one "
            "state folder; `indknn repair` on the ledger to keep retires every record (no refund) and writes the "
            "mark again. A store removed and made again under this name: remove this object by hand instead (it "
            "is the old store's)")
    return m


def write(store_path, fields: dict) -> None:
    """Write the bucket's copy of the mark (after the local one: a crash between leaves it behind, never ahead),
    sealed as the bucket's (``copy`` = "bucket"), which the state folder's copy is not (review 30, F1)."""
    where = _where(store_path)
    if where is None:
        return
    fs, url = where
    body = json.dumps(sealed_mark(fields, copy=BUCKET_COPY))
    try:
        fs.pipe_file(url, body.encode())
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp
        # The event is committed here, the bucket's mark behind it: a copy of the ledger on another machine would
        # pass the bucket's mark and commit a second history (review 25). The ledger writers' lease stays in the
        # bucket, so that other machines are refused until a writer here (same state root) commits again.
        store_lease.retain(object_store.location(Path(store_path)), store_lease.LEDGER_SUFFIX)
        raise StoreError(f"cannot write the ledger's high-water mark in the bucket {url} ({type(exc).__name__}); "
                         "the event before it is committed, nothing later was released; the store's ledger-writer "
                         "lease stays in the bucket (other machines are refused) until a ledger writer on this "
                         "machine runs again and writes the mark") from None


def _key(m: dict) -> tuple[int, int]:
    g = m.get("generation")
    return (g if isinstance(g, int) else 0, int(m["seq"]))


def furthest(local: dict | None, remote: dict | None, *, store_path) -> dict | None:
    """The mark the ledger must reach: the further of the state folder's and the bucket's. Two marks of one ledger
    at the same event with different events there are two histories (two copies that each committed): refused."""
    if remote is None:
        return local
    if local is None or remote.get("ledger_uuid") != local.get("ledger_uuid") or _key(remote) > _key(local):
        return {**remote, FROM_BUCKET: True}  # check_mark ignores it for a ledger of another uuid
    if _key(remote) == _key(local) and (remote.get("sha256"), remote.get("snapshot_sha256")) != (
            local.get("sha256"), local.get("snapshot_sha256")):
        raise LedgerIntegrityError(
            f"{store_path}: the store's high-water mark here and the one in the bucket name different events at "
            f"event {local['seq']}: two copies of the ledger committed, each its own (run every ledger writer of a "
            "store from one state folder; move it, never copy it); refusing. `indknn repair` on the copy to keep "
            "retires every record (no refund)")
    return local
