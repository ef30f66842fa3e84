"""The Renyi filter that admits runs against a partition's lifetime budget.

Unit of privacy. Event level, per partition: two datasets are neighbours when they differ in
one record of one partition (added or removed, or replaced: the relation each run names, as in
``beam_dp.accounting``). A record lives in exactly one partition. A run's DpEvent is its
guarantee for one record of everything it reads, so a run reading k partitions charges its
whole event to each of the k. A person with records in several partitions (several days) is
protected per record, not per person. An unpartitioned dataset is a single partition. All the
charges of one dataset name the same neighbouring relation: the filter adds RDP curves, which
only makes sense for one relation.

The filter. For a partition with lifetime budget (epsilon, delta), a fixed grid ORDERS of k
Renyi orders, and delta' = delta / k, write conv(a, r) for dp_accounting's conversion of
"(a, r)-RDP" to an epsilon at delta' (``rdp_privacy_accountant.compute_epsilon`` on one order:
Canonne, Kamath & Steinke 2020, Prop. 12, with the KL / Bretagnolle-Huber bound for tiny r);
it is nondecreasing in r, so B(a) = sup{r : conv(a, r) <= epsilon} is a budget per order. Run
t, with RDP curve rho_t (dp_accounting's RDP of its composed DpEvent), is admitted iff

    there is an order a in ORDERS with  sum_{admitted i <= t} rho_i(a) <= B(a),
    i.e.  min_a conv(a, sum_i rho_i(a)) <= epsilon,

where the sum runs over every charge of the partition that is reserved or committed (a void
charge read no data). A refused run releases nothing.

Theorem. Whatever the runs, however many, and however each one's parameters (hence rho_t) and
the decision to submit it depend on the outputs released before it, everything the filter ever
admits on a partition is (epsilon, delta)-DP for one record of that partition.

Proof. (1) One order (Feldman & Zrnic 2021, "Individual privacy accounting via a Renyi filter",
Thm 3.1; Lecuyer 2021, "Practical privacy filters and odometers with Renyi DP"): a sequence of
adaptively chosen mechanisms, each admitted only while the running sum of their RDP at order a
stays <= B, is (a, B)-RDP as a whole; the proof is a supermartingale over exp((a-1)(privacy loss
- running RDP sum)), so it needs rho_t to be fixed only when run t starts, not in advance. A
refused run is a run with rho = 0 (the refusal is a function of what was already public). So
the process P_a that admits by order a alone is (a, B(a))-RDP, hence (epsilon, delta')-DP by
the conversion. (2) Several orders: let A be the first order of ORDERS within its budget after
the last admitted run (one exists, by the rule). On {A = a} every run the filter admitted also
fit order a when it was admitted (sums only grow) and every run it refused did not fit a either,
so the transcript is exactly P_a's. {A = a} is a function of the transcript, so for any set S
of transcripts and neighbours D, D': Pr_D[S] = sum_a Pr_D[P_a in S, A = a] <= sum_a (e^epsilon
Pr_D'[P_a in S, A = a] + delta') = e^epsilon Pr_D'[S] + k delta' = e^epsilon Pr_D'[S] + delta.

Why delta is split. Lecuyer 2021, and systems built on it, state the multi-order rule with the
whole delta at every order; that statement's proof could not be checked here, and under
adaptivity the order that stays within budget is itself random, so the ledger pays the union
bound of step (2): delta / k per order. It costs ln(k) / (a - 1) in epsilon at the best order
(e.g. a DP-SGD run of RDP epsilon 1.46 at delta 1e-5 reads as 1.86); a short grid keeps k small.

(epsilon, delta) releases (``ApproxDpEvent``: partition selection, objective perturbation)
bound no Renyi divergence. For each pair of neighbours such a release is an epsilon-DP mechanism
except on an event of probability at most its delta (Kairouz, Oh & Viswanath 2015, Lemma 3.1),
so the filter counts it as ``PureDpEvent(epsilon)`` in the RDP sums and takes the sum D of those
deltas off the budget's delta: a run is admitted iff min_a conv'(a, sum_i rho_i(a)) <= epsilon
and D < delta, conv' converting at (delta - D) / k. Off the union of the releases' bad events
(probability <= D) the argument above holds at delta - D; with it, (epsilon, delta).

Concurrent runs are covered: a run's event is fixed when it is admitted, and runs admitted
while others are still in flight depend on fewer outputs than the sequential order allows.
The rule only holds if a run's event does not depend on the data except through earlier
releases, if the caller voids a charge only when the run read no data, and if a resumed run
releases nothing beyond its event. Raising a budget (``replace=True``) is a policy decision:
the guarantee is then the largest budget ever set.
"""
from __future__ import annotations

