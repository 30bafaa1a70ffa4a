"""FAISS's products under each OpenBLAS kernel family, in one run (issue 21, candidates.import_faiss).

    python bench/faiss_openblas.py [--n 50000] [--d 768] [--queries 2048]

The faiss-cpu wheel bundles its own OpenBLAS; on CPUs it does not know it falls back to SSE3 ("Prescott").
Each family (and ``auto``: indknn's choice from the CPU's flags) runs in a fresh process: FAISS
``range_search`` of the rows against a flat index of the queries, as the CPU screen does, CPU seconds of all
threads. Prints one JSON line per family and the ratio of Prescott's CPU seconds to auto's. Only families
the CPU has are tried (a family it lacks would stop the process with an illegal instruction).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from indknn_cli.candidates import _openblas_coretype

_CHILD = r"""
import json, resource, sys, time
import numpy as np
from indknn_cli.candidates import import_faiss
faiss = import_faiss()
n, d, m = map(int, sys.argv[1:4])
rng = np.random.default_rng(0)
x = rng.standard_normal((n, d)).astype(np.float32); x /= np.linalg.norm(x, axis=1, keepdims=True)
q = rng.standard_normal((m, d)).astype(np.float32); q /= np.linalg.norm(q, axis=1, keepdims=True)
index = faiss.IndexFlatIP(d); index.add(q)
r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
for lo in range(0, n, 8192):
    index.range_search(x[lo:lo + 8192], 0.1)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": round(time.perf_counter() - t, 3),
                  "cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 3)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50000)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--queries", type=int, default=2048)
    a = ap.parse_args()
    best = _openblas_coretype()
    families = ["Prescott"] + {"SkylakeX": ["Haswell", "SkylakeX"], "Haswell": ["Haswell"]}.get(best, []) + ["auto"]
    out = {}
    for fam in families:
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
        if fam != "auto":
            env["OPENBLAS_CORETYPE"] = fam
        res = subprocess.run([sys.executable, "-c", _CHILD, str(a.n), str(a.d), str(a.queries)], env=env,
                             capture_output=True, text=True, check=True)
        row = dict(json.loads(res.stdout.strip().splitlines()[-1]), family=fam, load_average=list(os.getloadavg()))
        out[fam] = row
        print(json.dumps(row), flush=True)
    print(json.dumps({"auto_family": best, "prescott_vs_auto_cpu": round(out["Prescott"]["cpu_s"] / out["auto"]["cpu_s"], 2)}))


if __name__ == "__main__":
    main()
