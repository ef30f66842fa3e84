"""Privacy accounting with dp_accounting: one ledger of DpEvents per job, calibration, epsilon.

Epsilon always comes from a dp_accounting accountant (PLD by default, RDP as an option) applied to
the composition of everything the ledger holds; nothing here is a hand formula.

Bounded work. A PLD's size is its range of privacy-loss values divided by its discretization
interval, and that range grows with epsilon: at dp_accounting's default interval (1e-4) a run
with noise multiplier 0.1 needs 1.5 GB and one with 0.05, or a calibration to epsilon 1000, runs
out of memory. So the PLD accountant here chooses the interval per composed event
(``pld_discretization_interval``): the default 1e-4 while a cheap RDP estimate of the event's
epsilon (at delta 1e-10) is at most ``PLD_POINTS`` * 1e-4 = 20, and coarser in proportion beyond
(a power of two times 1e-4), which keeps every PLD to at most ~1e6 points: under 0.4 GB and about
a second per PLD at any epsilon or noise multiplier (measured: tests/test_accountant_limits.py).
A coarser grid is still a valid upper bound: dp_accounting's PLDs are pessimistic (each loss is
rounded up to the grid, and the coarse grid is a subset of the fine one), so the reported epsilon
can only grow, by at most (number of composed mechanisms) x interval; measured, by less than
1e-6 relative. Ordinary budgets keep exactly dp_accounting's default. Epsilons are memoized by
(event, delta), so the driver's and the report's repeated questions cost nothing twice.

dp_accounting's RDP code logs "_compute_log_a_frac failed to converge ... Excluding this order"
for some fractional orders (absl logging). Excluding an order can only raise the RDP epsilon, so
the bound stays valid. Where RDP only estimates a PLD's scale or gives progress between chunks,
the messages say nothing about the result and are filtered out (``_quiet_rdp``, by message, only
around those calls); where RDP is the reporting accountant, they are collected and the ledger
gives them as a sentence in ``Ledger.notes`` (also when a memoized step no longer prints them).

Cost (issue 10, item 4: accounting off the critical path). A calibration searches on PLDs up
to PROBE_FACTOR times coarser than the reporting grid (pessimistic too, as coarse as the report's
precision allows: ``_probe_factor``), from a Gaussian-DP guess (``noise_multiplier_guess``);
the reporting grid's PLD of its answer is made in a background thread while the job trains
(``prefetch_epsilon``) and the ledger's report reuses it (memo keys ignore how compositions are
nested); the Gaussian's PLD is built on the whole grid at once (``_GaussianPrivacyLoss``,
``_connect_dots_pmf``: dp_accounting's PMF to the bit); a search's compositions cut their tails
with cumulative sums rather than the library's Python loop and reuse the count's PLD
(``_quick_compose``, ``_laplace_pld``: the library's result to the bit); RDP remembers each step's vector, so progress after every
chunk costs a multiplication. ``STOPWATCH.seconds`` is the driver's time in all this (a wait for
the background PLD included), for the benchmark.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
import numbers
import os
import queue
import threading
import time
from typing import Callable

import attr
import dp_accounting
import numpy as np
from dp_accounting import dp_event as events
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.pld import privacy_loss_mechanism
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import fft as scipy_fft
from scipy import signal as scipy_signal
from scipy import special as scipy_special

ACCOUNTANTS = ("pld", "rdp")
ADD_REMOVE = "add/remove"
REPLACE_ONE = "replace-one"
# User-level privacy (--privacy-unit-column, ``beam_dp.user_level``): the unit added or removed
# is a user with all their rows. dp_accounting's relation is the same add/remove one unit: the
# contribution bounding makes each release's sensitivity to a user what it was to a row.
USER_ADD_REMOVE = "add/remove one user (all their rows)"

_RELATIONS = {
    ADD_REMOVE: dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    REPLACE_ONE: dp_accounting.NeighboringRelation.REPLACE_ONE,
    USER_ADD_REMOVE: dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
}


class _Stopwatch:
    """Cumulative wall seconds spent in this module's accounting: calibrations and epsilon (or
    delta) computations, for the benchmark to print next to a run's wall time. A call made
    inside another timed call (an epsilon inside a calibration) is counted once, with its
    caller; per thread, so concurrent callers each count their own time."""

    def __init__(self):
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()

    def exclude_this_thread(self) -> None:
        """Work in this thread is off the driver's critical path (``prefetch_epsilon``'s
        background thread): not counted. A driver's wait for its result is counted."""
        self._local.depth = 1   # as if inside a timed call that never ends

    def reset(self) -> None:
        with self._lock:
            self.seconds = 0.0

    @contextlib.contextmanager
    def running(self):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                elapsed = time.perf_counter() - start
                with self._lock:
                    self.seconds += elapsed

    def __call__(self, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            with self.running():
                return function(*args, **kwargs)
        return timed


STOPWATCH = _Stopwatch()


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PureDpEvent(events.DpEvent):
    """A mechanism known only to be epsilon-DP, such as the exponential mechanism.

    dp_accounting has no event for it, so the two accountants below extend dp_accounting's own:
    PLD composes the library's pessimistic PLD for an (epsilon, 0)-DP mechanism
    (``privacy_loss_distribution.from_privacy_parameters``, the tight dominating pair); RDP uses
    the bound D_alpha <= min(epsilon, alpha * epsilon^2 / 2) (epsilon-DP implies
    epsilon^2/2-zCDP, Bun & Steinke 2016, Prop. 3.3).
    """

    epsilon: float


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ApproxDpEvent(events.DpEvent):
    """A mechanism known only to be (epsilon, delta)-DP, such as objective perturbation or the
    generalized Gaussian mechanism (paper 004): what its proof gives, nothing finer.

    PLD composes dp_accounting's PLD for an (epsilon, delta)-DP mechanism
    (``from_privacy_parameters``, the tight dominating pair of the randomized-response type), so
    a composition of these is accounted as the optimal composition of (epsilon, delta)-DP
    mechanisms: never looser than basic or advanced composition. RDP cannot account for it (an
    (epsilon, delta) guarantee with delta > 0 bounds no Renyi divergence): dp_accounting's RDP
    accountant, and so the budget ledger's Renyi filter, refuse it as an unsupported event.
    """

    epsilon: float
    delta: float


# ------------------------------------------------------------- the Gaussian PLD, on a whole grid

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


_FAST_RELATIONS = (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                   dp_accounting.NeighboringRelation.REPLACE_SPECIAL)


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


def merged_gaussians(event: events.DpEvent) -> events.DpEvent:
    """``event`` with every ComposedDpEvent made only of GaussianDpEvents (directly or under a
    PoissonSampledDpEvent) replaced by the single GaussianDpEvent it equals, else ``event``
    itself (the same object).

    Why it is exact: Gaussian releases of queries with sensitivities s_i and noise std
    sigma_i s_i, released together, are one Gaussian mechanism on the vector of the queries each
    divided by its noise std: its L2 sensitivity is sqrt(sum 1/sigma_i^2) and its noise std 1, so
    the pair of output distributions on neighbours is the same as a Gaussian's of multiplier
    (sum sigma_i^-2)^(-1/2), a function of the data that moves all queries at once included
    (the worst case). Under Poisson sampling the whole vector is computed on the same sample,
    so the subsampled composite is the subsampled Gaussian of that multiplier. dp_accounting's
    PLD accountant refuses PoissonSampledDpEvent(ComposedDpEvent(...)) (its RDP accountant
    composes it, and agrees: tests/test_adaptive_clipping.py); adaptive clipping's step (a
    clipped gradient sum and a count of unclipped rows, noised together) is such an event."""
    if isinstance(event, events.ComposedDpEvent):
        parts = [merged_gaussians(e) for e in event.events]
        if parts and all(isinstance(e, events.GaussianDpEvent) for e in parts):
            multipliers = [e.noise_multiplier for e in parts]
            if any(m == 0 for m in multipliers):
                return events.GaussianDpEvent(0.0)
            return events.GaussianDpEvent(sum(m ** -2 for m in multipliers) ** -0.5)
        return event if all(a is b for a, b in zip(parts, event.events)) \
            else events.ComposedDpEvent(parts)
    if isinstance(event, events.PoissonSampledDpEvent):
        inner = merged_gaussians(event.event)
        return event if inner is event.event else events.PoissonSampledDpEvent(
            event.sampling_probability, inner)
    if isinstance(event, events.SelfComposedDpEvent):
        inner = merged_gaussians(event.event)
        return event if inner is event.event else events.SelfComposedDpEvent(inner, event.count)
    return event


# dp_accounting's PLD of a pure (or approximate) DP release computes exp(epsilon): a float
# overflow above ~709.78; refused a little below with a clear message.
MAX_PURE_PLD_EPSILON = 700.0


class _EagerPLDAccountant(pld_privacy_accountant.PLDAccountant):
    """dp_accounting's PLD accountant with ``PureDpEvent`` and ``ApproxDpEvent``; builds the PLD
    as events come.
    Gaussian and Poisson-subsampled Gaussian events (add/remove) are composed exactly as the
    library composes them, with ``_gaussian_pld`` in place of ``from_gaussian_mechanism``;
    with ``quick`` (a calibration's search), self-compositions use ``_quick_self_compose``."""

    def __init__(self, neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                 value_discretization_interval: float = 1e-4, quick: bool = False):
        super().__init__(neighboring_relation, value_discretization_interval)
        self._quick = quick

    def _maybe_compose(self, event, count, do_compose):
        if (isinstance(event, events.PoissonSampledDpEvent)
                and isinstance(event.event, events.ComposedDpEvent)):
            # dp_accounting's PLD has no subsampled composed event (adaptive clipping's step);
            # elsewhere events are composed as they come, as the library does.
            merged = merged_gaussians(event)
            if merged is not event:
                return self._maybe_compose(merged, count, do_compose)
        if isinstance(event, (PureDpEvent, ApproxDpEvent)):
            if do_compose and event.epsilon > MAX_PURE_PLD_EPSILON:
                # dp_accounting builds this PLD with exp(epsilon) in floats: OverflowError, a
                # traceback, where a user should read what to change.
                raise ValueError(
                    f"a pure-epsilon release of epsilon {event.epsilon:.4g} (e.g. the private "
                    f"count's share of a very large --epsilon) is beyond dp_accounting's PLD "
                    f"(above {MAX_PURE_PLD_EPSILON:g}); use a smaller --epsilon (such values "
                    "protect nothing) or --accountant rdp")
            if do_compose:
                pld = privacy_loss_distribution.from_privacy_parameters(
                    pld_common.DifferentialPrivacyParameters(
                        event.epsilon, getattr(event, "delta", 0.0)),
                    value_discretization_interval=self._value_discretization_interval)
                self._pld = self._pld.compose(pld.self_compose(count))
            return None
        if do_compose and self.neighboring_relation in _FAST_RELATIONS:
            interval = self._value_discretization_interval
            if (self._quick and isinstance(event, events.LaplaceDpEvent)
                    and event.noise_multiplier != 0):
                # A calibration's probes all compose the same releases before training (the
                # count): their PLD is made once per grid.
                self._pld = _quick_compose(self._pld, _laplace_pld(event.noise_multiplier,
                                                                   interval, count))
                return None
            if (isinstance(event, events.GaussianDpEvent) and event.noise_multiplier != 0
                    and _fast_gaussian()):
                self._pld = self._pld.compose(
                    _gaussian_pld(event.noise_multiplier / math.sqrt(count), 1.0, interval))
                return None
            if (isinstance(event, events.PoissonSampledDpEvent)
                    and isinstance(event.event, events.GaussianDpEvent)
                    and event.sampling_probability != 0 and event.event.noise_multiplier != 0
                    and _fast_gaussian()):
                pld = _gaussian_pld(event.event.noise_multiplier, event.sampling_probability,
                                    interval)
                if self._quick:
                    self._pld = _quick_compose(self._pld, _quick_self_compose(pld, count))
                else:
                    self._pld = self._pld.compose(pld.self_compose(count))
                return None
        return super()._maybe_compose(event, count, do_compose)


# dp_accounting's default PLD discretization interval, kept for every event whose epsilon is
# estimated at most PLD_POINTS * DEFAULT_DISCRETIZATION; beyond, the interval grows with it.
DEFAULT_DISCRETIZATION = 1e-4
PLD_POINTS = 2e5
# The scale estimate is RDP's epsilon at this delta: the upper tail of the privacy loss, i.e.
# roughly the PLD's range, which is what its size depends on.
_ESTIMATE_DELTA = 1e-10
_EPSILON_CACHE: collections.OrderedDict = collections.OrderedDict()
_EPSILON_CACHE_SIZE = 512
# Answers being computed, by memo key (``_PLDAccountant._memo``), and the lock over both: the
# report's PLD may be under way in ``prefetch_epsilon``'s thread while the driver asks for it.
_IN_FLIGHT: dict = {}
_CACHE_LOCK = threading.Lock()
# A few of dp_accounting's default RDP orders (a subset of them), for a quick first estimate of
# the loss's scale: ~2 ms rather than ~20-40 ms for a subsampled Gaussian (the fractional
# orders are the slow ones). Its epsilon is never below the one over all the orders (a minimum
# over fewer orders), so where it is small enough for the default interval, so is the other.
_SCALE_ORDERS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


MAX_DISCRETIZATION = 256.0   # exp(interval) must stay finite in dp_accounting (< ~709)


def _interval_for(estimate: float) -> float:
    """The discretization interval for an RDP estimate of the loss's scale (see
    ``pld_discretization_interval``)."""
    if not math.isfinite(estimate):
        return math.inf
    ratio = estimate / (PLD_POINTS * DEFAULT_DISCRETIZATION)
    if ratio <= 1.0:
        return DEFAULT_DISCRETIZATION
    interval = DEFAULT_DISCRETIZATION * 2.0 ** math.ceil(math.log2(ratio))
    # Beyond MAX_DISCRETIZATION (losses of millions of nats) dp_accounting's PLD overflows
    # (exp of the interval): no PLD; the epsilon is then RDP's (``_PLDAccountant``).
    return interval if interval <= MAX_DISCRETIZATION else math.inf


def _scale_estimate(event: events.DpEvent, neighbouring: str, orders=None) -> float | None:
    """RDP's epsilon of ``event`` at delta 1e-10 (over ``orders``, default dp_accounting's);
    None when RDP does not support the event."""
    try:
        with _quiet_rdp():
            return _RdpAccountant(orders, neighboring_relation=_RELATIONS[neighbouring]).compose(
                event).get_epsilon(_ESTIMATE_DELTA)
    except dp_accounting.UnsupportedEventError:
        return None


@STOPWATCH
def pld_discretization_interval(event: events.DpEvent, neighbouring: str = ADD_REMOVE) -> float:
    """The PLD discretization interval used for ``event``: 1e-4 (dp_accounting's default) while
    RDP's epsilon of the event at delta 1e-10 (an upper estimate of the privacy loss's range) is
    at most PLD_POINTS * 1e-4 = 20, else 1e-4 times the power of two at or above that epsilon /
    20: the grid then has PLD_POINTS to 2 PLD_POINTS cells per epsilon of loss range (a
    Gaussian's loss range is about 2 epsilon wide). The power of two keeps the interval the same
    for events that differ only by rounding, so a calibration and the report that recomputes it
    use the same grid. inf when the RDP estimate is itself not finite (epsilon is then reported
    as inf rather than building a PLD without bound). (RDP over a few orders is asked first: if
    even that is at most 20, so is RDP over all of them, and the answer is 1e-4.)"""
    quick = _scale_estimate(event, neighbouring, _SCALE_ORDERS)
    if quick is None:
        return DEFAULT_DISCRETIZATION   # no RDP for it: dp_accounting's own default
    if _interval_for(quick) == DEFAULT_DISCRETIZATION:
        return DEFAULT_DISCRETIZATION
    return _interval_for(_scale_estimate(event, neighbouring))


def _flattened(event: events.DpEvent) -> list:
    if isinstance(event, events.ComposedDpEvent):
        return [leaf for e in event.events for leaf in _flattened(e)]
    return [event]


def _event_key(event: events.DpEvent) -> str:
    """A memo key for ``event`` that does not depend on how compositions are nested: both
    accountants compose a ComposedDpEvent's events one after the other, recursively, so
    ``Composed([Composed([count]), steps])`` (a calibration's event) and ``Composed([count,
    steps])`` (the ledger's) are the same computation, to the bit, and share their answers."""
    return repr(events.ComposedDpEvent(_flattened(event)))


class _PLDAccountant(_EagerPLDAccountant):
    """The PLD accountant used here: ``compose`` only records (and validates) the events; the PLD
    is built when an epsilon or delta is asked for, once, with the discretization interval of
    ``pld_discretization_interval`` for the whole composed event (or the one given), and the
    answers are memoized by (event, interval, delta). Pessimistic, as dp_accounting's.

    Beyond epsilon ~700 dp_accounting's PLD epsilon can come out as inf for a finite loss: it
    divides masses near exp(-700), whose ratio overflows (seen at noise multiplier 0.1 after 300
    steps, while 275 and 325 steps gave 681 and 743). There, and only there, the same formula is
    evaluated on the same (pessimistic) PLD in log space (``_log_space_epsilon``); should that be
    impossible (dp_accounting's internals changed), the epsilon is RDP's (also a valid upper
    bound, and finite), and ``rdp_fallback`` says so (PLD_FALLBACK_NOTE in the ledger's
    notes)."""

    def __init__(self, neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                 value_discretization_interval: float | None = None):
        super().__init__(neighboring_relation=neighboring_relation)
        self._fixed_interval = value_discretization_interval
        self._built = None
        self.rdp_fallback = False

    def _maybe_compose(self, event, count, do_compose):
        if do_compose:
            self._built = None
        return super()._maybe_compose(event, count, False)   # validation only

    def _eager(self) -> _EagerPLDAccountant | None:
        """The built accountant; None if the loss is beyond accounting (epsilon inf)."""
        if self._built is None:
            event = self.ledger
            interval = self._fixed_interval or pld_discretization_interval(
                event, _relation_name(self.neighboring_relation))
            if not math.isfinite(interval):
                self._built = (interval, None)
            else:
                eager = _EagerPLDAccountant(self.neighboring_relation, interval)
                self._built = (interval, eager.compose(event))
        return self._built[1]

    def _memo(self, kind: str, value: float, compute: Callable[[_EagerPLDAccountant], float],
              unbounded: float) -> float:
        key = (kind, _event_key(self.ledger), self.neighboring_relation, self._fixed_interval,
               value)
        while True:
            with _CACHE_LOCK:
                cached = _EPSILON_CACHE.get(key)
                if cached is not None:
                    _EPSILON_CACHE.move_to_end(key)
                    break
                running = _IN_FLIGHT.get(key)
                mine = running is None
                if mine:
                    running = _IN_FLIGHT[key] = threading.Event()
            if not mine:
                # Another thread (``prefetch_epsilon``) is computing this very answer: wait for
                # it rather than build the same PLD twice; should it fail, compute it here.
                running.wait()
                continue
            try:
                cached = self._compute(kind, value, compute, unbounded)
                with _CACHE_LOCK:
                    _EPSILON_CACHE[key] = cached
                    while len(_EPSILON_CACHE) > _EPSILON_CACHE_SIZE:
                        _EPSILON_CACHE.popitem(last=False)
            finally:
                with _CACHE_LOCK:
                    del _IN_FLIGHT[key]
                running.set()
            break
        result, fallback = cached
        self.rdp_fallback = self.rdp_fallback or fallback
        return result

    def _compute(self, kind: str, value: float, compute: Callable[[_EagerPLDAccountant], float],
                 unbounded: float) -> tuple[float, bool]:
        """(answer, whether RDP's bound stood in for PLD's); see the class docstring."""
        eager = self._eager()
        fallback = False
        if eager is None:
            result = unbounded
        else:
            # dp_accounting's own overflow near epsilon 700 (class docstring) is handled
            # below; its "overflow in scalar divide" warning would only be noise.
            with np.errstate(over="ignore", divide="ignore"):
                result = float(compute(eager))
        if kind == "epsilon" and math.isinf(result) and eager is not None \
                and not self._non_private():
            result = _log_space_epsilon(eager._pld, value)
        if kind == "epsilon" and math.isinf(result) and not self._non_private():
            try:
                with _quiet_rdp():
                    result = float(_RdpAccountant(neighboring_relation=self.neighboring_relation)
                                   .compose(self.ledger).get_epsilon(value))
                fallback = True
            except dp_accounting.UnsupportedEventError:
                pass   # (an ApproxDpEvent: inf is right below its delta, and RDP has no bound)
        return result, fallback

    def _non_private(self) -> bool:
        eager = self._eager()
        return eager is not None and eager._contains_non_dp_event

    @STOPWATCH
    def get_epsilon(self, target_delta: float) -> float:
        return self._memo("epsilon", target_delta, lambda a: a.get_epsilon(target_delta), math.inf)

    @STOPWATCH
    def get_delta(self, target_epsilon: float) -> float:
        return self._memo("delta", target_epsilon, lambda a: a.get_delta(target_epsilon), 1.0)


def _log_space_epsilon(pld, delta: float) -> float:
    """dp_accounting's epsilon of a PLD (``pld_pmf._get_epsilon_for_delta`` for each of its
    PMFs, the larger of the two), evaluated with the probability masses weighted by exp(-loss)
    kept in log space, so that losses beyond ~700 do not overflow. Same formula, same pessimistic
    PLD: a valid upper bound as dp_accounting's is. inf if the PLD's internals are not as
    expected (then the caller falls back to RDP) or the epsilon is truly unbounded."""
    try:
        pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
        return max(_pmf_log_space_epsilon(pmf, delta) for pmf in pmfs)
    except (AttributeError, TypeError, ValueError):
        return math.inf


def _pmf_log_space_epsilon(pmf, delta: float) -> float:
    if hasattr(pmf, "_get_losses_probs"):          # sparse PMF
        losses, probs = pmf._get_losses_probs()
        losses, probs = np.asarray(losses, float)[::-1], np.asarray(probs, float)[::-1]
    else:                                           # dense PMF
        probs = np.asarray(pmf._probs, float)[::-1]
        top = pmf._lower_loss + len(probs) - 1
        losses = (top - np.arange(len(probs))) * pmf._discretization
    infinity_mass = float(pmf._infinity_mass)
    if infinity_mass > delta:
        return math.inf
    # Before row k (losses descending): the upper mass and log of sum(exp(-loss) * prob).
    with np.errstate(divide="ignore"):
        # FFT composition leaves masses of -1e-17 here and there: as zeros in the log.
        log_terms = np.log(np.maximum(probs, 0.0)) - losses
    upper = infinity_mass + np.concatenate([[0.0], np.cumsum(probs)])
    log_lower = np.concatenate([[-np.inf], np.logaddexp.accumulate(log_terms)])
    with np.errstate(divide="ignore", invalid="ignore"):
        candidate = np.log(upper - delta) - log_lower
    stop = (upper[:-1] > delta) & np.isfinite(log_lower[:-1]) & (candidate[:-1] >= losses)
    hits = np.flatnonzero(stop)
    if hits.size:
        return max(0.0, float(candidate[hits[0]]))
    if upper[-1] <= np.exp(log_lower[-1]) + delta:
        return 0.0
    return max(0.0, float(candidate[-1]))


# Per-step RDP vectors, by (event, orders, relation). RDP composes additively: dp_accounting
# adds count * (the step's vector) for each of these events, so the vector is computed once and
# reused for every count (the ledger's RDP after every chunk of a run costs a multiplication,
# not a new series over the fractional orders: ~40 ms per chunk at q = 0.005).
_RDP_STEPS: collections.OrderedDict = collections.OrderedDict()
_RDP_STEPS_SIZE = 4096
_RDP_STEP_EVENTS = (events.GaussianDpEvent, events.PoissonSampledDpEvent, events.LaplaceDpEvent)


class _RdpAccountant(rdp_privacy_accountant.RdpAccountant):
    """dp_accounting's RDP accountant with ``PureDpEvent``, and each step's RDP vector memoized
    (``_RDP_STEPS``; the result is the library's, to the bit). ``excluded_orders``: whether
    dp_accounting left out orders it could not evaluate for any of the steps composed (its
    "failed to converge" message, which a memoized step no longer prints)."""

    def __init__(self, orders=None,
                 neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE):
        super().__init__(orders, neighboring_relation=neighboring_relation)
        self.excluded_orders = False

    def compose(self, event, count: int = 1):
        if self.neighboring_relation == _RELATIONS[REPLACE_ONE]:
            event = _rdp_replace_one_units(event)
        return super().compose(event, count)

    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, PureDpEvent):
            if do_compose:
                self._rdp += count * np.minimum(event.epsilon, self._orders * event.epsilon ** 2 / 2)
            return None
        if do_compose and isinstance(event, _RDP_STEP_EVENTS):
            step = self._step(event)
            if step is not None:
                vector, excluded = step
                self._rdp += count * vector
                self.excluded_orders = self.excluded_orders or excluded
                return None
        return super()._maybe_compose(event, count, do_compose)

    def _step(self, event):
        key = (repr(event), self._orders.tobytes(), str(self._orders.dtype),
               self.neighboring_relation)
        if key not in _RDP_STEPS:
            scratch = rdp_privacy_accountant.RdpAccountant(self._orders, self.neighboring_relation)
            before = _RDP_EXCLUSIONS[0]
            with _quiet_rdp():
                error = scratch._maybe_compose(event, 1, True)
            if error is not None:
                return None   # the library's own error, from the library's own path
            _RDP_STEPS[key] = (scratch._rdp.copy(), _RDP_EXCLUSIONS[0] > before)
            while len(_RDP_STEPS) > _RDP_STEPS_SIZE:
                _RDP_STEPS.popitem(last=False)
        _RDP_STEPS.move_to_end(key)
        return _RDP_STEPS[key]


