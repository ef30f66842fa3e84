"""The Python API: ``beam_dp.train(...)`` returns a ``Model``.

    model = beam_dp.train(X, y, model="logistic", algorithm="dpgd", epsilon=1.0, seed=None)
    model.predict(X_test); model.predict_proba(X_test); model.score(X_test, y_test)
    model.privacy_report["epsilon"]; model.save("out/model")

Data is either in-memory arrays (trained in-process), a pandas DataFrame read as a table
(``beam_dp.train(frame, schema=...)``, in-process: ``beam_dp.frames``) or files:
``input="data/train-*.parquet"`` (a glob, a comma-separated list of globs or a list of paths),
trained on Beam's in-process runner by default or on any Beam runner (``runner="DataflowRunner",
pipeline_args=[...]``), or with ``runner="local"`` in-process. The algorithm's own options are
keyword arguments (their names, defaults and ranges: ``beam-dp algorithms``); the CLI and the
scikit-learn estimators call this.

``train`` is a sequence of steps (``_execute``): the request's checks, every refusal before any
data is read; the rows; the problem they pose; the privacy budget; the training; then the Model
(``beam_dp.model``) and its report.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Sequence

import numpy as np

from beam_dp import (accounting, data, frames, losses, mechanisms, quality, report, storage,
                     user_level)
from beam_dp.algorithms import choice, ignored_options, registry, spec
from beam_dp.algorithms.base import CHECKPOINT_FILE
from beam_dp import schema as schema_mod
from beam_dp.categorical import Encoding, make_encoding
from beam_dp.model import Model
from beam_dp.warm_start import warm_start_theta

DEFAULT_BEAM_RUNNER = "FnApiRunner"   # DirectRunner first tries to download Prism: no network
LOCAL = "local"


_SCHEMA_DEFAULTS = dict(label_column="label", hash_seed=None)


class PrivacyWarning(UserWarning):
    """A setting that weakens the guarantee (e.g. delta not small against 1/n)."""


class QualityWarning(UserWarning):
    """The private quality check found the model worse than a constant predictor on the
    training data, beyond its noise (``beam_dp.quality``)."""


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
          label_positive: dict | None = None,
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

    ``X`` a pandas DataFrame with ``y`` None, a ``schema`` or declared columns (categorical,
    label classes, missing-value policies, ignored columns, a privacy unit): a table, read as
    ``input=`` reads a Parquet file with the same schema (``beam_dp.frames``), its labels in its
    ``label_column`` (or ``y``, added as that column); in-process only.

    ``categorical_columns`` (file input): string or integer columns encoded as sparse features
    through ``hash_buckets`` (with the public ``hash_seed``) or a ``vocabulary`` file
    (``beam_dp.categorical``); the model records the encoding and ``predict`` applies it.

    The table's schema (``beam_dp.schema``: a JSON file or dict in ``schema``, or these
    keywords, which win over it): ``label_classes`` (text labels, in class-id order; a binary
    model's ``positive_class`` defaults to the second) or ``label_positive`` (a binary label
    derived from the label column: {"at_least": 4} or {"one_of": [...]}), ``missing`` (column ->
    "constant:V",
    "indicator", "indicator:V", "drop", or "median"/"mean", a private fill released by dpgd and
    dpsgd; the label column only "drop"), ``ignore_columns``
    (left out of the default features), ``bounds`` (column -> (low, high): public ranges; dpgd
    and dpsgd scale those columns, and a regression label, without spending privacy).

    ``privacy_unit_column`` (file input; dpgd, dpsgd): user-level privacy, the guarantee for adding or
    removing one user with all their rows (``beam_dp.user_level``): the column is each row's
    user key (a categorical feature too if listed so, never printed); a user keeps at most
    ``max_rows_per_user`` rows (default ``user_level.DEFAULT_MAX_ROWS_PER_USER``, or "auto":
    ``beam_dp.user_rows``) and each step clips the user's summed gradient to the clip norm;
    dpsgd's steps sample users (``batch_size`` users expected).

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
    A model worse than a constant gives a ``QualityWarning`` (an inconclusive check is recorded
    in the report, never a warning); one much worse (or with
    non-finite coefficients) raises ``ModelQualityError`` and no model is returned.
    """
    _refuse_scaled_noise()
    table = Table.declared(schema, label_column=label_column, feature_columns=feature_columns,
                           categorical_columns=categorical_columns, hash_buckets=hash_buckets,
                           hash_seed=hash_seed, vocabulary=vocabulary, label_classes=label_classes,
                           positive_class=positive_class, label_positive=label_positive,
                           missing=missing,
                           ignore_columns=ignore_columns, bounds=bounds,
                           privacy_unit_column=privacy_unit_column)
    if table.label_classes is not None and model == "softmax" and num_classes is None:
        num_classes = len(table.label_classes)   # public: the declared classes
    if input is None and frames.is_frame(X) and (y is None or schema is not None
                                                 or table.declares_columns()):
        # A table, not a feature matrix: read as input= reads a file (converted when read).
        X, y, input = None, None, frames.FrameTable(X, y, table.label_column)
    request = _Request(
        input=input, algorithm=algorithm, model=model,
        privacy=spec.Privacy(epsilon, delta, noise_multiplier, accountant, num_examples,
                             count_epsilon, noise),
        num_classes=num_classes, huber_delta=huber_delta, fit_intercept=fit_intercept, table=table,
        bounding=user_level.requested(table.privacy_unit_column, max_rows_per_user), runner=runner,
        pipeline_args=pipeline_args, batch_rows=batch_rows, seed=seed, steps_per_job=steps_per_job,
        checkpoint_dir=checkpoint_dir, progress=progress, warm_start=warm_start,
        max_jobs=max_jobs, budget_gate=budget_gate, options=options, instrument=_instrument,
        rows_hint=rows_hint, quality_options=spec.make_options(quality.QualityOptions, dict(
            quality_check=quality_check, quality_epsilon=quality_epsilon,
            quality_label_bound=quality_label_bound)))
    return _model_of(_execute(X, y, request), request)


