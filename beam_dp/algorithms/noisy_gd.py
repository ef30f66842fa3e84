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
    rank: int | None = None            # dpgd: public bound on the feature rank (default d + 1)
    max_steps: int = 2000              # dpgd: cap on the rank-based number of steps

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
        if self.rank is not None and self.rank < 1:
            raise ValueError("--rank must be at least 1")
        if self.max_steps < 1:
            raise ValueError("--max-steps must be at least 1")
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
    shape: tuple            # of theta: (outputs, features + 1)
    fit_intercept: bool = True
    transform: Callable | None = None   # per-example feature map, applied to the sampled rows

    @property
    def subsamples(self) -> bool:
        return self.sampler.rate < 1.0

    def select(self, block, step: int):
        """The block's rows in step ``step``'s Poisson sample (all rows when q = 1)."""
        return self.sampler.select(block, step)

    def partial_sum(self, block, state: TrainState) -> np.ndarray:
        return self.selected_sum(self.select(block, state.step), state)

    def selected_sum(self, batch, state: TrainState) -> np.ndarray:
        """The clipped gradient sum of rows already selected for ``state.step``."""
        if self.transform is not None:
            batch = self.transform(batch)
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
    clip_norm: float | None     # None where it is chosen privately per step (dp-ambssgd)
    dataset_size: dict          # how n was obtained, and the (public or noisy) value used
    preprocessing: dict         # public releases made before training (empty for dpsgd/dpgd)


def _step_event(noise_multiplier: float, q: float) -> events.DpEvent:
    step = events.GaussianDpEvent(noise_multiplier)
    return step if q >= 1.0 else events.PoissonSampledDpEvent(q, step)


def _step_release_name(q: float) -> str:
    return "gaussian_clipped_gradient_sum" if q >= 1.0 else "poisson_sampled_gaussian_clipped_gradient_sum"


def release_dataset_size(config: NoisyGDConfig, aggregator: Aggregator, seed: int,
                         ledger: accounting.Ledger) -> dict:
    """n for q and the normalizers: public (``num_examples``) or a Laplace count in the ledger."""
    if config.num_examples is not None:
        return {"source": "public (--num-examples)", "value": int(config.num_examples)}
    count_epsilon = config.count_epsilon or (0.01 * config.epsilon if config.epsilon else 0.01)
    noisy = aggregator.count() + mechanisms.laplace_noise(
        mechanisms.rng(seed, mechanisms.STREAM_COUNT), 1.0 / count_epsilon)
    ledger.record("laplace_count", accounting.laplace_count_event(count_epsilon),
                  epsilon=count_epsilon, sensitivity=1)
    return {"source": "private estimate: Laplace count", "value": max(1, int(round(noisy))),
            "count_epsilon": count_epsilon}


