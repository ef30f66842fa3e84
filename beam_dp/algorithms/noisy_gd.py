"""DP-SGD and full-batch DP-GD for GLMs.

* ``dpsgd`` (paper 000 §1.1 with the errata applied): Poisson sampling with rate q = B / n, every
  per-example gradient clipped to C, Gaussian noise of std sigma*C added once to the sum, and the
  sum divided by the *public* expected batch size q*n. Accounted as a Poisson-subsampled Gaussian.
* ``dpgd`` (paper 002, Algorithm 1 with clipping, eq. 7): the same with q = 1, noise on the full
  sum divided by n, and the average of the iterates theta_1..theta_T as the output by default.
  Clipping at C optimizes the Huberized loss of Lemma 5.1, which equals the original loss when
  C bounds every gradient.

* ``--adaptive-clip-quantile`` (Andrew et al. 2021; dpsgd and dpgd): the clip norm follows a
  quantile of the per-example gradient norms from a noisy count made in the same pass
  (``AdaptiveClipStep``): over the step's Poisson sample (dpsgd) or over every row (dpgd, q = 1:
  the same step with the sampling rate 1, the count normalized by the public n).

Both are one driver because DP-GD is DP-SGD with q = 1; a separate module would repeat it.

Neighbouring relation: add/remove one example. Under it the dataset size is private, so n (for
q and the normalizer) is either given as public (``num_examples``) or estimated with a Laplace
count that is recorded in the ledger and composed with the training steps. Every use of it is a
smooth function of it that stays sane over the count's error range (``_plan``): the normalizer is
q * max(n, floor) with floor the count's own error bound, so an undershooting count cannot blow
up a step.

With ``--privacy-unit-column`` (dpgd and dpsgd) the relation is add/remove one user with all
their rows: the blocks are grouped by user and bounded to K rows each, each step clips every
user's summed gradient to C (``UserGradientStep``, ``beam_dp.user_level``), n is a count of
users, and dpsgd's Poisson sampling samples users (a user's rows in or out together).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting, clipping, features, geometry, mechanisms, stats, user_level
from beam_dp.algorithms.base import (Aggregator, TrainState, load_checkpoint, run_chunks,
                                     save_checkpoint)
from beam_dp.algorithms.registry import Algorithm, Problem, option
from beam_dp.batches import PoissonPlan
from beam_dp.categorical import Encoding
from beam_dp.losses import MODEL_NAMES, GlmLoss
from beam_dp.sampling import PoissonSampler

ALGORITHMS = ("dpsgd", "dpgd")
NOISE_KINDS = ("secure", "float")


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
    # "secure": integer noise on exact integer sums; "float" (or None): numpy's float noise.
    noise: str | None = None
    num_examples: int | None = None    # public dataset size; otherwise a Laplace count
    count_epsilon: float | None = None  # budget of that count (default 1% of epsilon, or 0.01)
    average_iterates: bool | None = None  # default: on for dpgd, off for dpsgd
    fit_intercept: bool = True
    steps_per_chunk: int | None = None   # steps per job (full batch); None: the aggregator's choice
    rank: int | None = None            # dpgd: public bound on the feature rank (default d + 1)
    # dpgd: cap on the rank-based number of steps; None: ``default_max_steps`` of the released n
    max_steps: int | None = None
    # dpgd --gradient-estimator projection: the l1 radius C sqrt(s) the noisy mean gradient is
    # projected onto (paper 001, Algorithm 1); None: the plain Gaussian estimate.
    projection_radius: float | None = None
    # --adaptive-clip-quantile (dpsgd, dpgd): the target quantile gamma of the per-row gradient norms
    # that the clip norm tracks (Andrew et al. 2021), from ``clip_norm``; None: a fixed clip.
    adaptive_clip_quantile: float | None = None
    adaptive_clip_rate: float = 0.2     # eta_C of the geometric update

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}")
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of --epsilon or --noise-multiplier")
        positive = {"clip norm": self.clip_norm, "learning rate": self.learning_rate,
                    "delta": self.delta}
        if self.steps_per_chunk is not None:
            positive["steps per job"] = self.steps_per_chunk
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
        if self.noise is not None and self.noise not in NOISE_KINDS:
            raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}, got {self.noise!r}")
        if self.rank is not None and self.rank < 1:
            raise ValueError("--rank must be at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("--max-steps must be at least 1")
        if self.steps is not None and self.steps < 1:
            raise ValueError("steps must be at least 1")
        if self.num_examples is not None and self.num_examples < 1:
            raise ValueError("--num-examples must be at least 1")
        if self.count_epsilon is not None and not self.count_epsilon > 0:
            raise ValueError("--count-epsilon must be positive")
        if self.projection_radius is not None and not (self.projection_radius > 0
                                                       and math.isfinite(self.projection_radius)):
            raise ValueError("the gradient projection's radius must be a positive number")
        if self.adaptive_clip_quantile is not None:
            if not 0.0 < self.adaptive_clip_quantile < 1.0:
                raise ValueError("--adaptive-clip-quantile must be a fraction in (0, 1)")
            if not (self.adaptive_clip_rate > 0 and math.isfinite(self.adaptive_clip_rate)):
                raise ValueError("--adaptive-clip-rate must be a positive number")
            if self.noise == "secure":
                raise ValueError("--adaptive-clip-quantile adds float noise (its clip norm "
                                 "changes the exact sums' grid every step); use --noise float")
            if self.projection_radius is not None:
                raise ValueError("--adaptive-clip-quantile and --gradient-estimator projection "
                                 "(whose radius is the fixed clip norm) do not combine")

    def adaptive(self) -> bool:
        return self.adaptive_clip_quantile is not None

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
    sampler: PoissonSampler   # keyed by a sampling key derived from the root seed, not the seed
    seed: int | None        # the root seed; None in the copies sent to Beam jobs (``for_steps``)
    shape: tuple            # of theta: (outputs, features + 1)
    fit_intercept: bool = True
    transform: Callable | None = None   # per-example feature map, applied to the sampled rows
    noise: str = "float"   # "secure": exact integer sums + discrete Gaussian; "float": numpy's
    # (first step, the noise keys of steps first, first + 1, ...): what a job's copy holds.
    noise_keys: tuple | None = None
    step_scale: "ColumnStepScale | None" = None   # per-coordinate step sizes (public)
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

    # The ledger releases the audit's canaries enter (``_step_release_name``).
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
            # Integer noise on the exact integer sum (see ``secure_noise_note``), scaled back.
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


@dataclasses.dataclass(frozen=True)
class ColumnStepScale:
    """A diagonal preconditioner for categorical columns (``--precondition counts``): the
    update of column ``first + j`` is multiplied by n / max(c_j, floor), c_j the column's
    private count, the rest (numeric columns, intercept) by 1.

    Why: a one-hot column used by a fraction f of the rows has curvature about f / 4 in the mean
    logistic loss, so plain gradient descent moves it f times slower than a dense column, and in
    100 steps learns nothing of the values below a few percent of the rows. Scaled by n / c the
    columns move alike. The scale is a function of released counts and public constants only
    (post-processing): the noisy sums are the same, only the step differs; it amplifies a
    column's noise by at most n / floor, which is why there is a floor (``PRECONDITION_NOISE_WALK``).
    Stored compactly (the columns above the floor; the others share ``default``), since the
    step travels in every Beam job's graph."""

    first: int
    default: float
    columns: tuple
    scales: tuple

    def __call__(self, update: np.ndarray) -> np.ndarray:
        out = np.array(update, dtype=np.float64)
        d = out.shape[1] - 1
        out[:, self.first:d] *= self.default
        if self.columns:
            idx = self.first + np.asarray(self.columns, dtype=np.int64)
            out[:, idx] *= np.asarray(self.scales) / self.default
        return out


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
    PoissonSampled(q, Composed([Gaussian(sigma), Gaussian(count_noise_std)])) (``_step_event``);
    for dpgd q = 1: every row is in the step (the sampler selects all), the normalizer is the
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


# The floor of the scaled counts: the preconditioned noise's random walk over the run,
# learning_rate * sigma * C * sqrt(T) / floor, stays below this in every column (the scale of a
# coefficient that matters for a one-hot column is about 1).
PRECONDITION_NOISE_WALK = 0.1


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
    sampling: str = ""          # how examples were chosen per step, for the report
    expected_batch_size: float | None = None   # the public normalizer of a step's noisy sum
    # The per-example map the model expects of raw features, as training applied it (recorded
    # in model.json and applied again by predict), e.g. {"normalize_rows": 1.0}; None: identity.
    feature_transform: dict | None = None
    # Where the report puts ``preprocessing``: "preprocessing" (private releases before
    # training) or "algorithm_parameters" (a one-pass algorithm's public plan).
    details_name: str = "preprocessing"
    # The public constraint set the coefficients lie in (``geometry.Constraint.to_json``),
    # recorded in model.json; None: unconstrained.
    constraint: dict | None = None
    # User-level privacy: the unit's column name and the contribution bounds (public), for the
    # report; None: a row is the unit.
    privacy_unit: dict | None = None


# The noise's scale in grid units stays within [2^32, 2^48]: from 2^32 the discrete Gaussian is
# within 2^-69 of the rounded Gaussian (``secure_noise_note``); below 2^48 its samples and the
# sums stay exact in int64 and float64.
_SECURE_NOISE_BITS = (32, 48)


class SecureNoiseUnavailable(ValueError):
    """Secure noise cannot keep its guarantee's slack (``sampler_delta_bound``) within 1e-3 delta,
    or its grid cannot hold the noise, at these (public) settings."""

    def __str__(self):
        return super().__str__() + "; use --noise float"


