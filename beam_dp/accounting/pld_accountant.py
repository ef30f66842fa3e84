"""The PLD accountant used here (``_PLDAccountant``): dp_accounting's, with this library's events,
a discretization chosen per composed event, and memoized answers.

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
"""
from __future__ import annotations

import collections
import math
import threading
from typing import Callable

import dp_accounting
import numpy as np
from dp_accounting import dp_event as events
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution

from beam_dp.accounting.dp_events import ApproxDpEvent, PureDpEvent, merged_gaussians
from beam_dp.accounting.fast_pld import (_fast_gaussian, _gaussian_pld, _laplace_pld,
                                         _quick_compose, _quick_self_compose)
from beam_dp.accounting.rdp_accountant import _quiet_rdp, _RdpAccountant
from beam_dp.accounting.relations import _RELATIONS, ADD_REMOVE, _relation_name
from beam_dp.accounting.stopwatch import STOPWATCH


_FAST_RELATIONS = (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                   dp_accounting.NeighboringRelation.REPLACE_SPECIAL)


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
# The last few PLDs built (by composed event, relation and interval): the report's privacy
# curve asks the run's own PLD for a dozen deltas, which would otherwise build it again (~1 s
# for a DP-SGD run). A few MB each (PLD_POINTS bounds their size).
_BUILT: collections.OrderedDict = collections.OrderedDict()
_BUILT_SIZE = 2
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
            key = (_event_key(event), self.neighboring_relation, interval)
            with _CACHE_LOCK:
                built = _BUILT.get(key)
            if built is None:
                built = None if not math.isfinite(interval) else \
                    _EagerPLDAccountant(self.neighboring_relation, interval).compose(event)
                with _CACHE_LOCK:
                    _BUILT[key] = built
                    while len(_BUILT) > _BUILT_SIZE:
                        _BUILT.popitem(last=False)
            self._built = (interval, built)
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
    return _log_space_epsilons(pld, [delta])[0]


def _log_space_epsilons(pld, deltas) -> list[float]:
    """``_log_space_epsilon`` for each of ``deltas``, the PMFs' running sums made once."""
    try:
        pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
        each = [_pmf_log_space_epsilons(pmf, deltas) for pmf in pmfs]
    except (AttributeError, TypeError, ValueError):
        return [math.inf] * len(deltas)
    return [max(values) for values in zip(*each)]


def _pmf_log_space_epsilons(pmf, deltas) -> list[float]:
    if hasattr(pmf, "_get_losses_probs"):          # sparse PMF
        losses, probs = pmf._get_losses_probs()
        losses, probs = np.asarray(losses, float)[::-1], np.asarray(probs, float)[::-1]
    else:                                           # dense PMF
        probs = np.asarray(pmf._probs, float)[::-1]
        top = pmf._lower_loss + len(probs) - 1
        losses = (top - np.arange(len(probs))) * pmf._discretization
    infinity_mass = float(pmf._infinity_mass)
    # Before row k (losses descending): the upper mass and log of sum(exp(-loss) * prob).
    with np.errstate(divide="ignore"):
        # FFT composition leaves masses of -1e-17 here and there: as zeros in the log.
        log_terms = np.log(np.maximum(probs, 0.0)) - losses
    upper = infinity_mass + np.concatenate([[0.0], np.cumsum(probs)])
    log_lower = np.concatenate([[-np.inf], np.logaddexp.accumulate(log_terms)])
    return [_pmf_epsilon_at(losses, upper, log_lower, infinity_mass, float(d)) for d in deltas]


def _pmf_epsilon_at(losses, upper, log_lower, infinity_mass: float, delta: float) -> float:
    if infinity_mass > delta:
        return math.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        candidate = np.log(upper - delta) - log_lower
    stop = (upper[:-1] > delta) & np.isfinite(log_lower[:-1]) & (candidate[:-1] >= losses)
    hits = np.flatnonzero(stop)
    if hits.size:
        return max(0.0, float(candidate[hits[0]]))
    if upper[-1] <= np.exp(log_lower[-1]) + delta:
        return 0.0
    return max(0.0, float(candidate[-1]))


PLD_FALLBACK_NOTE = (
    "PLD: dp_accounting's PLD could not evaluate this epsilon (above ~700 its arithmetic leaves "
    "the float range), so the RDP accountant's bound for the same releases is reported: also a "
    "valid upper bound, looser than PLD's.")
