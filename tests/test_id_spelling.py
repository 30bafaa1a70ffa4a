"""One id, one spelling (review 53, F2): record and user ids are read in Unicode NFC everywhere.

"José" composed ('Jos\\xe9') and decomposed ('Jose\\u0301') print alike. Before the fix `embed` stored both as
given, so under `--privacy-unit user` one person whose user id came from two systems was two users (2·B), and
`delete --user` typed in one form erased only that form's records (exit 0, nothing "not found"); a record id erased
in one form came back in the other with a fresh budget.
"""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from indknn_cli import readers_base
from indknn_cli.cli.app import app
from indknn_cli.errors import BadInputError
from indknn_cli.id_text import canonical
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows
from indknn_cli.user_unit import user_keys

runner = CliRunner()
NFC, NFD = "Jos\u00e9", "Jose\u0301"
D = 4


def test_the_two_spellings_differ_as_code_points_and_are_one_id():
    assert NFC != NFD and unicodedata.normalize("NFC", NFD) == NFC
    assert canonical(NFD) == canonical(NFC) == NFC
    assert canonical("\ufb01") == "\ufb01"  # NFC, never NFKC: the ligature "ﬁ" stays another id than "fi"
    keys = user_keys([NFC, NFD, "", "x"], ["a", "b", "c", "d"], user_for_missing="record")
    assert keys[0] == keys[1] and keys[2] != keys[3]


def _vectors(n, seed):
    rng = np.random.default_rng(seed)
    return normalize_rows(rng.standard_normal((n, D)))


def test_embed_stores_nfc_and_delete_user_erases_every_record_of_the_person(tmp_path):
    """The reviewer's reproduction: three records under each spelling of one user, user unit."""
    n = 40
    users = [NFC] * 3 + [NFD] * 3 + [f"u{i}" for i in range(n - 6)]
    x = _vectors(n, 1)
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "user": users,
                             "label": [str(i % 2) for i in range(n)],
                             "vector": pa.array(list(x.astype(np.float32)), pa.list_(pa.float32()))}),
                   tmp_path / "u.parquet")
    store, ledger = tmp_path / "s.zarr", tmp_path / "L"
    res = runner.invoke(app, ["embed", str(tmp_path / "u.parquet"), "--store", str(store), "--role", "private",
                              "--extractor", "vectors", "--label-names", "0,1", "--id-column", "id",
                              "--user-column", "user", "--vector-column", "vector", "--quiet"])
    assert res.exit_code == 0, res.stderr
    stored = FeatureStore.open(store, mode="r").read("private", "user_id")
    assert [str(u) for u in stored[:6]] == [NFC] * 6
    res = runner.invoke(app, ["index", "--store", str(store), "--ledger", str(ledger), "--eps", "1", "--delta", "1e-5",
                              "--tau", "0.5", "--sigma2", "0.6", "--planned-queries", "300", "--privacy-unit", "user",
                              "--quiet"])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["delete", "--store", str(store), "--ledger", str(ledger), "--user", NFD, "--quiet"])
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["records_erased"] == 6 and out["users_not_found"] == []
    s = BudgetLedger.open(ledger).state
    assert s.deleted[:6].all() and not s.deleted[6:].any()


def test_the_library_append_refuses_an_id_not_in_nfc(tmp_path):
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                             label_names=["a", "b"], chunk_rows=64)
    for rids, uids in (([NFD], None), (["r0"], [NFD])):
        with pytest.raises(BadInputError, match="NFC"):
            st.append("private", _vectors(1, 2), labels=np.zeros(1, np.int32), record_ids=rids, user_ids=uids)
    assert st.n_rows("private") == 0


@pytest.fixture
def legacy_store(tmp_path, monkeypatch):
    """A store and ledger written before ids were stored in NFC: record "ré" decomposed, spent by a serve."""
    monkeypatch.setattr(readers_base, "is_canonical", lambda text: True)  # the old append: any spelling
    n = 30
    x = _vectors(n, 3)
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                             label_names=["a", "b"], chunk_rows=64)
    ids = ["re\u0301"] + [f"r{i}" for i in range(1, n)]
    st.append("private", x, labels=(np.arange(n) % 2).astype(np.int32), record_ids=ids,
              user_ids=["alice"] + [f"u{i}" for i in range(1, n)])
    st.append("query", np.repeat(x[:1], 20, axis=0), record_ids=[f"q{i}" for i in range(20)], batch="b")
    ledger = tmp_path / "L"
    build_index(store_path=st.path, ledger_path=ledger,
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, sigma1=12.0, planned_queries=300))
    serve_queries(store_path=st.path, ledger_path=ledger, query_batch="b", seed=1, reuse=False, device="cpu")
    monkeypatch.undo()
    return st.path, ledger, x


