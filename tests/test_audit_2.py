"""Regression tests of the second privacy audit (AUDIT_FINDINGS_2.md). Each failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest

from indknn_cli import tuning
from indknn_cli.store import open_store

from .conftest import clustered


# -- P1: the private tuning's number of shards must not depend on the number of private records ------------------
def _noiseless_scores(monkeypatch, x, y, req):
    """Run private tuning and return the un-noised score of every run (and the shard counts it used)."""
    import indknn_cli.tuning as tmod

    from indknn_cli.tuning_base import emulated_expected as real  # the search's score (tuning.emulated_score)

    seen: list = []

    def spy(data, *, params, run_key, n_shards, planned_queries):
        s = real(data, params=params, run_key=run_key, n_shards=n_shards, planned_queries=planned_queries)
        seen.append((n_shards, s))
        return s

    monkeypatch.setattr(tmod, "emulated_score", spy)
    tuning.private_tune_arrays(x, y, n_classes=3, req=req)
    return seen


def test_private_tuning_score_moves_by_at_most_one_when_a_record_joins_a_small_store(monkeypatch):
    """The search's ρ per run assumes the score moves by ≤ 1 when one record is added or removed. With fewer
    private records N than --tune-queries S, S was clamped to N: adding one record changed S, re-dealt every
    record's shard and moved the score by many (an unaccounted cost, released through the chosen θ)."""
    x, y, _ = clustered(61, 16, 3, seed=5, spread=0.6)
    req = tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=3, taus=(0.2, 0.5), sigma2s=(0.3, 1.0), n_val=200,
                             mean_runs=6.0, share=0.3, planned_queries=50)
    d = _noiseless_scores(monkeypatch, x[:60], y[:60], req)     # D: 60 records
    d1 = _noiseless_scores(monkeypatch, x, y, req)              # D ∪ {x}: 61 records
    assert len(d) == len(d1) and d  # the same (data-independent) runs
    assert {s for s, _ in d} == {s for s, _ in d1} == {200}, "the number of shards must be the public --tune-queries"
    assert max(abs(a - b) for (_, a), (_, b) in zip(d, d1)) <= 1 + 1e-9


# -- P2: one object-storage store, one state folder (its locks and ledger mark), whatever the URL's spelling -------
def _s3_store(tmp_path, endpoint):
    from indknn_cli.embedding import embed_into_store

    from .s3_server import new_bucket

    bucket = new_bucket(endpoint)
    x, y, _ = clustered(40, 8, 3, seed=1)
    np.savez(tmp_path / "priv.npz", x=x, y=y, ids=np.array([f"r{i:04d}" for i in range(40)]))
    embed_into_store(tmp_path / "priv.npz", store_path=f"s3://{bucket}/stores/s1", extractor="vectors",
                     label_names=["0", "1", "2"])
    return bucket


@pytest.mark.heavy
def test_store_url_spellings_share_one_state_folder_and_one_write_lock(tmp_path, monkeypatch):
    """s3a:// and a trailing slash name the same objects as s3://bucket/prefix. Each spelling got its own state
    folder, so its own store write lock: two writers (an embed and a delete) could then write the same chunks at
    once (an append's uncommitted rows overwritten by the other's, an erasure racing an append)."""
    import pytest

    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from indknn_cli.errors import LockTimeoutError

    from .s3_server import moto_server

    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    with moto_server() as endpoint:
        bucket = _s3_store(tmp_path, endpoint)
        a = open_store(f"s3://{bucket}/stores/s1", mode="a")
        for alias in (f"s3a://{bucket}/stores/s1", f"s3://{bucket}/stores/s1/", f"S3://{bucket}/stores/s1"):
            b = open_store(alias, mode="a")
            assert b.uuid == a.uuid  # the same data
            assert b.path == a.path, alias  # hence the same state folder: locks, ledger mark, candidate index
            with a.write_lock(timeout=5):
                with pytest.raises(LockTimeoutError):
                    with b.write_lock(timeout=0.3):
                        pass


