"""Candidate indexes `lsh` and `ivf` (issue 5, SPEC §4): exactness, data independence, refusals, increments."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from indknn_cli import indexes
from indknn_cli.cli.app import app
from indknn_cli.engine import ArraySource, BudgetView, ReusePool, answer_batch, exact_kernel, find_candidates
from indknn_cli.errors import BadInputError, PrivacyRefusedError, StoreError
from indknn_cli.ledger import BudgetLedger, PrivacyParams
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

from .conftest import clustered
from .reference import reference_answers

runner = CliRunner()
EXTRACTOR = ExtractorInfo("vectors", "none", "1")


def make_store(path, x, y, *, queries=None, public=None, chunk_rows=64):
    store = FeatureStore.create(path, extractor=EXTRACTOR, dim=x.shape[1], label_names=["a", "b", "c"],
                                chunk_rows=chunk_rows)
    store.append("private", x, labels=y, record_ids=[f"r{i:05d}" for i in range(len(x))])
    if queries is not None:
        store.append("query", queries, record_ids=[f"q{i:04d}" for i in range(len(queries))], batch="q1")
    if public is not None:
        store.append("public", public, record_ids=[f"p{i:04d}" for i in range(len(public))])
    return store


def engine_params(kernel="cosine", tau=0.3, nu=None, budget=0.02, sigma1=8.0):
    return PrivacyParams(epsilon=1.0, delta=1e-5, conversion="gdp", budget=budget, kernel=kernel, tau=tau,
                         sigma1=sigma1, sigma2=0.5, nu=nu, k_min=5.0, planned_queries=None).validate()


def brute_force(x, q, *, kernel, tau, nu, member):
    """Reference candidates: rows with member(t, row) and κ ≥ τ (κ by engine.exact_kernel, row by row)."""
    rows, kap = [], []
    for t in range(len(q)):
        k = exact_kernel(x, np.repeat(q[t:t + 1], len(x), 0), kernel=kernel, nu=nu)
        ok = (k >= tau) & member(t)
        rows.append(np.flatnonzero(ok)); kap.append(k[ok])
    return rows, kap


def same_candidates(a, b_rows, b_kap):
    assert len(a.rows) == len(b_rows)
    for r1, k1, r2, k2 in zip(a.rows, a.kappa, b_rows, b_kap):
        assert r1.tolist() == list(r2)
        assert k1.tolist() == list(k2)  # bit for bit


@pytest.fixture
def data():
    x, y, _ = clustered(400, 12, 3, seed=11)
    q, _, _ = clustered(50, 12, 3, seed=12)
    q[5] = x[7]  # a query equal to a private vector
    pub, _, _ = clustered(300, 12, 3, seed=13)
    return x, y, q, pub


# -- exactness -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["lsh", "ivf"])
@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.3, None), ("rbf", 0.5, 1.0)])
@pytest.mark.parametrize("reuse", [False, True])
def test_covering_index_equals_reference_for_any_batch_size(tmp_path, data, kind, kernel, tau, nu, reuse):
    """lsh with buckets that cover every candidate pair, ivf with nprobe = nlist: the engine's exactness test."""
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, queries=q, public=pub)
    opts = dict(tables=48, bits=1, seed=5) if kind == "lsh" else dict(nlist=8, nprobe=8, seed=5)
    indexes.build(store, kind=kind, **opts)
    finder = indexes.open_finder(store, kernel=kernel, tau=tau, nu=nu)
    flat = find_candidates(q, ArraySource(x), kernel=kernel, tau=tau, nu=nu, device="cpu")
    same_candidates(finder(q), flat.rows, flat.kappa)  # the structure really covers all candidates
    p = engine_params(kernel=kernel, tau=tau, nu=nu)
    spent_ref = [0.0] * len(x)
    ref_labels, ref_counts = reference_answers(x, y, q, params=p, n_classes=3, spent=spent_ref,
                                               budget=[p.budget] * len(x), deleted=[False] * len(x),
                                               run_key=77, reuse_pool=[] if reuse else None)
    assert max(spent_ref) > 0
    n = len(x)
    for bs in (1, 7, 256):
        budgets = BudgetView(spent=np.zeros(n), budget=np.full(n, p.budget), deleted=np.zeros(n, bool),
                             times_selected=np.zeros(n, np.int64))
        pool = ReusePool.empty(x.shape[1]) if reuse else None
        labels, counts = [], []
        for lo in range(0, len(q), bs):
            ans = answer_batch(q[lo:lo + bs], source=ArraySource(x), row_to_ledger=np.arange(n), row_labels=y,
                               params=p, n_classes=3, budgets=budgets, run_key=77, first_index=lo, reuse=pool,
                               device="cpu", candidate_finder=finder)
            labels += [a.label for a in ans]; counts += [a.released_count for a in ans]
        assert labels == ref_labels and counts == ref_counts
        assert budgets.spent.tolist() == spent_ref
        assert (budgets.spent <= p.budget).all()


