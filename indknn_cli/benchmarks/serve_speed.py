"""Speed of `serve-queries` against the bare fp32 matrix product, and of its candidate phase against FAISS.

    indknn bench serve-speed                       # N = 50,000, d = 768, 20,000 stored queries, τ = 0.54
    indknn bench serve-speed --n 10000,200000 --d 384 --queries 2048
    indknn bench serve-speed --device cuda --n 1000000 --d 384 --queries 139264 --batch-size 8192  # serve_speed_gpu

Per (N, d), in one run on the same synthetic clustered data (private rows and queries drawn around the
same class centres, so each query has ~200 candidates at τ = 0.54 for N = 50,000):

- ``matmul``: the bare fp32 products of every query with every private row (torch, batches of
  ``--batch-size`` queries against the whole private matrix in memory), nothing else;
- ``candidates``: ``engine.find_candidates`` over the same batches (fp32 screen, exact float64 κ ≥ τ),
  rows in the store's chunk size;
- ``faiss``: FAISS ``IndexFlatIP.range_search`` with radius τ on the same batches (when faiss is installed);
- ``serve``: a whole ``indknn serve-queries`` process (imports, store read, candidates, filter, ledger
  commits; reuse off, fixed seed) on the stored batch, its CPU seconds from the children's rusage.

On a CPU with bf16 instructions (bf16_screen; unless ``INDKNN_SCREEN`` is set) the same run also prints
``fp32_screen`` (the candidate phase and a second serve process with ``INDKNN_SCREEN=fp32``, the ledger and
the store's ledger mark restored between the serves, and whether their answers are identical),
``bf16_matmul`` (the same products in bf16, in the screen's tiles) and ``screens`` (which screen each phase
takes by bf16_screen.rule).

Ratios are of CPU seconds (user + system, all threads), which a loaded machine disturbs less than wall
time; the wall-time ratios are printed next to them. One dict (JSON line) per configuration: :func:`run_grid`.

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

import contextlib
import logging
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from indknn_cli import bf16_screen
from indknn_cli.candidates import import_faiss
from indknn_cli.engine import ArraySource, _import_torch, find_candidates
from indknn_cli.serving import build_index, make_params
from indknn_cli.store import ExtractorInfo, FeatureStore

log = logging.getLogger(__name__)
CLASSES = 10


def class_centres(d: int, classes: int = CLASSES, seed: int = 0) -> np.ndarray:
    centres = np.random.default_rng(seed).standard_normal((classes, d)).astype(np.float32)
    return centres / np.linalg.norm(centres, axis=1, keepdims=True)


def clustered(n, centres, rng, spread=1.0):
    """Unit vectors around the given centres (shared by private rows and queries); labels = centre."""
    d = centres.shape[1]
    y = rng.integers(0, centres.shape[0], n)
    x = centres[y] + spread * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, y.astype(np.int32)


class _Clock:
    """Wall and CPU seconds (this process, all threads) of a block."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_matmul(x, q, batch):
    torch = _import_torch()
    xt = torch.from_numpy(x)
    (torch.from_numpy(q[:batch]) @ xt.T)  # warm-up (thread pool, allocator)
    with _Clock() as c:
        for lo in range(0, q.shape[0], batch):
            s = torch.from_numpy(q[lo:lo + batch]) @ xt.T
            del s
    return c