# Said in the report when the default noise had to be the float one (``float_instead``).
FLOAT_FALLBACK_NOTE = ("secure noise is the default, but it could not be used at these settings "
                       "({why}): these releases add numpy's float noise instead (--noise float "
                       "says so up front; --noise secure refuses such a run)")


def float_instead(requested: str | None, why: SecureNoiseUnavailable, ledger) -> str:
    """"float" where secure noise was the default (``requested`` None) and cannot be used,
    with a note in the report; with an explicit --noise secure, the refusal stands."""
    if requested == "secure":
        raise why
    note = FLOAT_FALLBACK_NOTE.format(why=ValueError.__str__(why))
    if note not in ledger.notes:
        ledger.notes.append(note)
    return "float"


def secure_scale_bits(noise_multiplier: float) -> int:
    """The exact grid's ``scale_bits`` for a noise multiplier; ValueError where none keeps the
    noise in grid units within _SECURE_NOISE_BITS."""
    low, high = _SECURE_NOISE_BITS
    room = high - (clipping.GRID_FEATURE_BITS - 1) - math.ceil(math.log2(max(noise_multiplier, 1e-300)))
    bits = min(clipping.GRID_SCALE_BITS, room)
    if bits < 1 or noise_multiplier * 2.0 ** (clipping.GRID_FEATURE_BITS - 1 + bits) < 2.0 ** low:
        raise SecureNoiseUnavailable(f"noise multiplier {noise_multiplier:.3g} is outside what "
                                     "the secure noise handles (about 2^-7 to 2^28)")
    return bits


def sampling_seed(seed: int) -> int:
    """The Poisson sampler's seed: a 128-bit key derived from the root seed (a PRF), so that the
    batch job's graph, which holds the sampler, holds nothing else of the run's randomness."""
    return mechanisms.stream_key(seed, mechanisms.STREAM_SAMPLING) >> 128


def noise_description(noise: str, noise_multiplier: float) -> str:
    """How a step's noise is drawn, for the report; ``secure_noise_note`` says why the Gaussian
    events account for the secure kind."""
    if noise == "secure":
        bits = clipping.GRID_FEATURE_BITS - 1 + secure_scale_bits(noise_multiplier)
        return (f"discrete Gaussian on exact integer sums (grid 2^-{bits} of the clip norm; "
                "ChaCha20 randomness; accounted as the Gaussian plus sampler_delta_bound)")
    return "float Gaussian (numpy) on float sums"


def secure_noise_note() -> str:
    """Why a secure step is accounted as the Gaussian mechanism, plus ``sampler_delta_bound``.

    A step releases S + Z: S the exact integer sum of the per-example contributions (each an
    integer vector of L2 norm at most Delta = C / grid, ``beam_dp.clipping``), Z a vector of
    draws of ``mechanisms.discrete_gaussian`` at scale s = sigma Delta >= 2^32 per coordinate.
    Compare with S + round(N(0, s^2 I)) = round(S + N(0, s^2 I)): a post-processing of the
    Gaussian mechanism of noise multiplier sigma, so its GaussianDpEvent (PoissonSampledDpEvent
    under Poisson sampling, whose randomness is the same in both) gives its (epsilon, delta), by
    either accountant. Each draw's law is within total variation tau of round(N(0, s^2)): the
    exact discrete Gaussian is within 1/(48 s^2) of it (each unit interval's mass against the
    density at its centre: Taylor's remainder), and the sampler within ~2^-50 of the exact law
    (its floating-point acceptance tests). Total variations add over the T D draws of a run,
    whatever the adaptivity, so for every set of outputs the run's probabilities move by at most
    T D tau from the Gaussian's (plus 2^-50 for the count's discrete Laplace draw): the
    guarantee holds with delta + (1 + e^eps) (T D tau + 2^-50)
    (``sampler_delta_bound``, in the report). A run refuses secure noise where that passes
    1e-3 delta (large epsilon, or very many coordinates and steps). Not claimed: that the
    discrete Gaussian is dominated by the Gaussian's PLD or (under subsampling) its RDP curve."""
    return " ".join(secure_noise_note.__doc__.split())


# The samplers' distance to their exact laws per draw (``mechanisms.discrete_gaussian``).
_SAMPLER_TV = 2.0 ** -50


def sampler_delta_bound(noise_multiplier: float, coordinates: int, steps: int,
                        epsilon: float, prior_variation: float = 0.0) -> float:
    """(1 + e^eps) (T D tau + tau_count + prior): what the secure noise can add to the Gaussian's
    delta (``secure_noise_note``), the count's one discrete Laplace draw (accounted as pure DP)
    included, as if there were one, and ``prior_variation``, the total variation of secure
    releases made before the steps (``sampler_total_variation`` of e.g. DPSGD-F's private mean)."""
    s = noise_multiplier * 2.0 ** (clipping.GRID_FEATURE_BITS - 1 + secure_scale_bits(noise_multiplier))
    tau = 1.0 / (48.0 * s * s) + _SAMPLER_TV
    return (1.0 + math.exp(min(epsilon, 700.0))) * (steps * coordinates * tau + _SAMPLER_TV
                                                     + prior_variation)


def draws_total_variation(draws) -> float:
    """The total variation between the discrete Gaussian draws ``draws`` ((count, scale in grid
    units) pairs, every scale at least 2^32 here) of ``mechanisms.discrete_gaussian`` and the
    rounded Gaussians of the same scales: per draw 1/(48 s^2) + 2^-50 (``secure_noise_note``)."""
    total = 0.0
    for count, scale in draws:
        if count:
            total += count * (1.0 / (48.0 * float(scale) ** 2) + _SAMPLER_TV)
    return total


def secure_delta_bound(variation: float, epsilon: float) -> float:
    """(1 + e^eps) (variation + tau_count): what the secure noise of a run whose draws are within
    total variation ``variation`` of the rounded Gaussians can add to delta, the dataset-size
    count's discrete Laplace draw included as if there were one (``secure_release_note``)."""
    return (1.0 + math.exp(min(epsilon, 700.0))) * (variation + _SAMPLER_TV)


def prior_total_variation(ledger: accounting.Ledger) -> float:
    """The ``sampler_total_variation`` of the secure releases in the ledger so far."""
    return sum(float(r.params.get("sampler_total_variation", 0.0)) * r.count
               for r in ledger.releases)


def secure_release_note() -> str:
    """Why a secure release other than a gradient step (SSP's statistics, DP-AMBSSGD's counts
    and sums, the private means and counts of ``beam_dp.stats``) is accounted as its float
    mechanism.

    Gaussian releases: the release is S + Z, S an integer vector that is a function of the data
    (an exact sum of per-example integer vectors on a public power-of-two grid, or an exact
    integer function of such a sum, e.g. ceil(lambda_min) - 1 of an integer Gram matrix, found
    by exact rational arithmetic), whose L2 sensitivity in grid units is at most Delta *after*
    the rounding to the grid (each entry moves by 1/2 at most, and every rounded row is
    certified against that bound), and Z discrete Gaussian draws at scale s = sigma Delta >=
    2^32 per coordinate. S + round(N(0, s^2 I)) = round(S + N(0, s^2 I)) is a post-processing of
    the Gaussian mechanism of multiplier sigma, so its GaussianDpEvent accounts for it, and each
    draw is within total variation 1/(48 s^2) + 2^-50 of round(N(0, s^2)); over every draw of
    the run the probabilities of any set of outputs move by at most the sum (whatever the
    adaptivity), so the guarantee holds with delta + (1 + e^eps) x (that sum + 2^-50 for the
    count's discrete Laplace draw): ``sampler_delta_bound`` in the report (each release's total
    variation is its ``sampler_total_variation``). A run refuses secure noise where that passes
    1e-3 delta. Counts (sensitivity 1) are put on the grid 2^-k with 2^k >= 2^32 / sigma before
    the noise, as a discrete Gaussian of scale sigma itself (tens) would be ~1e-4 in total
    variation from the rounded Gaussian, and dp_accounting's Gaussian PLD is not proven to
    bound the discrete Gaussian's own. Pure-DP releases: a discrete Laplace count of scale
    1/eps is eps-DP exactly (PureDpEvent); the exponential mechanism is sampled exactly (rational
    utilities, exact Bernoulli(exp(-x)) coins on ChaCha20 bits), so it is eps-DP as accounted."""
    return " ".join(secure_release_note.__doc__.split())


def _step_event(noise_multiplier: float, q: float,
                count_noise_std: float | None = None) -> events.DpEvent:
    """A step's event; with adaptive clipping (``count_noise_std``) the clipped sum's Gaussian
    composed with the count's (sensitivity 1, std ``count_noise_std``), both on the step's
    sample. dp_accounting composes them (its PLD through ``accounting.merged_gaussians``)."""
    step = events.GaussianDpEvent(noise_multiplier)
    if count_noise_std is not None:
        step = events.ComposedDpEvent([step, events.GaussianDpEvent(count_noise_std)])
    return step if q >= 1.0 else events.PoissonSampledDpEvent(q, step)


# Adaptive clipping's count noise: sigma_b = max(q n / 20, 10 sigma) rows. q n / 20 is Andrew et
# al.'s suggestion (the noisy fraction then has std 0.05); the floor 10 sigma keeps the count's
# share of a step's privacy loss at most 1% of the variance (1 / (1 + sigma^2 / sigma_b^2)), so
# a calibration always exists, whatever the batch size.
COUNT_NOISE_SHARE, COUNT_NOISE_FLOOR = 1.0 / 20.0, 10.0


