"""`serve-queries --scheduler` (issue 19): the candidate phase on a Dask LocalCluster of 2 processes gives the
in-process engine's answers and ledger bit for bit (flat, LSH, IVF; record and user unit; deletions and
additions between batches); an unreachable scheduler is exit 1 with nothing written; a dying worker's task is
retried by Dask."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("distributed")
from distributed.diagnostics.plugin import WorkerPlugin  # noqa: E402

from indknn_cli import deletion, distributed  # noqa: E402
from indknn_cli.engine import find_candidates, StoreSource  # noqa: E402
from indknn_cli.errors import BadInputError, SchedulerError  # noqa: E402
from indknn_cli.ledger import BudgetLedger  # noqa: E402
from indknn_cli.serving import build_index, make_params, serve_queries  # noqa: E402
from indknn_cli.store import ExtractorInfo, FeatureStore  # noqa: E402

from .conftest import clustered  # noqa: E402

EXTRACTOR = ExtractorInfo("vectors", "none", "1")
KIND_OPTS = {"flat": {}, "lsh": dict(tables=12, bits=3, index_seed=3), "ivf": dict(nlist=8, nprobe=3, index_seed=3)}


@pytest.fixture(scope="module")
def scheduler():
    """A LocalCluster of 2 worker processes (1 thread each); its scheduler address."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                      silence_logs=logging.ERROR) as cluster:
        yield cluster.scheduler_address


def make_world(path: Path, kind: str, *, unit: str = "record") -> tuple[Path, Path]:
    """The same store + ledger in every world: 300 private rows (chunks of 64), public rows for IVF, batch q1."""
    x, y, _ = clustered(300, 16, 3, seed=1)
    store = FeatureStore.create(path / "s.zarr", extractor=EXTRACTOR, dim=16, label_names=["a", "b", "c"],
                                chunk_rows=64)
    store.append("private", x, labels=y, record_ids=[f"r{i:04d}" for i in range(300)],
                 user_ids=[f"u{i % 70:03d}" for i in range(300)])
    pub, _, _ = clustered(400, 16, 3, seed=3)
    store.append("public", pub, record_ids=[f"p{i:04d}" for i in range(400)])
    q, _, _ = clustered(40, 16, 3, seed=2)
    q[5] = x[7]  # a query equal to a private vector
    store.append("query", q, record_ids=[f"q{i:03d}" for i in range(40)], batch="q1")
    # A small budget: records retire within the two batches (the filter's mask is exercised too).
    params = make_params(epsilon=0.3, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=80, privacy_unit=unit,
                         **({"max_records_per_user": 3} if unit == "user" else {}))
    build_index(store_path=store.path, ledger_path=path / "L", params=params, kind=kind, **KIND_OPTS[kind])
    return store.path, path / "L"


def twin_worlds(tmp_path: Path, kind: str, *, seed: int, batch_size: int):
    """Two identical worlds: q1 served in process in the first; (its answers, its ledger, the second's paths)."""
    (tmp_path / "here").mkdir()
    (tmp_path / "dask").mkdir()
    here = make_world(tmp_path / "here", kind)
    want = serve_queries(store_path=here[0], ledger_path=here[1], query_batch="q1", seed=seed, batch_size=batch_size)
    return want, here[1], *make_world(tmp_path / "dask", kind)


