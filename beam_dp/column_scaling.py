"""Column scaling before training: each numeric column mapped onto [-1, 1] on its declared
range, or on a private 2nd-98th percentile range (``--scale-features private`` / ``auto``), and
the median/mean fills of missing values released in the same pass (``prepare``).
"""
from __future__ import annotations

import numpy as np

from beam_dp import features, stats
from beam_dp.algorithms.spec import Problem
from beam_dp.categorical import Encoding


SCALE_QUANTILES = (0.02, 0.98)
# A privately scaled column keeps values up to this many half-ranges from its range's middle
# (features.ScaleColumns.reach). Clipping at the 98th percentile itself made the 3% defaulters
# of ISLR Default alike: ROC AUC 0.939 at reach 1, 0.946 at reach 4 (scikit-learn 0.949).
PRIVATE_RANGE_REACH = 4.0
# --scale-features auto scales where the quantiles' 95% rank error is below this share of n (the
# margin then keeps the range at least the inter-quartile one). Above it the targets are pulled
# toward the median and the range collapses. Measured at epsilon 1 (3 seeds):
# * ISLR Default, n = 8,000, d = 2, error/n = 0.09: ROC AUC 0.956 scaled vs 0.569 unscaled;
# * AER CreditCard, n = 1,055, d = 10, error/n = 3.5: accuracy 0.77 scaled vs 0.96 unscaled.
AUTO_SCALE_RANK_ERROR = 0.25
# The chance the margin leaves an extreme quantile to land on an empty grid cell beyond the data
# (``stats.exponential_mechanism_quantile``): such a range is orders of magnitude too wide and
# maps its column to ~0. At 0.05 (the 95% error) ISLR Default's balance once got a 98th
# percentile of 2.2e6 (its values stop near 2,650): ROC AUC 0.46 on 1 of 30 seeds, train's
# defaults. At 1e-3 the margin is 1.4x wider (Default: target ranks 1,070 rows from each end
# rather than 750).
SCALE_MARGIN_FAILURE = 1e-3
SCALE_GRID_BOUND, SCALE_GRID_SIZE = 1e9, 601   # +-[1e-3, 1e9], 10% steps, and 0
_SCALE_STREAM = 12


# --scale-features auto maps a privately ranged column only when the range is off the unit scale:
# a half-width outside [1/4, 4], or a middle more than one half-width from 0 (a range that does
# not reach 0: a shift the intercept would otherwise have to learn against the column). 0/1 and
# small-count columns ([0, k]: middle = half-width) and standardized ones stay as given. The
# middle's rule was 4 half-widths: ggplot2 diamonds' x, y and z (mm, 2nd-98th percentiles about
# [4.5, 7.8]) stayed raw, and with its schema alone the regression was much worse than the
# constant on 2 seeds of 3 (docs/benchmarks/real-tables.md).
UNIT_SCALE = (0.25, 4.0)
UNIT_SHIFT = 1.0


