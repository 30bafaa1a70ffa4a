"""Bytes written when queries are embedded into a store (issue 21: no tail-chunk rewrite per 256 rows).

    indknn bench append --rows 20000 --d 64

Embeds ``--rows`` unit vectors from a ``.npy`` file as one query batch (the reader
hands 256 rows at a time, as `serve-queries --queries FILE` does), and prints the
bytes this process wrote (``wchar`` of /proc/self/io: every write(2), compressed
chunks and metadata included) against the bytes of the vectors: the write
amplification (target ≤ 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def _wchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def run(rows: int, d: int) -> dict:
    from indknn_cli.embedding import embed_query_file
    from indknn_cli.store import ExtractorInfo, FeatureStore

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        np.save(tmp / "q.npy", x)
        store = FeatureStore.create(tmp / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=d,
                                    label_names=["a"])
        w0, t0 = _wchar(), time.perf_counter()
        name = embed_query_file(tmp / "q.npy", store=store, batch="b")
        wall, written = time.perf_counter() - t0, _wchar() - w0
        back = store.read("query", "features", name.start, name.stop)
        ids = store.read("query", "record_id", name.start, name.stop)
        assert np.allclose(back, x, atol=1e-6), "stored vectors differ from the input"
    vectors = rows * d * 4
    # every stored column, uncompressed: vectors, label (int32), deleted (bool), and record id, user id and
    # batch name as vlen-utf8 (4-byte length + bytes)
    data = vectors + rows * (4 + 1 + 3 * 4 + len("b")) + sum(len(str(r).encode()) for r in ids)
    return {"rows": rows, "d": d, "chunk_rows": store.chunk_rows, "vector_bytes": vectors, "row_data_bytes": data,
            "bytes_written": written, "write_amplification": round(written / data, 3),
            "vs_vectors_only": round(written / vectors, 3), "seconds": round(wall, 3),
            "loadavg": [round(v, 2) for v in os.getloadavg()]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="indknn bench append", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--d", type=int, default=64)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.rows, a.d)), flush=True)


if __name__ == "__main__":
    main()
