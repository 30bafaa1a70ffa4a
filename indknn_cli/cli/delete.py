"""`indknn delete`: erase records physically, keep a tombstone in the ledger; `--compact` rewrites the store."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from ..errors import BadInputError
from ..wording import count
from .common import check_lock_timeout, emit_json, resolve_ledger, resolve_store, run_library_call, stderr_console


def _load() -> None:
    """Import the library (numpy, pyarrow, zarr, scipy, ...) when the command runs, not at `indknn --help`: the
    names are this module's globals, declared here."""
    global delete_records, read_ids
    from ..deletion import delete_records
    from ..deletion_plan import read_ids


def _read_file(name: str, what: str) -> list[str]:
    if name == "-":
        return read_ids(sys.stdin)
    try:
        with open(name, encoding="utf-8") as fh:
            return read_ids(fh)
    except FileNotFoundError:
        raise BadInputError(f"{what} {name}: no such file") from None
    except IsADirectoryError:  # review 48, F5: exit 1 "Is a directory" before
        raise BadInputError(f"{what} {name}: is a folder, not a file of ids (one per line)") from None
    except PermissionError:
        raise BadInputError(f"{what} {name}: cannot be read (permission denied)") from None
    except UnicodeDecodeError:
        raise BadInputError(f"{what} {name}: not UTF-8 text (one id per line)") from None


def delete_command(
    record: Optional[List[str]] = typer.Option(None, "--record", help="Record id to erase (repeat for several)."),
    user: Optional[List[str]] = typer.Option(None, "--user", help="User id: erase every record of this user (repeat for several)."),
    ids_file: Optional[str] = typer.Option(None, "--ids-file", help="File of record ids, one per line; - reads stdin (pipe a batch of erasure requests)."),
    users_file: Optional[str] = typer.Option(None, "--users-file", help="File of user ids, one per line; - reads stdin."),
    store: Optional[str] = typer.Option(None, "--store", help="Feature store: a folder or an s3:// URL (else $INDKNN_STORE, ./indknn-store.zarr)."),
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="Ledger folder (else $INDKNN_LEDGER, ./indknn-ledger)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be erased; take no lock, write nothing."),
    strict: bool = typer.Option(False, "--strict", help="Unknown ids are an error (exit 2, nothing written); by default they are reported."),
    compact: bool = typer.Option(False, "--compact", help="Afterwards rewrite the store without deleted rows and fold the ledger into a snapshot (spent budgets and tombstones kept); alone it also finishes an interrupted compaction."),
    lock_timeout: float = typer.Option(60.0, "--lock-timeout", help="Seconds to wait for the ledger and store locks (serve-queries holds the ledger lock while it runs)."),
) -> None:
    """Erase records: features, label and ids overwritten in the store; the ledger keeps a tombstone
    (id, user, spent, deleted at), so a returning id never gets a fresh budget. Prints one JSON line."""
    _load()
    def call():
        check_lock_timeout(lock_timeout)
        if ids_file == "-" and users_file == "-":
            raise BadInputError("--ids-file and --users-file cannot both read stdin")
        rids = list(record or [])
        uids = list(user or [])
        if ids_file is not None:
            rids += _read_file(ids_file, "--ids-file")
        if users_file is not None:
            uids += _read_file(users_file, "--users-file")
        return delete_records(store_path=resolve_store(store), ledger_path=resolve_ledger(ledger), record_ids=rids,
                              user_ids=uids, dry_run=dry_run, strict=strict, compact=compact,
                              lock_timeout=lock_timeout,
                              finish_pending=ids_file is not None or users_file is not None)

    result = run_library_call(call)
    err = stderr_console()
    if result.ids_not_found or result.users_not_found:
        from ..readers_base import _CONTROL

        odd = sum(bool(_CONTROL.search(i)) for i in [*result.ids_not_found, *result.users_not_found])
        # review 48, F6: no stored id holds a control character (embed refuses them): such an id is a damaged
        # request (a file saved in another encoding, a stray NUL), worth saying so beside "not found"
        err.print(f"{count(len(result.ids_not_found), 'record id')} and "
                  f"{count(len(result.users_not_found), 'user id')} not found "
                  "(listed under ids_not_found / users_not_found)"
                  + (f"; {count(odd, 'of them holds', 'of them hold')} a control or invisible character, which "
                     "no stored id can: check the request's encoding" if odd else ""), soft_wrap=True)
    if result.ledger_unreadable is not None:
        err.print(f"[yellow]Warning:[/] the ledger cannot be read ({escape(str(result.ledger_unreadable))}). The erasure was "
                  "recorded and the vectors erased from the store; the tombstones of "
                  f"{count(result.tombstones_pending, 'row')} are written by the next `indknn delete`, `index` or "
                  "`serve-queries` that can read the ledger"
                  f"{'; --compact was skipped' if result.compaction else ''}", soft_wrap=True)
    if result.pending_completed and not dry_run:
        err.print(f"finished an interrupted deletion of {count(result.pending_completed, 'row')} first",
                  soft_wrap=True)
    if dry_run:
        if result.pending_completed:
            err.print(f"a real run would first finish an interrupted or deferred erasure of "
                      f"{count(result.pending_completed, 'row')}", soft_wrap=True)
        err.print("dry run: nothing was written", soft_wrap=True)
    emit_json(result.as_dict())
    refused = (result.compaction or {}).get("refused")  # a ledger in the store's folder: exit 2, fix the flags
    if refused:
        err.print(f"[bold red]Error:[/] --compact was refused, the erasure went through: {escape(str(refused))}",
                  soft_wrap=True)
    if refused and result.physical_erasure is None:
        raise typer.Exit(2)
    if result.physical_erasure is not None:  # recorded, but the bucket's old versions keep the vectors
        err.print(f"[bold red]Error:[/] physical erasure {escape(result.physical_erasure)}", soft_wrap=True)
        raise typer.Exit(1)
