"""The beam-dp command: train, algorithms, predict, stats, make-data, report.

A thin layer over the Python API (``beam_dp.train``): flags are generated from the algorithm
registry, so ``beam-dp train --algorithm X --help`` lists X's own options with their defaults.
Flags this command does not know are handed to Beam's PipelineOptions unchanged, so
``--runner DataflowRunner --project ... --temp_location ...`` works as with any Beam pipeline.
``--runner local`` runs the same kernels in-process without Beam; with no ``--runner``, Beam's
in-process FnApiRunner is used (DirectRunner would first try to download the Prism runner).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import textwrap
import warnings

import numpy as np

DEFAULT_BEAM_RUNNER = "FnApiRunner"
DEFAULT_ALGORITHM = "dpgd"
SPARSE_MECHANISMS = ("gaussian", "laplace")   # beam_dp.stats.SPARSE_MEAN_VARIANTS (not imported here)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:   # (argparse would name this function: "invalid _positive_int value")
        raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _columns(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]


class _StoreOnce(argparse.Action):
    """A flag that takes one value and may be given once: argparse would keep the last of
    ``--epsilon 0.5 --epsilon 8`` (or of two --feature-columns) without a word."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_flags", set())
        if self.dest in given:
            parser.error(f"{option_string} given twice")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--steps`` must not silently mean ``--steps-per-job``), a
    single-valued flag given once, and a usage error is one line, like every other error."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message):
        self.exit(2, f"beam-dp: error: {message} (see `{self.prog} --help`)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows every flag's default (a None default is described in the help text itself)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is not None and action.default is not False \
                and action.default is not argparse.SUPPRESS and "%(default)" not in text \
                and action.option_strings and action.nargs != 0:
            text += " (default: %(default)s)"
        elif isinstance(action, argparse.BooleanOptionalAction) and action.default is not None \
                and action.default is not argparse.SUPPRESS:
            # (a None default depends on other options, as dpgd's --average-iterates: its help
            # says how, and "off" here had contradicted it; SUPPRESS, under --algorithm auto and
            # tune's fixed options, is the chosen algorithm's default, and had shown as "on")
            text += f" (default: {'on' if action.default else 'off'})"
        return text


def _requested_algorithm(argv: list[str]) -> str:
    """The --algorithm value, read before the full parse so that its own flags can be added."""
    name = DEFAULT_ALGORITHM
    for i, token in enumerate(argv):   # the last one wins, as in argparse
        if token == "--algorithm" and i + 1 < len(argv):
            name = argv[i + 1]
        elif token.startswith("--algorithm="):
            name = token.split("=", 1)[1]
    return name


def _add_run_arguments(parser, audit: bool) -> None:
    """The flags of a training configuration: input, model and privacy (``train`` and ``audit``)."""
    from beam_dp import accounting, losses, user_level

    io = parser.add_argument_group("input and output")
    io.add_argument("--input", required=True, nargs="+", action="extend",
                    help="Parquet or CSV files: globs (quote them), comma-separated globs, or "
                         "several paths")
    io.add_argument("--output", required=True,
                    help="directory for audit_report.json" if audit else
                         "directory for model.json, privacy_report.json, metrics.json, report.html")
    io.add_argument("--overwrite", action="store_true",
                    help="replace an existing --output directory that beam-dp wrote (never "
                         "anything else)")
    io.add_argument("--label-column", default="label", help="the label's column")
    io.add_argument("--feature-columns", type=_columns, default=None,
                    help="comma-separated; default: every column but the label (CSV: by the "
                         "header; Parquet: every numeric column by its declared type)")
    if not audit:
        from beam_dp.algorithms import registry   # (imported late, as the algorithms' flags)
        io.add_argument("--categorical-columns", type=_columns, default=None,
                        help="comma-separated string or integer columns, encoded as sparse "
                             "features (needs --hash-buckets or --vocabulary; algorithms "
                             f"{', '.join(a.name for a in registry.algorithms().values() if a.sparse_input)}"
                             "); never inferred from the cells")
        io.add_argument("--hash-buckets", type=_positive_int, default=None,
                        help="feature hashing of the categorical columns into this many columns "
                             "(public; recorded in model.json)")
        io.add_argument("--hash-seed", type=int, default=None,
                        help="the hash's public seed (recorded in model.json); default 0; "
                             "with --hash-buckets only")
        io.add_argument("--vocabulary", default=None,
                        help="JSON file: categorical column -> list of its values (public; other "
                             "values share an 'other' column; stored in model.json)")
        io.add_argument("--schema", default=None,
                        help="JSON file declaring the table: label and its classes, numeric, "
                             "categorical, ignored and id columns, missing-value policies (see "
                             "README 'A table's schema'); flags given win over it")
        io.add_argument("--label-classes", type=_columns, default=None,
                        help="comma-separated label values in class-id order (text labels such "
                             "as No,Yes; a binary model's positive class is the second unless "
                             "--positive-class)")
        io.add_argument("--positive-class", default=None,
                        help="the label value that is class 1 of a binary model")
        io.add_argument("--missing", action="append", default=None, metavar="COLUMN=POLICY",
                        help="a numeric column's missing cells: constant:V, indicator (fill 0 and "
                             "add COLUMN_missing), indicator:V, drop (the row; the label "
                             "column takes only drop), or median or mean (a private fill "
                             "released by dpgd/dpsgd; mean needs the column's declared bounds); "
                             "repeat for each column")
        io.add_argument("--ignore-columns", type=_columns, default=None,
                        help="comma-separated columns left out of the default features")
        io.add_argument("--validation", default=None,
                        help="glob of validation files for metrics.json (not covered by the "
                             "guarantee)")
        io.add_argument("--batch-rows", type=_positive_int, default=65536,
                        help="rows per block read")

    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=losses.MODEL_NAMES, default="logistic",
                       help="logistic (labels 0/1 or -1/+1), softmax (0..K-1), hinge (linear "
                            "SVM), linear (least squares), huber (robust regression)")
    model.add_argument("--num-classes", type=int, default=None,
                       help="number of classes for --model softmax (only; public)")
    model.add_argument("--huber-delta", type=float, default=None,
                       help="threshold of --model huber (only); default 1")
    model.add_argument("--no-intercept", dest="fit_intercept", action="store_false",
                       help="fit no intercept")

    privacy = parser.add_argument_group("privacy")
    # One of the two is required; checked after the unknown flags (so that a misspelt --epsilom
    # is named rather than reported as a missing --epsilon).
    budget = privacy.add_mutually_exclusive_group()
    budget.add_argument("--epsilon", type=float, help="target epsilon: the noise is calibrated to it")
    budget.add_argument("--noise-multiplier", type=float,
                        help="instead of --epsilon: this noise, and report the epsilon it buys")
    privacy.add_argument("--delta", type=float, default=1e-5,
                         help="target delta; keep it well below 1/n")
    privacy.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld",
                         help="privacy accountant (dp_accounting)")
    privacy.add_argument("--num-examples", type=_positive_int, default=None,
                         help="public dataset size; without it n is a private Laplace count")
    privacy.add_argument("--count-epsilon", type=float, default=None,
                         help="budget of that count; default: a share of --epsilon (see README)")
    privacy.add_argument("--noise", choices=("secure", "float"), default=None,
                         help="secure (the default where the algorithm has it: all but the "
                              "paper-004 geometry algorithms): discrete noise on exact integer "
                              "sums from a cryptographic generator, the same model bits on every "
                              "runner; float: numpy's float noise on float sums. By default, "
                              "float noise stands in (said in the report) where secure noise's "
                              "slack would pass 1e-3 delta; --noise secure refuses such a run")
    privacy.add_argument("--seed", type=int, default=None,
                         help="fixed seed, for tests and comparisons only; default: the OS's "
                              "secure randomness")
    if not audit:
        privacy.add_argument(
            "--privacy-unit-column", default=None, metavar="COLUMN",
            help="user-level privacy (dpgd, dpsgd: which samples users): the guarantee is for adding or removing one user "
                 "with all their rows, COLUMN holding each row's user (a key, never a feature "
                 "or printed; the schema's privacy_unit)")
        privacy.add_argument(
            "--max-rows-per-user", type=_positive_int, default=None, metavar="K",
            help="with --privacy-unit-column: the rows kept per user (chosen by a keyed hash of "
                 "the user's own rows); each step clips the user's summed gradient to the clip "
                 f"norm whatever K. Default {user_level.DEFAULT_MAX_ROWS_PER_USER}")


