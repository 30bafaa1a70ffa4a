"""`indknn bench serve-speed --scheduler local|ADDRESS --workers 1,2,4`: serve-queries with the candidate phase on
Dask (issue 19) against the in-process engine, in one run, from the same store and the same starting ledger.

For every worker count: queries/s, the ratio to the in-process run, the coordinator's share of the wall time
(everything but waiting for the workers' triples: reading the batch, merging and masking the triples, the
filter, the ledger commits), the triples' bytes per batch, and whether the answers equal the in-process ones.
Also the per-chunk costs measured here (read one store chunk; score one chunk against one batch) that
docs/SCALING.md projects from.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..distributed import DaskCandidates, connect
from ..engine import ArraySource, find_candidates
from ..ledger_integrity import MARK_NAME
from ..serving import serve_queries


def _warm() -> int:
    """Import what a candidate task needs (torch, the engine) once per worker, outside the timed run; returns
    the worker's torch threads (printed: one, in the workers Dask starts)."""
    import torch

    from indknn_cli import engine  # noqa: F401
    return torch.get_num_threads()


@contextlib.contextmanager
def _cluster(scheduler: str, workers: int | None):
    if scheduler != "local":
        yield scheduler
        return
    import logging

    from distributed import LocalCluster

    # Each worker process runs one task at a time on one core (its torch uses one thread, as Dask's own workers
    # do: the nanny starts them with OMP_NUM_THREADS=1); the in-process run uses every core.
    with LocalCluster(n_workers=workers, processes=True, threads_per_worker=1, dashboard_address=None,
                      silence_logs=logging.ERROR) as cluster:
        yield cluster.scheduler_address


def per_chunk_costs(store, *, batch: int, tau: float, repeats: int = 3) -> dict:
    """Seconds to read one scan step of the store (``scan_rows``: the rows a worker reads and scores together)
    and to score it against ``batch`` queries at the run's ``tau`` (screen + exact κ), here."""
    rows = store.scan_rows
    q = store.read("query", "features", 0, batch)
    t = time.perf_counter()
    for _ in range(repeats):
        block = store.read("private", "features", 0, rows)
    read_s = (time.perf_counter() - t) / repeats
    p = dict(kernel="cosine", tau=tau, nu=None, device="cpu")
    find_candidates(q, ArraySource(block, rows=rows), **p)
    t = time.perf_counter()
    for _ in range(repeats):
        c = find_candidates(q, ArraySource(block, rows=rows), **p)
    score_s = (time.perf_counter() - t) / repeats
    return {"chunk_rows": int(rows), "chunk_bytes": int(rows * store.dim * 4), "batch": int(q.shape[0]),
            "read_chunk_s": round(read_s, 5), "score_chunk_s": round(score_s, 5),
            "pairs_per_chunk": int(sum(r.size for r in c.rows))}


def run_scheduled(n, d, m, tau, batch_size, device, scheduler, workers, *, make_store):
    """Yield one JSON-able dict for the in-process run and one per worker count."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store, _x, _q = make_store(tmp, n, d, m, tau)
        sp, lp = tmp / "s.zarr", tmp / "L"
        shutil.copytree(lp, tmp / "L.pristine")
        mark = (sp / MARK_NAME).read_bytes()

        def restore():
            shutil.rmtree(lp)
            shutil.copytree(tmp / "L.pristine", lp)
            (sp / MARK_NAME).write_bytes(mark)

        import torch

        base = {"n": n, "d": d, "queries": m, "tau": tau, "batch_size": batch_size, "device": device,
                "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
        costs = per_chunk_costs(store, batch=min(batch_size, m), tau=tau)
        # Untimed first: a process's first serve pays what every later one reuses (numba's kernels loaded or
        # compiled, torch's first calls); the workers are warmed likewise (_warm) and the coordinator's filter
        # runs in this process, so without it only the in-process run would pay them.
        serve_queries(store_path=sp, ledger_path=lp, query_batch="bench", seed=1, batch_size=batch_size,
                      device=device, reuse=False)
        restore()
        t0 = time.perf_counter()
        ref = serve_queries(store_path=sp, ledger_path=lp, query_batch="bench", seed=1, batch_size=batch_size,
                            device=device, reuse=False)
        wall0 = time.perf_counter() - t0
        yield {**base, "mode": "in-process", "torch_threads": torch.get_num_threads(), "seconds": round(wall0, 3),
               "queries_per_s": round(m / wall0, 1), "per_chunk": costs}
        for w in (workers if scheduler == "local" else [None]):
            restore()
            with _cluster(scheduler, w) as address:
                client = connect(address)
                try:
                    threads = sorted(set(client.run(_warm).values()))
                    dask = DaskCandidates(client, device=device)
                    t0 = time.perf_counter()
                    res = serve_queries(store_path=sp, ledger_path=lp, query_batch="bench", seed=1,
                                        batch_size=batch_size, device=device, reuse=False,
                                        candidate_finder_factory=dask.factory)
                    wall = time.perf_counter() - t0
                    st = dask.finders[0].stats
                    n_workers = dask.workers()
                    dask.release()
                finally:
                    client.close()
            yield {**base, "mode": "dask", "scheduler": scheduler, "workers": n_workers,
                   "torch_threads_per_worker": threads,
                   "tasks_per_batch": st["tasks"] // max(1, st["batches"]), "seconds": round(wall, 3),
                   "queries_per_s": round(m / wall, 1), "vs_in_process": round(wall0 / wall, 3),
                   "coordinator_share": round(1.0 - st["wait_seconds"] / wall, 3),
                   "merge_seconds": round(st["merge_seconds"], 3),
                   "triple_bytes_per_batch": int(st["result_bytes"] // max(1, st["batches"])),
                   "answers_identical": res.answers == ref.answers,
                   "load_avg_1m_after": round(os.getloadavg()[0], 2)}
