"""A fence for `embed --scheduler`'s worker writes: a run whose coordinator is gone stops writing (review 23, F1).

The workers of a Dask embed write whole store chunks past the committed ``n_rows`` while the coordinator holds
the store's write lock (and, on object storage, its writer lease). A coordinator killed outright (kill -9, the
OOM killer, a lost machine) releases them at once, but a partition already running on a worker goes on: the next
writer then wrote its own people at the same uncommitted rows and the partition wrote its chunks over them, so
that one person's vector sat under another's id and an erasure could not find it. Cancelling cannot stop a task
that runs; the workers must stop themselves.

- :func:`begin`: before its first partition, the coordinator writes a **stamp**, ``{"run", "state": "running"}``,
  where every worker can read it (``dask-run.json`` in a local store's folder; ``<store name>.indknn-dask-run.json``
  beside a store on object storage); :func:`end` removes it once no partition can run any more (all finished,
  or drained after a failure).
- :func:`check`: a worker reads the stamp before **each** chunk it writes and writes only while the stamp names its
  run as running (:class:`Fenced` otherwise: the task fails, nothing more is written).
- :func:`revoke_orphan`: every writer, once it holds the store's write lock, looks for a stamp of a run that is not
  its own process's. Since the coordinator holds that lock for its whole run, such a stamp is an orphan's: the
  writer marks it revoked, waits :data:`GRACE_SECONDS` (a chunk write that passed its check just before the
  revocation has finished by then), removes it, and only then writes. A stamp left by a drain that timed out is
  revoked the same way.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from . import store_lease
from .errors import BadInputError
from .fsio import atomic_write_text

log = logging.getLogger(__name__)

LOCAL_NAME = "dask-run.json"
SUFFIX = ".indknn-dask-run.json"
#: Seconds a writer waits after revoking an orphaned run's stamp: longer than one chunk's write takes. None:
#: ``$INDKNN_DASK_FENCE_SECONDS``, else 5 (:func:`grace_seconds`).
GRACE_SECONDS: float | None = None


def env_seconds(name: str, default: float) -> float:
    """A duration from the environment, read when it is used (review 61: parsed at import, a bad value failed the
    import with a bare ValueError that named neither the variable nor the value)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise BadInputError(f"${name} must be a number of seconds (0 or more), got {text!r}")
    return value


def grace_seconds() -> float:
    return GRACE_SECONDS if GRACE_SECONDS is not None else env_seconds("INDKNN_DASK_FENCE_SECONDS", 5.0)

_ACTIVE: set[str] = set()  # runs this process's coordinators have begun and not ended
_guard = threading.Lock()


class Fenced(RuntimeError):
    """Raised on a worker whose run's stamp is gone or revoked: its coordinator is gone; nothing more is written."""


def place(store) -> dict:
    """Where the stamp of ``store`` is, as a worker can read it: ``{"url", "options"}`` or ``{"path"}``."""
    if store.remote is not None:
        return {"url": store_lease.lease_url(store.remote, SUFFIX), "options": dict(store.remote.options)}
    return {"path": str(Path(store.path).resolve() / LOCAL_NAME)}


def _fs(where: dict):
    """The object store's filesystem (a stamp beside a store on object storage)."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(where["url"], **(where.get("options") or {}))
    return fs


def _read(where: dict) -> dict | None:
    try:
        raw = Path(where["path"]).read_bytes() if "path" in where else _fs(where).cat_file(where["url"])
    except FileNotFoundError:
        return None
    try:
        out = json.loads(raw)
    except ValueError:
        return {"run": None, "state": "unreadable"}
    return out if isinstance(out, dict) else {"run": None, "state": "unreadable"}


def _write(where: dict, body: dict) -> None:
    if "path" in where:
        atomic_write_text(json.dumps(body), Path(where["path"]))
    else:
        _fs(where).pipe_file(where["url"], json.dumps(body).encode())


def _remove(where: dict) -> None:
    if "path" in where:
        Path(where["path"]).unlink(missing_ok=True)
        return
    try:
        _fs(where).rm_file(where["url"])
    except FileNotFoundError:
        pass


def begin(store, run: str) -> dict:
    """Stamp ``run`` as running (the caller holds the store's write lock); returns where, for the workers."""
    where = place(store)
    with _guard:
        _ACTIVE.add(run)
    _write(where, {"run": run, "state": "running", "pid": os.getpid(),
                   "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return where


def end(store, run: str) -> None:
    """Remove the stamp of ``run`` (no partition of it can run any more)."""
    where = place(store)
    now = _read(where)
    if now is not None and now.get("run") == run:
        _remove(where)
    with _guard:
        _ACTIVE.discard(run)


def forget(run: str) -> None:
    """This process no longer answers for ``run`` (a drain that timed out): its stamp stays for the next writer."""
    with _guard:
        _ACTIVE.discard(run)


def check(where: dict, run: str) -> None:
    """On a worker, before each chunk it writes: the stamp must name ``run`` as running."""
    now = _read(where)
    if now is None or now.get("run") != run or now.get("state") != "running":
        raise Fenced(f"embed run {run}: its coordinator is gone (the store's next writer revoked the run); "
                     "this partition writes nothing more")


def revoke_orphan(store) -> bool:
    """Called by every writer holding the store's write lock: revoke a stamp of a run this process did not begin
    (its coordinator is gone), wait for chunk writes in flight, remove it. True when one was revoked."""
    where = place(store)
    now = _read(where)
    if now is None:
        return False
    with _guard:
        if now.get("run") in _ACTIVE:
            return False
    try:  # read before anything is written; a bad value never blocks the writer (an erasure among them: review 64)
        grace = grace_seconds()
    except BadInputError as exc:
        log.warning("%s; the default 5 s is used", exc)
        grace = 5.0
    if now.get("state") == "running":
        _write(where, {**now, "state": "revoked", "revoked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    log.warning("an embed --scheduler run (%s) ended without its coordinator; its workers were told to stop; "
                "waiting %.0f s for a chunk write in flight", now.get("run"), grace)
    time.sleep(grace)  # also for a stamp already revoked: its revoker may have died during its wait
    _remove(where)
    return True
