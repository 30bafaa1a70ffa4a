"""History figures cached in the ledger (issue 21: a year of cron keeps `serve-queries` and `account` flat).

Every serve event records, in ``state_after``, the figures of the state it leads to (records, active,
deleted, spent median), so that replay never computes an O(N) median per event. It also records the
realised ε of that median under the ledger's own conversion and δ (``realised_epsilon_median``),
computed once when the event is written (one conversion, ~1 ms): `account` then shows the history of a
year of daily batches without converting hundreds of medians again. Only the ledger's own (conversion,
δ, B) is cached; `account --delta/--conversion` with other values converts as before.

Realised ε is a descriptive figure (SPEC §8), never a second guarantee; the cache changes no figure:
:func:`history_epsilons` applies to the cached values exactly the monotone fix and the cap that
``report.realised_loss`` applies to the values it converts (tests/test_scale.py compares them).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .accounting import epsilon_for_budget
from .errors import LedgerError

#: Figures of the state after each serve event kept in the history (account's plot).
HISTORY_STATS = ("records_active", "records_deleted", "records", "spent_median")
#: state_after / history key of the cached realised ε of the spent median: {"epsilon", "conversion", "delta",
#: "budget"} (the conversion it was computed under).
REALISED_KEY = "realised_epsilon_median"


def history_stats(s, c1: float) -> dict:
    """The history figures of a ledger state (O(N): a median over every record's spent)."""
    return {"records_active": int(s.active_mask(c1).sum()), "records_deleted": int(s.deleted.sum()),
            "records": len(s), "spent_median": float(np.median(s.spent)) if len(s) else 0.0}


def realised_median(spent_median: float, *, budget: float, delta: float, conversion: str) -> dict:
    """The cached realised ε of one history point: the conversion of min(max(median, 0), B), as
    ``report.realised_loss`` converts it."""
    s = min(max(float(spent_median), 0.0), float(budget))
    eps = float(epsilon_for_budget(budget=s, delta=float(delta), conversion=str(conversion)))
    return {"epsilon": eps, "conversion": str(conversion), "delta": float(delta), "budget": float(budget)}


def with_realised(stats: dict, params) -> dict:
    """``state_after`` of a serve event: the history figures plus the cached realised ε of the median."""
    if not stats:
        return stats
    return dict(stats, **{REALISED_KEY: realised_median(stats["spent_median"], budget=params.budget,
                                                        delta=params.delta, conversion=params.conversion)})


def has_stats(stats) -> bool:
    """Whether an event's ``state_after`` carries the history figures (events written before it did not)."""
    return isinstance(stats, dict) and set(HISTORY_STATS) <= set(stats)


def history_entry(info: dict, stats: dict, *, time: float, answers: int) -> dict:
    """One LedgerState.history point of a replayed or committed serve event."""
    entry = {"seq": info.get("seq"), "time": time, "batch_id": info.get("batch_id"), "part": info.get("part"),
             "answers": answers, **{k: stats[k] for k in HISTORY_STATS}}
    if isinstance(stats.get(REALISED_KEY), dict):
        entry[REALISED_KEY] = stats[REALISED_KEY]
    return entry


def _cached(h: dict, *, budget: float, delta: float, conversion: str) -> float | None:
    c = h.get(REALISED_KEY)
    if not (isinstance(c, dict) and c.get("conversion") == conversion and c.get("delta") == delta
            and c.get("budget") == budget and isinstance(c.get("epsilon"), (int, float))):
        return None
    return float(c["epsilon"])


def history_epsilons(hist: list[dict], *, budget: float, delta: float, conversion: str) -> np.ndarray | None:
    """Realised ε of every history point's spent median from the cache, or None when a point lacks it
    (an event written before the cache, or another conversion or δ than the ledger's).

    As ``report.realised_loss`` does with converted values: non-decreasing in the median (the computed
    conversion is monotone only up to ~1e-13) and never above ε(B).
    """
    vals = [_cached(h, budget=budget, delta=delta, conversion=conversion) for h in hist]
    if any(v is None for v in vals):
        return None
    s = np.clip(np.asarray([float(h.get("spent_median", 0.0)) for h in hist], dtype=np.float64), 0.0, budget)
    if s.size == 0:
        return s.copy()
    uniq, first, inv = np.unique(s, return_index=True, return_inverse=True)
    per_median = np.asarray(vals, dtype=np.float64)[first]
    cap = epsilon_for_budget(budget=float(budget), delta=delta, conversion=conversion)
    per_median = np.minimum(np.maximum.accumulate(per_median), cap)
    return per_median[inv.reshape(s.shape)]


#: Key of the answers file's footer metadata holding :func:`answers_summary` (JSON).
SUMMARY_KEY = b"indknn_answers_summary"


def _add_label_counts(counts: dict[str, int], column) -> None:
    """Add one label_name column's counts to ``counts`` (value_counts keeps the order of first appearance)."""
    import pyarrow.compute as pc

    vc = pc.value_counts(column)
    for name, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
        if name is not None:
            counts[name] = counts.get(name, 0) + int(n)


def _clamp_counts(column, k_min: float) -> tuple[int, int]:
    """(answers with a finite released count K_t, those with K_t ≤ K_min) of one released_count column."""
    k = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
    k = k[np.isfinite(k)]
    return int(k.size), int(np.count_nonzero(k <= float(k_min)))


def answers_summary(tables, *, k_min: float | None) -> dict:
    """What `account` reads of every answer, summed once when a compaction writes the answers file (issue 21:
    `account` after a year of cron reads no column of the snapshot's answers): the row count, the answers per
    label name in first-seen order and, for the ledger's ``k_min``, the K_min clamp counts. Kept in the file's
    footer, so the file's sha256 (in the snapshot's hash chain) covers it; a summary that disagrees with the
    footer's row count is ignored and the columns are read instead."""
    counts: dict[str, int] = {}
    rows = finite = at = seeded = 0
    for t in tables:
        rows += t.num_rows
        _add_label_counts(counts, t.column("label_name"))
        seeded += _seeded(t.column("seed"))
        if k_min is not None:
            f, a = _clamp_counts(t.column("released_count"), k_min)
            finite, at = finite + f, at + a
    out = {"rows": rows, "label_counts": [[name, n] for name, n in counts.items()], "seeded": seeded}
    if k_min is not None:
        out.update(k_min=float(k_min), released_finite=finite, at_k_min=at)
    return out


def _seeded(column) -> int:
    """Answers of one ``seed`` column released by a seeded run (their noise is recomputable from the seed)."""
    return int(len(column) - column.null_count)


def seeded_answers(state) -> int:
    """Answers released with a fixed ``--seed`` (review 73, F0: the seed is printed with each answer, so whoever
    reads them can recompute the noise; `account` says the guarantee does not cover them)."""
    src = state._answers_src
    n = int(getattr(state, "seeded_not_held", 0))  # released, in events a repair could not recover
    if src is not None and src.summary is not None and "seeded" in src.summary:
        n += int(src.summary["seeded"])
    elif src is not None:  # a snapshot from before the footer counted them: its column, read once per open
        if getattr(src, "_seeded_n", None) is None:  # (review 75, F6: the mark counts them at every commit)
            src._seeded_n = _seeded(src.column("seed"))
        n += src._seeded_n
    return n + sum(_seeded(t.column("seed")) for t in state._answers_parts)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _valid_summary(s, rows: int) -> bool:
    """The shape :func:`answers_summary` writes, consistent with the file's ``rows``; anything else is ignored."""
    if not isinstance(s, dict) or s.get("rows") != rows or not isinstance(s.get("label_counts"), list):
        return False
    pairs = s["label_counts"]
    if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and _count(p[1]) for p in pairs):
        return False
    if sum(p[1] for p in pairs) > rows or ("seeded" in s and not (_count(s["seeded"]) and s["seeded"] <= rows)):
        return False
    if "k_min" in s:
        k, f, a = s.get("k_min"), s.get("released_finite"), s.get("at_k_min")
        if not (isinstance(k, float) and _count(f) and _count(a) and a <= f <= rows):
            return False
    return True


