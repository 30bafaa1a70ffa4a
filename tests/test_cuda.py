"""The CUDA path gives the same candidates, answers, charges and ledger as the CPU.

These run only where torch sees a GPU (`pytest -m cuda`); elsewhere they are
reported as skipped, never as passed. The fp32 screen runs on the device, the
exact float64 κ on the host, so the answers must agree bit for bit (SPEC §5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from indknn_cli.engine import (ArraySource, BudgetView, ReusePool, StoreSource, answer_batch, dot_threshold,
                               find_candidates)
from indknn_cli.ledger import BudgetLedger, PrivacyParams
from indknn_cli.serving import build_index, make_params
from indknn_cli.store import ExtractorInfo, FeatureStore, normalize_rows

from .conftest import clustered, copies_of_pair, queries_at_level

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch sees no GPU")]

REPO = Path(__file__).resolve().parents[1]


def _stream(x: np.ndarray, d: int, *, level: float, seed: int) -> np.ndarray:
    q, _, _ = clustered(1500, d, 4, seed=seed)
    q[:50] = x[7]  # a private vector, repeated
    return np.concatenate([q, queries_at_level(x, level=level, count=600, seed=seed + 1)])


@pytest.mark.parametrize("d", [64, 768])
@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.55, None), ("rbf", 0.4, 1.0), ("rbf", 0.3, 0.05)])
def test_candidates_identical_on_cuda(d, kernel, tau, nu):
    x, _, _ = clustered(6000, d, 4, seed=3)
    q = _stream(x, d, level=dot_threshold(kernel=kernel, tau=tau, nu=nu), seed=9)
    src = ArraySource(x, rows=1024)
    cpu = find_candidates(q, src, kernel=kernel, tau=tau, nu=nu, device="cpu")
    gpu = find_candidates(q, src, kernel=kernel, tau=tau, nu=nu, device="cuda")
    assert sum(r.size for r in cpu.rows) > 0  # the stream has candidates at all
    for t in range(len(q)):
        assert np.array_equal(cpu.rows[t], gpu.rows[t]), t
        assert np.array_equal(cpu.kappa[t], gpu.kappa[t]), t  # float64 κ, bit for bit


def test_store_chunks_resident_on_the_gpu_give_the_same_candidates(tmp_path):
    """The first batch copies the store's chunks to the GPU once; later batches use them: same candidates."""
    d = 256
    x, y, _ = clustered(9000, d, 4, seed=8)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=d,
                                label_names=list("abcd"), chunk_rows=1000)
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(len(x))])
    mask = np.ones(len(x), bool)
    mask[::7] = False  # deleted / unindexed rows are never candidates, resident or not
    src = StoreSource(FeatureStore.open(store.path))
    for seed in (20, 21, 22):  # first call fills the resident copy, the next two use it
        q = _stream(x, d, level=0.5, seed=seed)
        cpu = find_candidates(q, ArraySource(x, rows=1000), kernel="cosine", tau=0.5, nu=None, device="cpu",
                              row_mask=mask)
        gpu = find_candidates(q, src, kernel="cosine", tau=0.5, nu=None, device="cuda", row_mask=mask)
        assert [v is not None for v in src._on_device.values()] == [True]  # really resident
        assert sum(r.size for r in cpu.rows) > 0
        for t in range(len(q)):
            assert np.array_equal(cpu.rows[t], gpu.rows[t]) and np.array_equal(cpu.kappa[t], gpu.kappa[t]), t


@pytest.mark.parametrize("reuse", [False, True])
def test_answers_and_charges_identical_on_cuda(reuse):
    d, n = 128, 8000
    x, y, _ = clustered(n, d, 4, seed=4)
    q = _stream(x, d, level=0.5, seed=12)
    p = PrivacyParams(epsilon=1.0, delta=1e-5, conversion="gdp", budget=0.02, kernel="cosine", tau=0.5,
                      sigma1=8.0, sigma2=0.5, nu=None, k_min=5.0, planned_queries=None).validate()
    results = {}
    for device in ("cpu", "cuda"):
        budgets = BudgetView(spent=np.zeros(n), budget=np.full(n, p.budget), deleted=np.zeros(n, bool),
                             times_selected=np.zeros(n, np.int64))
        pool = ReusePool.empty(d) if reuse else None
        answers = []
        for lo in range(0, len(q), 500):
            answers += answer_batch(q[lo:lo + 500], source=ArraySource(x, rows=777), row_to_ledger=np.arange(n),
                                    row_labels=y, params=p, n_classes=4, budgets=budgets, run_key=99,
                                    first_index=lo, reuse=pool, device=device)
        results[device] = ([(a.label, a.released_count) for a in answers], budgets.spent.copy(),
                           budgets.times_selected.copy())
    assert results["cpu"][1].max() > 0 and results["cpu"][2].max() >= 2  # charged, some records several times
    assert results["cpu"][0] == results["cuda"][0]
    assert np.array_equal(results["cpu"][1], results["cuda"][1])  # spent, bit for bit
    assert np.array_equal(results["cpu"][2], results["cuda"][2])


