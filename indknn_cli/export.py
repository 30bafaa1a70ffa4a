"""`account --export FILE.parquet|.csv`: the current per-record state for a reviewer's spreadsheet or duckdb.

OPERATOR ONLY: every row carries exact, noise-free figures of the private data (spent budgets, times selected,
status). Never hand it to query-senders (SPEC §8).

The ledger's snapshot holds the state *before* its events; this export is the state after all of them, one row
per record (deleted ones included, as tombstones), with the ledger-wide parameters repeated as columns so one
file answers "what was promised and where does each record stand".
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .accounting import CONVERSIONS
from .errors import BadInputError

EXPORT_NOTE = "operator only: exact private figures (never for query-senders)"


def check_export_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.suffix.lower() not in (".parquet", ".csv"):
        raise BadInputError(f"--export {p}: the file name must end in .parquet or .csv")
    if not p.parent.is_dir():
        raise BadInputError(f"--export: folder {p.parent} does not exist")
    return p


def export_account(*, ledger_path: str | os.PathLike, out: str | os.PathLike, delta: float | None = None,
                   conversion: str | None = None, store_path: str | os.PathLike | None = None) -> dict:
    """Write one row per record: id, user, status, spent, budget, remaining, realised ε by conversion, times
    selected, last change and deletion time (UTC timestamps), and ε, δ, B, conversion, unit, adjacency."""
    import pyarrow as pa

    from .ledger_readonly import open_ledger_readonly
    from .report import build_account_report, realised_loss, unit_figures

    from .answers_out import refuse_output_over

    path = check_export_path(out)
    # validates options; --store (a copied store and ledger): checked against that store, not the recorded path
    report = build_account_report(ledger_path=ledger_path, store_path=store_path, delta=delta, conversion=conversion)
    d = report.data
    ledger = open_ledger_readonly(ledger_path)
    # a read-only command wrote its export over the ledger's snapshot (review 38, F1): never into ledger or store
    refuse_output_over(path, option="--export", folders=[("the ledger's folder", ledger_path),
                                                        ("the store's folder", ledger.meta.get("store_path")),
                                                        ("the store's folder", store_path)])
    s = ledger.state
    params = ledger.params
    n = len(s)
    c1 = params.c1
    spent = np.asarray(s.spent, dtype=np.float64)
    budget = np.asarray(s.budget, dtype=np.float64)
    deleted = np.asarray(s.deleted, dtype=bool)
    active = s.active_mask(c1) if n else np.zeros(0, bool)
    status = np.where(deleted, "deleted", np.where(active, "active", "retired"))
    B = float(d["budget"])
    tuning_meta = ledger.meta.get("tuning")  # a privately tuned ledger: realised ε composes the search (rdp only)

    def ts(values) -> pa.Array:
        t = np.asarray(values, dtype=np.float64)
        ok = np.isfinite(t)
        us = np.where(ok, np.round(np.where(ok, t, 0) * 1e6), 0).astype(np.int64)
        return pa.array(us, type=pa.timestamp("us", tz="UTC"), mask=~ok)

    cols: dict = {
        "record_id": pa.array([str(x) for x in s.record_id], pa.string()),
        "user_id": pa.array([None if not u else str(u) for u in s.user_id], pa.string()),
        "status": pa.array(status.tolist(), pa.string()),
        "spent": pa.array(spent),
        "budget": pa.array(budget),
        "remaining": pa.array(np.maximum(budget - spent, 0.0)),
    }
    for c in CONVERSIONS:
        cols[f"realised_epsilon_{c}"] = pa.array(
            np.asarray(realised_loss(spent, budget=B, delta=d["delta"], conversion=c, tuning=tuning_meta),
                       dtype=np.float64) if n else np.zeros(0), from_pandas=True)  # NaN → null (gdp, tuned)
    cols["times_selected"] = pa.array(np.asarray(s.times_selected, dtype=np.int64))
    cols["last_change"] = ts(s.last_change)
    cols["deleted_at"] = ts(np.where(deleted, np.asarray(s.deleted_at, dtype=np.float64), np.nan))
    unit = unit_figures(getattr(params, "privacy_unit", "record"))
    if unit["unit"] == "user" and n:  # the user's own spent: the largest over their records, tombstones included
        # the users the filter keeps (user_unit.user_keys): with --user-for-missing record, a record without a
        # user id is its own user, never pooled with the others (audit 9, F4)
        from .user_unit import user_keys

        keys = user_keys([u or "" for u in s.user_id], s.record_id,
                         user_for_missing=getattr(params, "user_for_missing", "refuse"))
        users = np.array(["\0" + str(r) if k is None else str(k) for k, r in zip(keys, s.record_id)], dtype=object)
        _, inv = np.unique(users, return_inverse=True)
        user_spent = np.zeros(inv.max() + 1)
        np.maximum.at(user_spent, inv, spent)
        cols["user_spent"] = pa.array(user_spent[inv])
    for name, value in (("epsilon", d["epsilon"]), ("delta", d["delta"]), ("B", B),
                        ("conversion", d["conversion"]), ("unit", unit["unit"]),
                        ("adjacency", unit["adjacency"]), ("note", EXPORT_NOTE)):
        cols[name] = pa.array([value] * n)
    table = pa.table(cols)
    from .output_files import atomic_output

    with atomic_output(path, option="--export") as fh:  # a random O_EXCL name, never NAME.tmp (review 45, F1)
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, fh)
        else:
            import pyarrow.csv as pacsv

            pacsv.write_csv(table, fh)
    return {"export": str(path), "rows": n, "columns": table.column_names, "note": EXPORT_NOTE}
