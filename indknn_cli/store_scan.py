"""A whole role's float32 features streamed from a local store's chunk files into reused buffers (issue 21).

Reading a role through zarr costs about three times the bytes' own read here: 1.1–1.3 s (1.4–1.7 CPU s) for
the 1.5 GB of N = 1M, d = 384, against 0.4 s to read the same chunk files and check their crc32c; and each
step lands in freshly allocated memory, whose page faults the screen then pays. The features arrays that
:mod:`indknn_cli.store` writes have one layout (``FeatureStore.create``): float32, a regular grid of
``(chunk_rows, dim)`` chunks, the codecs ``bytes`` (little endian) then ``crc32c``, the default ``/`` key
encoding, every chunk file written whole (padded) at ``<group>/features/c/<i>/0``. For that layout,
:func:`scan_features` reads each chunk file straight into a step's buffer and checks its crc32c with
google-crc32c, the library zarr's ``Crc32cCodec`` calls, over the same bytes (the chunk's body; the last four
bytes are the little-endian checksum): the same float32 values zarr decodes, the same refusal of a changed
chunk (``StoreError``, the wording of ``store_layout.read_chunks``). Anything else (another layout, an object-store
URL, a big-endian machine, a chunk file missing or of another size, a step not on chunk boundaries) is read
by zarr for that step, as before. tests/test_store_scan.py compares both paths bit for bit and corrupts chunks.

The buffers are reused: a block is valid until the consumer asks for the block after next (a ring of three:
one being read ahead, one being screened, one spare). Callers that keep blocks (a cached store) ask for
fresh ones (``reuse=False``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from .store_layout import GROUP_OF_ROLE, read_chunks


def _fast_layout(store, role: str) -> tuple[Path, int] | None:
    """(folder of the chunk files, chunk rows) when the role's features have the layout above, else None."""
    if sys.byteorder != "little" or getattr(store, "remote", None) is not None:
        return None
    try:
        from zarr.codecs import BytesCodec, Crc32cCodec

        arr = store.group(role)["features"]
        meta = arr.metadata
        codecs = tuple(getattr(meta, "codecs", ()) or ())
        grid = getattr(meta, "chunk_grid", None)
        enc = getattr(meta, "chunk_key_encoding", None)
        ok = (getattr(meta, "zarr_format", None) == 3 and np.dtype(arr.dtype) == np.float32
              and len(codecs) == 2 and isinstance(codecs[0], BytesCodec) and isinstance(codecs[1], Crc32cCodec)
              and str(getattr(codecs[0].endian, "value", codecs[0].endian)) == "little"
              and tuple(getattr(grid, "chunk_shape", ())) == (int(store.chunk_rows), int(store.dim))
              and getattr(enc, "name", None) == "default" and getattr(enc, "separator", None) == "/"
              and len(arr.shape) == 2 and int(arr.shape[1]) == int(store.dim))
    except Exception:  # noqa: BLE001 - anything unexpected: zarr reads it
        return None
    if not ok:
        return None
    folder = Path(store.path) / GROUP_OF_ROLE[role] / "features" / "c"
    return folder, int(store.chunk_rows)


def _read_chunk_into(path: Path, dest: memoryview, crc_buf: bytearray) -> bool:
    """Read one whole chunk file: its body into ``dest`` (exactly ``len(dest)`` bytes), then its 4 checksum
    bytes. False when the file is missing or not that size (zarr then reads the step); a checksum that
    does not match raises zarr's error text, which ``store_layout.read_chunks`` turns into a StoreError."""
    import google_crc32c

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):  # zarr reads a missing chunk as its fill value
        return False
    try:
        if os.fstat(fd).st_size != len(dest) + 4:
            return False
        got = os.readv(fd, [dest, crc_buf])
    finally:
        os.close(fd)
    if got != len(dest) + 4:
        return False
    computed = int(google_crc32c.value(np.frombuffer(dest, dtype=np.uint8)))
    if computed != int.from_bytes(bytes(crc_buf), "little"):
        raise ValueError("Stored and computed checksum do not match")
    return True


def scan_features(store, role: str = "private", rows: int | None = None, *,
                  reuse: bool = True) -> Iterator[tuple[int, np.ndarray]]:
    """(start_row, float32 features) over the role's committed rows in steps of ``rows`` (default the store's
    scan step): the values and steps of ``FeatureStore.iter_chunks``, read as the module docstring says."""
    n = store.n_rows(role)
    step = int(rows or store.scan_rows)
    layout = _fast_layout(store, role)
    if layout is None or step % layout[1]:
        yield from store.iter_chunks(role, rows=step)
        return
    folder, cr = layout
    d = int(store.dim)
    arr = store.group(role)["features"]
    ring: list[np.ndarray] = []
    crc_buf = bytearray(4)
    for i, start in enumerate(range(0, n, step)):
        stop = min(n, start + step)
        k = -(-(stop - start) // cr)  # whole chunks of this step (the last one padded on disk)
        if not reuse:
            buf = np.empty((k * cr, d), np.float32)
        else:
            if len(ring) < 3:
                ring.append(np.empty((-(-step // cr) * cr, d), np.float32))
            buf = ring[i % 3]
        raw = memoryview(buf).cast("B")
        nbytes = cr * d * 4

        def read_step(buf=buf, raw=raw, start=start, stop=stop, k=k):
            for j in range(k):
                c = start // cr + j
                if not _read_chunk_into(folder / str(c) / "0", raw[j * nbytes:(j + 1) * nbytes], crc_buf):
                    return np.asarray(arr[start:stop], dtype=np.float32)  # zarr reads this step
            return buf[:stop - start]

        yield start, read_chunks(store.path, role, "features", read_step)