def time_matmul_bf16(x, q, batch):
    """The same products with both operands rounded to bf16, in the bf16 screen's tiles (rows × queries of
    ``bf16_screen.TILE_BYTES``): the floor of that screen's product."""
    torch = _import_torch()
    xt = torch.from_numpy(x).to(torch.bfloat16)
    rows = max(16, bf16_screen.TILE_BYTES // (2 * batch))
    torch.mm(xt[:rows], torch.from_numpy(q[:batch]).to(torch.bfloat16).T)  # warm-up
    with _Clock() as c:
        for lo in range(0, q.shape[0], batch):
            qb = torch.from_numpy(q[lo:lo + batch]).to(torch.bfloat16).T
            for a in range(0, xt.shape[0], rows):
                s = torch.mm(xt[a:a + rows], qb)
                del s
    return c


@contextlib.contextmanager
def _screen(mode: str | None):
    """``INDKNN_SCREEN`` set to ``mode`` (None: as the caller has it) for the block."""
    old = os.environ.get("INDKNN_SCREEN")
    if mode is not None:
        os.environ["INDKNN_SCREEN"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("INDKNN_SCREEN", None)
        else:
            os.environ["INDKNN_SCREEN"] = old


def time_candidates(x, q, batch, *, tau, chunk_rows, screen=None):
    pairs = 0
    mask = np.ones(x.shape[0], bool)
    src = ArraySource(x, rows=chunk_rows)
    with _screen(screen):
        find_candidates(q[:batch], ArraySource(x[:chunk_rows], rows=chunk_rows), kernel="cosine", tau=tau,
                        nu=None, device="cpu")  # warm-up: imports, the probe, numba's cached kernels
        with _Clock() as c:
            for lo in range(0, q.shape[0], batch):
                cands = find_candidates(q[lo:lo + batch], src, kernel="cosine", tau=tau, nu=None, device="cpu",
                                        row_mask=mask)
                pairs += sum(r.size for r in cands.rows)
    return c, pairs


def time_faiss(x, q, batch, *, tau):
    try:
        faiss = import_faiss()
    except ImportError:
        return None, None
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    pairs = 0
    with _Clock() as c:
        for lo in range(0, q.shape[0], batch):
            lims, _dist, _ids = index.range_search(q[lo:lo + batch], tau)
            pairs += int(lims[-1])
    return c, pairs


def time_serve_process(tmp: Path, *, batch_size, device, screen=None):
    """Wall and CPU seconds and the process's own peak RSS in MB (:mod:`.peak_rss`) of one serve-queries
    (``screen``: its ``INDKNN_SCREEN``; None: the caller's)."""
    from .peak_rss import indknn_command, read_peak_mb

    env = dict(os.environ, INDKNN_DEBUG="0")
    if screen is not None:
        env["INDKNN_SCREEN"] = screen
    cmd = indknn_command(["serve-queries", "bench", "--store", str(tmp / "s.zarr"), "--ledger", str(tmp / "L"),
                          "--seed", "1", "--no-reuse", "--batch-size", str(batch_size), "--device", device,
                          "--out", str(tmp / "answers.parquet"), "-q"], tmp / "serve.peak")
    c0, w0 = _children_cpu(), time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, cwd=tmp)  # "bench": the stored batch
    return time.perf_counter() - w0, _children_cpu() - c0, read_peak_mb(tmp / "serve.peak")


def make_store(tmp: Path, n, d, m, tau):
    """The synthetic store (private rows, queries as the stored batch ``bench``) and its ledger in ``tmp``:
    (store, private matrix, query matrix), the matrices as the store holds them (float32: the matmul, the
    candidate phase and FAISS are timed on the serve's own data type, not on the float64 generator output)."""
    centres = class_centres(d)
    store = FeatureStore.create(tmp / "s.zarr", extractor=ExtractorInfo("vectors", "synthetic", "1"), dim=d,
                                label_names=[str(i) for i in range(CLASSES)], label_names_source="declared")
    app = store.appender("private")
    parts = []
    for lo in range(0, n, 50000):
        x, y = clustered(min(50000, n - lo), centres, np.random.default_rng(lo + 1))
        app.write(x, labels=y, record_ids=[f"r{i}" for i in range(lo, lo + len(x))])
        parts.append(x)
    app.commit()
    q, _ = clustered(m, centres, np.random.default_rng(10**9))
    store.append("query", q, record_ids=[f"q{i}" for i in range(m)], batch="bench")
    params = make_params(epsilon=1.0, delta=1e-5, tau=tau, sigma2=0.6, planned_queries=m)
    build_index(store_path=tmp / "s.zarr", ledger_path=tmp / "L", params=params)
    return store, np.concatenate(parts).astype(np.float32), q.astype(np.float32)


def run(*, n: int, d: int, queries: int, tau: float, batch_size: int, device: str) -> dict:
    """One configuration in this process: the matmul, candidate and FAISS timings and a serve-queries process."""
    m = queries
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store, x, q = make_store(tmp, n, d, m, tau)
        mm = time_matmul(x, q, batch_size)
        cand, pairs = time_candidates(x, q, batch_size, tau=tau, chunk_rows=store.scan_rows)
        fa, faiss_pairs = time_faiss(x, q, batch_size, tau=tau)
        # On a CPU with bf16 instructions the screen may run in bf16 (bf16_screen): the fp32 screen and the
        # bf16 product are timed too, in the same run, and the serve again with the fp32 screen forced.
        has_bf16 = device == "cpu" and bf16_screen.cpu_has_bf16() and os.environ.get("INDKNN_SCREEN") is None
        screens = {  # which screen each phase takes (bf16_screen.rule; serve: the run's size, serving.py)
            "candidates": "bf16" if bf16_screen.rule(batch_size, torch_loaded=True) else "fp32",
            "serve": "bf16" if device == "cpu" and bf16_screen.run_rule(m, batch=batch_size)
                     and bf16_screen.rule(batch_size, torch_loaded=True) else "fp32"}
        if has_bf16:
            mm16 = time_matmul_bf16(x, q, batch_size)
            cand32, pairs32 = time_candidates(x, q, batch_size, tau=tau, chunk_rows=store.scan_rows, screen="fp32")
            assert pairs32 == pairs, (pairs32, pairs)
            _state(tmp, "save")
        serve_wall, serve_cpu, serve_peak = time_serve_process(tmp, batch_size=batch_size, device=device)
        import pyarrow.parquet as pq

        ks = pq.read_table(tmp / "answers.parquet", columns=["released_count"]).column(0).to_numpy()
        if has_bf16:
            first = (tmp / "answers.parquet").read_bytes()
            _state(tmp, "restore")
            s32_wall, s32_cpu, s32_peak = time_serve_process(tmp, batch_size=batch_size, device=device,
                                                             screen="fp32")
            same = _answers(tmp / "answers.parquet") == _answers_bytes(first)
    torch = _import_torch()
    out = {"n": n, "d": d, "queries": m, "tau": tau, "batch_size": batch_size, "device": device,
           "candidates_per_query": round(pairs / m, 1), "faiss_pairs_per_query": (
               round(faiss_pairs / m, 1) if faiss_pairs is not None else None),
           "mean_released_K": round(float(np.mean(ks)), 1),
           "serve_vs_matmul": round(serve_cpu / mm.cpu, 3),
           "candidates_vs_matmul": round(cand.cpu / mm.cpu, 3),
           "candidates_vs_faiss": round(cand.cpu / fa.cpu, 3) if fa is not None else None,
           "faiss_vs_matmul": round(fa.cpu / mm.cpu, 3) if fa is not None else None,
           "cpu_s": {"matmul": round(mm.cpu, 2), "candidates": round(cand.cpu, 2),
                     "faiss": round(fa.cpu, 2) if fa is not None else None, "serve_process": round(serve_cpu, 2)},
           "wall_s": {"matmul": round(mm.wall, 2), "candidates": round(cand.wall, 2),
                      "faiss": round(fa.wall, 2) if fa is not None else None, "serve_process": round(serve_wall, 2)},
           "serve_vs_matmul_wall": round(serve_wall / mm.wall, 3),
           "candidates_vs_faiss_wall": round(cand.wall / fa.wall, 3) if fa is not None else None,
           "serve_queries_per_s": round(m / serve_wall, 1),
           # the serve-queries process's own peak (VmHWM) and this bench process's (it holds the matrix,
           # FAISS's copy and a batch's dense products, none of which serving needs)
           "serve_peak_rss_mb": serve_peak,
           "bench_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "serve_vs_matmul_throughput_wall": round(mm.wall / serve_wall, 3), "screens": screens,
           "torch_threads": torch.get_num_threads(), "load_average": [round(v, 2) for v in os.getloadavg()]}
    if has_bf16:  # the same figures with the fp32 screen forced, and the bf16 product, from this run
        out["fp32_screen"] = {
            "serve_vs_matmul": round(s32_cpu / mm.cpu, 3), "serve_vs_matmul_wall": round(s32_wall / mm.wall, 3),
            "serve_vs_matmul_throughput_wall": round(mm.wall / s32_wall, 3),
            "candidates_vs_faiss": round(cand32.cpu / fa.cpu, 3) if fa is not None else None,
            "cpu_s": {"candidates": round(cand32.cpu, 2), "serve_process": round(s32_cpu, 2)},
            "wall_s": {"candidates": round(cand32.wall, 2), "serve_process": round(s32_wall, 2)},
            "serve_peak_rss_mb": s32_peak, "answers_identical": same}
        out["bf16_matmul"] = {"cpu_s": round(mm16.cpu, 2), "wall_s": round(mm16.wall, 2),
                              "serve_vs_bf16_matmul": round(serve_cpu / mm16.cpu, 3)}
    return out


def _state(tmp: Path, how: str) -> None:
    """Save (``how="save"``) or restore the ledger and the store's ledger mark, so that a second serve starts
    where the first did (the mark's rollback check would refuse the restored ledger otherwise)."""
    import shutil

    for live, saved in [(tmp / "L", tmp / "L.orig"), (tmp / "s.zarr" / "ledger-mark.json", tmp / "mark.orig")]:
        src, dst = (live, saved) if how == "save" else (saved, live)
        if dst.is_dir():
            shutil.rmtree(dst)
        else:
            dst.unlink(missing_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        elif src.exists():
            shutil.copy2(src, dst)
    if how == "restore":
        (tmp / "answers.parquet").unlink(missing_ok=True)


def _answers_bytes(raw: bytes) -> list:
    import io

    import pyarrow.parquet as pq

    return pq.read_table(io.BytesIO(raw)).to_pylist()


def _answers(path: Path) -> list:
    return _answers_bytes(path.read_bytes())



def run_grid(*, sizes: Sequence[int], dims: Sequence[int], queries: int, tau: float, batch_size: int, device: str,
             scheduler: str | None = None, workers: Sequence[int] = (1, 2, 4)) -> Iterator[dict]:
    """One dict per N × d (``sizes`` × ``dims``): :func:`run`; with ``device`` cuda, the GPU's own figures
    (serve_speed_gpu); with a ``scheduler``, the in-process run and one per worker count (serve_dask)."""
    for d in dims:
        for n in sizes:
            log.info("N = %d, d = %d, %d queries", n, d, queries)
            if device == "cuda" and not scheduler:  # the GPU's own figures (serve_speed_gpu)
                from .serve_speed_gpu import run_gpu

                yield run_gpu(n, d, queries, tau, batch_size)
            elif scheduler:
                from .serve_dask import run_scheduled

                yield from run_scheduled(n, d, queries, tau, batch_size, device, scheduler, list(workers),
                                         make_store=make_store)
            else:
                yield run(n=n, d=d, queries=queries, tau=tau, batch_size=batch_size, device=device)
