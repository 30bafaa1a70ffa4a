"""Candidate indexes (issue 5): queries/s, candidate recall against exact search, Ind-KNN accuracy.

    indknn bench index-speed                      # synthetic N = 100k and 1M (d = 384) + AG News
    indknn bench index-speed --n 100000 --no-ag   # quicker
    indknn bench index-speed --out index_speed.json

For each data set, every kind goes through the library as `index` and
`serve-queries` use it: a real Zarr store, `build_index` / `indexes.build`
(timed), `indexes.open_finder` (timed), then the finder on batches of queries.

* exact = ``engine.find_candidates`` over the private features in memory
  (the flat scan of `serve-queries` when the store fits its cache);
* lsh = L=30 tables × b=9 bits (paper, AG News); ``auto`` picks the cheaper
  of its two identical strategies per batch; the one-query-at-a-time latency
  (the paper's setting, supplementary Table 3) is reported for exact and lsh;
* ivf = centroids trained on the store's public rows (synthetic) or query
  rows (AG News), swept over nprobe; ``*`` marks the nprobe `index` picks by
  itself (smallest with recall ≥ 0.95 measured on the public vectors only),
  the one whose accuracy is reported.

Candidate recall = Σ_t |C_t ∩ E_t| / Σ_t |E_t| against exact search E (the
kernel values of found candidates are the exact ones by construction).
Accuracy = mean over 3 seeded runs of Ind-KNN (SPEC §2, reuse off, the same
engine filter) on the same queries, at ε ∈ {0.5, 1, 2} (gdp conversion,
δ = 1e-5, σ1 from T = #queries). Seeds are fixed: an experiment, not a release.

Synthetic data: 10 classes; each class has sub-clusters (one per ~200 records)
around its centre; a record = sub-centre + noise (cos ≈ 0.74 within a
sub-cluster, ≈ 0.37 across sub-clusters of a class, ≈ 0 across classes);
20% of private labels flipped at random; query labels are the clean classes.
Public vectors (for IVF) are fresh draws from the same sub-clusters.

Reports a line per measurement and a table per data set through ``progress`` and returns one dict (all
figures).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..output_files import check_output_file, write_text_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from indknn_cli import indexes  # noqa: E402
from indknn_cli.engine import (ArraySource, BudgetView, Candidates, answer_batch,  # noqa: E402
                               find_candidates)
from indknn_cli.serving import build_index, make_params  # noqa: E402
from indknn_cli.store import ExtractorInfo, FeatureStore, chunk_rows_for, scan_rows_for  # noqa: E402

EPSILONS = (0.5, 1.0, 2.0)
RUN_KEYS = (101, 202, 303)


log = logging.getLogger(__name__)


# -- data -----------------------------------------------------------------------------------
class Synthetic:
    def __init__(self, n: int, d: int, *, classes: int = 10, per_sub: int = 200, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.d, self.classes = d, classes
        self.subs = max(classes, n // per_sub)
        centres = _unit(rng.standard_normal((classes, d)))
        self.sub_class = np.arange(self.subs) % classes
        self.sub_centres = _unit(centres[self.sub_class] + 1.0 * rng.standard_normal((self.subs, d)) / np.sqrt(d))

    def draw(self, m: int, seed: int, flip: float = 0.0):
        rng = np.random.default_rng(seed)
        x = np.empty((m, self.d), np.float32)
        sub = rng.integers(0, self.subs, m)
        for lo in range(0, m, 65536):
            hi = min(m, lo + 65536)
            noise = rng.standard_normal((hi - lo, self.d), dtype=np.float32) * np.float32(0.6 / np.sqrt(self.d))
            x[lo:hi] = _unit(self.sub_centres[sub[lo:hi]] + noise)
        y = self.sub_class[sub].astype(np.int32)
        if flip:
            f = rng.random(m) < flip
            y[f] = rng.integers(0, self.classes, int(f.sum()))
        return x, y


def _unit(x):
    x = np.asarray(x, np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def make_store(path, x, y, q, qy, public, label_names):
    store = FeatureStore.create(path, extractor=ExtractorInfo("vectors", "bench", "1"), dim=x.shape[1],
                                label_names=label_names, label_names_source="declared")
    app = store.appender("private")
    for lo in range(0, len(x), 131072):
        hi = min(len(x), lo + 131072)
        app.write(x[lo:hi], labels=y[lo:hi], record_ids=[f"r{i}" for i in range(lo, hi)])
    app.commit()
    store.append("query", q, labels=qy, record_ids=[f"q{i}" for i in range(len(q))], batch="bench")
    if public is not None:
        store.append("public", public, record_ids=[f"p{i}" for i in range(len(public))])
    return store


# -- measurements ------------------------------------------------------------------------------
def run_batches(fn, q, batch):
    rows, kappa = [], []
    t0 = time.perf_counter()
    for lo in range(0, len(q), batch):
        c = fn(q[lo:lo + batch])
        rows += c.rows; kappa += c.kappa
    return Candidates(rows, kappa), time.perf_counter() - t0


def recall(c: Candidates, exact: Candidates) -> float:
    found = sum(np.intersect1d(a, b, assume_unique=True).size for a, b in zip(c.rows, exact.rows))
    total = sum(b.size for b in exact.rows)
    return found / total if total else 1.0


def accuracy(cands: Candidates, q, qy, y, n_classes, *, tau, sigma2) -> dict:
    n = len(y)
    out = {}
    for eps in EPSILONS:
        p = make_params(epsilon=eps, delta=1e-5, tau=tau, sigma2=sigma2, planned_queries=len(q))
        accs = []
        for key in RUN_KEYS:
            b = BudgetView(spent=np.zeros(n), budget=np.full(n, p.budget), deleted=np.zeros(n, bool),
                           times_selected=np.zeros(n, np.int64))
            ans = answer_batch(q, source=None, row_to_ledger=np.arange(n), row_labels=y.astype(np.int64), params=p,
                               n_classes=n_classes, budgets=b, run_key=key, first_index=0, reuse=None, device="cpu",
                               candidate_finder=lambda qq, row_mask=None: cands)
            accs.append(float(np.mean(np.array([a.label for a in ans]) == qy)))
        out[str(eps)] = round(float(np.mean(accs)), 4)
    return out


def bench_dataset(name, x, y, q, qy, public, *, n_classes, tau, sigma2, batch, nlist, nprobes, latency_queries,
                  tmp: Path, bits_sweep=(), progress: Callable[[str], None] = log.info) -> dict:
    res = {"dataset": name, "n": int(len(x)), "d": int(x.shape[1]), "queries": int(len(q)), "tau": tau,
           "sigma2": sigma2, "batch": batch, "kinds": {}}
    t0 = time.perf_counter()
    store = make_store(tmp / f"{name}.zarr", x, y, q, qy, public, [str(i) for i in range(n_classes)])
    res["store_write_s"] = round(time.perf_counter() - t0, 2)
    res["matmul_floor_q_per_s"] = round(matmul_floor(x, batch), 1)
    top = int(np.bincount(np.asarray(y), minlength=n_classes).argmax())  # the floor every accuracy should beat
    res["majority_class"] = {"method": "majority class (constant)", "label": top,
                             "accuracy": round(float((np.asarray(qy) == top).mean()), 4)}
    p = make_params(epsilon=1.0, delta=1e-5, tau=tau, sigma2=sigma2, planned_queries=len(q))
    t0 = time.perf_counter()
    build_index(store_path=store.path, ledger_path=tmp / f"{name}-ledger", params=p, kind="flat")
    res["ledger_build_s"] = round(time.perf_counter() - t0, 2)

    # exact
    d = x.shape[1]
    src = ArraySource(x, rows=scan_rows_for(d, chunk_rows_for(d)))  # the store's scan step, as serve-queries reads it
    exact_fn = lambda qq: find_candidates(qq, src, kernel="cosine", tau=tau, nu=None, device="cpu")  # noqa: E731
    exact_fn(q[:8])  # warm-up
    exact, dt = run_batches(exact_fn, q, batch)
    k_exact = float(np.mean([r.size for r in exact.rows]))
    lat = _latency(exact_fn, q, latency_queries)
    progress(f"[{name}] exact: {len(q) / dt:.1f} q/s, mean |C| = {k_exact:.1f}, "
             f"one-at-a-time {lat * 1e3:.1f} ms/query")
    res["kinds"]["exact"] = {"build_s": res["ledger_build_s"], "queries_per_s": round(len(q) / dt, 1),
                             "recall": 1.0, "mean_candidates": round(k_exact, 1),
                             "latency_ms_one_query": round(lat * 1e3, 2),
                             "accuracy": accuracy(exact, q, qy, y, n_classes, tau=tau, sigma2=sigma2)}

    # lsh
    t0 = time.perf_counter()
    info = indexes.build(store, kind="lsh", tables=30, bits=9, seed=2024)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    finder = indexes.open_finder(store, kernel="cosine", tau=tau, nu=None)
    load_s = time.perf_counter() - t0
    finder(q[:8])
    lsh, dt = run_batches(finder, q, batch)
    strat = finder.last.get("strategy")
    entry = {"build_s": round(build_s, 2), "encode_s": info.get("encode_seconds"), "load_s": round(load_s, 2),
             "queries_per_s": round(len(q) / dt, 1), "strategy_at_batch": strat, "recall": round(recall(lsh, exact), 4),
             "mean_candidates": round(float(np.mean([r.size for r in lsh.rows])), 1)}
    for s in ("scan", "buckets"):
        finder.strategy = s
        sub = q[:min(len(q), batch)]
        _, dts = run_batches(finder, sub, batch)
        entry[f"queries_per_s_{s}"] = round(len(sub) / dts, 1)
    finder.strategy = "buckets"
    entry["latency_ms_one_query"] = round(_latency(finder, q, latency_queries) * 1e3, 2)
    entry["speedup_one_query_vs_exact"] = round(lat * 1e3 / entry["latency_ms_one_query"], 2)
    entry["accuracy"] = accuracy(lsh, q, qy, y, n_classes, tau=tau, sigma2=sigma2)
    progress(f"[{name}] lsh L=30 b=9: build {build_s:.1f}s, {entry['queries_per_s']} q/s ({strat}), "
        f"recall {entry['recall']}, one-at-a-time {entry['latency_ms_one_query']} ms/query")
    res["kinds"]["lsh"] = entry
    del finder, lsh
    gc.collect()
    if bits_sweep:  # the trade-off of b at L = 30: fewer bits, bigger buckets, more candidates found
        entry["bits_sweep"] = []
        for b in bits_sweep:
            indexes.build(store, kind="lsh", tables=30, bits=b, seed=2024)
            f = indexes.open_finder(store, kernel="cosine", tau=tau, nu=None)
            c, dt = run_batches(f, q, batch)
            f.strategy = "buckets"
            lat_b = _latency(f, q, latency_queries)
            entry["bits_sweep"].append({"bits": b, "queries_per_s": round(len(q) / dt, 1),
                                        "recall": round(recall(c, exact), 4),
                                        "latency_ms_one_query": round(lat_b * 1e3, 2),
                                        "accuracy": accuracy(c, q, qy, y, n_classes, tau=tau, sigma2=sigma2)})
            progress(f"[{name}] lsh L=30 b={b}: recall {entry['bits_sweep'][-1]['recall']}, "
                f"acc {entry['bits_sweep'][-1]['accuracy']}")
            del f, c

    # ivf
    t0 = time.perf_counter()
    info = indexes.build(store, kind="ivf", nlist=nlist, seed=2024, params=p)  # nprobe calibrated on public data
    calibrated = info["nprobe"]
    nprobes = sorted(set(nprobes) | {calibrated})
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    finder = indexes.open_finder(store, kernel="cosine", tau=tau, nu=None)
    load_s = time.perf_counter() - t0
    sweep = []
    chosen = None
    for npb in nprobes:
        if npb > info["nlist"]:
            continue
        finder.nprobe = npb
        finder(q[:8])
        c, dt = run_batches(finder, q, batch)
        r = recall(c, exact)
        sweep.append({"nprobe": npb, "queries_per_s": round(len(q) / dt, 1), "recall": round(r, 4),
                      "mean_candidates": round(float(np.mean([x.size for x in c.rows])), 1)})
        progress(f"[{name}] ivf nlist={info['nlist']} nprobe={npb}: {len(q) / dt:.1f} q/s, recall {r:.4f}")
        if npb == calibrated:
            chosen = (npb, c)
    res["kinds"]["ivf"] = {"build_s": round(build_s, 2), "train_s": info.get("train_seconds"),
                           "encode_s": info.get("encode_seconds"), "load_s": round(load_s, 2),
                           "nlist": info["nlist"], "nprobe_calibrated": calibrated,
                           "nprobe_calibration": info.get("nprobe_calibration"),
                           "training_rows": info["centroid_source"]["rows"],
                           "training_source": info["centroid_source"]["from"], "sweep": sweep,
                           "nprobe_for_accuracy": chosen[0],
                           "accuracy": accuracy(chosen[1], q, qy, y, n_classes, tau=tau, sigma2=sigma2)}
    del finder
    gc.collect()
    shutil_rm(tmp / f"{name}.zarr")
    return res


def matmul_floor(x, m):
    """Queries/s of the bare fp32 product (m queries × N rows) on this machine now: the scan's ceiling."""
    q = x[:m].copy()
    block = x[:min(len(x), 65536)]
    q @ block.T
    t0 = time.perf_counter()
    for _ in range(2):
        q @ block.T
    per_row = (time.perf_counter() - t0) / 2 / block.shape[0]
    return m / (per_row * len(x))


