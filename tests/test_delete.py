"""`indknn delete`: physical erasure, tombstones, no fresh budget for returning ids, crashes, compaction."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import indknn_cli
from indknn_cli import deletion
from indknn_cli.cli.app import app
from indknn_cli.deletion import delete_records
from indknn_cli.errors import BadInputError, ConcurrentChangeError, LedgerError, LockTimeoutError, StoreError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
PARAMS = dict(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100)


# -- helpers ------------------------------------------------------------------------
def _index(store, tmp_path, **kw):
    build_index(store_path=store.path, ledger_path=tmp_path / "L", params=make_params(**{**PARAMS, **kw}))
    return tmp_path / "L"


def _ledger(lp) -> BudgetLedger:
    return BudgetLedger.open(lp)


def _vector(store_path, row) -> np.ndarray:
    return FeatureStore.open(store_path).read("private", "features", row, row + 1)[0]


def _all_bytes(folder: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()]


def _digest(*folders: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(b).hexdigest() for f in folders for p, b in _all_bytes(f)}


def _events(lp) -> list[tuple[int, dict, object]]:
    out = []
    for p in sorted((Path(lp) / "events").glob("*.parquet")):
        t = pq.read_table(p)
        out.append((int(p.name.split("-", 1)[0]), json.loads(t.schema.metadata[b"indknn_event"]), t))
    return out


def _charged(table) -> set[int]:
    kinds = table.column("kind").to_pylist()
    return {i for k, i in zip(kinds, table.column("ledger_index").to_pylist()) if k == "charge"}


def _queries_at(store, vec, name, n=8):
    store.append("query", np.repeat(vec[None, :], n, axis=0), record_ids=[f"{name}-{i}" for i in range(n)],
                 batch=name)


def _assert_consistent(store_path, lp, x, ids):
    """Every live ledger record's store row holds its id and its original vector."""
    s = FeatureStore.open(store_path)
    led = BudgetLedger.open(lp, store_uuid=s.uuid)
    live = np.flatnonzero(~led.state.deleted)
    rows = led.state.row[live]
    assert (s.record_ids()[rows] == led.state.record_id[live]).all()
    pos = {rid: i for i, rid in enumerate(ids)}
    np.testing.assert_array_equal(s.read("private", "features")[rows], x[[pos[r] for r in led.state.record_id[live]]])
    assert (led.state.spent <= led.params.budget).all()
    return s, led


# -- erasure ------------------------------------------------------------------------
def test_deleted_vector_bytes_are_in_no_file_of_the_store(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", seed=1)
    targets = [7, 130, 131]  # one alone in its chunk, two neighbours in another
    vecs = [_vector(vector_store.path, r).tobytes() for r in targets]
    needles = vecs + [v[20:44] for v in vecs]  # the whole float32 vector and a distinctive 6-float slice
    before = b"".join(b for _, b in _all_bytes(vector_store.path))
    assert all(n in before for n in needles)  # the scan can see them
    res = delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0007", "r0130", "r0131"])
    assert res.records_erased == 3 and res.bytes_rewritten > 0
    for path, data in _all_bytes(vector_store.path) + _all_bytes(lp):
        assert not any(n in data for n in needles), path
    s = FeatureStore.open(vector_store.path)
    assert (s.read("private", "features")[targets] == 0).all() and (s.read("private", "labels")[targets] == -1).all()
    assert set(s.read("private", "record_id")[targets]) == {""} and s.read("private", "deleted")[targets].all()
    assert not list(vector_store.path.rglob("*.partial"))


def test_tombstone_keeps_spent_and_nothing_else_changes(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", seed=1)
    before = _ledger(lp).state
    target = int(np.argmax(before.spent))
    rid, uid = before.record_id[target], before.user_id[target]
    res = delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=[rid])
    assert res.as_dict()["users"] == [uid] and res.record_ids == [rid]
    after = _ledger(lp).state
    assert after.deleted[target] and after.row[target] == -1 and np.isfinite(after.deleted_at[target])
    assert after.spent[target] == before.spent[target] > 0  # never refunded
    others = np.arange(len(after)) != target
    for name in ("spent", "times_selected", "row", "budget", "deleted"):
        np.testing.assert_array_equal(getattr(after, name)[others], getattr(before, name)[others])
    from indknn_cli.report import build_account_report  # `indknn account --record` shows the tombstone

    rec = build_account_report(ledger_path=lp, record_id=rid).data  # the record at the top level (issue 15 §4)
    assert rec["deleted"] and rec["status"] == "deleted" and rec["spent"] == pytest.approx(before.spent[target])


def test_deleted_record_is_never_selected_again(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path, planned_queries=1000, sigma2=5.0)
    vec = _vector(vector_store.path, 42)
    _queries_at(vector_store, vec, "before")
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="before", seed=1)
    led = _ledger(lp)
    t = int(np.flatnonzero(led.state.record_id == "r0042")[0])
    assert led.state.times_selected[t] == 8  # a query equal to its vector selects it
    delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0042"])
    assert build_index(store_path=vector_store.path, ledger_path=lp, params=None).records_added == 0
    _queries_at(vector_store, vec, "after")
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="after", seed=2)
    events = _events(lp)
    del_seq = next(seq for seq, info, _ in events if info["type"] == "delete")
    assert any(t in _charged(tab) for seq, _, tab in events if seq < del_seq)
    assert all(t not in _charged(tab) for seq, _, tab in events if seq > del_seq)
    assert _ledger(lp).state.times_selected[t] == 8


