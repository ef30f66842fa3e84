"""The dataset size n under add/remove one example: public (``--num-examples``), or a private
count recorded in the ledger (``release_dataset_size``), with the public facts about its error
that every use of it needs (the normalizer floor).
"""
from __future__ import annotations

import math
from typing import Callable, Protocol

from beam_dp import accounting, mechanisms
from beam_dp.algorithms.base import Aggregator


class CountRequest(Protocol):
    """What ``release_dataset_size`` reads of a run's configuration (e.g. a ``NoisyGDConfig``)."""

    num_examples: int | None
    count_epsilon: float | None
    epsilon: float | None
    noise: str | None


# The default budget of the private count, as a share of epsilon. Reconsidered with dpgd and
# dpsgd's plan (``noisy_gd._plan``): no use of the count is sensitive to its error beyond a
# proportional scale (q, the normalizers, the dpgd step count), or at most logarithmically
# (DPSGD-F's failure probabilities); quantile targets no longer read it. Its cost is small:
# calibrated with PLD at epsilon 0.5-4, a 1% count raises the steps' noise multiplier by 0.1%,
# 2% by 0.25% and 5% by 1.5%. Its error (scale 1/(share * epsilon)) is what small tables feel:
# at 1% and epsilon 1 it is +-300 rows at 95% and the normalizer floor 391 rows, so a table of a
# few hundred rows had its gradients divided by up to 4x its size and barely left the start
# (airquality with its documented ranges, 93 labelled training rows: RMSE 44.1 against the
# constant's 34.3; 31.5 at 5%; iris 0.822 -> 0.856, Boston 5.77 -> 5.62, larger tables
# unchanged: pipelines/bench_raw_tables.py --train-option count_epsilon=0.05, 3 seeds). At 5%
# the error is +-60 rows and the floor 78 rows.
COUNT_SHARE = 0.05
# The count's error bound used for the normalizer floor: P(count < n - t) = COUNT_FAILURE.
COUNT_FAILURE = 0.01


def release_dataset_size(config: CountRequest, aggregator: Aggregator, seed: int,
                         ledger: accounting.Ledger,
                         exact_count: Callable[[], int] | None = None) -> dict:
    """n for q and the normalizers: public (``num_examples``) or a Laplace count in the ledger
    (budget ``count_epsilon``, default COUNT_SHARE of epsilon, or 0.01 with a noise multiplier).

    Besides the value (at least 1), the dict gives public facts about its error, all functions
    of the count's budget only: the Laplace scale b, the 95% error bound b ln 20, and
    ``normalizer_floor`` = b ln(1 / (2 COUNT_FAILURE)), the bound below which the true n
    exceeds the noisy one with probability COUNT_FAILURE (a public n has none: floor 1).
    Normalizers use max(n, floor): a count that undershoots (on tiny data it may be clamped to 1)
    then cannot blow up a gradient or a mean (at worst the true n is n_noisy + floor
    <= 2 max(n_noisy, floor)), while at any n well above the floor nothing changes.
    ``exact_count`` (default ``aggregator.count``): what is counted, e.g. the users of a
    user-level run (sensitivity 1 under its relation too)."""
    if config.num_examples is not None:
        return {"source": "public (--num-examples)", "value": int(config.num_examples)}
    count_epsilon = config.count_epsilon or (COUNT_SHARE * config.epsilon if config.epsilon else 0.01)
    scale = 1.0 / count_epsilon
    # Recorded (admitted by a budget ledger across runs, if any) before the count is made.
    if config.noise != "float":   # None: secure by default
        # The count is an integer and its sensitivity 1: a discrete Laplace of scale 1/eps is
        # eps-DP exactly, accounted as such (a PureDpEvent: dp_accounting's RDP accountant has
        # no discrete Laplace event, and its continuous Laplace curve would understate it).
        ledger.record("discrete_laplace_count", accounting.PureDpEvent(count_epsilon),
                      epsilon=count_epsilon, sensitivity=1, noise="discrete Laplace")
        noisy = (exact_count or aggregator.count)() + int(mechanisms.discrete_laplace(
            mechanisms.secure_generator(seed, mechanisms.STREAM_COUNT), scale, ()))
        source = "private estimate: discrete Laplace count"
    else:
        ledger.record("laplace_count", accounting.laplace_count_event(count_epsilon),
                      epsilon=count_epsilon, sensitivity=1, noise="float Laplace")
        noisy = (exact_count or aggregator.count)() + mechanisms.laplace_noise(
            mechanisms.rng(seed, mechanisms.STREAM_COUNT), scale)
        source = "private estimate: Laplace count"
    return {"source": source, "value": max(1, int(round(noisy))),
            "count_epsilon": count_epsilon, "laplace_scale": scale,
            "error_bound_95": scale * math.log(20.0),
            "normalizer_floor": scale * math.log(1.0 / (2.0 * COUNT_FAILURE))}