def scenario(path: Path, kind: str, serve, *, unit: str = "record") -> dict:
    """serve q1; delete two records; add 60 records and a batch q2; serve q2. Everything released and kept."""
    store_path, ledger_path = make_world(path, kind, unit=unit)
    first = serve(store_path=store_path, ledger_path=ledger_path, query_batch="q1", seed=4, batch_size=16)
    deletion.delete_records(store_path=store_path, ledger_path=ledger_path, record_ids=["r0003", "r0100"])
    if unit == "user":
        deletion.delete_records(store_path=store_path, ledger_path=ledger_path, user_ids=["u010"])
    x, y, _ = clustered(60, 16, 3, seed=5)
    store = FeatureStore.open(store_path, mode="a")
    store.append("private", x, labels=y, record_ids=[f"n{i:04d}" for i in range(60)],
                 user_ids=[f"u{i % 9:03d}" for i in range(60)])
    q, _, _ = clustered(40, 16, 3, seed=6)
    q[0] = x[2]
    store.append("query", q, record_ids=[f"z{i:03d}" for i in range(40)], batch="q2")
    second = serve(store_path=store_path, ledger_path=ledger_path, query_batch="q2", seed=5, batch_size=32)
    led = BudgetLedger.open(ledger_path)
    st = led.state
    return {
        "answers": [(a["query_id"], a["label"], a["released_count"]) for a in first.answers + second.answers],
        "spent": st.spent.tobytes(), "times_selected": st.times_selected.tolist(), "deleted": st.deleted.tolist(),
        "records": st.record_id.tolist(), "rows": st.row.tolist(),
        "retired": int((st.budget - st.spent < led.params.c1).sum()),
        "ledger_answers": {k: list(v) for k, v in st.answers.items()},
    }


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["flat", "lsh", "ivf"])
def test_scheduler_answers_and_ledger_equal_in_process(tmp_path, scheduler, kind):
    (tmp_path / "here").mkdir()
    (tmp_path / "dask").mkdir()
    here = scenario(tmp_path / "here", kind, serve_queries)
    dask = scenario(tmp_path / "dask", kind, lambda **kw: distributed.serve_queries(scheduler=scheduler, **kw))
    assert here["retired"] > 0 and any(here["deleted"])  # the masks had something to do
    assert len(here["answers"]) == 80
    assert dask == here  # answers, spent (bytes), selections, tombstones, the ledger's answer table


@pytest.mark.heavy
def test_user_unit_on_scheduler_equals_in_process(tmp_path, scheduler):
    (tmp_path / "here").mkdir()
    (tmp_path / "dask").mkdir()
    here = scenario(tmp_path / "here", "flat", serve_queries, unit="user")
    dask = scenario(tmp_path / "dask", "flat", lambda **kw: distributed.serve_queries(scheduler=scheduler, **kw),
                    unit="user")
    assert dask == here


def test_range_triples_merge_to_the_engine_candidates(tmp_path, scheduler):
    """The merged triples of every range are find_candidates' own (rows and κ bit for bit), masked as asked."""
    store_path, ledger_path = make_world(tmp_path, "flat")
    store = FeatureStore.open(store_path)
    led = BudgetLedger.open(ledger_path)
    q = store.read("query", "features", 0, 40)
    mask = np.ones(300, bool)
    mask[::7] = False
    want = find_candidates(q, StoreSource(store), kernel="cosine", tau=0.3, nu=None, row_mask=mask)
    client = distributed.connect(scheduler)
    try:
        dask = distributed.DaskCandidates(client, tasks_per_worker=3)
        finder = dask.factory(store, led)
        assert len(finder.ranges) == 5 and finder.ranges[-1] == (256, 300)
        got = finder(q, row_mask=mask)
        dask.release()
    finally:
        client.close()
    assert [r.tolist() for r in got.rows] == [r.tolist() for r in want.rows]
    assert [k.tobytes() for k in got.kappa] == [k.tobytes() for k in want.kappa]
    assert sum(r.size for r in got.rows) > 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.heavy