def _rdp_replace_one_units(event: events.DpEvent) -> events.DpEvent:
    """``event`` in the units dp_accounting's RDP accountant reads under replace-one.

    This library states a replace-one release's Gaussian (and Laplace) multiplier as dp_accounting's
    PLD accountant reads it: against the add/remove sensitivity, a replacement moving the sum by
    twice that (a mean of rows of norm <= L: unit L / n, a replacement moves it 2L / n). dp_accounting's
    RDP accountant ignores the relation for these events and reads the multiplier against the
    whole replace-one sensitivity (at (1, 1e-5) a GaussianDpEvent(4) gave epsilon 1.01 by RDP and
    1.99 by PLD under replace-one): passed as they are, an RDP run would claim half its epsilon.
    So the multipliers are halved here, once, where an event enters the RDP accountant. (Its
    Laplace too: PLD refuses a replace-one Laplace, and reading it as RDP does would be the
    optimistic reading of the two.)"""
    if isinstance(event, events.GaussianDpEvent):
        return events.GaussianDpEvent(event.noise_multiplier / 2.0)
    if isinstance(event, events.LaplaceDpEvent):   # (PLD refuses it under replace-one)
        return events.LaplaceDpEvent(event.noise_multiplier / 2.0)
    if isinstance(event, events.SelfComposedDpEvent):
        return events.SelfComposedDpEvent(_rdp_replace_one_units(event.event), event.count)
    if isinstance(event, events.ComposedDpEvent):
        return events.ComposedDpEvent([_rdp_replace_one_units(e) for e in event.events])
    if isinstance(event, events.SampledWithoutReplacementDpEvent):
        return events.SampledWithoutReplacementDpEvent(
            event.source_dataset_size, event.sample_size, _rdp_replace_one_units(event.event))
    return event


