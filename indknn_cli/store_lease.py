"""One writer per store on object storage, across machines: a lease object in the bucket (audit 8, F1).

A store on ``s3://`` keeps its locks in the coordinator's local state folder (:mod:`.object_store`), and a
``flock`` on one machine does not exclude another: two machines appending to one prefix at once interleaved
their chunk writes, so that one person's vectors ended under another person's ids and an erasure request for
the first missed them. Every write to such a store (:meth:`FeatureStore.write_lock`, and the creation of a
store) therefore also holds a *lease*: an object next to the store's prefix,

    <store URL as named>.indknn-writer.json   (``s3://bucket/indknn-writer.json`` for an older store at a bucket's
    root; a new one is refused there)

created with a conditional put (``If-None-Match: *``, s3fs ``mode="create"``): S3 lets exactly one of two
concurrent creators succeed, the other gets 412 (``FileExistsError``) and waits, up to the caller's lock
timeout, then is refused (:class:`~.errors.LockTimeoutError`, exit 1, nothing written). The lease is deleted
when the write ends.

The lease has no expiry, on purpose: a holder that paused past an expiry would go on writing beside the next
one, which is the fault being fixed. A lease left by a process that died is recognised when it names *this*
machine (``$INDKNN_STATE_DIR/machine-id``, the host name and the kernel's boot id, so that a cloned
machine-id is not enough) and either this state root (whose local lock ``$INDKNN_STATE_DIR/leases/<hash>.lock``,
an ``flock`` released when a process dies, every live holder holds and the new writer now holds) or a process that
no longer runs (pid and start time): it is replaced at once (:func:`_dead_here`). A lease left by another
machine that died stays until someone removes it; the refusal names the object, its holder (host, process, since
when) and its token, and `indknn break-lease --store URL --token TOKEN` (:func:`break_lease`) removes exactly that
lease. The ledger writers (serve-queries, index, delete, repair) hold a second lease of the same kind,
``<store name>.indknn-ledger-writer.json`` (review 23, F2). On a filesystem other
than S3, fsspec's generic ``pipe_file(mode="create")`` checks, then writes: the lease narrows the window
there but does not close it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

from . import locking
from .errors import BadInputError, LockTimeoutError, StoreError
from .object_store import RemoteLocation, canonical_url, filesystem, is_compaction_prefix, state_root

SUFFIX = ".indknn-writer.json"
#: The ledger writers' lease (serve-queries, index, delete, repair: whoever commits to the store's ledger), held
#: across machines as the local ledger-writer lock is held on one (review 23, F2); beside the writer lease.
LEDGER_SUFFIX = ".indknn-ledger-writer.json"
#: What each lease is called in messages.
KINDS = {SUFFIX: "writer lease", LEDGER_SUFFIX: "ledger-writer lease"}
MACHINE_ID = "machine-id"
POLL_SECONDS = 0.25

_held: dict[tuple, list] = {}  # (state root, lease URL, thread) -> [depth, token]: one thread re-entering its own
# lease (embed: create, then append); the state root is the machine's identity. Another thread of this process
# waits on the local lease lock like another process.
_guard = threading.Lock()
_retained: set[str] = set()  # leases left in place when their holder ends (retain): see ledger_mark_remote.write


def retain(loc: RemoteLocation, suffix: str = SUFFIX) -> None:
    """Leave this process's lease of ``loc`` (kind ``suffix``) in the bucket when its ``with`` block ends: another
    machine is then refused until a writer of this machine and state root takes it over (its holder is gone) or
    someone runs break-lease. Used when a commit's high-water mark could not be written to the bucket: until this
    machine commits again, the bucket's mark is behind its ledger, and a copy elsewhere must not commit (review 25)."""
    with _guard:
        _retained.add(lease_url(loc, suffix))


