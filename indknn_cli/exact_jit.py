"""The float64 recompute of candidate pairs, compiled (numba), bit for bit numpy's (issue 21).

:func:`indknn_cli.candidates.exact_kernel_pairs` defines κ of a pair as numpy computes it: the d float64
products (cosine) or squared differences (RBF) of the two float32 rows, each exact or correctly rounded,
summed by numpy's per-row reduction, which is the pairwise summation of ``numpy/_core/src/umath/
loops_utils.h.src`` (``@TYPE@_pairwise_sum``): fewer than 8 terms are added in order from 0.0; up to 128
(``PW_BLOCKSIZE``) go into 8 running sums ``r[j] += a[i + j]``, combined as
``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``, then the remainder added in order; longer runs are
split at ``n2 = n // 2 − (n // 2) mod 8`` and the two halves' sums added.

This module runs the same operations in the same order, compiled, reading the float32 rows in place: no
gathered float64 copies, no temporary products; four pairs at a time, so that one pair's additions need
not wait on its previous ones (each pair's sums are still its own). IEEE arithmetic without reassociation
or contraction (numba's default: no fastmath) rounds every step as numpy does, so the sums are the same
bits, and the result is added to 0.0 as numpy's reduction adds it to its identity (a −0.0 sum becomes
+0.0). Before the compiled path is used for a width, kernel and dtypes, :func:`agrees_with_numpy`
compares it with numpy on probe data on the running machine; any difference or failure there leaves
``candidates.exact_kernel_pairs`` on numpy's path (same numbers, slower), so a numpy that changed its
summation, or a broken numba, changes no candidate and raises nothing. tests/test_exact_jit.py pins the
bits on random, near-cancelling, signed-zero and extreme-magnitude data.

The kernels are in :mod:`indknn_cli.exact_jit_kernels`, imported when a batch is large enough
(``candidates.use_compiled``: the batch size and the store's size), before any private row is read: the first process on a machine compiles them (about 5 s
here) into numba's on-disk cache (``__pycache__`` beside the module, else numba's per-user cache
directory, or ``NUMBA_CACHE_DIR``); later processes load them (numba's import and the load: ~0.45 s).
``INDKNN_EXACT_THREADS`` caps the threads a large call is cut across (default: the process's cores, ≤ 8).
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from .threads import ProcessPool, usable_cores

#: numpy's PW_BLOCKSIZE: runs up to this length are summed with 8 running sums.
PW_BLOCKSIZE = 128

_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a lock another thread held at fork() would stay held in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_kernels: dict | None = None
_agrees: dict = {}


def pairwise_plan(d: int) -> np.ndarray:
    """numpy's pairwise split of ``d`` terms as a postorder program: a row (a, n) pushes the sum of terms
    a … a+n−1 (n ≤ 128, one leaf), a row (−1, 0) replaces the two values on top of the stack by their sum."""
    if d < 0:
        raise ValueError(f"d must be non-negative, got {d!r}")
    ops: list[tuple[int, int]] = []
    todo: list[tuple[int, int, bool]] = [(0, d, False)]
    while todo:  # iterative postorder (numpy recurses: left half, right half, add)
        a, n, expanded = todo.pop()
        if expanded:
            ops.append((-1, 0))
        elif n <= PW_BLOCKSIZE:
            ops.append((a, n))
        else:
            n2 = n // 2
            n2 -= n2 % 8
            todo += [(a, n, True), (a + n2, n - n2, False), (a, n2, False)]
    return np.array(ops, dtype=np.int64).reshape(-1, 2)


def _compile() -> dict | None:
    """The compiled kernels, or None when numba cannot be imported."""
    global _kernels
    with _lock:
        if _kernels is not None:
            return _kernels or None
        try:
            from . import exact_jit_kernels
        except Exception:  # numba not installed, or a broken install: numpy's path is the same numbers
            _kernels = {}
            return None
        _kernels = {"pair_sums": exact_jit_kernels.pair_sums}
        return _kernels


def available() -> bool:
    """Whether the compiled path can run here (numba importable)."""
    return _compile() is not None


#: Pairs per thread below which a call stays on one thread (a thread's start costs more than it saves).
PAIRS_PER_THREAD = 32768
_pool = ProcessPool("indknn-exact")


def default_threads() -> int:
    """Threads for a large call: the cores this process may run on, at most 8."""
    raw = os.environ.get("INDKNN_EXACT_THREADS", "").strip()
    if raw.isdigit() and int(raw) >= 1:  # anything else is ignored: a setting must never raise mid-serve
        return min(int(raw), 64)
    return usable_cores()


def _executor():
    """The process's one pool of :func:`default_threads` workers (:class:`~indknn_cli.threads.ProcessPool`)."""
    return _pool.get(default_threads())