def _relation_name(relation) -> str:
    return next(name for name, r in _RELATIONS.items() if r == relation)


_RDP_CONVERGENCE = "_compute_log_a_frac failed to converge"
_RDP_EXCLUSIONS = [0]   # how many such messages were dropped in this process


class _RdpConvergenceFilter(logging.Filter):
    """Drops (and counts) dp_accounting's RDP non-convergence messages, and only those."""

    def __init__(self):
        super().__init__()
        self.dropped = 0
        # Only this thread's messages: the report's PLD may be under way in another thread
        # (``prefetch_epsilon``), and an RDP report's own messages must reach its own filter.
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        if isinstance(record.msg, str) and record.msg.startswith(_RDP_CONVERGENCE):
            self.dropped += 1
            _RDP_EXCLUSIONS[0] += 1
            return False
        return True


@contextlib.contextmanager
def _quiet_rdp():
    """Keeps dp_accounting's "_compute_log_a_frac failed to converge" messages (absl logging)
    out of the output for the duration; yields the filter, whose ``dropped`` counts them."""
    logger = logging.getLogger("absl")
    quiet = _RdpConvergenceFilter()
    logger.addFilter(quiet)
    try:
        yield quiet
    finally:
        logger.removeFilter(quiet)


RDP_EXCLUDED_ORDERS_NOTE = (
    "RDP: dp_accounting could not evaluate some fractional Renyi orders for these releases (its "
    "series did not converge) and left them out; epsilon is the minimum over the remaining "
    "orders, still a valid upper bound, at most slightly looser than with them.")