class LazyAnswers:
    """A snapshot's answers file: its row count (and summary) from the Parquet footer at open, the rows parsed
    on first use.

    `account` and a serve of a new batch read only the count and the footer's :func:`answers_summary` (or,
    in a file written before it, one column for the label counts); the bytes are hashed at open all the same
    (ledger_integrity.check_snapshot), so an edited file is refused.
    """

    def __init__(self, data: bytes | None, *, where: str = "answers", table: pa.Table | None = None):
        self.where, self._data, self._table = where, data, table
        self.summary: dict | None = None
        if table is not None:
            self.num_rows = table.num_rows
        else:  # the footer: a truncated or foreign file is refused at open, as before
            md = pq.read_metadata(pa.BufferReader(data))
            self.num_rows = md.num_rows
            raw = (md.metadata or {}).get(SUMMARY_KEY)
            try:
                summary = json.loads(raw) if raw is not None else None
            except ValueError:
                summary = None
            if _valid_summary(summary, self.num_rows):
                self.summary = summary

    def distrust_summary(self) -> None:
        """Read the columns, not the footer's summary (a snapshot outside the hash chain: nothing checks it)."""
        self.summary = None

    @classmethod
    def of(cls, table: pa.Table | None) -> "LazyAnswers | None":
        return None if table is None or not table.num_rows else cls(None, table=table)

    def _read(self, columns=None) -> pa.Table:
        try:
            return pq.read_table(pa.BufferReader(self._data), columns=columns).replace_schema_metadata(None)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt ledger file
            raise LedgerError(f"{self.where}: corrupt or truncated Parquet ({type(exc).__name__})") from None

    def table(self) -> pa.Table:
        if self._table is None:
            self._table = self._read()
            self._data = None
        return self._table

    def column(self, name: str):
        return self._table.column(name) if self._table is not None else self._read([name]).column(0)


