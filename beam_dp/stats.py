"""Private statistics on blocks: counts, clipped means, exponential-mechanism quantiles.

Each statistic is a *stage*: ``partial_sum(block, state)`` is the exact sum over one block (an
array of the fixed ``shape``), ``apply(state, total)`` adds the noise and writes the release into
the state (a dict of public values), and ``releases()`` names its DpEvents for the ledger. Stages
run through the same Aggregator seam as training steps (in-process, or as one fused Beam stage
each: ``beam_dp.beam.transforms.RunStages``), so a statistic computed on either runner is the
same for the same seed (to float rounding: sums are added in another order).

Categorical columns (``beam-dp stats --categorical-columns``): ``categorical_frequency_stages``,
the frequencies of their values or hash buckets by the projection mechanism (paper 001,
Algorithm 1: ``SparseMeanStage``), under replace-one; see "categorical frequencies" below.

Why not pipeline-dp's MEAN / PERCENTILE / VECTOR_SUM: its noise comes from PyDP's C++ samplers,
which cannot be seeded, so the same-seed-same-result contract between runners and the seeded
statistical tests could not hold; its PERCENTILE (a quantile tree) has no simple rank-error
guarantee; and its budget accountant is separate from this project's dp_accounting ledger. The
mechanisms here are a few lines each on top of numpy and dp_accounting.

Secure noise (``noise="secure"`` on a stage; ``beam-dp stats --noise secure``, DPSGD-F's
preprocessing with ``--noise secure``): the count gets discrete Laplace noise (pure DP, as the
training count); the clipped and box means are exact integer sums of the clipped rows on a public
power-of-two grid (``mean_grid``: the noise's scale in grid units in [2^36, 2^37), every rounded
row certified to norm at most the clip radius plus the rounding, ``clipping.grid_rows``) plus
discrete Gaussian noise scaled to that enlarged sensitivity; the exponential-mechanism quantiles
are sampled exactly (``exact_exponential_mechanism``: utilities as exact rationals, a uniform
candidate accepted with an exact Bernoulli(exp(-gamma)) coin, Canonne, Kamath & Steinke 2020,
Algorithms 1-2), all from ChaCha20 streams. ``noisy_gd.secure_release_note`` has the accounting.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Callable

import numpy as np
import scipy.sparse as sp
from dp_accounting import dp_event as events
from dp_accounting import gaussian_mechanism

from beam_dp import accounting, categorical, clipping, mechanisms


# ----------------------------------------------------------------------------- mechanisms (numpy)

def gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """Noise multiplier of the Gaussian mechanism from the analytic calibration of Balle & Wang
    (2018), as implemented in dp_accounting."""
    return float(gaussian_mechanism.get_sigma_gaussian(epsilon, delta))


def histogram(values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Counts per column of ``values`` (m, j) in the cells of per-column grids (j, G):
    cell 0 holds values <= grid[0], cell i values in (grid[i-1], grid[i]], cell G values above
    grid[-1]. The cumulative count up to cell i is #{v <= grid[i]}. Every value lands in exactly
    one cell whatever it is (+-inf in the end cells), except a NaN, which is in none: a missing
    cell of a column imputed privately (``categorical.IMPUTED_POLICIES``), NaN until its fill is
    released, so that the column's quantiles are those of its present values. One example moves
    at most one count per column by 1 either way, and nothing here can overflow."""
    j, size = grid.shape
    out = np.zeros((j, size + 1))
    for c in range(j):  # one vectorized search per column, not per example
        column = values[:, c]
        present = column[~np.isnan(column)]
        out[c] = np.bincount(np.searchsorted(grid[c], present, side="left"), minlength=size + 1)
    return out


def exponential_mechanism_quantile(counts: np.ndarray, grid: np.ndarray, rank: float,
                                   epsilon: float, generator: np.random.Generator,
                                   quantile: float = 0.0, margin: float = 0.0) -> float:
    """A grid point g_i whose cell (g_{i-1}, g_i] holds the value of the target rank, chosen by the
    exponential mechanism.

    ``counts`` is the histogram of the values on ``grid`` (``histogram``: G + 1 cells, the last
    one above grid[-1]), so T = counts.sum() is the exact number of values. The target rank is

        r = clamp(quantile * T + rank, min(margin, T/2), max(T - margin, T/2)),

    i.e. ``rank`` alone (``quantile`` 0) is a public rank from the bottom; ``quantile`` 1 and
    ``rank`` -k ask for "k values above g" (a rank counted from the top); ``quantile`` p and
    ``rank`` 0 the p-quantile of the values actually there. ``margin`` keeps the target at least
    ``margin`` ranks inside either end (see below). No released (noisy) dataset size is involved,
    so an error in a released count cannot move the target.

    Cell i covers the ranks [c_{i-1}, c_i], with c_i = #{v <= g_i}. Its utility is minus the
    distance from r to that interval, u_i = -max(c_{i-1} - r, r - c_i, 0), so any cell holding
    the target scores 0 even when values pile up in one cell. Sensitivity 1 under add/remove:
    adding one value raises each c_i by 0 or 1 and T by 1, and r, a clamp of quantities that each
    rise by between 0 and 1 (p <= 1, the bounds by 1/2 or 1), by between 0 and 1; so every
    c_i - r moves by at most 1 (removal alike). Sampling i with probability proportional to
    exp(epsilon * u_i / 2) is therefore epsilon-DP (Gumbel-max trick: an exact sample).

    Guarantee (the exponential mechanism's bound, G candidates): with probability >= 1 - zeta the
    returned g_i satisfies #{v <= g_i} >= r - E and #{v <= g_{i-1}} <= r + E with
    E = (2/epsilon) ln(G/zeta) (``quantile_rank_error_bound``). Every empty grid cell beyond the
    data scores at most -min(r, T - r); with ``margin`` = E(zeta) the chance of returning one of
    them is at most zeta, which is what keeps an extreme quantile at small n inside the data
    instead of anywhere on the grid (the target then sits E ranks from the end, not p T).
    """
    utility = quantile_utility(counts, len(grid), rank, quantile, margin)
    scores = epsilon * utility / 2.0 + mechanisms.gumbel_noise(generator, len(grid))
    return float(grid[int(np.argmax(scores))])


