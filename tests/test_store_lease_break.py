"""`indknn break-lease`: a writer lease left on object storage by a machine that is gone blocked every write to
the store, an erasure included, until someone deleted the object by hand (audit 8, F1's known gap). The refusal
now names the lease's token, and `break-lease --store URL --token TOKEN` removes exactly that lease; a real
moto server, real `indknn` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from indknn_cli.store import open_store  # noqa: E402

from .test_audit_8 import _store  # noqa: E402
from .test_object_store import s3, state  # noqa: E402,F401 (the moto server and the state folder fixtures)

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, state_dir: Path):
    env = {**os.environ, "INDKNN_STATE_DIR": str(state_dir), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "indknn_cli", "break-lease", *args], env=env, capture_output=True,
                       text=True, timeout=120)
    return r.returncode, [json.loads(line) for line in r.stdout.splitlines()], r.stderr


@pytest.mark.heavy
def test_a_dead_machines_lease_is_shown_then_removed_by_its_token_and_the_erasure_goes_on(s3, state, tmp_path):
    from indknn_cli import object_store, store_lease
    from indknn_cli.deletion import delete_records
    from indknn_cli.errors import LockTimeoutError

    url, _ = _store(tmp_path, s3, n=120, d=16)
    st = open_store(url, mode="a")
    fs = object_store.filesystem(st.remote)
    lease = store_lease.lease_url(st.remote)
    fs.pipe_file(lease, json.dumps({"token": "t-dead", "machine": "another", "host": "node-7", "pid": 42,
                                    "since": "2026-11-27T10:00:00Z"}).encode())
    with pytest.raises(LockTimeoutError) as err:  # the erasure is blocked, and told how to go on
        delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0001"], lock_timeout=0.5)
    assert f"indknn break-lease --store {url} --token t-dead" in str(err.value)
    assert "recorded in the ledger" in str(err.value)  # never selected again meanwhile (review 67, F1)

    other = tmp_path / "operator"  # another machine's state root: the command needs nothing of the holder's
    rc, out, msg = _cli("--store", url, state_dir=other)  # shown, not removed
    assert rc == 0 and out[0]["removed"] is None and len(out[0]["leases"]) == 1, msg
    held = out[0]["leases"][0]
    assert held["holder"]["token"] == "t-dead" and held["holder"]["host"] == "node-7" and held["lease"] == lease
    assert held["kind"] == "writer lease"
    assert "--token t-dead" in msg and fs.exists(lease)

    rc, out, msg = _cli("--store", url, "--token", "t-other", state_dir=other)  # not its token: nothing removed
    assert rc == 2 and out == [] and "nothing removed" in msg
    assert json.loads(fs.cat_file(lease))["token"] == "t-dead"

    rc, out, msg = _cli("--store", url, "--token", "t-dead", state_dir=other)
    assert rc == 0 and out[0]["removed"] == lease and not fs.exists(lease), msg
    res = delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0001"])
    assert res.already_deleted == ["r0001"] and res.pending_completed == 1  # recorded then, overwritten now
    assert "r0001" not in set(open_store(url).read("private", "record_id"))

    rc, out, _ = _cli("--store", url, "--token", "t-dead", state_dir=other)  # safe to re-run: nothing held
    assert rc == 0 and out[0]["leases"] == [] and out[0]["removed"] is None


@pytest.mark.heavy
def test_an_unreadable_lease_is_named_unreadable_and_a_live_writers_lease_is_never_removed_by_an_old_token(
        s3, state, tmp_path):
    from indknn_cli import object_store, store_lease
    from indknn_cli.errors import BadInputError

    url, _ = _store(tmp_path, s3, n=60, d=8)
    st = open_store(url, mode="a")
    fs = object_store.filesystem(st.remote)
    lease = store_lease.lease_url(st.remote)
    fs.pipe_file(lease, b"\x00 not json")
    shown = store_lease.break_lease(url)
    assert [h["holder"]["token"] for h in shown["leases"]] == [store_lease.UNREADABLE] and fs.exists(lease)
    assert store_lease.break_lease(url, token=store_lease.UNREADABLE)["removed"] == lease and not fs.exists(lease)

    with st.write_lock(timeout=5):  # a live writer took the lease since: an old token removes nothing
        live = json.loads(fs.cat_file(lease))["token"]
        with pytest.raises(BadInputError, match="nothing removed"):
            store_lease.break_lease(url, token="t-dead")
        assert json.loads(fs.cat_file(lease))["token"] == live
    assert not fs.exists(lease)  # released by its writer


def test_a_local_store_has_no_lease_to_break(tmp_path):
    rc, out, msg = _cli("--store", str(tmp_path / "s.zarr"), state_dir=tmp_path / "state")
    assert rc == 2 and out == [] and "no lease" in msg


@pytest.mark.heavy
@pytest.mark.parametrize("pid", ["own", "init"])
def test_a_dead_holders_lease_whose_pid_now_names_a_live_process_does_not_block_an_erasure(s3, state, tmp_path, pid):
    """A lease left on this machine by a process that died, its pid since given to a live process (a container
    restarted: often the same pid, even this process's): every write, an erasure included, was refused for ever
    (review 23, F3). The lease names its state root and its process's start time: under the state root whose
    local lease lock the writer holds, no live holder can exist; elsewhere, a pid with another start time is
    another process."""
    import socket

    from indknn_cli import object_store, store_lease
    from indknn_cli.deletion import delete_records

    url, _ = _store(tmp_path, s3, n=60, d=8)
    st = open_store(url, mode="a")
    fs = object_store.filesystem(st.remote)
    lease = store_lease.lease_url(st.remote)
    with st.write_lock(timeout=5):  # a lease as this version writes it
        body = json.loads(fs.cat_file(lease))
    assert body["root"] == store_lease._root_tag() and body["pid_start"] == store_lease._start_time(os.getpid())
    live = os.getpid() if pid == "own" else 1
    fs.pipe_file(lease, json.dumps({**body, "token": "dead", "pid": live, "pid_start": "1"}).encode())
    assert delete_records(store_path=url, ledger_path=tmp_path / "L", record_ids=["r0001"],
                          lock_timeout=2).records_erased == 1
    assert not fs.exists(lease)

    # the same, written under another state root of this machine (a copied machine-id): its pid runs, but as
    # another process (another start time): dead too; the same process (same start time): kept
    fs.pipe_file(lease, json.dumps({**body, "token": "dead2", "root": "elsewhere", "pid": live,
                                    "pid_start": "1"}).encode())
    with st.write_lock(timeout=2):
        assert json.loads(fs.cat_file(lease))["token"] not in ("dead", "dead2")
    fs.pipe_file(lease, json.dumps({**body, "token": "alive", "root": "elsewhere"}).encode())
    from indknn_cli.errors import LockTimeoutError
    with pytest.raises(LockTimeoutError, match="this machine under another state folder"):
        with st.write_lock(timeout=0.5):
            pass
    assert json.loads(fs.cat_file(lease))["token"] == "alive"
    fs.rm_file(lease)


@pytest.mark.heavy
def test_a_lease_taken_by_another_writer_between_the_read_and_the_removal_is_not_removed(s3, state, tmp_path,
                                                                                        monkeypatch):
    """break-lease, a writer releasing its own lease, and a writer replacing a dead holder's lease each read the
    lease, then deleted it unconditionally: a lease released and taken by another writer in between was deleted,
    and a third writer could then write beside the second (review 23's open window). The delete is now
    conditional on the version read (S3 ``If-Match``): the new writer's lease stays."""
    from indknn_cli import object_store, store_lease
    from indknn_cli.errors import BadInputError

    url, _ = _store(tmp_path, s3, n=60, d=8)
    st = open_store(url, mode="a")
    fs = object_store.filesystem(st.remote)
    lease = store_lease.lease_url(st.remote)
    newer = json.dumps({"token": "t-new", "machine": "m2", "host": "node-2", "pid": 7, "since": "now"}).encode()
    original_read = store_lease._read
    swaps = []

    def read_then_swap(fs_, url_):
        out = original_read(fs_, url_)
        if out is not None and url_ == lease and out.get("token") in swaps:  # released and re-taken meanwhile
            fs_.pipe_file(url_, newer)
        return out

    monkeypatch.setattr(store_lease, "_read", read_then_swap)

    # 1. break-lease of a lease whose holder released it and another writer took it in between
    fs.pipe_file(lease, json.dumps({"token": "t-old", "machine": "m1", "host": "node-1", "pid": 5}).encode())
    swaps.append("t-old")
    with pytest.raises(BadInputError, match="taken by another writer while this ran"):
        store_lease.break_lease(url, token="t-old")
    assert json.loads(fs.cat_file(lease))["token"] == "t-new"

    # 2. a writer's own release, after someone broke its lease and another writer took it
    fs.rm_file(lease)
    swaps.clear()
    with st.write_lock(timeout=5):
        swaps.append(json.loads(fs.cat_file(lease))["token"])
    assert json.loads(fs.cat_file(lease))["token"] == "t-new"

    # 3. a dead holder of this machine replaced, when it was already replaced in between: the new one stays
    swaps.clear()
    body = {"token": "t-dead-here", "machine": store_lease.machine_id(), "host": __import__("socket").gethostname(),
            "boot": store_lease.boot_id(), "root": store_lease._root_tag(), "pid": 1, "pid_start": "1"}
    fs.pipe_file(lease, json.dumps(body).encode())
    swaps.append("t-dead-here")
    from indknn_cli.errors import LockTimeoutError
    with pytest.raises(LockTimeoutError, match="node-2"):
        with st.write_lock(timeout=0.6):
            pass
    assert json.loads(fs.cat_file(lease))["token"] == "t-new"
    fs.rm_file(lease)
