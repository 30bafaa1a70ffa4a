"""`indknn bench`: splits, the engine it runs, tuning, and every experiment end to end on tiny data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli.benchmarks import runner as bench_runner
from indknn_cli.benchmarks.config import BenchConfig
from indknn_cli.benchmarks.data import load_dataset, make_split, synthetic_dataset
from indknn_cli.benchmarks.experiments import query_draws
from indknn_cli.benchmarks.methods import (PrecomputedFinder, ValData, kernel_matrix, run_indknn, tune_indknn,
                                           tune_tau_stage1)
from indknn_cli.cli.app import app
from indknn_cli.ledger import BudgetLedger
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

cli = CliRunner()

#: Grids small enough for a few seconds per experiment on 2 cores.
TINY = dict(epsilons=(1.0,), draws=1, sigma2_grid=(0.5, 1.0), tau_offsets=(-0.1, 0.0), tune_draws=1,
            tune_queries=40, tune_runs=3.0, tune_taus=(0.3, 0.6), tune_sigma2s=(0.5, 1.0), margins=(0.0, 1.0),
            pknn_rates=(0.5,), pknn_ks=(10,), sgd_lrs=(1.0,), sgd_epochs=1, sgd_accountant="rdp",
            query_grid=(20, 45), retrain_every=(15, 45), timing_repeats=1, speed_n=(300,), speed_d=(16,),
            speed_queries=16)


@pytest.fixture
def labelled_store(tmp_path):
    """400 labelled private vectors (d=16, 3 classes) and 60 labelled public ones."""
    x, y, _ = clustered(460, 16, 3, seed=8)
    store = FeatureStore.create(tmp_path / "bench.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["a", "b", "c"], chunk_rows=64)
    store.append("private", x[:400], labels=y[:400], record_ids=[f"r{i}" for i in range(400)])
    store.append("public", x[400:], labels=y[400:], record_ids=[f"p{i}" for i in range(60)])
    return store


# -- data and splits ---------------------------------------------------------------
def test_split_is_seeded_disjoint_and_validation_comes_from_the_private_side():
    ds = synthetic_dataset(n=500, d=8, classes=3, seed=1)
    a, b = make_split(ds, seed=3), make_split(ds, seed=3)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("private", "query_pool", "val_queries"))
    assert not np.array_equal(a.query_pool, make_split(ds, seed=4).query_pool)
    assert np.intersect1d(a.private, a.query_pool).size == 0
    assert a.private.size + a.query_pool.size == 500
    assert set(a.val_queries) | set(a.val_reference) == set(a.private)  # carved from the private side
    assert np.intersect1d(a.val_queries, a.val_reference).size == 0
    assert np.intersect1d(a.val_queries, a.query_pool).size == 0  # never tuned on reported queries


def test_store_public_rows_are_the_validation_data(labelled_store):
    ds = load_dataset(str(labelled_store.path))
    sp = make_split(ds, seed=0)
    public = set(ds.public_rows.tolist())
    assert set(sp.val_queries) | set(sp.val_reference) == public
    assert not public & (set(sp.private) | set(sp.query_pool))


def test_query_draws_are_seeded_samples_without_replacement():
    d1 = query_draws(100, 100, 3, seed=0)
    assert all(sorted(d.tolist()) == list(range(100)) for d in d1)  # T = pool: permutations
    assert not np.array_equal(d1[0], d1[1])
    d2 = query_draws(100, 30, 2, seed=0)
    assert all(np.unique(d).size == 30 for d in d2)
    assert np.array_equal(query_draws(100, 30, 2, seed=0)[1], d2[1])


# -- the engine bench runs is the one serve-queries runs ------------------------------
@pytest.mark.parametrize("reuse", [False, True])
def test_bench_indknn_equals_serve_queries(vector_store, tmp_path, reuse):
    params = make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=100)
    build_index(store_path=vector_store.path, ledger_path=tmp_path / "L", params=params)
    served = serve_queries(store_path=vector_store.path, ledger_path=tmp_path / "L", query_batch="q1", seed=3,
                           batch_size=16, reuse=reuse)
    ledger = BudgetLedger.open(tmp_path / "L")
    x = vector_store.read("private", "features")
    y = vector_store.read("private", "labels")
    q = vector_store.read("query", "features", 0, 40)
    run = run_indknn(x, y, q, params=ledger.params, n_classes=3, seed=3, tag="q1", reuse=reuse, batch_size=7)
    assert run.labels.tolist() == [a["label"] for a in served.answers]
    assert run.released_counts.tolist() == [a["released_count"] for a in served.answers]
    np.testing.assert_array_equal(run.spent, ledger.state.spent)


@pytest.mark.heavy
def test_each_draw_starts_from_a_fresh_budget_and_never_overspends():
    x, y, _ = clustered(200, 8, 3, seed=2)
    q, _, _ = clustered(300, 8, 3, seed=3)
    params = make_params(epsilon=0.5, delta=1e-5, tau=0.3, sigma2=0.2, planned_queries=50)
    a = run_indknn(x, y, q, params=params, n_classes=3, seed=0, tag="d0")
    b = run_indknn(x, y, q, params=params, n_classes=3, seed=0, tag="d0")
    c = run_indknn(x, y, q, params=params, n_classes=3, seed=0, tag="d1")
    assert np.array_equal(a.labels, b.labels) and np.array_equal(a.spent, b.spent)  # fresh state, same noise
    assert not np.array_equal(a.released_counts, c.released_counts)  # another draw, other noise
    assert (a.spent <= params.budget).all() and a.active_after < 200  # the filter retired records


def test_precomputed_tuning_finder_matches_the_flat_scan():
    x, y, _ = clustered(300, 16, 3, seed=4)
    q, _, _ = clustered(60, 16, 3, seed=5)
    params = make_params(epsilon=1.0, delta=1e-5, tau=0.4, sigma2=0.5, planned_queries=60)
    flat = run_indknn(x, y, q, params=params, n_classes=3, seed=1, tag="t", batch_size=60)
    pre = run_indknn(x, y, q, params=params, n_classes=3, seed=1, tag="t", batch_size=60,
                     candidate_finder=PrecomputedFinder(kernel_matrix(q, x), 0.4))
    assert flat.labels.tolist() == pre.labels.tolist()
    np.testing.assert_allclose(flat.spent, pre.spent, rtol=1e-12, atol=1e-15)


def test_two_stage_tuner_searches_around_tau_star():
    x, y, _ = clustered(400, 16, 3, seed=6)
    val = ValData(x[:300], y[:300].astype(np.int64), x[300:], y[300:].astype(np.int64), 3)
    s1 = tune_tau_stage1(val)
    assert s1["tau_star"] in [r["tau"] for r in s1["sweep"]]
    best = max(r["accuracy"] for r in s1["sweep"])
    assert next(r for r in s1["sweep"] if r["tau"] == s1["tau_star"])["accuracy"] >= best - 0.005
    res = tune_indknn(val, epsilons=(1.0, 2.0), delta=1e-5, conversion="gdp", queries=100, seed=0,
                      sigma2_grid=(0.3, 0.8), tau_offsets=(-0.05, 0.0, 0.05), stage1=s1)
    assert set(res["chosen"]) == {1.0, 2.0}
    for ch in res["chosen"].values():
        assert ch["sigma2"] in (0.3, 0.8) and abs(ch["tau"] - s1["tau_star"]) <= 0.05 + 1e-9


# -- experiments end to end (tiny synthetic store, quick mode) -------------------------
def _png(path: str) -> bool:
    return Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("experiment", ["accuracy-vs-eps", "accuracy-vs-queries", "retraining", "tune", "speed",
                                        "min-margin"])
@pytest.mark.heavy
def test_experiment_end_to_end_writes_json_and_png(labelled_store, tmp_path, experiment):
    out = tmp_path / "out"
    lines: list[str] = []
    summary = bench_runner.run_bench(experiment, dataset=str(labelled_store.path), out_dir=out, quick=True, seed=5,
                                     progress=lines.append, **TINY)
    data = json.loads(Path(summary["json"]).read_text())
    # every ε a progress line prints names its unit and adjacency (SPEC §8; review 32's ε sweep left these)
    assert all("add/remove one record" in m for m in lines if "ε" in m), [m for m in lines if "ε" in m]
    assert data["experiment"] == experiment and data["quick"] is True
    assert data["config"]["seed"] == 5 and data["environment"]["versions"]["opacus"]
    assert "git_commit" in data["environment"]
    assert summary["plots"] and all(_png(p) for p in summary["plots"])
    assert summary["table"]["rows"]
    if experiment == "accuracy-vs-eps":
        methods = {r["method"] for r in data["results"]}
        assert {"ind-knn", "ind-knn+reuse", "private-knn", "linear-noisysgd", "knn (non-private)"} <= methods
        for r in data["results"]:
            assert 0.0 <= r["accuracy_median"] <= 1.0
            if r["method"] in ("private-knn", "linear-noisysgd"):
                assert r["accounted_epsilon"] <= r["epsilon"]
            if r["method"] in ("ind-knn", "ind-knn+reuse") and r["epsilon"] != "inf":
                assert r["conversion"] == "gdp" and "Gaussian-DP" in r["privacy"]
            if r["method"] == "ind-knn (tuned privately)":  # the search and serving composed into the same ε
                assert r["conversion"] == "rdp" and r["epsilon_total"] <= r["epsilon"]
                assert 0 < r["epsilon_tuning"] < r["epsilon"]
            if r["method"] in ("ind-knn", "ind-knn+reuse", "private-knn", "linear-noisysgd",
                               "ind-knn (tuned privately)"):  # audit D6
                assert r["unit"] == "record" and r["adjacency"] == "add/remove one record", r
                assert r["conversion"] and "add/remove one record" in r["privacy"], r
        assert {"ind-knn (tuned privately)", "ind-knn best grid point (oracle, B_serve)"} <= methods
        labels = [row[0] for row in summary["table"]["rows"]]
        assert "ind-knn (tuned non-privately)" in labels and "ind-knn (tuned privately)" in labels
        assert labels[-1] == "majority class (constant)" and summary["majority_class"]["label_name"] in "abc"
        assert "add/remove one record" in data["table"]["note"]
    if experiment == "retraining":
        rows = data["results"]
        assert [r["retrain_every"] for r in rows] == [15, 45]
        assert rows[0]["noisysgd_epsilon_total"] > rows[1]["noisysgd_epsilon_total"]  # more retrainings
        assert all(r["indknn_epsilon_guarantee"] == 1.0 for r in rows)
        assert all(r["unit"] == "record" and r["adjacency"] == "add/remove one record" and "Opacus"
                   in r["noisysgd_accountant"] and r["indknn_conversion"] == "gdp" for r in rows)
        assert "(gdp)" in " ".join(summary["table"]["columns"]) and "Opacus" in " ".join(summary["table"]["columns"])
    if experiment == "tune":
        assert "public or validation" in data["warning"] and "public rows" in data["data_used"]
        assert data["unit"] == "record" and data["adjacency"] == "add/remove one record" and data["conversion"]
        assert "add/remove one record" in summary["table"]["title"]
    if experiment == "min-margin":
        rows = {(r["min_margin"], r["reuse"]): r for r in data["results"]}
        assert rows[(0.0, False)]["coverage"]["median"] == 1.0  # M = 0 answers everything
        for reuse in (False, True):
            assert rows[(1.0, reuse)]["coverage"]["median"] <= rows[(0.0, reuse)]["coverage"]["median"]
        assert summary["table"]["rows"][-1][0] == "majority class (constant)"


@pytest.mark.heavy
def test_cli_bench_prints_table_on_stderr_and_one_json_line(labelled_store, tmp_path, monkeypatch):
    make = BenchConfig.make.__func__
    monkeypatch.setattr(BenchConfig, "make", classmethod(
        lambda cls, *, quick, seed=0, **kw: make(cls, quick=quick, seed=seed, **{**kw, **{
            k: v for k, v in TINY.items() if k != "epsilons"}})))
    res = cli.invoke(app, ["bench", "accuracy-vs-eps", "--dataset", str(labelled_store.path), "--quick",
                           "--out", str(tmp_path / "o"), "--eps", "1,2", "--seed", "2"])
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["table"]["columns"] == ["method", "ε=1", "ε=2", "ε=∞"] and summary["seed"] == 2
    assert "median accuracy" in res.stderr and "ind-knn" in res.stderr
    # audit D6: every printed ε names conversion, unit and adjacency
    assert "add/remove one record" in " ".join(res.stderr.split()) and "per record" in summary["table"]["note"]
    assert Path(summary["json"]).is_file()


@pytest.mark.parametrize("args", [["--eps", "one"], ["--dataset", "/nonexistent/store"], ["--eps", "-1"],
                                  ["--conversion", "moments"], ["--eps", ""], ["--eps", "nan"], ["--device", "tpu"],
                                  ["speed", "--n", "-5"], ["speed", "--n", "2.5"], ["speed", "--n", "nan"],
                                  ["speed", "--n", "1e99"], ["speed", "--d", "0"], ["--tune-share", "5"],
                                  ["speed", "--out-is-a-file"]])
def test_cli_bench_bad_input_exits_2_with_nothing_on_stdout(tmp_path, args):
    """(review 38, F5/F7: `--eps ""` ran with no ε, `--device tpu` and `speed --n nan/1e99` ended in "Internal
    error", `--n -5/2.5/0` printed junk rows)"""
    cmd = ["speed", *args[1:]] if args[0] == "speed" else ["accuracy-vs-eps", *args]
    out = tmp_path / "o"
    if "--out-is-a-file" in cmd:
        cmd.remove("--out-is-a-file")
        out = tmp_path / "taken"
        out.write_text("mine")
    res = cli.invoke(app, ["bench", *cmd, "--out", str(out)])
    assert res.exit_code == 2, (res.stdout, res.stderr)
    assert res.stdout == ""
    assert not (tmp_path / "o").exists() and (out == tmp_path / "o" or out.read_text() == "mine")


# -- issue 15 §5: no unaccounted private tuning by default; tables say where tuning happened -------------------
@pytest.fixture
def private_only_store(tmp_path):
    """300 labelled private vectors and no public rows."""
    x, y, _ = clustered(300, 16, 3, seed=9)
    store = FeatureStore.create(tmp_path / "private_only.zarr", extractor=ExtractorInfo("vectors", "none", "1"),
                                dim=16, label_names=["a", "b", "c"], chunk_rows=64)
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(300)])
    return store


