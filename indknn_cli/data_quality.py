"""Data-quality warnings for the operator (issue 20): empty texts and thin labels at ``embed``, a τ at which most
public/query rows have no neighbour at ``index``, and the share of released answers at the K_min clamp for
``account``.

Every figure here is computed from the private data (except the clamp share, which is computed from released
answers) and is for the data holder only: ``embed``, ``index`` and ``account`` print them on stderr (or in
``account``'s report); ``serve-queries`` never does, so nothing a query-sender sees depends on them (SPEC §8).
"""

from __future__ import annotations

import numpy as np

from .wording import count

#: A label with fewer records than this gets a warning (the filter rarely finds enough of its neighbours).
MIN_LABEL_RECORDS = 5
#: Public/query rows sampled for the neighbour check at ``index`` (bounded work on any store).
NEIGHBOUR_SAMPLE = 512
#: Warn when more than this share of the sampled rows has no private record with κ ≥ τ.
NO_NEIGHBOUR_SHARE = 0.5
OPERATOR_ONLY = "operator-only figure, from the private data; never shown to query-senders"


def empty_texts(items) -> list[int]:
    """The positions of a batch's text inputs that are empty or only white space (embedded as an empty string)."""
    return [k for k, t in enumerate(items) if isinstance(t, str) and not t.strip()]


def embed_warnings(*, source: str, empty: list[int], labels: np.ndarray | None, label_names) -> list[str]:
    """Warnings after an ``embed``: the rows of ``source`` (1-based) with an empty text; labels of the role's live
    rows in the store (``labels``: their label indices) with fewer than :data:`MIN_LABEL_RECORDS` records, a
    declared label with none among them (review 60, F8: it was left out)."""
    out = []
    if empty:
        rows = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        out.append(f"{source}: {count(len(empty), 'empty text')} (row{'s' if len(empty) > 1 else ''} {rows}; "
                   "embedded as the vector of an empty string; check --text-column)")
    if labels is not None and labels.size:
        counts = np.bincount(labels.astype(np.int64), minlength=len(label_names))
        thin = [(str(label_names[i]), int(c)) for i, c in enumerate(counts) if c < MIN_LABEL_RECORDS]
        if thin:
            shown = ", ".join(f"{name!r} ({count(c, 'record')})" for name, c in thin[:5])
            more = f" and {len(thin) - 5} more" if len(thin) > 5 else ""
            out.append(f"{count(len(thin), 'label')} with fewer than {MIN_LABEL_RECORDS} records: {shown}{more}; "
                       f"such labels are rarely predicted ({OPERATOR_ONLY})")
    return out


def _max_kernel(rows: np.ndarray, private: np.ndarray, *, kernel: str, nu: float | None) -> np.ndarray:
    """Per row, the largest κ to any private vector (unit vectors: ‖x − q‖² = 2 − 2 x·q for the RBF kernel)."""
    best = np.minimum((rows @ private.T).max(axis=1).astype(np.float64), 1.0)
    if kernel == "cosine":
        return best
    return np.exp(-(2.0 - 2.0 * best) / (nu * nu))


def neighbour_warning(store, params) -> str | None:
    """At ``index``: a warning when most public/query rows already in the store have no private record with
    κ ≥ τ (their answers would be noise alone). A sample of at most :data:`NEIGHBOUR_SAMPLE` rows."""
    groups = []
    for role in ("public", "query"):
        n = store.n_rows(role)
        if n:
            take = np.unique(np.linspace(0, n - 1, min(n, NEIGHBOUR_SAMPLE)).astype(np.int64))
            groups.append(store.read(role, "features")[take] if n <= 4 * NEIGHBOUR_SAMPLE else
                          np.stack([store.read(role, "features", int(i), int(i) + 1)[0] for i in take]))
    if not groups:
        return None
    rows = np.concatenate(groups).astype(np.float32)
    rows = rows[np.linspace(0, len(rows) - 1, min(len(rows), NEIGHBOUR_SAMPLE)).astype(np.int64)]
    n_priv = store.n_rows("private")
    if n_priv == 0:
        return None
    live = ~store.read("private", "deleted").astype(bool)
    if getattr(params, "privacy_unit", "record") == "user" and getattr(params, "user_for_missing", "refuse") != "record":
        # rows without a user id stay out of a user-unit ledger: never neighbours (review 45, F6)
        live &= np.array([bool(u) for u in store.read("private", "user_id")], dtype=bool)
    best = np.full(rows.shape[0], -np.inf)
    for lo in range(0, n_priv, 65536):
        block = store.read("private", "features", lo, min(n_priv, lo + 65536)).astype(np.float32)
        block = block[live[lo:lo + block.shape[0]]]
        if block.size:
            best = np.maximum(best, _max_kernel(rows, block, kernel=params.kernel, nu=params.nu))
    share = float(np.mean(best < params.tau))
    if share <= NO_NEIGHBOUR_SHARE:
        return None
    return (f"at τ = {params.tau:g} ({params.kernel}), {100 * share:.0f}% of the public/query rows in the store "
            f"({count(len(rows), 'row')} checked) have no private record with κ ≥ τ: their answers would be "
            f"noise alone; a lower τ (tuned on public data: `indknn bench tune`) may suit ({OPERATOR_ONLY})")