def test_user_deletion_and_unindexed_rows(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    x, y, _ = clustered(3, 16, 3, seed=8)
    vector_store.append("private", x, labels=y, record_ids=["n0", "n1", "n2"], user_ids=["u003", "zz", "zz"])
    res = delete_records(store_path=vector_store.path, ledger_path=lp, user_ids=["u003", "ghost"], record_ids=["n1"])
    assert res.users_not_found == ["ghost"] and res.ids_not_found == []
    assert set(res.record_ids) == {f"r{i:04d}" for i in range(3, 300, 50)} | {"n0", "n1"}
    led = _ledger(lp)
    assert led.state.deleted[led.state.user_id == "u003"].all()
    assert "n0" not in set(led.state.record_id)  # never indexed: erased in the store, nothing to tombstone
    assert build_index(store_path=vector_store.path, ledger_path=lp, params=None).records_added == 1  # only n2
    again = delete_records(store_path=vector_store.path, ledger_path=lp, user_ids=["u003"], record_ids=["r0003"])
    assert again.records_erased == 0 and again.already_deleted == ["r0003"] and again.users_not_found == []
    assert again.users_already_deleted == ["u003"] == again.as_dict()["users_already_deleted"]  # review 42, L5
    assert res.users_already_deleted == []


# -- returning ids keep their spent budget ------------------------------------------------
def test_readded_id_keeps_its_spent_and_a_users_new_record_starts_afresh(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", seed=1)
    led = _ledger(lp)
    t = int(np.argmax(led.state.spent))
    rid, uid, spent = led.state.record_id[t], led.state.user_id[t], float(led.state.spent[t])
    delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=[rid])
    x, y, _ = clustered(2, 16, 3, seed=21)
    start, _ = vector_store.append("private", x, labels=y, record_ids=[rid, "brand-new"], user_ids=[uid, uid])
    assert build_index(store_path=vector_store.path, ledger_path=lp, params=None).records_added == 2
    led = _ledger(lp)
    assert led.state.record_id[t] == rid and not led.state.deleted[t] and led.state.row[t] == start
    assert led.state.spent[t] == spent  # no fresh budget
    new = int(np.flatnonzero(led.state.record_id == "brand-new")[0])
    assert spent > 0 and led.state.spent[new] == 0  # record unit: another record id (review 71, F2)
    # and again through a compaction
    delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=[rid], compact=True)
    vector_store = FeatureStore.open(vector_store.path, mode="a")
    vector_store.append("private", x[:1], labels=y[:1], record_ids=[rid], user_ids=[uid])
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="q1", batch_id="again", seed=2)
    led = _ledger(lp)
    assert not led.state.deleted[t] and led.state.spent[t] >= spent


