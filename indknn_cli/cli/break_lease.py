"""`indknn break-lease`: show a remote store's writer lease; with `--token`, remove exactly that lease."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from .common import emit_json, run_library_call, stderr_console


def break_lease_command(
    store: Optional[str] = typer.Option(None, "--store", help="The remote store (s3://...) as named to embed/index (else $INDKNN_STORE)."),
    token: Optional[str] = typer.Option(None, "--token", help="Remove the lease only if this is its token (the refusal that named the lease printed it); without it, only show the lease."),
) -> None:
    """Show the writer lease of a store on object storage and, with `--token`, remove it.

    A write to a remote store (embed, index's binding, delete, repair) holds a lease object beside the
    store's prefix, so that two machines never write at once. When the machine holding it is gone (a crash),
    its lease stays and every other machine's write is refused, naming the holder and its token. Once you know
    that machine is gone, `indknn break-lease --store URL --token TOKEN` removes that lease and nothing else: a
    lease released since, or taken by another writer, has another token and is left as it is.

    stdout: one JSON line {store, lease, held, holder, removed}. Exit codes: 0 shown, removed, or no lease held;
    1 the object store cannot be reached; 2 bad input (a local store, a token that is not the lease's).
    """
    import os

    from ..errors import BadInputError

    err = stderr_console()

    def call():
        name = store if store is not None else os.environ.get("INDKNN_STORE")
        if not name:
            raise BadInputError("--store: name the remote store (s3://bucket/name.zarr) or set $INDKNN_STORE")
        from ..store_lease import break_lease

        return break_lease(name, token=token)

    out = run_library_call(call)
    emit_json(out)
    h = out["holder"]
    if not out["held"]:
        err.print(escape(f"{out['store']}: no writer lease is held; nothing to remove"))
    elif out["removed"]:
        err.print(escape(f"removed the writer lease of {out['store']} (host {h['host']}, process {h['pid']}, since "
                         f"{h['since']}); writes to the store can go on"))
    else:
        err.print(escape(f"{out['store']}: the writer lease {out['lease']} is held by host {h['host']}, process "
                         f"{h['pid']}, since {h['since']}. If that machine is gone, run again with --token "
                         f"{h['token']} to remove it"))
