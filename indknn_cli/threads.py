"""The process's worker threads: how many cores it may use, and thread pools made once per process
(the exact recompute's, :mod:`indknn_cli.exact_jit`; the FAISS screen's, :mod:`indknn_cli.faiss_screen`; the
bf16 screen's, :mod:`indknn_cli.bf16_screen`; the index finders', :mod:`indknn_cli.indexes.common`). A GPU
serve also runs two single threads of its own for the run, made and joined by
:mod:`indknn_cli.serve_pipeline` (``indknn-screen-ahead``, ``indknn-commit``)."""

from __future__ import annotations

import os
import threading


def usable_cores(*, cap: int = 8) -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count), at most ``cap``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, cap))


class ProcessPool:
    """A thread pool made on first use and made again in a forked child (whose copy of the parent's threads
    is dead); never replaced otherwise, so a caller holding it keeps a live pool."""

    def __init__(self, name: str, *, initializer=None):
        self._name, self._initializer = name, initializer
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._executor = None
        self._workers = 0
        if hasattr(os, "register_at_fork"):  # a lock another thread held at fork() would stay held in the child
            os.register_at_fork(after_in_child=self._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

    def get(self, workers: int):
        """(executor, its worker count): the process's pool, made with ``workers`` threads if not made yet."""
        with self._lock:
            if self._pid != os.getpid():
                from concurrent.futures import ThreadPoolExecutor

                self._executor = ThreadPoolExecutor(workers, thread_name_prefix=self._name,
                                                    initializer=self._initializer)
                self._pid, self._workers = os.getpid(), workers
            return self._executor, self._workers
