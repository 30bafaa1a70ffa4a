"""The one way indknn compiles a kernel with numba: ``nogil`` (kernels run beside the next tile's product), no
fastmath unless asked (no reassociation, no contraction: the bits are numpy's), cached on disk where numba finds a
writable place, else compiled per process. Imported only by the ``*_kernels`` modules, which import numba."""

from __future__ import annotations

import numba


def njit(fn=None, **options):
    """``numba.njit(nogil=True, cache=True, **options)``; without a writable cache location, the same uncached.
    Usable bare (``@njit``) or with options (``@njit(inline="always")``, ``@njit(error_model="numpy")``)."""
    if fn is None:
        return lambda f: njit(f, **options)
    try:
        return numba.njit(nogil=True, cache=True, **options)(fn)
    except Exception:  # noqa: BLE001 - no writable cache location: compile per process instead
        return numba.njit(nogil=True, **options)(fn)
