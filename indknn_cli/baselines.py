"""Baselines of the paper's comparisons (SPEC §6), reusable outside `bench`.

* **Private-kNN** (Zhu et al. 2020, CVPR; ``papers/private_knn_cvpr2020.md``):
  per query, Poisson-subsample the private set (each record independently
  with probability γ), take the k nearest neighbours *in the subsample*,
  release ``argmax(histogram + N(0, s²·I))``. Under add/remove adjacency one
  record can enter the top k and push another out, so the histogram's L2
  sensitivity is √2 and the noise standard deviation is ``s = σ·√2`` for a
  sensitivity-1 noise multiplier σ. σ is calibrated so that T-fold
  composition of ``PoissonSampledDpEvent(γ, GaussianDpEvent(σ))`` is
  (ε, δ)-DP by dp-accounting's RDP or PLD accountant (never hand-written
  bounds).
* **Linear NoisySGD** (Tramèr & Boneh 2021): DP-SGD of a linear head on the
  same features with Opacus (Poisson batches of expected size 256, per-sample
  clipping 0.1, 10 epochs), σ from Opacus's ``get_noise_multiplier`` (the
  calibration ``make_private_with_epsilon`` runs, cached) and the final ε read
  from the PrivacyEngine's accountant after training.
* Non-private references: k-NN majority vote and L2-regularised logistic
  regression (full-batch L-BFGS).

Randomness comes from the ``rng``/``seed`` arguments: benchmarks only. None of
these functions releases anything by itself.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import BadInputError

#: L2 sensitivity of the top-k label histogram under add/remove adjacency (SPEC §6).
HISTOGRAM_SENSITIVITY = math.sqrt(2.0)
ACCOUNTANTS = ("rdp", "pld")


# -- Private-kNN: accounting ------------------------------------------------------
def _check_private_knn_args(epsilon: float, delta: float, sampling_rate: float, queries: int, accountant: str):
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise BadInputError(f"epsilon must be positive and finite, got {epsilon!r}")
    if not (0 < delta < 1):
        raise BadInputError(f"delta must lie in (0, 1), got {delta!r}")
    if not (0 < sampling_rate <= 1):
        raise BadInputError(f"sampling rate γ must lie in (0, 1], got {sampling_rate!r}")
    if int(queries) != queries or queries < 1:
        raise BadInputError(f"number of queries T must be a positive integer, got {queries!r}")
    if accountant not in ACCOUNTANTS:
        raise BadInputError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")


def private_knn_epsilon(*, noise_multiplier: float, delta: float, sampling_rate: float, queries: int,
                        accountant: str = "rdp") -> float:
    """ε at δ of T Poisson-subsampled Gaussian mechanisms (sensitivity-1 noise multiplier σ).

    Add/remove adjacency (dp-accounting's default neighbouring relation).
    """
    _check_private_knn_args(1.0, delta, sampling_rate, queries, accountant)
    if not (noise_multiplier > 0):
        raise BadInputError(f"noise multiplier must be positive, got {noise_multiplier!r}")
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling_probability=float(sampling_rate),
                                            event=dp_accounting.GaussianDpEvent(float(noise_multiplier))),
        int(queries))
    if accountant == "rdp":
        import logging

        from dp_accounting.rdp import RdpAccountant

        # fractional orders that fail to converge are dropped by the library (still a valid bound)
        logging.getLogger("absl").setLevel(logging.ERROR)

        acc = RdpAccountant()
    else:
        from dp_accounting.pld import PLDAccountant

        acc = PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(event)
    return float(acc.get_epsilon(float(delta)))


@lru_cache(maxsize=1024)
def private_knn_noise_multiplier(*, epsilon: float, delta: float, sampling_rate: float, queries: int,
                                 accountant: str = "rdp", rel_tol: float = 2e-3) -> float:
    """Smallest σ (to ``rel_tol``, rounded up: the returned σ always meets ε) for T queries at (ε, δ)."""
    _check_private_knn_args(epsilon, delta, sampling_rate, queries, accountant)

    def ok(s: float) -> bool:
        return private_knn_epsilon(noise_multiplier=s, delta=delta, sampling_rate=sampling_rate,
                                   queries=queries, accountant=accountant) <= epsilon

    lo, hi = 0.0, 1.0
    while not ok(hi):
        lo, hi = hi, hi * 2.0
        if hi > 1e7:
            raise BadInputError(f"no noise level reaches ε={epsilon} for T={queries}")
    if lo == 0.0:
        lo = hi / 2.0
        while ok(lo) and lo > 1e-4:
            hi, lo = lo, lo / 2.0
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


# -- Private-kNN: prediction --------------------------------------------------------
def poisson_subsample_mask(n: int, *, rate: float, rng: np.random.Generator, size: int = 1) -> np.ndarray:
    """Bool [size, n]: each record in each row independently with probability ``rate`` (Poisson sampling)."""
    return rng.random((size, n)) < rate


def private_knn_predict(queries: np.ndarray, *, features: np.ndarray, labels: np.ndarray, n_classes: int,
                        sampling_rate: float, k: int, noise_std: float, rng: np.random.Generator,
                        batch: int = 128) -> np.ndarray:
    """Private-kNN labels (``noise_std`` = σ·√2; 0 with rate 1 gives the non-private k-NN vote).

    Neighbours by cosine similarity (unit vectors); a subsample with fewer
    than k records votes with all of them; an empty one releases argmax(noise).
    """
    if k < 1:
        raise BadInputError(f"k must be ≥ 1, got {k}")
    n = features.shape[0]
    k_eff = min(int(k), n)
    out = np.empty(queries.shape[0], np.int64)
    f32 = np.ascontiguousarray(features, dtype=np.float32)
    for lo in range(0, queries.shape[0], batch):
        q = np.ascontiguousarray(queries[lo:lo + batch], dtype=np.float32)
        scores = q @ f32.T
        if sampling_rate < 1.0:
            mask = poisson_subsample_mask(n, rate=sampling_rate, rng=rng, size=q.shape[0])
            scores = np.where(mask, scores, -np.inf)
        if k_eff < n:
            idx = np.argpartition(-scores, k_eff - 1, axis=1)[:, :k_eff]
        else:
            idx = np.broadcast_to(np.arange(n), (q.shape[0], n))
        valid = np.isfinite(np.take_along_axis(scores, idx, axis=1))
        votes = np.zeros((q.shape[0], n_classes))
        rows = np.broadcast_to(np.arange(q.shape[0])[:, None], idx.shape)
        np.add.at(votes, (rows[valid], labels[idx[valid]]), 1.0)
        if noise_std > 0:
            votes = votes + noise_std * rng.standard_normal(votes.shape)
        out[lo:lo + q.shape[0]] = np.argmax(votes, axis=1)
    return out


@dataclass
class PrivateKNN:
    """Private-kNN with noise calibrated for ``queries`` answers at (ε, δ)."""

    sampling_rate: float
    k: int
    epsilon: float
    delta: float
    queries: int
    noise_multiplier: float
    accountant: str = "rdp"

    @classmethod
    def calibrated(cls, *, sampling_rate: float, k: int, epsilon: float, delta: float, queries: int,
                   accountant: str = "rdp") -> "PrivateKNN":
        s = private_knn_noise_multiplier(epsilon=float(epsilon), delta=float(delta),
                                         sampling_rate=float(sampling_rate), queries=int(queries),
                                         accountant=accountant)
        return cls(float(sampling_rate), int(k), float(epsilon), float(delta), int(queries), s, accountant)

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * HISTOGRAM_SENSITIVITY

    def accounted_epsilon(self) -> float:
        return private_knn_epsilon(noise_multiplier=self.noise_multiplier, delta=self.delta,
                                   sampling_rate=self.sampling_rate, queries=self.queries, accountant=self.accountant)

    def predict(self, queries, *, features, labels, n_classes, rng) -> np.ndarray:
        if queries.shape[0] > self.queries:
            raise BadInputError(f"Private-kNN was calibrated for {self.queries} queries, asked {queries.shape[0]}")
        return private_knn_predict(queries, features=features, labels=labels, n_classes=n_classes,
                                   sampling_rate=self.sampling_rate, k=self.k, noise_std=self.noise_std, rng=rng)

    def as_dict(self) -> dict:
        return {"sampling_rate": self.sampling_rate, "k": self.k, "epsilon": self.epsilon, "delta": self.delta,
                "queries": self.queries, "noise_multiplier": self.noise_multiplier, "noise_std": self.noise_std,
                "sensitivity": HISTOGRAM_SENSITIVITY, "accountant": f"dp-accounting {self.accountant}"}


def knn_predict(queries, *, features, labels, n_classes, k) -> np.ndarray:
    """Non-private k-NN majority vote (cosine)."""
    return private_knn_predict(queries, features=features, labels=labels, n_classes=n_classes, sampling_rate=1.0,
                               k=k, noise_std=0.0, rng=np.random.default_rng(0))


# -- linear models ------------------------------------------------------------------
@dataclass
class LinearModel:
    weight: np.ndarray   # [c, d]
    bias: np.ndarray     # [c]

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(np.asarray(x, np.float32) @ self.weight.T + self.bias, axis=1)


@dataclass
class NoisySGDResult:
    model: LinearModel
    epsilon: float              # Opacus's accountant after training (inf when non-private)
    target_epsilon: float | None
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    lr: float
    accountant: str
    seconds: float                # the training itself (set-up and noise calibration excluded)
    calibration_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"epsilon": self.epsilon, "target_epsilon": self.target_epsilon, "delta": self.delta,
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "steps": self.steps,
                "lr": self.lr, "accountant": f"opacus {self.accountant}", "train_seconds": self.seconds,
                "calibration_seconds": self.calibration_seconds}


def train_linear_noisy_sgd(x: np.ndarray, y: np.ndarray, *, n_classes: int, epsilon: float | None, delta: float,
                           lr: float, epochs: int = 10, batch_size: int = 256, max_grad_norm: float = 0.1,
                           momentum: float = 0.9, seed: int = 0, accountant: str = "prv") -> NoisySGDResult:
    """Linear head trained by DP-SGD (Opacus) to (ε, δ); ``epsilon=None`` trains without clipping or noise."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    if epsilon is not None and not (math.isfinite(epsilon) and epsilon > 0):
        raise BadInputError(f"epsilon must be positive and finite (or None), got {epsilon!r}")
    if lr <= 0 or epochs < 1 or batch_size < 1 or max_grad_norm <= 0:
        raise BadInputError(f"lr, epochs, batch size and clip norm must be positive "
                            f"(lr={lr}, epochs={epochs}, batch={batch_size}, clip={max_grad_norm})")
    t0 = time.perf_counter()
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.asarray(y, dtype=np.int64))
    model = torch.nn.Linear(xt.shape[1], n_classes)
    with torch.no_grad():  # convex problem: a zero start is deterministic and as good as any
        model.weight.zero_()
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    gen = torch.Generator().manual_seed(int(seed))
    loader = DataLoader(TensorDataset(xt, yt), batch_size=batch_size, shuffle=True, generator=gen)
    sigma, q, steps, acc_name = 0.0, batch_size / xt.shape[0], 0, "none"
    engine = None
    calib_s = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus: "secure RNG turned off" (seeded: experiments only)
        if epsilon is not None:
            from opacus import PrivacyEngine

            engine = PrivacyEngine(accountant=accountant)
            # = make_private_with_epsilon(target_epsilon=ε, target_delta=δ, epochs=…): the same Opacus
            # calibration (get_noise_multiplier), cached across the learning-rate grid and retrainings.
            sigma = opacus_noise_multiplier(epsilon=float(epsilon), delta=float(delta),
                                            sample_rate=1.0 / len(loader), epochs=int(epochs), accountant=accountant)
            model, opt, loader = engine.make_private(
                module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
                max_grad_norm=float(max_grad_norm), poisson_sampling=True,
                noise_generator=torch.Generator().manual_seed(int(seed) + 1))
            sigma, q, acc_name = float(opt.noise_multiplier), 1.0 / len(loader), accountant
        calib_s = time.perf_counter() - t0
        loss_fn = torch.nn.CrossEntropyLoss()
        model.train()
        for _ in range(int(epochs)):
            for xb, yb in loader:
                opt.zero_grad()
                loss_fn(model(xb), yb).backward()
                opt.step()
                steps += 1
    train_s = time.perf_counter() - t0 - calib_s
    eps = math.inf
    if engine is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eps = float(engine.accountant.get_epsilon(delta=float(delta)))
    lin = model._module if hasattr(model, "_module") else model
    w = lin.weight.detach().numpy().astype(np.float32).copy()
    b = lin.bias.detach().numpy().astype(np.float32).copy()
    return NoisySGDResult(LinearModel(w, b), eps, epsilon, float(delta), sigma, q, steps, float(lr), acc_name,
                          train_s, calib_s)


