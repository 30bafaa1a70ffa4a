"""Candidate structures that keep the filter's guarantee: `lsh` (Ind-KNN-Hash) and `ivf` (public centroids).

SPEC §2 step 1 needs every record's candidate membership to depend only on
the record itself, the query and public data; §4 allows exactly two shortcuts:

* ``lsh``: L tables of b Gaussian hyperplanes drawn from a recorded seed
  (independent of all data). Record i is a candidate of query q when their
  sign codes agree in at least one table *and* κ(x_i, q) ≥ τ (paper's
  Ind-KNN-Hash, supplementary §B; the §2 filter then runs unchanged).
* ``ivf``: coarse centroids trained (spherical k-means, faiss-cpu) on public
  vectors only — the store's ``public`` or ``query`` rows or a ``--train-on``
  file. Each record is assigned to its nearest centroid (a function of the
  record and the public centroids); a query probes its ``nprobe`` nearest
  lists; the threshold τ is applied to the exact kernel (a range search).
  Unless given, ``nprobe`` is the smallest reaching candidate recall 0.95 on
  held-out public vectors (:func:`calibrate_nprobe`), and ``nlist`` a
  power of two with ≥ 39 public vectors per list — never a statistic of the
  private set (not even its size).

Anything fitted to the private vectors (IVF/PQ/PCA trained on them, an HNSW
graph) is refused: one record's membership would then depend on the others.

Exactness. Codes, list assignments and probed lists are *pure functions* of a
vector: scores come from fp32 BLAS, and only what that product's rounding-error
bound makes certain is decided from it; rows with an entry within the bound of a
decision boundary (a sign, an argmax, the k-th largest) are recomputed in
float64, and entries still too close are decided exactly with ``math.fsum`` (a
correctly rounded sum of products that are exact in float64), ties going to the
lowest index.
So an incremental update equals a rebuild bit for bit, and a query's candidate
set does not depend on the batch it is in (SPEC §5). The kernel test itself
is the engine's: an fp32 BLAS screen with a safety margin, then κ recomputed in
float64 by :func:`engine.exact_kernel` — the same values the flat scan gives.
With every list probed (``nprobe = nlist``), or with hash tables that put every
candidate pair in a shared bucket, the answers equal the flat engine's exactly.

Storage: a Zarr group ``index`` inside the store (``<store>/index``), attributes
= metadata (kind, seed, tables, bits, nlist, nprobe, centroid source + sha256,
``n_rows`` covered: the commit point of an incremental update), arrays
``hyperplanes``/``codes`` (lsh) or ``centroids``/``lists`` (ivf) and ``erased``.
Codes are derived from private vectors: a deleted record's codes are
overwritten (``remove_rows``), like its features.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import secrets
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import zarr

from .engine import Candidates, dot_threshold, exact_kernel, screening_margin
from .errors import BadInputError, LockTimeoutError, PrivacyRefusedError, StoreError
from .store import FeatureStore, checksum_compressors, normalize_rows, vectors_sha256

INDEX_GROUP = "index"
INDEX_FORMAT_VERSION = 1
LOCK_NAME = ".indknn-index.lock"
KINDS = ("flat", "lsh", "ivf")
DEFAULT_TABLES = 30   # paper: L = 10–30
DEFAULT_BITS = 9      # paper: b = 8 (CIFAR-10), 9 (AG News)
MAX_BITS = 32
KMEANS_NITER = 20
MAX_NLIST_DEFAULT = 4096
MIN_POINTS_PER_LIST = 39  # faiss's own warning level for k-means training
ENCODE_ROWS = 32768
PAIR_BLOCK = 1 << 15
#: Refuse training vectors when at least this share is bit-identical to private records (a copy of the
#: private set, or most of one); a few duplicates (a query equal to a record) are expected in public data.
PRIVATE_OVERLAP_LIMIT = 0.10

_WHY = ("a record's candidate membership would then depend on the other private records, which breaks "
        "the individual filter's guarantee (SPEC §2 step 1 and §4: membership may depend only on the "
        "record, the query and public data)")
REFUSED_KINDS = {
    "hnsw": "--kind hnsw is refused: an HNSW graph is built from the private vectors themselves, so whether a "
            f"record is reached from a query depends on which other records are in the graph; {_WHY}. "
            "Use --kind lsh (data-independent hash tables), --kind ivf (centroids trained on public vectors) "
            "or flat.",
    "pca": "--kind pca is refused: a PCA fitted to the private vectors is a statistic of the private set; "
           f"{_WHY}. Reduce dimension with a public extractor instead.",
    "pq": "--kind pq is refused: product-quantisation codebooks trained on the private vectors make every "
          f"record's code depend on the others; {_WHY}. Use --kind ivf with public centroids or --kind lsh.",
    "ivfpq": "--kind ivfpq is refused: its PQ codebooks would be trained on the private vectors; "
             f"{_WHY}. Use --kind ivf (exact vectors in lists, centroids from public data).",
}


# -- exact decisions ---------------------------------------------------------------
def _exact_dots(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Correctly rounded dot products of one float32 vector with float32 rows ``w``.

    A float32×float32 product is exact in float64 (48 ≤ 53 significand bits)
    and ``math.fsum`` rounds the exact sum once, so the sign and the order of
    the results are those of the true dot products.
    """
    prods = np.asarray(w, np.float32).astype(np.float64) * np.asarray(x, np.float32).astype(np.float64)
    return np.array([math.fsum(row) for row in prods], dtype=np.float64)


U32, U64 = 2.0**-24, 2.0**-53


def _guard(x: np.ndarray, w: np.ndarray, *, u: float) -> np.ndarray:
    """Per-row bound on |fl(x·w) − x·w| for any summation order and FMA use, with unit roundoff u:
    γ_d ‖x‖ max‖w‖, γ_d = d·u / (1 − d·u) (Higham, Accuracy and Stability, Thm 3.1 + Cauchy–Schwarz), ×2."""
    d = x.shape[1]
    x64 = x.astype(np.float64)
    wmax = float(np.sqrt((w.astype(np.float64) ** 2).sum(axis=1)).max()) if w.size else 0.0
    gamma = d * u / (1.0 - d * u)
    return 2.0 * gamma * np.sqrt((x64 * x64).sum(axis=1)) * wmax + 1e-300


