"""The statistics stages: ``partial_sum`` per block, ``apply`` adds the noise, ``releases`` names
the DpEvents (see ``beam_dp.stats``). Counts, quantiles, clipped / box / imputation means, second
moments, and ``PackedStages`` (several in one pass); float or secure noise."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting, clipping, mechanisms, user_level
from beam_dp.stats.primitives import (exact_exponential_mechanism, exact_quantile_utility,
                                      exponential_mechanism_quantile, histogram,
                                      quantile_rank_error_bound)


def stages_seed(seed: int) -> int:
    """What the statistics stages of a run draw from: a 128-bit key derived from the root seed
    (a PRF, ``mechanisms.stream_key``), so that a Beam job's graph, which holds the stages,
    holds nothing from which the training's noise, sampling or count could be derived."""
    return mechanisms.stream_key(seed, mechanisms.STREAM_STATS) >> 128


def _rng(stage, *more) -> np.random.Generator:
    if getattr(stage, "noise", "float") == "secure":
        return mechanisms.secure_generator(stage.seed, mechanisms.STREAM_STATS, *stage.stream, *more)
    return mechanisms.rng(stage.seed, mechanisms.STREAM_STATS, *stage.stream, *more)


# Secure means: the noise's scale in grid units lies in [2^36, 2^37] (``mean_grid``), inside the
# [2^32, 2^48] of every secure release, with room for noise multipliers from 2^-13 upwards.
_MEAN_SCALE_BITS = 36
_SAMPLER_TV = 2.0 ** -50   # the samplers' distance to their exact laws (secure_noise._SAMPLER_TV)


def mean_grid(bound: float, noise_multiplier: float, columns: int) -> tuple[float, float]:
    """(g, R): the power-of-two grid of a secure mean of rows of L2 norm at most ``bound``
    (public: a clip radius, or a released one) and their sensitivity in its units, enlarged for
    the rounding (``clipping.grid_row_bound``): g = 2^(e - 37) with 2^(e-1) < sigma bound <= 2^e,
    so that sigma R lies in [2^36, 2^37] (plus the rounding's share)."""
    exponent = clipping.grid_exponent(noise_multiplier * bound) - _MEAN_SCALE_BITS - 1
    grid = math.ldexp(1.0, exponent)
    limit = clipping.grid_row_bound(bound, grid, columns)
    if not (limit < 2.0 ** 50 and 2.0 ** 32 <= noise_multiplier * limit <= 2.0 ** 48):
        raise ValueError(f"noise multiplier {noise_multiplier:.3g} is outside what the secure "
                         "noise handles; use --noise float")
    return grid, limit


def mean_sampler_variation(columns: int) -> float:
    """The total variation of a secure mean's ``columns`` discrete Gaussian draws from the
    rounded Gaussians, at the smallest scale ``mean_grid`` allows (2^36): public before the
    radius is released."""
    return columns * (1.0 / (48.0 * 2.0 ** (2 * _MEAN_SCALE_BITS)) + _SAMPLER_TV)


def _secure_noisy_sum(stage, total, bound: float, columns: int) -> np.ndarray:
    """The exact sum ``total`` (an ExactSum in units of ``mean_grid(bound, ...)``) plus discrete
    Gaussian noise of scale sigma R, in data units. A zero bound (a released radius or range of
    0) has sensitivity 0: every row added 0, and no noise is needed."""
    if bound == 0.0:
        return np.zeros(columns)
    grid, limit = mean_grid(bound, stage.noise_multiplier, columns)
    noise = mechanisms.discrete_gaussian(_rng(stage), stage.noise_multiplier * limit, columns)
    return (total + noise).to_float() * grid


def _secure_row_sum(rows: np.ndarray, bound: float, noise_multiplier: float):
    """The exact sum of rows of L2 norm at most ``bound`` (up to the rounding of their clip) on
    ``mean_grid``'s grid."""
    columns = rows.shape[1]
    if bound == 0.0:
        return clipping.ExactSum.zeros(columns)
    grid, limit = mean_grid(bound, noise_multiplier, columns)
    return clipping.exact_row_sum(clipping.grid_rows(rows, grid, limit), limit)


SECURE_MEAN_NOISE = ("discrete Gaussian on exact integer sums (power-of-two grid at 2^-36 of the "
                     "noise; ChaCha20 randomness; accounted as the Gaussian plus the sampler's "
                     "total variation)")
