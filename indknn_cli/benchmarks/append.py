"""Bytes written when queries are embedded into a store (issue 21: no tail-chunk rewrite per 256 rows).

    indknn bench append --rows 20000 --d 64

Embeds ``--rows`` unit vectors from a ``.npy`` file as one query batch (the reader
hands 256 rows at a time, as `serve-queries --queries FILE` does), and the same
vectors as labelled private rows from a Parquet file (``--role``: one of them), and
returns, per role, the bytes this process wrote (``wchar`` of /proc/self/io: every write(2), compressed
chunks and metadata included) against the bytes of the vectors: the write
amplification (target ≤ 1.2).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
ROLES = ("query", "private")


def _wchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _write_private(path: Path, x: np.ndarray) -> None:
    """Labelled private rows as Parquet (id, label, vector), the input `embed` takes for vectors."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, d = x.shape
    vec = pa.ListArray.from_arrays(pa.array(np.arange(0, n * d + 1, d, dtype=np.int32)), pa.array(x.ravel()))
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "label": ["a"] * n, "vector": vec}), path)


def roles(role: str) -> tuple[str, ...]:
    """The roles ``--role`` names: query, private, or both of them."""
    if role == "both":
        return ROLES
    if role not in ROLES:
        from ..errors import BadInputError

        raise BadInputError(f"--role: expected query, private or both, got {role!r}")
    return (role,)


def run(*, rows: int, d: int, role: str) -> dict:
    """Embed ``rows`` vectors of dimension ``d`` as ``role`` (``query``: one batch from a .npy file;
    ``private``: labelled rows from a Parquet file) into a new store; bytes written against the row data."""
    if role not in ROLES:
        from ..errors import BadInputError

        raise BadInputError(f"role: expected query or private, got {role!r}")
    log.info("embedding %d rows of d = %d as %s", rows, d, role)
    from indknn_cli.embedding import embed_into_store, embed_query_file
    from indknn_cli.store import ExtractorInfo, FeatureStore

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / ("q.npy" if role == "query" else "p.parquet")
        np.save(src, x) if role == "query" else _write_private(src, x)
        store = FeatureStore.create(tmp / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=d,
                                    label_names=["a"], label_names_source="declared")
        w0, t0 = _wchar(), time.perf_counter()
        if role == "query":
            name = embed_query_file(src, store=store, batch="b")
            start, stop = name.start, name.stop
        else:
            embed_into_store(src, store_path=tmp / "s.zarr", role="private", id_column="id",
                             label_column="label", vector_column="vector", device="cpu")
            start, stop = 0, rows
        wall, written = time.perf_counter() - t0, _wchar() - w0
        store = FeatureStore.open(tmp / "s.zarr")
        group = "query" if role == "query" else "private"
        back = store.read(group, "features", start, stop)
        ids = store.read(group, "record_id", start, stop)
        assert np.allclose(back, x, atol=1e-6), "stored vectors differ from the input"
    vectors = rows * d * 4
    # every stored column, uncompressed: vectors, label (int32), deleted (bool), and record id, user id (and
    # a query's batch name) as vlen-utf8 (4-byte length + bytes)
    data = vectors + rows * (4 + 1 + 2 * 4) + sum(len(str(r).encode()) for r in ids)
    if role == "query":
        data += rows * (4 + len("b"))
    return {"role": role, "rows": rows, "d": d, "chunk_rows": store.chunk_rows, "vector_bytes": vectors,
            "row_data_bytes": data, "bytes_written": written, "write_amplification": round(written / data, 3),
            "vs_vectors_only": round(written / vectors, 3), "seconds": round(wall, 3),
            "loadavg": [round(v, 2) for v in os.getloadavg()]}

