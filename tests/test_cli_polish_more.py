"""Issue 20, the rest: refusals leave no file behind, data-quality warnings, one `seed` type, plural wording,
typer bench commands, no bench/ shims, --batch-id everywhere, shell completion, resumable bench."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from indknn_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args, env=None, input=None):
    """The CLI in this process (fast); INDKNN_* from the caller's environment are masked."""
    base = {k: None for k in os.environ if k.startswith("INDKNN_")}
    base.update(INDKNN_WIDTH="120", COLUMNS="200")
    return runner.invoke(app, [str(a) for a in args], env={**base, **(env or {})}, input=input)


def listing(folder: Path) -> dict:
    """Every path below ``folder`` with its size and mtime: what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size if p.is_file() else 0,
                                         p.stat().st_mtime_ns if p.is_file() else 0)
            for p in sorted(folder.rglob("*"))}


# -- 1. a refused command leaves no file behind --------------------------------------------------------------

def _refusals(t: Path, s: Path, led: Path):
    return [
        ("index", "--store", s, "--ledger", t / "new" / "sub" / "L", "--eps", "-1"),
        ("index", "--store", s, "--ledger", t / "L2", "--eps", "1", "--kind", "hnsw"),
        ("index", "--store", t / "none.zarr", "--ledger", t / "L3", "--eps", "1"),
        ("index", "--store", s, "--ledger", t / "L4", "--eps", "1", "--tune", "bogus"),
        ("index", "--store", s, "--ledger", t / "L5", "--eps", "1", "--kind", "ivf", "--train-on", t / "no.npy"),
        ("index", "--store", s, "--ledger", led, "--eps", "2"),
        ("serve-queries", "q1", "--store", s, "--ledger", t / "none" / "L"),
        ("serve-queries", "nobatch", "--store", s, "--ledger", led),
        ("serve-queries", "q1", "--store", s, "--ledger", led, "--max-memory", "1K"),
        ("serve-queries", "q1", "--store", s, "--ledger", led, "--out", t / "nodir" / "a.parquet"),
        ("serve-queries", "q1", "--store", t / "none.zarr", "--ledger", led),
        ("delete", "--record", "zzz", "--strict", "--store", s, "--ledger", led),
        ("delete", "--record", "r0001", "--store", t / "none.zarr", "--ledger", t / "none" / "L"),
        ("delete", "--ids-file", t / "none.txt", "--store", s, "--ledger", led),
        ("delete", "--compact", "--store", s, "--ledger", t / "none" / "L", "--lock-timeout", "nan"),
        ("account", "--ledger", t / "none" / "L"),
        ("account", "--ledger", led, "--record", "zzz"),
        ("account", "--ledger", led, "--export", t / "x" / "y.parquet"),
        ("account", "--ledger", led, "--export", t / "y.xlsx"),
        ("account", "--ledger", led, "--plot", t / "nod" / "p.png"),
        ("account", "--ledger", led, "--store", t / "none.zarr"),
        ("repair", "--ledger", t / "none" / "L", "--store", s),
        ("repair", "--ledger", led, "--store", t / "none.zarr"),
    ]


def test_a_refused_command_leaves_no_file_behind(vector_store, tmp_path):
    s, led = vector_store.path, tmp_path / "L"
    assert invoke("index", "--store", s, "--ledger", led, "--eps", "1", "--tau", "0.5").exit_code == 0
    for args in _refusals(tmp_path, s, led):
        before = listing(tmp_path)
        res = invoke(*args)
        assert res.exit_code == 2, (args, res.exit_code, res.output)
        assert listing(tmp_path) == before, args


def test_a_ledgerless_delete_leaves_no_ledger_folder(vector_store, tmp_path):
    """The ledger lock makes the folder it locks; when no ledger is written there it is removed again."""
    res = invoke("delete", "--record", "r0001", "--store", vector_store.path, "--ledger", tmp_path / "a" / "b" / "L")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "a").exists()
    from indknn_cli.ledger import BudgetLedger

    with BudgetLedger.write_lock(tmp_path / "c" / "L", timeout=1):
        assert (tmp_path / "c" / "L" / "LOCK").exists()
    assert not (tmp_path / "c").exists()


# -- 3. `seed` has one type: int64 in the answers Parquet as in the JSON lines ------------------------------

def test_seed_is_an_integer_in_parquet_as_in_json_lines(vector_store, tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from indknn_cli.answers_out import read_answers_parquet

    s, led = vector_store.path, tmp_path / "L"
    assert invoke("index", "--store", s, "--ledger", led, "--eps", "1", "--tau", "0.5").exit_code == 0
    res = invoke("serve-queries", "q1", "--store", s, "--ledger", led, "--seed", "7")
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert lines and all(type(x["seed"]) is int and x["seed"] == 7 for x in lines)
    out = tmp_path / "a.parquet"
    assert invoke("serve-queries", "q1", "--store", s, "--ledger", led, "--seed", "7", "--out", out).exit_code == 0
    t = pq.read_table(out)
    assert t.schema.field("seed").type == pa.int64() and set(t.column("seed").to_pylist()) == {7}
    old = tmp_path / "old.parquet"  # a file of an earlier version: seed as a string
    pq.write_table(t.set_column(t.schema.get_field_index("seed"), "seed", t.column("seed").cast(pa.string())), old)
    back = read_answers_parquet(old)
    assert back.schema.field("seed").type == pa.int64() and back.equals(read_answers_parquet(out))


# -- 4. plural rules ------------------------------------------------------------------------------------------

def test_plural_wording():
    from indknn_cli.wording import count, plural_of

    assert [count(0, "record"), count(1, "record"), count(2, "record")] == ["0 records", "1 record", "2 records"]
    assert [count(1, "query"), count(3, "query"), count(2, "batch"), count(1, "record id"), count(4, "record id"),
            count(2, "day"), count(1.0, "plot"), count(2.5, "plot")] == \
        ["1 query", "3 queries", "2 batches", "1 record id", "4 record ids", "2 days", "1 plot", "2.5 plots"]
    assert plural_of("index", ) == "indexes" and count(2, "person", "people") == "2 people"


def test_messages_use_plural_rules(vector_store, tmp_path):
    s, led = vector_store.path, tmp_path / "L"
    assert invoke("index", "--store", s, "--ledger", led, "--eps", "1", "--tau", "0.5").exit_code == 0
    res = invoke("delete", "--record", "nobody", "--strict", "--store", s, "--ledger", led)
    assert res.exit_code == 2 and "1 unknown id:" in res.stderr and "(s)" not in res.stderr, res.stderr
    res = invoke("delete", "--record", "nobody", "--store", s, "--ledger", led)
    assert res.exit_code == 0 and "1 record id and 0 user ids not found" in res.stderr, res.stderr
    res = invoke("account", "--ledger", led, "--min-active", "301", "--json")
    assert res.exit_code == 3 and "only 300 records are active" in res.stderr
    import re

    src = "\n".join(p.read_text() for p in (ROOT / "indknn_cli").rglob("*.py"))
    words = {w for w in re.findall(r"(?<![\w.])([A-Za-z]{2,})\(s\)[ ;:,.)\"']", src)} - {"len", "float", "int", "str", "conv"}
    assert not words, f"use indknn_cli.wording.count, not 'record(s)': {words}"


# -- 2. data-quality warnings for the operator (stderr), never for query-senders -----------------------------

@pytest.mark.heavy
def test_embed_warns_about_empty_texts_and_thin_labels(tmp_path):
    import json

    csv = tmp_path / "t.csv"
    csv.write_text("id,text,label\n" + "".join(f"a{i},some text number {i},big\n" for i in range(6))
                   + 'e1,"   ",big\ns1,a lone record,single\n', encoding="utf-8")
    res = invoke("embed", csv, "--store", tmp_path / "s.zarr", "--label-names", "big,single")
    assert res.exit_code == 0, res.output
    err = " ".join(res.stderr.split())
    assert "1 empty text (" in err and "1 label with fewer than 5 records: 'single' (1 record)" in err, err
    assert json.loads(res.stdout)["rows_added"] == 8  # a warning, not a refusal
    csv2 = tmp_path / "u.csv"
    csv2.write_text("id,text,label\n" + "".join(f"b{i},more text {i},single\n" for i in range(4)), encoding="utf-8")
    res = invoke("embed", csv2, "--store", tmp_path / "s.zarr")
    assert res.exit_code == 0 and "fewer than" not in res.stderr and "empty" not in res.stderr, res.stderr
    res = invoke("embed", csv, "--store", tmp_path / "s2.zarr", "--label-names", "big,single", "-q")
    assert res.exit_code == 0 and res.stderr == ""


def test_index_warns_when_most_rows_have_no_neighbour_and_serve_never_does(vector_store, tmp_path):
    import json

    import shutil

    s = vector_store.path
    shutil.copytree(s, tmp_path / "copy.zarr")  # one store, one ledger: the low-τ run on a copy
    res = invoke("index", "--store", s, "--ledger", tmp_path / "L", "--eps", "1", "--tau", "0.995")
    assert res.exit_code == 0, res.output
    err = " ".join(res.stderr.split())
    assert "at τ = 0.995 (cosine)" in err and "have no private record with κ ≥ τ" in err and "operator-only" in err
    res = invoke("index", "--store", tmp_path / "copy.zarr", "--ledger", tmp_path / "L2", "--eps", "1", "--tau", "0.05")
    assert res.exit_code == 0 and "no private record" not in res.stderr, res.stderr
    serve = invoke("serve-queries", "q1", "--store", s, "--ledger", tmp_path / "L", "--seed", "1")
    assert serve.exit_code == 0 and "κ" not in serve.stderr and "K_min" not in serve.stderr
    assert "operator" not in serve.stderr.lower() and "fewer than" not in serve.stderr
    # account: the share of released answers at the K_min clamp, marked operator-only
    res = invoke("account", "--ledger", tmp_path / "L")
    text = " ".join(res.stdout.split())
    assert res.exit_code == 0 and "answers at the K_min = 30 clamp:" in text and "OPERATOR ONLY" in text, text
    d = json.loads(invoke("account", "--ledger", tmp_path / "L", "--json").stdout)["answers_at_k_min"]
    assert d["answers"] == 40 and 0 < d["at_k_min"] <= 40 and d["share"] == d["at_k_min"] / 40
    assert "operator-only" in d["note"]


# -- 5. every bench sub-command is a typer command: same option style, defaults shown, units explained -------

def test_every_bench_command_is_typer_style():
    import indknn_cli.cli.bench as bench

    for info in bench.bench_app.registered_commands:
        assert not (info.context_settings or {}).get("ignore_unknown_options"), info.name  # no argv passthrough
        res = invoke("bench", info.name, "-h", env={"COLUMNS": "250"})
        assert res.exit_code == 0, info.name
        text = res.stdout
        assert "Usage: indknn bench " + info.name in " ".join(text.split()), info.name
        assert "usage: indknn" not in text and "issue 5" not in text and "[default:" in text, info.name
        assert "--quiet" in text and "--verbose" in text, info.name
    for cmd, needles in ((["year"], ["--days", "x>=17", "[default: 60]", "Queries per day", "--processes"]),
                         (["append"], ["--rows", "[default: 20000]", "per byte"]),
                         (["startup"], ["--repeat", "[default: 5]", "seconds"]),
                         (["user-unit"], ["--eps", "[default: 0.5,1,2]", "--user-size-max", "--max-records-per-user"])):
        text = " ".join(invoke("bench", *cmd, "-h", env={"COLUMNS": "250"}).stdout.split())
        assert all(n in text for n in needles), (cmd, text)
    # bad values are refused by the typer options (exit 2), before any work
    for args in (["year", "--days", "5"], ["append", "--rows", "0"], ["startup", "--repeat", "0"],
                 ["user-unit", "--eps", "x"], ["year", "--bogus"],
                 ["index-speed", "--batch", "5"]):  # index-speed's hidden --batch (= --batch-size) is gone
        res = invoke("bench", *args)
        assert res.exit_code == 2, (args, res.output)


def test_bench_measurements_have_one_parser():
    """Each measurement is a keyword-only `run(...)` returning a dict; the module parses no argv, prints nothing
    and never exits (the typer command is the one parser; architecture review)."""
    import importlib
    import inspect

    for name in ("serve_speed", "year", "append", "stream", "startup", "index_speed", "user_unit", "audit"):
        mod = importlib.import_module(f"indknn_cli.benchmarks.{name}")
        text = inspect.getsource(mod)
        assert not hasattr(mod, "main") and "argparse" not in text and "__main__" not in text, name
        assert "print(" not in text.replace("print('HEAVY=", "") and "sys.exit" not in text, name
        params = inspect.signature(mod.run).parameters.values()
        assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params), name


def test_bench_append_runs_as_a_typer_command():
    import json

    res = invoke("bench", "append", "--rows", "600", "--d", "8")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["rows"] == 600 and out["d"] == 8


# -- 6. no bench/ shims that repeat `indknn bench` commands --------------------------------------------------

def test_no_bench_shims():
    for name in ("audit.py", "serve_speed.py", "index_speed.py"):
        assert not (ROOT / "bench" / name).exists(), name
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "indknn_cli").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        for name in ("bench/audit.py", "bench/serve_speed.py", "bench/index_speed.py"):
            assert name not in text, (path, name)
    for rest in (ROOT / "bench").glob("*.py"):  # what is left does something no bench command does
        assert "Thin wrapper" not in rest.read_text(encoding="utf-8"), rest


# -- 7. one concept, one name: --batch-id for a stored query batch; --batch-size for a size ------------------

def test_batch_id_everywhere_with_a_hidden_deprecated_alias(vector_store, tmp_path):
    import json

    import numpy as np

    for cmd in (["embed"], ["serve-queries"]):
        text = invoke(*cmd, "-h", env={"COLUMNS": "250"}).stdout
        assert "--batch-id" in text and "--batch " not in text.replace("--batch-id", "").replace("--batch-size", ""), cmd
    text = invoke("bench", "index-speed", "-h", env={"COLUMNS": "250"}).stdout
    assert "--batch-size" in text and "--batch " not in text, text
    q = tmp_path / "q.npy"
    np.save(q, np.random.default_rng(0).standard_normal((5, 16)))
    res = invoke("embed", q, "--role", "query", "--store", vector_store.path, "--batch-id", "day-1")
    assert res.exit_code == 0 and json.loads(res.stdout)["batch_id"] == "day-1", res.output
    res = invoke("embed", q, "--role", "query", "--store", vector_store.path, "--batch", "day-1")  # old spelling
    assert res.exit_code == 0 and "--batch is deprecated, use --batch-id" in res.stderr, res.output
    assert json.loads(res.stdout)["batch"] == "day-1" and json.loads(res.stdout)["rows_added"] == 0
    before = listing(tmp_path)
    res = invoke("embed", q, "--role", "query", "--store", vector_store.path, "--batch", "a", "--batch-id", "b")
    assert res.exit_code == 2 and "old name of --batch-id" in res.stderr and listing(tmp_path) == before
    res = invoke("embed", q, "--role", "private", "--store", vector_store.path, "--batch-id", "x")
    assert res.exit_code == 2 and "--batch-id applies to --role query only" in res.stderr


def test_serve_queries_takes_a_stored_batch_by_its_batch_id(vector_store, tmp_path):
    """Review 42, M4: `embed --role query --batch-id q4` then `serve-queries --batch-id q4` said "Missing argument
    'queries'", `serve-queries --batch q4` "No such option", and embed's JSON line said "batch" where answers say
    "batch_id". One name now: QUERIES may be left out when --batch-id names a stored batch."""
    import json

    from indknn_cli.serving import build_index, make_params

    build_index(store_path=vector_store.path, ledger_path=tmp_path / "L",
                params=make_params(epsilon=1, delta=1e-5, tau=0.3, sigma2=0.5, planned_queries=100))
    where = ["--store", vector_store.path, "--ledger", tmp_path / "L", "--seed", "3"]
    res = invoke("serve-queries", "--batch-id", "q1", *where)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert len(lines) == 40 and {x["batch_id"] for x in lines} == {"q1"}
    res = invoke("serve-queries", "--batch", "q1", *where)  # the old spelling: the same batch, replayed
    assert res.exit_code == 0 and "--batch is deprecated" in res.stderr, res.output
    assert [json.loads(x) for x in res.stdout.splitlines()] == lines
    before = listing(tmp_path)
    for args, says in ((("serve-queries", *where), "give QUERIES"),
                       (("serve-queries", "--batch-id", "nope", *where), "no such file, folder or stored query batch"),
                       (("serve-queries", "", *where), "QUERIES is empty"),  # "" was the working folder (review 43)
                       (("serve-queries", "--batch-id", " ", *where), "--batch-id is empty"),
                       (("serve-queries", "--batch-id", "-", *where), "'-' means embed's JSON line on stdin")):
        res = invoke(*args)
        assert res.exit_code == 2 and says in res.stderr and res.stdout == "", res.output
    assert listing(tmp_path) == before
    q = tmp_path / "q.npy"
    import numpy as np

    np.save(q, np.random.default_rng(0).standard_normal((5, 16)))
    emb = json.loads(invoke("embed", q, "--role", "query", "--store", vector_store.path, "--batch-id", "d2").stdout)
    assert emb["batch_id"] == emb["batch"] == "d2"
    piped = invoke("serve-queries", "-", *where, input=json.dumps({k: v for k, v in emb.items() if k != "batch"}))
    assert piped.exit_code == 0 and len(piped.stdout.splitlines()) == 5, piped.output
    # a null under one key is no name; two different names are refused (review 43, L2)
    piped = invoke("serve-queries", "-", *where, input=json.dumps(dict(emb, batch_id=None)))
    assert piped.exit_code == 0 and len(piped.stdout.splitlines()) == 5, piped.output
    piped = invoke("serve-queries", "-", *where, input=json.dumps(dict(emb, batch="other")))
    assert piped.exit_code == 2 and "names two batches" in piped.stderr, piped.output


# -- 8. shell completion, as typer offers it, for a program named `indknn` ------------------------------------

def test_shell_completion():
    import subprocess
    import sys

    res = invoke("-h")
    assert "--install-completion" in res.stdout and "--show-completion" in res.stdout
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INDKNN_")}, "PYTHONPATH": str(ROOT)}
    # run from bash, as a user would: typer detects the shell from the parent process
    script = subprocess.run(["bash", "-c", f"'{sys.executable}' -m indknn_cli --show-completion; exit $?"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert script.returncode == 0 and "_INDKNN_COMPLETE=complete_bash" in script.stdout, script.stderr
    assert "complete -o default -F _indknn_completion indknn" in script.stdout
    for words, cword, expect in (("indknn ser", "1", {"serve-queries"}), ("indknn bench ye", "2", {"year"}),
                                 ("indknn serve-queries --batch", "2", {"--batch-id", "--batch-size"})):
        out = subprocess.run([sys.executable, "-m", "indknn_cli"], capture_output=True, text=True, timeout=600,
                             env={**env, "_INDKNN_COMPLETE": "complete_bash", "COMP_WORDS": words,
                                  "COMP_CWORD": cword})
        assert out.returncode == 0 and set(out.stdout.split()) == expect, (words, out.stdout, out.stderr)


# -- 9. bench: the feature cache is written block by block (a re-run resumes); partial results in --out --------

def _mini_mnist(data_dir: Path, n_train=70, n_test=30):
    import numpy as np

    rng = np.random.default_rng(0)
    (data_dir / "mnist").mkdir(parents=True)
    np.savez(data_dir / "mnist" / "mnist.npz", x_train=rng.integers(0, 255, (n_train, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, n_train), x_test=rng.integers(0, 255, (n_test, 28, 28), dtype=np.uint8),
             y_test=rng.integers(0, 10, n_test))


def test_feature_cache_is_written_block_by_block_and_resumes(tmp_path, monkeypatch):
    import numpy as np

    from indknn_cli.benchmarks import data

    _mini_mnist(tmp_path / "data")
    monkeypatch.setattr(data, "FEATURE_BLOCK_ROWS", 16)
    real_save, saved = data._save_atomic, []

    def interrupted(path, arr):  # the machine stops while the third block is embedded
        if len(saved) == 2:
            raise KeyboardInterrupt
        saved.append(path)
        real_save(path, arr)

    monkeypatch.setattr(data, "_save_atomic", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data.load_mnist(tmp_path / "data", tmp_path / "cache", features="pixels")
    parts = sorted((tmp_path / "cache").glob("*.parts/*.npy"))
    assert [p.name for p in parts] == ["000000000-000000016.npy", "000000016-000000032.npy"]
    monkeypatch.setattr(data, "_save_atomic", real_save)
    lines: list = []
    ds = data.load_mnist(tmp_path / "data", tmp_path / "cache", features="pixels", progress=lines.append)
    assert ds.info["blocks_resumed"] == 2 and ds.info["blocks_computed"] == 5 and not ds.info["cache_hit"]
    assert lines[-1].startswith("features: 100/100 rows") and len(lines) == 7
    assert not list((tmp_path / "cache").glob("*.parts")) and len(list((tmp_path / "cache").glob("*.npy"))) == 1
    fresh = data.load_mnist(tmp_path / "data", tmp_path / "cache2", features="pixels")
    assert np.array_equal(ds.x, fresh.x)
    again = data.load_mnist(tmp_path / "data", tmp_path / "cache", features="pixels")
    assert again.info["cache_hit"] and np.array_equal(again.x, ds.x)


def test_partial_results_are_written_as_each_step_completes(tmp_path, monkeypatch):
    import json

    from indknn_cli.benchmarks import experiments
    from indknn_cli.benchmarks.runner import run_bench

    real, calls = experiments.run_indknn, []

    def stops_at_the_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(experiments, "run_indknn", stops_at_the_second)
    kw = dict(dataset=None, out_dir=tmp_path / "out", quick=True, seed=1, speed_n=(200, 300), speed_d=(8,),
              speed_queries=16)
    with pytest.raises(KeyboardInterrupt):
        run_bench("speed", **kw)
    part = json.loads((tmp_path / "out" / "speed_synthetic.partial.json").read_text())
    assert part["complete"] is False and [r["n"] for r in part["results"]] == [200]
    monkeypatch.setattr(experiments, "run_indknn", real)
    summary = run_bench("speed", **kw)
    done = json.loads(Path(summary["json"]).read_text())
    assert [r["n"] for r in done["results"]] == [200, 300]
    assert not (tmp_path / "out" / "speed_synthetic.partial.json").exists()


# -- plots: the spread over query draws in every accuracy plot; close references can be told apart ------------

def test_accuracy_plots_show_the_spread_and_distinct_references(tmp_path, monkeypatch):
    import math

    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure

    from indknn_cli.benchmarks.figures import make_plots

    figs, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figs.append(self), save(self, *a, **k))[1])
    rows = [{"method": m, "epsilon": e, "accuracy_median": 0.8 + e / 100, "accuracy_min": 0.7, "accuracy_max": 0.9}
            for m in ("ind-knn", "ind-knn+reuse", "private-knn", "linear-noisysgd") for e in (0.5, 1.0, 2.0)]
    rows += [{"method": "knn (non-private)", "epsilon": math.inf, "accuracy_median": 0.897, "accuracy_min": 0.89,
              "accuracy_max": 0.90},
             {"method": "logistic regression", "epsilon": math.inf, "accuracy_median": 0.896,
              "accuracy_min": 0.888, "accuracy_max": 0.905}]
    result = {"experiment": "accuracy-vs-eps", "results": rows, "dataset": {"name": "x", "queries_per_draw": 10},
              "config": {"delta": 1e-5, "conversion": "gdp", "pknn_accountant": "pld", "sgd_accountant": "prv"}}
    paths = make_plots(result, tmp_path, "acc")
    assert paths[0].is_file()
    ax = figs[-1].axes[0]
    assert sum(isinstance(c, PolyCollection) for c in ax.collections) == 4  # a band per private method
    refs = [ln for ln in ax.lines if "non-private" in ln.get_label() or "logistic" in ln.get_label()]
    assert len(refs) == 2 and refs[0].get_linestyle() != refs[1].get_linestyle()
    assert {"knn (non-private) (0.897)", "logistic regression (0.896)"} == {ln.get_label() for ln in refs}
    assert len(ax.patches) >= 2  # each reference's spread as a band
    assert "min–max over draws" in ax.get_ylabel()
    qrows = [{**r, "queries": q} for r in rows[:12] for q in (100, 1000)]
    make_plots({"experiment": "accuracy-vs-queries", "results": qrows, "epsilon": 1.0, "dataset": {}},
               tmp_path, "accq")
    assert sum(isinstance(c, PolyCollection) for c in figs[-1].axes[0].collections) == 4



@pytest.mark.heavy
@pytest.mark.parametrize("exc, code, word", [("Terminated", 143, "Terminated."), ("KeyboardInterrupt", 130, "Interrupted.")])
def test_an_interrupt_after_the_library_call_still_ends_with_its_message_and_code(tmp_path, monkeypatch, exc, code,
                                                                                   word):
    """Review 51, F2: a SIGTERM landing after a command's library call (while it printed its result) reached typer,
    which exits 130 with no word; `indknn -h` promises 143 for SIGTERM. Both signals end as inside the call."""
    import numpy as np

    import indknn_cli.cli.account as account_cli
    from indknn_cli import errors
    from indknn_cli.serving import build_index, make_params
    from indknn_cli.store import ExtractorInfo, FeatureStore

    st = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=4,
                             label_names=["a", "b"])
    st.append("private", np.eye(4, dtype="f4"), labels=np.array([0, 1, 0, 1]), record_ids=["r0", "r1", "r2", "r3"])
    build_index(store_path=st.path, ledger_path=tmp_path / "L", params=make_params(epsilon=1.0, delta=1e-5, tau=0.5,
                                                                                    sigma2=1.0))
    raised, printed = getattr(errors, exc, KeyboardInterrupt), []

    def interrupted(*a, **k):
        printed.append(1)
        raise raised()

    monkeypatch.setattr(account_cli, "emit_json", interrupted)
    r = runner.invoke(app, ["account", "--ledger", str(tmp_path / "L"), "--store", str(st.path), "--json"])
    assert printed, r.output  # the library call returned and its result was being printed
    assert r.exit_code == code and word in r.stderr and "Traceback" not in r.stderr, (r.exit_code, r.output)


def test_sigterm_does_nothing_once_the_command_is_over(monkeypatch):
    """Review 55, F8: a SIGTERM in the ~1.5 s a finished serve takes to wind down turned it into exit 143 with no word;
    once `main` has its exit code, indknn's SIGTERM handler does nothing. Review 57, F5: nothing is set to SIG_IGN
    (a program calling `main()` kept ignoring both signals, and so did every child it started)."""
    import signal
    import sys

    from indknn_cli.cli import app as app_module

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    monkeypatch.setattr(sys, "argv", ["indknn", "--version"])
    try:
        with pytest.raises(SystemExit) as e:
            app_module.main()
        assert e.value.code in (0, None)
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler) and signal.getsignal(signal.SIGINT) == old[signal.SIGINT]
        handler(signal.SIGTERM, None)  # no Terminated raised: the command is over
    finally:
        for s, h in old.items():
            signal.signal(s, h)
