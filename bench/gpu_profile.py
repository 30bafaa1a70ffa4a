"""Where a GPU serve's time goes (issue 21): per thread in one in-process serve, and one screen pass alone.

On a CUDA machine (about 2 minutes at the default size; P_N, P_M, P_B change the rows, queries, batch):

    PYTHONPATH=. python bench/gpu_profile.py

Prints, for an in-process `serving.serve_queries` of P_M stored queries against P_N clustered rows (d = 384,
τ = 0.59, reuse off, fused kernels where gpu_fused takes them): each wrapped step's calls per thread (the screen
pass, gpu_screen's blocks, the collect, the gather of ledger indices, the filter, the event's columns, the commit)
with their spans; then one pass of 16,384 queries screened alone with gpu_screen's steps synchronised one by one
(product, comparison, count, nonzero, recompute, collect), the bare fp16 product of that pass, and the fused
kernels' pass (screen, leaf sums, collect), whose candidates must equal the steps' (`same_as_old`).
"""
import json, os, sys, tempfile, threading, time
from pathlib import Path
import numpy as np
sys.path.insert(0, os.getcwd())
import torch
from indknn_cli.benchmarks.serve_speed import make_store
from indknn_cli import serving, gpu_screen, serve_pipeline, candidates
from indknn_cli.ledger import BudgetLedger

N = int(os.environ.get("P_N", 1_000_000)); D = 384; M = int(os.environ.get("P_M", 65536)); B = int(os.environ.get("P_B", 8192))
DEV = os.environ.get("P_DEV", "cuda")
EV = []
def wrap(obj, name, label):
    f = getattr(obj, name)
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            EV.append((label, threading.current_thread().name, t0, time.perf_counter()))
    setattr(obj, name, w)

wrap(serve_pipeline.PassScreen, "_find", "find_pass")
wrap(gpu_screen.GpuScreen, "block", "block")
wrap(gpu_screen.GpuScreen, "collect", "collect")
wrap(candidates.CsrCandidates, "gather", "gather")
wrap(serving, "answer_batch", "answer_batch")
wrap(serving, "event_columns", "event_columns")
wrap(BudgetLedger, "commit_event", "commit_event")

tmp = Path(tempfile.mkdtemp())
t0 = time.perf_counter()
store, x, q = make_store(tmp, N, D, M, 0.59)
print("setup_s", round(time.perf_counter() - t0, 1), flush=True)
T0 = time.perf_counter()
res = serving.serve_queries(store_path=tmp / "s.zarr", ledger_path=tmp / "L", query_batch="bench", seed=1,
                            batch_size=B, device=DEV, reuse=False, keep_answers=False)
T1 = time.perf_counter()
print("serve_in_process_s", round(T1 - T0, 3), "q/s", round(M / (T1 - T0)), flush=True)
agg = {}
for lab, th, a, b in EV:
    agg.setdefault((lab, th), []).append(b - a)
for (lab, th), v in sorted(agg.items()):
    print(f"{lab:14s} {th:28s} n={len(v):4d} total={sum(v):7.3f} mean={np.mean(v)*1e3:8.2f}ms max={max(v)*1e3:8.2f}ms "
          f"list={[round(t*1e3) for t in v][:24]}")
# timeline of main-thread answer_batch ends (per-batch intervals)
ends = sorted(b for lab, th, a, b in EV if lab == "answer_batch")
print("answer_batch ends (s from start):", [round(e - T0, 3) for e in ends])
fe = sorted((a - T0, b - T0) for lab, th, a, b in EV if lab == "find_pass")
print("find_pass spans:", [(round(a, 3), round(b, 3)) for a, b in fe])
ce = sorted((a - T0, b - T0) for lab, th, a, b in EV if lab == "commit_event")
print("commit spans:", [(round(a, 3), round(b, 3)) for a, b in ce])

# One screen pass alone, synchronised phase timings
dev = torch.device(DEV)
xt = torch.from_numpy(x).to(dev)
del x
qm = min(16384, M)
gs = gpu_screen.GpuScreen(q[:qm], dev, kernel="cosine", tau=0.59, nu=None, threshold=0.59,
                          fp32_margin=candidates.screening_margin(D), row_mask=None, strictly_before=None)
