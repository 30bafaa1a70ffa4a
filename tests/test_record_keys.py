"""Audit 5, F1: the private search's coin must not depend on other records through the embedding batch.

The text extractor embeds rows in padded batches, so a row's float32 vector changes in its last bits with the
rows embedded beside it. The coin used to hash that vector: leaving one person out of 1,200 texts re-dealt 68
other records' shards and moved the un-noised score by up to 9 (sensitivity 1 assumed). ``embed`` now records
each private row's key from its own text and label (``record_keys.py``), and ``index --tune private`` deals
shards by it. These tests run the real extractor (all-MiniLM-L6-v2 from disk) into real stores."""

from __future__ import annotations

import numpy as np
import pytest

from indknn_cli import record_keys, tuning, tuning_base
from indknn_cli.compaction_copy import _write_compacted_copy
from indknn_cli.embedding import embed_into_store
from indknn_cli.errors import BadInputError
from indknn_cli.extractors import get_extractor
from indknn_cli.store import FeatureStore

from .conftest import clustered

TOPICS = [["match", "goal", "team", "coach", "league", "season"], ["stock", "market", "bank", "shares", "profit"],
          ["rocket", "science", "code", "chip", "data", "research"], ["vote", "minister", "war", "city", "talks"]]
COMMON = "the a of in on with today new report says after".split()
NAMES = ["W", "S", "B", "T"]


@pytest.fixture(scope="module")
def minilm():
    return get_extractor("text", device="cpu")


def _texts(n: int, seed: int = 1) -> list[tuple[str, str, str]]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        y = int(rng.integers(4))
        words = [str(rng.choice(TOPICS[y])) if rng.random() < 0.5 else str(rng.choice(TOPICS[int(rng.integers(4))]
                                                                                      + COMMON))
                 for _ in range(int(rng.integers(4, 40)))]
        rows.append((f"u{i:05d}", " ".join(words), NAMES[y]))
    return rows


def _embed_csv(tmp_path, tag, rows, extractor, salt=None):
    """``salt``: the content keys' salt of another store (a random draw of the mechanism, coupled between D and
    D − {x} as the tuning seed is); None: the new store's own."""
    import csv

    if salt is not None:
        st = FeatureStore.create(tmp_path / f"{tag}.zarr", extractor=extractor.info, dim=extractor.dim,
                                 label_names=NAMES, label_names_source="declared")
        st.root.attrs.update({record_keys.SALT_ATTR: salt})

    src = tmp_path / f"{tag}.csv"
    with open(src, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "text", "label"])
        w.writerows(rows)
    embed_into_store(src, store_path=tmp_path / f"{tag}.zarr", role="private", extractor=extractor,
                     id_column="id", label_names=NAMES)
    return FeatureStore.open(tmp_path / f"{tag}.zarr", mode="r")


def _search_keys(store, monkeypatch) -> dict[str, str]:
    """record id → the key the private search dealt that record's shard by (spied on ``shard_split``)."""
    seen = []
    real = tuning_base.shard_split

    def spy(keys, **kw):
        seen.append(list(keys))
        return real(keys, **kw)

    monkeypatch.setattr(tuning_base, "shard_split", spy)
    req = tuning.TuneRequest(epsilon=1.0, delta=1e-5, seed=3, taus=(0.2,), sigma2s=(0.5,), n_val=100,
                             planned_queries=200)
    tuning.run_tuning(store, req)
    ids = [str(r) for r in store.read("private", "record_id")]
    assert len(seen) == 1 and len(seen[0]) == len(ids)
    return dict(zip(ids, seen[0]))


def _make_old(path):
    """The store as one written before content keys: no salt attribute, no key array."""
    import zarr

    root = zarr.open_group(str(path), mode="r+")
    attrs = dict(root.attrs)
    del attrs[record_keys.SALT_ATTR]
    root.attrs.clear()
    root.attrs.update(attrs)
    del root["private"][record_keys.KEY_ARRAY]


@pytest.mark.heavy
@pytest.mark.parametrize("batch_size", [64, 1])
def test_leaving_one_text_out_changes_no_other_records_coin(tmp_path, minilm, monkeypatch, batch_size):
    """batch_size 64: an extractor whose vectors depend on their batch (as the text extractor's did): the keys
    still do not. 1 (the default now): the other records' vectors do not change either."""
    monkeypatch.setattr(minilm, "batch_size", batch_size)
    rows = _texts(600)
    d = _embed_csv(tmp_path, "d", rows, minilm)
    d_minus = _embed_csv(tmp_path, "dm", rows[:10] + rows[11:], minilm, salt=d.key_salt)  # row 10 opts out
    x, xm = d.read("private", "features"), d_minus.read("private", "features")
    keep = np.arange(600) != 10
    # batched: some other rows' vectors moved in their last bits; one by one: none did
    assert np.array_equal(x[keep], xm) == (batch_size == 1)
    full, minus = _search_keys(d, monkeypatch), _search_keys(d_minus, monkeypatch)
    changed = [rid for rid in minus if minus[rid] != full[rid]]
    assert changed == [], f"{len(changed)} other records were re-dealt"


