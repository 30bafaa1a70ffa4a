"""The user privacy unit (SPEC §9): exact against a plain reference, identical to the record unit with one
record per user, never past B under adversarial streams, end to end through index/serve/delete."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.engine import ArraySource, BudgetView, answer_batch
from indknn_cli.ledger import BudgetLedger, LedgerState, PrivacyParams
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows
from indknn_cli.user_unit import UserBudgetView

from .conftest import clustered
from .reference import kappa
from .reference_user import reference_user_answers

runner = CliRunner()


def params(kernel="cosine", tau=0.3, budget=0.05, sigma1=8.0, sigma2=0.5, nu=None, k_min=3.0, k=None):
    return PrivacyParams(epsilon=1.0, delta=1e-5, conversion="gdp", budget=budget, kernel=kernel, tau=tau,
                         sigma1=sigma1, sigma2=sigma2, nu=nu, k_min=k_min, planned_queries=None,
                         privacy_unit="user", max_records_per_user=k).validate()


def _state(users, spent=None):
    n = len(users)
    return LedgerState(np.array([f"r{i}" for i in range(n)], object), np.array(users, object),
                       np.arange(n), np.zeros(n), np.zeros(n) if spent is None else np.asarray(spent, float),
                       np.zeros(n, np.int64), np.zeros(n, bool), np.full(n, np.nan), np.zeros(n))


def run_user_engine(X, y, users, Q, p, *, batch_size, reuse, run_key=4321, n_classes=3):
    view = UserBudgetView.from_ledger_state(_state(users), budget=p.budget, user_for_missing="refuse",
                                            max_records_per_user=p.max_records_per_user)
    from indknn_cli.engine import ReusePool

    pool = ReusePool.empty(X.shape[1]) if reuse else None
    labels, counts = [], []
    for lo in range(0, len(Q), batch_size):
        view.reset_part()
        ans = answer_batch(Q[lo:lo + batch_size], source=ArraySource(X, rows=29), row_to_ledger=np.arange(len(X)),
                           row_labels=y, params=p, n_classes=n_classes, budgets=view, run_key=run_key,
                           first_index=lo, reuse=pool, device="cpu")
        labels += [a.label for a in ans]
        counts += [a.released_count for a in ans]
    return labels, counts, view


@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.3, None), ("rbf", 0.5, 1.0)])
@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("k", [None, 2])
def test_user_engine_equals_plain_reference(kernel, tau, nu, reuse, k):
    X, y, _ = clustered(90, 8, 3, seed=15)
    Q, _, _ = clustered(50, 8, 3, seed=16)
    rng = np.random.default_rng(0)
    users = [f"u{int(v)}" for v in rng.integers(0, 25, 90)]  # 1–10 records per user
    Q[5] = X[3]; Q[6] = X[3]
    p = params(kernel=kernel, tau=tau, nu=nu, budget=0.03, k=k)
    spent_ref: dict = {}
    ref_labels, ref_counts = reference_user_answers(
        X, y, users, Q, params=p, n_classes=3, spent_u=spent_ref, budget=p.budget, deleted=[False] * 90,
        run_key=4321, k=k, reuse_pool=[] if reuse else None)
    assert max(spent_ref.values()) > 0
    for bs in (1, 7, 256):
        labels, counts, view = run_user_engine(X, y, users, Q, p, batch_size=bs, reuse=reuse)
        assert labels == ref_labels and counts == ref_counts
        order = {u: i for i, u in enumerate(dict.fromkeys(users))}
        assert {u: view.spent[order[u]] for u in spent_ref} == spent_ref  # bit for bit
        assert (view.spent <= p.budget).all()


@pytest.mark.parametrize("reuse", [False, True])
def test_one_record_per_user_is_exactly_the_record_unit(reuse):
    X, y, _ = clustered(120, 8, 3, seed=5)
    Q, _, _ = clustered(70, 8, 3, seed=6)
    pu = params(budget=0.02)
    pr = PrivacyParams(**{**pu.as_dict(), "privacy_unit": "record"})
    from indknn_cli.engine import ReusePool

    rec = BudgetView(spent=np.zeros(120), budget=np.full(120, pr.budget), deleted=np.zeros(120, bool),
                     times_selected=np.zeros(120, np.int64))
    poolr = ReusePool.empty(8) if reuse else None
    a_rec = answer_batch(Q, source=ArraySource(X), row_to_ledger=np.arange(120), row_labels=y, params=pr,
                         n_classes=3, budgets=rec, run_key=7, first_index=0, reuse=poolr, device="cpu")
    labels, counts, view = run_user_engine(X, y, [f"u{i}" for i in range(120)], Q, pu, batch_size=13, reuse=reuse,
                                           run_key=7)
    assert [a.label for a in a_rec] == labels and [a.released_count for a in a_rec] == counts
    assert rec.spent.tolist() == view.spent.tolist()
    assert rec.spent.max() > 0


@settings(max_examples=25, deadline=None)
@given(n_user_records=st.integers(2, 30), n_others=st.integers(1, 20), n_queries=st.integers(1, 60),
       jitter=st.floats(0.0, 0.05), k=st.one_of(st.none(), st.integers(1, 5)), seed=st.integers(0, 2**20),
       budget=st.floats(0.005, 0.2))
def test_adversarial_stream_at_one_user_never_passes_b(n_user_records, n_others, n_queries, jitter, k, seed, budget):
    """Queries aimed at one user with many near-identical records: that user (and everybody) stays ≤ B."""
    rng = np.random.default_rng(seed)
    target = normalize_rows(rng.standard_normal((1, 8)))
    X = normalize_rows(np.repeat(target, n_user_records, axis=0) + jitter * rng.standard_normal((n_user_records, 8)))
    X = np.concatenate([X, normalize_rows(rng.standard_normal((n_others, 8)))]).astype(np.float32)
    y = rng.integers(0, 3, len(X)).astype(np.int64)
    users = ["victim"] * n_user_records + [f"o{i % 4}" for i in range(n_others)]
    Q = normalize_rows(np.repeat(target, n_queries, axis=0) + 0.01 * rng.standard_normal((n_queries, 8)))
    sigma1 = max(float(rng.uniform(2, 20)), 1.01 * math.sqrt(1 / (2 * budget)))
    p = params(budget=budget, sigma1=sigma1, sigma2=float(rng.uniform(0.1, 2)), k=k, k_min=1.0)
    _, _, view = run_user_engine(X.astype(np.float32), y, users, Q.astype(np.float32), p, batch_size=7, reuse=False)
    assert (view.spent <= p.budget).all() and (view.spent >= 0).all()
    assert view.times_selected[:n_user_records].sum() <= n_queries * (k or n_user_records)


def _user_store(tmp_path, users, *, seed=3, n_queries=30):
    x, y, _ = clustered(len(users), 16, 3, seed=seed)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=32)
    store.append("private", x, labels=y, record_ids=[f"r{i:03d}" for i in range(len(users))], user_ids=users)
    q, _, _ = clustered(n_queries, 16, 3, seed=seed + 1)
    store.append("query", q, record_ids=[f"q{i}" for i in range(n_queries)], batch="q1")
    return store, x, y, q


def test_end_to_end_user_unit_and_an_auditor_recomputes_every_charge(tmp_path):
    """index --privacy-unit user → serve → every record of a user carries the user's spent, and an auditor
    who recomputes the charges from the raw vectors and the *released* K_t finds the ledger's figures."""
    users = [f"u{i % 7}" for i in range(60)]
    store, x, y, q = _user_store(tmp_path, users)
    res = runner.invoke(app, ["index", "--store", str(store.path), "--ledger", str(tmp_path / "L"), "--eps", "1",
                              "--tau", "0.3", "--sigma2", "0.5", "--planned-queries", "30", "--k-min", "5",
                              "--privacy-unit", "user", "--max-records-per-user", "4"])
    assert res.exit_code == 0, res.stderr
    import json
    info = json.loads(res.stdout)
    assert info["unit"] == "user" and info["adjacency"] == "add/remove one user"
    out = serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="q1", seed=5, reuse=False)
    led = BudgetLedger.open(tmp_path / "L")
    p = led.params
    s = led.state
    for u in set(users):
        vals = s.spent[s.user_id == u]
        assert (vals == vals[0]).all()  # one budget per user
    assert s.spent.max() > 0 and (s.spent <= p.budget).all()
    # the auditor: raw vectors + released K_t → charges
    spent = {u: 0.0 for u in set(users)}
    for t, a in enumerate(out.answers):
        K = a["released_count"]
        groups: dict = {}
        for i in range(len(x)):
            kap = kappa(x[i], q[t], "cosine", None)
            if kap >= p.tau:
                groups.setdefault(users[i], []).append(kap)
        for u, kaps in groups.items():
            kaps = sorted(kaps, reverse=True)[:4]
            m = len(kaps)
            cnt = p.c1 if m == 1 else math.nextafter(m * m * p.c1, math.inf)
            after = math.nextafter(spent[u] + cnt, math.inf)
            if after > p.budget:
                continue
            vec = np.zeros(3)
            cand = sorted([(kappa(x[i], q[t], "cosine", None), i) for i in range(len(x)) if users[i] == u
                           and kappa(x[i], q[t], "cosine", None) >= p.tau], key=lambda r: (-r[0], r[1]))[:4]
            for kap, i in cand:
                vec[y[i]] += kap
            norm = cand[0][0] if m == 1 else math.sqrt(float((vec * vec).sum()))
            r = max(math.nextafter(p.budget - after, -math.inf), 0.0)
            c = min(norm, p.sigma2 * math.sqrt(2 * K * r) * (1 - 1e-9))
            cost = math.nextafter(c * c / (2 * p.sigma2 ** 2 * K) * (1 + 1e-12), math.inf)
            new = math.nextafter(after + cost, math.inf)
            spent[u] = after if new > p.budget else new
    for u in set(users):
        assert s.spent[s.user_id == u][0] == spent[u], u


