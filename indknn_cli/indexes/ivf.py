"""``ivf``: coarse centroids trained on public vectors only, where the training vectors come from
(and what is refused), nprobe calibration on held-out public vectors, and its finder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr

from ..candidates import import_faiss
from ..engine import Candidates, dot_threshold
from ..errors import BadInputError, PrivacyRefusedError
from ..store import FeatureStore, normalize_rows
from .common import (ENCODE_ROWS, KMEANS_NITER, MAX_NLIST_DEFAULT, MIN_POINTS_PER_LIST,
                     NEAR_DUPLICATE_COSINE, PRIVATE_OVERLAP_LIMIT, _WHY, _allowed, _cat, _FinderBase, _parallel_blocks, _top_k)


# -- the structure ------------------------------------------------------------------
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
        faiss = import_faiss()

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


def _near_private(store: FeatureStore, train: np.ndarray, *, block: int = 4096) -> np.ndarray:
    """Per training vector: is its cosine to some committed, not-deleted private row ≥ NEAR_DUPLICATE_COSINE?

    Found through the engine's own candidate search (:func:`engine.find_candidates`: fp32 screen with a
    safety margin, then κ in float64), so the decision is exact for the float32 vectors and catches copies
    perturbed by rounding or small noise, not only bit-identical ones. The result is for the refusal only:
    neither which vectors matched nor how many is ever printed (that would be a membership oracle).
    """
    from ..engine import StoreSource, find_candidates

    n = store.n_rows("private")
    hit = np.zeros(train.shape[0], bool)
    if n == 0 or train.shape[0] == 0:
        return hit
    live = ~store.read("private", "deleted", 0, n).astype(bool)
    source = StoreSource(store)
    for lo in range(0, train.shape[0], block):
        cands = find_candidates(np.ascontiguousarray(train[lo:lo + block], np.float32), source, kernel="cosine",
                                tau=NEAR_DUPLICATE_COSINE, nu=None, row_mask=live)
        hit[lo:lo + block] = [r.size > 0 for r in cands.rows]
    return hit


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
    """Public training vectors for IVF centroids and where they came from; refuses private sources.

    The vectors are trusted to be public data (SPEC §8: a statistic over the private set is computed on
    public data or paid for). As a guard against mistakes, vectors (near-)identical to a private record
    (cosine ≥ NEAR_DUPLICATE_COSINE) are refused: any of them in a ``--train-on`` file or folder; in the
    store's own public/query rows, where a query equal to a record is expected, only when they make up
    PRIVATE_OVERLAP_LIMIT of the rows (a copy of the private set). The refusal never says how many or which.
    """
    x, src = _training_source(store, train_on)
    near = _near_private(store, x)
    external = src["from"] in ("file", "zarr")
    if near.any() and (external or near.sum() >= PRIVATE_OVERLAP_LIMIT * x.shape[0]):
        raise PrivacyRefusedError(
            f"--train-on {train_on or src['from']} is refused: it contains vectors identical or nearly identical "
            f"(cosine ≥ 1 − {1.0 - NEAR_DUPLICATE_COSINE:.0e}) to private records, so it is not public data; "
            f"IVF centroids trained on private vectors — {_WHY}. --train-on must be public data only "
            "(vectors of records that are not in the private set).")
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


# -- finder ---------------------------------------------------------------------------
class IvfFinder(_FinderBase):
    """Candidates = rows in the query's ``nprobe`` nearest lists with κ ≥ τ (lists stored contiguously)."""

    kind = "ivf"

    def __init__(self, index: IvfIndex, sorted_x: np.ndarray, order: np.ndarray, offsets: np.ndarray, *,
                 nprobe: int, kernel: str, tau: float, nu: float | None):
        super().__init__(kernel=kernel, tau=tau, nu=nu, dim=index.centroids.shape[1])
        self.index, self.xs, self.order, self.offsets = index, sorted_x, order, offsets
        self.nprobe = min(int(nprobe), index.nlist)

    def __call__(self, queries: np.ndarray, row_mask: np.ndarray | None = None,
                 max_pairs: int | None = None) -> Candidates:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        m = q.shape[0]
        probe = self.index.probe(q, self.nprobe)
        li = probe.ravel()
        qi_all = np.repeat(np.arange(m), probe.shape[1])
        o = np.argsort(li, kind="stable")
        li, qi_all = li[o], qi_all[o]
        bounds = np.searchsorted(li, np.arange(self.index.nlist + 1))
        off = self.offsets

        count = self._pairs(m, max_pairs)

        def scan_list(j):
            qs = qi_all[bounds[j]:bounds[j + 1]]
            base = int(off[j])
            a, b = self._screen(q[qs], lambda i, k: self.xs[base + i:base + k], int(off[j + 1]) - base, count)
            return qs[a], b + base

        found = _parallel_blocks(np.flatnonzero((bounds[1:] > bounds[:-1]) & (off[1:] > off[:-1])).tolist(),
                                 scan_list)
        qi, pos = _cat([f[0] for f in found], np.int64), _cat([f[1] for f in found], np.int64)
        rows = self.order[pos]
        if row_mask is not None:
            keep = _allowed(row_mask, rows)
            qi, pos, rows = qi[keep], pos[keep], rows[keep]
        self.last = {"screened_pairs": int(qi.size), "lists_scanned": int(len(np.unique(li)))}
        self._check_pairs(m, qi.size, max_pairs)
        return self._exact(m, q, qi, rows, self.xs, pos)