@pytest.mark.parametrize("strategy", ["scan", "buckets", "auto"])
def test_lsh_candidates_are_bucket_sharers_above_tau(tmp_path, data, strategy):
    x, y, q, _ = data
    store = make_store(tmp_path / "s.zarr", x, y)
    indexes.build(store, kind="lsh", tables=6, bits=4, seed=9)
    finder = indexes.open_finder(store, kernel="cosine", tau=0.2, nu=None, strategy=strategy)
    lsh = indexes.LshIndex.from_seed(seed=9, tables=6, bits=4, dim=x.shape[1])
    cx, cq = lsh.codes(x), lsh.codes(q)
    rows, kap = brute_force(x, q, kernel="cosine", tau=0.2, nu=None,
                            member=lambda t: (cx == cq[t]).any(axis=1))
    got = finder(q)
    same_candidates(got, rows, kap)
    flat = find_candidates(q, ArraySource(x), kernel="cosine", tau=0.2, nu=None, device="cpu")
    assert sum(map(len, rows)) < sum(len(r) for r in flat.rows)  # a real restriction
    # one query at a time gives the same sets (SPEC §5: batch composition never matters)
    for t in range(0, len(q), 9):
        single = finder(q[t:t + 1])
        assert single.rows[0].tolist() == got.rows[t].tolist()


def test_ivf_candidates_are_probed_lists_above_tau(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, public=pub)
    indexes.build(store, kind="ivf", nlist=8, nprobe=3, seed=2)
    finder = indexes.open_finder(store, kernel="cosine", tau=0.2, nu=None)
    ivf = indexes.IvfIndex(np.asarray(zarr.open_group(str(store.path / "index"))["centroids"][:]))
    lists, probe = ivf.assign(x), ivf.probe(q, 3)
    rows, kap = brute_force(x, q, kernel="cosine", tau=0.2, nu=None, member=lambda t: np.isin(lists, probe[t]))
    same_candidates(finder(q), rows, kap)
    # lists are nearest centroids by inner product
    assert (lists == np.argmax(x.astype(np.float64) @ ivf.centroids.T.astype(np.float64), axis=1)).all()


def test_serve_gives_identical_answers_for_flat_and_covering_indexes(tmp_path, data):
    x, y, q, pub = data
    results = {}
    for kind, opts in (("flat", {}), ("lsh", dict(tables=48, bits=1, index_seed=3)),
                       ("ivf", dict(nlist=4, nprobe=4, index_seed=3))):
        store = make_store(tmp_path / f"{kind}.zarr", x, y, queries=q, public=pub)
        p = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=50)
        out = build_index(store_path=store.path, ledger_path=tmp_path / f"L-{kind}", params=p, kind=kind, **opts)
        assert out.kind == kind and out.as_dict()["index"]["kind"] == kind
        res = serve_queries(store_path=store.path, ledger_path=tmp_path / f"L-{kind}", query_batch="q1", seed=4,
                            batch_size=16)
        results[kind] = ([a["label"] for a in res.answers], [a["released_count"] for a in res.answers],
                         BudgetLedger.open(tmp_path / f"L-{kind}").state.spent.tolist())
    assert results["lsh"] == results["flat"] == results["ivf"]