def count_noise_std(noise_multiplier: float, expected_batch: float) -> float:
    return max(COUNT_NOISE_SHARE * expected_batch, COUNT_NOISE_FLOOR * noise_multiplier)


def _step_release_name(q: float) -> str:
    return "gaussian_clipped_gradient_sum" if q >= 1.0 else "poisson_sampled_gaussian_clipped_gradient_sum"


# The default budget of the private count, as a share of epsilon. Reconsidered with the plan
# below: no use of the count is sensitive to its error beyond a proportional scale (q, the
# normalizers, the dpgd step count), or at most logarithmically (DPSGD-F's failure
# probabilities); quantile targets no longer read it. Its cost is small either way: calibrated
# with PLD at epsilon 0.5-4, a 1% count raises the steps' noise multiplier by 0.1%, 2% by 0.25%
# and 5% by 1.5%, while the count's error (scale 1/(share * epsilon)) is 100 rows at 1% and
# epsilon 1, i.e. <= 1% of n from n = 10,000. So 1% stays the default.
COUNT_SHARE = 0.01
# The count's error bound used for the normalizer floor: P(count < n - t) = COUNT_FAILURE.
COUNT_FAILURE = 0.01


def release_dataset_size(config: NoisyGDConfig, aggregator: Aggregator, seed: int,
                         ledger: accounting.Ledger,
                         exact_count: Callable[[], int] | None = None) -> dict:
    """n for q and the normalizers: public (``num_examples``) or a Laplace count in the ledger
    (budget ``count_epsilon``, default COUNT_SHARE of epsilon, or 0.01 with a noise multiplier).

    Besides the value (at least 1), the dict gives public facts about its error, all functions
    of the count's budget only: the Laplace scale b, the 95% error bound b ln 20, and
    ``normalizer_floor`` = b ln(1 / (2 COUNT_FAILURE)), the bound below which the true n
    exceeds the noisy one with probability COUNT_FAILURE (a public n has none: floor 1).
    Normalizers use max(n, floor): a count that undershoots (on tiny data it may be clamped to 1)
    then cannot blow up a gradient or a mean (at worst the true n is n_noisy + floor
    <= 2 max(n_noisy, floor)), while at any n well above the floor nothing changes.
    ``exact_count`` (default ``aggregator.count``): what is counted, e.g. the users of a
    user-level run (sensitivity 1 under its relation too)."""
    if config.num_examples is not None:
        return {"source": "public (--num-examples)", "value": int(config.num_examples)}
    count_epsilon = config.count_epsilon or (COUNT_SHARE * config.epsilon if config.epsilon else 0.01)
    scale = 1.0 / count_epsilon
    # Recorded (admitted by a budget ledger across runs, if any) before the count is made.
    if config.noise != "float":   # None: secure by default
        # The count is an integer and its sensitivity 1: a discrete Laplace of scale 1/eps is
        # eps-DP exactly, accounted as such (a PureDpEvent: dp_accounting's RDP accountant has
        # no discrete Laplace event, and its continuous Laplace curve would understate it).
        ledger.record("discrete_laplace_count", accounting.PureDpEvent(count_epsilon),
                      epsilon=count_epsilon, sensitivity=1, noise="discrete Laplace")
        noisy = (exact_count or aggregator.count)() + int(mechanisms.discrete_laplace(
            mechanisms.secure_generator(seed, mechanisms.STREAM_COUNT), scale, ()))
        source = "private estimate: discrete Laplace count"
    else:
        ledger.record("laplace_count", accounting.laplace_count_event(count_epsilon),
                      epsilon=count_epsilon, sensitivity=1, noise="float Laplace")
        noisy = (exact_count or aggregator.count)() + mechanisms.laplace_noise(
            mechanisms.rng(seed, mechanisms.STREAM_COUNT), scale)
        source = "private estimate: Laplace count"
    return {"source": source, "value": max(1, int(round(noisy))),
            "count_epsilon": count_epsilon, "laplace_scale": scale,
            "error_bound_95": scale * math.log(20.0),
            "normalizer_floor": scale * math.log(1.0 / (2.0 * COUNT_FAILURE))}


def _recorded_before(ledger: accounting.Ledger, saved: list) -> int:
    """How many of a checkpoint's saved releases the ledger already holds: those recorded before
    ``train`` was called (the quality check's reservation, ``beam_dp.quality``) are recorded
    again by the resumed run's caller, and must not be counted twice."""
    held = [{"name": r.name, "event": accounting.event_to_json(r.event), "count": r.count,
             "params": r.params} for r in ledger.releases]
    if json.loads(json.dumps(saved[:len(held)], default=str)) != json.loads(json.dumps(held, default=str)):
        raise ValueError("the checkpoint was written by a run whose releases before training "
                         "differ from this one's (e.g. other quality-check settings); use another "
                         "--checkpoint-dir or the same settings")
    return len(held)


def train(config: NoisyGDConfig, loss: GlmLoss, dim: int, aggregator: Aggregator, seed: int,
          ledger: accounting.Ledger,
          on_progress: Callable[[int, int, float], None] = lambda done, total, eps: None,
          checkpoint_dir: str | None = None,
          preprocess: Callable[[int], dict] | None = None,
          make_transform: Callable[[dict], Callable] | None = None,
          clip_norm_from: Callable[[dict], float] | None = None,
          checkpoint_key: dict | None = None,
          initial_theta: np.ndarray | None = None,
          make_step_scale: Callable[[dict, dict], "ColumnStepScale"] | None = None,
          user_bounding: "user_level.UserBounding | None" = None) -> TrainResult:
    """Trains a GLM with DP-SGD or DP-GD over ``dim`` model features, from ``initial_theta``
    (a released model's coefficients: public) or zeros.

    ``preprocess(n)``, if given, makes private releases (recorded in the ledger) before training
    and returns them as a dict of public values; ``make_transform(preprocessing)`` turns them into
    the per-example feature map of every step, and ``clip_norm_from(preprocessing)``, if given,
    the clip norm (replacing ``config.clip_norm``). The noise multiplier is calibrated so that the
    composition of everything in the ledger and all the steps meets (epsilon, delta).
    ``on_progress(steps_done, steps_total, epsilon_so_far)`` is called after every chunk; the
    epsilon there is the ledger's, never a data statistic.

    ``user_bounding`` (user-level privacy: the aggregator's blocks are grouped by user and
    bounded to K rows each, ``user_level.group_by_user``): n is then the number of USERS
    (public ``num_examples``, or a noisy count of them, sensitivity 1 per user), so q = B / n
    samples users (dpsgd: ``--batch-size`` is an expected number of users), the normalizer is
    q max(noisy users, floor) and each update the mean over (expected) users of their clipped
    sums, at most C in norm as in a row-level run; the steps are ``UserGradientStep``s, each
    accounted as the row-level step is (PoissonSampledDpEvent(q, Gaussian) for dpsgd) under
    add/remove one user.
    """
    config.validate()
    public_config = {k: v for k, v in dataclasses.asdict(config).items() if k != "steps_per_chunk"}
    public_config.update(model=loss.name, dim=dim, outputs=loss.outputs(), **(checkpoint_key or {}))

    resumed = load_checkpoint(checkpoint_dir, public_config) if checkpoint_dir else None
    if resumed is not None:
        state, plan = resumed
        for r in plan["releases"][_recorded_before(ledger, plan["releases"]):]:
            ledger.record(r["name"], accounting.event_from_json(r["event"]), r["count"], **r["params"])
    else:
        state = TrainState.zeros(loss.outputs(), dim)
        if initial_theta is not None:
            if np.shape(initial_theta) != state.theta.shape:
                raise ValueError(f"the warm-start model has coefficients of shape "
                                 f"{np.shape(initial_theta)}, this run {state.theta.shape}")
            state.theta = np.array(initial_theta, dtype=np.float64)
        if user_bounding is not None:
            if config.noise != "float" or config.adaptive():
                raise ValueError("user-level privacy is built for dpgd and dpsgd with float "
                                 "noise and a fixed clip norm")
            dataset_size = release_dataset_size(
                config, aggregator, seed, ledger,
                lambda: aggregator.run_stages([user_level.DistinctUsersStage()], None))
            dataset_size["unit"] = "users"
        else:
            dataset_size = release_dataset_size(config, aggregator, seed, ledger)
        preprocessing = preprocess(dataset_size["value"]) if preprocess else {}
        plan = _plan(config, dataset_size, ledger, dim)
        plan.update(preprocessing=preprocessing, releases=[
            {"name": r.name, "event": accounting.event_to_json(r.event), "count": r.count,
             "params": r.params} for r in ledger.releases])
    q, sigma, total_steps = plan["sampling_probability"], plan["noise_multiplier"], plan["steps"]
    clip_norm = clip_norm_from(plan["preprocessing"]) if clip_norm_from else config.clip_norm
    noise = "float" if config.noise == "float" or config.adaptive() else "secure"   # None: secure
    count_std = plan.get("count_noise_std") if config.adaptive() else None
    sampler_delta = None
    if noise == "secure":
        try:
            # The ledger holds the releases before training (a resumed run's too): with all
            # the steps, the run's epsilon.
            epsilon = config.epsilon if config.epsilon is not None else accounting.epsilon_of(
                ledger.event_after(_step_release_name(q), _step_event(sigma, q), total_steps),
                config.delta, config.accountant)
            # The releases before the steps (DPSGD-F's secure preprocessing) count in it too.
            sampler_delta = sampler_delta_bound(sigma, int(np.prod(state.theta.shape)),
                                                total_steps, epsilon, prior_total_variation(ledger))
            if sampler_delta > 1e-3 * config.delta:
                raise SecureNoiseUnavailable(
                    f"secure noise's samplers could add {sampler_delta:.2g} to delta at epsilon "
                    f"{epsilon:.3g} over these steps")
        except SecureNoiseUnavailable as why:
            noise, sampler_delta = float_instead(config.noise, why, ledger), None
    step_event = _step_event(sigma, q, count_std)
    step_params = dict(noise_multiplier=sigma, sampling_probability=q, clip_norm=clip_norm,
                       sensitivity=clip_norm, noise=noise_description(noise, sigma))
    if count_std is not None:
        step_params.update(
            clip_norm=f"adaptive from {clip_norm:g} (target quantile "
                      f"{config.adaptive_clip_quantile:g}, rate {config.adaptive_clip_rate:g})",
            sensitivity="the step's clip norm C_t for the sum, 1 for the count",
            count_noise_std=count_std,
            normalizer=f"public expected batch size {plan['normalizer']:.6g}")
    if sampler_delta is not None:
        step_params["sampler_delta_bound"] = sampler_delta
        if secure_noise_note() not in ledger.notes:
            ledger.notes.append(secure_noise_note())
    ledger.record(_step_release_name(q), step_event, count=state.step, **step_params)
    # The whole run's event, for a cheap progress epsilon (one PLD per run, not one per chunk).
    planned = ledger.event_after(_step_release_name(q), step_event, total_steps - state.step,
                                 **step_params)
    ledger.admit(planned)   # the steps are recorded after each chunk: admitted before the first

    step_class = UserGradientStep if user_bounding is not None else NoisyGradientStep
    adaptive = {}
    if count_std is not None:
        step_class = AdaptiveClipStep
        adaptive = dict(noise_multiplier=sigma, count_noise_std=count_std,
                        target_quantile=config.adaptive_clip_quantile,
                        clip_rate=config.adaptive_clip_rate)
        released = tuple(plan.get("clip_norms", ()))   # a resumed run's, from its checkpoint
        state = AdaptiveClipState(state.theta, state.theta_sum, state.step,
                                  clip_norm=released[-1] if released else clip_norm,
                                  clip_norms=released)
    step_fn = step_class(
        **adaptive,
        loss=loss, clip_norm=clip_norm, noise_std=sigma * clip_norm,
        normalizer=plan["normalizer"], learning_rate=config.learning_rate,
        sampler=PoissonSampler(q, sampling_seed(seed)), seed=seed, shape=state.theta.shape,
        fit_intercept=config.fit_intercept,
        transform=make_transform(plan["preprocessing"]) if make_transform else None,
        noise=noise,
        step_scale=make_step_scale(plan["preprocessing"], plan) if make_step_scale else None,
        l1_radius=config.projection_radius)

    def after_chunk(new_state: TrainState, k: int) -> None:
        ledger.record(_step_release_name(q), step_event, count=k, **step_params)
        if count_std is not None:
            plan["clip_norms"] = list(new_state.clip_norms)
        if checkpoint_dir:
            save_checkpoint(checkpoint_dir, new_state, public_config, plan)
        on_progress(new_state.step, total_steps, ledger.progress_epsilon(config.delta, planned))

    if checkpoint_dir and resumed is None:   # the plan (its count and noise) before any job
        save_checkpoint(checkpoint_dir, state, public_config, plan)
    on_progress(state.step, total_steps, ledger.progress_epsilon(config.delta, planned))
    state = run_chunks(aggregator, step_fn, state, total_steps, config.steps_per_chunk, after_chunk,
                       plan if checkpoint_dir else None, keep_batches=bool(checkpoint_dir))
    theta = state.averaged() if config.averaging() else state.theta
    details = plan["preprocessing"]
    if count_std is not None:
        details = {**details, "adaptive_clipping": adaptive_clipping_summary(
            config, clip_norm, count_std, plan["normalizer"], state.clip_norms)}
        clip_norm = None
    return TrainResult(theta, ledger, sigma, q, total_steps, clip_norm, plan["dataset_size"],
                       details, sampling=("full batch" if q >= 1 else "Poisson over users"
                                          if user_bounding is not None else "Poisson"),
                       expected_batch_size=plan["normalizer"],
                       privacy_unit=user_bounding.describe() if user_bounding is not None else None)



