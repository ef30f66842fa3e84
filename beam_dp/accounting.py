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
the bound stays valid. Where RDP only brackets the PLD search or estimates a PLD's scale, the
messages say nothing about the result and are filtered out (``_quiet_rdp``, by message, only
around those calls); where RDP is the reporting accountant, they are collected and the ledger
gives them as a sentence in ``Ledger.notes``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
from typing import Callable

import attr
import dp_accounting
import numpy as np
from dp_accounting import dp_event as events
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

ACCOUNTANTS = ("pld", "rdp")
ADD_REMOVE = "add/remove"
REPLACE_ONE = "replace-one"

_RELATIONS = {
    ADD_REMOVE: dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    REPLACE_ONE: dp_accounting.NeighboringRelation.REPLACE_ONE,
}


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


class _EagerPLDAccountant(pld_privacy_accountant.PLDAccountant):
    """dp_accounting's PLD accountant with ``PureDpEvent``; builds the PLD as events come."""

    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, PureDpEvent):
            if do_compose:
                pld = privacy_loss_distribution.from_privacy_parameters(
                    pld_common.DifferentialPrivacyParameters(event.epsilon, 0.0),
                    value_discretization_interval=self._value_discretization_interval)
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


MAX_DISCRETIZATION = 256.0   # exp(interval) must stay finite in dp_accounting (< ~709)


def pld_discretization_interval(event: events.DpEvent, neighbouring: str = ADD_REMOVE) -> float:
    """The PLD discretization interval used for ``event``: 1e-4 (dp_accounting's default) while
    RDP's epsilon of the event at delta 1e-10 (an upper estimate of the privacy loss's range) is
    at most PLD_POINTS * 1e-4 = 20, else 1e-4 times the power of two at or above that epsilon /
    20: the grid then has PLD_POINTS to 2 PLD_POINTS cells per epsilon of loss range (a
    Gaussian's loss range is about 2 epsilon wide). The power of two keeps the interval the same
    for events that differ only by rounding, so a calibration and the report that recomputes it
    use the same grid. inf when the RDP estimate is itself not finite (epsilon is then reported
    as inf rather than building a PLD without bound)."""
    try:
        with _quiet_rdp():
            estimate = _RdpAccountant(neighboring_relation=_RELATIONS[neighbouring]).compose(
                event).get_epsilon(_ESTIMATE_DELTA)
    except dp_accounting.UnsupportedEventError:
        return DEFAULT_DISCRETIZATION   # no RDP for it: dp_accounting's own default
    if not math.isfinite(estimate):
        return math.inf
    ratio = estimate / (PLD_POINTS * DEFAULT_DISCRETIZATION)
    if ratio <= 1.0:
        return DEFAULT_DISCRETIZATION
    interval = DEFAULT_DISCRETIZATION * 2.0 ** math.ceil(math.log2(ratio))
    # Beyond MAX_DISCRETIZATION (losses of millions of nats) dp_accounting's PLD overflows
    # (exp of the interval): no PLD; the epsilon is then RDP's (``_PLDAccountant``).
    return interval if interval <= MAX_DISCRETIZATION else math.inf


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
        key = (kind, repr(self.ledger), self.neighboring_relation, self._fixed_interval, value)
        if key not in _EPSILON_CACHE:
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
                with _quiet_rdp():
                    result = float(_RdpAccountant(neighboring_relation=self.neighboring_relation)
                                   .compose(self.ledger).get_epsilon(value))
                fallback = True
            _EPSILON_CACHE[key] = (result, fallback)
            while len(_EPSILON_CACHE) > _EPSILON_CACHE_SIZE:
                _EPSILON_CACHE.popitem(last=False)
        _EPSILON_CACHE.move_to_end(key)
        result, fallback = _EPSILON_CACHE[key]
        self.rdp_fallback = self.rdp_fallback or fallback
        return result

    def _non_private(self) -> bool:
        eager = self._eager()
        return eager is not None and eager._contains_non_dp_event

    def get_epsilon(self, target_delta: float) -> float:
        return self._memo("epsilon", target_delta, lambda a: a.get_epsilon(target_delta), math.inf)

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


