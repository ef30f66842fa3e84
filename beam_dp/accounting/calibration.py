"""Calibration: the smallest noise multiplier (or any inverse budget scale) whose event meets a
target (epsilon, delta), by a search on the accountant's epsilons (``calibrate_noise_multiplier``).

Cost (issue 10, item 4: accounting off the critical path). A calibration searches on PLDs up
to PROBE_FACTOR times coarser than the reporting grid (pessimistic too, as coarse as the report's
precision allows: ``_probe_factor``), from a Gaussian-DP guess (``noise_multiplier_guess``);
the reporting grid's PLD of its answer is made in a background thread while the job trains
(``accountants.prefetch_epsilon``) and the ledger's report reuses it (memo keys ignore how
compositions are nested); the search's PLDs are built and composed by ``fast_pld``'s
vectorized constructions (the library's result to the bit, or within ``_QUICK_ROUNDING``,
charged on the safe side); RDP remembers each step's vector, so progress after every chunk
costs a multiplication. ``STOPWATCH.seconds`` is the driver's time in all this (a wait for the
background PLD included), for the benchmark.
"""
from __future__ import annotations

import collections
import math
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp.accounting.accountants import (epsilon_of, make_accountant, prefetch_epsilon,
                                            settle)
from beam_dp.accounting.fast_pld import _laplace_pld
from beam_dp.accounting.pld_accountant import (_BUILT, _CACHE_LOCK, _EPSILON_CACHE, _SCALE_ORDERS,
                                               DEFAULT_DISCRETIZATION, MAX_DISCRETIZATION,
                                               _EagerPLDAccountant, _event_key, _interval_for,
                                               _log_space_epsilon, _scale_estimate)
from beam_dp.accounting.rdp_accountant import _RDP_STEPS, _quiet_rdp, _RdpAccountant
from beam_dp.accounting.relations import _RELATIONS, ADD_REMOVE
from beam_dp.accounting.stopwatch import STOPWATCH


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
    accountant's discretization follows the size of the privacy loss (``pld_accountant``).
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


def clear_caches() -> None:
    """Forgets every memoized epsilon, calibration and RDP step: the next run in this process is
    accounted as in a fresh one (pipelines/benchmark.py compares runs this way)."""
    settle()   # a prefetch under way would fill the cache afterwards
    _EPSILON_CACHE.clear()
    _BUILT.clear()
    _RDP_STEPS.clear()
    _CALIBRATIONS.clear()
    _laplace_pld.cache_clear()
