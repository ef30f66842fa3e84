"""``beam-dp train``: its flags (the shared run flags, execution, the ledger, the quality check
and the chosen algorithm's options) and the run: ``beam_dp.train``, its warnings printed as
lines, the output directory written (``beam_dp.outputs``), charged to the budget ledger with
--ledger (``beam_dp.ledger.charged_run``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings

from beam_dp import storage
from beam_dp.cli import run_arguments
from beam_dp.cli.exit_codes import EXIT_IN_PROGRESS, EXIT_MORE_JOBS, EXIT_REFUSED
from beam_dp.cli.interrupts import stop_if_interrupted
from beam_dp.cli.parsing import Formatter, key_values, missing_policies, positive_int

USAGE = ("beam-dp train --input FILES --output DIR (--epsilon E | --noise-multiplier S)\n"
         "                     [--algorithm NAME] [options]")


def add_parser(sub, argv, algorithms):
    from beam_dp import api

    train = sub.add_parser(
        "train", help="train a differentially private GLM", formatter_class=Formatter,
        usage=USAGE,
        description="Train a GLM with (epsilon, delta)-differential privacy.",
        epilog="Unknown flags are passed to Beam's PipelineOptions.\n" + run_arguments.LEDGER_EPILOG)
    run_arguments.add_run_arguments(train, audit=False)
    run = train.add_argument_group("execution")
    run.add_argument("--runner", default=api.DEFAULT_BEAM_RUNNER,
                     help="'local' (in-process numpy) or a Beam runner")
    run.add_argument("--steps-per-job", type=positive_int, default=None, metavar="N",
                     help="steps per Beam job (checkpoints between jobs); default as many as fit, "
                          "up to 200")
    run.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                     help="save the state after every job and resume from it")
    run.add_argument("--max-jobs", type=positive_int, default=None, metavar="N",
                     help="launch at most N Beam jobs, then exit 75 to be run again; needs "
                          "--checkpoint-dir")
    run.add_argument("--warm-start", default=None, metavar="MODEL",
                     help="start from a released model (dpgd, dpsgd; free)")
    run_arguments.add_ledger_arguments(train)
    run_arguments.add_quality_arguments(train, "The trained model")
    run_arguments.add_algorithm_arguments(train, argv, algorithms, auto=True)
    return train


def run(args, beam_args: list[str]) -> int:
    from beam_dp import api, data, report
    from beam_dp.algorithms import choice, registry
    from beam_dp.ledger import charged_run

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
    charged_run.check_request(args.ledger, args.dataset_id, args.partition)
    chosen = charged_unit(args, chosen)
    if args.max_jobs is not None and args.checkpoint_dir is None:
        raise ValueError("--max-jobs needs --checkpoint-dir: the next invocation goes on from it")
    orchestrator = key_values("--orchestrator-id", args.orchestrator_id)
    release = release_id(args, chosen, input_files, validation_files)
    if args.checkpoint_dir:
        args.checkpoint_dir = storage.join(args.checkpoint_dir, release)
    if args.ledger is None:
        return _train_and_write(api, args, beam_args, options, validation_files, release)
    from beam_dp.algorithms.base import checkpoint_exists

    return run_charged(args, chosen, release, orchestrator,
                       lambda ledger, gate: _train_and_write(api, args, beam_args, options,
                                                             validation_files, release, ledger,
                                                             gate),
                       lambda output: _write_released(args, release, output, validation_files),
                       bool(args.checkpoint_dir) and checkpoint_exists(args.checkpoint_dir))


def charged_unit(args, chosen):
    """For a user-level run (--privacy-unit-column, or the schema's privacy_unit), charged to
    its own budget: --dataset-id becomes the ledger's dataset of that unit
    (``ledger.core.budget_dataset``) and the relation the user-level one. ``chosen`` (its
    ``relation``) otherwise."""
    from beam_dp import accounting, schema
    from beam_dp.ledger import core

    unit = args.privacy_unit_column
    if unit is None and args.schema:
        unit = schema.read(args.schema).get("privacy_unit_column")
    if unit is None:
        return chosen
    if args.dataset_id is not None:
        args.dataset_id = core.budget_dataset(args.dataset_id, unit)
    return argparse.Namespace(relation=accounting.USER_ADD_REMOVE)


def run_charged(args, chosen, release: str, orchestrator: dict, run, write_released,
                from_checkpoint: bool = False) -> int:
    """``run(ledger, gate) -> exit code`` charged to --ledger as ``release``
    (``charged_run.run_charged``), its refusals as exit codes; a run that succeeds prints what
    it was charged."""
    from beam_dp.ledger import charged_run, core

    def run_and_say(ledger, gate) -> int:
        code = run(ledger, gate)
        if code == 0:
            print("ledger: " + charged_run.charge_summary(ledger, release, args.dataset_id),
                  file=sys.stderr)
        return code

    try:
        return charged_run.run_charged(
            args.ledger, release, args.dataset_id, args.partition, chosen.relation, orchestrator,
            args.epsilon, run_and_say, write_released, from_checkpoint,
            notify=lambda message: print(f"beam-dp: {message}", file=sys.stderr),
            checkpoint_dir=getattr(args, "checkpoint_dir", None), delta=getattr(args, "delta", None))
    except charged_run.RunRefused as e:
        print(f"beam-dp: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except core.ReleaseInProgress as e:
        print(f"beam-dp: {e}", file=sys.stderr)
        return EXIT_IN_PROGRESS
    except core.LedgerUnavailable:
        raise   # (a temporary failure: its exit code is main's)
    except core.LedgerError as e:
        print(f"beam-dp: error: {e}", file=sys.stderr)
        return 2


def release_id(args, chosen, input_files, validation_files) -> str:
    """The run's release id (``beam_dp.ledger.runs``: configuration, input snapshot, code): the
    flags that change what is released, not where it is written or how it is run."""
    import beam_dp
    from beam_dp import report
    from beam_dp.ledger import runs

    configuration = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in (
        "command", "input", "validation", "output", "overwrite", "runner", "steps_per_job",
        "checkpoint_dir", "max_jobs", "ledger", "orchestrator_id", "warm_start",
        "input_snapshot")}
    configuration["neighbouring"] = chosen.relation   # (the algorithm's options are in args)
    if configuration.get("rows_hint") is None:   # (release ids stay as before the flag)
        configuration.pop("rows_hint", None)
    if configuration.get("privacy_unit_column") is None:
        # Row-level runs: their release ids stay as they were before these flags existed.
        configuration.pop("privacy_unit_column", None)
        configuration.pop("max_rows_per_user", None)
    if args.command != "train":   # (not written for train: its release ids stay as they were)
        configuration["command"] = args.command
    warm_start = getattr(args, "warm_start", None)
    extra = [warm_start] if warm_start else []
    if warm_start and report.is_output_directory(warm_start):
        extra = [storage.join(warm_start, "model.json")]
    mode = getattr(args, "input_snapshot", None) or "metadata"
    snapshot = {"input": runs.input_snapshot(input_files, mode),
                "validation": runs.input_snapshot(validation_files, mode),
                "warm_start": runs.artifact_snapshot(extra)}
    return runs.release_id(configuration, snapshot, beam_dp.__version__)


def write_outputs(args, files: dict) -> None:
    """The output directory (``outputs.write_outputs``), its warnings printed."""
    from beam_dp import outputs

    for warning in outputs.write_outputs(args.output, args.overwrite, files):
        print(f"beam-dp: warning: {warning}", file=sys.stderr)


def with_report_html(files: dict) -> dict:
    """``files`` and their report.html (``outputs.with_report_html``), its warnings printed."""
    from beam_dp import outputs

    files, warnings_ = outputs.with_report_html(files)
    for warning in warnings_:
        print(f"beam-dp: warning: {warning}", file=sys.stderr)
    return files


def _write_released(args, release: str, output, validation_files) -> int:
    """A rerun of a committed release: its stored output, byte for byte, and its validation
    metrics computed again (they are not DP: the ledger does not keep them); nothing charged."""
    from beam_dp import outputs, report, report_html
    from beam_dp.model import Model

    if output is None:
        print(f"beam-dp: release {release} was refused for lack of budget after its first "
              f"releases (they are charged); nothing to write", file=sys.stderr)
        return EXIT_REFUSED
    files = dict(output["files"])
    if validation_files:
        files.pop(report_html.REPORT_HTML, None)   # made again below, with the metrics
        model = Model(json.loads(files["model.json"]))
        files["metrics.json"] = report.json_text(outputs.validation_metrics(
            model, validation_files, args.runner, args.batch_rows))
    write_outputs(args, files)
    print(f"release {release} was already committed: wrote its output to {args.output} again; "
          f"nothing was charged or trained")
    return 0


def _train_and_write(api, args, beam_args, options, validation_files, release, ledger=None,
                     gate=None) -> int:
    from beam_dp import outputs, quality, report
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
    for line in (model.privacy_report.get("preprocessing") or {}).get("scaling", []):
        print(f"beam-dp: scaling: {line}", file=sys.stderr)   # (column names only)
    cap = (model.privacy_report.get("privacy_unit") or {}).get("cap")
    if cap is not None:   # (noisy released estimates only)
        from beam_dp import user_rows
        print(f"beam-dp: {user_rows.line(cap)}", file=sys.stderr)
    from beam_dp import step_costs
    if (model.privacy_report.get("step_sums") or {}).get("reason") not in (None, step_costs.IN_PROCESS):
        print(f"beam-dp: {step_costs.Choice(**model.privacy_report['step_sums']).line()}",
              file=sys.stderr)
    chose = model.privacy_report.get("algorithm_choice")
    if chose is not None:
        print(f"beam-dp: --algorithm auto chose {chose['chosen']}: {chose['reason']}",
              file=sys.stderr)
    model.privacy_report["release_id"] = release
    if ledger is not None:
        model.privacy_report["ledger"] = {"dataset_id": args.dataset_id,
                                          "partitions": args.partition or []}
    metrics = (outputs.validation_metrics(model, validation_files, args.runner, args.batch_rows)
               if validation_files else None)
    if metrics is not None and metrics.get("better_than_constant") is False:
        # Said, not refused: the model is the release, and the user decides what to do with it.
        metric = "accuracy" if "accuracy" in metrics else "rmse"
        print(f"beam-dp: warning: the model is no better than a constant predictor on the "
              f"validation data ({metric} {metrics[metric]:.4g}, the constant's "
              f"{metrics['constant_baseline'][metric]:.4g}; not covered by the privacy "
              "guarantee): "
              + quality.advice((model.privacy_report.get("hyperparameters") or {}).get("values")),
              file=sys.stderr)
    stop_if_interrupted()
    files = {"model.json": report.json_text(model.artifact),
             "privacy_report.json": report.json_text(model.privacy_report)}
    if metrics is None:
        # report.html kept with the release: a rerun writes the same bytes without making it
        # again (with metrics it shows them, which the ledger does not keep: made again).
        files = with_report_html(files)
    if ledger is not None:   # committed before the first output byte: a rerun writes these
        ledger.commit(release, {"files": files})   # (not the metrics: they are not DP)
    if metrics is not None:
        files["metrics.json"] = report.json_text(metrics)
    write_outputs(args, files)
    print(f"trained {args.model} with {model.artifact['algorithm']}: epsilon={model.epsilon:.4g}, "
          f"delta={args.delta:g}; wrote {args.output}")
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
        missing=missing_policies(args.missing), ignore_columns=args.ignore_columns,
        privacy_unit_column=args.privacy_unit_column, max_rows_per_user=args.max_rows_per_user,
        quality_check=args.quality_check, quality_epsilon=args.quality_epsilon,
        quality_label_bound=args.quality_label_bound, rows_hint=getattr(args, "rows_hint", None),
        **options)
