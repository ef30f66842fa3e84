"""The Python API: ``beam_dp.train(...)`` returns a ``Model``.

    model = beam_dp.train(X, y, model="logistic", algorithm="dpgd", epsilon=1.0, seed=None)
    model.predict(X_test); model.predict_proba(X_test); model.score(X_test, y_test)
    model.privacy_report["epsilon"]; model.save("out/model")

Data is either in-memory arrays (trained in-process) or files: ``input="data/train-*.parquet"``
(a glob, a comma-separated list of globs or a list of paths), trained on Beam's in-process runner
by default or on any Beam runner (``runner="DataflowRunner", pipeline_args=[...]``), or with
``runner="local"`` in-process. The algorithm's own options are keyword arguments (their names,
defaults and ranges: ``beam-dp algorithms``); the CLI and the scikit-learn estimators call this.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import warnings
from typing import Callable, Sequence

import numpy as np

from beam_dp import accounting, data, features, losses, mechanisms, quality, report, user_level
from beam_dp.algorithms import choice, registry
from beam_dp import schema as schema_mod
from beam_dp.categorical import Encoding, make_encoding

DEFAULT_BEAM_RUNNER = "FnApiRunner"   # DirectRunner first tries to download Prism: no network
LOCAL = "local"


_SCHEMA_DEFAULTS = dict(label_column="label", hash_seed=None)


class PrivacyWarning(UserWarning):
    """A setting that weakens the guarantee (e.g. delta not small against 1/n)."""


class QualityWarning(UserWarning):
    """The private quality check found the model not better than a constant predictor on the
    training data (``beam_dp.quality``)."""


ModelQualityError = quality.ModelQualityError


def train(X=None, y=None, *, input: str | Sequence[str] | None = None,
          algorithm: str = "dpgd", model: str = "logistic",
          epsilon: float | None = None, delta: float = 1e-5,
          noise_multiplier: float | None = None, accountant: str = "pld",
          num_examples: int | None = None, count_epsilon: float | None = None,
          noise: str | None = None, num_classes: int | None = None, huber_delta: float | None = None,
          fit_intercept: bool = True,
          label_column: str = "label", feature_columns: Sequence[str] | None = None,
          runner: str | None = None, pipeline_args: Sequence[str] = (),
          batch_rows: int = data.DEFAULT_BATCH_ROWS, seed: int | None = None,
          steps_per_job: int | None = None, checkpoint_dir: str | None = None,
          progress: Callable[[int, int, float], None] | None = None,
          warm_start: "str | Model | None" = None, max_jobs: int | None = None,
          budget_gate: Callable | None = None, categorical_columns: Sequence[str] | None = None,
          hash_buckets: int | None = None, hash_seed: int | None = None, vocabulary: str | None = None,
          label_classes: Sequence[str] | None = None, positive_class: str | None = None,
          missing: dict | None = None, ignore_columns: Sequence[str] | None = None,
          schema: "str | dict | None" = None, bounds: dict | None = None,
          privacy_unit_column: str | None = None, max_rows_per_user: int | None = None,
          quality_check: str = "on", quality_epsilon: float | None = None,
          quality_label_bound: float | None = None, rows_hint: int | None = None,
          _instrument: Callable | None = None, **options) -> "Model":
    """Trains a differentially private GLM; see the module docstring.

    ``epsilon`` (with ``delta``) calibrates the noise; ``noise_multiplier`` instead reports the
    epsilon it buys. Without ``num_examples`` the dataset size is a private Laplace count whose
    budget is part of epsilon. ``noise``: None (the default: secure noise where the algorithm has
    it, float where secure noise's slack would pass 1e-3 delta, said in the report), "secure"
    (integer noise on exact integer sums, exactly sampled exponential mechanisms; refused where it
    cannot be used) or "float" (numpy's float noise). Without ``seed`` all randomness comes from
    the OS's secure source; a fixed seed is for tests. ``progress(steps_done, steps_total, epsilon_so_far)`` is called
    between chunks of steps. The neighbouring relation is add/remove one row.

    ``warm_start``: a released model (a Model, or its model.json or output directory) to start
    from, for algorithms that support it (dpgd, dpsgd): free, a post-processing of a release.
    ``max_jobs``: on a Beam runner, stop with ``JobLimitReached`` (state checkpointed: needs
    ``checkpoint_dir``) rather than launch more jobs. ``budget_gate(event)``: called with
    everything the run will have released before it releases more (``beam_dp.ledger``'s
    budget across runs; it raises to refuse).

    ``categorical_columns`` (file input): string or integer columns encoded as sparse features
    through ``hash_buckets`` (with the public ``hash_seed``) or a ``vocabulary`` file
    (``beam_dp.categorical``); the model records the encoding and ``predict`` applies it.

    The table's schema (``beam_dp.schema``: a JSON file or dict in ``schema``, or these
    keywords, which win over it): ``label_classes`` (text labels, in class-id order; a binary
    model's ``positive_class`` defaults to the second), ``missing`` (column -> "constant:V",
    "indicator", "indicator:V", "drop", or "median"/"mean", a private fill released by dpgd and
    dpsgd; the label column only "drop"), ``ignore_columns``
    (left out of the default features), ``bounds`` (column -> (low, high): public ranges; dpgd
    and dpsgd scale those columns, and a regression label, without spending privacy).

    ``privacy_unit_column`` (file input; dpgd, dpsgd): user-level privacy, the guarantee for adding or
    removing one user with all their rows (``beam_dp.user_level``): the column is each row's
    user key (never a feature, never printed); a user keeps at most ``max_rows_per_user`` rows
    (default ``user_level.DEFAULT_MAX_ROWS_PER_USER``) and each step clips the user's summed
    gradient to the clip norm; dpsgd's steps sample users (``batch_size`` users expected).

    ``algorithm="auto"`` (``beam_dp.algorithms.choice``): the algorithm the measurements favour
    for the model, the options given and a declared size (``num_examples``, or ``rows_hint``: a
    public estimate of the rows read by that rule only); dpgd but for classification at 10
    million declared rows and more (dpsgd). The report's ``algorithm_choice`` says what it chose
    and why.

    ``_instrument(problem, aggregator) -> (problem, aggregator)``: internal (``beam_dp.tune``
    keeps a candidate's training rows and gives it the released size).

    The private quality check (``beam_dp.quality``, algorithms whose calibration counts the
    releases already in the ledger): ``quality_check`` "on" (default) or "off";
    ``quality_epsilon`` its share of epsilon (default 5 percent; part of the total, not on top);
    ``quality_label_bound`` the public bound L of a regression's labels and predictions in it.
    A model not better than a constant gives a ``QualityWarning``; one much worse (or with
    non-finite coefficients) raises ``ModelQualityError`` and no model is returned.
    """
    if mechanisms.NOISE_SCALE_FOR_TESTS != 1.0:   # the audit's broken build must not train models
        raise RuntimeError("this process has mechanisms.NOISE_SCALE_FOR_TESTS set (a test-only "
                           "hook that scales every noise draw): refusing to train")
    if schema is not None:
        declared = schema_mod.read(schema) if isinstance(schema, str) else schema_mod.from_dict(schema)
        declared.pop("id_columns", None)   # predict's
        given = dict(label_column=label_column, feature_columns=feature_columns,
                     categorical_columns=categorical_columns, hash_buckets=hash_buckets,
                     hash_seed=hash_seed, vocabulary=vocabulary, label_classes=label_classes,
                     positive_class=positive_class, missing=missing, ignore_columns=ignore_columns,
                     bounds=bounds, privacy_unit_column=privacy_unit_column)
        merged = schema_mod.merge(declared, given, _SCHEMA_DEFAULTS)
        (label_column, feature_columns, categorical_columns, hash_buckets, hash_seed, vocabulary,
         label_classes, positive_class, missing, ignore_columns, bounds,
         privacy_unit_column) = (merged[k] for k in given)
    if bounds is not None:
        bounds = schema_mod.check_bounds(bounds)
    if label_classes is not None and model == "softmax" and num_classes is None:
        num_classes = len(label_classes)   # public: the declared classes
    run = _run(X, y, input=input, algorithm=algorithm, model=model, epsilon=epsilon, delta=delta,
               noise_multiplier=noise_multiplier, accountant=accountant,
               num_examples=num_examples, count_epsilon=count_epsilon, noise=noise,
               num_classes=num_classes, huber_delta=huber_delta, fit_intercept=fit_intercept,
               label_column=label_column, feature_columns=feature_columns, runner=runner,
               pipeline_args=pipeline_args, batch_rows=batch_rows, seed=seed,
               steps_per_job=steps_per_job, checkpoint_dir=checkpoint_dir, progress=progress,
               warm_start=warm_start, max_jobs=max_jobs, budget_gate=budget_gate, options=options,
               bounds=bounds, instrument=_instrument, rows_hint=rows_hint,
               bounding=_user_bounding(privacy_unit_column, max_rows_per_user),
               categorical=dict(categorical_columns=categorical_columns, hash_buckets=hash_buckets,
                                hash_seed=hash_seed, vocabulary=vocabulary,
                                label_classes=label_classes, positive_class=positive_class,
                                missing=missing, ignore_columns=ignore_columns),
               quality_options=registry.make_options(quality.QualityOptions, dict(
                   quality_check=quality_check, quality_epsilon=quality_epsilon,
                   quality_label_bound=quality_label_bound)))
    checked = run.quality or {}
    if checked.get("status") == "much_worse":
        raise ModelQualityError(quality.refusal_text(checked))
    artifact = report.model_artifact(run.loss, run.result.theta, run.feature_columns, label_column,
                                     run.algorithm.name, fit_intercept, run.result.feature_transform,
                                     run.result.constraint,
                                     run.encoding.spec() if run.encoding is not None else None)
    privacy_report = report.privacy_report(run.ledger, run.privacy, run.result, run.algorithm,
                                           run.options, seed_fixed=seed is not None)
    if run.quality is not None:
        privacy_report["quality_check"] = run.quality
    if run.choice is not None:
        privacy_report["algorithm_choice"] = run.choice
    for message in _warnings(privacy_report, run.result.dataset_size):
        privacy_report.setdefault("warnings", []).append(message)
        warnings.warn(message, PrivacyWarning, stacklevel=2)
    if checked.get("status") in ("not_better", "inconclusive"):
        message = quality.warning_text(
            checked, (privacy_report.get("hyperparameters") or {}).get("values"))
        privacy_report.setdefault("warnings", []).append(message)
        warnings.warn(message, QualityWarning, stacklevel=2)
    return Model(artifact, privacy_report)


@dataclasses.dataclass
class _Run:
    """A finished training run, before its model artifact and report are made."""

    result: object              # the algorithm's TrainResult
    ledger: accounting.Ledger
    algorithm: registry.Algorithm
    options: object
    privacy: registry.Privacy
    loss: losses.GlmLoss
    feature_columns: list
    encoding: Encoding | None = None
    quality: dict | None = None   # the private quality check's report (None: not asked, the audit)
    choice: dict | None = None    # what --algorithm auto chose and why (None: named by the user)


def _imputed_policies(missing: dict | None) -> bool:
    """Whether a missing-value policy asks for a private fill (median or mean: released by the
    column scaling, with --scale-epsilon's budget)."""
    from beam_dp.categorical import IMPUTED_POLICIES
    return any(str(policy).partition(":")[0] in IMPUTED_POLICIES
               for policy in (missing or {}).values())


def _run(X, y, *, input, algorithm, model, epsilon, delta, noise_multiplier, accountant,
         num_examples, count_epsilon, noise, num_classes, huber_delta, fit_intercept, label_column,
         feature_columns, runner, pipeline_args, batch_rows, seed, steps_per_job=None,
         checkpoint_dir=None, progress=None, warm_start=None, max_jobs=None, budget_gate=None,
         options=None, instrument=None, categorical: dict | None = None,
         bounds: dict | None = None,
         bounding: "user_level.UserBounding | None" = None, quality_options=None,
         rows_hint: int | None = None) -> _Run:
    """``train`` up to its result: what ``train`` and ``beam_dp.audit.run`` share.
    ``instrument(problem, aggregator) -> (problem, aggregator)``: the audit's canaries (a wider
    problem, an aggregator that injects them); None for training. ``quality_options``: the
    ``quality.QualityOptions`` of the private quality check (None: no check, e.g. the audit).
    ``algorithm="auto"``: resolved first, from public inputs only (``choice.choose``)."""
    auto = None
    if algorithm == choice.AUTO:
        categorical = categorical or {}
        auto = choice.choose(model, (options or {}).keys(), num_examples=num_examples,
                             rows_hint=rows_hint,
                             sparse=bool(categorical.get("categorical_columns")),
                             user_level=bounding is not None, checkpoint=bool(checkpoint_dir),
                             warm_start=warm_start is not None, fit_intercept=fit_intercept,
                             noise=noise)
        algorithm = auto.algorithm
    elif rows_hint is not None:
        raise ValueError("rows_hint (--rows-hint) is read by algorithm 'auto' only; drop it or "
                         "give --num-examples (a public size the accounting uses)")
    chosen = registry.get(algorithm)
    if max_jobs is not None and (max_jobs < 1 or not checkpoint_dir):
        raise ValueError("max_jobs (--max-jobs) must be at least 1 and needs a checkpoint_dir "
                         "(--checkpoint-dir) to go on from")
    algorithm_options = registry.make_options(chosen.options, options or {})
    privacy = registry.Privacy(epsilon, delta, noise_multiplier, accountant, num_examples,
                               count_epsilon, noise)
    privacy.validate()
    if (steps_per_job is not None and steps_per_job < 1) or batch_rows < 1:
        raise ValueError("steps_per_job and batch_rows must be at least 1")
    loss = losses.make_loss(model, num_classes, huber_delta)
    chosen.check_request(loss, privacy, algorithm_options)   # before any data is read
    categorical = categorical or {}
    registry.refuse_ignored(registry.Request(
        model, privacy, algorithm_options,
        given=dict(num_classes=num_classes, huber_delta=huber_delta,
                   hash_seed=categorical.get("hash_seed"), count_epsilon=count_epsilon),
        categorical_columns=tuple(categorical.get("categorical_columns") or ()),
        hash_buckets=categorical.get("hash_buckets"),
        imputed=_imputed_policies(categorical.get("missing")),
        warm_start=warm_start is not None, user_level=bounding is not None))
    if bounding is not None:   # before the input is read and grouped by user
        chosen.check_user_level()
    if bounds:
        # A declaration is applied or refused, never silently dropped: only dpgd and dpsgd's
        # column scaling (noisy_gd._column_scaling) applies declared ranges (on dense rows, and
        # on the numeric columns of categorical columns' CSR rows).
        why = (f"--algorithm {chosen.name}" if chosen.name not in SCALING_ALGORITHMS else
               "--feature-norm (another map of the same features)"
               if getattr(algorithm_options, "feature_norm", None) else None)
        if why:
            raise ValueError(f"declared bounds are applied by {' and '.join(SCALING_ALGORITHMS)}'s "
                             f"column scaling, not with {why}: leave the bounds out")
    if (X is None) == (input is None):
        raise ValueError("give either arrays X, y or input= files")
    encoding = None
    if X is not None:
        if runner not in (None, LOCAL):
            raise ValueError("in-memory arrays train in-process; write them to files to use a Beam runner")
        if bounding is not None:
            raise ValueError("privacy_unit_column names a column of the input files (input=); "
                             "write the arrays and their user column to files")
        if categorical and any(v not in (None, 0) for v in categorical.values()):
            raise ValueError("categorical columns, label classes, missing-value policies and "
                             "ignored columns are read from files (input=); encode in-memory "
                             "arrays first")
        feature_columns, aggregator = _array_input(X, y, loss, feature_columns, batch_rows)
        files = "in-memory arrays"
    else:
        files, feature_columns, aggregator, encoding = file_input(
            input, runner or DEFAULT_BEAM_RUNNER, list(pipeline_args), loss, label_column,
            feature_columns, batch_rows, categorical=categorical, bounding=bounding)
    if encoding is not None and encoding.imputed and chosen.name not in IMPUTING_ALGORITHMS:
        # The fill is released by dpgd/dpsgd's private ranges stage, the one place that reads
        # the columns' private statistics before training.
        aggregator.close()
        raise ValueError("median/mean imputation (--missing COLUMN=median or mean) needs "
                         f"--algorithm {' or '.join(IMPUTING_ALGORITHMS)}")
    if max_jobs is not None and hasattr(aggregator, "max_jobs"):
        aggregator.max_jobs = max_jobs
    source = {"files": files, "label_column": label_column, "feature_columns": list(feature_columns)}
    if encoding is not None:   # public: the declared columns and the hash or vocabulary
        source["encoding"] = encoding.spec()
    indicators = [f"{c}_missing" for c in encoding.indicators] if encoding is not None else []
    if bounds or indicators:
        source["bounds"] = _declared_bounds(bounds or {}, encoding.dense_names if encoding is not None
                                            else list(feature_columns), label_column, loss,
                                            indicators)
    initial = None
    if warm_start is not None:
        initial, inherited = _warm_start_theta(warm_start, chosen, loss, list(feature_columns),
                                               label_column, fit_intercept, algorithm_options,
                                               encoding)
        if inherited is not None:
            # The released model's column ranges (public) are this run's: its coefficients
            # are in their space, and nothing new is spent on ranges.
            if "bounds" in source and bounds:
                raise ValueError("--warm-start from a scaled model takes its ranges: drop the "
                                 "schema's bounds")
            source["bounds"] = inherited
    problem = registry.Problem(loss, encoding.dim if encoding is not None else len(feature_columns),
                               privacy, fit_intercept, steps_per_job, checkpoint_dir, source,
                               seed_fixed=seed is not None, initial_theta=initial,
                               sparse=encoding is not None and encoding.sparse,
                               privacy_unit=bounding)
    if bounding is not None:   # public: the unit's column name and K
        source["privacy_unit"] = dataclasses.asdict(bounding)
    chosen.check(problem)
    if bounding is not None and budget_gate is not None:
        raise ValueError(USER_LEVEL_LEDGER)
    relation = accounting.USER_ADD_REMOVE if bounding is not None else chosen.relation
    ledger = accounting.Ledger(accountant, relation, gate=budget_gate)
    run_seed = seed if seed is not None else mechanisms.secure_seed()
    check, checked = None, None
    if quality_options is not None and quality_options.quality_check == "off":
        checked = {"status": "off", "reason": "quality_check off (--quality-check off)"}
    elif quality_options is not None and not chosen.quality_check:
        checked = {"status": "skipped", "reason": f"{chosen.name}: {chosen.why_no_quality_check}"}
    elif quality_options is not None:
        # Reserved before training, from public constants: the algorithm's calibration then
        # meets the total (epsilon, delta) with the check's release in it.
        bound = quality_options.quality_label_bound
        if bound is None:   # an algorithm's own public label bound (ssp's --label-bound), if any
            bound = getattr(algorithm_options, "label_bound", None)
        # Secure noise where the algorithm's is (sparse input: float, as its steps).
        secure = chosen.secure_noise and not problem.sparse and privacy.noise != "float"
        check = quality.reserve(ledger, loss, privacy, epsilon=quality_options.quality_epsilon,
                                label_bound=bound, secure=secure)
    try:
        if instrument is not None:
            problem, aggregator = instrument(problem, aggregator)
        result = chosen.train(algorithm_options, problem, aggregator, run_seed, ledger,
                              progress or (lambda done, total, eps: None))
        if encoding is not None and encoding.imputed:
            # The released fills (public) go into the encoding: model.json's, and so predict's.
            released = (getattr(result, "preprocessing", None) or {}).get("imputation") or {}
            encoding = encoding.with_fills({c: v["fill"] for c, v in released.items()})
            if encoding.pending.any():
                raise RuntimeError("a median/mean fill was not released (a bug)")
        if quality_options is not None:   # (even with the check off: such a model is no model)
            quality.check_finite(result.theta)
        label_range = (getattr(result, "preprocessing", None) or {}).get("label_range")
        if (check is not None and check.label_bound is not None and label_range
                and quality_options.quality_label_bound is None
                and getattr(algorithm_options, "label_bound", None) is None):
            check = check.with_label_range(label_range)
        if check is not None:
            # A run resumed after it finished finds its check's release beside the checkpoint.
            noisy = quality.load_saved(problem.checkpoint_dir, result.theta, check)
            if noisy is None:
                stage = check.stage(loss, result.theta, result.feature_transform, run_seed)
                noisy = aggregator.run_stages([stage], {})[stage.key]
                quality.save(problem.checkpoint_dir, result.theta, check, noisy)
            checked = quality.judged(loss, noisy, check, result.dataset_size["value"],
                                     "the training data")
    finally:
        aggregator.close()
    return _Run(result, ledger, chosen, algorithm_options, privacy, loss, list(feature_columns),
                encoding, checked, auto.report() if auto is not None else None)


IMPUTING_ALGORITHMS = ("dpgd", "dpsgd")   # whose private ranges stage releases the fills
SCALING_ALGORITHMS = ("dpgd", "dpsgd")    # whose column scaling applies declared bounds


def _declared_bounds(bounds: dict, dense_names: list, label_column: str, loss,
                     indicators=()) -> dict:
    """The declared public ranges by model column ({"columns": [[index, low, high], ...],
    "label": [low, high] or None}); a missing-value indicator column is [0, 1] by construction.
    A name that is neither a numeric feature nor a regression label is an error (naming the
    column: a declaration, not data)."""
    index = {name: i for i, name in enumerate(dense_names)}
    columns = {index[name]: [0.0, 1.0] for name in indicators}
    label = None
    for name, pair in bounds.items():
        if name == label_column:
            if loss.name != "linear":
                raise ValueError(f"bounds for the label '{name}': only a linear regression's "
                                 "label is scaled (a classifier's labels are classes; Huber's "
                                 "--huber-delta is in the label's units)")
            label = [float(pair[0]), float(pair[1])]
        elif name in index:
            columns[index[name]] = [float(pair[0]), float(pair[1])]
        else:
            raise ValueError(f"bounds given for '{name}', which is not a numeric feature column "
                             "of this model (nor its label)")
    return {"columns": [[i, *columns[i]] for i in sorted(columns)], "label": label}


def _warm_start_theta(warm_start, chosen, loss, feature_columns, label_column, fit_intercept,
                      algorithm_options, encoding: Encoding | None = None) -> np.ndarray:
    """The coefficients of a released model to start from, if it fits this run: the same
    model, features, label and intercept, and no feature transform on either side (a transform
    would put the coefficients in another space)."""
    if not chosen.warm_start:
        supported = ", ".join(a.name for a in registry.algorithms().values() if a.warm_start)
        raise ValueError(f"{chosen.name} does not start from a model (--warm-start works with "
                         f"{supported})")
    try:
        model = warm_start if isinstance(warm_start, Model) else Model.load(warm_start)
    except (OSError, ValueError) as e:
        raise ValueError(f"--warm-start {warm_start}: {' '.join(str(e).split())}") from None
    artifact = model.artifact
    mismatch = [what for what, same in (
        ("model", artifact["model"] == loss.name),
        ("feature columns", list(artifact["feature_columns"]) == feature_columns),
        ("categorical encoding", artifact.get("encoding") == (encoding.spec() if encoding else None)),
        ("label column", artifact["label_column"] == label_column),
        ("intercept", artifact["fit_intercept"] == fit_intercept),
        ("number of outputs", model.theta.shape[0] == loss.outputs())) if not same]
    if mismatch:
        detail = ""
        if "feature columns" in mismatch:
            theirs, ours = list(artifact["feature_columns"]), feature_columns
            detail = (f" (the model's {len(theirs)}, this run's {len(ours)}; only in the model: "
                      f"{sorted(set(theirs) - set(ours))[:5]}, only in this run: "
                      f"{sorted(set(ours) - set(theirs))[:5]})")
        raise ValueError(f"--warm-start: the model does not fit this run: its "
                         f"{', '.join(mismatch)} differ{detail}")
    # A model scaled by ranges (declared or released: public) is continued on the same ranges
    # (noisy_gd, with --scale-features auto or none); any other map would put the coefficients
    # in another space.
    transform = artifact.get("feature_transform") or {}
    scaled = set(transform) == {"scale_columns"} and hasattr(algorithm_options, "scale_features")
    if ((transform and not scaled) or getattr(algorithm_options, "feature_norm", None)
            or getattr(algorithm_options, "scale_features", "none") == "private"):
        raise ValueError("--warm-start needs models without a feature transform other than "
                         "column ranges (no --feature-norm, no --scale-features private) on "
                         "both sides")
    inherited = features.ranges_as_bounds(transform["scale_columns"]) if scaled else None
    return np.array(model.theta, dtype=np.float64), inherited


LARGE_EPSILON = 10.0


def _warnings(privacy_report: dict, dataset_size: dict) -> list[str]:
    """Settings that weaken the guarantee or the model, from public values only (the reported
    epsilon, delta and the released count with its public error bound)."""
    found = []
    n, delta, epsilon = dataset_size["value"], privacy_report["delta"], privacy_report["epsilon"]
    if delta * n >= 1:
        found.append(f"delta = {delta:g} is not small against 1/n (n ~ {n}): a mechanism may then "
                     f"publish a {'user' if dataset_size.get('unit') == 'users' else 'row'} "
                     "outright; choose delta well below 1/n")
    if epsilon > LARGE_EPSILON:
        found.append(f"epsilon = {epsilon:.4g} is above {LARGE_EPSILON:g}: the guarantee says "
                     "little at that level")
    error = dataset_size.get("error_bound_95")
    if error is not None and error > 0.1 * n:
        unit = dataset_size.get("unit", "rows")   # users under user-level privacy
        found.append(f"the private count's 95% error (+-{error:.0f} {unit}) is large against n ~ {n}: "
                     "steps are normalized by a cautious floor and learn slowly; give "
                     "num_examples (--num-examples) if n is public, or a larger count_epsilon")
    chose = privacy_report.get("algorithm_choice") or {}
    if chose.get("rows_source") == "--rows-hint" and error is not None:
        # The hint (public) against the released count (public): a hint off by 10x or more
        # made --algorithm auto choose for another table (20,000,000 hinted on ISLR Default's
        # 10,000 rows chose dpsgd, which the quality check found no better than the constant).
        hint = chose["rows"]
        if hint > 10 * (n + error) or 10 * hint < n - error:
            found.append(f"--rows-hint {hint:,} is far from the private count (n ~ {n}, "
                         f"+-{error:.0f}): --algorithm auto chose {chose['chosen']} for a table "
                         "of the hinted size; give a closer hint or name the algorithm")
    imputed = (privacy_report.get("preprocessing") or {}).get("imputation") or {}
    for name, fill in imputed.items():
        # (public: the mechanism's error bound against the released count)
        if fill.get("policy") == "median" and fill["rank_error_95"] > IMPUTE_RANK_ERROR * n:
            # (declaring the range is advice only where the column has none)
            declare = ("" if fill.get("grid") == "uniform over the declared range"
                       else "declare the column's range (bounds), ")
            found.append(f"the private median filling '{name}' has a 95% rank error of "
                         f"{fill['rank_error_95']:.0f} rows against n ~ {n}: it may lie anywhere "
                         f"on its grid ({fill['grid']}); {declare}give a larger --scale-epsilon, "
                         "or use indicator")
    preprocessing = privacy_report.get("preprocessing") or {}
    declared = (preprocessing.get("declared_bounds") or {}).get("columns")
    if declared and preprocessing.get("scaling_skipped"):
        # Some columns mapped onto [-1, 1] from declared ranges, the rest raw (n too small for
        # their private ranges): MASS Boston with three of 13 ranges declared gave RMSE 61.5
        # against the constant's 9.2, and only the report's scaling_skipped said why.
        found.append(f"{len(declared)} column(s) are mapped onto [-1, 1] by their declared ranges "
                     "but the others are used as given (n is too small for their private ranges: "
                     "the report's preprocessing.scaling_skipped): declare every column's range, "
                     "or none")
    return found


IMPUTE_RANK_ERROR = 0.25   # as --scale-features auto's rule (noisy_gd.AUTO_SCALE_RANK_ERROR)


# Why the budget ledger refuses user-level runs: its Renyi filter composes every run on a
# partition under one row-level relation, and a user-level guarantee is for another unit (with
# this bounding, removing one row can move a user's clipped sum by up to 2 C, so it is not a
# row-level guarantee at the same epsilon either). Mixing them needs a per-relation budget.
USER_LEVEL_LEDGER = ("the budget ledger (--ledger) composes row-level runs; user-level runs "
                     "(--privacy-unit-column) are not charged to it yet")


def _user_bounding(column: str | None, max_rows: int | None):
    """The user-level bounds from the keywords (None: row-level), checked."""
    if column is None:
        if max_rows is not None:
            raise ValueError("max_rows_per_user (--max-rows-per-user) bounds the rows of each "
                             "user: it needs privacy_unit_column (--privacy-unit-column)")
        return None
    if not isinstance(column, str) or not column:
        raise ValueError("privacy_unit_column must be a column name")
    if max_rows is None:
        max_rows = user_level.DEFAULT_MAX_ROWS_PER_USER
    if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or max_rows < 1:
        raise ValueError("max_rows_per_user (--max-rows-per-user) must be a whole number, at least 1")
    return user_level.UserBounding(column, int(max_rows))


def file_input(input, runner, pipeline_args, loss, label_column, feature_columns, batch_rows,
               read_label: bool = True, categorical: dict | None = None,
               bounding: "user_level.UserBounding | None" = None):
    """The input files, their feature columns, the aggregator for the chosen runner and the
    categorical encoding (None without categorical columns). ``read_label`` False (private
    statistics): the label column is only left out of the default features. ``categorical``:
    ``categorical_columns``, ``hash_buckets``, ``hash_seed`` and ``vocabulary`` as given."""
    patterns = [input] if isinstance(input, str) else list(input)
    files = sorted({f for pattern in patterns for f in data.list_files(pattern)})
    if not files:   # input=[] or "" (list_files of "" matches nothing without an error)
        raise data.DataError("no input files given")
    if runner == LOCAL:
        open_file = data.open_local
    else:
        from beam_dp.beam.transforms import open_file
    categorical = dict(categorical or {})
    named = list(categorical.pop("categorical_columns", None) or ())
    ignore = list(categorical.pop("ignore_columns", None) or ())
    user_column = bounding.column if bounding is not None else None
    if user_column is not None:
        _check_user_column(files[0], open_file, user_column, label_column, feature_columns,
                           categorical.get("categorical_columns"))
        ignore = ignore + [user_column] * (user_column not in ignore)   # a key, never a feature
    columns = data.resolve_feature_columns(files[0], label_column, feature_columns, open_file,
                                           require_label=read_label, categorical=named,
                                           ignore=ignore,
                                           text_label=bool(categorical.get("label_classes")))
    categorical["missing"] = schema_mod.label_policy(categorical.get("missing"), label_column)
    encoding = make_encoding(columns, named, **categorical)
    if encoding is not None:
        columns = encoding.columns
        _check_classes(encoding, loss)
    read = label_column if read_label else None
    if runner == LOCAL:
        from beam_dp.local import LocalAggregator
        blocks = data.load_blocks(files, read, columns, loss, batch_rows, encoding, user_column)
        if bounding is not None:   # every user's rows bounded and in one block (one sort)
            blocks = user_level.group_by_user(blocks, bounding.max_rows, batch_rows)
        return files, columns, LocalAggregator(blocks), encoding
    from beam_dp.beam.aggregator import BeamAggregator
    return files, columns, BeamAggregator(files, read, columns, loss, batch_rows,
                                          ["--runner", runner] + pipeline_args,
                                          encoding=encoding, user_bounding=bounding), encoding


def _check_user_column(path, open_file, column, label_column, feature_columns, categorical):
    """The privacy unit's column exists and is not also the label or a feature."""
    if column == label_column or column in (feature_columns or ()) or column in (categorical or ()):
        raise ValueError(f"the privacy unit column '{column}' is also the label or a feature: "
                         "it is read as a key only")
    if column not in data.read_schema(path, open_file).names:
        raise data.DataError(f"{path}: privacy unit column '{column}' not found")


def _check_classes(encoding: Encoding, loss: losses.GlmLoss) -> None:
    """Declared label classes fit the model: two for a binary one, num_classes for softmax,
    none for regression."""
    classes = encoding.label_classes
    if classes is None:
        return
    if not loss.is_classifier:
        raise ValueError(f"--label-classes declares classes, but --model {loss.name} is a regression")
    if loss.name == "softmax":
        if len(classes) != loss.outputs():
            raise ValueError(f"--label-classes lists {len(classes)} classes, --num-classes is "
                             f"{loss.outputs()}")
    elif len(classes) != 2:
        raise ValueError(f"--model {loss.name} is binary: --label-classes must list two classes "
                         "(use --model softmax for more)")


def _feature_names(X, feature_columns, width: int) -> list[str]:
    if feature_columns is not None:
        names = list(feature_columns)
    elif hasattr(X, "columns"):   # a pandas DataFrame: its column names, as declared
        names = [str(c) for c in X.columns]
    else:
        names = [f"x{j}" for j in range(width)]
    if len(names) != width:
        raise ValueError(f"{len(names)} feature names for {width} columns")
    return names


def _array_input(X, y, loss, feature_columns, batch_rows):
    from beam_dp.local import LocalAggregator

    if y is None:
        raise ValueError("give the labels y with X")
    x = data.as_feature_matrix(X)
    labels = np.asarray(y, dtype=np.float64).reshape(-1) if _numeric_labels(y) else None
    if labels is None:
        raise ValueError("labels must be numbers (encode classes as 0..K-1, or 0/1 or -1/+1)")
    if len(labels) != x.shape[0]:
        raise ValueError(f"X has {x.shape[0]} rows but y has {len(labels)}")
    names = _feature_names(X, feature_columns, x.shape[1])
    blocks = data.blocks_from_arrays(x, labels, loss, batch_rows, feature_names=names)
    if not blocks:
        raise data.DataError("arrays: the input has no rows")
    return names, LocalAggregator(blocks)


def _numeric_labels(y) -> bool:
    kind = np.asarray(y).dtype.kind
    return kind in "biuf"


class Model:
    """A trained model: the artifact of model.json and, after training, the privacy report.

    ``predict``/``predict_proba``/``decision_function``/``score`` take a feature matrix (or a
    DataFrame with the feature columns) of raw features: the recorded feature map (e.g. the row
    normalization training used) is applied first, as training applied it.
    """

    def __init__(self, artifact: dict, privacy_report: dict | None = None):
        self.artifact = artifact
        self.privacy_report = privacy_report
        self.loss, self.theta, _ = report.load_model_dict(artifact)

    @property
    def encoding(self) -> Encoding | None:
        """How categorical columns become features (None: dense numeric features only)."""
        spec = self.artifact.get("encoding")
        return Encoding.from_spec(spec) if spec else None

    @property
    def feature_map(self):
        """The recorded raw-feature map (identity when none). Built on access, not stored: the
        identity is a lambda, and a stored lambda made Models (and fitted estimators) unpicklable."""
        return features.from_spec(self.artifact.get("feature_transform"))

    # -- what it is
    @property
    def feature_columns(self) -> list[str]:
        return list(self.artifact["feature_columns"])

    @property
    def coefficients(self) -> np.ndarray:
        return self.theta[:, :-1] if self.loss.outputs() > 1 else self.theta[0, :-1]

    @property
    def intercept(self):
        return self.theta[:, -1] if self.loss.outputs() > 1 else float(self.theta[0, -1])

    @property
    def epsilon(self) -> float | None:
        return None if self.privacy_report is None else self.privacy_report["epsilon"]

    def __repr__(self):
        budget = "" if self.privacy_report is None else (
            f", epsilon={self.privacy_report['epsilon']:.4g}, delta={self.privacy_report['delta']:g}")
        return (f"Model({self.artifact['model']} by {self.artifact['algorithm']}, "
                f"{len(self.feature_columns)} features{budget})")

    # -- applying it
    def block_scores(self, block: data.Block) -> np.ndarray:
        """(m, k) scores of a block of raw features."""
        return losses.scores(self.theta, self.feature_map(block).features)

    def _features(self, X):
        encoding = self.encoding
        if encoding is not None:
            return encode_columns(X, encoding)
        if hasattr(X, "columns") and set(self.feature_columns) <= {str(c) for c in X.columns}:
            X = X[self.feature_columns]
        elif isinstance(X, dict):   # columns by name, as a model with an encoding takes them
            absent = [c for c in self.feature_columns if c not in X]
            if absent:
                raise ValueError(f"X lacks the model's column(s): {', '.join(absent)}")
            X = np.column_stack([np.asarray(X[c]) for c in self.feature_columns])
        x = data.as_feature_matrix(X)
        if x.shape[1] != len(self.feature_columns):
            raise ValueError(f"X has {x.shape[1]} columns; the model has {len(self.feature_columns)} features")
        data.check_finite(x, "X")
        return x

    def _rows(self, X):
        """(features, rows a declared "drop" policy leaves out, or None)."""
        encoding = self.encoding
        return encode_rows(X, encoding) if encoding is not None else (self._features(X), None)

    def decision_function(self, X) -> np.ndarray:
        """Scores; NaN for a row a declared "drop" policy leaves out."""
        x, dropped = self._rows(X)
        s = self.block_scores(data.Block(x, np.zeros(x.shape[0])))
        if dropped is not None:
            s[dropped] = np.nan
        return s[:, 0] if s.shape[1] == 1 else s

    def predict(self, X) -> np.ndarray:
        """Predictions: class ids (or the declared class names, ``label_classes``), or values.
        A row that a declared "drop" policy would leave out of training gets None (NaN for a
        regression)."""
        x, dropped = self._rows(X)
        return self.labels_of(self._ids(x), dropped)

    def _ids(self, x) -> np.ndarray:
        """Predicted class ids (or values) of encoded features."""
        return self.loss.predict(self.block_scores(data.Block(x, np.zeros(x.shape[0]))))

    def labels_of(self, predicted: np.ndarray, dropped: np.ndarray | None = None) -> np.ndarray:
        """Predicted ids as the declared class names (if any); rows in ``dropped`` as None (or
        NaN for numbers)."""
        encoding = self.encoding
        classes = encoding.label_classes if encoding is not None else None
        if classes is not None:
            if len(classes) == 2 and encoding.positive_class is not None:
                negative = [c for c in classes if c != encoding.positive_class][0]
                names = np.array([negative, encoding.positive_class], dtype=object)
            else:
                names = np.array(classes, dtype=object)
            predicted = names[np.asarray(predicted, dtype=np.int64)]
        if dropped is not None and dropped.any():
            predicted = np.array(predicted, dtype=object if classes is not None or
                                 self.loss.is_classifier else np.float64)
            predicted[dropped] = None if predicted.dtype == object else np.nan
        return predicted

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities, (m, 2) for logistic (columns: class 0, class 1) and (m, K) for
        softmax. Hinge and regression models have none."""
        if self.loss.name not in ("logistic", "softmax"):
            raise ValueError(f"a {self.loss.name} model has no class probabilities")
        s = self.decision_function(X)
        if self.loss.name == "logistic":
            p = losses.expit(s)
            return np.column_stack([1.0 - p, p])
        from scipy.special import softmax
        return softmax(s, axis=1)

    def score(self, X, y) -> float:
        """Accuracy for classifiers, R^2 for regression (scikit-learn's conventions)."""
        x, dropped = self._rows(X)
        prediction = self.labels_of(self._ids(x))
        # Rows a declared "drop" policy leaves out are not scored (they have no prediction).
        scored = np.ones(len(prediction), dtype=bool) if dropped is None else ~dropped
        encoding = self.encoding
        if encoding is not None and encoding.label_classes is not None:
            truth = np.asarray(y, dtype=object).reshape(-1).astype(str)
            return float(np.mean(prediction[scored].astype(str) == truth[scored]))
        prediction = prediction[scored].astype(np.float64)
        y = np.asarray(y, dtype=np.float64).reshape(-1)[scored]
        if self.loss.is_classifier:
            truth = (y > 0).astype(np.int64) if self.loss.name in ("logistic", "hinge") else y
            return float(np.mean(prediction == truth))
        residual = float(np.sum((y - prediction) ** 2))
        total = float(np.sum((y - y.mean()) ** 2))
        return 1.0 - residual / total if total > 0 else 0.0

    # -- files
    def save(self, path: str, overwrite: bool = False) -> None:
        """Writes model.json and privacy_report.json into the directory ``path`` atomically."""
        with report.atomic_directory(path, overwrite) as out:
            report.write_json(out, "model.json", self.artifact)
            if self.privacy_report is not None:
                report.write_json(out, "privacy_report.json", self.privacy_report)

    @classmethod
    def load(cls, path: str) -> "Model":
        """From a directory written by ``save`` or ``beam-dp train``, or a model.json file."""
        artifact = report.read_model(path)
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        privacy_path = os.path.join(directory, "privacy_report.json")
        privacy = report.read_json(privacy_path) if os.path.exists(privacy_path) else None
        return cls(artifact, privacy)


def encode_columns(X, encoding: Encoding):
    """The features of in-memory columns (a DataFrame, or a dict of column -> values) through a
    model's encoding (``encode_rows``, whose flagged rows are left filled with zeros)."""
    return encode_rows(X, encoding)[0]


def encode_rows(X, encoding: Encoding):
    """(features, dropped rows or None) of in-memory columns (a DataFrame, or a dict of column ->
    values) through a model's encoding: its numeric columns as numbers (a missing cell by its
    declared policy, else checked finite), its categorical ones as text. A value the encoding
    has not seen takes its hash bucket or its column's "other" id. The features are CSR with
    categorical columns, else dense; a row a "drop" policy leaves out is filled with zeros and
    flagged in the second value."""
    import pyarrow as pa
    if not encoding.categorical and not hasattr(X, "columns") and not isinstance(X, dict):
        # No categorical columns: a matrix of the numeric columns, in order, will do.
        x = data.as_feature_matrix(X)
        if x.shape[1] != len(encoding.numeric):
            raise ValueError(f"X has {x.shape[1]} columns; the model has {len(encoding.numeric)} "
                             "features")
        X = {name: x[:, j] for j, name in enumerate(encoding.numeric)}
    try:
        table = pa.Table.from_pandas(X, preserve_index=False) if hasattr(X, "columns") else pa.table(X)
    except (TypeError, ValueError, pa.ArrowException):
        raise ValueError("a model with categorical columns predicts from a DataFrame or a dict "
                         "of columns") from None
    absent = [c for c in encoding.columns if c not in table.column_names]
    if absent:
        raise ValueError(f"X lacks the model's column(s): {', '.join(absent)}")
    m = table.num_rows
    numeric = np.empty((m, len(encoding.numeric)))
    for j, name in enumerate(encoding.numeric):
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                or pa.types.is_null(column.type)):
            raise ValueError(f"column '{name}' must hold numbers")
        numeric[:, j] = column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    dense, keep = encoding.fill(numeric)   # the declared missing-value policies
    data.check_finite(dense, "X", 0, encoding.dense_names)
    return (encoding.encode(dense, {c: table.column(c) for c in encoding.categorical}),
            None if keep.all() else ~keep)


def options_of(algorithm: str) -> dict:
    """The declared options of an algorithm with their defaults (None: derived)."""
    chosen = registry.get(algorithm)
    return {f.name: f.default for f in dataclasses.fields(chosen.options)}