import math

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from beam_dp import accounting
from beam_dp.accounting import rdp_accountant, relations

# The fixed grid. Changing it is safe (charges keep their events, and a curve stored on another
# grid is recomputed), but every order added costs a little epsilon (delta / k above).
ORDERS: tuple[float, ...] = (1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0,
                             24.0, 32.0, 64.0, 256.0)

_RELATION_NAMES = {
    accounting.ADD_REMOVE: accounting.ADD_REMOVE, "add_remove": accounting.ADD_REMOVE,
    accounting.REPLACE_ONE: accounting.REPLACE_ONE, "replace_one": accounting.REPLACE_ONE,
    # User-level runs: their own datasets in the ledger (``core.budget_dataset``).
    accounting.USER_ADD_REMOVE: accounting.USER_ADD_REMOVE,
}

VALIDITY = (
    "The ledger admits a run on a partition only if, at some Renyi order a of its fixed grid, "
    "the RDP of all the partition's reserved and committed runs plus this one stays within the "
    "order's budget: the RDP that dp_accounting's conversion turns into the lifetime epsilon at "
    "delta / k (k orders). For one order this is the Renyi filter of Feldman & Zrnic (2021) and "
    "Lecuyer (2021): runs whose parameters are chosen after seeing earlier outputs still compose "
    "to that RDP, because the proof bounds a supermartingale and never needs the parameters in "
    "advance. Across orders, splitting delta over the k orders (a union bound) makes the whole "
    "lifetime of the partition (epsilon, delta)-DP for one record of it. Epsilons are never "
    "added, and runs are not composed by PLD across runs, because neither is valid when runs "
    "are chosen adaptively. An (epsilon, delta) release enters the RDP sums as an epsilon-DP one, "
    "and its delta is taken off the budget's delta before the conversion.")


def relation(neighbouring: str) -> str:
    """``beam_dp.accounting``'s name of a neighbouring relation ('add_remove' and
    'replace_one' accepted too)."""
    try:
        return _RELATION_NAMES[neighbouring]
    except (KeyError, TypeError):
        raise ValueError(f"unknown neighbouring relation {neighbouring!r}; choose "
                         f"{accounting.ADD_REMOVE!r} or {accounting.REPLACE_ONE!r}") from None


# A charge's curve: its RDP at each order of ORDERS, then one more entry: the delta of its
# (epsilon, delta)-DP parts (``ApproxDpEvent``: objective perturbation, partition selection),
# which bound no Renyi divergence. Each such part is, for any pair of neighbours, an
# epsilon-DP mechanism except on an event of probability at most its delta (Kairouz, Oh &
# Viswanath 2015, Lemma 3.1; the decomposition used by every (epsilon, delta) composition
# theorem), so the filter counts it as ``PureDpEvent(epsilon)`` in the RDP sum and adds its
# delta to the failure probability: the partition's budget delta less the sum of those deltas
# is what the conversion of the RDP sum may use. Both parts add up over charges, so a curve
# stays a vector that sums.
CURVE_LENGTH = len(ORDERS) + 1


