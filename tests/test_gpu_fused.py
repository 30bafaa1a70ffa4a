"""The fused GPU kernels (gpu_fused), run in Triton's interpreter on torch's CPU device against the CPU path.

The candidates and κ must be bit for bit find_candidates' on ``--device cpu``: the fused screen's margin on
data placed at the threshold, the row mask, ``strictly_before``, the pair bound, the float64 leaf sums of
numpy's pairwise order (cosine and RBF). Skipped where Triton is not installed; tests/test_cuda.py runs the
kernels compiled on a GPU.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from indknn_cli import candidates, gpu_fused, gpu_screen
from indknn_cli.candidates import ArraySource, TooManyPairs, exact_sums, find_candidates
from indknn_cli.exact_jit import pairwise_plan

from .conftest import assert_same_candidates, clustered, one_way_rounding_world, reuse_world, threshold_world

# Triton's interpreter must be chosen before Triton is first imported (its own library functions are
# decorated then). With a GPU, tests/test_cuda.py runs the compiled kernels instead.
if torch.cuda.is_available():
    pytest.skip("a GPU is present: tests/test_cuda.py runs the kernels compiled", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton was imported before its interpreter could be chosen", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
CPU = torch.device("cpu")


@pytest.mark.heavy
@pytest.mark.parametrize("kernel", ["cosine", "rbf"])
@pytest.mark.parametrize("d", [8, 96, 256, 384, 768, 1024])
def test_leaf_pair_sums_are_numpys_bits(kernel, d):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((300, d)) * 10.0 ** rng.uniform(-6, 6, (300, d))).astype(np.float32)
    q = rng.standard_normal((40, d)).astype(np.float32)
    x[0] = 0.0
    xi = rng.integers(0, 300, 700).astype(np.int32)
    qi = rng.integers(0, 40, 700).astype(np.int32)
    xi[:5] = 0
    want = exact_sums(x[xi], q[qi], kernel=kernel)
    got = gpu_fused.leaf_pair_sums(torch.from_numpy(x), torch.from_numpy(xi), torch.from_numpy(q),
                                   torch.from_numpy(qi), kernel=kernel, plan=pairwise_plan(d)).numpy()
    assert np.array_equal(got.view(np.int64), want.view(np.int64))


def test_leaf_shape_takes_only_equal_leaves_of_eights():
    assert gpu_fused.leaf_shape(384) == (96, 4)
    assert gpu_fused.leaf_shape(768) == (96, 8)
    assert gpu_fused.leaf_shape(96) == (96, 1)
    assert gpu_fused.leaf_shape(200) is None  # numpy splits 200 into 96 + 104
    assert gpu_fused.leaf_shape(7) is None


@pytest.mark.heavy
@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.55, None), ("rbf", 0.4, 1.0), ("rbf", 0.3, 0.05)])
def test_fused_path_gives_the_cpu_candidates(kernel, tau, nu):
    q, src, mask, thr = threshold_world(kernel, tau, nu, rows=2000, queries=200, chunk=700)
    want = find_candidates(q, src, kernel=kernel, tau=tau, nu=nu, device="cpu", row_mask=mask)
    got = candidates._find_on_gpu(q, src, CPU, kernel=kernel, tau=tau, nu=nu, threshold=thr, row_mask=mask,
                                  strictly_before=None, max_pairs=10**7, fp16=True, fused=True)
    assert sum(r.size for r in want.rows) > 100
    assert_same_candidates(want, got)


def test_strictly_before_and_a_single_query():
    x, q, limit = reuse_world()
    want = find_candidates(q, ArraySource(x), kernel="cosine", tau=0.6, nu=None, device="cpu", strictly_before=limit)
    got = candidates._find_on_gpu(q, ArraySource(x), CPU, kernel="cosine", tau=0.6, nu=None, threshold=0.6,
                                  row_mask=None, strictly_before=limit, max_pairs=10**6, fp16=True, fused=True)
    assert_same_candidates(want, got)
    one = candidates._find_on_gpu(q[:1], ArraySource(x), CPU, kernel="cosine", tau=0.6, nu=None, threshold=0.6,
                                  row_mask=None, strictly_before=None, max_pairs=None, fp16=True, fused=True)
    assert_same_candidates(find_candidates(q[:1], ArraySource(x), kernel="cosine", tau=0.6, nu=None, device="cpu"), one)


def test_the_margin_is_what_keeps_pairs_at_the_threshold(monkeypatch):
    """gpu_screen's case of rounding that runs one way (components rounded down to 0.0625 in fp16, τ the exact
    x·x of one row): without the margin the fused screen drops the pair whose exact dot is τ (the test can
    fail); with it, the candidates are the CPU path's."""
    x, q, tau = one_way_rounding_world()
    src = ArraySource(x)
    want = find_candidates(q, src, kernel="cosine", tau=tau, nu=None, device="cpu")
    assert 40 in want.rows[10]
    kw = dict(kernel="cosine", tau=tau, nu=None, threshold=tau, row_mask=None, strictly_before=None, max_pairs=10**6,
              fp16=True, fused=True)
    assert_same_candidates(want, candidates._find_on_gpu(q, src, CPU, **kw))
    monkeypatch.setattr(gpu_screen, "SAFETY", 0.0)
    lost = candidates._find_on_gpu(q, src, CPU, **kw)
    assert 40 not in lost.rows[10]


