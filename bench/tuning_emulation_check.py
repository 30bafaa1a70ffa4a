"""Emulated shard accuracy (the private search's count before its noise) beside serving accuracy, per grid point.

    INDKNN_DATA=../shared/data python bench/tuning_emulation_check.py EPS [DRAWS [KEYS [SEED]]]

For the total ε given: B_serve as ``index --tune private`` computes it, then for every (τ, σ2) of the default grid
the mean fraction of shards the earlier emulation answers correctly ("emulated": ``emulated_correct``) and the
mean chance the search now scores ("expected": ``emulated_expected``) (no score noise; KEYS run keys × DRAWS seeds)
and the median serving accuracy at B_serve over DRAWS query draws of `bench accuracy-vs-eps`'s split. A search
that tracks serving ranks the grid points in the same order (Spearman ρ printed). See docs/TUNING.md.
``INDKNN_SERVING_CACHE=FILE`` keeps the serving accuracies (they do not depend on the emulation) between runs.
"""

from __future__ import annotations

import json
import os
import sys
import time

from indknn_cli.benchmarks.config import BenchConfig
from indknn_cli.benchmarks.data import load_dataset, make_split
from indknn_cli.benchmarks.emulation_check import emulation_table
from indknn_cli.benchmarks.experiments import prepare, query_draws


def main(argv: list[str]) -> None:
    eps = float(argv[0])
    n_draws, keys, seed = (int(argv[i]) if len(argv) > i else dflt for i, dflt in ((1, 3), (2, 3), (3, 0)))
    ds = load_dataset("ag_news")
    cfg = BenchConfig.make(quick=False, seed=seed, epsilons=(eps,), draws=n_draws)
    p = prepare(ds, make_split(ds, seed=seed), cfg)
    draws = query_draws(p.pool_x.shape[0], p.T, n_draws, seed)
    cache_file = os.environ.get("INDKNN_SERVING_CACHE")
    tag = f"{eps}:{n_draws}:{seed}"
    cache = json.load(open(cache_file)) if cache_file and os.path.exists(cache_file) else {}
    serving = {tuple(json.loads(k)): v for k, v in cache.get(tag, {}).items()}
    t0 = time.perf_counter()
    t = emulation_table(p, cfg, eps=eps, draws=draws, keys=keys, serving=serving)
    if cache_file:
        cache[tag] = {json.dumps(list(k)): v for k, v in t["serving"].items()}
        json.dump(cache, open(cache_file, "w"))
    print(f"ε={eps} B_serve={t['budget_serve']:.4g} σ_s={t['score_noise_std']:.1f} shards={t['shards']} "
          f"(draws={n_draws}, keys={keys}, seed={seed})")
    print("   τ    σ2   emulated (sd)   expected   serving")
    for r in t["rows"]:
        print(f"{r['tau']:5.2f} {r['sigma2']:5.2f}   {r['emulated']:.3f} ({r['emulated_sd']:.3f})    {r['expected']:.3f}     "
              f"{r['serving']:.3f}")
    print(f"Spearman with serving: emulated (the search's) {t['spearman']:.2f}, expected {t['spearman_expected']:.2f}; "
          f"serving at their best point {t['serving_of_emulated_best']:.3f} / {t['serving_of_expected_best']:.3f}, "
          f"best {t['serving_best']:.3f}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