def test_the_key_is_the_rows_own_input_and_label():
    a = record_keys.input_keys(["Stocks fell", "Team won", "Stocks fell"], [0, 1, 1])
    assert a[0] != a[2]  # same text, other label: another record
    assert record_keys.input_keys(["Team won"], [1]) == a[1:2]  # no key depends on another row
    v = np.arange(6.0).reshape(2, 3)
    assert record_keys.input_keys(v, [0, 0])[1] == record_keys.input_keys(v[1:], [0])[0]
    with pytest.raises(BadInputError, match="2 input items but 1 labels"):
        record_keys.input_keys(["a", "b"], [0])


def test_a_store_without_keys_is_refused_for_text_and_falls_back_to_vectors_for_row_wise(tmp_path, minilm):
    d = _embed_csv(tmp_path, "old", _texts(40), minilm)
    _make_old(tmp_path / "old.zarr")
    old = FeatureStore.open(tmp_path / "old.zarr", mode="r")
    assert old.content_keys() is None
    req = tuning.TuneRequest(epsilon=1.0, delta=1e-5, seed=1, n_val=20, planned_queries=100)
    with pytest.raises(BadInputError, match="40 private rows without a recorded content key .* re-embed the private rows"):
        tuning.run_tuning(old, req)
    assert d.n_rows("private") == 40
    # row-wise extractor (vectors): the vector's hash is the key, as before
    x, y, _ = clustered(60, 8, 3, seed=2)
    keys = record_keys.stored_keys(keys=None, features=x, labels=y, extractor="vectors", where="s")
    assert keys == tuning.content_keys(x, y)


def test_erasure_blanks_the_key_and_compaction_keeps_the_others(tmp_path):
    from indknn_cli.store import ExtractorInfo

    x, y, _ = clustered(30, 8, 3, seed=4)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                label_names=["a", "b", "c"], label_names_source="declared")
    given = [f"{i:064x}" for i in range(30)]
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(30)], content_keys=given)
    assert list(store.content_keys()) == given
    with store.write_lock():
        store.erase_rows("private", np.array([3, 7]))
    keys = list(store.content_keys())
    assert keys[3] == keys[7] == "" and keys[:3] == given[:3] and keys[8:] == given[8:]
    # appended as vectors without keys: keyed by the vector and label given
    store.append("private", x[:2], labels=y[:2], record_ids=["n0", "n1"])
    salted = record_keys.vector_keys(x[:2], y[:2], salt=store.key_salt)
    assert list(store.content_keys(np.array([30, 31]))) == salted
    assert salted != tuning.content_keys(x[:2], y[:2])  # keyed by the store's salt, not a plain hash
    # compaction: the kept rows keep their keys, in order, and the salt
    keep = np.setdiff1d(np.arange(32), [3, 7])
    _write_compacted_copy(store, tmp_path / "c.zarr", keep, "c" * 32)
    c = FeatureStore.open(tmp_path / "c.zarr", mode="r")
    assert c.key_salt == store.key_salt
    assert list(c.content_keys()) == [keys[i] if i < 30 else salted[i - 30] for i in keep]


def test_a_store_that_records_keys_and_lost_them_is_refused(tmp_path):
    import shutil

    import zarr

    from indknn_cli.errors import StoreError
    from indknn_cli.store import ExtractorInfo

    x, y, _ = clustered(20, 8, 3, seed=4)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                label_names=["a", "b", "c"], label_names_source="declared")
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(20)])
    shutil.copytree(tmp_path / "s.zarr", tmp_path / "short.zarr")
    zarr.open_array(str(tmp_path / "short.zarr" / "private" / record_keys.KEY_ARRAY), mode="r+").resize((12,))
    with pytest.raises(StoreError, match="content_key has 12 rows for 20 records"):
        FeatureStore.open(tmp_path / "short.zarr", mode="r").content_keys()
    shutil.rmtree(tmp_path / "s.zarr" / "private" / record_keys.KEY_ARRAY)
    with pytest.raises(StoreError, match="content_key is missing"):
        FeatureStore.open(tmp_path / "s.zarr", mode="a")  # not taken for a store made before keys


def test_compacting_a_store_made_before_keys_records_none(tmp_path):
    from indknn_cli.store import ExtractorInfo

    x, y, _ = clustered(20, 8, 3, seed=5)
    FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                        label_names=["a", "b", "c"], label_names_source="declared")
    _make_old(tmp_path / "s.zarr")
    store = FeatureStore.open(tmp_path / "s.zarr", mode="a")
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(20)])  # no key array: none written
    with store.write_lock():
        store.erase_rows("private", np.array([0]))
    assert store.content_keys() is None
    _write_compacted_copy(store, tmp_path / "c.zarr", np.arange(1, 20), "d" * 32)
    c = FeatureStore.open(tmp_path / "c.zarr", mode="r")
    assert list(c.content_keys()) == [""] * 19
    # a row-wise store falls back to the vectors' hash for them
    assert record_keys.stored_keys(keys=c.content_keys(), features=c.read("private", "features"),
                                   labels=c.read("private", "labels"), extractor="vectors",
                                   where="c") == tuning.content_keys(x[1:], y[1:])