# -- exact decisions near boundaries ---------------------------------------------------------
def test_sign_and_argmax_ties_are_decided_exactly():
    lsh = indexes.LshIndex.from_seed(seed=1, tables=1, bits=3, dim=8)
    h = lsh.hyperplanes[0]
    x = np.zeros((1, 8), np.float32)
    x[0, 0], x[0, 1] = h[1], -h[0]  # x·h = h1·h0 − h0·h1 = 0 exactly
    bit0 = lsh.codes(x)[0, 0] & 1
    assert bit0 == 1  # sign(0) := +, decided by the exact sum, not by rounding
    c = normalize_rows(np.random.default_rng(0).standard_normal((3, 8)))
    ivf = indexes.IvfIndex(np.concatenate([c, c[1:2], c]))  # duplicated centroids: exact ties
    v = c[1:2] + np.float32(1e-3) * c[0:1]
    assert ivf.assign(v)[0] == 1  # lowest index among equal scores
    assert ivf.probe(v, 2)[0].tolist() == [1, 3]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 60), nprobe=st.integers(1, 6))
def test_codes_and_lists_are_pure_functions_of_the_vector(seed, rows, nprobe):
    rng = np.random.default_rng(seed)
    x = normalize_rows(rng.standard_normal((rows, 10)))
    lsh = indexes.LshIndex.from_seed(seed=seed, tables=5, bits=7, dim=10)
    ivf = indexes.IvfIndex(normalize_rows(rng.standard_normal((6, 10))))
    # rows within float32 rounding of a hyperplane / of a tie between two centroids (the cascade's slow paths)
    h = lsh.hyperplanes[seed % 35].astype(np.float64)
    v = x[0].astype(np.float64)
    x[0] = normalize_rows((v - (v @ h) / (h @ h) * h)[None])[0]
    c = ivf.centroids.astype(np.float64)
    x[-1] = normalize_rows((c[1] + c[2])[None] + 1e-9)[0]
    whole = lsh.codes(x), ivf.assign(x), ivf.probe(x, nprobe)
    exact_bits = np.array([[indexes._exact_dots(r, lsh.hyperplanes[j:j + 1])[0] >= 0 for j in range(35)] for r in x])
    exact_codes = (exact_bits.reshape(rows, 5, 7) * (1 << np.arange(7))).sum(axis=2)
    assert (whole[0] == exact_codes).all()
    exact_scores = np.array([indexes._exact_dots(r, ivf.centroids) for r in x])
    assert (whole[1] == np.argmax(exact_scores, axis=1)).all()
    for i in range(rows):
        assert (lsh.codes(x[i:i + 1])[0] == whole[0][i]).all()
        assert ivf.assign(x[i:i + 1])[0] == whole[1][i]
        assert (ivf.probe(x[i:i + 1], nprobe)[0] == whole[2][i]).all()


# -- independence from private data ------------------------------------------------------------
def test_hyperplanes_and_centroids_do_not_depend_on_private_records(tmp_path, data):
    x, y, q, pub = data
    x2 = x.copy()
    x2[0] = normalize_rows(-x[0:1].astype(np.float64))[0]  # one private record changed
    metas = []
    for name, xs in (("a", x), ("b", x2), ("c", x[:-1])):  # changed, and one record removed
        store = make_store(tmp_path / f"{name}.zarr", xs, y[:len(xs)], queries=q, public=pub)
        m_lsh = indexes.build(store, kind="lsh", tables=4, bits=5, seed=123)
        m_ivf = indexes.build(store, kind="ivf", nlist=8, seed=123)
        metas.append((m_lsh["hyperplanes_sha256"], m_ivf["centroids_sha256"], m_ivf["centroid_source"]["sha256"]))
    assert metas[0] == metas[1] == metas[2]
    regen = indexes.LshIndex.from_seed(seed=123, tables=4, bits=5, dim=x.shape[1])
    assert metas[0][0] == indexes.vectors_sha256(regen.hyperplanes)  # a function of the seed alone
    assert metas[0][2] == indexes.vectors_sha256(pub)  # trained on the public group, nothing else


