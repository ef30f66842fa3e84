"""``--precondition counts``: categorical columns' steps scaled by n / (their private count).

The counts are one Gaussian release before training (``column_counts``, its share of epsilon);
the step scale (``ColumnStepScale``) is made from them once the plan is known, a post-processing
that changes the step, not the noisy sums.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from beam_dp import stats
from beam_dp.algorithms.spec import Problem
from beam_dp.categorical import Encoding


@dataclasses.dataclass(frozen=True)
class ColumnStepScale:
    """A diagonal preconditioner for categorical columns (``--precondition counts``): the
    update of column ``first + j`` is multiplied by n / max(c_j, floor), c_j the column's
    private count, the rest (numeric columns, intercept) by 1.

    Why: a one-hot column used by a fraction f of the rows has curvature about f / 4 in the mean
    logistic loss, so plain gradient descent moves it f times slower than a dense column, and in
    100 steps learns nothing of the values below a few percent of the rows. Scaled by n / c the
    columns move alike. The scale is a function of released counts and public constants only
    (post-processing): the noisy sums are the same, only the step differs; it amplifies a
    column's noise by at most n / floor, which is why there is a floor (``PRECONDITION_NOISE_WALK``).
    Stored compactly (the columns above the floor; the others share ``default``), since the
    step travels in every Beam job's graph."""

    first: int
    default: float
    columns: tuple
    scales: tuple

    def __call__(self, update: np.ndarray) -> np.ndarray:
        out = np.array(update, dtype=np.float64)
        d = out.shape[1] - 1
        out[:, self.first:d] *= self.default
        if self.columns:
            idx = self.first + np.asarray(self.columns, dtype=np.int64)
            out[:, idx] *= np.asarray(self.scales) / self.default
        return out


# The floor of the scaled counts: the preconditioned noise's random walk over the run,
# learning_rate * sigma * C * sqrt(T) / floor, stays below this in every column (the scale of a
# coefficient that matters for a one-hot column is about 1).
PRECONDITION_NOISE_WALK = 0.1


def preconditioned(options, problem: Problem) -> bool:
    choice = getattr(options, "precondition", "none")
    if choice == "counts" and not problem.sparse:
        raise ValueError("--precondition counts scales categorical columns: it needs "
                         "--categorical-columns")
    if choice == "counts" and problem.privacy.epsilon is None and options.precondition_epsilon is None:
        raise ValueError("--precondition counts with --noise-multiplier needs "
                         "--precondition-epsilon (the counts' budget)")
    return preconditions(choice, problem.sparse, problem.privacy.epsilon)


def preconditions(choice: str | None, sparse: bool, epsilon: float | None) -> bool:
    """Whether --precondition ``choice`` releases column counts (and so spends
    --precondition-epsilon): counts, or auto with categorical columns and --epsilon."""
    return sparse and (choice == "counts" or (choice == "auto" and epsilon is not None))


def column_counts(options, problem: Problem, aggregator, seed: int, ledger):
    """The private column counts of ``--precondition counts`` (one Gaussian release, its share
    of epsilon) and the step scale made from them once the plan is known; also (stage,
    released) for ``_column_scaling``'s ``also`` (the counts in the ranges' pass)."""
    epsilon = problem.privacy.epsilon
    count_epsilon = options.precondition_epsilon or 0.1 * epsilon
    if epsilon is not None and count_epsilon >= epsilon:
        raise ValueError("--precondition-epsilon is a share of --epsilon: it must be smaller")
    encoding = Encoding.from_spec(problem.source["encoding"])   # (checked: problem.sparse)
    first = encoding.first_categorical
    per_row = len(encoding.categorical)
    multiplier = stats.gaussian_noise_multiplier(count_epsilon, problem.privacy.delta)
    noise_std = multiplier * math.sqrt(per_row)

    # (user-level: each row weighs 1 / its user's rows, the counts then of users, fractionally)
    stage = stats.ColumnCountStage("column_counts", first, problem.dim, per_row, multiplier,
                                   stats.stages_seed(seed), (_COUNTS_STREAM,),
                                   per_user=problem.privacy_unit is not None)

    def preprocess(n: int) -> dict:   # (alone: the counts in a pass of their own)
        stats.record_releases([stage], ledger)
        return released(aggregator.run_stages([stage], {"n": n}))

    def released(state: dict) -> dict:
        counts = state["column_counts"]
        # Only the columns clearly above the noise are kept (the rest get the floor anyway):
        # a public threshold, so the plan stays small.
        keep = np.flatnonzero(counts > KEEP_COUNT_NOISE * noise_std)
        return {"column_counts": {"first": first, "columns": keep.tolist(),
                                  "counts": counts[keep].tolist(), "epsilon": count_epsilon,
                                  "noise_multiplier": multiplier}}

    def make_step_scale(pre: dict, plan: dict) -> ColumnStepScale:
        counts = pre["column_counts"]
        n = float(plan["normalizer"])
        walk = (options.learning_rate * plan["noise_multiplier"] * options.clip_norm
                * math.sqrt(plan["steps"]))
        floor = max(walk / PRECONDITION_NOISE_WALK, KEEP_COUNT_NOISE * noise_std, 1.0)
        values = np.asarray(counts["counts"], dtype=np.float64)
        above = values > floor
        columns = np.asarray(counts["columns"], dtype=np.int64)[above]
        return ColumnStepScale(counts["first"], n / floor, tuple(columns.tolist()),
                               tuple((n / values[above]).tolist()))

    return preprocess, make_step_scale, (stage, released)


_COUNTS_STREAM = 7
KEEP_COUNT_NOISE = 4.0   # counts kept in the plan: above 4 standard deviations of their noise