def test_cli_serve_on_cuda_equals_cpu(tmp_path):
    """Real processes: the same store and ledger served with --device cpu and --device cuda."""
    d, n = 384, 20000
    x, y, _ = clustered(n, d, 5, seed=31)
    store = FeatureStore.create(tmp_path / "built" / "store.zarr", extractor=ExtractorInfo("vectors", "none", "1"),
                                dim=d, label_names=list("abcde"), chunk_rows=4096)
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(n)])
    q = normalize_rows(_stream(x, d, level=0.5, seed=40))
    store.append("query", q, record_ids=[f"q{i}" for i in range(len(q))], batch="b")
    build_index(store_path=store.path, ledger_path=tmp_path / "built" / "ledger",
                params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5, planned_queries=2000))
    # two copies of one pair, none beside a live original (store_twins)
    copies_of_pair(store.path, tmp_path / "built" / "ledger", tmp_path / "cpu", tmp_path / "cuda")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1")
    out = {}
    for device in ("cpu", "cuda"):
        root = tmp_path / device
        proc = subprocess.run([sys.executable, "-m", "indknn_cli", "serve-queries", "b", "--store",
                               str(root / "store.zarr"), "--ledger", str(root / "ledger"), "--seed", "5",
                               "--batch-size", "256", "--device", device],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        out[device] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(out["cpu"]) == len(q)
    assert out["cpu"] == out["cuda"]
    a, b = BudgetLedger.open(tmp_path / "cpu" / "ledger"), BudgetLedger.open(tmp_path / "cuda" / "ledger")
    assert a.state.spent.max() > 0
    for name in ("spent", "times_selected", "deleted"):
        assert np.array_equal(getattr(a.state, name), getattr(b.state, name)), name
    assert a.state.answers == b.state.answers


@pytest.mark.parametrize("d", [384, 768])
@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.55, None), ("rbf", 0.4, 1.0)])
def test_fused_kernels_give_the_cpu_candidates_on_cuda(tmp_path, monkeypatch, d, kernel, tau, nu):
    """The fused kernels (gpu_fused), compiled: their probe passes on this GPU, a pass over a resident store
    with a pair bound takes them (spied), and the candidates and κ are the CPU's, bit for bit."""
    pytest.importorskip("triton")
    from indknn_cli import gpu_fused

    assert gpu_fused.usable(torch.device("cuda"), d)
    x, y, _ = clustered(7000, d, 4, seed=13)
    store = FeatureStore.create(tmp_path / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=d,
                                label_names=list("abcd"), chunk_rows=1000)
    store.append("private", x, labels=y, record_ids=[f"r{i}" for i in range(len(x))])
    mask = np.ones(len(x), bool)
    mask[::5] = False
    calls = []
    real = gpu_fused.find_pass
    monkeypatch.setattr(gpu_fused, "find_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    src = StoreSource(FeatureStore.open(store.path))
    for seed in (50, 51):
        q = _stream(x, d, level=dot_threshold(kernel=kernel, tau=tau, nu=nu), seed=seed)
        cpu = find_candidates(q, ArraySource(x, rows=1000), kernel=kernel, tau=tau, nu=nu, device="cpu", row_mask=mask)
        gpu = find_candidates(q, src, kernel=kernel, tau=tau, nu=nu, device="cuda", row_mask=mask, max_pairs=10**7)
        assert sum(r.size for r in cpu.rows) > 0
        for t in range(len(q)):
            assert np.array_equal(cpu.rows[t], gpu.rows[t]) and np.array_equal(cpu.kappa[t], gpu.kappa[t]), t
    assert len(calls) == 2