def test_state_folder_made_under_an_alias_spelling_moves_to_the_merged_one(tmp_path, monkeypatch):
    """A state folder made before the spellings were merged (with its ledger mark) is moved, not forgotten:
    a forgotten mark would refuse the bound ledger (or, worse, leave two folders)."""
    from indknn_cli import object_store

    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    old = object_store._legacy_state_dir("s3a://bkt/p")
    old.mkdir(parents=True)
    object_store.write_pointer(old, name="s3a://bkt/p", url="s3a://bkt/p")
    (old / "ledger-mark.json").write_text("{}")
    new = object_store.local_path("s3a://bkt/p/")
    assert new == object_store.state_dir("s3://bkt/p") == object_store.local_path("s3://bkt/p")
    assert (new / "ledger-mark.json").is_file() and not old.exists()
    # and when the merged spelling is the one given now
    old2 = object_store._legacy_state_dir("s3a://bkt/q")
    old2.mkdir(parents=True)
    object_store.write_pointer(old2, name="s3a://bkt/q", url="s3a://bkt/q")
    (old2 / "ledger-mark.json").write_text("{}")
    assert (object_store.local_path("s3://bkt/q") / "ledger-mark.json").is_file() and not old2.exists()


# -- P3: the Dask candidate phase keeps serving's --max-memory bound on a batch's candidate pairs ----------------
def _dense_world(path, n=3000, m=64):
    """Every private record is a candidate of every query (a tight cluster, low τ): m·n pairs per batch."""
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

    rng = np.random.default_rng(0)
    centre = rng.standard_normal(8)
    x = normalize_rows(centre + 0.05 * rng.standard_normal((n, 8))).astype(np.float32)
    store = FeatureStore.create(path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                label_names=["a", "b"], chunk_rows=512)
    store.append("private", x, labels=(np.arange(n) % 2).astype(np.int32), record_ids=[f"r{i:05d}" for i in range(n)])
    q = normalize_rows(centre + 0.05 * rng.standard_normal((m, 8))).astype(np.float32)
    store.append("query", q, record_ids=[f"q{i:03d}" for i in range(m)], batch="q1")
    build_index(store_path=store.path, ledger_path=path / "L",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.2, sigma2=0.5, planned_queries=100))
    return store.path, path / "L", q


def test_dask_candidate_phase_splits_a_batch_past_the_pair_bound(tmp_path):
    """In process, a batch whose candidate pairs would pass the --max-memory bound is answered in halves; the
    Dask finder returned every triple of the batch (192,000 here, bound 174,762 at --max-memory 16M), so the
    memory a run needs — and whether a worker or the coordinator is killed, i.e. the exit code and the number of
    answers — grew with a private quantity (records within τ of the queries)."""
    import pytest

    pytest.importorskip("distributed")
    import logging

    from distributed import Client, LocalCluster

    from indknn_cli import distributed as dist
    from indknn_cli.engine import TooManyPairs
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import serve_queries
    from indknn_cli.store import FeatureStore

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sp, lp, q = _dense_world(tmp_path / "a")
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None,
                      silence_logs=logging.ERROR) as cluster, Client(cluster, set_as_default=False) as client:
        store, ledger = FeatureStore.open(sp), BudgetLedger.open(lp)
        finder = dist.DaskCandidates(client, device="cpu", max_memory=16 << 20).factory(store, ledger)
        with pytest.raises(TooManyPairs):
            finder(q, row_mask=np.ones(store.n_rows("private"), bool))
        one = finder(q[:1], row_mask=np.ones(store.n_rows("private"), bool))  # one query: never split
        assert one.rows[0].size == 3000
        # serving answers the halves: the same answers and ledger as in process; every task has a key of its own
        # (a split batch re-scored under its first call's keys would get that call's triples back)
        keys: list = []
        submit = client.submit

        def spy(*a, **kw):
            keys.append(kw.get("key"))
            return submit(*a, **kw)

        client.submit = spy
        got = serve_queries(store_path=sp, ledger_path=lp, query_batch="q1", seed=2, max_memory=16 << 20,
                            device="cpu", candidate_finder_factory=dist.DaskCandidates(
                                client, device="cpu", max_memory=16 << 20).factory)
        assert len(keys) == len(set(keys)) > 2
    sp2, lp2, _ = _dense_world(tmp_path / "b")
    want = serve_queries(store_path=sp2, ledger_path=lp2, query_batch="q1", seed=2, max_memory=16 << 20,
                         device="cpu")
    assert [(a["label"], a["released_count"]) for a in got.answers] == \
        [(a["label"], a["released_count"]) for a in want.answers]
    assert BudgetLedger.open(lp).state.spent.tobytes() == BudgetLedger.open(lp2).state.spent.tobytes()