# The report keeps at most this many of the released clip norms (evenly spaced, the last kept).
CLIP_HISTORY_POINTS = 50


def adaptive_clipping_summary(config: NoisyGDConfig, initial: float, count_std: float,
                              normalizer: float, history) -> dict:
    """The report's account of adaptive clipping: its public settings and the released (noisy)
    clip norms, thinned to CLIP_HISTORY_POINTS."""
    history = list(history)
    if len(history) > CLIP_HISTORY_POINTS:
        picks = np.unique(np.linspace(0, len(history) - 1, CLIP_HISTORY_POINTS).round().astype(int))
        thinned = {int(i) + 1: history[i] for i in picks}
    else:
        thinned = {i + 1: c for i, c in enumerate(history)}
    return {"method": "Andrew et al. 2021, geometric update", "initial_clip_norm": initial,
            "target_quantile": config.adaptive_clip_quantile, "rate": config.adaptive_clip_rate,
            "count_noise_std": count_std, "count_normalizer": normalizer,
            "clip_norm_after_step": {str(k): v for k, v in thinned.items()},
            "final_clip_norm": history[-1] if history else initial}


# dpgd's default cap on the number of steps (``default_max_steps``): DEFAULT_MAX_STEPS[1] steps
# on small tables, falling as DEFAULT_STEP_ROWS / n to DEFAULT_MAX_STEPS[0], the earlier fixed
# cap, from n = 300,000 on, so a default run reads at most max(DEFAULT_STEP_ROWS, 100 n) rows
# and no large-n run is slower than before (at n = 10^6 the README's benchmark puts a local step
# at ~46 ms: 100 steps, ~5 s). Why more steps where n is small: at 100 steps dpgd is
# under-converged on columns mapped onto [-1, 1] by their ranges (not standardized, so
# ill-conditioned), and with the iterates averaged the extra steps cost little in noise.
# Measured with pipelines/bench_raw_tables.py at epsilon 1 (MASS Boston with its declared ranges,
# 10 seeds, mean RMSE; OLS 4.31): cap 100 6.54, 200 6.38, 300 6.25, 500 6.40 (fixed 200 steps
# 6.17, 300 6.23, 500 6.81: past ~300 the noise per step, sigma ~ sqrt(T), wins); ISLR Default
# ROC AUC 0.946 -> 0.948 and AER CreditCard accuracy 0.955 -> 0.970 at 300 (3 seeds).
DEFAULT_MAX_STEPS = (100, 300)
DEFAULT_STEP_ROWS = 3e7


def default_max_steps(n: int) -> int:
    """dpgd's cap on the number of steps without --max-steps, from n (the public or released
    count: post-processing, nothing spent): DEFAULT_STEP_ROWS / n within DEFAULT_MAX_STEPS,
    i.e. 300 up to n = 100,000, 200 at 150,000, 100 from 300,000 on; non-increasing in n."""
    low, high = DEFAULT_MAX_STEPS
    return int(min(high, max(low, math.ceil(DEFAULT_STEP_ROWS / max(int(n), 1)))))


def dpgd_steps(n: int, epsilon: float | None, delta: float, rank: int, max_steps: int) -> int:
    """Paper 002 (note §2.3): the excess-risk bound of averaged DP-GD is
    ||theta*||_M sqrt(L^2/T + 2 L^2 rank log(1/delta) / (n eps)^2), so any
    T >= (n eps)^2 / (2 rank log(1/delta)) is within sqrt(2) of the T -> infinity limit (the paper's
    T = (n eps)^2 is far more than needed). Capped at ``max_steps`` full passes (whatever default
    the caller passes); with only a noise multiplier given, epsilon is unknown and the cap is
    used. With a noisy n, T moves by a factor (1 +- err/n)^2 below the cap, continuously: the
    count's error changes the run time a little, never the privacy (sigma is calibrated to T)."""
    if epsilon is None:
        return max_steps
    return int(min(max_steps, max(1, math.ceil((n * epsilon) ** 2 / (2 * rank * math.log(1 / delta))))))


DEFAULT_EPOCHS = 5.0   # dpsgd without --epochs / --steps


