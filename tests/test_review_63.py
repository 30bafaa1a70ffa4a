"""Review 63 (2026-11-29, a QA helper after this session's refactors): a TSV field that starts with a quote, an
.npz id array under another name, --tune public options that were ignored, `bench year --keep` into a folder in use."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.errors import BadInputError
from indknn_cli.readers import open_source
from indknn_cli.tuning import check_tune_options

runner = CliRunner()


def test_a_tsv_field_starting_with_a_quote_says_how_to_quote_it_and_shows_the_tab(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text('id\ttext\tlabel\na1\t"Quoted" headline\tSports\n')
    with pytest.raises(BadInputError) as info:
        with open_source(path, extractor_kind="text", id_column="id") as src:
            list(src.batches())
    assert "\t" not in str(info.value) and "'\\t' expected" in str(info.value)
    assert '"""Quoted"" headline"' in str(info.value)
    path.write_text('id\ttext\tlabel\na1\t"""Quoted"" headline"\tSports\n')
    with open_source(path, extractor_kind="text", id_column="id") as src:
        assert [b.items for b in src.batches()] == [['"Quoted" headline']]


@pytest.mark.parametrize("name,option", [("id", "--id-column"), ("record_id", "--id-column"),
                                         ("user", "--user-column")])
def test_an_npz_array_under_a_near_name_is_refused_not_ignored(tmp_path, name, option):
    """An array `id` was ignored: the records got generated ids, and `delete --record` later said "not found"."""
    np.savez(tmp_path / "p.npz", x=np.eye(3, dtype=np.float32), y=np.array([0, 1, 0]), **{name: np.array(["a", "b", "c"])})
    res = runner.invoke(app, ["embed", str(tmp_path / "p.npz"), "--store", str(tmp_path / "s.zarr"), "--extractor",
                              "vectors", "--label-names", "0,1"])
    assert res.exit_code == 2 and f"array '{name}' is not read" in res.stderr and option in res.stderr, res.stderr
    assert not (tmp_path / "s.zarr").exists()
    res = runner.invoke(app, ["embed", str(tmp_path / "p.npz"), "--store", str(tmp_path / "s.zarr"), "--extractor",
                              "vectors", "--label-names", "0,1", option, name])
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("flag", ["--tune-share", "--tune-runs", "--tune-shape", "--tune-queries", "--tune-method"])
def test_tune_public_refuses_the_options_of_the_private_search(flag):
    with pytest.raises(BadInputError, match=f"{flag} applies to --tune private"):
        check_tune_options(tune="public", given=[flag], eps=1.0, method="exp-mech", privacy_unit="record",
                           max_records_per_user=None)
    check_tune_options(tune="public", given=["--tune-taus", "--tune-seed"], eps=1.0, method="exp-mech",
                       privacy_unit="record", max_records_per_user=None)


def test_bench_keep_refuses_a_folder_in_use(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    for cmd in (["year", "--days", "17", "--queries", "3", "--n", "50", "--d", "4"], ["stream", "--queries", "10"]):
        res = runner.invoke(app, ["bench", *cmd, "--keep", str(tmp_path / "used")])
        assert res.exit_code == 2 and "not a new folder" in res.stderr, res.stderr
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == ["notes.txt"]


def test_a_bad_fence_duration_never_blocks_an_erasure_beside_a_leftover_dask_stamp(tmp_path, monkeypatch, caplog):
    """Review 64, F1: with a leftover `embed --scheduler` stamp and `$INDKNN_DASK_FENCE_SECONDS=abc`, the writer
    rewrote the stamp to "revoked", then read the variable and failed: `delete` exited 2, nothing recorded, and every
    later write the same way."""
    import json

    from indknn_cli import dask_fence
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

    rng = np.random.default_rng(2)
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=4,
                             label_names=["a", "b"])
    st.append("private", normalize_rows(rng.standard_normal((8, 4))), labels=np.zeros(8, np.int32),
              record_ids=[f"r{i}" for i in range(8)])
    build_index(store_path=st.path, ledger_path=tmp_path / "L",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=50))
    (st.path / dask_fence.LOCAL_NAME).write_text(json.dumps({"run": "gone", "state": "running", "pid": 1}))
    monkeypatch.setattr(dask_fence, "GRACE_SECONDS", None)
    monkeypatch.setattr(dask_fence.time, "sleep", lambda s: None)
    res = runner.invoke(app, ["delete", "--store", str(st.path), "--ledger", str(tmp_path / "L"), "--record", "r2"],
                        env={"INDKNN_DASK_FENCE_SECONDS": "abc"})
    assert res.exit_code == 0, res.stderr
    said = " ".join(r.getMessage() for r in caplog.records)  # the warning (pytest's handler holds indknn's log lines)
    assert "INDKNN_DASK_FENCE_SECONDS" in said and "default 5 s" in said
    assert str(FeatureStore.open(st.path, mode="r").read("private", "record_id")[2]) == ""
    assert not (st.path / dask_fence.LOCAL_NAME).exists()


@pytest.mark.heavy
def test_a_ledger_folder_that_cannot_be_written_is_refused_before_a_query_file_is_embedded(tmp_path, monkeypatch):
    """Review 64, F2: `chmod a-w L L/events` with LOCK left writable passed the check (LOCK opened for writing), the
    query file was embedded into the store, then the event write failed (exit 1). Root passes permission checks, so
    access(2) is answered here as it is for another user."""
    import hashlib
    import os

    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

    rng = np.random.default_rng(3)
    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=4,
                             label_names=["a", "b"])
    st.append("private", normalize_rows(rng.standard_normal((8, 4))), labels=np.zeros(8, np.int32),
              record_ids=[f"r{i}" for i in range(8)])
    lp = tmp_path / "L"
    build_index(store_path=st.path, ledger_path=lp,
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.6, planned_queries=50))
    np.save(tmp_path / "q.npy", normalize_rows(rng.standard_normal((3, 4))).astype(np.float32))

    def digest():
        return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(st.path.rglob("*")) if p.is_file())).hexdigest()

    before = digest()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(lp / "events") else real(p, mode, **kw))
    res = runner.invoke(app, ["serve-queries", str(tmp_path / "q.npy"), "--store", str(st.path), "--ledger", str(lp)])
    assert res.exit_code == 1 and "cannot be written" in res.stderr, res.stderr
    assert digest() == before  # the query file was not embedded