def _tiny_config(monkeypatch):
    make = BenchConfig.make.__func__
    monkeypatch.setattr(BenchConfig, "make", classmethod(
        lambda cls, *, quick, seed=0, **kw: make(cls, quick=quick, seed=seed, **{**kw, **{
            k: v for k, v in TINY.items() if k != "epsilons"}})))


def test_bench_tune_refuses_a_store_without_public_rows(private_only_store, tmp_path, monkeypatch):
    _tiny_config(monkeypatch)
    args = ["bench", "tune", "--dataset", str(private_only_store.path), "--quick", "--out", str(tmp_path / "o"),
            "--eps", "1"]
    res = cli.invoke(app, args)
    assert res.exit_code == 2 and res.stdout == "", (res.stdout, res.stderr)
    assert "no labelled public rows" in res.stderr and "--unaccounted-private-tuning" in res.stderr
    assert not (tmp_path / "o").exists()
    res = cli.invoke(app, args + ["--unaccounted-private-tuning"])
    assert res.exit_code == 0, res.stderr
    assert "--unaccounted-private-tuning: this store has no labelled public rows" in " ".join(res.stderr.split())
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert "no budget accounts for" in summary["unaccounted_private_tuning"]
    assert "no budget accounts for" in json.loads(Path(summary["json"]).read_text())["unaccounted_private_tuning"]