def pair_sums(x: np.ndarray, xi: np.ndarray, q: np.ndarray, qi: np.ndarray, *, kernel: str,
              threads: int | None = None) -> np.ndarray:
    """Σ_k x[xi[p], k]·q[qi[p], k] (cosine) or Σ_k (x[xi[p], k] − q[qi[p], k])² (RBF) for every pair p,
    in float64, summed as numpy sums a row. ``x`` and ``q``: C-contiguous float32 or float64 rows.

    A large call is cut into contiguous runs of pairs summed on ``threads`` threads (default
    :func:`default_threads`; the compiled loop releases the GIL). Each pair's sum is its own, so the cut
    changes no bit; it shortens the wall time, not the CPU seconds."""
    kernels = _compile()
    if kernels is None:
        raise RuntimeError("numba is not available")
    if kernel not in ("cosine", "rbf"):
        raise ValueError(f"kernel must be 'cosine' or 'rbf', got {kernel!r}")
    # C-contiguous, aligned and writable whatever the caller passed (a read-only memory map, say): one numba
    # type per dtype pair, the one the probe compiled under the lock and checked against numpy.
    x = np.require(x, requirements=["C", "A", "W"])
    q = np.require(q, requirements=["C", "A", "W"])
    if x.dtype not in (np.float32, np.float64) or q.dtype not in (np.float32, np.float64):
        raise ValueError(f"rows must be float32 or float64, got {x.dtype} and {q.dtype}")
    if x.shape[1] != q.shape[1]:
        raise ValueError(f"rows of different widths: {x.shape[1]} and {q.shape[1]}")
    xi = np.require(xi, dtype=np.int64, requirements=["C", "A", "W"])
    qi = np.require(qi, dtype=np.int64, requirements=["C", "A", "W"])
    if xi.shape != qi.shape or xi.ndim != 1:
        raise ValueError(f"xi and qi must be 1-d of one length, got {xi.shape} and {qi.shape}")
    out = np.empty(xi.size, dtype=np.float64)
    if xi.size == 0:
        return out
    # Out-of-range indices would read outside the arrays (the compiled loop does not check): check here.
    if int(xi.min()) < 0 or int(xi.max()) >= x.shape[0] or int(qi.min()) < 0 or int(qi.max()) >= q.shape[0]:
        raise IndexError("pair index out of range")
    plan = pairwise_plan(x.shape[1])
    cosine = kernel == "cosine"
    n = xi.size
    threads = default_threads() if threads is None else int(threads)
    parts = max(1, min(threads, n // PAIRS_PER_THREAD))
    if parts == 1:
        kernels["pair_sums"](x, xi, q, qi, plan, cosine, out)
        return out
    pool, workers = _executor()
    parts = min(parts, workers)
    cuts = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
    futures = [pool.submit(kernels["pair_sums"], x, xi[a:b], q, qi[a:b], plan, cosine, out[a:b])
               for a, b in zip(cuts[:-1], cuts[1:])]
    for f in futures:
        f.result()
    return out


def _probe(d: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Rows that exercise rounding: unit vectors, near-cancelling pairs, wide magnitudes (fixed seed)."""
    rng = np.random.default_rng(20261126 + d)
    x = rng.standard_normal((24, d))
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    x[8:12] *= np.exp2(rng.integers(-60, 60, size=(4, d)))
    x[22] = 0.0  # signed zeros: −0.0 products and differences sum to +0.0 in numpy's reduction
    x[23] = -0.0
    q = np.concatenate([x[:8] + 1e-7 * rng.standard_normal((8, d)), -x[8:16], rng.standard_normal((8, d))])
    q[23] = 0.0
    return x.astype(dtype), q.astype(dtype)


#: Longest wait for another process's compile before this one gives up and uses numpy's path.
COMPILE_LOCK_WAIT_S = 300.0


def _lock_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "indknn")


@contextlib.contextmanager
def _compile_lock():
    """One process at a time compiles or loads the kernels (numba's on-disk cache takes no lock of its own:
    two processes writing it at once could leave an index naming the other's code). The lock file lives in
    the user's own cache folder (``$XDG_CACHE_HOME/indknn``, mode 0700), is opened without following a
    symbolic link and must be a regular file of this user. Yields False when it cannot be had within
    COMPILE_LOCK_WAIT_S (the caller then keeps numpy's path)."""
    import fcntl
    import stat
    import time

    try:
        folder = _lock_dir()
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(folder, "numba-compile.lock"),
                     os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        yield True  # no lock possible here: the probe still guards the numbers
        return
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            yield False
            return
        deadline = time.monotonic() + COMPILE_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)


def agrees_with_numpy(d: int, *, kernel: str, x_dtype=np.float32, q_dtype=np.float32) -> bool:
    """Whether the compiled sums equal numpy's on probe data of width ``d`` (checked once per process per
    width, kernel and dtypes; the check is also the kernels' compilation for those types). False when numba
    is missing or anything in compiling, loading or running the kernels fails: the caller then takes
    numpy's path, which gives the same numbers, so no error reaches the caller from here.

    While it compiles, ``NUMBA_SLP_VECTORIZE=1`` (unless the caller set it) lets LLVM pack the 8 running
    sums into SIMD lanes, a lane per sum, no addition reordered; numba leaves it off by default because it
    has miscompiled other code (numba PR #8852), which is one more reason every compiled kernel is checked
    against numpy here before use. The variable is removed again afterwards."""
    key = (int(d), kernel, np.dtype(x_dtype).str, np.dtype(q_dtype).str)
    if key in _agrees:
        return _agrees[key]
    ok = False
    try:
        with _compile_lock() as locked:
            if not locked:
                raise TimeoutError("the compile lock could not be had")
            set_slp = "NUMBA_SLP_VECTORIZE" not in os.environ
            if set_slp:
                os.environ["NUMBA_SLP_VECTORIZE"] = "1"
            try:
                if available():
                    x, _ = _probe(int(d), x_dtype)
                    _, q = _probe(int(d), q_dtype)
                    # 575 pairs: groups of four and a remainder of three, so both kernels are checked
                    xi = np.repeat(np.arange(x.shape[0]), q.shape[0])[:-1]
                    qi = np.tile(np.arange(q.shape[0]), x.shape[0])[:-1]
                    got = pair_sums(x, xi, q, qi, kernel=kernel, threads=1)
                    from .candidates import exact_sums

                    want = exact_sums(x[xi], q[qi], kernel=kernel)
                    ok = bool(np.array_equal(got.view(np.int64), want.view(np.int64)))
            finally:
                if set_slp:
                    os.environ.pop("NUMBA_SLP_VECTORIZE", None)
    except Exception:  # a broken numba, a damaged cache, …: numpy's path
        ok = False
    _agrees[key] = ok
    return ok