def test_embed_accepts_a_deleted_id_again(tmp_path):
    from indknn_cli.embedding import embed_into_store

    def npz(path, x, ids):
        np.savez(path, x=x, y=np.array(["a", "b"] * (len(ids) // 2 + 1))[:len(ids)], ids=np.array(ids))
        return path

    x, _, _ = clustered(20, 6, 2, seed=3)
    embed_into_store(npz(tmp_path / "a.npz", x, [f"r{i}" for i in range(20)]), store_path=tmp_path / "s.zarr",
                     role="private", extractor="vectors", label_names=["a", "b"])
    store = FeatureStore.open(tmp_path / "s.zarr", mode="a")
    store.append("query", np.repeat(x[:1], 4, axis=0), record_ids=list("abcd"), batch="q")
    build_index(store_path=store.path, ledger_path=tmp_path / "L",
                params=make_params(epsilon=1, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=10))
    serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="q", seed=1)
    spent = float(_ledger(tmp_path / "L").state.spent[0])
    assert spent > 0
    delete_records(store_path=store.path, ledger_path=tmp_path / "L", record_ids=["r0"])
    embed_into_store(npz(tmp_path / "b.npz", x[:1], ["r0"]), store_path=tmp_path / "s.zarr", role="private",
                     extractor="vectors")
    build_index(store_path=store.path, ledger_path=tmp_path / "L", params=None)
    led = _ledger(tmp_path / "L")
    assert led.state.spent[0] == spent and not led.state.deleted[0] and led.state.row[0] == 20


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "delete", "delete_user", "query", "query", "compact"]),
                              st.integers(0, 9)), min_size=1, max_size=7),
       seed=st.integers(0, 2**16))
@pytest.mark.heavy
def test_any_interleaving_keeps_every_id_within_budget(tmp_path_factory, ops, seed):
    tmp = tmp_path_factory.mktemp("live")
    pool, y, _ = clustered(10, 8, 2, seed=seed)
    ids = [f"r{i}" for i in range(10)]
    user = {f"r{i}": f"u{i % 3}" for i in range(10)}
    store = FeatureStore.create(tmp / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                label_names=["a", "b"], chunk_rows=4)
    store.append("private", pool[:5], labels=y[:5], record_ids=ids[:5], user_ids=[user[r] for r in ids[:5]])
    # small planned_queries: records retire within a few queries, so the filter's edge is exercised
    params = make_params(epsilon=0.5, delta=1e-5, tau=0.3, sigma2=0.4, planned_queries=4, k_min=1)
    build_index(store_path=store.path, ledger_path=tmp / "L", params=params)
    live = set(ids[:5])
    seen: dict[str, float] = {}          # largest spent ever observed per id
    tomb: dict[str, float] = {}          # spent at deletion
    selected_when_deleted: dict[str, int] = {}
    for step, (op, k) in enumerate(ops):
        rid = ids[k]
        if op == "add" and rid not in live:
            store = FeatureStore.open(tmp / "s.zarr", mode="a")
            store.append("private", pool[k:k + 1], labels=y[k:k + 1], record_ids=[rid], user_ids=[user[rid]])
            build_index(store_path=store.path, ledger_path=tmp / "L", params=None)
            live.add(rid)
        elif op == "delete":
            delete_records(store_path=tmp / "s.zarr", ledger_path=tmp / "L", record_ids=[rid])
            live.discard(rid)
        elif op == "delete_user":
            u = f"u{k % 3}"
            delete_records(store_path=tmp / "s.zarr", ledger_path=tmp / "L", user_ids=[u])
            live -= {r for r in ids if user[r] == u}
        elif op == "query":
            store = FeatureStore.open(tmp / "s.zarr", mode="a")
            store.append("query", np.repeat(pool[k:k + 1], 3, axis=0), record_ids=["a", "b", "c"], batch=f"b{step}")
            res = serve_queries(store_path=store.path, ledger_path=tmp / "L", query_batch=f"b{step}", seed=step)
            assert len(res.answers) == 3  # answered whatever the private state (SPEC §8)
        elif op == "compact":
            delete_records(store_path=tmp / "s.zarr", ledger_path=tmp / "L", compact=True)
        led = _ledger(tmp / "L")
        s = led.state
        assert (s.spent <= led.params.budget).all() and (s.spent >= 0).all()
        assert len(set(s.record_id)) == len(s)  # one ledger record per id, forever
        for i, r in enumerate(s.record_id):
            assert s.spent[i] >= seen.get(r, 0.0)  # never refunded: not by delete, re-add or compaction
            seen[r] = float(s.spent[i])
            if s.deleted[i]:
                tomb.setdefault(r, float(s.spent[i]))
                selected_when_deleted.setdefault(r, int(s.times_selected[i]))
                assert s.times_selected[i] == selected_when_deleted[r]  # a tombstone is never selected
                assert r not in live
            else:
                selected_when_deleted.pop(r, None)
                if r in tomb:
                    assert s.spent[i] >= tomb.pop(r)  # came back with the budget it had spent
        assert {r for r in s.record_id[~s.deleted]} == live & set(s.record_id)
    _assert_consistent(tmp / "s.zarr", tmp / "L", pool, ids)


