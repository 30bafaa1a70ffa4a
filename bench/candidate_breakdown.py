"""Where the candidate phase's CPU seconds go, against FAISS ``range_search``, in one process (issue 21).

    OMP_NUM_THREADS=1 python bench/candidate_breakdown.py [--n 50000] [--d 768] [--queries 4096] [--rounds 4]

The data of ``indknn bench serve-speed`` (clustered unit vectors, τ = 0.54, ~229 candidates per query).
Rounds alternate two recompute paths on the same arrays: ``numpy`` (the per-row reduction on gathered float64
copies) and ``compiled`` (indknn_cli/exact_jit.py); each round times ``find_candidates`` over batches of 1,024
queries (CPU seconds, split into the FAISS screen, the compiled sums and the rest) and FAISS ``range_search``
of the same batches against a flat index of the rows. One JSON line per round, then the medians. One OpenMP
thread (``OMP_NUM_THREADS=1``) keeps CPU seconds steady; with two, a thread's spin and wake-ups swing them ±30%
on this machine. The two paths' candidates are compared bit for bit in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from indknn_cli import candidates, exact_jit
from indknn_cli.benchmarks.serve_speed import class_centres, clustered
from indknn_cli.candidates import ArraySource, find_candidates, import_faiss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50000)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--queries", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--tau", type=float, default=0.54)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    faiss = import_faiss()
    centres = class_centres(a.d)
    x = clustered(a.n, centres, np.random.default_rng(1))[0].astype(np.float32)
    q = clustered(a.queries, centres, np.random.default_rng(10**9))[0].astype(np.float32)
    src = ArraySource(x, rows=32768)
    index = faiss.IndexFlatIP(a.d)
    index.add(x)
    spent = {"screen": 0.0, "sums": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] += time.process_time() - t
        return wrapper

    screen, sums = timed("screen", candidates._screen_cpu), timed("sums", exact_jit.pair_sums)
    candidates._screen_cpu, exact_jit.pair_sums = screen, sums
    default_min = candidates.COMPILED_MIN_QUERIES
    candidates.COMPILED_COLD_QUERIES = 0  # any batch: the comparison is of the two paths
    rows = {"numpy": [], "compiled": []}
    last = {}
    for path in ["numpy", "compiled"] * (a.rounds + 1):  # the first pair warms up (compile, caches)
        candidates.COMPILED_MIN_QUERIES = default_min if path == "compiled" else 10**12
        spent["screen"] = spent["sums"] = 0.0
        t = time.process_time()
        got = [find_candidates(q[lo:lo + a.batch], src, kernel="cosine", tau=a.tau, nu=None, device="cpu")
               for lo in range(0, a.queries, a.batch)]
        cand = time.process_time() - t
        t = time.process_time()
        for lo in range(0, a.queries, a.batch):
            index.range_search(q[lo:lo + a.batch], a.tau)
        fa = time.process_time() - t
        flat = [(r.tolist(), k.tolist()) for c in got for r, k in zip(c.rows, c.kappa)]
        last[path] = flat
        if len(last) == 2:
            assert last["numpy"] == last["compiled"], "the two recompute paths disagree"
        row = {"path": path, "candidates_cpu_s": round(cand, 3), "screen_cpu_s": round(spent["screen"], 3),
               "compiled_sums_cpu_s": round(spent["sums"], 3),
               "rest_cpu_s": round(cand - spent["screen"] - spent["sums"], 3), "faiss_cpu_s": round(fa, 3),
               "candidates_vs_faiss": round(cand / fa, 3), "load_average": list(os.getloadavg())}
        rows[path].append(row)
        print(json.dumps(row), flush=True)
    summary = {"n": a.n, "d": a.d, "queries": a.queries, "batch": a.batch, "rounds": a.rounds,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "candidate_pairs": sum(len(r) for r, _ in last["compiled"])}
    for path, rs in rows.items():
        rs = rs[1:]  # drop the warm-up round
        summary[f"{path}_candidates_vs_faiss_median"] = statistics.median(r["candidates_vs_faiss"] for r in rs)
        summary[f"{path}_recompute_cpu_s_median"] = statistics.median(
            r["candidates_cpu_s"] - r["screen_cpu_s"] for r in rs)
    summary["recompute_numpy_vs_compiled"] = round(summary["numpy_recompute_cpu_s_median"]
                                                   / summary["compiled_recompute_cpu_s_median"], 2)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