def answer_label_counts(state) -> dict[str, int]:
    """Answers released per label name, in first-seen order, without a Python object per answer: the
    snapshot's answers and those of each event replayed since are counted by Arrow from their one column
    (value_counts keeps the order of first appearance; merged in ledger order)."""
    counts: dict[str, int] = {}
    src = state._answers_src
    if src is not None and src.summary is not None:
        for name, n in src.summary["label_counts"]:
            counts[str(name)] = counts.get(str(name), 0) + int(n)
    elif src is not None:
        _add_label_counts(counts, src.column("label_name"))
    for t in state._answers_parts:
        _add_label_counts(counts, t.column("label_name"))
    return counts


def check_answers_summary(state) -> str:
    """`account --verify`: the snapshot's footer summary (what `account` reads instead of the columns) against a
    count of the columns themselves. Returns "checked" or "absent"; a mismatch (a summary written wrong, the
    file's hash then agreeing with it) is a LedgerIntegrityError."""
    from .errors import LedgerIntegrityError

    src = state._answers_src
    if src is None or src.summary is None:
        return "absent"
    # counted here, not by answers_summary: a fault in the function that wrote the summary must show
    counts: dict[str, int] = {}
    _add_label_counts(counts, src.column("label_name"))
    ok = [[name, n] for name, n in counts.items()] == [list(p) for p in src.summary["label_counts"]]
    ok = ok and ("seeded" not in src.summary or _seeded(src.column("seed")) == src.summary["seeded"])
    if ok and "k_min" in src.summary:
        finite, at = _clamp_counts(src.column("released_count"), src.summary["k_min"])
        ok = (finite, at) == (src.summary["released_finite"], src.summary["at_k_min"])
    if not ok:
        raise LedgerIntegrityError(f"{src.where}: the answer counts in its footer do not match its rows (account "
                                   "would print them); `indknn delete --compact` rewrites them from the rows")
    return "checked"


def answer_clamp_counts(state, k_min: float) -> tuple[int, int]:
    """(answers with a finite released count K_t, those at or below the K_min clamp), over every answer: the
    snapshot's from its footer summary when it was written for this ``k_min``, else from its column."""
    finite = at = 0
    src = state._answers_src
    if src is not None and src.summary is not None and src.summary.get("k_min") == float(k_min):
        finite, at = int(src.summary["released_finite"]), int(src.summary["at_k_min"])
    elif src is not None:
        finite, at = _clamp_counts(src.column("released_count"), k_min)
    for t in state._answers_parts:
        f, a = _clamp_counts(t.column("released_count"), k_min)
        finite, at = finite + f, at + a
    return finite, at