# -- P5: every exact figure `account` prints says it is operator-only; every ε line names unit and adjacency ------
def _served_ledger(tmp_path):
    from indknn_cli.serving import build_index, make_params, serve_queries
    from indknn_cli.store import ExtractorInfo, FeatureStore

    x, y, _ = clustered(100, 8, 3, seed=1)
    s = FeatureStore.create(tmp_path / "st.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                            label_names=["a", "b", "c"], chunk_rows=64)
    s.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(100)])
    q, _, _ = clustered(10, 8, 3, seed=2)
    s.append("query", q, record_ids=[f"q{i}" for i in range(10)], batch="q1")
    build_index(store_path=s.path, ledger_path=tmp_path / "led",
                params=make_params(epsilon=1, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    serve_queries(store_path=s.path, ledger_path=tmp_path / "led", query_batch="q1")  # unseeded: review 73, F0
    return s.path, tmp_path / "led"


def test_account_labels_its_exact_figures_operator_only_and_eps_checks_name_unit_and_adjacency(tmp_path):
    import json

    from typer.testing import CliRunner

    from indknn_cli.cli.app import app

    sp, lp = _served_ledger(tmp_path)
    runner = CliRunner()
    env = {"INDKNN_WIDTH": "200"}
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp)], env=env)
    assert res.exit_code == 0, res.output
    out = res.stdout
    # the note comes before the first exact figure (the Records table)
    assert "OPERATOR ONLY" in out and out.index("OPERATOR ONLY") < out.index("Records")
    d = json.loads(runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--json"],
                                 env=env).stdout)
    assert "operator-only" in d["operator_only"] and "records_active" in d["operator_only"]
    res = runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--eps", "5", "--min-active", "1"],
                        env=env)
    assert res.exit_code == 0, res.output
    for line in res.stderr.splitlines():
        if "--eps 5 check" in line:
            assert "add/remove one record" in line, line
        if "--min-active 1 check" in line:
            assert "operator-only" in line, line
    assert "--eps 5 check" in res.stderr and "--min-active 1 check" in res.stderr