def _plan(config: NoisyGDConfig, dataset_size: dict, ledger: accounting.Ledger, dim: int) -> dict:
    """The public plan: q, the number of steps, the normalizer and sigma (calibrated against the
    ledger so far). Each is a smooth (continuous up to a ceiling), documented function of the
    released n, so that a count that is off by a little changes the run by a little:

    * q = 1 for dpgd; min(1, B / n) for dpsgd;
    * steps: ``steps`` if given; else ceil(epochs / q) with epochs = ``epochs`` or, for dpsgd,
      DEFAULT_EPOCHS (so n = 999 and 1001 with B = 1000 give 5 and 6 steps; the rank-based count
      below used to take over for dpsgd whenever q reached 1, i.e. 2,000 full-batch steps at
      n = 999); else, for dpgd only, ``dpgd_steps`` (continuous in n up to the ``max_steps`` cap,
      by default ``default_max_steps`` of the released n);
    * normalizer of the noisy sums: q * max(n, floor), floor the count's ``normalizer_floor`` (1 for
      a public n); for dpsgd with n above the floor that is the expected batch size B.
    """
    n = dataset_size["value"]
    q = 1.0 if config.algorithm == "dpgd" else min(1.0, config.batch_size / n)
    if config.steps is not None:
        steps = int(config.steps)
    elif config.epochs is not None or config.algorithm == "dpsgd":
        steps = max(1, math.ceil((config.epochs if config.epochs is not None else DEFAULT_EPOCHS) / q))
    else:
        cap = config.max_steps if config.max_steps is not None else default_max_steps(n)
        steps = dpgd_steps(n, config.epsilon, config.delta, config.rank or dim + 1, cap)
    normalizer = q * max(float(n), float(dataset_size.get("normalizer_floor", 1.0)))
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
            if config.adaptive():
                return events.ComposedDpEvent([prior, accounting.self_composed(
                    _step_event(s, q, count_noise_std(s, normalizer)), steps)])
            return events.ComposedDpEvent([prior, accounting.gaussian_steps_event(s, q, steps)])
        guess, slope = accounting.noise_multiplier_guess(q, steps, config.epsilon - spent,
                                                         config.delta)
        sigma = accounting.calibrate_noise_multiplier(make_event, config.epsilon, config.delta,
                                                      config.accountant, guess=guess, slope=slope)
    plan = {"sampling_probability": q, "steps": steps, "noise_multiplier": sigma,
            "normalizer": normalizer, "dataset_size": dataset_size}
    if config.adaptive():
        plan["count_noise_std"] = count_noise_std(sigma, normalizer)
    return plan


# ------------------------------------------------------------------------------ registry entries

_CLIP = option(1.0, "per-example gradient clip norm C (the sensitivity of each noisy sum)",
               low=0, low_open=True)
_SCALE = option("auto", "numeric columns without declared bounds (the schema's 'bounds'; "
                        "categorical columns' one-hot columns are left as they are): 'private': "
                        "each clipped to its private 2nd-98th percentile range and mapped to "
                        "[-1, 1] (exponential-mechanism quantiles on a public log grid, "
                        "--scale-epsilon of the budget; a linear regression's label too; "
                        "recorded in model.json, applied again by predict); 'auto' (the "
                        "default): the same where the quantiles' rank error is below a quarter "
                        "of the (noisy) n (else as given, said in the report), mapping only the "
                        "columns whose released range is off the unit scale; 'none': as given. "
                        "Declared bounds are always applied, at no privacy cost",
                choices=("none", "private", "auto"))
_SCALE_EPSILON = option(None, "the budget of --scale-features private's quantiles; default a "
                              "tenth of epsilon", low=0, low_open=True)
_FEATURE_NORM = option(None, "normalize every feature vector to this norm before training "
                             "(recorded in model.json, applied again by predict); default: "
                             "features used as given, so --clip-norm must suit their scale",
                       low=0, low_open=True)
# Adaptive clipping's options, shared by dpgd and dpsgd (one kernel, ``AdaptiveClipStep``).
_ADAPTIVE_QUANTILE = option(
    None, "adaptive clipping (Andrew et al. 2021): the clip norm starts at the given clip norm and "
          "follows this quantile of the per-row gradient norms, from a noisy count of the rows "
          "below it (dpsgd: of the step's sampled rows) made in the same pass (accounted with the "
          "step; float noise); default off: a fixed clip norm", low=0, low_open=True, high=1)
# (None when not given, so that one given without --adaptive-clip-quantile is refused:
# registry.ACTS_ONLY_WHEN; NoisyGDConfig's 0.2 applies)
_ADAPTIVE_RATE = option(None, "eta_C of adaptive clipping's geometric update "
                              "C <- C exp(-eta_C (b - gamma)), with --adaptive-clip-quantile; "
                              "default 0.2", low=0, low_open=True)


@dataclasses.dataclass
class DpgdOptions:
    clip_norm: float = _CLIP
    learning_rate: float | None = option(
        None, "step size; default 1, or 1/4 for --model linear and huber, whose curvature is 4 "
              "times the logistic loss's at the same feature scale (so the same step is as "
              "stable; measured on MASS Boston, 404 rows, epsilon 1: RMSE 6.2 at 1/4 against 8.7 "
              "at 1, the constant predictor's 8.6)", low=0, low_open=True)
    steps: int | None = option(None, "full-batch steps (each reads all the data); default "
                                     "ceil((n eps)^2 / (2 rank ln(1/delta))) capped at --max-steps",
                               low=1)
    rank: int | None = option(None, "public bound on the rank of the features, which sets the "
                                    "default steps (paper 002); default d + 1", low=1)
    max_steps: int | None = option(
        None, "cap on the default number of steps; default 300 up to n = 100,000 rows, then "
              "3e7 / n (a default run reads at most 3e7 rows, or 100 passes) down to 100 from "
              "n = 300,000 on, n the public or privately counted size", low=1)
    average_iterates: bool | None = option(
        None, "output the average of the iterates (paper 002) rather than the last; default on, "
              "except with --precondition counts, whose scaled steps converge in a few dozen "
              "steps and whose average would keep part of the way from zero (measured on the "
              "click-log benchmark: accuracy 0.729 averaged, 0.743 last)")
    feature_norm: float | None = _FEATURE_NORM
    scale_features: str = _SCALE
    scale_epsilon: float | None = _SCALE_EPSILON
    precondition: str = option("auto", "categorical columns' steps scaled by n / (their private "
                                       "count): 'counts', 'none', or 'auto' (counts with "
                                       "--categorical-columns and --epsilon)",
                               choices=("auto", "counts", "none"))
    precondition_epsilon: float | None = option(
        None, "share of epsilon spent on the column counts of --precondition counts; default "
              "a tenth of epsilon", low=0, low_open=True)
    gradient_estimator: str = option(
        "gaussian", "'projection': each step's noisy mean gradient projected onto the l1 ball of "
                    "radius C sqrt(s), s the nonzeros of one example's gradient (public: the "
                    "declared columns and the intercept), paper 001's projection mechanism; "
                    "post-processing, so the same privacy. Its error grows like (ln d)^(1/4) "
                    "rather than sqrt(d), but it shrinks the gradient: on the click-log benchmark "
                    "it was 1-2 points below 'gaussian'",
        choices=("gaussian", "projection"))
    adaptive_clip_quantile: float | None = _ADAPTIVE_QUANTILE
    adaptive_clip_rate: float | None = _ADAPTIVE_RATE


@dataclasses.dataclass
class DpsgdOptions:
    clip_norm: float = _CLIP
    learning_rate: float = option(2.0, "step size", low=0, low_open=True)
    batch_size: int = option(1000, "expected batch size B: each example is in a step's batch "
                                   "with probability B / n (Poisson sampling); with "
                                   "--privacy-unit-column (dpsgd) B users of n users, each "
                                   "with all their kept rows", low=1)
    epochs: float = option(5.0, "passes over the data: steps = ceil(epochs n / B)", low=0,
                           low_open=True)
    steps: int | None = option(None, "number of steps; overrides --epochs", low=1)
    average_iterates: bool = option(False, "output the average of the iterates rather than the last")
    feature_norm: float | None = _FEATURE_NORM


@dataclasses.dataclass
class ScaledDpsgdOptions(DpsgdOptions):
    """dpsgd's options: DpsgdOptions (which dpsgd-f shares, with its own private preprocessing
    instead of this one) and the private column scaling."""

    # (dpsgd-f keeps DpsgdOptions' fixed 2: its preprocessing and tables were measured with it)
    learning_rate: float | None = option(
        None, "step size; default 2, or 1/2 for --model linear and huber (dpgd's curvature "
              "rule: measured at epsilon 1 on standardized ggplot2 diamonds, R^2 0.91 against "
              "-0.09 at 2)", low=0, low_open=True)
    scale_features: str = _SCALE
    scale_epsilon: float | None = _SCALE_EPSILON
    adaptive_clip_quantile: float | None = _ADAPTIVE_QUANTILE
    adaptive_clip_rate: float | None = _ADAPTIVE_RATE


def core_config(name: str, options, problem: Problem, exclude=(), secure: bool = False) -> NoisyGDConfig:
    """The driver's configuration from an algorithm's declared options (fields of the same name)
    and the shared problem; the noise as asked, else secure only if the algorithm has it."""
    shared = {k: v for k, v in dataclasses.asdict(options).items()
              if k not in exclude and k in NoisyGDConfig.__dataclass_fields__}
    if shared.get("adaptive_clip_rate", 0) is None:
        del shared["adaptive_clip_rate"]   # not given: the config's default
    privacy = dataclasses.asdict(problem.privacy)
    if not secure:
        privacy["noise"] = "float"   # (Algorithm.check refused an explicit "secure")
    return NoisyGDConfig(algorithm=name, **privacy, **shared,
                         fit_intercept=problem.fit_intercept, steps_per_chunk=problem.steps_per_chunk)


# The squared and Huber losses' curvature is at most ||x||^2, the logistic loss's ||x||^2 / 4 (the
# softmax's ||x||^2 / 2): dpgd's default step is scaled by the same factor.
_SQUARED_CURVATURE_STEP = 0.25


# dpsgd's base step (for the logistic loss); scaled by the same curvature rule as dpgd's. At 2
# on a regression it was below the constant predictor (Table C: diamonds R^2 -0.09, Computers
# 0.30; MASS Boston with ranges RMSE 23.9 against the constant's 8.6).
_BASE_STEP = {"dpgd": 1.0, "dpsgd": 2.0}