def test_missing_user_ids_refused_with_count_or_each_its_own_user(tmp_path):
    users = ["u1", "", "u1", "", "", "u2"] + ["u3"] * 10
    store, *_ = _user_store(tmp_path, users)
    base = ["index", "--store", str(store.path), "--eps", "1", "--tau", "0.3", "--privacy-unit", "user"]
    res = runner.invoke(app, base + ["--ledger", str(tmp_path / "L")])
    assert res.exit_code == 2 and "3 private rows have no user id" in res.stderr
    assert not (tmp_path / "L" / "CURRENT").exists()
    res = runner.invoke(app, base + ["--ledger", str(tmp_path / "L"), "--user-for-missing", "record"])
    assert res.exit_code == 0, res.stderr
    serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="q1", seed=1)
    led = BudgetLedger.open(tmp_path / "L")
    assert len(led.state) == 16 and (led.state.spent <= led.params.budget).all()
    other = tmp_path / "other"
    other.mkdir()
    store2, *_ = _user_store(other, users)  # one store, one ledger: the record-unit check needs its own store
    rec = runner.invoke(app, ["index", "--store", str(store2.path), "--ledger", str(other / "R"), "--eps", "1",
                              "--tau", "0.3"])
    assert rec.exit_code == 0 and "--privacy-unit user" in rec.stderr  # warned: user ids, record unit


