"""dp_accounting's PLD constructions, vectorized: the Gaussian PLD on a whole grid at once
(``_GaussianPrivacyLoss``, ``_gaussian_pld``, ``_connect_dots_pmf``: dp_accounting's PMF to the
bit, checked once per process by ``_fast_gaussian``), and the compositions a calibration's search
uses (``_quick_compose``, ``_laplace_pld``, ``_quick_self_compose``: tails cut with cumulative
sums rather than the library's Python loop, a real FFT where it takes a complex one).

Why hand-written: the library evaluates these one grid point at a time in Python, which was most
of the cost of a DP-SGD run's PLD (see each function). Reported epsilons stay the library's own
computation: the search-only shortcuts are used by ``calibration`` alone.
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.pld import privacy_loss_mechanism
from scipy import fft as scipy_fft
from scipy import signal as scipy_signal
from scipy import special as scipy_special


class _ScaledNormal:
    """What ``scipy.stats.norm(scale=s)`` computes for the three methods dp_accounting's Gaussian
    privacy loss calls, by the same special functions (its ``_cdf``, ``_logcdf``, ``_ppf``:
    ``ndtr``, ``log_ndtr``, ``ndtri``, on (x - 0) / s, and times s), which also give its values at
    +-inf and the ends of (0, 1). Checked against scipy through ``_fast_gaussian``."""

    def __init__(self, scale: float):
        self.scale = scale

    def cdf(self, x):
        return scipy_special.ndtr(np.asarray(x, dtype=np.float64) / self.scale)[()]

    def logcdf(self, x):
        return scipy_special.log_ndtr(np.asarray(x, dtype=np.float64) / self.scale)[()]

    def ppf(self, q):
        return (scipy_special.ndtri(np.asarray(q, dtype=np.float64)) * self.scale)[()]


class _GaussianPrivacyLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """dp_accounting's ``GaussianPrivacyLoss`` with ``get_delta_for_epsilon`` evaluated on the
    whole grid of losses at once.

    Hand-written because dp_accounting inverts the privacy loss one grid point at a time in
    Python (``AdditiveNoisePrivacyLoss.get_delta_for_epsilon``), ~4 us per point: at the default
    interval a Poisson-subsampled Gaussian step has ~1e5 points per adjacency, which was most of
    the cost of a DP-SGD run's PLD (0.4 of 0.55 s at q = 0.005, sigma 0.94). Here the same
    formulas (``inverse_privacy_loss`` with ``common.log_a_times_exp_b_plus_c`` and the
    Gaussian's ``_inverse_privacy_loss_without_subsampling_remove``) are applied to the array,
    operation for operation, so the result is dp_accounting's to the bit: checked once per
    process against the library (``_fast_gaussian``) before it is used, and in the tests. Only
    the ADD and REMOVE adjacencies (the add/remove relation); REPLACE is left to the library."""

    def __init__(self, standard_deviation: float, sensitivity: float = 1,
                 pessimistic_estimate: bool = True, log_mass_truncation_bound: float = -50,
                 sampling_prob: float = 1.0,
                 adjacency_type=privacy_loss_mechanism.AdjacencyType.REMOVE) -> None:
        # GaussianPrivacyLoss.__init__ with _ScaledNormal in place of scipy's frozen
        # norm(scale=standard_deviation), whose making costs ~1 ms (two per PLD).
        if standard_deviation <= 0:
            raise ValueError("the standard deviation must be positive")
        if log_mass_truncation_bound > 0:
            raise ValueError("the log mass truncation bound must not be positive")
        self._standard_deviation = standard_deviation
        self._gaussian_random_variable = _ScaledNormal(standard_deviation)
        self._pessimistic_estimate = pessimistic_estimate
        self._log_mass_truncation_bound = log_mass_truncation_bound
        privacy_loss_mechanism.AdditiveNoisePrivacyLoss.__init__(
            self, sensitivity, False, sampling_prob, adjacency_type)

    def _inverse_privacy_losses(self, losses: np.ndarray) -> np.ndarray:
        q, sensitivity = self.sampling_prob, self.sensitivity
        variance = self._standard_deviation ** 2
        add = self.adjacency_type == privacy_loss_mechanism.AdjacencyType.ADD
        if q == 1.0:
            unsampled = losses
            edge = np.zeros(losses.shape, dtype=bool)
        else:
            # Losses at the end of the range (math.isclose, as the library tests them): the
            # inverse there is the unsampled inverse at -inf (REMOVE) or +inf (ADD).
            limit = -math.log(1 - q) if add else math.log(1 - q)
            edge = np.abs(losses - limit) <= 1e-9 * np.maximum(np.abs(losses), abs(limit))
            beyond = (losses > limit) if add else (losses <= limit)
            if np.any(beyond & ~edge):
                raise ValueError("privacy loss outside the range of the subsampled mechanism")
            b = -losses if add else losses
            a, c = 1 / q, 1 - 1 / q
            log_minus_c = np.log(-c)
            with np.errstate(divide="ignore", invalid="ignore"):
                d = b + np.log(a)
                if np.any((b != 0) & ~edge & (log_minus_c >= d)):
                    raise ValueError("a exp(b) + c must be positive")
                # log(a exp(b) + c) for c < 0: common._log_sub(d, log(-c)), or log(a + c) at b = 0.
                value = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(log_minus_c - d)))
            unsampled = -value if add else value
        x = -0.5 * sensitivity - unsampled * variance / sensitivity
        if add:
            x = sensitivity + x
        x[edge] = -math.inf if add else math.inf
        return x

    def get_delta_for_epsilon(self, epsilon):
        # AdditiveNoisePrivacyLoss.get_delta_for_epsilon, but for the whole array of cutoffs.
        AdjacencyType = privacy_loss_mechanism.AdjacencyType
        if self.adjacency_type not in (AdjacencyType.ADD, AdjacencyType.REMOVE):
            return super().get_delta_for_epsilon(epsilon)
        is_scalar = isinstance(epsilon, numbers.Number)
        epsilons = np.array([epsilon]) if is_scalar else np.asarray(epsilon)
        deltas = np.zeros_like(epsilons, dtype=float)
        if self.sampling_prob == 1.0:
            inverse = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == AdjacencyType.ADD:
            inverse = epsilons < -math.log1p(-self.sampling_prob)
        else:
            inverse = epsilons > math.log1p(-self.sampling_prob)
            other = np.logical_not(inverse)
            deltas[other] = -np.expm1(epsilons[other])
        x_cutoffs = self._inverse_privacy_losses(np.asarray(epsilons[inverse], dtype=float))
        deltas[inverse] = (self.mu_upper_cdf(x_cutoffs)
                           - np.exp(epsilons[inverse] + self.mu_lower_log_cdf(x_cutoffs)))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if is_scalar else deltas


def _gaussian_pld(standard_deviation: float, sampling_prob: float, interval: float):
    """``privacy_loss_distribution.from_gaussian_mechanism(standard_deviation,
    value_discretization_interval=interval, sampling_prob=sampling_prob)`` under add/remove (its
    defaults otherwise), built with ``_GaussianPrivacyLoss``: the same steps as the library's."""
    AdjacencyType = privacy_loss_mechanism.AdjacencyType

    def single(adjacency):
        loss = _GaussianPrivacyLoss(standard_deviation, sensitivity=1, pessimistic_estimate=True,
                                    log_mass_truncation_bound=-50, sampling_prob=sampling_prob,
                                    adjacency_type=adjacency)
        # privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss, continuous
        # connect-the-dots branch, step for step.
        bounds = loss.connect_dots_bounds()
        upper = math.ceil(bounds.epsilon_upper / interval)
        lower = math.floor(bounds.epsilon_lower / interval)
        deltas = loss.get_delta_for_epsilon(np.arange(lower, upper + 1) * interval)
        return _connect_dots_pmf(interval, lower, upper, deltas)

    remove = single(AdjacencyType.REMOVE)
    if sampling_prob == 1.0:
        return privacy_loss_distribution.PrivacyLossDistribution(remove)
    return privacy_loss_distribution.PrivacyLossDistribution(remove, single(AdjacencyType.ADD))


def _connect_dots_pmf(interval: float, lower: int, upper: int, deltas: np.ndarray):
    """``pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(interval, lower, upper, deltas)``
    with the same arithmetic, made dense at once: the library goes through a dict of ~1e4-1e5
    Python floats and back (``common.dictionary_to_list``), a fifth of a calibration PLD's
    time. Small supports (where the library makes a sparse PMF) are left to it."""
    deltas = np.asarray(deltas, dtype=np.float64)
    if upper - lower + 1 <= pld_pmf._MAX_PMF_SPARSE_SIZE or deltas.size != upper - lower + 1:
        return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(interval, lower, upper, deltas)
    if np.any(deltas < 0) or np.any(deltas > 1) or np.any(np.diff(deltas) > pld_pmf._DELTA_DIFF_TOLERANCE):
        raise ValueError("deltas out of [0, 1] or not non-increasing")
    deltas = np.minimum.accumulate(deltas)
    diffs = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + diffs[0] / math.expm1(interval)
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(interval)) / math.expm1(interval)
    probs[-1] = diffs[-1] / math.expm1(-interval)
    return pld_pmf.DensePLDPmf(interval, lower, np.maximum(0.0, probs), deltas[-1], True)


