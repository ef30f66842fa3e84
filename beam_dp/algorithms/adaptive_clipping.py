"""Quantile-based adaptive clipping for dpsgd and dpgd (``--adaptive-clip-quantile``; Andrew,
Thakkar, McMahan & Ramaswamy, NeurIPS 2021): the step (``AdaptiveClipStep``), the state that
carries the clip norm (``AdaptiveClipState``), the count's noise (``count_noise_std``) and the
report's summary (``adaptive_clipping_summary``).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from beam_dp import clipping, mechanisms, user_level
from beam_dp.algorithms.base import TrainState
from beam_dp.algorithms.gradient_step import NoisyGradientStep, UserGradientStep


@dataclasses.dataclass
class AdaptiveClipState(TrainState):
    """TrainState plus the clip norm of the next step and the clip norms released so far (noisy:
    post-processing of the counts), for ``AdaptiveClipStep``."""

    clip_norm: float = 1.0
    clip_norms: tuple = ()


@dataclasses.dataclass(frozen=True)
class AdaptiveClipStep(NoisyGradientStep):
    """A dpsgd or dpgd step with quantile-based adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy,
    "Differentially private learning with adaptive clipping", NeurIPS 2021, Algorithm 1 with the
    geometric update), float noise only.

    Step t clips every sampled row's gradient to C_t and, in the same pass, counts the rows
    whose unclipped gradient norm is at most C_t: the stage's sum is the flat clipped sum with
    that count appended (one combine serves both). ``apply`` adds Gaussian noise of std
    sigma * C_t to the sum (sensitivity C_t) and of std ``count_noise_std`` to the count
    (sensitivity 1), divides both by the *public* expected batch size q n (never the realized
    one: its size is private under add/remove, and dividing by it would release it), and sets
    C_{t+1} = C_t exp(-eta_C (b - gamma)), b the noisy fraction. Accounted per step as
    PoissonSampled(q, Composed([Gaussian(sigma), Gaussian(count_noise_std)]))
    (``noisy_gd._step_event``); for dpgd q = 1: every row is in the step (the sampler selects all), the normalizer is the
    public or privately counted n, and the event is the Composed pair itself.
    The clip norm is carried in the state (``AdaptiveClipState``), so the sensitivity of each
    step's release is the public C_t, a post-processing of earlier releases."""

    noise_multiplier: float = 1.0      # sigma of the sum: std sigma * C_t
    count_noise_std: float = 1.0       # sigma_b, in rows
    target_quantile: float = 0.5       # gamma
    clip_rate: float = 0.2             # eta_C

    @property
    def flat_size(self) -> int:
        return int(np.prod(self.shape)) + 1

    def zero_sum(self):
        return np.zeros(self.flat_size)

    def selected_sum(self, batch, state: TrainState):
        if self.transform is not None:
            batch = self.transform(batch)
        total, below = clipping.clipped_gradient_sum_and_count(
            state.theta, batch.features, batch.sq_norms, batch.labels, self.loss,
            state.clip_norm, self.fit_intercept)
        return np.concatenate([total.ravel(), [float(below)]])

    def canary_sum(self, state: TrainState, canaries):
        """As ``NoisyGradientStep.canary_sum`` at the step's clip norm C_t; each canary also
        counts as a row below C_t (the count's sensitivity)."""
        columns = canaries.present(state.step, self.sampler.rate)
        out = np.zeros(self.shape)
        out[0, columns] = state.clip_norm
        return np.concatenate([out.ravel(), [float(np.size(columns))]])

    def apply(self, state: TrainState, total) -> TrainState:
        total = np.asarray(total, dtype=np.float64)
        g = self._noise_generator(state.step)
        clip_norm = float(state.clip_norm)
        noise = mechanisms.gaussian_noise(g, self.shape, self.noise_multiplier * clip_norm)
        count_noise = float(mechanisms.gaussian_noise(g, (), self.count_noise_std))
        if not self.fit_intercept:
            noise[:, -1] = 0.0
        noisy = total[:-1].reshape(self.shape) + noise
        update = noisy / self.normalizer
        if self.step_scale is not None:
            update = self.step_scale(update)
        theta = state.theta - self.learning_rate * update
        fraction = (total[-1] + count_noise) / self.normalizer   # public normalizer q n
        # The exponent is bounded (the fraction's noise is unbounded): a step moves C by at most
        # a factor e^(2 eta_C) either way, so one extreme draw cannot send it to 0 or inf.
        exponent = -self.clip_rate * min(max(fraction - self.target_quantile, -2.0), 2.0)
        next_clip = clip_norm * math.exp(exponent)
        return AdaptiveClipState(theta, state.theta_sum + theta, state.step + 1,
                                 clip_norm=next_clip, clip_norms=(*state.clip_norms, next_clip))