step = gpu_screen.step_rows(qm, N, budget=gpu_screen.step_bytes(dev), per_pair=gpu_screen.STEP_PAIR_BYTES_COUNTED)
print("fp16", gs.fp16, "step_rows", step, "steps", -(-N // step), "recompute slice", gs.slice)
def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()
for rep in range(2):
    ph = {"mm": 0, "cmp": 0, "count": 0, "nonzero": 0, "recompute": 0, "pairs": 0}
    parts = ([], [], [])
    sync(); tp = time.perf_counter()
    for lo in range(0, N, step):
        xs = xt[lo:lo + step]
        t = time.perf_counter()
        with gpu_screen._exact_matmul(torch):
            s = torch.mm(gs.q_s, (xs.to(torch.float16) if gs.fp16 else xs).T)
        sync(); t2 = time.perf_counter(); ph["mm"] += t2 - t
        hit = s >= gs.level; del s
        sync(); t3 = time.perf_counter(); ph["cmp"] += t3 - t2
        c = int(hit.sum()); t4 = time.perf_counter(); ph["count"] += t4 - t3
        qi, ri = torch.nonzero(hit, as_tuple=True); del hit
        sync(); t5 = time.perf_counter(); ph["nonzero"] += t5 - t4
        ph["pairs"] += int(qi.shape[0])
        sums = gpu_screen.pair_sums(xs, ri, gs.q_t, qi, kernel="cosine", plan=gs.plan)
        ok = sums >= gs.tau
        parts[0].append(qi[ok]); parts[1].append(ri[ok] + lo); parts[2].append(sums[ok])
        sync(); ph["recompute"] += time.perf_counter() - t5
    t6 = time.perf_counter()
    out = gs.collect(*parts)
    t7 = time.perf_counter()
    ph = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ph.items()}
    print("isolated pass", rep, "of", qm, "queries:", ph, "collect", round(t7 - t6, 4), "total", round(t7 - tp, 4),
          "candidates", len(out[0]), flush=True)
# a fused-free bare mm reference
sync(); t = time.perf_counter()
for lo in range(0, N, step):
    with gpu_screen._exact_matmul(torch):
        s = torch.mm(gs.q_s, (xt[lo:lo + step].to(torch.float16) if gs.fp16 else xt[lo:lo+step]).T)
    del s
sync(); print("bare fp16 mm of the pass", round(time.perf_counter() - t, 4))

# The fused pass (gpu_fused), isolated
import traceback
from indknn_cli import gpu_fused
try:
    print("fused probe", gpu_fused._probe(dev, D), "usable", gpu_fused.usable(dev, D), flush=True)
except Exception:
    traceback.print_exc()
old_out = out
for rep in range(3):
    sync(); t = time.perf_counter()
    cap = 16_000_000
    oq = torch.empty(cap, dtype=torch.int32, device=dev); orr = torch.empty(cap, dtype=torch.int32, device=dev)
    cnt = torch.zeros(1, dtype=torch.int64, device=dev)
    for lo in range(0, N, 1 << 20):
        x16 = xt[lo:lo + (1 << 20)].to(torch.float16)
        gpu_fused._launch_screen(gs.q_s, x16, row0=lo, level=gpu_fused.fused_level(gs), mask=None, out_q=oq, out_r=orr, count=cnt, cap=cap)
    tot = int(cnt.item()); t1 = time.perf_counter()
    s = gpu_fused.leaf_pair_sums(xt, orr[:tot], gs.q_t, oq[:tot], kernel="cosine", plan=gs.plan)
    sync(); t2 = time.perf_counter()
    qi, rows, sums = gpu_fused.find_pass(gs, xt, max_pass=cap)
    sync(); t3 = time.perf_counter()
    o = gs.collect([qi], [rows], [sums])
    t4 = time.perf_counter()
    same = all(np.array_equal(a, b) for a, b in zip(o, old_out[:2])) and np.array_equal(o[2].view(np.int64), old_out[2].view(np.int64))
    print(f"fused rep {rep}: screen {t1-t:.4f} (pairs {tot}) leaf_sums {t2-t1:.4f} find_pass {t3-t2:.4f} collect {t4-t3:.4f} same_as_old {same}", flush=True)