def _refuse_scaled_noise() -> None:
    if mechanisms.NOISE_SCALE_FOR_TESTS != 1.0:   # the audit's broken build must not train models
        raise RuntimeError("this process has mechanisms.NOISE_SCALE_FOR_TESTS set (a test-only "
                           "hook that scales every noise draw): refusing to train")


_TABLE_ENCODING = ("categorical_columns", "hash_buckets", "hash_seed", "vocabulary",
                   "label_classes", "positive_class", "label_positive", "missing", "ignore_columns")


@dataclasses.dataclass
class Table:
    """The table as declared (public, never read from the data): a schema (``beam_dp.schema``,
    a file or a dict) under ``train``'s keywords, a keyword not at its default winning."""

    label_column: str = "label"
    feature_columns: Sequence[str] | None = None
    categorical_columns: Sequence[str] | None = None
    hash_buckets: int | None = None
    hash_seed: int | None = None
    vocabulary: str | dict | None = None
    label_classes: Sequence[str] | None = None
    positive_class: str | None = None
    label_positive: dict | None = None   # a binary label derived from the label column
    missing: dict | None = None
    ignore_columns: Sequence[str] | None = None
    bounds: dict | None = None
    privacy_unit_column: str | None = None

    @classmethod
    def declared(cls, schema: "str | dict | None", **keywords) -> "Table":
        if schema is not None:
            declared = (schema_mod.read(schema) if isinstance(schema, str)
                        else schema_mod.from_dict(schema))
            declared.pop("id_columns", None)   # predict's
            keywords = schema_mod.merge(declared, keywords, _SCHEMA_DEFAULTS)
        table = cls(**keywords)
        if table.bounds is not None:
            table.bounds = schema_mod.check_bounds(table.bounds)
        return table

    def encoding_keywords(self) -> dict:
        """What the categorical encoding is made from (``file_input``'s ``categorical``)."""
        return {name: getattr(self, name) for name in _TABLE_ENCODING}

    def declares_columns(self) -> bool:
        """Whether columns are declared beyond numeric features and a numeric label (what only
        a table, a file or a DataFrame, can carry)."""
        return (self.privacy_unit_column is not None
                or any(v not in (None, 0) for v in self.encoding_keywords().values()))


