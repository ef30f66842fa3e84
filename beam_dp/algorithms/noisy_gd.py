"""DP-SGD and full-batch DP-GD for GLMs.

* ``dpsgd`` (paper 000 §1.1 with the errata applied): Poisson sampling with rate q = B / n, every
  per-example gradient clipped to C, Gaussian noise of std sigma*C added once to the sum, and the
  sum divided by the *public* expected batch size q*n. Accounted as a Poisson-subsampled Gaussian.
* ``dpgd`` (paper 002, Algorithm 1 with clipping, eq. 7): the same with q = 1, noise on the full
  sum divided by n, and the average of the iterates theta_1..theta_T as the output by default.
  Clipping at C optimizes the Huberized loss of Lemma 5.1, which equals the original loss when
  C bounds every gradient.

Both are one driver because DP-GD is DP-SGD with q = 1; a separate module would repeat it.

Neighbouring relation: add/remove one example. Under it the dataset size is private, so n (for
q and the normalizer) is either given as public (``num_examples``) or estimated with a Laplace
count that is recorded in the ledger and composed with the training steps.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting, clipping, mechanisms
from beam_dp.algorithms.base import (Aggregator, TrainState, load_checkpoint, run_chunks,
                                     save_checkpoint)
from beam_dp.losses import GlmLoss
from beam_dp.sampling import PoissonSampler

ALGORITHMS = ("dpsgd", "dpgd")


@dataclasses.dataclass
class NoisyGDConfig:
    algorithm: str = "dpsgd"
    clip_norm: float = 1.0
    learning_rate: float = 1.0
    batch_size: int = 256              # expected batch size (dpsgd only)
    epochs: float | None = None        # passes over the data; steps = ceil(epochs / q)
    steps: int | None = None           # overrides epochs
    epsilon: float | None = None       # target; calibrates the noise multiplier
    delta: float = 1e-5
    noise_multiplier: float | None = None  # instead of epsilon: report the epsilon it buys
    accountant: str = "pld"
    num_examples: int | None = None    # public dataset size; otherwise a Laplace count
    count_epsilon: float | None = None  # budget of that count (default 1% of epsilon, or 0.01)
    average_iterates: bool | None = None  # default: on for dpgd, off for dpsgd
    fit_intercept: bool = True
    steps_per_chunk: int = 25

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}")
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of --epsilon or --noise-multiplier")
        positive = {"clip norm": self.clip_norm, "learning rate": self.learning_rate,
                    "delta": self.delta, "steps per chunk": self.steps_per_chunk}
        if self.epsilon is not None:
            positive["epsilon"] = self.epsilon
        if self.noise_multiplier is not None:
            positive["noise multiplier"] = self.noise_multiplier
        if self.algorithm == "dpsgd":
            positive["batch size"] = self.batch_size
        for name, value in positive.items():
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if not self.delta < 1:
            raise ValueError("delta must be below 1")
        if self.steps is not None and self.steps < 1:
            raise ValueError("steps must be at least 1")
        if self.num_examples is not None and self.num_examples < 1:
            raise ValueError("--num-examples must be at least 1")
        if self.count_epsilon is not None and not self.count_epsilon > 0:
            raise ValueError("--count-epsilon must be positive")

    def averaging(self) -> bool:
        return self.algorithm == "dpgd" if self.average_iterates is None else self.average_iterates


@dataclasses.dataclass(frozen=True)
class NoisyGradientStep:
    """One noisy (stochastic) gradient step; see the module docstring. Picklable and Beam-free."""

    loss: GlmLoss
    clip_norm: float
    noise_std: float        # std of the Gaussian noise on the clipped sum (sigma * C)
    normalizer: float       # public expected batch size q * n
    learning_rate: float
    sampler: PoissonSampler
    seed: int
    fit_intercept: bool = True

    def partial_sum(self, block, state: TrainState) -> np.ndarray:
        batch = self.sampler.select(block, state.step)
        return clipping.clipped_gradient_sum(state.theta, batch.features, batch.sq_norms,
                                             batch.labels, self.loss, self.clip_norm,
                                             self.fit_intercept)

    def apply(self, state: TrainState, total: np.ndarray) -> TrainState:
        noise = mechanisms.gaussian_noise(
            mechanisms.rng(self.seed, mechanisms.STREAM_NOISE, state.step), total.shape, self.noise_std)
        if not self.fit_intercept:
            noise[:, -1] = 0.0
        theta = state.theta - self.learning_rate * (total + noise) / self.normalizer
        return TrainState(theta, state.theta_sum + theta, state.step + 1)


@dataclasses.dataclass
class TrainResult:
    theta: np.ndarray
    ledger: accounting.Ledger
    noise_multiplier: float
    sampling_probability: float
    steps: int
    dataset_size: dict          # how n was obtained, and the (public or noisy) value used


def _step_event(noise_multiplier: float, q: float) -> events.DpEvent:
    step = events.GaussianDpEvent(noise_multiplier)
    return step if q >= 1.0 else events.PoissonSampledDpEvent(q, step)


def _step_release_name(q: float) -> str:
    return "gaussian_clipped_gradient_sum" if q >= 1.0 else "poisson_sampled_gaussian_clipped_gradient_sum"


def train(config: NoisyGDConfig, loss: GlmLoss, dim: int, aggregator: Aggregator, seed: int,
          ledger: accounting.Ledger,
          on_progress: Callable[[int, int, float], None] = lambda done, total, eps: None,
          checkpoint_dir: str | None = None) -> TrainResult:
    """Trains a GLM with DP-SGD or DP-GD. ``on_progress(steps_done, steps_total, epsilon_so_far)``
    is called after every chunk; the epsilon there is the ledger's, never a data statistic."""
    config.validate()
    public_config = {k: v for k, v in dataclasses.asdict(config).items() if k != "steps_per_chunk"}
    public_config.update(model=loss.name, dim=dim, outputs=loss.outputs())

    resumed = load_checkpoint(checkpoint_dir, public_config) if checkpoint_dir else None
    if resumed is not None:
        state, plan = resumed
    else:
        state, plan = TrainState.zeros(loss.outputs(), dim), None

    if plan is None:
        plan = _plan(config, aggregator, seed)
    for release in plan["releases_before_training"]:
        ledger.record(release["name"], accounting.laplace_count_event(release["epsilon"]),
                      epsilon=release["epsilon"], sensitivity=1)
    q, sigma, total_steps = plan["sampling_probability"], plan["noise_multiplier"], plan["steps"]
    step_event = _step_event(sigma, q)
    step_params = dict(noise_multiplier=sigma, sampling_probability=q, clip_norm=config.clip_norm,
                       sensitivity=config.clip_norm)
    ledger.record(_step_release_name(q), step_event, count=state.step, **step_params)

    step_fn = NoisyGradientStep(
        loss=loss, clip_norm=config.clip_norm, noise_std=sigma * config.clip_norm,
        normalizer=q * plan["n"], learning_rate=config.learning_rate,
        sampler=PoissonSampler(q, seed), seed=seed, fit_intercept=config.fit_intercept)

    def after_chunk(new_state: TrainState, k: int) -> None:
        ledger.record(_step_release_name(q), step_event, count=k, **step_params)
        if checkpoint_dir:
            save_checkpoint(checkpoint_dir, new_state, public_config, plan)
        on_progress(new_state.step, total_steps, ledger.epsilon(config.delta))

    on_progress(state.step, total_steps, ledger.epsilon(config.delta))
    state = run_chunks(aggregator, step_fn, state, total_steps, config.steps_per_chunk, after_chunk)
    theta = state.averaged() if config.averaging() else state.theta
    return TrainResult(theta, ledger, sigma, q, total_steps, plan["dataset_size"])


