"""What the private search is worth on average: the chosen point's serving accuracy over many tuning seeds.

    INDKNN_DATA=../shared/data python bench/private_tuning_seeds.py EPS[,EPS…] [SEEDS] [SPLIT_SEED] [--sigma2s A,B,C]
        [--shape 0|1|poisson] [--runs MEAN] [--share FRACTION] [--queries SHARDS]
        [--method exp-mech|random-search] [--dataset ag_news|mnist] [--features hog|pixels] [--quick] [--sharpen P]

For each ε: SEEDS tuning seeds (default 20) on the bench's AG News split SPLIT_SEED (default 0), each choice served
on 3 query draws (`benchmarks.private_tuning.chosen_point_accuracy`); prints the mean ± standard error of the
chosen point's accuracy beside the best grid point and, under exp-mech, the *exact expectation* of that accuracy
(Σ_g P[g]·accuracy(g) with P the mechanism's own softmax over the seed's un-noised scores, averaged over the seeds:
`benchmarks.private_tuning.choice_distribution`; the sampled mean adds the luck of 20 Gumbel draws). Without ``--sigma2s`` the grid is index's budget-relative
default; ``--sigma2s 0.5,0.8,1.2`` gives the fixed grid of earlier versions. ``--shape``, ``--runs`` and ``--share``
override index's distribution of the number of runs, its mean and the search's share of ε (docs/TUNING.md, "Other
run distributions and shares do no better"); ``--queries`` the number of validation shards (index --tune-queries), ``--method`` the selection
(index --tune-method; ``--shape`` and ``--runs`` apply to random-search). ``--dataset mnist --quick`` runs on MNIST's
HOG features with bench's quick settings (at most 20,000 private records); ``--features pixels`` uses MNIST's raw
pixels instead (the pixels extractor's τ prior, a feature set the shard score's power was not chosen on).
``--sharpen P`` scores each shard's chance to the power P instead of index's ``tuning_base.SHARPEN`` (a bench
experiment: docs/TUNING.md, "Sharpening"; the tuning record's ``emulation`` text still names the default power).
"""

from __future__ import annotations

import functools
import json
import sys

from indknn_cli import tuning, tuning_base
from indknn_cli.benchmarks import private_tuning
from indknn_cli.benchmarks.config import BenchConfig
from indknn_cli.benchmarks.data import load_dataset, make_split
from indknn_cli.benchmarks.experiments import prepare, query_draws


def main(argv: list[str]) -> None:
    opts = {}
    for name in ("--sigma2s", "--shape", "--runs", "--share", "--queries", "--method", "--sharpen"):
        if name in argv:
            i = argv.index(name)
            opts[name] = argv[i + 1]
            argv = argv[:i] + argv[i + 2:]
    dataset, quick = "ag_news", "--quick" in argv
    if "--dataset" in argv:
        i = argv.index("--dataset")
        dataset, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    features = "hog"
    if "--features" in argv:
        i = argv.index("--features")
        features, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    argv = [a for a in argv if a != "--quick"]
    sigma2s = tuple(float(v) for v in opts["--sigma2s"].split(",")) if "--sigma2s" in opts else None
    shape = opts.get("--shape")
    over = {"tune_shape": None if shape is None else (shape if shape == "poisson" else float(shape)),
            "tune_runs": float(opts["--runs"]) if "--runs" in opts else None,
            "tune_share": float(opts["--share"]) if "--share" in opts else None,
            "tune_queries": int(opts["--queries"]) if "--queries" in opts else None,
            "tune_method": opts.get("--method")}
    sharpen = {}
    if "--sharpen" in opts:  # both the search and the bench's rebuild of its scores look the score up here
        sharpen = {"sharpen": float(opts["--sharpen"])}
        tuning.emulated_score = functools.partial(tuning_base.emulated_expected, **sharpen)
    epss = [float(e) for e in argv[0].split(",")]
    n_seeds = int(argv[1]) if len(argv) > 1 else 20
    split_seed = int(argv[2]) if len(argv) > 2 else 0
    ds = load_dataset(dataset, features=features)
    cfg = BenchConfig.make(quick=quick, seed=split_seed, epsilons=tuple(epss), draws=3, **over)
    p = prepare(ds, make_split(ds, seed=split_seed, max_private=cfg.max_private), cfg)
    draws = query_draws(p.pool_x.shape[0], p.T, 3, split_seed)
    for eps in epss:
        out = private_tuning.chosen_point_accuracy(
            p, cfg, eps=eps, draws=draws, tuning_seeds=[split_seed * 1000 + 100 + k for k in range(n_seeds)],
            sigma2s=sigma2s, progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(json.dumps(dict(out, split=split_seed, dataset=dataset, features=features, **sharpen,
                              **{k: v for k, v in over.items() if v is not None})), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
