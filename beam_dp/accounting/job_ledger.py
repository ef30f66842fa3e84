"""The ledger of one job: every release, in order, as DpEvents (``Ledger``), its epsilon by the
job's accountant, a cheap bound for progress output, and the gate of the budget across runs
(``beam_dp.ledger``)."""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable

import dp_accounting
from dp_accounting import dp_event as events

from beam_dp.accounting.accountants import epsilon_of, make_accountant, ready_epsilon
from beam_dp.accounting.dp_events import self_composed
from beam_dp.accounting.pld_accountant import _SCALE_ORDERS
from beam_dp.accounting.rdp_accountant import _quiet_rdp, _RdpAccountant
from beam_dp.accounting.relations import _RELATIONS, ADD_REMOVE
from beam_dp.accounting.stopwatch import STOPWATCH


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

    def admit(self, planned: events.DpEvent, whole_run: bool = False) -> None:
        """Before releases: ``planned`` is everything this job will have released once they are
        made (e.g. ``event_after(...)`` with a whole run's steps). The gate, if any, admits it
        or raises; what it admitted needs no second admission as it is recorded. ``whole_run``:
        ``planned`` is all the run will release, which the gate may want to know
        (``beam_dp.ledger.runs.RunCharge.whole_run_admitted``: other runs may be admitted)."""
        leaves = _leaf_counts(planned)
        if self.gate is not None and not _within(leaves, self._admitted):
            self.gate(planned)
        self._admitted |= leaves
        if whole_run and self.gate is not None:
            getattr(self.gate, "whole_run_admitted", lambda: None)()

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