def test_a_legacy_spelling_is_found_by_delete_and_account_and_never_comes_back_with_a_fresh_budget(legacy_store):
    store, ledger, x = legacy_store
    spent = float(BudgetLedger.open(ledger).state.spent[0])
    assert spent > 0
    res = runner.invoke(app, ["account", "--ledger", str(ledger), "--record", "r\u00e9", "--json"])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["delete", "--store", str(store), "--ledger", str(ledger), "--record", "r\u00e9",
                              "--quiet"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["records_erased"] == 1
    # the same person comes back, now spelt composed (as embed and append store it): not a fresh budget
    st = FeatureStore.open(store, mode="r+")
    st.append("private", x[:1], labels=np.zeros(1, np.int32), record_ids=["r\u00e9"], user_ids=["alice"])
    build_index(store_path=store, ledger_path=ledger, params=None)
    s = BudgetLedger.open(ledger).state
    back = int(np.flatnonzero(s.record_id == "r\u00e9")[0])
    assert not s.deleted[back] and s.spent[back] == spent


def test_a_query_id_is_kept_as_the_sender_wrote_it(tmp_path):
    """Queries are not people: their ids are released with their answers as written, in any spelling."""
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                             label_names=["a", "b"], chunk_rows=64)
    st.append("query", _vectors(2, 4), record_ids=[NFD, NFC], batch="b")
    assert [str(r) for r in st.read("query", "record_id")] == [NFD, NFC]


def test_a_second_spelling_of_a_live_id_is_not_a_second_record(legacy_store):
    """Review 56, F3: the ledger keyed records by spelling when they joined, so "ré" composed appended beside a live
    "ré" decomposed became a second live record with its own budget B."""
    from indknn_cli.errors import LedgerError

    store, ledger, x = legacy_store
    FeatureStore.open(store, mode="r+").append("private", x[:1], labels=np.zeros(1, np.int32), record_ids=["r\u00e9"],
                                               user_ids=["alice"])
    with pytest.raises(LedgerError, match="live at another row"):
        build_index(store_path=store, ledger_path=ledger, params=None)
    assert sum(canonical(r) == "r\u00e9" for r in BudgetLedger.open(ledger).state.record_id) == 1


def test_an_erased_id_back_in_another_spelling_under_another_user_is_refused(legacy_store):
    """Review 56, F3 (user_moves): an erased id re-embedded in NFC under another user joined the ledger; in the same
    spelling `index` refuses it (its tombstone would move away from its first user)."""
    store, ledger, x = legacy_store
    res = runner.invoke(app, ["delete", "--store", str(store), "--ledger", str(ledger), "--record", "r\u00e9"])
    assert res.exit_code == 0, res.stderr
    FeatureStore.open(store, mode="r+").append("private", x[:1], labels=np.zeros(1, np.int32), record_ids=["r\u00e9"],
                                               user_ids=["bob"])
    res = runner.invoke(app, ["index", "--store", str(store), "--ledger", str(ledger)])
    assert res.exit_code == 2 and "another user" in " ".join(res.stderr.split()), res.stderr


def test_a_user_back_in_nfc_after_an_erasure_is_the_same_user(tmp_path, monkeypatch):
    """Review 57, F1: a record and user stored decomposed, erased, then embedded again (now composed): the add row
    gave the record to "another user" by code points, and every later serve was refused; repair did not help."""
    monkeypatch.setattr(readers_base, "is_canonical", lambda text: True)
    x = _vectors(30, 6)
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                             label_names=["a", "b"], chunk_rows=64)
    st.append("private", x, labels=(np.arange(30) % 2).astype(np.int32),
              record_ids=["re\u0301"] + [f"r{i}" for i in range(1, 30)],
              user_ids=["Zoe\u0308"] + [f"u{i}" for i in range(1, 30)])
    st.append("query", np.repeat(x[:1], 5, axis=0), record_ids=[f"q{i}" for i in range(5)], batch="b")
    build_index(store_path=st.path, ledger_path=tmp_path / "L",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=300))
    monkeypatch.undo()
    res = runner.invoke(app, ["delete", "--store", str(st.path), "--ledger", str(tmp_path / "L"), "--record", "r\u00e9"])
    assert res.exit_code == 0, res.stderr
    FeatureStore.open(st.path, mode="r+").append("private", x[:1], labels=np.zeros(1, np.int32),
                                                  record_ids=["r\u00e9"], user_ids=["Zo\u00eb"])
    res = runner.invoke(app, ["index", "--store", str(st.path), "--ledger", str(tmp_path / "L")])
    assert res.exit_code == 0, res.stderr
    serve_queries(store_path=st.path, ledger_path=tmp_path / "L", query_batch="b", seed=1, device="cpu")


def test_two_spellings_joining_together_are_refused_not_a_crash(tmp_path, monkeypatch):
    """Review 57, F2: a store from before NFC holding "ré" in both spellings, neither in the ledger yet: IndexError."""
    from indknn_cli.errors import LedgerError

    monkeypatch.setattr(readers_base, "is_canonical", lambda text: True)
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=D,
                             label_names=["a", "b"], chunk_rows=64)
    st.append("private", _vectors(4, 7), labels=np.zeros(4, np.int32), record_ids=["re\u0301", "r\u00e9", "x", "y"])
    with pytest.raises(LedgerError, match="another Unicode spelling"):
        build_index(store_path=st.path, ledger_path=tmp_path / "L",
                    params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=300))