def lease_url(loc: RemoteLocation, suffix: str = SUFFIX) -> str:
    """Where the lease of the store named ``loc.name`` lives (a sibling object of its prefix; the name is
    stable across compactions, which move the data to ``<name>.compacted-<token>``)."""
    name = canonical_url(loc.name)
    if is_compaction_prefix(name):  # one prefix of data, two names: two sets of leases and marks (review 31)
        raise StoreError(f"{loc.name}: a compaction's prefix (`<name>.compacted-<token>`) is not a store's name; "
                         "nothing writes through it: open the store by the name it was made under (its state folder "
                         "points at the compaction)")
    if "/" not in name.split("://", 1)[1]:  # a store at a bucket's root: a sibling would be another bucket
        return f"{name}/{suffix.lstrip('.')}"
    return name + suffix


def machine_id() -> str:
    """This machine's indknn identity (a random id kept in the state root; made once, atomically)."""
    root = state_root()
    root.mkdir(parents=True, exist_ok=True)
    p = root / MACHINE_ID
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex)
            f.flush()
            os.fsync(f.fileno())
    for _ in range(50):  # a concurrent creator may not have written it yet
        text = p.read_text().strip()
        if text:
            return text
        time.sleep(0.01)
    raise StoreError(f"{p}: empty machine id; remove the file and run again")


def boot_id() -> str:
    """This boot of this machine (Linux: the kernel's random boot id; elsewhere empty, and then only the pid
    check below tells a dead holder from a live one)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (Linux: field 22 of /proc/PID/stat, clock ticks since boot); None elsewhere
    or when it does not run. With the pid it names one process: a pid reused later has another start time."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return raw[raw.rindex(")") + 2:].split()[19]  # the fields after the command name, which may hold spaces
    except (ValueError, IndexError):
        return None


def _alive(pid, start=None) -> bool:
    """Whether process ``pid`` runs here and, when the lease recorded its ``start`` time, is still that process (a
    container restarted, or pid reuse, gives the pid to another process: review 23, F3). An unreadable pid counts
    as alive: the lease is then kept."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        pass
    if isinstance(start, str) and start:
        now = _start_time(pid)
        return now is None or now == start  # unreadable: kept
    return True


def _root_tag() -> str:
    """This state root, as a lease records it (a hash of its resolved path)."""
    return hashlib.sha256(str(state_root().resolve()).encode()).hexdigest()[:24]


def _dead_here(other: dict, *, me: str, host: str, boot: str) -> bool:
    """Whether a lease names a holder on this boot of this machine that no longer runs. The caller holds the local
    lease lock of this state root, which every live holder under this state root holds too: a lease naming this
    state root is therefore dead whatever its pid now names. One naming another state root on this machine (a
    copied machine-id) is dead only when its process is gone."""
    if not (other.get("machine") == me and other.get("host") == host and other.get("boot") == boot):
        return False
    if other.get("root") == _root_tag():
        return True
    return not _alive(other.get("pid"), other.get("pid_start"))


#: The key under which :func:`_read` keeps the version (S3's ETag) of the lease it read; never written anywhere.
ETAG = "_etag"


def _is_s3(fs) -> bool:
    protocol = getattr(fs, "protocol", "")
    return "s3" in ((protocol,) if isinstance(protocol, str) else tuple(protocol))


async def _get_with_etag(fs, url: str):
    bucket, key, _ = fs.split_path(url)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)  # body and ETag of one version, one request
    try:
        return await resp["Body"].read(), resp.get("ETag")
    finally:
        resp["Body"].close()


def _read(fs, url: str) -> dict | None:
    """The lease now at ``url`` (None when there is none); an unreadable one is a holder we cannot name. On S3 the
    body and the ETag come from one request, and the ETag is kept under :data:`ETAG` for :func:`_remove_if`."""
    etag = None
    try:
        if _is_s3(fs):
            from fsspec.asyn import sync

            raw, etag = sync(fs.loop, _get_with_etag, fs, url)
        else:
            raw = fs.cat_file(url)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp: endpoint down, no permission
        raise StoreError(f"cannot read the store's lease {url} ({type(exc).__name__}: {exc})") from None
    try:
        out = json.loads(raw)
        out = out if isinstance(out, dict) else {"token": None}
    except ValueError:
        out = {"token": None}
    out[ETAG] = etag
    return out