PLD_FALLBACK_NOTE = (
    "PLD: dp_accounting's PLD could not evaluate this epsilon (above ~700 its arithmetic leaves "
    "the float range), so the RDP accountant's bound for the same releases is reported: also a "
    "valid upper bound, looser than PLD's.")


def settle() -> None:
    """Waits for the computations ``prefetch_epsilon`` started."""
    with _CACHE_LOCK:
        running = list(_IN_FLIGHT.values()) + list(_QUEUED)
    for event in running:
        event.wait()


def clear_caches() -> None:
    """Forgets every memoized epsilon, calibration and RDP step: the next run in this process is
    accounted as in a fresh one (pipelines/benchmark.py compares runs this way)."""
    settle()   # a prefetch under way would fill the cache afterwards
    _EPSILON_CACHE.clear()
    _RDP_STEPS.clear()
    _CALIBRATIONS.clear()
    _laplace_pld.cache_clear()


def make_accountant(kind: str = "pld", neighbouring: str = ADD_REMOVE) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant. The PLD one chooses its discretization per composed event and
    memoizes its answers (see the module docstring)."""
    relation = _RELATIONS[neighbouring]
    if kind == "pld":
        return _PLDAccountant(neighboring_relation=relation)
    if kind == "rdp":
        return _RdpAccountant(neighboring_relation=relation)
    raise ValueError(f"unknown accountant {kind!r}; choose one of {', '.join(ACCOUNTANTS)}")


@STOPWATCH
def epsilon_of(event: events.DpEvent, delta: float, accountant: str = "pld",
               neighbouring: str = ADD_REMOVE, notes: list | None = None) -> float:
    """Epsilon of ``event`` at ``delta``. ``notes`` (a list), if given, receives a sentence for
    the report when the value needs one: RDP_EXCLUDED_ORDERS_NOTE (RDP accountant, orders left
    out) or PLD_FALLBACK_NOTE (PLD accountant, RDP's bound used beyond PLD's float range)."""
    acc = make_accountant(accountant, neighbouring)
    with _quiet_rdp() as quiet:
        value = float(acc.compose(event).get_epsilon(delta))
    if notes is not None:
        excluded = quiet.dropped or getattr(acc, "excluded_orders", False)
        if accountant == "rdp" and excluded and RDP_EXCLUDED_ORDERS_NOTE not in notes:
            notes.append(RDP_EXCLUDED_ORDERS_NOTE)
        if getattr(acc, "rdp_fallback", False) and PLD_FALLBACK_NOTE not in notes:
            notes.append(PLD_FALLBACK_NOTE)
    return value


def ready_epsilon(event: events.DpEvent, delta: float, accountant: str = "pld",
                  neighbouring: str = ADD_REMOVE) -> float | None:
    """``epsilon_of(event, delta, ...)`` if the PLD accountant already knows it (memoized, e.g.
    by ``prefetch_epsilon``), else None without computing anything."""
    if accountant != "pld":
        return None
    acc = make_accountant(accountant, neighbouring).compose(event)
    key = ("epsilon", _event_key(acc.ledger), acc.neighboring_relation, None, delta)
    with _CACHE_LOCK:
        cached = _EPSILON_CACHE.get(key)
    return None if cached is None else cached[0]


# ---------------------------------------------------------------------------------- calibration

# Noise multipliers (parameters) below this are not searched: if even this little noise meets
# the target, it is returned (more noise than needed, so still within the budget).
MIN_PARAMETER = 1e-6
# The precision of a calibration: the parameter returned meets the target epsilon (by the
# accountant that reports it) and its epsilon is at most 0.3% below the target. Epsilon falls
# at least in proportion to the noise multiplier for the releases here (as 1/sigma for a
# Gaussian at large noise, faster at small noise or with subsampling: slope -2.4 for DP-SGD at
# q = 0.005 and epsilon 1), so the multiplier is at most ~0.3% above the smallest one that meets
# the target, ~0.13% for DP-SGD: noise that much larger than it need be, far below anything a
# model's accuracy can show (the brief allowed 0.1-0.5%), where asking for less costs more PLDs.
CALIBRATION_TOLERANCE = 3e-3
# The search runs on PLDs this many times coarser than the reporting accountant's grid
# (``pld_discretization_interval``): ~6x cheaper for a DP-SGD run's PLD, and as dp_accounting's
# PLDs are pessimistic, their epsilon is an upper bound too, within ~7e-4 relative of the fine
# grid's at q = 0.005 and 1,000 steps. The search stops within _PROBE_TOLERANCE below the target
# on that grid and returns: the fine grid's epsilon is then within CALIBRATION_TOLERANCE below
# the target as long as the grids differ by less than their difference (checked by the tests
# over the algorithms' events). The fine grid's PLD is the report's, made in the background
# while the job runs (``prefetch_epsilon``): a calibration costs the driver 3-5 coarse PLDs.
PROBE_FACTOR = 8
_PROBE_TOLERANCE = 2e-3
_CALIBRATIONS: collections.OrderedDict = collections.OrderedDict()
_CALIBRATIONS_SIZE = 256


@STOPWATCH
def calibrate_noise_multiplier(make_event: Callable[[float], events.DpEvent], epsilon: float,
                               delta: float, accountant: str = "pld",
                               neighbouring: str = ADD_REMOVE,
                               lower: float = MIN_PARAMETER, guess: float = 1.0,
                               upper: float | None = None, slope: float | None = None) -> float:
    """The smallest parameter, within CALIBRATION_TOLERANCE, whose event meets (epsilon, delta)
    by ``accountant``, for events whose epsilon falls as the parameter grows (a noise
    multiplier, or any inverse budget scale): its epsilon is at most the target and at least
    (1 - CALIBRATION_TOLERANCE) times it. Parameters below ``lower`` are not searched: if
    ``lower`` already meets the target, it is returned. With ``upper``, the search is within
    [lower, upper] (ValueError if even ``upper`` does not meet the target).

    With PLD, the search runs on coarser (still pessimistic) PLDs (``_calibrate_pld``), and the
    reporting accountant's epsilon of the answer is computed in the background, memoized for the
    report. ``guess`` and ``slope`` (d log epsilon / d log parameter) start the search
    (``noise_multiplier_guess``). Calibrations are memoized too, by their inputs (the event at
    two fixed parameters standing for ``make_event``, and the starting point); a memoized answer
    is checked again (free: memoized) before it is returned.

    Any epsilon works, including 1e6, within a few seconds and well under 1 GB: the PLD
    accountant's discretization follows the size of the privacy loss (module docstring).
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a positive number, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    make_accountant(accountant, neighbouring)   # validates both names
    if upper is not None and not upper > lower:
        raise ValueError(f"upper ({upper}) must be above lower ({lower})")

    def meets(parameter: float) -> float:   # the search accountant's epsilon (memoized)
        if accountant == "rdp":
            return epsilon_of(make_event(parameter), delta, accountant, neighbouring)
        return _probe_epsilon(make_event(parameter), delta, neighbouring, epsilon)[0]

    # The family make_event stands for, by its events at two fixed parameters (not at the guess:
    # s -> Gaussian(s / 10) at 37.6 and s -> Gaussian(s / sqrt(12)) at 13.0, each problem's
    # guess, are the same event, and the second problem got the first one's answer), and the
    # search's starting point, on which the answer within the tolerance depends.
    key = (_event_key(make_event(1.0)), _event_key(make_event(2.0)), guess, slope, epsilon,
           delta, accountant, neighbouring, lower, upper)
    if key in _CALIBRATIONS and meets(_CALIBRATIONS[key]) <= epsilon:
        _CALIBRATIONS.move_to_end(key)
        return _CALIBRATIONS[key]
    if accountant == "rdp":
        # RDP is its own search accountant (no grid); its convergence messages about the probes
        # say nothing about the released parameter (the ledger's epsilon is recomputed).
        with _quiet_rdp():
            result = _search(meets, epsilon, CALIBRATION_TOLERANCE, lower, upper, guess, {},
                             slope or _FIRST_SLOPE)
    else:
        result = _calibrate_pld(make_event, epsilon, delta, neighbouring, lower, upper, guess,
                                slope or _FIRST_SLOPE)
    _CALIBRATIONS[key] = result
    while len(_CALIBRATIONS) > _CALIBRATIONS_SIZE:
        _CALIBRATIONS.popitem(last=False)
    return result