def _top_k_candidates(scores: np.ndarray, k: int, guard: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top k by ``scores`` (unordered) and the rows where the top k is not certain under ``guard``.

    Entries outside U = {j : s_j ≥ s_(k) − 2g} have true value < s_(k) − g ≤ the true
    value of each of the top k by s, so the true top k lies in U; it is certain when |U| = k.
    """
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    kth = np.take_along_axis(scores, part, axis=1).min(axis=1).astype(np.float64)
    crowded = (scores >= (kth - 2.0 * guard)[:, None]).sum(axis=1) > k
    return part, crowded


def _top_k(x: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest x_i·w_j per row, exactly (ties → lowest index), sorted ascending.

    A cascade: fp32 BLAS; rows not certain under its error bound again in float64; entries still
    too close to call in exact arithmetic (:func:`_exact_dots`). Each stage only decides what its
    bound makes certain, so the result is a function of the vectors alone.
    """
    m, total = x.shape[0], w.shape[0]
    if k >= total:
        return np.broadcast_to(np.arange(total), (m, total)).copy()
    part, crowded = _top_k_candidates(x @ w.T, k, _guard(x, w, u=U32))
    rows = np.flatnonzero(crowded)
    if rows.size:
        x64 = x[rows].astype(np.float64)
        s64 = x64 @ w.astype(np.float64).T
        g64 = _guard(x64, w, u=U64)
        sub, crowded64 = _top_k_candidates(s64, k, g64)
        for r in np.flatnonzero(crowded64):
            u_set = np.flatnonzero(s64[r] >= s64[r, sub[r]].min() - 2.0 * g64[r])
            ex = _exact_dots(x[rows[r]], w[u_set])
            sub[r] = u_set[np.lexsort((u_set, -ex))[:k]]
        part[rows] = sub
    return np.sort(part, axis=1)


def _signs(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[x_i·w_j ≥ 0] exactly (the same fp32 → float64 → exact cascade as :func:`_top_k`)."""
    proj = x @ w.T
    bits = proj >= 0.0
    rows = np.flatnonzero((np.abs(proj) <= _guard(x, w, u=U32)[:, None]).any(axis=1))
    if rows.size:
        x64 = x[rows].astype(np.float64)
        p64 = x64 @ w.astype(np.float64).T
        sub = p64 >= 0.0
        for i, j in zip(*np.nonzero(np.abs(p64) <= _guard(x64, w, u=U64)[:, None])):
            sub[i, j] = _exact_dots(x[rows[i]], w[j:j + 1])[0] >= 0.0
        bits[rows] = sub
    return bits


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


@dataclass
class IvfIndex:
    """Inverted lists over centroids trained on public vectors only (SPEC §4 "Any other candidate structure")."""

    centroids: np.ndarray  # float32 [nlist, d], unit rows

    @property
    def nlist(self) -> int:
        return int(self.centroids.shape[0])

    @classmethod
    def train(cls, public: np.ndarray, *, nlist: int, seed: int, niter: int = KMEANS_NITER) -> "IvfIndex":
        """Spherical k-means (faiss-cpu, seeded) on *public* vectors; the result never sees a private row."""
        import faiss

        public = np.ascontiguousarray(public, dtype=np.float32)
        if nlist < 1:
            raise BadInputError(f"--nlist must be ≥ 1, got {nlist}")
        if public.shape[0] < nlist:
            raise BadInputError(f"--nlist {nlist} needs at least {nlist} public training vectors, "
                                f"got {public.shape[0]}")
        if nlist == 1:
            c = public.astype(np.float64).sum(axis=0, keepdims=True)
            return cls(normalize_rows(c if np.any(c) else public[:1], what="centroid"))
        km = faiss.Kmeans(public.shape[1], int(nlist), niter=int(niter), seed=kmeans_seed(seed),
                          spherical=True, verbose=False, min_points_per_centroid=1)
        km.train(public)
        return cls(normalize_rows(np.asarray(km.centroids, np.float32), what="centroids"))

    def assign(self, x: np.ndarray) -> np.ndarray:
        """List of every row: the nearest centroid by inner product (exact; ties → lowest index)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty(x.shape[0], np.int32)
        for lo in range(0, x.shape[0], ENCODE_ROWS):
            xb = x[lo:lo + ENCODE_ROWS]
            out[lo:lo + xb.shape[0]] = _top_k(xb, self.centroids, 1)[:, 0]
        return out

    def probe(self, q: np.ndarray, nprobe: int) -> np.ndarray:
        """The ``nprobe`` lists nearest each query, [m, nprobe] (exact, sorted ascending)."""
        return _top_k(np.ascontiguousarray(q, dtype=np.float32), self.centroids, min(int(nprobe), self.nlist))


# -- storage -------------------------------------------------------------------------
def index_path(store_path: str | os.PathLike) -> Path:
    return Path(store_path) / INDEX_GROUP


def read_meta(store_path: str | os.PathLike) -> dict | None:
    """The index metadata of a store, or None when it has no index (flat search)."""
    path = index_path(store_path)
    if not (path / "zarr.json").is_file():
        return None
    try:
        return dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception as exc:  # noqa: BLE001 - corrupt metadata
        raise StoreError(f"{path}: the candidate index cannot be read ({type(exc).__name__}); "
                         "rebuild it with `indknn index --kind ...`") from None


@contextlib.contextmanager
def index_lock(store_path: str | os.PathLike, timeout: float = 300.0) -> Iterator[None]:
    """One index writer at a time (fcntl lock file in the store folder)."""
    fd = os.open(Path(store_path) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(f"{store_path}: another indknn process is writing the candidate index")
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _structure(group: zarr.Group, meta: dict) -> LshIndex | IvfIndex:
    kind = meta.get("kind")
    if meta.get("format_version") != INDEX_FORMAT_VERSION:
        raise StoreError(f"candidate index format {meta.get('format_version')!r}, this indknn reads "
                         f"{INDEX_FORMAT_VERSION}; rebuild it with `indknn index --kind {kind}`")
    if kind == "lsh":
        return LshIndex(np.asarray(group["hyperplanes"][:]), int(meta["tables"]), int(meta["bits"]),
                        int(meta["seed"]))
    if kind == "ivf":
        src = meta.get("centroid_source", {})
        if src.get("role") == "private":  # defence in depth: never serve from private-trained centroids
            raise PrivacyRefusedError(f"the index's centroids were trained on private vectors; {_WHY}")
        return IvfIndex(np.asarray(group["centroids"][:]))
    raise StoreError(f"unknown candidate index kind {kind!r}; rebuild it with `indknn index --kind ...`")


def _values_array(kind: str) -> str:
    return "codes" if kind == "lsh" else "lists"


def _encode(structure: LshIndex | IvfIndex, block: np.ndarray, deleted: np.ndarray) -> np.ndarray:
    """Codes / lists of a block of rows; erased rows get the sentinel (codes 0, list −1) without encoding."""
    if isinstance(structure, LshIndex):
        out = np.zeros((block.shape[0], structure.tables), structure.code_dtype)
    else:
        out = np.full(block.shape[0], -1, np.int32)
    live = ~deleted
    if live.any():
        out[live] = structure.codes(block[live]) if isinstance(structure, LshIndex) else structure.assign(block[live])
    return out


def _fill(group: zarr.Group, structure, store: FeatureStore, start: int, stop: int) -> None:
    """Write codes/lists and erased flags of store rows [start, stop) (arrays already sized)."""
    values = group[_values_array(group.attrs["kind"])]
    erased = group["erased"]
    step = max(store.chunk_rows, ENCODE_ROWS)
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        block = store.read("private", "features", lo, hi)
        deleted = store.read("private", "deleted", lo, hi).astype(bool)
        values[lo:hi] = _encode(structure, block, deleted)
        erased[lo:hi] = deleted


def _resize(group: zarr.Group, n: int) -> None:
    for name in ("codes", "lists", "erased"):
        if name in group:
            arr = group[name]
            if arr.shape[0] < n:
                arr.resize((n,) + tuple(arr.shape[1:]))


def add_rows(store: FeatureStore, rows=None, *, lock_timeout: float = 300.0) -> int:
    """Incremental add: encode the store's committed private rows the index does not cover yet.

    ``rows`` (the new rows, any order) is informational: the index is always
    brought up to the store's committed ``n_rows``, which includes them. The
    group attribute ``n_rows`` is written last (the commit point). Returns the
    number of rows encoded; 0 when there is no index.
    """
    if read_meta(store.path) is None:
        return 0
    with index_lock(store.path, lock_timeout):
        meta = read_meta(store.path)
        if meta is None or meta.get("kind") == "flat" or meta.get("store_uuid") != store.uuid:
            return 0  # another store's numbering (an unfinished compaction): `index` rebuilds it
        group = zarr.open_group(str(index_path(store.path)), mode="r+")
        covered, n = int(meta["n_rows"]), store.n_rows("private")
        if rows is not None and len(rows) and int(np.max(rows)) >= n:
            raise BadInputError(f"row {int(np.max(rows))} is past the store's {n} committed private rows")
        if n <= covered:
            return 0
        structure = _structure(group, meta)
        _resize(group, n)
        _fill(group, structure, store, covered, n)
        group.attrs.update({"n_rows": n})
        return n - covered


def remove_rows(store: FeatureStore, rows, *, lock_timeout: float = 300.0) -> int:
    """Incremental delete: overwrite the codes/list of deleted rows (they derive from the erased vectors).

    Rows past the index's coverage are left to :func:`add_rows`, which writes
    the sentinel for rows the store marks deleted. Returns rows overwritten.
    """
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    if rows.size == 0 or read_meta(store.path) is None:
        return 0
    with index_lock(store.path, lock_timeout):
        meta = read_meta(store.path)
        if meta is None or meta.get("kind") == "flat" or meta.get("store_uuid") != store.uuid:
            return 0
        rows = rows[(rows >= 0) & (rows < int(meta["n_rows"]))]
        if rows.size == 0:
            return 0
        group = zarr.open_group(str(index_path(store.path)), mode="r+")
        values = group[_values_array(meta["kind"])]
        if meta["kind"] == "lsh":
            values.set_orthogonal_selection((rows, slice(None)), np.zeros((rows.size, values.shape[1]),
                                                                          values.dtype))
        else:
            values.set_orthogonal_selection((rows,), np.full(rows.size, -1, np.int32))
        group["erased"].set_orthogonal_selection((rows,), np.ones(rows.size, bool))
        return int(rows.size)


def renumber_rows(store: FeatureStore, new_row_of, *, lock_timeout: float = 300.0) -> int:
    """After a compaction (``new_row_of[old] = new``, −1 = removed; kept rows stay in order): drop the
    removed rows' codes/lists and bind the index to the compacted store. Returns rows kept."""
    if read_meta(store.path) is None:
        return 0
    new_row_of = np.asarray(new_row_of, dtype=np.int64)
    with index_lock(store.path, lock_timeout):
        meta = read_meta(store.path)
        if meta is None or meta.get("kind") == "flat":
            return 0
        covered = min(int(meta["n_rows"]), new_row_of.size)
        keep = np.flatnonzero(new_row_of[:covered] >= 0)
        if keep.size and not (np.diff(new_row_of[keep]) > 0).all():
            raise StoreError("renumber_rows: kept rows must keep their order")
        path = index_path(store.path)
        group = zarr.open_group(str(path), mode="r+")
        tmp = store.path / f".index-renumber-{uuid.uuid4().hex[:8]}"
        try:
            new = zarr.open_group(str(tmp), mode="w")
            for name in group.array_keys():
                arr = group[name]
                data = np.asarray(arr[:covered])[keep] if name in ("codes", "lists", "erased") else np.asarray(arr[:])
                new.create_array(name, data=data, chunks=arr.chunks, fill_value=arr.fill_value,
                                 compressors=checksum_compressors())
            new.attrs.update(dict(meta, n_rows=int(keep.size), store_uuid=store.uuid))
            _swap_out(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    add_rows(store, lock_timeout=lock_timeout)
    return int(keep.size)


def reconcile(store: FeatureStore, *, lock_timeout: float = 300.0) -> dict:
    """Bring the index up to the store: encode new rows, overwrite rows the store has deleted since."""
    meta = read_meta(store.path)
    if meta is None or meta.get("kind") == "flat" or meta.get("store_uuid") != store.uuid:
        return {"added": 0, "removed": 0}
    added = add_rows(store, lock_timeout=lock_timeout)
    meta = read_meta(store.path)
    n = int(meta["n_rows"])
    deleted = store.read("private", "deleted", 0, n).astype(bool)
    erased = np.asarray(zarr.open_group(str(index_path(store.path)), mode="r")["erased"][:n])
    stale = np.flatnonzero(deleted & ~erased)
    removed = remove_rows(store, stale, lock_timeout=lock_timeout) if stale.size else 0
    return {"added": added, "removed": removed}


# -- training data for IVF ------------------------------------------------------------
def _role_of_zarr_dir(path: Path) -> str | None:
    """The indknn role attribute of a Zarr group at or above ``path`` (None if none)."""
    import json

    for p in [path, *path.parents][:4]:
        meta = p / "zarr.json"
        if meta.is_file():
            try:
                attrs = json.loads(meta.read_text()).get("attributes", {})
            except (OSError, ValueError):
                continue
            if "role" in attrs:
                return str(attrs["role"])
    return None


def _row_hashes(x: np.ndarray, mult: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    with np.errstate(over="ignore"):
        return (u * mult).sum(axis=1, dtype=np.uint64)


def _private_overlap(store: FeatureStore, train: np.ndarray) -> int:
    """Training rows bit-identical to a committed private row (64-bit row hash; one streamed pass)."""
    mult = np.random.Generator(np.random.PCG64(12345)).integers(1, 2**63, store.dim, dtype=np.uint64) | np.uint64(1)
    mine = np.unique(_row_hashes(train, mult))
    hits = np.zeros(mine.size, bool)
    for _, block in store.iter_chunks("private"):
        hits |= np.isin(mine, _row_hashes(block, mult))
    return int(hits.sum())


def _store_role_vectors(store: FeatureStore, role: str) -> np.ndarray:
    n = store.n_rows(role)
    if n == 0:
        return np.empty((0, store.dim), np.float32)
    x = store.read(role, "features", 0, n)
    return x[~store.read(role, "deleted", 0, n).astype(bool)]


NO_PUBLIC_MESSAGE = (
    "--kind ivf needs public vectors to train its centroids (training them on the private records is refused: "
    f"{_WHY}). This store has no public or query rows. Provide them with `indknn embed FILE --role public "
    "--store STORE` (vectors from the same extractor that are not private: a public corpus, past queries), "
    "or pass --train-on FILE.npy/.npz (an [n, d] array of public vectors), or use --kind lsh, which needs no data."
)


def load_training_vectors(store: FeatureStore, train_on: str | os.PathLike | None) -> tuple[np.ndarray, dict]:
    """Public training vectors for IVF centroids and where they came from; refuses private sources."""
    x, src = _training_source(store, train_on)
    overlap = _private_overlap(store, x)
    if overlap and overlap >= PRIVATE_OVERLAP_LIMIT * x.shape[0]:
        raise PrivacyRefusedError(
            f"--train-on {train_on or src['from']} is refused: {overlap} of its {x.shape[0]} vectors are identical "
            "to private records, so it looks like a copy of the private set; IVF centroids trained on private "
            f"vectors — {_WHY}")
    return x, src


def _training_source(store: FeatureStore, train_on) -> tuple[np.ndarray, dict]:
    if train_on is None:
        for role in ("public", "query"):
            x = _store_role_vectors(store, role)
            if x.shape[0]:
                return x, {"from": f"store:{role}", "role": role}
        raise PrivacyRefusedError(NO_PUBLIC_MESSAGE)
    spec = str(train_on)
    if spec == "private":
        raise PrivacyRefusedError(f"--train-on private is refused: IVF centroids trained on private vectors; {_WHY}")
    if spec in ("public", "query", "queries"):
        role = "query" if spec == "queries" else spec
        x = _store_role_vectors(store, role)
        if x.shape[0] == 0:
            raise PrivacyRefusedError(f"--train-on {spec}: the store has no {role} rows. " + NO_PUBLIC_MESSAGE)
        return x, {"from": f"store:{role}", "role": role}
    path = Path(spec)
    if not path.exists():
        raise BadInputError(f"--train-on {spec}: no such file, and not one of public, query")
    rp = path.resolve()
    private_dir = (store.path / "private").resolve()
    role = _role_of_zarr_dir(rp if rp.is_dir() else rp.parent)
    if rp == private_dir or private_dir in rp.parents or role == "private":
        raise PrivacyRefusedError(f"--train-on {spec} is refused: it is a store's private group; "
                                  f"IVF centroids trained on private vectors — {_WHY}")
    if rp == store.path.resolve():
        raise BadInputError(f"--train-on {spec} is the feature store itself; pass --train-on public or query")
    if rp.is_dir():
        if role is None:
            raise BadInputError(f"--train-on {spec}: a folder that is not a store group of public vectors")
        grp = zarr.open_group(str(rp if (rp / "features").exists() else rp.parent), mode="r")
        n = int(grp.attrs.get("n_rows", grp["features"].shape[0]))
        x = np.asarray(grp["features"][:n])
        if "deleted" in grp:
            x = x[~np.asarray(grp["deleted"][:n]).astype(bool)]
        src = {"from": "zarr", "role": role}
    elif rp.suffix == ".npy":
        x = np.load(rp, allow_pickle=False)
        src = {"from": "file", "role": "public"}
    elif rp.suffix == ".npz":
        with np.load(rp, allow_pickle=False) as z:
            keys = list(z.keys())
            key = next((k for k in ("x", "features", "vectors", "embeddings") if k in keys),
                       keys[0] if len(keys) == 1 else None)
            if key is None:
                raise BadInputError(f"--train-on {spec}: .npz with arrays {keys}; name one x, features or vectors")
            x = z[key]
        src = {"from": "file", "role": "public"}
    else:
        raise BadInputError(f"--train-on {spec}: expected public, query, a .npy/.npz file of vectors, "
                            "or a store group of public vectors")
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != store.dim:
        raise BadInputError(f"--train-on {spec}: vectors of shape {x.shape}, the store has d={store.dim}")
    x = normalize_rows(x, what=f"--train-on {spec}")  # per-vector only (SPEC §8)
    src["path"] = str(rp)
    return x, src


def kmeans_seed(seed: int) -> int:
    return int(seed) % (2**31)


def default_nlist(n_public: int) -> int:
    """A power of two with ≥ 39 public training points per list (depends on public data only, not on N)."""
    target = max(1, n_public // MIN_POINTS_PER_LIST)
    return int(min(MAX_NLIST_DEFAULT, 1 << (target.bit_length() - 1)))


def default_nprobe(nlist: int) -> int:
    return max(1, nlist // 8)


TARGET_RECALL = 0.95


def calibrate_nprobe(public: np.ndarray, *, nlist: int, seed: int, kernel: str, tau: float, nu: float | None,
                     target: float = TARGET_RECALL, holdout: float = 0.2, max_holdout: int = 20000,
                     max_queries: int = 2000) -> dict:
    """The smallest nprobe reaching candidate recall ``target``, measured on *public* vectors only.

    Vectors the centroids were trained on sit closer to them than new records
    do, so recall measured on them is optimistic: a held-out share of the public
    vectors is kept out of a k-means run of the same ``nlist`` and ``seed``, and
    recall is measured among the held-out vectors (a sample as queries against all
    of them, pairs with κ ≥ τ, self-pairs excluded). The final centroids are then
    trained on every public vector, as without calibration.
    """
    public = np.ascontiguousarray(public, dtype=np.float32)
    n = public.shape[0]
    rng = np.random.Generator(np.random.PCG64(seed))
    n_hold = min(int(n * holdout), max_holdout)
    if n - n_hold < nlist or n_hold < 2:
        return {"nprobe": default_nprobe(nlist), "method": "nlist/8 (too few public vectors to hold some out)"}
    perm = rng.permutation(n)
    hold = public[np.sort(perm[:n_hold])]
    ivf = IvfIndex.train(public[np.sort(perm[n_hold:])], nlist=nlist, seed=seed)
    qidx = np.sort(rng.choice(n_hold, size=min(n_hold, max_queries), replace=False))
    q = hold[qidx]
    lists = ivf.assign(hold)
    rank = np.empty((q.shape[0], ivf.nlist), np.int32)  # rank of each list for each query (0 = nearest)
    np.put_along_axis(rank, np.argsort(-(q @ ivf.centroids.T), axis=1, kind="stable"),
                      np.arange(ivf.nlist, dtype=np.int32)[None, :].repeat(q.shape[0], 0), axis=1)
    thr = dot_threshold(kernel=kernel, tau=tau, nu=nu)
    hist = np.zeros(ivf.nlist, np.int64)
    for lo in range(0, n_hold, 16384):
        sc = q @ hold[lo:lo + 16384].T
        qi, rj = np.nonzero(sc >= thr)
        rj = rj + lo
        keep = qidx[qi] != rj
        hist += np.bincount(rank[qi[keep], lists[rj[keep]]], minlength=ivf.nlist)
    pairs = int(hist.sum())
    if pairs == 0:
        return {"nprobe": default_nprobe(nlist), "method": f"nlist/8 (no held-out public pairs with κ ≥ τ={tau})"}
    cum = np.cumsum(hist) / pairs
    lower = cum - 2.0 * np.sqrt(cum * (1.0 - cum) / pairs)  # ~97.5% lower bound: erring toward more lists
    nprobe = int(np.flatnonzero(lower >= target - 1e-12)[0] + 1) if (lower >= target - 1e-12).any() else ivf.nlist
    return {"nprobe": nprobe, "method": f"smallest nprobe whose candidate recall on held-out public vectors "
                                        f"(centroids trained without them) is ≥ {target} at 2 standard errors",
            "heldout_vectors": int(n_hold), "heldout_queries": int(q.shape[0]), "heldout_pairs": pairs,
            "heldout_recall": round(float(cum[nprobe - 1]), 4), "tau": float(tau), "kernel": kernel}


# -- planning and building --------------------------------------------------------------
@dataclass
class IndexPlan:
    """What `index` will do to the candidate structure; computed (and refused) before anything is written."""

    kind: str
    action: str  # keep | remove | build | update
    structure: LshIndex | IvfIndex | None = None
    meta: dict = field(default_factory=dict)
    train_seconds: float = 0.0


def check_kind(kind: str | None) -> None:
    kind = None if kind is None else kind.lower()
    if kind is None or kind in KINDS:
        return
    if kind in REFUSED_KINDS:
        raise PrivacyRefusedError(REFUSED_KINDS[kind])
    raise BadInputError(f"--kind must be one of {', '.join(KINDS)} (hnsw is refused), got {kind!r}")


def plan_index(
    store: FeatureStore, *, kind: str | None, tables: int | None = None, bits: int | None = None,
    seed: int | None = None, nlist: int | None = None, nprobe: int | None = None,
    train_on: str | os.PathLike | None = None, params=None,
) -> IndexPlan:
    """Validate the request, train IVF centroids on public data; raises before anything is written.

    ``params`` (PrivacyParams, or a callable returning them, called only when an
    IVF is trained) gives the kernel and τ for calibrating ``nprobe``.

    ``kind=None`` keeps the store's current kind (flat when it has no index),
    so re-running `index` to add records never drops or rebuilds an index.
    """
    check_kind(kind)
    kind = None if kind is None else kind.lower()
    existing = read_meta(store.path)
    current = existing["kind"] if existing else "flat"
    if existing and current != "flat" and existing.get("store_uuid") != store.uuid:
        # Rows were renumbered (a compaction that did not finish renumbering the index): re-encode
        # every row with the same public structure (same hyperplanes / centroids).
        if kind in (None, current) and all(v is None for v in (tables, bits, seed, nlist, train_on)):
            group = zarr.open_group(str(index_path(store.path)), mode="r")
            meta = {k: v for k, v in existing.items() if k not in ("n_rows", "store_uuid", "built")}
            if nprobe is not None:
                meta["nprobe"] = min(int(nprobe), int(existing["nlist"]))
            return IndexPlan(current, "build", _structure(group, existing), meta=meta)
    kind = kind or current
    if kind != "lsh" and (tables is not None or bits is not None):
        raise BadInputError(f"--tables/--bits apply to --kind lsh, not {kind}")
    if kind != "ivf" and (nlist is not None or nprobe is not None or train_on is not None):
        raise BadInputError(f"--nlist/--nprobe/--train-on apply to --kind ivf, not {kind}")
    if kind == "flat":
        if seed is not None:
            raise BadInputError("--index-seed applies to --kind lsh or ivf")
        return IndexPlan("flat", "remove" if existing else "keep", meta={"kind": "flat"})
    if kind == "lsh":
        same = existing is not None and current == "lsh"
        if same and tables in (None, existing["tables"]) and bits in (None, existing["bits"]) \
                and seed in (None, existing["seed"]):
            return IndexPlan("lsh", "keep", meta=existing)
        tables = tables if tables is not None else (existing["tables"] if same else DEFAULT_TABLES)
        bits = bits if bits is not None else (existing["bits"] if same else DEFAULT_BITS)
        seed = secrets.randbits(63) if seed is None else int(seed)
        lsh = LshIndex.from_seed(seed=seed, tables=int(tables), bits=int(bits), dim=store.dim)
        return IndexPlan("lsh", "build", lsh, meta={
            "kind": "lsh", "seed": lsh.seed, "tables": lsh.tables, "bits": lsh.bits,
            "hyperplanes": "standard normal, numpy PCG64(SeedSequence(seed)), float32 [tables*bits, d]",
            "hyperplanes_sha256": vectors_sha256(lsh.hyperplanes)})
    # ivf
    if nprobe is not None and nprobe < 1:
        raise BadInputError(f"--nprobe must be ≥ 1, got {nprobe}")
    if existing and current == "ivf" and train_on is None and nlist in (None, existing["nlist"]) \
            and seed in (None, existing["seed"]):
        if nprobe is None or nprobe == existing["nprobe"]:
            return IndexPlan("ivf", "keep", meta=existing)
        return IndexPlan("ivf", "update", meta=dict(existing, nprobe=min(int(nprobe), int(existing["nlist"])),
                                                    nprobe_calibration={"method": "set with --nprobe"}))
    public, source = load_training_vectors(store, train_on)
    nlist = default_nlist(public.shape[0]) if nlist is None else int(nlist)
    seed = secrets.randbits(31) if seed is None else int(seed)
    source.update(rows=int(public.shape[0]), sha256=vectors_sha256(public))
    t0 = time.perf_counter()
    ivf = IvfIndex.train(public, nlist=nlist, seed=seed)
    calibration = None
    if callable(params):
        params = params()
    if nprobe is None and params is not None:
        calibration = calibrate_nprobe(public, nlist=nlist, seed=seed, kernel=params.kernel, tau=params.tau,
                                       nu=params.nu)
        nprobe = calibration["nprobe"]
    nprobe = default_nprobe(nlist) if nprobe is None else min(int(nprobe), nlist)
    return IndexPlan("ivf", "build", ivf, train_seconds=time.perf_counter() - t0, meta={
        "kind": "ivf", "seed": seed, "nlist": nlist, "nprobe": int(nprobe), "nprobe_calibration": calibration,
        "centroid_source": source,
        "kmeans": {"library": "faiss-cpu", "spherical": True, "niter": KMEANS_NITER, "seed": kmeans_seed(seed)},
        "centroids_sha256": vectors_sha256(ivf.centroids)})


def apply_plan(store: FeatureStore, plan: IndexPlan, *, lock_timeout: float = 300.0) -> dict:
    """Carry out a plan: build into a temporary group, then swap it in as ``<store>/index``."""
    t0 = time.perf_counter()
    path = index_path(store.path)
    if plan.action == "keep":
        info = reconcile(store, lock_timeout=lock_timeout) if plan.kind != "flat" else {}
        meta = read_meta(store.path) or {"kind": "flat"}
        return _public_meta(meta, rows_added=info.get("added", 0), seconds=time.perf_counter() - t0)
    with index_lock(store.path, lock_timeout):
        if plan.action == "remove":
            _swap_out(path)
            return {"kind": "flat", "removed_index": True}
        if plan.action == "update":
            zarr.open_group(str(path), mode="r+").attrs.update(
                {k: plan.meta[k] for k in ("nprobe", "nprobe_calibration")})
            return _public_meta(read_meta(store.path), rows_added=0, seconds=time.perf_counter() - t0)
        n = store.n_rows("private")
        tmp = store.path / f".index-build-{uuid.uuid4().hex[:8]}"
        try:
            group = zarr.open_group(str(tmp), mode="w")
            rows_chunk = 65536
            if plan.kind == "lsh":
                s: LshIndex = plan.structure
                group.create_array("hyperplanes", data=s.hyperplanes, chunks=s.hyperplanes.shape,
                                   compressors=checksum_compressors())
                group.create_array("codes", shape=(n, s.tables), chunks=(rows_chunk, s.tables),
                                   dtype=s.code_dtype, fill_value=0, compressors=checksum_compressors())
            else:
                s: IvfIndex = plan.structure
                group.create_array("centroids", data=s.centroids, chunks=s.centroids.shape,
                                   compressors=checksum_compressors())
                group.create_array("lists", shape=(n,), chunks=(rows_chunk * 4,), dtype="int32", fill_value=-1,
                                   compressors=checksum_compressors())
            group.create_array("erased", shape=(n,), chunks=(rows_chunk * 4,), dtype="bool", fill_value=False,
                               compressors=checksum_compressors())
            group.attrs.update(dict(plan.meta, format_version=INDEX_FORMAT_VERSION, store_uuid=store.uuid,
                                    dim=store.dim, n_rows=0))
            t_enc = time.perf_counter()
            _fill(group, plan.structure, store, 0, n)
            group.attrs.update({"n_rows": n, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "encode_seconds": round(time.perf_counter() - t_enc, 3),
                                "train_seconds": round(plan.train_seconds, 3)})
            _swap_out(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    added = add_rows(store, lock_timeout=lock_timeout)  # rows committed while we encoded
    return _public_meta(read_meta(store.path), rows_added=n + added, seconds=time.perf_counter() - t0)


def _swap_out(path: Path) -> None:
    if path.exists():
        old = path.with_name(f".index-old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        shutil.rmtree(old, ignore_errors=True)


def _public_meta(meta: dict, *, rows_added: int, seconds: float) -> dict:
    """Index metadata for `index` output (no statistic of private data beyond the row count)."""
    out = {k: v for k, v in meta.items() if k not in ("format_version", "store_uuid")}
    out.update(rows_encoded=int(rows_added), seconds=round(seconds, 3))
    return out


def build(store: FeatureStore, *, kind: str | None, lock_timeout: float = 300.0, **options) -> dict:
    """plan_index + apply_plan in one call (benchmarks, tests)."""
    return apply_plan(store, plan_index(store, kind=kind, **options), lock_timeout=lock_timeout)


# -- candidate finders -------------------------------------------------------------------
#: Cost model of this 2-core CPU (seconds per unit) used to pick the cheaper of two identical LSH strategies.
COST_PER_MAC = 1.0 / 70e9        # fp32 BLAS
COST_PER_BYTE_STREAM = 1.0 / 5e9
COST_PER_BYTE_GATHER = 1.0 / 2.5e9
COST_PER_CALL = 30e-6


def _read_private(store: FeatureStore, n: int) -> np.ndarray:
    x = np.empty((n, store.dim), np.float32)
    for start, block in store.iter_chunks("private"):
        stop = min(n, start + block.shape[0])
        if stop > start:
            x[start:stop] = block[:stop - start]
    return x


def _collect(m: int, qi: np.ndarray, rows: np.ndarray, kap: np.ndarray) -> Candidates:
    order = np.lexsort((rows, qi))
    qi, rows, kap = qi[order], rows[order], kap[order]
    bounds = np.searchsorted(qi, np.arange(m + 1))
    return Candidates([rows[bounds[t]:bounds[t + 1]].astype(np.int64) for t in range(m)],
                      [kap[bounds[t]:bounds[t + 1]] for t in range(m)])


class _FinderBase:
    kind = "?"

    def __init__(self, *, kernel: str, tau: float, nu: float | None, dim: int):
        self.kernel, self.tau, self.nu = kernel, float(tau), nu
        self.screen = dot_threshold(kernel=kernel, tau=tau, nu=nu) - screening_margin(dim)
        self.last: dict = {}

    def _exact(self, m, queries, qi, rows, vectors, vec_idx) -> Candidates:
        """κ in float64 (engine.exact_kernel, as the flat scan) and the exact test κ ≥ τ."""
        order = np.lexsort((rows, qi))
        qi, rows, vec_idx = qi[order], rows[order], vec_idx[order]
        bounds = np.searchsorted(qi, np.arange(m + 1))
        kap = np.empty(qi.size, np.float64)

        def exact_one(t):
            # One query against its rows: q broadcasts, so every value is bit-identical to the flat scan's
            # exact_kernel(x_rows, q_rows) (same elementwise products, same per-row reduction).
            for lo in range(bounds[t], bounds[t + 1], PAIR_BLOCK):
                hi = min(bounds[t + 1], lo + PAIR_BLOCK)
                kap[lo:hi] = exact_kernel(vectors[vec_idx[lo:hi]], queries[t:t + 1], kernel=self.kernel, nu=self.nu)

        _parallel_blocks(np.flatnonzero(bounds[1:] > bounds[:-1]).tolist(), exact_one)
        ok = kap >= self.tau
        self.last["candidate_pairs"] = int(ok.sum())
        qi, rows, kap = qi[ok], rows[ok], kap[ok]
        bounds = np.searchsorted(qi, np.arange(m + 1))
        return Candidates([rows[bounds[t]:bounds[t + 1]].astype(np.int64) for t in range(m)],
                          [kap[bounds[t]:bounds[t + 1]] for t in range(m)])

    def _screen(self, q: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = q @ x.T
        return np.nonzero(s >= self.screen)


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

    def __call__(self, queries: np.ndarray, row_mask: np.ndarray | None = None) -> Candidates:
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
        if strategy == "scan":
            qi, rows = self._scan(q, qcodes)
        else:
            qi, rows = self._buckets(q, plans)
        keep = self.live[rows] & _allowed(row_mask, rows)
        qi, rows = qi[keep], rows[keep]
        self.last["screened_pairs"] = int(qi.size)
        return self._exact(m, q, qi, rows, self.x, rows)

    def _scan(self, q, qcodes):
        out_q, out_r = [], []
        step = max(1, min(65536, (256 << 20) // (4 * max(1, q.shape[0]))))
        for lo in range(0, self.x.shape[0], step):
            qi, ri = self._screen(q, self.x[lo:lo + step])
            rows = ri.astype(np.int64) + lo
            share = np.zeros(qi.size, bool)
            for a in range(0, qi.size, PAIR_BLOCK):
                b = a + PAIR_BLOCK
                share[a:b] = (self.codes[rows[a:b]] == qcodes[qi[a:b]]).any(axis=1)
            out_q.append(qi[share]); out_r.append(rows[share])
        return _cat(out_q, np.int64), _cat(out_r, np.int64)

    def _buckets(self, q, plans):
        def scan_bucket(task):
            t, u = task
            order, first, counts, lo, hi = plans[t]
            qs = order[first[u]:first[u] + counts[u]]
            rows = self.perm[t][lo[u]:hi[u]]
            a, b = self._screen(q[qs], np.take(self.x, rows, axis=0))
            return qs[a], rows[b].astype(np.int64)

        tasks = [(t, int(u)) for t, p in enumerate(plans) for u in np.flatnonzero(p[4] > p[3])]
        found = _parallel_blocks(tasks, scan_bucket)
        qi, rows = _cat([f[0] for f in found], np.int64), _cat([f[1] for f in found], np.int64)
        if qi.size:  # a pair found in several tables counts once
            key = np.unique(qi * self.x.shape[0] + rows)
            qi, rows = key // self.x.shape[0], key % self.x.shape[0]
        return qi, rows


class IvfFinder(_FinderBase):
    """Candidates = rows in the query's ``nprobe`` nearest lists with κ ≥ τ (lists stored contiguously)."""

    kind = "ivf"

    def __init__(self, index: IvfIndex, sorted_x: np.ndarray, order: np.ndarray, offsets: np.ndarray, *,
                 nprobe: int, kernel: str, tau: float, nu: float | None):
        super().__init__(kernel=kernel, tau=tau, nu=nu, dim=index.centroids.shape[1])
        self.index, self.xs, self.order, self.offsets = index, sorted_x, order, offsets
        self.nprobe = min(int(nprobe), index.nlist)

    def __call__(self, queries: np.ndarray, row_mask: np.ndarray | None = None) -> Candidates:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        m = q.shape[0]
        probe = self.index.probe(q, self.nprobe)
        li = probe.ravel()
        qi_all = np.repeat(np.arange(m), probe.shape[1])
        o = np.argsort(li, kind="stable")
        li, qi_all = li[o], qi_all[o]
        bounds = np.searchsorted(li, np.arange(self.index.nlist + 1))
        off = self.offsets

        def scan_list(j):
            qs = qi_all[bounds[j]:bounds[j + 1]]
            a, b = self._screen(q[qs], self.xs[off[j]:off[j + 1]])
            return qs[a], b.astype(np.int64) + off[j]

        found = _parallel_blocks(np.flatnonzero((bounds[1:] > bounds[:-1]) & (off[1:] > off[:-1])).tolist(),
                                 scan_list)
        qi, pos = _cat([f[0] for f in found], np.int64), _cat([f[1] for f in found], np.int64)
        rows = self.order[pos]
        if row_mask is not None:
            keep = _allowed(row_mask, rows)
            qi, pos, rows = qi[keep], pos[keep], rows[keep]
        self.last = {"screened_pairs": int(qi.size), "lists_scanned": int(len(np.unique(li)))}
        return self._exact(m, q, qi, rows, self.xs, pos)


_POOL: dict = {}


def _blas_one_thread():
    """A context holding BLAS to one thread (threadpoolctl ships with scikit-learn); the controller,
    which scans the loaded libraries, is built once."""
    if "controller" not in _POOL:
        try:
            from threadpoolctl import ThreadpoolController

            _POOL["controller"] = ThreadpoolController()
        except ImportError:  # pragma: no cover
            _POOL["controller"] = None
    ctl = _POOL["controller"]
    return ctl.limit(limits=1, user_api="blas") if ctl is not None else contextlib.nullcontext()


def _parallel_blocks(tasks: list, work: Callable) -> list:
    """Run ``work(task)`` over many small matrix products: BLAS held to one thread per product (its own
    threading costs more than a small product under load) and the tasks spread over the CPU cores.
    Results come back in task order, so the output never depends on the scheduling."""
    workers = max(1, min(os.cpu_count() or 1, 8))
    if len(tasks) < 4 * workers:
        return [work(t) for t in tasks]
    if "executor" not in _POOL:
        from concurrent.futures import ThreadPoolExecutor

        _POOL["executor"] = ThreadPoolExecutor(workers, thread_name_prefix="indknn-index")
    chunks = [tasks[i::workers] for i in range(workers)]
    with _blas_one_thread():
        parts = list(_POOL["executor"].map(lambda c: [work(t) for t in c], chunks))
    out = [None] * len(tasks)
    for i, part in enumerate(parts):
        out[i::workers] = part
    return out


def _allowed(row_mask: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """The engine's row mask at ``rows``; rows past it (committed after the caller read the store) are out."""
    if row_mask is None:
        return np.ones(rows.size, bool)
    inside = rows < row_mask.size
    out = np.zeros(rows.size, bool)
    out[inside] = row_mask[rows[inside]]
    return out


def _cat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)


def open_finder(store: FeatureStore, *, kernel: str, tau: float, nu: float | None, nprobe: int | None = None,
                strategy: str = "auto", reconcile_first: bool = True):
    """The candidate finder of the store's index (None when flat); features are held in memory."""
    if read_meta(store.path) is None:
        return None
    if reconcile_first:
        reconcile(store)
    meta = read_meta(store.path)
    if meta is None or meta.get("kind") == "flat":
        return None
    if meta.get("store_uuid") != store.uuid or int(meta.get("dim", -1)) != store.dim:
        raise StoreError(f"{index_path(store.path)}: the candidate index was built for other row numbers "
                         "(the store was compacted or replaced); re-encode it with `indknn index`")
    group = zarr.open_group(str(index_path(store.path)), mode="r")
    structure = _structure(group, meta)
    n = int(meta["n_rows"])
    live = ~np.asarray(group["erased"][:n]).astype(bool)
    if meta["kind"] == "lsh":
        codes = np.asarray(group["codes"][:n])
        return LshFinder(structure, _read_private(store, n), codes, live, kernel=kernel, tau=tau, nu=nu,
                         strategy=strategy)
    lists = np.asarray(group["lists"][:n]).astype(np.int64)
    lists[~live] = -1
    order = np.argsort(lists, kind="stable")
    order = order[lists[order] >= 0]
    offsets = np.searchsorted(lists[order], np.arange(structure.nlist + 1)).astype(np.int64)
    pos_of_row = np.full(n, -1, np.int64)
    pos_of_row[order] = np.arange(order.size)
    xs = np.empty((order.size, store.dim), np.float32)
    for start, block in store.iter_chunks("private"):
        stop = min(n, start + block.shape[0])
        pos = pos_of_row[start:stop]
        ok = pos >= 0
        xs[pos[ok]] = block[:stop - start][ok]
    return IvfFinder(structure, xs, order.astype(np.int64), offsets,
                     nprobe=int(meta["nprobe"] if nprobe is None else nprobe), kernel=kernel, tau=tau, nu=nu)


def load_candidate_finder(store: FeatureStore, ledger, **options) -> Callable[..., Candidates] | None:
    """``finder(queries, row_mask=...) -> Candidates`` for `serve-queries`, or None for flat search."""
    p = ledger.params
    return open_finder(store, kernel=p.kernel, tau=p.tau, nu=p.nu, **options)