def clamp_share(*, answers: int, at_k_min: int, k_min: float) -> dict:
    """Released answers whose count K_t sits at the K_min clamp (few or no candidates: a noise-only answer is
    likely), from the counts (answers with a finite K_t, those at or below K_min: ledger_history.
    answer_clamp_counts). Operator-only: shown by ``account``, never by ``serve-queries``."""
    return {"answers": int(answers), "at_k_min": int(at_k_min), "share": (at_k_min / answers) if answers else None,
            "k_min": float(k_min), "note": OPERATOR_ONLY}


#: Fewer private records per validation shard than this, and `--tune private` can hardly compare its grid points.
MIN_RECORDS_PER_SHARD = 4


def tuning_size_warning(*, records: int, tuning: dict | None) -> str | None:
    """`index --tune private` on a private set too small for its S shards (docs/TUNING.md, "The base run": each shard
    holds about N/S records, one of them its validation record, the others its P set): a warning naming N, which
    is exact (operator only: index's stderr). Before, 20 records were tuned over 500 shards without a word (review
    42, M2)."""
    if not tuning or tuning.get("mode") != "private":
        return None
    shards = int(tuning.get("validation_queries") or 0)
    if shards <= 0 or records >= MIN_RECORDS_PER_SHARD * shards:
        return None
    return (f"--tune private split {count(records, 'private record')} into S = {shards} validation shards (about "
            f"{records / shards:.2g} per shard; at least {MIN_RECORDS_PER_SHARD} give each shard a record to "
            "validate and others to answer it from): the search could hardly tell its grid points apart, and it "
            f"still took its share of ε. With few records, give fewer shards (--tune-queries "
            f"{max(1, records // 10)}), tune on labelled public rows (--tune public), or give --tau and --sigma2")


def store_warnings(store, role: str, source: str, empty: list[int]) -> list[str]:
    """Issue 20: empty texts in this input; labels of the role's live rows with fewer than a handful of records."""
    labels = None
    if role != "query":
        labels = store.read(role, "labels")[~store.read(role, "deleted").astype(bool)]
    return embed_warnings(source=source, empty=empty, labels=labels, label_names=store.label_names)


def delta_warning(*, subjects: int, delta: float, unit: str) -> str | None:
    """At ``index`` (operator only: it names the exact number of records or users): δ at least 1/N. A mechanism
    that publishes one subject's data in full with probability δ meets (0, δ)-DP, so a δ of that size promises
    little (Dwork & Roth 2014, §2.3: δ "less than the inverse of any polynomial in the size of the database").
    Review 65, F2: `--delta 0.1` on 2,000 records was taken without a word."""
    if subjects <= 0 or delta * subjects < 1.0:
        return None
    return (f"δ = {delta:g} is at least 1/N for the {count(subjects, unit)} of this ledger (operator-only count): at "
            "that δ, publishing one of them in full with probability δ would meet the guarantee too; choose δ well "
            f"below 1/N (for example ≤ {0.01 / subjects:.1g}) when the ledger is made")


def truncated_warning(source: str, rows: list[int], *, limit: int) -> list[str]:
    """After an ``embed``: the rows (1-based) of ``source`` whose text is longer than the text model reads (``limit``
    word pieces): it embeds their start only, so texts that differ after it get the same vector (review 66, F9)."""
    if not rows:
        return []
    shown_rows = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
    return [f"{source}: {count(len(rows), 'text')} longer than the text model reads ({limit} word pieces) "
            f"(row{'s' if len(rows) > 1 else ''} {shown_rows}): each was embedded from its start only, so texts "
            "that differ after it get the same vector"]