@dataclasses.dataclass
class _Request:
    """A training request as given (``train``'s keywords, the table resolved): what each step of
    ``_execute`` reads."""

    input: object                # files (globs or paths), a frames.FrameTable, or None (arrays)
    algorithm: str
    model: str
    privacy: spec.Privacy    # (validated by the request's checks)
    num_classes: int | None
    huber_delta: float | None
    fit_intercept: bool
    table: Table
    bounding: "user_level.UserBounding | None"
    runner: str | None
    pipeline_args: Sequence[str]
    batch_rows: int
    seed: int | None
    steps_per_job: int | None = None
    checkpoint_dir: str | None = None
    progress: Callable | None = None
    warm_start: "str | Model | None" = None
    max_jobs: int | None = None
    budget_gate: Callable | None = None
    options: dict = dataclasses.field(default_factory=dict)   # the algorithm's, as given
    instrument: Callable | None = None
    rows_hint: int | None = None
    quality_options: object = None   # quality.QualityOptions (None: no check, e.g. the audit)


@dataclasses.dataclass
class _Checked:
    """The request after its checks, before any data is read."""

    algorithm: spec.Algorithm
    options: object              # the algorithm's options
    loss: losses.GlmLoss
    choice: "choice.Choice | None" = None   # what algorithm "auto" chose (None: named)


@dataclasses.dataclass
class _Input:
    """The rows, read: a description for the report, the feature columns, the aggregator over
    them and the categorical encoding (None: dense numeric features)."""

    files: object
    feature_columns: list
    aggregator: object
    encoding: Encoding | None = None


@dataclasses.dataclass
class _Budget:
    """The run's ledger and the quality check's reservation in it, made before training."""

    ledger: accounting.Ledger
    check: object = None         # quality.reserve's check (None: no check runs)
    verdict: dict | None = None  # the check's report when it does not run (off, skipped)


@dataclasses.dataclass
class _Run:
    """A finished training run, before its model artifact and report are made."""

    result: object              # the algorithm's TrainResult
    ledger: accounting.Ledger
    algorithm: spec.Algorithm
    options: object
    privacy: spec.Privacy
    loss: losses.GlmLoss
    feature_columns: list
    encoding: Encoding | None = None
    quality: dict | None = None   # the private quality check's report (None: not asked, the audit)
    choice: dict | None = None    # what --algorithm auto chose and why (None: named by the user)
    step_sums: object = None      # who summed the steps over sampled batches (Beam: step_costs)


def _imputed_policies(missing: dict | None) -> bool:
    """Whether a missing-value policy asks for a private fill (median or mean: released by the
    column scaling, with --scale-epsilon's budget)."""
    from beam_dp.categorical import IMPUTED_POLICIES
    return any(str(policy).partition(":")[0] in IMPUTED_POLICIES
               for policy in (missing or {}).values())


def _run(X, y, *, input, algorithm, model, epsilon, delta, noise_multiplier, accountant,
         num_examples, count_epsilon, noise, num_classes, huber_delta, fit_intercept, label_column,
         feature_columns, runner, pipeline_args, batch_rows, seed, progress=None, options=None,
         instrument=None, budget_gate=None) -> _Run:
    """``train`` up to its result, for ``beam_dp.audit.run`` (numeric columns only, no quality
    check). ``instrument(problem, aggregator) -> (problem, aggregator)``: the audit's canaries
    (a wider problem, an aggregator that injects them)."""
    return _execute(X, y, _Request(
        input=input, algorithm=algorithm, model=model,
        privacy=spec.Privacy(epsilon, delta, noise_multiplier, accountant, num_examples,
                             count_epsilon, noise),
        num_classes=num_classes, huber_delta=huber_delta, fit_intercept=fit_intercept,
        table=Table(label_column=label_column, feature_columns=feature_columns), bounding=None,
        runner=runner, pipeline_args=pipeline_args, batch_rows=batch_rows, seed=seed,
        progress=progress, budget_gate=budget_gate, options=options or {},
        instrument=instrument))


