"""Review 69 (2026-11-29, a helper as privacy auditor of reviews 66–68's fixes, `/work/review69`): a torn last line of the
erased-ids log swallowed the next erasure's entry; the in-place rebuild applied the erased rows of an index of
another numbering; an erased row restored without its id chunk came back under the id "" and was selected."""
from __future__ import annotations

import shutil

import numpy as np
import zarr
from typer.testing import CliRunner

from indknn_cli import store_erased_ids
from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.store import FeatureStore

from .test_review_54 import pair  # noqa: F401 (the fixture)

runner = CliRunner()


def _chunks(sp, arrays=None):
    out = []
    for arr in (sp / "private").iterdir():
        if arr.is_dir() and (arr / "c").is_dir() and (arrays is None or arr.name in arrays):
            out += [p for p in (arr / "c").rglob("*") if p.is_file() and p.relative_to(arr / "c").parts[0] == "0"]
    return out


def _restore(sp, backup, arrays=None):
    for p in _chunks(sp, arrays):
        if p not in backup:
            p.unlink()
    for p, b in backup.items():
        p.write_bytes(b)


def test_f1_a_torn_last_line_does_not_swallow_the_next_erasure(pair):
    sp, lp = pair
    (sp / store_erased_ids.NAME).write_text('{"record_id": "r0')  # a crash mid-append
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r005"]).exit_code == 0
    st = FeatureStore.open(sp, mode="r")
    assert store_erased_ids.rows_of(st.path, st.uuid).get(5) == "r005"
    assert ("r005", "") in store_erased_ids.read(st.path)


def test_f2_an_index_of_another_numbering_does_not_mark_live_rows_erased_in_the_rebuild(pair):
    sp, lp = pair
    args = ["--store", str(sp), "--ledger", str(lp)]
    assert runner.invoke(app, ["index", *args, "--kind", "lsh", "--tables", "4", "--bits", "3",
                               "--index-seed", "7"]).exit_code == 0
    assert runner.invoke(app, ["delete", *args, "--record", "r003"]).exit_code == 0
    old = sp.parent / "old_index"
    shutil.copytree(sp / "index", old)
    assert runner.invoke(app, ["delete", *args, "--compact"]).exit_code == 0
    shutil.rmtree(sp / "index")
    shutil.copytree(old, sp / "index")  # a compaction stopped before the index was renumbered
    assert runner.invoke(app, ["delete", *args, "--record", "r010"]).exit_code == 0
    st = FeatureStore.open(sp, mode="r")
    erased = np.asarray(zarr.open_group(str(sp / "index"), mode="r")["erased"][:])
    live = ~st.read("private", "deleted").astype(bool)
    assert not (erased[:live.size] & live).any()


def test_f3_a_logged_row_restored_without_its_id_is_never_readmitted(pair):
    sp, lp = pair
    arrays = ("deleted", "features", "labels")
    backup = {p: p.read_bytes() for p in _chunks(sp, arrays)}
    assert runner.invoke(app, ["delete", "--store", str(sp), "--ledger", str(lp), "--record", "r003"]).exit_code == 0
    _restore(sp, backup, arrays)
    st = FeatureStore.open(sp, mode="r")
    q = sp.parent / "q.npy"
    np.save(q, np.tile(st.read("private", "features")[3], (4, 1)))
    assert runner.invoke(app, ["serve-queries", "--store", str(sp), "--ledger", str(lp), str(q),
                               "--seed", "1"]).exit_code == 0
    s = BudgetLedger.open(lp).state
    assert not [i for i in range(len(s)) if int(s.row[i]) == 3 and not s.deleted[i]]
    assert runner.invoke(app, ["account", "--store", str(sp), "--ledger", str(lp), "--verify"]).exit_code != 0


def test_f4_an_index_rerun_checks_the_flags_typed_against_the_ledger_not_against_defaults(tmp_path):
    """F4: on a user-unit ledger `index --eps 2 --max-records-per-user 3` (the creation's values, the unit left out)
    was refused "--max-records-per-user needs --privacy-unit user": the typed flags were made into parameters with
    defaults first. Typed values equal to the ledger's pass; a differing one (ε by a hair too) is refused naming it."""
    from .test_tuned_realised import _store

    st = _store(tmp_path / "s.zarr", n=60, user_ids=[f"u{i % 20}" for i in range(60)])
    base = ["index", "--store", str(st.path), "--ledger", str(tmp_path / "L")]
    create = ["--eps", "2", "--delta", "1e-6", "--tau", "0.3", "--sigma2", "0.8", "--planned-queries", "200",
              "--privacy-unit", "user", "--max-records-per-user", "3"]
    assert runner.invoke(app, base + create).exit_code == 0
    for args, code in ((["--eps", "2", "--max-records-per-user", "3"], 0), (["--eps", "2"], 0),
                       (["--eps", "2", "--privacy-unit", "user"], 0), (["--eps", "2.0000000001"], 2),
                       (["--eps", "2", "--max-records-per-user", "4"], 2), (["--eps", "2", "--sigma1", "1.0"], 2)):
        res = runner.invoke(app, base + args)
        assert res.exit_code == code, (args, res.stderr)
        if code:
            err = " ".join(res.stderr.split())
            assert "this run's differ" in err and "exceed the budget" not in err, err


def test_f5_batch_ids_refuse_more_invisible_characters_surrounding_spaces_and_decomposed_forms(pair):
    """F5: bidi isolates, U+2028, the soft hyphen and tag characters passed; "day1 " and a decomposed "é" named other
    batches than "day1" and "é", so a retyped id was charged as a new batch instead of printed again."""
    from indknn_cli.errors import BadInputError
    from indknn_cli.readers_base import check_batch_id

    for bad in ("a\u2066b", "a\u00adb", "a\u2028b", "a\U000e0041", "day1 ", " day1", "cafe\u0301",
                # review 70, F3: more characters that render as nothing, and spaces other than U+0020
                "da\u034fy1", "day1\ufe0f", "a\u3164", "a\u2800", "a\u17b4", "a\U0001d173", "day\u00a01", "a\u180b"):
        try:
            check_batch_id(bad)
        except BadInputError:
            continue
        raise AssertionError(f"{bad!r} was taken")
    for good in ("day1", "caf\u00e9", "2026-11-29", "日本", "day 1"):
        check_batch_id(good)
    sp, lp = pair
    q = sp.parent / "q.npy"
    np.save(q, np.eye(4, dtype=np.float32))
    res = runner.invoke(app, ["serve-queries", "--store", str(sp), "--ledger", str(lp), str(q),
                              "--batch-id", "day1 "])
    assert res.exit_code == 2 and res.stdout == "" and "starts or ends with a space" in res.stderr
