"""What a ledger holds, in memory: the mechanism's parameters, the file schemas and the per-record state.

:class:`PrivacyParams` fixes the mechanism (stored in the ledger's metadata); :class:`LedgerState` is the
snapshot plus the events replayed since, as arrays indexed by ledger index (the files: docs/FORMAT.md).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa

from . import ledger_history, rounding
from .errors import BadInputError, LedgerError
from .unit_options import check_unit_options
from .wording import count


KERNELS = ("cosine", "rbf")


@functools.lru_cache(maxsize=256)
def count_charge(sigma1: float) -> float:
    """c1 = 1/(2σ1²) (SPEC §2, the noisy count's Gaussian mechanism), rounded up: never below the exact value for
    the float σ1 (SPEC §8, costs rounded against the user).

    The float formula rounds twice (σ1², then the division), so one step up (``nextafter``) is not always enough:
    about 1 % of σ1 values left it an ulp short (audit 2026-11-27, e.g. σ1 = 16.956463439532442). It is compared
    with the exact rational value: where it is already above, nothing changes; else the exact value correctly
    rounded, stepped up once if it rounded down.
    """
    c = math.nextafter(1.0 / (2.0 * sigma1 * sigma1), math.inf)
    if not (isinstance(sigma1, (int, float)) and math.isfinite(sigma1) and sigma1 != 0 and math.isfinite(c)):
        return c  # refused by validate (check_range)
    exact = Fraction(1) / (2 * Fraction(sigma1) ** 2)
    if Fraction(c) >= exact:
        return c
    c = float(exact)  # correctly rounded (σ1² overflowing, far outside check_range, lands here too): at most one step
    return c if Fraction(c) >= exact else math.nextafter(c, math.inf)


@dataclass(frozen=True)
class PrivacyParams:
    """Everything that fixes the mechanism; stored in the ledger metadata."""

    epsilon: float
    delta: float
    conversion: str
    budget: float
    kernel: str
    tau: float
    sigma1: float
    sigma2: float
    nu: float | None
    k_min: float
    planned_queries: int | None
    #: The privacy unit (SPEC §9): "record" (default; every ledger before the user unit) or "user".
    privacy_unit: str = "record"
    #: user unit: only the k largest κ of a user count per query (None: all of them).
    max_records_per_user: int | None = None
    #: user unit: records without a user id are refused ("refuse") or each is its own user ("record").
    user_for_missing: str = "refuse"

    @property
    def c1(self) -> float:
        """Charge of the noisy count, 1/(2σ1²), rounded up (SPEC §2): :func:`count_charge`."""
        return count_charge(self.sigma1)

    def validate(self) -> "PrivacyParams":
        """Every parameter finite and inside its documented range (accounting.PARAM_RANGES); else BadInputError."""
        from .accounting import CONVERSIONS, check_range

        if self.kernel not in KERNELS:
            raise BadInputError(f"kernel must be cosine or rbf, got {self.kernel!r}")
        if self.conversion not in CONVERSIONS:
            raise BadInputError(f"conversion must be one of {', '.join(CONVERSIONS)}, got {self.conversion!r}")
        if not (isinstance(self.tau, (int, float)) and 0.0 < self.tau < 1.0):
            raise BadInputError(f"tau must lie in (0, 1) for the {self.kernel} kernel, got {self.tau!r}")
        for name in ("epsilon", "delta", "sigma1", "sigma2", "k_min"):
            check_range(name, getattr(self, name))
        v = self.budget
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise BadInputError(f"budget must be a positive finite number, got {v!r}")
        if self.kernel == "rbf" and not (isinstance(self.nu, (int, float)) and math.isfinite(self.nu) and self.nu > 0):
            raise BadInputError(f"nu must be positive for the rbf kernel, got {self.nu!r}")
        if self.nu is not None:
            check_range("nu", self.nu)
        if self.planned_queries is not None:
            if not isinstance(self.planned_queries, numbers.Integral) or isinstance(self.planned_queries, bool):
                raise BadInputError(f"planned_queries must be an integer, got {self.planned_queries!r}")
            check_range("planned_queries", self.planned_queries)
        check_unit_options(privacy_unit=self.privacy_unit, max_records_per_user=self.max_records_per_user,
                           user_for_missing=self.user_for_missing)
        if self.c1 > self.budget:
            raise BadInputError(
                f"sigma1={self.sigma1} makes one count charge 1/(2σ1²)={rounding.up(self.c1)} exceed the budget B={rounding.up(self.budget)}"
            )
        return self

    def as_dict(self) -> dict:
        return asdict(self)


RECORD_SCHEMA = pa.schema([
    ("record_id", pa.string()), ("user_id", pa.string()), ("row", pa.int64()),
    ("budget", pa.float64()), ("spent", pa.float64()), ("times_selected", pa.int64()),
    ("status", pa.string()), ("deleted", pa.bool_()), ("deleted_at", pa.float64()),
    ("last_change", pa.float64()),
])
ANSWER_SCHEMA = pa.schema([
    ("batch_id", pa.string()), ("part", pa.int64()), ("query_index", pa.int64()),
    ("query_id", pa.string()), ("query_row", pa.int64()), ("label", pa.int32()),
    ("label_name", pa.string()), ("released_count", pa.float64()), ("seed", pa.string()),
])
EVENT_SCHEMA = pa.schema([
    ("kind", pa.string()),            # add | charge | delete | answer
    ("ledger_index", pa.int64()),     # position of the record in the ledger (stable forever)
    ("record_id", pa.string()), ("user_id", pa.string()), ("row", pa.int64()),
    ("budget", pa.float64()), ("spent_after", pa.float64()), ("selected", pa.int64()),
    ("batch_id", pa.string()), ("part", pa.int64()), ("query_index", pa.int64()),
    ("query_id", pa.string()), ("query_row", pa.int64()), ("label", pa.int32()),
    ("label_name", pa.string()), ("released_count", pa.float64()), ("seed", pa.string()),
])


#: Float columns of an event that must be finite (a NaN spent would compare False against B forever).
FINITE_COLUMNS = ("spent_after", "budget", "released_count")


def _float_values(vals) -> tuple[np.ndarray, np.ndarray]:
    """(values, present) of a float column given as a list (None: absent), a numpy array or a pyarrow array."""
    if isinstance(vals, (pa.Array, pa.ChunkedArray)):
        present = vals.is_valid().to_numpy(zero_copy_only=False).astype(bool)
        return np.asarray(vals.fill_null(0.0).to_numpy(zero_copy_only=False), dtype=np.float64), present
    if isinstance(vals, np.ndarray) and vals.dtype.kind == "f":
        return vals.astype(np.float64, copy=False), np.ones(vals.shape[0], dtype=bool)
    vals = list(vals)
    return (np.asarray([np.nan if v is None else v for v in vals], dtype=np.float64),
            np.asarray([v is not None for v in vals], dtype=bool))


def _check_finite_columns(path: Path, event_type: str, columns: dict) -> None:
    """Refuse (LedgerError, nothing written) an event whose spent, budget or released count is NaN or ±inf."""
    for name in FINITE_COLUMNS:
        vals = columns.get(name)
        if vals is None:
            continue
        arr, present = _float_values(vals)
        bad = np.flatnonzero(present & ~np.isfinite(arr))
        if bad.size:
            raise LedgerError(f"{path}: refusing to commit a {event_type} event with {name} = "
                              f"{float(arr[bad[0]])!r} (row {int(bad[0])}; {count(int(bad.size), 'non-finite value')}); "
                              "nothing was written")


@dataclass
class LedgerState:
    """In-memory state: arrays indexed by ledger index."""

    record_id: np.ndarray
    user_id: np.ndarray
    row: np.ndarray
    budget: np.ndarray
    spent: np.ndarray
    times_selected: np.ndarray
    deleted: np.ndarray
    deleted_at: np.ndarray
    last_change: np.ndarray
    batches: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    #: Answers released that no event holds any more (a repair after a rollback or an unreadable event: the
    #: store's high-water mark counted them). Counted in queries answered, so that figure never goes down.
    answers_not_held: int = 0
    #: Of those, answers released with a fixed --seed (the mark counted them: review 74, F3).
    seeded_not_held: int = 0
    #: The store's state at the latest commit that recorded it: {"store_uuid", "version"} (store_versions.py).
    store_seen: dict | None = None
    #: Store rows an erasure recorded while the store's writer lease was held elsewhere (review 67, F1): their
    #: tombstones are committed but the rows not yet flagged nor overwritten: {"store_uuid", "rows"}. Never
    #: candidates nor added back (:func:`indknn_cli.deletion_deferred.rows`); the next writer holding the lease
    #: erases them. Kept after that (a flagged row is no longer pending); another store uuid (a compaction) voids it.
    rows_to_erase: dict | None = None
    #: Store rows the ledger's erasures overwrote, in the numbering of one store uuid: {"store_uuid", "rows"}
    #: (review 72, F1). Rows are never reused (an append goes past the last row), so one of them holding data again
    #: is a chunk restored from a backup older than its erasure: never added back, whatever the store's own
    #: erased-ids log (an unsealed file) says (:func:`indknn_cli.store_erased_ids.in_ledger`). Another uuid (a
    #: compaction renumbered the rows) replaces it.
    erased_rows: dict | None = None
    # Answers released: the snapshot's (ledger_history.LazyAnswers: an Arrow table parsed on first use) plus one
    # Arrow table per event replayed or committed since. No Python object per answer unless someone asks for
    # ``answers`` (issue 21: a 2,000,000-query run holds its answers as Arrow columns, ~100 bytes each).
    _answers_src: ledger_history.LazyAnswers | None = field(default=None, repr=False)
    _answers_parts: list = field(default_factory=list, repr=False)
    _batch_set: set | None = field(default=None, repr=False)

    @property
    def _answers_base(self) -> pa.Table | None:
        return None if self._answers_src is None else self._answers_src.table()

    @_answers_base.setter
    def _answers_base(self, table: pa.Table | None) -> None:
        self._answers_src = ledger_history.LazyAnswers.of(table)

    @property
    def answers(self) -> dict[str, list]:
        """Every answer released, column → list (a new dict of Python objects each time: prefer the methods
        below)."""
        return self.answers_table().to_pydict()

    @answers.setter
    def answers(self, value: dict[str, list]) -> None:
        self._answers_src = None
        self._answers_parts = [pa.table({n: pa.array(value[n], type=ANSWER_SCHEMA.field(n).type)
                                         for n in ANSWER_SCHEMA.names}, schema=ANSWER_SCHEMA)]

    def extend_answers(self, table: pa.Table) -> None:
        """Keep an event's answer rows (their own buffers, ANSWER_SCHEMA columns, no event metadata)."""
        if table.num_rows:
            part = table.select(ANSWER_SCHEMA.names).replace_schema_metadata(None).cast(ANSWER_SCHEMA)
            self._answers_parts.append(part)

    def _new_answers(self) -> pa.Table:
        """The answers of the events since the snapshot, one table (ANSWER_SCHEMA)."""
        if not self._answers_parts:
            return ANSWER_SCHEMA.empty_table()
        return pa.concat_tables(self._answers_parts)

    def answers_released(self) -> int:
        """Answers released through the ledger: those it holds plus those a repair could not recover."""
        return self.n_answers() + int(self.answers_not_held)

    def n_answers(self) -> int:
        base = 0 if self._answers_src is None else self._answers_src.num_rows
        return base + sum(t.num_rows for t in self._answers_parts)

    def answer_column(self, name: str, dtype=None) -> np.ndarray:
        """One answers column as an array (Arrow → NumPy, no per-value Python objects; the snapshot's answers
        file is parsed for this one column only unless its table is already loaded)."""
        parts = []
        if self._answers_src is not None:
            parts.append(np.asarray(self._answers_src.column(name).to_numpy(zero_copy_only=False), dtype=dtype))
        parts += [np.asarray(t.column(name).to_numpy(zero_copy_only=False), dtype=dtype)
                  for t in self._answers_parts]
        if not parts:
            return np.asarray([], dtype=dtype)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def answers_table_for(self, batch_id: str) -> pa.Table:
        """The answers released under ``batch_id`` (ANSWER_SCHEMA), in ledger order."""
        import pyarrow.compute as pc

        tables = []
        if self._answers_base is not None:
            base = self._answers_base.select(ANSWER_SCHEMA.names).cast(ANSWER_SCHEMA)
            tables.append(base.filter(pc.equal(base.column("batch_id"), batch_id)))
        if self._answers_parts:
            new = self._new_answers()
            tables.append(new.filter(pc.equal(new.column("batch_id"), batch_id)))
        if not tables:
            return ANSWER_SCHEMA.empty_table()
        return pa.concat_tables(tables)

    def answers_for(self, batch_id: str) -> dict[str, list]:
        return self.answers_table_for(batch_id).to_pydict()

    def add_batch(self, batch_id) -> None:
        if self._batch_set is None or len(self._batch_set) != len(self.batches):
            self._batch_set = set(self.batches)
        if batch_id not in self._batch_set:
            self.batches.append(batch_id)
            self._batch_set.add(batch_id)

    def __len__(self) -> int:
        return len(self.record_id)

    @classmethod
    def empty(cls) -> "LedgerState":
        return cls(np.empty(0, object), np.empty(0, object), np.empty(0, np.int64), np.empty(0),
                   np.empty(0), np.empty(0, np.int64), np.empty(0, bool), np.empty(0), np.empty(0))

    def active_mask(self, c1: float) -> np.ndarray:
        """Not deleted and able to pay the next count charge: up(spent + c1) ≤ B."""
        nxt = np.nextafter(self.spent + c1, np.inf)
        return (~self.deleted) & (nxt <= self.budget) & (self.row >= 0)

    def status(self, c1: float) -> np.ndarray:
        out = np.where(self.deleted, "deleted", "retired").astype(object)
        out[self.active_mask(c1)] = "active"
        return out

    def answer_tables(self):
        """The answers as a sequence of tables of ANSWER_SCHEMA (the snapshot's, then one per event since)."""
        if self._answers_base is not None:
            yield self._answers_base.select(ANSWER_SCHEMA.names).cast(ANSWER_SCHEMA)
        yield from self._answers_parts

    def answers_table(self) -> pa.Table:
        new = self._new_answers()
        if self._answers_base is None:
            return new.combine_chunks()
        base = self._answers_base.select(ANSWER_SCHEMA.names).cast(new.schema)
        return pa.concat_tables([base, new]).combine_chunks()