# Adaptive clipping's count noise: sigma_b = max(q n / 20, 10 sigma) rows. q n / 20 is Andrew et
# al.'s suggestion (the noisy fraction then has std 0.05); the floor 10 sigma keeps the count's
# share of a step's privacy loss at most 1% of the variance (1 / (1 + sigma^2 / sigma_b^2)), so
# a calibration always exists, whatever the batch size.
COUNT_NOISE_SHARE, COUNT_NOISE_FLOOR = 1.0 / 20.0, 10.0


def count_noise_std(noise_multiplier: float, expected_batch: float) -> float:
    return max(COUNT_NOISE_SHARE * expected_batch, COUNT_NOISE_FLOOR * noise_multiplier)


# The report keeps at most this many of the released clip norms (evenly spaced, the last kept).
CLIP_HISTORY_POINTS = 50


def adaptive_clipping_summary(target_quantile: float, rate: float, initial: float,
                              count_std: float, normalizer: float, history) -> dict:
    """The report's account of adaptive clipping: its public settings and the released (noisy)
    clip norms, thinned to CLIP_HISTORY_POINTS."""
    history = list(history)
    if len(history) > CLIP_HISTORY_POINTS:
        picks = np.unique(np.linspace(0, len(history) - 1, CLIP_HISTORY_POINTS).round().astype(int))
        thinned = {int(i) + 1: history[i] for i in picks}
    else:
        thinned = {i + 1: c for i, c in enumerate(history)}
    return {"method": "Andrew et al. 2021, geometric update", "initial_clip_norm": initial,
            "target_quantile": target_quantile, "rate": rate,
            "count_noise_std": count_std, "count_normalizer": normalizer,
            "clip_norm_after_step": {str(k): v for k, v in thinned.items()},
            "final_clip_norm": history[-1] if history else initial}


ADAPTIVE_FLOAT_NOTE = ("--adaptive-clip-quantile: the steps add numpy's float Gaussian noise (secure "
                       "noise is not implemented for a clip norm that changes every step)")


@dataclasses.dataclass(frozen=True)
class UserAdaptiveClipStep(AdaptiveClipStep):
    """``AdaptiveClipStep`` under user-level privacy (``UserGradientStep``'s sums): each
    sampled user's summed gradient clipped to C_t, and the count of USERS whose sum was at most
    C_t before it (``user_level.user_clipped_gradient_sum``'s count): one user moves the sum by
    C_t and the count by 1, as one row does in a row-level run, so the same noise and events
    hold under add/remove one user; the fraction is over the public expected number of users."""

    # Users sampled in the grouped blocks, full-batch stages: UserGradientStep's own.
    batch_plan = UserGradientStep.batch_plan
    partial_sum = UserGradientStep.partial_sum

    def selected_sum(self, batch, state: TrainState):
        users = batch.users
        if self.transform is not None:   # a per-row map: the rows (and their users) stay
            batch = self.transform(batch)
        total, below = user_level.user_clipped_gradient_sum(
            state.theta, batch, self.loss, state.clip_norm, self.fit_intercept, users, count=True)
        return np.concatenate([total.ravel(), [float(below)]])
