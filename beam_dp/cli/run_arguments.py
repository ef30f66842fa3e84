"""The flags of a training configuration, shared by ``train``, ``audit`` and ``tune``: input,
model, privacy, the budget ledger, the quality check and the algorithm's own options (generated
from the algorithm registry, so that a new algorithm needs no edit here)."""
from __future__ import annotations

import argparse
import textwrap

from beam_dp.cli.parsing import (DEFAULT_ALGORITHM, columns, positive_int, requested_algorithm,
                                 rows_per_user)

# The exit codes a run charged to the ledger may end with (said in its help).
LEDGER_EPILOG = ("Exit codes: 3 refused by the budget, 4 running elsewhere, 6 refused by the\n"
                 "quality check, 7 unreadable checkpoint, 69 temporary (retry), 75 run again.")


def add_run_arguments(parser, audit: bool) -> None:
    """The flags of a training configuration: input, model and privacy (``train``, ``audit``,
    ``tune``; ``audit`` takes no categorical or schema input)."""
    from beam_dp import accounting, losses, user_level

    io = parser.add_argument_group("input and output")
    io.add_argument("--input", required=True, nargs="+", action="extend", metavar="FILES",
                    help="Parquet or CSV files: quoted globs or paths")
    io.add_argument("--output", required=True, metavar="DIR",
                    help="directory for audit_report.json" if audit else
                         "directory for model.json and the reports")
    io.add_argument("--overwrite", action="store_true",
                    help="replace an --output directory beam-dp wrote")
    io.add_argument("--label-column", default="label", metavar="COL", help="the label's column")
    io.add_argument("--feature-columns", type=columns, default=None, metavar="COLS",
                    help="comma-separated; default all numeric but the label")
    if not audit:
        from beam_dp.algorithms import registry   # (imported late, as the algorithms' flags)
        sparse = ", ".join(a.name for a in registry.algorithms().values() if a.sparse_input)
        io.add_argument("--categorical-columns", type=columns, default=None, metavar="COLS",
                        help="string or integer columns, encoded by --hash-buckets or "
                             f"--vocabulary (algorithms {sparse})")
        io.add_argument("--hash-buckets", type=positive_int, default=None, metavar="N",
                        help="hash the categorical columns into N columns")
        io.add_argument("--hash-seed", type=int, default=None, metavar="S",
                        help="the hash's public seed; default 0")
        io.add_argument("--vocabulary", default=None, metavar="FILE",
                        help="JSON file: column -> its public values")
        io.add_argument("--schema", default=None, metavar="FILE",
                        help="JSON file declaring the table; flags given win")
        io.add_argument("--label-classes", type=columns, default=None, metavar="VALUES",
                        help="label values in class-id order, e.g. No,Yes")
        io.add_argument("--positive-class", default=None, metavar="VALUE",
                        help="the label value that is class 1 of a binary model")
        io.add_argument("--missing", action="append", default=None, metavar="COLUMN=POLICY",
                        help="a numeric column's missing cells: constant:V, indicator[:V], "
                             "drop, median or mean; repeatable")
        io.add_argument("--ignore-columns", type=columns, default=None, metavar="COLS",
                        help="comma-separated columns left out of the features")
        io.add_argument("--validation", default=None, metavar="GLOB",
                        help="files for metrics.json (not private)")
        io.add_argument("--batch-rows", type=positive_int, default=65536, metavar="N",
                        help="rows per block read")

    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=losses.MODEL_NAMES, default="logistic",
                       help="logistic, softmax, hinge (linear SVM), linear or huber")
    model.add_argument("--num-classes", type=int, default=None, metavar="K",
                       help="classes of --model softmax (public)")
    model.add_argument("--huber-delta", type=float, default=None, metavar="D",
                       help="threshold of --model huber; default 1")
    model.add_argument("--no-intercept", dest="fit_intercept", action="store_false",
                       help="fit no intercept")

    privacy = parser.add_argument_group("privacy")
    # One of the two is required; checked after the unknown flags (so that a misspelt --epsilom
    # is named rather than reported as a missing --epsilon).
    budget = privacy.add_mutually_exclusive_group()
    budget.add_argument("--epsilon", type=float, metavar="E",
                        help="target epsilon: the noise is calibrated to it")
    budget.add_argument("--noise-multiplier", type=float, metavar="S",
                        help="instead of --epsilon: this noise; reports its epsilon")
    privacy.add_argument("--delta", type=float, default=1e-5, metavar="D",
                         help="target delta, well below 1/n")
    privacy.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld",
                         help="privacy accountant")
    privacy.add_argument("--num-examples", type=positive_int, default=None, metavar="N",
                         help="public dataset size; default a private count")
    privacy.add_argument("--count-epsilon", type=float, default=None, metavar="E",
                         help="budget of that count; default a share of --epsilon")
    privacy.add_argument("--noise", choices=("secure", "float"), default=None,
                         help="secure: discrete noise on exact sums; float: numpy's. Default "
                              "secure where the algorithm has it and its slack stays under 1e-3 "
                              "delta")
    privacy.add_argument("--seed", type=int, default=None,
                         help="fixed seed (tests only); default secure randomness")
    if not audit:
        privacy.add_argument(
            "--privacy-unit-column", default=None, metavar="COLUMN",
            help="user-level privacy (dpgd, dpsgd): the unit is a user of COLUMN")
        privacy.add_argument(
            "--max-rows-per-user", type=rows_per_user, default=None, metavar="K",
            help=f"rows kept per user, or auto; default {user_level.DEFAULT_MAX_ROWS_PER_USER}")


