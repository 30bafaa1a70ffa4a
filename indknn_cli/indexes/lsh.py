"""``lsh`` (Ind-KNN-Hash): L tables of b Gaussian hyperplanes from a recorded seed, and its finder."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine import Candidates
from ..errors import BadInputError
from .common import (ENCODE_ROWS, MAX_BITS, PAIR_BLOCK, _allowed, _cat, _FinderBase, _parallel_blocks, _signs)


# -- the two structures ------------------------------------------------------------
@dataclass
class LshIndex:
    """L tables × b random Gaussian hyperplanes (SPEC §4 "Hashing"), from a recorded seed."""

    hyperplanes: np.ndarray  # float32 [tables * bits, d]
    tables: int
    bits: int
    seed: int

    @classmethod
    def from_seed(cls, *, seed: int, tables: int, bits: int, dim: int) -> "LshIndex":
        if not 1 <= tables <= 1024:
            raise BadInputError(f"--tables must be between 1 and 1024, got {tables}")
        if not 1 <= bits <= MAX_BITS:
            raise BadInputError(f"--bits must be between 1 and {MAX_BITS}, got {bits}")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed))))
        planes = rng.standard_normal((tables * bits, dim)).astype(np.float32)
        return cls(planes, int(tables), int(bits), int(seed))

    @property
    def code_dtype(self):
        return np.uint16 if self.bits <= 16 else np.uint32

    def codes(self, x: np.ndarray) -> np.ndarray:
        """Bucket code of every row in every table, [n, tables]; bit k = [h_k·x ≥ 0] (exact sign)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.tables), dtype=self.code_dtype)
        weights = (np.uint64(1) << np.arange(self.bits, dtype=np.uint64))
        for lo in range(0, x.shape[0], ENCODE_ROWS):
            xb = x[lo:lo + ENCODE_ROWS]
            bits = _signs(xb, self.hyperplanes)
            packed = bits.reshape(-1, self.tables, self.bits).astype(np.uint64) @ weights
            out[lo:lo + xb.shape[0]] = packed.astype(self.code_dtype)
        return out



#: Cost model of this 2-core CPU (seconds per unit) used to pick the cheaper of two identical LSH strategies.
COST_PER_MAC = 1.0 / 70e9        # fp32 BLAS
COST_PER_BYTE_STREAM = 1.0 / 5e9
COST_PER_BYTE_GATHER = 1.0 / 2.5e9
COST_PER_CALL = 30e-6


class LshFinder(_FinderBase):
    """Candidates = rows sharing the query's bucket in ≥ 1 table with κ ≥ τ (two strategies, same set).

    ``scan``: fp32 screen of all rows, then the bucket test on the few pairs
    that pass. ``buckets``: per table, gather the rows of each bucket the
    batch's queries fall in and screen only those. Which is cheaper depends on
    the batch size and the machine; ``strategy='auto'`` asks a cost model.
    """

    kind = "lsh"

    def __init__(self, index: LshIndex, features: np.ndarray, codes: np.ndarray, live: np.ndarray, *,
                 kernel: str, tau: float, nu: float | None, strategy: str = "auto"):
        super().__init__(kernel=kernel, tau=tau, nu=nu, dim=features.shape[1])
        if strategy not in ("auto", "scan", "buckets"):
            raise BadInputError(f"LSH strategy must be auto, scan or buckets, got {strategy!r}")
        self.index, self.x, self.codes, self.live, self.strategy = index, features, codes, live, strategy
        live_rows = np.flatnonzero(live).astype(np.int32 if features.shape[0] < 2**31 else np.int64)
        self.sorted_codes, self.perm = [], []
        for t in range(index.tables):
            c = codes[live_rows, t]
            o = np.argsort(c, kind="stable")
            self.sorted_codes.append(c[o])
            self.perm.append(live_rows[o])  # rows ascending within each bucket

    def _bucket_plan(self, qcodes: np.ndarray):
        plans, gather_rows, macs, calls = [], 0, 0, 0
        for t in range(self.index.tables):
            qc = qcodes[:, t]
            order = np.argsort(qc, kind="stable")
            uniq, first, counts = np.unique(qc[order], return_index=True, return_counts=True)
            lo = np.searchsorted(self.sorted_codes[t], uniq, side="left")
            hi = np.searchsorted(self.sorted_codes[t], uniq, side="right")
            size = hi - lo
            plans.append((order, first, counts, lo, hi))
            gather_rows += int(size.sum()); macs += int((size * counts).sum()); calls += int((size > 0).sum())
        d = self.x.shape[1]
        cost = gather_rows * d * 4 * COST_PER_BYTE_GATHER + macs * d * COST_PER_MAC + calls * COST_PER_CALL
        return plans, cost

    def __call__(self, queries: np.ndarray, row_mask: np.ndarray | None = None,
                 max_pairs: int | None = None) -> Candidates:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        m, (n, d) = q.shape[0], self.x.shape
        qcodes = self.index.codes(q)
        strategy = self.strategy
        plans = None
        if strategy != "scan":
            plans, bucket_cost = self._bucket_plan(qcodes)
            scan_cost = m * n * d * COST_PER_MAC + n * d * 4 * COST_PER_BYTE_STREAM
            if strategy == "auto":
                strategy = "buckets" if bucket_cost < scan_cost else "scan"
        self.last = {"strategy": strategy}
        count = self._pairs(m, max_pairs)
        if strategy == "scan":
            qi, rows = self._scan(q, qcodes, count)
        else:
            qi, rows = self._buckets(q, plans, count)
        keep = self.live[rows] & _allowed(row_mask, rows)
        qi, rows = qi[keep], rows[keep]
        self.last["screened_pairs"] = int(qi.size)
        self._check_pairs(m, qi.size, max_pairs)
        return self._exact(m, q, qi, rows, self.x, rows)

    def _scan(self, q, qcodes, count):
        out_q, out_r = [], []
        step = max(1, min(65536, (256 << 20) // (4 * max(1, q.shape[0]))))
        for lo in range(0, self.x.shape[0], step):
            block = self.x[lo:lo + step]
            qi, ri = self._screen(q, lambda a, b: block[a:b], block.shape[0], count)
            rows = ri + lo
            share = np.zeros(qi.size, bool)
            for a in range(0, qi.size, PAIR_BLOCK):
                b = a + PAIR_BLOCK
                share[a:b] = (self.codes[rows[a:b]] == qcodes[qi[a:b]]).any(axis=1)
            out_q.append(qi[share]); out_r.append(rows[share])
        return _cat(out_q, np.int64), _cat(out_r, np.int64)

    def _buckets(self, q, plans, count):
        def scan_bucket(task):
            t, u = task
            order, first, counts, lo, hi = plans[t]
            qs = order[first[u]:first[u] + counts[u]]
            rows = self.perm[t][lo[u]:hi[u]]
            # the bucket's rows gathered a screen step at a time (a bucket's size depends on the private data)
            a, b = self._screen(q[qs], lambda i, j: np.take(self.x, rows[i:j], axis=0), rows.size, count)
            return qs[a], rows[b].astype(np.int64)

        tasks = [(t, int(u)) for t, p in enumerate(plans) for u in np.flatnonzero(p[4] > p[3])]
        found = _parallel_blocks(tasks, scan_bucket)
        qi, rows = _cat([f[0] for f in found], np.int64), _cat([f[1] for f in found], np.int64)
        if qi.size:  # a pair found in several tables counts once
            key = np.unique(qi * self.x.shape[0] + rows)
            qi, rows = key // self.x.shape[0], key % self.x.shape[0]
        return qi, rows
