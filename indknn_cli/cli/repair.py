"""`indknn repair`: quarantine a damaged ledger's unreadable or unchained events, retire every record; no refund."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..wording import count
from .common import check_lock_timeout, emit_json, resolve_ledger, resolve_store, run_library_call, stderr_console


def _load() -> None:
    """Import the library (numpy, pyarrow, zarr, scipy, ...) when the command runs, not at `indknn --help`: the
    names are this module's globals, declared here."""
    global repair_ledger
    from ..ledger_repair import repair_ledger


def repair_command(
    store: Optional[str] = typer.Option(None, "--store", help="Feature store the ledger is bound to (else $INDKNN_STORE, ./indknn-store.zarr)."),
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="Ledger folder (else $INDKNN_LEDGER, ./indknn-ledger)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what repair would quarantine and retire; write nothing."),
    lock_timeout: float = typer.Option(60.0, "--lock-timeout", help="Seconds to wait for the ledger lock."),
) -> None:
    """Repair a ledger that is refused (truncated or edited event, broken chain, rolled back): keep the longest
    verified prefix of events, move the rest to quarantine/, and retire every record (spent = B) with one
    `repair` event. Costs utility, never privacy: no spent budget goes down. A healthy ledger is left as it is.

    CURRENT naming a snapshot that is missing (or unreadable) is written back to the newest snapshot of this store's
    ledger first, and event files a killed repair left in .repair-probe-*/ are put back; when the ledger then
    verifies against the store's high-water mark, nothing is retired.

    stdout: one JSON line. Exit codes: 0 repaired or nothing to repair; 1 the snapshot or its answers file is
    damaged or missing, or none is left (restore the ledger folder from a backup); 2 bad input (no ledger, a
    ledger of another store).
    """
    _load()
    err = stderr_console()

    def call():
        check_lock_timeout(lock_timeout)
        return repair_ledger(ledger_path=resolve_ledger(ledger), store_path=resolve_store(store), dry_run=dry_run,
                             lock_timeout=lock_timeout)

    result = run_library_call(call)
    emit_json(result.as_dict())
    if result.events_put_back:
        err.print(escape(f"a repair killed while it probed had left {count(len(result.events_put_back), 'event file')} "
                         f"aside; {'would put' if result.dry_run else 'put'} them back into events/"))
    if result.current_written_back is not None:
        err.print(escape(f"CURRENT was unreadable or named a snapshot that is missing; "
                         f"{'would write' if result.dry_run else 'wrote'} it "
                         f"back to generation {result.current_written_back}, the newest snapshot of this store's ledger (the old "
                         "CURRENT is kept in quarantine/)"))
    if not result.repaired:
        err.print("the ledger verifies: nothing to repair")
    elif (result.current_written_back is not None or result.events_put_back) and not result.records_retired \
            and not result.quarantined and not result.store_rows_added_retired:
        err.print("the ledger then verified against the store's high-water mark: nothing retired, no budget refunded")
    else:
        verb = "would quarantine" if result.dry_run else "quarantined"
        err.print(escape(f"[OPERATOR ONLY] {verb} {count(len(result.quarantined), 'event file')}; "
                         f"{count(result.records_retired, 'record')} "
                         f"retired (spent = B) and {count(result.store_rows_added_retired, 'store row')} brought in "
                         "retired: utility lost, no budget refunded"))
        if result.rows_erased_again:
            err.print(escape(f"{count(result.rows_erased_again, 'store row')} held records the ledger had erased (a store "
                             f"restored from an older copy): {'would be ' if result.dry_run else ''}erased again"))
        if result.rows_left_out_other_user:
            err.print(escape(f"{count(result.rows_left_out_other_user, 'store row')} held a record id of another user (an "
                             "erased id embedded again under someone else): left out of the ledger, as serving does; "
                             "the tombstone stays with its user"))
        if result.answers_recovered:
            err.print(escape(f"{count(result.answers_recovered, 'released answer')} of the quarantined events kept "
                             "(still counted in queries answered; a re-run batch returns them)"))
        if result.answers_not_recovered:
            err.print(escape(f"warning: the store's high-water mark counted {count(result.answers_not_recovered, 'more answer')} "
                             "than the repaired ledger holds (a rolled-back copy or unreadable events): they stay "
                             "counted in queries answered, but which queries they answered is lost; re-run those "
                             "batches under a new --batch-id, or their lost queries are answered again with fresh "
                             "noise"))
        if result.unreadable_events:
            err.print(escape(f"warning: {count(len(result.unreadable_events), 'quarantined event')} cannot be read "
                             f"({', '.join(result.unreadable_events)}): answers they released, if any, are no longer "
                             "counted in queries answered; lower --max-queries by what you know was released"))
