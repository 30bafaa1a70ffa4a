"""Cost of `indknn delete`: erasing 1 and 10,000 records from a 1,000,000-record store (d = 384).

The store is filled with synthetic unit vectors through the store's own appender
(blocks of 65,536 rows, one commit), indexed (a ledger with every record at
budget B), then records are deleted with the library call behind `indknn delete`
(ledger lock, store lock, tombstone event, physical overwrite of every touched
chunk). Reported per deletion: wall time and bytes rewritten (uncompressed bytes
of the store chunks rewritten; the features are stored uncompressed). With
``--compact`` the compaction that follows is timed too. Prints one JSON object.

    .venv/bin/python bench/delete_bench.py [--rows 1000000] [--dim 384] [--compact]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from indknn_cli.deletion import delete_records  # noqa: E402
from indknn_cli.serving import build_index, make_params  # noqa: E402
from indknn_cli.store import ExtractorInfo, FeatureStore  # noqa: E402

BLOCK = 65536


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_store(path: Path, *, rows: int, dim: int, seed: int) -> FeatureStore:
    store = FeatureStore.create(path, extractor=ExtractorInfo("vectors", "synthetic", "bench"), dim=dim,
                                label_names=[f"c{i}" for i in range(10)], label_names_source="declared")
    rng = np.random.default_rng(seed)
    app = store.appender("private")
    for lo in range(0, rows, BLOCK):
        hi = min(rows, lo + BLOCK)
        x = rng.standard_normal((hi - lo, dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        app.write(x, labels=np.arange(lo, hi) % 10, record_ids=[f"r{i:07d}" for i in range(lo, hi)],
                  user_ids=[f"u{i % 250000:06d}" for i in range(lo, hi)])
    app.commit()
    return store


def timed_delete(store_path: Path, ledger_path: Path, ids: list[str], *, compact: bool = False) -> dict:
    t0 = time.perf_counter()
    res = delete_records(store_path=store_path, ledger_path=ledger_path, record_ids=ids, compact=compact)
    wall = time.perf_counter() - t0
    out = {"records": len(ids), "records_erased": res.records_erased, "wall_s": round(wall, 3),
           "bytes_rewritten": res.bytes_rewritten}
    if res.compaction is not None:
        out["compaction"] = res.compaction
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 10_000])
    ap.add_argument("--compact", action="store_true", help="also time a compaction after the deletions")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="indknn-delete-bench-", dir=args.workdir))
    try:
        store_path, ledger_path = work / "store.zarr", work / "ledger"
        t0 = time.perf_counter()
        store = build_store(store_path, rows=args.rows, dim=args.dim, seed=args.seed)
        t_store = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_index(store_path=store_path, ledger_path=ledger_path,
                    params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=1000))
        t_index = time.perf_counter() - t0
        result = {
            "rows": args.rows, "dim": args.dim, "chunk_rows": store.chunk_rows,
            "feature_chunk_bytes": store.chunk_rows * args.dim * 4, "store_bytes": du(store_path),
            "setup_s": {"write_store": round(t_store, 1), "index": round(t_index, 1)},
            "cpu_count": os.cpu_count(), "deletions": [],
        }
        rng = np.random.default_rng(args.seed + 1)
        order = rng.permutation(args.rows)
        used = 0
        for size in args.sizes:
            ids = [f"r{i:07d}" for i in order[used:used + size]]
            used += size
            result["deletions"].append(timed_delete(store_path, ledger_path, ids))
        if args.compact:
            result["compaction"] = timed_delete(store_path, ledger_path, [], compact=True)
            result["compaction"]["store_bytes_after"] = du(store_path)
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
