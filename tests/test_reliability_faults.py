"""Faults of real `indknn` processes (issue 8 "Faults"): kill -9, full disk, read-only ledger, concurrency.

What is tested, always on real files (Zarr store, Parquet ledger) and real subprocesses
(`python -m indknn_cli ...`):

- ``kill -9`` of ``serve-queries`` at random moments (before any output, while it replays
  already-released answers, mid-batch, during the final compaction, after it finished): after
  each kill the ledger opens, no record is over budget, every JSON line the killed process
  printed is an answer committed in the ledger with the same label and released count, no query
  index is answered (charged) twice; re-running completes the batch and prints the same answers
  for the indices already released; a seeded batch ends in exactly the state of an uninterrupted
  run (no lost and no double charge). Fast: 5 kills; slow: 100 kills.
- Full disk: a file-size limit (RLIMIT_FSIZE → EFBIG, works as root without mount rights) and a
  real small tmpfs (ENOSPC mid-batch; skipped where mounting is not permitted): exit code 1,
  ``Error:`` and the reason on stderr, no traceback, nothing printed that is not committed, the
  previous files byte for byte unchanged, the batch completes once there is room again.
- Read-only ledger: a read-only bind mount (EROFS; skipped without mount rights) and a ledger
  without write permission for a process whose capabilities to override file permissions were
  dropped (EACCES; root otherwise ignores permissions): ``serve-queries`` and ``delete`` exit 1
  with a readable message, every file of ledger and store unchanged.
- Concurrency: 4 (fast) / 8 (slow) ``serve-queries`` and ``delete`` processes on one ledger: all
  finish (no deadlock), each batch's events are contiguous and each batch is answered once with
  all its indices, every charge recorded in the events increases its record's spent by at least
  the count charge c1 (no lost update), deleted records are never charged again, the per-record
  spent equals the sum of the recorded charges, and a serial replay of the same operations in
  the committed order reproduces the final ledger exactly.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from indknn_cli.deletion import delete_records
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered, original_set_aside

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", INDKNN_WIDTH="200")
TIMEOUT = 300  # seconds: generous, only there to turn a hang (deadlock) into a failure


# -- helpers ---------------------------------------------------------------------------------
def _world(root: Path, batches: dict[str, int], *, n: int = 2000, d: int = 16) -> tuple[Path, Path]:
    """2000 clustered private records (200 users), the given query batches, a fresh flat ledger."""
    x, y, _ = clustered(n, d, 3, seed=21)
    store = FeatureStore.create(root / "store.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=d,
                                label_names=["a", "b", "c"])
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(n)],
                 user_ids=[f"u{i % 200}" for i in range(n)])
    for k, (name, m) in enumerate(batches.items()):
        q, _, _ = clustered(m, d, 3, seed=100 + k)
        store.append("query", q, record_ids=[f"{name}-{i}" for i in range(m)], batch=name)
    params = make_params(epsilon=2.0, delta=1e-5, tau=0.5, sigma2=2.0, planned_queries=10_000)
    build_index(store_path=store.path, ledger_path=root / "ledger", params=params)
    return Path(store.path), root / "ledger"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "indknn_cli", *args]


def _serve_cmd(store: Path, ledger: Path, batch: str, *extra: str) -> list[str]:
    return _cli("serve-queries", batch, "--store", str(store), "--ledger", str(ledger), "--batch-size", "8",
                "--device", "cpu", *extra)


def _rows(text: str) -> list[dict]:
    """The JSON lines of stdout; a torn last line would be a released half answer."""
    assert text == "" or text.endswith("\n"), f"torn last line on stdout: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def _check_released(ledger: Path, batch_id: str, printed: list[dict]) -> tuple[BudgetLedger, dict]:
    """The ledger opens, nobody is over budget, each printed answer is committed exactly as printed."""
    led = BudgetLedger.open(ledger)
    assert (led.state.spent <= led.state.budget).all()
    a = led.answers_for(batch_id)
    assert len(a["query_index"]) == len(set(a["query_index"])), "a query index was answered (charged) twice"
    committed = {i: (lab, k) for i, lab, k in zip(a["query_index"], a["label"], a["released_count"])}
    for r in printed:
        assert committed.get(r["query_index"]) == (r["label"], r["released_count"]), r
    return led, committed


def _digest(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _same_state(a: BudgetLedger, b: BudgetLedger) -> None:
    for name in ("spent", "times_selected", "deleted", "row"):
        assert np.array_equal(getattr(a.state, name), getattr(b.state, name)), name
    assert a.state.answers == b.state.answers


def _assert_clear_error(proc: subprocess.CompletedProcess, *reasons: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "Internal error" not in proc.stderr, proc.stderr
    assert any(r in proc.stderr for r in reasons), proc.stderr


def _events(ledger: Path) -> list[tuple[int, dict, dict]]:
    """(seq, info, columns) of every committed event file, in commit order."""
    out = []
    for p in (ledger / "events").glob("*.parquet"):
        if p.name.startswith("."):
            continue
        t = pq.read_table(p)
        out.append((int(p.name.split("-", 1)[0]), json.loads(t.schema.metadata[b"indknn_event"]), t.to_pydict()))
    return sorted(out, key=lambda e: e[0])


# -- kill -9 ---------------------------------------------------------------------------------
def _kill_campaign(root: Path, *, kills: int, per_batch: int, n_queries: int, rng_seed: int) -> dict:
    """Kill serve-queries `kills` times at random moments; complete and check each batch."""
    store, lp = _world(root, {"big": n_queries})
    rng = random.Random(rng_seed)  # the harness's schedule only; seeded noise only on even batches
    out_path, err_path = root / "out.jsonl", root / "err.txt"
    figures = {"kills": 0, "kills_before_output": 0, "finished_before_kill": 0, "answers_checked": 0, "batches": 0,
               "reference_runs": 0}
    batch_no = 0
    while figures["kills"] < kills:
        bid = f"k{batch_no}"
        seed = 1000 + batch_no if batch_no % 2 == 0 else None
        cmd = _serve_cmd(store, lp, "big", "--batch-id", bid, *(["--seed", str(seed)] if seed is not None else []))
        ref_lp, ref_sp = root / "ref-ledger", root / "ref-store.zarr"
        if seed is not None:  # the state this batch starts from, for an uninterrupted reference run
            shutil.rmtree(ref_lp, ignore_errors=True)
            shutil.rmtree(ref_sp, ignore_errors=True)
            shutil.copytree(lp, ref_lp, ignore=shutil.ignore_patterns("LOCK", ".*"))
            shutil.copytree(store, ref_sp, ignore=shutil.ignore_patterns(".*"))  # with its store: one ledger each
        released: dict[int, tuple] = {}  # every answer printed by any process of this batch
        for _ in range(min(per_batch, kills - figures["kills"])):
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=ENV)
            if rng.random() < 0.5:  # a moment in time: often before the first line (imports take ~2 s)
                try:
                    proc.wait(timeout=rng.uniform(0.0, 3.0))
                except subprocess.TimeoutExpired:
                    pass
            else:  # after a number of printed lines (replayed answers count: kills during the replay too)
                want = rng.randint(1, n_queries)
                deadline = time.monotonic() + TIMEOUT
                while proc.poll() is None and out_path.read_bytes().count(b"\n") < want:
                    assert time.monotonic() < deadline, "serve-queries hung"
                    time.sleep(0.005)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            rc = proc.wait()
            if rc == -signal.SIGKILL:
                figures["kills"] += 1
            else:
                assert rc == 0, err_path.read_text()
                figures["finished_before_kill"] += 1
            printed = _rows(out_path.read_text())
            figures["kills_before_output"] += rc == -signal.SIGKILL and not printed
            _, committed = _check_released(lp, bid, printed)
            for r in printed:
                released.setdefault(r["query_index"], (r["label"], r["released_count"]))
                assert released[r["query_index"]] == (r["label"], r["released_count"])  # the same answer again
            assert all(committed[i] == v for i, v in released.items())  # no released answer lost
            figures["answers_checked"] += len(printed)
        # Re-run to the end: same answers for the released indices, every index answered once.
        done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr
        final = _rows(done.stdout)
        assert [r["query_index"] for r in final] == list(range(n_queries))
        assert all(released[r["query_index"]] == (r["label"], r["released_count"])
                   for r in final if r["query_index"] in released)
        led, committed = _check_released(lp, bid, final)
        assert len(committed) == n_queries
        figures["answers_checked"] += len(final)
        # Once more: nothing charged, nothing written.
        files = sorted(p.name for p in (lp / "events").iterdir())
        again = serve_queries(store_path=store, ledger_path=lp, query_batch="big", batch_id=bid, seed=seed,
                              batch_size=8)
        assert again.newly_answered == 0 and again.already_answered == n_queries
        assert sorted(p.name for p in (lp / "events").iterdir()) == files
        _same_state(BudgetLedger.open(lp), led)
        if seed is not None:  # killed-and-resumed == uninterrupted: no lost, no double charge
            with original_set_aside(store):  # the reference copy is not served beside the live pair (store_twins)
                serve_queries(store_path=ref_sp, ledger_path=ref_lp, query_batch="big", batch_id=bid, seed=seed,
                              batch_size=8)
            ref = BudgetLedger.open(ref_lp)
            assert np.array_equal(ref.state.spent, led.state.spent)
            assert np.array_equal(ref.state.times_selected, led.state.times_selected)
            ref_answers = ref.answers_for(bid)
            assert dict(zip(ref_answers["query_index"], zip(ref_answers["label"], ref_answers["released_count"]))) \
                == committed
            figures["reference_runs"] += 1
        figures["batches"] += 1
        batch_no += 1
    return figures


@pytest.mark.heavy
def test_kill_9_at_random_moments(tmp_path):
    f = _kill_campaign(tmp_path, kills=5, per_batch=3, n_queries=120, rng_seed=8)
    assert f["kills"] == 5 and f["reference_runs"] >= 1


@pytest.mark.slow
def test_kill_9_a_hundred_times(tmp_path, capsys):
    f = _kill_campaign(tmp_path, kills=100, per_batch=8, n_queries=300, rng_seed=2024)
    assert f["kills"] == 100
    with capsys.disabled():
        print(f"\n[reliability] kill -9: {f['kills']} kills survived ({f['kills_before_output']} before any output; "
              f"{f['finished_before_kill']} runs finished before their kill), {f['answers_checked']} answers checked, {f['batches']} batches completed, "
              f"{f['reference_runs']} equal to an uninterrupted run", file=sys.stderr)


# -- full disk -------------------------------------------------------------------------------
def _file_size_limit(limit: int):
    def apply() -> None:  # in the child: writes past `limit` bytes fail with EFBIG instead of SIGXFSZ
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.heavy
def test_disk_full_file_size_limit(tmp_path):
    store, lp = _world(tmp_path, {"q": 64})
    serve_queries(store_path=store, ledger_path=lp, query_batch="q", batch_id="before", batch_size=8)
    before, led0 = _digest(store, lp), BudgetLedger.open(lp)
    limit = _file_size_limit(512)  # every ledger event is > 4 KiB
    proc = subprocess.run(_serve_cmd(store, lp, "q", "--batch-id", "full"), capture_output=True, text=True,
                          env=ENV, timeout=TIMEOUT, preexec_fn=limit)
    _assert_clear_error(proc, "File too large")
    assert _rows(proc.stdout) == []  # no event could be committed: nothing released
    assert _digest(store, lp) == before
    _same_state(BudgetLedger.open(lp), led0)
    # With room again the batch is answered in full; the released batch is untouched.
    res = serve_queries(store_path=store, ledger_path=lp, query_batch="q", batch_id="full", batch_size=8)
    assert res.newly_answered == 64
    assert BudgetLedger.open(lp).answers_for("before") == led0.answers_for("before")


def test_delete_on_full_disk_keeps_the_ledger(tmp_path):
    store, lp = _world(tmp_path, {"q": 16})
    before, led0 = _digest(lp), BudgetLedger.open(lp)
    proc = subprocess.run(_cli("delete", "--record", "r5", "--store", str(store), "--ledger", str(lp)),
                          capture_output=True, text=True, env=ENV, timeout=TIMEOUT, preexec_fn=_file_size_limit(512))
    _assert_clear_error(proc, "File too large")
    # the message must not claim nothing changed: the request is recorded and finished by the next delete
    assert "previous state is kept" not in proc.stderr and "run `indknn delete` again" in proc.stderr
    assert proc.stdout == ""
    assert _digest(lp) == before  # the ledger event (the commit point) failed: ledger byte for byte as before
    _same_state(BudgetLedger.open(lp), led0)
    # The store keeps the intent mark of step 1 (row flagged, never selectable; deletion.py docstring):
    # the accepted request is finished by the next delete, never undone.
    flagged = FeatureStore.open(store, mode="r")
    assert flagged.group("private").attrs.get("erase_pending") in ([], [5])
    res = delete_records(store_path=store, ledger_path=lp, record_ids=["r5"])
    led = BudgetLedger.open(lp)
    assert led.state.deleted[list(led.state.record_id).index("r5")]
    assert res.pending_completed == 1 and res.already_deleted == ["r5"]  # finished as the pending request
    assert not FeatureStore.open(store, mode="r").group("private").attrs.get("erase_pending")


@pytest.mark.slow
def test_disk_full_tmpfs_mid_batch(tmp_path):
    store, lp = _world(tmp_path, {"q": 200})
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        small = mnt / "ledger"
        shutil.copytree(lp, small)
        st = os.statvfs(mnt)
        with open(mnt / "filler", "wb") as fh:  # leave room for a few events only
            left = st.f_bavail * st.f_frsize - (64 << 10)
            while left > 0:
                left -= fh.write(b"\0" * min(left, 1 << 20))
        before = _digest(small)
        proc = subprocess.run(_serve_cmd(store, small, "q", "--batch-id", "full"), capture_output=True, text=True,
                              env=ENV, timeout=TIMEOUT)
        _assert_clear_error(proc, "No space left on device")
        printed = _rows(proc.stdout)
        _, committed = _check_released(small, "full", printed)
        assert {r["query_index"] for r in printed} == set(committed) and len(committed) < 200
        after = _digest(small)
        assert all(after[f] == h for f, h in before.items())  # earlier files untouched
        assert not [p for p in small.rglob(".*")]  # no temporary file left behind
        (mnt / "filler").unlink()
        done = subprocess.run(_serve_cmd(store, small, "q", "--batch-id", "full"), capture_output=True, text=True,
                              env=ENV, timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr
        final = {r["query_index"]: (r["label"], r["released_count"]) for r in _rows(done.stdout)}
        assert sorted(final) == list(range(200))
        assert all(final[r["query_index"]] == (r["label"], r["released_count"]) for r in printed)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# -- read-only ledger ------------------------------------------------------------------------
def _drop_dac_override() -> None:
    """In the child: drop the capabilities that let root ignore file permissions, before exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER (prctl PR_CAPBSET_DROP = 24)
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.heavy
@pytest.mark.parametrize("how", ["no-write-permission", pytest.param("read-only-mount", marks=pytest.mark.slow)])
def test_read_only_ledger(tmp_path, how):
    store, lp = _world(tmp_path, {"q": 32})
    serve_queries(store_path=store, ledger_path=lp, query_batch="q", batch_id="before", batch_size=8)
    led0 = BudgetLedger.open(lp)
    ledger_arg, preexec = lp, None
    ro = tmp_path / "ro"
    try:
        if how == "read-only-mount":
            ro.mkdir()
            for cmd in (["mount", "--bind", str(lp), str(ro)], ["mount", "-o", "remount,bind,ro", str(ro)]):
                r = subprocess.run(cmd, capture_output=True)
                if r.returncode != 0:
                    pytest.skip(f"cannot make a read-only bind mount here: {r.stderr.decode().strip()}")
            ledger_arg = ro
        else:
            for p in [lp, *lp.rglob("*")]:
                p.chmod(p.stat().st_mode & ~0o222)
            probe = subprocess.run([sys.executable, "-c", f"open({str(lp / 'LOCK')!r}, 'r+')"],
                                   capture_output=True, text=True, preexec_fn=_drop_dac_override)
            if "PermissionError" not in probe.stderr:
                pytest.skip(f"cannot run a process bound by file permissions here: {probe.stderr[-200:]}")
            preexec = _drop_dac_override
        before, ledger_before = _digest(store, lp), _digest(lp)
        serve = subprocess.run(_serve_cmd(store, ledger_arg, "q", "--batch-id", "ro"), capture_output=True,
                               text=True, env=ENV, timeout=TIMEOUT, preexec_fn=preexec)
        _assert_clear_error(serve, "Read-only file system", "Permission denied")
        assert serve.stdout == ""
        delete = subprocess.run(_cli("delete", "--record", "r3", "--store", str(store), "--ledger", str(ledger_arg)),
                                capture_output=True, text=True, env=ENV, timeout=TIMEOUT, preexec_fn=preexec)
        # an erasure is never blocked by its ledger (review 32): the store alone, the tombstone pending, exit 0
        assert delete.returncode == 0, delete.stderr
        out = json.loads(delete.stdout)
        assert out["records_erased"] == 1 and any(r in out["ledger_unreadable"] for r in ("Read-only", "Permission"))
        assert _digest(lp) == ledger_before and _digest(store, lp) != before
        assert FeatureStore.open(store).read("private", "deleted")[3]
        _same_state(BudgetLedger.open(ledger_arg), led0)
    finally:
        if how == "read-only-mount" and ro.exists():
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
        for p in [lp, *lp.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)


