"""Private statistics on blocks: counts, clipped means, exponential-mechanism quantiles.

Each statistic is a *stage*: ``partial_sum(block, state)`` is the exact sum over one block (an
array of the fixed ``shape``), ``apply(state, total)`` adds the noise and writes the release into
the state (a dict of public values), and ``releases()`` names its DpEvents for the ledger. Stages
run through the same Aggregator seam as training steps (in-process or as Beam CombineFns), so a
statistic computed on either runner is identical for the same seed.

``ArraySum`` is the Beam-free combiner (create / add / merge / extract) behind every stage, in the
manner of tf.Transform's analyzers; ``beam_dp.beam.combiners.CombinerFn`` adapts it to Beam.

Why not pipeline-dp's MEAN / PERCENTILE / VECTOR_SUM: its noise comes from PyDP's C++ samplers,
which cannot be seeded, so the same-seed-same-result contract between runners and the seeded
statistical tests could not hold; its PERCENTILE (a quantile tree) has no simple rank-error
guarantee; and its budget accountant is separate from this project's dp_accounting ledger. The
mechanisms here are a few lines each on top of numpy and dp_accounting.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events
from dp_accounting import gaussian_mechanism

from beam_dp import accounting, mechanisms


class ArraySum:
    """Sums arrays of a fixed shape; an empty input sums to zeros (so a step with an empty batch
    still releases a noisy zero)."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def create(self):
        return np.zeros(self.shape)

    def add(self, acc, value):
        acc += value
        return acc

    def merge(self, accs):
        accs = iter(accs)
        total = next(accs).copy()
        for acc in accs:
            total += acc
        return total

    def extract(self, acc):
        return acc


# ----------------------------------------------------------------------------- mechanisms (numpy)

def gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """Noise multiplier of the Gaussian mechanism from the analytic calibration of Balle & Wang
    (2018), as implemented in dp_accounting."""
    return float(gaussian_mechanism.get_sigma_gaussian(epsilon, delta))


