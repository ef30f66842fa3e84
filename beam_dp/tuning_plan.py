"""The public plan of a private hyperparameter selection (``beam_dp.tuning``): the law of the
number K of candidates (a truncated negative binomial, Papernot & Steinke's random stopping) and
the noise that makes the whole run, the count, the ranges, the quality check and the selection
of the best of K candidates, meet (epsilon, delta) by dp_accounting's RDP accountant. Public:
computed from the request alone, before any data is read, and recorded in the report.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from dp_accounting import dp_event as events
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from beam_dp import accounting
from beam_dp.dataset_size import COUNT_SHARE

# The number of candidates: logarithmic (shape 0) of mean 3. Each candidate's Gaussian multiplier
# (training and score together) by dp_accounting's RDP accountant at (1, 1e-5), against 4.05 for
# one Gaussian release at the same budget (``plan``), with the quality check off (with it on at
# its default share, 5.63 6.07 6.54 7.06 and 6.30 6.99 7.73 8.59: docs/benchmarks/privacy-features.md):
#     mean        2     3     5    10
#     shape 0   5.61  6.06  6.51  7.04      P[K = 1]: 0.57 0.45 0.35 0.27
#     shape 1   6.28  6.97  7.70  8.55      P[K = 1]: 0.50 0.33 0.20 0.10
# (dp_accounting takes shapes >= 0 only: Papernot & Steinke's eta in (-1, 0) is not available.)
# The noise is what a tuned model pays on small tables, so the cheapest law that still tries a
# few settings: shape 0, mean 3 (1.5x one run's noise; it was 2.1x at geometric mean 10). A lone
# candidate (P 0.45) is train's setting with probability 0.56 (``setting_law``) and otherwise a
# neighbour of it in the narrow grid. Measured over 10 seeds (narrow grid, default share 1/2):
# mean 2 / 3 logarithmic and mean 3 geometric within 0.004 of each other on all three tables.
DEFAULT_MEAN_CANDIDATES = 3.0
DEFAULT_SHAPE = 0.0
DEFAULT_SCORE_SHARE = 0.1      # of the candidate's 1 / sigma^2
DEFAULT_COUNT_SHARE = COUNT_SHARE   # of epsilon: train's private count's


# ------------------------------------------------------------------- a regression's score bound

NO_SCORE_BOUND = ("a regression's score needs --score-bound (the absolute error, in label units, "
                  "at which a scored row scores 0), or a range of its label to take it from: "
                  "declared (the schema's bounds) or released (--scale-features auto or private)")


def label_score_bound(scaling: dict | None) -> float | None:
    """A regression's default score bound: half the width of its label's range, declared or
    privately released by the ranges' pass (public either way, and released before any candidate
    trains): an error of half the label's spread scores 0, as a useless model's would. Its 2nd-
    98th percentile range when released, which on MASS Boston is about [10, 50]: 20 ($1000s),
    against the 10 chosen by hand before."""
    scaling = scaling or {}
    label = ((scaling.get("declared_bounds") or {}).get("label")
             or (scaling.get("column_bounds") or {}).get("label"))
    if label is None or not label[1] > label[0]:
        return None
    return (float(label[1]) - float(label[0])) / 2.0


# ------------------------------------------------------------------- the number of candidates

def _gamma(mean: float, shape: float) -> float:
    """The truncated negative binomial's gamma for ``mean`` and ``shape``: dp_accounting's own
    (conservative) inversion, so that the law drawn from is the one accounted."""
    return rdp_lib._gamma_truncated_negative_binomial(shape, mean)


def check_repetitions(mean: float, shape: float) -> None:
    if not (math.isfinite(mean) and mean >= 1):
        raise ValueError("the mean number of candidates must be a number, at least 1")
    if not (math.isfinite(shape) and shape >= 0):
        raise ValueError("the shape of the number of candidates must be a finite number >= 0 "
                         "(0 logarithmic, 1 geometric; the Poisson law is not supported)")


def draw_candidates(generator: np.random.Generator, mean: float, shape: float) -> int:
    """K >= 1 from the truncated negative binomial law dp_accounting accounts for
    ``RepeatAndSelectDpEvent(event, mean, shape)`` (Papernot & Steinke, Def. 1):
    P[K = k] proportional to binom(k + shape - 1, k) (1 - gamma)^k for k >= 1; shape 0 is the
    logarithmic law P[K = k] proportional to (1 - gamma)^k / k. Mean 1 is K = 1."""
    check_repetitions(mean, shape)
    if mean == 1:
        return 1
    gamma = _gamma(mean, shape)
    if shape == 0:
        return int(generator.logseries(1.0 - gamma))
    while True:   # the negative binomial given K >= 1: P[K = 0] = gamma^shape < 1
        k = int(generator.negative_binomial(shape, gamma))
        if k >= 1:
            return k


def candidates_law(mean: float, shape: float, upto: int) -> np.ndarray:
    """P[K = k] for k = 1..upto (the tests' reference)."""
    if mean == 1:
        return np.eye(1, upto)[0]
    gamma = _gamma(mean, shape)
    k = np.arange(1, upto + 1)
    from scipy.special import gammaln
    if shape == 0:
        log_p = k * math.log1p(-gamma) - np.log(k)
        return np.exp(log_p) / -math.log(gamma)
    log_p = (gammaln(k + shape) - gammaln(shape) - gammaln(k + 1) + shape * math.log(gamma)
             + k * math.log1p(-gamma))
    return np.exp(log_p) / (1.0 - gamma ** shape)


# ------------------------------------------------------------------------------ the budget plan

@dataclasses.dataclass(frozen=True)
class Plan:
    """The public noise plan of a tuning run."""

    sigma_train: float        # one candidate's training: Gaussian multiplier (T steps composed)
    sigma_score: float        # its score's Gaussian std (sensitivity 1)
    count_epsilon: float      # the pair of counts' Laplace budget
    mean: float
    shape: float
    scale_epsilon: float = 0.0   # the columns' quantiles, released once (0: no scaling)
    # The chosen model's private quality check (``quality.reserve``): its Gaussian multiplier,
    # released once after the selection, outside it (0: quality_check "off").
    quality_multiplier: float = 0.0

    def candidate_event(self) -> events.DpEvent:
        return events.ComposedDpEvent([events.GaussianDpEvent(self.sigma_train),
                                       events.GaussianDpEvent(self.sigma_score)])

    def selection_event(self) -> events.DpEvent:
        return events.RepeatAndSelectDpEvent(self.candidate_event(), self.mean, self.shape)

    def count_event(self) -> events.DpEvent:
        return accounting.laplace_count_event(self.count_epsilon)

    def event(self) -> events.DpEvent:
        """The run's event, as planned: the quantiles' exponential mechanisms are bounded by one
        pure-DP event of their total epsilon (in RDP, sum_j min(e_j, a e_j^2 / 2) is at most
        min(sum e_j, a (sum e_j)^2 / 2))."""
        first = [self.count_event()]
        if self.scale_epsilon:
            first.append(accounting.PureDpEvent(self.scale_epsilon))
        if self.quality_multiplier:
            first.append(events.GaussianDpEvent(self.quality_multiplier))
        return events.ComposedDpEvent(first + [self.selection_event()])


def plan(epsilon: float, delta: float, mean: float = DEFAULT_MEAN_CANDIDATES,
         shape: float = DEFAULT_SHAPE, score_share: float = DEFAULT_SCORE_SHARE,
         count_epsilon: float | None = None, scale_epsilon: float = 0.0,
         quality_multiplier: float = 0.0) -> Plan:
    """The smallest candidate noise (within accounting.CALIBRATION_TOLERANCE) whose whole run
    (``Plan.event``) meets (epsilon, delta) by dp_accounting's RDP accountant.
    ``quality_multiplier``: the chosen model's quality check's Gaussian multiplier (0: none),
    one more fixed release beside the count and the ranges."""
    check_repetitions(mean, shape)
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError("epsilon must be a positive number")
    if not 0 < delta < 1:
        raise ValueError("delta must be in (0, 1)")
    if not 0 < score_share < 1:
        raise ValueError("the score's share must be in (0, 1)")
    count_epsilon = DEFAULT_COUNT_SHARE * epsilon if count_epsilon is None else count_epsilon
    if not (0 < count_epsilon < epsilon):
        raise ValueError("count_epsilon is a share of epsilon: it must be positive and smaller")
    if not (0 <= scale_epsilon and count_epsilon + scale_epsilon < epsilon):
        raise ValueError("scale_epsilon is a share of epsilon: with the count's it must be smaller")

    if not (quality_multiplier == 0 or (quality_multiplier > 0 and math.isfinite(quality_multiplier))):
        raise ValueError("the quality check's multiplier must be positive (0: no check)")
    fixed = [accounting.laplace_count_event(count_epsilon)] + (
        [accounting.PureDpEvent(scale_epsilon)] if scale_epsilon else []) + (
        [events.GaussianDpEvent(quality_multiplier)] if quality_multiplier else [])
    if accounting.epsilon_of(events.ComposedDpEvent(fixed), delta, "rdp") >= epsilon:
        raise ValueError("the count, the ranges and the quality check leave nothing of epsilon "
                         "for the candidates: lower their shares (count_epsilon, scale_epsilon, "
                         "quality_epsilon)")

    def make(sigma: float) -> Plan:
        return Plan(sigma / math.sqrt(1.0 - score_share), sigma / math.sqrt(score_share),
                    count_epsilon, float(mean), float(shape), float(scale_epsilon),
                    float(quality_multiplier))

    sigma = accounting.calibrate_noise_multiplier(lambda s: make(s).event(), epsilon, delta,
                                                  accountant="rdp", guess=3.0 * math.sqrt(mean))
    return make(sigma)
