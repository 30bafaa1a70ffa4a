"""Precomputed vectors for `indknn embed`: ``.npy`` (no labels) and ``.npz`` (x, optional y, ids, users)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import BadInputError
from .readers_base import NPZ_DEFAULTS, RecordBatch, Source, _label_str

# ---------------------------------------------------------------------------
# .npy / .npz vectors
# ---------------------------------------------------------------------------
class NumpySource(Source):
    """``.npy`` (vectors only) or ``.npz`` (``x``, optional ``y``, ``ids``, ``users``)."""

    def __init__(self, path: Path, fmt: str, *, display: str, extractor_kind: str, batch_rows: int,
                 label_column: str | None, id_column: str | None, user_column: str | None,
                 vector_column: str | None):
        super().__init__(extractor_kind=extractor_kind, batch_rows=batch_rows)
        if extractor_kind != "vector":
            raise BadInputError(f"{display}: a .{fmt} file holds precomputed vectors, but this store's extractor "
                                f"takes {extractor_kind} input; vectors go into a store made with `embed "
                                "--extractor vectors`")
        self.kind, self.name, self.bytes_path = fmt, display, path
        self.labels_arr = self.ids_arr = self.users_arr = None
        self.requested_label_column = label_column or NPZ_DEFAULTS["label"]
        try:
            if fmt == "npy":
                if label_column or id_column or user_column:
                    raise BadInputError(f"{display}: a .npy file holds vectors only (no labels, ids or users); "
                                        f"use .npz with arrays x, y, ids, users")
                self.x = np.load(path, mmap_mode="r", allow_pickle=False)
                self.columns = ["x"]
            else:
                z = np.load(path, allow_pickle=False)
                self.columns = list(z.files)
                xname = vector_column or NPZ_DEFAULTS["x"]
                self._require(xname, "vector")
                self.x = z[xname]
                lab = label_column or NPZ_DEFAULTS["label"]
                if label_column:
                    self._require(lab, "label")
                if lab in z.files:
                    self.labels_arr = z[lab]
                _refuse_near_names(display, z.files, id_column=id_column, user_column=user_column)
                for attr, opt, key in (("ids_arr", id_column, "id"), ("users_arr", user_column, "user")):
                    nm = opt or NPZ_DEFAULTS[key]
                    if opt:
                        self._require(nm, key)
                    if nm in z.files:
                        setattr(self, attr, z[nm])
        except BadInputError:
            raise
        except Exception as exc:
            raise BadInputError(f"{display}: cannot read as .{fmt} ({type(exc).__name__}: {exc})") from None
        if self.x.ndim != 2:
            raise BadInputError(f"{display}: vectors must be a 2-d array [n, d], got shape {self.x.shape}")
        if not (np.issubdtype(self.x.dtype, np.floating) or np.issubdtype(self.x.dtype, np.integer)):
            raise BadInputError(f"{display}: vectors have dtype {self.x.dtype}, not numbers")
        n = self.x.shape[0]
        for nm, arr in (("labels", self.labels_arr), ("ids", self.ids_arr), ("users", self.users_arr)):
            if arr is not None and (arr.ndim != 1 or arr.shape[0] != n):
                raise BadInputError(f"{display}: array {nm} has shape {arr.shape}, expected ({n},)")
        self._count = n

    def _drop_pages(self, rows_read: int) -> None:
        """A memory-mapped .npy read front to back: hand the pages of rows already copied back to the page
        cache (madvise DONTNEED on a read-only file mapping), so that the file's pages do not pile up in this
        process's resident memory (issue 21: a 2,000,000-row query file in one run). Every ``1 << 24`` bytes."""
        mm = getattr(self.x, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not self.x.flags.c_contiguous:
            return
        import mmap

        start = self.x.offset - self.x.offset % mmap.ALLOCATIONGRANULARITY  # where numpy's mapping begins
        end = self.x.offset - start + rows_read * self.x.strides[0]
        end -= end % mmap.PAGESIZE
        if end - getattr(self, "_dropped", 0) >= (1 << 24):
            try:
                mm.madvise(mmap.MADV_DONTNEED, 0, end)
            except (OSError, ValueError, AttributeError):  # not supported here: the pages stay mapped
                return
            self._dropped = end

    def _require(self, name: str, what: str) -> None:
        if name not in self.columns:
            raise BadInputError(f"{self.name}: {what} array {name!r} not found; arrays present: "
                                f"{', '.join(self.columns) or '(none)'}")

    @property
    def has_labels(self) -> bool:
        return self.labels_arr is not None

    def missing_labels_message(self) -> str:
        if self.kind == "npy":
            return f"{self.name}: a .npy file has no labels (required for this role); use .npz with arrays x and y"
        return (f"{self.name}: label array {self.requested_label_column!r} not found (labels are required for "
                f"this role); arrays present: {', '.join(self.columns)}")

    def label_values(self) -> list[str] | None:
        if self.labels_arr is None:
            return None
        seen: dict[str, None] = {}
        for v in self.labels_arr.tolist():
            s = _label_str(v)
            if not s:
                raise BadInputError(f"{self.name}: empty label")
            seen.setdefault(s, None)
        return list(seen)

    def batches(self, *, labels: bool = True) -> Iterator[RecordBatch]:
        n = self.x.shape[0]
        for lo in range(0, n, self.batch_rows):
            hi = min(n, lo + self.batch_rows)
            self._drop_pages(lo)  # the rows before this batch were handed out (and read) already
            yield RecordBatch(
                items=np.asarray(self.x[lo:hi], dtype=np.float64),
                labels=(None if not labels or self.labels_arr is None
                        else [_label_str(v) for v in self.labels_arr[lo:hi].tolist()]),
                ids=None if self.ids_arr is None else [_label_str(v) for v in self.ids_arr[lo:hi].tolist()],
                users=None if self.users_arr is None else [_label_str(v) for v in self.users_arr[lo:hi].tolist()],
                start=lo,
            )


#: Array names a .npz is often written with that are not the ones read (review 63: an array ``id`` was ignored
#: without a word, the records got generated ids and `delete --record` later said the id was not found).
_NEAR_NAMES = {"id": ("id", "record_id", "record_ids"), "user": ("user", "user_id", "user_ids")}


def _refuse_near_names(display: str, files, *, id_column, user_column) -> None:
    given = {"id": id_column, "user": user_column}
    option = {"id": "--id-column", "user": "--user-column"}
    for key, names in _NEAR_NAMES.items():
        if given[key] or NPZ_DEFAULTS[key] in files:
            continue
        near = [n for n in names if n in files]
        if near:
            raise BadInputError(f"{display}: array {near[0]!r} is not read: a .npz's {key}s are its array "
                                f"{NPZ_DEFAULTS[key]!r}; rename it, or give {option[key]} {near[0]}")

