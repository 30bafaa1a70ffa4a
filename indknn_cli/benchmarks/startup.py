"""Fixed cost of a process (issue 21: lazy imports; cron serves small batches often).

    indknn bench startup --repeat 5

Runs each command ``--repeat`` times in a fresh interpreter (the same Python) and
returns the best wall time of each and their ratios:

- ``indknn --help`` against a bare ``python -c pass`` (target ≤ 0.3 s), and which
  heavy libraries `--help` imported (none of torch, zarr, scipy, pyarrow, numpy expected);
- a whole ``indknn serve-queries`` process answering ``--small-queries`` (100) stored
  queries from ``--small-n`` (10,000) private rows of d = ``--small-d`` (384; default
  device, reuse off, fixed seed), each run on a fresh copy of the same store and
  ledger, against a bare Python process that imports numpy and torch, loads the
  same private vectors and queries from ``.npy`` files and forms the same fp32
  product (target ≤ 3×).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)
HEAVY = ("torch", "zarr", "scipy", "pyarrow", "numpy", "pandas", "sklearn")

HELP_PROBE = (
    "import sys\nsys.argv = ['indknn', '--help']\nfrom indknn_cli.cli.app import app\n"
    "try:\n    app()\nexcept SystemExit:\n    pass\n"
    "print('HEAVY=' + ','.join(m for m in %r if m in sys.modules), file=sys.stderr)\n" % (HEAVY,)
)


BARE_PRODUCT = (
    "import sys\nimport numpy as np\nimport torch\n"
    "x = torch.from_numpy(np.load(sys.argv[1]))\nq = torch.from_numpy(np.load(sys.argv[2]))\n"
    "s = q @ x.T\nassert s.shape == (q.shape[0], x.shape[0])\n"
)


def _best(cmd: list[str], repeat: int, before=None) -> float:
    """Best wall seconds of ``repeat`` runs of ``cmd``; ``before()`` (untimed) runs ahead of each."""
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        t = time.perf_counter()
        out = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        best = min(best, time.perf_counter() - t)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[2:4])}: exit {out.returncode}: "
                               f"{out.stderr.decode(errors='replace')[-2000:]}")
    return best


def small_serve(*, n: int, d: int, m: int, repeat: int) -> dict:
    """A whole ``serve-queries`` process on ``m`` stored queries at N = ``n`` against the bare product process."""
    import numpy as np

    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import ExtractorInfo, FeatureStore

    from .year import clustered

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, work = root / "base", root / "work"
        base.mkdir()
        x, y = clustered(n, d, 10, np.random.default_rng(0))
        q, _ = clustered(m, d, 10, np.random.default_rng(1))
        np.save(root / "x.npy", x)
        np.save(root / "q.npy", q)
        store = FeatureStore.create(base / "s.zarr", extractor=ExtractorInfo("vectors", "synthetic", "1"), dim=d,
                                    label_names=[str(i) for i in range(10)], label_names_source="declared")
        store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(n)])
        store.append("query", q, record_ids=[f"q{i}" for i in range(m)], batch="small")
        build_index(store_path=base / "s.zarr", ledger_path=base / "L",
                    params=make_params(epsilon=100.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=1000 * m))

        pristine = root / "pristine"  # not at the path the ledger records: its copies are not twins of it
        base.rename(pristine)

        def fresh() -> None:  # every serve starts from the same store and ledger (a re-run would replay)
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(pristine, work)

        serve = _best([sys.executable, "-m", "indknn_cli", "serve-queries", "small", "--store", str(work / "s.zarr"),
                       "--ledger", str(work / "L"), "--seed", "1", "--no-reuse", "--quiet"], repeat, before=fresh)
        bare = _best([sys.executable, "-c", BARE_PRODUCT, str(root / "x.npy"), str(root / "q.npy")], repeat)
    return {"n": n, "d": d, "queries": m, "serve_s": round(serve, 4), "bare_numpy_torch_product_s": round(bare, 4),
            "serve_vs_bare_product_process": round(serve / bare, 2)}


def heavy_modules_at_help() -> list[str]:
    out = subprocess.run([sys.executable, "-c", HELP_PROBE], capture_output=True, text=True, check=True)
    line = [x for x in out.stderr.splitlines() if x.startswith("HEAVY=")][-1]
    return [m for m in line[len("HEAVY="):].split(",") if m]


def run(*, repeat: int, small_n: int, small_d: int, small_queries: int) -> dict:
    """`indknn --help` against `python -c pass`, and the small serve against the bare product process, each
    the best of ``repeat`` runs."""
    load0 = os.getloadavg()
    log.info("timing python -c pass and indknn --help (%d runs each)", repeat)
    bare = _best([sys.executable, "-c", "pass"], repeat)
    helps = _best([sys.executable, "-m", "indknn_cli", "--help"], repeat)
    log.info("timing the small serve (N = %d, d = %d, %d queries)", small_n, small_d, small_queries)
    small = small_serve(n=small_n, d=small_d, m=small_queries, repeat=repeat)
    return {"python_pass_s": round(bare, 4), "indknn_help_s": round(helps, 4),
            "help_vs_bare_python": round(helps / bare, 2), "heavy_imported_by_help": heavy_modules_at_help(),
            "small_serve": small, "loadavg_start": [round(v, 2) for v in load0],
            "loadavg_end": [round(v, 2) for v in os.getloadavg()]}