def quantile_utility(counts: np.ndarray, size: int, rank: float, quantile: float = 0.0,
                     margin: float = 0.0) -> np.ndarray:
    """The utilities u_0..u_{size-1} of ``exponential_mechanism_quantile`` (sensitivity 1)."""
    counts = np.asarray(counts, float)
    total = float(counts.sum())
    low, high = min(margin, total / 2), max(total - margin, total / 2)
    target = min(max(quantile * total + rank, low, 0.0), high, total)
    upper = np.cumsum(counts)[:size]
    lower = np.concatenate([[0.0], upper[:-1]])
    return -np.maximum(np.maximum(lower - target, target - upper), 0.0)


def exact_quantile_utility(counts: np.ndarray, size: int, rank: float, quantile: float = 0.0,
                           margin: float = 0.0) -> list:
    """``quantile_utility`` in exact rational arithmetic (Fractions of the float inputs, which
    are dyadic rationals): its sensitivity is then exactly the 1 of the proof, with no float
    rounding of the target (p T + rank) in between."""
    ints = [int(c) for c in np.asarray(counts, float)]   # integer-valued counts (< 2^53)
    total = sum(ints)
    half = Fraction(total, 2)
    low, high = min(Fraction(margin), half), max(total - Fraction(margin), half)
    target = min(max(Fraction(quantile) * total + Fraction(rank), low, 0), high, total)
    out, lower = [], 0
    for c in ints[:size]:
        upper = lower + c
        out.append(-max(lower - target, target - upper, 0))
        lower = upper
    return out


def _uniform_below(generator: np.random.Generator, bound: int) -> int:
    """A uniform integer in [0, bound), exactly: numpy's unbiased bounded integers below 2^63,
    else 64-bit words masked to the bound's bit length and rejected when too large."""
    if bound <= 2 ** 63:
        return int(generator.integers(0, bound))
    bits = (bound - 1).bit_length()
    words = -(-bits // 64)
    while True:
        value = 0
        for word in generator.integers(0, 2 ** 64, size=words, dtype=np.uint64):
            value = (value << 64) | int(word)
        value &= (1 << bits) - 1
        if value < bound:
            return value


def _bernoulli(generator: np.random.Generator, p: Fraction) -> bool:
    """True with probability p (a rational in [0, 1]), exactly."""
    return _uniform_below(generator, p.denominator) < p.numerator


def bernoulli_exp(generator: np.random.Generator, gamma: Fraction) -> bool:
    """True with probability exp(-gamma), gamma >= 0 rational, exactly (Canonne, Kamath &
    Steinke 2020, Algorithms 1 and 2): for gamma in [0, 1], count K = 1, 2, ... while
    Bernoulli(gamma / K) succeeds and return whether K is odd (P = sum_k (-gamma)^k / k! );
    above 1, one Bernoulli(exp(-1)) per whole unit (stopping at the first failure), then the
    fraction. Only rational coins, so no floating-point rounding enters the law."""
    gamma = Fraction(gamma)
    if gamma < 0:
        raise ValueError("gamma must be non-negative")
    while gamma > 1:
        if not bernoulli_exp(generator, Fraction(1)):
            return False
        gamma -= 1
    k = 1
    while _bernoulli(generator, gamma / k):
        k += 1
    return k % 2 == 1


def exact_exponential_mechanism(generator: np.random.Generator, utilities: list,
                                epsilon: float) -> int:
    """An index i drawn with probability proportional to exp(epsilon u_i / 2), exactly, for
    rational utilities (``exact_quantile_utility``): a uniform candidate, accepted with
    probability exp(-gamma_i), gamma_i = epsilon (max u - u_i) / 2 (``bernoulli_exp``), until
    one is (each round accepts with probability at least 1/G). Its running time depends on the
    utilities (a timing side channel, as the discrete Gaussian's; the README says so)."""
    # The audit's broken-build hook (mechanisms.NOISE_SCALE_FOR_TESTS) scales the Gumbel noise of
    # the float sampler; here it scales epsilon by its inverse, the same law.
    scaled = Fraction(epsilon) / Fraction(mechanisms.NOISE_SCALE_FOR_TESTS)
    top = max(utilities)
    gammas = [scaled * (top - u) / 2 for u in utilities]
    while True:
        i = _uniform_below(generator, len(gammas))
        if bernoulli_exp(generator, gammas[i]):
            return i


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
class Selected:
    """Some feature columns, then the label if ``label`` (a regression label's range is chosen
    with the columns'), (m, len(columns) + label)."""

    columns: tuple
    label: bool = False

    def __call__(self, block, state) -> np.ndarray:
        picked = block.features[:, list(self.columns)]
        if sp.issparse(picked):
            # CSR rows' numeric columns (the first ones, ``beam_dp.categorical``): a zero is
            # not stored, and is a value like any other here, so the few selected columns are
            # taken densely, (rows, len(columns)) per block.
            picked = picked.toarray()
        if self.label:
            picked = np.column_stack([picked, np.asarray(block.labels, dtype=np.float64)])
        return picked


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
        # Overflow-safe: a row of 1e200 has norm 1e200 (sqrt of the overflowed square is inf).
        return clipping.row_norms(block.features, block.sq_norms)[:, None]


@dataclasses.dataclass(frozen=True)
class DistancesTo:
    """The L2 distance of each vector of ``values`` to the released point ``state[key]``, (m, 1)."""

    key: str
    values: Callable = Columns()

    def __call__(self, block, state) -> np.ndarray:
        diff = clipping.saturating_difference(self.values(block, state),
                                              np.asarray(state[self.key], float).reshape(-1))
        return clipping.row_norms(diff)[:, None]


# ----------------------------------------------------------------------------------- stages

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
_SAMPLER_TV = 2.0 ** -50   # the samplers' distance to their exact laws (noisy_gd._SAMPLER_TV)


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
            # As the training count (noisy_gd.release_dataset_size): eps-DP exactly.
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

    def __post_init__(self):
        # The utility's sensitivity is 1 only for quantiles in [0, 1] (a p outside moves the
        # target by more than one rank when a value is added).
        if not all(0.0 <= p <= 1.0 for p in self.quantiles):
            raise ValueError("quantiles must be fractions in [0, 1]")
        if self.rearrange and list(self.quantiles) != sorted(self.quantiles):
            raise ValueError("rearranged quantiles must be listed in ascending order")

    @property
    def shape(self):
        return (self.columns, self.grid_size + 1)

    def rank_error_bound(self, failure_probability: float) -> float:
        """Each release's rank error at that failure probability (public)."""
        return quantile_rank_error_bound(self.grid_size, self.epsilon, failure_probability)

    def partial_sum(self, block, state):
        return histogram(self.values(block, state), self.grid(state))

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
        if self.noise == "secure":
            return clipping.ExactSum.zeros(self.shape)
        return np.zeros(self.shape)

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
        return clipping.ExactSum.zeros(self.shape) if self.noise == "secure" else np.zeros(self.shape)

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
        if self.noise == "secure":
            return clipping.ExactSum.zeros(self.shape)
        return np.zeros(self.shape)

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
        return np.stack([np.where(present, u, 0.0).sum(axis=0), present.sum(axis=0)])

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
                         grid_size: int = 1024, failure_probability: float = 0.01,
                         noise: str = "float") -> list:
    """A private mean whose error scales with the data's spread rather than the bound R on the
    feature norms (the role of Lemma 3 in paper 000):

    1. a coarse center: per-coordinate exponential-mechanism medians over [-R, R], refined once
       on a grid one coarse cell wide around the first estimate (resolution 4R / G^2);
    2. a private radius: an exponential-mechanism quantile of the distances to that center,
       aiming at k = (2/eps) ln(G/zeta) points above it, over a log grid from R/G^2 to
       2R*sqrt(d). The rank is counted from the top of the histogram (``QuantileStage``), so it
       does not depend on n: a noisy count that overshoots cannot push the target past the
       data (with "n - k" it did, once the overshoot exceeded k, and the radius was then drawn
       almost uniformly from the grid). With probability 1 - zeta between 0 and 2k points lie
       farther than the radius;
    3. the mean of the vectors clipped to that ball, with Gaussian noise scaled to the radius,
       divided by the released ``state['n']`` and projected onto the ball.

    Budget: epsilon/2 for the center (split over the 2 * d medians), epsilon/4 for the radius
    (pure DP), and (epsilon/4, delta) for the Gaussian mean (analytic calibration). The center
    gets the largest share because a wrong coarse median is the one failure that is not
    graceful: every grid cell on the wrong side of the data scores -n/2, so it happens with
    probability ~ G exp(-eps_median n / 4), and then the radius, the noise and the mean are all
    on the scale of R. On the paper's counterexample (note §3.2, n = 2000, DPSGD-F's
    epsilon 1/3 here) that probability is 9.5e-4 per coordinate with the former thirds and
    9.2e-7 with a half (exact, from the utilities), seen as 1 failed run in 200; the radius and
    the Gaussian lose only linearly (k grows by 4/3, the noise by ~1.3). The ledger
    composes them (PLD), so the total is at most (epsilon, delta). Only the last stage reads
    ``state['n']`` (its normalizer).
    The center's budget is split over the d coordinates, so this suits small and moderate d.
    """
    eps_median = epsilon / 2 / (2 * columns)
    eps_radius = epsilon / 4
    coarse = uniform_grid(np.full(columns, -bound), np.full(columns, bound), grid_size)
    cell = 2 * bound / (grid_size - 1)
    radius_grid = log_grid(bound / grid_size ** 2, 2 * bound * math.sqrt(columns), grid_size)
    outliers = quantile_rank_error_bound(grid_size, eps_radius, failure_probability)
    return [
        QuantileStage(f"{key}_center_coarse", values, FixedGrid(coarse), columns, grid_size,
                      (0.5,), eps_median, seed, (stream, 1), noise=noise),
        QuantileStage(f"{key}_center", values, _ZoomGrid(f"{key}_center_coarse", cell, grid_size),
                      columns, grid_size, (0.5,), eps_median, seed, (stream, 2), noise=noise),
        QuantileStage(f"{key}_radius", DistancesTo(f"{key}_center", values), FixedGrid(radius_grid), 1,
                      grid_size, (1.0,), eps_radius, seed, (stream, 3), outliers=outliers,
                      noise=noise),
        ClippedMeanStage(key, values, columns, f"{key}_center", f"{key}_radius",
                         gaussian_noise_multiplier(epsilon / 4, delta), seed, (stream, 4),
                         noise=noise),
    ]