def train(config: NoisyGDConfig, loss: GlmLoss, dim: int, aggregator: Aggregator, seed: int,
          ledger: accounting.Ledger,
          on_progress: Callable[[int, int, float], None] = lambda done, total, eps: None,
          checkpoint_dir: str | None = None,
          preprocess: Callable[[int], dict] | None = None,
          make_transform: Callable[[dict], Callable] | None = None,
          clip_norm_from: Callable[[dict], float] | None = None) -> TrainResult:
    """Trains a GLM with DP-SGD or DP-GD over ``dim`` model features.

    ``preprocess(n)``, if given, makes private releases (recorded in the ledger) before training
    and returns them as a dict of public values; ``make_transform(preprocessing)`` turns them into
    the per-example feature map of every step, and ``clip_norm_from(preprocessing)``, if given,
    the clip norm (replacing ``config.clip_norm``). The noise multiplier is calibrated so that the
    composition of everything in the ledger and all the steps meets (epsilon, delta).
    ``on_progress(steps_done, steps_total, epsilon_so_far)`` is called after every chunk; the
    epsilon there is the ledger's, never a data statistic.
    """
    config.validate()
    public_config = {k: v for k, v in dataclasses.asdict(config).items() if k != "steps_per_chunk"}
    public_config.update(model=loss.name, dim=dim, outputs=loss.outputs())

    resumed = load_checkpoint(checkpoint_dir, public_config) if checkpoint_dir else None
    if resumed is not None:
        state, plan = resumed
        for r in plan["releases"]:
            ledger.record(r["name"], accounting.event_from_json(r["event"]), r["count"], **r["params"])
    else:
        state = TrainState.zeros(loss.outputs(), dim)
        dataset_size = release_dataset_size(config, aggregator, seed, ledger)
        preprocessing = preprocess(dataset_size["value"]) if preprocess else {}
        plan = _plan(config, dataset_size, ledger, dim)
        plan.update(preprocessing=preprocessing, releases=[
            {"name": r.name, "event": accounting.event_to_json(r.event), "count": r.count,
             "params": r.params} for r in ledger.releases])
    q, sigma, total_steps = plan["sampling_probability"], plan["noise_multiplier"], plan["steps"]
    clip_norm = clip_norm_from(plan["preprocessing"]) if clip_norm_from else config.clip_norm
    step_event = _step_event(sigma, q)
    step_params = dict(noise_multiplier=sigma, sampling_probability=q, clip_norm=clip_norm,
                       sensitivity=clip_norm)
    ledger.record(_step_release_name(q), step_event, count=state.step, **step_params)

    step_fn = NoisyGradientStep(
        loss=loss, clip_norm=clip_norm, noise_std=sigma * clip_norm,
        normalizer=q * plan["dataset_size"]["value"], learning_rate=config.learning_rate,
        sampler=PoissonSampler(q, seed), seed=seed, shape=state.theta.shape,
        fit_intercept=config.fit_intercept,
        transform=make_transform(plan["preprocessing"]) if make_transform else None)

    def after_chunk(new_state: TrainState, k: int) -> None:
        ledger.record(_step_release_name(q), step_event, count=k, **step_params)
        if checkpoint_dir:
            save_checkpoint(checkpoint_dir, new_state, public_config, plan)
        on_progress(new_state.step, total_steps, ledger.epsilon(config.delta))

    on_progress(state.step, total_steps, ledger.epsilon(config.delta))
    state = run_chunks(aggregator, step_fn, state, total_steps, config.steps_per_chunk, after_chunk)
    theta = state.averaged() if config.averaging() else state.theta
    return TrainResult(theta, ledger, sigma, q, total_steps, clip_norm, plan["dataset_size"],
                       plan["preprocessing"])


def dpgd_steps(n: int, epsilon: float | None, delta: float, rank: int, max_steps: int) -> int:
    """Paper 002 (note §2.3): the excess-risk bound of averaged DP-GD is
    ||theta*||_M sqrt(L^2/T + 2 L^2 rank log(1/delta) / (n eps)^2), so any
    T >= (n eps)^2 / (2 rank log(1/delta)) is within sqrt(2) of the T -> infinity limit (the paper's
    T = (n eps)^2 is far more than needed). Capped at ``max_steps`` full passes; with only a
    noise multiplier given, epsilon is unknown and the cap is used."""
    if epsilon is None:
        return max_steps
    return int(min(max_steps, max(1, math.ceil((n * epsilon) ** 2 / (2 * rank * math.log(1 / delta))))))


def _plan(config: NoisyGDConfig, dataset_size: dict, ledger: accounting.Ledger, dim: int) -> dict:
    """The public plan: q, the number of steps and sigma (calibrated against the ledger so far)."""
    n = dataset_size["value"]
    q = 1.0 if config.algorithm == "dpgd" else min(1.0, config.batch_size / n)
    if config.steps is not None:
        steps = int(config.steps)
    elif config.epochs is not None or q < 1:
        steps = max(1, math.ceil((config.epochs if config.epochs is not None else 5.0) / q))
    else:
        steps = dpgd_steps(n, config.epsilon, config.delta, config.rank or dim + 1, config.max_steps)
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    else:
        prior = ledger.event()
        spent = ledger.epsilon(config.delta)
        if spent >= config.epsilon:
            raise ValueError(f"the releases before training already spend epsilon {spent:.3g} of the "
                             f"{config.epsilon} budget; lower --count-epsilon / --preprocess-epsilon "
                             "or give --num-examples")

        def make_event(s: float) -> events.DpEvent:
            return events.ComposedDpEvent([prior, accounting.gaussian_steps_event(s, q, steps)])
        sigma = accounting.calibrate_noise_multiplier(make_event, config.epsilon, config.delta,
                                                      config.accountant)
    return {"sampling_probability": q, "steps": steps, "noise_multiplier": sigma,
            "dataset_size": dataset_size}
