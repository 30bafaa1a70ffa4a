"""Where the candidate phase reads private rows from: (start row, float32 rows) blocks in row order.

:class:`ArraySource` holds them in memory; :class:`StoreSource` streams them from the Zarr store (its chunk
files read directly where it can, :mod:`indknn_cli.store_scan`), kept for the run when they fit the feature
cache (half of ``--max-memory``), with the next block read in a thread while the current one is screened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

__all__ = ["ArraySource", "ChunkSource", "StoreSource"]


def _source_rows(source) -> int | None:
    """Rows of a chunk source, where it knows them without reading them."""
    if isinstance(source, ArraySource):
        return int(source.features.shape[0])
    if isinstance(source, StoreSource):
        return int(source.store.n_rows(source.role))
    return None


class ChunkSource(Protocol):
    """``chunks()`` yields (start row, float32 rows) in row order. A block is valid until the block after the
    next one is asked for (a StoreSource over its cache reads into a ring of reused buffers, store_scan):
    a caller that keeps blocks copies them."""

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]: ...


@dataclass
class ArraySource:
    """Private features already in memory (tests, small stores, cached stores)."""

    features: np.ndarray
    rows: int = 8192

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, self.features.shape[0], self.rows):
            yield start, self.features[start:start + self.rows]


@dataclass
class StoreSource:
    """Private features streamed from the Zarr store; cached when under the memory cap."""

    store: object
    role: str = "private"
    cache_bytes: int = 1 << 30
    _cache: list | None = None
    _on_device: dict = field(default_factory=dict)  # device → [(start, tensor)] resident for the run, or None

    def step_rows(self) -> int:
        """Rows read per step: the store's scan step, at most an eighth of ``cache_bytes`` (two steps are in
        memory at once while one is read ahead; ``--max-memory`` halves into the cache), whole chunks."""
        chunk = int(self.store.chunk_rows)
        fit = (max(self.cache_bytes, 0) // 8) // (4 * self.store.dim) // chunk * chunk
        return max(chunk, min(int(self.store.scan_rows), fit))

    def fits_cache(self) -> bool:
        """Whether the role's float32 features fit in ``cache_bytes`` (then read once and kept for the run)."""
        return self.store.n_rows(self.role) * self.store.dim * 4 <= self.cache_bytes

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        if self._cache is not None:
            yield from self._cache
            return
        from .store_scan import scan_features

        fits = self.fits_cache()
        cache = [] if fits else None
        # Blocks of a store over the cache are read into a ring of reused buffers (store_scan): each is valid
        # until the block after next is asked for, which the screen below never outlives.
        steps = scan_features(self.store, self.role, rows=self.step_rows(), reuse=not fits)
        for start, block in _read_ahead(steps):
            if cache is not None:
                cache.append((start, block))
            yield start, block
        if cache is not None:
            self._cache = cache


def _read_ahead(blocks: Iterator):
    """Yield from ``blocks`` while a thread reads the next one (Zarr read and crc32c check overlap the
    consumer's screen of the current step; the blocks and their order are unchanged). A read error is raised
    where the block would have been yielded."""
    from concurrent.futures import ThreadPoolExecutor

    done = object()
    with ThreadPoolExecutor(1, thread_name_prefix="indknn-read-ahead") as pool:
        fut = pool.submit(next, blocks, done)
        while True:
            item = fut.result()
            if item is done:
                return
            fut = pool.submit(next, blocks, done)
            yield item