SECURE_QUANTILE_NOISE = ("exact exponential mechanism (rational utilities, exact Bernoulli(exp(-x)) "
                         "coins on ChaCha20 bits)")


def zeros_for(noise: str, shape):
    """A stage's empty sum: exact integers on a grid for secure noise, floats otherwise."""
    return clipping.ExactSum.zeros(shape) if noise == "secure" else np.zeros(shape)


@dataclasses.dataclass(frozen=True)
class CountStage:
    """Noisy count with Laplace noise of scale 1/epsilon; writes ``state['n']`` (at least 1)."""

    epsilon: float
    seed: int
    stream: tuple = (0,)
    key: str = "n"
    noise: str = "float"    # "secure": discrete Laplace (pure epsilon-DP) on the exact count

    @property
    def shape(self):
        return (1,)

    def partial_sum(self, block, state):
        return np.array([float(len(block))])

    def apply(self, state, total):
        if self.noise == "secure":   # an integer below 2^53: exact in float64
            noisy = int(total[0]) + int(mechanisms.discrete_laplace(_rng(self), 1.0 / self.epsilon, ()))
            return {**state, self.key: max(1, noisy)}
        noisy = float(total[0]) + mechanisms.laplace_noise(_rng(self), 1.0 / self.epsilon)
        return {**state, self.key: max(1, int(round(noisy)))}

    def releases(self):
        if self.noise == "secure":
            # As the training count (dataset_size.release_dataset_size): eps-DP exactly.
            return [("discrete_laplace_count", accounting.PureDpEvent(self.epsilon), 1,
                     {"epsilon": self.epsilon, "sensitivity": 1, "noise": "discrete Laplace",
                      "sampler_total_variation": _SAMPLER_TV})]
        return [("laplace_count", accounting.laplace_count_event(self.epsilon), 1,
                 {"epsilon": self.epsilon, "sensitivity": 1})]


@dataclasses.dataclass(frozen=True)
class QuantileStage:
    """Exponential-mechanism quantiles of per-example values, one per (column, quantile).

    The target rank of quantile p is p * T - outliers, T the exact number of values (the total of
    the histogram, inside the mechanism: ``exponential_mechanism_quantile``), kept at least
    ``margin`` ranks from either end. So p = 1 with ``outliers`` k means "k values above" (a rank
    counted from the top), and no released count enters: ``state['n']`` is not read, and an
    over- or undershooting noisy count cannot move the target (it did, through n - outliers,
    before: with n_noisy - n > outliers every cell above the data scored the same). ``margin`` =
    ``rank_error_bound(zeta)`` keeps extreme quantiles inside the data with probability 1 - zeta
    at any n. ``grid(state)`` gives the (columns, G) candidate points. Writes ``state[key]`` of
    shape (columns, len(quantiles)). Each release is epsilon-DP (sensitivity 1).
    """

    key: str
    values: Callable
    grid: Callable
    columns: int
    grid_size: int
    quantiles: tuple
    epsilon: float
    seed: int
    stream: tuple = (0,)
    outliers: float = 0.0
    margin: float = 0.0
    noise: str = "float"    # "secure": the exponential mechanism sampled exactly
    # Sort each column's releases (the quantiles must then be ascending): independent releases
    # can cross on small n (a 5th percentile above the 95th). Post-processing, nothing spent, and
    # the rearranged estimates are never farther from the true (monotone) quantiles in any Lp
    # norm (Chernozhukov, Fernandez-Val & Galichon 2010, "Quantile and probability curves
    # without crossing"). Off by default so that existing releases keep their meaning.
    rearrange: bool = False
    # User-level privacy: each row counts 1 / its user's rows (blocks grouped by user), so one
    # user moves the histogram by 1 in all, as one row does: the utilities keep sensitivity 1.
    # Float only (the exact mechanism's utilities are integers).
    per_user: bool = False

    def __post_init__(self):
        # The utility's sensitivity is 1 only for quantiles in [0, 1] (a p outside moves the
        # target by more than one rank when a value is added).
        if not all(0.0 <= p <= 1.0 for p in self.quantiles):
            raise ValueError("quantiles must be fractions in [0, 1]")
        if self.rearrange and list(self.quantiles) != sorted(self.quantiles):
            raise ValueError("rearranged quantiles must be listed in ascending order")
        if self.per_user and self.noise == "secure":
            raise ValueError("per-user quantiles weight rows by fractions: float noise only")

    @property
    def shape(self):
        return (self.columns, self.grid_size + 1)

    def rank_error_bound(self, failure_probability: float) -> float:
        """Each release's rank error at that failure probability (public)."""
        return quantile_rank_error_bound(self.grid_size, self.epsilon, failure_probability)

    def partial_sum(self, block, state):
        weights = user_level.per_row_weights(block.users) if self.per_user else None
        return histogram(self.values(block, state), self.grid(state), weights)

    def apply(self, state, total):
        grid = self.grid(state)
        out = np.empty((self.columns, len(self.quantiles)))
        for c in range(self.columns):
            for i, p in enumerate(self.quantiles):
                if self.noise == "secure":
                    utilities = exact_quantile_utility(total[c], len(grid[c]), -self.outliers,
                                                       quantile=p, margin=self.margin)
                    chosen = exact_exponential_mechanism(_rng(self, c, i), utilities, self.epsilon)
                    out[c, i] = float(grid[c][chosen])
                    continue
                out[c, i] = exponential_mechanism_quantile(
                    total[c], grid[c], -self.outliers, self.epsilon, _rng(self, c, i),
                    quantile=p, margin=self.margin)
        if self.rearrange:
            out.sort(axis=1)
        return {**state, self.key: out}

    def releases(self):
        return [("exponential_mechanism_quantile", accounting.PureDpEvent(self.epsilon),
                 self.columns * len(self.quantiles),
                 {"epsilon": self.epsilon, "sensitivity": 1, "grid_size": self.grid_size,
                  "quantiles": list(self.quantiles), "outliers": self.outliers,
                  **({"margin": self.margin} if self.margin else {}),
                  **({"noise": SECURE_QUANTILE_NOISE, "sampler_total_variation": 0.0}
                     if self.noise == "secure" else {})})]