def _calibrate_pld(make_event, epsilon, delta, neighbouring, lower, upper, guess, first_slope):
    """The search on the coarse grid alone: the parameter it returns meets the target by a
    pessimistic PLD, so by the reporting grid's too (a subset of that grid: rounding each loss up
    to the coarse grid can only raise epsilon; tests/test_accounting.py checks the order), and
    the reporting grid's epsilon is lower by at most the coarse grid's excess (~7e-4 relative at
    q = 0.005 and 1,000 steps, CALIBRATION_TOLERANCE minus _PROBE_TOLERANCE at most, checked by
    the tests). The reporting grid's PLD (the report's epsilon) is started in the background."""
    # Epsilon falls as the parameter grows (the contract of calibrate_noise_multiplier), so once
    # a parameter's event is within the default grid, so is every larger one's: its RDP scale
    # estimate (~3.5 ms a probe) is skipped.
    default_from = [math.inf]

    def probe(parameter: float) -> float:
        known = DEFAULT_DISCRETIZATION if parameter >= default_from[0] else None
        value, base = _probe_epsilon(make_event(parameter), delta, neighbouring, epsilon, known)
        if base == DEFAULT_DISCRETIZATION:
            default_from[0] = min(default_from[0], parameter)
        return value

    found = _search(probe, epsilon, _PROBE_TOLERANCE, lower, upper, guess, {}, first_slope)
    prefetch_epsilon(make_event(found), delta, "pld", neighbouring)
    return found


def prefetch_epsilon(event: events.DpEvent, delta: float, accountant: str = "pld",
                     neighbouring: str = ADD_REMOVE) -> None:
    """Starts ``epsilon_of(event, delta, accountant, neighbouring)`` in a background thread: the
    report's PLD (~0.2 s for a DP-SGD run, seconds for some) is computed while the job trains,
    off the driver's critical path (issue 10, item 4), and the driver's later question waits for
    it rather than computing it again (``_PLDAccountant._memo``), in ``_background``'s thread.
    Not counted by STOPWATCH; the driver's wait is."""
    if accountant != "pld":
        return

    def work():
        try:
            epsilon_of(event, delta, accountant, neighbouring)
        except Exception:   # the driver's own call computes it again and raises there
            pass

    done = threading.Event()
    with _CACHE_LOCK:
        _QUEUED.add(done)

    def job():
        try:
            work()
        finally:
            with _CACHE_LOCK:
                _QUEUED.discard(done)
            done.set()

    _background().put(job)


