"""Malformed inputs across the commands: documented exit code, a clear message, nothing written.

One table (``CASES``) drives the test and the documentation: every row runs the
real CLI (``CliRunner``, separate stdout/stderr) on a copy of a small world (a
vectors store with 60 private records and a served query batch, its ledger, a
second store with its own ledger), and checks

* the exit code (2 bad input / usage, 1 runtime — ``indknn_cli/errors.py``),
* stderr carries ``Error:`` and the case's keyword; stdout is empty,
* NOTHING was written: every file and folder under the test's folder has the same
  path and the same sha256 before and after.

``docs/BAD_INPUT.md`` is generated from the same table with the messages the CLI
actually printed::

    .venv/bin/python -m tests.test_bad_inputs docs/BAD_INPUT.md
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from indknn_cli.cli.app import app
from indknn_cli.embedding import embed_into_store, embed_query_file
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "BAD_INPUT.md"
D = 8
runner = CliRunner()


# -- the world -----------------------------------------------------------------------
def build_world(root: Path) -> Path:
    """store s.zarr (60 private, d=8, labels a/b/c, batch q1 served), ledger L; other.zarr with ledger L2."""
    root.mkdir(parents=True, exist_ok=True)
    x, y, _ = clustered(60, D, 3, seed=5)
    np.savez(root / "priv.npz", x=x, y=np.array(list("abc"))[y], ids=np.array([f"r{i:03d}" for i in range(60)]),
             users=np.array([f"u{i % 7}" for i in range(60)]))
    embed_into_store(root / "priv.npz", store_path=root / "s.zarr", extractor="vectors", label_names=["a", "b", "c"])
    q, _, _ = clustered(12, D, 3, seed=6)
    np.save(root / "q.npy", q)
    embed_query_file(root / "q.npy", store_path=root / "s.zarr", batch="q1", device="cpu")
    np.save(root / "q2.npy", q[::-1].copy())
    embed_query_file(root / "q2.npy", store_path=root / "s.zarr", batch="q2", device="cpu")
    params = make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100)
    build_index(store_path=root / "s.zarr", ledger_path=root / "L", params=params)
    serve_queries(store_path=root / "s.zarr", ledger_path=root / "L", query_batch="q1", seed=1, device="cpu")
    embed_into_store(root / "priv.npz", store_path=root / "other.zarr", extractor="vectors",
                     label_names=["a", "b", "c"])
    build_index(store_path=root / "other.zarr", ledger_path=root / "L2", params=params)
    embed_query_file(root / "q.npy", store_path=root / "other.zarr", batch="oq", device="cpu")
    serve_queries(store_path=root / "other.zarr", ledger_path=root / "L2", query_batch="oq", seed=2, device="cpu")
    return root


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under root (folders too) → sha256 of its bytes ('dir' for folders, 'link:' and its target for a
    symbolic link, 'fifo' for a named pipe: neither is read)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif stat.S_ISFIFO(p.lstat().st_mode):
            out[rel] = "fifo"
        else:
            out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- input makers (each returns nothing; writes into the world folder w) ------------
def npz(w: Path, name: str, x, y=None, ids=None, users=None) -> str:
    arrays = {"x": np.asarray(x)}
    for k, v in (("y", y), ("ids", ids), ("users", users)):
        if v is not None:
            arrays[k] = np.asarray(v)
    np.savez(w / name, **arrays)
    return str(w / name)


def vecs(n: int, d: int = D, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d))


def with_row(x: np.ndarray, row: int, value) -> np.ndarray:
    x = x.copy()
    x[row] = value
    return x


def set_snapshot_meta(w: Path, ledger: str, **changes) -> None:
    path = _snapshot(w / ledger)
    t = pq.read_table(path)
    meta = json.loads(t.schema.metadata[b"indknn"])
    meta.update(changes)
    pq.write_table(t.replace_schema_metadata({b"indknn": json.dumps(meta).encode()}), path)


def _snapshot(ledger: Path) -> Path:
    gen = json.loads((ledger / "CURRENT").read_text())["generation"]
    return ledger / f"snapshot-{gen:06d}.parquet"


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])


def set_store_attr(w: Path, store: str, **changes) -> None:
    p = w / store / "zarr.json"
    meta = json.loads(p.read_text())
    meta["attributes"].update(changes)
    p.write_text(json.dumps(meta))


def broken_images(w: Path) -> str:
    for cls in ("a", "b"):
        (w / "imgs" / cls).mkdir(parents=True)
        for i in range(2):
            img = np.random.default_rng(i).integers(0, 255, (28, 28), dtype=np.uint8)
            Image.fromarray(img).save(w / "imgs" / cls / f"{i}.png")
    (w / "imgs" / "b" / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return str(w / "imgs")


def first_event(w: Path, ledger: str = "L") -> Path:
    return sorted((w / ledger / "events").glob("*.parquet"))[0]


# -- the table -------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    command: str
    what: str                                  # the malformed input, in words (docs)
    args: Callable[[Path], list[str]]          # prepares the input under w, returns the CLI arguments
    code: int
    keyword: str                               # must appear in stderr
    behaviour: str = "refused before anything is written"
    stdin: str | None = None
    env: dict[str, str] | None = None            # environment settings for the run (as a cron job would set them)


def S(w):  # noqa: N802 - short helpers for the table
    return ["--store", str(w / "s.zarr")]


def SL(w, ledger="L"):  # noqa: N802
    return ["--store", str(w / "s.zarr"), "--ledger", str(w / ledger)]


def INDEX(w, *extra):  # noqa: N802 - a fresh ledger with otherwise valid parameters
    return ["index", "--store", str(w / "s.zarr"), "--ledger", str(w / "new-ledger"), *extra]


CASES: list[Case] = [
    # ---------------------------------------------------------------- embed
    Case("embed-nan", "embed", "a NaN in one vector (.npz)",
         lambda w: ["embed", npz(w, "in.npz", with_row(vecs(5), 3, np.nan), y=list("abcab"),
                                 ids=[f"n{i}" for i in range(5)]), *S(w)], 2, "NaN",
         "refused, naming the row and id; the store is unchanged"),
    Case("embed-inf", "embed", "an infinite value in one vector",
         lambda w: ["embed", npz(w, "in.npz", with_row(vecs(5), 1, np.inf), y=list("abcab"),
                                 ids=[f"i{i}" for i in range(5)]), *S(w)], 2, "infinite"),
    Case("embed-zero", "embed", "an all-zero vector (cannot be L2-normalised)",
         lambda w: ["embed", npz(w, "in.npz", with_row(vecs(5), 2, 0.0), y=list("abcab"),
                                 ids=[f"z{i}" for i in range(5)]), *S(w)], 2, "zero vector"),
    Case("embed-wrong-d", "embed", "vectors of another dimension than the store's (d=5 into d=8)",
         lambda w: ["embed", npz(w, "in.npz", vecs(4, 5), y=list("abca"), ids=[f"d{i}" for i in range(4)]), *S(w)],
         2, "d=8"),
    Case("embed-ragged", "embed", "JSON lines whose vectors have different lengths",
         lambda w: ["embed", _jsonl(w, [{"vector": [1, 2, 3, 4, 5, 6, 7, 8], "label": "a"},
                                        {"vector": [1, 2, 3], "label": "b"}]), *S(w)], 2, "d=3"),
    Case("embed-vector-strings", "embed", "JSON lines whose vector holds numbers as strings (\"0.5\")",
         lambda w: ["embed", _jsonl(w, [{"vector": ["0.5"] * 8, "label": "a"}]), *S(w)], 2, "not a number",
         "refused (before: read as numbers)"),
    Case("embed-vector-bools", "embed", "JSON lines whose vector mixes true/false with numbers",
         lambda w: ["embed", _jsonl(w, [{"vector": [1, 2, 3, True, 5, 6, 7, 8], "label": "a"}]), *S(w)], 2,
         "a bool (True) in the vector", "refused (before: true read as 1)"),
    Case("embed-jsonl-bool-id", "embed", "JSON lines whose record id is true (a boolean)",
         lambda w: ["embed", _jsonl(w, [{"vector": [1, 2, 3, 4, 5, 6, 7, 8], "label": "a", "id": "j0"},
                                        {"vector": [8, 7, 6, 5, 4, 3, 2, 1], "label": "b", "id": True}]),
                    *S(w), "--id-column", "id"], 2, "row 2, column 'id': a boolean (true) is not an id",
         "refused (review 66; before: stored as the id \"True\")"),
    Case("embed-jsonl-object-user", "embed", "JSON lines whose user id is an object ({\"a\": 1})",
         lambda w: ["embed", _jsonl(w, [{"vector": [1, 2, 3, 4, 5, 6, 7, 8], "label": "a", "id": "j0",
                                         "user": {"a": 1}}]), *S(w), "--id-column", "id", "--user-column", "user"],
         2, "an object is not an id", "refused (review 66; before: stored as the user id \"{'a': 1}\")"),
    Case("embed-npz-id-array-misnamed", "embed", "an .npz whose ids are in an array named `id` (read from `ids`)",
         lambda w: ["embed", _npz_raw(w, "in.npz", x=vecs(3), y=np.array(["a", "b", "a"]),
                                      id=np.array(["m0", "m1", "m2"])), *S(w)], 2, "array 'id' is not read",
         "refused naming --id-column (review 63; before: ignored, the records got generated ids)"),
    Case("embed-label-out-of-range", "embed", "a label that is not one of the store's labels",
         lambda w: ["embed", npz(w, "in.npz", vecs(3), y=["a", "zebra", "b"], ids=["k0", "k1", "k2"]), *S(w)],
         2, "unknown label 'zebra'"),
    Case("embed-private-no-label-names", "embed", "private rows into a new store without --label-names",
         lambda w: ["embed", npz(w, "in.npz", vecs(3), y=["a", "b", "zeta"]), "--store", str(w / "new.zarr"),
                    "--extractor", "vectors"], 2, "needs --label-names",
         "refused; no store is created (the class list is declared, never read from private rows)"),
    Case("embed-vectors-new-store-no-extractor", "embed", "an .npz into a new store without --extractor (text)",
         lambda w: ["embed", npz(w, "in.npz", vecs(3), y=["a", "b", "c"]), "--store", str(w / "new.zarr"),
                    "--label-names", "a,b,c"], 2, "give --extractor vectors",
         "refused; no store is created (review 66; before: \"this store's extractor takes text input\")"),
    Case("embed-vector-column-new-store-no-extractor", "embed",
         "JSON lines with a `vector` and no `text` column into a new store without --extractor",
         lambda w: ["embed", _jsonl(w, [{"vector": [1, 2, 3, 4, 5, 6, 7, 8], "label": "a"}]), "--store",
                    str(w / "new.zarr"), "--label-names", "a,b,c"], 2, "give --extractor vectors",
         "refused; no store is created (review 66; before: \"text column 'text' not found\")"),
    Case("embed-label-not-in-names", "embed", "numeric label 7 with --label-names 0,1,2 (new store)",
         lambda w: ["embed", npz(w, "in.npz", vecs(3), y=[0, 7, 1]), "--store", str(w / "new.zarr"),
                    "--extractor", "vectors", "--label-names", "0,1,2"], 2, "unknown label '7'",
         "refused; no store is created"),
    Case("embed-duplicate-ids", "embed", "the same record id twice in one input",
         lambda w: ["embed", npz(w, "in.npz", vecs(4), y=list("abca"), ids=["x0", "x1", "x2", "x1"]), *S(w)],
         2, "duplicate id 'x1'"),
    Case("embed-control-char-id", "embed", "a record id ending in a NUL character (\"r007\\u0000\", JSON lines)",
         lambda w: ["embed", _jsonl(w, [{"vector": [1, 2, 3, 4, 5, 6, 7, 8], "label": "a", "id": "r007\u0000"}]),
                    *S(w)], 2, "holds the control character U+0000",
         "refused before anything is written (the store's fixed-width ids would drop the NUL: a second r007)"),
    Case("embed-scheduler-not-an-address", "embed", "--scheduler notaurl (no scheme or port)",
         lambda w: ["embed", npz(w, "in.npz", vecs(2), y=list("ab"), ids=["e0", "e1"]), *S(w), "--scheduler",
                    "notaurl"], 2, "is not a Dask scheduler address",
         "refused at once (before: a 20 s wait, exit 1, and a traceback from Client.__del__)"),
    Case("embed-existing-id", "embed", "a record id that is already in the store",
         lambda w: ["embed", npz(w, "in.npz", vecs(2), y=list("ab"), ids=["e0", "r007"]), *S(w)], 2,
         "already in the private set", "refused (use --if-exists skip to skip such rows)"),
    Case("embed-empty", "embed", "an input with no rows (empty .npz arrays)",
         lambda w: ["embed", npz(w, "in.npz", np.zeros((0, D)), y=np.array([], str)), *S(w)], 2, "empty"),
    Case("embed-empty-file", "embed", "a 0-byte input file",
         lambda w: ["embed", _touch(w / "in.parquet"), *S(w)], 2, "empty input"),
    Case("embed-truncated-parquet", "embed", "a truncated Parquet input",
         lambda w: ["embed", _truncated_parquet(w), *S(w)], 2, "Parquet"),
    Case("embed-non-utf8", "embed", "a JSON lines input with bytes that are not UTF-8",
         lambda w: ["embed", _write_bytes(w / "in.jsonl", b'{"vector": [1,2,3,4,5,6,7,8], "label": "a", '
                                          b'"id": "caf\xe9"}\n'), *S(w), "--id-column", "id"], 2, "UTF-8"),
    Case("embed-broken-image", "embed", "a folder of images with one unreadable (truncated) PNG",
         lambda w: ["embed", broken_images(w), "--store", str(w / "img.zarr"), "--extractor", "hog",
                    "--label-names", "a,b"], 2,
         "cannot read image", "refused, naming the file; no store is created"),
    Case("embed-query-no-store", "embed", "--role query into a folder without a store",
         lambda w: ["embed", _save_npy(w / "in.npy", vecs(2)), "--role", "query", "--store", str(w / "none.zarr")],
         2, "no feature store here"),
    Case("embed-foreign-folder", "embed", "--store pointing at a non-empty folder that is not a store",
         lambda w: ["embed", npz(w, "in.npz", vecs(2), y=list("ab")), "--store", _foreign_folder(w)], 2,
         "not an indknn feature store"),
    Case("embed-newer-store", "embed", "a store written by a newer indknn (format_version 99)",
         lambda w: (set_store_attr(w, "s.zarr", format_version=99),
                    ["embed", npz(w, "in.npz", vecs(2), y=list("ab")), *S(w)])[1], 2, "format_version 99"),
    Case("embed-truncated-zarr-json", "embed", "a store whose root zarr.json is truncated",
         lambda w: (truncate(w / "s.zarr" / "zarr.json", 40),
                    ["embed", npz(w, "in.npz", vecs(2), y=list("ab")), *S(w)])[1], 2, "Zarr"),
    Case("embed-bad-role", "embed", "an unknown --role",
         lambda w: ["embed", npz(w, "in.npz", vecs(2), y=list("ab")), *S(w), "--role", "secret"], 2, "--role"),
    Case("embed-query-label-names", "embed", "--role query with --label-names a,b,c (queries carry no labels)",
         lambda w: ["embed", _save_npy(w / "in.npy", vecs(2)), "--role", "query", "--label-names", "a,b,c",
                    "--batch-id", "lnq", *S(w)], 2, "--label-names applies to",
         "refused (review 66; before: ignored without a word)"),
    Case("embed-batch-id-control-char", "embed", "--role query --batch-id with a tab (\"a\\tb\")",
         lambda w: ["embed", _save_npy(w / "in.npy", vecs(2)), "--role", "query", "--batch-id", "a\tb", *S(w)],
         2, "holds the control character U+0009", "refused, as control characters in record ids are (review 66)"),
    # ---------------------------------------------------------------- index
    Case("index-eps-zero", "index", "--eps 0", lambda w: INDEX(w, "--eps", "0"), 2, "epsilon"),
    Case("index-eps-negative", "index", "--eps -1", lambda w: INDEX(w, "--eps", "-1"), 2, "epsilon"),
    Case("index-eps-nan", "index", "--eps nan", lambda w: INDEX(w, "--eps", "nan"), 2, "epsilon"),
    Case("index-delta-one", "index", "--delta 1 (δ ≥ 1)", lambda w: INDEX(w, "--eps", "1", "--delta", "1"), 2,
         "delta"),
    Case("index-delta-zero", "index", "--delta 0", lambda w: INDEX(w, "--eps", "1", "--delta", "0"), 2, "delta"),
    Case("index-tau-above", "index", "--tau 1.2 (cosine κ ≤ 1: nobody could ever be a candidate)",
         lambda w: INDEX(w, "--eps", "1", "--tau", "1.2"), 2, "tau"),
    Case("index-tau-zero", "index", "--tau 0 (every record a candidate of every query)",
         lambda w: INDEX(w, "--eps", "1", "--tau", "0"), 2, "tau"),
    Case("index-tau-rbf-negative", "index", "--kernel rbf --tau -0.5 (RBF κ ∈ (0, 1])",
         lambda w: INDEX(w, "--eps", "1", "--kernel", "rbf", "--tau", "-0.5"), 2, "tau"),
    Case("index-nu-zero", "index", "--kernel rbf --nu 0",
         lambda w: INDEX(w, "--eps", "1", "--kernel", "rbf", "--nu", "0"), 2, "nu"),
    Case("index-rerun-other-unit", "index", "re-run on the existing ledger with --privacy-unit user --tau 0.9",
         lambda w: ["index", "--store", str(w / "s.zarr"), "--ledger", str(w / "L"), "--privacy-unit", "user",
                    "--tau", "0.9"], 2, "differs from the ledger's",
         "refused (before: exit 0, the flags dropped; the ledger stayed record-level)"),
    Case("index-tune-with-tau", "index", "--tune public with --tau 0.3 (what the tuning chooses)",
         lambda w: INDEX(w, "--eps", "1", "--tune", "public", "--tau", "0.3"), 2, "is what --tune chooses",
         "refused (before: --tau dropped without a word)"),
    Case("index-user-for-missing-record-unit", "index", "--user-for-missing record on a new record-unit ledger",
         lambda w: INDEX(w, "--eps", "1", "--tau", "0.3", "--user-for-missing", "record"), 2, "needs --privacy-unit user",
         "refused (before: exit 0, the flag ignored; review 69, F6)"),
    Case("index-tune-user-for-missing", "index", "--tune private with --user-for-missing record",
         lambda w: INDEX(w, "--eps", "1", "--tune", "private", "--user-for-missing", "record"), 2,
         "needs --privacy-unit user", "refused (before: exit 0, the flag ignored: the tuned ledger is per record)"),
    Case("index-seed-negative", "index", "--kind lsh --index-seed -1",
         lambda w: INDEX(w, "--eps", "1", "--kind", "lsh", "--index-seed", "-1"), 2, "--index-seed must be",
         "refused before anything is written (before: \"Internal error: ValueError\", exit 1)"),
    Case("index-tune-method-unknown", "index", "--tune private --tune-method grid",
         lambda w: INDEX(w, "--eps", "1", "--tune", "private", "--tune-method", "grid"), 2, "--tune-method"),
    Case("index-tune-runs-with-exp-mech", "index", "--tune private --tune-runs 3 (the default exp-mech has no runs)",
         lambda w: INDEX(w, "--eps", "1", "--tune", "private", "--tune-runs", "3"), 2, "random-search"),
    Case("index-sigma1-too-small", "index", "--sigma1 0.5: one count charge 1/(2σ1²) exceeds B",
         lambda w: INDEX(w, "--eps", "1", "--sigma1", "0.5"), 2, "sigma1"),
    Case("index-planned-zero", "index", "--planned-queries 0", lambda w: INDEX(w, "--eps", "1", "--planned-queries",
                                                                             "0"), 2, "planned"),
    Case("index-k-min-zero", "index", "--k-min 0", lambda w: INDEX(w, "--eps", "1", "--k-min", "0"), 2, "k_min"),
    # issue 16 §4: every privacy parameter finite and inside its documented range (accounting.PARAM_RANGES)
    Case("index-sigma2-tiny", "index", "--sigma2 1e-300 (σ2² underflows: the first serve would write NaN spent)",
         lambda w: INDEX(w, "--eps", "1", "--sigma2", "1e-300"), 2, "sigma2"),
    Case("index-sigma2-inf", "index", "--sigma2 inf", lambda w: INDEX(w, "--eps", "1", "--sigma2", "inf"), 2,
         "sigma2"),
    Case("index-sigma1-nan", "index", "--sigma1 nan", lambda w: INDEX(w, "--eps", "1", "--sigma1", "nan"), 2,
         "sigma1"),
    Case("index-k-min-inf", "index", "--k-min inf (would release K = Infinity, not JSON)",
         lambda w: INDEX(w, "--eps", "1", "--k-min", "inf"), 2, "k_min"),
    Case("index-k-min-huge", "index", "--k-min 1e300", lambda w: INDEX(w, "--eps", "1", "--k-min", "1e300"), 2,
         "k_min"),
    Case("index-eps-huge", "index", "--eps 1e308", lambda w: INDEX(w, "--eps", "1e308"), 2, "epsilon"),
    Case("index-eps-tiny", "index", "--eps 1e-300", lambda w: INDEX(w, "--eps", "1e-300"), 2, "epsilon"),
    Case("index-eps-inf", "index", "--eps inf", lambda w: INDEX(w, "--eps", "inf"), 2, "epsilon"),
    Case("index-delta-large", "index", "--delta 0.5 (above the documented 0.1)",
         lambda w: INDEX(w, "--eps", "1", "--delta", "0.5"), 2, "delta"),
    Case("index-nu-inf", "index", "--kernel rbf --nu inf",
         lambda w: INDEX(w, "--eps", "1", "--kernel", "rbf", "--nu", "inf"), 2, "nu"),
    Case("index-planned-huge", "index", "--planned-queries 10000000000 (above 1e9)",
         lambda w: INDEX(w, "--eps", "1", "--planned-queries", "10000000000"), 2, "planned"),
    Case("index-lock-timeout-nan", "index", "--lock-timeout nan (would wait forever when the lock is held)",
         lambda w: INDEX(w, "--eps", "1", "--lock-timeout", "nan"), 2, "--lock-timeout"),
    Case("index-lock-timeout-negative", "index", "--lock-timeout -1",
         lambda w: INDEX(w, "--eps", "1", "--lock-timeout", "-1"), 2, "--lock-timeout"),
    Case("embed-empty-store", "embed", "--store \"\" (an empty path)",
         lambda w: ["embed", npz(w, "in.npz", vecs(2), y=list("ab"), ids=["e0", "e1"]), "--store", ""], 2,
         "--store is empty", "refused; before, the working folder was taken as the store"),
    Case("serve-empty-store", "serve-queries", "--store \"\" (an empty path)",
         lambda w: ["serve-queries", "q1", "--store", "", "--ledger", str(w / "L")], 2, "--store is empty"),
    Case("index-into-a-data-folder", "index", "--ledger a folder that holds other files and no ledger",
         lambda w: ((w / "data").mkdir(), _write_bytes(w / "data" / "notes.txt", b"mine"),
                    ["index", "--store", str(w / "s.zarr"), "--ledger", str(w / "data"), "--eps", "1", "--tau", "0.5",
                     "--sigma2", "0.5", "--planned-queries", "10"])[2], 2,
         "files that are not a ledger's ('notes.txt')",
         "refused before anything is written (no LOCK or ledger file is added among the folder's files)"),
    Case("index-other-store-ledger", "index", "the ledger of another store (L2 with s.zarr)",
         lambda w: ["index", *SL(w, "L2")], 2, "another feature store"),
    Case("index-corrupt-current", "index", "a ledger whose CURRENT pointer is not JSON",
         lambda w: (_write_bytes(w / "L" / "CURRENT", b"\x00garbage"), ["index", *SL(w)])[1], 1, "CURRENT"),
    Case("index-empty-store", "index", "a store without private records",
         lambda w: ["index", "--store", _empty_store(w), "--ledger", str(w / "new-ledger"), "--eps", "1"], 2,
         "no private records"),
    # ---------------------------------------------------------------- serve-queries
    Case("serve-screen-setting-unknown", "serve-queries", "INDKNN_SCREEN=fp23 (a misspelt screen setting)",
         lambda w: ["serve-queries", "q2", *SL(w)], 2, "INDKNN_SCREEN must be one of",
         "refused before anything is read (before: taken as auto without a word)", env={"INDKNN_SCREEN": "fp23"}),
    Case("serve-empty-query-file", "serve-queries", "a query file with no vectors (.npy of shape (0, 8))",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", np.zeros((0, D))), *SL(w)], 2, "empty"),
    Case("serve-wrong-d", "serve-queries", "a query file of another dimension (d=5)",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", vecs(3, 5)), *SL(w)], 2, "d=8",
         "refused; no query batch is stored, nothing charged"),
    Case("serve-wrong-d-jsonl", "serve-queries", "a JSON-lines query file of another dimension (d=3)",
         lambda w: ["serve-queries", _jsonl(w, [{"id": "q1", "vector": [0.1, 0.2, 0.3]}]), *SL(w)], 2,
         "the store has d=8", "refused, naming the store's d (before: \"earlier vectors had d=8\"; review 73, F2)"),
    Case("serve-nan-query", "serve-queries", "a query vector with NaN",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", with_row(vecs(3), 0, np.nan)), *SL(w)], 2, "NaN"),
    Case("serve-zero-query", "serve-queries", "an all-zero query vector",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", with_row(vecs(3), 2, 0.0)), *SL(w)], 2, "zero vector"),
    Case("serve-unknown-batch", "serve-queries", "a stored batch name that does not exist",
         lambda w: ["serve-queries", "no-such-batch", *SL(w)], 2, "no such file"),
    Case("serve-batch-size-zero", "serve-queries", "--batch-size 0",
         lambda w: ["serve-queries", "q2", *SL(w), "--batch-size", "0"], 2, "batch-size"),
    Case("serve-max-memory-junk", "serve-queries", "--max-memory lots",
         lambda w: ["serve-queries", "q2", *SL(w), "--max-memory", "lots"], 2, "cannot read size"),
    Case("serve-max-memory-tiny", "serve-queries", "--max-memory 1M (below the 16 MiB floor)",
         lambda w: ["serve-queries", "q2", *SL(w), "--max-memory", "1M"], 2, "16 MiB"),
    Case("serve-max-memory-inf", "serve-queries", "--max-memory infG",
         lambda w: ["serve-queries", "q2", *SL(w), "--max-memory", "infG"], 2, "--max-memory"),
    Case("serve-max-memory-nan", "serve-queries", "--max-memory nanM",
         lambda w: ["serve-queries", "q2", *SL(w), "--max-memory", "nanM"], 2, "--max-memory"),
    Case("serve-lock-timeout-nan", "serve-queries", "--lock-timeout nan (would wait forever when the lock is held)",
         lambda w: ["serve-queries", "q2", *SL(w), "--lock-timeout", "nan"], 2, "--lock-timeout"),
    Case("serve-lock-timeout-inf", "serve-queries", "--lock-timeout inf",
         lambda w: ["serve-queries", "q2", *SL(w), "--lock-timeout", "inf"], 2, "--lock-timeout"),
    Case("serve-missing-ledger", "serve-queries", "--ledger pointing at a folder that does not exist",
         lambda w: ["serve-queries", "q2", *SL(w, "no-ledger")], 2, "no budget ledger",
         "refused; the folder is not created"),
    Case("serve-other-store-ledger", "serve-queries", "the ledger of another store (query file given)",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", vecs(3)), *SL(w, "L2")], 2, "another feature store",
         "refused before the query file is embedded"),
    Case("serve-newer-ledger", "serve-queries", "a ledger of a newer format_version (2)",
         lambda w: (set_snapshot_meta(w, "L", format_version=2), ["serve-queries", "q2", *SL(w)])[1], 2,
         "format_version 2"),
    Case("serve-foreign-parquet-snapshot", "serve-queries", "a random Parquet file in place of the ledger snapshot",
         lambda w: (pq.write_table(pa.table({"a": [1, 2, 3]}), _snapshot(w / "L")),
                    ["serve-queries", "q2", *SL(w)])[1], 2, "not an indknn ledger snapshot"),
    Case("serve-truncated-snapshot", "serve-queries", "a truncated ledger snapshot",
         lambda w: (truncate(_snapshot(w / "L"), -200), ["serve-queries", "q2", *SL(w)])[1], 1,
         "corrupt or truncated"),
    Case("serve-truncated-event", "serve-queries", "a truncated ledger event file",
         lambda w: (truncate(first_event(w), 100), ["serve-queries", "q2", *SL(w)])[1], 1,
         "corrupt or truncated event"),
    Case("serve-foreign-event", "serve-queries", "an event file copied from another ledger",
         lambda w: (_copy_event(w), ["serve-queries", "q2", *SL(w)])[1], 2, "another ledger"),
    Case("serve-truncated-zarr-chunk", "serve-queries", "a truncated chunk of the store's private features",
         lambda w: (truncate(w / "s.zarr" / "private" / "features" / "c" / "0" / "0", 100),
                    ["serve-queries", "q2", *SL(w)])[1], 2, "corrupt or truncated",
         "refused when the chunk is read; nothing charged"),
    Case("serve-missing-zarr-chunk", "serve-queries", "a chunk file of the store's private features removed",
         lambda w: ((w / "s.zarr" / "private" / "features" / "c" / "0" / "0").unlink(),
                    ["serve-queries", "q2", *SL(w)])[1], 2, "is missing",
         "refused before anything is charged (before: its rows read as zeros, answered, exit 0; review 73, F16)"),
    Case("serve-missing-labels-chunk", "serve-queries", "a chunk file of the store's private labels removed",
         lambda w: ((w / "s.zarr" / "private" / "labels" / "c" / "0").unlink(),
                    ["serve-queries", "q2", *SL(w)])[1], 2, "is missing",
         "refused before anything is charged (before: labels read as -1, answered, exit 0; review 73, F16)"),
    Case("serve-flipped-byte-zarr-chunk", "serve-queries", "one flipped byte in a chunk of the store's private "
         "features (issue 16 §5)", lambda w: (_flip_byte(w / "s.zarr" / "private" / "features" / "c" / "0" / "0", 37),
                                              ["serve-queries", "q2", *SL(w)])[1], 2, "crc32c checksum",
         "refused when the chunk is read (crc32c); nothing charged"),
    Case("serve-truncated-array-meta", "serve-queries", "a truncated zarr.json of a store array",
         lambda w: (truncate(w / "s.zarr" / "private" / "labels" / "zarr.json", 30),
                    ["serve-queries", "q2", *SL(w)])[1], 2, "corrupt"),
    Case("serve-content-key-array-lost", "serve-queries", "a store that records content keys without its "
         "private/content_key array (audit 5)",
         lambda w: (shutil.rmtree(w / "s.zarr" / "private" / "content_key"), ["serve-queries", "q2", *SL(w)])[1], 2,
         "content_key is missing", "refused when the store is opened; nothing charged"),
    Case("serve-batch-id-reused", "serve-queries", "--batch-id of an answered batch, for other queries",
         lambda w: ["serve-queries", "q2", *SL(w), "--batch-id", "q1"], 2, "already used"),
    Case("serve-jsonl-list-id", "serve-queries", "JSON lines queries whose id is a list ([1, 2])",
         lambda w: ["serve-queries", _jsonl(w, [{"vector": [1, 2, 3, 4, 5, 6, 7, 8], "id": [1, 2]}]), *SL(w),
                    "--id-column", "id"], 2, "a list is not an id",
         "refused; nothing charged (review 66; before: answered with the query id \"[1, 2]\")"),
    Case("serve-batch-id-control-char", "serve-queries", "--batch-id with a tab (\"a\\tb\")",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", vecs(3)), *SL(w), "--batch-id", "a\tb"], 2,
         "holds the control character U+0009",
         "refused (review 66; before: answered, the tab echoed in every answer line and the event file named a_b)"),
    Case("serve-out-missing-folder", "serve-queries", "--out into a folder that does not exist",
         lambda w: ["serve-queries", "q2", *SL(w), "--out", str(w / "no-folder" / "a.parquet")], 2,
         "does not exist", "refused before any query is answered (nothing charged)"),
    Case("serve-out-over-ledger", "serve-queries", "--out the ledger's own snapshot file",
         lambda w: ["serve-queries", "q2", *SL(w), "--out", str(w / "L" / "snapshot-000001.parquet")], 2,
         "inside the ledger's folder", "refused before any query is answered (before: charged, then the answers "
         "written over the snapshot, which repair cannot rebuild)"),
    Case("serve-out-in-store", "serve-queries", "--out a file inside the store's folder",
         lambda w: ["serve-queries", "q2", *SL(w), "--out", str(w / "s.zarr" / "answers.parquet")], 2,
         "inside the store's folder"),
    Case("serve-out-over-input", "serve-queries", "--out the query file being read",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", vecs(3)), *SL(w), "--out", str(w / "in.npy")], 2,
         "the query file being read", "refused; no query batch is stored, nothing charged"),
    Case("serve-out-named-pipe", "serve-queries", "--out a named pipe (a consumer reading the answers from it)",
         lambda w: ["serve-queries", "q2", *SL(w), "--out", _fifo(w / "answers.parquet")], 2, "is a named pipe",
         "refused before any query is answered (before: charged, then the pipe replaced by the Parquet file, exit 0; "
         "review 44)"),
    Case("serve-out-link-to-dev-null", "serve-queries", "--out a link to /dev/null (as --out /dev/null)",
         lambda w: ["serve-queries", "q2", *SL(w), "--out", _link(w / "null.parquet", os.devnull)], 2,
         "in /dev or /proc", "refused before any query is answered (before: `--out /dev/null` as root replaced "
         "the machine's /dev/null with the Parquet file, exit 0; review 44, H1)"),
    Case("serve-device-unknown", "serve-queries", "--device tpu (a query file given)",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", vecs(3)), *SL(w), "--device", "tpu"], 2,
         "is not a device", "refused before the query file is stored (before: stored, then \"Internal error: "
         "RuntimeError\", exit 1)"),
    Case("serve-scheduler-not-an-address", "serve-queries", "--scheduler notaurl",
         lambda w: ["serve-queries", "q2", *SL(w), "--scheduler", "notaurl"], 2, "is not a Dask scheduler address"),
    Case("serve-cuda-index-missing", "serve-queries", "--device cuda:0 on a machine without CUDA (a query file given)",
         lambda w: ["serve-queries", _save_npy(w / "in.npy", vecs(3)), *SL(w), "--device", "cuda:0"], 2,
         "no CUDA device", "refused before the query file is stored (before: stored, then \"Internal error\")"),
    Case("serve-scheduler-inproc", "serve-queries", "--scheduler inproc://x (no other process can reach it)",
         lambda w: ["serve-queries", "q2", *SL(w), "--scheduler", "inproc://x"], 2, "is not a Dask scheduler address",
         "refused at once (before: a wait, exit 1 and a traceback)"),
    Case("serve-cuda-missing", "serve-queries", "--device cuda on a machine without CUDA",
         lambda w: ["serve-queries", "q2", *SL(w), "--device", "cuda"], 2, "CUDA"),
    Case("serve-stdin-garbage", "serve-queries", "- with stdin that is not the JSON line of `indknn embed`",
         lambda w: ["serve-queries", "-", *SL(w)], 2, "JSON line", stdin="this is not json\n"),
    # ---------------------------------------------------------------- delete
    Case("delete-strict-unknown", "delete", "--strict with an unknown record id",
         lambda w: ["delete", *SL(w), "--record", "r001", "--record", "nobody", "--strict"], 2, "unknown id",
         "refused; not even the known id is deleted"),
    Case("delete-ids-file-non-utf8", "delete", "--ids-file with bytes that are not UTF-8",
         lambda w: ["delete", *SL(w), "--ids-file", _write_bytes(w / "ids.txt", b"r001\nr\xff02\n")], 2, "UTF-8"),
    Case("delete-ids-file-missing", "delete", "--ids-file that does not exist",
         lambda w: ["delete", *SL(w), "--ids-file", str(w / "none.txt")], 2, "no such file"),
    Case("delete-ids-file-folder", "delete", "--ids-file that is a folder",
         lambda w: ["delete", *SL(w), "--ids-file", str(w)], 2, "is a folder"),
    Case("delete-users-file-folder", "delete", "--users-file that is a folder",
         lambda w: ["delete", *SL(w), "--users-file", str(w)], 2, "is a folder"),
    Case("delete-nothing", "delete", "no --record/--user/--ids-file/--users-file",
         lambda w: ["delete", *SL(w)], 2, "nothing to delete"),
    Case("delete-empty-id", "delete", "an empty record id (--record '')",
         lambda w: ["delete", *SL(w), "--record", ""], 2, "empty record"),
    # (the ledger of another store: the erasure goes on from the store alone since review 32, not a refusal:
    # tests/test_review_31_qa.py::test_an_erasure_goes_through_whatever_the_ledger_path_holds)
    Case("delete-lock-timeout-nan", "delete", "--lock-timeout nan",
         lambda w: ["delete", *SL(w), "--record", "r001", "--lock-timeout", "nan"], 2, "--lock-timeout"),
    Case("delete-both-stdin", "delete", "--ids-file - and --users-file - together",
         lambda w: ["delete", *SL(w), "--ids-file", "-", "--users-file", "-"], 2, "both read stdin"),
    # ---------------------------------------------------------------- account
    Case("account-export-over-ledger", "account", "--export onto the ledger's snapshot file",
         lambda w: ["account", "--ledger", str(w / "L"), "--export", str(w / "L" / "snapshot-000001.parquet")], 2,
         "inside the ledger's folder", "refused (before: a read-only command replaced the snapshot)"),
    Case("account-export-named-pipe", "account", "--export a named pipe ending in .csv",
         lambda w: ["account", "--ledger", str(w / "L"), "--export", _fifo(w / "budgets.csv")], 2, "is a named pipe",
         "refused (before: the pipe replaced by the file; review 44)"),
    Case("account-plot-named-pipe", "account", "--plot a named pipe ending in .png",
         lambda w: ["account", "--ledger", str(w / "L"), "--plot", _fifo(w / "budgets.png")], 2, "is a named pipe",
         "refused (before: the pipe replaced by the picture; review 44)"),
    Case("account-queries-left-with-eps", "account", "--queries-left --eps 0.5 (two jobs' options)",
         lambda w: ["account", "--ledger", str(w / "L"), "--queries-left", "--eps", "0.5"], 2,
         "does not apply to --queries-left", "refused (before: --eps silently ignored, exit 0 where the check gives 4)"),
    Case("account-verify-with-delta", "account", "--verify --delta 1e-6 (the check reads no δ)",
         lambda w: ["account", "--ledger", str(w / "L"), "--verify", "--delta", "1e-6"], 2,
         "--delta does not apply to --verify", "refused (before: --delta silently ignored)"),
    Case("account-queries-left-with-conversion", "account", "--queries-left --conversion rdp",
         lambda w: ["account", "--ledger", str(w / "L"), "--queries-left", "--conversion", "rdp"], 2,
         "--conversion does not apply to --queries-left", "refused (before: --conversion silently ignored)"),
    Case("account-blank-record", "account", "--record made of spaces",
         lambda w: ["account", "--ledger", str(w / "L"), "--record", "   "], 2, "--record '': an empty id",
         "refused naming the option (before: \"record id '' is not in the ledger\")"),
    Case("account-max-queries-alone", "account", "--max-queries 10 without --queries-left",
         lambda w: ["account", "--ledger", str(w / "L"), "--max-queries", "10"], 2, "give --queries-left too",
         "refused (before: ignored)"),
    Case("account-plot-in-ledger", "account", "--plot inside the ledger's events folder",
         lambda w: ["account", "--ledger", str(w / "L"), "--plot", str(w / "L" / "events" / "x.png")], 2,
         "inside the ledger's folder", "refused (before: the picture was written among the ledger's events)"),
    Case("account-unknown-record", "account", "--record with an id the ledger never saw",
         lambda w: ["account", "--ledger", str(w / "L"), "--record", "nobody"], 2, "nobody"),
    Case("account-eps-negative", "account", "--eps -1", lambda w: ["account", "--ledger", str(w / "L"), "--eps",
                                                                   "-1"], 2, "epsilon"),
    Case("account-delta-above-one", "account", "--delta 1.5",
         lambda w: ["account", "--ledger", str(w / "L"), "--delta", "1.5"], 2, "delta"),
    Case("account-conversion", "account", "--conversion zcdp",
         lambda w: ["account", "--ledger", str(w / "L"), "--conversion", "zcdp"], 2, "conversion"),
    Case("account-min-active-junk", "account", "--min-active many",
         lambda w: ["account", "--ledger", str(w / "L"), "--min-active", "many"], 2, "--min-active"),
    Case("account-foreign-snapshot", "account", "a random Parquet file in place of the ledger snapshot",
         lambda w: (pq.write_table(pa.table({"a": [1]}), _snapshot(w / "L")),
                    ["account", "--ledger", str(w / "L")])[1], 2, "not an indknn ledger snapshot"),
    Case("account-verify-store-empty", "account", "--verify --store '' (an empty store path)",
         lambda w: ["account", "--ledger", str(w / "L"), "--store", "", "--verify"], 2, "--store is empty"),
    Case("account-other-store", "account", "--store of another store than the ledger's",
         lambda w: ["account", "--ledger", str(w / "L2"), "--store", str(w / "s.zarr")], 2, "another feature store"),
]


def _npz_raw(w: Path, name: str, **arrays) -> str:
    np.savez(w / name, **arrays)
    return str(w / name)


def _jsonl(w: Path, rows: list[dict]) -> str:
    (w / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(w / "in.jsonl")


def _flip_byte(p: Path, offset: int) -> None:
    data = bytearray(p.read_bytes())
    data[offset] ^= 0x01
    p.write_bytes(bytes(data))


def _fifo(p: Path) -> str:
    os.mkfifo(p)
    return str(p)


def _link(p: Path, target: str) -> str:
    p.symlink_to(target)
    return str(p)


def _touch(p: Path) -> str:
    p.write_bytes(b"")
    return str(p)


def _write_bytes(p: Path, data: bytes) -> str:
    p.write_bytes(data)
    return str(p)


def _save_npy(p: Path, x) -> str:
    np.save(p, np.asarray(x))
    return str(p)


def _truncated_parquet(w: Path) -> str:
    t = pa.table({"vector": [list(map(float, v)) for v in vecs(20)], "label": list("abcd" * 5)})
    pq.write_table(t, w / "in.parquet")
    truncate(w / "in.parquet", -60)
    return str(w / "in.parquet")


def _foreign_folder(w: Path) -> str:
    (w / "foreign").mkdir()
    (w / "foreign" / "notes.txt").write_text("not a store")
    return str(w / "foreign")


def _empty_store(w: Path) -> str:
    FeatureStore.create(w / "empty.zarr", extractor=ExtractorInfo("vectors", "precomputed", "passthrough"), dim=D,
                        label_names=["a", "b"])
    with FeatureStore.open(w / "empty.zarr", mode="a").write_lock():  # the lock file exists, as after `embed`
        pass
    return str(w / "empty.zarr")


def _copy_event(w: Path) -> None:
    """An event of ledger L2 (another ledger_uuid) dropped into L's events folder, after L's own events."""
    ev = sorted((w / "L2" / "events").glob("*.parquet"))
    seq = max(int(p.name.split("-", 1)[0]) for p in (w / "L" / "events").glob("*.parquet")) + 1
    shutil.copy(ev[0], w / "L" / "events" / f"{seq:08d}-serve-foreign.parquet")


# -- running a case ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def world_template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-input-world") / "w"
    built = Path(build_world(root))
    # each case works on a copy; the template moves away from the path its ledger records, so that a copy is not
    # a second live copy of the pair (refused since review 42: store_twins)
    return built.rename(built.parent / "template")


def run_case(case: Case, w: Path):
    args = case.args(w)
    before = tree_digest(w)
    res = runner.invoke(app, args, input=case.stdin, env=case.env)
    after = tree_digest(w)
    return res, before, after


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input_is_refused_cleanly(case, world_template, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(world_template, w)
    res, before, after = run_case(case, w)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == case.code, (res.exit_code, res.stderr)
    assert res.stdout == "", res.stdout
    assert "Error:" in res.stderr and "Internal error" not in res.stderr, res.stderr
    assert case.keyword.lower() in res.stderr.lower(), res.stderr
    assert "Traceback" not in res.stderr
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"written despite the refusal: {changed}"


def test_at_least_thirty_cases_across_every_command():
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)
    assert {c.command for c in CASES} == {"embed", "index", "serve-queries", "delete", "account"}


def test_docs_table_lists_every_case():
    text = DOC.read_text(encoding="utf-8")
    missing = [c.name for c in CASES if f"`{c.name}`" not in text]
    assert not missing, f"docs/BAD_INPUT.md is out of date (regenerate: python -m tests.test_bad_inputs): {missing}"


def test_unnormalised_vectors_are_normalised_per_vector(world_template, tmp_path):
    """Not an error: embed L2-normalises each vector on its own (SPEC §8), for every kernel."""
    w = tmp_path / "w"
    shutil.copytree(world_template, w)
    x = vecs(4) * np.array([[0.001], [1.0], [7.0], [1e4]])
    res = runner.invoke(app, ["embed", npz(w, "in.npz", x, y=list("abca"), ids=[f"s{i}" for i in range(4)]), *S(w)])
    assert res.exit_code == 0, res.stderr
    stored = FeatureStore.open(w / "s.zarr").read("private", "features")[-4:]
    np.testing.assert_allclose(np.linalg.norm(stored, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(stored, x / np.linalg.norm(x, axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


# -- docs ------------------------------------------------------------------------------------
def _first_message(stderr: str) -> str:
    text = " ".join(stderr.split())
    return text.split("Error: ", 1)[-1]  # drop any progress bar printed before the error


def write_docs(path: Path = DOC) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        built = build_world(Path(tmp) / "built")
        template = Path(built).rename(Path(tmp) / "template")  # as world_template: copies are not twins
        rows = []
        for case in CASES:
            w = Path(tmp) / case.name
            shutil.copytree(template, w)
            res, before, after = run_case(case, w)
            msg = _first_message(res.stderr).replace(str(w) + "/", "").replace(str(w), ".").replace("|", "\\|")
            rows.append(f"| `{case.name}` | `{case.command}` | {case.what} | {res.exit_code} | {msg} | "
                        f"{case.behaviour}{'' if before == after else ' **(WROTE FILES)**'} |")
    lines = [
        "# Malformed inputs: what each command does",
        "",
        "Generated by `python -m tests.test_bad_inputs` from the table the test `tests/test_bad_inputs.py` runs "
        "(edit the table, then regenerate). Every row is a real CLI run on a copy of a small world "
        "(a vectors store with 60 private records, d = 8, labels a/b/c, one served query batch; its ledger; "
        "a second store with its own ledger).",
        "",
        "For every row the test checks: the exit code (2 = bad input / usage, 1 = runtime; see "
        "`indknn_cli/errors.py`), `Error:` and the keyword in stderr, nothing on stdout, and that **no file or "
        "folder under the test's folder changed** (sha256 of every path before and after).",
        "",
        f"{len(CASES)} malformed inputs across {len({c.command for c in CASES})} commands.",
        "",
        "| case | command | malformed input | exit | message (stderr) | behaviour |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "## Accepted on purpose",
        "",
        "| input | behaviour |",
        "|---|---|",
        "| unnormalised vectors (any norm > 0), for either kernel | `embed` L2-normalises every vector on its own "
        "(a per-vector step, SPEC §8: no statistic of the private set); the cosine kernel then sees unit vectors. "
        "Tested by `test_unnormalised_vectors_are_normalised_per_vector`. |",
        "| a query file of the right dimension but any norm | normalised per vector in the same way |",
        "| `serve-queries FILE` whose answering fails later (e.g. a corrupt store chunk) | the query batch "
        "embedded from FILE stays in the store (queries are public; re-running reuses it); nothing is charged |",
        "",
        "An `embed` that fails *after* some batches were written past the committed row count leaves those "
        "bytes invisible (`n_rows` is the commit point, docs/FORMAT.md); the next append overwrites them. The "
        "inputs above are refused before any write.",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    write_docs(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
    print(f"wrote {sys.argv[1] if len(sys.argv) > 1 else DOC}")
