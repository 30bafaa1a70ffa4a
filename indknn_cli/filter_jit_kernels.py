"""The compiled filter loop of :mod:`indknn_cli.filter_jit` (numba): SPEC §2 for a batch, query by query.

Imported only by ``filter_jit._load``. Each line mirrors one of :func:`indknn_cli.engine.answer_one` and
:func:`indknn_cli.engine.release_answer` (same operations, same order, IEEE float64 without fastmath), so
charges, counts and labels are the same bits; filter_jit's docstring says where and why the two may differ
and how that is excluded.
"""

from __future__ import annotations

import numpy as np

from .jit_common import njit


_jit = njit(error_model="numpy")  # a float division by zero gives inf or nan, as numpy's does
_jit_inline = njit(error_model="numpy", inline="always")


@_jit_inline
def _up(buf, bits, x):
    """np.nextafter(x, inf) for x ≥ +0, +inf or NaN (every use below): one step up of the bit pattern (libm's
    nextafter is a call per value: 9 ns against 1 ns here)."""
    if x != x or x == np.inf:
        return x
    buf[0] = x
    bits[0] += 1
    return buf[0]


@_jit_inline
def _down(buf, bits, x):
    """np.nextafter(x, −inf) for finite x, −inf or NaN: a step toward −inf of the bit pattern (±0 → −5e-324)."""
    if x != x or x == -np.inf:
        return x
    if x == 0.0:
        return -5e-324
    buf[0] = x
    if x > 0.0:
        bits[0] -= 1
    else:
        bits[0] += 1
    return buf[0]


@_jit
def filter_batch(bounds, ledger, labels_of, kappa, spent, limit, selected, c1, sigma1, sigma2, k_min, denom, normals,
                 labels, counts, margins):
    """Answer queries 0 … m−1 in order over their candidates (CSR: ``bounds``; per candidate its ledger index
    ``ledger``, label ``labels_of`` and κ ``kappa``), charging ``spent`` in place and counting selections in
    ``selected``. ``limit`` is B per record, −inf for a deleted one (never eligible: answer_one's ~deleted).
    ``normals[t]`` = query t's count draw, then one vote draw per class; ``denom`` = 2·σ2·σ2 (Python's
    left-to-right product). Writes ``labels``, ``counts`` (K_t) and ``margins``."""
    m = bounds.shape[0] - 1
    n_classes = normals.shape[1] - 1
    width = 0
    for t in range(m):
        width = max(width, bounds[t + 1] - bounds[t])
    sel = np.empty(width, np.int64)
    kap = np.empty(width, np.float64)
    lab = np.empty(width, np.int64)
    sp_e = np.empty(width, np.float64)
    bud = np.empty(width, np.float64)
    votes = np.empty(n_classes, np.float64)
    buf = np.empty(1, np.float64)
    bits = buf.view(np.int64)
    for t in range(m):
        n = 0
        for j in range(bounds[t], bounds[t + 1]):
            li = ledger[j]
            s = spent[li]
            b = limit[li]
            if _up(buf, bits, s + c1) <= b:  # eligible (step 1; a deleted record's limit is −inf)
                sel[n] = li
                kap[n] = kappa[j]
                lab[n] = labels_of[j]
                sp_e[n] = s
                bud[n] = b
                n += 1
        # Step 2: K_t = max(round(|C_t| + σ1·z, 2 decimals), K_min) (engine.release_count).
        noisy = np.float64(n) + sigma1 * normals[t, 0]
        k_t = (np.rint(noisy * 100.0) + 0.0) / 100.0  # + 0.0: Python's round gives an int, never −0
        if k_min > k_t:
            k_t = k_min
        two_k = 2.0 * k_t
        d_k = denom * k_t
        for c in range(n_classes):
            votes[c] = 0.0
        for j in range(n):
            s = _up(buf, bits, sp_e[j] + c1)
            rem = _down(buf, bits, bud[j] - s)
            if rem < 0.0:  # np.maximum(rem, 0.0)
                rem = 0.0
            cap = sigma2 * np.sqrt(two_k * rem) * (1.0 - 1e-9)
            w = kap[j] if (kap[j] <= cap or kap[j] != kap[j]) else cap  # np.minimum(kap, cap)
            cost = _up(buf, bits, w * w / d_k * (1.0 + 1e-12))
            new = _up(buf, bits, s + cost)
            if new > bud[j]:  # rounding edge: a vote of weight 0 (cost 0) rather than overspend
                w = 0.0
                new = s
            li = sel[j]
            spent[li] = new
            selected[li] += 1
            votes[lab[j]] += w
        # Steps 4–5: votes (+ reuse 0.0) + σ2·sqrt(K_t)·z per class; argmax; the noisy margin.
        scale = sigma2 * np.sqrt(k_t)
        best = 0
        for c in range(n_classes):
            votes[c] = (votes[c] + 0.0) + scale * normals[t, 1 + c]
            if votes[c] > votes[best]:
                best = c
        labels[t] = best
        counts[t] = k_t
        if n_classes < 2:
            margins[t] = np.inf
        else:
            second = -np.inf
            seen_best = False
            for c in range(n_classes):
                if c == best and not seen_best:
                    seen_best = True
                    continue
                if votes[c] > second:
                    second = votes[c]
            margins[t] = (votes[best] - second) / scale