def _execute(X, y, request: _Request) -> _Run:
    """The steps of a run: every refusal first, then the rows, the problem they pose, the budget,
    and the training."""
    checked = _check_request(request)
    read = _read_input(X, y, request, checked)
    problem = _problem(request, checked, read)
    return _fit(request, checked, read, problem, _plan_budget(request, checked, problem))


def _check_request(request: _Request) -> _Checked:
    """The request's refusals, all before any data is read. ``algorithm="auto"``: resolved
    first, from public inputs only (``choice.choose``)."""
    auto, algorithm, table = None, request.algorithm, request.table
    encoding = table.encoding_keywords()
    if algorithm == choice.AUTO:
        auto = choice.choose(request.model, request.options.keys(),
                             num_examples=request.privacy.num_examples,
                             rows_hint=request.rows_hint,
                             sparse=bool(encoding.get("categorical_columns")),
                             user_level=request.bounding is not None,
                             checkpoint=bool(request.checkpoint_dir),
                             warm_start=request.warm_start is not None,
                             fit_intercept=request.fit_intercept, noise=request.privacy.noise)
        algorithm = auto.algorithm
    elif request.rows_hint is not None:
        raise ValueError("rows_hint (--rows-hint) is read by algorithm 'auto' only; drop it or "
                         "give --num-examples (a public size the accounting uses)")
    chosen = registry.get(algorithm)
    if request.max_jobs is not None and (request.max_jobs < 1 or not request.checkpoint_dir):
        raise ValueError("max_jobs (--max-jobs) must be at least 1 and needs a checkpoint_dir "
                         "(--checkpoint-dir) to go on from")
    options = spec.make_options(chosen.options, request.options)
    privacy = request.privacy
    privacy.validate()
    if (request.steps_per_job is not None and request.steps_per_job < 1) or request.batch_rows < 1:
        raise ValueError("steps_per_job and batch_rows must be at least 1")
    loss = losses.make_loss(request.model, request.num_classes, request.huber_delta)
    chosen.check_request(loss, privacy, options)
    ignored_options.refuse_ignored(ignored_options.Request(
        request.model, privacy, options,
        given=dict(num_classes=request.num_classes, huber_delta=request.huber_delta,
                   hash_seed=encoding.get("hash_seed"), count_epsilon=privacy.count_epsilon),
        categorical_columns=tuple(encoding.get("categorical_columns") or ()),
        hash_buckets=encoding.get("hash_buckets"),
        imputed=_imputed_policies(encoding.get("missing")),
        warm_start=request.warm_start is not None))
    if request.bounding is not None:   # before the input is read and grouped by user
        registry.check_user_level(chosen)
    if table.bounds:
        # A declaration is applied or refused, never silently dropped: only dpgd and dpsgd's
        # column scaling (column_scaling.prepare) applies declared ranges (on dense rows, and
        # on the numeric columns of categorical columns' CSR rows).
        why = (f"--algorithm {chosen.name}" if chosen.name not in SCALING_ALGORITHMS else
               "--feature-norm (another map of the same features)"
               if getattr(options, "feature_norm", None) else None)
        if why:
            raise ValueError(f"declared bounds are applied by {' and '.join(SCALING_ALGORITHMS)}'s "
                             f"column scaling, not with {why}: leave the bounds out")
    return _Checked(chosen, options, loss, auto)


