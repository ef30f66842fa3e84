"""The noisy gradient step of DP-SGD and DP-GD (``noisy_gd``'s stage): per-example clipped
gradients summed over the step's Poisson sample (or every row), Gaussian noise added once to the
sum (float, or discrete on an exact integer sum: ``secure_noise``), and the update. Picklable
and Beam-free; ``UserGradientStep`` clips each user's summed gradient instead (user-level
privacy).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from beam_dp import clipping, geometry, mechanisms, user_level
from beam_dp.algorithms.base import TrainState
from beam_dp.batches import PoissonPlan
from beam_dp.losses import GlmLoss
from beam_dp.preconditioning import ColumnStepScale
from beam_dp.sampling import PoissonSampler
from beam_dp.secure_noise import secure_scale_bits


@dataclasses.dataclass(frozen=True)
class NoisyGradientStep:
    """One noisy (stochastic) gradient step (see the module docstring and ``noisy_gd``'s).
    Picklable and Beam-free."""

    loss: GlmLoss
    clip_norm: float
    noise_std: float        # std of the Gaussian noise on the clipped sum (sigma * C)
    normalizer: float       # public expected batch size q * n
    learning_rate: float
    sampler: PoissonSampler   # keyed by a sampling key derived from the root seed, not the seed
    seed: int | None        # the root seed; None in the copies sent to Beam jobs (``for_steps``)
    shape: tuple            # of theta: (outputs, features + 1)
    fit_intercept: bool = True
    transform: Callable | None = None   # per-example feature map, applied to the sampled rows
    noise: str = "float"   # "secure": exact integer sums + discrete Gaussian; "float": numpy's
    # (first step, the noise keys of steps first, first + 1, ...): what a job's copy holds.
    noise_keys: tuple | None = None
    step_scale: ColumnStepScale | None = None   # per-coordinate step sizes (public)
    # Paper 001's projection mechanism (Algorithm 1) as the gradient estimator: the noisy mean
    # gradient projected onto the l1 ball of this radius, C sqrt(s) (see ``gradient_sparsity``).
    l1_radius: float | None = None

    def for_steps(self, first: int, count: int) -> "NoisyGradientStep":
        """The step for a job running steps first .. first + count - 1: the root seed replaced by
        those steps' noise keys, so that the job's graph (which a runner stores and shows its
        operators) holds nothing from which other steps' noise, the count's noise or the root
        could be derived."""
        if self.seed is None:
            return self
        return dataclasses.replace(self, seed=None,
                                   noise_keys=mechanisms.step_keys(self.seed, first, count))

    def _noise_generator(self, step: int) -> np.random.Generator:
        return mechanisms.step_noise_generator(self.seed, self.noise_keys, step)

    @property
    def secure(self) -> bool:
        return self.noise == "secure"

    # The ledger releases the audit's canaries enter (``noisy_gd._step_release_name``).
    canary_releases = ("gaussian_clipped_gradient_sum",
                       "poisson_sampled_gaussian_clipped_gradient_sum")

    def canary_sum(self, state: TrainState, canaries):
        """The audit's white-box canaries (``beam_dp.audit``) at this step: each included canary
        that the step's Poisson sampling would take (at the step's rate, from the audit's own
        randomness) adds a clipped gradient of norm C on its own feature column, the most one
        example can add (in grid units with secure noise: the sensitivity exactly)."""
        columns = canaries.present(state.step, self.sampler.rate)
        if self.secure:
            units = np.zeros(self.shape, np.int64)
            units[0, columns] = 1 << (clipping.GRID_FEATURE_BITS - 1 + self.scale_bits)
            return clipping.ExactSum.of(units)
        out = np.zeros(self.shape)
        out[0, columns] = self.clip_norm
        return out

    def canary_scores(self, before: TrainState, after: TrainState, canaries) -> np.ndarray:
        """What the step released about each canary: minus its column's update (a canary's
        gradient pushes its coordinate down). Every canary is scored at every step: which
        steps sampled it is secret to the mechanism, and the audit must not use it."""
        columns = canaries.columns
        return before.theta[0, columns] - after.theta[0, columns]

    @property
    def scale_bits(self) -> int:
        """Levels of the clipped loss derivative on the exact grid: GRID_SCALE_BITS, fewer where
        the noise in grid units would pass 2^48 (a noise multiplier above ~500)."""
        return secure_scale_bits(self.noise_std / self.clip_norm)

    @property
    def batch_plan(self) -> PoissonPlan | None:
        """Poisson batches are fixed in advance (``beam_dp.batches``); q = 1 reads everything."""
        return PoissonPlan(self.sampler, self.normalizer) if self.sampler.rate < 1.0 else None

    def partial_sum(self, block, state: TrainState) -> np.ndarray:
        return self.selected_sum(self.sampler.select(block, state.step), state)

    def selected_sum(self, batch, state: TrainState):
        """The clipped gradient sum of rows already selected for ``state.step``: with secure
        noise an exact integer sum in units of ``clipping.gradient_grid`` (``ExactSum``), else
        a float sum."""
        if self.transform is not None:
            batch = self.transform(batch)
        if self.secure:
            q, shift, norms = clipping.block_quantized_rows(batch, self.fit_intercept)
            return clipping.exact_clipped_gradient_sum(state.theta, q, shift, norms, batch.labels,
                                                       self.loss, self.clip_norm, self.scale_bits)
        return clipping.clipped_gradient_sum(state.theta, batch.features, batch.sq_norms,
                                             batch.labels, self.loss, self.clip_norm,
                                             self.fit_intercept)

    def zero_sum(self):
        """The sum over no rows (a bundle or batch without any)."""
        return clipping.ExactSum.zeros(self.shape) if self.secure else np.zeros(self.shape)

    def apply(self, state: TrainState, total) -> TrainState:
        if self.secure:
            # Integer noise on the exact integer sum (``secure_noise.secure_noise_note``), scaled
            # back.
            grid = clipping.gradient_grid(self.clip_norm, self.scale_bits)
            noise = mechanisms.discrete_gaussian(self._noise_generator(state.step),
                                                 self.noise_std / grid, self.shape)
            if not self.fit_intercept:
                noise[:, -1] = 0
            noisy = (total + noise).to_float() * grid
        else:
            noise = mechanisms.gaussian_noise(self._noise_generator(state.step), total.shape,
                                              self.noise_std)
            if not self.fit_intercept:
                noise[:, -1] = 0.0
            noisy = total + noise
        update = noisy / self.normalizer
        if self.l1_radius is not None:
            # Post-processing of the noisy sum: the privacy is the Gaussian's, whatever s.
            update = geometry.project_l1_ball(update.ravel(), self.l1_radius).reshape(update.shape)
        if self.step_scale is not None:
            update = self.step_scale(update)
        theta = state.theta - self.learning_rate * update
        return TrainState(theta, state.theta_sum + theta, state.step + 1)


@dataclasses.dataclass(frozen=True)
class UserGradientStep(NoisyGradientStep):
    """A step under user-level privacy (``beam_dp.user_level``): each user's per-row-clipped
    gradients summed over their kept rows, that sum clipped to C, so one user (not one row)
    adds at most C: the same noise, for "add/remove one user". Its blocks are grouped by user
    (no user spans two), so per-block sums are whole users' sums. Float noise only (the exact
    integer sums quantize rows, not users' sums).

    dpsgd (rate q < 1): the step's batch is a Poisson sample of USERS (``user_level.in_step_batch``:
    a user's rows all in or all out), drawn from the grouped blocks in ``partial_sum``. So it
    runs as a full-batch stage (no ``batch_plan``): the row-level batch job's files hold rows
    without their users and cut users apart, so on Beam every job reads the data and groups it
    by user once (one GroupByKey), then runs its steps, each step's gradient work being only its
    sampled users' rows. Passes over the data: one per job, not one per step."""

    @property
    def batch_plan(self) -> None:
        return None

    def partial_sum(self, block, state: TrainState) -> np.ndarray:
        if self.sampler.rate < 1.0:
            block = block.take(np.flatnonzero(user_level.in_step_batch(
                block.users, state.step, self.sampler.seed, self.sampler.rate)))
        return self.selected_sum(block, state)

    def selected_sum(self, batch, state: TrainState):
        users = batch.users
        if self.transform is not None:   # a per-row map: the rows (and their users) stay
            batch = self.transform(batch)
        return user_level.user_clipped_gradient_sum(state.theta, batch, self.loss, self.clip_norm,
                                                    self.fit_intercept, users)