def _precondition_failed(exc: BaseException) -> bool:
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            err = response.get("Error") or {}
            meta = response.get("ResponseMetadata") or {}
            if err.get("Code") in ("PreconditionFailed", "412") or meta.get("HTTPStatusCode") == 412:
                return True
    return False


def _remove_if(fs, url: str, read: dict) -> bool:
    """Remove the lease at ``url`` only if it is still the version ``read`` (as :func:`_read` returned it): on S3 a
    delete with ``If-Match: <ETag>``, so that a lease released and taken by another writer between the read and the
    removal is left in place (review 23's open window). Returns False when the lease changed (nothing removed),
    True when it was removed or is gone. A server that ignores ``If-Match`` deletes unconditionally, as before;
    elsewhere than S3 the delete is unconditional (fsspec has no conditional delete)."""
    etag = read.get(ETAG)
    try:
        if etag and _is_s3(fs):
            bucket, key, _ = fs.split_path(url)
            fs.invalidate_cache(url)
            fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        else:
            fs.rm_file(url)
    except FileNotFoundError:
        return True
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp
        if _precondition_failed(exc):
            return False
        raise
    return True


def _describe(other: dict) -> str:
    return (f"host {other.get('host', '?')!s}, process {other.get('pid', '?')!s}, "
            f"since {other.get('since', '?')!s}")


#: The token `break-lease --token` takes for a lease whose body cannot be read as a lease (it names no holder).
UNREADABLE = "unreadable"


def _token(other: dict) -> str:
    tok = other.get("token")
    return tok if isinstance(tok, str) and tok else UNREADABLE


def break_lease(store, *, token: str | None = None) -> dict:
    """Show the leases of the remote store ``store`` (a URL or its local state folder: the writer lease and the
    ledger writers' lease) and, when ``token`` names one of them, remove it: the way out when the machine that held
    it is gone (a crash), which no other machine can tell from a long write. Returns ``{"store", "leases": [{"kind",
    "lease", "holder"}...] (those held), "removed"}`` (the URL removed, or None).

    Only the lease whose token is ``token`` is removed; when none has it (released since, or taken by another
    writer: another token) nothing is removed (BadInputError). Between the read and the removal (one request) a
    holder that was alive after all could release it and a new writer take it: on S3 the removal is a delete
    with ``If-Match`` on the version read, so the new writer's lease stays (BadInputError, nothing removed). Break
    only a lease whose machine is known to be gone: a holder that lives goes on writing (docs/OBJECT_STORAGE.md)."""
    from .object_store import local_path, location

    folder = local_path(store)
    loc = location(folder)
    if loc is None:
        raise BadInputError(f"{store}: a local store has no lease (its locks are flocks the system releases when "
                            "the process holding them ends); nothing to break")
    fs = filesystem(loc)
    held, read = [], {}
    for suffix, kind in KINDS.items():
        url = lease_url(loc, suffix)
        other = _read(fs, url)
        if other is not None:
            read[url] = other
            held.append({"kind": kind, "lease": url, "holder": {
                **{k: other.get(k) for k in ("host", "pid", "since", "machine")}, "token": _token(other)}})
    out = {"store": loc.name, "leases": held, "removed": None}
    if token is None or not held:
        return out
    match = [h for h in held if h["holder"]["token"] == token]
    if not match:
        now = "; ".join(f"{h['kind']} {h['holder']['token']}" for h in held)
        raise BadInputError(f"{loc.name}: no lease of the store has the token {token} (now: {now}): it was released "
                            "or taken by another writer since; nothing removed")
    url = match[0]["lease"]
    try:
        removed = _remove_if(fs, url, read[url])
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp: endpoint down, no permission
        raise StoreError(f"{loc.name}: cannot remove the lease {url} ({type(exc).__name__}: {exc})") from None
    if not removed:
        raise BadInputError(f"{loc.name}: the {match[0]['kind']} with the token {token} was released and taken by "
                            "another writer while this ran; nothing removed (run again to see who holds it now)")
    out["removed"] = url
    return out


