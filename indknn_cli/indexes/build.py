"""Planning and building an index (`indknn index`), and opening the finder `serve-queries` uses."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import zarr

from ..engine import Candidates
from ..errors import BadInputError, PrivacyRefusedError, StoreError
from ..store import FeatureStore, vectors_sha256
from .common import DEFAULT_BITS, DEFAULT_TABLES, KINDS, KMEANS_NITER, REFUSED_KINDS, _read_private
from .ivf import IvfFinder, IvfIndex, calibrate_nprobe, default_nlist, default_nprobe, kmeans_seed, load_training_vectors
from .lsh import LshFinder, LshIndex
from .storage import (_structure, _swap_out, add_rows, index_lock, index_path, read_meta, reconcile,
                      remove_stale_copies, write_index)


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
        if seed is not None and not 0 <= int(seed) < 2**63:  # "Internal error: ValueError" before (review 38, F7)
            raise BadInputError(f"--index-seed must be a whole number in [0, 2^63), got {seed}")
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
    if seed is not None and not 0 <= int(seed) < 2**31:
        raise BadInputError(f"--index-seed must be a whole number in [0, 2^31) for ivf, got {seed}")
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
        remove_stale_copies(store.path)  # a killed build's codes (review 38, F2)
        if plan.action == "remove":
            _swap_out(path)
            return {"kind": "flat", "removed_index": True}
        if plan.action == "update":
            zarr.open_group(str(path), mode="r+").attrs.update(
                {k: plan.meta[k] for k in ("nprobe", "nprobe_calibration")})
            return _public_meta(read_meta(store.path), rows_added=0, seconds=time.perf_counter() - t0)
        n = write_index(store, plan.structure, plan.meta, train_seconds=plan.train_seconds)
    added = add_rows(store, lock_timeout=lock_timeout)  # rows committed while we encoded
    return _public_meta(read_meta(store.path), rows_added=n + added, seconds=time.perf_counter() - t0)


def _public_meta(meta: dict, *, rows_added: int, seconds: float) -> dict:
    """Index metadata for `index` output (no statistic of private data beyond the row count)."""
    out = {k: v for k, v in meta.items() if k not in ("format_version", "store_uuid")}
    out.update(rows_encoded=int(rows_added), seconds=round(seconds, 3))
    return out


def build(store: FeatureStore, *, kind: str | None, lock_timeout: float = 300.0, **options) -> dict:
    """plan_index + apply_plan in one call (benchmarks, tests)."""
    return apply_plan(store, plan_index(store, kind=kind, **options), lock_timeout=lock_timeout)


# -- candidate finders -------------------------------------------------------------------
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