def default_learning_rate(model: str, algorithm: str = "dpgd") -> float:
    """dpgd's (or dpsgd's) default step for a model (``--model``)."""
    return _BASE_STEP[algorithm] * (_SQUARED_CURVATURE_STEP if model in ("linear", "huber") else 1.0)

ADAPTIVE_FLOAT_NOTE = ("--adaptive-clip-quantile: the steps add numpy's float Gaussian noise (secure "
                       "noise is not implemented for a clip norm that changes every step)")


def _train_noisy(name: str, options, problem: Problem, aggregator, seed: int, ledger, progress):
    if getattr(options, "learning_rate", 1.0) is None:
        options = dataclasses.replace(options,
                                      learning_rate=default_learning_rate(problem.loss.name, name))
    # Sparse (categorical) input: float noise, since the exact sums quantize dense rows.
    bounding = problem.privacy_unit
    if bounding is not None:
        _check_user_level(options, problem)
    config = core_config(name, options, problem, exclude=("feature_norm",),
                         secure=not problem.sparse and bounding is None)
    if config.adaptive():
        if config.noise == "secure":
            raise ValueError("--adaptive-clip-quantile adds float noise (its clip norm changes "
                             "the exact sums' grid every step); use --noise float")
        if config.noise is None and ADAPTIVE_FLOAT_NOTE not in ledger.notes:
            ledger.notes.append(ADAPTIVE_FLOAT_NOTE)
        config = dataclasses.replace(config, noise="float")
    if getattr(options, "gradient_estimator", "gaussian") == "projection":
        if config.noise == "secure":
            raise ValueError("--gradient-estimator projection post-processes float noise; "
                             "use --noise float")
        config = dataclasses.replace(config, noise="float", projection_radius=options.clip_norm
                                     * math.sqrt(gradient_sparsity(problem)))
    if problem.sparse and options.feature_norm:
        raise ValueError("--feature-norm needs dense features; categorical rows have one 1 per "
                         "column, so scale the numeric columns instead")
    normalize = features.NormalizeRows(options.feature_norm) if options.feature_norm else None
    preprocess = make_step_scale = None
    make_transform = (lambda pre: normalize) if normalize else None
    counts = ()
    if _preconditioned(options, problem):
        preprocess, make_step_scale, counted = _column_counts(options, problem, aggregator, seed,
                                                              ledger)
        counts = (counted,)
        if options.average_iterates is None:
            config = dataclasses.replace(config, average_iterates=False)
    if (getattr(options, "scale_features", "none") != "none" or problem.source.get("bounds")
            or _imputed(problem)):
        # (categorical columns next to numeric ones: their counts in the ranges' pass)
        scaling = _column_scaling(options, problem, aggregator, seed, ledger, also=counts)
        if scaling[0] is not None:
            preprocess, make_transform = scaling
    initial_theta = problem.initial_theta
    if initial_theta is not None and make_transform is not None and preprocess is not None:
        # (a warm start's ranges are all declared: the map is known before any release)
        start_map = make_transform({})
        if isinstance(start_map, features.ScaleColumns):
            initial_theta = start_map.scale_label(initial_theta)
    result = train(config, problem.loss, problem.dim, aggregator, seed, ledger, progress,
                   problem.checkpoint_dir, preprocess=preprocess, make_transform=make_transform,
                   checkpoint_key={"input": problem.source, "seed_fixed": problem.seed_fixed,
                                   "scale_features": options.scale_features,
                                   "scale_epsilon": options.scale_epsilon,
                                   **({"privacy_unit": dataclasses.asdict(bounding)}
                                      if bounding is not None else {})},
                   initial_theta=initial_theta, make_step_scale=make_step_scale,
                   user_bounding=bounding)
    applied = make_transform(result.preprocessing) if make_transform else None
    theta, preprocessing = result.theta, result.preprocessing
    if isinstance(applied, features.ScaleColumns) and applied.label_low is not None:
        theta = applied.unscale_label(result.theta)
        preprocessing = {**preprocessing, "label_range": applied.label_range()}
    return dataclasses.replace(result, theta=theta, preprocessing=preprocessing,
                               feature_transform=features.spec(applied))


def _check_user_level(options, problem: Problem) -> None:
    """What user-level privacy does not cover yet, refused by name: secure noise (its exact sums
    quantize rows, not users' sums), and the private preprocessing (its statistics bound one
    row, not one user)."""
    if problem.privacy.noise == "secure":
        raise ValueError("--privacy-unit-column has float noise only (the secure noise's exact "
                         "sums are per row); use --noise float or leave --noise out")
    if getattr(options, "scale_features", "none") == "private":
        raise ValueError("--scale-features private bounds one row's influence, not one user's: "
                         "it is not available with --privacy-unit-column (declared bounds are; "
                         "the default auto then scales only the declared columns)")
    if getattr(options, "precondition", "none") == "counts":
        raise ValueError("--precondition counts bounds one row's influence, not one user's: it is "
                         "not available with --privacy-unit-column")
    if getattr(options, "adaptive_clip_quantile", None) is not None:
        raise ValueError("--adaptive-clip-quantile counts rows below the clip norm, not users: it "
                         "is not available with --privacy-unit-column")


SCALE_QUANTILES = (0.02, 0.98)
# A privately scaled column keeps values up to this many half-ranges from its range's middle
# (features.ScaleColumns.reach). Clipping at the 98th percentile itself made the 3% defaulters
# of ISLR Default alike: ROC AUC 0.939 at reach 1, 0.946 at reach 4 (scikit-learn 0.949).
PRIVATE_RANGE_REACH = 4.0
# --scale-features auto scales where the quantiles' 95% rank error is below this share of n (the
# margin then keeps the range at least the inter-quartile one). Above it the targets are pulled
# toward the median and the range collapses. Measured at epsilon 1 (3 seeds):
# * ISLR Default, n = 8,000, d = 2, error/n = 0.09: ROC AUC 0.956 scaled vs 0.569 unscaled;
# * AER CreditCard, n = 1,055, d = 10, error/n = 3.5: accuracy 0.77 scaled vs 0.96 unscaled.
AUTO_SCALE_RANK_ERROR = 0.25
# The chance the margin leaves an extreme quantile to land on an empty grid cell beyond the data
# (``stats.exponential_mechanism_quantile``): such a range is orders of magnitude too wide and
# maps its column to ~0. At 0.05 (the 95% error) ISLR Default's balance once got a 98th
# percentile of 2.2e6 (its values stop near 2,650): ROC AUC 0.46 on 1 of 30 seeds, train's
# defaults. At 1e-3 the margin is 1.4x wider (Default: target ranks 1,070 rows from each end
# rather than 750).
SCALE_MARGIN_FAILURE = 1e-3
SCALE_GRID_BOUND, SCALE_GRID_SIZE = 1e9, 601   # +-[1e-3, 1e9], 10% steps, and 0
_SCALE_STREAM = 12


# --scale-features auto maps a privately ranged column only when the range is off the unit scale:
# a half-width outside [1/4, 4], or a middle more than 4 half-widths from 0 (past the reach).
UNIT_SCALE = (0.25, 4.0)


