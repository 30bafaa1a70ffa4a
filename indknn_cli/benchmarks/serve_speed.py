"""Throughput of `serve-queries` (exact flat search, cosine, reuse off) end to end from a Zarr store.

    indknn bench serve-speed --n 10000 50000 200000 --d 384 768 --queries 2048

Builds a synthetic clustered store per (N, d) in a temp dir, creates a ledger,
and times `serving.serve_queries` (candidates, filter, ledger commits) with a
fixed seed. Prints one JSON line per configuration: queries/s, mean released
K, peak RSS of the process (ru_maxrss), and the fp32 matmul floor measured
on the same machine.

    indknn bench serve-speed --n 200000 --d 384 --scheduler local --workers 1,2,4

With ``--scheduler`` (issue 19) the candidate phase runs on Dask (``local``: a
LocalCluster of 1, 2, 4 worker processes, one thread each, started per count;
else the address of a running scheduler): per (N, d) one line for the
in-process run and one per worker count, from the same store and the same
starting ledger (restored between runs), with queries/s, the ratio to the
in-process run, the coordinator's share of the wall time (everything but
waiting for the workers' triples), the triples' bytes per batch, and the
measured per-chunk costs (read, score) behind docs/SCALING.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


from indknn_cli.serving import build_index, make_params, serve_queries  # noqa: E402
from indknn_cli.store import ExtractorInfo, FeatureStore  # noqa: E402


def clustered(n, d, classes, rng, spread=1.0):
    centres = rng.standard_normal((classes, d)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    y = rng.integers(0, classes, n)
    x = centres[y] + spread * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, y.astype(np.int32)


def matmul_floor(n, d, q=1024):
    a = torch.randn(q, d)
    b = torch.randn(n, d)
    (a @ b.T)
    t = time.perf_counter()
    for _ in range(3):
        (a @ b.T)
    return (time.perf_counter() - t) / 3 / q


def make_store(tmp: Path, n, d, m, tau):
    store = FeatureStore.create(tmp / "s.zarr", extractor=ExtractorInfo("vectors", "synthetic", "1"), dim=d,
                                label_names=[str(i) for i in range(10)])
    app = store.appender("private")
    for lo in range(0, n, 50000):
        x, y = clustered(min(50000, n - lo), d, 10, np.random.default_rng(lo))
        app.write(x, labels=y, record_ids=[f"r{i}" for i in range(lo, lo + len(x))])
    app.commit()
    q, _ = clustered(m, d, 10, np.random.default_rng(10**9))
    store.append("query", q, record_ids=[f"q{i}" for i in range(m)], batch="bench")
    params = make_params(epsilon=1.0, delta=1e-5, tau=tau, sigma2=0.6, planned_queries=m)
    build_index(store_path=tmp / "s.zarr", ledger_path=tmp / "L", params=params)
    return store


def run(n, d, m, tau, batch_size, device):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_store(tmp, n, d, m, tau)
        t0 = time.perf_counter()
        res = serve_queries(store_path=tmp / "s.zarr", ledger_path=tmp / "L", query_batch="bench", seed=1,
                            batch_size=batch_size, device=device, reuse=False)
        wall = time.perf_counter() - t0
    ks = [a["released_count"] for a in res.answers]
    return {"n": n, "d": d, "queries": m, "tau": tau, "batch_size": batch_size, "device": device,
            "seconds": round(wall, 3), "queries_per_s": round(m / wall, 1),
            "mean_released_K": round(float(np.mean(ks)), 1),
            "matmul_floor_ms_per_query": round(matmul_floor(n, d) * 1e3, 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[10000, 50000, 200000])
    ap.add_argument("--d", type=int, nargs="+", default=[384, 768])
    ap.add_argument("--queries", type=int, default=2048)
    ap.add_argument("--tau", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--scheduler", default=None, help="local (a LocalCluster per worker count) or a scheduler address")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    a = ap.parse_args(argv)
    for d in a.d:
        for n in a.n:
            if a.scheduler:
                from .serve_dask import run_scheduled

                for line in run_scheduled(n, d, a.queries, a.tau, a.batch_size, a.device, a.scheduler, a.workers,
                                          make_store=make_store):
                    print(json.dumps(line), flush=True)
            else:
                print(json.dumps(run(n, d, a.queries, a.tau, a.batch_size, a.device)), flush=True)


if __name__ == "__main__":
    main()