def _read_input(X, y, request: _Request, checked: _Checked) -> _Input:
    """The rows: in-memory arrays, a DataFrame read as a table, or files on the runner."""
    if (X is None) == (request.input is None):
        raise ValueError("give either arrays X, y or input= files")
    table, loss = request.table, checked.loss
    if X is not None:
        if request.runner not in (None, LOCAL):
            raise ValueError("in-memory arrays train in-process; write them to files to use a Beam runner")
        if request.bounding is not None:
            raise ValueError("privacy_unit_column names a column of the input files (input=); "
                             "write the arrays and their user column to files")
        if any(v not in (None, 0) for v in table.encoding_keywords().values()):
            raise ValueError("categorical columns, label classes, missing-value policies and "
                             "ignored columns are read from files (input=); encode in-memory "
                             "arrays first")
        names, aggregator = _array_input(X, y, loss, table.feature_columns, request.batch_rows)
        read = _Input("in-memory arrays", names, aggregator)
    elif isinstance(request.input, frames.FrameTable):
        if request.runner not in (None, LOCAL):
            raise ValueError("a DataFrame trains in-process; write it to files to use a Beam runner")
        try:
            _, columns, aggregator, encoding = file_input(
                [frames.PATH], LOCAL, [], loss, table.label_column, table.feature_columns,
                request.batch_rows, categorical=table.encoding_keywords(),
                bounding=request.bounding, opener=request.input.open)
        except data.DataError as e:
            raise frames.renamed(e) from None
        read = _Input(frames.SOURCE, columns, aggregator, encoding)
    else:
        read = _Input(*file_input(
            request.input, request.runner or DEFAULT_BEAM_RUNNER, list(request.pipeline_args), loss,
            table.label_column, table.feature_columns, request.batch_rows,
            categorical=table.encoding_keywords(), bounding=request.bounding))
    if (read.encoding is not None and read.encoding.imputed
            and checked.algorithm.name not in IMPUTING_ALGORITHMS):
        # The fill is released by dpgd/dpsgd's private ranges stage, the one place that reads
        # the columns' private statistics before training.
        read.aggregator.close()
        raise ValueError("median/mean imputation (--missing COLUMN=median or mean) needs "
                         f"--algorithm {' or '.join(IMPUTING_ALGORITHMS)}")
    if request.max_jobs is not None and hasattr(read.aggregator, "max_jobs"):
        read.aggregator.max_jobs = request.max_jobs
    return read


def _problem(request: _Request, checked: _Checked, read: _Input) -> spec.Problem:
    """What the algorithm is given: the public description of the input (checkpoints resume
    only over the same), its declared or inherited ranges, a warm start's coefficients."""
    table, loss, encoding = request.table, checked.loss, read.encoding
    columns = list(read.feature_columns)
    source = {"files": read.files, "label_column": table.label_column, "feature_columns": columns}
    if encoding is not None:   # public: the declared columns and the hash or vocabulary
        source["encoding"] = encoding.spec()
    indicators = [f"{c}_missing" for c in encoding.indicators] if encoding is not None else []
    if table.bounds or indicators:
        source["bounds"] = _declared_bounds(table.bounds or {}, encoding.dense_names
                                            if encoding is not None else columns,
                                            table.label_column, loss, indicators)
    initial = None
    if request.warm_start is not None:
        initial, inherited = warm_start_theta(request.warm_start, checked.algorithm, loss, columns,
                                               table.label_column, request.fit_intercept,
                                               checked.options, encoding)
        if inherited is not None:
            # The released model's column ranges (public) are this run's: its coefficients
            # are in their space, and nothing new is spent on ranges.
            if "bounds" in source and table.bounds:
                raise ValueError("--warm-start from a scaled model takes its ranges: drop the "
                                 "schema's bounds")
            source["bounds"] = inherited
    problem = spec.Problem(loss, encoding.dim if encoding is not None else len(columns),
                           request.privacy, request.fit_intercept, request.steps_per_job,
                           request.checkpoint_dir, source, seed_fixed=request.seed is not None,
                           initial_theta=initial,
                           sparse=encoding is not None and encoding.sparse,
                           privacy_unit=request.bounding)
    if request.bounding is not None:   # public: the unit's column name and K
        source["privacy_unit"] = dataclasses.asdict(request.bounding)
    registry.check(checked.algorithm, problem)
    charged_as = getattr(request.budget_gate, "neighbouring", None)   # (a schema's unit, say)
    run_as = (accounting.USER_ADD_REMOVE if request.bounding is not None
              else checked.algorithm.relation)
    if charged_as is not None and charged_as != run_as:
        raise ValueError(f"the budget ledger would charge this run as {charged_as!r}, but it "
                         f"runs as {run_as!r}: each unit of privacy has its own budget "
                         f"(beam_dp.ledger.core.budget_dataset)")
    return problem


