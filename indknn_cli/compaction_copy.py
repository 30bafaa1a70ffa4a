"""The copy a compaction writes (``indknn delete --compact``, deletion.py): the store without its deleted
private rows, local or on object storage."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from . import object_store
from .fsio import fsync_path
from .record_keys import KEY_ARRAY
from .store import CHECKSUM, ERASE_PENDING_ATTR, GROUP_OF_ROLE, FeatureStore, scan_rows_for
from .store_layout import read_chunks

PENDING_ATTR = ERASE_PENDING_ATTR
#: a store created before the class list's origin was recorded keeps that fact through compaction
UNRECORDED_LABEL_SOURCE = "unrecorded"


def _write_compacted_copy(store: FeatureStore, dest: Path, keep: np.ndarray, new_uuid: str) -> None:
    """The store without its deleted private rows, under ``new_uuid`` (the caller fsyncs it; :func:`compact`
    has checked the key array)."""
    if store.remote is not None:  # the copy goes under a new prefix, named by dest's remote.json
        object_store.new_generation(store, dest)
    new = FeatureStore.create(dest, extractor=store.extractor, dim=store.dim, label_names=store.label_names,
                              chunk_rows=store.chunk_rows,
                              label_names_source=store.label_names_source or UNRECORDED_LABEL_SOURCE)
    attrs = dict(store.root.attrs)
    history = list(attrs.get("compactions", []))
    history.append({"from_store_uuid": store.uuid, "rows_removed": int(store.n_rows("private") - keep.size),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    attrs.update(store_uuid=new_uuid, compactions=history)
    new.root.attrs.update(attrs)

    names = ("features", "labels", "record_id", "user_id", "deleted", KEY_ARRAY)
    # each array opened once (on object storage an open is two requests)
    src_group, dst_group = store.group("private"), new.group("private")
    src = {name: src_group[name] for name in names if name in src_group}
    dst = {name: dst_group[name].with_config({"write_empty_chunks": True}) for name in names}  # dense (review 74, F4)
    m = int(keep.size)
    for name in names:
        dst[name].resize((m,) + tuple(dst[name].shape[1:]))
    # a multiple of every array's chunk length (each chunk written once), ~8 MiB of features per step
    step = scan_rows_for(store.dim, 4 * store.chunk_rows, nbytes=8 << 20)
    n = store.n_rows("private")
    buf: dict[str, list[np.ndarray]] = {name: [] for name in names}
    buffered = written = 0

    def flush(final: bool) -> None:
        nonlocal buffered, written
        while buffered >= step or (final and buffered):
            take = min(step, buffered)
            for name in names:
                block = np.concatenate(buf[name]) if len(buf[name]) > 1 else buf[name][0]
                dst[name][written:written + take] = block[:take]
                buf[name] = [block[take:]] if take < len(block) else []
            written += take
            buffered -= take

    for lo in range(0, n, step):
        hi = min(n, lo + step)
        sel = keep[(keep >= lo) & (keep < hi)] - lo
        if sel.size == 0:
            continue
        for name in names:
            if name not in src:  # a store made before content keys: its copy records none ("")
                buf[name].append(np.full(sel.size, "", dtype=str))
                continue
            buf[name].append(read_chunks(store.path, "private", name, lambda: np.asarray(src[name][lo:hi]))[sel])
        buffered += sel.size
        flush(False)
    flush(True)
    group_attrs = {k: v for k, v in dict(src_group.attrs).items() if k != PENDING_ATTR}
    group_attrs["n_rows"] = m
    dst_group.attrs.update(group_attrs)
    for role in ("public", "query"):  # untouched: copied byte for byte (query rows keep their numbers)
        g = GROUP_OF_ROLE[role]
        object_store.copy_group(store, dest, g)
    known = {"zarr.json", FeatureStore.LOCK_NAME, object_store.POINTER, *GROUP_OF_ROLE.values()}
    for entry in store.path.iterdir():  # other tools' files (e.g. candidate indexes): carried as they are
        if entry.name in known or entry.name.startswith("."):
            continue
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, dest / entry.name)
    # crc32c: the rewritten private arrays have it; public/query groups copied from a store made before
    # checksums do not, so the root attribute says "crc32c" only when every array really carries it.
    copy = FeatureStore.open(dest, mode="a")
    if copy.checksummed:
        copy.root.attrs.update({"checksums": CHECKSUM})
    elif "checksums" in copy.root.attrs:
        del copy.root.attrs["checksums"]


def _fsync_tree(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for f in files:
            p = Path(folder) / f
            total += p.stat().st_size
            fsync_path(p)
        fsync_path(Path(folder))
    return total
