"""DP-AMBSSGD: one-pass private linear regression with adaptive clipping (paper 003, Varshney,
Thakurta & Jain, Algorithms 2 and 3).

* Every example is assigned, from the seed and its position only (data-independently), to one
  of T blocks and, within it, to the statistics part (probability ``stat_fraction``) or the
  gradient part. The assignment is made once (``assign``) and step t reads only block t.
* Step t, one pass over block t (fused, note §5.6): a histogram of the statistics part's absolute
  residuals |<x, w_t> + b_t - y| over the doubling grid Delta * 2^i, i = 0..L, and the gradient
  part's clipped gradient sums for every candidate clip norm zeta_i = R_x Delta 2^i.
* DP-STAT on the driver: the noisy doubling search over the cumulative counts c_i, each with
  fresh Gaussian noise, stopping at the first i with c_i + noise >= s - Gamma' (the note's robust
  rule, §1.3: the literal "c_priv < s" rule overshoots with a geometric tail), Gamma' =
  sigma_stat sqrt(2 ln((L + 1) / beta)) + sqrt(2 s ln(T / beta)), beta = 0.01 (the second term
  allows for the random size of the statistics part). gamma_t = Delta 2^i (capped at the bound B).
* The selected clipped sum gets Gaussian noise of std sigma_grad * zeta_t and the update is
  w_{t+1} = w_t - eta / b (S_t + noise), with b the *nominal* batch size (public).
* Output: the tail average of the last T/2 iterates.

Accounting (add/remove, so the nominal s and b, not the realized block sizes, are used): each
example takes part in exactly one release, either the L + 1 noisy counts of its block's DP-STAT
(multiplier sigma_stat each, together a Gaussian with multiplier sigma_stat / sqrt(L + 1)) or
one clipped gradient sum (multiplier sigma_grad); everything else is adaptive post-processing
(parallel composition over disjoint blocks). Both branches are Gaussian, so the per-example
privacy loss is dominated by a single Gaussian with multiplier
min(sigma_stat / sqrt(L + 1), sigma_grad); the two are set equal (the paper's 50/50 zCDP split)
and that one GaussianDpEvent goes in the ledger, composed with the dataset-size count.
The paper accounts 1/alpha^2 zCDP (sequential within a block); the disjoint roles give the
note's factor-2 saving (§2.2 remark 1), which this uses.

Secure noise (``--noise secure``): the rows are quantized as DP-GD's (``clipping.quantized_rows``:
20-bit block floating point, the features both parts see); the histogram counts are exact
integers and are put on the grid 2^-k (2^k = the smallest power of two with sigma_stat 2^k >=
2^32, sensitivity 2^k per count in those units) before discrete Gaussian noise of scale
sigma_stat 2^k, the search comparing c 2^k + Z with the threshold exactly; each level's clipped
gradient sum is an exact integer sum on its own grid zeta_i 2^-(19 + U)
(``clipping.exact_clipped_gradient_sums``: sensitivity 2^(19 + U) in those units, U as DP-GD's
``secure_scale_bits``), and the selected level gets discrete Gaussian noise of scale
sigma_grad 2^(19 + U). The same GaussianDpEvent accounts for it, plus ``sampler_delta_bound``
(``secure_noise.secure_release_note``). Why the counts are scaled rather than noised at scale
sigma_stat directly: see that note.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import (accounting, clipping, column_scaling, features, mechanisms, secure_noise,
                     stats)
from beam_dp.algorithms import spec
from beam_dp.algorithms.base import TrainState, run_chunks
from beam_dp.algorithms.noisy_gd import NoisyGDConfig, core_config
from beam_dp.algorithms.spec import Algorithm, Problem, TrainResult, option
from beam_dp.block import Block
from beam_dp.dataset_size import release_dataset_size
from beam_dp.losses import GlmLoss, SquaredLoss, scores
from beam_dp.mechanisms import sampling_seed

STAT, GRAD = 0, 1
# The divergence guard: the run stops once ||theta|| R > DIVERGENCE_FACTOR B, B the residual bound
# (the labels' scale the clip search allows) and R the feature bound (sqrt(d + 1) for privately
# standardized rows, whose entries lie in [-1, 1]; the private norm quantile otherwise; R_x with
# a fixed --learning-rate), i.e. once the model's predictions on rows within the
# feature bound can pass 10 B. A step size too large for the curvature does not explode
# geometrically here (every gradient is clipped) but swings with amplitude ~ eta R_x B: on
# diamonds at eta = 1 the predictions reached 1e5-1e6 (RMSE 2e5-7e5, labels < 2e4). A converging
# run's coefficients stay within a few B / R in the directions it can learn in T steps.
DIVERGENCE_FACTOR = 10.0
# The private step size eta = STEP_FACTOR / lambda_up (the paper's Theta(1/||H||), note §1.2):
# 1 matches the old default on standardized features and is below the 2 / lambda_max at which
# the full-gradient iteration diverges, with lambda_up an upper bound w.h.p.
STEP_FACTOR = 1.0
# The first release's share of the curvature budget: the 2d column quantiles take most of it
# (the matrix's noise, std sigma r^2 / n per entry, matters little once r is sqrt(d + 1)); the
# one norm quantile little, as there the matrix's noise (r^2 ~ E||x||^2) sets the step size:
# measured on Ecdat Computers (n = 5,000 standardized rows, epsilon 1), 3/4 to the norm
# quantile gave eta = 0.087 and R^2 0.537, a quarter eta = 0.24 and R^2 0.728 (medians of 3
# seeds; the fixed step 1: 0.718).
QUANTILE_SHARE = 0.75
NORM_QUANTILE_SHARE = 0.25
NOISE_MULTIPLIER_CURVATURE_EPSILON = 0.1   # the curvature's budget with --noise-multiplier
NORM_QUANTILE = 0.98               # the second-moment matrix's clip radius: this norm quantile
NORM_GRID = (1e-3, 1e9, 601)       # its candidates: 0 and a log grid, ~3.5% apart
_CURVATURE_STREAM = 31


class DivergenceError(ValueError):
    """dp-ambssgd's iterate left the public bound (``AmbssgdStep.check_iterate``)."""