def _plan_budget(request: _Request, checked: _Checked, problem: spec.Problem) -> _Budget:
    """The ledger, and the quality check's release reserved in it before training, from public
    constants: the algorithm's calibration then meets the total (epsilon, delta) with it."""
    chosen, quality_options = checked.algorithm, request.quality_options
    relation = accounting.USER_ADD_REMOVE if request.bounding is not None else chosen.relation
    budget = _Budget(accounting.Ledger(request.privacy.accountant, relation,
                                       gate=request.budget_gate))
    if quality_options is None:
        return budget
    if quality_options.quality_check == "off":
        budget.verdict = {"status": "off", "reason": "quality_check off (--quality-check off)"}
    elif not chosen.quality_check:
        budget.verdict = {"status": "skipped", "reason": f"{chosen.name}: {chosen.why_no_quality_check}"}
    else:
        bound = quality_options.quality_label_bound
        if bound is None:   # an algorithm's own public label bound (ssp's --label-bound), if any
            bound = getattr(checked.options, "label_bound", None)
        # Secure noise where the algorithm's is (sparse input: float, as its steps).
        secure = chosen.secure_noise and not problem.sparse and request.privacy.noise != "float"
        budget.check = quality.reserve(budget.ledger, checked.loss, request.privacy,
                                       epsilon=quality_options.quality_epsilon, label_bound=bound,
                                       secure=secure)
    return budget


def _fit(request: _Request, checked: _Checked, read: _Input, problem: spec.Problem,
         budget: _Budget) -> _Run:
    """Trains, releases the fills into the encoding, and runs the reserved quality check."""
    chosen, options, loss = checked.algorithm, checked.options, checked.loss
    aggregator, encoding, check, verdict = read.aggregator, read.encoding, budget.check, budget.verdict
    job_results = _job_results(aggregator, problem)
    run_seed = (request.seed if request.seed is not None else
                job_results.seed() if job_results is not None else mechanisms.secure_seed())
    quality_options = request.quality_options
    run_check = None if check is None else quality.RunCheck(
        check, loss, run_seed, quality_options.quality_label_bound is not None
        or getattr(options, "label_bound", None) is not None)
    try:
        if request.instrument is not None:
            problem, aggregator = request.instrument(problem, aggregator)
        if run_check is not None:   # in the last training job, where the algorithm can
            problem = dataclasses.replace(problem, final_check=run_check.final_check)
        result = chosen.train(options, problem, aggregator, run_seed, budget.ledger,
                              request.progress or (lambda done, total, eps: None))
        if encoding is not None and encoding.imputed:
            # The released fills (public) go into the encoding: model.json's, and so predict's.
            released = (getattr(result, "preprocessing", None) or {}).get("imputation") or {}
            encoding = encoding.with_fills({c: v["fill"] for c, v in released.items()})
            if encoding.pending.any():
                raise RuntimeError("a median/mean fill was not released (a bug)")
        if quality_options is not None:   # (even with the check off: such a model is no model)
            quality.check_finite(result.theta)
        if run_check is not None:
            check, noisy = run_check.release(result, aggregator, problem.checkpoint_dir)
            verdict = quality.judged(loss, noisy, check, result.dataset_size["value"],
                                     "the training data")
        if job_results is not None:   # the run is over: its jobs' results and seed go
            job_results.remove()
    finally:
        aggregator.close()
    return _Run(result, budget.ledger, chosen, options, request.privacy, loss,
                list(read.feature_columns), encoding, verdict,
                checked.choice.report() if checked.choice is not None else None,
                getattr(aggregator, "step_sums", None))


def _job_results(aggregator, problem: spec.Problem):
    """A Flex Template launch (--template_location): its job runs after it, so the job's result
    is kept under the release's checkpoint for the next launch (``beam_dp.beam.job_results``)."""
    if not getattr(aggregator, "writes_templates", False):
        return None
    if not problem.checkpoint_dir:
        raise ValueError("--template_location: each launch writes one job, which runs after it; "
                         "give --checkpoint-dir, where the job leaves its result for the next "
                         "launch")
    return aggregator.keep_job_results(storage.join(problem.checkpoint_dir, "template-jobs"),
                                       storage.join(problem.checkpoint_dir, CHECKPOINT_FILE))


