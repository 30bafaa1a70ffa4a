"""A query file served in one run: peak RSS, and queries/s against the same queries already stored (issue 21).

    indknn bench stream --queries 200000              # a few minutes on 2 cores
    indknn bench stream                               # the issue's 2,000,000 queries (about 20 min per run here)

Builds a synthetic clustered store of N private vectors and its ledger, writes the
queries to one ``.npy`` (or Parquet, ``--format parquet``) file, copies the store
and ledger, then times two whole `indknn` processes on the two copies:

(a) streamed: ``serve-queries q.npy --out a.parquet`` (the file embedded into the
    store, then answered, in one run);
(b) stored: ``embed q.npy --role query`` first (not timed with the serve), then
    ``serve-queries <batch> --out b.parquet``.

Returns one dict: each process's own peak RSS (its VmHWM, written by the process
at exit: :mod:`.peak_rss`; ``ru_maxrss`` would include this bench's own high-water
mark), wall and CPU seconds, queries/s, the ratio streamed / stored (target
≤ 1.3; peak RSS target ≤ 2 GB), whether the two answer files and ledgers are
identical, and the load average. Fixed seed (``--seed 1``): for measurement only.
Reuse is off unless ``--reuse``: with reuse every query is scored against every
answer released before it (quadratic in the run's queries; see README).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
BLOCK = 1 << 16
FORMATS = ("npy", "parquet")


def _write_queries(path: Path, m: int, d: int, fmt: str) -> None:
    """``m`` clustered unit vectors (the store's centres), written block by block (never all in memory)."""
    from .year import clustered

    rng = np.random.default_rng(1)
    if fmt == "npy":
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(m, d))
        for lo in range(0, m, BLOCK):
            out[lo:lo + BLOCK] = clustered(min(BLOCK, m - lo), d, 10, rng)[0]
        out.flush()
        del out
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, pa.schema([("vector", pa.list_(pa.float32()))])) as w:
        for lo in range(0, m, BLOCK):
            x = clustered(min(BLOCK, m - lo), d, 10, rng)[0]
            flat = pa.array(x.ravel(), pa.float32())
            offsets = pa.array(np.arange(0, x.size + 1, d, dtype=np.int32))
            w.write_table(pa.table({"vector": pa.ListArray.from_arrays(offsets, flat)}))


def _child(args: list[str], *, stdout_path: Path | None = None) -> dict:
    """Run ``indknn ARGS``; its wall seconds, CPU seconds (this child's own ``wait4`` rusage) and peak RSS (its
    own VmHWM: :mod:`.peak_rss`). stdout goes to ``stdout_path`` (else nowhere), stderr is kept for an error
    message."""
    from .peak_rss import indknn_command, read_peak_mb

    peak = Path(tempfile.mkdtemp()) / "peak"
    cmd = indknn_command(args, peak)
    t0 = time.perf_counter()
    with open(stdout_path or os.devnull, "wb") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE)
        err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])}: exit {p.returncode}: {err.decode(errors='replace')[-2000:]}")
    out = {"wall_s": round(wall, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "peak_rss_mb": read_peak_mb(peak)}
    shutil.rmtree(peak.parent, ignore_errors=True)
    return out


def _ledger_digest(lp: Path) -> dict:
    from indknn_cli.ledger import BudgetLedger

    led = BudgetLedger.open(lp)
    s = led.state
    return {"spent": s.spent.tobytes(), "times_selected": s.times_selected.tobytes(), "answers": s.answers_table(),
            "batches": list(s.batches)}


def run(*, queries: int, n: int, d: int, tau: float, reuse: bool, batch_size: int, fmt: str, device: str,
        keep: str | Path | None = None) -> dict:
    """``queries`` queries in one file (``fmt``: npy or parquet) served streamed and stored, each in its own
    `indknn` process (``keep``: build everything in this new folder and keep it)."""
    if fmt not in FORMATS:
        from ..errors import BadInputError

        raise BadInputError(f"--format must be npy or parquet, got {fmt!r}")
    m = queries
    from indknn_cli.answers_out import read_answers_parquet
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import ExtractorInfo, FeatureStore

    from .year import clustered, refuse_a_folder_in_use

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(keep) if keep else Path(tmp)
        refuse_a_folder_in_use(keep)
        a, b, built = root / "streamed", root / "stored", root / "built"
        built.mkdir(parents=True)
        store = FeatureStore.create(built / "s.zarr", extractor=ExtractorInfo("vectors", "synthetic", "1"), dim=d,
                                    label_names=[str(i) for i in range(10)], label_names_source="declared")
        x, y = clustered(n, d, 10, np.random.default_rng(0))
        store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(n)])
        build_index(store_path=built / "s.zarr", ledger_path=built / "L",
                    params=make_params(epsilon=100.0, delta=1e-5, tau=tau, sigma2=0.6, planned_queries=m))
        qfile = root / ("q.npy" if fmt == "npy" else "q.parquet")
        _write_queries(qfile, m, d, fmt)
        # the same starting store and ledger for both runs: two copies, and the pair they were copied from removed
        # (a copy is refused while its original is still where the ledger was made: store_twins)
        shutil.copytree(built, a)
        shutil.copytree(built, b)
        shutil.rmtree(built)
        opts = ["--seed", "1", "--device", device, "--batch-size", str(batch_size)] + ([] if reuse else ["--no-reuse"])
        load0 = os.getloadavg()
        log.info("serving %d queries streamed from %s", m, qfile.name)
        streamed = _child(["serve-queries", str(qfile), "--store", str(a / "s.zarr"), "--ledger", str(a / "L"),
                                 "--out", str(a / "out.parquet")] + opts)
        embed = _child(["embed", str(qfile), "--role", "query", "--store", str(b / "s.zarr")],
                       stdout_path=root / "embed.json")
        batch = json.loads((root / "embed.json").read_text().strip().splitlines()[-1])["batch_id"]
        log.info("serving the same %d queries stored (batch %s)", m, batch)
        stored = _child(["serve-queries", batch, "--store", str(b / "s.zarr"), "--ledger", str(b / "L"),
                               "--out", str(b / "out.parquet")] + opts)
        load1 = os.getloadavg()
        ta, tb = read_answers_parquet(a / "out.parquet"), read_answers_parquet(b / "out.parquet")
        answers_identical = ta.num_rows == m and ta.equals(tb)
        del ta, tb
        la, lb = _ledger_digest(a / "L"), _ledger_digest(b / "L")
        ledgers_identical = all(la[k] == lb[k] if k != "answers" else la[k].equals(lb[k]) for k in la)
    for r in (streamed, stored):
        r["queries_per_s"] = round(m / r["wall_s"], 1)
    return {
        "queries": m, "n": n, "d": d, "tau": tau, "reuse": reuse, "batch_size": batch_size, "format": fmt,
        "device": device, "streamed": streamed, "stored": stored, "embed_before": embed,
        "streamed_vs_stored_wall": round(streamed["wall_s"] / stored["wall_s"], 3),
        "streamed_vs_stored_cpu": round(streamed["cpu_s"] / stored["cpu_s"], 3),
        "peak_rss_streamed_le_2gb": streamed["peak_rss_mb"] <= 2048,
        "answers_identical": bool(answers_identical), "ledgers_identical": bool(ledgers_identical),
        "loadavg_start": [round(v, 2) for v in load0], "loadavg_end": [round(v, 2) for v in load1],
    }