@contextlib.contextmanager
def hold(loc: RemoteLocation, *, timeout: float, suffix: str = SUFFIX) -> Iterator[None]:
    """Hold the store's writer lease (``suffix``: or its ledger-writer lease) for the ``with`` block (re-entrant
    within one process)."""
    url = lease_url(loc, suffix)
    kind = KINDS[suffix]
    key = (str(state_root()), url, threading.get_ident())
    with _guard:
        mine = _held.get(key)
        if mine is not None:
            mine[0] += 1
    if mine is not None:
        try:
            yield
        finally:
            with _guard:
                mine[0] -= 1
        return

    deadline = time.monotonic() + timeout
    lock_file = state_root() / "leases" / f"{hashlib.sha256(url.encode()).hexdigest()[:24]}.lock"
    lock_file.parent.mkdir(parents=True, exist_ok=True)

    def busy_here() -> LockTimeoutError:
        return LockTimeoutError(f"{loc.name}: another indknn process on this machine is writing this store")

    with locking.exclusive_file(lock_file, timeout=timeout, on_timeout=busy_here):
        fs = filesystem(loc)
        me = machine_id()
        host = socket.gethostname()
        token = uuid.uuid4().hex
        boot = boot_id()
        body = json.dumps({"token": token, "machine": me, "host": host, "boot": boot, "pid": os.getpid(),
                           "pid_start": _start_time(os.getpid()), "root": _root_tag(),
                           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "store": loc.name}).encode()
        while True:
            try:
                fs.pipe_file(url, body, mode="create")
                break
            except FileExistsError:
                pass
            except Exception as exc:  # noqa: BLE001 - botocore/aiohttp: endpoint down, no permission
                raise StoreError(f"{loc.name}: cannot write the store's {kind} {url} "
                                 f"({type(exc).__name__}: {exc})") from None
            other = _read(fs, url)
            if other is None:
                continue  # released meanwhile: try again
            if _dead_here(other, me=me, host=host, boot=boot):
                # written on this machine since its last boot (a cloned machine-id has another boot id) by a
                # holder that no longer runs: under this state root (whose local lease lock we hold), or a
                # process that is gone (its pid free, or now another process's); only that version of it
                _remove_if(fs, url, other)
                continue
            if time.monotonic() >= deadline:
                where = ("a process of this machine under another state folder (or one that ran before an "
                         "upgrade) holds" if other.get("machine") == me and other.get("host") == host
                         else "another machine holds")
                raise LockTimeoutError(
                    f"{loc.name}: {where} the store's {kind} ({_describe(other)}); nothing "
                    f"was written. Run again when it is done. If its holder is gone (a crash), remove the lease "
                    f"with `indknn break-lease --store {loc.name} --token {_token(other)}` (or delete the object "
                    f"{url}) and run again (docs/OBJECT_STORAGE.md)")
            time.sleep(POLL_SECONDS)
        with _guard:
            _held[key] = [1, token]
        try:
            yield
        finally:
            with _guard:
                _held.pop(key, None)
                keep = url in _retained
                _retained.discard(url)
            if not keep:
                with contextlib.suppress(Exception):  # a lease we cannot remove is reported by the next writer
                    now = _read(fs, url)
                    if now is not None and now.get("token") == token:
                        _remove_if(fs, url, now)  # not a lease another writer put there since (a break-lease)