_QUEUED: set = set()   # prefetches not yet finished (queued or running), for ``settle``
_WORKER: tuple[int, queue.SimpleQueue] | None = None   # (process id, its work queue)
_WORKER_LOCK = threading.Lock()


def _background() -> queue.SimpleQueue:
    """The queue of this process's accounting thread, started on first use while it has no work:
    a thread started with its work holds the GIL for a switch interval (5 ms) before
    ``Thread.start`` returns to the driver, and that was a tenth of a calibration. A daemon
    thread: an interrupted run does not wait for it. A forked child starts its own."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER[0] != os.getpid():
            work_queue: queue.SimpleQueue = queue.SimpleQueue()

            def serve():
                STOPWATCH.exclude_this_thread()
                while True:
                    work_queue.get()()

            threading.Thread(target=serve, name="beam-dp-accounting", daemon=True).start()
            _WORKER = (os.getpid(), work_queue)
        return _WORKER[1]


def _compositions(event: events.DpEvent) -> int:
    """How many mechanisms ``event`` composes (self-compositions counted out)."""
    if isinstance(event, events.ComposedDpEvent):
        return sum(_compositions(e) for e in event.events)
    if isinstance(event, events.SelfComposedDpEvent):
        return event.count * _compositions(event.event)
    return 1


def _probe_factor(event: events.DpEvent, base: float, target: float) -> int:
    """How much coarser than the reporting grid (``base``) a calibration may search: the largest
    power of two up to PROBE_FACTOR whose grid overstates epsilon by at most the precision left
    over (CALIBRATION_TOLERANCE - _PROBE_TOLERANCE), so that the answer meets the target on the
    reporting grid with no PLD of its own. Measured over subsampled and full-batch Gaussian
    runs (q 0.002 to 1, epsilon 0.1 to 8, 20 to 3,000 steps), the coarse grid's excess is at
    most 1.5 T (h / epsilon)^2 for T compositions on a grid of interval h (0.18 at epsilon 0.1,
    3,000 steps and h = 8e-4; 7e-4 for the benchmark's DP-SGD run). A wrong guess here costs
    precision (a little more noise), never privacy: the coarse grid's epsilon is an upper bound
    on the reporting grid's (``_calibrate_pld``)."""
    room = CALIBRATION_TOLERANCE - _PROBE_TOLERANCE
    factor = PROBE_FACTOR
    while factor > 1 and 1.5 * _compositions(event) * (factor * base / target) ** 2 > room:
        factor //= 2
    return factor


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Epsilon at ``delta`` of a Gaussian mechanism of sensitivity / noise ``mu`` (the exact
    curve of Balle & Wang 2018, delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)),
    by bisection."""
    def phi(x: float) -> float:   # the standard normal CDF (math.erfc: ~0.1 us a call)
        return 0.5 * math.erfc(-x / math.sqrt(2.0))

    def delta_at(eps: float) -> float:
        lower = phi(-eps / mu - mu / 2)   # e^eps * lower, in logs: e^eps alone may overflow
        tail = math.exp(min(eps + math.log(lower), 0.0)) if lower > 0 else 0.0
        return phi(-eps / mu + mu / 2) - tail

    lo, hi = 0.0, max(1.0, mu * mu + 10 * mu)
    if delta_at(lo) <= delta:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_at(mid) > delta else (lo, mid)
    return hi


def noise_multiplier_guess(sampling_probability: float, steps: int, epsilon: float,
                           delta: float) -> tuple[float, float]:
    """Where a calibration of ``steps`` Poisson-subsampled Gaussian steps starts, and the slope
    d log(epsilon) / d log(sigma) of its first step: the central-limit view of such steps as
    one Gaussian mechanism (mu-GDP, Dong, Roth & Su 2019: mu = q sqrt(T (e^{1/sigma^2} - 1));
    mu = sqrt(T) / sigma exactly when q = 1). A starting point only, in microseconds: the search
    that follows decides on the accountant's PLDs, so a poor guess costs a PLD or two, never
    privacy. Measured on the benchmark's DP-SGD run it starts within ~1% of the answer and saves
    one or two of the search's ~20 ms PLDs."""
    q, t = float(sampling_probability), max(int(steps), 1)

    def mu(sigma: float) -> float:
        if q >= 1.0:
            return math.sqrt(t) / sigma
        return q * math.sqrt(t * math.expm1(min(1.0 / sigma ** 2, 700.0)))

    def epsilon_at(sigma: float) -> float:
        return _gaussian_epsilon(mu(sigma), delta)

    lo, hi = 0.05, 1e6
    if not (epsilon_at(hi) < epsilon < epsilon_at(lo)):
        return 1.0, _FIRST_SLOPE
    for _ in range(60):   # bisection in log sigma: epsilon falls as sigma grows
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if epsilon_at(mid) > epsilon else (lo, mid)
    sigma = hi
    a, b = epsilon_at(sigma * 0.99), epsilon_at(sigma * 1.01)
    slope = (math.log(b) - math.log(a)) / (math.log(1.01) - math.log(0.99)) if a > 0 and b > 0 \
        else _FIRST_SLOPE
    return sigma, min(max(slope, -50.0), -0.1)


def _probe_epsilon(event: events.DpEvent, delta: float, neighbouring: str, target: float,
                   base: float | None = None) -> tuple[float, float]:
    """A calibration's search accountant, and the reporting grid's interval ``base`` it judged
    (given, it is not judged again): dp_accounting's PLD (pessimistic, an upper bound too) on a
    grid ``_probe_factor`` times the reporting one, the latter judged from RDP over a few orders
    (at least as coarse as ``pld_discretization_interval``'s); RDP's epsilon where no PLD can be
    built."""
    if base is None:
        quick = _scale_estimate(event, neighbouring, _SCALE_ORDERS)
        base = DEFAULT_DISCRETIZATION if quick is None else _interval_for(quick)
    if not math.isfinite(base):
        with _quiet_rdp():
            return float(_RdpAccountant(neighboring_relation=_RELATIONS[neighbouring])
                         .compose(event).get_epsilon(delta)), base
    interval = min(_probe_factor(event, base, target) * base, MAX_DISCRETIZATION)
    if interval == base:   # the reporting grid itself: its answer is the report's (memoized)
        return epsilon_of(event, delta, "pld", neighbouring), base
    key = ("probe", _event_key(event), neighbouring, interval, delta)
    with _CACHE_LOCK:
        if key in _EPSILON_CACHE:
            return _EPSILON_CACHE[key][0], base
    eager = _EagerPLDAccountant(_RELATIONS[neighbouring], interval, quick=True).compose(event)
    # The same formula as dp_accounting's epsilon of this PLD, vectorized (~1.5 ms, not ~5).
    result = _log_space_epsilon(eager._pld, delta) if not eager._contains_non_dp_event else math.inf
    if math.isinf(result):
        with np.errstate(over="ignore", divide="ignore"):
            result = float(eager.get_epsilon(delta))
    result *= 1.0 + _QUICK_ROUNDING   # the real FFT's rounding, on the safe side
    with _CACHE_LOCK:
        _EPSILON_CACHE[key] = (result, False)
    return result, base


# How far a search PLD's epsilon may fall below the library's for the same grid, by rounding
# alone (``_quick_self_compose``'s real FFT; measured <= 3e-9 relative at delta 1e-9); added
# to every search epsilon, so that the answer is still judged by an upper bound.
_QUICK_ROUNDING = 1e-6


