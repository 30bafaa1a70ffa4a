"""Embedding one group of input rows (in process and on a Dask worker: bit-identical stores), and the label order
of a store created from public rows."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import BadInputError, StoreError
from .id_text import canonical
from .extractors import Extractor
from .readers import Source, open_source
from .store import normalize_rows


def sort_label_names(values: Sequence[str]) -> list[str]:
    """Distinct labels, sorted numerically when all are numbers, else as strings."""
    values = list(dict.fromkeys(str(v) for v in values))
    for conv in (int, float):
        try:
            return sorted(values, key=lambda s: (conv(s), s))
        except ValueError:
            continue
    return sorted(values)


def _check_finite_nonzero(x: np.ndarray, rows: Sequence[int], ids: Sequence[str | None], display: str) -> None:
    """NaN/inf/zero vectors are errors naming the input row (1-based) and id."""
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        j = int(np.flatnonzero(~finite)[0])
        raise BadInputError(f"{display}: row {rows[j] + 1}{_id_note(ids[j])}: vector contains NaN or infinite values")
    zero = ~np.any(x != 0, axis=1)
    if zero.any():
        j = int(np.flatnonzero(zero)[0])
        raise BadInputError(f"{display}: row {rows[j] + 1}{_id_note(ids[j])}: zero vector (cannot be L2-normalised)")


def embed_rows(ex: Extractor, items, rows: Sequence[int], ids: Sequence[str | None], *, name: str,
               dim: int | None, store_named: str | None) -> np.ndarray:
    """Embed one group of input rows and L2-normalise them, refusing a wrong d, NaN/inf and zero vectors
    (errors name the input row). The same code in process and on a Dask worker (bit-identical stores)."""
    x = np.asarray(ex.embed(items))
    if x.ndim != 2 or x.shape[0] != len(rows):
        raise BadInputError(f"{name}: extractor returned shape {x.shape} for {len(rows)} rows")
    if dim is not None and x.shape[1] != dim:
        if store_named is not None:
            raise StoreError(f"{store_named}: store has d={dim}, input {name} has d={x.shape[1]} (row {rows[0] + 1})")
        raise BadInputError(f"{name}: row {rows[0] + 1}: d={x.shape[1]}, earlier rows have d={dim}")
    _check_finite_nonzero(x, rows, ids, name)
    return normalize_rows(x, what=name)


def _id_note(rid: str | None) -> str:
    return "" if rid is None else f" (id {rid!r})"


def open_checked(source, kind: str | None, reader_opts: dict, *, defaulted: bool) -> Source | None:
    """``open_source`` before any model is loaded. ``defaulted`` (a new store, no --extractor: text): an input the
    text extractor cannot read but the vectors one can is refused with what to pass (review 66, F1: a .npz or a
    Parquet file with a `vector` column was refused as "this store's extractor takes text input", with no store
    yet, or as "text column 'text' not found")."""
    if kind is None:
        return None
    try:
        return open_source(source, extractor_kind=kind, **reader_opts)
    except BadInputError as exc:
        if not defaulted or kind == "vector" or str(source) == "-":  # stdin cannot be read twice
            raise
        try:
            open_source(source, extractor_kind="vector", **reader_opts).close()
        except Exception:  # noqa: BLE001 - not vectors either: the text reader's message stands
            raise exc from None
        raise BadInputError(f"{source}: this input holds precomputed vectors, and a new store's extractor defaults "
                            "to text: give --extractor vectors (the store keeps it; later embeds into it need not "
                            "repeat it)") from None


def first_row_of(src: Source, label: str) -> str:
    """``row N: `` of the first row holding ``label`` (review 60, F6: a 100k-row file had to be searched by hand);
    read again on this error path only."""
    for rb in src.batches(labels=True):
        for k, value in enumerate(rb.labels or []):
            if canonical(value) == label:  # labels are compared in NFC (review 73, F13)
                return f"row {rb.start + k + 1}: "
    return ""
