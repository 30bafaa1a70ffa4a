"""Where serving's best σ2 sits: every τ of the dataset's prior × σ2 from a quarter to twice the budget-relative unit.

    INDKNN_DATA=../shared/data python bench/sigma2_sweep.py ag_news|mnist EPS[,EPS…] [SPLIT]

For each ε: B_serve as ``index --tune private`` (exp-mech, 20 % share) computes it, the budget-relative unit
u = sqrt(2.29e-5·T/B_serve) (tuning_grid.py), then the mean serving accuracy over 3 query draws of the bench's split
at σ2 = m·u, m ∈ {0.25, 0.35, 0.5, 0.7, 1, 1.4, 2}, for each τ of the prior, with the candidates' κ statistics at
that τ (on the first draw): candidates per query, mean and root-mean-square κ. The default grid is m = 0.5 / 0.8 / 1.2
(docs/TUNING.md, "Where serving's best σ2 sits"). ``mnist`` uses bench's quick split (HOG, ≤ 20,000 private).
One JSON line per (ε, τ).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from indknn_cli import tuning
from indknn_cli.benchmarks.config import BenchConfig
from indknn_cli.benchmarks.data import load_dataset, make_split
from indknn_cli.benchmarks.experiments import prepare, query_draws
from indknn_cli.benchmarks.private_tuning import _serve, tune_request
from indknn_cli.ledger_state import PrivacyParams
from indknn_cli.tuning_grid import REFERENCE_BUDGET_PER_QUERY

MULTS = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0)


def main(argv: list[str]) -> None:
    dataset, epss = argv[0], [float(e) for e in argv[1].split(",")]
    split = int(argv[2]) if len(argv) > 2 else 0
    ds = load_dataset(dataset)
    cfg = BenchConfig.make(quick=dataset == "mnist", seed=split, epsilons=tuple(epss), draws=3)
    p = prepare(ds, make_split(ds, seed=split, max_private=cfg.max_private), cfg)
    draws = query_draws(p.pool_x.shape[0], p.T, 3, split)
    kcache: dict = {}
    for eps in epss:
        rec, params = tuning.private_tune_arrays(p.priv_x, p.priv_y, n_classes=p.ds.n_classes,
                                                 req=tune_request(cfg, eps=eps, T=p.T, seed=1, extractor=p.ds.extractor))
        unit = (REFERENCE_BUDGET_PER_QUERY * p.T / params.budget) ** 0.5
        for tau in sorted({t for t, _ in rec.grid}):
            acc = []
            for m in MULTS:
                prm = PrivacyParams(**{**params.as_dict(), "tau": float(tau), "sigma2": float(f"{m * unit:.3g}")}).validate()
                acc.append(round(float(np.mean([_serve(p, cfg, idx, prm, tag=f"sweep:{eps}:{d}:{tau}:{m}", kcache=kcache,
                                                       d=d) for d, idx in enumerate(draws)])), 4))
            k = kcache[0]
            sel = k >= tau
            print(json.dumps({"dataset": dataset, "split": split, "epsilon": eps, "budget_serve": params.budget,
                              "unit": unit, "tau": tau, "mults": MULTS, "accuracy": acc,
                              "best_mult": MULTS[int(np.argmax(acc))], "candidates_per_query": float(sel.sum(1).mean()),
                              "kappa_mean": float(k[sel].mean()), "kappa_rms": float(np.sqrt((k[sel] ** 2).mean())),
                              "private_records": int(p.priv_x.shape[0])}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