def _add_ledger_arguments(parser) -> None:
    """The budget ledger across runs (``train`` and ``audit``: an audit is a release too)."""
    prod = parser.add_argument_group(
        "budget across runs", "A ledger keeps every run's charge against the dataset's lifetime "
        "budget (beam-dp ledger budget|show|explain); a rerun of the same release (same "
        "settings, same input files, same beam-dp) returns the released output without "
        "charging or training again. Exit codes: 3 refused (budget), 4 the same release is "
        "running elsewhere, 6 the model was refused by the quality check (train), 75 "
        "--max-jobs reached.")
    prod.add_argument("--ledger", default=None, metavar="URL",
                      help="the budget ledger: a SQLite file (a path; or sqlite:///relative, sqlite:////absolute) or "
                           "postgresql://... (password from PGPASSWORD or ~/.pgpass)")
    prod.add_argument("--dataset-id", default=None,
                      help="the dataset's id in the ledger (required with --ledger)")
    prod.add_argument("--partition", action="append", default=None, metavar="P",
                      help="a data partition the run reads (e.g. a date), each with its own "
                           "lifetime budget; repeatable")
    prod.add_argument("--orchestrator-id", action="append", default=None, metavar="KEY=VALUE",
                      help="who ran it (e.g. airflow_run_id=...), recorded with the charge; "
                           "repeatable; not part of the release id")


def _add_tune_parser(sub, argv):
    """``beam-dp tune``: train's input, model and privacy flags, the tuning's own, and the
    algorithm's options as fixed values (no default: an option left out is the grid's or the
    algorithm's default)."""
    from beam_dp import tuning
    from beam_dp.algorithms import registry

    grids = "; ".join(f"{name}: " + " ".join(
        f"{k}={','.join(f'{x:.4g}' for x in v)}"
        + (" (times the model's default step; 3x that for logistic, whose candidates run 100 "
           "steps where train runs up to 300)" if k in tuning.RELATIVE_TO_DEFAULT_STEP.get(name, ())
           else "") for k, v in grid.items()) for name, grid in tuning.DEFAULT_GRIDS.items())
    tune = sub.add_parser(
        "tune", help="private hyperparameter selection (random stopping, inside epsilon)",
        formatter_class=_Formatter,
        description="Train a random number of candidates, each a setting drawn from a public "
                    "grid, score each on private rows with Gaussian noise (the training rows "
                    "themselves by default; --holdout or --validation for held-out ones), and release "
                    "the best (Papernot & Steinke 2022): the whole selection is inside the "
                    "reported (epsilon, delta), accounted by dp_accounting's RDP accountant "
                    "(RepeatAndSelectDpEvent). Runs in-process. Writes model.json, "
                    "privacy_report.json and tuning.json (the grid, the chosen setting and its "
                    "noisy score; not the number of candidates, which stays secret).",
        epilog=f"default grids: {grids}")
    _add_run_arguments(tune, audit=False)
    for action in tune._actions:
        if action.dest == "validation":
            action.help = ("glob of held-out files the candidates are scored on (private data "
                           "too, inside epsilon); default: --holdout of the input")
    group = tune.add_argument_group("tuning")
    group.add_argument("--algorithm", choices=tuple(tuning.TUNABLE), default=next(iter(tuning.TUNABLE)),
                       help="the optimizer (tuning needs one whose cost is the same for every "
                            "setting)")
    group.add_argument("--grid", action="append", default=None, metavar="KEY=V1,V2,...",
                       help="an option and its values (repeat for each option; the grid is "
                            "their product); default: the algorithm's default grid")
    group.add_argument("--mean-candidates", type=float, default=tuning.DEFAULT_MEAN_CANDIDATES,
                       help="mean of the random number of candidates (at least 1)")
    group.add_argument("--candidates-shape", type=float, default=tuning.DEFAULT_SHAPE,
                       help="shape of its truncated negative binomial law: 1 geometric, 0 "
                            "logarithmic")
    group.add_argument("--holdout", type=float, default=tuning.DEFAULT_HOLDOUT,
                       help="share of the input held out to score candidates (by a keyed hash "
                            "of row position), without --validation; 0 (the default): score on "
                            "the training rows (no privacy cost: training and score are composed "
                            "anyway)")
    group.add_argument("--default-share", type=float, default=tuning.DEFAULT_SETTING_SHARE,
                       help="probability that a candidate takes train's default setting (when "
                            "the grid holds it), else a setting uniform over the grid")
    group.add_argument("--score", choices=tuning.SCORES, default="loss",
                       help="per scored row: loss (1 - clipped loss / bound) or accuracy "
                            "(classifiers)")
    group.add_argument("--score-bound", type=float, default=None,
                       help="where the clipped loss stops: log or hinge loss (default 2), or "
                            "for a regression the absolute error in label units (required)")
    group.add_argument("--score-share", type=float, default=tuning.DEFAULT_SCORE_SHARE,
                       help="share of each candidate's budget (of its 1 / sigma^2) spent on its "
                            "score")
    from beam_dp import quality
    registry.add_arguments(tune.add_argument_group(
        "quality check", "train's private comparison with the best constant predictor, run once "
        "on the chosen model over the training rows, within the run's epsilon (see README)."),
        quality.QualityOptions)
    for name, chosen in registry.algorithms().items():
        if name == _requested_algorithm(list(argv or [])) and name in tuning.TUNABLE:
            fixed = tune.add_argument_group(f"{name} options (fixed for every candidate)")
            registry.add_arguments(fixed, chosen.options)
            for action in fixed._group_actions:
                action.default = argparse.SUPPRESS
    return tune


def _tune(args) -> int:
    import beam_dp
    from beam_dp import data, report
    from beam_dp.algorithms import registry

    report.check_output_directory(args.output, args.overwrite)
    validation_files = data.list_files(args.validation) if args.validation else []
    input_files = [f for pattern in args.input for f in data.list_files(pattern)]
    report.check_not_inside(args.output, input_files + validation_files)
    for flag, value in (("--noise-multiplier", args.noise_multiplier),
                        ("--num-examples", args.num_examples)):
        if value is not None:
            raise ValueError(f"tune does not take {flag}: its plan sets the noise, and counts the "
                             "rows it trains and scores on")
    if args.accountant != "pld":
        raise ValueError("tune always uses the RDP accountant (the only one dp_accounting has "
                         "for random stopping); drop --accountant")
    chosen = registry.get(args.algorithm)
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(chosen.options)
               if hasattr(args, f.name)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = beam_dp.tune(
            input=args.input, validation=validation_files or None, algorithm=args.algorithm,
            model=args.model, epsilon=args.epsilon, delta=args.delta, grid=args.grid,
            mean_candidates=args.mean_candidates, shape=args.candidates_shape,
            holdout=args.holdout, default_share=args.default_share, score=args.score, score_bound_=args.score_bound,
            score_share=args.score_share, count_epsilon=args.count_epsilon, seed=args.seed,
            noise=args.noise, num_classes=args.num_classes, huber_delta=args.huber_delta,
            fit_intercept=args.fit_intercept, label_column=args.label_column,
            feature_columns=args.feature_columns, batch_rows=args.batch_rows,
            categorical_columns=args.categorical_columns, hash_buckets=args.hash_buckets,
            hash_seed=args.hash_seed, vocabulary=args.vocabulary, schema=args.schema,
            label_classes=args.label_classes, positive_class=args.positive_class,
            missing=_missing_policies(args.missing), ignore_columns=args.ignore_columns,
            quality_check=args.quality_check, quality_epsilon=args.quality_epsilon,
            quality_label_bound=args.quality_label_bound,
            privacy_unit_column=args.privacy_unit_column,   # (refused by tune, never dropped)
            max_rows_per_user=args.max_rows_per_user,
            progress=lambda message: print(f"beam-dp: {message}", file=sys.stderr), **options)
    for warning in model.privacy_report.get("warnings", []):   # (the quality check's, as train's)
        print(f"beam-dp: warning: {warning}", file=sys.stderr)
    _stop_if_interrupted()
    _write_outputs(args, {"model.json": report.json_text(model.artifact),
                          "privacy_report.json": report.json_text(model.privacy_report),
                          "tuning.json": report.json_text(model.tuning)})
    print(f"tuned {args.model} with {args.algorithm}: epsilon={model.epsilon:.4g}, "
          f"delta={args.delta:g}; wrote {args.output}")
    return 0


def _add_algorithm_arguments(parser, argv, algorithms, auto: bool = False) -> None:
    """--algorithm and the chosen algorithm's own flags (from its declared options). ``auto``
    (train): also --algorithm auto, whose flags are its candidates' (none with a default: the
    rule reads which were given) and --rows-hint."""
    from beam_dp.algorithms import choice, registry

    algo = parser.add_argument_group("algorithm")
    algo.add_argument("--algorithm", choices=tuple(algorithms) + ((choice.AUTO,) if auto else ()),
                      default=DEFAULT_ALGORITHM,
                      help="the optimizer; see the list below"
                           + ("; auto: dpgd, or dpsgd for classification from "
                              f"{choice.FULL_PASS_ROWS:,} declared rows (--num-examples or "
                              "--rows-hint), or the one that takes the options given (the "
                              "report's algorithm_choice says which and why)" if auto else ""))
    name = _requested_algorithm(list(argv or []))
    if auto:
        algo.add_argument("--rows-hint", type=_positive_int, default=None,
                          help="with --algorithm auto: a public estimate of the number of rows, "
                               "read by its rule only (never by the accounting: that is "
                               "--num-examples)")
    if auto and name == choice.AUTO:
        group = parser.add_argument_group(
            "auto options", textwrap.fill("the options of " + " and ".join(choice.CANDIDATES)
                                          + "; each one given counts in the choice, the rest "
                                          "take the chosen algorithm's defaults", 78))
        added: set = set()
        for candidate in choice.CANDIDATES:
            registry.add_arguments(group, algorithms[candidate].options, defaults=False, skip=added)
            added |= {f.name for f, _ in registry.fields(algorithms[candidate].options)}
    elif name in algorithms:
        chosen = algorithms[name]
        about = f"{chosen.use_when}. Models: {', '.join(chosen.models)}."
        group = parser.add_argument_group(f"{name} options", textwrap.fill(about, 78))
        registry.add_arguments(group, chosen.options)