@functools.lru_cache(maxsize=64)
def _laplace_pld(parameter: float, interval: float, count: int):
    """The library's PLD of ``count`` Laplace mechanisms (sensitivity 1), as its accountant
    composes a ``LaplaceDpEvent``; memoized for calibration searches (PLDs are not modified by
    composing them)."""
    return privacy_loss_distribution.from_laplace_mechanism(
        parameter=parameter, value_discretization_interval=interval).self_compose(count)


def _dense_probs(pmf) -> tuple[int, np.ndarray]:
    """(lowest loss index, dense probabilities) of a PLD PMF; ``to_dense_pmf`` vectorized."""
    if type(pmf) is pld_pmf.DensePLDPmf:
        return pmf._lower_loss, np.asarray(pmf._probs, dtype=float)
    keys = np.fromiter(pmf._loss_probs.keys(), dtype=np.int64, count=len(pmf._loss_probs))
    values = np.fromiter(pmf._loss_probs.values(), dtype=float, count=len(pmf._loss_probs))
    lowest = int(keys.min())
    probs = np.zeros(int(keys.max()) - lowest + 1)
    probs[keys - lowest] = values
    return lowest, probs


def _tail_sizes(probs: np.ndarray, threshold: float) -> tuple[int, int]:
    """The longest prefix and suffix of ``probs`` each of mass at most ``threshold``: what
    ``pld_pmf._truncate_tails`` finds with a Python loop over the elements, by cumulative sums
    (sequential additions, as the loop's)."""
    def prefix(values):
        over = np.flatnonzero(np.cumsum(values) > threshold)
        return int(over[0]) if over.size else len(values)
    return prefix(probs), prefix(probs[::-1])