def test_bench_tables_say_tuning_was_on_the_private_side(private_only_store, tmp_path, monkeypatch):
    _tiny_config(monkeypatch)
    res = cli.invoke(app, ["bench", "accuracy-vs-eps", "--dataset", str(private_only_store.path), "--quick",
                           "--out", str(tmp_path / "o"), "--eps", "1"])
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    said = "tuned on a validation split carved from the private side"
    assert said in summary["tuned_on"] and said in summary["table"]["note"]
    assert said in " ".join(res.stderr.split())  # the table note printed under the table


# -- issue 18: the user's own labelled test rows ----------------------------------------------------------------
@pytest.mark.heavy
def test_bench_scores_on_a_test_store_and_refuses_a_mismatched_one(private_only_store, tmp_path):
    """--test-store: the store's `--role test` rows are the query pool; the private side keeps every record."""
    x, y, _ = clustered(50, 16, 3, seed=11)
    test = FeatureStore.create(tmp_path / "test.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                               label_names=["a", "b", "c"], chunk_rows=64)
    test.append("query", x, labels=y, record_ids=[f"t{i}" for i in range(50)], batch="test-1")
    summary = bench_runner.run_bench("accuracy-vs-eps", dataset=str(private_only_store.path), out_dir=tmp_path / "o",
                                     quick=True, seed=1, test_store=tmp_path / "test.zarr",
                                     **{**TINY, "private_tuning": False})
    data = json.loads(Path(summary["json"]).read_text())
    assert data["dataset"]["split"]["query_pool"] == 50 and data["dataset"]["test_rows"] == 50
    assert data["dataset"]["split"]["private"] == 300  # no private record was carved out as a query
    assert summary["test_store"] == str(tmp_path / "test.zarr")
    label = int(np.bincount(private_only_store.read("private", "labels")).argmax())
    assert summary["majority_class"]["label"] == label  # the private side's most frequent label, scored on test
    assert summary["majority_class"]["accuracy_median"] == pytest.approx(float(np.mean(y == label)))
    other = FeatureStore.create(tmp_path / "other.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                                label_names=["x", "y", "z"], chunk_rows=64)
    other.append("query", x, labels=y, record_ids=[f"t{i}" for i in range(50)], batch="test-1")
    res = cli.invoke(app, ["bench", "accuracy-vs-eps", "--dataset", str(private_only_store.path), "--quick",
                           "--out", str(tmp_path / "o2"), "--test-store", str(tmp_path / "other.zarr")])
    assert res.exit_code == 2 and res.stdout == "" and "label names" in res.stderr
    assert not (tmp_path / "o2").exists()


@pytest.mark.heavy
def test_cli_bench_shows_a_bar_with_step_counts_on_a_terminal_and_lines_off_it(labelled_store, tmp_path,
                                                                                 monkeypatch):
    """Issue 20: bench progress is a rich bar on a terminal (the phase as label, ε steps counted), one line
    per step off a terminal, nothing under --quiet."""
    import io

    from rich.console import Console

    from indknn_cli.cli.bench import papers as bench_cli
    from indknn_cli.cli import common

    make = BenchConfig.make.__func__
    monkeypatch.setattr(BenchConfig, "make", classmethod(
        lambda cls, *, quick, seed=0, **kw: make(cls, quick=quick, seed=seed, **{**kw, **{
            k: v for k, v in TINY.items() if k != "epsilons"}})))
    args = ["bench", "accuracy-vs-eps", "--dataset", str(labelled_store.path), "--quick", "--eps", "1,2"]
    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=120, highlight=False)
    monkeypatch.setattr(common, "stderr_console", lambda **kw: term)
    monkeypatch.setattr(bench_cli, "stderr_console", lambda **kw: term)
    res = cli.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, buf.getvalue()
    text = buf.getvalue()
    assert "2/2" in text and "0:00:" in text and "ε=2" in text, text  # the bar (M/N, elapsed) at the last ε
    assert "· tuning" not in text  # no per-step lines on a terminal
    monkeypatch.undo()
    monkeypatch.setattr(BenchConfig, "make", classmethod(
        lambda cls, *, quick, seed=0, **kw: make(cls, quick=quick, seed=seed, **{**kw, **{
            k: v for k, v in TINY.items() if k != "epsilons"}})))
    res = cli.invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert res.exit_code == 0 and "0:00:" not in res.stderr and "· tuning Ind-KNN" in res.stderr
    res = cli.invoke(app, [*args, "--out", str(tmp_path / "c"), "--quiet"])
    assert res.exit_code == 0 and "tuning" not in res.stderr and len(res.stdout.strip().splitlines()) == 1


def test_index_speed_table_shows_the_majority_class_beside_the_accuracies():
    """Issue 18/20: every accuracy table carries the constant majority-class answer, the floor to beat."""
    from indknn_cli.benchmarks import index_speed

    acc = {str(e): 0.8 for e in index_speed.EPSILONS}
    kind = {"build_s": 1.0, "queries_per_s": 10.0, "recall": 1.0, "mean_candidates": 5.0,
            "latency_ms_one_query": 1.0, "accuracy": acc}
    res = {"dataset": "toy", "n": 10, "d": 4, "queries": 3, "tau": 0.5, "sigma2": 0.5, "matmul_floor_q_per_s": 1.0,
           "majority_class": {"accuracy": 0.3333},
           "kinds": {"exact": kind, "lsh": {**kind, "strategy_at_batch": "scan", "queries_per_s_scan": 1,
                                            "queries_per_s_buckets": 1},
                     "ivf": {"nlist": 4, "build_s": 1.0, "nprobe_for_accuracy": 1, "nprobe_calibrated": 1,
                             "accuracy": acc, "sweep": [{"nprobe": 1, "queries_per_s": 1.0, "recall": 1.0,
                                                         "mean_candidates": 5.0}]}}}
    last = index_speed.table(res).splitlines()[-1]
    assert last.startswith("majority class") and last.split()[-3:] == ["0.333"] * len(index_speed.EPSILONS)


def test_a_long_axis_label_stays_inside_the_figure(tmp_path, monkeypatch):
    """The accuracy-vs-ε plot's x label names every method's accountant, the unit and the adjacency; on one line it
    ran past the figure's right edge, and the adjacency was cut ("add/remove one rec")."""
    import matplotlib.pyplot as plt

    from indknn_cli.benchmarks import report

    kept = []
    monkeypatch.setattr(plt, "close", lambda fig: kept.append(fig))
    label = ("total ε (δ=1e-05; Ind-KNN GDP, tuned privately RDP; P-kNN PLD; SGD PRV; per record, add/remove one "
             "record)")
    report.plot_lines(tmp_path / "p.png", series={"ind-knn": ([0.5, 1, 2], [0.8, 0.85, 0.86])}, xlabel=label,
                      ylabel="median accuracy, 1000 queries (band: min–max over draws)", title="t")
    fig = kept[0]
    fig.canvas.draw()
    box, width = fig.axes[0].xaxis.label.get_window_extent(), fig.bbox.width
    assert 0 <= box.x0 and box.x1 <= width, (box.x0, box.x1, width)
    assert fig.axes[0].get_xlabel().replace("\n", " ") == label


def test_two_nearly_equal_references_are_told_apart(tmp_path, monkeypatch):
    """Issue 20: kNN (0.897) and logistic regression (0.896) drew one line; each reference now also has its own
    marker, at its own x right of the data, with its min–max over draws as an error bar."""
    import matplotlib.pyplot as plt

    from indknn_cli.benchmarks import report

    kept = []
    monkeypatch.setattr(plt, "close", lambda fig: kept.append(fig))
    report.plot_lines(tmp_path / "p.png", series={"ind-knn": ([0.5, 1, 2], [0.8, 0.85, 0.86])}, xlabel="ε",
                      ylabel="acc", title="t", hlines={"knn (non-private)": (0.897, 0.89, 0.90),
                                                       "logistic regression": (0.896, 0.893, 0.899)})
    ax = kept[0].axes[0]
    points = [(float(ln.get_xdata()[0]), float(ln.get_ydata()[0]), ln.get_marker()) for ln in ax.lines
              if len(ln.get_xdata()) == 1 and ln.get_marker() not in (None, "None", "", "_")]  # "_": error-bar caps
    assert len(points) == 2 and points[0][0] != points[1][0] and points[0][2] != points[1][2]
    assert {round(p[1], 3) for p in points} == {0.897, 0.896} and min(p[0] for p in points) > 2


@pytest.mark.heavy
def test_gpu_serve_bench_times_parts_inside_the_process_dry_run_on_cpu():
    """`bench serve-speed --device cuda`'s steps run on the CPU (its dry run): B's parts are timed from the `-v`
    line each writes on stderr as it is released (8 parts of 256: 7 intervals), besides the two processes' walls."""
    from indknn_cli.benchmarks.serve_speed_gpu import run_gpu

    r = run_gpu(600, 16, 2048, 0.5, 256, device="cpu")
    assert r["first_batch_identical"] is True and r["in_process_queries_per_s"] > 0
    gaps = r["part_interval_ms"]
    assert 0 < gaps["min"] <= gaps["median"] <= gaps["max"] and 0 < r["first_part_released_s"] < r["wall_s"]["serve_all"]