def off_unit_scale(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Columns whose (released) range [low, high] is far from the unit scale (see UNIT_SCALE)."""
    half, mid = (high - low) / 2.0, (high + low) / 2.0
    return (half < UNIT_SCALE[0]) | (half > UNIT_SCALE[1]) | (np.abs(mid) > UNIT_SHIFT * half)


def widen_collapsed(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Released ranges whose two quantiles fell on the same grid point away from 0 (a column
    whose 2nd-98th percentiles lie within one 10% cell: diamonds' depth, 58-65 percent, released
    as [65.5, 65.5]) widened to that cell, from the grid point before toward 0: the column is
    then centred and scaled by the cell's width instead of entering as given (at ~62 next to the
    intercept's 1). A range collapsed at 0 (a 0/1 column with under 2% ones) stays collapsed
    (left as given: mapping it would erase its rare values)."""
    grid = stats.symmetric_log_grid(SCALE_GRID_BOUND, SCALE_GRID_SIZE, 1e12)[0]
    collapsed = (high <= low) & (low != 0)
    position = np.searchsorted(grid, low)
    toward_zero = np.where(low > 0, grid[np.maximum(position - 1, 0)],
                           grid[np.minimum(position + 1, grid.size - 1)])
    low, high = (np.where(collapsed & (low > 0), toward_zero, low),
                 np.where(collapsed & (low < 0), toward_zero, high))
    return low, high


def prepare(options, problem: Problem, aggregator, seed: int, ledger, also=()):
    """Each column mapped onto [-1, 1] (``features.ScaleColumns``): on its declared public range
    (the schema's ``bounds``; a missing-value indicator is [0, 1] by construction), else, with
    ``--scale-features private`` or ``auto``, on its 2nd and 98th percentiles released by the
    exponential mechanism (``stats.QuantileStage``: pure epsilon each, under add/remove; the
    targets kept their 95% rank error inside the data, so a small n lands inside it rather than
    anywhere on the grid). A linear regression's label is scaled the same way (declared, else
    private with the columns) and the coefficients mapped back to its units afterwards.

    Why quantiles on a public log grid: a range has to come from somewhere, and reading it from
    the data un-noised is what diffprivlib warns about (PrivacyLeakWarning); a log grid from
    1e-3 to 1e9 in 10% steps covers incomes and 0/1 columns alike, and a value outside it is
    only clipped.

    Median/mean imputation (the schema's ``missing`` "median"/"mean") is released here too, in
    the same job (one read of the data), and filled before scaling (``ScaleColumns.fill``):
    * "median": the column's 50th percentile of its present values, on the same grid by the
      same exponential mechanism (``stats.histogram`` leaves a missing cell out);
    * "mean": the mean of its present values clipped to the column's *declared* range
      (``stats.ImputeMeanStage``, Laplace). Declared rather than the private 2nd-98th range:
      that range is released in this very job, so a mean within it would need a second read
      of the data (and a second job); a column without a declared range takes "median".
    Each imputed column gets the epsilon of one quantile (the share is split over the scaling's
    quantiles and the imputed columns), in the ledger before the step noise is calibrated.

    ``also``: (stage, released) pairs of other releases before the steps that do not depend on
    these (the categorical columns' counts): their stages run in the same pass, and
    ``released(state)`` (a dict) joins the preprocessing.

    Returns (preprocess, make_transform), or (None, None) when nothing is scaled (``also`` is
    then not run)."""
    choice = options.scale_features
    imputed = imputed_columns(problem)
    if imputed:
        why = ("categorical columns (sparse features)" if problem.sparse else
               "--feature-norm" if options.feature_norm else None)
        if why:
            raise ValueError(f"median/mean imputation is not available with {why}: use "
                             "constant:V or indicator for those columns")
        # The fills' releases draw numpy's float noise (the median's Gumbel-max exponential
        # mechanism, the mean's Laplace on float sums): --noise secure, which insists on integer
        # noise on exact sums, refuses them (as adaptive clipping); the default says so.
        if problem.privacy.noise == "secure":
            raise ValueError("median/mean imputation adds float noise (its fills' releases are "
                             "not built on exact sums); use --noise float or leave --noise out")
        if IMPUTE_FLOAT_NOTE not in ledger.notes:
            ledger.notes.append(IMPUTE_FLOAT_NOTE)
    # User-level privacy: the quantiles and means weigh each row 1 / its user's rows (a user
    # moves them as one row does), over the users (n is the number of users).
    per_user = problem.privacy_unit is not None
    declared = problem.source.get("bounds") or {"columns": [], "label": None}
    if problem.initial_theta is not None and choice == "auto":
        # A warm start continues in its model's space: that model's ranges, if any, came as
        # declared bounds (api._warm_start_theta); nothing new is released.
        choice = "none"
    if options.feature_norm:
        if choice == "private":
            raise ValueError("--scale-features private and --feature-norm are two maps of the "
                             "same features: choose one")
        return None, None   # auto/none: features as given (the feature norm maps them)
    # The columns mapped: every one of dense rows; of CSR rows (categorical columns) the numeric
    # ones (and missing indicators), which come first, the one-hot columns after them being 0/1
    # already (features.ScaleColumns maps the first d columns of CSR rows).
    d = (Encoding.from_spec(problem.source["encoding"]).first_categorical if problem.sparse
         else problem.dim)
    # [index, low, high] (declared), or [index, low, high, reach] (ranges released earlier, e.g.
    # once for all of beam-dp tune's candidates)
    fixed = {int(c[0]): (c[1], c[2], c[3] if len(c) > 3 else 1.0) for c in declared["columns"]}
    for j, policy, name in imputed:
        if policy == "mean" and j not in fixed:
            raise ValueError(f"mean imputation of '{name}' needs its declared range (the schema's "
                             "bounds): the mean of values clipped to it. Without one use median")
    label_scaled = problem.loss.name == "linear"
    private_columns = tuple(j for j in range(d) if j not in fixed) if choice != "none" else ()
    private_label = label_scaled and declared["label"] is None and choice != "none"
    epsilon = problem.privacy.epsilon
    share = options.scale_epsilon or (0.1 * epsilon if epsilon is not None else None)
    if imputed and share is None:
        raise ValueError("median/mean imputation with --noise-multiplier needs --scale-epsilon "
                         "(the fills' budget)")
    if (private_columns or private_label) and share is None:
        if choice == "private":
            raise ValueError("--scale-features private with --noise-multiplier needs "
                             "--scale-epsilon (the quantiles' budget)")
        private_columns, private_label = (), False   # auto: only what is declared
    if epsilon is not None and share is not None and share >= epsilon:
        raise ValueError("--scale-epsilon is a share of --epsilon: it must be smaller")
    if not (fixed or declared["label"] is not None or private_columns or private_label or imputed):
        return None, None
    stage = per_release = None
    released = len(private_columns) + int(private_label)
    if released or imputed:
        # one quantile's epsilon per scaling quantile and per imputed column
        per_release = share / (released * len(SCALE_QUANTILES) + len(imputed))
    if released:
        stage = _range_stage(private_columns, private_label, per_release, seed,
                             problem.privacy.noise, per_user)

    def preprocess(n: int) -> dict:
        out = {"declared_bounds": declared} if fixed or declared["label"] is not None else {}
        scale, ranged, fill_epsilon = stage, private_columns, per_release
        if stage is not None:
            # The margin (the rank error at SCALE_MARGIN_FAILURE), as the targets sit that far
            # from the ends: above a quarter of n the range shrinks inside the quartiles.
            error = stage.margin
            if choice == "auto" and error > AUTO_SCALE_RANK_ERROR * n:
                # Decided from the released count and public constants: nothing is spent.
                skipped = (f"--scale-features auto: the quantiles' rank error bound ({error:.0f} "
                           f"rows at probability {1 - SCALE_MARGIN_FAILURE:g}, {per_release:.3g} "
                           f"epsilon each) is above {AUTO_SCALE_RANK_ERROR:.0%} of n; columns "
                           "without declared bounds used as given")
                scale, ranged = None, ()
                fill_epsilon = share / len(imputed) if imputed else None   # the whole share
                if label_scaled:
                    # A regression on raw units is not trained by accident: its label's scale
                    # sets the steps and the clip norm's meaning. Its range alone (the share on
                    # its two quantiles) is affordable long before every column's: then the
                    # columns go as given (ggplot2 diamonds standardized, 43,152 rows and 23
                    # columns: 48 quantiles' error 12,774 rows, the label's alone 532). Where
                    # not even that is (MASS Boston, 404 rows, schema alone: RMSE 10.9-17.0
                    # against the constant's 8.6, OLS 4.3), the run stops before training.
                    alone = share / (len(SCALE_QUANTILES) + len(imputed))
                    alone_error = stats.quantile_rank_error_bound(SCALE_GRID_SIZE, alone,
                                                                  SCALE_MARGIN_FAILURE)
                    if alone_error > AUTO_SCALE_RANK_ERROR * n:
                        raise ValueError(_unranged_refusal(problem, private_columns,
                                                           private_label, error, per_release))
                    fill_epsilon = alone
                    if private_label:
                        scale = _range_stage((), True, alone, seed, problem.privacy.noise,
                                             per_user)
                        skipped += (f"; the label's range released alone ({alone_error:.0f} "
                                    f"rows, {alone:.3g} epsilon each)")
                elif private_label:
                    skipped += ", and the label too"
                out = {**out, "column_bounds": None, "scaling_skipped": skipped}
        # The fills' epsilon: one quantile's each, or the whole share when no range is released
        # (decided from public values: the released n and constants).
        fill_stages = (_imputation_stages(imputed, fixed, fill_epsilon, seed, per_user)
                       if imputed else [])
        for q in fill_stages:
            unranged = [name for j, p, name in imputed if p == "median" and j not in fixed]
            if q.key == "impute_median" and unranged and (
                    q.rank_error_bound(0.05) > AUTO_SCALE_RANK_ERROR * n):
                # On the wide log grid a median this uncertain can land orders of magnitude away
                # from the data (airquality, 153 rows: RMSE 2.9e6). Refused before it is spent,
                # from public values (the released n and constants).
                raise ValueError(
                    f"median imputation of {', '.join(repr(c) for c in unranged)}: at this n the "
                    f"private median's 95% rank error ({q.rank_error_bound(0.05):.0f} rows at "
                    f"{q.epsilon:.3g} epsilon) is above {AUTO_SCALE_RANK_ERROR:.0%} of the rows, "
                    "so without a declared range it may land anywhere from 1e-3 to 1e9: declare "
                    "the column's range (the schema's bounds), give a larger --scale-epsilon, or "
                    "use the indicator policy")
        # The fills with the ranges (if any), and the run's other releases that do not depend
        # on them (``also``: the categorical columns' counts), in one pass over the data: one job.
        stages = ([scale] if scale is not None else []) + fill_stages + [s for s, _ in also]
        if not stages:
            return out
        stats.record_releases(stages, ledger)
        state = aggregator.run_stages(
            [stats.PackedStages(tuple(stages))] if len(stages) > 1 or fill_stages else stages,
            {"n": n})
        for _, released in also:
            out = {**out, **released(state)}
        if fill_stages:
            out = {**out, "imputation": _released_fills(imputed, fill_stages, state, fixed)}
        if scale is None:
            return out
        bounds = state["column_bounds"]
        # Quantiles released independently may cross (both inside one grid cell, or a column
        # with almost all rows equal): the range is then their span, and a span of one grid
        # point away from 0 that point's cell (post-processing of public values).
        low, high = widen_collapsed(np.minimum(bounds[:, 0], bounds[:, 1]),
                                    np.maximum(bounds[:, 0], bounds[:, 1]))
        k = len(ranged)
        return {**out, "column_bounds": {
            "columns": list(ranged), "low": low[:k].tolist(), "high": high[:k].tolist(),
            **({"label": [float(low[k]), float(high[k])]} if private_label else {}),
            "quantiles": list(SCALE_QUANTILES), "epsilon": share,
            "rank_error_95": scale.rank_error_bound(0.05)}}

    def make_transform(pre: dict):
        low, high, reach = np.full(d, np.nan), np.full(d, np.nan), np.ones(d)
        # a declared range is the label's domain (reach 1); an inherited one keeps its reach
        label_reach = float(declared.get("label_reach", 1.0))
        for j, (lo, hi, r) in fixed.items():
            low[j], high[j], reach[j] = lo, hi, r
        label = declared["label"]
        released_bounds = pre.get("column_bounds")
        if released_bounds:
            columns = np.asarray(released_bounds["columns"], dtype=np.int64)
            lo, hi = np.asarray(released_bounds["low"]), np.asarray(released_bounds["high"])
            # A range collapsed to a point (a 0/1 column whose ones are under 2% of the rows, or a
            # column almost constant) would map the column to 0 and erase its rare values: such
            # a column is left as given.
            use = hi > lo
            if choice == "auto":
                # ... and auto maps only the columns its released ranges show off the unit scale
                # (a standardized or 0/1 column is left as given): mapping them anyway cost
                # ROC AUC 0.947 -> 0.905 on standardized ISLR Default (real_data_benchmark.py).
                use &= off_unit_scale(lo, hi)
            low[columns[use]], high[columns[use]] = lo[use], hi[use]
            reach[columns[use]] = PRIVATE_RANGE_REACH
            if "label" in released_bounds:
                label = released_bounds["label"]
                label_reach = PRIVATE_RANGE_REACH
                if not label[1] > label[0] or (choice == "auto" and not off_unit_scale(
                        np.asarray(label[:1]), np.asarray(label[1:]))[0]):
                    label = None   # one grid cell, or already on the unit scale: as given
        if not problem.fit_intercept:
            # Without an intercept the model is y = <w, x>, through the origin: a shift of a
            # column or of the label would need the intercept the user left out, so each range
            # becomes symmetric about 0 (scale only, no shift).
            top = np.maximum(np.abs(low), np.abs(high))
            low, high = np.where(np.isnan(low), low, -top), np.where(np.isnan(high), high, top)
            if label is not None:
                label_top = max(abs(label[0]), abs(label[1]))
                label = (-label_top, label_top)
        fill = None
        if pre.get("imputation"):
            fill = np.full(d, np.nan)
            for column in pre["imputation"].values():
                fill[column["index"]] = column["fill"]
        if np.isnan(low).all() and label is None and fill is None:
            return None
        return features.ScaleColumns(tuple(low.tolist()), tuple(high.tolist()),
                                     *((float(label[0]), float(label[1])) if label else (None, None)),
                                     reach=tuple(reach.tolist()) if (reach != 1).any() else None,
                                     label_reach=label_reach,
                                     fill=None if fill is None else tuple(fill.tolist()))

    return preprocess, make_transform


def _range_stage(columns: tuple, label: bool, epsilon: float, seed: int, noise: str | None,
                 per_user: bool = False):
    """The 2nd and 98th percentiles of ``columns`` (and of the label) on the public log grid,
    ``epsilon`` each, their targets kept the margin (at SCALE_MARGIN_FAILURE) inside the data;
    ``per_user``: of the rows weighted 1 / their user's rows (float noise)."""
    released = len(columns) + int(label)
    grid = np.repeat(stats.symmetric_log_grid(SCALE_GRID_BOUND, SCALE_GRID_SIZE, 1e12),
                     released, axis=0)
    return stats.QuantileStage(
        "column_bounds", stats.Selected(columns, label), stats.FixedGrid(grid), released,
        SCALE_GRID_SIZE, SCALE_QUANTILES, epsilon, stats.stages_seed(seed), (_SCALE_STREAM,),
        margin=stats.quantile_rank_error_bound(SCALE_GRID_SIZE, epsilon, SCALE_MARGIN_FAILURE),
        # The run's noise kind: secure unless float was asked for (as the steps' default), so
        # the ranges are no float release inside a secure run.
        noise="float" if noise == "float" or per_user else "secure", per_user=per_user)


def column_names(problem: Problem, d: int) -> list[str]:
    """The names of the first ``d`` model columns (the encoding's dense columns, else the feature
    columns as read): public, from the schema and the files' headers."""
    spec = problem.source.get("encoding")
    names = (Encoding.from_spec(spec).dense_names if spec
             else list(problem.source.get("feature_columns") or []))
    return [names[j] if j < len(names) else f"column {j}" for j in range(d)]


def _listed(names: list[str], most: int = 12) -> str:
    shown = ", ".join(repr(c) for c in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _unranged_refusal(problem: Problem, columns: tuple, label: bool, error: float,
                      per_release: float) -> str:
    """The message of a regression stopped before training: which columns (and the label) have
    neither a declared range nor a usable private one at this n (public values only)."""
    d = max(columns, default=-1) + 1
    names = column_names(problem, d)
    unranged = _listed([names[j] for j in columns], most=50)
    if label:
        label_name = repr(problem.source.get("label_column", "label"))
        unranged = (f"{unranged} and of the label {label_name}" if columns
                    else f"the label {label_name}")
    return (f"--scale-features auto: at this n the private ranges' rank error ({error:.0f} rows "
            f"at probability {1 - SCALE_MARGIN_FAILURE:g}, {per_release:.3g} epsilon each) is "
            f"above {AUTO_SCALE_RANK_ERROR:.0%} of the rows, so a regression would train on raw "
            f"units: declare the ranges of {unranged} (the schema's bounds: what each "
            "column can hold, from its documentation), or pass --scale-features none "
            "(scale_features='none') to train on them as given. Nothing was trained")


def describe(problem: Problem, applied, preprocessing: dict, choice: str) -> list[str]:
    """What column scaling did, by column name, one line per kind (public: names, and whether
    each range was declared or released): for stderr and the top of report.html."""
    d = len(applied.low) if isinstance(applied, features.ScaleColumns) else (
        Encoding.from_spec(problem.source["encoding"]).first_categorical
        if problem.sparse else problem.dim)
    names = column_names(problem, d)
    declared = {int(c[0]) for c in (preprocessing.get("declared_bounds") or {}).get("columns", [])}
    released = set((preprocessing.get("column_bounds") or {}).get("columns", []))
    mapped = (np.zeros(d, dtype=bool) if not isinstance(applied, features.ScaleColumns)
              else ~np.isnan(np.asarray(applied.low, dtype=np.float64)))
    groups = {"declared": [], "private": [], "given": []}
    for j, name in enumerate(names):
        groups["declared" if mapped[j] and j in declared else
               "private" if mapped[j] else "given"].append(name)
    lines = []
    if groups["declared"]:
        lines.append(f"mapped onto [-1, 1] by their declared ranges: {_listed(groups['declared'])}")
    if groups["private"]:
        lines.append("mapped onto [-1, 1] by private 2nd-98th percentile ranges: "
                     f"{_listed(groups['private'])}")
    if groups["given"]:
        if preprocessing.get("scaling_skipped"):
            why = "n is too small for private ranges"
        elif released:
            why = "their private ranges show them on the unit scale, or hold one point"
        elif choice == "auto":   # (prepare's rules: nothing private for this run)
            why = ("no private ranges with --warm-start or --noise-multiplier without "
                   "--scale-epsilon")
        else:
            why = f"--scale-features {choice}"
        lines.append(f"used as given ({why}): {_listed(groups['given'])}")
    if problem.loss.name == "linear":
        label = problem.source.get("label_column", "label")
        if isinstance(applied, features.ScaleColumns) and applied.label_low is not None:
            how = ("its declared range" if (problem.source.get("bounds") or {}).get("label")
                   is not None else "a private 2nd-98th percentile range")
            lines.append(f"the label {label!r} scaled by {how} during training (the "
                         "coefficients are in its units)")
        else:
            lines.append(f"the label {label!r} used as given")
    return lines


_IMPUTE_STREAM = 13
IMPUTE_FLOAT_NOTE = ("median/mean imputation: the fills' releases add numpy's float noise (the "
                     "median's exponential mechanism by Gumbel-max, the mean's Laplace on float "
                     "sums); the other releases keep their own noise")


def imputed_columns(problem: Problem) -> list:
    """(model column, "median"/"mean", name) of the columns whose fill is still to be released."""
    spec = problem.source.get("encoding")
    if not spec:
        return []
    encoding = Encoding.from_spec(spec)
    pending = encoding.pending
    index = {name: j for j, name in enumerate(encoding.dense_names)}
    return [(index[c], p, c) for c, p in encoding.imputed if pending[index[c]]]


def _imputation_stages(imputed: list, fixed: dict, epsilon: float | None, seed: int,
                       per_user: bool = False) -> list:
    """The releases of the fills (``epsilon`` each column): one exponential-mechanism median per
    "median" column, one Laplace stage for all "mean" columns (each within its declared range).
    A median's grid is the scaling's public log grid, or, for a column with a declared range,
    as many points spread evenly over that range: the fill then stays in the column's domain,
    and at small n (where the mechanism is nearly uniform over the grid) it does not land
    orders of magnitude away from the data."""
    medians = tuple(j for j, p, _ in imputed if p == "median")
    means = tuple(j for j, p, _ in imputed if p == "mean")
    out = []
    if medians:
        log_grid = stats.symmetric_log_grid(SCALE_GRID_BOUND, SCALE_GRID_SIZE, 1e12)[0]
        size = log_grid.size
        grid = np.stack([np.linspace(fixed[j][0], fixed[j][1], size) if j in fixed else log_grid
                         for j in medians])
        out.append(stats.QuantileStage("impute_median", stats.Selected(medians),
                                       stats.FixedGrid(grid), len(medians), size, (0.5,),
                                       epsilon, stats.stages_seed(seed), (_IMPUTE_STREAM,),
                                       per_user=per_user))
    if means:
        out.append(stats.ImputeMeanStage("impute_mean", means,
                                         tuple(float(fixed[j][0]) for j in means),
                                         tuple(float(fixed[j][1]) for j in means),
                                         epsilon * len(means), stats.stages_seed(seed),
                                         (_IMPUTE_STREAM, 1), per_user=per_user))
    return out


def _released_fills(imputed: list, stages: list, state: dict, fixed: dict) -> dict:
    """{column: its policy, released fill, model column and the release's noise} (public)."""
    out = {}
    medians = iter(state["impute_median"][:, 0]) if "impute_median" in state else iter(())
    means = iter(state["impute_mean"]) if "impute_mean" in state else iter(())
    by_key = {s.key: s for s in stages}
    for j, policy, name in imputed:
        if policy == "median":
            q = by_key["impute_median"]
            out[name] = {"policy": "median", "index": j, "fill": float(next(medians)),
                         "epsilon": q.epsilon, "mechanism": "exponential mechanism quantile",
                         "grid": ("uniform over the declared range" if j in fixed
                                  else "symmetric log grid, 10% steps"),
                         "rank_error_95": q.rank_error_bound(0.05)}
        else:
            m = by_key["impute_mean"]
            half = (fixed[j][1] - fixed[j][0]) / 2.0
            out[name] = {"policy": "mean", "index": j, "fill": float(next(means)),
                         "epsilon": m.epsilon / len(m.columns), "mechanism": "Laplace",
                         "range": [fixed[j][0], fixed[j][1]],
                         # the Laplace scale of the noisy sum, in the column's units, and of
                         # the noisy count of present cells (neither total is reported)
                         "noise_scale_sum": half * m.laplace_scale,
                         "noise_scale_count": m.laplace_scale}
    return out