def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    from beam_dp import accounting, synthetic
    from beam_dp.algorithms import registry

    algorithms = registry.algorithms()
    parser = _Parser(prog="beam-dp", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-data", help="write a synthetic dataset (train and validation shards)",
                          formatter_class=_Formatter)
    make.add_argument("--output", required=True, help="directory to write into")
    make.add_argument("--task", choices=synthetic.TASKS + ("click-log",), default="binary",
                      help="kind of labels; click-log: string columns user, item, site (--values "
                           "each), a number position and a 0/1 label (--d is ignored)")
    make.add_argument("--values", type=_positive_int, default=1000,
                      help="distinct values per categorical column of --task click-log")
    make.add_argument("--n", type=_positive_int, default=20000, help="training examples")
    make.add_argument("--d", type=_positive_int, default=20, help="features")
    make.add_argument("--num-classes", type=int, default=3, help="classes for --task multiclass")
    make.add_argument("--validation-n", type=int, default=5000, help="validation examples")
    make.add_argument("--shards", type=_positive_int, default=4, help="training files")
    make.add_argument("--format", choices=("parquet", "csv"), default="parquet", help="file format")
    make.add_argument("--seed", type=int, default=0, help="the data is synthetic: seeded by default")
    make.add_argument("--overwrite", action="store_true",
                      help="replace an existing --output directory that beam-dp wrote")

    listing = "\n".join(textwrap.fill(a.use_when, 78, initial_indent=f"  {a.name:<11} ",
                                       subsequent_indent=" " * 14) for a in algorithms.values())
    train = sub.add_parser(
        "train", help="train a differentially private GLM", formatter_class=_Formatter,
        description="Train a GLM with (epsilon, delta)-differential privacy for add/remove-one-row "
                    "neighbouring datasets.",
        epilog=f"algorithms (--algorithm; `beam-dp train --algorithm X --help` lists X's own "
               f"flags, `beam-dp algorithms` all of them):\n{listing}\n\n"
               "Unknown flags are passed to Beam's PipelineOptions.")
    _add_run_arguments(train, audit=False)
    run = train.add_argument_group("execution")
    run.add_argument("--runner", default=DEFAULT_BEAM_RUNNER,
                     help="'local' for the in-process numpy runner, else a Beam runner "
                          "(FnApiRunner is Beam's in-process runner)")
    run.add_argument("--steps-per-job", type=_positive_int, default=None,
                     help="full-batch steps unrolled into one Beam job (default: as many as the "
                          "job graph holds, up to 200); with batches fixed in advance (dpsgd), "
                          "steps between checkpoints. The driver checkpoints between jobs; "
                          "with --runner local (no jobs), steps between progress reports and "
                          "checkpoints")
    run.add_argument("--checkpoint-dir", default=None,
                     help="save the (noised) state after every chunk and resume from it (in a "
                          "subdirectory named by the run's release id: new data or settings "
                          "start afresh)")
    run.add_argument("--max-jobs", type=_positive_int, default=None,
                     help="launch at most this many Beam jobs, checkpoint and exit with code 75: "
                          "the same command goes on (one job per invocation: a Flex Template's "
                          "launcher, an orchestrator's task); needs --checkpoint-dir")
    run.add_argument("--warm-start", default=None, metavar="MODEL",
                     help="start from a released model (a training output directory or its "
                          "model.json): dpgd and dpsgd; free (post-processing of a release)")

    _add_ledger_arguments(train)
    from beam_dp import quality
    registry.add_arguments(train.add_argument_group(
        "quality check", "A private comparison of the trained model with the best constant "
        "predictor on the training data, within the run's epsilon (see README)."),
        quality.QualityOptions)

    _add_algorithm_arguments(train, argv, algorithms, auto=True)

    audit = sub.add_parser(
        "audit", help="an empirical lower bound on a configuration's epsilon (one-run audit)",
        formatter_class=_Formatter,
        description="Audit a training configuration: train it once, in-process, with m white-box "
                    "canaries (each included with probability 1/2, each on a feature column of "
                    "its own), guess which were included from what the run released, and report "
                    "the epsilon those guesses prove at the given confidence (Steinke, Nasr & "
                    "Jagielski 2023). A lower bound above the claimed epsilon means the "
                    "implementation leaks more than its accounting says. The audit trains on the "
                    "data: its report is a release at the claimed epsilon.",
        epilog=f"algorithms (--algorithm):\n{listing}")
    _add_run_arguments(audit, audit=True)
    _add_ledger_arguments(audit)
    canary = audit.add_argument_group("audit")
    canary.add_argument("--canaries", type=_positive_int, default=1000,
                        help="m: canaries (each adds a zero feature column to the copy); more "
                             "canaries allow a larger bound (about 5 at m = 1000)")
    canary.add_argument("--confidence", type=float, default=0.95,
                        help="confidence of the lower bound")
    _add_algorithm_arguments(audit, argv, algorithms)

    tune = _add_tune_parser(sub, argv)

    sub.add_parser("algorithms", help="list the algorithms, when to use each, and their flags")
    from beam_dp.ledger import commands
    commands.add_parser(sub)

    st = sub.add_parser("stats", help="private statistics of a dataset (to choose clip norms)",
                        epilog="Unknown flags are passed to Beam's PipelineOptions.",
                        formatter_class=_Formatter)
    st.add_argument("--input", required=True, nargs="+", action="extend", help="Parquet or CSV files (globs)")
    st.add_argument("--output", required=True, help="directory for stats_report.json")
    st.add_argument("--overwrite", action="store_true",
                    help="replace an existing --output directory that beam-dp wrote")
    st.add_argument("--label-column", default="label", help="excluded from the default features")
    st.add_argument("--feature-columns", type=_columns, default=None, help="comma-separated")
    st.add_argument("--quantiles", type=lambda t: tuple(float(q) for q in _columns(t)),
                    default=(0.05, 0.5, 0.95), help="comma-separated fractions")
    st.add_argument("--value-bound", type=float, default=1e6,
                    help="public bound on |values|; the quantile grids span it")
    st.add_argument("--epsilon", type=float, required=True, help="total budget")
    st.add_argument("--delta", type=float, default=1e-5, help="total delta")
    st.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld",
                    help="privacy accountant")
    st.add_argument("--num-examples", type=_positive_int, default=None, help="public dataset size")
    st.add_argument("--noise", choices=("secure", "float"), default=None,
                    help="secure (the default): discrete Laplace count, means as exact sums on a "
                         "grid with discrete Gaussian noise, exactly sampled exponential-mechanism "
                         "quantiles, from a cryptographic generator; float: numpy's float noise "
                         "(the default falls back to it, saying so, where secure noise's slack "
                         "would pass 1e-3 delta)")
    st.add_argument("--seed", type=int, default=None, help="fixed seed (tests only)")
    st.add_argument("--runner", default=DEFAULT_BEAM_RUNNER, help="'local' or a Beam runner")
    st.add_argument("--batch-rows", type=_positive_int, default=65536, help="rows per block read")
    sparse = st.add_argument_group(
        "categorical frequencies",
        "With --categorical-columns, stats releases the frequency of each value (vocabulary)\n"
        "or hash bucket of those columns instead of the numeric statistics: the mean of the\n"
        "one-hot rows by the projection mechanism (paper 001, Algorithm 1; replace-one\n"
        "neighbours; float noise).")
    sparse.add_argument("--categorical-columns", type=_columns, default=None,
                        help="comma-separated string or integer columns (as in train)")
    sparse.add_argument("--hash-buckets", type=_positive_int, default=None,
                        help="hash each categorical column into its own this many buckets "
                             "(public); the report names buckets, never values")
    sparse.add_argument("--hash-seed", type=int, default=0, help="the hash's public seed")
    sparse.add_argument("--vocabulary", default=None,
                        help="JSON file: categorical column -> list of its values (public; other "
                             "values share an 'other' frequency)")
    sparse.add_argument("--sparse-mechanism", choices=SPARSE_MECHANISMS, default=None,
                        help="the projection mechanism's noise: gaussian ((epsilon, delta), "
                             "privacy independent of the sparsity) or laplace (pure epsilon-DP, "
                             "rows clipped to l1 norm L sqrt(s)); default gaussian")

    predict = sub.add_parser("predict", help="apply a trained model to a dataset",
                             formatter_class=_Formatter)
    predict.add_argument("--model", required=True, help="model.json or the training output directory")
    predict.add_argument("--input", required=True, nargs="+", action="extend", help="Parquet or CSV files (globs)")
    predict.add_argument("--output", required=True, help="predictions file (.csv or .parquet)")
    predict.add_argument("--overwrite", action="store_true",
                         help="replace an existing predictions file that beam-dp wrote")
    predict.add_argument("--batch-rows", type=_positive_int, default=65536, help="rows per block read")
    predict.add_argument("--vocabulary", default=None,
                         help="check that this vocabulary file is the one the model was trained "
                              "with (the model carries its own copy)")
    predict.add_argument("--id-columns", type=_columns, default=None,
                         help="comma-separated columns copied from the input into the "
                              "predictions, row by row (default: the --schema's id_columns)")
    predict.add_argument("--schema", default=None,
                         help="the training's schema file, for its id_columns")
    voc = sub.add_parser(
        "vocabulary", formatter_class=_Formatter,
        help="release the values of categorical columns privately (for train --vocabulary)",
        description="Release, for each categorical column, the values that occur in enough rows, "
                    "by pipeline-dp's partition selection (truncated geometric thresholding): "
                    "(epsilon, delta)-DP under add/remove of one row, each row contributing one "
                    "value per column. Writes vocabulary.json (for train --vocabulary) and "
                    "privacy_report.json. Its budget is its own: a training run on the "
                    "vocabulary spends more (compose them in a --ledger budget).")
    voc.add_argument("--input", required=True, nargs="+", action="extend",
                     help="Parquet or CSV files (globs)")
    voc.add_argument("--output", required=True, help="directory for vocabulary.json")
    voc.add_argument("--overwrite", action="store_true",
                     help="replace an existing --output directory that beam-dp wrote")
    voc.add_argument("--categorical-columns", type=_columns, required=True, help="comma-separated")
    voc.add_argument("--epsilon", type=float, required=True, help="budget of the release")
    voc.add_argument("--delta", type=float, default=1e-6, help="delta of the release")
    voc.add_argument("--seed", type=int, default=None, help="fixed seed (tests only)")
    voc.add_argument("--batch-rows", type=_positive_int, default=65536, help="rows per block read")
    rep = sub.add_parser(
        "report", formatter_class=_Formatter,
        help="write a training output's report.html again from its JSON files",
        description=textwrap.fill(
                    "Write OUT/report.html (the report `train` writes) again from OUT's "
                    "model.json, privacy_report.json and metrics.json alone: a summary, epsilon "
                    "as training progressed and as a function of delta (recomputed by the "
                    "run's accountant), the released preprocessing statistics with error bars, "
                    "the validation metrics (not covered by the guarantee) and the largest "
                    "coefficients. Reads no data and spends no budget.", 78))
    rep.add_argument("output", metavar="OUT", help="a training output directory")
    parser.command_parsers = {"train": train, "tune": tune, "report": rep, "stats": st, "predict": predict, "make-data": make,
                              "vocabulary": voc,
                              "audit": audit}
    return parser