def add_ledger_arguments(parser) -> None:
    """The budget ledger across runs (``train`` and ``audit``: an audit is a release too)."""
    ledger = parser.add_argument_group("budget across runs")
    ledger.add_argument("--ledger", default=None, metavar="URL",
                        help="charge the run to the dataset's lifetime budget in this ledger "
                             "(a rerun returns the released output free): a SQLite path or URL, "
                             "or postgresql://...")
    ledger.add_argument("--dataset-id", default=None, metavar="ID",
                        help="the dataset's id in the ledger")
    ledger.add_argument("--partition", action="append", default=None, metavar="P",
                        help="a partition the run reads (own budget); repeatable")
    ledger.add_argument("--orchestrator-id", action="append", default=None, metavar="KEY=VALUE",
                        help="who ran it, recorded with the charge; repeatable")
    ledger.add_argument("--input-snapshot", choices=("metadata", "content"), default="metadata",
                        metavar="HOW", help="content: local inputs' bytes, not times, in the "
                                            "release id")


def add_quality_arguments(parser, what: str) -> None:
    """The private quality check's flags (``beam_dp.quality``), declared like an algorithm's."""
    from beam_dp import quality

    _add_declared(parser.add_argument_group(
        "quality check", f"{what} against the best constant predictor, privately, within epsilon"),
        quality.QualityOptions)


def add_algorithm_arguments(parser, argv, algorithms, auto: bool = False) -> None:
    """--algorithm and the chosen algorithm's own flags (from its declared options). ``auto``
    (train): also --algorithm auto, whose flags are its candidates' (none with a default: the
    rule reads which were given) and --rows-hint."""
    from beam_dp.algorithms import choice, spec

    algo = parser.add_argument_group("algorithm")
    algo.add_argument("--algorithm", choices=tuple(algorithms) + ((choice.AUTO,) if auto else ()),
                      default=DEFAULT_ALGORITHM, metavar="NAME",
                      help="the optimizer: one of `beam-dp algorithms` (`--algorithm NAME "
                           "--help` shows its flags)"
                           + (f", or auto: dpgd, or dpsgd for classification from "
                              f"{choice.FULL_PASS_ROWS:,} declared rows" if auto else ""))
    name = requested_algorithm(list(argv or []))
    if auto:
        algo.add_argument("--rows-hint", type=positive_int, default=None, metavar="N",
                          help="a public estimate of the rows, for --algorithm auto's rule only")
    if auto and name == choice.AUTO:
        group = parser.add_argument_group(
            "auto options", textwrap.fill("the options of " + " and ".join(choice.CANDIDATES)
                                          + "; each one given counts in the choice, the rest "
                                          "take the chosen algorithm's defaults", 78))
        added: set = set()
        for candidate in choice.CANDIDATES:
            _add_declared(group, algorithms[candidate].options, defaults=False, skip=added)
            added |= {f.name for f, _ in spec.fields(algorithms[candidate].options)}
    elif name in algorithms:
        chosen = algorithms[name]
        about = f"{chosen.use_when}. Models: {', '.join(chosen.models)}."
        group = parser.add_argument_group(f"{name} options", textwrap.fill(about, 78))
        _add_declared(group, chosen.options)


def add_fixed_algorithm_arguments(group, options_class) -> None:
    """An algorithm's options with no default (``tune``: an option left out is the grid's or the
    algorithm's default)."""
    _add_declared(group, options_class)
    for action in group._group_actions:
        action.default = argparse.SUPPRESS


def _add_declared(group, options_class, **kwargs) -> None:
    """The flags of declared options (``spec.add_arguments``), shown as ``--flag N`` (a whole
    number) or ``--flag X`` (a number) rather than ``--flag FLAG_NAME``, so that most fit on one
    line of the help."""
    from beam_dp.algorithms import spec

    before = len(group._group_actions)
    spec.add_arguments(group, options_class, **kwargs)
    for action in group._group_actions[before:]:
        if action.nargs != 0 and action.choices is None and action.type in (int, float):
            action.metavar = "N" if action.type is int else "X"