def _search(epsilon_at: Callable[[float], float], target: float, tolerance: float, lower: float,
            upper: float | None, start: float, points: dict,
            first_slope: float | None = None) -> float:
    """A parameter x in [lower, upper] with target * (1 - tolerance) <= epsilon_at(x) <= target,
    for epsilon_at non-increasing in x; ``lower`` if it already meets the target; the upper end
    of a bracket narrower than 1e-9 relative if the window cannot be hit (a jump in epsilon).
    ``points`` (parameter -> epsilon, already known) is updated with every evaluation.

    Hand-written rather than dp_accounting's ``calibrate_dp_mechanism`` (Brent's method to an
    absolute tolerance in the parameter): that one needs ~10 evaluations of the accountant it is
    given, each a full PLD, and cannot stop as soon as a value lands inside the budget's window.
    Here epsilon is treated as a power of the parameter: secant steps on (log x, log epsilon)
    through the two latest points (a straight line for a Gaussian, nearly one for its
    compositions) usually reach the window in 3-5 evaluations; steps stay inside the bracket
    once there is one (else regula falsi, else bisection, in log x), so the search cannot fail
    on a curve that is not a power."""
    ceiling = math.inf if upper is None else upper
    aim = target * (1.0 - tolerance / 2.0)   # the middle of the window
    x = min(max(start, lower), ceiling)
    latest: list = [p for p in points if p != x]   # evaluation order, oldest first
    hi = None
    for _ in range(200):
        if x not in points:
            value = float(epsilon_at(x))
            points[x] = math.inf if math.isnan(value) else value
        latest.append(x)
        valid = [p for p, e in points.items() if e <= target]
        hi = min(valid) if valid else None
        below = [p for p, e in points.items() if e > target and (hi is None or p < hi)]
        lo = max(below) if below else None
        if hi is not None and (points[hi] >= target * (1.0 - tolerance) or hi <= lower):
            return hi
        if lo is not None and hi is not None and hi <= lo * (1.0 + 1e-9):
            return hi
        if hi is None and lo >= ceiling:
            raise ValueError(f"no parameter up to {ceiling:g} meets the target epsilon and delta")
        if hi is None and lo > 1e12:
            raise ValueError("no noise multiplier up to 1e12 meets the target epsilon and delta")
        x = _propose(points, latest, lo, hi, target, aim, lower, ceiling,
                     first_slope or _FIRST_SLOPE)
    if hi is None:
        raise ValueError("no parameter meets the target epsilon and delta")
    return hi   # only for an epsilon that is not monotone in the parameter


# The slope of log epsilon in log parameter assumed for the first step, before two points give
# one: between a Gaussian's (-1 at large noise, steeper at small) and that of DP-SGD's
# subsampled steps near epsilon 1 (-2.5 to -3). Measured over dpsgd/dpgd events at epsilon 0.5
# to 8, it saves a PLD in some calibrations against -1.
_FIRST_SLOPE = -2.0


def _slope(points: dict, a: float, b: float) -> float | None:
    """d log(epsilon) / d log(x) between two known points; None unless both epsilons are
    positive and finite, the points distinct and epsilon falls between them."""
    ea, eb = points[a], points[b]
    if a == b or not (0 < ea < math.inf and 0 < eb < math.inf):
        return None
    slope = (math.log(ea) - math.log(eb)) / (math.log(a) - math.log(b))
    return slope if slope < 0 else None


def _propose(points: dict, latest: list, lo: float | None, hi: float | None, target: float,
             aim: float, lower: float, ceiling: float, first_slope: float = _FIRST_SLOPE) -> float:
    """The next parameter for ``_search``: the secant step in (log x, log epsilon) towards
    ``aim`` through the two latest points; with a bracket [lo, hi], kept strictly inside it
    (else the regula falsi step through lo and hi, else bisection; bisection too after three
    evaluations in a row on one side of the target); without, an extrapolation from the known
    side by at most a factor 1000, with slope _FIRST_SLOPE until two points give one."""
    recent = list(dict.fromkeys(reversed(latest)))[:2]
    slope = _slope(points, recent[0], recent[1]) if len(recent) == 2 else None
    if lo is not None and hi is not None:
        a, b = math.log(lo), math.log(hi)
        sides = [points[p] <= target for p in latest[-3:]]
        candidates = []
        if not (len(sides) == 3 and len(set(sides)) == 1):
            if slope is not None:
                candidates.append(math.log(recent[0])
                                  + (math.log(aim) - math.log(points[recent[0]])) / slope)
            falsi = _slope(points, lo, hi)
            if falsi is not None:
                candidates.append(a + (math.log(aim) - math.log(points[lo])) / falsi)
        for u in candidates:
            if a < u < b and math.exp(u) not in points:
                return math.exp(u)
        return math.exp((a + b) / 2.0)
    side = lo if hi is None else hi
    e = points[side]
    slope = slope if slope is not None else first_slope
    slope = min(max(slope, -50.0), -0.1)   # a flat stretch moves by at most 1000x a step
    if hi is None:       # every point so far spends too much: more noise
        factor = 4.0 if e == math.inf else math.exp((math.log(aim) - math.log(e)) / slope)
        return min(side * min(max(factor, 1.0 + 1e-6), 1e3), ceiling)
    # every point so far meets the target with room to spare: less noise
    factor = 4.0 if e <= 0 else math.exp((math.log(e) - math.log(aim)) / slope)
    return max(side / min(max(factor, 1.0 + 1e-6), 1e3), lower)


@dataclasses.dataclass
class Release:
    """One kind of release: a name for the report, its DpEvent, how many times it happened, and
    the public parameters a reader needs to recompute it."""

    name: str
    event: events.DpEvent
    count: int
    params: dict

    def composed(self) -> events.DpEvent:
        return self_composed(self.event, self.count)


class Ledger:
    """Every release of a job, in order. Consecutive releases of the same kind are merged into one
    self-composed entry."""

    def __init__(self, accountant: str = "pld", neighbouring: str = ADD_REMOVE,
                 gate: Callable[[events.DpEvent], None] | None = None):
        make_accountant(accountant, neighbouring)  # validates both names
        self.accountant = accountant
        self.neighbouring = neighbouring
        self.releases: list[Release] = []
        # Sentences about how the accountant computed the epsilon (RDP_EXCLUDED_ORDERS_NOTE),
        # for the privacy report.
        self.notes: list[str] = []
        # The budget across runs (``beam_dp.ledger``): called with everything the job will have
        # released before it releases more; raises (BudgetExceeded) to stop it.
        self.gate = gate
        self._admitted: collections.Counter = collections.Counter()

    def admit(self, planned: events.DpEvent) -> None:
        """Before releases: ``planned`` is everything this job will have released once they are
        made (e.g. ``event_after(...)`` with a whole run's steps). The gate, if any, admits it
        or raises; what it admitted needs no second admission as it is recorded."""
        leaves = _leaf_counts(planned)
        if self.gate is not None and not _within(leaves, self._admitted):
            self.gate(planned)
        self._admitted |= leaves

    def record(self, name: str, event: events.DpEvent, count: int = 1, **params) -> None:
        """Records releases, admitted first (``admit``) unless already admitted: record before
        releasing, or admit the plan first (steps recorded after each chunk)."""
        if self.gate is not None:
            self.admit(self.event_after(name, event, count, **params))
        _record(self.releases, name, event, count, params)

    def event(self) -> events.DpEvent:
        return _composed(self.releases)

    def event_after(self, name: str, event: events.DpEvent, count: int, **params) -> events.DpEvent:
        """The event this ledger will hold after ``record(name, event, count, **params)``,
        without recording it (e.g. a run's whole plan, for ``progress_epsilon``)."""
        releases = [dataclasses.replace(r) for r in self.releases]
        _record(releases, name, event, count, params)
        return _composed(releases)

    @STOPWATCH
    def epsilon(self, delta: float) -> float:
        """The accountant's epsilon of everything recorded (memoized by event and delta)."""
        if not self.releases:
            return 0.0
        return epsilon_of(self.event(), delta, self.accountant, self.neighbouring, self.notes)

    def epsilon_of_releases(self, names, delta: float) -> float:
        """The epsilon of the releases named in ``names`` alone (e.g. those an audit's canaries
        take part in: a neighbour that changes only them is protected by their composition)."""
        chosen = [r for r in self.releases if r.name in set(names)]
        if not chosen:
            return 0.0
        return epsilon_of(_composed(chosen), delta, self.accountant, self.neighbouring)

    @STOPWATCH
    def progress_epsilon(self, delta: float, planned: events.DpEvent | None = None) -> float:
        """A cheap upper bound on the epsilon spent so far, for progress output after every
        chunk of steps (a full PLD after every chunk costs seconds and, at small noise, a lot of
        memory). With the RDP accountant it is ``epsilon``. With PLD it is the smaller of RDP's
        epsilon of the releases so far (over a few orders: milliseconds; inf for releases RDP
        cannot account) and, if ``planned`` (the whole run's event, e.g. ``event_after(...)``
        with the remaining steps) is given and its PLD epsilon is ready (the calibration starts
        it in the background; progress never waits for it): the releases so far are part of the plan, and composing more
        releases never lowers epsilon. So it never understates what was spent, ends at the
        reported value when the plan completes, and may overstate mid-run progress. Not the
        value to report: that is ``epsilon``."""
        if not self.releases:
            return 0.0
        if self.accountant == "rdp":
            return self.epsilon(delta)
        # RDP over a few orders (_SCALE_ORDERS): an upper bound as any set of orders gives, a
        # little looser than over all of dp_accounting's, in ~2 ms rather than 20-60 for the
        # first chunk of a subsampled Gaussian (each step's vector is then memoized).
        try:
            with _quiet_rdp():
                so_far = float(_RdpAccountant(_SCALE_ORDERS, _RELATIONS[self.neighbouring])
                               .compose(self.event()).get_epsilon(delta))
        except dp_accounting.UnsupportedEventError:
            so_far = math.inf
        if planned is None:
            return so_far
        ready = ready_epsilon(planned, delta, self.accountant, self.neighbouring)
        return so_far if ready is None else min(so_far, ready)

    def mechanisms(self) -> list[dict]:
        return [dict(name=r.name, count=r.count, **r.params) for r in self.releases]


