"""This library's DpEvents: the two dp_accounting lacks (``PureDpEvent``, ``ApproxDpEvent``),
the events of its releases (``gaussian_steps_event``, ``laplace_count_event``, the generalized
Gaussian's), their algebra (``self_composed``, ``merged_gaussians``) and their JSON form."""
from __future__ import annotations

import math

import attr
from dp_accounting import dp_event as events


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
