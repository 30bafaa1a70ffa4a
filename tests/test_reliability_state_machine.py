"""Adversarial privacy: a hypothesis state machine over embed / index / serve-queries / delete / re-add.

Every step goes through the library entry points the CLI calls (``embed_into_store``
and ``embed_query_file`` with the ``vectors`` extractor, ``build_index``,
``serve_queries``, ``delete_records``) on real Zarr stores and Parquet ledgers.
Query streams are random or targeted: a private vector repeated, queries whose
kernel value sits on the threshold τ (within 1e-7), queries at erased records'
old vectors, RBF kernels with a tiny bandwidth ν (only near-duplicates count).

After every step (SPEC §2, §8):

* every record's spent is in [0, B] and the calibrated guarantee ε(B) ≤ target ε;
* spent never decreases for any record id — not by delete, re-add or compaction;
* tombstones are kept (id, spent, times selected frozen, never a candidate) and
  their data is gone from the store;
* the realised loss of every record, ε_i = conversion(spent_i), is ≤ the guarantee
  ε(B) in both conversions (descriptive figure, never above the guarantee);
* after a serve: only records with κ(x, q) ≥ τ for some query of the batch were
  charged; each at least c1 per selection; an active record with a candidate query
  was selected; one still active afterwards was selected at every candidate query
  (selection depends only on the record, the query and its own spent, SPEC §2 step 1).

The fast setting runs in CI; ``test_state_machine_million_queries`` (slow) keeps
running the machine with large batches of cheap d=6 queries until at least 10⁶
queries were served, and prints the count.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from indknn_cli.accounting import epsilon_for_budget
from indknn_cli.deletion import delete_records
from indknn_cli.embedding import embed_into_store, embed_query_file
from indknn_cli.errors import BudgetExhaustedError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.report import build_account_report
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import FeatureStore, normalize_rows

D = 6
LABELS = ["a", "b", "c"]
POOL = 48             # candidate private records r00..r47 (users u0..u5)
KAPPA_TOL = 1e-12     # summation-order slack of a float64 kernel value
KINDS = st.sampled_from(["random", "repeat", "boundary", "erased", "mixed"])

#: Queries served by every machine run in this process (reported by the slow test).
COUNTER = {"queries": 0, "serves": 0, "runs": 0, "exhausted": 0, "deletes": 0, "readds": 0, "compactions": 0}


def _pool(seed: int):
    rng = np.random.default_rng(seed)
    centres = normalize_rows(rng.standard_normal((3, D)))
    y = rng.integers(0, 3, POOL)
    x = centres[y] + 0.3 * rng.standard_normal((POOL, D)) / math.sqrt(D)
    return normalize_rows(x).astype(np.float64), y


def _candidate_counts(x: np.ndarray, q: np.ndarray, p) -> tuple[np.ndarray, np.ndarray]:
    """Per record: how many queries have κ ≥ τ (+/− KAPPA_TOL), κ in float64 from the stored float32 vectors."""
    x64 = x.astype(np.float64)
    strict = np.zeros(len(x), np.int64)
    loose = np.zeros(len(x), np.int64)
    for lo in range(0, len(q), 4096):
        q64 = q[lo:lo + 4096].astype(np.float64)
        if p.kernel == "cosine":
            kap = (x64[:, None, :] * q64[None, :, :]).sum(-1)
        else:
            diff = x64[:, None, :] - q64[None, :, :]
            kap = np.exp(-(diff * diff).sum(-1) / (p.nu * p.nu))
        strict += (kap >= p.tau + KAPPA_TOL).sum(1)
        loose += (kap >= p.tau - KAPPA_TOL).sum(1)
    return strict, loose


class IndKnnMachine(RuleBasedStateMachine):
    """One store + ledger per run; the model tracks what every record id may and may not do."""

    big_queries = False  # the slow test switches on batches of thousands of queries

    def __init__(self):
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="indknn-sm-"))
        self.store_path = self.tmp / "s.zarr"
        self.ledger_path = self.tmp / "L"
        self.step = 0
        self.max_spent: dict[str, float] = {}     # largest spent ever seen per id
        self.tomb: dict[str, tuple[float, int]] = {}  # deleted id -> (spent, times selected) at deletion
        self.old_vec: dict[str, np.ndarray] = {}  # deleted id -> its former vector (attack queries)
        self.in_store: set[str] = set()            # live ids in the store (maybe not yet in the ledger)
        self.ever: set[str] = set()
        self.readd_pending: set[str] = set()     # re-added ids the ledger has not synced yet (still tombstones)

    def teardown(self):
        try:
            if self.ledger_path.exists():
                rep = build_account_report(ledger_path=self.ledger_path, store_path=self.store_path).data
                led = self._ledger()
                assert rep["records"] == len(led.state) and set(led.state.record_id) <= self.ever
                tombs = set(self.tomb) | (self.readd_pending & set(led.state.record_id))
                assert rep["records_deleted"] == len(tombs & set(led.state.record_id))
                assert rep["realised_epsilon"]["max"] is None or rep["realised_epsilon"]["max"] <= rep["epsilon"]
                assert rep["epsilon_by_conversion"][self.params.conversion] <= self.params.epsilon
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
            COUNTER["runs"] += 1

    # -- helpers -----------------------------------------------------------------
    def _embed_private(self, idx: list[int], scale: np.ndarray) -> None:
        x = self.pool[idx] * scale[:, None]  # unnormalised on purpose: embed normalises per vector
        y = np.array(LABELS)[self.labels_of[idx]]
        f = self.tmp / f"add-{self.step}.npz"
        np.savez(f, x=x, y=y, ids=np.array([f"r{i:02d}" for i in idx]), users=np.array([f"u{i % 6}" for i in idx]))
        embed_into_store(f, store_path=self.store_path, role="private", extractor="vectors", label_names=LABELS)
        self.in_store |= {f"r{i:02d}" for i in idx}
        self.ever |= {f"r{i:02d}" for i in idx}

    def _sync(self) -> None:
        build_index(store_path=self.store_path, ledger_path=self.ledger_path, params=None)
        self.readd_pending.clear()

    def _ledger(self) -> BudgetLedger:
        return BudgetLedger.open(self.ledger_path, store_uuid=FeatureStore.open(self.store_path).uuid)

    def _live_vectors(self):
        st_ = FeatureStore.open(self.store_path)
        ids = st_.record_ids()
        live = ~st_.read("private", "deleted").astype(bool)
        return st_.read("private", "features")[live], ids[live]

    # -- set-up ------------------------------------------------------------------
    @initialize(kernel=st.sampled_from(["cosine", "cosine", "rbf", "rbf-tiny"]), data=st.data())
    def setup(self, kernel, data):
        seed = data.draw(st.integers(0, 2**16), label="pool seed")
        self.pool, self.labels_of = _pool(seed)
        self.rng = np.random.default_rng(seed + 1)
        eps = data.draw(st.sampled_from([0.3, 1.0, 4.0]), label="epsilon")
        conversion = data.draw(st.sampled_from(["gdp", "rdp"]), label="conversion")
        sigma2 = data.draw(st.sampled_from([0.05, 0.5, 2.0]), label="sigma2")
        planned = data.draw(st.sampled_from([4, 20, 1000]), label="planned queries")
        k_min = data.draw(st.sampled_from([1.0, 5.0, 30.0]), label="k_min")
        if kernel == "cosine":
            tau, nu = data.draw(st.sampled_from([0.3, 0.7, 0.97]), label="tau"), None
        else:
            nu = 0.05 if kernel == "rbf-tiny" else data.draw(st.sampled_from([0.5, math.exp(1.5)]), label="nu")
            tau = data.draw(st.sampled_from([0.2, 0.6, 0.95]), label="tau")
        self.params = make_params(epsilon=eps, delta=1e-5, conversion=conversion, kernel=kernel.split("-")[0],
                                  tau=tau, sigma2=sigma2, planned_queries=planned, nu=nu, k_min=k_min)
        n0 = data.draw(st.integers(3, 16), label="initial records")
        self._embed_private(list(range(n0)), self.rng.uniform(0.2, 5.0, n0))
        build_index(store_path=self.store_path, ledger_path=self.ledger_path, params=self.params)
        assert epsilon_for_budget(budget=self.params.budget, delta=self.params.delta,
                                  conversion=self.params.conversion) <= eps

    # -- rules -------------------------------------------------------------------
    @rule(k=st.integers(1, 6), sync=st.booleans())
    def add(self, k, sync):
        fresh = [i for i in range(POOL) if f"r{i:02d}" not in self.ever][:k]
        if not fresh:
            return
        self.step += 1
        self._embed_private(fresh, self.rng.uniform(0.2, 5.0, len(fresh)))
        if sync:  # else the next serve brings them in (serving.sync_ledger)
            self._sync()

    @precondition(lambda self: bool(self.tomb))
    @rule(data=st.data(), sync=st.booleans())
    def readd(self, data, sync):
        """An erased id comes back (same or another vector/label): it keeps the spent it had."""
        rid = data.draw(st.sampled_from(sorted(self.tomb)), label="re-added id")
        i = int(rid[1:])
        self.step += 1
        if data.draw(st.booleans(), label="new label"):
            self.labels_of[i] = (self.labels_of[i] + 1) % 3
        self._embed_private([i], np.array([1.0]))
        self.tomb.pop(rid)
        self.readd_pending.add(rid)
        if sync:
            self._sync()
        COUNTER["readds"] += 1

    @precondition(lambda self: len(self.in_store) > 0)
    @rule(data=st.data(), by_user=st.booleans())
    def delete(self, data, by_user):
        self.step += 1
        led = self._ledger()
        live = sorted(self.in_store)
        if by_user:
            user = f"u{int(data.draw(st.sampled_from(live), label='a record of the user')[1:]) % 6}"
            victims = [r for r in live if f"u{int(r[1:]) % 6}" == user]
            res = delete_records(store_path=self.store_path, ledger_path=self.ledger_path, user_ids=[user])
        else:
            victims = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True), label="ids")
            res = delete_records(store_path=self.store_path, ledger_path=self.ledger_path, record_ids=victims)
        assert sorted(res.record_ids) == sorted(victims)
        s = led.state
        pos = {r: i for i, r in enumerate(s.record_id)}
        for r in victims:
            i = pos.get(r)
            self.tomb[r] = (float(s.spent[i]), int(s.times_selected[i])) if i is not None else (0.0, 0)
            self.old_vec[r] = self.pool[int(r[1:])]
            self.in_store.discard(r)
        COUNTER["deletes"] += 1

    @precondition(lambda self: bool(self.tomb))
    @rule()
    def compact(self):
        self.step += 1
        delete_records(store_path=self.store_path, ledger_path=self.ledger_path, compact=True)
        COUNTER["compactions"] += 1

    @rule(kind=KINDS, data=st.data(), reuse=st.booleans(), seeded=st.booleans())
    def serve(self, kind, data, reuse, seeded):
        n = data.draw(st.integers(1, 48), label="n queries")
        self._serve(kind, n, data.draw(st.sampled_from([1, 7, 64, 4096]), label="batch size"), reuse, seeded)

    @precondition(lambda self: self.big_queries)
    @rule(kind=KINDS, n=st.integers(4000, 25000), batch_size=st.sampled_from([1024, 4096, 8192]))
    def serve_big(self, kind, n, batch_size):
        # no reuse: its pool scan is O(n²) pairs on a batch of repeated queries (docs/RELIABILITY.md)
        self._serve(kind, n, batch_size, False, False)

    def _serve(self, kind, n, batch_size, reuse, seeded):
        self.step += 1
        p = self.params
        q = self._queries(kind, n)
        name = embed_query_file(_save(self.tmp / f"q{self.step}.npy", q), store_path=self.store_path,
                                batch=f"b{self.step}", device="cpu", batch_rows=8192)
        store = FeatureStore.open(self.store_path)
        qv = store.read("query", "features", name.start, name.stop)
        before = self._ledger()
        s0 = before.state
        c1 = p.c1
        live0 = (~s0.deleted) & (s0.row >= 0)
        active0 = dict(zip(s0.record_id, s0.active_mask(c1)))
        spent0 = {r: sp for r, sp, lv in zip(s0.record_id, s0.spent, live0) if lv}  # live in the ledger before
        sel0 = dict(zip(s0.record_id, s0.times_selected))
        try:
            res = serve_queries(store_path=self.store_path, ledger_path=self.ledger_path, query_batch=name,
                                batch_size=batch_size, reuse=reuse, seed=self.step if seeded else None,
                                device="cpu")
        except BudgetExhaustedError:
            COUNTER["exhausted"] += 1
            self.readd_pending.clear()  # the ledger synced the store's new rows before finding none active
            after = self._ledger()
            assert not after.state.active_mask(c1).any()
            assert not after.answers_for(f"b{self.step}")["query_index"]  # nothing answered, nothing charged
            return
        self.readd_pending.clear()
        assert res.newly_answered == n and len(res.answers) == n
        assert [a["query_index"] for a in res.answers] == list(range(n))
        assert all(0 <= a["label"] < len(LABELS) and a["released_count"] >= p.k_min for a in res.answers)
        assert all(("seed" in a) == seeded for a in res.answers)
        COUNTER["queries"] += n
        COUNTER["serves"] += 1
        # who paid, and whether they could have: candidacy depends on the record, the query and its own spent
        after = self._ledger()
        s1 = after.state
        live = (~s1.deleted) & (s1.row >= 0)
        rows = s1.row[live]
        n_strict, n_loose = _candidate_counts(store.read("private", "features")[rows], qv, p)
        for j, li in enumerate(np.flatnonzero(live)):
            rid = s1.record_id[li]
            d_sel = int(s1.times_selected[li] - sel0.get(rid, 0))
            assert 0 <= d_sel <= n_loose[j], (rid, d_sel, n_loose[j])  # never selected without κ ≥ τ
            if rid not in spent0:  # joined during this serve (sync; a returning id may inherit spent): bound only
                continue
            d_spent = s1.spent[li] - spent0[rid]
            if d_sel == 0:
                assert d_spent == 0.0, rid  # the unselected pay nothing
            else:
                assert d_spent >= d_sel * c1 * (1 - 1e-12), rid  # at least the count charge per selection
            if active0[rid] and n_strict[j] >= 1:
                assert d_sel >= 1, rid  # its first candidate query saw its start budget: selected
            if s1.active_mask(c1)[li]:
                assert d_sel >= n_strict[j], rid  # still active: selected at every candidate query
        for rid, (sp, sel) in self.tomb.items():  # the erased never pay, even when queried at their old vector
            if rid in s1.record_id:
                i = int(np.flatnonzero(s1.record_id == rid)[0])
                assert s1.spent[i] == sp and s1.times_selected[i] == sel

    def _queries(self, kind: str, n: int) -> np.ndarray:
        p = self.params
        rng = self.rng
        live_x, _ = self._live_vectors()
        if kind == "repeat" and len(live_x):
            return np.repeat(live_x[rng.integers(0, len(live_x), 1)], n, axis=0).astype(np.float64)
        if kind == "erased" and self.old_vec:
            olds = np.stack(list(self.old_vec.values()))
            return olds[rng.integers(0, len(olds), n)]
        if kind == "boundary" and len(live_x):
            # κ(x, q) = τ exactly in real arithmetic, then ±1e-7 around it: the fp32 screen's edge
            s = p.tau if p.kernel == "cosine" else 1.0 + p.nu * p.nu * math.log(p.tau) / 2.0
            x = live_x[rng.integers(0, len(live_x), n)].astype(np.float64)
            u = rng.standard_normal((n, D))
            u -= (u * x).sum(1, keepdims=True) * x
            u /= np.linalg.norm(u, axis=1, keepdims=True)
            s_t = np.clip(s + rng.choice([-1e-7, 0.0, 1e-7], n), -1.0, 1.0)
            return s_t[:, None] * x + np.sqrt(1.0 - s_t * s_t)[:, None] * u
        if kind == "mixed" and len(live_x):
            half = n // 2
            rep = np.repeat(live_x[rng.integers(0, len(live_x), 1)], half, axis=0)
            return np.concatenate([rep, rng.standard_normal((n - half, D))])
        return rng.standard_normal((n, D))

    # -- invariants --------------------------------------------------------------
    @invariant()
    def budgets_and_tombstones(self):
        if not hasattr(self, "params"):
            return
        led = self._ledger()
        s, p = led.state, led.params
        assert (s.spent <= s.budget).all() and (s.spent >= 0).all(), "a record was charged past B"
        assert (s.budget == p.budget).all()
        assert len(set(s.record_id)) == len(s), "one ledger record per id, forever"
        for rid, sp in zip(s.record_id, s.spent):
            assert sp >= self.max_spent.get(rid, 0.0), f"{rid}: spent decreased (refund)"
            self.max_spent[rid] = float(sp)
        for rid in self.ever - set(s.record_id):
            assert rid not in self.max_spent, f"{rid}: a ledger record disappeared"
        store_ids = set(FeatureStore.open(self.store_path).record_ids().tolist())
        pos = {r: i for i, r in enumerate(s.record_id)}
        for rid, (sp, sel) in self.tomb.items():
            if rid not in pos:  # deleted before it was ever indexed: erased from the store only
                assert rid not in store_ids
                continue
            i = pos[rid]
            assert s.deleted[i] and s.row[i] == -1, f"{rid}: tombstone lost"
            assert s.spent[i] == sp and s.times_selected[i] == sel, f"{rid}: tombstone changed"
            assert rid not in store_ids, f"{rid}: erased record still in the store"
        assert {r for r, dl in zip(s.record_id, s.deleted) if not dl} <= self.in_store
        # the guarantee, and realised individual loss against it, in both conversions
        top = float(s.spent.max()) if len(s) else 0.0
        for conv in ("gdp", "rdp"):
            guarantee = epsilon_for_budget(budget=p.budget, delta=p.delta, conversion=conv)
            assert epsilon_for_budget(budget=top, delta=p.delta, conversion=conv) <= guarantee
        assert epsilon_for_budget(budget=p.budget, delta=p.delta, conversion=p.conversion) <= p.epsilon


def _save(path: Path, x: np.ndarray) -> Path:
    np.save(path, x)
    return path


FAST = settings(max_examples=6, stateful_step_count=8, deadline=None, database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


@pytest.mark.heavy
def test_state_machine_fast():
    run_state_machine_as_test(IndKnnMachine, settings=FAST)


class BigQueryMachine(IndKnnMachine):
    big_queries = True


@pytest.mark.slow
def test_state_machine_million_queries(capsys):
    """Keep running the machine (big batches) until ≥ 10⁶ queries were served; print the count."""
    target = 1_000_000
    start = dict(COUNTER)
    # no shrinking: a failing run prints its steps; shrinking 10⁴-query steps takes many minutes
    slow = settings(max_examples=5, stateful_step_count=14, deadline=None, database=None,
                    phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    rounds = 0
    while COUNTER["queries"] - start["queries"] < target:
        run_state_machine_as_test(BigQueryMachine, settings=slow)
        rounds += 1
        assert rounds < 200, "the machine stopped serving queries"
    done = {k: COUNTER[k] - start[k] for k in COUNTER}
    with capsys.disabled():
        print(f"\n[reliability] state machine: {done['queries']} queries served in {done['serves']} serves over "
              f"{done['runs']} machine runs ({done['deletes']} deletions, {done['readds']} re-adds, "
              f"{done['compactions']} compactions, {done['exhausted']} exhausted refusals)", file=sys.stderr)
    assert done["queries"] >= target
