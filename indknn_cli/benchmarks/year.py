"""A year of cron: K daily batches of queries into one ledger; is the per-batch cost flat? (issue 21)

    indknn bench year --days 60 --queries 200 --n 5000 --d 64
    indknn bench year --days 365 --queries 1000 --n 5000          # the issue's year

Builds a synthetic clustered store of N private vectors and a ledger, stores
each day's queries as their own batch, then per day times (in this process)
``BudgetLedger.open`` + ``serving.serve_queries`` and ``report.build_account_report``
(what `indknn serve-queries` and `indknn account` do after their imports; with
``--processes``, whole `indknn` processes on the compared days). Returns
one dict: the median of days 8-12 ("day 10") and of the last five days, and
their ratios (target: ≤ 1.2), plus the event files and generation at the end.
Fixed seed: for measurement only.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
#: Days 8-12 ("day 10") and the last five days apart: at 12 they were the same days (ratio 1 by design).
MIN_DAYS = 17


def clustered(n, d, classes, rng, spread=1.0):
    centres = np.random.default_rng(12345).standard_normal((classes, d)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    y = rng.integers(0, classes, n)
    x = centres[y] + spread * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, y.astype(np.int32)


def refuse_a_folder_in_use(keep) -> None:
    """``--keep DIR`` is a new folder: one that holds anything is refused (review 63: the store and ledger were
    written beside what was there)."""
    from ..errors import BadInputError

    if keep is not None and Path(keep).exists() and (not Path(keep).is_dir() or any(Path(keep).iterdir())):
        raise BadInputError(f"--keep {keep}: not a new folder (it exists and is not empty); give a new one")


def run(*, days: int, queries: int, n: int, d: int, tau: float, reuse: bool, eps: float,
        keep: str | Path | None = None, processes: bool = False) -> dict:
    """``days`` daily batches of ``queries`` queries served into one ledger (``keep``: build in this new folder
    and keep it); the seconds of the last days against day 10's."""
    if days < MIN_DAYS:
        from ..errors import BadInputError

        raise BadInputError(f"--days must be at least {MIN_DAYS} (days 8-12, \"day 10\", are compared with the "
                            "last five days)")
    m = queries
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.report import build_account_report
    from indknn_cli.serving import build_index, make_params, serve_queries
    from indknn_cli.store import ExtractorInfo, FeatureStore

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(keep) if keep else Path(tmp)
        refuse_a_folder_in_use(keep)
        sp, lp = tmp / "s.zarr", tmp / "L"
        store = FeatureStore.create(sp, extractor=ExtractorInfo("vectors", "synthetic", "1"), dim=d,
                                    label_names=[str(i) for i in range(10)], label_names_source="declared")
        x, y = clustered(n, d, 10, np.random.default_rng(0))
        store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(n)])
        # every day's queries stored up front (one batch per day): the timed part is what cron pays per day
        q, _ = clustered(days * m, d, 10, np.random.default_rng(1))
        for day in range(days):
            store.append("query", q[day * m:(day + 1) * m], record_ids=[f"q{day}-{i}" for i in range(m)],
                         batch=f"day{day:04d}")
        params = make_params(epsilon=eps, delta=1e-5, tau=tau, sigma2=0.6, planned_queries=days * m)
        build_index(store_path=sp, ledger_path=lp, params=params)
        log.info("store of %d records and %d daily batches built; serving", n, days)
        serve_s, account_s = [], []
        ten_days = set(range(max(0, min(7, days - 5)), max(5, min(12, days))))
        for day in range(days):
            if processes and (day in ten_days or day >= days - 5):
                # whole `indknn` processes (imports, CLI, JSON output) on the days compared
                cmd = [sys.executable, "-m", "indknn_cli"]
                t0 = time.perf_counter()
                subprocess.run(cmd + ["serve-queries", f"day{day:04d}", "--store", str(sp), "--ledger", str(lp),
                                      "--seed", str(day), "--device", "cpu"] + ([] if reuse else ["--no-reuse"]),
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                t1 = time.perf_counter()
                subprocess.run(cmd + ["account", "--json", "--store", str(sp), "--ledger", str(lp)],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                t2 = time.perf_counter()
                serve_s.append(t1 - t0)
                account_s.append(t2 - t1)
                continue
            t0 = time.perf_counter()
            BudgetLedger.open(lp)  # the serve command opens it to check the allowance first
            serve_queries(store_path=sp, ledger_path=lp, query_batch=f"day{day:04d}", seed=day, reuse=reuse)
            t1 = time.perf_counter()
            build_account_report(ledger_path=lp, store_path=sp)
            t2 = time.perf_counter()
            serve_s.append(t1 - t0)
            account_s.append(t2 - t1)
            if (day + 1) % 10 == 0:
                log.info("day %d of %d served", day + 1, days)
        led = BudgetLedger.open(lp)
        events = len(led._event_files())
        answers = len(led.state.answers["query_index"])

    def med(xs):
        return statistics.median(xs)

    ten = slice(max(0, min(7, days - 5)), max(5, min(12, days)))
    last = slice(max(0, days - 5), days)
    out = {"days": days, "queries_per_day": m, "n": n, "d": d, "tau": tau, "reuse": reuse,
           "timed": "whole indknn processes" if processes else "in process: BudgetLedger.open + serve_queries",
           "answers_total": answers, "event_files_at_end": events,
           "serve_day10_s": round(med(serve_s[ten]), 4), "serve_last_s": round(med(serve_s[last]), 4),
           "account_day10_s": round(med(account_s[ten]), 4), "account_last_s": round(med(account_s[last]), 4)}
    out["serve_ratio_last_vs_day10"] = round(out["serve_last_s"] / out["serve_day10_s"], 3)
    out["account_ratio_last_vs_day10"] = round(out["account_last_s"] / out["account_day10_s"], 3)
    out["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    return out