# -- CLI ------------------------------------------------------------------------------
def test_cli_dry_run_writes_nothing(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    before = _digest(vector_store.path, lp)
    r = runner.invoke(app, ["delete", "--record", "r0001", "--user", "u002", "--record", "nope", "--dry-run",
                            "--compact", "--store", str(vector_store.path), "--ledger", str(lp)])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dry_run"] is True and out["bytes_rewritten"] == 0 and out["ids_not_found"] == ["nope"]
    assert out["records_to_erase"] == 7 and "r0001" in out["record_ids"] and out["users"] == ["u001", "u002"]
    assert out["records_erased"] == 0  # nothing was (review 73, F6)
    assert "dry run" in r.stderr
    assert _digest(vector_store.path, lp) == before


def test_cli_strict_unknown_id_exits_2_and_writes_nothing(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    before = _digest(vector_store.path, lp)
    r = runner.invoke(app, ["delete", "--record", "r0001", "--record", "nope", "--strict",
                            "--store", str(vector_store.path), "--ledger", str(lp)])
    assert r.exit_code == 2 and r.stdout == "" and "nope" in r.stderr
    assert _digest(vector_store.path, lp) == before
    r = runner.invoke(app, ["delete", "--record", "nope", "--store", str(vector_store.path), "--ledger", str(lp)])
    assert r.exit_code == 0 and json.loads(r.stdout)["ids_not_found"] == ["nope"] and "not found" in r.stderr
    r = runner.invoke(app, ["delete", "--store", str(vector_store.path), "--ledger", str(lp)])
    assert r.exit_code == 2 and "nothing to delete" in r.stderr


def test_ids_with_surrounding_spaces_find_the_record_as_embed_stored_it(vector_store, tmp_path):
    """Review 38, F3: `embed` trims ids (" sp1 " is stored as "sp1") and `--ids-file` trims its lines, but
    `delete --record ' sp1 ' --strict` said "unknown id; nothing was deleted" and `account --record ' sp1 '` "not in
    the ledger": the id as it appears in the source file must reach the record."""
    lp = _index(vector_store, tmp_path)
    args = ["--store", str(vector_store.path), "--ledger", str(lp)]
    r = runner.invoke(app, ["account", "--ledger", str(lp), "--record", " r0004 ", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["record_id"] == "r0004", r.stderr
    r = runner.invoke(app, ["account", "--ledger", str(lp), "--user", "\tu001 ", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["user_id"] == "u001", r.stderr
    r = runner.invoke(app, ["delete", "--record", " r0003 ", "--user", " u002", "--strict", *args])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert "r0003" in out["record_ids"] and "r0052" in out["record_ids"] and out["ids_not_found"] == []
    assert out["users_not_found"] == []


def test_cli_ids_from_stdin_with_env_fallbacks(vector_store, tmp_path, monkeypatch):
    lp = _index(vector_store, tmp_path)
    monkeypatch.setenv("INDKNN_STORE", str(vector_store.path))
    monkeypatch.setenv("INDKNN_LEDGER", str(lp))
    r = runner.invoke(app, ["delete", "--ids-file", "-"], input="r0010\n\n  r0011  \nr0012\n")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["records_erased"] == 3 and out["record_ids"] == ["r0010", "r0011", "r0012"]
    assert out["dry_run"] is False and out["bytes_rewritten"] > 0 and out["ids_not_found"] == []
    assert _ledger(lp).state.deleted[10:13].all()
    ids = tmp_path / "users.txt"
    ids.write_text("u020\n")
    r = runner.invoke(app, ["delete", "--users-file", str(ids), "--compact"])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["users"] == ["u020"] and out["compaction"]["store_rows_removed"] == 3 + 6
    assert FeatureStore.open(vector_store.path).n_rows("private") == 291
    r = runner.invoke(app, ["delete", "--ids-file", str(tmp_path / "missing.txt")])
    assert r.exit_code == 2 and "no such file" in r.stderr


# -- concurrency: two processes ------------------------------------------------------
def _spawn(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the other process never got going"
        time.sleep(0.02)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


SERVE = """
    import json, time
    from pathlib import Path
    import torch  # imported before `ready`: what follows is quick
    from indknn_cli.serving import serve_queries
    from indknn_cli.store import FeatureStore
    store, ledger, batch, row, started, wait_for, ready = {args}
    seen = []
    def progress(done, total):
        # what this run's queries could see of the target row, read while the run holds the ledger lock
        seen.append(bool((FeatureStore.open(store).read("private", "features", row, row + 1) != 0).any()))
        Path(started).touch()
        while wait_for and not Path(wait_for).exists():
            time.sleep(0.01)
        time.sleep(0.2 if wait_for else 0)  # the other process is now blocked on the ledger lock
    Path(ready).touch()
    serve_queries(store_path=store, ledger_path=ledger, query_batch=batch, batch_size=2, seed=1, device="cpu",
                  on_progress=progress)
    print(json.dumps(seen))
"""


def _serve_proc(store, lp, tmp_path, *, wait_for=None):
    args = (str(store.path), str(lp), "run", 42, str(tmp_path / "serve-started"),
            None if wait_for is None else str(wait_for), str(tmp_path / "serve-ready"))
    return _spawn(SERVE.format(args=repr(args)))


@pytest.mark.heavy
def test_delete_waits_for_a_running_serve(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path, planned_queries=1000, sigma2=5.0)
    _queries_at(vector_store, _vector(vector_store.path, 42), "run", n=6)
    serve = _serve_proc(vector_store, lp, tmp_path, wait_for=tmp_path / "delete-ready")
    _wait_for(tmp_path / "serve-started", serve)  # the serve holds the ledger lock now
    deleter = _spawn(f"""
        from pathlib import Path
        from indknn_cli.deletion import delete_records
        Path({str(tmp_path / "delete-ready")!r}).touch()
        delete_records(store_path={str(vector_store.path)!r}, ledger_path={str(lp)!r}, record_ids=["r0042"])
    """)
    seen = json.loads(_finish(serve))
    _finish(deleter)
    assert seen == [True] * 3  # every part of the running batch saw the record whole
    t = int(np.flatnonzero(_ledger(lp).state.record_id == "r0042")[0])
    events = _events(lp)
    serve_seqs = [seq for seq, info, _ in events if info["type"] == "serve"]
    del_seq = next(seq for seq, info, _ in events if info["type"] == "delete")
    assert len(serve_seqs) == 3 and max(serve_seqs) < del_seq  # the deletion landed after the batch
    assert all(t in _charged(tab) for seq, info, tab in events if info["type"] == "serve")
    assert not (_vector(vector_store.path, 42) != 0).any()


@pytest.mark.heavy
def test_serve_waits_for_a_running_delete(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path, planned_queries=1000, sigma2=5.0)
    _queries_at(vector_store, _vector(vector_store.path, 42), "run", n=6)
    flag, ready = tmp_path / "deleting", tmp_path / "serve-ready"
    deleter = _spawn(f"""
        import time
        from pathlib import Path
        from indknn_cli import deletion
        def pause(point):
            if point == "ledger-committed":  # tombstone committed, store not yet erased: the half-deleted window
                Path({str(flag)!r}).touch()
                while not Path({str(ready)!r}).exists():
                    time.sleep(0.01)
                time.sleep(0.3)  # the serve is now blocked on the ledger lock
        deletion.FAULT_HOOK = pause
        deletion.delete_records(store_path={str(vector_store.path)!r}, ledger_path={str(lp)!r}, record_ids=["r0042"])
    """)
    _wait_for(flag, deleter)
    serve = _serve_proc(vector_store, lp, tmp_path)
    _finish(deleter)
    seen = json.loads(_finish(serve))
    assert seen == [False] * 3  # the serve ran only after the erasure was complete
    t = int(np.flatnonzero(_ledger(lp).state.record_id == "r0042")[0])
    events = _events(lp)
    del_seq = next(seq for seq, info, _ in events if info["type"] == "delete")
    assert all(seq > del_seq and t not in _charged(tab) for seq, info, tab in events if info["type"] == "serve")


def test_delete_refuses_when_the_ledger_lock_is_held(vector_store, tmp_path):
    lp = _index(vector_store, tmp_path)
    before = _digest(vector_store.path, lp)
    with BudgetLedger.write_lock(lp):
        with pytest.raises(LockTimeoutError):
            delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0001"], lock_timeout=0.2)
    assert _digest(vector_store.path, lp) == before


# -- crashes --------------------------------------------------------------------------
class Crash(Exception):
    pass


def _crash_at(monkeypatch, point):
    def hook(p):
        if p == point:
            raise Crash(p)
    monkeypatch.setattr(deletion, "FAULT_HOOK", hook)


@pytest.mark.parametrize("point", ["flagged", "ledger-committed", "erased"])
def test_crash_during_delete_is_finished_by_the_next_delete(vector_store, tmp_path, monkeypatch, point):
    lp = _index(vector_store, tmp_path, planned_queries=1000, sigma2=5.0)
    vec = _vector(vector_store.path, 42)
    _crash_at(monkeypatch, point)
    with pytest.raises(Crash):
        delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0042"])
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    t = int(np.flatnonzero(_ledger(lp).state.record_id == "r0042")[0])
    # whatever the crash point, the row is never added again as a fresh record
    assert build_index(store_path=vector_store.path, ledger_path=lp, params=None).records_added == 0
    _queries_at(vector_store, vec, "after")
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="after", seed=2)
    selected = _ledger(lp).state.times_selected[t]
    assert selected == 0  # flagged in the store = never a candidate again, even before the ledger commit
    # index and serve-queries finish the pending erasure first (tombstones written; the audit's D2)
    assert not FeatureStore.open(vector_store.path).group("private").attrs.get("erase_pending")
    res = delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0001"])
    assert res.pending_completed == 0
    led = _ledger(lp)
    assert led.state.deleted[t] and led.state.times_selected[t] == selected
    assert not any(vec.tobytes() in b for _, b in _all_bytes(vector_store.path / "private"))
    assert not FeatureStore.open(vector_store.path).group("private").attrs.get("erase_pending")


@pytest.mark.parametrize("failing", ["mark_deleted", "erase_rows"])
def test_storage_failure_after_the_request_is_recorded_says_so(vector_store, tmp_path, monkeypatch, failing):
    """Disk full after erase_pending was written: the error says the erasure is recorded, not undone."""
    import errno

    from indknn_cli.errors import StorageError
    lp = _index(vector_store, tmp_path, planned_queries=1000, sigma2=5.0)
    vec = _vector(vector_store.path, 42)

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
    monkeypatch.setattr(FeatureStore, failing, full)
    with pytest.raises(StorageError) as info:
        delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0042"])
    monkeypatch.undo()
    msg = str(info.value)
    assert "No space left on device" in msg and "recorded but not finished" in msg
    assert "previous state is kept" not in msg
    t = int(np.flatnonzero(_ledger(lp).state.record_id == "r0042")[0])
    # even when the store row is not flagged yet, the recorded request keeps it out of every answer
    _queries_at(vector_store, vec, "after")
    serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch="after", seed=2)
    assert _ledger(lp).state.times_selected[t] == 0
    assert _ledger(lp).state.deleted[t]  # serve-queries finished the recorded erasure first (the audit's D2)
    res = delete_records(store_path=vector_store.path, ledger_path=lp, compact=False, record_ids=["r0001"])
    assert res.pending_completed == 0
    assert _ledger(lp).state.deleted[t]
    assert not any(vec.tobytes() in b for _, b in _all_bytes(vector_store.path / "private"))


# -- compaction -------------------------------------------------------------------------
def _twin(tmp_path, name):
    x, y, _ = clustered(200, 16, 3, seed=11)
    ids = [f"r{i:03d}" for i in range(200)]
    store = FeatureStore.create(tmp_path / name / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=32)
    store.append("private", x, labels=y, record_ids=ids, user_ids=[f"u{i % 40}" for i in range(200)])
    q, _, _ = clustered(30, 16, 3, seed=12)
    store.append("query", q, record_ids=[f"q{i}" for i in range(30)], batch="q1")
    store.append("query", q[::-1].copy(), record_ids=[f"p{i}" for i in range(30)], batch="q2")
    lp = tmp_path / name / "L"
    build_index(store_path=store.path, ledger_path=lp, params=make_params(**PARAMS))
    serve_queries(store_path=store.path, ledger_path=lp, query_batch="q1", seed=5, batch_size=7)
    delete_records(store_path=store.path, ledger_path=lp, record_ids=ids[3:200:9], user_ids=["u7"])
    return store.path, lp, x, ids


@pytest.mark.heavy
def test_compaction_renumbers_rows_and_changes_no_answer(tmp_path):
    a_store, a_lp, x, ids = _twin(tmp_path, "a")
    b_store, b_lp, _, _ = _twin(tmp_path, "b")
    before = _ledger(b_lp).state
    res = delete_records(store_path=b_store, ledger_path=b_lp, compact=True)
    comp = res.compaction
    removed = int(before.deleted.sum())
    assert removed == len(range(3, 200, 9)) + 5  # ids[3::9] and user u7's five records
    assert comp["store_rows_removed"] == removed and comp["store_rows"] == 200 - removed
    s, led = _assert_consistent(b_store, b_lp, x, ids)
    assert s.n_rows("private") == 200 - removed and not s.read("private", "deleted").any()
    assert s.uuid == comp["store_uuid"] != FeatureStore.open(a_store).uuid
    for name in ("spent", "times_selected", "deleted", "deleted_at", "record_id", "user_id"):
        np.testing.assert_array_equal(getattr(led.state, name), getattr(before, name))
    assert led.state.answers == before.answers and not list((b_lp / "events").glob("*.parquet"))
    assert sorted(p.name for p in b_store.parent.iterdir()) == ["L", "s.zarr"]
    ra = serve_queries(store_path=a_store, ledger_path=a_lp, query_batch="q2", seed=9, batch_size=5)
    rb = serve_queries(store_path=b_store, ledger_path=b_lp, query_batch="q2", seed=9, batch_size=5)
    assert [(r["label"], r["released_count"]) for r in ra.answers] == [(r["label"], r["released_count"]) for r in rb.answers]
    np.testing.assert_array_equal(_ledger(a_lp).state.spent, _ledger(b_lp).state.spent)


@pytest.mark.parametrize("point,exchange", [("compact-copied", True), ("compact-ledger-prepared", True),
                                            ("compact-swapped", True), ("compact-published", True),
                                            ("compact-half-swapped", False), ("compact-swapped", False)])
@pytest.mark.heavy
def test_crash_during_compaction_never_mixes_rows(tmp_path, monkeypatch, point, exchange):
    store_path, lp, x, ids = _twin(tmp_path, "c")
    spent = _ledger(lp).state.spent.copy()
    monkeypatch.setattr(deletion, "USE_RENAME_EXCHANGE", exchange)
    _crash_at(monkeypatch, point)
    with pytest.raises(Crash):
        delete_records(store_path=store_path, ledger_path=lp, compact=True)
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    # in between, serving either works on a consistent pair or refuses; it never mixes old and new rows
    try:
        serve_queries(store_path=store_path, ledger_path=lp, query_batch="q2", seed=1)
        _assert_consistent(store_path, lp, x, ids)
    except (LedgerError, StoreError) as exc:
        assert point in ("compact-swapped", "compact-half-swapped")
        assert "delete --compact" in str(exc) or "not an indknn feature store" in str(exc)
    res = delete_records(store_path=store_path, ledger_path=lp, compact=True)
    s, led = _assert_consistent(store_path, lp, x, ids)
    assert (led.state.spent[:len(spent)] >= spent).all()
    assert not s.read("private", "deleted").any() and res.compaction["store_rows"] == s.n_rows("private")
    assert sorted(p.name for p in store_path.parent.iterdir()) == ["L", "s.zarr"]
    assert len(list(lp.glob("snapshot-*.parquet"))) == 1
    serve_queries(store_path=store_path, ledger_path=lp, query_batch="q2", batch_id="after", seed=1)


def test_a_writer_that_waited_through_a_compaction_is_refused(tmp_path):
    store_path, lp, _, _ = _twin(tmp_path, "w")
    stale = FeatureStore.open(store_path, mode="a")
    delete_records(store_path=store_path, ledger_path=lp, compact=True)
    with pytest.raises(ConcurrentChangeError, match="compacted"):  # transient: exit 1, not bad input
        with stale.write_lock(timeout=1):
            pass
    with pytest.raises(ConcurrentChangeError, match="compacted"):  # a serve that opened the store before it
        BudgetLedger.open(lp, store_uuid=stale.uuid)
    r = runner.invoke(app, ["delete", "--help"])
    assert r.exit_code == 0 and "--ids-file" in r.stdout and "--compact" in r.stdout


def test_index_hooks_are_called(vector_store, tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("indknn_cli.indexes")
    fake.remove_rows = lambda store, rows: calls.append(("remove", list(map(int, rows))))
    fake.renumber_rows = lambda store, new_row_of: calls.append(("renumber", int((new_row_of >= 0).sum())))
    monkeypatch.setitem(sys.modules, "indknn_cli.indexes", fake)
    monkeypatch.setattr(indknn_cli, "indexes", fake, raising=False)
    lp = _index(vector_store, tmp_path)
    delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0005", "r0009"], compact=True)
    assert calls == [("remove", [5, 9]), ("renumber", 298)]


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["lsh", "ivf"])
def test_deleted_record_leaves_every_candidate_index(vector_store, tmp_path, kind):
    indexes = pytest.importorskip("indknn_cli.indexes")
    if not all(hasattr(indexes, n) for n in ("build", "load_candidate_finder", "index_path")):
        pytest.skip("candidate indexes not available")
    lp = _index(vector_store, tmp_path, planned_queries=1000, sigma2=5.0)
    opts = dict(tables=4, bits=2, seed=1) if kind == "lsh" else dict(train_on="query", nlist=2, nprobe=2, seed=1)
    indexes.build(vector_store, kind=kind, **opts)

    def serve(batch):
        serve_queries(store_path=vector_store.path, ledger_path=lp, query_batch=batch, seed=3,
                      candidate_finder_factory=lambda s, led: indexes.load_candidate_finder(s, led))

    vec = _vector(vector_store.path, 42)
    _queries_at(vector_store, vec, "before")
    serve("before")
    t = int(np.flatnonzero(_ledger(lp).state.record_id == "r0042")[0])
    assert _ledger(lp).state.times_selected[t] == 8
    index_files = _all_bytes(indexes.index_path(vector_store.path))
    delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0042"])
    assert _all_bytes(indexes.index_path(vector_store.path)) != index_files  # its codes / list were overwritten
    assert not any(vec.tobytes() in b for _, b in _all_bytes(vector_store.path / "private"))
    _queries_at(vector_store, vec, "after")
    serve("after")
    assert _ledger(lp).state.times_selected[t] == 8
    delete_records(store_path=vector_store.path, ledger_path=lp, record_ids=["r0043"], compact=True)
    store = FeatureStore.open(vector_store.path, mode="a")
    if not hasattr(indexes, "renumber_rows"):
        indexes.build(store, kind=None)  # re-encodes the renumbered rows with the same public structure
    _queries_at(store, vec, "compacted")
    serve_queries(store_path=store.path, ledger_path=lp, query_batch="compacted", seed=3,
                  candidate_finder_factory=lambda s, led: indexes.load_candidate_finder(s, led))
    assert _ledger(lp).state.times_selected[t] == 8


def test_an_ids_file_saved_with_a_byte_order_mark_erases_its_first_id(vector_store, tmp_path):
    """Review 40, M7: an ids file from Excel or Notepad (UTF-8 with a BOM, CRLF lines) had its first id read as
    "\\ufeffr0001": not found, that erasure silently skipped (exit 0)."""
    lp = _index(vector_store, tmp_path)
    (tmp_path / "ids.txt").write_bytes(b"\xef\xbb\xbfr0001\r\nr0002\r\n")
    r = runner.invoke(app, ["delete", "--ids-file", str(tmp_path / "ids.txt"), "--strict",
                            "--store", str(vector_store.path), "--ledger", str(lp)])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["record_ids"] == ["r0001", "r0002"]
    r = runner.invoke(app, ["delete", "--ids-file", "-", "--store", str(vector_store.path), "--ledger", str(lp)],
                      input="\ufeffr0003\n")
    assert r.exit_code == 0 and json.loads(r.stdout)["record_ids"] == ["r0003"], r.stderr


@pytest.mark.heavy
def test_ids_with_control_characters_are_called_out_beside_not_found(tmp_path):
    """Review 48, F6: an id holding a control character (a NUL, a file saved in another encoding) was only counted
    "not found" (exit 0). No stored id can hold one (embed refuses them): stderr now says so, the rest is erased."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "p.npz", x=rng.standard_normal((10, 4)).astype("f4"), y=np.array(["a", "b"] * 5),
             ids=np.array([f"r{i}" for i in range(10)]))
    sp, lp = tmp_path / "s.zarr", tmp_path / "L"
    runner = CliRunner()
    assert runner.invoke(app, ["embed", str(tmp_path / "p.npz"), "--store", str(sp), "--extractor", "vectors",
                               "--label-names", "a,b", "-q"]).exit_code == 0
    assert runner.invoke(app, ["index", "--store", str(sp), "--ledger", str(lp), "--eps", "1", "-q"]).exit_code == 0
    (tmp_path / "ids.txt").write_text("r1\nr\x002\nr3\u200b\n", encoding="utf-8")
    r = runner.invoke(app, ["delete", "--ids-file", str(tmp_path / "ids.txt"), "--store", str(sp), "--ledger",
                            str(lp)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["records_erased"] == 1
    said = " ".join(r.stderr.split())
    assert "2 record ids and 0 user ids not found" in said and "2 of them hold a control or invisible character" in said
