"""`indknn embed`: stream an input through a public extractor into the feature store."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from .common import (check_device, deprecated_alias, emit_json, progress_bar, resolve_store, run_library_call,
                     stderr_console)


def _load() -> None:
    """Import the library (numpy, pyarrow, zarr, scipy, ...) when the command runs, not at `indknn --help`: the
    names are this module's globals, declared here."""
    global resolve_scheduler, embed_into_store
    from ..scheduler_address import resolve_scheduler
    from ..embedding import embed_into_store


def parse_label_names(text: Optional[str]) -> Optional[list]:
    """--label-names: ``a,b,c``, or a JSON list of strings for names that hold commas (review 31 QA: a class name
    with a comma could not be given)."""
    import json

    from ..errors import BadInputError
    from ..id_text import canonical

    if text is None:
        return None
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except ValueError:
            raise BadInputError(f"--label-names {text!r}: not a JSON list (give a,b,c or [\"a\", \"b\"])") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadInputError(f"--label-names {text!r}: the JSON list must hold strings only")
        return [canonical(n.strip()) for n in names]
    return [canonical(n.strip()) for n in text.split(",")]  # in NFC, as ids (review 73, F13)


def embed_command(
    input: str = typer.Argument(..., metavar="INPUT", help="CSV, Parquet or JSON lines file; a folder of images (one sub-folder per class); .npy/.npz vectors; or - for stdin. Files but .npz may be gzip-compressed (.csv.gz, .jsonl.gz, ...)."),
    store: Optional[str] = typer.Option(None, "--store", help="Feature store: a folder or an s3:// URL (else $INDKNN_STORE, else ./indknn-store.zarr). Created if missing (private/public)."),
    role: str = typer.Option("private", "--role", help="private | query | public | test. Labels are required for private, public and test, ignored for queries. test: a labelled query batch (default name test-<sha256>) whose labels are kept for `indknn bench --test-store` scoring only; serve-queries never reads them and refuses the piped line of a test batch."),
    extractor: Optional[str] = typer.Option(None, "--extractor", help="text | image | pixels | hog | vectors. Default: the store's own extractor, else text."),
    model: Optional[str] = typer.Option(None, "--model", help="text: all-MiniLM-L6-v2 (default, bundled) or a local model folder; image: ARCH:/path/ckpt.pt; pixels-28; hog-28; vectors: a tag naming the vector source."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Text column (default: text); a comma list such as title,description is joined with '. '."),
    label_column: Optional[str] = typer.Option(None, "--label-column", help="Label column (default: label; .npz: y; image folders: the class folder names)."),
    id_column: Optional[str] = typer.Option(None, "--id-column", help="Record id column (default: id when the input has such a column, else generated ids ROLE-00000000; \"\" always generates; image folders: FOLDERNAME/CLASS/FILE; .npz: ids)."),
    user_column: Optional[str] = typer.Option(None, "--user-column", help="User id column (default: user, when the input has one; \"\" reads none; .npz: users)."),
    image_column: Optional[str] = typer.Option(None, "--image-column", help="Image path column of a table of images (default: path; relative to the table's folder)."),
    vector_column: Optional[str] = typer.Option(None, "--vector-column", help="List column of precomputed vectors in Parquet / JSON lines (default: vector; .npz: x)."),
    label_names: Optional[str] = typer.Option(None, "--label-names", help="Comma-separated class names (or a JSON list, '[\"a, b\", \"c\"]', for names holding commas), fixed at store creation: required when the store is created from private rows (every answer is one of them, so the list is declared, never read from private data); from --role public or test rows the default is their sorted distinct labels."),
    if_exists: str = typer.Option("error", "--if-exists", help="error | skip: what to do with a record id that is already in the store."),
    batch_id: Optional[str] = typer.Option(None, "--batch-id", help="Name of the stored query batch (--role query or test; default q-<sha256 of the input>, test-<sha256> for test): give it to serve-queries as QUERIES. Re-running the same input is a no-op."),
    batch: Optional[str] = typer.Option(None, "--batch", hidden=True, help="Deprecated spelling of --batch-id."),
    device: str = typer.Option("auto", "--device", callback=check_device, help="auto | cpu | cuda."),
    batch_size: int = typer.Option(256, "--batch-size", help="Rows read and embedded per batch (bounds memory)."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Dask scheduler address (tcp://HOST:8786; else $INDKNN_SCHEDULER, else in process): the rows are embedded on its workers, which write them into the store (a shared folder or an s3:// URL); the commit stays here. Unreachable: exit 1."),
) -> None:
    """Embed INPUT into the feature store. stdout: one JSON line (store, role, rows_added, rows_skipped, d, extractor)."""
    _load()
    err = stderr_console()
    store_path = run_library_call(lambda: resolve_store(store))
    names = run_library_call(lambda: parse_label_names(label_names))
    batch_id = deprecated_alias(batch_id, batch, new="--batch-id", old="--batch")

    def call():
        # on a terminal only; "loading model" until the first rows are embedded (the input is checked first)
        with progress_bar("loading model") as update:
            def progress(done: int, total: int | None) -> None:
                update(completed=done, total=total, description="embedding")

            return embed_into_store(
                input, store_path=store_path, role=role, extractor=extractor, model=model,
                text_column=text_column, label_column=label_column, id_column=id_column,
                user_column=user_column, image_column=image_column, vector_column=vector_column,
                if_exists=if_exists, batch=batch_id, label_names=names, device=device, batch_rows=batch_size,
                progress=progress, scheduler=resolve_scheduler(scheduler),
            )

    result = run_library_call(call)
    for w in result.warnings:
        err.print(f"[yellow]Warning:[/] {escape(str(w))}", soft_wrap=True)
    emit_json(result.as_dict())
