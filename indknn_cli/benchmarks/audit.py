"""Empirical privacy audit of Ind-KNN: ε lower bound from a canary attack vs the certified ε.

    indknn bench audit                          # 2000 trials per world, OS-entropy noise
    indknn bench audit --trials 5000 --eps 4 --out audit.json

Prints one JSON object on stdout: the measured ε lower bound (Clopper–Pearson,
confidence 1 − α), the certified ε of the budget B with its conversion, the
chosen membership-inference test and its error rates. Exit 0 when the lower
bound does not exceed the certified ε, 4 when it does (an implementation leak).
Method and references: indknn_cli/audit.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from ..audit import AuditConfig, run_audit
from ..errors import EXIT_CHECK_FAILED
from ..output_files import check_output_file, write_text_file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="indknn bench audit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = AuditConfig()
    for f in fields(AuditConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=default,
                            help=f"(default {default})")
        elif f.name == "seed":
            ap.add_argument(flag, type=int, default=None,
                            help="experiments only: fixed noise seed (default: OS entropy; recorded in the output)")
        else:
            ap.add_argument(flag, type=type(default), default=default, help=f"(default {default})")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    if args.out is not None:  # before the run: a folder, pipe, device or missing folder is refused (exit 2)
        check_output_file(args.out, option="--out")
    config = AuditConfig(**{f.name: getattr(args, f.name) for f in fields(AuditConfig)})
    t0 = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if sys.stderr.isatty() and (now - last[0] > 5 or done == total):  # progress on a terminal only
            last[0] = now
            print(f"audit: {done}/{total} trials", file=sys.stderr, flush=True)

    result = run_audit(config, on_progress=progress)
    out = result.as_dict()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["noise"] = "seeded (experiment)" if config.seed is not None else "OS entropy"
    text = json.dumps(out, ensure_ascii=False)
    print(text)
    if args.out is not None:
        write_text_file(args.out, text + "\n", option="--out")
    print(f"ε lower bound {result.epsilon_lower_bound:.3f} (confidence {result.confidence:.0%}) vs certified "
          f"ε({result.conversion}) = {result.certified_epsilon:.3f} at δ = {result.delta:g}, per {result.unit} "
          f"({result.adjacency} adjacency): "
          f"{'consistent' if result.passed else 'LEAK: the lower bound exceeds the certificate'}", file=sys.stderr)
    return 0 if result.passed else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
