"""How long `indknn account --json` takes on a 1,000,000-record ledger, and its peak memory.

Builds a synthetic ledger in a temporary folder with the BudgetLedger API
(create, one `add` event of N records, then a few serve-like events that charge
a random fifth of the records and release answers), then builds the account
report in a fresh child process (so the figures are the reader's alone):

    .venv/bin/python bench/ledger_read.py              # N = 1,000,000
    .venv/bin/python bench/ledger_read.py --n 100000 --compact

Prints wall time and peak RSS (resource.getrusage, the child's own
ru_maxrss) for: opening the ledger (snapshot + events), building the report
(gdp headline), the report with the rdp headline, and the whole CLI command
`account --json` (Python start-up and imports included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(path: Path, n: int, events: int, compact: bool) -> float:
    import numpy as np

    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import make_params

    t0 = time.perf_counter()
    params = make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=1000)
    ledger = BudgetLedger.create(path, params=params, store_uuid="bench-ledger-read", store_path="(synthetic)")
    ledger.add_records(record_ids=[f"rec-{i:08d}" for i in range(n)], user_ids=[f"user-{i // 4:07d}" for i in range(n)],
                       rows=list(range(n)))
    rng = np.random.default_rng(0)
    spent = np.zeros(n)
    c1 = params.c1
    per_event_answers = 256
    for e in range(events):
        idx = np.sort(rng.choice(n, size=n // 5, replace=False))
        room = params.budget - spent[idx]
        step = np.minimum(room, c1 + rng.random(idx.size) * 0.5 * params.budget)
        ok = step >= c1
        idx, step = idx[ok], step[ok]
        spent[idx] = np.minimum(params.budget, spent[idx] + step)
        n_ch, n_ans = idx.size, per_event_answers
        qi = list(range(e * n_ans, (e + 1) * n_ans))
        cols = {
            "kind": ["charge"] * n_ch + ["answer"] * n_ans,
            "ledger_index": idx.tolist() + [None] * n_ans,
            "spent_after": spent[idx].tolist() + [None] * n_ans,
            "selected": [1] * n_ch + [None] * n_ans,
            "batch_id": [None] * n_ch + [f"day-{e}"] * n_ans,
            "part": [None] * n_ch + [0] * n_ans,
            "query_index": [None] * n_ch + list(range(n_ans)),
            "query_id": [None] * n_ch + [f"q{i}" for i in qi],
            "query_row": [None] * n_ch + qi,
            "label": [None] * n_ch + [int(x) for x in rng.integers(0, 4, n_ans)],
            "label_name": [None] * n_ch + [None] * n_ans,
            "released_count": [None] * n_ch + [50.0] * n_ans,
            "seed": [None] * n_ch + ["bench"] * n_ans,
        }
        ledger.commit_event(event_type="serve", columns=cols, info={
            "batch_id": f"day-{e}", "part": 0, "seed": "bench", "answers": n_ans, "charged_records": n_ch})
    if compact:
        ledger.compact()
    return time.perf_counter() - t0


def read(path: Path, what: str) -> None:
    """Child process: time one read; print a JSON line with wall time and peak RSS."""
    t0 = time.perf_counter()
    if what == "open":
        from indknn_cli.ledger_readonly import open_ledger_readonly

        ledger = open_ledger_readonly(path)
        extra = {"records": len(ledger.state)}
    elif what in ("gdp", "rdp"):
        from indknn_cli.report import build_account_report

        rep = build_account_report(ledger_path=path, conversion=what, eps=1.0, min_active="0.1")
        extra = {k: rep.data[k] for k in ("records", "records_active", "records_retired", "epsilon", "conversion")}
        extra["json_bytes"] = len(json.dumps(rep.data))
    elif what == "record":
        from indknn_cli.report import build_account_report

        from indknn_cli.ledger_readonly import open_ledger_readonly

        n = len(open_ledger_readonly(path).state)  # not timed separately: the report opens it again
        t0 = time.perf_counter()
        rep = build_account_report(ledger_path=path, record_id=f"rec-{n // 2:08d}")
        urep = build_account_report(ledger_path=path, user_id=f"user-{n // 8:07d}")  # one subject per view
        extra = {"record_status": rep.data["status"], "user_records": urep.data["records"]}
    else:
        raise SystemExit(f"unknown --read target {what}")
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB → MiB on Linux
    print(json.dumps({"what": what, "wall_s": round(wall, 3), "peak_rss_mib": round(peak, 1), **extra}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="records in the synthetic ledger")
    ap.add_argument("--events", type=int, default=5, help="serve-like charge events after the add event")
    ap.add_argument("--compact", action="store_true", help="also time the ledger after compaction (snapshot only)")
    ap.add_argument("--read", nargs=2, metavar=("LEDGER", "WHAT"), help=argparse.SUPPRESS)
    ap.add_argument("--build", metavar="LEDGER", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.read:
        read(Path(args.read[0]), args.read[1])
        return
    if args.build:
        built = build(Path(args.build), args.n, args.events, compact=False)
        if args.compact:
            import shutil

            from indknn_cli.ledger import BudgetLedger

            shutil.copytree(args.build, Path(args.build).parent / "compacted")
            BudgetLedger.open(Path(args.build).parent / "compacted").compact()
        print(json.dumps({"built_s": built}))
        return
    # Linux keeps ru_maxrss across fork+exec: build and read in children of this small process,
    # so each child's peak is its own.
    with tempfile.TemporaryDirectory(prefix="indknn-ledger-read-") as tmp:
        path = Path(tmp) / "ledger"
        out = subprocess.run([sys.executable, __file__, "--build", str(path), "--n", str(args.n), "--events",
                              str(args.events)] + (["--compact"] if args.compact else []),
                             capture_output=True, text=True, check=True)
        built = json.loads(out.stdout)["built_s"]
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        print(f"built {args.n:,} records + {args.events} serve events in {built:.1f} s "
              f"({size / 2**20:.1f} MiB on disk)", file=sys.stderr)
        layouts = [("snapshot+events", path)]
        if args.compact:
            layouts.append(("compacted", Path(tmp) / "compacted"))
        env = dict(os.environ, INDKNN_WIDTH="120")
        for layout, p in layouts:
            for what in ("open", "gdp", "rdp", "record"):
                out = subprocess.run([sys.executable, __file__, "--read", str(p), what], capture_output=True,
                                     text=True, env=env, check=True)
                row = json.loads(out.stdout)
                print(json.dumps({"layout": layout, "n": args.n, **row}))
            t0 = time.perf_counter()
            cli = subprocess.run([sys.executable, "-c",
                                  "import resource,sys; from indknn_cli.cli.app import main; sys.argv=sys.argv[1:]\n"
                                  "try: main()\n"
                                  "except SystemExit as e: code = e.code\n"
                                  "else: code = 0\n"
                                  "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
                                  "sys.stderr.write('PEAK %f\\n' % peak)\n"
                                  "sys.exit(code)",
                                  "indknn", "account", "--ledger", str(p), "--json", "--eps", "1"],
                                 capture_output=True, text=True, env=env, cwd=ROOT)
            wall = time.perf_counter() - t0
            peak = float(cli.stderr.rsplit("PEAK", 1)[1]) if "PEAK" in cli.stderr else float("nan")
            obj = json.loads(cli.stdout)
            print(json.dumps({"layout": layout, "n": args.n, "what": "cli account --json --eps 1",
                              "exit_code": cli.returncode, "wall_s": round(wall, 3), "peak_rss_mib": round(peak, 1),
                              "records_active": obj["records_active"]}))


if __name__ == "__main__":
    main()