def _stray_arguments(extra: list[str]) -> list[str]:
    """Arguments left over by the parser that are neither Beam flags nor their values: e.g. the
    2nd..kth file of an unquoted glob that the shell expanded after an option other than --input."""
    stray = []
    for i, token in enumerate(extra):
        if token.startswith("-"):
            continue
        previous = extra[i - 1] if i > 0 else ""
        if not (previous.startswith("--") and "=" not in previous):
            stray.append(token)
    return stray


def _refuse_other_algorithms_flags(parser, algorithm: str, extra: list[str]) -> None:
    """A flag of another algorithm would otherwise pass silently to Beam's options."""
    from beam_dp.algorithms import registry

    owners: dict[str, list[str]] = {}
    for other in registry.algorithms().values():
        for flag, _, _ in registry.describe(other.options):
            owners.setdefault(flag, []).append(other.name)
            owners.setdefault("--no-" + flag[2:], []).append(other.name)
    for token in extra:
        flag = token.split("=", 1)[0]
        if flag in owners:
            parser.error(f"{flag} is an option of {', '.join(owners[flag])}, not of {algorithm} "
                         f"(choose the algorithm with --algorithm)")


RENAMED_FLAGS = {"--steps-per-pipeline": "--steps-per-job"}


def _refuse_unknown_flags(parser, runner: str | None, extra: list[str]) -> None:
    """Flags beam-dp does not know go to Beam, which would drop a misspelt one (--clip_norm) with
    at most a log line: refuse those neither knows, and any with the local runner (no Beam)."""
    flags = [t.split("=", 1)[0] for t in extra if t.startswith("-")]
    if not flags:
        return
    if runner == "local":
        parser.error(f"unknown flag(s) {', '.join(flags)} (--runner local takes no Beam flags)")
    from apache_beam.options.pipeline_options import PipelineOptions

    options = PipelineOptions(extra)
    beam_log = logging.getLogger("apache_beam.options.pipeline_options")
    level = beam_log.level
    beam_log.setLevel(logging.ERROR)   # it would log "Discarding unparseable args": we say it once
    try:
        unknown = (set(options.get_all_options(retain_unknown_options=True))
                   - set(options.get_all_options()))
    finally:
        beam_log.setLevel(level)
    named = [f for f in flags if f.lstrip("-").replace("-", "_") in unknown]
    if named:
        renamed = [f"{f} is now {RENAMED_FLAGS[f]}" for f in named if f in RENAMED_FLAGS]
        parser.error(f"unknown flag(s) {', '.join(named)}: neither beam-dp nor Beam knows them"
                     + (f" ({'; '.join(renamed)})" if renamed else ""))


