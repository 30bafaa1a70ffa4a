"""Does the private search's emulated shard answer rank (τ, σ2) as serving does? (issue 18 diagnostic)

For one total ε: the tuning's ρ_run and B_serve exactly as ``index --tune private`` computes them, then for
every grid point

* **emulated**: the fraction of shards answered correctly by :func:`indknn_cli.tuning_base.emulated_correct`
  *without* the score's noise (mean over ``keys`` run keys and over the query draws' tuning seeds), the
  search's score until 2026-11-27;
* **expected**: the same with :func:`indknn_cli.tuning_base.emulated_expected` (per-shard chances with serving's
  vote noise modelled, the margin share from the label agreement of the shard's pairs): the search's score now
  (``tuning.emulated_score``), before it is noised;
* **serving**: the accuracy of serving the draw's T queries at B_serve with that grid point (median over draws).

Nothing here is private: it reads the reported queries' labels (like the oracle row). It exists to see where
the emulation's ranking departs from serving's; ``bench/tuning_emulation_check.py`` prints it.
"""

from __future__ import annotations

import numpy as np

from .. import tuning
from ..accounting import default_sigma1
from ..ledger_state import PrivacyParams
from .config import BenchConfig
from .private_tuning import _serve, tune_request


def _spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if np.std(ra) == 0 or np.std(rb) == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def emulation_table(p, cfg: BenchConfig, *, eps: float, draws: list[np.ndarray], keys: int = 3,
                    serving: dict | None = None, emulate=None, alternative=None) -> dict:
    """Per grid point: emulated shard accuracy (no score noise) beside serving accuracy at B_serve.

    ``serving`` maps (τ, σ2) → list of per-draw accuracies already measured (reused, not recomputed);
    ``emulate`` replaces :func:`tuning.emulated_correct` (same signature) to compare variants.
    """
    emulate = emulate or tuning.emulated_correct
    alternative = alternative or tuning.emulated_expected
    req = tune_request(cfg, eps=eps, T=p.T, seed=cfg.seed * 1000, extractor=p.ds.extractor)
    search = tuning.search_kwargs(method=req.method, mean_runs=req.mean_runs, shape=req.shape)
    rho = tuning.rho_for_share(epsilon=eps, delta=cfg.delta, share=req.share, **search)
    b = tuning.serving_budget(epsilon=eps, delta=cfg.delta, rho_run=rho, **search)
    grid = tuning.tuning_grid(taus=req.tau_grid()[0], sigma2s=req.sigma2s, budget=b, planned_queries=p.T)
    sigma1 = req.sigma1 if req.sigma1 is not None else default_sigma1(planned_queries=p.T, budget=b)
    datas = [tuning.BaseRunData.build(p.priv_x, p.priv_y, n_shards=min(req.n_val, len(p.priv_y)),
                                      seed_text=f"seed:{cfg.seed * 1000 + d}", n_classes=p.ds.n_classes)
             for d in range(len(draws))]
    serving = {} if serving is None else serving
    kcache: dict = {}
    rows = []
    for tau, s2 in grid:
        prm = PrivacyParams(epsilon=eps, delta=cfg.delta, conversion="rdp", budget=b, kernel=req.kernel, tau=tau,
                            sigma1=sigma1, sigma2=s2, nu=req.nu, k_min=req.k_min, planned_queries=p.T).validate()
        emu, alt = [], []
        for d, data in enumerate(datas):
            n_sh = int((data.val_row >= 0).sum())
            for k in range(keys):
                key = tuning._run_key(cfg.seed * 1000 + d, f"tune:run:{k}")
                kw = dict(params=prm, run_key=key, n_shards=data.val_row.size, planned_queries=p.T)
                emu.append(emulate(data, **kw) / n_sh)
                alt.append(alternative(data, **kw) / n_sh)
        if (tau, s2) not in serving:
            serving[(tau, s2)] = [_serve(p, cfg, idx, prm, tag=f"oracle:{eps}:{p.T}:{d}:{tau}:{s2}", kcache=kcache, d=d)
                                  for d, idx in enumerate(draws)]
        rows.append({"tau": tau, "sigma2": s2, "emulated": float(np.mean(emu)), "emulated_sd": float(np.std(emu)),
                     "expected": float(np.mean(alt)), "serving": float(np.median(serving[(tau, s2)]))})
    emu_v = [r["emulated"] for r in rows]
    alt_v = [r["expected"] for r in rows]
    srv_v = [r["serving"] for r in rows]
    return {"epsilon": eps, "budget_serve": b, "rho_run": rho, "method": search["method"],
            "score_noise_std": tuning.score_noise_std(rho=rho, method=search["method"]),
            "shards": int((datas[0].val_row >= 0).sum()), "rows": rows, "spearman": _spearman(emu_v, srv_v),
            "serving_of_emulated_best": srv_v[int(np.argmax(emu_v))], "serving_best": max(srv_v),
            "spearman_expected": _spearman(alt_v, srv_v), "serving_of_expected_best": srv_v[int(np.argmax(alt_v))],
            "serving": serving}
