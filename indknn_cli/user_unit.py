"""The user privacy unit (SPEC §9; docs/USER_UNIT.md has the derivation).

With ``index --privacy-unit user`` the individual Rényi filter runs on users, not records. For query t let
R_ut be user u's candidate records (κ ≥ τ, not deleted), optionally only the k largest κ
(``--max-records-per-user k``: a choice that depends on u's own records and q_t only), m_ut = |R_ut|.

- u is eligible iff ``up(spent_u + m_ut²·c1) ≤ B`` — a function of u's records, q_t and u's own spent, so
  adding or removing another user never changes whether u is eligible;
- ``K_t = max(round(Σ_{u eligible} m_ut + σ1·z), K_min)``; u pays ``m_ut²·c1`` (u moves the count by m_ut:
  a Gaussian mechanism of sensitivity m_ut costs m_ut²/(2σ1²) in ρ);
- u's vote vector ``s_ut = Σ_{i∈R_ut} κ_i e_{y_i}`` is scaled as a whole to L2 norm
  ``c_ut = min(‖s_ut‖, σ2·sqrt(2·K_t·r_ut))`` (r_ut: what is left after the count charge), and u pays
  ``c_ut²/(2σ2²K_t)`` rounded up.

With one record per user this is SPEC §2 bit for bit: m = 1 costs c1 exactly, ‖s‖ is κ itself and the vote
weight is ``min(κ, cap)`` (``tests/test_user_unit.py`` checks it against the record unit).

State: a user's spent is kept on each of the user's records in the ledger (every record of u carries
spent_u; a charge event writes a row for each live record of a charged user), so the ledger format and
its replay are unchanged and the per-user state is ``spent_u = max`` over u's records, tombstones included
(a returning user, or a new record of a known user, inherits it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .engine import QueryAnswer, release_answer, release_count
from .id_text import canonical

#: Key prefix of a record that is its own user (``--user-for-missing record``); cannot clash with a user id
#: read from data (user ids are stripped text without control characters).
OWN_USER_PREFIX = "\x00record:"


def user_keys(user_ids, record_ids, *, user_for_missing: str) -> np.ndarray:
    """The user each record belongs to (object array of keys); ``None`` where a record has no user id and
    ``user_for_missing`` is ``refuse`` (such records never enter a user-unit ledger)."""
    users = np.asarray(user_ids, dtype=object)
    # one user, one key whatever the Unicode spelling of their id (review 53, F2: two spellings were two budgets)
    keys = np.array([u if u is None else canonical(u) for u in users], dtype=object)
    missing = np.array([u is None or str(u) == "" for u in users], dtype=bool)
    if missing.any():
        if user_for_missing == "record":
            rids = np.asarray(record_ids, dtype=object)
            keys[missing] = [OWN_USER_PREFIX + str(r) for r in rids[missing]]
        else:
            keys[missing] = None
    return keys


@dataclass
class UserBudgetView:
    """The filter's state by user (the engine's BudgetView, for the user unit).

    ``user_of[ledger_index]`` is the user index (−1: not servable). ``spent``/``budget`` are by user;
    ``times_selected`` and ``selected_in_part`` stay by record (what the ledger's records carry).
    """

    user_of: np.ndarray
    spent: np.ndarray
    budget: np.ndarray
    deleted: np.ndarray  # by record
    times_selected: np.ndarray  # by record
    max_records_per_user: int | None = None
    selected_in_part: np.ndarray | None = None  # by record
    charged_in_part: np.ndarray | None = None  # by user
    members: list = field(default_factory=list)  # live ledger indices of each user

    @classmethod
    def from_ledger_state(cls, state, *, budget: float, user_for_missing: str,
                          max_records_per_user: int | None) -> "UserBudgetView":
        keys = user_keys(state.user_id, state.record_id, user_for_missing=user_for_missing)
        n = len(keys)
        user_of = np.full(n, -1, np.int64)
        has = np.array([k is not None for k in keys], dtype=bool)
        n_users = 0
        if has.any():
            # users numbered in order of first appearance (a vectorised np.unique, no per-record Python loop)
            uniq, first, inv = np.unique(keys[has].astype(str), return_index=True, return_inverse=True)
            rank = np.empty(uniq.size, np.int64)
            rank[np.argsort(first, kind="stable")] = np.arange(uniq.size)
            user_of[has] = rank[inv]
            n_users = int(uniq.size)
        spent = np.zeros(n_users)
        np.maximum.at(spent, user_of[has], state.spent[has])  # tombstones included: never refunded
        live = has & ~state.deleted
        order = np.argsort(user_of[live], kind="stable")
        live_idx = np.flatnonzero(live)[order]
        bounds = np.searchsorted(user_of[live_idx], np.arange(n_users + 1))
        members = [live_idx[bounds[u]:bounds[u + 1]] for u in range(n_users)]
        return cls(user_of=user_of, spent=spent, budget=np.full(n_users, float(budget)),
                   deleted=state.deleted.copy(), times_selected=np.zeros(n, np.int64),
                   max_records_per_user=max_records_per_user, members=members)

    def reset_part(self) -> None:
        self.selected_in_part = np.zeros(self.user_of.shape[0], dtype=np.int64)
        self.charged_in_part = np.zeros(self.spent.shape[0], dtype=bool)

    def part_charges(self) -> tuple[np.ndarray, np.ndarray]:
        """(ledger indices to write a charge row for, times each was selected): every live record of every
        user charged since reset_part(), so that each carries its user's spent."""
        if self.charged_in_part is None or not self.charged_in_part.any():
            return np.empty(0, np.int64), np.empty(0, np.int64)
        users = np.flatnonzero(self.charged_in_part)
        idx = np.sort(np.concatenate([self.members[u] for u in users] + [np.empty(0, np.int64)]))
        return idx, self.selected_in_part[idx]

    def record_spent(self, ledger_idx: np.ndarray) -> np.ndarray:
        return self.spent[self.user_of[ledger_idx]]

    def answer_one(self, **kw) -> QueryAnswer:
        return answer_one_user(budgets=self, **kw)


def answer_one_user(
    *,
    cand_ledger_idx: np.ndarray,
    cand_kappa: np.ndarray,
    cand_labels: np.ndarray,
    reuse_votes: np.ndarray,
    params,
    n_classes: int,
    budgets: UserBudgetView,
    rng: np.random.Generator,
) -> QueryAnswer:
    """SPEC §9 for one query (rounding against the user, §8); the same draws, in the same order, as §2."""
    c1 = params.c1
    users = budgets.user_of[cand_ledger_idx]
    keep = (users >= 0) & ~budgets.deleted[cand_ledger_idx]
    k = budgets.max_records_per_user
    if k is not None and keep.any():
        # the k largest κ of each user (ties: the lower ledger index); depends on u's records and q_t only
        pos = np.flatnonzero(keep)
        order = np.lexsort((cand_ledger_idx[pos], -cand_kappa[pos], users[pos]))
        srt = pos[order]
        su = users[srt]
        starts = np.r_[0, np.flatnonzero(su[1:] != su[:-1]) + 1]
        rank = np.arange(srt.size) - np.repeat(starts, np.diff(np.r_[starts, srt.size]))
        keep = np.zeros_like(keep)
        keep[srt[rank < k]] = True
    pos = np.flatnonzero(keep)
    uniq, inv, m = np.unique(users[pos], return_inverse=True, return_counts=True)
    sp = budgets.spent[uniq]
    bud = budgets.budget[uniq]
    # Step 1: eligibility and the count charge m²·c1 (m = 1: c1 exactly, as the record unit).
    mf = m.astype(np.float64)
    count_cost = np.where(m == 1, c1, np.nextafter(mf * mf * c1, np.inf))
    after_count = np.nextafter(sp + count_cost, np.inf)
    eligible = after_count <= bud
    # Step 2: noisy count over eligible users' records, on the release grid.
    z = rng.standard_normal()
    k_t = release_count(float(m[eligible].sum()) + params.sigma1 * z, k_min=params.k_min)
    # Step 3: scale each user's vote vector as a whole to fit what is left.
    remaining = np.maximum(np.nextafter(bud - after_count, -np.inf), 0.0)
    cap = params.sigma2 * np.sqrt(2.0 * k_t * remaining) * (1.0 - 1e-9)
    kap = cand_kappa[pos]
    lab = cand_labels[pos]
    s = np.zeros((uniq.size, n_classes))
    np.add.at(s, (inv, lab), kap)
    single = np.zeros(uniq.size)
    single[inv] = kap  # for m = 1 the only κ: ‖s‖ is κ itself, no sqrt of a square
    norm = np.where(m == 1, single, np.sqrt((s * s).sum(axis=1)))
    c = np.minimum(norm, cap)
    cost = np.nextafter(c * c / (2.0 * params.sigma2 * params.sigma2 * k_t) * (1.0 + 1e-12), np.inf)
    new = np.nextafter(after_count + cost, np.inf)
    over = new > bud
    if over.any():  # rounding edge: vote with weight 0 (cost 0) rather than overspend
        c = np.where(over, 0.0, c)
        new = np.where(over, after_count, new)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.where(norm > 0, c / norm, 0.0)
    w = np.where(m[inv] == 1, c[inv], kap * scale[inv])
    ok = eligible[inv]
    budgets.spent[uniq[eligible]] = new[eligible]
    sel = cand_ledger_idx[pos[ok]]
    budgets.times_selected[sel] += 1
    if budgets.selected_in_part is not None:
        budgets.selected_in_part[sel] += 1
        budgets.charged_in_part[uniq[eligible]] = True
    # Step 4-5: votes + reuse + N(0, σ2² K) per class; argmax.
    votes = np.bincount(lab[ok], weights=w[ok], minlength=n_classes).astype(np.float64) + reuse_votes
    return release_answer(votes, k_t=k_t, params=params, rng=rng)