def rdp_curve(event, neighbouring: str, orders=ORDERS) -> np.ndarray:
    """A charge's curve (``CURVE_LENGTH`` above, on ``orders``): dp_accounting's RDP of
    ``event`` (the project's RDP accountant: the library's, plus ``PureDpEvent``) with each
    (epsilon, delta) part counted as its epsilon, then the sum of those parts' deltas.
    ValueError if RDP cannot account for the event."""
    pure, approx_delta = _approx_as_pure(event)
    acc = rdp_accountant._RdpAccountant(list(orders), relations._RELATIONS[relation(neighbouring)])
    try:
        with rdp_accountant._quiet_rdp():
            acc.compose(pure)
    except dp_accounting.UnsupportedEventError as error:
        raise ValueError(f"the RDP accountant cannot account for this event under "
                         f"{relation(neighbouring)}: {error}") from None
    curve = np.asarray(acc.rdp, dtype=float)
    if np.any(curve < 0):
        # dp_accounting's sign of numerical trouble; its conversion would read it as epsilon 0.
        raise ValueError("dp_accounting gave a negative RDP for this event (numerical "
                         "instability); the ledger does not charge it")
    return np.append(curve, approx_delta)


def _approx_as_pure(event):
    """(``event`` with each ``ApproxDpEvent(e, d)`` leaf as ``PureDpEvent(e)``, the sum of their
    deltas). Only composed and self-composed events are walked: an (epsilon, delta) part under
    sampling stays, and the RDP accountant refuses it (no amplification is claimed for it)."""
    from dp_accounting import dp_event as events
    if isinstance(event, accounting.ApproxDpEvent):
        return accounting.PureDpEvent(event.epsilon), float(event.delta)
    if isinstance(event, events.ComposedDpEvent):
        parts = [_approx_as_pure(e) for e in event.events]
        return events.ComposedDpEvent([p for p, _ in parts]), sum(d for _, d in parts)
    if isinstance(event, events.SelfComposedDpEvent):
        inner, delta = _approx_as_pure(event.event)
        return events.SelfComposedDpEvent(inner, event.count), delta * event.count
    return event, 0.0


def _split(curve, orders) -> tuple[np.ndarray, float]:
    """(the RDP part, the (epsilon, delta) parts' delta) of a curve; a curve stored before the
    delta entry existed has none."""
    curve = np.asarray(curve, dtype=float)
    if len(curve) == len(orders) + 1:
        return curve[:-1], float(curve[-1])
    return curve, 0.0


def delta_per_order(delta: float, orders=ORDERS) -> float:
    return delta / len(orders)


def order_epsilons(curve, delta: float, orders=ORDERS) -> np.ndarray:
    """conv(a, rdp(a)) for each order: the epsilon each order alone would certify, at what the
    (epsilon, delta) parts leave of ``delta``."""
    rdp, approx_delta = _split(curve, orders)
    if approx_delta >= delta:
        return np.full(len(orders), math.inf)
    d = delta_per_order(delta - approx_delta, orders)
    return np.array([float(rdp_privacy_accountant.compute_epsilon([a], [r], d)[0])
                     for a, r in zip(orders, rdp)])


def epsilon(curve, delta: float, orders=ORDERS) -> tuple[float, float]:
    """The filter's reading of a curve: (min over orders of conv(a, rdp(a)) at the delta the
    (epsilon, delta) parts leave, best order). A run is admitted iff this, for the partition's
    charges plus the run, is <= epsilon."""
    rdp, approx_delta = _split(curve, orders)
    if approx_delta >= delta:
        return math.inf, float(orders[0])
    if not np.any(rdp > 0):
        return 0.0, float(orders[0])
    value, order = rdp_privacy_accountant.compute_epsilon(
        list(orders), list(rdp), delta_per_order(delta - approx_delta, orders))
    value = float(value)
    return (value if not math.isnan(value) else math.inf), float(order)


def admits(rdp, budget_epsilon: float, budget_delta: float, orders=ORDERS) -> bool:
    return epsilon(rdp, budget_delta, orders)[0] <= budget_epsilon