@dataclasses.dataclass(frozen=True)
class ClippedMeanStage:
    """Gaussian mean of vectors clipped to the L2 ball of ``radius`` around ``center``.

    Sum of clip(v - center, radius) has L2 sensitivity ``radius`` under add/remove; Gaussian noise
    of std noise_multiplier * radius is added once, the sum is divided by the released n, and
    the shift from the center is projected onto the ball (where the exact clipped mean lies).
    ``center`` and ``radius`` are numbers or the names of earlier releases in the state.
    Writes ``state[key]``.
    """

    key: str
    values: Callable
    columns: int
    center: object
    radius: object
    noise_multiplier: float
    seed: int
    stream: tuple = (0,)
    noise: str = "float"    # "secure": exact sum on a grid, discrete Gaussian (``mean_grid``)

    @property
    def shape(self):
        return (self.columns,)

    def zero_sum(self):
        return zeros_for(self.noise, self.shape)

    def _center(self, state):
        c = state[self.center] if isinstance(self.center, str) else self.center
        return np.broadcast_to(np.asarray(c, float).reshape(-1), (self.columns,))

    def _radius(self, state):
        r = state[self.radius] if isinstance(self.radius, str) else self.radius
        return float(np.asarray(r).reshape(-1)[0])

    def partial_sum(self, block, state):
        # Overflow-safe clipping (clipping.scale_rows): every row adds at most ``radius`` in norm
        # however large its values, and nothing is printed.
        diff = clipping.saturating_difference(self.values(block, state), self._center(state))
        clipped, _ = clipping.scale_rows(diff, self._radius(state), only_shrink=True)
        if self.noise == "secure":
            return _secure_row_sum(clipped, self._radius(state), self.noise_multiplier)
        return clipped.sum(axis=0)

    def apply(self, state, total):
        # The normalizer is the released count (public; at least 1). A noisy count that is too
        # small inflates (total + noise) / n, too large shrinks it towards the center; either way
        # the exact clipped mean lies in the ball of ``radius`` around ``center``, so projecting
        # onto that ball (post-processing) never moves the release farther from it and bounds
        # the damage of any count error, or of the noise at tiny n, by the radius.
        radius = self._radius(state)
        if self.noise == "secure":
            noisy = _secure_noisy_sum(self, total, radius, self.columns)
        else:
            noisy = total + mechanisms.gaussian_noise(_rng(self), total.shape,
                                                      self.noise_multiplier * radius)
        shift = noisy / max(float(state["n"]), 1.0)
        shift = clipping.scale_rows(shift[None, :], radius, only_shrink=True)[0][0]
        return {**state, self.key: self._center(state) + shift}

    def releases(self):
        if self.noise == "secure":
            return [("gaussian_clipped_mean", events.GaussianDpEvent(self.noise_multiplier), 1,
                     {"noise_multiplier": self.noise_multiplier,
                      "sensitivity": "clip radius, enlarged for the rounding to the grid "
                                     "(radius (1 + 2^-30) + sqrt(d) g / 2)",
                      "noise": SECURE_MEAN_NOISE,
                      "sampler_total_variation": mean_sampler_variation(self.columns)})]
        return [("gaussian_clipped_mean", events.GaussianDpEvent(self.noise_multiplier), 1,
                 {"noise_multiplier": self.noise_multiplier, "sensitivity": "clip radius"})]


