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

Package layout: ``common`` (constants, exact decisions, finder helpers), ``lsh``, ``ivf``
(structure, public training data, nprobe calibration, finder), ``storage`` (the index inside the store)
and ``build`` (planning, building, opening finders). Everything public is re-exported here.
"""

from __future__ import annotations

from ..store import normalize_rows, vectors_sha256  # noqa: F401  (re-exported, as before the split)
from .build import (IndexPlan, apply_plan, build, check_kind, load_candidate_finder, open_finder,  # noqa: F401
                    plan_index)
from .common import *  # noqa: F401,F403
from .common import (_POOL, _WHY, U32, U64, _allowed, _blas_one_thread, _cat, _collect, _exact_dots,  # noqa: F401
                     _FinderBase, _guard, _parallel_blocks, _read_private, _signs, _top_k, _top_k_candidates)
from .ivf import (NO_PUBLIC_MESSAGE, TARGET_RECALL, IvfFinder, IvfIndex, calibrate_nprobe,  # noqa: F401
                  default_nlist, default_nprobe, kmeans_seed, load_training_vectors)
from .ivf import _near_private, _role_of_zarr_dir, _store_role_vectors, _training_source  # noqa: F401
from .lsh import COST_PER_BYTE_GATHER, COST_PER_BYTE_STREAM, COST_PER_CALL, COST_PER_MAC, LshFinder, LshIndex  # noqa: F401
from .storage import (add_rows, index_lock, index_path, read_meta, reconcile, remove_rows,  # noqa: F401
                      renumber_rows)
from .storage import _encode, _fill, _resize, _structure, _swap_out, _values_array  # noqa: F401
from .build import _public_meta  # noqa: F401
