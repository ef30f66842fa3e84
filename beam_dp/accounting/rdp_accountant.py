"""dp_accounting's RDP accountant, extended: ``PureDpEvent``, replace-one units, and each step's
RDP vector memoized (``_RdpAccountant``); and its "failed to converge" messages kept quiet.

dp_accounting's RDP code logs "_compute_log_a_frac failed to converge ... Excluding this order"
for some fractional orders (absl logging). Excluding an order can only raise the RDP epsilon, so
the bound stays valid. Where RDP only estimates a PLD's scale or gives progress between chunks,
the messages say nothing about the result and are filtered out (``_quiet_rdp``, by message, only
around those calls); where RDP is the reporting accountant, they are collected and the ledger
gives them as a sentence in ``Ledger.notes`` (also when a memoized step no longer prints them).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading

import dp_accounting
import numpy as np
from dp_accounting import dp_event as events
from dp_accounting.rdp import rdp_privacy_accountant

from beam_dp.accounting.dp_events import PureDpEvent
from beam_dp.accounting.relations import _RELATIONS, REPLACE_ONE


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