# -- P4: repair after a rollback must not refund an id added, charged and erased in the removed events ------------
def test_repair_after_a_rollback_keeps_an_erased_id_from_coming_back_fresh(tmp_path):
    """An id added, charged and erased in events that a rollback removed was in none of repair's sources (the
    kept ledger, the store — erasure blanks the id —, readable quarantined events): re-embedded, it started at
    spent 0 after having spent B (SPEC §8: repair may retire, never refund; a returning id keeps its spent)."""
    from indknn_cli.deletion import delete_records
    from indknn_cli.errors import LedgerError
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.ledger_repair import repair_ledger
    from indknn_cli.serving import build_index, make_params, serve_queries
    from indknn_cli.store import ExtractorInfo, FeatureStore

    import pytest

    x, y, _ = clustered(60, 8, 3, seed=1)
    s = FeatureStore.create(tmp_path / "st.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                            label_names=["a", "b", "c"], chunk_rows=64)
    s.append("private", x[:50], labels=y[:50], record_ids=[f"r{i}" for i in range(50)])
    q = np.repeat(x[55:56], 10, axis=0)  # every query is rX's own vector: rX is charged
    s.append("query", q, record_ids=[f"q{i}" for i in range(10)], batch="q1")
    led = tmp_path / "led"
    build_index(store_path=s.path, ledger_path=led,
                params=make_params(epsilon=1, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    kept = set((led / "events").glob("*.parquet"))
    FeatureStore.open(s.path, mode="a").append("private", x[55:56], labels=y[55:56], record_ids=["rX"])
    serve_queries(store_path=s.path, ledger_path=led, query_batch="q1", seed=1)
    st = BudgetLedger.open(led).state
    spent_before = float(st.spent[list(st.record_id).index("rX")])
    assert spent_before > 0
    delete_records(store_path=s.path, ledger_path=led, record_ids=["rX"])
    for p in set((led / "events").glob("*.parquet")) - kept:  # the rollback: add rX, serve, delete rX
        p.unlink()
    with pytest.raises(LedgerError):
        serve_queries(store_path=s.path, ledger_path=led, query_batch="q1", seed=2)
    assert repair_ledger(ledger_path=led, store_path=s.path).repaired
    FeatureStore.open(s.path, mode="a").append("private", x[55:56], labels=y[55:56], record_ids=["rX"])  # rX returns
    build_index(store_path=s.path, ledger_path=led, params=None)
    ledger = BudgetLedger.open(led)
    st = ledger.state
    assert float(st.spent[list(st.record_id).index("rX")]) >= spent_before


def test_private_tuning_records_the_public_shard_count_not_a_count_of_private_records(monkeypatch):
    """docs/TUNING.md: `validation_queries` is S. It was the number of non-empty shards, an exact statistic of
    the private records (≈ N when N < S) printed by `index` and `account` without an operator-only label."""
    x, y, _ = clustered(60, 16, 3, seed=5)
    req = tuning.TuneRequest(epsilon=2.0, delta=1e-5, seed=3, taus=(0.2,), sigma2s=(0.5,), n_val=200, mean_runs=2.0,
                             share=0.3, planned_queries=50)
    rec, _ = tuning.private_tune_arrays(x, y, n_classes=3, req=req)
    assert rec.validation_queries == 200


def test_index_output_labels_its_exact_record_counts_operator_only(tmp_path):
    """`index` prints the exact number of private records (records, records_added) on stdout: an exact figure of
    the private data, printed without the operator-only note (SPEC §8: say so wherever printed)."""
    import json

    from typer.testing import CliRunner

    from indknn_cli.cli.app import app
    from indknn_cli.store import ExtractorInfo, FeatureStore

    x, y, _ = clustered(50, 8, 3, seed=1)
    s = FeatureStore.create(tmp_path / "st.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                            label_names=["a", "b", "c"], chunk_rows=64)
    s.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(50)])
    res = CliRunner().invoke(app, ["index", "--store", str(s.path), "--ledger", str(tmp_path / "L"), "--eps", "1"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert d["records"] == 50 and "operator-only" in d["operator_only"] and "records" in d["operator_only"]


@pytest.mark.heavy
def test_auto_compaction_depends_on_the_number_of_serve_events_only(tmp_path, monkeypatch):
    """Audit 2, P7: whether a serve run compacts the ledger at its end (its time, and its exit code should the
    compaction fail) must not depend on how many records were charged. Two ledgers, one store each, served
    the same number of parts: in one every query charges records (τ low), in the other none (τ high). Before
    the fix the bytes of the charge rows decided it (the charged world compacted at 9 events, the other not)."""
    from indknn_cli import serving
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import build_index, make_params, serve_queries
    from indknn_cli.store import ExtractorInfo, FeatureStore

    monkeypatch.delenv("INDKNN_AUTO_COMPACT", raising=False)
    n = 40000  # a snapshot heavier than 9 uncharged events, lighter than 9 events charging every record
    x, y, _ = clustered(n, 16, 3, seed=4)
    generations = {}
    for name, tau in (("charged", 0.01), ("none", 0.9999)):
        store = FeatureStore.create(tmp_path / f"{name}.zarr", extractor=ExtractorInfo("vectors", "none", "1"),
                                    dim=16, label_names=["a", "b", "c"])
        store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(n)])
        q, _, _ = clustered(9 * 4, 16, 3, seed=5)
        store.append("query", q, record_ids=[f"q{i}" for i in range(36)], batch="b")
        lp = tmp_path / f"{name}-L"
        build_index(store_path=store.path, ledger_path=lp,
                    params=make_params(epsilon=50.0, delta=1e-5, tau=tau, sigma2=0.5, planned_queries=36))
        serve_queries(store_path=store.path, ledger_path=lp, query_batch="b", batch_size=4, reuse=False, seed=1)
        led = BudgetLedger.open(lp)
        generations[name] = (led.generation, len(led._event_files()))
        charged = int((led.state.spent > 0).sum())
        assert (charged > 0) == (name == "charged")
    assert generations["charged"] == generations["none"], generations
    assert serving.AUTO_COMPACT_EVENTS > 9 and generations["none"][1] >= 9  # 9 parts: no compaction yet


# -- P9: a bucket versioned after the store was made must not block an erasure -----------------------------------
@pytest.mark.heavy
def test_erasure_in_a_bucket_versioned_later_is_recorded_and_reported_incomplete(tmp_path, monkeypatch):
    """Writes to a versioned bucket are refused (old versions would keep erased vectors). When versioning is
    switched on after the store was made, `delete` was refused whole: the record stayed live in the ledger and
    `serve-queries` (a read-only open, no versioning check) went on selecting it. The erasure must still be
    recorded (tombstone, never served again, current versions overwritten), and the incomplete physical erasure
    reported (exit 1, naming the bucket)."""
    import json

    import boto3
    import pytest

    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from typer.testing import CliRunner

    from indknn_cli.cli.app import app
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import build_index, make_params

    from .s3_server import _creds, moto_server, raw_objects

    monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "state"))
    with moto_server() as endpoint:
        bucket = _s3_store(tmp_path, endpoint)
        url = f"s3://{bucket}/stores/s1"
        build_index(store_path=url, ledger_path=tmp_path / "L",
                    params=make_params(epsilon=1, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=10))
        boto3.client("s3", endpoint_url=endpoint, **_creds()).put_bucket_versioning(
            Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})

        victim = open_store(url).read("private", "features")[3].tobytes()
        res = CliRunner().invoke(app, ["delete", "--store", url, "--ledger", str(tmp_path / "L"), "--record", "r0003"])
        assert res.exit_code == 1, res.output
        assert "versioning" in res.stderr and bucket in res.stderr
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["records_erased"] == 1 and "incomplete" in out["physical_erasure"]
        st = BudgetLedger.open(tmp_path / "L").state
        assert st.deleted[list(st.record_id).index("r0003")]  # tombstoned: never selected again
        s3 = boto3.client("s3", endpoint_url=endpoint, **_creds())
        bodies = [s3.get_object(Bucket=bucket, Key=v["Key"], VersionId=v["VersionId"])["Body"].read()
                  for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket)
                  for v in page.get("Versions", [])]
        assert any(victim in body for body in bodies)  # what the report says: an old version keeps it
        assert not any(victim in body for body in raw_objects(endpoint, bucket).values() if body)  # current: gone


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["lsh", "ivf"])
def test_lsh_and_ivf_finders_honour_the_pair_bound_in_process(tmp_path, kind, monkeypatch):
    """Audit 2, P3 in process: the LSH/IVF finders were called without serving's pair bound (--max-memory), so
    the memory of a batch — whether the process is killed, i.e. the exit code and the number of answers — grew
    with the number of private records near the queries. Now they stop past the bound and serving answers the
    halves: the same answers and ledger as a run whose bound is never reached."""
    from indknn_cli.engine import TooManyPairs
    from indknn_cli.indexes.common import _FinderBase
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import build_index, serve_queries

    raised = []
    real = _FinderBase._check_pairs

    def spy(m, screened, max_pairs):
        try:
            real(m, screened, max_pairs)
        except TooManyPairs:
            raised.append((m, screened))
            raise

    monkeypatch.setattr(_FinderBase, "_check_pairs", staticmethod(spy))
    runs = {}
    for name, mem in (("small", 16 << 20), ("large", 1 << 30)):
        (tmp_path / name).mkdir()
        sp, lp, _ = _dense_world(tmp_path / name)
        opts = dict(nlist=4, nprobe=4) if kind == "ivf" else dict(bits=2, tables=2)
        # one index seed for both worlds: LSH tables from two random seeds find other candidates (this test
        # compared two randomly seeded indexes and failed 2 runs of 7 here)
        build_index(store_path=sp, ledger_path=lp, params=None, kind=kind, index_seed=7, **opts)
        res = serve_queries(store_path=sp, ledger_path=lp, query_batch="q1", seed=2, max_memory=mem, device="cpu")
        runs[name] = ([(a["label"], a["released_count"]) for a in res.answers],
                      BudgetLedger.open(lp).state.spent.tobytes())
        if name == "small":
            assert raised and all(s > 174762 for _, s in raised), raised  # the bound was hit and split
            n_small = len(raised)
    assert len(raised) == n_small  # the large bound was never reached
    assert runs["small"] == runs["large"]