# -- concurrency -----------------------------------------------------------------------------
def _concurrent(root: Path, *, n_serve: int, n_delete: int, n_queries: int = 40) -> dict:
    batches = {f"c{i}": n_queries for i in range(n_serve)}
    store, lp = _world(root, batches)
    ref_store, ref_lp = root / "ref-store.zarr", root / "ref-ledger"
    shutil.copytree(store, ref_store)
    shutil.copytree(lp, ref_lp)
    led0 = BudgetLedger.open(lp)
    c1 = led0.params.c1
    # Disjoint erasure requests: delete j erases user u{j} (10 records) and two single records.
    deletes = {}
    for j in range(n_delete):
        records = [f"r{1501 + 7 * j}", f"r{1603 + 11 * j}"]
        deletes[j] = {"user": f"u{j}", "records": records}
    wanted = [{f"r{i}" for i in range(2000) if i % 200 == j} | set(v["records"]) for j, v in deletes.items()]
    assert sum(map(len, wanted)) == len(set().union(set(), *wanted))  # disjoint requests
    procs = {}
    lock = ["--lock-timeout", str(TIMEOUT)]
    order = [("serve", f"c{i}") for i in range(n_serve)] + [("delete", j) for j in range(n_delete)]
    random.Random(n_serve * 10 + n_delete).shuffle(order)
    for kind, key in order:
        if kind == "serve":
            cmd = _serve_cmd(store, lp, key, "--seed", key[1:], *lock)
        else:
            v = deletes[key]
            cmd = _cli("delete", "--user", v["user"], *sum((["--record", r] for r in v["records"]), []),
                       "--store", str(store), "--ledger", str(lp), *lock)
        # every event file kept (no auto-compaction): the checks below walk the whole event log
        procs[(kind, key)] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env=dict(ENV, INDKNN_AUTO_COMPACT="0"))
    deadline = time.monotonic() + TIMEOUT
    outputs = {}
    try:
        for k, p in procs.items():
            outputs[k] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs.values():
            p.kill()
        pytest.fail("deadlock: concurrent serve-queries/delete did not finish within the timeout")
    for k, p in procs.items():
        assert p.returncode == 0, (k, outputs[k][1])
        assert "Traceback" not in outputs[k][1]
    led = BudgetLedger.open(lp)
    # Each batch answered once with all its indices; what each process printed is committed.
    for i in range(n_serve):
        printed = _rows(outputs[("serve", f"c{i}")][0])
        assert [r["query_index"] for r in printed] == list(range(n_queries))
        _, committed = _check_released(lp, f"c{i}", printed)
        assert len(committed) == n_queries
    for j in range(n_delete):
        res = json.loads(outputs[("delete", j)][0])
        assert res["records_erased"] == len(wanted[j])
    # Event log: contiguous batches, monotone charges, tombstones never charged.
    events = _events(lp)
    seen_order: list = []
    position: dict[str, list[int]] = {}
    cur = led0.state.spent.copy()
    per_record = np.zeros_like(cur)
    tombstoned: set[int] = set()
    n_charges = 0
    for pos, (seq, info, cols) in enumerate(events):
        if info["type"] == "serve":
            position.setdefault(info["batch_id"], []).append(pos)
            assert info["part"] == len(position[info["batch_id"]]) - 1
            op = ("serve", info["batch_id"])
        else:
            assert info["type"] == "delete", info
            ids = set(cols["record_id"])
            op = ("delete", next(j for j in range(n_delete) if ids == wanted[j]))
        if op not in seen_order:
            seen_order.append(op)
        for kind, li, after, sel in zip(cols["kind"], cols["ledger_index"], cols["spent_after"], cols["selected"]):
            if kind == "charge":
                delta = after - cur[li]
                assert delta > 0 and delta >= sel * c1 * (1 - 1e-9), (seq, li, after, cur[li], sel)
                assert li not in tombstoned, f"deleted record {li} charged in event {seq}"
                cur[li] = after
                per_record[li] += delta
                n_charges += 1
            elif kind == "delete":
                assert after == cur[li]  # the tombstone keeps the spent budget as it was
                tombstoned.add(li)
    for b, pos in position.items():
        assert pos == list(range(pos[0], pos[0] + len(pos))), f"batch {b} interleaved with other events"
    assert len(seen_order) == n_serve + n_delete
    assert np.array_equal(cur, led.state.spent)
    assert np.isclose(per_record.sum(), (led.state.spent - led0.state.spent).sum(), rtol=1e-12)
    assert np.allclose(per_record, led.state.spent - led0.state.spent, rtol=1e-12, atol=0)
    assert tombstoned == set(np.flatnonzero(led.state.deleted).tolist())
    # A serial replay of the same operations in the committed order gives the same ledger (on the copy, the live
    # pair set aside: a copy is not served beside its live original, store_twins).
    with original_set_aside(store):
        for kind, key in seen_order:
            if kind == "serve":
                serve_queries(store_path=ref_store, ledger_path=ref_lp, query_batch=key, seed=int(key[1:]),
                              batch_size=8)
            else:
                delete_records(store_path=ref_store, ledger_path=ref_lp, user_ids=[deletes[key]["user"]],
                               record_ids=deletes[key]["records"])
    _same_state(BudgetLedger.open(ref_lp), led)
    return {"processes": len(procs), "charges": n_charges, "events": len(events),
            "spent_total": float(led.state.spent.sum())}


@pytest.mark.heavy
def test_four_concurrent_writers(tmp_path):
    f = _concurrent(tmp_path, n_serve=3, n_delete=1)
    assert f["processes"] == 4 and f["charges"] > 0


@pytest.mark.slow
def test_eight_concurrent_writers(tmp_path, capsys):
    f = _concurrent(tmp_path, n_serve=5, n_delete=3)
    with capsys.disabled():
        print(f"\n[reliability] concurrency: {f['processes']} processes (5 serve-queries, 3 delete) on one ledger, "
              f"{f['events']} events, {f['charges']} charges checked, no lost charge", file=sys.stderr)