def _quick_compose(first, second, tail_mass: float = 1e-15):
    """``first.compose(second)`` (PLDs, default tail truncation) for a calibration's search, as
    the library composes dense PMFs (FFT convolution, tails of mass up to ``tail_mass`` / 2 each
    cut: the left one onto the lowest loss, the right one to infinity, which is pessimistic),
    with vectorized tail search and densification."""
    def pmf_compose(a, b):
        if (a._discretization, a._pessimistic_estimate) != (b._discretization, b._pessimistic_estimate):
            raise ValueError("only PLDs on the same grid, both pessimistic or not, compose")
        if not a._pessimistic_estimate or (
                isinstance(a, pld_pmf.SparsePLDPmf) and isinstance(b, pld_pmf.SparsePLDPmf)
                and a.size * b.size <= pld_pmf._MAX_PMF_SPARSE_SIZE):
            return pld_pmf.compose_pmfs(a, b, tail_mass)   # small (the exact sum), or optimistic
        (la, pa), (lb, pb) = _dense_probs(a), _dense_probs(b)
        probs = scipy_signal.fftconvolve(pa, pb)
        infinity = a._infinity_mass + b._infinity_mass - a._infinity_mass * b._infinity_mass
        left, right = _tail_sizes(probs, tail_mass / 2)
        end = max(len(probs) - right, left + 1)
        left_mass, right_mass = np.sum(probs[:left]), np.sum(probs[end:])
        kept = probs[left:end]
        kept[0] += left_mass
        return pld_pmf.DensePLDPmf(a._discretization, la + lb + left, kept, infinity + right_mass,
                                   a._pessimistic_estimate)

    remove = pmf_compose(first._pmf_remove, second._pmf_remove)
    if first._symmetric and second._symmetric:
        return privacy_loss_distribution.PrivacyLossDistribution(remove)
    return privacy_loss_distribution.PrivacyLossDistribution(
        remove, pmf_compose(first._pmf_add, second._pmf_add))


