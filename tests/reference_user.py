"""A plain one-query-at-a-time Ind-KNN for the user unit (SPEC §9), with scalars and dicts, for exactness tests.

Written from the SPEC text, independently of indknn_cli.user_unit: per query, group the candidates by user,
keep each user's k largest κ, check eligibility B − spent_u ≥ m²·c1 (rounded against the user), release
K_t = max(round(Σ m + σ1 z, 0.01), K_min), scale each user's vote vector to fit, charge, vote, argmax.
"""

from __future__ import annotations

import math

import numpy as np

from indknn_cli.engine import noise_generator

from .reference import kappa, reuse_votes


def reference_user_answers(X, y, users, Q, *, params, n_classes, spent_u, budget, deleted, run_key, k=None,
                           reuse_pool=None):
    """Returns (labels, counts); mutates ``spent_u`` (dict user → spent)."""
    c1 = params.c1
    labels, counts = [], []
    pool = None if reuse_pool is None else list(reuse_pool)
    for t, q in enumerate(Q):
        rng = noise_generator(run_key, t)
        by_user: dict = {}
        for i in range(len(X)):
            if deleted[i]:
                continue
            kap = kappa(X[i], q, params.kernel, params.nu)
            if kap >= params.tau:
                by_user.setdefault(users[i], []).append((kap, i))
        chosen = {}
        for u, recs in by_user.items():
            recs = sorted(recs, key=lambda r: (-r[0], r[1]))
            if k is not None:
                recs = recs[:k]
            m = len(recs)
            cnt = c1 if m == 1 else math.nextafter(m * m * c1, math.inf)
            after = math.nextafter(spent_u.get(u, 0.0) + cnt, math.inf)
            if after <= budget:
                chosen[u] = (sorted(recs, key=lambda r: r[1]), after)
        z = rng.standard_normal()
        K = max(round((sum(len(r) for r, _ in chosen.values()) + params.sigma1 * z) * 100) / 100,
                float(params.k_min))
        weights = {}  # record index → vote weight
        for u, (recs, after) in chosen.items():
            r = max(math.nextafter(budget - after, -math.inf), 0.0)
            cap = params.sigma2 * math.sqrt(2.0 * K * r) * (1.0 - 1e-9)
            vec = [0.0] * n_classes
            for kap, i in recs:
                vec[int(y[i])] += kap
            norm = recs[0][0] if len(recs) == 1 else math.sqrt(sum(v * v for v in vec))
            c = min(norm, cap)
            cost = math.nextafter(c * c / (2.0 * params.sigma2 * params.sigma2 * K) * (1.0 + 1e-12), math.inf)
            new = math.nextafter(after + cost, math.inf)
            if new > budget:
                c, new = 0.0, after
            spent_u[u] = new
            for kap, i in recs:
                weights[i] = c if len(recs) == 1 else kap * (c / norm)
        votes = [0.0] * n_classes
        for i in sorted(weights):  # candidate (row) order, as the engine sums
            votes[int(y[i])] += weights[i]
        total = np.array(votes) + np.array(reuse_votes(pool, q, params=params, n_classes=n_classes))
        total = total + params.sigma2 * math.sqrt(K) * rng.standard_normal(n_classes)
        a = int(np.argmax(total))
        labels.append(a)
        counts.append(K)
        if pool is not None:
            pool.append((q, a))
    return labels, counts
