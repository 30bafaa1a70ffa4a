"""`indknn embed --scheduler ADDRESS`: the input's rows embedded on Dask workers (issue 19).

The coordinator (embedding.py) reads the input, checks ids and labels, numbers the rows and writes every array
but ``features`` as in process. The rows go to the workers in partitions of whole reader batches (each batch
embedded in one call, exactly as in process, so the vectors are bit-identical); a worker embeds and
normalises its partition (:func:`embedding.embed_rows`) and writes the store chunks lying wholly inside its
rows itself, straight into the store (a shared folder or an ``s3://`` URL: ``store.remote``). The rows of the
partly covered chunks at either end come back, and the coordinator writes those chunks once every worker is
done, so that no chunk has two writers. All of it lands past the committed ``n_rows``; the commit (one
attribute update) stays on the coordinator: a worker that fails, past Dask's retries, leaves the store as it
was for every reader.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from .errors import IndknnError, SchedulerError
from .scheduler_address import connect
from .scheduler_address import SCHEDULER_ENV, resolve_scheduler  # noqa: F401 (their home before: library callers)
from .store import GROUP_OF_ROLE, ExtractorInfo

CONNECT_TIMEOUT_S = 10
_EXTRACTORS: dict = {}  # on a worker: (extractor info, device, d) -> extractor, loaded once per process


def connect_client(address: str):
    """A ``distributed.Client`` for ``address`` (:func:`indknn_cli.scheduler_address.connect`, embed's timeout)."""
    return connect(address, timeout=CONNECT_TIMEOUT_S)


def _target(store) -> dict:
    """How a worker re-opens the store: its data URL and storage options, or its (shared) folder."""
    if store.remote is not None:
        return {"url": store.remote.url, "options": dict(store.remote.options)}
    return {"path": str(store.path.resolve())}


def _features(target: dict, role: str):
    import zarr

    if "url" in target:
        root = zarr.open_group(target["url"], mode="r+", storage_options=target["options"] or None)
    else:
        root = zarr.open_group(target["path"], mode="r+")
    return root[GROUP_OF_ROLE[role]]["features"]


def embed_partition(target: dict, role: str, info: dict, device: str, dim: int, chunk: int, lo: int,
                    groups: list, name: str, store_named: str, fence: dict | None = None, run: str | None = None):
    """On a worker: embed ``groups`` (rows ``lo`` on), write the whole chunks inside them, return the rest
    as ``[(first_row, float32 rows), ...]`` for the coordinator. Idempotent: a retried task writes the same.
    Each chunk is written only while the run's stamp says it is running (:mod:`.dask_fence`): a partition whose
    coordinator is gone stops instead of writing over the next writer's rows (review 23, F1)."""
    from . import dask_fence
    from .embedding_rows import embed_rows
    from .extractors import extractor_from_info

    key = (tuple(sorted(info.items())), device, dim)
    if key not in _EXTRACTORS:
        _EXTRACTORS[key] = extractor_from_info(ExtractorInfo(**info), device=device, dim=dim)
    ex = _EXTRACTORS[key]
    block = np.concatenate([embed_rows(ex, items, rows, ids, name=name, dim=dim, store_named=store_named)
                            for items, rows, ids in groups])
    hi = lo + block.shape[0]
    a, b = -(-lo // chunk) * chunk, (hi // chunk) * chunk  # whole chunks: [a, b)
    if a >= b:
        return [(lo, block)]
    arr = _features(target, role)
    for c in range(a, b, chunk):
        if fence is not None:
            dask_fence.check(fence, run)
        arr[c:c + chunk] = block[c - lo:c + chunk - lo]
    return [(lo, block[:a - lo]), (b, block[b - lo:])]


#: How long a failed embed waits for the partitions still running before it gives up (and says so). None:
#: ``$INDKNN_DASK_DRAIN_SECONDS``, else 600 (read when used).
DRAIN_SECONDS: float | None = None


def _drain_seconds() -> float:
    from .dask_fence import env_seconds

    return DRAIN_SECONDS if DRAIN_SECONDS is not None else env_seconds("INDKNN_DASK_DRAIN_SECONDS", 600.0)


class DaskFeatureWriter:
    """The ``dist`` of embedding._embed_source: partitions out, edge rows back, written before the commit."""

    def __init__(self, client, ex, *, device: str, partition_rows: int | None = None):
        self._drain = _drain_seconds()  # read now: a bad value is refused before anything runs
        self.client, self.ex, self.device = client, ex, device
        self.partition_rows = partition_rows
        self.futures: list = []
        self._groups: list = []
        self._lo = self._rows = 0
        self._store = self._role = None
        self._run: str | None = None  # the fence's run token (dask_fence), stamped before the first partition
        self._fence: dict | None = None

    @classmethod
    @contextlib.contextmanager
    def connect(cls, address: str, ex, *, device: str = "auto") -> Iterator["DaskFeatureWriter"]:
        client = connect_client(address)
        try:
            yield cls(client, ex, device=device)
        finally:
            client.close()

    def dim_of(self, ex, items) -> int:
        """The store's d for a new store: the extractor's, or a pass-through's first vector's."""
        return int(ex.dim) if ex.dim else int(np.asarray(ex.embed(items[:1])).shape[1])

    def submit(self, store, role: str, items, rows, ids, *, at: int, name: str) -> None:
        """Queue one reader batch's kept rows (store rows ``at`` on; ``name``: the input, for messages);
        send a partition when it is full."""
        if self._store is None:
            self._store, self._role, self._lo, self._name = store, role, at, name
        items = items.tolist() if isinstance(items, np.ndarray) and items.dtype == object else items
        self._groups.append((items, list(rows), list(ids)))
        self._rows += len(rows)
        if self._rows >= (self.partition_rows or max(store.chunk_rows, store.scan_rows // 4)):
            self._send()

    def _send(self) -> None:
        if not self._groups:
            return
        st, lo, hi = self._store, self._lo, self._lo + self._rows
        arr = st.group(self._role)["features"]
        if arr.shape[0] < hi:  # grow the array before the worker writes (a metadata update)
            arr.resize((hi, st.dim))
        if self._run is None:
            import uuid

            from . import dask_fence

            self._run = uuid.uuid4().hex
            self._fence = dask_fence.begin(st, self._run)
        self.futures.append(self.client.submit(
            embed_partition, _target(st), self._role, st.extractor.as_dict(), self.device, st.dim, st.chunk_rows,
            lo, self._groups, self._name, st.where, self._fence, self._run, pure=False))
        self._groups, self._lo, self._rows = [], hi, 0

    def drain(self) -> None:
        """Wait until no partition is running; called before the store's lock (and writer lease) is released after
        a failure. Cancelling does not stop a task already running, which would go on writing its rows into the
        bucket after the lock was released: the next writer's rows, at the same uncommitted row numbers, could
        then be overwritten under their ids (review 20 of audit 8, F1)."""
        if not self.futures:  # none was sent (a submit that raised): no partition can run; the stamp goes
            self._end()
            return
        from distributed import as_completed

        try:  # each future ends finished, failed or lost: all that is waited for
            with self.client.as_current():
                for _ in as_completed([f for f in self.futures if not f.done()], timeout=self._drain):
                    pass
        except TimeoutError:
            self._end(remove=False)  # the stamp stays: the next writer revokes it before writing (dask_fence)
            raise SchedulerError(
                f"the Dask workers did not finish within {self._drain:.0f} s of a failure; nothing was "
                "committed, but a worker may still write rows past the store's committed ones: let the cluster "
                "finish (or restart it) before the next write to this store") from None
        self._end()

    def _end(self, *, remove: bool = True) -> None:
        """The run's stamp: removed once no partition can run (``remove``), else only forgotten by this process."""
        if self._run is None:
            return
        from . import dask_fence

        if remove:
            dask_fence.end(self._store, self._run)
        else:
            dask_fence.forget(self._run)
        self._run = None

    def finish(self, store, role: str) -> None:
        """Send the last partition, wait for all, write the edge rows; raise the first failure."""
        self._send()
        try:
            parts = [p for res in self.client.gather(self.futures) for p in res]
            self._end()  # every partition has finished: none can write any more
        except IndknnError:
            self.drain()
            raise
        except Exception as exc:  # noqa: BLE001 - a worker that died past Dask's retries, lost connection
            self.drain()
            raise SchedulerError(f"a Dask worker failed ({type(exc).__name__}: {exc}); nothing was committed, "
                                 "the store is as it was") from None
        finally:
            self.client.cancel(self.futures)
        arr = store.group(role)["features"]
        run_lo, run = None, []
        for lo, rows in sorted(((lo, r) for lo, r in parts if len(r)), key=lambda p: p[0]) + [(None, None)]:
            if run and (lo is None or lo != run_lo + sum(len(r) for r in run)):
                block = np.concatenate(run)
                arr[run_lo:run_lo + len(block)] = block
                run = []
            if lo is not None:
                run_lo = lo if not run else run_lo
                run.append(rows)