def _model_of(run: _Run, request: _Request) -> "Model":
    """The Model and its privacy report; the quality check's verdict refuses or warns."""
    checked = run.quality or {}
    if checked.get("status") == "much_worse":
        raise ModelQualityError(quality.refusal_text(checked))
    artifact = report.model_artifact(run.loss, run.result.theta, run.feature_columns,
                                     request.table.label_column, run.algorithm.name,
                                     request.fit_intercept, run.result.feature_transform,
                                     run.result.constraint,
                                     run.encoding.spec() if run.encoding is not None else None)
    privacy_report = report.privacy_report(run.ledger, run.privacy, run.result, run.algorithm,
                                           run.options, seed_fixed=request.seed is not None)
    if run.quality is not None:
        privacy_report["quality_check"] = run.quality
    report.compose_with_inputs(privacy_report, request.table.vocabulary)
    if run.choice is not None:
        privacy_report["algorithm_choice"] = run.choice
    if run.step_sums is not None:   # (from public values only: the runner, q n, d)
        privacy_report["step_sums"] = dataclasses.asdict(run.step_sums)
    # stacklevel 3: the warnings point at the caller of train
    for message in _warnings(privacy_report, run.result.dataset_size):
        privacy_report.setdefault("warnings", []).append(message)
        warnings.warn(message, PrivacyWarning, stacklevel=3)
    if checked.get("status") == "worse":   # (inconclusive: recorded, never an alarm)
        message = quality.warning_text(
            checked, (privacy_report.get("hyperparameters") or {}).get("values"))
        privacy_report.setdefault("warnings", []).append(message)
        warnings.warn(message, QualityWarning, stacklevel=3)
    return Model(artifact, privacy_report)


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


LARGE_EPSILON = 10.0