def _leaf_counts(event: events.DpEvent) -> collections.Counter:
    """How many times each mechanism occurs in ``event`` (self-compositions counted out)."""
    if isinstance(event, events.ComposedDpEvent):
        total = collections.Counter()
        for e in event.events:
            total.update(_leaf_counts(e))
        return total
    if isinstance(event, events.SelfComposedDpEvent):
        return collections.Counter({k: v * event.count for k, v in _leaf_counts(event.event).items()})
    return collections.Counter({repr(event): 1})


def _within(leaves: collections.Counter, admitted: collections.Counter) -> bool:
    """Whether the mechanisms ``leaves`` are among those ``admitted`` (composition is monotone:
    fewer of the same mechanisms spend no more)."""
    return all(admitted[k] >= v for k, v in leaves.items())


def _record(releases: list, name: str, event: events.DpEvent, count: int, params: dict) -> None:
    if count <= 0:
        return
    last = releases[-1] if releases else None
    if last is not None and last.name == name and last.event == event and last.params == params:
        last.count += count
    else:
        releases.append(Release(name, event, count, params))


def _composed(releases: list) -> events.DpEvent:
    return events.ComposedDpEvent([r.composed() for r in releases])


def prior_event(ledger: "Ledger | None") -> events.DpEvent | None:
    """What ``ledger`` already holds (e.g. the quality check's release, reserved before
    training), for a calibration that must meet the run's target with it; None when empty."""
    return ledger.event() if ledger is not None and ledger.releases else None


def after(prior: events.DpEvent | None, event: events.DpEvent) -> events.DpEvent:
    """``event`` composed after ``prior`` (``prior_event``): what a calibration against the
    ledger measures; ``event`` itself without one (the same calibration as before)."""
    return event if prior is None else events.ComposedDpEvent([prior, event])


def self_composed(event: events.DpEvent, count: int) -> events.DpEvent:
    """``count`` runs of ``event``. k Gaussian mechanisms with multiplier s compose to exactly one
    Gaussian with multiplier s / sqrt(k) (their privacy-loss distributions are Gaussian), which
    accountants handle far more cheaply than a k-fold composition."""
    if count == 1:
        return event
    if isinstance(event, events.GaussianDpEvent):
        return events.GaussianDpEvent(event.noise_multiplier / math.sqrt(count))
    return events.SelfComposedDpEvent(event, count)


def gaussian_steps_event(noise_multiplier: float, sampling_probability: float, steps: int) -> events.DpEvent:
    """DP-SGD/DP-GD steps: a Gaussian sum query, Poisson-subsampled when q < 1."""
    step = events.GaussianDpEvent(noise_multiplier)
    if sampling_probability < 1.0:
        step = events.PoissonSampledDpEvent(sampling_probability, step)
    return self_composed(step, steps)


def generalized_gaussian_epsilon(sigma: float, sensitivity: float, kappa: float,
                                 delta: float) -> float:
    """The epsilon of the generalized Gaussian mechanism (paper 004, Lemma 3, from Bassily,
    Guzman & Nandi 2021): noise GG_{||.||+}(0, sigma^2), with ||.||+ the kappa-regular smooth
    norm of the dual space, on a query of dual-norm sensitivity s, is (epsilon, delta)-DP for
    sigma^2 = 2 kappa ln(1/delta) s^2 / epsilon^2, i.e. epsilon = s sqrt(2 kappa ln(1/delta)) /
    sigma. Used only where this epsilon is at most 1 (``generalized_gaussian_event``)."""
    if not (sigma > 0 and sensitivity >= 0 and kappa >= 1 and 0 < delta < 1):
        raise ValueError("the generalized Gaussian mechanism needs sigma > 0, sensitivity >= 0, "
                         "kappa >= 1 and delta in (0, 1)")
    return sensitivity * math.sqrt(2.0 * kappa * math.log(1.0 / delta)) / sigma


def generalized_gaussian_event(sigma: float, sensitivity: float, kappa: float,
                               delta: float) -> "ApproxDpEvent":
    """The generalized Gaussian mechanism as the (epsilon, delta) its lemma proves
    (``generalized_gaussian_epsilon``), an ``ApproxDpEvent``. Conservatively refused where that
    epsilon passes 1: the lemma generalizes the classical Gaussian-mechanism bound
    (sigma^2 = 2 ln(1.25/delta) s^2 / epsilon^2), which holds only for epsilon < 1, and its
    statement does not say it holds beyond. (With the Euclidean norm the noise is Gaussian: use
    ``GaussianDpEvent`` there, which dp_accounting accounts exactly at every epsilon.)"""
    epsilon = generalized_gaussian_epsilon(sigma, sensitivity, kappa, delta)
    if epsilon > 1.0:
        raise ValueError(f"a generalized Gaussian release at epsilon {epsilon:.3g} is beyond the "
                         "range (epsilon <= 1) its guarantee is used for: more noise, or a "
                         "smaller epsilon per release")
    return ApproxDpEvent(epsilon, delta)


def laplace_count_event(epsilon: float) -> events.DpEvent:
    """A count with sensitivity 1 released with Laplace noise of scale 1/epsilon."""
    return events.LaplaceDpEvent(1.0 / epsilon)


def event_to_json(event: events.DpEvent):
    """A DpEvent as plain JSON (from dp_accounting's own named-tuple form), for the report."""
    def convert(value):
        if hasattr(value, "_asdict"):
            d = value._asdict()
            d.pop("module_name", None)
            return {k: convert(v) for k, v in d.items()}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        return value
    return convert(event.to_named_tuple())


def event_from_json(value) -> events.DpEvent:
    """The inverse of ``event_to_json`` (for resuming from a checkpoint)."""
    if isinstance(value, list):
        return [event_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    fields = {k: event_from_json(v) for k, v in value.items() if k != "class_name"}
    own = {"PureDpEvent": PureDpEvent, "ApproxDpEvent": ApproxDpEvent}
    cls = own.get(value["class_name"]) or getattr(events, value["class_name"])
    return cls(**fields)
