"""The privately tuned rows of `indknn bench accuracy-vs-eps` alone, for one ε (without the baselines' tuning).

Calls ``indknn_cli.benchmarks.private_tuning.private_rows`` — what `bench accuracy-vs-eps` calls for each ε —
on the same split, query draws and seed, and prints the privately tuned row, the best grid point at B_serve
and the whole grid. Used for the README's figures when the full command could not finish on a loaded machine:

    INDKNN_DATA=../shared/data python bench/private_tuning_rows.py 1.0 5 [SEED] [--no-oracle] [--quick]
        [--dataset ag_news|mnist|STORE] [--tune-taus A,B,...] [--tune-method exp-mech|random-search]

``--no-oracle`` skips serving every grid point (the yardstick), which is most of the run's time. ``--quick`` takes
bench's quick settings (at most 20,000 private records). ``--tune-taus`` replaces the extractor's τ prior;
``--tune-method`` picks index's selection (default exp-mech).
"""

from __future__ import annotations

import sys
import time

from indknn_cli.benchmarks import private_tuning
from indknn_cli.benchmarks.config import BenchConfig
from indknn_cli.benchmarks.data import load_dataset, make_split
from indknn_cli.benchmarks.experiments import majority_class, prepare, query_draws


def main(argv: list[str]) -> None:
    opts = {}
    for flag in ("--dataset", "--tune-taus", "--tune-method"):
        if flag in argv:
            i = argv.index(flag)
            opts[flag] = argv[i + 1]
            del argv[i:i + 2]
    oracle, quick = "--no-oracle" not in argv, "--quick" in argv
    argv = [a for a in argv if a not in ("--no-oracle", "--quick")]
    eps, n_draws, seed = float(argv[0]), int(argv[1]) if len(argv) > 1 else 5, int(argv[2]) if len(argv) > 2 else 0
    ds = load_dataset(opts.get("--dataset", "ag_news"))
    taus = tuple(float(t) for t in opts["--tune-taus"].split(",")) if "--tune-taus" in opts else None
    cfg = BenchConfig.make(quick=quick, seed=seed, epsilons=(eps,), draws=n_draws, tune_taus=taus,
                           tune_method=opts.get("--tune-method"))
    cfg.oracle_grid = oracle
    p = prepare(ds, make_split(ds, seed=seed, max_private=cfg.max_private), cfg)
    draws = query_draws(p.pool_x.shape[0], p.T, n_draws, seed)
    t0 = time.perf_counter()
    rows = private_tuning.private_rows(p, cfg, eps=eps, draws=draws, progress=lambda s: print(s, flush=True))
    print("τ grid:", rows[0]["tuning_records"][0]["tau_grid"], "extractor:", ds.extractor)
    for r in rows:
        print(r["method"], round(r["accuracy_median"], 4), "min", round(r["accuracy_min"], 4), "max",
              round(r["accuracy_max"], 4), "B_serve", r["hyper"]["budget_B_serve"],
              "ε_total", r.get("epsilon_total"), "ε_tuning", r.get("epsilon_tuning"))
    for g in rows[-1].get("grid_accuracy", []):
        print("grid", g["tau"], g["sigma2"], round(g["accuracy_median"], 4))
    print("majority class", majority_class(p, draws)["accuracy_median"])
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