def off_unit_scale(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Columns whose (released) range [low, high] is far from the unit scale (see UNIT_SCALE)."""
    half, mid = (high - low) / 2.0, (high + low) / 2.0
    return (half < UNIT_SCALE[0]) | (half > UNIT_SCALE[1]) | (np.abs(mid) > UNIT_SCALE[1] * half)


def _column_scaling(options, problem: Problem, aggregator, seed: int, ledger, also=()):
    """Each column mapped onto [-1, 1] (``features.ScaleColumns``): on its declared public range
    (the schema's ``bounds``; a missing-value indicator is [0, 1] by construction), else, with
    ``--scale-features private`` or ``auto``, on its 2nd and 98th percentiles released by the
    exponential mechanism (``stats.QuantileStage``: pure epsilon each, under add/remove; the
    targets kept their 95% rank error inside the data, so a small n lands inside it rather than
    anywhere on the grid). A linear regression's label is scaled the same way (declared, else
    private with the columns) and the coefficients mapped back to its units afterwards.

    Why quantiles on a public log grid: a range has to come from somewhere, and reading it from
    the data un-noised is what diffprivlib warns about (PrivacyLeakWarning); a log grid from
    1e-3 to 1e9 in 10% steps covers incomes and 0/1 columns alike, and a value outside it is
    only clipped.

    Median/mean imputation (the schema's ``missing`` "median"/"mean") is released here too, in
    the same job (one read of the data), and filled before scaling (``ScaleColumns.fill``):
    * "median": the column's 50th percentile of its present values, on the same grid by the
      same exponential mechanism (``stats.histogram`` leaves a missing cell out);
    * "mean": the mean of its present values clipped to the column's *declared* range
      (``stats.ImputeMeanStage``, Laplace). Declared rather than the private 2nd-98th range:
      that range is released in this very job, so a mean within it would need a second read
      of the data (and a second job); a column without a declared range takes "median".
    Each imputed column gets the epsilon of one quantile (the share is split over the scaling's
    quantiles and the imputed columns), in the ledger before the step noise is calibrated.

    ``also``: (stage, released) pairs of other releases before the steps that do not depend on
    these (the categorical columns' counts): their stages run in the same pass, and
    ``released(state)`` (a dict) joins the preprocessing.

    Returns (preprocess, make_transform), or (None, None) when nothing is scaled (``also`` is
    then not run)."""
    choice = options.scale_features
    imputed = _imputed(problem)
    if imputed:
        why = ("categorical columns (sparse features)" if problem.sparse else
               "--feature-norm" if options.feature_norm else
               "--privacy-unit-column (the release bounds one row, not one user)"
               if problem.privacy_unit is not None else None)
        if why:
            raise ValueError(f"median/mean imputation is not available with {why}: use "
                             "constant:V or indicator for those columns")
        # The fills' releases draw numpy's float noise (the median's Gumbel-max exponential
        # mechanism, the mean's Laplace on float sums): --noise secure, which insists on integer
        # noise on exact sums, refuses them (as adaptive clipping); the default says so.
        if problem.privacy.noise == "secure":
            raise ValueError("median/mean imputation adds float noise (its fills' releases are "
                             "not built on exact sums); use --noise float or leave --noise out")
        if IMPUTE_FLOAT_NOTE not in ledger.notes:
            ledger.notes.append(IMPUTE_FLOAT_NOTE)
    if problem.privacy_unit is not None and choice == "auto":
        choice = "none"   # the quantiles bound one row's influence, not one user's: declared only
    declared = problem.source.get("bounds") or {"columns": [], "label": None}
    if problem.initial_theta is not None and choice == "auto":
        # A warm start continues in its model's space: that model's ranges, if any, came as
        # declared bounds (api._warm_start_theta); nothing new is released.
        choice = "none"
    if options.feature_norm:
        if choice == "private":
            raise ValueError("--scale-features private and --feature-norm are two maps of the "
                             "same features: choose one")
        return None, None   # auto/none: features as given (the feature norm maps them)
    # The columns mapped: every one of dense rows; of CSR rows (categorical columns) the numeric
    # ones (and missing indicators), which come first, the one-hot columns after them being 0/1
    # already (features.ScaleColumns maps the first d columns of CSR rows).
    d = (Encoding.from_spec(problem.source["encoding"]).first_categorical if problem.sparse
         else problem.dim)
    # [index, low, high] (declared), or [index, low, high, reach] (ranges released earlier, e.g.
    # once for all of beam-dp tune's candidates)
    fixed = {int(c[0]): (c[1], c[2], c[3] if len(c) > 3 else 1.0) for c in declared["columns"]}
    for j, policy, name in imputed:
        if policy == "mean" and j not in fixed:
            raise ValueError(f"mean imputation of '{name}' needs its declared range (the schema's "
                             "bounds): the mean of values clipped to it. Without one use median")
    label_scaled = problem.loss.name == "linear"
    private_columns = tuple(j for j in range(d) if j not in fixed) if choice != "none" else ()
    private_label = label_scaled and declared["label"] is None and choice != "none"
    epsilon = problem.privacy.epsilon
    share = options.scale_epsilon or (0.1 * epsilon if epsilon is not None else None)
    if imputed and share is None:
        raise ValueError("median/mean imputation with --noise-multiplier needs --scale-epsilon "
                         "(the fills' budget)")
    if (private_columns or private_label) and share is None:
        if choice == "private":
            raise ValueError("--scale-features private with --noise-multiplier needs "
                             "--scale-epsilon (the quantiles' budget)")
        private_columns, private_label = (), False   # auto: only what is declared
    if epsilon is not None and share is not None and share >= epsilon:
        raise ValueError("--scale-epsilon is a share of --epsilon: it must be smaller")
    if not (fixed or declared["label"] is not None or private_columns or private_label or imputed):
        return None, None
    stage = per_release = None
    released = len(private_columns) + int(private_label)
    if released or imputed:
        # one quantile's epsilon per scaling quantile and per imputed column
        per_release = share / (released * len(SCALE_QUANTILES) + len(imputed))
    if released:
        grid = np.repeat(stats.symmetric_log_grid(SCALE_GRID_BOUND, SCALE_GRID_SIZE, 1e12),
                         released, axis=0)
        stage = stats.QuantileStage(
            "column_bounds", stats.Selected(private_columns, private_label), stats.FixedGrid(grid),
            released, SCALE_GRID_SIZE, SCALE_QUANTILES, per_release, stats.stages_seed(seed),
            (_SCALE_STREAM,), margin=stats.quantile_rank_error_bound(SCALE_GRID_SIZE, per_release,
                                                                      SCALE_MARGIN_FAILURE),
            # The run's noise kind: secure unless float was asked for (as the steps' default),
            # so the ranges are no float release inside a secure run.
            noise="float" if problem.privacy.noise == "float" else "secure")

    def preprocess(n: int) -> dict:
        out = {"declared_bounds": declared} if fixed or declared["label"] is not None else {}
        scale = stage
        if stage is not None:
            # The margin (the rank error at SCALE_MARGIN_FAILURE), as the targets sit that far
            # from the ends: above a quarter of n the range shrinks inside the quartiles.
            error = stage.margin
            if choice == "auto" and error > AUTO_SCALE_RANK_ERROR * n:
                # Decided from the released count and public constants: nothing is spent.
                out = {**out, "column_bounds": None, "scaling_skipped": (
                    f"--scale-features auto: the quantiles' rank error bound ({error:.0f} rows at "
                    f"probability {1 - SCALE_MARGIN_FAILURE:g}, "
                    f"{per_release:.3g} epsilon each) is above {AUTO_SCALE_RANK_ERROR:.0%} of n; "
                    "columns without declared bounds used as given"
                    + ("" if not private_label else ", and the label too"))}
                scale = None
        # The fills' epsilon: one quantile's each, or the whole share when no range is released
        # (decided from public values: the released n and constants).
        fill_stages = _imputation_stages(
            imputed, fixed, per_release if scale is not None else share / len(imputed),
            seed) if imputed else []
        for q in fill_stages:
            unranged = [name for j, p, name in imputed if p == "median" and j not in fixed]
            if q.key == "impute_median" and unranged and (
                    q.rank_error_bound(0.05) > AUTO_SCALE_RANK_ERROR * n):
                # On the wide log grid a median this uncertain can land orders of magnitude away
                # from the data (airquality, 153 rows: RMSE 2.9e6). Refused before it is spent,
                # from public values (the released n and constants).
                raise ValueError(
                    f"median imputation of {', '.join(repr(c) for c in unranged)}: at this n the "
                    f"private median's 95% rank error ({q.rank_error_bound(0.05):.0f} rows at "
                    f"{q.epsilon:.3g} epsilon) is above {AUTO_SCALE_RANK_ERROR:.0%} of the rows, "
                    "so without a declared range it may land anywhere from 1e-3 to 1e9: declare "
                    "the column's range (the schema's bounds), give a larger --scale-epsilon, or "
                    "use the indicator policy")
        # The fills with the ranges (if any), and the run's other releases that do not depend
        # on them (``also``: the categorical columns' counts), in one pass over the data: one job.
        stages = ([scale] if scale is not None else []) + fill_stages + [s for s, _ in also]
        if not stages:
            return out
        stats.record_releases(stages, ledger)
        state = aggregator.run_stages(
            [stats.PackedStages(tuple(stages))] if len(stages) > 1 or fill_stages else stages,
            {"n": n})
        for _, released in also:
            out = {**out, **released(state)}
        if fill_stages:
            out = {**out, "imputation": _released_fills(imputed, fill_stages, state, fixed)}
        if scale is None:
            return out
        bounds = state["column_bounds"]
        # Quantiles released independently may cross (both inside one grid cell, or a column
        # with almost all rows equal): the range is then their span.
        low, high = np.minimum(bounds[:, 0], bounds[:, 1]), np.maximum(bounds[:, 0], bounds[:, 1])
        k = len(private_columns)
        return {**out, "column_bounds": {
            "columns": list(private_columns), "low": low[:k].tolist(), "high": high[:k].tolist(),
            **({"label": [float(low[k]), float(high[k])]} if private_label else {}),
            "quantiles": list(SCALE_QUANTILES), "epsilon": share,
            "rank_error_95": stage.rank_error_bound(0.05)}}

    def make_transform(pre: dict):
        low, high, reach = np.full(d, np.nan), np.full(d, np.nan), np.ones(d)
        # a declared range is the label's domain (reach 1); an inherited one keeps its reach
        label_reach = float(declared.get("label_reach", 1.0))
        for j, (lo, hi, r) in fixed.items():
            low[j], high[j], reach[j] = lo, hi, r
        label = declared["label"]
        released_bounds = pre.get("column_bounds")
        if released_bounds:
            columns = np.asarray(released_bounds["columns"], dtype=np.int64)
            lo, hi = np.asarray(released_bounds["low"]), np.asarray(released_bounds["high"])
            # A range collapsed to a point (a 0/1 column whose ones are under 2% of the rows, or a
            # column almost constant) would map the column to 0 and erase its rare values: such
            # a column is left as given.
            use = hi > lo
            if choice == "auto":
                # ... and auto maps only the columns its released ranges show off the unit scale
                # (a standardized or 0/1 column is left as given): mapping them anyway cost
                # ROC AUC 0.947 -> 0.905 on standardized ISLR Default (real_data_benchmark.py).
                use &= off_unit_scale(lo, hi)
            low[columns[use]], high[columns[use]] = lo[use], hi[use]
            reach[columns[use]] = PRIVATE_RANGE_REACH
            if "label" in released_bounds:
                label = released_bounds["label"]
                label_reach = PRIVATE_RANGE_REACH
                if not label[1] > label[0] or (choice == "auto" and not off_unit_scale(
                        np.asarray(label[:1]), np.asarray(label[1:]))[0]):
                    label = None   # one grid cell, or already on the unit scale: as given
        if not problem.fit_intercept:
            # Without an intercept the model is y = <w, x>, through the origin: a shift of a
            # column or of the label would need the intercept the user left out, so each range
            # becomes symmetric about 0 (scale only, no shift).
            top = np.maximum(np.abs(low), np.abs(high))
            low, high = np.where(np.isnan(low), low, -top), np.where(np.isnan(high), high, top)
            if label is not None:
                label_top = max(abs(label[0]), abs(label[1]))
                label = (-label_top, label_top)
        fill = None
        if pre.get("imputation"):
            fill = np.full(d, np.nan)
            for column in pre["imputation"].values():
                fill[column["index"]] = column["fill"]
        if np.isnan(low).all() and label is None and fill is None:
            return None
        return features.ScaleColumns(tuple(low.tolist()), tuple(high.tolist()),
                                     *((float(label[0]), float(label[1])) if label else (None, None)),
                                     reach=tuple(reach.tolist()) if (reach != 1).any() else None,
                                     label_reach=label_reach,
                                     fill=None if fill is None else tuple(fill.tolist()))

    return preprocess, make_transform


_IMPUTE_STREAM = 13
IMPUTE_FLOAT_NOTE = ("median/mean imputation: the fills' releases add numpy's float noise (the "
                     "median's exponential mechanism by Gumbel-max, the mean's Laplace on float "
                     "sums); the other releases keep their own noise")


def _imputed(problem: Problem) -> list:
    """(model column, "median"/"mean", name) of the columns whose fill is still to be released."""
    spec = problem.source.get("encoding")
    if not spec:
        return []
    encoding = Encoding.from_spec(spec)
    pending = encoding.pending
    index = {name: j for j, name in enumerate(encoding.dense_names)}
    return [(index[c], p, c) for c, p in encoding.imputed if pending[index[c]]]


def _imputation_stages(imputed: list, fixed: dict, epsilon: float | None, seed: int) -> list:
    """The releases of the fills (``epsilon`` each column): one exponential-mechanism median per
    "median" column, one Laplace stage for all "mean" columns (each within its declared range).
    A median's grid is the scaling's public log grid, or, for a column with a declared range,
    as many points spread evenly over that range: the fill then stays in the column's domain,
    and at small n (where the mechanism is nearly uniform over the grid) it does not land
    orders of magnitude away from the data."""
    medians = tuple(j for j, p, _ in imputed if p == "median")
    means = tuple(j for j, p, _ in imputed if p == "mean")
    out = []
    if medians:
        log_grid = stats.symmetric_log_grid(SCALE_GRID_BOUND, SCALE_GRID_SIZE, 1e12)[0]
        size = log_grid.size
        grid = np.stack([np.linspace(fixed[j][0], fixed[j][1], size) if j in fixed else log_grid
                         for j in medians])
        out.append(stats.QuantileStage("impute_median", stats.Selected(medians),
                                       stats.FixedGrid(grid), len(medians), size, (0.5,),
                                       epsilon, stats.stages_seed(seed), (_IMPUTE_STREAM,)))
    if means:
        out.append(stats.ImputeMeanStage("impute_mean", means,
                                         tuple(float(fixed[j][0]) for j in means),
                                         tuple(float(fixed[j][1]) for j in means),
                                         epsilon * len(means), stats.stages_seed(seed),
                                         (_IMPUTE_STREAM, 1)))
    return out


def _released_fills(imputed: list, stages: list, state: dict, fixed: dict) -> dict:
    """{column: its policy, released fill, model column and the release's noise} (public)."""
    out = {}
    medians = iter(state["impute_median"][:, 0]) if "impute_median" in state else iter(())
    means = iter(state["impute_mean"]) if "impute_mean" in state else iter(())
    by_key = {s.key: s for s in stages}
    for j, policy, name in imputed:
        if policy == "median":
            q = by_key["impute_median"]
            out[name] = {"policy": "median", "index": j, "fill": float(next(medians)),
                         "epsilon": q.epsilon, "mechanism": "exponential mechanism quantile",
                         "grid": ("uniform over the declared range" if j in fixed
                                  else "symmetric log grid, 10% steps"),
                         "rank_error_95": q.rank_error_bound(0.05)}
        else:
            m = by_key["impute_mean"]
            half = (fixed[j][1] - fixed[j][0]) / 2.0
            out[name] = {"policy": "mean", "index": j, "fill": float(next(means)),
                         "epsilon": m.epsilon / len(m.columns), "mechanism": "Laplace",
                         "range": [fixed[j][0], fixed[j][1]],
                         # the Laplace scale of the noisy sum, in the column's units, and of
                         # the noisy count of present cells (neither total is reported)
                         "noise_scale_sum": half * m.laplace_scale,
                         "noise_scale_count": m.laplace_scale}
    return out


def gradient_sparsity(problem: Problem) -> int:
    """s, a public bound on the nonzeros of one example's gradient: per output, one per numeric
    column, one per categorical column (its value's or bucket's, exactly one whatever the value)
    and the intercept; a dense problem's s is every coefficient. From the declared columns only."""
    spec = problem.source.get("encoding")
    per_output = ((Encoding.from_spec(spec).nonzeros_per_row if spec else problem.dim)
                  + int(problem.fit_intercept))
    return problem.loss.outputs() * max(per_output, 1)


def _preconditioned(options, problem: Problem) -> bool:
    choice = getattr(options, "precondition", "none")
    if choice == "counts" and not problem.sparse:
        raise ValueError("--precondition counts scales categorical columns: it needs "
                         "--categorical-columns")
    if choice == "counts" and problem.privacy.epsilon is None and options.precondition_epsilon is None:
        raise ValueError("--precondition counts with --noise-multiplier needs "
                         "--precondition-epsilon (the counts' budget)")
    return preconditions(choice, problem.sparse, problem.privacy.epsilon)


def preconditions(choice: str | None, sparse: bool, epsilon: float | None) -> bool:
    """Whether --precondition ``choice`` releases column counts (and so spends
    --precondition-epsilon): counts, or auto with categorical columns and --epsilon."""
    return sparse and (choice == "counts" or (choice == "auto" and epsilon is not None))


def _column_counts(options, problem: Problem, aggregator, seed: int, ledger):
    """The private column counts of ``--precondition counts`` (one Gaussian release, its share
    of epsilon) and the step scale made from them once the plan is known; also (stage,
    released) for ``_column_scaling``'s ``also`` (the counts in the ranges' pass)."""
    epsilon = problem.privacy.epsilon
    count_epsilon = options.precondition_epsilon or 0.1 * epsilon
    if epsilon is not None and count_epsilon >= epsilon:
        raise ValueError("--precondition-epsilon is a share of --epsilon: it must be smaller")
    encoding = Encoding.from_spec(problem.source["encoding"])   # (checked: problem.sparse)
    first = encoding.first_categorical
    per_row = len(encoding.categorical)
    multiplier = stats.gaussian_noise_multiplier(count_epsilon, problem.privacy.delta)
    noise_std = multiplier * math.sqrt(per_row)

    stage = stats.ColumnCountStage("column_counts", first, problem.dim, per_row, multiplier,
                                   stats.stages_seed(seed), (_COUNTS_STREAM,))

    def preprocess(n: int) -> dict:   # (alone: the counts in a pass of their own)
        stats.record_releases([stage], ledger)
        return released(aggregator.run_stages([stage], {"n": n}))

    def released(state: dict) -> dict:
        counts = state["column_counts"]
        # Only the columns clearly above the noise are kept (the rest get the floor anyway):
        # a public threshold, so the plan stays small.
        keep = np.flatnonzero(counts > KEEP_COUNT_NOISE * noise_std)
        return {"column_counts": {"first": first, "columns": keep.tolist(),
                                  "counts": counts[keep].tolist(), "epsilon": count_epsilon,
                                  "noise_multiplier": multiplier}}

    def make_step_scale(pre: dict, plan: dict) -> ColumnStepScale:
        counts = pre["column_counts"]
        n = float(plan["normalizer"])
        walk = (options.learning_rate * plan["noise_multiplier"] * options.clip_norm
                * math.sqrt(plan["steps"]))
        floor = max(walk / PRECONDITION_NOISE_WALK, KEEP_COUNT_NOISE * noise_std, 1.0)
        values = np.asarray(counts["counts"], dtype=np.float64)
        above = values > floor
        columns = np.asarray(counts["columns"], dtype=np.int64)[above]
        return ColumnStepScale(counts["first"], n / floor, tuple(columns.tolist()),
                               tuple((n / values[above]).tolist()))

    return preprocess, make_step_scale, (stage, released)


_COUNTS_STREAM = 7
KEEP_COUNT_NOISE = 4.0   # counts kept in the plan: above 4 standard deviations of their noise


def _train_dpgd(options, problem, aggregator, seed, ledger, progress):
    return _train_noisy("dpgd", options, problem, aggregator, seed, ledger, progress)


def _train_dpsgd(options, problem, aggregator, seed, ledger, progress):
    return _train_noisy("dpsgd", options, problem, aggregator, seed, ledger, progress)


DPGD = Algorithm(
    "dpgd", "classification or regression on up to a few million rows: full-batch noisy "
            "gradient descent; accurate at small epsilon, each step reads all the data",
    MODEL_NAMES, DpgdOptions, _train_dpgd, warm_start=True, secure_noise=True, sparse_input=True,
    user_level=True, quality_check=True)
DPSGD = Algorithm(
    "dpsgd", "large data where a full pass per step is too slow: Poisson-sampled mini-batches, "
             "each step reads only its batch; needs more tuning than dpgd",
    MODEL_NAMES, ScaledDpsgdOptions, _train_dpsgd, warm_start=True, secure_noise=True,
    user_level=True, quality_check=True)
