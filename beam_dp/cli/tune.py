"""``beam-dp tune``: private hyperparameter selection (``beam_dp.tune``) with train's input,
model and privacy flags, the tuning's own, and the algorithm's options as fixed values."""
from __future__ import annotations

import dataclasses
import sys
import textwrap
import warnings

from beam_dp.cli import releases, run_arguments, train
from beam_dp.cli.parsing import Formatter, missing_policies, requested_algorithm

USAGE = "beam-dp tune --input FILES --output DIR --epsilon E [--algorithm NAME] [options]"


def add_parser(sub, argv):
    """The algorithm's options have no default here: an option left out is the grid's or the
    algorithm's default."""
    from beam_dp import tuning
    from beam_dp.algorithms import registry

    grids = "; ".join(f"{name}: " + " ".join(
        f"{k}={','.join(f'{x:.4g}' for x in v)}"
        + (" (times the model's default step)" if k in tuning.RELATIVE_TO_DEFAULT_STEP.get(name, ())
           else "") for k, v in grid.items()) for name, grid in tuning.DEFAULT_GRIDS.items())
    tune = sub.add_parser(
        "tune", help="private hyperparameter selection (random stopping, inside epsilon)",
        formatter_class=Formatter, usage=USAGE,
        description=textwrap.fill("Train a random number of candidates drawn from a public grid, score each "
                    "privately and release the best (Papernot & Steinke 2022), all within the "
                    "reported (epsilon, delta). Runs in-process; writes model.json, "
                    "privacy_report.json and tuning.json.", 78),
        epilog=f"default grids: {grids}")
    run_arguments.add_run_arguments(tune, audit=False)
    for action in tune._actions:
        if action.dest == "validation":
            action.help = ("held-out files to score the candidates on (private too); default "
                           "--holdout of the input")
    group = tune.add_argument_group("tuning")
    group.add_argument("--algorithm", choices=tuple(tuning.TUNABLE),
                       default=next(iter(tuning.TUNABLE)),
                       help="the optimizer (one whose cost is the same for every setting)")
    group.add_argument("--grid", action="append", default=None, metavar="KEY=V1,V2,...",
                       help="an option and its values, repeatable (the grid is their product); "
                            "default the algorithm's grid")
    group.add_argument("--mean-candidates", type=float, default=tuning.DEFAULT_MEAN_CANDIDATES,
                       metavar="M", help="mean of the random number of candidates (at least 1)")
    group.add_argument("--candidates-shape", type=float, default=tuning.DEFAULT_SHAPE,
                       metavar="S", help="shape of its truncated negative binomial law: 1 "
                                         "geometric, 0 logarithmic")
    group.add_argument("--holdout", type=float, default=tuning.DEFAULT_HOLDOUT, metavar="SHARE",
                       help="share of the input held out to score candidates, without "
                            "--validation; 0 scores on the training rows (at no extra cost)")
    group.add_argument("--default-share", type=float, default=tuning.DEFAULT_SETTING_SHARE,
                       metavar="P", help="probability that a candidate takes train's default "
                                         "setting (when the grid holds it)")
    group.add_argument("--score", choices=tuning.SCORES, default="loss",
                       help="per scored row: loss (1 - clipped loss / bound) or accuracy")
    group.add_argument("--score-bound", type=float, default=None, metavar="B",
                       help="where the clipped loss stops: default 2 for classifiers, half "
                            "the label's declared or private range for a regression")
    group.add_argument("--score-share", type=float, default=tuning.DEFAULT_SCORE_SHARE,
                       metavar="SHARE", help="share of each candidate's budget spent on its score")
    run_arguments.add_quality_arguments(tune, "The chosen model")
    run_arguments.add_ledger_arguments(tune)
    for name, chosen in registry.algorithms().items():
        if name == requested_algorithm(list(argv or [])) and name in tuning.TUNABLE:
            run_arguments.add_fixed_algorithm_arguments(
                tune.add_argument_group(f"{name} options (fixed for every candidate)"),
                chosen.options)
    return tune


def run(args) -> int:
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

    def tune_and_write(release, gate, before_write) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = beam_dp.tune(
                input=args.input, validation=validation_files or None, algorithm=args.algorithm,
                model=args.model, epsilon=args.epsilon, delta=args.delta, grid=args.grid,
                mean_candidates=args.mean_candidates, shape=args.candidates_shape,
                holdout=args.holdout, default_share=args.default_share, score=args.score,
                score_bound_=args.score_bound, score_share=args.score_share,
                count_epsilon=args.count_epsilon, seed=args.seed,
                noise=args.noise, num_classes=args.num_classes, huber_delta=args.huber_delta,
                fit_intercept=args.fit_intercept, label_column=args.label_column,
                feature_columns=args.feature_columns, batch_rows=args.batch_rows,
                categorical_columns=args.categorical_columns, hash_buckets=args.hash_buckets,
                hash_seed=args.hash_seed, vocabulary=args.vocabulary, schema=args.schema,
                label_classes=args.label_classes, positive_class=args.positive_class,
                missing=missing_policies(args.missing), ignore_columns=args.ignore_columns,
                quality_check=args.quality_check, quality_epsilon=args.quality_epsilon,
                quality_label_bound=args.quality_label_bound,
                privacy_unit_column=args.privacy_unit_column,   # (refused by tune, never dropped)
                max_rows_per_user=args.max_rows_per_user, budget_gate=gate,
                progress=lambda message: print(f"beam-dp: {message}", file=sys.stderr),
                **options)
        for warning in model.privacy_report.get("warnings", []):   # (the quality check's)
            print(f"beam-dp: warning: {warning}", file=sys.stderr)
        model.privacy_report["release_id"] = release
        files = {"model.json": report.json_text(model.artifact),
                 "privacy_report.json": report.json_text(model.privacy_report),
                 "tuning.json": report.json_text(model.tuning)}
        files = train.with_report_html(files)   # (kept with the release, as train's)
        before_write(files)
        train.write_outputs(args, files)
        print(f"tuned {args.model} with {args.algorithm}: epsilon={model.epsilon:.4g}, "
              f"delta={args.delta:g}; wrote {args.output}")
        return 0

    return releases.run(args, chosen.relation, input_files, tune_and_write, validation_files)