# -- refusals -----------------------------------------------------------------------------------
def _nothing_written(store, tmp_path):
    assert not (tmp_path / "L").exists()
    assert not (store.path / "index").exists()


def test_hnsw_pca_pq_are_refused_with_the_reason(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, public=pub)
    p = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5)
    for kind in ("hnsw", "pca", "pq", "ivfpq"):
        with pytest.raises(PrivacyRefusedError, match="depend on the other private records"):
            build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind=kind)
    with pytest.raises(BadInputError, match="--kind must be one of"):
        build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind="annoy")
    _nothing_written(store, tmp_path)


def test_ivf_refuses_private_training_data(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y)  # no public, no query rows
    p = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5)
    with pytest.raises(PrivacyRefusedError) as err:
        build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind="ivf")
    msg = str(err.value)
    assert "public" in msg and "--train-on" in msg and "--role public" in msg
    for bad in ("private", store.path / "private", store.path / "private" / "features"):
        with pytest.raises(PrivacyRefusedError, match="private"):
            build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind="ivf", train_on=bad)
    np.save(tmp_path / "copy.npy", x)  # an export of the private features
    with pytest.raises(PrivacyRefusedError, match="nearly identical"):
        build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind="ivf",
                    train_on=tmp_path / "copy.npy")
    _nothing_written(store, tmp_path)
    np.savez(tmp_path / "pub.npz", x=pub)  # a real public file is fine and recorded
    out = build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind="ivf", nlist=4,
                      train_on=tmp_path / "pub.npz").as_dict()["index"]
    assert out["centroid_source"]["from"] == "file" and out["centroid_source"]["sha256"] == indexes.vectors_sha256(normalize_rows(pub))
    cal = out["nprobe_calibration"]  # nprobe chosen on public vectors only, for the ledger's τ
    assert out["nlist"] == 4 and out["nprobe"] == cal["nprobe"] and cal["heldout_recall"] >= 0.95


def test_nprobe_calibration_uses_held_out_public_vectors(data):
    x, y, q, pub = data
    cal = indexes.calibrate_nprobe(pub, nlist=8, seed=1, kernel="cosine", tau=0.3, nu=None, target=0.9,
                                   holdout=0.3)
    # recompute: centroids from the public vectors not held out, recall among the held-out ones
    rng = np.random.Generator(np.random.PCG64(1))
    n_hold = int(len(pub) * 0.3)
    perm = rng.permutation(len(pub))
    hold = pub[np.sort(perm[:n_hold])]
    ivf = indexes.IvfIndex.train(pub[np.sort(perm[n_hold:])], nlist=8, seed=1)
    lists = ivf.assign(hold)
    s = hold.astype(np.float64) @ hold.T.astype(np.float64)
    np.fill_diagonal(s, -np.inf)
    qi, rj = np.nonzero(s >= 0.3)

    def recall(nprobe):
        probe = ivf.probe(hold, nprobe)
        return np.mean([lists[j] in probe[i] for i, j in zip(qi, rj)])

    def lower(nprobe):
        r = recall(nprobe)
        return r - 2 * np.sqrt(r * (1 - r) / qi.size)

    assert cal["heldout_pairs"] == qi.size
    assert lower(cal["nprobe"]) >= 0.9 - 1e-9 and recall(cal["nprobe"]) == pytest.approx(cal["heldout_recall"], abs=1e-4)
    assert cal["nprobe"] == 1 or lower(cal["nprobe"] - 1) < 0.9


