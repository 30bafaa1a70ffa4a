"""Where a serve's time goes per part of 8,192 queries, without a GPU (issue 21): a CPU stand-in for the GPU
pipeline's Python work. A small store (N rows, d) keeps the candidate phase short, so a cProfile of one whole
`serve-queries --device cpu --batch-size 8192 --no-reuse --out FILE` process shows the per-part work around the
filter: building the answers, the event's columns, the released rows, the commit and the --out writer.

    PYTHONPATH=. python bench/serve_part_profile.py            # N=3000, d=64, 65,536 queries (8 parts)
    N=3000 D=64 M=65536 SRC=/path/to/other/checkout python bench/serve_part_profile.py   # another version, A/B

Prints the whole process's wall time (two runs, the first pays numba's compiles) and the cumulative seconds of
the per-part functions of that run's profile.
"""

import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = os.environ.get("SRC", str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, SRC)

from indknn_cli.benchmarks.serve_speed import make_store  # noqa: E402

N, M, D = int(os.environ.get("N", 3000)), int(os.environ.get("M", 65536)), int(os.environ.get("D", 64))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_store(tmp, N, D, M, 0.5)
        shutil.copytree(tmp / "L", tmp / "L.orig")
        shutil.copy2(tmp / "s.zarr" / "ledger-mark.json", tmp / "mark.orig")
        env = dict(os.environ, PYTHONPATH=SRC)
        cmd = ["-m", "indknn_cli", "serve-queries", "bench", "--store", str(tmp / "s.zarr"), "--ledger", str(tmp / "L"),
               "--device", "cpu", "--batch-size", "8192", "--seed", "1", "--no-reuse", "--out", str(tmp / "o.parquet"),
               "-q"]

        def fresh():
            shutil.rmtree(tmp / "L")
            shutil.copytree(tmp / "L.orig", tmp / "L")
            shutil.copy2(tmp / "mark.orig", tmp / "s.zarr" / "ledger-mark.json")
            (tmp / "o.parquet").unlink(missing_ok=True)

        for _ in range(2):
            fresh()
            t = time.perf_counter()
            subprocess.run([sys.executable, *cmd], check=True, env=env, cwd=tmp)
            print(f"whole process: {time.perf_counter() - t:.2f} s")
        fresh()
        subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp / "p.out"), *cmd], check=True, env=env, cwd=tmp)
        pstats.Stats(str(tmp / "p.out")).sort_stats("cumulative").print_stats(
            r"indknn_cli/.*(serving.py.*(serve_queries|listcomp|commit|release)|answer_batch_compiled|event_columns|"
            r"answers_out.py.*(write|_flush)|commit_event|cli/serve.py.*emit)", 20)


if __name__ == "__main__":
    main()