def test_unreachable_scheduler_is_exit_1_and_nothing_written(tmp_path):
    store_path, ledger_path = make_world(tmp_path, "flat")
    before = _tree(tmp_path)
    address = f"tcp://127.0.0.1:{_closed_port()}"
    with pytest.raises(SchedulerError, match="cannot reach the Dask scheduler"):
        distributed.serve_queries(scheduler=address, connect_timeout=1.0, store_path=store_path,
                                  ledger_path=ledger_path, query_batch="q1", seed=1)
    # The CLI, through $INDKNN_SCHEDULER, with a query FILE: refused before the file is embedded.
    qfile = tmp_path.parent / f"{tmp_path.name}-q.npz"
    np.savez(qfile, x=clustered(5, 16, 3, seed=9)[0])
    env = dict(os.environ, INDKNN_SCHEDULER=address, INDKNN_SCHEDULER_TIMEOUT="1")
    proc = subprocess.run([sys.executable, "-m", "indknn_cli", "serve-queries", str(qfile), "--store", str(store_path),
                           "--ledger", str(ledger_path), "--seed", "1"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert "cannot reach the Dask scheduler" in proc.stderr and "Traceback" not in proc.stderr
    assert _tree(tmp_path) == before
    with pytest.raises(BadInputError, match="--scheduler-timeout"):
        distributed.connect(address, timeout=0)


@pytest.mark.heavy
def test_an_unreachable_tls_scheduler_is_one_clean_error_in_serve_and_embed(tmp_path):
    """tls:// without certificates (or unreachable): serving printed `Client.__del__`'s traceback 20 s after its
    error, and embed said "Internal error: TypeError" (review 40, left). One error line, exit 1, nothing written."""
    store_path, ledger_path = make_world(tmp_path, "flat")
    before = _tree(tmp_path)
    address = f"tls://127.0.0.1:{_closed_port()}"
    qfile = tmp_path.parent / f"{tmp_path.name}-q.npz"
    np.savez(qfile, x=clustered(5, 16, 3, seed=9)[0])
    env = dict(os.environ, INDKNN_SCHEDULER_TIMEOUT="1")
    for args in (["serve-queries", str(qfile), "--ledger", str(ledger_path)],
                 ["embed", str(qfile), "--role", "query", "--extractor", "vectors"]):
        proc = subprocess.run([sys.executable, "-m", "indknn_cli", *args, "--store", str(store_path), "--scheduler",
                               address], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stdout == "", proc.stderr
        assert "TLS needs certificates" in proc.stderr, proc.stderr  # not "unreachable" (review 43, L3)
        for noise in ("Traceback", "Exception ignored", "Internal error"):
            assert noise not in proc.stderr, proc.stderr
        assert _tree(tmp_path) == before


def test_cli_scheduler_option_answers_equal_in_process(tmp_path, scheduler):
    """`indknn serve-queries --scheduler ADDRESS` (typer, in this process) prints the in-process answers."""
    from typer.testing import CliRunner

    from indknn_cli.cli.app import app

    want, here_ledger, store_path, ledger_path = twin_worlds(tmp_path, "ivf", seed=7, batch_size=10)
    res = CliRunner().invoke(app, ["serve-queries", "q1", "--store", str(store_path), "--ledger", str(ledger_path),
                                   "--seed", "7", "--batch-size", "10", "--scheduler", scheduler])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(a["query_id"], a["label"], a["released_count"]) for a in got] == \
        [(a["query_id"], a["label"], a["released_count"]) for a in want.answers]
    assert BudgetLedger.open(ledger_path).state.spent.tobytes() == BudgetLedger.open(here_ledger).state.spent.tobytes()


@pytest.mark.heavy
def test_cli_env_scheduler_answers_equal_in_process(tmp_path, scheduler):
    """A real `indknn serve-queries` process on $INDKNN_SCHEDULER prints the in-process answers."""
    outs = {}
    for name, extra in (("here", {}), ("dask", {"INDKNN_SCHEDULER": scheduler})):
        (tmp_path / name).mkdir()
        store_path, ledger_path = make_world(tmp_path / name, "lsh")
        env = {k: v for k, v in os.environ.items() if k != "INDKNN_SCHEDULER"} | extra
        proc = subprocess.run([sys.executable, "-m", "indknn_cli", "serve-queries", "q1", "--store", str(store_path),
                               "--ledger", str(ledger_path), "--seed", "7", "--batch-size", "10"], env=env,
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        outs[name] = [json.loads(line) for line in proc.stdout.splitlines()]
        outs[name + "-spent"] = BudgetLedger.open(ledger_path).state.spent.tobytes()
    assert len(outs["here"]) == 40
    assert outs["dask"] == outs["here"] and outs["dask-spent"] == outs["here-spent"]


class _KillOnce(WorkerPlugin):
    """A worker plugin: the first candidate task to start kills its worker process (a real death, once:
    the marker file says it happened); or, with ``sleep``, every candidate task starts that much later."""

    name = "indknn-test-fault"

    def __init__(self, marker: str, *, sleep: float = 0.0):
        self.marker, self.sleep = marker, sleep

    def transition(self, key, start, finish, **kwargs):
        name = key if isinstance(key, str) else str(key)
        if finish != "executing" or distributed.TASK_PREFIX not in name:
            return
        if self.sleep:
            Path(self.marker).touch()
            import time

            time.sleep(self.sleep)
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os._exit(17)


@pytest.mark.heavy  # a worker restart: ~15 s on the shared 2 cores
def test_a_dying_worker_task_is_retried_and_answers_are_unchanged(tmp_path, scheduler):
    want, here_ledger, store_path, ledger_path = twin_worlds(tmp_path, "lsh", seed=3, batch_size=20)
    marker = tmp_path / "killed"
    client = distributed.connect(scheduler)
    try:
        client.register_plugin(_KillOnce(str(marker)))
        got = distributed.serve_queries(scheduler=scheduler, store_path=store_path, ledger_path=ledger_path,
                                        query_batch="q1", seed=3, batch_size=20)
        client.unregister_worker_plugin(_KillOnce.name)
        client.wait_for_workers(2, timeout=60)  # the nanny restarts the killed worker for the next tests
    finally:
        client.close()
    assert marker.exists()  # a worker really died under a task
    assert got.answers == want.answers
    assert BudgetLedger.open(ledger_path).state.spent.tobytes() == BudgetLedger.open(here_ledger).state.spent.tobytes()


@pytest.mark.heavy
def test_a_coordinator_killed_before_commit_releases_and_charges_nothing(tmp_path, scheduler):
    """kill -9 of `serve-queries --scheduler` while its candidate tasks run: no answer printed, no charge."""
    import signal
    import time

    store_path, ledger_path = make_world(tmp_path, "flat")
    spent0 = BudgetLedger.open(ledger_path).state.spent.tobytes()
    marker = tmp_path / "started"
    client = distributed.connect(scheduler)
    try:
        client.register_plugin(_KillOnce(str(marker), sleep=4.0))
        proc = subprocess.Popen([sys.executable, "-m", "indknn_cli", "serve-queries", "q1", "--store", str(store_path),
                                 "--ledger", str(ledger_path), "--seed", "2", "--scheduler", scheduler],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "the candidate tasks never started"
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        client.unregister_worker_plugin(_KillOnce.name)
    finally:
        client.close()
    assert out == ""
    led = BudgetLedger.open(ledger_path)  # verifies the hash chain
    assert led.state.n_answers() == 0 and led.state.spent.tobytes() == spent0
    again = serve_queries(store_path=store_path, ledger_path=ledger_path, query_batch="q1", seed=2)
    assert again.newly_answered == 40


@pytest.mark.heavy
def test_bench_serve_speed_on_a_local_cluster():
    """`indknn bench serve-speed --scheduler local --workers 1,2` prints the in-process line and one per count."""
    env = {k: v for k, v in os.environ.items() if k != "INDKNN_SCHEDULER"}
    proc = subprocess.run([sys.executable, "-m", "indknn_cli", "bench", "serve-speed", "--n", "9000", "--d", "32",
                           "--queries", "300", "--batch-size", "100", "--device", "cpu", "--scheduler", "local",
                           "--workers", "1,2"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(x["mode"], x.get("workers")) for x in lines] == [("in-process", None), ("dask", 1), ("dask", 2)]
    assert all(x["answers_identical"] for x in lines[1:])
    assert all(0 < x["coordinator_share"] < 1 and x["queries_per_s"] > 0 for x in lines[1:])
    assert lines[0]["per_chunk"]["score_chunk_s"] > 0


def test_a_worker_that_cannot_see_the_store_is_a_scheduler_error(tmp_path):
    """The task itself (as a worker runs it): another store, or none, at the coordinator's path → SchedulerError."""
    store_path, _ = make_world(tmp_path, "flat")
    store = FeatureStore.open(store_path)
    q = store.read("query", "features", 0, 4)
    spec = distributed.RangeSpec(distributed.StoreLocation.of(store), store.uuid, "run1", "flat", "cosine", 0.3, None)
    qi, rows, kap = distributed.score_range(spec, 0, 64, q)
    assert rows.size and (rows < 64).all() and (kap >= 0.3).all()
    other = distributed.RangeSpec(spec.loc, "0" * 32, "run2", "flat", "cosine", 0.3, None)
    with pytest.raises(SchedulerError, match="sees another store"):
        distributed.score_range(other, 0, 64, q)
    missing = distributed.RangeSpec(distributed.StoreLocation(str(tmp_path / "nowhere.zarr")), store.uuid, "run3",
                                    "flat", "cosine", 0.3, None)
    with pytest.raises(SchedulerError, match="cannot open the store"):
        distributed.score_range(missing, 0, 64, q)
    assert distributed.drop_run("run3") == 0 and not any(k[0] in ("run1", "run2") for k in distributed._PARTS)


class _RaiseOnRead(WorkerPlugin):
    """A worker plugin: the worker's range reader raises an error whose text quotes a value it read."""

    name = "indknn-test-raise"

    def setup(self, worker):
        self.saved = distributed._range_scorer

        def broken(*args, **kwargs):
            raise RuntimeError("record r0017 has kappa 0.8123 (secret-7)")

        distributed._range_scorer = broken

    def teardown(self, worker):
        distributed._range_scorer = self.saved


def test_a_failing_worker_task_is_named_by_its_exception_type_only(tmp_path, scheduler):
    """Audit 9, S3: a worker's exception text can quote what it read; serve's stderr shows only its type."""
    store_path, ledger_path = make_world(tmp_path, "flat")
    store = FeatureStore.open(store_path)
    led = BudgetLedger.open(ledger_path)
    client = distributed.connect(scheduler)
    try:
        dask = distributed.DaskCandidates(client, tasks_per_worker=1)
        finder = dask.factory(store, led)
        client.register_plugin(_RaiseOnRead())  # each worker's range reader raises, quoting a "private" value
        q = store.read("query", "features", 0, 4)
        with pytest.raises(SchedulerError) as err:
            finder(q, row_mask=np.ones(store.n_rows("private"), bool))
        client.unregister_worker_plugin(_RaiseOnRead.name)
        dask.release()
    finally:
        client.close()
    msg = str(err.value)
    assert "candidate phase failed (" in msg and "nothing was charged" in msg and "secret-7" not in msg


@pytest.mark.heavy
def test_dasks_own_log_lines_never_reach_serves_stderr(scheduler):
    """Review 59, L1: `distributed` gives its loggers a stderr handler of their own; some of its lines are gated on
    time ("Event loop was unresponsive in Client for N s" after a busy client), and how long a serve keeps the client
    busy depends on the private data. Opening indknn's client sets them to CRITICAL (a process of its own: the
    handler writes to the stderr of the process that imported `distributed`)."""
    import subprocess
    import sys

    code = ("import logging; from indknn_cli.scheduler_address import open_client; "
            f"c = open_client({scheduler!r}, timeout=30); "
            "[logging.getLogger(n).error('Event loop was unresponsive in Client for 3.2s (review 59)') "
            "for n in ('distributed.client', 'distributed.utils', 'distributed.core')]; c.close()")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr
    assert "review 59" not in res.stderr