def shutil_rm(path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _latency(fn, q, m):
    fn(q[:1])
    t0 = time.perf_counter()
    for i in range(m):
        fn(q[i:i + 1])
    return (time.perf_counter() - t0) / m


def table(res: dict) -> str:
    k = res["kinds"]
    lines = [f"{res['dataset']}: N={res['n']:,} d={res['d']} queries={res['queries']} τ={res['tau']} "
             f"σ2={res['sigma2']} (accuracy at ε: gdp, δ=1e-5, per record, add/remove one record); "
             f"bare fp32 product {res['matmul_floor_q_per_s']} q/s",
             f"{'kind':<22}{'build s':>9}{'q/s':>10}{'recall':>8}{'mean|C|':>9}{'ms/q (1)':>10}"
             + "".join(f"{'acc ε=' + e:>11}" for e in map(str, EPSILONS))]

    def row(label, e, qps, rec, cands, lat, acc):
        return (f"{label:<22}{_f(e):>9}{_f(qps):>10}{_f(rec):>8}{_f(cands):>9}{_f(lat):>10}"
                + "".join(f"{_f(acc.get(str(x)) if acc else None):>11}" for x in EPSILONS))

    lines.append(row("exact (flat)", k["exact"]["build_s"], k["exact"]["queries_per_s"], 1.0,
                     k["exact"]["mean_candidates"], k["exact"]["latency_ms_one_query"], k["exact"]["accuracy"]))
    e = k["lsh"]
    lines.append(row(f"lsh L=30 b=9 ({e['strategy_at_batch']})", e["build_s"], e["queries_per_s"], e["recall"],
                     e["mean_candidates"], e["latency_ms_one_query"], e["accuracy"]))
    lines.append(row("  lsh scan / buckets", None, f"{e['queries_per_s_scan']}/{e['queries_per_s_buckets']}",
                     None, None, None, None))
    for b in e.get("bits_sweep", []):
        lines.append(row(f"lsh L=30 b={b['bits']}", None, b["queries_per_s"], b["recall"], None,
                         b["latency_ms_one_query"], b["accuracy"]))
    v = k["ivf"]
    for s in v["sweep"]:
        acc = v["accuracy"] if s["nprobe"] == v["nprobe_for_accuracy"] else None
        mark = "*" if s["nprobe"] == v["nprobe_calibrated"] else ""
        lines.append(row(f"ivf {v['nlist']}/{s['nprobe']}{mark}", v["build_s"] if s is v["sweep"][0] else None,
                         s["queries_per_s"], s["recall"], s["mean_candidates"], None, acc))
    maj = res.get("majority_class")
    if maj is not None:
        lines.append(row("majority class", None, None, None, None, None,
                         {str(x): maj["accuracy"] for x in EPSILONS}))
    return "\n".join(lines)


def _f(v):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


def run(*, sizes: Sequence[int], d: int, queries: int, batch_size: int, tau: float, ag: bool, ag_tau: float,
        latency_queries: int, out: Path | None = None, progress: Callable[[str], None] = log.info) -> dict:
    """Every index kind on synthetic data of each N in ``sizes`` (τ = ``tau``) and, with ``ag``, on AG News
    (τ = ``ag_tau``); ``progress(text)``: a line per measurement, a table per data set. ``out``: also write
    the JSON there (checked before the run)."""
    if out:  # before the run (review 48, F1)
        check_output_file(out, option="--out")
    import torch

    from ..candidates import import_faiss

    faiss = import_faiss()

    results = {"bench": "index_speed", "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                                                   "faiss": faiss.__version__, "numpy": np.__version__,
                                                   "python": platform.python_version()},
               "epsilons": list(EPSILONS), "conversion": "gdp", "delta": 1e-5, "unit": "record",
               "adjacency": "add/remove one record", "run_keys": list(RUN_KEYS), "datasets": []}
    with tempfile.TemporaryDirectory(prefix="indknn-index-bench-") as tmp:
        tmp = Path(tmp)
        for n in sizes:
            t0 = time.perf_counter()
            gen = Synthetic(n, d, seed=n)
            x, y = gen.draw(n, seed=1, flip=0.2)
            q, qy = gen.draw(queries, seed=2)
            nlist = 1024 if n >= 500_000 else 256
            public, _ = gen.draw(64 * nlist, seed=3)
            progress(f"[synthetic-{n}] data {time.perf_counter() - t0:.1f}s, {gen.subs} sub-clusters")
            r = bench_dataset(f"synthetic-{n}", x, y, q, qy, public, n_classes=10, tau=tau, sigma2=0.6,
                              batch=batch_size, nlist=nlist, nprobes=(1, 2, 4, 8, 16, 32), tmp=tmp,
                              latency_queries=latency_queries, progress=progress)
            r["synthetic"] = {"sub_clusters": gen.subs, "label_flip_private": 0.2, "public_rows": len(public)}
            results["datasets"].append(r)
            progress(table(r))
            del x, y, q, public
            gc.collect()
        if ag:
            from indknn_cli.benchmarks.data import load_dataset

            ds = load_dataset("ag_news")
            perm = np.random.default_rng(0).permutation(len(ds.x))
            xi, qi = perm[:6600], perm[6600:7600]
            r = bench_dataset("ag_news", ds.x[xi], ds.y[xi].astype(np.int32), ds.x[qi], ds.y[qi], None,
                              n_classes=4, tau=ag_tau, sigma2=0.6, batch=batch_size, nlist=None,
                              nprobes=(1, 2, 4, 8, 16), tmp=tmp, latency_queries=latency_queries, progress=progress,
                              bits_sweep=(4, 5, 6, 7))
            r["split"] = "seeded permutation (0): 6,600 private / 1,000 queries; IVF trained on the 1,000 query rows"
            results["datasets"].append(r)
            progress(table(r))
    if out:
        write_text_file(out, json.dumps(results, indent=1), option="--out")
    return results
