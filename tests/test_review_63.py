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