@lru_cache(maxsize=256)
def opacus_noise_multiplier(*, epsilon: float, delta: float, sample_rate: float, epochs: int,
                            accountant: str = "prv") -> float:
    """Opacus's own calibration (what ``make_private_with_epsilon`` calls): σ reaching (ε, δ) after ``epochs``."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                          epochs=epochs, accountant=accountant))


def opacus_epsilon(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                   accountant: str = "prv") -> float:
    """ε of ``steps`` DP-SGD steps by Opacus's accountant (e.g. several retrainings composed)."""
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(acc.get_epsilon(delta=float(delta)))


def train_logistic_regression(x: np.ndarray, y: np.ndarray, *, n_classes: int, l2: float = 1e-4,
                              max_iter: int = 200) -> LinearModel:
    """Non-private multinomial logistic regression (mean cross-entropy + l2/2·‖W‖², L-BFGS)."""
    import torch

    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.asarray(y, dtype=np.int64))
    lin = torch.nn.Linear(xt.shape[1], n_classes)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.zero_()
    opt = torch.optim.LBFGS(lin.parameters(), lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")
    loss_fn = torch.nn.CrossEntropyLoss()

    def closure():
        opt.zero_grad()
        loss = loss_fn(lin(xt), yt) + 0.5 * l2 * (lin.weight ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return LinearModel(lin.weight.detach().numpy().copy(), lin.bias.detach().numpy().copy())