@dataclasses.dataclass(frozen=True)
class SecondMomentStage:
    """Gaussian estimate of the second-moment matrix E[z z^T] of z = (x, 1) (the intercept's 1
    included), every z first shrunk to the L2 ball of ``radius`` (a number or an earlier
    release's name in the state). One row moves the upper triangle (diagonal included) of
    sum z z^T by at most ||z||^2 <= radius^2 in L2 norm (add/remove), so Gaussian noise of std
    noise_multiplier * radius^2 goes on each upper entry; the matrix is then made symmetric and
    divided by the released n. Writes ``state[key]``, (d + 1, d + 1).

    Secure noise (``noise="secure"``): the shrunk rows are put on a power-of-two grid g as
    integers p with ||p|| <= L = ``clipping.grid_row_bound(radius, g, d + 1)`` (certified by
    ``clipping.grid_rows``), so sum p p^T is an exact integer matrix (``clipping.exact_gram``)
    whose upper triangle moves by at most L^2 in L2 norm; discrete Gaussian noise of scale
    sigma L^2 (g chosen so that it lies in [2^34, 2^36], plus the rounding's share) goes on each
    upper entry, accounted as
    the Gaussian plus the draws' total variation (``secure_moment_variation``)."""

    key: str
    columns: int            # d
    radius: object
    noise_multiplier: float
    seed: int
    stream: tuple = (0,)
    transform: Callable | None = None   # a per-example feature map applied first
    noise: str = "float"

    @property
    def shape(self):
        return (self.columns + 1, self.columns + 1)

    def zero_sum(self):
        return zeros_for(self.noise, self.shape)

    def secure_grid(self, radius: float) -> tuple[float, float]:
        """(g, L): the grid and the rows' certified norm bound in its units (class docstring)."""
        target = math.sqrt(2.0 ** _MOMENT_SCALE_BITS / self.noise_multiplier)   # L wanted
        grid = math.ldexp(1.0, clipping.grid_exponent(radius / target))
        limit = clipping.grid_row_bound(radius, grid, self.columns + 1)
        if not (limit <= 2.0 ** 24 and 2.0 ** 32 <= self.noise_multiplier * limit ** 2 <= 2.0 ** 48):
            raise ValueError(f"noise multiplier {self.noise_multiplier:.3g} is outside what the "
                             "secure second-moment matrix handles; use --noise float")
        return grid, limit

    def _radius(self, state) -> float:
        r = state[self.radius] if isinstance(self.radius, str) else self.radius
        return float(np.asarray(r).reshape(-1)[0])

    def partial_sum(self, block, state):
        if self.transform is not None:
            block = self.transform(block)
        z = np.column_stack([np.asarray(block.features, dtype=np.float64), np.ones(len(block))])
        clipped, _ = clipping.scale_rows(z, self._radius(state), only_shrink=True)
        if self.noise == "secure":
            grid, limit = self.secure_grid(self._radius(state))
            return clipping.exact_gram(clipping.grid_rows(clipped, grid, limit), limit)
        return clipped.T @ clipped

    def apply(self, state, total):
        radius = self._radius(state)
        upper = np.triu_indices(self.columns + 1)
        noisy = np.zeros(self.shape)
        if self.noise == "secure":
            grid, limit = self.secure_grid(radius)
            draws = np.zeros(self.shape, np.int64)
            draws[upper] = mechanisms.discrete_gaussian(_rng(self), self.noise_multiplier * limit ** 2,
                                                        len(upper[0]))
            noisy[upper] = ((total + draws).to_float() * grid * grid)[upper]
        else:
            noisy[upper] = np.asarray(total)[upper] + mechanisms.gaussian_noise(
                _rng(self), len(upper[0]), self.noise_multiplier * radius ** 2)
        noisy = noisy + np.triu(noisy, 1).T
        return {**state, self.key: noisy / max(float(state["n"]), 1.0)}

    def releases(self):
        params = {"noise_multiplier": self.noise_multiplier,
                  "sensitivity": "radius^2 (the upper triangle of z z^T, z = (x, 1) clipped to "
                                 "the radius)", "noise": "float Gaussian (numpy)"}
        if self.noise == "secure":
            params.update(sensitivity="L^2 in units of g^2, L the rows' certified norm on the "
                                      "grid g (radius / g enlarged for the rounding)",
                          noise=SECURE_MOMENT_NOISE,
                          sampler_total_variation=secure_moment_variation(self.columns))
        return [("gaussian_second_moment_matrix", events.GaussianDpEvent(self.noise_multiplier), 1,
                 params)]


