"""The index inside the store (``<store>/index``): metadata, the writer lock, incremental add/remove,
renumbering after a compaction, reconciling with the store."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import zarr

from ..errors import BadInputError, LockTimeoutError, PrivacyRefusedError, StoreError
from ..store import FeatureStore, checksum_compressors, vectors_sha256
from .common import ENCODE_ROWS, INDEX_FORMAT_VERSION, INDEX_GROUP, LOCK_NAME, _WHY
from .ivf import IvfIndex
from .lsh import LshIndex

log = logging.getLogger(__name__)


# -- storage -------------------------------------------------------------------------
def index_path(store_path: str | os.PathLike) -> Path:
    return Path(store_path) / INDEX_GROUP


def read_meta(store_path: str | os.PathLike) -> dict | None:
    """The index metadata of a store, or None when it has no index (flat search)."""
    path = index_path(store_path)
    if not (path / "zarr.json").is_file():
        return None
    try:
        return dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception as exc:  # noqa: BLE001 - corrupt metadata
        raise StoreError(f"{path}: the candidate index cannot be read ({type(exc).__name__}); "
                         "rebuild it with `indknn index --kind ...`") from None


@contextlib.contextmanager
def index_lock(store_path: str | os.PathLike, timeout: float = 300.0) -> Iterator[None]:
    """One index writer at a time (a flock on a lock file in the store folder that must still be the file at
    the path: locking.exclusive_file)."""
    from ..locking import exclusive_file

    with exclusive_file(Path(store_path) / LOCK_NAME, timeout=timeout, on_timeout=lambda: LockTimeoutError(
            f"{store_path}: another indknn process is writing the candidate index")):
        yield


_STALE = re.compile(r"\.index-(?:build|renumber|old)-[0-9a-f]{8}")


def stale_copies(store_path: str | os.PathLike) -> list[Path]:
    """Index folders a build, renumbering or swap killed before its cleanup left in the store folder."""
    try:
        return sorted(p for p in Path(store_path).iterdir() if _STALE.fullmatch(p.name) and p.is_dir())
    except OSError:
        return []


def remove_stale_copies(store_path: str | os.PathLike) -> int:
    """Remove :func:`stale_copies`; the caller holds :func:`index_lock`, so none belongs to a live writer. They hold
    LSH codes or IVF lists derived from the private vectors, erased ones included, which no erasure reached: an
    `index --kind lsh` killed with -9 left `.index-build-*` beside the index, and a later `delete` zeroed the row's
    codes only in the live index (review 38, F2). Returns the folders removed."""
    gone = 0
    for p in stale_copies(store_path):
        shutil.rmtree(p, ignore_errors=True)
        gone += not p.exists()
    return gone


def _structure(group: zarr.Group, meta: dict) -> LshIndex | IvfIndex:
    kind = meta.get("kind")
    if meta.get("format_version") != INDEX_FORMAT_VERSION:
        raise StoreError(f"candidate index format {meta.get('format_version')!r}, this indknn reads "
                         f"{INDEX_FORMAT_VERSION}; rebuild it with `indknn index --kind {kind}`")
    if kind == "lsh":
        return LshIndex(np.asarray(group["hyperplanes"][:]), int(meta["tables"]), int(meta["bits"]),
                        int(meta["seed"]))
    if kind == "ivf":
        src = meta.get("centroid_source", {})
        if src.get("role") == "private":  # defence in depth: never serve from private-trained centroids
            raise PrivacyRefusedError(f"the index's centroids were trained on private vectors; {_WHY}")
        return IvfIndex(np.asarray(group["centroids"][:]))
    raise StoreError(f"unknown candidate index kind {kind!r}; rebuild it with `indknn index --kind ...`")


def _values_array(kind: str) -> str:
    return "codes" if kind == "lsh" else "lists"


def _encode(structure: LshIndex | IvfIndex, block: np.ndarray, deleted: np.ndarray) -> np.ndarray:
    """Codes / lists of a block of rows; erased rows get the sentinel (codes 0, list −1) without encoding."""
    if isinstance(structure, LshIndex):
        out = np.zeros((block.shape[0], structure.tables), structure.code_dtype)
    else:
        out = np.full(block.shape[0], -1, np.int32)
    live = ~deleted
    if live.any():
        out[live] = structure.codes(block[live]) if isinstance(structure, LshIndex) else structure.assign(block[live])
    return out


def _fill(group: zarr.Group, structure, store: FeatureStore, start: int, stop: int,
          also_erased: np.ndarray | None = None) -> None:
    """Write codes/lists and erased flags of store rows [start, stop) (arrays already sized); ``also_erased``: rows
    to leave out besides those the store flags (an index rebuilt in place keeps its own erased rows out)."""
    values = group[_values_array(group.attrs["kind"])]
    erased = group["erased"]
    step = max(store.scan_rows, ENCODE_ROWS)
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        block = store.read("private", "features", lo, hi)
        deleted = store.read("private", "deleted", lo, hi).astype(bool)
        if also_erased is not None:
            part = also_erased[lo:hi]  # shorter than the block where the old index covered fewer rows
            deleted[:part.size] |= part
        values[lo:hi] = _encode(structure, block, deleted)
        erased[lo:hi] = deleted


def _resize(group: zarr.Group, n: int) -> None:
    for name in ("codes", "lists", "erased"):
        if name in group:
            arr = group[name]
            if arr.shape[0] < n:
                arr.resize((n,) + tuple(arr.shape[1:]))


def add_rows(store: FeatureStore, rows=None, *, lock_timeout: float = 300.0) -> int:
    """Incremental add: encode the store's committed private rows the index does not cover yet.

    ``rows`` (the new rows, any order) is informational: the index is always
    brought up to the store's committed ``n_rows``, which includes them. The
    group attribute ``n_rows`` is written last (the commit point). Returns the
    number of rows encoded; 0 when there is no index.
    """
    if read_meta(store.path) is None:
        return 0
    with index_lock(store.path, lock_timeout):
        meta = read_meta(store.path)
        if meta is None or meta.get("kind") == "flat" or meta.get("store_uuid") != store.uuid:
            return 0  # another store's numbering (an unfinished compaction): `index` rebuilds it
        group = zarr.open_group(str(index_path(store.path)), mode="r+")
        covered, n = int(meta["n_rows"]), store.n_rows("private")
        if rows is not None and len(rows) and int(np.max(rows)) >= n:
            raise BadInputError(f"row {int(np.max(rows))} is past the store's {n} committed private rows")
        if n <= covered:
            return 0
        structure = _structure(group, meta)
        _resize(group, n)
        _fill(group, structure, store, covered, n)
        group.attrs.update({"n_rows": n})
        return n - covered


def remove_rows(store: FeatureStore, rows, *, lock_timeout: float = 300.0) -> int:
    """Incremental delete: overwrite the codes/list of deleted rows (they derive from the erased vectors).

    Rows past the index's coverage are left to :func:`add_rows`, which writes
    the sentinel for rows the store marks deleted. Returns rows overwritten.
    """
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    if rows.size == 0 or (not index_path(store.path).exists() and not stale_copies(store.path)):
        return 0
    with index_lock(store.path, lock_timeout):
        try:
            done = _overwrite(store, rows)
        except Exception as exc:  # noqa: BLE001 - corrupt metadata or chunk (zarr's ValueError), EIO, ...
            # Review 58, F3: a candidate index that cannot be updated held every later erasure pending and
            # `serve-queries`/`index` (which finish it first) stopped until someone removed it by hand. The index
            # is derived data, rebuilt from the store by `indknn index`; the erased rows' codes are in it, so the
            # erasure removes the whole of it (serving uses the exact scan until it is built again).
            why = f"{type(exc).__name__}: {exc}" if isinstance(exc, StoreError) else type(exc).__name__
            if not _rebuild(store, why=why):  # review 62, F4: kept when its public structure can be read
                drop_index(store.path, why=why)
            done = int(rows.size)
        _refuse_copies_left(store.path)  # an erasure reaches every copy of the codes: killed builds' too
        return done


def _refuse_copies_left(store_path) -> None:
    """Remove :func:`stale_copies` (killed builds', and an index this erasure renamed aside); one still there is a
    StoreError (review 62, F1: a removal that failed half way (EIO) left a copy holding the erased rows' codes while
    the erasure reported success), so the erasure stays pending and the next command tries again."""
    remove_stale_copies(store_path)
    left = stale_copies(store_path)
    if left:
        raise StoreError(f"{left[0]}: a copy of the candidate index (it holds the erased rows' codes) cannot be "
                         "removed; the erasure stays pending (never selected) and the next `indknn delete`, `index` "
                         "or `serve-queries` tries again (or remove that folder by hand)")


def _overwrite(store: FeatureStore, rows: np.ndarray) -> int:
    meta = read_meta(store.path)
    if meta is None:
        if index_path(store.path).exists():  # files without metadata (its zarr.json lost): they may hold codes
            raise StoreError(f"{index_path(store.path)}: the candidate index has no metadata")
        return 0
    if meta.get("kind") == "flat":
        return 0
    if meta.get("store_uuid") != store.uuid:  # another numbering (a compaction stopped before the index was
        # renumbered): these rows cannot be found in it, and the erased ones' codes are there (review 62, F2)
        raise StoreError(f"{index_path(store.path)}: the candidate index was built for other row numbers")
    rows = rows[(rows >= 0) & (rows < int(meta["n_rows"]))]
    if rows.size == 0:
        return 0
    group = zarr.open_group(str(index_path(store.path)), mode="r+")
    values = group[_values_array(meta["kind"])]
    if meta["kind"] == "lsh":
        values.set_orthogonal_selection((rows, slice(None)), np.zeros((rows.size, values.shape[1]), values.dtype))
    else:
        values.set_orthogonal_selection((rows,), np.full(rows.size, -1, np.int32))
    group["erased"].set_orthogonal_selection((rows,), np.ones(rows.size, bool))
    return int(rows.size)


_NOT_CARRIED = ("n_rows", "store_uuid", "built", "format_version", "dim", "encode_seconds", "train_seconds")


def _rebuild(store: FeatureStore, *, why: str) -> bool:
    """Rebuild the index in place from its public structure (caller holds :func:`index_lock`); True when done.

    Review 62, F4: an index that could not be updated for an erasure (a corrupt codes chunk, another row numbering, a
    transient write error) was removed, and serving used the exact scan for everyone until `indknn index` ran. The
    structure is public (LSH hyperplanes drawn from the index's seed; IVF centroids trained on public vectors), so
    every row is encoded again from the store, as `indknn index` would: the erased rows are flagged deleted there
    already (step 1 of the erasure) and get the sentinel, never a code of their vector. When the structure cannot be
    read, does not match its recorded hash, or the rebuild fails, the caller removes the index instead."""
    try:
        meta = read_meta(store.path)
        if meta is None or meta.get("kind") not in ("lsh", "ivf"):
            return False
        structure = _structure(zarr.open_group(str(index_path(store.path)), mode="r"), meta)
        key, values = (("hyperplanes_sha256", structure.hyperplanes) if isinstance(structure, LshIndex)
                       else ("centroids_sha256", structure.centroids))
        if meta.get(key) != vectors_sha256(values):  # a structure edited or damaged without a checksum error
            return False
        write_index(store, structure, {k: v for k, v in meta.items() if k not in _NOT_CARRIED},
                    also_erased=_erased_before(store))
    except Exception as exc:  # noqa: BLE001 - the same failure again (ENOSPC), a corrupt structure, ...: removed
        log.info("%s: the candidate index could not be rebuilt either (%s)", index_path(store.path),
                 type(exc).__name__)
        return False
    log.warning("%s: the candidate index could not be updated for an erasure (%s), so it was encoded again from the "
                "store with its own public structure; the erased rows are not in it", index_path(store.path), why)
    return True


def _erased_before(store: FeatureStore) -> np.ndarray | None:
    """Rows the old index marks erased (review 68, F4: a store chunk of flags restored from an older backup would
    otherwise let the rebuild encode an erased row again), or None when that column cannot be read."""
    try:
        group = zarr.open_group(str(index_path(store.path)), mode="r")
        if group.attrs.get("store_uuid") != store.uuid:  # another numbering (review 69, F2: live rows were left out)
            return None
        return np.asarray(group["erased"][:int(group.attrs["n_rows"])], dtype=bool)
    except Exception:  # noqa: BLE001 - the column is what could not be read: the store's flags alone
        return None


def write_index(store: FeatureStore, structure: LshIndex | IvfIndex, meta: dict, *,
                train_seconds: float = 0.0, also_erased: np.ndarray | None = None) -> int:
    """Encode the store's committed private rows with ``structure`` into a new group, then swap it in as
    ``<store>/index`` (caller holds :func:`index_lock`). A failure leaves the old index, or a stale copy that the
    next index writer or erasure removes, never a half index at the path. Returns the rows encoded."""
    n = store.n_rows("private")
    tmp = store.path / f".index-build-{uuid.uuid4().hex[:8]}"
    rows_chunk = 65536
    try:
        group = zarr.open_group(str(tmp), mode="w")
        if isinstance(structure, LshIndex):
            group.create_array("hyperplanes", data=structure.hyperplanes, chunks=structure.hyperplanes.shape,
                               compressors=checksum_compressors())
            group.create_array("codes", shape=(n, structure.tables), chunks=(rows_chunk, structure.tables),
                               dtype=structure.code_dtype, fill_value=0, compressors=checksum_compressors())
        else:
            group.create_array("centroids", data=structure.centroids, chunks=structure.centroids.shape,
                               compressors=checksum_compressors())
            group.create_array("lists", shape=(n,), chunks=(rows_chunk * 4,), dtype="int32", fill_value=-1,
                               compressors=checksum_compressors())
        group.create_array("erased", shape=(n,), chunks=(rows_chunk * 4,), dtype="bool", fill_value=False,
                           compressors=checksum_compressors())
        group.attrs.update(dict(meta, format_version=INDEX_FORMAT_VERSION, store_uuid=store.uuid, dim=store.dim,
                                n_rows=0))
        t_enc = time.perf_counter()
        _fill(group, structure, store, 0, n, also_erased)
        group.attrs.update({"n_rows": n, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "encode_seconds": round(time.perf_counter() - t_enc, 3),
                            "train_seconds": round(train_seconds, 3)})
        path = index_path(store.path)
        _swap_out(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return n


def drop_index(store_path: str | os.PathLike, *, why: str) -> None:
    """Remove the store's candidate index (caller holds :func:`index_lock`): renamed aside first, so a failure half
    way leaves a stale copy that the next erasure or index writer removes (:func:`remove_stale_copies`), never a
    half index that serving would read. Raises StoreError when it cannot be renamed."""
    path = index_path(store_path)
    try:
        _swap_out(path)
    except OSError as exc:
        raise StoreError(f"{path}: the candidate index cannot be updated ({why}) nor removed ({exc.strerror}); "
                         "remove that folder by hand (the exact scan is used without it), then `indknn delete` "
                         "finishes the erasure and `indknn index --kind ...` builds the index again") from None
    log.warning("%s: the candidate index could not be updated for an erasure (%s), so it was removed with the "
                "erased rows' codes; serving uses the exact scan until `indknn index --kind ...` builds it again",
                path, why)


def renumber_rows(store: FeatureStore, new_row_of, *, lock_timeout: float = 300.0) -> int:
    """After a compaction (``new_row_of[old] = new``, −1 = removed; kept rows stay in order): drop the
    removed rows' codes/lists and bind the index to the compacted store. Returns rows kept."""
    if read_meta(store.path) is None:
        return 0
    new_row_of = np.asarray(new_row_of, dtype=np.int64)
    with index_lock(store.path, lock_timeout):
        remove_stale_copies(store.path)
        meta = read_meta(store.path)
        if meta is None or meta.get("kind") == "flat":
            return 0
        covered = min(int(meta["n_rows"]), new_row_of.size)
        keep = np.flatnonzero(new_row_of[:covered] >= 0)
        if keep.size and not (np.diff(new_row_of[keep]) > 0).all():
            raise StoreError("renumber_rows: kept rows must keep their order")
        path = index_path(store.path)
        group = zarr.open_group(str(path), mode="r+")
        tmp = store.path / f".index-renumber-{uuid.uuid4().hex[:8]}"
        try:
            new = zarr.open_group(str(tmp), mode="w")
            for name in group.array_keys():
                arr = group[name]
                data = np.asarray(arr[:covered])[keep] if name in ("codes", "lists", "erased") else np.asarray(arr[:])
                new.create_array(name, data=data, chunks=arr.chunks, fill_value=arr.fill_value,
                                 compressors=checksum_compressors())
            new.attrs.update(dict(meta, n_rows=int(keep.size), store_uuid=store.uuid))
            _swap_out(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    add_rows(store, lock_timeout=lock_timeout)
    return int(keep.size)


def reconcile(store: FeatureStore, *, lock_timeout: float = 300.0) -> dict:
    """Bring the index up to the store: encode new rows, overwrite rows the store has deleted since, remove what a
    killed index writer left (:func:`remove_stale_copies`)."""
    if stale_copies(store.path):
        with index_lock(store.path, lock_timeout):
            remove_stale_copies(store.path)
    meta = read_meta(store.path)
    if meta is None or meta.get("kind") == "flat" or meta.get("store_uuid") != store.uuid:
        return {"added": 0, "removed": 0}
    added = add_rows(store, lock_timeout=lock_timeout)
    meta = read_meta(store.path)
    n = int(meta["n_rows"])
    deleted = store.read("private", "deleted", 0, n).astype(bool)
    erased = np.asarray(zarr.open_group(str(index_path(store.path)), mode="r")["erased"][:n])
    stale = np.flatnonzero(deleted & ~erased)
    removed = remove_rows(store, stale, lock_timeout=lock_timeout) if stale.size else 0
    return {"added": added, "removed": removed}


def _swap_out(path: Path) -> None:
    if path.exists():
        old = path.with_name(f".index-old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        shutil.rmtree(old, ignore_errors=True)