class _RdpAccountant(rdp_privacy_accountant.RdpAccountant):
    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, PureDpEvent):
            if do_compose:
                self._rdp += count * np.minimum(event.epsilon, self._orders * event.epsilon ** 2 / 2)
            return None
        return super()._maybe_compose(event, count, do_compose)


def _relation_name(relation) -> str:
    return next(name for name, r in _RELATIONS.items() if r == relation)


_RDP_CONVERGENCE = "_compute_log_a_frac failed to converge"


class _RdpConvergenceFilter(logging.Filter):
    """Drops (and counts) dp_accounting's RDP non-convergence messages, and only those."""

    def __init__(self):
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_RDP_CONVERGENCE):
            self.dropped += 1
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


def make_accountant(kind: str = "pld", neighbouring: str = ADD_REMOVE) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant. The PLD one chooses its discretization per composed event and
    memoizes its answers (see the module docstring)."""
    relation = _RELATIONS[neighbouring]
    if kind == "pld":
        return _PLDAccountant(neighboring_relation=relation)
    if kind == "rdp":
        return _RdpAccountant(neighboring_relation=relation)
    raise ValueError(f"unknown accountant {kind!r}; choose one of {', '.join(ACCOUNTANTS)}")


def epsilon_of(event: events.DpEvent, delta: float, accountant: str = "pld",
               neighbouring: str = ADD_REMOVE, notes: list | None = None) -> float:
    """Epsilon of ``event`` at ``delta``. ``notes`` (a list), if given, receives a sentence for
    the report when the value needs one: RDP_EXCLUDED_ORDERS_NOTE (RDP accountant, orders left
    out) or PLD_FALLBACK_NOTE (PLD accountant, RDP's bound used beyond PLD's float range)."""
    acc = make_accountant(accountant, neighbouring)
    with _quiet_rdp() as quiet:
        value = float(acc.compose(event).get_epsilon(delta))
    if notes is not None:
        if accountant == "rdp" and quiet.dropped and RDP_EXCLUDED_ORDERS_NOTE not in notes:
            notes.append(RDP_EXCLUDED_ORDERS_NOTE)
        if getattr(acc, "rdp_fallback", False) and PLD_FALLBACK_NOTE not in notes:
            notes.append(PLD_FALLBACK_NOTE)
    return value


# Noise multipliers (parameters) below this are not searched: if even this little noise meets
# the target, it is returned (more noise than needed, so still within the budget).
MIN_PARAMETER = 1e-6


def calibrate_noise_multiplier(make_event: Callable[[float], events.DpEvent], epsilon: float,
                               delta: float, accountant: str = "pld",
                               neighbouring: str = ADD_REMOVE,
                               lower: float = MIN_PARAMETER, guess: float = 1.0,
                               upper: float | None = None) -> float:
    """The smallest parameter (within 1e-4, or 1e-4 relative below 1) whose event meets
    (epsilon, delta), for events whose epsilon falls as the parameter grows (a noise multiplier,
    or any inverse budget scale). Parameters below ``lower`` are not searched: if ``lower``
    already meets the target, it is returned. With ``upper``, the search is within
    [lower, upper].

    Any epsilon works, including 1e6, within a few seconds and well under 1 GB: the PLD
    accountant's discretization follows the size of the privacy loss (module docstring).
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a positive number, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")

    def eps_at(kind: str, parameter: float) -> float:
        return epsilon_of(make_event(parameter), delta, kind, neighbouring)

    def calibrate(kind: str, lo: float, hi: float, tol: float | None = None) -> float:
        # brentq's tolerance is absolute: relative below 1 so that small multipliers are as
        # precise as large ones. RDP's convergence messages about the probes say nothing about
        # the released parameter (the ledger's epsilon is recomputed, with its notes).
        with _quiet_rdp():
            return float(dp_accounting.calibrate_dp_mechanism(
                lambda: make_accountant(kind, neighbouring), make_event, epsilon, delta,
                dp_accounting.ExplicitBracketInterval(lo, hi), tol=tol or 1e-4 * min(1.0, lo)))

    if upper is not None:
        return calibrate(accountant, lower, upper, 1e-4)
    # RDP first: cheap at any parameter, and (its epsilon being the larger) usually just above
    # what PLD needs, so the PLD search starts there and needs few PLDs. Its convergence
    # messages say nothing about the PLD result: filtered (module docstring).
    with _quiet_rdp():
        bracket = _bracket(lambda s: eps_at("rdp", s) > epsilon, lower, max(guess, 2 * lower))
        rdp = bracket[1] if bracket[0] is None else calibrate("rdp", *bracket)
    if accountant == "rdp":
        return rdp
    lo, hi = _bracket(lambda s: eps_at(accountant, s) > epsilon, lower, rdp)
    return hi if lo is None else calibrate(accountant, lo, hi)