# The secure second-moment matrix's noise scale sigma L^2 is aimed at 2^36; the power-of-two grid
# puts it in (2^34, 2^36] (plus the rounding's share of L).
_MOMENT_SCALE_BITS = 36
SECURE_MOMENT_NOISE = ("discrete Gaussian on an exact integer Gram matrix (power-of-two grid; "
                       "ChaCha20 randomness; accounted as the Gaussian plus the sampler's total "
                       "variation)")


def secure_moment_variation(columns: int) -> float:
    """The total variation of the (d + 1)(d + 2) / 2 draws of a secure second-moment matrix
    from the rounded Gaussians, at the smallest scale its grid allows (2^34, a margin below)."""
    draws = (columns + 1) * (columns + 2) // 2
    return draws * (1.0 / (48.0 * 2.0 ** 68) + _SAMPLER_TV)


@dataclasses.dataclass(frozen=True)
class BoxMeanStage:
    """Per-column Gaussian means of values clipped to per-column bounds [lo, hi]: columns
    ``lo_index`` and ``hi_index`` of the released quantiles ``state[bounds_key]`` (columns, k).

    Centered at the midpoints, one example changes the sum by at most ||(hi - lo)/2||_2, the
    sensitivity that the Gaussian noise is scaled by. The noisy sum is divided by the released n
    and the mean clamped to [lo, hi] (where the exact clipped mean lies). Writes ``state[key]``.
    """

    key: str
    values: Callable
    columns: int
    bounds_key: str
    lo_index: int
    hi_index: int
    noise_multiplier: float
    seed: int
    stream: tuple = (0,)
    noise: str = "float"    # "secure": exact sum on a grid, discrete Gaussian (``mean_grid``)

    @property
    def shape(self):
        return (self.columns,)

    def zero_sum(self):
        return zeros_for(self.noise, self.shape)

    def _bounds(self, state):
        bounds = np.asarray(state[self.bounds_key], float)
        lo = bounds[:, self.lo_index]
        return lo, np.maximum(bounds[:, self.hi_index], lo)

    def sensitivity(self, state) -> float:
        """||(hi - lo)/2||_2 from the released bounds (public), without overflow."""
        lo, hi = self._bounds(state)
        return float(clipping.row_norms((hi / 2 - lo / 2)[None, :])[0])

    def partial_sum(self, block, state):
        lo, hi = self._bounds(state)
        # lo / 2 + hi / 2: the same midpoint without overflow at bounds near the float range.
        rows = np.clip(self.values(block, state), lo, hi) - (lo / 2 + hi / 2)
        if self.noise == "secure":   # rows of norm <= ||(hi - lo)/2|| up to rounding
            return _secure_row_sum(rows, self.sensitivity(state), self.noise_multiplier)
        return rows.sum(axis=0)

    def apply(self, state, total):
        lo, hi = self._bounds(state)
        sensitivity = self.sensitivity(state)
        if self.noise == "secure":
            noisy = _secure_noisy_sum(self, total, sensitivity, self.columns)
        else:
            noisy = total + mechanisms.gaussian_noise(_rng(self), total.shape,
                                                      self.noise_multiplier * sensitivity)
        # As in ClippedMeanStage: the exact mean of values clipped to [lo, hi] lies in [lo, hi],
        # so the release is clamped to it (post-processing), which bounds the effect of a noisy
        # count far too small (or of the noise at tiny n) by the range.
        mean = (lo / 2 + hi / 2) + noisy / max(float(state["n"]), 1.0)
        return {**state, self.key: np.clip(mean, lo, hi)}

    def releases(self):
        if self.noise == "secure":
            return [("gaussian_bounded_mean", events.GaussianDpEvent(self.noise_multiplier), 1,
                     {"noise_multiplier": self.noise_multiplier,
                      "sensitivity": "L2 norm of half the per-column ranges, enlarged for the "
                                     "rounding to the grid (x (1 + 2^-30) + sqrt(d) g / 2)",
                      "noise": SECURE_MEAN_NOISE,
                      "sampler_total_variation": mean_sampler_variation(self.columns)})]
        return [("gaussian_bounded_mean", events.GaussianDpEvent(self.noise_multiplier), 1,
                 {"noise_multiplier": self.noise_multiplier,
                  "sensitivity": "L2 norm of half the per-column ranges"})]