@functools.lru_cache(maxsize=None)
def _fast_gaussian() -> bool:
    """Whether ``_GaussianPrivacyLoss`` gives exactly dp_accounting's deltas here (this
    dp_accounting, this numpy), and ``_gaussian_pld`` its PLD: compared once per process on
    ~80 losses and one small PLD (~10 ms); if not, or if the library's internals moved, the
    library's own (slower) construction is used."""
    AdjacencyType = privacy_loss_mechanism.AdjacencyType
    try:
        for adjacency in (AdjacencyType.REMOVE, AdjacencyType.ADD):
            kwargs = dict(sampling_prob=0.005, adjacency_type=adjacency)
            theirs = privacy_loss_mechanism.GaussianPrivacyLoss(0.94, **kwargs)
            bounds = theirs.connect_dots_bounds()
            # Points across the grid, and the end of the range (the library's special case).
            grid = np.linspace(bounds.epsilon_lower, bounds.epsilon_upper, 41)
            grid = grid[grid > math.log1p(-0.005)] if adjacency == AdjacencyType.REMOVE \
                else np.append(grid[grid < -math.log1p(-0.005)], -math.log(1 - 0.005))
            ours = _GaussianPrivacyLoss(0.94, **kwargs)
            if not np.array_equal(ours.get_delta_for_epsilon(grid),
                                  theirs.get_delta_for_epsilon(grid)):
                return False
        grid = np.linspace(-0.5, 4.0, 19)
        theirs = privacy_loss_distribution.from_gaussian_mechanism(
            2.0, value_discretization_interval=0.1, sampling_prob=0.1)
        return bool(np.array_equal(_gaussian_pld(2.0, 0.1, 0.1).get_delta_for_epsilon(grid),
                                   theirs.get_delta_for_epsilon(grid)))
    except Exception:   # any change in dp_accounting's internals: use the library as it is
        return False


def _self_convolve_bounds(probs: np.ndarray, num_times: int, tail_mass: float) -> tuple[int, int]:
    """``pld_common.compute_self_convolve_bounds(probs, num_times, tail_mass)`` with its default
    orders +-1/n ... +-20/n: the same Chernoff bounds, with the 40 moment generating functions
    sum(probs * exp(order * i)) made from powers of exp(+-i/n) (at most e^20: no overflow, so no
    log-sum-exp shift is needed) in one matrix product, rather than one
    ``scipy.special.logsumexp`` call each (a third of a search PLD's time). Used by calibration
    searches only (``_EagerPLDAccountant(quick=True)``): a bound one cell off would change which
    tail is truncated, never the guarantee (the truncated mass is charged to infinity either
    way); the reported epsilon stays the library's own computation to the bit."""
    n = len(probs)
    steps = np.arange(n) / n
    powers = np.empty((40, n))
    powers[20] = np.exp(steps)              # orders 1/n ... 20/n
    powers[19] = np.exp(-steps)             # orders -1/n ... -20/n
    for j in range(1, 20):
        powers[20 + j] = powers[19 + j] * powers[20]
        powers[19 - j] = powers[20 - j] * powers[19]
    orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / n
    with np.errstate(divide="ignore", invalid="ignore"):
        bounds = (num_times * np.log(powers @ probs) + math.log(2 / tail_mass)) / orders
    upper, lower = (n - 1) * num_times, 0
    finite = np.isfinite(bounds)
    if np.any(finite & (orders > 0)):
        upper = min(upper, int(np.min(np.ceil(bounds[finite & (orders > 0)]))))
    if np.any(finite & (orders < 0)):
        lower = max(lower, int(np.max(np.floor(bounds[finite & (orders < 0)]))))
    return lower, upper


def _quick_self_compose(pld, num_times: int, tail_mass: float = 1e-15):
    """``pld.self_compose(num_times)`` (dense PMFs: what ``_gaussian_pld`` makes), as
    dp_accounting's ``DensePLDPmf.self_compose`` does it (the power of the PMF's Fourier
    transform on a window holding all but ``tail_mass`` of the result, from
    ``_self_convolve_bounds``), with a real FFT where the library takes a complex one: half the
    time; the result differs by rounding (~1e-16 per point), as the library's own FFT does from
    the exact convolution. For searches only: reported epsilons are the library's."""
    def pmf_self_compose(pmf):
        probs = np.asarray(pmf._probs, dtype=float)
        lower, upper = _self_convolve_bounds(probs, num_times, tail_mass)
        length = upper - lower + 1
        size = scipy_fft.next_fast_len(max(length, len(probs)))   # the library's window
        composed = scipy_fft.irfft(scipy_fft.rfft(probs, size) ** num_times, size)
        infinity = tail_mass - math.expm1(num_times * math.log1p(-pmf._infinity_mass))
        return pld_pmf.DensePLDPmf(pmf._discretization, pmf._lower_loss * num_times + lower,
                                   np.roll(composed, -lower)[:length], infinity,
                                   pmf._pessimistic_estimate)

    if not all(type(pmf) is pld_pmf.DensePLDPmf for pmf in (pld._pmf_remove, pld._pmf_add)):
        return pld.self_compose(num_times)
    remove = pmf_self_compose(pld._pmf_remove)
    if pld._symmetric:
        return privacy_loss_distribution.PrivacyLossDistribution(remove)
    return privacy_loss_distribution.PrivacyLossDistribution(remove, pmf_self_compose(pld._pmf_add))
