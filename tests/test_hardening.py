"""Issue 16 §4–§6: parameters that cannot poison the ledger, checksummed store chunks, no custom model code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from indknn_cli.errors import BadInputError, LedgerError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import make_params, serve_queries

from .test_bad_inputs import build_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    built = build_world(tmp_path_factory.mktemp("hardening") / "w")
    return built.rename(built.parent / "template")  # tests work on copies: none beside a live original (store_twins)


def _copy(world: Path, tmp_path: Path) -> Path:
    import shutil

    w = tmp_path / "w"
    shutil.copytree(world, w)
    return w


def _event_digest(ledger: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(ledger.rglob("*")) if p.is_file()}


# -- §4 parameters ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    dict(sigma2=1e-300), dict(sigma2=math.inf), dict(sigma2=math.nan), dict(k_min=math.inf), dict(k_min=1e300),
    dict(epsilon=1e308), dict(epsilon=1e-300), dict(delta=0.5), dict(sigma1=1e-300), dict(nu=math.inf, kernel="rbf"),
    dict(planned_queries=10**12), dict(tau=math.nan),
])
def test_make_params_refuses_values_outside_the_documented_ranges(kw):
    base = dict(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100)
    base.update(kw)
    with pytest.raises(BadInputError) as err:
        make_params(**base)
    name, value = next(iter(kw.items()))
    assert name in str(err.value) and repr(float(value)).replace("inf", "inf") in str(err.value) or \
        str(value) in str(err.value)


def test_documented_range_ends_are_accepted():
    from indknn_cli.accounting import PARAM_RANGES

    lo_eps, hi_eps = PARAM_RANGES["epsilon"]
    for eps in (lo_eps, hi_eps):
        p = make_params(epsilon=eps, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=10**6)
        assert math.isfinite(p.budget) and p.budget > 0 and math.isfinite(p.c1)


def test_commit_refuses_non_finite_spent_and_writes_nothing(world, tmp_path):
    w = _copy(world, tmp_path)
    ledger = BudgetLedger.open(w / "L")
    before = _event_digest(w / "L")
    for col, val in (("spent_after", math.nan), ("spent_after", math.inf), ("budget", -math.inf),
                     ("released_count", math.inf)):
        with pytest.raises(LedgerError, match=col):
            ledger.commit_event(event_type="serve", info={}, columns={
                "kind": ["charge", "charge"], "ledger_index": [0, 1], col: [0.01, val]})
    assert _event_digest(w / "L") == before
    assert np.isfinite(BudgetLedger.open(w / "L").state.spent).all()


def test_a_ledger_with_poisoned_parameters_never_commits_nan(tmp_path):
    """A ledger whose metadata carries σ2 = 1e-300 (written before the ranges, or crafted): the first
    serve used to write NaN spent for every candidate; now the commit is refused and nothing is written."""
    from indknn_cli.embedding import embed_into_store, embed_query_file
    from indknn_cli.serving import build_index

    from .conftest import clustered

    x, y, _ = clustered(40, 8, 2, seed=1)
    np.savez(tmp_path / "p.npz", x=x, y=y)
    embed_into_store(tmp_path / "p.npz", store_path=tmp_path / "s.zarr", extractor="vectors", label_names=["0", "1"])
    np.save(tmp_path / "q.npy", x[:5])  # queries next to the private records: every one has candidates
    embed_query_file(tmp_path / "q.npy", store_path=tmp_path / "s.zarr", batch="q", device="cpu")
    build_index(store_path=tmp_path / "s.zarr", ledger_path=tmp_path / "L",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    gen = json.loads((tmp_path / "L" / "CURRENT").read_text())["generation"]
    snap = tmp_path / "L" / f"snapshot-{gen:06d}.parquet"
    t = pq.read_table(snap)
    meta = json.loads(t.schema.metadata[b"indknn"])
    meta["params"]["sigma2"] = 1e-300
    pq.write_table(t.replace_schema_metadata({b"indknn": json.dumps(meta).encode()}), snap)
    before = _event_digest(tmp_path / "L")
    # the store's high-water mark now names the snapshot's hash, so the edit is refused on open (before any
    # charge); without the mark the finite check at commit refuses it (test_commit_refuses_non_finite_...)
    with pytest.raises(LedgerError, match="spent_after = nan|snapshot was edited"):
        serve_queries(store_path=tmp_path / "s.zarr", ledger_path=tmp_path / "L", query_batch="q", seed=3,
                      device="cpu")
    assert _event_digest(tmp_path / "L") == before


# -- §5 checksums ---------------------------------------------------------------------------------
def _crc_store(tmp_path, *, n=300, chunk_rows=64):
    from indknn_cli.store import ExtractorInfo, FeatureStore

    from .conftest import clustered

    x, y, _ = clustered(n, 16, 3, seed=1)
    store = FeatureStore.create(tmp_path / "store.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=chunk_rows)
    store.append("private", x, labels=y, record_ids=[f"r{i:04d}" for i in range(n)],
                 user_ids=[f"u{i % 50:03d}" for i in range(n)])
    store.append("query", x[:20], record_ids=[f"q{i:03d}" for i in range(20)], batch="q1")
    return store, x, y


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_new_store_arrays_carry_crc32c(tmp_path):
    from zarr.codecs import Crc32cCodec

    from indknn_cli.store import FeatureStore, store_checksummed

    store, _, _ = _crc_store(tmp_path)
    assert store_checksummed(store) and store_checksummed(store.path)
    assert FeatureStore.open(store.path).root.attrs["checksums"] == "crc32c"
    for group in ("private", "public", "queries"):
        for name in ("features", "labels", "record_id", "user_id", "deleted"):
            codecs = store.root[group][name].metadata.codecs
            assert isinstance(codecs[-1], Crc32cCodec), (group, name, codecs)


def test_a_flipped_byte_in_a_feature_chunk_is_an_error_not_a_changed_vector(tmp_path):
    from typer.testing import CliRunner

    from indknn_cli.cli.app import app
    from indknn_cli.errors import StoreError
    from indknn_cli.serving import build_index
    from indknn_cli.store import FeatureStore

    store, x, _ = _crc_store(tmp_path)
    lp = tmp_path / "L"
    build_index(store_path=store.path, ledger_path=lp,
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    chunk = store.path / "private" / "features" / "c" / "1" / "0"  # rows 64..127, raw float32 + 4 crc bytes
    _flip(chunk, 4 * 16 * 3 + 5)  # a byte of row 67's vector
    with pytest.raises(StoreError, match="crc32c checksum"):
        FeatureStore.open(store.path).read("private", "features")
    before = _event_digest(lp)
    res = CliRunner().invoke(app, ["serve-queries", "q1", "--store", str(store.path), "--ledger", str(lp),
                                   "--seed", "1", "--device", "cpu"])
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert "checksum" in res.stderr and "private/features" in res.stderr and res.stdout == ""
    assert _event_digest(lp) == before  # nothing charged


@pytest.mark.parametrize("name", ["labels", "record_id", "user_id"])
def test_a_flipped_byte_in_a_compressed_chunk_is_a_store_error(tmp_path, name):
    from indknn_cli.errors import StoreError
    from indknn_cli.store import FeatureStore

    store, _, _ = _crc_store(tmp_path)
    chunk = store.path / "private" / name / "c" / "0"
    _flip(chunk, len(chunk.read_bytes()) // 2)
    with pytest.raises(StoreError, match="corrupt"):
        FeatureStore.open(store.path).read("private", name)


def test_erase_append_and_compaction_keep_checksums(tmp_path):
    from indknn_cli.deletion import delete_records
    from indknn_cli.serving import build_index
    from indknn_cli.store import FeatureStore, store_checksummed

    from .conftest import clustered

    store, x, _ = _crc_store(tmp_path, n=100, chunk_rows=64)  # a partly filled tail chunk
    lp = tmp_path / "L"
    build_index(store_path=store.path, ledger_path=lp,
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    delete_records(store_path=store.path, ledger_path=lp, record_ids=["r0003", "r0070"])  # two chunks rewritten
    more, y2, _ = clustered(50, 16, 3, seed=9)
    s = FeatureStore.open(store.path, mode="a")
    with s.write_lock():
        s.append("private", more, labels=y2, record_ids=[f"n{i}" for i in range(50)])  # rewrites the tail chunk
    s = FeatureStore.open(store.path)
    feats = s.read("private", "features")  # every chunk verifies
    assert feats.shape == (150, 16) and not feats[3].any() and not feats[70].any()
    np.testing.assert_array_equal(feats[100:], more.astype(np.float32))
    assert list(s.read("private", "record_id")[[3, 70, 100]]) == ["", "", "n0"]
    assert store_checksummed(s)
    res = delete_records(store_path=store.path, ledger_path=lp, record_ids=["r0004"], compact=True)
    assert res.compaction["store_rows"] == 147
    s = FeatureStore.open(store.path)
    assert store_checksummed(s) and s.root.attrs["checksums"] == "crc32c"
    assert s.read("private", "features").shape == (147, 16)


def test_a_store_made_before_checksums_keeps_working_and_says_unchecked(tmp_path, monkeypatch):
    import indknn_cli.store as store_mod
    from indknn_cli.deletion import delete_records
    from indknn_cli.serving import build_index
    from indknn_cli.store import FeatureStore, store_checksummed

    from zarr.codecs import ZstdCodec

    monkeypatch.setattr(store_mod, "checksum_compressors",
                        lambda compress=True: [ZstdCodec(level=0, checksum=False)] if compress else None)
    store, _, _ = _crc_store(tmp_path, n=100)
    monkeypatch.undo()
    del store.root.attrs["checksums"]  # as written before checksums existed
    s = FeatureStore.open(store.path)
    assert not store_checksummed(s) and "private/features" in s.unchecked_arrays()
    lp = tmp_path / "L"
    build_index(store_path=store.path, ledger_path=lp,
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    r = serve_queries(store_path=store.path, ledger_path=lp, query_batch="q1", seed=1, device="cpu")
    assert r.newly_answered == 20
    delete_records(store_path=store.path, ledger_path=lp, record_ids=["r0001"], compact=True)
    s = FeatureStore.open(store.path)
    # private arrays were rewritten with crc32c; the public/query groups were copied as they were: not all checked
    assert s.unchecked_arrays() and all(not a.startswith("private/") for a in s.unchecked_arrays())
    assert "checksums" not in s.root.attrs and not store_checksummed(s)


# -- §6 no custom model code -------------------------------------------------------------------------
def _model_folder(tmp_path: Path, variant: str) -> Path:
    """The bundled all-MiniLM-L6-v2 files (linked), plus custom code in one of three forms."""
    from indknn_cli.text_model import bundled_minilm_path

    src = bundled_minilm_path()
    dst = tmp_path / f"model-{variant}"
    for p in src.rglob("*"):
        if p.is_file():
            (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            if p.name in ("config.json", "modules.json"):
                (dst / p.relative_to(src)).write_bytes(p.read_bytes())
            else:
                (dst / p.relative_to(src)).symlink_to(p)
    if variant == "py":
        (dst / "modeling_evil.py").write_text("raise SystemExit('custom code ran')\n")
    elif variant == "auto_map":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
        (dst / "config.json").write_text(json.dumps(cfg))
    elif variant == "module":
        mods = json.loads((dst / "modules.json").read_text())
        mods[1]["type"] = "evil_pooling.EvilPooling"
        (dst / "modules.json").write_text(json.dumps(mods))
    return dst


@pytest.mark.parametrize("variant", ["py", "auto_map", "module"])
def test_a_store_naming_a_model_folder_with_custom_code_is_refused(tmp_path, variant):
    from typer.testing import CliRunner

    from indknn_cli.cli.app import app
    from indknn_cli.serving import build_index
    from indknn_cli.store import ExtractorInfo, FeatureStore

    folder = _model_folder(tmp_path, variant)
    x = np.random.default_rng(0).standard_normal((30, 384)).astype(np.float32)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("text", str(folder), "crafted"),
                                dim=384, label_names=["a", "b"])
    store.append("private", x / np.linalg.norm(x, axis=1, keepdims=True), labels=np.arange(30) % 2,
                 record_ids=[f"r{i}" for i in range(30)])
    build_index(store_path=store.path, ledger_path=tmp_path / "L",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("hello", "world")))
    runner = CliRunner()
    for args in (["embed", str(tmp_path / "q.jsonl"), "--role", "query", "--store", str(store.path)],
                 ["serve-queries", str(tmp_path / "q.jsonl"), "--store", str(store.path), "--ledger",
                  str(tmp_path / "L"), "--device", "cpu", "--seed", "1"]):
        before = _event_digest(tmp_path)
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args[0], res.exit_code, res.stdout, res.stderr)
        assert "custom code" in res.stderr and str(folder) in " ".join(res.stderr.split()), res.stderr
        assert _event_digest(tmp_path) == before


def test_the_bundled_model_folder_is_not_refused():
    from indknn_cli.text_model import bundled_minilm_path, refuse_custom_code

    refuse_custom_code(bundled_minilm_path())


# -- §3 a damaged ledger does not block erasure ---------------------------------------------------
def test_delete_erases_even_when_the_ledger_cannot_be_read(world, tmp_path):
    """A truncated event file used to make `delete` exit 2 with nothing done. Now the request is recorded
    (erase_pending) and the vectors erased; the ledger is not touched; once the ledger is readable again the
    next delete writes the tombstone (spent kept, never refunded) and clears erase_pending."""
    from typer.testing import CliRunner

    from indknn_cli.cli.app import app
    from indknn_cli.store import FeatureStore

    w = _copy(world, tmp_path)
    store0 = FeatureStore.open(w / "s.zarr")
    ids = list(store0.read("private", "record_id"))
    row = ids.index("r001")
    led0 = BudgetLedger.open(w / "L")
    li = int(np.flatnonzero(led0.state.record_id == "r001")[0])
    spent0 = float(led0.state.spent[li])
    event = sorted((w / "L" / "events").glob("*.parquet"))[0]
    good = event.read_bytes()
    event.write_bytes(good[:100])  # damaged
    ledger_before = _event_digest(w / "L")
    runner = CliRunner()
    args = ["delete", "--store", str(w / "s.zarr"), "--ledger", str(w / "L"), "--record", "r001"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, (res.exit_code, res.stderr)
    out = json.loads(res.stdout)
    assert out["record_ids"] == ["r001"] and out["tombstones_pending"] == 1 and "ledger_unreadable" in out
    assert "cannot be read" in res.stderr
    s = FeatureStore.open(w / "s.zarr")
    assert not s.read("private", "features")[row].any() and s.read("private", "record_id")[row] == ""
    assert bool(s.read("private", "deleted")[row]) and list(s.erase_pending_rows("private")) == [row]
    assert _event_digest(w / "L") == ledger_before  # the damaged ledger is left for repair
    # --compact alone still needs the ledger
    res = runner.invoke(app, ["delete", "--store", str(w / "s.zarr"), "--ledger", str(w / "L"), "--compact"])
    assert res.exit_code == 1 and "corrupt or truncated event" in res.stderr  # damaged ledger: exit 1
    # the ledger is readable again (here: the event restored; later: `ledger repair`)
    event.write_bytes(good)
    res = runner.invoke(app, ["delete", "--store", str(w / "s.zarr"), "--ledger", str(w / "L"), "--record", "r002"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["pending_completed"] == 1
    led = BudgetLedger.open(w / "L")
    assert bool(led.state.deleted[li]) and float(led.state.spent[li]) >= spent0  # tombstone, no refund
    assert FeatureStore.open(w / "s.zarr").erase_pending_rows("private").size == 0


def test_strict_and_dry_run_with_an_unreadable_ledger_use_the_store(world, tmp_path):
    from typer.testing import CliRunner

    from indknn_cli.cli.app import app

    w = _copy(world, tmp_path)
    event = sorted((w / "L" / "events").glob("*.parquet"))[0]
    event.write_bytes(event.read_bytes()[:100])
    before = _event_digest(w)
    base = ["delete", "--store", str(w / "s.zarr"), "--ledger", str(w / "L")]
    res = CliRunner().invoke(app, base + ["--record", "r003", "--dry-run"])
    assert res.exit_code == 0 and json.loads(res.stdout)["record_ids"] == ["r003"], res.stderr
    res = CliRunner().invoke(app, base + ["--record", "r003", "--record", "nobody", "--strict"])
    assert res.exit_code == 2 and "nobody" in res.stderr
    assert _event_digest(w) == before


def test_store_source_reads_ahead_the_same_blocks_and_raises_a_corrupt_one_in_place(tmp_path):
    """The candidate phase's StoreSource reads the next step in a thread while the current one is screened:
    the same blocks in the same order as iter_chunks, steps within an eighth of the cache (``--max-memory``),
    and a corrupt chunk is a StoreError raised where its block would have come, after the blocks before it."""
    from indknn_cli.candidates import StoreSource
    from indknn_cli.errors import StoreError
    from indknn_cli.store import FeatureStore

    store, x, _ = _crc_store(tmp_path, n=1200, chunk_rows=64)
    assert StoreSource(store, cache_bytes=0).step_rows() == 64  # one chunk at least
    assert StoreSource(store, cache_bytes=1 << 30).step_rows() == store.scan_rows
    assert StoreSource(store, cache_bytes=8 * 4 * 16 * 128).step_rows() == 128
    src = StoreSource(store, cache_bytes=8 * 4 * 16 * 128)  # 128-row steps; 1,200 rows do not fit: no cache
    blocks = [(s, b.copy()) for s, b in src.chunks()]  # uncached blocks live in reused buffers (store_scan)
    assert [s for s, _ in blocks] == list(range(0, 1200, 128)) and src._cache is None
    np.testing.assert_array_equal(np.vstack([b for _, b in blocks]), store.read("private", "features"))
    _flip(store.path / "private" / "features" / "c" / "2" / "0", 4 * 16 * 3 + 5)  # rows 128..191
    seen = []
    with pytest.raises(StoreError, match="crc32c checksum"):
        for start, _ in StoreSource(FeatureStore.open(store.path), cache_bytes=8 * 4 * 16 * 128).chunks():
            seen.append(start)
    assert seen == [0]


def test_screen_pairs_stay_within_the_pair_bound_and_no_read_ahead_thread_survives(tmp_path, monkeypatch):
    """Audit of this change (P3 again): the pair bound was checked only after a whole scan step's pairs were
    formed — up to m × step (8,192-65,536 rows) pairs whatever --max-memory said, so whether the process ran
    out of memory depended on how many private records lie near the queries. The screen now sees at most
    max_pairs // m rows at a time. And the read-ahead thread is gone once the batch gives up."""
    import threading

    from indknn_cli import candidates
    from indknn_cli.candidates import StoreSource, TooManyPairs, find_candidates

    store, x, _ = _crc_store(tmp_path, n=1200, chunk_rows=64)
    q = np.asarray(x[:10], np.float32)
    sizes = []
    real = candidates._screen_cpu

    def spy(index, block, screen):
        qi, ri = real(index, block, screen)
        sizes.append(qi.size)
        return qi, ri

    monkeypatch.setattr(candidates, "_screen_cpu", spy)
    src = StoreSource(store, cache_bytes=8 * 4 * 16 * 512)  # 512-row steps, no cache (1,200 rows)
    with pytest.raises(TooManyPairs):
        find_candidates(q, src, kernel="cosine", tau=-0.99, nu=None, device="cpu", max_pairs=1000)
    assert sizes and max(sizes) <= 1000, sizes  # 10 queries × 100 rows per screen; a 512-row step held 5,120
    assert not [t for t in threading.enumerate() if t.name.startswith("indknn-read-ahead")]
    sizes.clear()
    full = find_candidates(q, src, kernel="cosine", tau=-0.99, nu=None, device="cpu")  # no bound: every row
    split = find_candidates(q, src, kernel="cosine", tau=-0.99, nu=None, device="cpu", max_pairs=10**6)
    for a, b in zip(full.rows + full.kappa, split.rows + split.kappa):
        np.testing.assert_array_equal(a, b)
    assert sum(r.size for r in full.rows) == 10 * 1200