def _parse(top, argv: list[str]):
    args, extra = top.parse_known_args(argv)
    parser = top.command_parsers.get(args.command, top)   # its errors point at its own --help
    if args.command in ("train", "audit"):
        _refuse_other_algorithms_flags(parser, args.algorithm, extra)
    if extra and args.command not in ("train", "stats"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    stray = _stray_arguments(extra)
    if stray:
        parser.error(f"unexpected argument(s) {' '.join(stray)}: if the shell expanded a glob, "
                     "quote it (--input 'data/train-*.parquet') or list every file after --input")
    _refuse_unknown_flags(parser, args.runner if extra else None, extra)
    if args.command in ("train", "audit") and args.epsilon is None and args.noise_multiplier is None:
        parser.error("give --epsilon (the target) or --noise-multiplier")
    if args.command == "tune" and args.epsilon is None:
        parser.error("give --epsilon: the target of the whole tuning, selection included")
    return args, extra


# Set by Ctrl-C. Beam's runner threads may swallow the KeyboardInterrupt (an "Exception ignored"
# in a weakref callback) or wrap it in another error, so the flag, checked before any output is
# written, is what decides that an interrupted job writes nothing.
_INTERRUPTED = threading.Event()


def _on_interrupt(signum, frame):
    _INTERRUPTED.set()
    raise KeyboardInterrupt


def _stop_if_interrupted() -> None:
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


def console_main() -> None:
    """The ``beam-dp`` command. After an interrupt it exits at once: Beam's non-daemon threads
    could otherwise keep the process waiting after the message."""
    code = main()
    # The run is over (its output complete, or none written): a late Ctrl-C while Beam's threads
    # wind down must not turn its exit code into 130.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if _INTERRUPTED.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _INTERRUPTED.clear()
    in_main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM (what Kubernetes, Airflow and most schedulers send) stops a run as Ctrl-C does, so
    # that it too deletes its mini-batches and leaves no half-written output.
    previous = ({sig: signal.signal(sig, _on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
                if in_main_thread else {})
    try:
        return _main(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(argv: list[str]) -> int:
    from beam_dp.data import DataError

    try:   # usage errors (and --help) exit through argparse: return their code instead
        args, extra = _parse(build_parser(argv), argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "make-data":
            return _make_data(args)
        if args.command == "train":
            return _train(args, extra)
        if args.command == "tune":
            return _tune(args)
        if args.command == "algorithms":
            return _algorithms()
        if args.command == "audit":
            return _audit(args)
        if args.command == "stats":
            return _stats(args, extra)
        if args.command == "ledger":
            from beam_dp.ledger import commands
            return commands.run(args)
        if args.command == "vocabulary":
            return _vocabulary(args)
        if args.command == "report":
            return _report(args)
        return _predict(args)
    except KeyboardInterrupt:
        return _interrupted(args)
    except _quality_error() as e:   # its text: public settings and noisy (DP) figures only
        print(f"beam-dp: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_QUALITY
    except _ledger_error() as e:
        print(f"beam-dp: error: {e}", file=sys.stderr)
        return 2
    except (DataError, ValueError, TypeError, OSError) as e:
        print(f"beam-dp: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a Beam runner wraps worker errors; show our one line if it is there
        if _INTERRUPTED.is_set():   # Beam wrapped the KeyboardInterrupt
            return _interrupted(args)
        text = str(e)
        if DataError.MARKER in text:
            line = text[text.index(DataError.MARKER) + len(DataError.MARKER):].splitlines()[0]
            line = line.split(" [while running")[0]  # Beam appends the step's name
            print(f"beam-dp: error: {line.strip()}", file=sys.stderr)
            return 2
        raise


def _quality_error() -> type:
    from beam_dp.quality import ModelQualityError
    return ModelQualityError


def _ledger_error() -> type:
    from beam_dp.ledger.store import LedgerError
    return LedgerError


def _interrupted(args) -> int:
    _INTERRUPTED.set()
    checkpoint = getattr(args, "checkpoint_dir", None)
    resume = (f"; rerun the same command to resume from {checkpoint}"
              if checkpoint and _checkpoint_exists(checkpoint) else "")
    if resume:
        from beam_dp.beam.aggregator import kept_batch_files
        kept = kept_batch_files(checkpoint)
        if kept:   # raw rows: the user must know they are there if no rerun comes
            resume += (f" (the run's mini-batches stay in {kept} until then; delete that directory "
                       "if you will not resume)")
    print(f"beam-dp: interrupted; no output was written{resume}", file=sys.stderr)
    return 130


def _checkpoint_exists(directory: str) -> bool:
    from beam_dp.algorithms.base import checkpoint_exists
    try:
        return checkpoint_exists(directory)
    except Exception:   # an unreachable remote location: no resume is promised
        return False


def _one_line(e: BaseException) -> str:
    from beam_dp.data import DataError

    if isinstance(e, DataError):
        return e.detail.split(" [while running")[0]   # Beam appends the failing step's name
    if isinstance(e, OSError) and e.strerror:
        # The path and the system's reason only (an OSError's text has no data values).
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return " ".join(str(e).split())


def _make_data(args) -> int:
    from beam_dp import data, report, synthetic

    if args.task == "click-log":
        with report.atomic_directory(args.output, args.overwrite) as tmp:
            for name, split, rows, shards in (("train", 0, args.n, args.shards),
                                              ("validation", 1, args.validation_n, 1)):
                if rows <= 0:
                    continue
                table = synthetic.click_log(rows, args.seed, split=split, values=args.values)
                for i, part in enumerate(np.array_split(np.arange(rows), shards)):
                    if part.size == 0:
                        continue
                    data.write_table(os.path.join(tmp, f"{name}-{i:05d}-of-{shards:05d}.{args.format}"),
                                     {k: v[int(part[0]):int(part[-1]) + 1] for k, v in table.items()})
        print(f"wrote {args.n} training and {args.validation_n} validation click-log rows to {args.output}")
        return 0
    x, y = synthetic.make_dataset(args.task, args.n + args.validation_n, args.d, args.seed,
                                  num_classes=args.num_classes)
    with report.atomic_directory(args.output, args.overwrite) as tmp:
        synthetic.write_shards(tmp, "train", x[:args.n], y[:args.n], args.shards, args.format)
        if args.validation_n > 0:
            synthetic.write_shards(tmp, "validation", x[args.n:], y[args.n:], 1, args.format)
    print(f"wrote {args.n} training and {args.validation_n} validation examples to {args.output}")
    return 0


def _progress_callback():
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int, epsilon: float) -> None:
        nonlocal bar
        if bar is None:
            # disable=None: drawn only on a terminal; also quiet under CI.
            bar = tqdm(total=total, unit="step", desc="training",
                       disable=True if os.environ.get("CI") else None)
        bar.update(done - bar.n)
        bar.set_postfix(epsilon=f"{epsilon:.3f}")
        if done >= total:
            bar.close()

    return update


def _input(args, beam_args: list[str], loss):
    """The files, their feature columns and the aggregator for ``stats`` (no label read); the
    output is checked before anything is read."""
    from beam_dp import api, data, report

    report.check_output_directory(args.output, args.overwrite)
    files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    report.check_not_inside(args.output, files)
    _, features, aggregator, _ = api.file_input(files, args.runner, beam_args, loss, args.label_column,
                                                args.feature_columns, args.batch_rows, read_label=False)
    return features, aggregator


def _privacy_report(ledger, delta: float, seed_fixed: bool, **fields) -> dict:
    from beam_dp import report
    return report.release_report(ledger, delta, seed_fixed, **fields)


# Exit codes of ``beam-dp train`` besides 0, 2 (usage, input) and 130 (interrupted).
EXIT_REFUSED = 3        # the budget ledger refused the run
EXIT_IN_PROGRESS = 4    # the same release is running elsewhere (its lock is held)
EXIT_MORE_JOBS = 75     # --max-jobs reached: state checkpointed, run the same command again
EXIT_AUDIT_VIOLATION = 5   # beam-dp audit: the lower bound exceeds the claimed epsilon
EXIT_QUALITY = 6        # the model diverged or is much worse than a constant: nothing written


def _release(args, chosen, input_files, validation_files):
    """The run's release id (``beam_dp.ledger.runs``: configuration, input snapshot, code)."""
    import beam_dp
    from beam_dp.ledger import runs

    configuration = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in (
        "command", "input", "validation", "output", "overwrite", "runner", "steps_per_job",
        "checkpoint_dir", "max_jobs", "ledger", "orchestrator_id", "warm_start")}
    configuration["neighbouring"] = chosen.relation   # (the algorithm's options are in args)
    if configuration.get("rows_hint") is None:   # (release ids stay as before the flag)
        configuration.pop("rows_hint", None)
    if configuration.get("privacy_unit_column") is None:
        # Row-level runs: their release ids stay as they were before these flags existed.
        configuration.pop("privacy_unit_column", None)
        configuration.pop("max_rows_per_user", None)
    if args.command == "audit":   # (not written for train: its release ids stay as they were)
        configuration["command"] = "audit"
    warm_start = getattr(args, "warm_start", None)
    extra = [warm_start] if warm_start else []
    if warm_start and os.path.isdir(warm_start):
        extra = [os.path.join(warm_start, "model.json")]
    snapshot = {"input": runs.input_snapshot(input_files),
                "validation": runs.input_snapshot(validation_files),
                "warm_start": runs.input_snapshot(extra)}
    return runs.release_id(configuration, snapshot, beam_dp.__version__)


def _orchestrator(values) -> dict:
    ids = {}
    for value in values or []:
        key, sep, text = value.partition("=")
        if not sep or not key:
            raise ValueError(f"--orchestrator-id takes KEY=VALUE, got {value!r}")
        ids[key] = text
    return ids


def _train(args, beam_args: list[str]) -> int:
    from beam_dp import api, data, report
    from beam_dp.algorithms import choice, registry

    if args.algorithm == choice.AUTO:
        # Resolved by beam_dp.train (after the schema is read); here only what any choice
        # shares: its relation, and the options given (none has a default here).
        chosen = argparse.Namespace(relation=choice.relation())
        options = {name: getattr(args, name) for name in choice.option_names() if hasattr(args, name)}
    else:
        chosen = registry.get(args.algorithm)
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(chosen.options)}
    # Refuse a bad --output before any work (and again when writing).
    report.check_output_directory(args.output, args.overwrite)
    validation_files = data.list_files(args.validation) if args.validation else []
    input_files = [f for pattern in args.input for f in data.list_files(pattern)]
    report.check_not_inside(args.output, input_files + validation_files)
    _check_ledger_flags(args)
    if args.max_jobs is not None and args.checkpoint_dir is None:
        raise ValueError("--max-jobs needs --checkpoint-dir: the next invocation goes on from it")
    orchestrator = _orchestrator(args.orchestrator_id)
    release = _release(args, chosen, input_files, validation_files)
    if args.checkpoint_dir:
        args.checkpoint_dir = os.path.join(args.checkpoint_dir, release)
    if args.ledger is None:
        return _train_and_write(api, args, beam_args, options, validation_files, release)
    from beam_dp.algorithms.base import checkpoint_exists

    return _charged(args, chosen, release, orchestrator,
                    lambda ledger, gate: _train_and_write(api, args, beam_args, options,
                                                          validation_files, release, ledger, gate),
                    lambda output: _write_released(args, release, output, validation_files),
                    bool(args.checkpoint_dir) and checkpoint_exists(args.checkpoint_dir))


def _check_ledger_flags(args) -> None:
    if (args.ledger is None) != (args.dataset_id is None):
        raise ValueError("--ledger and --dataset-id go together: the ledger charges the run to "
                         "the dataset's budget")
    if args.partition and args.ledger is None:
        raise ValueError("--partition needs --ledger (partitions are budgets in the ledger)")
    if args.ledger is not None and getattr(args, "privacy_unit_column", None) is not None:
        from beam_dp.api import USER_LEVEL_LEDGER
        raise ValueError(USER_LEVEL_LEDGER)


def _charged(args, chosen, release: str, orchestrator: dict, run, write_released,
             from_checkpoint: bool = False) -> int:
    """``run(ledger, gate) -> exit code`` charged to the budget ledger (--ledger) as release
    ``release``: a committed release is written again by ``write_released(output)`` without
    running; a run the budget refuses exits with EXIT_REFUSED."""
    from beam_dp.ledger import core, runs

    with core.open_ledger(args.ledger, create=False) as ledger:
        try:
            with ledger.lock(release):
                charge = ledger.charge(release)
                if charge is not None and charge.status == core.COMMITTED:
                    return write_released(charge.output)
                earlier = charge if charge is not None and charge.status == core.RESERVED else None
                gate = runs.RunCharge(
                    ledger, release, args.dataset_id, args.partition, chosen.relation,
                    orchestrator, earlier, from_checkpoint=from_checkpoint)
                if earlier is not None and gate.base is not None:
                    print(f"beam-dp: release {release} has a reserved charge from an attempt "
                          f"whose checkpoint is not here: starting over, and charging this "
                          f"attempt's releases on top of it", file=sys.stderr)
                try:
                    if not gate.reserved:
                        gate.precheck(args.epsilon)
                    code = run(ledger, gate)
                except core.BudgetExceeded as e:
                    kept = ""
                    if gate.reserved:   # what the run released before the refusal stays charged
                        ledger.commit(release, None)
                        kept = (" (the releases it made before this refusal, its dataset-size "
                                "count, stay charged: the refusal depends on them)")
                    print(f"beam-dp: {e}{kept}", file=sys.stderr)
                    return EXIT_REFUSED
                if code == 0:
                    _print_charge(ledger, release, args)
                return code
        except core.ReleaseInProgress as e:
            print(f"beam-dp: {e}", file=sys.stderr)
            return EXIT_IN_PROGRESS
        except core.LedgerError as e:
            print(f"beam-dp: error: {e}", file=sys.stderr)
            return 2


def _audit(args) -> int:
    """``beam-dp audit``: a release like a training run (its report is a function of a DP run
    on the data), so it is charged to the budget ledger when one is given, under its own
    release id (an audit and a training run of the same settings are two releases)."""
    from beam_dp import audit, data, report
    from beam_dp.algorithms import registry

    chosen = registry.get(args.algorithm)
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(chosen.options)}
    report.check_output_directory(args.output, args.overwrite)
    input_files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    report.check_not_inside(args.output, input_files)
    _check_ledger_flags(args)

    def run(ledger=None, gate=None) -> int:
        found = audit.run(
            input=input_files, canaries=args.canaries, confidence=args.confidence,
            algorithm=args.algorithm, model=args.model, epsilon=args.epsilon, delta=args.delta,
            noise_multiplier=args.noise_multiplier, accountant=args.accountant,
            num_examples=args.num_examples, count_epsilon=args.count_epsilon, noise=args.noise,
            num_classes=args.num_classes, huber_delta=args.huber_delta,
            fit_intercept=args.fit_intercept, label_column=args.label_column,
            feature_columns=args.feature_columns, seed=args.seed, budget_gate=gate, **options)
        _stop_if_interrupted()
        files = {"audit_report.json": report.json_text(found)}
        if ledger is not None:   # committed before the first output byte, as a training run
            ledger.commit(release, {"files": files})
        _write_outputs(args, files)
        print(f"audited {args.algorithm} ({args.model}): claimed epsilon="
              f"{found['claimed_epsilon_of_canary_releases']:.4g} for the releases the canaries "
              f"enter ({found['claimed_epsilon']:.4g} for the run) at delta={args.delta:g}; "
              f"empirical lower bound {found['epsilon_lower_bound']:.4g} at "
              f"{found['confidence']:.0%} confidence ({found['correct']} of {found['guesses']} "
              f"guesses right, {found['canaries']} canaries): {found['verdict']}; "
              f"wrote {args.output}")
        return _audit_code(found)

    def write_released(output) -> int:
        if output is None:
            print(f"beam-dp: release {release} was refused for lack of budget; nothing to write",
                  file=sys.stderr)
            return EXIT_REFUSED
        _write_outputs(args, dict(output["files"]))
        print(f"release {release} was already committed: wrote its audit report to "
              f"{args.output} again; nothing was charged or trained")
        return _audit_code(json.loads(output["files"]["audit_report.json"]))

    if args.ledger is None:
        return run()
    release = _release(args, chosen, input_files, [])
    return _charged(args, chosen, release, _orchestrator(args.orchestrator_id), run,
                    write_released)


def _audit_code(found: dict) -> int:
    return (0 if found["epsilon_lower_bound"] <= found["claimed_epsilon_of_canary_releases"]
            else EXIT_AUDIT_VIOLATION)


def _print_charge(ledger, release: str, args) -> None:
    """What the run was charged and what each partition it read has left (filter readings)."""
    from beam_dp.ledger import filter as rdp_filter

    charge = ledger.charge(release)
    parts = []
    for key in charge.keys:
        view = ledger.explain(args.dataset_id, key)
        alone, _ = rdp_filter.epsilon(charge.rdp_on(rdp_filter.ORDERS), view.budget.delta)
        where = "the dataset" if key is None else f"partition {key}"
        parts.append(f"{where}: charged epsilon={alone:.4g}, {max(0.0, view.remaining_epsilon):.4g} "
                     f"of {view.budget.epsilon:g} remaining at delta={view.budget.delta:g}")
    print(f"ledger: release {release} committed to dataset {args.dataset_id} ("
          + "; ".join(parts) + ")", file=sys.stderr)


def _write_released(args, release: str, output, validation_files) -> int:
    """A rerun of a committed release: its stored output, byte for byte, and its validation
    metrics computed again (they are not DP: the ledger does not keep them); nothing charged."""
    from beam_dp import api, report

    if output is None:
        print(f"beam-dp: release {release} was refused for lack of budget after its first "
              f"releases (they are charged); nothing to write", file=sys.stderr)
        return EXIT_REFUSED
    files = dict(output["files"])
    if validation_files:
        model = api.Model(json.loads(files["model.json"]))
        files["metrics.json"] = report.json_text(_metrics(args, model, validation_files))
    _write_outputs(args, files)
    print(f"release {release} was already committed: wrote its output to {args.output} again; "
          f"nothing was charged or trained")
    return 0


def _write_outputs(args, files: dict) -> None:
    """The output directory, all at once (``report.atomic_directory``): file name -> text. A
    training run's also gets report.html, made from its JSON files alone."""
    from beam_dp import report

    if all(name in files for name in ("model.json", "privacy_report.json")):
        files = {**files, **_report_html(files)}
    with report.atomic_directory(args.output, args.overwrite) as out:
        for name, text in files.items():
            with open(os.path.join(out, name), "w") as f:
                f.write(text)


def _report_html(files: dict) -> dict:
    """{"report.html": text} from the output's JSON texts; {} with a warning if it cannot be
    made (the model and its privacy report are written all the same; `beam-dp report OUT`
    makes it later). The warning names the error's type only: its text is not ours."""
    from beam_dp import report_html

    try:
        metrics = json.loads(files["metrics.json"]) if "metrics.json" in files else None
        text = report_html.build(json.loads(files["model.json"]),
                                 json.loads(files["privacy_report.json"]), metrics)
    except Exception as e:  # noqa: BLE001 - the report must not cost the run its model
        print(f"beam-dp: warning: report.html not written ({type(e).__name__}); run `beam-dp "
              f"report OUT` on the output directory to make it", file=sys.stderr)
        return {}
    return {report_html.REPORT_HTML: text}


def _report(args) -> int:
    """``beam-dp report OUT``: report.html again from OUT's JSON files."""
    from beam_dp import report_html

    path = report_html.write(args.output)
    print(f"wrote {path}")
    return 0


def _train_and_write(api, args, beam_args, options, validation_files, release, ledger=None,
                     gate=None) -> int:
    from beam_dp import quality, report
    from beam_dp.algorithms.base import JobLimitReached, checkpoint_exists

    if args.checkpoint_dir and checkpoint_exists(args.checkpoint_dir):
        print(f"beam-dp: resuming from the checkpoint in {args.checkpoint_dir}", file=sys.stderr)
    try:
        with warnings.catch_warnings():   # printed below as one line, not as Python's warning
            warnings.simplefilter("ignore", api.PrivacyWarning)
            warnings.simplefilter("ignore", api.QualityWarning)
            model = _train_model(api, args, beam_args, options, gate)
    except JobLimitReached as e:
        where = (f"the state is in {args.checkpoint_dir}: run the same command again to go on"
                 if args.checkpoint_dir else "nothing was saved (no --checkpoint-dir)")
        print(f"beam-dp: stopped before the next Beam job ({e}); {where}", file=sys.stderr)
        return EXIT_MORE_JOBS
    for warning in model.privacy_report.get("warnings", []):
        print(f"beam-dp: warning: {warning}", file=sys.stderr)
    chose = model.privacy_report.get("algorithm_choice")
    if chose is not None:
        print(f"beam-dp: --algorithm auto chose {chose['chosen']}: {chose['reason']}",
              file=sys.stderr)
    model.privacy_report["release_id"] = release
    if ledger is not None:
        model.privacy_report["ledger"] = {"dataset_id": args.dataset_id,
                                          "partitions": args.partition or []}
    metrics = _metrics(args, model, validation_files) if validation_files else None
    if metrics is not None and metrics.get("better_than_constant") is False:
        # Said, not refused: the model is the release, and the user decides what to do with it.
        metric = "accuracy" if "accuracy" in metrics else "rmse"
        print(f"beam-dp: warning: the model is no better than a constant predictor on the "
              f"validation data ({metric} {metrics[metric]:.4g}, the constant's "
              f"{metrics['constant_baseline'][metric]:.4g}; not covered by the privacy "
              "guarantee): "
              + quality.advice((model.privacy_report.get("hyperparameters") or {}).get("values")),
              file=sys.stderr)
    _stop_if_interrupted()
    files = {"model.json": report.json_text(model.artifact),
             "privacy_report.json": report.json_text(model.privacy_report)}
    if ledger is not None:   # committed before the first output byte: a rerun writes these
        ledger.commit(release, {"files": files})   # (not the metrics: they are not DP)
    if metrics is not None:
        files["metrics.json"] = report.json_text(metrics)
    _write_outputs(args, files)
    print(f"trained {args.model} with {model.artifact['algorithm']}: epsilon={model.epsilon:.4g}, "
          f"delta={args.delta:g}; wrote {args.output}")
    return 0


def _metrics(args, model, validation_files) -> dict:
    """Validation metrics of ``model``: computed without noise, so outside the guarantee (and
    said so in the file); never kept in the budget ledger."""
    from beam_dp import data, report

    open_file = data.open_local if args.runner == "local" else _beam_open_file()
    blocks = (model.feature_map(b) for f in validation_files for b in data.blocks_from_file(
        f, model.artifact["label_column"], model.feature_columns, model.loss, args.batch_rows, open_file,
        model.encoding))
    metrics = report.evaluate(model.loss, model.theta, blocks)
    metrics["covered_by_privacy_guarantee"] = False
    metrics["note"] = "computed on the validation data without noise; not differentially private"
    return metrics


def _train_model(api, args, beam_args, options, gate=None):
    return api.train(
        input=args.input, algorithm=args.algorithm, model=args.model, epsilon=args.epsilon,
        delta=args.delta, noise_multiplier=args.noise_multiplier, accountant=args.accountant,
        num_examples=args.num_examples, count_epsilon=args.count_epsilon, noise=args.noise,
        num_classes=args.num_classes, huber_delta=args.huber_delta,
        fit_intercept=args.fit_intercept, label_column=args.label_column,
        feature_columns=args.feature_columns, runner=args.runner, pipeline_args=beam_args,
        batch_rows=args.batch_rows, seed=args.seed, steps_per_job=args.steps_per_job,
        checkpoint_dir=args.checkpoint_dir, progress=_progress_callback(),
        warm_start=args.warm_start, max_jobs=args.max_jobs, budget_gate=gate,
        categorical_columns=args.categorical_columns, hash_buckets=args.hash_buckets,
        hash_seed=args.hash_seed, vocabulary=args.vocabulary, schema=args.schema,
        label_classes=args.label_classes, positive_class=args.positive_class,
        missing=_missing_policies(args.missing), ignore_columns=args.ignore_columns,
        privacy_unit_column=args.privacy_unit_column, max_rows_per_user=args.max_rows_per_user,
        quality_check=args.quality_check, quality_epsilon=args.quality_epsilon,
        quality_label_bound=args.quality_label_bound, rows_hint=getattr(args, "rows_hint", None),
        **options)


def _concat_ids(pieces: list):
    """An id column from its pieces: as they are if all have one type, else all as text (a CSV
    file's ids are text, a Parquet file's may be integers)."""
    import pyarrow as pa
    if not pieces:
        return pa.array([], pa.string())
    if len({p.type for p in pieces}) > 1:
        pieces = [p.cast(pa.large_string()) for p in pieces]
    return pa.concat_arrays(pieces)


def _missing_policies(given: list[str] | None) -> dict | None:
    """--missing COLUMN=POLICY flags as a dict (a column given twice is an error)."""
    if not given:
        return None
    out = {}
    for item in given:
        column, sep, policy = item.partition("=")
        if not sep or not column.strip():
            raise ValueError("--missing takes COLUMN=POLICY (e.g. income=indicator)")
        if column.strip() in out:
            raise ValueError(f"--missing gives column '{column.strip()}' twice")
        out[column.strip()] = policy.strip()
    return out


def _beam_open_file():
    from beam_dp.beam.transforms import open_file
    return open_file


def _algorithms() -> int:
    from beam_dp.algorithms import registry

    for algorithm in registry.algorithms().values():
        print(f"{algorithm.name}: {algorithm.use_when}")
        print(f"  models: {', '.join(algorithm.models)}; guarantee for {algorithm.relation} "
              f"neighbouring datasets")
        for flag, default, text in registry.describe(algorithm.options):
            print(f"  {flag:<26} {text.replace('%%', '%')} (default: {default})")
        print()
    return 0


def _stats(args, beam_args: list[str]) -> int:
    from beam_dp import accounting, losses, mechanisms, report, stats

    if args.categorical_columns:
        return _categorical_stats(args, beam_args)
    if args.sparse_mechanism is not None:
        raise ValueError("--sparse-mechanism is the noise of the categorical frequencies: it needs "
                         "--categorical-columns")
    if args.hash_buckets is not None or args.vocabulary is not None:
        raise ValueError("--hash-buckets and --vocabulary need --categorical-columns")
    if not args.quantiles or not all(0.0 <= q <= 1.0 for q in args.quantiles):
        raise ValueError("--quantiles must be fractions in [0, 1]")
    if not (args.epsilon > 0 and 0 < args.delta < 1 and 0 < args.value_bound <= 1e150):
        # (The grids span value_bound * sqrt(d): a bound near the float range would overflow.)
        raise ValueError("--epsilon must be positive, --delta in (0, 1) and --value-bound in "
                         "(0, 1e150]")
    features, aggregator = _input(args, beam_args, losses.SquaredLoss())
    # The stages go into the Beam job: they hold a key derived from the root seed, not the seed.
    seed = stats.stages_seed(args.seed if args.seed is not None else mechanisms.secure_seed())
    from beam_dp.algorithms import noisy_gd

    def make_stages(noise: str) -> list:
        return stats.dataset_summary_stages(len(features), args.quantiles, args.epsilon,
                                            args.delta, seed, args.value_bound,
                                            count=args.num_examples is None,
                                            accountant=args.accountant, noise=noise)

    # Closed however the run ends: a calibration that raises must not leave a Beam run's work
    # directory and shard cache behind.
    with contextlib.closing(aggregator), report.atomic_directory(args.output, args.overwrite) as out:
        ledger = accounting.Ledger(args.accountant, accounting.ADD_REMOVE)
        # Secure noise unless --noise float; where its samplers' slack would pass 1e-3 delta,
        # refused with --noise secure, float noise (said in the report) by default.
        secure, sampler_delta = args.noise != "float", None
        if secure:
            stages = make_stages("secure")
            planned = accounting.Ledger(args.accountant, accounting.ADD_REMOVE)
            stats.record_releases(stages, planned)
            # The samplers' total variation over every release, at the run's (target) epsilon.
            sampler_delta = noisy_gd.secure_delta_bound(noisy_gd.prior_total_variation(planned),
                                                        args.epsilon)
            if sampler_delta > 1e-3 * args.delta:
                why = noisy_gd.SecureNoiseUnavailable(
                    f"secure noise's samplers could add {sampler_delta:.2g} to delta")
                secure = noisy_gd.float_instead(args.noise, why, ledger) == "secure"
                sampler_delta = None
        if not secure:
            stages = make_stages("float")
        stats.record_releases(stages, ledger)
        if secure:
            ledger.notes.append(noisy_gd.secure_release_note())
        state = aggregator.run_stages(stages, {"n": args.num_examples} if args.num_examples else {})
        summary = stats.summary(state, stages, features,
                                "public (--num-examples)" if args.num_examples
                                else "private estimate: discrete Laplace count" if secure
                                else "private estimate: Laplace count")
        summary["privacy"] = _privacy_report(ledger, args.delta, args.seed is not None,
                                             requested_epsilon=args.epsilon,
                                             value_bound=args.value_bound,
                                             **({"sampler_delta_bound": sampler_delta}
                                                if secure else {}))
        _stop_if_interrupted()
        report.write_json(out, "stats_report.json", summary)
    for warning in summary["warnings"]:     # public bounds only, never a data value
        print(f"beam-dp: warning: {warning}", file=sys.stderr)
    print(f"private statistics of {len(features)} columns: epsilon={summary['privacy']['epsilon']:.4g}, "
          f"delta={args.delta:g}; wrote {args.output}")
    return 0


def _categorical_input(args, beam_args: list[str], encoding):
    """The aggregator of ``stats --categorical-columns`` over ``encoding``'s blocks (the
    categorical columns only: ``stats.frequency_encoding``); the output is checked before
    anything is read."""
    from beam_dp import api, data, losses, report

    report.check_output_directory(args.output, args.overwrite)
    files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    if not files:
        raise data.DataError("no input files given")
    report.check_not_inside(args.output, files)
    columns = list(args.categorical_columns)
    open_file = data.open_local if args.runner == api.LOCAL else _beam_open_file()
    data.check_categorical(files[0], data.read_schema(files[0], open_file), columns)
    loss = losses.SquaredLoss()   # (no label is read: the loss only types the blocks)
    if args.runner == api.LOCAL:
        from beam_dp.local import LocalAggregator
        return LocalAggregator(data.load_blocks(files, None, encoding.columns, loss,
                                                args.batch_rows, encoding))
    from beam_dp.beam.aggregator import BeamAggregator
    return BeamAggregator(files, None, encoding.columns, loss, args.batch_rows,
                                    ["--runner", args.runner] + beam_args, encoding=encoding)


def _categorical_stats(args, beam_args: list[str]) -> int:
    """``stats --categorical-columns``: each categorical value's (or bucket's) frequency by the
    projection mechanism (``stats.categorical_frequency_stages``), under replace-one."""
    from beam_dp import accounting, mechanisms, report, stats

    if args.feature_columns:
        raise ValueError("--feature-columns and --categorical-columns: stats releases the numeric "
                         "statistics or the categorical frequencies; run it once for each")
    if args.noise == "secure":
        raise ValueError("--noise secure: the categorical frequencies (the projection mechanism) "
                         "have float noise only; use --noise float or leave --noise out")
    variant = args.sparse_mechanism or "gaussian"
    # The encoding and the stages (the noise calibrated) before the data is read: a bad request
    # fails at once. The stages hold a key derived from the root seed, not the seed.
    seed = stats.stages_seed(args.seed if args.seed is not None else mechanisms.secure_seed())
    encoding = stats.frequency_encoding(list(args.categorical_columns), args.hash_buckets,
                                        args.hash_seed, args.vocabulary)
    stages = stats.categorical_frequency_stages(encoding, variant, args.epsilon, args.delta, seed,
                                                count=args.num_examples is None,
                                                accountant=args.accountant)
    aggregator = _categorical_input(args, beam_args, encoding)
    try:
        with report.atomic_directory(args.output, args.overwrite) as out:
            ledger = accounting.Ledger(args.accountant, accounting.REPLACE_ONE)
            stats.record_releases(stages, ledger)
            state = aggregator.run_stages(stages, {"n": args.num_examples} if args.num_examples else {})
            summary = stats.categorical_summary(
                state, stages, encoding, "public (--num-examples)" if args.num_examples
                else "private estimate: Laplace count")
            fields = {"requested_epsilon": args.epsilon, "noise": "float (numpy)",
                      "sparse_mechanism": variant, "privacy_and_sparsity": stats.SPARSE_PRIVACY[variant]}
            if variant == "laplace":
                fields["delta_note"] = "the Laplace variant is pure epsilon-DP: --delta is not spent"
            summary["privacy"] = _privacy_report(ledger, args.delta, args.seed is not None, **fields)
            _stop_if_interrupted()
            report.write_json(out, "stats_report.json", summary)
    finally:
        aggregator.close()
    for warning in summary["warnings"]:     # public bounds only, never a data value
        print(f"beam-dp: warning: {warning}", file=sys.stderr)
    print(f"private frequencies of {len(encoding.categorical)} categorical columns "
          f"({variant} projection mechanism, {encoding.dim} columns): "
          f"epsilon={summary['privacy']['epsilon']:.4g}"
          + (f", delta={args.delta:g}" if variant == "gaussian" else " (pure)")
          + f"; wrote {args.output}")
    return 0


def _vocabulary(args) -> int:
    from beam_dp import accounting, categorical, data, mechanisms, report

    if not (args.epsilon > 0 and math.isfinite(args.epsilon) and 0 < args.delta < 1):
        raise ValueError("--epsilon must be positive and --delta in (0, 1)")
    report.check_output_directory(args.output, args.overwrite)
    files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    report.check_not_inside(args.output, files)
    columns = list(args.categorical_columns)
    data.check_categorical(files[0], data.read_schema(files[0]), columns)
    counts = categorical.value_counts(files, columns, data.open_local, args.batch_rows)
    seed = args.seed if args.seed is not None else mechanisms.secure_seed()
    vocabulary = categorical.private_vocabulary(counts, args.epsilon, args.delta, seed)
    ledger = accounting.Ledger("pld", accounting.ADD_REMOVE)
    ledger.record(categorical.VOCABULARY_RELEASE,
                  categorical.vocabulary_event(args.epsilon, args.delta), 1,
                  mechanism="pipeline-dp partition selection (truncated geometric thresholding)",
                  max_partitions_contributed=len(columns))
    privacy = _privacy_report(ledger, args.delta, args.seed is not None,
                              columns={c: len(v) for c, v in vocabulary})
    with report.atomic_directory(args.output, args.overwrite) as out:
        _stop_if_interrupted()
        report.write_json(out, "vocabulary.json", {c: list(v) for c, v in vocabulary})
        report.write_json(out, "privacy_report.json", privacy)
    sizes = ", ".join(f"{c}: {len(v)}" for c, v in vocabulary)
    print(f"released a vocabulary ({sizes} values): epsilon={privacy['epsilon']:.4g}, "
          f"delta={args.delta:g}; wrote {args.output}")
    return 0


def _class_column_names(model, classes: int) -> list[str]:
    """softmax's probability columns: probability_<class name> in class-id order (the declared
    names are public, in model.json), or probability_<id> without declared names."""
    encoding = model.encoding
    names = encoding.label_classes if encoding is not None and encoding.label_classes else None
    return [f"probability_{names[k] if names is not None else k}" for k in range(classes)]


def _predict(args) -> int:
    import pyarrow as pa
    import scipy.special

    from beam_dp import api, data, report

    id_columns = args.id_columns
    if id_columns is None and args.schema is not None:
        from beam_dp import schema as schema_mod
        id_columns = schema_mod.read(args.schema).get("id_columns")
    id_columns = list(id_columns or ())
    report.check_output_file(args.output, args.overwrite, id_columns)
    model = api.Model.load(args.model)
    encoding = model.encoding
    if args.vocabulary is not None:
        from beam_dp import categorical
        if encoding is None or encoding.vocabulary is None:
            raise ValueError(f"--vocabulary {args.vocabulary}: the model has no vocabulary "
                             "(it was trained without one)")
        given = categorical.read_vocabulary(args.vocabulary, encoding.categorical)
        if categorical.vocabulary_fingerprint(given) != categorical.vocabulary_fingerprint(encoding.vocabulary):
            raise ValueError(f"--vocabulary {args.vocabulary} is not the vocabulary the model was "
                             "trained with (their SHA-256 differ); the model's own copy is used "
                             "without --vocabulary")
    files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    predictions, probabilities, dropped, ids = [], [], [], {c: [] for c in id_columns}
    for path in files:
        if id_columns:
            ids_of = data.read_columns(path, id_columns, args.batch_rows)
            for c in id_columns:
                ids[c].append(ids_of[c])
        for block in data.blocks_from_file(path, None, model.feature_columns, model.loss,
                                           args.batch_rows, encoding=encoding):
            s = model.block_scores(block)
            predictions.append(model.loss.predict(s))
            dropped.append(block.dropped if block.dropped is not None
                           else np.zeros(len(block), dtype=bool))
            if model.loss.name == "logistic":
                probabilities.append(api.losses.expit(s[:, 0]))
            elif model.loss.name == "softmax":
                probabilities.append(scipy.special.softmax(s, axis=1))
    mask = np.concatenate(dropped) if dropped else np.zeros(0, dtype=bool)
    labels = model.labels_of(np.concatenate(predictions), mask)
    columns = {c: _concat_ids([a for part in ids[c] for a in part.chunks]) for c in id_columns}
    columns["prediction"] = (pa.array(labels.tolist()) if labels.dtype == object
                             else pa.array(labels, mask=mask if mask.any() else None))
    if probabilities and model.loss.name == "logistic":
        columns["probability"] = pa.array(np.concatenate(probabilities),
                                          mask=mask if mask.any() else None)
    elif probabilities:   # softmax: one column per class, named by the declared class (or its id)
        stacked = np.concatenate(probabilities)
        for k, name in enumerate(_class_column_names(model, stacked.shape[1])):
            columns[name] = pa.array(stacked[:, k], mask=mask if mask.any() else None)
    # Written beside the target under a fresh temporary name (created exclusively, so no one
    # can plant a link there), then renamed: no partial file on failure.
    directory, name = os.path.split(os.path.abspath(args.output))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=f"-{name}", dir=directory)
    os.close(fd)
    try:
        data.write_table(tmp, columns)
        _stop_if_interrupted()
        os.replace(tmp, args.output)
    except (OSError, pa.ArrowException) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(f"cannot write {args.output}: {reason}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {len(columns['prediction'])} predictions to {args.output}")
    return 0


if __name__ == "__main__":   # ``python -m beam_dp.cli ...``, as the console script
    console_main()