def test_options_of_another_kind_are_bad_input(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, public=pub)
    for kind, opts in (("ivf", {"tables": 3}), ("lsh", {"nprobe": 2}), ("flat", {"nlist": 4}),
                       ("lsh", {"bits": 0}), ("ivf", {"nlist": 10_000})):
        with pytest.raises(BadInputError):
            indexes.plan_index(store, kind=kind, **opts)
    assert not (store.path / "index").exists()


# -- incremental updates ---------------------------------------------------------------------
def _arrays(store):
    g = zarr.open_group(str(store.path / "index"), mode="r")
    return {k: np.asarray(g[k][:]) for k in g.array_keys()}, dict(g.attrs)


@pytest.mark.parametrize("kind", ["lsh", "ivf"])
def test_incremental_add_and_delete_equal_rebuild(tmp_path, data, kind):
    x, y, q, pub = data
    opts = dict(tables=5, bits=6, seed=8) if kind == "lsh" else dict(nlist=8, seed=8)
    store = make_store(tmp_path / "s.zarr", x[:250], y[:250], queries=q, public=pub)
    p = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=50)
    opts_cli = {("index_seed" if k == "seed" else k): v for k, v in opts.items()}
    build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind=kind, **opts_cli)
    store = FeatureStore.open(store.path, mode="a")
    store.append("private", x[250:330], labels=y[250:330], record_ids=[f"r{i:05d}" for i in range(250, 330)])
    serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="q1", seed=1)  # sync → add hook
    assert _arrays(store)[1]["n_rows"] == 330
    gone = np.array([3, 100, 260])
    store.erase_rows("private", gone)
    assert indexes.remove_rows(store, gone) == 3
    store.append("private", x[330:], labels=y[330:], record_ids=[f"r{i:05d}" for i in range(330, 400)])
    store.erase_rows("private", np.array([390]))  # deleted before the index saw it
    assert indexes.add_rows(store, np.arange(330, 400)) == 70
    inc, inc_meta = _arrays(store)
    fresh = make_store(tmp_path / "fresh.zarr", x, y, queries=q, public=pub)
    fresh.erase_rows("private", np.array([3, 100, 260, 390]))
    indexes.build(fresh, kind=kind, **opts)
    reb, reb_meta = _arrays(fresh)
    assert inc.keys() == reb.keys()
    for k in inc:
        assert np.array_equal(inc[k], reb[k]), k
    assert inc_meta["n_rows"] == reb_meta["n_rows"] == 400
    assert inc["erased"][[3, 100, 260, 390]].all() and inc["erased"].sum() == 4
    values = inc["codes"] if kind == "lsh" else inc["lists"]
    assert (values[[3, 100, 260, 390]] == (0 if kind == "lsh" else -1)).all()  # codes of erased rows overwritten


def test_finder_reconciles_deletions_and_never_returns_erased_rows(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, public=pub)
    indexes.build(store, kind="lsh", tables=48, bits=1, seed=1)
    store = FeatureStore.open(store.path, mode="a")
    gone = np.array([7, 8, 9])
    queries = x[gone]  # each deleted vector was its own candidate (κ = 1, same buckets everywhere)
    before = indexes.open_finder(store, kernel="cosine", tau=0.3, nu=None)(queries)
    assert all(g in r for g, r in zip(gone, before.rows))
    store.erase_rows("private", gone)  # without the hook
    finder = indexes.open_finder(store, kernel="cosine", tau=0.3, nu=None)
    got = finder(queries)
    for r0, r1 in zip(before.rows, got.rows):
        assert r1.tolist() == np.setdiff1d(r0, gone).tolist()
    assert _arrays(store)[0]["erased"][gone].all()
    mask = np.ones(len(x), bool); mask[:50] = False  # the engine's row mask (rows not in the ledger)
    assert all(r.min() >= 50 for r in finder(queries, row_mask=mask).rows if r.size)


