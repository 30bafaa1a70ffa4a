"""Object storage and `embed --scheduler` timings (issue 19); not an `indknn bench` command (no such one exists).

    PYTHONPATH=. python bench/object_store_speed.py [--rows 20000] [--text-rows 2000] [--out docs/img/object_store_speed.png]

Part 1, the workflow on a local folder and on S3 (moto's server on 127.0.0.1, started here; a real bucket
adds network latency on top): embed ROWS precomputed vectors (d=384), index (flat), serve 100 queries,
delete 10 records (physical erasure), compact. Part 2, `embed` of TEXT_ROWS texts of sample_data with the
text model: in process, and on a Dask LocalCluster of 1 and 2 worker processes (the workers' model loaded
by a warm-up embed first, not timed). Prints one JSON line per timing on stdout and draws the figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from indknn_cli.deletion import delete_records  # noqa: E402
from indknn_cli.embedding import embed_into_store  # noqa: E402
from indknn_cli.serving import build_index, make_params, serve_queries  # noqa: E402

PARAMS = dict(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=1000)


def _timed(out: list, what: str, where: str, fn) -> None:
    t = time.perf_counter()
    fn()
    row = {"what": what, "where": where, "seconds": round(time.perf_counter() - t, 3)}
    out.append(row)
    print(json.dumps(row), flush=True)


AG_NEWS = ["Business", "Sci/Tech", "Sports", "World"]  # the sample's classes, declared (never read from the rows)


def workflow(store: str, tmp: Path, where: str, out: list) -> None:
    lp = tmp / f"ledger-{where}"
    _timed(out, "embed", where, lambda: embed_into_store(tmp / "priv.npz", store_path=store, extractor="vectors",
                                                                 label_names=["0", "1", "2", "3"]))
    _timed(out, "index", where, lambda: build_index(store_path=store, ledger_path=lp, params=make_params(**PARAMS)))
    _timed(out, "serve 100", where, lambda: (
        embed_into_store(tmp / "q.npz", store_path=store, role="query", batch="q"),
        serve_queries(store_path=store, ledger_path=lp, query_batch="q", seed=1)))
    _timed(out, "delete 10", where, lambda: delete_records(store_path=store, ledger_path=lp,
                                                            record_ids=[f"r{i:06d}" for i in range(0, 1000, 100)]))
    _timed(out, "compact", where, lambda: delete_records(store_path=store, ledger_path=lp, compact=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--text-rows", type=int, default=2000)
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "object_store_speed.png"))
    ap.add_argument("--parts", default="workflow,text", help="workflow, text, or both (comma list)")
    ap.add_argument("--merge", help="a JSON lines file of an earlier run: its rows of the parts not run here are "
                    "drawn too")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    from s3_server import moto_server, new_bucket

    tmp = Path(tempfile.mkdtemp(prefix="indknn-os-bench-"))
    os.environ["INDKNN_STATE_DIR"] = str(tmp / "state")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, 384)).astype(np.float32)
    np.savez(tmp / "priv.npz", x=x, y=rng.integers(0, 4, args.rows), ids=np.array([f"r{i:06d}" for i in range(args.rows)]))
    np.savez(tmp / "q.npz", x=rng.standard_normal((100, 384)).astype(np.float32))
    out: list = []
    if args.merge:
        kept = {"workflow": lambda r: r["what"] != "embed text", "text": lambda r: r["what"] == "embed text"}
        with open(args.merge) as f:
            old = [json.loads(line) for line in f if '"what"' in line]
        out += [r for r in old if any(kept[p](r) for p in kept if p not in parts)]
    if "workflow" in parts:
        workflow(str(tmp / "local.zarr"), tmp, "local folder", out)
        with moto_server() as endpoint:
            workflow(f"s3://{new_bucket(endpoint)}/store", tmp, "s3 (moto, 127.0.0.1)", out)
    if "text" in parts:
        text(args, tmp, out)
    uptime = os.popen("uptime").read().strip()
    print(json.dumps({"uptime": uptime}), flush=True)
    draw(out, args.out, note="uptime at the end: " + uptime)


def text(args, tmp: Path, out: list) -> None:

    with open(ROOT / "sample_data" / "ag_news_private.csv") as f:
        rows = list(csv.DictReader(f))[:args.text_rows]
    with open(tmp / "t.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(tmp / "warm.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows[:20])
    _timed(out, "embed text", "in process", lambda: embed_into_store(tmp / "t.csv", store_path=tmp / "t0.zarr",
                                                                      extractor="text", label_names=AG_NEWS))
    from distributed import LocalCluster

    for n in (1, 2):
        with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0",
                          silence_logs=50) as c:
            embed_into_store(tmp / "warm.csv", store_path=tmp / f"w{n}.zarr", extractor="text",
                             batch_rows=10, scheduler=c.scheduler_address, label_names=AG_NEWS)  # loads the model on every worker
            _timed(out, "embed text", f"{n} Dask worker{'s' if n > 1 else ''}", lambda: embed_into_store(
                tmp / "t.csv", store_path=tmp / f"t{n}.zarr", extractor="text", scheduler=c.scheduler_address,
                label_names=AG_NEWS))


def draw(out: list, path: str, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = list(dict.fromkeys(r["what"] for r in out if r["what"] != "embed text"))
    wheres = list(dict.fromkeys(r["where"] for r in out if r["what"] != "embed text"))
    for i, where in enumerate(wheres):
        vals = [next(r["seconds"] for r in out if r["what"] == s and r["where"] == where) for s in steps]
        a.bar(np.arange(len(steps)) + 0.4 * i, vals, 0.4, label=where)
    a.set_xticks(np.arange(len(steps)) + 0.2, steps)
    a.set_ylabel("seconds")
    a.set_title("workflow: local folder vs S3")
    a.legend()
    text = [r for r in out if r["what"] == "embed text"]
    b.bar([r["where"] for r in text], [r["seconds"] for r in text], color="tab:green")
    b.set_ylabel("seconds")
    b.set_title("embed (text model): in process vs Dask workers")
    if note:
        fig.suptitle(note, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