def symmetric_log_grid(bound: float, size: int, dynamic_range: float = 1e8) -> np.ndarray:
    """(1, size) grid for signed values: +-geometric steps from bound/dynamic_range to bound,
    and 0 (size odd)."""
    half = np.geomspace(bound / dynamic_range, bound, (size - 1) // 2)
    return np.concatenate([-half[::-1], [0.0], half])[None, :]


SUMMARY_FAILURE = 0.05   # the failure probability of the error bounds ``beam-dp stats`` reports


def dataset_summary_stages(columns: int, quantiles: tuple, epsilon: float, delta: float,
                           seed: int, value_bound: float = 1e6, grid_size: int = 2047,
                           count: bool = True, accountant: str = "pld",
                           noise: str = "float") -> list:
    """``beam-dp stats``: the private count, per-column quantiles, quantiles of the feature-vector
    norms, and per-column means clipped to the private 5th and 95th percentiles.

    Budget shares: count 5%, column quantiles 50% (split evenly over columns x quantiles), norm
    quantiles 20%, means 25% with all of delta (Gaussian, analytic calibration). The many
    quantile releases compose far better than linearly, so the shares are scaled up by one
    factor, calibrated with dp_accounting so that the composition of every release meets
    (epsilon, delta). Grids are public: a symmetric log grid over [-value_bound, value_bound]
    with relative resolution about 1.8%. Two passes over the data: count and histograms packed
    in one, the means in a second.

    Useful at small n: every quantile's target is kept at least its 95% rank error E from either
    end of the data (``QuantileStage.margin``), so where the budget cannot resolve the 5th
    percentile (E > 0.05 n: at epsilon 1, d = 3, n = 2,000, E is ~300 rows) the release is about
    the E/n-th quantile, inside the data, rather than a point anywhere on the grid; ``summary``
    reports each release's error bound and warns where that happened. (The shares were 40% / 15%
    / 40% for column quantiles / norms / means: at such n the means' noise, ~0.005 of the range,
    was far below the quantiles' error that their clipping bounds inherit.)
    """
    def build(inverse_scale: float) -> list:
        return _summary_stages(columns, quantiles, epsilon / inverse_scale, delta, seed,
                               value_bound, grid_size, count, noise)

    def make_event(inverse_scale: float):
        return events.ComposedDpEvent([accounting.self_composed(e, c)
                                       for stage in build(inverse_scale)
                                       for _, e, c, _ in stage.releases()])
    return build(accounting.calibrate_noise_multiplier(make_event, epsilon, delta, accountant,
                                                       lower=0.02, upper=1.5))


def _summary_stages(columns, quantiles, epsilon, delta, seed, value_bound, grid_size, count,
                    noise="float"):
    qs = tuple(sorted(set(quantiles) | {0.05, 0.95}))
    lo, hi = qs.index(0.05), qs.index(0.95)
    column_grid = np.repeat(symmetric_log_grid(value_bound, grid_size), columns, axis=0)
    norm_grid = log_grid(value_bound / 1e8, value_bound * math.sqrt(columns), grid_size)
    norm_qs = tuple(sorted(set(quantiles)))
    eps_column = 0.50 * epsilon / (columns * len(qs))
    eps_norm = 0.20 * epsilon / len(norm_qs)
    # margin: every target at least the 95% rank error from either end of the data, so that an
    # extreme quantile the budget cannot resolve at this n lands inside the data (near rank E
    # from that end) instead of anywhere on the grid; ``summary`` warns where that happens.
    first = [QuantileStage("column_quantiles", Columns(), FixedGrid(column_grid), columns,
                           grid_size, qs, eps_column, seed, (1,),
                           margin=quantile_rank_error_bound(grid_size, eps_column, SUMMARY_FAILURE),
                           noise=noise, rearrange=True),
             QuantileStage("norm_quantiles", Norms(), FixedGrid(norm_grid), 1, grid_size,
                           norm_qs, eps_norm, seed, (2,),
                           margin=quantile_rank_error_bound(grid_size, eps_norm, SUMMARY_FAILURE),
                           noise=noise, rearrange=True)]
    if count:
        first.insert(0, CountStage(0.05 * epsilon, seed, (0,), noise=noise))
    return [PackedStages(tuple(first)),
            BoxMeanStage("column_means", Columns(), columns, "column_quantiles", lo, hi,
                         gaussian_noise_multiplier(0.25 * epsilon, delta), seed, (3,),
                         noise=noise)]


def _flat_stages(stages) -> list:
    out = []
    for stage in stages:
        out.extend(_flat_stages(stage.stages) if isinstance(stage, PackedStages) else [stage])
    return out


def summary(state: dict, stages, feature_names, count_source: str,
            failure_probability: float = SUMMARY_FAILURE) -> dict:
    """The ``beam-dp stats`` report (everything but the privacy report) from the released
    ``state`` of ``dataset_summary_stages``'s ``stages``: every released statistic with its error
    bound, and warnings (no data values in them) where a bound makes a statistic easy to misread.

    * count: the Laplace scale and the 95% error bound b ln(20) (a public function of the budget);
    * quantiles: each release's rank error bound E at ``failure_probability`` (exponential
      mechanism, ``quantile_rank_error_bound``). A warning names the quantiles with
      E > min(p, 1 - p) n (n the released count): their target was moved E ranks inside the data
      (``QuantileStage.margin``), so they are about the E/n-th quantile from that end, not p;
    * means: the standard error of the Gaussian noise, sigma * ||(hi - lo)/2||_2 / n (public: the
      noise multiplier, the released clipping bounds and the released count), and the 95%
      interval mean +- 1.96 se cut to [lo, hi] (the noisy mean itself projected onto [lo, hi];
      the quantiles are sorted per column, ``QuantileStage.rearrange``, so lo <= hi). The
      interval covers the noise only: the clipping
      to [lo, hi] biases a mean when values lie outside, and a count error scales (mean - mid).
    """
    by_key = {getattr(s, "key", None): s for s in _flat_stages(stages)}
    n = float(state["n"])
    z = 1.959963984540054                     # two-sided 95% normal quantile
    warnings = []
    out = {"count": state["n"], "count_source": count_source}
    count_stage = next((s for s in by_key.values() if isinstance(s, CountStage)), None)
    if count_stage is not None:
        scale = 1.0 / count_stage.epsilon
        out["count_laplace_scale"] = scale
        out["count_error_95"] = scale * math.log(1 / 0.05)
        if out["count_error_95"] > n / 2:
            warnings.append("count: its 95% error bound exceeds half the released count; the "
                            "count and every statistic divided by it are mostly noise.")

    column_q, norm_q = by_key["column_quantiles"], by_key["norm_quantiles"]
    means = by_key["column_means"]
    rank_errors = {}
    for label, stage in (("columns", column_q), ("norms", norm_q)):
        e = stage.rank_error_bound(failure_probability)
        rank_errors[f"exponential_mechanism_quantile ({label})"] = e
        unresolved = [p for p in stage.quantiles if e > min(p, 1 - p) * n]
        if unresolved:
            what = "column" if label == "columns" else "feature-norm"
            warnings.append(
                f"{what} quantiles {', '.join(f'{p:g}' for p in unresolved)}: the "
                f"{1 - failure_probability:.0%} rank error ({e:.0f} rows) exceeds min(p, 1-p) x n; "
                f"each was aimed {e:.0f} rows inside the data instead, so it is not the requested "
                "quantile. Use more rows, a larger --epsilon, fewer --quantiles or fewer columns.")

    lo, hi = means._bounds(state)
    se = means.noise_multiplier * means.sensitivity(state) / max(n, 1.0)
    columns = {}
    for j, name in enumerate(feature_names):
        # A mean of values clipped to [lo, hi] lies in [lo, hi]: the noisy one is projected
        # there (post-processing, never farther from it), so its interval is never crossed.
        mean = min(max(float(state["column_means"][j]), float(lo[j])), float(hi[j]))
        columns[name] = {
            "mean": mean,
            "mean_standard_error": se,
            "mean_interval_95": [max(mean - z * se, float(lo[j])), min(mean + z * se, float(hi[j]))],
            "mean_clipped_to": [float(lo[j]), float(hi[j])],
            "quantiles": {str(q): float(state["column_quantiles"][j, i])
                          for i, q in enumerate(column_q.quantiles)},
        }
    widths = (hi - lo)[hi > lo]
    if widths.size and z * se > float(np.min(widths)) / 2:
        warnings.append("column means: the 95% noise interval is wider than the clipping range of "
                        "some columns; those means are mostly noise.")
    out.update({
        "columns": columns,
        "feature_norm_quantiles": {str(q): float(state["norm_quantiles"][0, i])
                                   for i, q in enumerate(norm_q.quantiles)},
        "quantile_rank_error_95": rank_errors,
        "warnings": warnings,
        "notes": ("Quantiles are grid points of a symmetric log grid over +-value_bound (relative "
                  "resolution about 1.8%), chosen by the exponential mechanism: with probability "
                  "0.95 each one's rank is within quantile_rank_error_95 rows of its target, p n, "
                  "or that many rows inside the data where p n is closer to an end (see warnings). "
                  "Means are of values clipped to mean_clipped_to (the released 0.05 and 0.95 "
                  "quantiles); mean_standard_error and mean_interval_95 cover the Gaussian noise "
                  "only, not the clipping bias. count_error_95 bounds the count's Laplace noise "
                  "with probability 0.95."),
    })
    return out


# ----------------------------------------------------------------- sparse mean (paper 001, Alg. 1)
#
# The projection mechanism for the mean of sparse vectors (Ghazi, Guzman, Kamath, Kumar &
# Manurangsi 2024, Algorithm 1; the note /work/shared/papers/001, §1A): noise on the mean, then the
# Euclidean projection onto the l1 ball of radius L sqrt(s), which holds every s-sparse vector of
# l2 norm <= L. Replace-one neighbours (the paper's), n public. The rows stay sparse (scipy CSR):
# a block's contribution is one sparse sum, O(nnz + d); only the d-vector of the total is dense.
#
# * "gaussian": rows clipped to l2 norm L, so one replacement moves the mean by <= 2L / n in l2;
#   the Gaussian noise's multiplier is calibrated by dp_accounting (a GaussianDpEvent under
#   replace-one, unit L / n). Its privacy does not depend on s: s only sets the projection's
#   radius, a post-processing (a wrong s costs accuracy, never privacy).
# * "laplace": rows clipped to l1 norm L sqrt(s) (which the privacy needs: enforced, not assumed),
#   so a replacement moves the mean by <= 2 L sqrt(s) / n in l1; Laplace noise of scale that over
#   epsilon per coordinate: pure epsilon-DP (a PureDpEvent).
#
# Lemma 3.1 (almost surely): ||release - mean||_2^2 <= 2 L sqrt(s) ||noise||_inf, since the mean
# lies in the ball (the projection's obtuse angle with y = mean, then Hoelder); so the error grows
# like (s ln d)^(1/4) / sqrt(n eps) where the dense Gaussian's grows like sqrt(d) / (n eps).

SPARSE_MEAN_VARIANTS = ("gaussian", "laplace")


def clip_sparse_rows(rows, norm_order: float, bound: float):
    """The CSR matrix ``rows`` with each row scaled by min(1, bound / ||row||) in l1 or l2, sparse
    throughout (the scale is per stored entry's row). Overflow-safe: the norms come from each
    row's entries divided by its largest |entry|. Returns a new CSR matrix."""
    import scipy.sparse as sp

    rows = sp.csr_matrix(rows, dtype=np.float64, copy=True)
    if rows.nnz == 0:
        return rows
    lengths = np.diff(rows.indptr)
    owner = np.repeat(np.arange(rows.shape[0]), lengths)
    magnitude = np.abs(rows.data)
    largest = np.zeros(rows.shape[0])
    np.maximum.at(largest, owner, magnitude)
    safe = np.where(largest > 0, largest, 1.0)
    scaled = magnitude / safe[owner]
    if norm_order == 1:
        norms = safe * np.bincount(owner, scaled, minlength=rows.shape[0])
    else:
        norms = safe * np.sqrt(np.bincount(owner, scaled * scaled, minlength=rows.shape[0]))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        factor = np.where(norms > bound, bound / np.where(norms > 0, norms, 1.0), 1.0)
    # CLIP_MARGIN: the product of a row with its factor rounds; shrink a hair more so that every
    # clipped row's norm is <= bound as computed in floats.
    factor = np.where(norms > bound, factor * (1.0 - 2.0 ** -40), factor)
    rows.data = rows.data * factor[owner]
    return rows


def sparse_mean_bound(variant: str, lipschitz: float, sparsity: int) -> tuple[float, float]:
    """(the clip's norm order, its bound) for a variant: l2 <= L (gaussian), l1 <= L sqrt(s)
    (laplace)."""
    if variant == "gaussian":
        return 2.0, float(lipschitz)
    if variant == "laplace":
        return 1.0, float(lipschitz) * math.sqrt(sparsity)
    raise ValueError(f"variant must be one of {', '.join(SPARSE_MEAN_VARIANTS)}")


def sparse_clipped_sum(rows, variant: str, lipschitz: float, sparsity: int) -> np.ndarray:
    """The block kernel: the dense sum over the rows of a CSR block, each clipped as the variant
    needs. O(nnz + d)."""
    order, bound = sparse_mean_bound(variant, lipschitz, sparsity)
    clipped = clip_sparse_rows(rows, order, bound)
    return np.asarray(clipped.sum(axis=0), dtype=np.float64).ravel()


def sparse_mean_noise_scale(variant: str, n: int, lipschitz: float, sparsity: int,
                            epsilon: float, delta: float, accountant: str = "pld"):
    """(the noise's scale per coordinate, its DpEvent): gaussian, sigma = multiplier * L / n with
    the multiplier calibrated under replace-one; laplace, b = 2 L sqrt(s) / (n eps)."""
    if variant == "gaussian":
        multiplier = accounting.calibrate_noise_multiplier(
            lambda m: events.GaussianDpEvent(m), epsilon, delta, accountant,
            accounting.REPLACE_ONE, guess=2.0 * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon,
            slope=-1.0)
        return multiplier * lipschitz / n, events.GaussianDpEvent(multiplier)
    _, bound = sparse_mean_bound(variant, lipschitz, sparsity)
    return 2.0 * bound / (n * epsilon), accounting.PureDpEvent(epsilon)


def sparse_mean_release(total: np.ndarray, n: int, variant: str, lipschitz: float, sparsity: int,
                        scale: float, generator: np.random.Generator,
                        project: bool = True) -> tuple[np.ndarray, float]:
    """Algorithm 1 on the driver: (the release, ||noise||_inf). ``total`` is the clipped sum
    (``sparse_clipped_sum`` over the blocks), ``n`` the public size, ``scale`` the noise's
    (``sparse_mean_noise_scale``). ``project`` False: the dense mechanism (noise, no projection),
    the baseline the projection is measured against. ||noise||_inf is for Lemma 3.1's check; it
    must not leave the job."""
    from beam_dp import geometry

    d = total.shape[0]
    if variant == "gaussian":
        noise = mechanisms.gaussian_noise(generator, d, scale)
    elif variant == "laplace":
        noise = generator.laplace(0.0, scale * mechanisms.NOISE_SCALE_FOR_TESTS, size=d)
    else:
        raise ValueError(f"variant must be one of {', '.join(SPARSE_MEAN_VARIANTS)}")
    noisy = total / n + noise
    if project:
        noisy = geometry.project_l1_ball(noisy, lipschitz * math.sqrt(sparsity))
    return noisy, float(np.max(np.abs(noise)))


# ----------------------------------------------------- categorical column counts (sparse blocks)

@dataclasses.dataclass(frozen=True)
class ColumnCountStage:
    """Gaussian counts of the rows having a nonzero in each of the columns [first, dim) of CSR
    blocks (the categorical columns of ``beam_dp.categorical``): a row counts at most once per
    column and is in at most ``per_row`` of them (one per categorical column), so the counts'
    l2 sensitivity under add/remove is sqrt(per_row); Gaussian noise of std noise_multiplier
    sqrt(per_row) per column. Writes ``state[key]`` (dim - first,). O(nnz) per block."""

    key: str
    first: int
    dim: int
    per_row: int
    noise_multiplier: float
    seed: int
    stream: tuple = (0,)

    @property
    def shape(self):
        return (self.dim - self.first,)

    def partial_sum(self, block, state):
        x = block.features
        # One stored entry per (row, column) (the encoder sums duplicate entries), and the
        # categorical entries are >= 1: the entry's presence is the row's membership.
        columns = x.indices[x.indices >= self.first] - self.first
        return np.bincount(columns, minlength=self.dim - self.first).astype(np.float64)

    def apply(self, state, total):
        noise = mechanisms.gaussian_noise(_rng(self), total.shape,
                                          self.noise_multiplier * math.sqrt(self.per_row))
        return {**state, self.key: total + noise}

    def releases(self):
        return [("gaussian_column_counts", events.GaussianDpEvent(self.noise_multiplier), 1,
                 {"noise_multiplier": self.noise_multiplier,
                  "sensitivity": f"sqrt({self.per_row}) (one count per categorical column)",
                  "columns": self.dim - self.first})]


# -------------------------------------------- categorical frequencies (Algorithm 1 as a stage)
#
# ``beam-dp stats --categorical-columns``: the private mean of the one-hot rows, i.e. each
# categorical value's (or hash bucket's) frequency, by the projection mechanism above. Every
# encoded row has exactly one 1 per categorical column (each column in its own block of ids:
# ``ColumnBlockHashing`` for hashing, a vocabulary's blocks already are), so s = k, the number of
# categorical columns, and L = sqrt(k) are public facts of the request: no data-dependent clip.
# The rows are still clipped inside the stage (l2 <= L, or l1 <= L sqrt(s) for Laplace), because
# the guarantee lives in the mechanism, not in what the encoder is believed to produce.

SPARSE_COUNT_SHARE = 0.05   # of epsilon, for the private count when --num-examples is not given
SPARSE_FAILURE = 0.05       # the failure probability of the error bound the report gives


@dataclasses.dataclass(frozen=True)
class ColumnBlockHashing(categorical.Encoding):
    """Feature hashing with each categorical column in its own ``hash_buckets`` ids (column j's
    bucket b is id j B + b; the bucket b is the one ``train --hash-buckets B`` gives that value).
    Training shares the B buckets between columns; frequencies are asked per column, and separate
    blocks keep every row's k ones apart (no collision makes a 2), so each row is exactly
    k-sparse and each column's frequencies sum to 1."""

    def __post_init__(self):
        super().__post_init__()
        if self.hash_buckets is None:
            raise categorical.EncodingError("ColumnBlockHashing needs --hash-buckets")

    @property
    def dim(self) -> int:
        return len(self.numeric) + len(self.categorical) * self.hash_buckets

    def column_ids(self, name: str, values) -> np.ndarray:
        return super().column_ids(name, values) + self.categorical.index(name) * self.hash_buckets


def frequency_encoding(columns, hash_buckets: int | None = None, hash_seed: int = 0,
                       vocabulary: str | None = None) -> categorical.Encoding:
    """The encoding of ``beam-dp stats --categorical-columns``: the categorical columns only (no
    numeric ones), hashed per column (``ColumnBlockHashing``) or through a vocabulary."""
    encoding = categorical.make_encoding((), columns, hash_buckets, hash_seed, vocabulary)
    if encoding is None:
        raise categorical.EncodingError("give --categorical-columns")
    if encoding.hash_buckets is not None:
        encoding = ColumnBlockHashing((), encoding.categorical, hash_buckets=encoding.hash_buckets,
                                      hash_seed=encoding.hash_seed)
    return encoding


@dataclasses.dataclass(frozen=True)
class ReplaceOneCountStage(CountStage):
    """The Laplace count of a replace-one release. Replacing a row leaves the count unchanged, so
    this charges nothing in truth; dp_accounting has no Laplace event under replace-one, and the
    ledger records it as what it is under add/remove, an epsilon-DP release (an upper bound)."""

    def releases(self):
        return [("laplace_count", accounting.PureDpEvent(self.epsilon), 1,
                 {"epsilon": self.epsilon, "sensitivity": "1 under add/remove; 0 under replace-one "
                  "(neighbours have the same n), so this charge is an upper bound"})]


@dataclasses.dataclass(frozen=True)
class SparseMeanStage:
    """Algorithm 1 (the projection mechanism) on the columns [first, dim) of CSR blocks: the sum
    of the rows clipped as ``variant`` needs (``sparse_clipped_sum``: O(nnz + d) per block, never
    a dense row), noise on the sum, division by the public ``state['n']`` (a declared size or a
    released count: post-processing), then the Euclidean projection onto the l1 ball of radius
    L sqrt(s). Writes ``state[key]`` (d,) and ``state[key + '_noise_scale']`` (the noise's scale
    per coordinate of the mean, public).

    ``noise_parameter``: the Gaussian's noise multiplier m (std m L on the sum: a replacement
    moves the sum by at most 2L in l2, the unit dp_accounting's replace-one Gaussian takes), or
    the Laplace variant's epsilon (scale 2 L sqrt(s) / epsilon on the sum: a replacement moves it
    by at most 2 L sqrt(s) in l1, once the rows are clipped to l1 <= L sqrt(s))."""

    key: str
    first: int
    dim: int
    variant: str
    lipschitz: float
    sparsity: int
    noise_parameter: float
    seed: int
    stream: tuple = (1,)

    def __post_init__(self):
        sparse_mean_bound(self.variant, self.lipschitz, self.sparsity)   # validates the variant
        if not (self.noise_parameter > 0 and math.isfinite(self.noise_parameter)):
            raise ValueError("the noise parameter must be a positive number")

    @property
    def shape(self):
        return (self.dim - self.first,)

    @property
    def radius(self) -> float:
        """The l1 ball's radius L sqrt(s): it holds every s-sparse row of l2 norm <= L."""
        return self.lipschitz * math.sqrt(self.sparsity)

    def sum_noise_scale(self) -> float:
        if self.variant == "gaussian":
            return self.noise_parameter * self.lipschitz
        return 2.0 * self.radius / self.noise_parameter

    def partial_sum(self, block, state):
        rows = block.features
        if self.first or rows.shape[1] != self.dim:
            rows = rows[:, self.first:self.dim]   # CSR column slice: O(nnz)
        return sparse_clipped_sum(rows, self.variant, self.lipschitz, self.sparsity)

    def apply(self, state, total):
        n = max(float(state["n"]), 1.0)
        scale = self.sum_noise_scale() / n
        # ||noise||_inf (the second value) stays here: only Lemma 3.1's tests look at it.
        release, _ = sparse_mean_release(total, n, self.variant, self.lipschitz, self.sparsity,
                                         scale, _rng(self))
        return {**state, self.key: release, f"{self.key}_noise_scale": scale}

    def error_bound(self, noise_scale: float, failure_probability: float = SPARSE_FAILURE) -> float:
        """With probability >= 1 - beta, the l2 distance of the release to the exact mean (n
        public) is at most this: the smaller of Lemma 3.1's sqrt(2 L sqrt(s) t), t a (1 - beta)
        bound on ||noise||_inf (the exact mean lies in the ball), and ||noise||_2 (the projection
        onto a convex set holding the mean moves nothing farther from it), the dense mechanism's
        error. Gaussian (each at beta / 2): t = sigma sqrt(2 ln(4d/beta)), ||noise||_2 <=
        sigma (sqrt(d) + sqrt(2 ln(2/beta))) (Lipschitz concentration); Laplace: t = b ln(d/beta)
        and ||noise||_2 <= sqrt(d) t on the same event. Public: the noise scale, d, s and L."""
        d = self.dim - self.first
        beta = failure_probability
        if self.variant == "gaussian":
            tail = noise_scale * math.sqrt(2.0 * math.log(4.0 * d / beta))
            dense = noise_scale * (math.sqrt(d) + math.sqrt(2.0 * math.log(2.0 / beta)))
        else:
            tail = noise_scale * math.log(d / beta)
            dense = math.sqrt(d) * tail
        return min(math.sqrt(2.0 * self.radius * tail), dense)

    def releases(self):
        if self.variant == "gaussian":
            return [("projection_mechanism_gaussian_mean",
                     events.GaussianDpEvent(self.noise_parameter), 1,
                     {"noise_multiplier": self.noise_parameter, "columns": self.dim - self.first,
                      "sparsity": self.sparsity, "l2_clip": self.lipschitz,
                      "l1_ball_radius": self.radius,
                      "sensitivity": "2 L in l2 on the sum of rows clipped to l2 <= L "
                                     "(replace-one); s sets only the projection's radius"})]
        return [("projection_mechanism_laplace_mean", accounting.PureDpEvent(self.noise_parameter), 1,
                 {"epsilon": self.noise_parameter, "columns": self.dim - self.first,
                  "sparsity": self.sparsity, "l1_clip": self.radius, "l1_ball_radius": self.radius,
                  "sensitivity": "2 L sqrt(s) in l1 on the sum of rows clipped to l1 <= L sqrt(s) "
                                 "(replace-one; the clip is enforced)"})]


def categorical_frequency_stages(encoding, variant: str, epsilon: float, delta: float, seed: int,
                                 count: bool = True, accountant: str = "pld") -> list:
    """The stages of ``beam-dp stats --categorical-columns`` (one pass over the data): a private
    count when n is not declared (SPARSE_COUNT_SHARE of epsilon; ``ReplaceOneCountStage``), then
    the projection mechanism on the encoded rows, s = k categorical columns, L = sqrt(k).
    Gaussian: the multiplier is calibrated with dp_accounting (replace-one) so that the count and
    the mean together meet (epsilon, delta). Laplace: the mean gets the rest of epsilon (less, if
    the accountant's epsilon of the two needs it), and the two pure releases compose to pure
    epsilon-DP (delta unused)."""
    if variant not in SPARSE_MEAN_VARIANTS:
        raise ValueError(f"--sparse-mechanism must be one of {', '.join(SPARSE_MEAN_VARIANTS)}")
    if not (epsilon > 0 and math.isfinite(epsilon) and 0 < delta < 1):
        raise ValueError("--epsilon must be positive and --delta in (0, 1)")
    k = len(encoding.categorical)
    first = len(encoding.numeric)
    count_epsilon = SPARSE_COUNT_SHARE * epsilon if count else 0.0
    head = [ReplaceOneCountStage(count_epsilon, seed, (0,))] if count else []
    count_events = [r[1] for s in head for r in s.releases()]
    if variant == "gaussian":
        def make(multiplier: float):
            mean = events.GaussianDpEvent(multiplier)
            return events.ComposedDpEvent(count_events + [mean]) if count_events else mean
        parameter = accounting.calibrate_noise_multiplier(
            make, epsilon, delta, accountant, accounting.REPLACE_ONE,
            guess=2.0 * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon, slope=-1.0)
    else:
        # Pure DP: count_epsilon + the mean's epsilon <= epsilon holds by basic composition; the
        # accountant's own epsilon must meet the target too (RDP's conversion of pure events is
        # looser than their sum), so the mean's share is lowered by the smallest factor >= 1
        # that makes it do so (1 with PLD).
        rest = epsilon - count_epsilon

        def make(inverse: float):
            mean = accounting.PureDpEvent(rest / inverse)
            return events.ComposedDpEvent(count_events + [mean]) if count_events else mean
        parameter = rest / accounting.calibrate_noise_multiplier(
            make, epsilon, delta, accountant, accounting.REPLACE_ONE, lower=1.0, guess=1.0)
    mean = SparseMeanStage("categorical_frequencies", first, encoding.dim, variant,
                           math.sqrt(k), k, parameter, seed, (1,))
    # One pass: the count's sum and the mean's are independent; the count is applied first, so
    # the mean divides by it.
    return [PackedStages(tuple(head + [mean]))] if head else [mean]


def frequency_layout(encoding) -> list:
    """(column, first id, width, value names or None for hash buckets) of each categorical
    column, in the encoding's ids (a vocabulary's column j: its values, then "other")."""
    first = len(encoding.numeric)
    if encoding.hash_buckets is not None:
        return [(name, first + j * encoding.hash_buckets, encoding.hash_buckets, None)
                for j, name in enumerate(encoding.categorical)]
    out, start = [], first
    for name, values in encoding.vocabulary:
        out.append((name, start, len(values) + 1, values))
        start += len(values) + 1
    return out


def categorical_summary(state: dict, stages, encoding, count_source: str) -> dict:
    """The stats report of the categorical frequencies (everything but the privacy report).
    Vocabulary columns: every listed value by name and "other" (public names). Hashed columns:
    only bucket ids (never a raw value), and only the buckets the release holds nonzero (the
    projection onto the l1 ball soft-thresholds, so at large d most are exactly 0: listing them
    would be a JSON of d numbers); a bucket not listed was released as 0."""
    stage = next(s for s in _flat_stages(stages) if isinstance(s, SparseMeanStage))
    count_stage = next((s for s in _flat_stages(stages) if isinstance(s, CountStage)), None)
    release = np.asarray(state[stage.key], float)
    scale = float(state[f"{stage.key}_noise_scale"])
    mechanism = (f"projection mechanism (paper 001, Algorithm 1), {stage.variant} noise, then the "
                 f"Euclidean projection onto the l1 ball of radius {stage.radius:g}")
    noise = ("gaussian_std" if stage.variant == "gaussian" else "laplace_scale")
    columns = {}
    for name, start, width, values in frequency_layout(encoding):
        part = release[start - stage.first:start - stage.first + width]
        entry = {"mechanism": mechanism, "noise_scale": scale, "noise": noise}
        if values is None:
            kept = np.flatnonzero(part)
            entry["buckets"] = {str(int(b)): float(part[b]) for b in kept}
            entry["buckets_total"] = width
            entry["buckets_listed"] = int(kept.size)
        else:
            entry["values"] = {v: float(part[i]) for i, v in enumerate(values)}
            entry["other"] = float(part[-1])
        entry["sum"] = float(part.sum())
        columns[name] = entry
    bound = stage.error_bound(scale)
    warnings = []
    if bound >= 1.0:
        warnings.append("categorical frequencies: the 95% l2 error bound is at least 1, the whole "
                        "of one column's frequencies; they are mostly noise. Use more rows or a "
                        "larger --epsilon.")
    out = {"count": state["n"], "count_source": count_source}
    if count_stage is not None:
        out["count_laplace_scale"] = 1.0 / count_stage.epsilon
        out["count_error_95"] = math.log(1 / 0.05) / count_stage.epsilon
    out.update({
        "categorical_frequencies": columns,
        "sparse_mechanism": {
            "variant": stage.variant, "columns": stage.dim - stage.first,
            "sparsity": stage.sparsity, "lipschitz": stage.lipschitz,
            "l1_ball_radius": stage.radius, "noise_scale": scale, "noise": noise,
            "l2_error_bound_95": bound,
            "encoding": ("hashing, each column in its own buckets" if encoding.hash_buckets
                         is not None else "vocabulary"),
        },
        "warnings": warnings,
        "notes": SPARSE_NOTES[stage.variant],
    })
    return out


SPARSE_NOTES = {
    "gaussian": (
        "Frequencies are the mean of the one-hot rows (one 1 per categorical column: s = k "
        "columns, L = sqrt(k)), released by the projection mechanism: Gaussian noise on the mean, "
        "then the Euclidean projection onto the l1 ball of radius L sqrt(s) = k, which holds the "
        "exact mean. The Gaussian variant's privacy does not depend on s: the rows are clipped to "
        "l2 norm L and the noise calibrated (dp_accounting, replace-one) to that alone; s only sets "
        "the projection's radius, a post-processing. With probability 0.95 the l2 distance to the "
        "exact frequencies (n public) is at most l2_error_bound_95 (Lemma 3.1); a released count "
        "scales it by n / count. Hashed columns list only the nonzero buckets; the projection "
        "releases the others as exactly 0."),
    "laplace": (
        "Frequencies are the mean of the one-hot rows (one 1 per categorical column: s = k "
        "columns, L = sqrt(k)), released by the projection mechanism: Laplace noise on the mean, "
        "then the Euclidean projection onto the l1 ball of radius L sqrt(s) = k. The Laplace "
        "variant's privacy needs every row's l1 norm to be at most L sqrt(s): that clip is "
        "enforced on every row inside the mechanism (not assumed of the encoder), and the noise "
        "is scaled to it (pure epsilon-DP). With probability 0.95 the l2 distance to the exact "
        "frequencies (n public) is at most l2_error_bound_95 (Lemma 3.1); a released count "
        "scales it by n / count. Hashed columns list only the nonzero buckets; the projection "
        "releases the others as exactly 0."),
}

SPARSE_PRIVACY = {
    "gaussian": ("Gaussian variant: its privacy does not depend on s (the sparsity): rows are "
                 "clipped to l2 norm L and the noise is calibrated to that; s only sets the l1 "
                 "ball the noisy mean is projected onto (post-processing)."),
    "laplace": ("Laplace variant: its privacy needs every row's l1 norm to be at most L sqrt(s); "
                "that l1 clip is enforced on every row inside the mechanism, and the Laplace "
                "noise is scaled to 2 L sqrt(s) / n (pure epsilon-DP)."),
}