def test_renumber_after_compaction_equals_rebuild(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, public=pub)
    indexes.build(store, kind="ivf", nlist=8, seed=4)
    keep = np.setdiff1d(np.arange(len(x)), [0, 5, 399])
    new_row_of = np.full(len(x), -1); new_row_of[keep] = np.arange(keep.size)
    compacted = make_store(tmp_path / "c.zarr", x[keep], y[keep], public=pub)
    shutil.copytree(store.path / "index", compacted.path / "index")  # carried by the compaction
    with pytest.raises(StoreError, match="other row numbers"):
        indexes.open_finder(compacted, kernel="cosine", tau=0.3, nu=None)
    assert indexes.renumber_rows(compacted, new_row_of) == keep.size
    fresh = make_store(tmp_path / "f.zarr", x[keep], y[keep], public=pub)
    indexes.build(fresh, kind="ivf", nlist=8, seed=4)
    a, b = _arrays(compacted), _arrays(fresh)
    assert all(np.array_equal(a[0][k], b[0][k]) for k in b[0]) and a[1]["n_rows"] == keep.size
    assert indexes.open_finder(compacted, kernel="cosine", tau=0.3, nu=None) is not None


def test_rerunning_index_keeps_the_index_and_flat_removes_it(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, public=pub)
    p = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5)
    first = build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind="ivf", nlist=8)
    again = build_index(store_path=store.path, ledger_path=tmp_path / "L", params=None)  # no --kind
    assert again.kind == "ivf" and again.extra["index"]["centroids_sha256"] == first.extra["index"]["centroids_sha256"]
    assert again.extra["index"]["rows_encoded"] == 0
    moved = build_index(store_path=store.path, ledger_path=tmp_path / "L", params=None, nprobe=8)
    assert moved.extra["index"]["nprobe"] == 8  # nprobe changes without retraining
    assert moved.extra["index"]["centroids_sha256"] == first.extra["index"]["centroids_sha256"]
    flat = build_index(store_path=store.path, ledger_path=tmp_path / "L", params=None, kind="flat")
    assert flat.kind == "flat" and not (store.path / "index").exists()
    assert indexes.load_candidate_finder(store, BudgetLedger.open(tmp_path / "L")) is None


# -- CLI ------------------------------------------------------------------------------------------
def _cli_index(store, tmp_path, *extra):
    return runner.invoke(app, ["index", "--store", str(store.path), "--ledger", str(tmp_path / "L"), "--eps", "1",
                               "--tau", "0.3", "--sigma2", "0.5", *extra])


