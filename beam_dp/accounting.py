"""Privacy accounting with dp_accounting: one ledger of DpEvents per job, calibration, epsilon.

Epsilon always comes from a dp_accounting accountant (PLD by default, RDP as an option) applied to
the composition of everything the ledger holds; nothing here is a hand formula.
"""
from __future__ import annotations

import dataclasses
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


class _PLDAccountant(pld_privacy_accountant.PLDAccountant):
    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, PureDpEvent):
            if do_compose:
                pld = privacy_loss_distribution.from_privacy_parameters(
                    pld_common.DifferentialPrivacyParameters(event.epsilon, 0.0),
                    value_discretization_interval=self._value_discretization_interval)
                self._pld = self._pld.compose(pld.self_compose(count))
            return None
        return super()._maybe_compose(event, count, do_compose)


class _RdpAccountant(rdp_privacy_accountant.RdpAccountant):
    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, PureDpEvent):
            if do_compose:
                self._rdp += count * np.minimum(event.epsilon, self._orders * event.epsilon ** 2 / 2)
            return None
        return super()._maybe_compose(event, count, do_compose)


def make_accountant(kind: str = "pld", neighbouring: str = ADD_REMOVE) -> dp_accounting.PrivacyAccountant:
    relation = _RELATIONS[neighbouring]
    if kind == "pld":
        return _PLDAccountant(neighboring_relation=relation)
    if kind == "rdp":
        return _RdpAccountant(neighboring_relation=relation)
    raise ValueError(f"unknown accountant {kind!r}; choose one of {', '.join(ACCOUNTANTS)}")


def epsilon_of(event: events.DpEvent, delta: float, accountant: str = "pld",
               neighbouring: str = ADD_REMOVE) -> float:
    return float(make_accountant(accountant, neighbouring).compose(event).get_epsilon(delta))


def calibrate_noise_multiplier(make_event: Callable[[float], events.DpEvent], epsilon: float,
                               delta: float, accountant: str = "pld",
                               neighbouring: str = ADD_REMOVE,
                               lower: float = 0.3, guess: float = 1.0,
                               upper: float | None = None) -> float:
    """The smallest parameter (within 1e-4) whose event meets (epsilon, delta), for events whose
    epsilon falls as the parameter grows (a noise multiplier, or any inverse budget scale).

    The default search starts at 0.3: PLD discretization of a Gaussian with a much smaller
    multiplier needs gigabytes, and budgets that allow less noise are out of this tool's scope.
    """
    def calibrate(kind, bracket):
        return float(dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(kind, neighbouring), make_event, epsilon, delta, bracket,
            tol=1e-4))

    if upper is not None:
        return calibrate(accountant, dp_accounting.ExplicitBracketInterval(lower, upper))
    # RDP first: cheap at any parameter, and never below what PLD needs, so it brackets the PLD
    # search away from tiny multipliers (a PLD of many steps at a small multiplier can take
    # gigabytes). Parameters below ``lower`` are not searched.
    rdp = calibrate("rdp", dp_accounting.LowerEndpointAndGuess(min(lower, 1e-2), guess))
    if accountant == "rdp":
        return rdp
    if make_accountant(accountant, neighbouring).compose(make_event(0.5 * rdp)).get_epsilon(delta) > epsilon:
        return calibrate(accountant, dp_accounting.ExplicitBracketInterval(0.5 * rdp, rdp))
    return calibrate(accountant, dp_accounting.LowerEndpointAndGuess(max(lower, 0.1 * rdp), 0.5 * rdp))


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

    def record(self, name: str, event: events.DpEvent, count: int = 1, **params) -> None:
        if count <= 0:
            return
        last = self.releases[-1] if self.releases else None
        if last is not None and last.name == name and last.event == event and last.params == params:
            last.count += count
        else:
            self.releases.append(Release(name, event, count, params))

    def event(self) -> events.DpEvent:
        return events.ComposedDpEvent([r.composed() for r in self.releases])

    def epsilon(self, delta: float) -> float:
        if not self.releases:
            return 0.0
        return epsilon_of(self.event(), delta, self.accountant, self.neighbouring)

    def mechanisms(self) -> list[dict]:
        return [dict(name=r.name, count=r.count, **r.params) for r in self.releases]


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