def _warnings(privacy_report: dict, dataset_size: dict) -> list[str]:
    """Settings that weaken the guarantee or the model, from public values only (the reported
    epsilon, delta and the released count with its public error bound)."""
    found = []
    n, delta, epsilon = dataset_size["value"], privacy_report["delta"], privacy_report["epsilon"]
    error = dataset_size.get("error_bound_95")
    # n as a noisy estimate with its error (a small table's "n ~ 1" was read as a fact)
    size = (f"n = {n:,}" if error is None else f"the noisy estimate of n, {n:,} +-{error:.0f}")
    if delta * n >= 1:
        found.append(f"delta = {delta:g} is not small against 1/n ({size}): a mechanism may then "
                     f"publish a {'user' if dataset_size.get('unit') == 'users' else 'row'} "
                     "outright; choose delta well below 1/n")
    if epsilon > LARGE_EPSILON:
        found.append(f"epsilon = {epsilon:.4g} is above {LARGE_EPSILON:g}: the guarantee says "
                     "little at that level")
    if error is not None and error > 0.1 * n:
        unit = dataset_size.get("unit", "rows")   # users under user-level privacy
        found.append(f"the private count's 95% error (+-{error:.0f} {unit}) is large against its "
                     f"noisy estimate of n ({n:,}): "
                     "steps are normalized by a cautious floor and learn slowly; give "
                     "num_examples (--num-examples) if n is public, or a larger count_epsilon")
    chose = privacy_report.get("algorithm_choice") or {}
    if chose.get("rows_source") == "--rows-hint" and error is not None:
        # The hint (public) against the released count (public): a hint off by 10x or more
        # made --algorithm auto choose for another table (20,000,000 hinted on ISLR Default's
        # 10,000 rows chose dpsgd, which the quality check found no better than the constant).
        hint = chose["rows"]
        if hint > 10 * (n + error) or 10 * hint < n - error:
            found.append(f"--rows-hint {hint:,} is far from the private count ({size}): "
                         f"--algorithm auto chose {chose['chosen']} for a table "
                         "of the hinted size; give a closer hint or name the algorithm")
    imputed = (privacy_report.get("preprocessing") or {}).get("imputation") or {}
    for name, fill in imputed.items():
        # (public: the mechanism's error bound against the released count)
        if fill.get("policy") == "median" and fill["rank_error_95"] > IMPUTE_RANK_ERROR * n:
            # (declaring the range is advice only where the column has none)
            declare = ("" if fill.get("grid") == "uniform over the declared range"
                       else "declare the column's range (bounds), ")
            found.append(f"the private median filling '{name}' has a 95% rank error of "
                         f"{fill['rank_error_95']:.0f} rows against {size}: it may lie anywhere "
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


IMPUTE_RANK_ERROR = 0.25   # as --scale-features auto's rule (column_scaling.AUTO_SCALE_RANK_ERROR)


def file_input(input, runner, pipeline_args, loss, label_column, feature_columns, batch_rows,
               read_label: bool = True, categorical: dict | None = None,
               bounding: "user_level.UserBounding | None" = None, opener=None):
    """The input files, their feature columns, the aggregator for the chosen runner and the
    categorical encoding (None without categorical columns). ``read_label`` False (private
    statistics): the label column is only left out of the default features. ``categorical``:
    ``categorical_columns``, ``hash_buckets``, ``hash_seed`` and ``vocabulary`` as given.
    ``opener``: reads the files named in ``input`` from elsewhere than a file system (a
    DataFrame's in-memory file, ``beam_dp.frames``), in-process."""
    if opener is not None:
        files, open_file = list(input), opener
    else:
        patterns = [input] if isinstance(input, str) else list(input)
        files = sorted({f for pattern in patterns for f in data.list_files(pattern)})
        if not files:   # input=[] or "" (list_files of "" matches nothing without an error)
            raise data.DataError("no input files given")
        if runner == LOCAL:
            open_file = data.open_input
        else:
            from beam_dp.beam.transforms import open_file
    categorical = dict(categorical or {})
    named = list(categorical.pop("categorical_columns", None) or ())
    ignore = list(categorical.pop("ignore_columns", None) or ())
    user_column = bounding.column if bounding is not None else None
    if user_column is not None:
        _check_user_column(files[0], open_file, user_column, label_column, feature_columns)
        if user_column not in named:   # a key only, unless declared a categorical feature too
            ignore = ignore + [user_column] * (user_column not in ignore)
    data.check_shards_agree(files, open_file)
    columns = data.resolve_feature_columns(files[0], label_column, feature_columns, open_file,
                                           require_label=read_label, categorical=named,
                                           ignore=ignore,
                                           text_label=_text_label(categorical))
    categorical["missing"] = schema_mod.label_policy(categorical.get("missing"), label_column)
    encoding = make_encoding(columns, named, **categorical)
    if encoding is not None:
        columns = encoding.columns
        _check_classes(encoding, loss)
    read = label_column if read_label else None
    if runner == LOCAL:
        from beam_dp.local import LocalAggregator
        blocks = data.load_blocks(files, read, columns, loss, batch_rows, encoding, user_column,
                                  opener=open_file)
        if bounding is not None:   # every user's rows bounded and in one block (one sort)
            blocks = user_level.group_by_user(blocks, bounding.max_rows, batch_rows)
        return files, columns, LocalAggregator(blocks), encoding
    from beam_dp.beam.aggregator import BeamAggregator
    return files, columns, BeamAggregator(files, read, columns, loss, batch_rows,
                                          ["--runner", runner] + pipeline_args,
                                          encoding=encoding, user_bounding=bounding), encoding


def _text_label(declared: dict) -> bool:
    """Whether the label is read as text: declared classes, or a derived label's listed values
    (a threshold reads numbers)."""
    return bool(declared.get("label_classes")) or "one_of" in (declared.get("label_positive") or {})


def _check_user_column(path, open_file, column, label_column, feature_columns):
    """The privacy unit's column exists and is not the label or a numeric feature. It may be a
    categorical one (a user's own id): each user's summed gradient is clipped to C whatever
    coefficients it touches, their id's too, so the guarantee stands."""
    if column == label_column or column in (feature_columns or ()):
        raise ValueError(f"the privacy unit column '{column}' is the label or listed as a numeric "
                         "feature: an id is not a quantity (declare it categorical to use it)")
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


def options_of(algorithm: str) -> dict:
    """The declared options of an algorithm with their defaults (None: derived)."""
    chosen = registry.get(algorithm)
    return {f.name: f.default for f in dataclasses.fields(chosen.options)}