def _bracket(too_small: Callable[[float], bool], lower: float,
             start: float) -> tuple[float | None, float]:
    """(lo, hi) with too_small(lo) and not too_small(hi), by doubling ``start`` until it is not
    too small and then halving; lo None when even ``lower`` is not too small (hi = lower then).
    The parameter's epsilon falls as it grows. PLD evaluations are memoized, so the
    calibration that follows gets its endpoints for free."""
    hi = max(start, lower)
    while too_small(hi):
        if hi > 1e12:
            raise ValueError("no noise multiplier up to 1e12 meets the target epsilon and delta")
        hi *= 2.0
    lo = hi / 2.0
    while lo > lower and not too_small(lo):
        hi, lo = lo, lo / 2.0
    if lo <= lower:
        if not too_small(lower):
            return None, lower
        lo = lower
    return lo, hi


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

    def __init__(self, accountant: str = "pld", neighbouring: str = ADD_REMOVE):
        make_accountant(accountant, neighbouring)  # validates both names
        self.accountant = accountant
        self.neighbouring = neighbouring
        self.releases: list[Release] = []
        # Sentences about how the accountant computed the epsilon (RDP_EXCLUDED_ORDERS_NOTE),
        # for the privacy report.
        self.notes: list[str] = []

    def record(self, name: str, event: events.DpEvent, count: int = 1, **params) -> None:
        _record(self.releases, name, event, count, params)

    def event(self) -> events.DpEvent:
        return _composed(self.releases)

    def event_after(self, name: str, event: events.DpEvent, count: int, **params) -> events.DpEvent:
        """The event this ledger will hold after ``record(name, event, count, **params)``,
        without recording it (e.g. a run's whole plan, for ``progress_epsilon``)."""
        releases = [dataclasses.replace(r) for r in self.releases]
        _record(releases, name, event, count, params)
        return _composed(releases)

    def epsilon(self, delta: float) -> float:
        """The accountant's epsilon of everything recorded (memoized by event and delta)."""
        if not self.releases:
            return 0.0
        return epsilon_of(self.event(), delta, self.accountant, self.neighbouring, self.notes)

    def progress_epsilon(self, delta: float, planned: events.DpEvent | None = None) -> float:
        """A cheap upper bound on the epsilon spent so far, for progress output after every
        chunk of steps (a full PLD after every chunk costs seconds and, at small noise, a lot of
        memory). With the RDP accountant it is ``epsilon``. With PLD it is the smaller of RDP's
        epsilon of the releases so far (milliseconds) and, if ``planned`` (the whole run's event,
        e.g. ``event_after(...)`` with the remaining steps) is given, its PLD epsilon, computed
        once and memoized: the releases so far are part of the plan, and composing more
        releases never lowers epsilon. So it never understates what was spent, ends at the
        reported value when the plan completes, and may overstate mid-run progress. Not the
        value to report: that is ``epsilon``."""
        if not self.releases:
            return 0.0
        if self.accountant == "rdp":
            return self.epsilon(delta)
        with _quiet_rdp():
            so_far = epsilon_of(self.event(), delta, "rdp", self.neighbouring)
        if planned is None:
            return so_far
        return min(so_far, epsilon_of(planned, delta, self.accountant, self.neighbouring))

    def mechanisms(self) -> list[dict]:
        return [dict(name=r.name, count=r.count, **r.params) for r in self.releases]


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
    cls = PureDpEvent if value["class_name"] == "PureDpEvent" else getattr(events, value["class_name"])
    return cls(**fields)