@dataclasses.dataclass(frozen=True)
class ImputeMeanStage:
    """Per-column means of the *present* values (a NaN is a missing cell) of ``columns``, each
    clipped to its public range [low_j, high_j] (declared, known before the data is read), for
    mean imputation. Each column's value u = (clip(x) - mid_j) / half_j lies in [-1, 1]; the
    stage sums u and counts the present cells per column, and adds Laplace noise of scale
    2k / epsilon to each of the 2k totals: under add/remove of one row the k pairs (sum, count)
    move by at most 1 + 1 each, an L1 sensitivity of 2k, so the release is epsilon-DP. The mean
    is mid_j + half_j * clip(sum / count, -1, 1): its noise, in the column's units, is
    proportional to the column's own half-range. Neither noisy total is reported (only the
    mean); the exact count of missing cells never leaves the stage. Writes ``state[key]`` (k,).
    """

    key: str
    columns: tuple
    low: tuple
    high: tuple
    epsilon: float
    seed: int
    stream: tuple = (0,)
    # User-level privacy: each row weighs 1 / its user's rows, so one user moves each (sum,
    # count) pair by at most 1 + 1, as one row does.
    per_user: bool = False

    @property
    def shape(self):
        return (2, len(self.columns))

    @property
    def laplace_scale(self) -> float:
        return 2.0 * len(self.columns) / self.epsilon

    def partial_sum(self, block, state):
        lo, hi = np.asarray(self.low), np.asarray(self.high)
        x = block.features[:, list(self.columns)]
        present = ~np.isnan(x)
        half = (hi - lo) / 2.0
        u = (np.clip(np.where(present, x, lo), lo, hi) - (lo + half)) / half
        w = (user_level.per_row_weights(block.users) if self.per_user
             else np.ones(len(x)))[:, None]
        return np.stack([(w * np.where(present, u, 0.0)).sum(axis=0), (w * present).sum(axis=0)])

    def apply(self, state, total):
        rng = _rng(self)
        noisy = total + np.array([[mechanisms.laplace_noise(rng, self.laplace_scale)
                                   for _ in range(total.shape[1])] for _ in range(2)])
        lo, hi = np.asarray(self.low), np.asarray(self.high)
        half = (hi - lo) / 2.0
        # A noisy count below 1 (few present cells): the ratio is clipped to the range anyway.
        ratio = np.clip(noisy[0] / np.maximum(noisy[1], 1.0), -1.0, 1.0)
        return {**state, self.key: lo + half + half * ratio}

    def releases(self):
        return [("laplace_imputation_mean", events.LaplaceDpEvent(1.0 / self.epsilon), 1,
                 {"epsilon": self.epsilon, "columns": len(self.columns),
                  "sensitivity": "L1 2 per column (a sum of values scaled to [-1, 1], a count)",
                  "laplace_scale": self.laplace_scale, "noise": "float Laplace (numpy)"})]


@dataclasses.dataclass(frozen=True)
class PackedStages:
    """Several stages whose partial sums do not depend on each other's releases, computed in one
    pass (one combine) and applied in order."""

    stages: tuple

    @property
    def shape(self):
        return (sum(int(np.prod(s.shape)) for s in self.stages),)

    def partial_sum(self, block, state):
        return np.concatenate([np.ravel(s.partial_sum(block, state)) for s in self.stages])

    def apply(self, state, total):
        offset = 0
        for s in self.stages:
            size = int(np.prod(s.shape))
            state = s.apply(state, total[offset:offset + size].reshape(s.shape))
            offset += size
        return state

    def releases(self):
        return [r for s in self.stages for r in s.releases()]


def _flat_stages(stages) -> list:
    out = []
    for stage in stages:
        out.extend(_flat_stages(stage.stages) if isinstance(stage, PackedStages) else [stage])
    return out


def record_releases(stages, ledger) -> None:
    """Records every release the stages will make in the ledger (before they run)."""
    for stage in stages:
        for name, event, count, params in stage.releases():
            ledger.record(name, event, count, **params)
