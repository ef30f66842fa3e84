"""Composite statistics, several stages whose budget is split and calibrated together: the
adaptive mean (center, radius, clipped mean: paper 000's Lemma 3) and ``beam-dp stats``'s dataset
summary (count, quantiles, norms, clipped means) with its report (``summary``)."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting
from beam_dp.stats.primitives import (gaussian_noise_multiplier, log_grid,
                                      quantile_rank_error_bound, uniform_grid)
from beam_dp.stats.stages import (BoxMeanStage, ClippedMeanStage, CountStage, PackedStages,
                                  QuantileStage, _flat_stages)
from beam_dp.stats.values import Columns, DistancesTo, Norms


@dataclasses.dataclass(frozen=True)
class _ZoomGrid:
    """Per-column uniform grid around the previous level's estimate, one old cell wide each side."""

    key: str
    half_width: float
    size: int

    def __call__(self, state):
        center = state[self.key][:, 0]
        return uniform_grid(center - self.half_width, center + self.half_width, self.size)


@dataclasses.dataclass(frozen=True)
class FixedGrid:
    """A public grid that does not depend on earlier releases."""

    grid: np.ndarray

    def __call__(self, state):
        return self.grid


def adaptive_mean_stages(key: str, columns: int, bound: float, epsilon: float, delta: float,
                         seed: int, stream: int, values: Callable = Columns(),
                         grid_size: int = 1024, failure_probability: float = 0.01,
                         noise: str = "float") -> list:
    """A private mean whose error scales with the data's spread rather than the bound R on the
    feature norms (the role of Lemma 3 in paper 000):

    1. a coarse center: per-coordinate exponential-mechanism medians over [-R, R], refined once
       on a grid one coarse cell wide around the first estimate (resolution 4R / G^2);
    2. a private radius: an exponential-mechanism quantile of the distances to that center,
       aiming at k = (2/eps) ln(G/zeta) points above it, over a log grid from R/G^2 to
       2R*sqrt(d). The rank is counted from the top of the histogram (``QuantileStage``), so it
       does not depend on n: a noisy count that overshoots cannot push the target past the
       data (with "n - k" it did, once the overshoot exceeded k, and the radius was then drawn
       almost uniformly from the grid). With probability 1 - zeta between 0 and 2k points lie
       farther than the radius;
    3. the mean of the vectors clipped to that ball, with Gaussian noise scaled to the radius,
       divided by the released ``state['n']`` and projected onto the ball.

    Budget: epsilon/2 for the center (split over the 2 * d medians), epsilon/4 for the radius
    (pure DP), and (epsilon/4, delta) for the Gaussian mean (analytic calibration). The center
    gets the largest share because a wrong coarse median is the one failure that is not
    graceful: every grid cell on the wrong side of the data scores -n/2, so it happens with
    probability ~ G exp(-eps_median n / 4), and then the radius, the noise and the mean are all
    on the scale of R. On the paper's counterexample (note §3.2, n = 2000, DPSGD-F's
    epsilon 1/3 here) that probability is 9.5e-4 per coordinate with the former thirds and
    9.2e-7 with a half (exact, from the utilities), seen as 1 failed run in 200; the radius and
    the Gaussian lose only linearly (k grows by 4/3, the noise by ~1.3). The ledger
    composes them (PLD), so the total is at most (epsilon, delta). Only the last stage reads
    ``state['n']`` (its normalizer).
    The center's budget is split over the d coordinates, so this suits small and moderate d.
    """
    eps_median = epsilon / 2 / (2 * columns)
    eps_radius = epsilon / 4
    coarse = uniform_grid(np.full(columns, -bound), np.full(columns, bound), grid_size)
    cell = 2 * bound / (grid_size - 1)
    radius_grid = log_grid(bound / grid_size ** 2, 2 * bound * math.sqrt(columns), grid_size)
    outliers = quantile_rank_error_bound(grid_size, eps_radius, failure_probability)
    return [
        QuantileStage(f"{key}_center_coarse", values, FixedGrid(coarse), columns, grid_size,
                      (0.5,), eps_median, seed, (stream, 1), noise=noise),
        QuantileStage(f"{key}_center", values, _ZoomGrid(f"{key}_center_coarse", cell, grid_size),
                      columns, grid_size, (0.5,), eps_median, seed, (stream, 2), noise=noise),
        QuantileStage(f"{key}_radius", DistancesTo(f"{key}_center", values), FixedGrid(radius_grid), 1,
                      grid_size, (1.0,), eps_radius, seed, (stream, 3), outliers=outliers,
                      noise=noise),
        ClippedMeanStage(key, values, columns, f"{key}_center", f"{key}_radius",
                         gaussian_noise_multiplier(epsilon / 4, delta), seed, (stream, 4),
                         noise=noise),
    ]


