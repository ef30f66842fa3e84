"""``beam-dp audit``: an empirical lower bound on a configuration's epsilon (``beam_dp.audit``),
charged to the budget ledger with --ledger like a training run (its report is a release)."""
from __future__ import annotations

import dataclasses
import json
import sys
import textwrap

from beam_dp.cli import run_arguments, train
from beam_dp.cli.exit_codes import EXIT_AUDIT_VIOLATION, EXIT_REFUSED
from beam_dp.cli.interrupts import stop_if_interrupted
from beam_dp.cli.parsing import Formatter, key_values, positive_int

USAGE = ("beam-dp audit --input FILES --output DIR (--epsilon E | --noise-multiplier S)\n"
         "                     [--algorithm NAME] [options]")


def add_parser(sub, argv, algorithms):
    audit = sub.add_parser(
        "audit", help="an empirical lower bound on a configuration's epsilon (one-run audit)",
        formatter_class=Formatter, usage=USAGE,
        description=textwrap.fill("Train a configuration once, in-process, with m white-box canaries, and "
                    "report the epsilon that guessing them proves (Steinke, Nasr & Jagielski "
                    "2023); a bound above the claimed epsilon means a leak. The report is a "
                    "release at the claimed epsilon.", 78),
        epilog=run_arguments.LEDGER_EPILOG.replace(", 6 refused by the quality check", "")
        + " 5: the bound exceeds the claimed epsilon.")
    run_arguments.add_run_arguments(audit, audit=True)
    run_arguments.add_ledger_arguments(audit)
    canary = audit.add_argument_group("audit")
    canary.add_argument("--canaries", type=positive_int, default=None, metavar="M",
                        help="canaries, each on a zero feature column of its own; more allow a "
                             "larger bound. Default: sized by --epsilon (1000 up to 3, more "
                             "above)")
    canary.add_argument("--confidence", type=float, default=0.95,
                        help="confidence of the lower bound")
    run_arguments.add_algorithm_arguments(audit, argv, algorithms)
    return audit


def run(args) -> int:
    """A release like a training run (its report is a function of a DP run on the data), so it
    is charged to the budget ledger when one is given, under its own release id (an audit and a
    training run of the same settings are two releases)."""
    from beam_dp import audit, data, report
    from beam_dp.algorithms import registry
    from beam_dp.ledger import charged_run

    chosen = registry.get(args.algorithm)
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(chosen.options)}
    report.check_output_directory(args.output, args.overwrite)
    input_files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    report.check_not_inside(args.output, input_files)
    charged_run.check_request(args.ledger, args.dataset_id, args.partition)

    def audited(ledger=None, gate=None) -> int:
        found = audit.run(
            input=input_files, canaries=args.canaries, confidence=args.confidence,
            algorithm=args.algorithm, model=args.model, epsilon=args.epsilon, delta=args.delta,
            noise_multiplier=args.noise_multiplier, accountant=args.accountant,
            num_examples=args.num_examples, count_epsilon=args.count_epsilon, noise=args.noise,
            num_classes=args.num_classes, huber_delta=args.huber_delta,
            fit_intercept=args.fit_intercept, label_column=args.label_column,
            feature_columns=args.feature_columns, seed=args.seed, budget_gate=gate, **options)
        stop_if_interrupted()
        files = {"audit_report.json": report.json_text(found)}
        if ledger is not None:   # committed before the first output byte, as a training run
            ledger.commit(release, {"files": files})
        train.write_outputs(args, files)
        print(f"audited {args.algorithm} ({args.model}): claimed epsilon="
              f"{found['claimed_epsilon_of_canary_releases']:.4g} for the releases the canaries "
              f"enter ({found['claimed_epsilon']:.4g} for the run) at delta={args.delta:g}; "
              f"empirical lower bound {found['epsilon_lower_bound']:.4g} at "
              f"{found['confidence']:.0%} confidence ({found['correct']} of {found['guesses']} "
              f"guesses right, {found['canaries']} canaries): {found['verdict']}; "
              f"wrote {args.output}")
        return _exit_code(found)

    def write_released(output) -> int:
        if output is None:
            print(f"beam-dp: release {release} was refused for lack of budget; nothing to write",
                  file=sys.stderr)
            return EXIT_REFUSED
        train.write_outputs(args, dict(output["files"]))
        print(f"release {release} was already committed: wrote its audit report to "
              f"{args.output} again; nothing was charged or trained")
        return _exit_code(json.loads(output["files"]["audit_report.json"]))

    if args.ledger is None:
        return audited()
    release = train.release_id(args, chosen, input_files, [])
    return train.run_charged(args, chosen, release, key_values("--orchestrator-id",
                                                                args.orchestrator_id),
                             audited, write_released)


def _exit_code(found: dict) -> int:
    return (0 if found["epsilon_lower_bound"] <= found["claimed_epsilon_of_canary_releases"]
            else EXIT_AUDIT_VIOLATION)
