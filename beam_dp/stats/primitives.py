"""The mechanisms under the statistics, on numpy arrays: exponential-mechanism quantiles on a
public grid (float, and exact with rational utilities and Bernoulli(exp(-gamma)) coins, Canonne,
Kamath & Steinke 2020), their rank-error bound, the Gaussian's analytic noise multiplier, and
the public grids they choose from."""
from __future__ import annotations

import collections.abc
import math
from fractions import Fraction

import numpy as np
from dp_accounting import gaussian_mechanism

from beam_dp import mechanisms


def gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """Noise multiplier of the Gaussian mechanism from the analytic calibration of Balle & Wang
    (2018), as implemented in dp_accounting."""
    return float(gaussian_mechanism.get_sigma_gaussian(epsilon, delta))


def histogram(values: np.ndarray, grid: np.ndarray,
              weights: np.ndarray | None = None) -> np.ndarray:
    """Counts per column of ``values`` (m, j) in the cells of per-column grids (j, G):
    cell 0 holds values <= grid[0], cell i values in (grid[i-1], grid[i]], cell G values above
    grid[-1]. The cumulative count up to cell i is #{v <= grid[i]}. Every value lands in exactly
    one cell whatever it is (+-inf in the end cells), except a NaN, which is in none: a missing
    cell of a column imputed privately (``categorical.IMPUTED_POLICIES``), NaN until its fill is
    released, so that the column's quantiles are those of its present values. One example moves
    at most one count per column by 1 either way, and nothing here can overflow. ``weights``
    (one per row, each in [0, 1]): each row counts its weight (user-level privacy: 1 / the
    user's rows, so one user moves a column's counts by at most 1 in all)."""
    j, size = grid.shape
    out = np.zeros((j, size + 1))
    for c in range(j):  # one vectorized search per column, not per example
        column = values[:, c]
        kept = ~np.isnan(column)
        out[c] = np.bincount(np.searchsorted(grid[c], column[kept], side="left"),
                             weights=None if weights is None else weights[kept],
                             minlength=size + 1)
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


class RationalUtilities(collections.abc.Sequence):
    """Utilities n_i / q over one common denominator q, made Fractions only when read: the
    exponential mechanism reads the largest and those of the candidates it draws, so a grid of
    thousands of cells needs no Fraction per cell (their normalizations were ~85% of an exact
    quantile release: 2 million Fractions in a DPSGD-F audit run, 18 s)."""

    def __init__(self, numerators: list, denominator: int):
        self.numerators, self.denominator = numerators, denominator

    def __len__(self) -> int:
        return len(self.numerators)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [Fraction(n, self.denominator) for n in self.numerators[i]]
        return Fraction(self.numerators[i], self.denominator)

    @property
    def top(self) -> Fraction:
        return Fraction(max(self.numerators), self.denominator)


def exact_quantile_utility(counts: np.ndarray, size: int, rank: float, quantile: float = 0.0,
                           margin: float = 0.0) -> RationalUtilities:
    """``quantile_utility`` in exact rational arithmetic (Fractions of the float inputs, which
    are dyadic rationals): its sensitivity is then exactly the 1 of the proof, with no float
    rounding of the target (p T + rank) in between."""
    ints = np.asarray(counts, float).astype(np.int64).tolist()   # integer-valued (< 2^53)
    total = sum(ints)
    half = Fraction(total, 2)
    low, high = min(Fraction(margin), half), max(total - Fraction(margin), half)
    target = min(max(Fraction(quantile) * total + Fraction(rank), low, 0), high, total)
    # -max(lower - target, target - upper, 0) over target's denominator, in integers.
    # (numpy object arrays: Python's exact integers, one vector operation each, ~3x a loop)
    p, q = target.numerator, target.denominator
    upper = np.cumsum(np.array(ints[:size] or [0], dtype=object))[:size]
    lower = np.concatenate([np.array([0], dtype=object), upper[:-1]])
    worst = np.maximum(np.maximum(lower * q - p, p - upper * q), 0)
    return RationalUtilities((-worst).tolist(), q)


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
    fraction. Only rational coins, so no floating-point rounding enters the law.

    In integers, not Fractions: each coin is ``_bernoulli`` of gamma / K in lowest terms, the
    same draws as Fraction arithmetic made (~10x faster; the secure private ranges' exponential
    mechanism spends most of its time here: 4.8 s of a default run's 100 quantiles)."""
    gamma = Fraction(gamma)
    if gamma < 0:
        raise ValueError("gamma must be non-negative")
    return _bernoulli_exp_ratio(generator, gamma.numerator, gamma.denominator)


def _bernoulli_exp_ratio(generator: np.random.Generator, num: int, den: int) -> bool:
    """``bernoulli_exp`` of num / den (integers, num >= 0, den > 0, in any terms: each coin is
    reduced to lowest terms, so the draws are those of the reduced fraction)."""
    while num > den:   # gamma > 1: a Bernoulli(exp(-1)) per whole unit
        k = 1
        while _uniform_below(generator, k) < 1:   # Bernoulli(1 / k)
            k += 1
        if k % 2 == 0:
            return False
        num -= den
    k = 1
    while True:   # Bernoulli(gamma / k): num / (den k) in lowest terms
        divisor = math.gcd(num, den * k)
        if _uniform_below(generator, den * k // divisor) >= num // divisor:
            return k % 2 == 1
        k += 1


def exact_exponential_mechanism(generator: np.random.Generator, utilities: list,
                                epsilon: float) -> int:
    """An index i drawn with probability proportional to exp(epsilon u_i / 2), exactly, for
    rational utilities (``exact_quantile_utility``): a uniform candidate, accepted with
    probability exp(-gamma_i), gamma_i = epsilon (max u - u_i) / 2 (``bernoulli_exp``), until
    one is (each round accepts with probability at least 1/G). Its running time depends on the
    utilities (a timing side channel, as the discrete Gaussian's; docs/secure-noise.md says so)."""
    # The audit's broken-build hook (mechanisms.NOISE_SCALE_FOR_TESTS) scales the Gumbel noise of
    # the float sampler; here it scales epsilon by its inverse, the same law.
    scaled = Fraction(epsilon) / Fraction(mechanisms.NOISE_SCALE_FOR_TESTS)
    if not isinstance(utilities, RationalUtilities):   # (rationals given one by one)
        fractions = [Fraction(u) for u in utilities]
        denominator = math.lcm(*(f.denominator for f in fractions))
        utilities = RationalUtilities([f.numerator * (denominator // f.denominator)
                                       for f in fractions], denominator)
    # gamma_i = scaled (top - u_i) / 2 = a (T - N_i) / b over the utilities' common denominator,
    # in integers (each coin reduces it: the draws of the Fraction form, in a tenth the time)
    numerators, size = utilities.numerators, len(utilities)
    best = max(numerators)
    a, b = scaled.numerator, scaled.denominator * utilities.denominator * 2
    while True:   # gamma_i only for the candidates drawn
        i = _uniform_below(generator, size)
        if _bernoulli_exp_ratio(generator, a * (best - numerators[i]), b):
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
