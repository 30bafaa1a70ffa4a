"""A plain one-query-at-a-time Ind-KNN (SPEC §2, §4) written with scalars, for exactness tests."""

from __future__ import annotations

import math

import numpy as np

from indknn_cli.engine import noise_generator


def kappa(x: np.ndarray, q: np.ndarray, kernel: str, nu: float | None) -> float:
    x64 = x.astype(np.float64)
    q64 = q.astype(np.float64)
    if kernel == "cosine":
        return float((x64 * q64).sum())
    d = x64 - q64
    return float(np.exp(-(d * d).sum() / (nu * nu)))


def reuse_votes(pool, q, *, params, n_classes):
    """SPEC §4: κ-weighted votes of the released (vector, label) pairs within τ of q (none without reuse)."""
    reuse = [0.0] * n_classes
    for v, lab in pool or []:
        k = kappa(v, q, params.kernel, params.nu)
        if k >= params.tau:
            reuse[lab] += k
    return reuse


def reference_answers(X, y, Q, *, params, n_classes, spent, budget, deleted, run_key, reuse_pool=None):
    """Returns (labels, counts); mutates ``spent`` (list of floats). ``reuse_pool`` = list of (vec, label) or None."""
    c1 = params.c1
    labels, counts = [], []
    pool = None if reuse_pool is None else list(reuse_pool)
    for t, q in enumerate(Q):
        rng = noise_generator(run_key, t)
        chosen = []
        for i in range(len(X)):
            if deleted[i]:
                continue
            k = kappa(X[i], q, params.kernel, params.nu)
            if k < params.tau:
                continue
            if math.nextafter(spent[i] + c1, math.inf) > budget[i]:
                continue
            chosen.append((i, k))
        z = rng.standard_normal()
        K = max(round((len(chosen) + params.sigma1 * z) * 100) / 100, float(params.k_min))  # 1e-2 grid (SPEC §8)
        votes = [0.0] * n_classes
        for i, k in chosen:
            sp = math.nextafter(spent[i] + c1, math.inf)
            r = max(math.nextafter(budget[i] - sp, -math.inf), 0.0)
            cap = params.sigma2 * math.sqrt(2.0 * K * r) * (1.0 - 1e-9)
            w = min(k, cap)
            cost = math.nextafter(w * w / (2.0 * params.sigma2 * params.sigma2 * K) * (1.0 + 1e-12), math.inf)
            new = math.nextafter(sp + cost, math.inf)
            if new > budget[i]:
                w, new = 0.0, sp
            spent[i] = new
            votes[int(y[i])] += w
        total = np.array(votes) + np.array(reuse_votes(pool, q, params=params, n_classes=n_classes))
        total = total + params.sigma2 * math.sqrt(K) * rng.standard_normal(n_classes)
        a = int(np.argmax(total))
        labels.append(a)
        counts.append(K)
        if pool is not None:
            pool.append((q, a))
    return labels, counts