def symmetric_log_grid(bound: float, size: int, dynamic_range: float = 1e8) -> np.ndarray:
    """(1, size) grid for signed values: +-geometric steps from bound/dynamic_range to bound,
    and 0 (size odd)."""
    half = np.geomspace(bound / dynamic_range, bound, (size - 1) // 2)
    return np.concatenate([-half[::-1], [0.0], half])[None, :]


SUMMARY_FAILURE = 0.05   # the failure probability of the error bounds ``beam-dp stats`` reports


def dataset_summary_stages(columns: int, quantiles: tuple, epsilon: float, delta: float,
                           seed: int, value_bound: float = 1e6, grid_size: int = 2047,
                           count: bool = True, accountant: str = "pld",
                           noise: str = "float") -> list:
    """``beam-dp stats``: the private count, per-column quantiles, quantiles of the feature-vector
    norms, and per-column means clipped to the private 5th and 95th percentiles.

    Budget shares: count 5%, column quantiles 50% (split evenly over columns x quantiles), norm
    quantiles 20%, means 25% with all of delta (Gaussian, analytic calibration). The many
    quantile releases compose far better than linearly, so the shares are scaled up by one
    factor, calibrated with dp_accounting so that the composition of every release meets
    (epsilon, delta). Grids are public: a symmetric log grid over [-value_bound, value_bound]
    with relative resolution about 1.8%. Two passes over the data: count and histograms packed
    in one, the means in a second.

    Useful at small n: every quantile's target is kept at least its 95% rank error E from either
    end of the data (``QuantileStage.margin``), so where the budget cannot resolve the 5th
    percentile (E > 0.05 n: at epsilon 1, d = 3, n = 2,000, E is ~300 rows) the release is about
    the E/n-th quantile, inside the data, rather than a point anywhere on the grid; ``summary``
    reports each release's error bound and warns where that happened. (The shares were 40% / 15%
    / 40% for column quantiles / norms / means: at such n the means' noise, ~0.005 of the range,
    was far below the quantiles' error that their clipping bounds inherit.)
    """
    def build(inverse_scale: float) -> list:
        return _summary_stages(columns, quantiles, epsilon / inverse_scale, delta, seed,
                               value_bound, grid_size, count, noise)

    def make_event(inverse_scale: float):
        return events.ComposedDpEvent([accounting.self_composed(e, c)
                                       for stage in build(inverse_scale)
                                       for _, e, c, _ in stage.releases()])
    return build(accounting.calibrate_noise_multiplier(make_event, epsilon, delta, accountant,
                                                       lower=0.02, upper=1.5))


def _summary_stages(columns, quantiles, epsilon, delta, seed, value_bound, grid_size, count,
                    noise="float"):
    qs = tuple(sorted(set(quantiles) | {0.05, 0.95}))
    lo, hi = qs.index(0.05), qs.index(0.95)
    column_grid = np.repeat(symmetric_log_grid(value_bound, grid_size), columns, axis=0)
    norm_grid = log_grid(value_bound / 1e8, value_bound * math.sqrt(columns), grid_size)
    norm_qs = tuple(sorted(set(quantiles)))
    eps_column = 0.50 * epsilon / (columns * len(qs))
    eps_norm = 0.20 * epsilon / len(norm_qs)
    # margin: every target at least the 95% rank error from either end of the data, so that an
    # extreme quantile the budget cannot resolve at this n lands inside the data (near rank E
    # from that end) instead of anywhere on the grid; ``summary`` warns where that happens.
    first = [QuantileStage("column_quantiles", Columns(), FixedGrid(column_grid), columns,
                           grid_size, qs, eps_column, seed, (1,),
                           margin=quantile_rank_error_bound(grid_size, eps_column, SUMMARY_FAILURE),
                           noise=noise, rearrange=True),
             QuantileStage("norm_quantiles", Norms(), FixedGrid(norm_grid), 1, grid_size,
                           norm_qs, eps_norm, seed, (2,),
                           margin=quantile_rank_error_bound(grid_size, eps_norm, SUMMARY_FAILURE),
                           noise=noise, rearrange=True)]
    if count:
        first.insert(0, CountStage(0.05 * epsilon, seed, (0,), noise=noise))
    return [PackedStages(tuple(first)),
            BoxMeanStage("column_means", Columns(), columns, "column_quantiles", lo, hi,
                         gaussian_noise_multiplier(0.25 * epsilon, delta), seed, (3,),
                         noise=noise)]


def _unresolved(rank_error: float, p: float, n: float) -> bool:
    """Whether a p-quantile with this rank error cannot be told from an end of the data at n
    (its target then aimed ``rank_error`` rows inside: ``QuantileStage.margin``)."""
    return rank_error > min(p, 1 - p) * n


def summary(state: dict, stages, feature_names, count_source: str,
            failure_probability: float = SUMMARY_FAILURE) -> dict:
    """The ``beam-dp stats`` report (everything but the privacy report) from the released
    ``state`` of ``dataset_summary_stages``'s ``stages``: every released statistic with its error
    bound, and warnings (no data values in them) where a bound makes a statistic easy to misread.

    * count: the Laplace scale and the 95% error bound b ln(20) (a public function of the budget);
    * quantiles: each release's rank error bound E at ``failure_probability`` (exponential
      mechanism, ``quantile_rank_error_bound``). A warning names the quantiles with
      E > min(p, 1 - p) n (n the released count): their target was moved E ranks inside the data
      (``QuantileStage.margin``), so they are about the E/n-th quantile from that end, not p;
    * means: the standard error of the Gaussian noise, sigma * ||(hi - lo)/2||_2 / n (public: the
      noise multiplier, the released clipping bounds and the released count), and the 95%
      interval mean +- 1.96 se cut to [lo, hi] (the noisy mean itself projected onto [lo, hi];
      the quantiles are sorted per column, ``QuantileStage.rearrange``, so lo <= hi). The
      interval covers the noise only: the clipping
      to [lo, hi] biases a mean when values lie outside, and a count error scales (mean - mid).
    """
    by_key = {getattr(s, "key", None): s for s in _flat_stages(stages)}
    n = float(state["n"])
    z = 1.959963984540054                     # two-sided 95% normal quantile
    warnings = []
    out = {"count": state["n"], "count_source": count_source}
    count_stage = next((s for s in by_key.values() if isinstance(s, CountStage)), None)
    if count_stage is not None:
        scale = 1.0 / count_stage.epsilon
        out["count_laplace_scale"] = scale
        out["count_error_95"] = scale * math.log(1 / 0.05)
        if out["count_error_95"] > n / 2:
            warnings.append("count: its 95% error bound exceeds half the released count; the "
                            "count and every statistic divided by it are mostly noise.")

    column_q, norm_q = by_key["column_quantiles"], by_key["norm_quantiles"]
    means = by_key["column_means"]
    rank_errors = {}
    for label, stage in (("columns", column_q), ("norms", norm_q)):
        e = stage.rank_error_bound(failure_probability)
        rank_errors[f"exponential_mechanism_quantile ({label})"] = e
        unresolved = [p for p in stage.quantiles if _unresolved(e, p, n)]
        if unresolved:
            what = "column" if label == "columns" else "feature-norm"
            warnings.append(
                f"{what} quantiles {', '.join(f'{p:g}' for p in unresolved)}: the "
                f"{1 - failure_probability:.0%} rank error ({e:.0f} rows) exceeds min(p, 1-p) x n; "
                f"each was aimed {e:.0f} rows inside the data instead, so it is not the requested "
                "quantile. Use more rows, a larger --epsilon, fewer --quantiles or fewer columns.")

    lo, hi = means._bounds(state)
    se = means.noise_multiplier * means.sensitivity(state) / max(n, 1.0)
    columns = {}
    for j, name in enumerate(feature_names):
        # A mean of values clipped to [lo, hi] lies in [lo, hi]: the noisy one is projected
        # there (post-processing, never farther from it), so its interval is never crossed.
        mean = min(max(float(state["column_means"][j]), float(lo[j])), float(hi[j]))
        columns[name] = {
            "mean": mean,
            "mean_standard_error": se,
            "mean_interval_95": [max(mean - z * se, float(lo[j])), min(mean + z * se, float(hi[j]))],
            "mean_clipped_to": [float(lo[j]), float(hi[j])],
            "quantiles": {str(q): float(state["column_quantiles"][j, i])
                          for i, q in enumerate(column_q.quantiles)},
        }
    widths = (hi - lo)[hi > lo]
    if widths.size and z * se > float(np.min(widths)) / 2:
        warnings.append("column means: the 95% noise interval is wider than the clipping range of "
                        "some columns; those means are mostly noise.")
    out.update({
        "columns": columns,
        "feature_norm_quantiles": {str(q): float(state["norm_quantiles"][0, i])
                                   for i, q in enumerate(norm_q.quantiles)},
        "quantile_rank_error_95": rank_errors,
        "warnings": warnings,
        "notes": ("Quantiles are grid points of a symmetric log grid over +-value_bound (relative "
                  "resolution about 1.8%), chosen by the exponential mechanism: with probability "
                  "0.95 each one's rank is within quantile_rank_error_95 rows of its target, p n, "
                  "or that many rows inside the data where p n is closer to an end (see warnings). "
                  "Means are of values clipped to mean_clipped_to (the released 0.05 and 0.95 "
                  "quantiles); mean_standard_error and mean_interval_95 cover the Gaussian noise "
                  "only, not the clipping bias. count_error_95 bounds the count's Laplace noise "
                  "with probability 0.95."),
    })
    return out


# A declared range whose column's 5th-95th percentiles span less than this share of it maps the
# column into a sliver of [-1, 1]: AER CreditCard's expenditure, documented as [0, 5000] with
# most rows near 0 (a span of 0.128), cost dpgd 0.16 ROC AUC (0.830 with every documented range,
# 0.990 with all but expenditure's, 0.959 with [0, 500] for it; 3 seeds, epsilon 1:
# docs/guide/preprocessing.md). Over the 42 documented ranges of the six real tables
# (bench_raw_tables.DOMAIN_BOUNDS, exact 5th-95th spans) this share names expenditure and
# diamonds' depth, table, y and z (0.06-0.12; diamonds' documented ranges together cost RMSE
# 1,255 -> 1,388), and none of the other 37 (0.15-1.0), ISLR Default's (0.33, 0.41, where the
# ranges cost 0.004 AUC) and MASS Boston's among them. At 0.1 expenditure was missed.
WIDE_RANGE_SPAN = 0.14


def check_declared_ranges(summary: dict, stages, bounds: dict) -> None:
    """``summary["declared_ranges"]``: for each column of ``summary`` (made from ``stages``)
    with a declared range (``bounds``: column -> (low, high), public), where its released
    quantiles lie against it: "wide" (their span under WIDE_RANGE_SPAN of the range), "beyond"
    (a quantile past the grid cell holding an end of the range: those values are clipped; a
    quantile in that cell, e.g. a 0/1 column's 1 released as the grid point 1.02, is not),
    "fits", "cannot tell" where the quantiles' rank error leaves them unresolved at this n (the
    summary's own test) or they fell on one grid point, or "not checked" for a declared column
    the run did not read; a warning for the first two. Shares of the declared range only:
    no released value is repeated in a message."""
    n = float(summary["count"])
    error = summary["quantile_rank_error_95"]["exponential_mechanism_quantile (columns)"]
    stage = {getattr(s, "key", None): s for s in _flat_stages(stages)}["column_quantiles"]
    grid = np.asarray(stage.grid(summary))[0]   # public; the same for every column
    out = {}
    for name, (low, high) in bounds.items():
        column = summary["columns"].get(name)
        if column is None:   # (the label, or a name the run did not read: said, not dropped)
            out[name] = {"declared": [low, high], "verdict": "not checked",
                         "why": "not a feature column of this run"}
            continue
        levels = sorted(column["quantiles"], key=float)
        first, last = float(levels[0]), float(levels[-1])
        entry = {"declared": [low, high], "quantiles": [first, last]}
        if _unresolved(error, first, n) or _unresolved(error, last, n):
            out[name] = {**entry, "verdict": "cannot tell", "why": (
                f"the quantiles' 95% rank error ({error:.0f} rows) leaves them unresolved at "
                "this n")}
            continue
        q_low, q_high = column["quantiles"][levels[0]], column["quantiles"][levels[-1]]
        share = (q_high - q_low) / (high - low)
        entry["span_share"] = share
        # the grid points around the range's ends: the cells that hold them
        below = grid[max(int(np.searchsorted(grid, low, side="right")) - 1, 0)]
        above = grid[min(int(np.searchsorted(grid, high, side="left")), grid.size - 1)]
        if q_low < below or q_high > above:
            out[name] = {**entry, "verdict": "beyond"}
            summary["warnings"].append(
                f"'{name}': its private {first:g} or {last:g} quantile lies outside its declared "
                "range: values beyond the range are clipped to it in training; check the range "
                "against the column's documentation")
        elif q_high == q_low:   # a point mass (a rare 0/1 column): its span says nothing
            out[name] = {**entry, "verdict": "cannot tell",
                         "why": "its quantiles fell on one grid point"}
        elif share < WIDE_RANGE_SPAN:
            out[name] = {**entry, "verdict": "wide"}
            summary["warnings"].append(
                f"'{name}': its private {first:g}-{last:g} quantiles span {share:.1%} of its "
                "declared range, so mapped by that range onto [-1, 1] the column varies over a "
                "sliver of it, which dpgd's noisy steps may not learn from (AER CreditCard's "
                "expenditure: ROC AUC 0.83 so, 0.99 undeclared): declare a range nearer where "
                "its values lie, or leave it undeclared where n allows private ranges")
        else:
            out[name] = {**entry, "verdict": "fits"}
    summary["declared_ranges"] = out