def test_cli_kinds_and_refusals(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, queries=q)
    res = _cli_index(store, tmp_path, "--kind", "hnsw")
    assert res.exit_code == 2 and res.stdout == ""
    assert "refused" in res.stderr and "private records" in res.stderr
    res = _cli_index(store, tmp_path, "--kind", "ivf", "--train-on", "private")
    assert res.exit_code == 2 and "refused" in res.stderr and not (tmp_path / "L").exists()
    res = _cli_index(store, tmp_path, "--kind", "lsh", "--index-seed", "7")
    assert res.exit_code == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["kind"] == "lsh" and info["index"]["tables"] == 30 and info["index"]["bits"] == 9
    assert info["index"]["seed"] == 7 and info["index"]["n_rows"] == len(x)
    res = _cli_index(store, tmp_path, "--kind", "ivf", "--nlist", "4", "--nprobe", "2")  # trains on the queries
    assert res.exit_code == 0, res.stderr
    info = json.loads(res.stdout)["index"]
    assert info["centroid_source"]["from"] == "store:query" and info["nprobe"] == 2
    res = runner.invoke(app, ["serve-queries", "q1", "--store", str(store.path), "--ledger", str(tmp_path / "L"),
                              "--seed", "1"])
    assert res.exit_code == 0, res.stderr and len(res.stdout.splitlines()) == len(q)


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["lsh", "ivf"])
def test_delete_and_compact_keep_the_index_equal_to_a_rebuild(tmp_path, data, kind):
    deletion = pytest.importorskip("indknn_cli.deletion")
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, queries=q, public=pub)
    p = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=50)
    opts = dict(tables=5, bits=6, index_seed=8) if kind == "lsh" else dict(nlist=8, nprobe=3, index_seed=8)
    build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind=kind, **opts)
    deletion.delete_records(store_path=store.path, ledger_path=tmp_path / "L", record_ids=["r00003", "r00100"])
    inc, _ = _arrays(FeatureStore.open(store.path))
    assert inc["erased"][[3, 100]].all() and inc["erased"].sum() == 2  # the delete hook overwrote them
    deletion.delete_records(store_path=store.path, ledger_path=tmp_path / "L", compact=True)
    compacted = FeatureStore.open(store.path)
    keep = np.setdiff1d(np.arange(len(x)), [3, 100])
    fresh = make_store(tmp_path / "fresh.zarr", x[keep], y[keep], queries=q, public=pub)
    build_index(store_path=fresh.path, ledger_path=tmp_path / "L2", params=p, kind=kind, **opts)
    a, b = _arrays(compacted), _arrays(fresh)
    assert a[1]["n_rows"] == b[1]["n_rows"] == keep.size and a[1]["store_uuid"] == compacted.uuid
    for k in b[0]:
        assert np.array_equal(a[0][k], b[0][k]), k
    res = serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="q1", seed=2)
    assert res.newly_answered == len(q)


# -- issue 15 §5: near-copies of private rows in --train-on, and no membership oracle in the refusal ------------
def test_ivf_train_on_refuses_near_copies_without_saying_how_many(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y)
    p = make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5)
    rng = np.random.default_rng(0)
    f = tmp_path / "train.npy"
    messages = []
    for n_private in (1, 27, 300):  # one record, 9 % of the file, a whole (perturbed) copy
        mix = pub.copy()
        rows = rng.choice(len(x), n_private, replace=False)
        where = rng.choice(len(pub), n_private, replace=False)
        mix[where] = x[rows] + 1e-7 * rng.standard_normal((n_private, x.shape[1])).astype(np.float32)
        assert not np.isin(mix.view(np.uint32), x.view(np.uint32)).all(axis=1).any()  # no bit-identical row
        np.save(f, mix)
        with pytest.raises(PrivacyRefusedError, match="nearly identical") as err:
            build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind="ivf", nlist=4, train_on=f)
        messages.append(str(err.value))
        _nothing_written(store, tmp_path)
    assert len(set(messages)) == 1  # the message is the same whatever the number of private rows
    assert str(len(pub)) not in messages[0] and "of its" not in messages[0]
    np.save(f, pub)  # the public vectors alone are fine
    out = build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p, kind="ivf", nlist=4,
                      train_on=f).as_dict()["index"]
    assert out["centroid_source"]["from"] == "file"


def test_cli_ivf_train_on_refusal_says_public_only(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y)
    mix = pub.copy()
    mix[:3] = x[:3] * (1 + 1e-7)
    np.save(tmp_path / "mix.npy", mix)
    res = _cli_index(store, tmp_path, "--kind", "ivf", "--train-on", str(tmp_path / "mix.npy"))
    assert res.exit_code == 2 and res.stdout == "" and not (tmp_path / "L").exists()
    assert "nearly identical" in res.stderr and "public data" in res.stderr
    assert " 3 " not in res.stderr and "300" not in res.stderr


def test_index_json_states_unit_and_adjacency_and_errors_keep_brackets(tmp_path, data):
    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y)  # no public rows: the IVF refusal names an "[n, d] array"
    res = _cli_index(store, tmp_path, "--kind", "ivf")
    assert res.exit_code == 2 and "[n, d]" in res.stderr, res.stderr  # rich markup must not swallow it
    res = _cli_index(store, tmp_path)
    assert res.exit_code == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["unit"] == "record" and info["adjacency"] == "add/remove one record"


