"""Appending rows to a :class:`~indknn_cli.store.FeatureStore`: rows written past the committed ``n_rows``,
made visible by one attribute update (the commit point; see store.py)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Sequence

import numpy as np

from . import store_versions
from .errors import BadInputError, StoreError
from .readers_base import check_key_text
from .record_keys import KEY_ARRAY, vector_keys
from .store_layout import read_chunks

if TYPE_CHECKING:  # the store module imports this one (FeatureStore.appender)
    from .store import FeatureStore


class Appender:
    """Writes rows past the committed ``n_rows``; :meth:`commit` bumps it (the commit point).

    Uncommitted rows are invisible to readers and are overwritten by the next
    append, so a failed or abandoned append leaves the store as it was.
    """

    def __init__(self, store: FeatureStore, role: str, *, batch: str | None = None):
        self.store = store
        self.role = role
        self.group = store.group(role)
        self.batch = batch
        self.start = store.n_rows(role)
        self.stop = self.start
        self._hash = hashlib.sha256()
        # Rows are buffered per array and written in whole chunks (issue 21: writing 256 rows at a time into
        # a chunk of thousands rewrote the tail chunk on every call); the rest at commit.
        self._pending: dict[str, list[np.ndarray]] = {}
        self._written: dict[str, int] = {}
        #: Rows and bytes (uncompressed) handed to zarr, summed over the arrays: for tests and benchmarks.
        self.rows_written = 0
        self.bytes_written = 0
        self.external_features = False
        self._arrays: dict = {}
        # private rows of a store that records content keys (not one made before audit 5); a short key array is
        # refused here, or the append would extend it past its gap and it would look whole
        self._keys = role == "private" and store.check_key_rows()

    def write(self, features: np.ndarray | None, *, labels: np.ndarray | None = None,
              record_ids: Sequence[str], user_ids: Sequence[str] | None = None,
              content_keys: Sequence[str] | None = None) -> None:
        """Buffer rows. ``features=None``: the features of these rows are written into the store by someone
        else (the Dask workers of :mod:`.dask_embed`) before :meth:`commit`; the other arrays are written here.

        ``content_keys`` (private rows): each row's key from its own input (:mod:`.record_keys`; ``embed`` gives
        them); None: the hash of each given vector and label, which are then the rows' input."""
        if features is None:
            self.external_features = True
            m = len(record_ids)
        else:
            feats = np.ascontiguousarray(features, dtype=np.float32)
            if feats.ndim != 2 or feats.shape[1] != self.store.dim:
                raise BadInputError(f"vectors have shape {feats.shape}, store expects d={self.store.dim}")
            m = feats.shape[0]
        if m == 0:
            return
        if labels is None:
            labels = np.full(m, -1, dtype=np.int32)
        start, stop = self.stop, self.stop + m
        rids = [str(r) for r in record_ids]
        uids = ["" if u is None else str(u) for u in (user_ids or [""] * m)]
        composed = self.role != "query"  # review 53, F2: one id, one spelling (a query's id is released as written)
        check_key_text(rids, what="record id", display="append", start=0, surrounding_space=True,  # review 37, F1
                       composed=composed)
        check_key_text(uids, what="user id", display="append", start=0, surrounding_space=True, composed=composed)
        arrays = {
            "labels": np.asarray(labels, dtype=np.int32),
            "record_id": np.asarray(rids, dtype=str),
            "user_id": np.asarray(uids, dtype=str),
            "deleted": np.zeros(m, dtype=bool),
        }
        if features is not None:
            arrays["features"] = feats
        if self.role == "query":
            arrays["batch"] = np.asarray([self.batch or ""] * m, dtype=str)
        if self._keys:
            if content_keys is None:
                if features is None:
                    raise BadInputError("private rows written without their vectors need their content keys")
                content_keys = vector_keys(feats, arrays["labels"], salt=self.store.key_salt)
            arrays[KEY_ARRAY] = np.asarray([str(k) for k in content_keys], dtype=str)
        for name, values in arrays.items():
            if len(values) != m:
                raise BadInputError(f"{name}: {len(values)} values for {m} vectors")
        for name, values in arrays.items():
            self._pending.setdefault(name, []).append(values)
        if features is not None:
            self._hash.update(feats.tobytes())
        self.stop = stop
        self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        """Write each array's buffered rows up to its last whole chunk boundary (``final``: all of them)."""
        for name, parts in self._pending.items():
            if not parts:
                continue
            if name not in self._arrays:  # opened once: on object storage each open is two requests
                # every chunk a file, of fill values only too: an absent one is then a lost one (review 74, F4)
                self._arrays[name] = self.group[name].with_config({"write_empty_chunks": True})
            arr = self._arrays[name]
            lo = self._written.get(name, self.start)
            chunk = int(arr.chunks[0])
            hi = self.stop if final else (self.stop // chunk) * chunk
            if hi <= lo:
                continue
            values = parts[0] if len(parts) == 1 else np.concatenate(parts)
            head, rest = values[:hi - lo], values[hi - lo:]
            self._pending[name] = [rest] if len(rest) else []
            if arr.shape[0] < hi:
                arr.resize((hi,) + tuple(arr.shape[1:]))
            # a partly filled tail chunk is read back and rewritten whole: a corrupt one is a StoreError
            read_chunks(self.store.path, self.role, name, lambda: arr.__setitem__(slice(lo, hi), head))
            self._written[name] = hi
            self.rows_written += int(len(head))
            self.bytes_written += int(head.nbytes)

    def commit(self, extra_attrs: dict | None = None) -> tuple[int, int]:
        self._flush(final=True)
        if self.store.n_rows(self.role) != self.start:
            raise StoreError(f"{self.store.path}: {self.role} rows changed during the append (concurrent writer?)")
        attrs: dict = {"n_rows": self.stop}
        if self.external_features:  # the hash of the batch's vectors, read back as they were written
            self._hash = hashlib.sha256()
            arr = self.group["features"]
            for lo in range(self.start, self.stop, self.store.scan_rows):
                hi = min(self.stop, lo + self.store.scan_rows)
                self._hash.update(read_chunks(self.store.path, self.role, "features",
                                               lambda: np.ascontiguousarray(arr[lo:hi], dtype=np.float32)).tobytes())
        if self.role == "query" and self.batch is not None:
            batches = dict(self.group.attrs.get("batches", {}))
            batches[self.batch] = {"start": self.start, "stop": self.stop, "sha256": self._hash.hexdigest()}
            attrs["batches"] = batches
        if extra_attrs:
            attrs.update(extra_attrs)
        if self.role == "private":  # a new version of the private rows (store_versions.py), in the same replace
            attrs.update(store_versions.appended(self.group))
        self.group.attrs.update(attrs)  # the commit point: one atomic zarr.json replace
        return self.start, self.stop
