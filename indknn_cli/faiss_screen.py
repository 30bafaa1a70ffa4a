"""The CPU screen: FAISS loaded at the CPU's speed, and its range search cut across threads (issue 21).

``candidates.find_candidates`` screens a chunk of private rows against a batch's queries with
:func:`_screen_cpu`: FAISS ``range_search`` of the rows against a flat inner-product index of the queries
(:func:`_query_index`), any fp32 summation order being within the screening margin, every screened pair's κ
then recomputed exactly. Kept apart from the candidate phase's logic (one job: the fp32 screen on a CPU).
"""

from __future__ import annotations

import threading

import numpy as np

from .threads import ProcessPool, usable_cores


def _passive_openmp(module: str) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` before torch or faiss loads its OpenMP runtime, unless the caller set a
    policy: threads that spin after each matrix product would otherwise hold a core while the float64
    recompute and the filter run on one thread (CPU seconds, and other processes on a shared machine, pay
    for the spinning)."""
    import os
    import sys

    if module not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's Linux feature flags (empty when unknown: not Linux)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as fh:
            return next((set(line.split(":", 1)[1].split()) for line in fh if line.startswith("flags")), set())
    except OSError:
        return set()


def _openblas_coretype(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The OpenBLAS kernel family this CPU runs (``OPENBLAS_CORETYPE``), from its Linux feature flags: AVX-512
    (F, CD, BW, DQ, VL) → SkylakeX, AVX2 + FMA → Haswell; None when unknown (not Linux, other CPUs)."""
    flags = cpu_flags(cpuinfo)
    if not flags:
        return None
    if {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


_FAISS_LOCK = threading.Lock()


def import_faiss():
    """faiss, loaded so that its products run at the CPU's speed.

    The faiss-cpu wheel bundles OpenBLAS 0.3.15, which does not recognise recent CPUs and falls back to its
    SSE3 kernels ("Prescott"): on this project's Xeon (AVX-512) FAISS's range search took 4.3–5.7× the CPU
    seconds (50,000 rows against 2,048 queries, d = 768: ``python bench/faiss_openblas.py``; README, issue
    21). Unless the caller set ``OPENBLAS_CORETYPE``, it is set from the CPU's own feature flags
    (:func:`_openblas_coretype`, never a family the CPU lacks) while faiss loads its OpenBLAS, then removed
    again, so numpy's and scipy's own OpenBLAS and child processes are unaffected. The fp32 screen's values
    may change in their last bits, within the screening margin (:func:`screening_margin` bounds any fp32
    summation order), and every screened pair's κ is recomputed exactly, so no candidate or answer changes.
    Also ``OMP_WAIT_POLICY=PASSIVE`` (:func:`_passive_openmp`).
    """
    import os
    import sys

    with _FAISS_LOCK:  # one thread loads faiss; the variable is set and removed by that thread alone
        core = None
        if "faiss" not in sys.modules:
            _passive_openmp("faiss")
            core = None if "OPENBLAS_CORETYPE" in os.environ else _openblas_coretype()
        if core:
            os.environ["OPENBLAS_CORETYPE"] = core
        try:
            import faiss
        finally:
            if core:
                os.environ.pop("OPENBLAS_CORETYPE", None)
    return faiss


def _query_index(queries: np.ndarray):
    """A FAISS flat inner-product index of a batch's queries (built once per batch, searched per chunk)."""
    faiss = import_faiss()
    index = faiss.IndexFlatIP(queries.shape[1])
    index.add(queries)
    return index


#: Row × query products per FAISS call below which a chunk is screened in one call (a thread's hand-off costs
#: more than it saves): 4,194,304, e.g. 4,096 rows against 1,024 queries or 256 rows against 16,384.
SCREEN_SPLIT_MIN_PRODUCTS = 1 << 22


def _screen_threads() -> int:
    """FAISS calls run at once on a chunk: the cores this process may use (at most 8; ``OMP_NUM_THREADS``,
    when set to a number, caps it, as it caps FAISS's own threads)."""
    import os

    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    cap = int(raw) if raw.isdigit() and int(raw) >= 1 else 8
    return usable_cores(cap=min(cap, 8))


def _one_omp_thread() -> None:
    import_faiss().omp_set_num_threads(1)  # this worker's own OpenMP setting (per thread), not the caller's


_screen_pool = ProcessPool("indknn-screen", initializer=_one_omp_thread)


def _screen_executor(workers: int):
    """The process's pool of screening threads (made with ``workers`` threads on first use), each running
    FAISS on one OpenMP thread."""
    return _screen_pool.get(workers)[0]


def _screen_cpu(query_index, block: np.ndarray, screen: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_screen_one` cut by rows across :func:`_screen_threads` threads, one OpenMP thread each.

    FAISS's range search multiplies on all its OpenMP threads but tests the scores against the radius on one,
    so with two cores one idles through every test: at N = 1M, d = 384, 2,048 queries one call per chunk took
    9.3–10.4 s wall (15.9–18.9 CPU s), two threads of one OpenMP thread each on the two halves of each chunk
    7.8–7.9 s (14.4–14.7 CPU s) (README, issue 21). The pieces' pairs are concatenated in row order: the
    same pairs, in the same order, as one call."""
    threads = _screen_threads()
    k = min(threads, block.shape[0] * int(query_index.ntotal) // SCREEN_SPLIT_MIN_PRODUCTS, block.shape[0])
    if k <= 1:
        return _screen_one(query_index, block, screen)
    cuts = np.linspace(0, block.shape[0], k + 1).astype(np.int64).tolist()
    pool = _screen_executor(threads)
    futures = [pool.submit(_screen_one, query_index, block[a:b], screen) for a, b in zip(cuts[:-1], cuts[1:])]
    parts = [f.result() for f in futures]
    return (np.concatenate([qi for qi, _ in parts]),
            np.concatenate([ri + a for (_, ri), a in zip(parts, cuts[:-1])]))


def _screen_one(query_index, block: np.ndarray, screen: float) -> tuple[np.ndarray, np.ndarray]:
    """(query, row) pairs of one chunk whose fp32 dot product exceeds ``screen``, on the CPU, in row order.

    FAISS ``range_search`` of the chunk's rows against the flat inner-product index of the batch's
    queries: its blocked product and the threshold test run in one pass, with no score matrix kept, and a
    CPU serve never imports torch. Searching the rows against the queries (not the queries against an index
    of each chunk) costs fewer CPU seconds here (larger products per block; no copy of the chunk into an
    index per batch) and gives the pairs grouped by row, the order the exact recompute reads them in. Any fp32 summation order is within
    the screening margin, and every screened pair's κ is then recomputed exactly, so the candidates do not
    depend on this choice.
    """
    lims, _scores, ids = query_index.range_search(np.ascontiguousarray(block, dtype=np.float32), float(screen))
    ri = np.repeat(np.arange(block.shape[0], dtype=np.int64), np.diff(lims).astype(np.int64))
    return ids.astype(np.int64, copy=False), ri