@pytest.mark.heavy
@pytest.mark.parametrize("kind,strategy", [("lsh", "buckets"), ("lsh", "scan"), ("ivf", None)])
def test_a_crowded_bucket_or_list_never_forms_more_pairs_than_the_bound(tmp_path, kind, strategy):
    """Audit 2, P3 for the LSH/IVF finders: a bucket or list's screen formed all its pairs (and its score
    matrix, and an LSH bucket's gathered rows) before the pair bound was checked, so peak memory (whether the
    process is killed: exit code, number of answers) grew with the private records near the queries. Now the
    screen goes a bounded step at a time and the bound stops the call within one step."""
    import tracemalloc

    from indknn_cli.engine import TooManyPairs

    x, y, _ = clustered(20000, 16, 3, seed=21)
    q, _, _ = clustered(50, 16, 3, seed=22)
    store = make_store(tmp_path / "s.zarr", x, y, queries=q)
    opts = dict(tables=1, bits=1, seed=3) if kind == "lsh" else dict(nlist=1, nprobe=1, seed=3)
    indexes.build(store, kind=kind, **opts)  # one or two buckets / one list: every record crowded together
    kw = {} if strategy is None else {"strategy": strategy}
    finder = indexes.open_finder(store, kernel="cosine", tau=-0.99, nu=None, **kw)  # every row passes the screen
    finder(q[:2], max_pairs=10**9)  # warm up (thread pool, BLAS) outside the measurement
    tracemalloc.start()
    try:
        with pytest.raises(TooManyPairs):
            finder(q, max_pairs=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 50 queries × 20,000 rows would be 1M pairs (16 MB of indices, a 4 MB score matrix); a step is ≤ 1,000
    assert peak < 2 << 20, peak
    # below the bound the same call answers, and splitting the batch changes no candidate
    whole = finder(q, max_pairs=10**9)
    halves = [finder(q[:25], max_pairs=10**9), finder(q[25:], max_pairs=10**9)]
    assert [r.tolist() for r in whole.rows] == [r.tolist() for h in halves for r in h.rows]
    assert [k.tolist() for k in whole.kappa] == [k.tolist() for h in halves for k in h.kappa]


@pytest.mark.parametrize("who", ["delete", "index again", "index flat"])
def test_a_killed_builds_copy_of_the_codes_is_removed_by_the_next_erasure_or_index(tmp_path, data, who):
    """Review 38, F2: `index --kind lsh` killed with -9 left `<store>/.index-build-<hex>/` (hyperplanes and the codes
    of the private rows); a later `delete` zeroed the row's codes only in the live index, and nothing removed the
    copy. Every index writer (delete's erasure, `index` again, in any kind) now removes such leftovers under the
    index lock, which no live writer holds while they are there."""
    from indknn_cli.deletion import delete_records

    x, y, q, pub = data
    store = make_store(tmp_path / "s.zarr", x, y, public=pub)
    lp = tmp_path / "L"
    build_index(store_path=store.path, ledger_path=lp, params=make_params(epsilon=1, delta=1e-5, tau=0.3,
                                                                           sigma2=0.5, planned_queries=50),
                kind="lsh", tables=8, bits=6, index_seed=1)
    for name in (".index-build-0123abcd", ".index-renumber-89abcdef", ".index-old-deadbeef"):
        shutil.copytree(store.path / "index", store.path / name)  # what a killed writer leaves
    assert len(indexes.storage.stale_copies(store.path)) == 3
    if who == "delete":
        delete_records(store_path=store.path, ledger_path=lp, record_ids=[str(store.record_ids()[5])])
    else:
        build_index(store_path=store.path, ledger_path=lp, params=None,
                    kind="lsh" if who == "index again" else "flat")
    assert indexes.storage.stale_copies(store.path) == []
    assert not [p for p in store.path.iterdir() if p.name.startswith(".index-")]