def test_a_later_row_without_a_user_id_is_never_a_candidate_and_does_not_block_index(tmp_path):
    """Review 44, L2: under --user-for-missing refuse, one row without a user id embedded after creation made
    every later `index` refuse (exit 2), so no other new record could join; docs/USER_UNIT.md said such rows
    stay out of selection. Now index warns with their count and adds the others; the row is never a candidate."""
    users = [f"u{i % 3}" for i in range(30)]
    store, x, y, q = _user_store(tmp_path, users)
    res = runner.invoke(app, ["index", "--store", str(store.path), "--ledger", str(tmp_path / "L"), "--eps", "1",
                              "--tau", "0.3", "--sigma2", "0.5", "--planned-queries", "30", "--k-min", "5",
                              "--privacy-unit", "user"])
    assert res.exit_code == 0, res.stderr
    store = FeatureStore.open(store.path, mode="a")
    store.append("private", q[:2], labels=y[:2], record_ids=["nobody", "late"], user_ids=["", "u1"])
    res = runner.invoke(app, ["index", "--store", str(store.path), "--ledger", str(tmp_path / "L")])
    assert res.exit_code == 0, res.stderr
    assert "1 private row of the store has no user id" in " ".join(res.stderr.split())
    led = BudgetLedger.open(tmp_path / "L")
    assert "late" in list(led.state.record_id) and "nobody" not in list(led.state.record_id)
    # the query batch holds the no-user row's own vector (κ = 1 ≥ τ): it would be selected if it could be
    serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="q1", seed=4, reuse=False)
    s = BudgetLedger.open(tmp_path / "L").state
    ids = list(s.record_id)
    assert "nobody" not in ids and s.spent[ids.index("late")] > 0.0  # it stayed out of the ledger: never selected