def _plan(config: NoisyGDConfig, aggregator: Aggregator, seed: int) -> dict:
    """The public plan: n (public or a noisy count), q, the number of steps and sigma."""
    releases = []
    if config.num_examples is not None:
        n = int(config.num_examples)
        dataset_size = {"source": "public (--num-examples)", "value": n}
    else:
        count_epsilon = config.count_epsilon or (0.01 * config.epsilon if config.epsilon else 0.01)
        noisy = aggregator.count() + mechanisms.laplace_noise(
            mechanisms.rng(seed, mechanisms.STREAM_COUNT), 1.0 / count_epsilon)
        n = max(1, int(round(noisy)))
        releases.append({"name": "laplace_count", "epsilon": count_epsilon})
        dataset_size = {"source": "private estimate: Laplace count", "value": n,
                        "count_epsilon": count_epsilon}
    q = 1.0 if config.algorithm == "dpgd" else min(1.0, config.batch_size / n)
    if config.steps is not None:
        steps = int(config.steps)
    else:
        epochs = config.epochs if config.epochs is not None else (5.0 if q < 1 else 100.0)
        steps = max(1, math.ceil(epochs / q))
    prior = [accounting.laplace_count_event(r["epsilon"]) for r in releases]
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    else:
        def make_event(s: float) -> events.DpEvent:
            return events.ComposedDpEvent(prior + [accounting.gaussian_steps_event(s, q, steps)])
        floor = accounting.epsilon_of(events.ComposedDpEvent(prior + [events.NoOpDpEvent()]),
                                      config.delta, config.accountant)
        if floor >= config.epsilon:
            raise ValueError(f"the dataset-size count alone spends epsilon {floor:.3g} of the "
                             f"{config.epsilon} budget; lower --count-epsilon or give --num-examples")
        sigma = accounting.calibrate_noise_multiplier(make_event, config.epsilon, config.delta,
                                                      config.accountant)
    return {"n": n, "sampling_probability": q, "steps": steps, "noise_multiplier": sigma,
            "dataset_size": dataset_size, "releases_before_training": releases}