@dataclasses.dataclass
class AmbssgdConfig:
    blocks: int = option(12, "T: the data is split into T disjoint blocks, one step each", low=2)
    stat_fraction: float = option(1.0 / 11.0, "share of each block used for the clip statistics "
                                              "(s / (b + s); the paper's s = b / 10)",
                                  low=0, low_open=True, high=0.5)
    expected_feature_norm: float | None = option(
        None, "R_x: the clip norm is R_x times the private residual scale; default the "
              "private root mean square of ||(x, 1)||, or sqrt(d) (standardized "
              "features) when --learning-rate is given", low=0, low_open=True)
    residual_bound: float = option(1e4, "B: the largest residual scale the clip search considers",
                                   low=0, low_open=True)
    failure_probability: float = option(0.01, "beta of the search's robust stopping rule",
                                        low=0, low_open=True, high=0.5)
    learning_rate: float | None = option(
        None, "step size; default 1 / (a private upper bound on the largest eigenvalue "
              "of E[(x, 1)(x, 1)^T]), the paper's 1/||H||, spending --curvature-epsilon", low=0, low_open=True)
    standardize: str = option(
        "private", "with the private step size: 'private' maps each column's private "
                   "2nd-98th percentiles onto [-1, 1], an affine map that clips nothing (applied "
                   "again by predict), "
                   "so that one step size suits every direction; 'none': features as "
                   "given", choices=("private", "none"))
    curvature_epsilon: float | None = option(
        None, "budget of the private step size's releases (quantiles and a "
              "second-moment matrix); default a tenth of epsilon",
        low=0, low_open=True)

    def validate(self) -> None:
        spec.validate(self)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Block and role of every example, from the seed and the example's position only: the
    batch plan (``beam_dp.batches``) of the steps, step t reading the parts tagged 2t and 2t+1."""

    seed: int
    blocks: int
    stat_fraction: float
    expected_rows: float = 0.0     # of a step: n / T (sizes the batch files)

    @property
    def expected_total_rows(self) -> float:   # n, public (sizes the files of every row)
        return self.expected_rows * self.blocks

    def pieces(self, block: Block, steps):
        wanted = set(steps)
        for part in self(block):
            if part.tag // 2 in wanted:
                yield part.tag // 2, part

    def __call__(self, block: Block):
        g = mechanisms.rng(self.seed, mechanisms.STREAM_SAMPLING, block.key)
        m = len(block)
        tags = 2 * g.integers(0, self.blocks, size=m) + (g.random(m) >= self.stat_fraction)
        yield from block.parts(tags)


@dataclasses.dataclass(frozen=True)
class AmbssgdStep:
    """One block of DP-AMBSSGD as a stage; see the module docstring."""

    dim: int
    levels: int                 # L: candidates Delta * 2^i for i = 0..L
    resolution: float           # Delta
    bound: float                # B
    feature_norm: float         # R_x
    sigma_stat: float
    sigma_grad: float
    stat_size: float            # nominal s
    batch_size: float           # nominal b
    learning_rate: float
    margin: float               # Gamma'
    tail_start: int             # steps >= tail_start enter the tail average
    seed: int
    batch_plan: Assignment | None = None   # which rows each step reads
    # "secure": exact integer counts and sums, discrete Gaussian noise (module docstring).
    noise: str = "float"
    count_bits: int = 0         # secure: the counts' grid 2^-count_bits
    scale_bits: int = clipping.GRID_SCALE_BITS   # secure: the gradient sums' grids (U)
    # The divergence guard (``check_iterate``): a public bound on the iterate's norm.
    divergence_bound: float | None = None
    transform: Callable | None = None   # per-example feature map (--standardize private)

    def check_iterate(self, theta: np.ndarray, step: int) -> None:
        """Stops a diverging run (a step size too large for the features' curvature) with a
        clear error rather than writing its model: the iterate is a post-processing of noisy
        releases, its bound public, and the message holds neither."""
        if self.divergence_bound is None:
            return
        with np.errstate(over="ignore", invalid="ignore"):
            size = float(np.linalg.norm(theta))
        if not size <= self.divergence_bound:   # NaN and inf included
            raise DivergenceError(
                f"dp-ambssgd diverged at step {step + 1}: the coefficients' norm passed the "
                f"public bound {self.divergence_bound:.3g} (DIVERGENCE_FACTOR x --residual-bound "
                "/ the feature bound); "
                "no model is written. Lower --learning-rate (or leave it to the private step "
                "size) or standardize the features")

    def selected_sum(self, batch: Block, state: TrainState) -> np.ndarray:
        return self.partial_sum(batch, state)

    @property
    def shape(self):
        return ((self.levels + 1) * (self.dim + 2),)

    def thresholds(self) -> np.ndarray:
        return self.resolution * 2.0 ** np.arange(self.levels + 1)

    def clip_norms(self) -> np.ndarray:
        """zeta_i = R_x min(Delta 2^i, B), the candidate clip norms."""
        return self.feature_norm * np.minimum(self.thresholds(), self.bound)

    @property
    def secure(self) -> bool:
        return self.noise == "secure"

    def zero_sum(self):
        """The sum over no rows."""
        return clipping.ExactSum.zeros(self.shape) if self.secure else np.zeros(self.shape)

    def count_scale(self) -> float:
        """secure: the counts' noise scale in units of 2^-count_bits."""
        return math.ldexp(self.sigma_stat, self.count_bits)

    def gradient_scale(self) -> float:
        """secure: the gradient noise scale in units of a level's grid."""
        return self.sigma_grad * 2.0 ** (clipping.GRID_FEATURE_BITS - 1 + self.scale_bits)

    def _exact_sum(self, block: Block, state: TrainState) -> clipping.ExactSum:
        """``partial_sum`` with secure noise: column 0 the exact counts, columns 1.. each
        level's exact clipped gradient sum in units of its grid."""
        if block.tag not in (2 * state.step + STAT, 2 * state.step + GRAD):
            return clipping.ExactSum.zeros(self.shape)
        if self.transform is not None:
            block = self.transform(block)
        q, shift, norms = clipping.block_quantized_rows(block, True)
        hi = np.zeros((self.levels + 1, self.dim + 2), dtype=np.int64)
        lo = np.zeros_like(hi)
        if block.tag % 2 == STAT:
            with np.errstate(over="ignore", invalid="ignore"):
                residual = clipping.quantized_scores(state.theta, q, shift)[:, 0] - block.labels
            cells = np.searchsorted(self.thresholds(), np.abs(residual), side="left")
            lo[:, 0] = np.bincount(cells, minlength=self.levels + 2)[:self.levels + 1]
            return clipping.ExactSum(hi.ravel(), lo.ravel())
        sums = clipping.exact_clipped_gradient_sums(state.theta, q, shift, norms, block.labels,
                                                    SquaredLoss(), self.clip_norms(),
                                                    self.scale_bits)
        hi[:, 1:], lo[:, 1:] = sums.hi[:, 0, :], sums.lo[:, 0, :]
        return clipping.ExactSum(hi.ravel(), lo.ravel())

    def _apply_secure(self, state: TrainState, total: clipping.ExactSum) -> TrainState:
        hi = total.hi.reshape(self.levels + 1, self.dim + 2)
        lo = total.lo.reshape(self.levels + 1, self.dim + 2)
        g = mechanisms.secure_generator(self.seed, mechanisms.STREAM_NOISE, state.step)
        unit = 1 << self.count_bits
        # c 2^k + Z >= (s - Gamma') 2^k, in exact rational arithmetic.
        threshold = Fraction(self.stat_size - self.margin) * unit
        cumulative, level = 0, self.levels
        for i in range(self.levels + 1):   # the doubling search: fresh noise per level
            cumulative += (int(hi[i, 0]) << 32) + int(lo[i, 0])
            noise = int(mechanisms.discrete_gaussian(g, self.count_scale(), ()))
            if cumulative * unit + noise >= threshold:
                level = i
                break
        grid = clipping.gradient_grid(float(self.clip_norms()[level]), self.scale_bits)
        noise = mechanisms.discrete_gaussian(g, self.gradient_scale(), self.dim + 1)
        noisy = (clipping.ExactSum(hi[level, 1:], lo[level, 1:]) + noise).to_float() * grid
        theta = state.theta - self.learning_rate / self.batch_size * noisy[None, :]
        self.check_iterate(theta, state.step)
        in_tail = state.step >= self.tail_start
        return TrainState(theta, state.theta_sum + theta if in_tail else state.theta_sum, state.step + 1)

    def partial_sum(self, block: Block, state: TrainState) -> np.ndarray:
        if self.secure:
            return self._exact_sum(block, state)
        out = np.zeros((self.levels + 1, self.dim + 2))
        if block.tag not in (2 * state.step + STAT, 2 * state.step + GRAD):
            return out.ravel()
        if self.transform is not None:
            block = self.transform(block)
        # Scores are never NaN (losses.scores); a residual beyond the float range is +-inf,
        # silently: a huge feature value must not print a warning that reveals its row.
        with np.errstate(over="ignore"):
            residual = scores(state.theta, block.features)[:, 0] - block.labels
        if block.tag % 2 == STAT:
            # Histogram of |residual| over the doubling thresholds; overflow beyond the last
            # threshold (including inf) is dropped (it only lowers the cumulative counts).
            cells = np.searchsorted(self.thresholds(), np.abs(residual), side="left")
            out[:, 0] = np.bincount(cells, minlength=self.levels + 2)[:self.levels + 1]
        else:
            # Clipped sums for every candidate clip norm at once: the residual is the squared
            # loss's derivative, and clipping.clipped_outer_sums bounds each row's contribution
            # by zeta exactly, also for rows whose norm or residual overflows.
            zetas = self.feature_norm * np.minimum(self.thresholds(), self.bound)
            out[:, 1:] = clipping.clipped_outer_sums(residual[:, None], block.features,
                                                     block.sq_norms, zetas, True)[:, 0, :]
        return out.ravel()

    # The ledger release the audit's canaries enter.
    canary_releases = ("dp_ambssgd_blocks_parallel_composition",)

    def canary_sum(self, state: TrainState, canaries):
        """The audit's white-box canaries (``beam_dp.audit``) in this block: each included canary
        assigned to it (uniformly over the blocks, from the audit's randomness, as a row's block
        is) takes the gradient role and adds, at every candidate clip norm zeta_i, a clipped
        gradient of norm zeta_i on its own feature column: the most one example can add (with
        secure noise: the sensitivity 2^(19 + U) in units of every level's grid)."""
        columns = canaries.columns[canaries.included & (canaries.blocks(self.batch_plan.blocks) == state.step)]
        if self.secure:
            units = np.zeros((self.levels + 1, self.dim + 2), dtype=np.int64)
            units[:, 1 + columns] = 1 << (clipping.GRID_FEATURE_BITS - 1 + self.scale_bits)
            return clipping.ExactSum.of(units.ravel())
        out = np.zeros((self.levels + 1, self.dim + 2))
        zetas = self.feature_norm * np.minimum(self.thresholds(), self.bound)
        out[:, 1 + columns] = zetas[:, None]
        return out.ravel()

    def canary_scores(self, before: TrainState, after: TrainState, canaries) -> np.ndarray:
        """Minus the update of each canary's column at its own block's step (0 for the canaries
        of other blocks). The assignment of examples to blocks is data-independent and the
        guarantee holds for each assignment (parallel composition), so the audit may use it."""
        in_block = canaries.blocks(self.batch_plan.blocks) == before.step
        columns = canaries.columns
        return np.where(in_block, before.theta[0, columns] - after.theta[0, columns], 0.0)

    def apply(self, state: TrainState, total: np.ndarray) -> TrainState:
        if self.secure:
            return self._apply_secure(state, total)
        total = total.reshape(self.levels + 1, self.dim + 2)
        g = mechanisms.rng(self.seed, mechanisms.STREAM_NOISE, state.step)
        cumulative = np.cumsum(total[:, 0])
        level = self.levels
        for i in range(self.levels + 1):   # the doubling search: fresh noise per level
            if cumulative[i] + mechanisms.gaussian_noise(g, (), self.sigma_stat) >= self.stat_size - self.margin:
                level = i
                break
        zeta = self.feature_norm * min(self.thresholds()[level], self.bound)
        noise = mechanisms.gaussian_noise(g, self.dim + 1, self.sigma_grad * zeta)
        with np.errstate(over="ignore", invalid="ignore"):
            theta = state.theta - self.learning_rate / self.batch_size * (total[level, 1:] + noise)[None, :]
        self.check_iterate(theta, state.step)
        in_tail = state.step >= self.tail_start
        return TrainState(theta, state.theta_sum + theta if in_tail else state.theta_sum, state.step + 1)


def train(config: NoisyGDConfig, a_config: AmbssgdConfig, loss: GlmLoss, dim: int, aggregator,
          seed: int, ledger: accounting.Ledger,
          on_progress: Callable[[int, int, float], None] = lambda *a: None,
          private_step_size: bool = False) -> TrainResult:
    """``config`` supplies epsilon / noise multiplier, delta, the accountant, the learning rate,
    the dataset size and the count budget; ``a_config`` the DP-AMBSSGD knobs. With
    ``private_step_size`` (the registered algorithm's default) the learning rate, and R_x unless
    given, come from ``private_curvature`` instead, budgeted in the same ledger before the pass."""
    if loss.name != "linear":
        raise ValueError("dp-ambssgd fits linear regression: use --model linear")
    config.validate()
    a_config.validate()
    dataset_size = release_dataset_size(config, aggregator, seed, ledger)
    n = dataset_size["value"]
    learning_rate, feature_norm = config.learning_rate, a_config.expected_feature_norm
    curvature, transform = {}, None
    feature_bound = feature_norm or math.sqrt(dim)
    if private_step_size and config.noise == "secure" and not secure_moment_fits(config, dim):
        # An explicit --noise secure whose second-moment matrix's samplers would take too much
        # of delta (many columns, large epsilon): the fixed step size, said in the report.
        private_step_size = False
        if SECURE_FIXED_STEP_NOTE not in ledger.notes:
            ledger.notes.append(SECURE_FIXED_STEP_NOTE)
    if private_step_size:
        curvature, transform = private_curvature(config, a_config, dim, aggregator, seed, ledger, n)
        learning_rate = curvature["learning_rate"]
        feature_norm = feature_norm or curvature["root_mean_square_norm"]
        feature_bound = curvature["feature_bound"]
    T = a_config.blocks
    stat_size = n * a_config.stat_fraction / T
    batch_size = n * (1.0 - a_config.stat_fraction) / T
    resolution = a_config.residual_bound / max(n, 2)
    levels = int(math.ceil(math.log2(a_config.residual_bound / resolution)))
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    else:
        prior = ledger.event()
        if ledger.epsilon(config.delta) >= config.epsilon:
            raise ValueError("the releases before the pass (the dataset-size count, the step "
                             "size's curvature, the quality check) spend the budget; give "
                             "--num-examples or a smaller --curvature-epsilon")
        sigma = accounting.calibrate_noise_multiplier(
            lambda s: events.ComposedDpEvent([prior, events.GaussianDpEvent(s)]),
            config.epsilon, config.delta, config.accountant)
    sigma_stat = sigma * math.sqrt(levels + 1)
    params = dict(noise_multiplier=sigma, blocks=T, stat_noise_multiplier_per_count=sigma_stat,
                  counts_per_search=levels + 1, gradient_noise_multiplier=sigma,
                  composition=("parallel over disjoint blocks and roles: each example is in one "
                               "DP-STAT search or one clipped gradient sum, each equivalent to "
                               "a Gaussian with this multiplier"))
    secure = {}
    if config.noise != "float":   # None: secure by default, float where it cannot be used
        try:
            secure = _secure_plan(config, sigma, sigma_stat, T, levels, dim, ledger, params)
        except secure_noise.SecureNoiseUnavailable as why:   # (before any release)
            secure_noise.float_instead(config.noise, why, ledger)
    if not secure:
        params["noise"] = secure_noise.noise_description("float", sigma)
    ledger.record("dp_ambssgd_blocks_parallel_composition", events.GaussianDpEvent(sigma), **params)
    # The search compares noisy counts with the nominal s (the realized size of a block's
    # statistics part is private under add/remove). That size is Binomial with std ~ sqrt(s), so
    # the margin also allows for it, or once sqrt(s) is comparable to the noise margin the search
    # cannot stop and falls through to gamma = B (seen at n = 1e6 in the regression benchmark).
    size_slack = math.sqrt(2.0 * stat_size * math.log(T / a_config.failure_probability))
    step = AmbssgdStep(
        dim=dim, levels=levels, resolution=resolution, bound=a_config.residual_bound,
        feature_norm=feature_norm or math.sqrt(dim),
        sigma_stat=sigma_stat, sigma_grad=sigma, stat_size=stat_size, batch_size=batch_size,
        learning_rate=learning_rate,
        divergence_bound=DIVERGENCE_FACTOR * a_config.residual_bound / feature_bound,
        transform=transform,
        margin=(sigma_stat * math.sqrt(2.0 * math.log((levels + 1) / a_config.failure_probability))
                + size_slack),
        tail_start=T - T // 2, seed=seed,
        # The batch job's graph holds the plan: a key derived from the seed for the assignment,
        # not the root seed (from which the steps' noise could be derived).
        batch_plan=Assignment(sampling_seed(seed), T, a_config.stat_fraction, n / T), **secure)
    state = TrainState.zeros(1, dim)
    epsilon = ledger.epsilon(config.delta)
    on_progress(0, T, epsilon)
    state = run_chunks(aggregator, step, state, T, config.steps_per_chunk,
                       lambda s, k: on_progress(s.step, T, epsilon))
    theta = state.theta_sum / (T // 2)
    return TrainResult(theta, ledger, sigma, 1.0, T, None, dataset_size,
                       feature_transform=features.spec(transform),
                       sampling="one pass over disjoint blocks (data-independent assignment)",
                       expected_batch_size=batch_size, details_name="algorithm_parameters",
                       preprocessing={"blocks": T, "stat_size": stat_size, "batch_size": batch_size,
                        "residual_levels": levels + 1, "residual_resolution": resolution,
                        "expected_feature_norm": step.feature_norm,
                        "learning_rate": learning_rate,
                        **({"private_step_size": curvature} if curvature else {})})


SECURE_FIXED_STEP_NOTE = ("dp-ambssgd with --noise secure: the private step size's secure "
                          "second-moment matrix would take more than 1e-4 of delta at these settings "
                          "(its draws grow with d^2), so the step size is the fixed "
                          "--learning-rate default 1; --noise float gives the private one")


def secure_moment_fits(config: NoisyGDConfig, dim: int) -> bool:
    """Whether the secure second-moment matrix's sampler slack, (1 + e^eps) x its draws' total
    variation, stays within 1e-4 delta (the run's secure releases together must stay within
    1e-3 delta); with a noise multiplier (epsilon not yet known) at epsilon 10. Public."""
    epsilon = config.epsilon if config.epsilon is not None else 10.0
    variation = stats.secure_moment_variation(dim)
    return secure_noise.secure_delta_bound(variation, epsilon) <= 1e-4 * config.delta


# How far past its private 2nd-98th percentile range a column may go under --standardize
# private, in half-widths: far enough that no real value is clipped, near enough that the
# mapped value and its square stay finite.
UNCLIPPED_REACH = 1e6
# Where the 2nd and 98th percentiles go under --standardize private: +-2.054, the standard normal
# distribution's, so that a Gaussian column is mapped to (about) unit variance.
PERCENTILE_SPAN = 2.054


def private_curvature(config: NoisyGDConfig, a_config: AmbssgdConfig, dim: int, aggregator,
                      seed: int, ledger: accounting.Ledger, n: int):
    """The private step size, from two releases made before the pass (QUANTILE_SHARE or
    NORM_QUANTILE_SHARE of the curvature budget for the first, the rest for the second; the ledger composes them with the count and the pass, whose noise is calibrated after
    them), and, with --standardize private, the column map. Returns (public details, map).

    1. A bound on the rows: with --standardize private, each column's 2nd and 98th percentiles
       (exponential mechanism on the public log grid of dpsgd's --scale-features private, pure
       DP), and the map ``features.ScaleColumns`` of each column onto [-1, 1], so every mapped
       row z = (x', 1) has norm <= r = sqrt(d + 1); as there, skipped (nothing spent) where the
       quantiles' 95% rank error passes a quarter of n. Otherwise R, the NORM_QUANTILE quantile
       of ||x|| (same mechanism), and r = sqrt(R^2 + 1).
    2. The second-moment matrix H of the (mapped) rows shrunk to norm r
       (``stats.SecondMomentStage``: the analytic Gaussian's multiplier at (its share, delta / 2)).

    lambda_up = lambda_max(noisy H) + 3 sqrt(d + 1) sigma r^2 / n (a symmetric Gaussian matrix's
    spectral norm is about 2 sqrt(d + 1) times its entries' std), eta = STEP_FACTOR / lambda_up,
    and R_x's default sqrt(trace H), the root mean square of ||z||: post-processing only.

    Why standardize: the step size can only be as large as the steepest direction allows, so on
    unscaled columns (diamonds: depth and table ~60 beside carat ~0.8) a safe eta leaves the
    directions that carry the label unlearnt in T steps; on mapped columns the curvature is
    within a small factor in every direction that matters."""
    epsilon = config.epsilon
    # With a noise multiplier (no target), a fixed default budget, as the dataset-size count's.
    share = a_config.curvature_epsilon or (epsilon / 10.0 if epsilon is not None
                                           else NOISE_MULTIPLIER_CURVATURE_EPSILON)
    if epsilon is not None and share >= epsilon / 2:
        raise ValueError("--curvature-epsilon is a share of --epsilon: keep it below half")
    noise = "float" if config.noise == "float" else "secure"   # None: secure by default
    transform, details = None, {}
    if a_config.standardize == "private":
        per_release = QUANTILE_SHARE * share / (dim * len(column_scaling.SCALE_QUANTILES))
        size = column_scaling.SCALE_GRID_SIZE
        grid = np.repeat(stats.symmetric_log_grid(column_scaling.SCALE_GRID_BOUND, size, 1e12), dim,
                         axis=0)
        stage = stats.QuantileStage(
            "column_bounds", stats.Columns(), stats.FixedGrid(grid), dim, size,
            column_scaling.SCALE_QUANTILES, per_release, stats.stages_seed(seed),
            (_CURVATURE_STREAM, 0),
            # dpgd's margin (column_scaling.SCALE_MARGIN_FAILURE: a range on the empty grid far past
            # the data maps its column to ~0), and its rule for when n is too small for it
            margin=stats.quantile_rank_error_bound(size, per_release,
                                                   column_scaling.SCALE_MARGIN_FAILURE),
            noise=noise)
        if stage.margin <= column_scaling.AUTO_SCALE_RANK_ERROR * n:
            stats.record_releases([stage], ledger)
            bounds = aggregator.run_stages([stage], {"n": n})["column_bounds"]
            low, high = np.minimum(bounds[:, 0], bounds[:, 1]), np.maximum(bounds[:, 0], bounds[:, 1])
            # An affine map, not a clip: the pass clips each example's gradient itself, at a
            # norm that follows the private residual scale, so values past the 2nd-98th
            # percentiles keep their place (clipping them to [-1, 1] biased the fit: excess risk
            # 2.3e-2 at zero label noise instead of vanishing with it, paper 003's claim). The
            # reach only keeps every difference finite (UNCLIPPED_REACH half-widths).
            # The range onto [-PERCENTILE_SPAN, PERCENTILE_SPAN]: a Gaussian column gets unit
            # variance, as the intercept's constant 1 has, so one step size suits both (onto
            # [-1, 1] the columns' curvature was a quarter of the intercept's, and the 12
            # blocks left them unlearnt: 3e-4 excess risk at zero label noise).
            middle, half = (low + high) / 2.0, (high - low) / (2.0 * PERCENTILE_SPAN)
            transform = features.ScaleColumns(tuple((middle - half).tolist()),
                                              tuple((middle + half).tolist()),
                                              reach=(UNCLIPPED_REACH,) * dim)
            # (most mapped rows lie within this norm; the second-moment matrix shrinks the rest)
            radius = math.sqrt(PERCENTILE_SPAN ** 2 * dim + 1.0)
            details = {"standardize": "private: columns mapped onto [-1, 1] from their private "
                                      "2nd-98th percentiles"}
        else:   # decided from the released count and public constants: nothing spent
            details = {"standardize": "skipped: the quantiles' rank error bound (probability "
                                      f"{1 - column_scaling.SCALE_MARGIN_FAILURE:g}) is above a "
                                      "quarter of n; features used as given"}
    if transform is None:
        grid_size = NORM_GRID[2]
        quantile = stats.QuantileStage(
            "norm_bound", stats.Norms(), stats.FixedGrid(stats.log_grid(*NORM_GRID)), 1,
            grid_size, (NORM_QUANTILE,), NORM_QUANTILE_SHARE * share, stats.stages_seed(seed),
            (_CURVATURE_STREAM, 0),
            margin=stats.quantile_rank_error_bound(grid_size, NORM_QUANTILE_SHARE * share, 0.05),
            noise=noise)
        stats.record_releases([quantile], ledger)
        state = aggregator.run_stages([quantile], {"n": n})
        radius = math.sqrt(float(state["norm_bound"][0, 0]) ** 2 + 1.0)
        details["norm_quantile"] = NORM_QUANTILE
    first = QUANTILE_SHARE if transform is not None else NORM_QUANTILE_SHARE
    multiplier = stats.gaussian_noise_multiplier((1 - first) * share, config.delta / 2)
    moment = stats.SecondMomentStage("second_moment", dim, radius, multiplier,
                                     stats.stages_seed(seed), (_CURVATURE_STREAM, 1), transform,
                                     noise=noise)
    if noise == "secure":
        try:
            moment.secure_grid(radius)
            if not secure_moment_fits(config, dim):
                raise ValueError("the second-moment matrix's samplers would take more than 1e-4 "
                                 "of delta")
        except ValueError as why:   # float where secure noise was only the default
            secure_noise.float_instead(config.noise, secure_noise.SecureNoiseUnavailable(str(why)),
                                       ledger)
            moment = dataclasses.replace(moment, noise="float")
    stats.record_releases([moment], ledger)
    h = aggregator.run_stages([moment], {"n": n})["second_moment"]
    noise_norm = 3.0 * math.sqrt(dim + 1) * multiplier * radius ** 2 / max(n, 1)
    top = float(np.linalg.eigvalsh(h)[-1]) + noise_norm
    # A noisy matrix can come out near 0 (tiny n); the floor keeps eta below 1 / (its noise).
    top = max(top, 2.0 * noise_norm, 1e-12)
    rms = math.sqrt(max(float(np.trace(h)), 1.0))
    return ({"epsilon": share, "row_bound": radius, "second_moment_noise_multiplier": multiplier,
             "largest_eigenvalue_bound": top, "learning_rate": STEP_FACTOR / top,
             "root_mean_square_norm": rms, "feature_bound": radius, **details}, transform)


def _secure_plan(config, sigma, sigma_stat, T, levels, dim, ledger, params) -> dict:
    """The secure steps' grids (module docstring), with the run's sampler slack checked and
    written into ``params``; SecureNoiseUnavailable where they cannot hold the noise or the
    slack passes 1e-3 delta."""
    secure = dict(noise="secure", count_bits=count_bits(sigma_stat),
                  scale_bits=secure_noise.secure_scale_bits(sigma))
    # Every block draws at most L + 1 counts' noise and one gradient sum's (the scales of
    # AmbssgdStep.count_scale and .gradient_scale).
    count_scale = math.ldexp(sigma_stat, secure["count_bits"])
    gradient_scale = sigma * 2.0 ** (clipping.GRID_FEATURE_BITS - 1 + secure["scale_bits"])
    # (plus the secure releases before the pass: the private step size's second-moment matrix)
    variation = secure_noise.draws_total_variation(
        [(T * (levels + 1), count_scale), (T * (dim + 1), gradient_scale)]) \
        + secure_noise.prior_total_variation(ledger)
    event = events.GaussianDpEvent(sigma)
    epsilon = config.epsilon if config.epsilon is not None else accounting.epsilon_of(
        ledger.event_after("dp_ambssgd_blocks_parallel_composition", event, 1, **params),
        config.delta, config.accountant)
    sampler_delta = secure_noise.secure_delta_bound(variation, epsilon)
    if sampler_delta > 1e-3 * config.delta:
        raise secure_noise.SecureNoiseUnavailable(
            f"secure noise's samplers could add {sampler_delta:.2g} to delta at epsilon "
            f"{epsilon:.3g}")
    params.update(noise=secure_description(secure["count_bits"], secure["scale_bits"]),
                  sampler_total_variation=variation, sampler_delta_bound=sampler_delta)
    if secure_noise.secure_release_note() not in ledger.notes:
        ledger.notes.append(secure_noise.secure_release_note())
    return secure


def count_bits(sigma_stat: float) -> int:
    """k of the counts' grid 2^-k: the smallest with sigma_stat 2^k >= 2^32 (module docstring);
    ValueError where the scale would pass 2^48."""
    bits = 0
    while math.ldexp(sigma_stat, bits) < 2.0 ** 32:
        bits += 1
    if math.ldexp(sigma_stat, bits) > 2.0 ** 48:
        raise secure_noise.SecureNoiseUnavailable(f"noise multiplier {sigma_stat:.3g} per count is "
                                                  "outside what the secure noise handles")
    return bits


def secure_description(count_bits: int, scale_bits: int) -> str:
    return (f"discrete Gaussian on exact integer sums (counts on the grid 2^-{count_bits}; each "
            f"level's gradient sum on 2^-{clipping.GRID_FEATURE_BITS - 1 + scale_bits} of its "
            "clip norm; ChaCha20 randomness; accounted as the Gaussian plus sampler_delta_bound)")


def _train_registered(options: AmbssgdConfig, problem: Problem, aggregator, seed, ledger, progress):
    private_step = options.learning_rate is None
    config = core_config("dpsgd", options, problem, exclude=("learning_rate",), secure=True)
    if not private_step:
        config = dataclasses.replace(config, learning_rate=options.learning_rate)
    return train(config, options, problem.loss, problem.dim, aggregator, seed, ledger, progress,
                 private_step_size=private_step)



DP_AMBSSGD = Algorithm(
    "dp-ambssgd", "linear regression on 100,000+ rows of standardized data: one pass, adaptive "
                  "clipping; its error vanishes as the observation noise does (paper 003)",
    ("linear",), AmbssgdConfig, _train_registered, checkpoints=False, no_intercept=False,
    secure_noise=True, quality_check=True)