@pytest.mark.heavy
@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.55, None), ("rbf", 0.4, 1.0)])
def test_many_launches_and_recompute_slices_give_the_cpu_candidates(monkeypatch, kernel, tau, nu):
    """Rows in launches of 128 (the second and later from row0 > 0: the mask and the rows written are offset) and
    the recompute in slices of 1,024 pairs: the CPU's candidates (review 17: dropping row0 passed every test)."""
    q, src, mask, thr = threshold_world(kernel, tau, nu, rows=2000, queries=200, chunk=700)
    want = find_candidates(q, src, kernel=kernel, tau=tau, nu=nu, device="cpu", row_mask=mask)
    monkeypatch.setattr(gpu_fused, "LAUNCH_BYTES", 1)  # BN = 128 rows per launch: 16 launches
    monkeypatch.setattr(gpu_screen, "RECOMPUTE_BYTES", 1)  # 1,024 pairs per slice
    got = candidates._find_on_gpu(q, src, CPU, kernel=kernel, tau=tau, nu=nu, threshold=thr, row_mask=mask,
                                  strictly_before=None, max_pairs=10**7, fp16=True, fused=True)
    assert sum(r.size for r in want.rows) > 10 * 1024
    assert_same_candidates(want, got)


def test_the_screen_writes_nothing_past_its_bound_and_counts_every_pair():
    x, _, _ = clustered(500, 16, 2, seed=1)
    x = torch.from_numpy(x.astype(np.float32))
    q16 = x[:50].clone().to(torch.float16)
    x16 = x.to(torch.float16)
    sentinel = -7
    out_q = torch.full((6000,), sentinel, dtype=torch.int32)
    out_r = torch.full((6000,), sentinel, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int64)
    gpu_fused._launch_screen(q16, x16, row0=0, level=0.1, mask=None, out_q=out_q, out_r=out_r, count=count, cap=5000)
    total = int(count.item())
    assert total > 5000  # more pairs pass than the bound: all counted
    assert (out_q[:5000] >= 0).all() and (out_r[:5000] >= 0).all()
    assert (out_q[5000:] == sentinel).all() and (out_r[5000:] == sentinel).all()  # nothing written past it


def test_more_pairs_than_the_bound_raise_and_the_bound_itself_is_kept():
    x, _, _ = clustered(500, 16, 2, seed=1)
    x = x.astype(np.float32)
    with pytest.raises(TooManyPairs):
        candidates._find_on_gpu(x[:50], ArraySource(x), CPU, kernel="cosine", tau=0.1, nu=None, threshold=0.1,
                                row_mask=None, strictly_before=None, max_pairs=100, fp16=True, fused=True)
    src = ArraySource(x)
    want = find_candidates(x[:50], src, kernel="cosine", tau=0.1, nu=None, device="cpu")
    n = sum(r.size for r in want.rows)
    # x[:50] copied: the interpreter takes tensors that share memory for one
    gs = gpu_screen.GpuScreen(x[:50].copy(), CPU, kernel="cosine", tau=0.1, nu=None, threshold=0.1,
                              fp32_margin=candidates.screening_margin(16), row_mask=None, strictly_before=None,
                              fp16=True)
    count = torch.zeros(1, dtype=torch.int64)  # the pairs the screen passes (a superset of the n candidates)
    big = torch.empty(50 * 500, dtype=torch.int32)
    gpu_fused._launch_screen(gs.q_s, torch.from_numpy(x).to(torch.float16), row0=0, level=gpu_fused.fused_level(gs),
                             mask=None, out_q=big, out_r=big.clone(), count=count, cap=50 * 500)
    screened = int(count.item())
    assert screened >= n
    qi, rows, _ = gpu_fused.find_pass(gs, torch.from_numpy(x), max_pass=screened)  # at the bound exactly
    assert qi.shape[0] == n
    with pytest.raises(TooManyPairs):
        gpu_fused.find_pass(gs, torch.from_numpy(x), max_pass=screened - 1)


def test_probe_passes_here_and_fails_when_the_accumulation_bound_is_too_tight(monkeypatch):
    assert gpu_fused._probe(CPU, 64)
    monkeypatch.setattr(gpu_screen, "U_ACC", 0.0)  # no room for the accumulator's rounding: the probe must refuse
    assert not gpu_fused._probe(CPU, 64)


def test_auto_choice_stays_off_the_cpu_and_off_when_disabled(monkeypatch):
    assert not gpu_fused.wanted(CPU)
    monkeypatch.setenv("INDKNN_GPU_FUSED", "0")
    assert not gpu_fused.wanted(torch.device("cuda"))


def test_a_failure_of_the_fused_path_falls_back_to_the_same_candidates(monkeypatch):
    """Chosen automatically (a resident store, a pair bound), a fused pass that fails (a later variant that does
    not compile, say) leaves the batch, and the process, on gpu_screen's path: the same candidates."""
    x, _, _ = clustered(900, 96, 3, seed=9)
    x = x.astype(np.float32)
    q = x[:60].copy()
    want = find_candidates(q, ArraySource(x), kernel="cosine", tau=0.6, nu=None, device="cpu")
    marked = []
    monkeypatch.setattr(gpu_fused, "wanted", lambda dev: True)
    monkeypatch.setattr(gpu_fused, "usable", lambda dev, dim: True)
    monkeypatch.setattr(gpu_fused, "mark_unusable", lambda dev, dim: marked.append(dim))
    monkeypatch.setattr(candidates, "_resident_blocks", lambda source, dev: [(0, torch.from_numpy(x.copy()))])

    def broken(*a, **k):
        raise RuntimeError("does not compile")

    monkeypatch.setattr(gpu_fused, "find_pass", broken)
    got = candidates._find_on_gpu(q, ArraySource(x), CPU, kernel="cosine", tau=0.6, nu=None, threshold=0.6,
                                  row_mask=None, strictly_before=None, max_pairs=10**6, fp16=True)
    assert_same_candidates(want, got)
    assert marked == [96]
    with pytest.raises(RuntimeError):
        candidates._find_on_gpu(q, ArraySource(x), CPU, kernel="cosine", tau=0.6, nu=None, threshold=0.6,
                                row_mask=None, strictly_before=None, max_pairs=10**6, fp16=True, fused=True)