def test_a_new_record_of_a_known_user_joins_that_users_budget(tmp_path):
    users = [f"u{i % 3}" for i in range(30)]
    store, x, y, q = _user_store(tmp_path, users)
    p = make_params(epsilon=1, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=30, k_min=5, privacy_unit="user")
    build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p)
    serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="q1", seed=2)
    before = BudgetLedger.open(tmp_path / "L").state
    spent_u0 = before.spent[before.user_id == "u0"][0]
    assert spent_u0 > 0
    store = FeatureStore.open(store.path, mode="a")
    store.append("private", x[:1], labels=y[:1], record_ids=["late"], user_ids=["u0"])
    build_index(store_path=store.path, ledger_path=tmp_path / "L", params=None)
    led = BudgetLedger.open(tmp_path / "L")
    assert led.state.spent[list(led.state.record_id).index("late")] == spent_u0  # never a fresh budget
    from indknn_cli.deletion import delete_records
    delete_records(store_path=store.path, ledger_path=tmp_path / "L", user_ids=["u0"])
    led = BudgetLedger.open(tmp_path / "L")
    assert led.state.deleted[led.state.user_id == "u0"].all()
    assert (led.state.spent[led.state.user_id == "u0"] == spent_u0).all()  # tombstones keep it


def test_account_names_the_user_unit_and_shows_the_users_own_figures(tmp_path):
    import json

    users = [f"u{i % 4}" for i in range(40)]
    store, *_ = _user_store(tmp_path, users)
    p = make_params(epsilon=1, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=30, k_min=5, privacy_unit="user")
    build_index(store_path=store.path, ledger_path=tmp_path / "L", params=p)
    serve_queries(store_path=store.path, ledger_path=tmp_path / "L", query_batch="q1", seed=3)
    head = json.loads(runner.invoke(app, ["account", "--ledger", str(tmp_path / "L"), "--json"]).stdout)
    assert head["unit"] == "user" and head["adjacency"] == "add/remove one user" and "per user" in head["scope"]
    res = runner.invoke(app, ["account", "--ledger", str(tmp_path / "L"), "--user", "u1", "--json"])
    d = json.loads(res.stdout)
    led = BudgetLedger.open(tmp_path / "L")
    assert d["spent"] == led.state.spent[led.state.user_id == "u1"].max() > 0
    assert d["realised_epsilon_by_conversion"]["gdp"] <= 1.0 and d["user_level"].startswith("per user")
    text = runner.invoke(app, ["account", "--ledger", str(tmp_path / "L"), "--user", "u1"]).stdout
    flat = " ".join(text.split())
    assert "adjacency: add/remove one user" in flat and "realised individual loss" in flat
    # review 42, L6: the user's figure (the privacy unit's) comes first and says per user; the rows are not units
    assert "per record:" not in flat and flat.index("(the privacy unit)") < flat.index("record id")
    assert "per user, add/remove one user" in flat
    # review 37 notes: the distribution's JSON names its unit and that it is over records; a record's view says a
    # user selected through m records pays m² times the count charge
    re_q = head["realised_epsilon"]
    assert re_q["unit"] == "user" and re_q["adjacency"] == "add/remove one user" and re_q["over"] == "records"
    rid = str(led.state.record_id[0])
    flat = " ".join(runner.invoke(app, ["account", "--ledger", str(tmp_path / "L"), "--record", rid]).stdout.split())
    assert "m²× this" in flat, flat
    # review 53, F3: the record's realised ε is its user's, and says so (unit and adjacency), in text and JSON
    wide = runner.invoke(app, ["account", "--ledger", str(tmp_path / "L"), "--record", rid], env={"INDKNN_WIDTH": "300"})
    assert "realised ε (gdp, the user's; per user, add/remove one user)" in wide.stdout, wide.stdout
    rec = json.loads(runner.invoke(app, ["account", "--ledger", str(tmp_path / "L"), "--record", rid,
                                         "--json"]).stdout)
    assert rec["realised_epsilon_unit"] == "per user, add/remove one user"


def test_tune_never_silently_downgrades_a_user_unit_request(tmp_path):
    users = [f"u{i % 4}" for i in range(40)]
    store, *_ = _user_store(tmp_path, users)
    res = runner.invoke(app, ["index", "--store", str(store.path), "--ledger", str(tmp_path / "L"), "--eps", "1",
                              "--privacy-unit", "user", "--tune", "private"])
    assert res.exit_code == 2 and "--privacy-unit user" in res.stderr
    assert not (tmp_path / "L" / "CURRENT").exists()


def test_a_ledger_written_before_the_user_unit_reads_as_a_record_unit_ledger():
    """Issue 17: a ledger's params written before the user unit carry no privacy_unit, max_records_per_user nor
    user_for_missing: they read as the record unit, and written back they say so explicitly."""
    from indknn_cli.ledger_state import PrivacyParams
    from indknn_cli.serving import make_params

    old = make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100).as_dict()
    for key in ("privacy_unit", "max_records_per_user", "user_for_missing"):
        old.pop(key, None)
    p = PrivacyParams(**old)
    assert p.privacy_unit == "record" and p.max_records_per_user is None
    assert p.as_dict()["privacy_unit"] == "record"
    assert p == make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100)