def test_a_texts_vector_does_not_depend_on_the_texts_embedded_with_it(minilm):
    texts = [t for _, t, _ in _texts(70, seed=9)]
    alone = np.vstack([minilm.embed([t]) for t in texts[:5]])
    together = minilm.embed(texts)[:5]
    shuffled = minilm.embed(texts[:5][::-1] + texts[40:])[:5][::-1]
    assert np.array_equal(alone, together) and np.array_equal(alone, shuffled)


def test_a_texts_vector_does_not_depend_on_torchs_thread_count(minilm):
    """A Dask worker (one thread) and this process (all cores) embed a text into the same bits (review of audit 5:
    109 of 300 AG News rows differed between 1 and 2 threads before each pass ran on one)."""
    import torch

    texts = [t for _, t, _ in _texts(60, seed=11)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = minilm.embed(texts)
        torch.set_num_threads(2)
        two = minilm.embed(texts)
        assert torch.get_num_threads() == 2  # restored after the passes
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(one, two)


def test_a_short_key_array_is_refused_by_append_and_compaction_before_anything_is_written(tmp_path):
    import shutil

    import zarr

    from indknn_cli.deletion_compact import compact
    from indknn_cli.errors import StoreError
    from indknn_cli.store import ExtractorInfo

    x, y, _ = clustered(20, 8, 3, seed=8)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                label_names=["a", "b", "c"], label_names_source="declared")
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(20)])
    with store.write_lock():
        store.mark_deleted("private", np.array([2]))
    zarr.open_array(str(tmp_path / "s.zarr" / "private" / record_keys.KEY_ARRAY), mode="r+").resize((12,))
    store = FeatureStore.open(tmp_path / "s.zarr", mode="a")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(StoreError, match="has 12 rows for 20 records"):
        store.append("private", x[:2], labels=y[:2], record_ids=["n0", "n1"])
    with pytest.raises(StoreError, match="has 12 rows for 20 records"):
        compact(store, None, fault=lambda step: None, use_exchange=False, index_hook=lambda name: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and store.n_rows("private") == 20
    shutil.rmtree(tmp_path / "s.zarr")


def test_a_store_with_unsalted_keys_still_keeps_them(tmp_path):
    """Stores of the commits that kept keys before the salt: the array decides, keys stay unsalted."""
    import zarr

    from indknn_cli.store import ExtractorInfo

    x, y, _ = clustered(10, 8, 3, seed=9)
    FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                        label_names=["a", "b", "c"], label_names_source="declared")
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="r+")
    attrs = dict(root.attrs)
    del attrs[record_keys.SALT_ATTR]
    root.attrs.clear()
    root.attrs.update(attrs)
    store = FeatureStore.open(tmp_path / "s.zarr", mode="a")
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(10)])
    assert list(store.content_keys()) == tuning.content_keys(x, y)
    with store.write_lock():
        store.erase_rows("private", np.array([4]))
    assert store.content_keys()[4] == ""


def test_a_models_default_prompt_is_applied_one_text_at_a_time(tmp_path):
    """The direct forward pass skips what ``encode`` adds (review 12, R3): a model with a default prompt goes
    through ``encode`` one text at a time."""
    import json
    import shutil

    import torch

    from indknn_cli.extractors import TextExtractor
    from indknn_cli.text_model import bundled_minilm_path

    folder = tmp_path / "model"
    shutil.copytree(bundled_minilm_path(), folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    cfg = folder / "config_sentence_transformers.json"
    meta = json.loads(cfg.read_text()) if cfg.exists() else {}
    cfg.write_text(json.dumps({**meta, "prompts": {"document": "passage: "}, "default_prompt_name": "document"}))
    ex = TextExtractor(str(folder), device="cpu")
    texts = ["the match ended with a late goal", "stock market shares fell"]
    got = ex.embed(texts)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = np.vstack([ex._model.encode([t], batch_size=1, normalize_embeddings=False) for t in texts])
        bare = np.vstack([ex._model.encode([t], batch_size=1, normalize_embeddings=False, prompt="") for t in texts])
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(got, want) and not np.array_equal(got, bare)


def test_a_lone_surrogate_is_bad_input(minilm):
    with pytest.raises(BadInputError, match="text item 1: not valid Unicode"):
        minilm.embed(["fine", "bad \ud800 text"])


def test_concurrent_embeds_on_one_thread_give_the_same_vectors(minilm):
    """Two callers at once on the shared path (torch on one thread, as on a Dask worker running two tasks): the
    tokenizer is used by one at a time, and each gets the vectors it would get alone."""
    import threading

    import torch

    texts = [t for _, t, _ in _texts(80, seed=12)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = minilm.embed(texts)
        got, errors = {}, []

        def run(k):
            try:
                got[k] = minilm.embed(texts[k::2])
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        workers = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(before)
    assert errors == []
    assert np.array_equal(got[0], alone[0::2]) and np.array_equal(got[1], alone[1::2])
