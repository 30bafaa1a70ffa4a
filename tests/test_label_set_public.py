"""The class list is public (SPEC §1): never read from the private rows (audit 9, F1).

Every answer is one of the store's label names, so a list inferred from the private rows lets one record with a
label of its own change what serving can release ("zeta" answered only when that record exists) and, through the
number of classes every tuning shard reads, move the private search's score by far more than its sensitivity 1.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from indknn_cli import tuning
from indknn_cli.cli.app import app
from indknn_cli.store import FeatureStore

from .conftest import clustered

runner = CliRunner()


def _npz(path, x, names, ids):
    np.savez(path, x=x, y=np.asarray(names, str), ids=np.asarray(ids, str))
    return str(path)


def _world(tmp_path, n=120):
    """D (n records, labels a/b/c) and D ∪ {x}, where x is the only record labelled zeta."""
    x, y, _ = clustered(n, 8, 3, seed=1)
    names = np.array(["a", "b", "c"])[y]
    ids = [f"r{i:04d}" for i in range(n)]
    d = _npz(tmp_path / "d.npz", x, names, ids)
    dx = _npz(tmp_path / "dx.npz", np.vstack([x, x[:1]]), list(names) + ["zeta"], ids + ["rzeta"])
    return d, dx


def test_a_store_is_never_created_with_names_read_from_private_rows(tmp_path):
    d, dx = _world(tmp_path)
    for src, tag in ((d, "d"), (dx, "dx")):
        res = runner.invoke(app, ["embed", src, "--store", str(tmp_path / f"{tag}.zarr"), "--extractor", "vectors"])
        assert res.exit_code == 2, res.output
        assert "--label-names" in res.stderr and "zeta" not in res.stderr  # no private label in the message
        assert not (tmp_path / f"{tag}.zarr").exists()  # nothing written
    # declared: D and D ∪ {x} cannot differ in their label set; x's label is refused instead of joining it
    ok = runner.invoke(app, ["embed", d, "--store", str(tmp_path / "s.zarr"), "--extractor", "vectors",
                             "--label-names", "a,b,c"])
    assert ok.exit_code == 0, ok.output
    st = FeatureStore.open(tmp_path / "s.zarr", mode="r")
    assert st.label_names == ["a", "b", "c"] and st.label_names_source == "declared"
    bad = runner.invoke(app, ["embed", dx, "--store", str(tmp_path / "s2.zarr"), "--extractor", "vectors",
                              "--label-names", "a,b,c"])
    assert bad.exit_code == 2 and "unknown label" in bad.stderr and not (tmp_path / "s2.zarr").exists()


@pytest.mark.heavy
def test_served_labels_range_over_the_declared_list_for_d_and_d_plus_x(tmp_path):
    """With a declared list that contains zeta, D ∪ {x} and D release over the same label set (same support)."""
    d, dx = _world(tmp_path)
    q, _, _ = clustered(40, 8, 3, seed=2)
    np.save(tmp_path / "q.npy", q.astype(np.float32))
    support = []
    for src, tag in ((d, "d"), (dx, "dx")):
        s, led = str(tmp_path / f"{tag}.zarr"), str(tmp_path / f"L{tag}")
        for args in (["embed", src, "--store", s, "--extractor", "vectors", "--label-names", "a,b,c,zeta"],
                     ["index", "--store", s, "--ledger", led, "--eps", "1", "--tau", "0.5"]):
            res = runner.invoke(app, args)
            assert res.exit_code == 0, res.output
        res = subprocess.run([sys.executable, "-m", "indknn_cli", "serve-queries", str(tmp_path / "q.npy"),
                              "--store", s, "--ledger", led, "--quiet"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        answers = [json.loads(line) for line in res.stdout.splitlines()]
        assert len(answers) == 40
        support.append(FeatureStore.open(s, mode="r").label_names)
        assert {a["label_name"] for a in answers} <= set(support[-1])
    assert support[0] == support[1] == ["a", "b", "c", "zeta"]


def test_public_rows_may_fix_the_list_and_private_rows_join_it(tmp_path):
    x, y, _ = clustered(60, 8, 3, seed=4)
    names = np.array(["a", "b", "c"])[y]
    pub = _npz(tmp_path / "pub.npz", x[:30], names[:30], [f"p{i}" for i in range(30)])
    priv = _npz(tmp_path / "priv.npz", x[30:], names[30:], [f"r{i}" for i in range(30)])
    s = str(tmp_path / "s.zarr")
    assert runner.invoke(app, ["embed", pub, "--store", s, "--extractor", "vectors", "--role", "public"]).exit_code == 0
    assert FeatureStore.open(s, mode="r").label_names_source == "public rows"
    res = runner.invoke(app, ["embed", priv, "--store", s, "--role", "private"])
    assert res.exit_code == 0, res.output


def test_tuning_reads_the_number_of_classes_from_the_declared_list(tmp_path):
    """The shards' noise draws one value per class: with the list declared, x (labelled with a declared class no
    other record has) moves the noiseless score by at most 1, the bound the score's noise is calibrated for."""
    x, y, _ = clustered(800, 8, 3, seed=5)
    base = dict(epsilon=2.0, delta=1e-5, seed=1, taus=(0.3,), sigma2s=(0.5,), n_val=200, mean_runs=1.0,
                planned_queries=100)
    req = tuning.TuneRequest(**base).check()
    n_classes = 4  # declared a, b, c, zeta; only x has zeta
    data = tuning.BaseRunData.build(x, y, n_shards=200, seed_text="seed:1", n_classes=n_classes)
    data_x = tuning.BaseRunData.build(np.vstack([x, x[:1]]), np.r_[y, 3], n_shards=200,
                                      seed_text="seed:1", n_classes=n_classes)
    rec, params = tuning.private_tune_arrays(x, y, n_classes=n_classes, req=req)
    for key in range(5):
        a = tuning.emulated_correct(data, params=params, run_key=key, n_shards=200, planned_queries=100)
        b = tuning.emulated_correct(data_x, params=params, run_key=key, n_shards=200, planned_queries=100)
        assert abs(a - b) <= 1


def test_a_library_created_store_that_does_not_say_where_its_names_came_from_is_unrecorded(tmp_path):
    """Audit 3, S1: ``FeatureStore.create`` used to record "declared" for any caller that did not say, so a
    library caller who built the list from private rows was never warned. It now records "unrecorded" unless the
    caller declares it, and `index` warns when it creates a ledger on such a store."""
    from indknn_cli.extractors import ExtractorInfo
    from indknn_cli.indexing import build_index, make_params

    x, y, _ = clustered(60, 8, 3, seed=2)
    st = FeatureStore.create(tmp_path / "u.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                             label_names=["a", "b", "c"])
    st.append("private", x, labels=y.astype(np.int32), record_ids=[f"r{i}" for i in range(60)])
    assert FeatureStore.open(tmp_path / "u.zarr", mode="r").label_names_source == "unrecorded"
    res = build_index(store_path=tmp_path / "u.zarr", ledger_path=tmp_path / "L",
                      params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=2.0, planned_queries=10))
    assert any("where its class names came from" in w for w in res.extra.get("warnings", []))
    declared = FeatureStore.create(tmp_path / "d.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=8,
                                   label_names=["a", "b", "c"], label_names_source="declared")
    assert declared.label_names_source == "declared"
