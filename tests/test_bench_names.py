"""One concept, one name across `indknn bench` (architecture review): the renamed options keep their old spelling
as a hidden, deprecated alias that prints a note; every comma-separated number list has one parser, which refuses
empty items; `accuracy-vs-eps --no-baselines` replaces bench/private_tuning_rows.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from indknn_cli.cli.common import parse_number_list
from indknn_cli.errors import BadInputError

from .test_cli_polish_more import ROOT, invoke

SUMMARY = {"experiment": "tune", "dataset": "ag_news", "json": "x.json", "plots": [], "seconds": 0.0,
           "table": {"title": "t", "columns": ["a"], "rows": [], "note": ""}}


@pytest.fixture
def calls(monkeypatch):
    """The library calls of bench tune, audit and user-unit recorded instead of run."""
    seen: dict = {}
    from indknn_cli.benchmarks import audit, runner, user_unit

    def fake_bench(experiment, **kw):
        seen.update(kw)
        return {**SUMMARY, "experiment": experiment}

    def fake(name, result):
        def run(**kw):
            seen.update(kw)
            return result
        return run

    monkeypatch.setattr(runner, "run_bench", fake_bench)
    monkeypatch.setattr(audit, "run", fake("audit", {
        "epsilon_lower_bound": 0.1, "confidence": 0.95, "conversion": "gdp", "certified_epsilon": 1.0,
        "delta": 1e-5, "unit": "record", "adjacency": "add/remove one record", "passed": True}))
    monkeypatch.setattr(user_unit, "run", fake("user-unit", {"rows": []}))
    return seen


@pytest.mark.parametrize("cmd,old,new,value,key", [
    (["audit"], "--dim", "--d", "5", ("dim", 5)),
    (["audit"], "--epsilon", "--eps", "1.5", ("epsilon", 1.5)),
    (["tune"], "--queries", "--planned-queries", "77", ("queries", 77)),
    (["user-unit"], "--k", "--max-records-per-user", "4", ("max_records_per_user", 4)),
    (["user-unit"], "--max-records", "--user-size-max", "7", ("user_size_max", 7)),
])
def test_an_old_spelling_still_works_with_a_note_and_is_hidden(calls, cmd, old, new, value, key):
    res = invoke("bench", *cmd, old, value)
    assert res.exit_code == 0, res.output
    assert f"note: {old} is deprecated, use {new}" in " ".join(res.stderr.split())
    assert calls[key[0]] == key[1]
    calls.clear()
    res = invoke("bench", *cmd, new, value)  # the new name: the same call, no note
    assert res.exit_code == 0 and "deprecated" not in res.stderr and calls[key[0]] == key[1]
    calls.clear()
    res = invoke("bench", *cmd, new, value, old, value)  # both, the same value: accepted
    assert res.exit_code == 0 and calls[key[0]] == key[1]
    res = invoke("bench", *cmd, new, value, old, "9")  # both, different values: refused
    assert res.exit_code == 2 and f"{old} is the old name of {new}" in res.stderr
    text = invoke("bench", *cmd, "-h", env={"COLUMNS": "250"}).stdout
    words = set(text.replace("│", " ").split())
    assert new in words and old not in words, text


def test_the_new_names_keep_the_old_defaults(calls):
    assert invoke("bench", "audit").exit_code == 0
    assert calls["epsilon"] == 2.0 and calls["dim"] == 8
    calls.clear()
    assert invoke("bench", "user-unit").exit_code == 0
    assert calls["user_size_max"] == 20 and calls["max_records_per_user"] == 3
    calls.clear()
    assert invoke("bench", "tune").exit_code == 0
    assert calls["queries"] is None  # min(1000, query pool)


def test_the_device_help_names_auto_wherever_it_is_accepted():
    for cmd in ("accuracy-vs-eps", "accuracy-vs-queries", "retraining", "min-margin", "speed", "tune"):
        text = " ".join(invoke("bench", cmd, "-h", env={"COLUMNS": "250"}).stdout.replace("│", " ").split())
        assert "--device <str> auto, cpu or cuda" in text, (cmd, text)


@pytest.mark.parametrize("cmd", [["accuracy-vs-eps"], ["tune"], ["min-margin", "--margins", "0.5,,1"],
                                 ["user-unit"], ["speed", "--n", "100,,200"]])
def test_a_bench_list_with_an_empty_item_is_refused(calls, tmp_path, cmd):
    args = cmd if len(cmd) > 1 else [*cmd, "--eps", "0.5,,1"]
    res = invoke("bench", *args, "--out", tmp_path / "o") if cmd[0] != "user-unit" else invoke("bench", *args)
    assert res.exit_code == 2, res.output
    assert res.stdout == "" and "without empty items" in res.stderr
    assert f"{args[-2]} '{args[-1]}'" in res.stderr  # the flag and the value are named
    assert not calls or "epsilons" not in calls


@pytest.mark.parametrize("args", [["--eps", "0.5,,1"], ["--eps", "1", "--tune", "private", "--tune-taus", "0.5,,1"],
                                  ["--eps", "1", "--tune", "private", "--tune-sigma2s", "0.5,0.5"]])
def test_index_refuses_a_list_with_an_empty_or_repeated_item(tmp_path, args):
    res = invoke("index", "--store", tmp_path / "none.zarr", "--ledger", tmp_path / "L", *args)
    assert res.exit_code == 2, res.output
    assert res.stdout == "" and not (tmp_path / "L").exists()
    if "--tune" in args:
        assert args[-2] in res.stderr and ("without empty items" in res.stderr or "twice" in res.stderr)


def test_parse_number_list():
    assert parse_number_list("0.5, 1,2e0", flag="--eps") == (0.5, 1.0, 2.0)
    assert parse_number_list("1,1", flag="--eps") == (1.0, 1.0)  # bench: a repeated ε is allowed
    for text, why in (("0.5,,1", "without empty items"), ("1,", "without empty items"), (",1", "without empty"),
                      ("", "no number given"), (" , ", "no number given"), ("x", "expected comma-separated"),
                      ("1,nan", "not a finite number"), ("inf", "not a finite number")):
        with pytest.raises(BadInputError) as exc:
            parse_number_list(text, flag="--eps")
        assert "--eps" in str(exc.value) and why in str(exc.value), (text, exc.value)
        assert exc.value.exit_code == 2
    with pytest.raises(BadInputError, match="--tune-taus lists a value twice"):
        parse_number_list("0.2,0.2", flag="--tune-taus", distinct=True)


def test_no_baselines_needs_the_private_rows(tmp_path):
    res = invoke("bench", "accuracy-vs-eps", "--no-baselines", "--no-private-tuning", "--out", tmp_path / "o")
    assert res.exit_code == 2 and "--no-baselines" in res.stderr and res.stdout == ""


def test_the_private_tuning_script_is_gone_and_no_document_names_it():
    assert not (ROOT / "bench" / "private_tuning_rows.py").exists()
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").iterdir()]:
        if path.is_file():
            assert "private_tuning_rows" not in path.read_text(errors="replace"), path


@pytest.mark.heavy
def test_no_baselines_gives_the_rows_the_script_printed(tmp_path):
    """`accuracy-vs-eps --no-baselines` returns, for each ε, exactly what bench/private_tuning_rows.py computed:
    `private_rows` on the same split, draws and seed (the script's steps, replayed here), and nothing else."""
    from indknn_cli.benchmarks import private_tuning
    from indknn_cli.benchmarks import runner as bench_runner
    from indknn_cli.benchmarks.config import BenchConfig
    from indknn_cli.benchmarks.data import load_dataset, make_split
    from indknn_cli.benchmarks.experiments import majority_class, prepare, query_draws

    from .test_bench import TINY, clustered
    from indknn_cli.store import ExtractorInfo, FeatureStore

    x, y, _ = clustered(460, 16, 3, seed=8)
    store = FeatureStore.create(tmp_path / "bench.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=64)
    store.append("private", x[:400], labels=y[:400], record_ids=[f"r{i}" for i in range(400)])
    store.append("public", x[400:], labels=y[400:], record_ids=[f"p{i}" for i in range(60)])
    tiny = {k: v for k, v in TINY.items() if k != "epsilons"}
    summary = bench_runner.run_bench("accuracy-vs-eps", dataset=str(store.path), out_dir=tmp_path / "o", quick=True,
                                     seed=3, baselines=False, epsilons=(1.0, 2.0), **tiny)
    data = json.loads(Path(summary["json"]).read_text())
    assert data["tuning"] == {} and "--no-baselines" in data["table"]["note"]
    # review 73, F10: no word of the other rows' protocol (tuned without accounting) nor of a Gaussian-DP ε
    note = data["table"]["note"]
    assert "ε of Ind-KNN: Gaussian-DP" not in note and "without accounting" not in note
    assert data["protocol"] is None and data["tuned_on"].startswith("Ind-KNN alone, tuned privately")
    assert {r["method"] for r in data["results"]} == {private_tuning.PRIVATE, private_tuning.ORACLE}
    # the script: load, split, prepare, draw, private_rows per ε
    ds = load_dataset(str(store.path))
    for eps in (1.0, 2.0):
        cfg = BenchConfig.make(quick=True, seed=3, epsilons=(eps,), **tiny)
        p = prepare(ds, make_split(ds, seed=3, max_private=cfg.max_private), cfg)
        draws = query_draws(p.pool_x.shape[0], p.T, cfg.draws, 3)
        want = json.loads(json.dumps(private_tuning.private_rows(p, cfg, eps=eps, draws=draws)))
        got = [r for r in data["results"] if r["epsilon"] == eps]
        for r in want + got:
            r.pop("tuning_seconds_per_draw", None)
            for t in r.get("tuning_records", []):
                t.pop("seconds", None)
        assert got == want
        assert summary["majority_class"]["accuracy_median"] == majority_class(p, draws)["accuracy_median"]
    assert [row[0] for row in summary["table"]["rows"]] == [private_tuning.PRIVATE, private_tuning.ORACLE,
                                                            "majority class (constant)"]
