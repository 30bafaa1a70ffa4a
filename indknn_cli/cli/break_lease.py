"""`indknn break-lease`: show a remote store's leases; with `--token`, remove exactly that lease."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from .common import emit_json, env_value, run_library_call, stderr_console


def break_lease_command(
    store: Optional[str] = typer.Option(None, "--store", help="The remote store (s3://...) as named to embed/index (else $INDKNN_STORE)."),
    token: Optional[str] = typer.Option(None, "--token", help="Remove the lease whose token this is (the refusal that named the lease printed it); without it, only show the leases."),
) -> None:
    """Show the leases of a store on object storage and, with `--token`, remove one.

    A write to a remote store (embed, serve-queries' query file, delete, repair, ...) holds its writer lease,
    and a writer of its ledger (serve-queries, index, delete, repair) its ledger-writer lease: objects beside the
    store's prefix, so that two machines never write at once. When the machine holding one is gone (a crash), the lease stays and
    every other machine's write is refused, naming the holder and the token. Once you know that machine is gone,
    `indknn break-lease --store URL --token TOKEN` removes that lease and nothing else: a lease released since, or
    taken by another writer, has another token and is left as it is.

    stdout: one JSON line {store, leases: [{kind, lease, holder}], removed}. Exit codes: 0 shown, removed, or no
    lease held; 1 the object store cannot be reached; 2 bad input (a local store, a token no lease has).
    """
    from ..errors import BadInputError

    err = stderr_console()

    def call():
        name = store if store is not None else env_value("INDKNN_STORE")  # blank: unset (review 50, F4)
        if not name:
            raise BadInputError("--store: name the remote store (s3://bucket/name.zarr) or set $INDKNN_STORE")
        from ..store_lease import break_lease

        return break_lease(name, token=token)

    out = run_library_call(call)
    emit_json(out)
    if not out["leases"]:
        err.print(escape(f"{out['store']}: no lease is held; nothing to remove"))
    for h in out["leases"]:
        who = h["holder"]
        if out["removed"] == h["lease"]:
            err.print(escape(f"removed the {h['kind']} of {out['store']} (host {who['host']}, process {who['pid']}, "
                             f"since {who['since']}); writes to the store can go on"))
        else:
            err.print(escape(f"{out['store']}: the {h['kind']} {h['lease']} is held by host {who['host']}, process "
                             f"{who['pid']}, since {who['since']}. If that holder is gone, run again with --token "
                             f"{who['token']} to remove it"))