def histogram(values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Counts per column of ``values`` (m, j) in the cells of per-column grids (j, G):
    cell 0 holds values <= grid[0], cell i values in (grid[i-1], grid[i]], cell G values above
    grid[-1]. The cumulative count up to cell i is #{v <= grid[i]}."""
    j, size = grid.shape
    out = np.zeros((j, size + 1))
    for c in range(j):  # one vectorized search per column, not per example
        out[c] = np.bincount(np.searchsorted(grid[c], values[:, c], side="left"), minlength=size + 1)
    return out


def exponential_mechanism_quantile(counts: np.ndarray, grid: np.ndarray, rank: float,
                                   epsilon: float, generator: np.random.Generator) -> float:
    """A grid point g_i whose cell (g_{i-1}, g_i] holds the value of rank ``rank``, chosen by the
    exponential mechanism.

    Cell i covers the ranks [c_{i-1}, c_i], with c_i = #{v <= g_i}. Its utility is minus the
    distance from ``rank`` to that interval, u_i = -max(c_{i-1} - rank, rank - c_i, 0), so any
    cell holding the target scores 0 even when values pile up in one cell. One example moves every
    c_i by at most 1 under add/remove, so u has sensitivity 1 and sampling i with probability
    proportional to exp(epsilon * u_i / 2) is epsilon-DP (Gumbel-max trick: an exact sample).

    Guarantee (the exponential mechanism's bound, G candidates): with probability >= 1 - zeta the
    returned g_i satisfies #{v <= g_i} >= rank - E and #{v <= g_{i-1}} <= rank + E with
    E = (2/epsilon) ln(G/zeta) (``quantile_rank_error_bound``).
    """
    upper = np.cumsum(counts)[:len(grid)]
    lower = np.concatenate([[0.0], upper[:-1]])
    utility = -np.maximum(np.maximum(lower - rank, rank - upper), 0.0)
    scores = epsilon * utility / 2.0 + generator.gumbel(size=len(grid))
    return float(grid[int(np.argmax(scores))])


def quantile_rank_error_bound(grid_size: int, epsilon: float, failure_probability: float) -> float:
    """The exponential mechanism's excess rank error at the given failure probability."""
    return 2.0 / epsilon * math.log(grid_size / failure_probability)


def uniform_grid(lo: np.ndarray, hi: np.ndarray, size: int) -> np.ndarray:
    """(j, size) evenly spaced grids between per-column bounds."""
    return np.linspace(np.asarray(lo, float), np.asarray(hi, float), size, axis=-1).reshape(-1, size)


def log_grid(smallest: float, largest: float, size: int) -> np.ndarray:
    """(1, size) grid for non-negative values: 0 then geometric steps from ``smallest`` to
    ``largest``, i.e. a relative resolution of (largest/smallest)^(1/(size-2))."""
    return np.concatenate([[0.0], np.geomspace(smallest, largest, size - 1)])[None, :]


# ------------------------------------------------------------------------- per-example values

@dataclasses.dataclass(frozen=True)
class Columns:
    """The feature columns, (m, d)."""

    def __call__(self, block, state) -> np.ndarray:
        return block.features


@dataclasses.dataclass(frozen=True)
class Transformed:
    """The feature columns after a per-example transform (``beam_dp.features``), (m, d)."""

    transform: Callable

    def __call__(self, block, state) -> np.ndarray:
        return self.transform(block).features


@dataclasses.dataclass(frozen=True)
class Norms:
    """The L2 norm of each feature vector, (m, 1)."""

    def __call__(self, block, state) -> np.ndarray:
        return np.sqrt(block.sq_norms)[:, None]


@dataclasses.dataclass(frozen=True)
class DistancesTo:
    """The L2 distance of each vector of ``values`` to the released point ``state[key]``, (m, 1)."""

    key: str
    values: Callable = Columns()

    def __call__(self, block, state) -> np.ndarray:
        diff = self.values(block, state) - np.asarray(state[self.key], float).reshape(-1)
        return np.sqrt(np.einsum("ij,ij->i", diff, diff))[:, None]


# ----------------------------------------------------------------------------------- stages

def _rng(stage, *more) -> np.random.Generator:
    return mechanisms.rng(stage.seed, mechanisms.STREAM_STATS, *stage.stream, *more)


@dataclasses.dataclass(frozen=True)
class CountStage:
    """Noisy count with Laplace noise of scale 1/epsilon; writes ``state['n']`` (at least 1)."""

    epsilon: float
    seed: int
    stream: tuple = (0,)
    key: str = "n"

    @property
    def shape(self):
        return (1,)

    def partial_sum(self, block, state):
        return np.array([float(len(block))])

    def apply(self, state, total):
        noisy = float(total[0]) + mechanisms.laplace_noise(_rng(self), 1.0 / self.epsilon)
        return {**state, self.key: max(1, int(round(noisy)))}

    def releases(self):
        return [("laplace_count", accounting.laplace_count_event(self.epsilon), 1,
                 {"epsilon": self.epsilon, "sensitivity": 1})]


@dataclasses.dataclass(frozen=True)
class QuantileStage:
    """Exponential-mechanism quantiles of per-example values, one per (column, quantile).

    The target rank of quantile p is p * n - outliers (n is the released ``state['n']``), clamped
    to [0, n]. ``grid(state)`` gives the (columns, G) candidate points. Writes
    ``state[key]`` of shape (columns, len(quantiles)). Each release is epsilon-DP.
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

    @property
    def shape(self):
        return (self.columns, self.grid_size + 1)

    def partial_sum(self, block, state):
        return histogram(self.values(block, state), self.grid(state))

    def apply(self, state, total):
        grid = self.grid(state)
        n = state["n"]
        out = np.empty((self.columns, len(self.quantiles)))
        for c in range(self.columns):
            for i, p in enumerate(self.quantiles):
                rank = min(max(p * n - self.outliers, 0.0), n)
                out[c, i] = exponential_mechanism_quantile(total[c], grid[c], rank, self.epsilon,
                                                           _rng(self, c, i))
        return {**state, self.key: out}

    def releases(self):
        return [("exponential_mechanism_quantile", accounting.PureDpEvent(self.epsilon),
                 self.columns * len(self.quantiles),
                 {"epsilon": self.epsilon, "sensitivity": 1, "grid_size": self.grid_size,
                  "quantiles": list(self.quantiles), "outliers": self.outliers})]


@dataclasses.dataclass(frozen=True)
class ClippedMeanStage:
    """Gaussian mean of vectors clipped to the L2 ball of ``radius`` around ``center``.

    Sum of clip(v - center, radius) has L2 sensitivity ``radius`` under add/remove; Gaussian noise
    of std noise_multiplier * radius is added once and the sum is divided by the released n.
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

    @property
    def shape(self):
        return (self.columns,)

    def _center(self, state):
        c = state[self.center] if isinstance(self.center, str) else self.center
        return np.broadcast_to(np.asarray(c, float).reshape(-1), (self.columns,))

    def _radius(self, state):
        r = state[self.radius] if isinstance(self.radius, str) else self.radius
        return float(np.asarray(r).reshape(-1)[0])

    def partial_sum(self, block, state):
        diff = self.values(block, state) - self._center(state)
        radius = self._radius(state)
        norms = np.sqrt(np.einsum("ij,ij->i", diff, diff))
        scale = np.minimum(1.0, radius / np.maximum(norms, np.finfo(float).tiny))
        return scale @ diff

    def apply(self, state, total):
        radius = self._radius(state)
        noise = mechanisms.gaussian_noise(_rng(self), total.shape, self.noise_multiplier * radius)
        return {**state, self.key: self._center(state) + (total + noise) / state["n"]}

    def releases(self):
        return [("gaussian_clipped_mean", events.GaussianDpEvent(self.noise_multiplier), 1,
                 {"noise_multiplier": self.noise_multiplier, "sensitivity": "clip radius"})]


@dataclasses.dataclass(frozen=True)
class BoxMeanStage:
    """Per-column Gaussian means of values clipped to per-column bounds [lo, hi]: columns
    ``lo_index`` and ``hi_index`` of the released quantiles ``state[bounds_key]`` (columns, k).

    Centered at the midpoints, one example changes the sum by at most ||(hi - lo)/2||_2, the
    sensitivity that the Gaussian noise is scaled by. Writes ``state[key]``.
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

    @property
    def shape(self):
        return (self.columns,)

    def _bounds(self, state):
        bounds = np.asarray(state[self.bounds_key], float)
        lo = bounds[:, self.lo_index]
        return lo, np.maximum(bounds[:, self.hi_index], lo)

    def partial_sum(self, block, state):
        lo, hi = self._bounds(state)
        return (np.clip(self.values(block, state), lo, hi) - (lo + hi) / 2).sum(axis=0)

    def apply(self, state, total):
        lo, hi = self._bounds(state)
        sensitivity = float(np.linalg.norm((hi - lo) / 2))
        noise = mechanisms.gaussian_noise(_rng(self), total.shape, self.noise_multiplier * sensitivity)
        return {**state, self.key: (lo + hi) / 2 + (total + noise) / state["n"]}

    def releases(self):
        return [("gaussian_bounded_mean", events.GaussianDpEvent(self.noise_multiplier), 1,
                 {"noise_multiplier": self.noise_multiplier,
                  "sensitivity": "L2 norm of half the per-column ranges"})]


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


def record_releases(stages, ledger) -> None:
    """Records every release the stages will make in the ledger (before they run)."""
    for stage in stages:
        for name, event, count, params in stage.releases():
            ledger.record(name, event, count, **params)


# -------------------------------------------------------------------------- composite statistics

@dataclasses.dataclass(frozen=True)
class _ZoomGrid:
    """Per-column uniform grid around the previous level's estimate, one old cell wide each side."""

    key: str
    half_width: float
    size: int

    def __call__(self, state):
        center = state[self.key][:, 0]
        return uniform_grid(center - self.half_width, center + self.half_width, self.size)


@dataclasses.dataclass(frozen=True)
class FixedGrid:
    """A public grid that does not depend on earlier releases."""

    grid: np.ndarray

    def __call__(self, state):
        return self.grid


def adaptive_mean_stages(key: str, columns: int, bound: float, epsilon: float, delta: float,
                         seed: int, stream: int, values: Callable = Columns(),
                         grid_size: int = 1024, failure_probability: float = 0.01) -> list:
    """A private mean whose error scales with the data's spread rather than the bound R on the
    feature norms (the role of Lemma 3 in paper 000):

    1. a coarse center: per-coordinate exponential-mechanism medians over [-R, R], refined once
       on a grid one coarse cell wide around the first estimate (resolution 4R / G^2);
    2. a private radius: an exponential-mechanism quantile of the distances to that center,
       aiming at all but (2/eps) ln(G/zeta) points, over a log grid from R/G^2 to 2R*sqrt(d);
    3. the mean of the vectors clipped to that ball, with Gaussian noise scaled to the radius.

    Budget: epsilon/3 for the center (split over the 2 * d medians), epsilon/3 for the radius
    (pure DP), and (epsilon/3, delta) for the Gaussian mean (analytic calibration). The ledger
    composes them (PLD), so the total is at most (epsilon, delta). Requires ``state['n']``.
    The center's budget is split over the d coordinates, so this suits small and moderate d.
    """
    eps_median = epsilon / 3 / (2 * columns)
    eps_radius = epsilon / 3
    coarse = uniform_grid(np.full(columns, -bound), np.full(columns, bound), grid_size)
    cell = 2 * bound / (grid_size - 1)
    radius_grid = log_grid(bound / grid_size ** 2, 2 * bound * math.sqrt(columns), grid_size)
    outliers = quantile_rank_error_bound(grid_size, eps_radius, failure_probability)
    return [
        QuantileStage(f"{key}_center_coarse", values, FixedGrid(coarse), columns, grid_size,
                      (0.5,), eps_median, seed, (stream, 1)),
        QuantileStage(f"{key}_center", values, _ZoomGrid(f"{key}_center_coarse", cell, grid_size),
                      columns, grid_size, (0.5,), eps_median, seed, (stream, 2)),
        QuantileStage(f"{key}_radius", DistancesTo(f"{key}_center", values), FixedGrid(radius_grid), 1,
                      grid_size, (1.0,), eps_radius, seed, (stream, 3), outliers=outliers),
        ClippedMeanStage(key, values, columns, f"{key}_center", f"{key}_radius",
                         gaussian_noise_multiplier(epsilon / 3, delta), seed, (stream, 4)),
    ]


def symmetric_log_grid(bound: float, size: int, dynamic_range: float = 1e8) -> np.ndarray:
    """(1, size) grid for signed values: +-geometric steps from bound/dynamic_range to bound,
    and 0 (size odd)."""
    half = np.geomspace(bound / dynamic_range, bound, (size - 1) // 2)
    return np.concatenate([-half[::-1], [0.0], half])[None, :]


def dataset_summary_stages(columns: int, quantiles: tuple, epsilon: float, delta: float,
                           seed: int, value_bound: float = 1e6, grid_size: int = 2047,
                           count: bool = True, accountant: str = "pld") -> list:
    """``beam-dp stats``: the private count, per-column quantiles, quantiles of the feature-vector
    norms, and per-column means clipped to the private 5th and 95th percentiles.

    Budget shares: count 5%, column quantiles 40% (split evenly over columns x quantiles), norm
    quantiles 15%, means 40% with all of delta (Gaussian, analytic calibration). The many
    quantile releases compose far better than linearly, so the shares are scaled up by one
    factor, calibrated with dp_accounting so that the composition of every release meets
    (epsilon, delta). Grids are public: a symmetric log grid over [-value_bound, value_bound]
    with relative resolution about 1.8%. Two passes over the data: count and histograms packed
    in one, the means in a second.
    """
    def build(inverse_scale: float) -> list:
        return _summary_stages(columns, quantiles, epsilon / inverse_scale, delta, seed,
                               value_bound, grid_size, count)

    def make_event(inverse_scale: float):
        return events.ComposedDpEvent([accounting.self_composed(e, c)
                                       for stage in build(inverse_scale)
                                       for _, e, c, _ in stage.releases()])
    return build(accounting.calibrate_noise_multiplier(make_event, epsilon, delta, accountant,
                                                       lower=0.02, upper=1.5))


def _summary_stages(columns, quantiles, epsilon, delta, seed, value_bound, grid_size, count):
    qs = tuple(sorted(set(quantiles) | {0.05, 0.95}))
    lo, hi = qs.index(0.05), qs.index(0.95)
    column_grid = np.repeat(symmetric_log_grid(value_bound, grid_size), columns, axis=0)
    norm_grid = log_grid(value_bound / 1e8, value_bound * math.sqrt(columns), grid_size)
    first = [QuantileStage("column_quantiles", Columns(), FixedGrid(column_grid), columns,
                           grid_size, qs, 0.40 * epsilon / (columns * len(qs)), seed, (1,)),
             QuantileStage("norm_quantiles", Norms(), FixedGrid(norm_grid), 1, grid_size,
                           tuple(sorted(set(quantiles))), 0.15 * epsilon / len(set(quantiles)), seed, (2,))]
    if count:
        first.insert(0, CountStage(0.05 * epsilon, seed, (0,)))
    return [PackedStages(tuple(first)),
            BoxMeanStage("column_means", Columns(), columns, "column_quantiles", lo, hi,
                         gaussian_noise_multiplier(0.40 * epsilon, delta), seed, (3,))]
