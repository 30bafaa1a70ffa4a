"""`embed`: the library call, its refusals (store untouched), the CLI and a real pipe."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from indknn_cli.embedding import embed_into_store, embed_query_file, sort_label_names
from indknn_cli.errors import BadInputError, StoreError
from indknn_cli.extractors import get_extractor
from indknn_cli.store import FeatureStore

REPO = Path(__file__).resolve().parents[1]

try:
    from indknn_cli.cli.app import app
except ImportError:  # the app module is another part of the project; embed alone is enough here
    import typer

    from indknn_cli.cli.embed import embed_command

    app = typer.Typer()
    app.command("embed")(embed_command)
    app.command("noop")(lambda: None)


@pytest.fixture(scope="module")
def minilm():
    return get_extractor("text", device="cpu")


def rng_vectors(n, d, seed=0):
    return np.random.default_rng(seed).standard_normal((n, d))


def write_npz(path, x, y=None, ids=None, users=None):
    arrays = {"x": np.asarray(x)}
    if y is not None:
        arrays["y"] = np.asarray(y)
    if ids is not None:
        arrays["ids"] = np.asarray(ids)
    if users is not None:
        arrays["users"] = np.asarray(users)
    np.savez(path, **arrays)
    return path


def write_csv(path, rows, cols):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(rows)
    return path


def snapshot(path: Path):
    """Everything a reader can see: root attrs, and per role the group attrs and committed rows."""
    if not (path / "zarr.json").exists():
        return None
    s = FeatureStore.open(path)
    out = {"root": dict(s.root.attrs)}
    for role in ("private", "public", "query"):
        n = s.n_rows(role)
        out[role] = {
            "attrs": dict(s.group(role).attrs),
            **{name: s.read(role, name).tolist() for name in ("features", "labels", "record_id", "user_id", "deleted")},
        }
        assert len(out[role]["features"]) == n
    return out


@pytest.fixture
def vstore(tmp_path):
    """A vectors store (d=6, labels a/b/c) with 20 private rows r00..r19."""
    x = rng_vectors(20, 6)
    src = write_npz(tmp_path / "base.npz", x, y=np.array(list("abc") * 7)[:20], ids=[f"r{i:02d}" for i in range(20)],
                    users=[f"u{i % 4}" for i in range(20)])
    res = embed_into_store(src, store_path=tmp_path / "v.zarr", role="private", extractor="vectors",
                           label_names=["a", "b", "c"])
    assert res.rows_added == 20 and res.created
    return tmp_path / "v.zarr"


# -- library: happy paths -------------------------------------------------------------
def test_text_csv_into_a_new_store(tmp_path, minilm):
    rows = [("n1", "u1", "Stocks fell on Wall Street as oil prices rose.", "Business"),
            ("n2", "u1", "The home team won the championship in overtime.", "Sports"),
            ("n3", "u2", "Markets rallied after the central bank cut rates.", "Business"),
            ("n4", "u3", "Rebels and government troops clashed near the border.", "World")]
    src = write_csv(tmp_path / "news.csv", rows, ["id", "user", "text", "label"])
    seen = []
    res = embed_into_store(src, store_path=tmp_path / "s.zarr", role="private", extractor=minilm,
                           id_column="id", user_column="user", batch_rows=3,
                           label_names=["Business", "Sports", "World"],
                           progress=lambda done, total: seen.append((done, total)))
    assert res.as_dict() == {"store": str(tmp_path / "s.zarr"), "role": "private", "rows_added": 4,
                             "rows_skipped": 0, "d": 384, "extractor": minilm.info.as_dict(),
                             "operator_only": "operator-only: rows_added and rows_skipped are exact counts of private "
                                              "rows"}
    assert seen == [(3, 4), (4, 4)]
    s = FeatureStore.open(tmp_path / "s.zarr")
    assert s.label_names == ["Business", "Sports", "World"]
    assert s.read("private", "labels").tolist() == [0, 1, 0, 2]
    assert s.record_ids().tolist() == ["n1", "n2", "n3", "n4"]
    assert s.read("private", "user_id").tolist() == ["u1", "u1", "u2", "u3"]
    f = s.read("private", "features")
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(f, minilm.embed([r[2] for r in rows]) /
                               np.linalg.norm(minilm.embed([r[2] for r in rows]), axis=1, keepdims=True),
                               rtol=1e-4, atol=1e-5)
    assert (f[0] @ f[2]) > (f[0] @ f[1])  # business closer to business


def test_generated_ids_labels_sorted_numerically_and_append(tmp_path):
    # The names are inferred from labelled public rows (a store created from private rows needs them declared).
    p0 = write_npz(tmp_path / "pub.npz", rng_vectors(3, 4, 2), y=[10, 2, 1])
    r0 = embed_into_store(p0, store_path=tmp_path / "s.zarr", role="public", extractor="vectors")
    s = FeatureStore.open(tmp_path / "s.zarr")
    assert r0.created and s.label_names == ["1", "2", "10"] and s.label_names_source == "public rows"
    assert s.read("public", "labels").tolist() == [2, 1, 0]
    p1 = write_npz(tmp_path / "a.npz", rng_vectors(3, 4), y=[10, 2, 1])
    r1 = embed_into_store(p1, store_path=tmp_path / "s.zarr")  # extractor: the store's own
    s = FeatureStore.open(tmp_path / "s.zarr")
    assert s.label_names == ["1", "2", "10"] and s.read("private", "labels").tolist() == [2, 1, 0]
    assert s.record_ids().tolist() == ["private-00000000", "private-00000001", "private-00000002"]
    p2 = write_npz(tmp_path / "b.npz", rng_vectors(2, 4, 1), y=[2, 2])
    r2 = embed_into_store(p2, store_path=tmp_path / "s.zarr")  # extractor: the store's own
    assert (r1.rows_added, r2.rows_added, r2.created, r2.dim) == (3, 2, False, 4)
    assert FeatureStore.open(tmp_path / "s.zarr").record_ids().tolist()[3:] == ["private-00000003",
                                                                                "private-00000004"]


def test_sort_label_names():
    assert sort_label_names(["b", "a", "b"]) == ["a", "b"]
    assert sort_label_names(["10", "9", "1.5"]) == ["1.5", "9", "10"]


def test_label_names_option(tmp_path):
    p = write_npz(tmp_path / "a.npz", rng_vectors(2, 4), y=["cat", "cat"])
    embed_into_store(p, store_path=tmp_path / "s.zarr", extractor="vectors", label_names=["dog", "cat", "owl"])
    assert FeatureStore.open(tmp_path / "s.zarr").label_names == ["dog", "cat", "owl"]
    with pytest.raises(BadInputError, match="fixed when the store is created"):
        embed_into_store(p, store_path=tmp_path / "s.zarr", label_names=["cat", "dog"], if_exists="skip")
    with pytest.raises(BadInputError, match="distinct"):
        embed_into_store(p, store_path=tmp_path / "t.zarr", extractor="vectors", label_names=["a", "a"])


def test_public_role_and_image_folder(tmp_path):
    for cls in ("3", "7"):
        for i in range(3):
            (tmp_path / "imgs" / cls).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.random.default_rng(i).integers(0, 255, (28, 28), dtype=np.uint8)).save(
                tmp_path / "imgs" / cls / f"{i}.png")
    res = embed_into_store(tmp_path / "imgs", store_path=tmp_path / "s.zarr", role="public", extractor="pixels",
                           batch_rows=4)
    assert (res.rows_added, res.dim, res.role) == (6, 784, "public")
    s = FeatureStore.open(tmp_path / "s.zarr")
    assert s.n_rows("public") == 6 and s.n_rows("private") == 0
    assert s.label_names == ["3", "7"] and s.record_ids("public").tolist()[0] == "imgs/3/0.png"
    # the same folder as private data: same store, same extractor
    embed_into_store(tmp_path / "imgs", store_path=tmp_path / "s.zarr", role="private")
    assert FeatureStore.open(tmp_path / "s.zarr").n_rows("private") == 6
    with pytest.raises(StoreError, match="built with extractor pixels:pixels-28, not hog:hog-28"):
        embed_into_store(tmp_path / "imgs", store_path=tmp_path / "s.zarr", extractor="hog", if_exists="skip")


def test_if_exists_skip(vstore, tmp_path):
    x = rng_vectors(4, 6, 3)
    p = write_npz(tmp_path / "more.npz", x, y=list("abca"), ids=["r01", "new1", "r05", "new2"])
    before = snapshot(vstore)
    with pytest.raises(BadInputError, match=r"row 1: id 'r01' is already in the private set .* --if-exists skip"):
        embed_into_store(p, store_path=vstore)
    assert snapshot(vstore) == before
    res = embed_into_store(p, store_path=vstore, if_exists="skip")
    assert (res.rows_added, res.rows_skipped) == (2, 2)
    s = FeatureStore.open(vstore)
    assert s.record_ids().tolist()[-2:] == ["new1", "new2"]
    np.testing.assert_allclose(s.read("private", "features")[-1], x[3] / np.linalg.norm(x[3]), rtol=1e-6)
    again = embed_into_store(p, store_path=vstore, if_exists="skip")
    assert (again.rows_added, again.rows_skipped) == (0, 4)
    assert FeatureStore.open(vstore).n_rows() == 22


def test_query_role(vstore, tmp_path):
    q = write_npz(tmp_path / "q.npz", rng_vectors(5, 6, 7), y=list("aaaaa"), ids=[f"q{i}" for i in range(5)])
    res = embed_into_store(q, store_path=vstore, role="query")
    digest = __import__("hashlib").sha256(q.read_bytes()).hexdigest()
    assert res.batch == "q-" + digest[:16] and res.rows_added == 5
    assert res.as_dict()["batch"] == res.batch
    assert any("ignored for queries" in w for w in res.warnings)
    s = FeatureStore.open(vstore)
    assert s.query_batch(res.batch)[:2] == (0, 5)
    assert s.read("query", "labels").tolist() == [-1] * 5  # labels are not stored for queries
    # idempotent re-run
    again = embed_into_store(q, store_path=vstore, role="query")
    assert (again.rows_added, again.rows_skipped, again.batch) == (0, 5, res.batch)
    # same name, other content
    q2 = write_npz(tmp_path / "q2.npz", rng_vectors(5, 6, 8))
    before = snapshot(vstore)
    with pytest.raises(BadInputError, match="other content"):
        embed_into_store(q2, store_path=vstore, role="query", batch=res.batch)
    assert snapshot(vstore) == before
    # query ids are unique per batch: the same ids in a new batch are fine
    res2 = embed_into_store(q, store_path=vstore, role="query", batch="day-2")
    assert res2.rows_added == 5 and FeatureStore.open(vstore).query_batch("day-2")[:2] == (5, 10)


def test_test_role_keeps_labels_for_scoring_and_is_not_piped_to_serving(vstore, tmp_path):
    """--role test: a labelled query batch (labels kept for bench's scoring); serve-queries refuses its JSON line."""
    from indknn_cli.serving import resolve_query_batch

    q = write_npz(tmp_path / "t.npz", rng_vectors(5, 6, 9), y=list("abcab"), ids=[f"t{i}" for i in range(5)])
    res = embed_into_store(q, store_path=vstore, role="test")
    assert res.role == "test" and res.batch.startswith("test-") and res.as_dict()["batch"] == res.batch
    assert not res.warnings
    s = FeatureStore.open(vstore)
    assert s.read("query", "labels").tolist() == [0, 1, 2, 0, 1]
    assert s.read("private", "labels").size == 20  # nothing joined the private set
    with pytest.raises(BadInputError, match="role"):
        resolve_query_batch(store_path=vstore, queries="-", batch_id=None, upstream=res.as_dict())
    again = embed_into_store(q, store_path=vstore, role="test")
    assert (again.rows_added, again.rows_skipped) == (0, 5)
    bad = write_npz(tmp_path / "t2.npz", rng_vectors(2, 6, 9), y=["a", "zzz"])
    before = snapshot(vstore)
    with pytest.raises(BadInputError, match="unknown label"):
        embed_into_store(bad, store_path=vstore, role="test")
    nolab = write_npz(tmp_path / "t3.npz", rng_vectors(2, 6, 9))
    with pytest.raises(BadInputError, match="label"):
        embed_into_store(nolab, store_path=vstore, role="test")
    assert snapshot(vstore) == before


def test_query_role_needs_an_existing_store(tmp_path):
    q = write_npz(tmp_path / "q.npz", rng_vectors(2, 6))
    with pytest.raises(StoreError, match="no feature store here"):
        embed_into_store(q, store_path=tmp_path / "none.zarr", role="query", extractor="vectors")
    assert not (tmp_path / "none.zarr").exists()
    with pytest.raises(BadInputError, match="--role query only"):
        embed_into_store(q, store_path=tmp_path / "none.zarr", role="private", batch="b1")


def test_embed_query_file(tmp_path, minilm):
    write_csv(tmp_path / "p.csv", [("a", "Stocks fell"), ("b", "Team won")], ["text", "label"])
    embed_into_store(tmp_path / "p.csv", store_path=tmp_path / "s.zarr", extractor=minilm,
                     label_names=["Stocks fell", "Team won"])
    q = write_csv(tmp_path / "q.csv", [("q1", "Shares dropped"), ("q2", "A goal in the final"),
                                       ("q3", "Oil prices")], ["id", "text"])
    name = embed_query_file(q, store_path=tmp_path / "s.zarr", batch=None, id_column="id", device="cpu")
    assert name.startswith("q-") and (name.start, name.stop) == (0, 3)
    s = FeatureStore.open(tmp_path / "s.zarr", mode="a")
    assert s.record_ids("query").tolist() == ["q1", "q2", "q3"]
    # idempotent; and usable while the caller holds the store lock
    with s.write_lock():
        again = embed_query_file(q, store=s, batch=str(name), id_column="id", lock=False, device="cpu")
    assert again == name and again.rows == (0, 3) and s.n_rows("query") == 3


# -- library: refusals leave the store untouched --------------------------------------
def _nan_file(tmp_path):
    x = rng_vectors(10, 6, 1)
    x[9, 2] = np.nan  # in the last batch: earlier batches were already written past n_rows
    return write_npz(tmp_path / "bad.npz", x, y=["a"] * 10, ids=[f"n{i}" for i in range(10)])


def _inf_file(tmp_path):
    x = rng_vectors(3, 6, 1)
    x[1, 0] = np.inf
    return write_npz(tmp_path / "bad.npz", x, y=["a"] * 3, ids=["i0", "i1", "i2"])


def _zero_file(tmp_path):
    x = rng_vectors(3, 6, 1)
    x[2] = 0
    return write_npz(tmp_path / "bad.npz", x, y=["a"] * 3, ids=["z0", "z1", "z2"])


def _wrong_d_file(tmp_path):
    return write_npz(tmp_path / "bad.npz", rng_vectors(3, 5), y=["a"] * 3)


def _unknown_label_file(tmp_path):
    return write_npz(tmp_path / "bad.npz", rng_vectors(3, 6), y=["a", "zebra", "b"], ids=["k0", "k1", "k2"])


def _missing_label_file(tmp_path):
    return write_npz(tmp_path / "bad.npz", rng_vectors(3, 6), ids=["m0", "m1", "m2"])


def _empty_file(tmp_path):
    pq.write_table(pa.table({"vector": pa.array([], pa.list_(pa.float64())), "label": pa.array([], pa.string())}),
                   tmp_path / "bad.parquet")
    return tmp_path / "bad.parquet"


def _duplicate_ids_file(tmp_path):
    return write_npz(tmp_path / "bad.npz", rng_vectors(8, 6), y=["a"] * 8, ids=[f"d{i}" for i in range(7)] + ["d2"])


def _existing_id_file(tmp_path):
    return write_npz(tmp_path / "bad.npz", rng_vectors(3, 6), y=["a"] * 3, ids=["e0", "r07", "e2"])


BAD_VECTOR_INPUTS = {
    "nan": (_nan_file, BadInputError, r"row 10 \(id 'n9'\): vector contains NaN"),
    "inf": (_inf_file, BadInputError, r"row 2 \(id 'i1'\): vector contains NaN or infinite"),
    "zero": (_zero_file, BadInputError, r"row 3 \(id 'z2'\): zero vector"),
    "wrong-d": (_wrong_d_file, StoreError, r"store has d=6, input .*bad\.npz has d=5"),
    "unknown-label": (_unknown_label_file, BadInputError, r"unknown label 'zebra'; the store's labels are \['a', 'b', 'c'\]"),
    "missing-label": (_missing_label_file, BadInputError, r"label array 'y' not found"),
    "empty": (_empty_file, BadInputError, r"empty input"),
    "duplicate-ids": (_duplicate_ids_file, BadInputError, r"row 8: duplicate id 'd2'"),
    "existing-id": (_existing_id_file, BadInputError, r"id 'r07' is already in the private set"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("case", sorted(BAD_VECTOR_INPUTS))
def test_bad_input_leaves_store_untouched(vstore, tmp_path, case):
    make, exc, msg = BAD_VECTOR_INPUTS[case]
    path = make(tmp_path)
    before = snapshot(vstore)
    files_before = sorted(p.relative_to(vstore).as_posix() for p in vstore.rglob("zarr.json"))
    with pytest.raises(exc, match=msg):
        embed_into_store(path, store_path=vstore, role="private", batch_rows=4)
    if case == "nan":  # two batches were read before the bad row: buffered (whole chunks only) or written past
        # n_rows, never visible
        assert 20 <= FeatureStore.open(vstore).group("private")["features"].shape[0] <= 28
    assert snapshot(vstore) == before
    assert sorted(p.relative_to(vstore).as_posix() for p in vstore.rglob("zarr.json")) == files_before
    # the store still takes a good append afterwards, overwriting whatever was left past n_rows
    good = write_npz(tmp_path / "good.npz", rng_vectors(5, 6, 11), y=list("abcab"), ids=[f"g{i}" for i in range(5)])
    assert embed_into_store(good, store_path=vstore, batch_rows=2).rows_added == 5
    s = FeatureStore.open(vstore)
    assert s.n_rows() == 25 and s.record_ids().tolist()[-5:] == [f"g{i}" for i in range(5)]
    np.testing.assert_allclose(np.linalg.norm(s.read("private", "features"), axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("case", ["nan", "zero", "empty", "duplicate-ids", "missing-label"])
def test_bad_input_into_a_new_store_leaves_nothing(tmp_path, case):
    make, exc, msg = BAD_VECTOR_INPUTS[case]
    path = make(tmp_path)
    with pytest.raises(exc, match=msg):
        embed_into_store(path, store_path=tmp_path / "new.zarr", extractor="vectors", batch_rows=4,
                         label_names=["a"])  # declared, so the check for the bad input is what fires
    assert not (tmp_path / "new.zarr").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".new.zarr")]


@pytest.mark.parametrize("rid, uid, what", [("r01\x00", "u9", "record id 'r01\\x00'"),
                                             ("\x00", "u9", "record id '\\x00'"),
                                             ("n1", "u\n9", "user id 'u\\n9'")])
def test_an_id_with_a_control_character_is_refused_and_the_store_left_as_it_was(vstore, tmp_path, rid, uid, what):
    """Review 37, F1: the store keeps ids as fixed-width Unicode, which drops trailing NULs, so "r01\x00" was
    accepted as new and stored as a second live r01 under another user (every later serve refused until both were
    erased); an id of NULs alone became "", the id erased rows carry. Control characters in ids are refused (exit 2),
    the store left as it was; the library's append refuses them too."""
    pq.write_table(pa.table({"vector": pa.array(rng_vectors(2, 6, 5).tolist()), "label": ["a", "b"],
                             "id": ["ok1", rid], "user": ["u1", uid]}), tmp_path / "bad.parquet")
    before = snapshot(vstore)
    with pytest.raises(BadInputError, match=re.escape(f"bad.parquet: row 2: {what} holds the control character U+00")):
        embed_into_store(tmp_path / "bad.parquet", store_path=vstore, id_column="id", user_column="user")
    assert snapshot(vstore) == before
    st = FeatureStore.open(vstore, mode="a")
    with pytest.raises(BadInputError, match="control character"):
        st.append("private", rng_vectors(1, 6, 6), labels=[0], record_ids=[rid], user_ids=[uid])
    assert snapshot(vstore) == before


def test_unreadable_image_leaves_store_untouched(tmp_path):
    for cls in ("a", "b"):
        for i in range(3):
            (tmp_path / "imgs" / cls).mkdir(parents=True, exist_ok=True)
            noise = np.random.default_rng(i).integers(0, 255, (28, 28), dtype=np.uint8)
            Image.fromarray(noise).save(tmp_path / "imgs" / cls / f"{i}.png")
    embed_into_store(tmp_path / "imgs", store_path=tmp_path / "s.zarr", extractor="hog", label_names=["a", "b"])
    before = snapshot(tmp_path / "s.zarr")
    (tmp_path / "more" / "b").mkdir(parents=True)
    Image.fromarray(np.random.default_rng(9).integers(0, 255, (28, 28), dtype=np.uint8)).save(
        tmp_path / "more" / "b" / "0.png")
    (tmp_path / "more" / "b" / "1.png").write_bytes(b"\x89PNG truncated")
    with pytest.raises(BadInputError, match=r"cannot read image .*more/b/1\.png"):
        embed_into_store(tmp_path / "more", store_path=tmp_path / "s.zarr", batch_rows=1)
    assert snapshot(tmp_path / "s.zarr") == before


def test_non_utf8_text_and_missing_label_column(tmp_path, minilm):
    write_csv(tmp_path / "p.csv", [("fine text", "x")], ["text", "label"])
    embed_into_store(tmp_path / "p.csv", store_path=tmp_path / "s.zarr", extractor=minilm, label_names=["x"])
    before = snapshot(tmp_path / "s.zarr")
    (tmp_path / "bad.csv").write_bytes(b"text,label\nok,x\nna\xefve,x\n")
    with pytest.raises(BadInputError, match=r"row 2 \(line 3\), column 'text': not valid UTF-8"):
        embed_into_store(tmp_path / "bad.csv", store_path=tmp_path / "s.zarr", extractor=minilm, batch_rows=1)
    write_csv(tmp_path / "nolabel.csv", [("t",)], ["text"])
    with pytest.raises(BadInputError, match=r"label column 'label' not found .* columns present: text"):
        embed_into_store(tmp_path / "nolabel.csv", store_path=tmp_path / "s.zarr", extractor=minilm)
    assert snapshot(tmp_path / "s.zarr") == before


def test_blank_image_is_a_zero_hog_vector(tmp_path):
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    Image.fromarray(np.full((28, 28), 200, dtype=np.uint8)).save(tmp_path / "imgs" / "a" / "blank.png")
    with pytest.raises(BadInputError, match=r"row 1 \(id 'imgs/a/blank.png'\): zero vector"):
        embed_into_store(tmp_path / "imgs", store_path=tmp_path / "s.zarr", extractor="hog", label_names=["a"])
    assert not (tmp_path / "s.zarr").exists()


def test_refuses_other_extractor_or_foreign_folder(vstore, tmp_path):
    p = write_npz(tmp_path / "x.npz", rng_vectors(2, 6), y=["a", "b"])
    with pytest.raises(StoreError, match="vectors:precomputed, not vectors:other-encoder"):
        embed_into_store(p, store_path=vstore, extractor="vectors", model="other-encoder")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(StoreError, match="not an indknn feature store"):
        embed_into_store(p, store_path=tmp_path / "junk", extractor="vectors")


# -- CLI ------------------------------------------------------------------------------
def test_cli_embed_prints_one_json_line(tmp_path, minilm):
    runner = CliRunner()
    write_csv(tmp_path / "p.csv", [("p1", "Stocks fell", "Business"), ("p2", "Team won", "Sports")],
              ["id", "text", "label"])
    store = tmp_path / "s.zarr"
    result = runner.invoke(app, ["embed", str(tmp_path / "p.csv"), "--store", str(store), "--id-column", "id",
                                 "--device", "cpu", "--label-names", "Business,Sports"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out == {"store": str(store), "role": "private", "rows_added": 2, "rows_skipped": 0, "d": 384,
                   "extractor": minilm.info.as_dict(), "operator_only": "operator-only: rows_added and rows_skipped "
                                                                         "are exact counts of private rows"}
    assert "{" not in result.stderr  # the progress bar and messages only
    # a query batch through stdin
    result = runner.invoke(app, ["embed", "-", "--store", str(store), "--role", "query", "--device", "cpu"],
                           input="text\nShares dropped\n")
    assert result.exit_code == 0, result.stderr
    q = json.loads(result.stdout)
    assert q["role"] == "query" and q["rows_added"] == 1 and q["batch"].startswith("q-")


def test_cli_errors_go_to_stderr_with_exit_code_2(vstore, tmp_path):
    runner = CliRunner()
    bad = _unknown_label_file(tmp_path)
    before = snapshot(vstore)
    result = runner.invoke(app, ["embed", str(bad), "--store", str(vstore)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "Error:" in result.stderr and "zebra" in result.stderr
    assert snapshot(vstore) == before
    result = runner.invoke(app, ["embed", str(bad), "--store", str(vstore), "--if-exists", "maybe"])
    assert result.exit_code == 2 and "--if-exists" in result.stderr and result.stdout == ""


def test_cli_store_from_environment(tmp_path):
    runner = CliRunner()
    p = write_npz(tmp_path / "v.npz", rng_vectors(3, 4), y=[0, 1, 0])
    env_store = tmp_path / "from-env.zarr"
    result = runner.invoke(app, ["embed", str(p), "--extractor", "vectors", "--label-names", "0,1,2"],
                           env={"INDKNN_STORE": str(env_store)})
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["store"] == str(env_store)
    assert FeatureStore.open(env_store).label_names == ["0", "1", "2"]


def test_real_pipe_into_a_json_reader(tmp_path):
    """`indknn embed … | <reader of the JSON line>` in real processes."""
    p = write_npz(tmp_path / "v.npz", rng_vectors(6, 5), y=list("xyxyxy"))
    store = tmp_path / "piped.zarr"
    reader = ("import json, sys; lines = sys.stdin.read().splitlines(); assert len(lines) == 1, lines; "
              "d = json.loads(lines[0]); print(d['store'], d['rows_added'], d['d'])")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = (f"'{sys.executable}' -m indknn_cli embed '{p}' --store '{store}' --extractor vectors --label-names x,y "
           f"| '{sys.executable}' -c \"{reader}\"")
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(store), "6", "5"]
    assert FeatureStore.open(store).n_rows() == 6


def test_label_names_with_commas_are_given_as_a_json_list(tmp_path):
    """Review 31 QA (LOW): a class name holding a comma could not be declared with --label-names a,b,c."""
    runner = CliRunner()
    p = write_npz(tmp_path / "c.npz", rng_vectors(4, 6), y=["a, b", "c", "a, b", "c"], ids=["c0", "c1", "c2", "c3"])
    res = runner.invoke(app, ["embed", str(p), "--store", str(tmp_path / "c.zarr"), "--extractor", "vectors",
                              "--label-names", '["a, b", "c"]'])
    assert res.exit_code == 0, res.stderr
    assert FeatureStore.open(tmp_path / "c.zarr").label_names == ["a, b", "c"]
    for bad in ('["a, b", 3]', '["a, b"'):
        res = runner.invoke(app, ["embed", str(p), "--store", str(tmp_path / "d.zarr"), "--extractor", "vectors",
                                  "--label-names", bad])
        assert res.exit_code == 2 and "--label-names" in res.stderr and not (tmp_path / "d.zarr").exists()


def test_the_library_refuses_ids_with_surrounding_whitespace(vstore):
    """Review 39, F1: `delete` and `account` trim the ids asked for (as `embed`'s readers trim the ids they read),
    so a store made through the library with ids "a" and "a " had `delete --record "a "` erase "a", another person,
    and `account --record "a "` show "a"'s figures. The library's append refuses such ids (Unicode spaces too)."""
    st = FeatureStore.open(vstore, mode="a")
    before = snapshot(vstore)
    for rid, uid in (("a ", "u1"), (" a", "u1"), ("b\u2003", "u1"), ("c", "u1 "), ("d", "\u00a0u1")):
        with pytest.raises(BadInputError, match="starts or ends with whitespace"):
            st.append("private", rng_vectors(1, 6, 7), labels=[0], record_ids=[rid], user_ids=[uid])
    assert snapshot(vstore) == before


@pytest.mark.parametrize("names, why", [('["a", "\\ud800"]', "not valid Unicode"), ('["a", "abstain"]', "abstention"),
                                        ('["a", "b\\u200b"]', "control or invisible")])
def test_label_names_that_would_break_serving_or_look_like_another_are_refused(tmp_path, names, why):
    """Review 40, M4/L5: a lone surrogate in --label-names made a store every serve failed on (UnicodeEncodeError);
    "abstain" is the label name of an abstention; "b\\u200b" looks like "b"."""
    runner = CliRunner()
    p = write_npz(tmp_path / "c.npz", rng_vectors(2, 6), y=["a", "a"], ids=["c0", "c1"])
    res = runner.invoke(app, ["embed", str(p), "--store", str(tmp_path / "c.zarr"), "--extractor", "vectors",
                              "--label-names", names])
    assert res.exit_code == 2 and why in res.stderr and not (tmp_path / "c.zarr").exists(), res.stderr


def test_ids_with_invisible_characters_are_refused(vstore):
    """Review 40, L4: "x\\u200b" (zero-width space), a direction mark or a C1 control made an id that looks like
    another ("x") and that `account --record x` could not find."""
    st = FeatureStore.open(vstore, mode="a")
    before = snapshot(vstore)
    for rid in ("x\u200b", "x\u200f", "x\x85y", "\ufeffx"):
        with pytest.raises(BadInputError, match="control or invisible character"):
            st.append("private", rng_vectors(1, 6, 8), labels=[0], record_ids=[rid], user_ids=["u1"])
    assert snapshot(vstore) == before
