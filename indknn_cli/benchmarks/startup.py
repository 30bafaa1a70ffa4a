"""Fixed cost of a process: `indknn --help` against a bare `python -c pass` (issue 21: lazy imports).

    indknn bench startup --repeat 5

Runs each command ``--repeat`` times in a fresh interpreter (the same Python) and
prints the best wall time of each, their ratio, and which heavy libraries
`indknn --help` imported (none of torch, zarr, scipy, pyarrow, numpy expected).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HEAVY = ("torch", "zarr", "scipy", "pyarrow", "numpy", "pandas", "sklearn")

HELP_PROBE = (
    "import sys\nsys.argv = ['indknn', '--help']\nfrom indknn_cli.cli.app import app\n"
    "try:\n    app()\nexcept SystemExit:\n    pass\n"
    "print('HEAVY=' + ','.join(m for m in %r if m in sys.modules), file=sys.stderr)\n" % (HEAVY,)
)


def _best(cmd: list[str], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - t)
    return best


def heavy_modules_at_help() -> list[str]:
    out = subprocess.run([sys.executable, "-c", HELP_PROBE], capture_output=True, text=True, check=True)
    line = [x for x in out.stderr.splitlines() if x.startswith("HEAVY=")][-1]
    return [m for m in line[len("HEAVY="):].split(",") if m]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="indknn bench startup", description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    bare = _best([sys.executable, "-c", "pass"], a.repeat)
    helps = _best([sys.executable, "-m", "indknn_cli", "--help"], a.repeat)
    print(json.dumps({"python_pass_s": round(bare, 4), "indknn_help_s": round(helps, 4),
                      "help_vs_bare_python": round(helps / bare, 2), "heavy_imported_by_help": heavy_modules_at_help(),
                      "loadavg": [round(v, 2) for v in os.getloadavg()]}), flush=True)


if __name__ == "__main__":
    main()
