"""`indknn bench serve-speed --device cuda`: queries per second of `serve-queries` on a GPU (issue 21).

    indknn bench serve-speed --device cuda --n 1000000 --d 384 --queries 139264 --batch-size 8192

On the synthetic clustered store of serve-speed (private rows and queries around the same class centres),
two batches are stored: ``one`` (the first ``--batch-size`` queries) and ``bench`` (all ``--queries``). Two
whole ``serve-queries --device cuda`` processes run from the same ledger (restored between them, reuse off,
fixed seed): A answers ``one``, B answers ``bench``. Printed, one JSON line:

- ``serve_queries_per_s``: B's queries over B's wall time (process start, CUDA's, the store's first copy to
  the GPU and every commit included);
- ``steady_queries_per_s``: (queries of B − queries of A) / (wall of B − wall of A): the rate of the batches
  after the first, start-up cancelled (both processes pay it alike);
- ``in_process_queries_per_s``: inside B, the queries released after its first part over the time from the first
  part's release to the last's (each part's `-v` line on stderr, read as it comes), with ``part_interval_ms``
  (min, median, max between consecutive releases): the same rate without the difference of two start-ups
  (which moved the steady figure by half on 2026-11-28);
- ``matmul_fp32_queries_per_s`` / ``matmul_fp16_queries_per_s``: the bare products of the same queries with
  every row on the GPU (batches of ``--batch-size``, rows in steps as the screen takes them), nothing else;
- ``gpu_fused_kernels``: whether the fused kernels (:mod:`indknn_cli.gpu_fused`) pass their probe here (a
  first serve, not timed, fills Triton's disk cache before A and B);
- ``first_batch_identical``: whether A's answers equal the first ``--batch-size`` answers of B (same run key:
  the batch id is the seed's other half, so ``one`` is served under the id ``bench``).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np


_PART = re.compile(r"part \d+ released: (\d+) of \d+ queries")


def _serve(tmp: Path, batch: str, *, batch_size: int, out: str, device: str):
    """(wall s, peak RSS MB, [(s since start, queries released so far)] per part, read from `-v`'s stderr lines)."""
    from .peak_rss import indknn_command, read_peak_mb

    env = dict(os.environ, INDKNN_DEBUG="0")
    cmd = indknn_command(["serve-queries", batch, "--batch-id", "bench", "--store", str(tmp / "s.zarr"),
                          "--ledger", str(tmp / "L"), "--seed", "1", "--no-reuse", "--batch-size", str(batch_size),
                          "--device", device, "--out", str(tmp / out), "-v"], tmp / "serve.peak")
    w0 = time.perf_counter()
    parts, tail = [], []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          cwd=tmp) as proc:
        for line in proc.stderr:  # one line per released part, as it is released
            m = _PART.search(line)
            if m:
                parts.append((time.perf_counter() - w0, int(m.group(1))))
            tail = (tail + [line])[-20:]
    if proc.returncode:
        raise RuntimeError(f"serve-queries exited {proc.returncode}: {''.join(tail)}")
    return time.perf_counter() - w0, read_peak_mb(tmp / "serve.peak"), parts


def _in_process(parts: list) -> dict:
    """The rate between the first and the last part's release inside one process (no start-up in it), and the
    intervals between consecutive parts' releases."""
    if len(parts) < 2:
        return {"in_process_queries_per_s": None, "part_interval_ms": None}
    (t0, q0), (t1, q1) = parts[0], parts[-1]
    gaps = np.diff([t for t, _ in parts]) * 1e3
    return {"in_process_queries_per_s": round((q1 - q0) / (t1 - t0), 1) if t1 > t0 else None,
            "part_interval_ms": {"min": round(float(gaps.min()), 1), "median": round(float(np.median(gaps)), 1),
                                 "max": round(float(gaps.max()), 1)},
            "first_part_released_s": round(t0, 2)}


def _matmul_rate(x, q, batch: int, dtype, device: str) -> float | None:
    import torch

    from ..gpu_screen import step_bytes, step_rows

    if device != "cuda":
        return None
    dev = torch.device("cuda")
    xt = torch.from_numpy(x).to(dev).to(dtype)
    qt = torch.from_numpy(q).to(dev).to(dtype)
    step = step_rows(batch, x.shape[0], budget=step_bytes(dev))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.mm(qt[:batch], xt[:step].T)
    torch.cuda.synchronize()
    w0 = time.perf_counter()
    for lo in range(0, q.shape[0], batch):
        for a in range(0, x.shape[0], step):
            s = torch.mm(qt[lo:lo + batch], xt[a:a + step].T)
            del s
    torch.cuda.synchronize()
    rate = q.shape[0] / (time.perf_counter() - w0)
    del xt, qt
    torch.cuda.empty_cache()
    return rate


def run_gpu(n: int, d: int, m: int, tau: float, batch_size: int, *, device: str = "cuda") -> dict:
    """The figures above (``device``: "cpu" runs the same steps on the CPU, for a dry run without a GPU)."""
    import pyarrow.parquet as pq
    import torch

    from ..store import FeatureStore
    from .serve_speed import _state, make_store

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        w0 = time.perf_counter()
        _store, x, q = make_store(tmp, n, d, m, tau)
        store = FeatureStore.open(tmp / "s.zarr", mode="a")
        store.append("query", q[:batch_size], record_ids=[f"q{i}" for i in range(batch_size)], batch="one")
        setup_s = time.perf_counter() - w0
        fp32 = _matmul_rate(x, q, batch_size, torch.float32, device)
        fp16 = _matmul_rate(x, q, batch_size, torch.float16, device)
        del x
        _state(tmp, "save")
        fused = None
        if device == "cuda":  # a first serve fills Triton's disk cache, so that A and B both find the kernels built
            from .. import gpu_fused

            fused = gpu_fused.wanted(torch.device("cuda")) and gpu_fused.usable(torch.device("cuda"), d)
            _serve(tmp, "one", batch_size=batch_size, out="warm.parquet", device=device)
            _state(tmp, "restore")
        a_wall, a_peak, _ = _serve(tmp, "one", batch_size=batch_size, out="a.parquet", device=device)
        first = pq.read_table(tmp / "a.parquet").to_pylist()
        _state(tmp, "restore")
        b_wall, b_peak, b_parts = _serve(tmp, "bench", batch_size=batch_size, out="b.parquet", device=device)
        answers = pq.read_table(tmp / "b.parquet")
    ks = answers.column("released_count").to_numpy()
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("query_id",)} for r in rows]  # noqa: E731
    return {
        "n": n, "d": d, "queries": m, "tau": tau, "batch_size": batch_size, "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "mean_released_K": round(float(np.mean(ks)), 1),
        "serve_queries_per_s": round(m / b_wall, 1),
        "steady_queries_per_s": round((m - batch_size) / (b_wall - a_wall), 1) if b_wall > a_wall else None,
        **_in_process(b_parts),
        "matmul_fp32_queries_per_s": fp32 and round(fp32, 1), "matmul_fp16_queries_per_s": fp16 and round(fp16, 1),
        "wall_s": {"setup": round(setup_s, 1), "serve_one_batch": round(a_wall, 2), "serve_all": round(b_wall, 2)},
        "serve_peak_rss_mb": {"one_batch": a_peak, "all": b_peak},
        "gpu_fused_kernels": fused,
        "first_batch_identical": strip(first) == strip(answers.slice(0, batch_size).to_pylist()),
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }
