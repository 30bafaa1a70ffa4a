"""The GPU candidate phase (gpu_screen), run here on torch's CPU device: the same tensor operations the GPU runs.

The candidates and κ must be bit for bit the CPU path's (find_candidates on ``--device cpu``): numpy's
pairwise order of the float64 sums, the fp16 screen's margin on data placed at the threshold, the RBF
kernel's host-side exp, the row mask and the reuse pool's ``strictly_before``. tests/test_cuda.py runs the
same comparison on a GPU, where there is one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from indknn_cli import candidates, gpu_screen
from indknn_cli.candidates import ArraySource, TooManyPairs, dot_threshold, exact_sums, find_candidates
from indknn_cli.exact_jit import pairwise_plan

from .conftest import assert_same_candidates, clustered, one_way_rounding_world, reuse_world, threshold_world

CPU = torch.device("cpu")


@pytest.mark.parametrize("d", [1, 5, 8, 9, 64, 128, 129, 200, 300, 384, 768, 1000])
def test_numpy_order_sums_are_numpys_bits(d):
    rng = np.random.default_rng(d)
    t = rng.standard_normal((257, d)) * 10.0 ** rng.uniform(-8, 8, (257, d))
    t[0] = 0.0
    t[1] = -0.0  # a −0.0 sum becomes +0.0 in numpy's reduction
    t[2, ::2], t[2, 1::2] = 1e300, -1e300  # cancellation
    want = t.sum(axis=1)
    got = gpu_screen.numpy_order_sums(torch.from_numpy(t), pairwise_plan(d)).numpy()
    assert np.array_equal(got.view(np.int64), want.view(np.int64))


@pytest.mark.parametrize("kernel", ["cosine", "rbf"])
@pytest.mark.parametrize("d", [7, 384, 770])
def test_pair_sums_equal_exact_sums(kernel, d):
    rng = np.random.default_rng(d + 1)
    x = rng.standard_normal((300, d)).astype(np.float32)
    q = rng.standard_normal((40, d)).astype(np.float32)
    xi = rng.integers(0, 300, 5000)
    qi = rng.integers(0, 40, 5000)
    want = exact_sums(x[xi], q[qi], kernel=kernel)
    got = gpu_screen.pair_sums(torch.from_numpy(x), torch.from_numpy(xi), torch.from_numpy(q), torch.from_numpy(qi),
                               kernel=kernel, plan=pairwise_plan(d)).numpy()
    assert np.array_equal(got.view(np.int64), want.view(np.int64))


@pytest.mark.parametrize("fp16", [True, False])
@pytest.mark.parametrize("kernel,tau,nu", [("cosine", 0.55, None), ("rbf", 0.4, 1.0), ("rbf", 0.3, 0.05)])
def test_device_path_gives_the_cpu_candidates(kernel, tau, nu, fp16):
    q, src, mask, thr = threshold_world(kernel, tau, nu, rows=3000, queries=300, chunk=1000)
    want = find_candidates(q, src, kernel=kernel, tau=tau, nu=nu, device="cpu", row_mask=mask)
    got = candidates._find_on_gpu(q, src, CPU, kernel=kernel, tau=tau, nu=nu, threshold=thr, row_mask=mask,
                                  strictly_before=None, max_pairs=None, fp16=fp16)
    assert sum(r.size for r in want.rows) > 100
    assert_same_candidates(want, got)


def test_strictly_before_as_the_reuse_pool_uses_it():
    x, q, limit = reuse_world()
    want = find_candidates(q, ArraySource(x), kernel="cosine", tau=0.6, nu=None, device="cpu", strictly_before=limit)
    got = candidates._find_on_gpu(q, ArraySource(x), CPU, kernel="cosine", tau=0.6, nu=None, threshold=0.6,
                                  row_mask=None, strictly_before=limit, max_pairs=None, fp16=True)
    assert_same_candidates(want, got)


def test_the_fp16_margin_is_what_keeps_pairs_at_the_threshold(monkeypatch):
    """Rounding that runs one way: rows of k components a = 0.0625 + 2^-15 − 2^-24, each rounded down to 0.0625
    in fp16, and τ = the exact x·x of one of them. Without the margin the fp16 screen drops the pair whose exact
    dot is τ (the test can fail); with it, the candidates are the CPU path's."""
    x, q, tau = one_way_rounding_world()
    src = ArraySource(x)
    want = find_candidates(q, src, kernel="cosine", tau=tau, nu=None, device="cpu")
    assert 40 in want.rows[10]
    kw = dict(kernel="cosine", tau=tau, nu=None, threshold=tau, row_mask=None, strictly_before=None, max_pairs=None,
              fp16=True)
    assert_same_candidates(want, candidates._find_on_gpu(q, src, CPU, **kw))
    monkeypatch.setattr(gpu_screen, "SAFETY", 0.0)
    lost = candidates._find_on_gpu(q, src, CPU, **kw)
    assert 40 not in lost.rows[10]


def test_step_rows_bound_device_memory_whatever_the_data():
    for m in (1, 100, 8192, 65536):
        rows = gpu_screen.step_rows(m, 10**6)
        assert (rows % 1024 == 0 and rows >= 1024) or rows == 10**6
        assert m * rows * 19 <= max(gpu_screen.GPU_STEP_BYTES, m * 1024 * 19)
    assert gpu_screen.recompute_slice(384) * 16 * 384 <= gpu_screen.RECOMPUTE_BYTES


def test_many_pairs_raise_for_the_caller_to_halve():
    x, _, _ = clustered(500, 16, 2, seed=1)
    with pytest.raises(TooManyPairs):
        candidates._find_on_gpu(x[:50], ArraySource(x), CPU, kernel="cosine", tau=0.1, nu=None, threshold=0.1,
                                row_mask=None, strictly_before=None, max_pairs=100, fp16=True)


def test_margin_closed_form():
    m = gpu_screen.fp16_screen_margin(dim=384, norm_x=1.0, norm_q=1.0)
    u, s, g = 2.0**-11, 2.0**-25, 384 * 2.0**-20 / (1 - 384 * 2.0**-20)
    e1 = (2 * u + u * u) + s * (1 + u) * np.sqrt(384) * 2 + 384 * s * s
    assert m == pytest.approx(e1 + g * (1 + e1), rel=1e-12)
    assert 0.0013 < m < 0.0014
    with pytest.raises(ValueError, match="dim"):
        gpu_screen.fp16_screen_margin(dim=0, norm_x=1.0, norm_q=1.0)
    with pytest.raises(ValueError, match="norm_q"):
        gpu_screen.fp16_screen_margin(dim=8, norm_x=1.0, norm_q=float("nan"))


def test_probe_passes_on_torch_cpu_and_fails_on_a_product_off_its_bound(monkeypatch):
    assert gpu_screen._probe(CPU, 64)
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: (real_mm(a.float(), b.float()) * (1 + 2.0**-9)).to(a.dtype))
    assert not gpu_screen._probe(CPU, 64)


def test_rbf_with_tau_next_to_one_keeps_the_cpus_candidates():
    """τ set to the CPU's own κ of a pair, 1 − τ down to ~1e-16: the device's conservative test on the sums
    must keep it (a relative slack alone dropped 118 of 300 such pairs; audit 2026-11-27)."""
    import math

    from indknn_cli.candidates import exact_kernel

    rng = np.random.default_rng(2)
    nu, d, kept = math.exp(1.5), 64, 0
    for _ in range(60):
        q = rng.standard_normal(d)
        q = (q / np.linalg.norm(q)).astype(np.float32)
        x = q.astype(np.float64).copy()
        x[:4] += rng.standard_normal(4) * 10.0 ** rng.uniform(-7, -3)
        x = (x / np.linalg.norm(x)).astype(np.float32)
        tau = float(exact_kernel(x[None], q[None], kernel="rbf", nu=nu)[0])
        if not 0 < tau < 1:
            continue
        thr = dot_threshold(kernel="rbf", tau=tau, nu=nu)
        got = candidates._find_on_gpu(q[None], ArraySource(x[None]), CPU, kernel="rbf", tau=tau, nu=nu,
                                      threshold=thr, row_mask=None, strictly_before=None, max_pairs=None, fp16=True)
        assert got.rows[0].size == 1, 1 - tau
        kept += 1
    assert kept > 30


def test_a_step_counts_its_pairs_before_making_them(monkeypatch):
    """With a pair bound the device never holds more passing pairs than the bound, whatever the data: the
    step raises TooManyPairs before torch.nonzero when its count is over (audit 2026-11-27, D1)."""
    x, _, _ = clustered(4000, 16, 2, seed=1)
    made = []
    real = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", lambda t, **kw: made.append(int(t.sum())) or real(t, **kw))
    with pytest.raises(TooManyPairs):
        candidates._find_on_gpu(x[:64], ArraySource(x), CPU, kernel="cosine", tau=0.01, nu=None, threshold=0.01,
                                row_mask=None, strictly_before=None, max_pairs=5000, fp16=True)
    assert all(n <= 5000 for n in made)


def test_two_threads_never_screen_with_the_flags_of_the_other():
    """The cuBLAS flags are process-wide: while one thread's product runs inside _exact_matmul another thread
    cannot enter and restore them (D2)."""
    import threading

    inside = threading.Event()
    release = threading.Event()
    entered = []

    def a():
        with gpu_screen._exact_matmul(torch):
            inside.set()
            release.wait(5)

    def b():
        inside.wait(5)
        with gpu_screen._exact_matmul(torch):
            entered.append(release.is_set())

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start(); tb.start()
    inside.wait(5)
    tb.join(0.3)
    assert tb.is_alive() and not entered  # B waits while A's block is open
    release.set()
    ta.join(5); tb.join(5)
    assert entered == [True]
    assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is not None
