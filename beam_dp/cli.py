"""The ``beam-dp`` command: make-data, train, predict.

Flags this command does not know are handed to Beam's PipelineOptions unchanged, so
``--runner DataflowRunner --project ... --temp_location ...`` works as with any Beam pipeline.
``--runner local`` runs the same kernels in-process without Beam; with no ``--runner``, Beam's
in-process FnApiRunner is used (DirectRunner would first try to download the Prism runner).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

DEFAULT_BEAM_RUNNER = "FnApiRunner"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _columns(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]


def build_parser() -> argparse.ArgumentParser:
    from beam_dp import accounting, losses, synthetic
    from beam_dp.algorithms import dpsgd_f
    from beam_dp.algorithms.noisy_gd import ALGORITHMS

    parser = argparse.ArgumentParser(prog="beam-dp", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-data", help="write a synthetic dataset (train and validation shards)")
    make.add_argument("--output", required=True, help="directory to write into")
    make.add_argument("--task", choices=synthetic.TASKS, default="binary")
    make.add_argument("--n", type=_positive_int, default=20000, help="training examples")
    make.add_argument("--d", type=_positive_int, default=20, help="features")
    make.add_argument("--num-classes", type=int, default=3, help="classes for --task multiclass")
    make.add_argument("--validation-n", type=int, default=5000)
    make.add_argument("--shards", type=_positive_int, default=4)
    make.add_argument("--format", choices=("parquet", "csv"), default="parquet")
    make.add_argument("--seed", type=int, default=0, help="the data is synthetic: seeded by default")
    make.add_argument("--overwrite", action="store_true", help="replace an existing --output directory")

    train = sub.add_parser("train", help="train a differentially private GLM",
                           epilog="Unknown flags are passed to Beam's PipelineOptions.")
    io = train.add_argument_group("input and output")
    io.add_argument("--input", required=True, help="glob of Parquet or CSV files (comma-separated globs allowed)")
    io.add_argument("--output", required=True, help="directory for model.json, privacy_report.json, metrics.json")
    io.add_argument("--overwrite", action="store_true", help="replace an existing --output directory")
    io.add_argument("--label-column", default="label")
    io.add_argument("--feature-columns", type=_columns, default=None,
                    help="comma-separated; default: every numeric column but the label")
    io.add_argument("--validation", default=None, help="glob of validation files (not covered by the guarantee)")
    io.add_argument("--batch-rows", type=_positive_int, default=65536, help="rows per block read")

    model = train.add_argument_group("model")
    model.add_argument("--model", choices=losses.MODEL_NAMES, default="logistic")
    model.add_argument("--num-classes", type=int, default=None, help="classes for --model softmax (public)")
    model.add_argument("--huber-delta", type=float, default=1.0)
    model.add_argument("--no-intercept", dest="fit_intercept", action="store_false")

    algo = train.add_argument_group("algorithm")
    algo.add_argument("--algorithm", choices=ALGORITHMS + ("dpsgd-f", "dp-ambssgd", "ssp"), default="dpsgd")
    algo.add_argument("--clip-norm", type=float, default=1.0)
    algo.add_argument("--learning-rate", type=float, default=None,
                      help="default 2 (dpsgd, dpsgd-f), 1 (dpgd, dp-ambssgd)")
    algo.add_argument("--batch-size", type=_positive_int, default=1000, help="expected batch size (dpsgd)")
    algo.add_argument("--epochs", type=float, default=None, help="default 5 (dpsgd) or 100 steps (dpgd)")
    algo.add_argument("--steps", type=_positive_int, default=None, help="overrides --epochs")
    algo.add_argument("--average-iterates", dest="average_iterates", action="store_true", default=None,
                      help="output the average of the iterates (default for dpgd)")
    algo.add_argument("--no-average-iterates", dest="average_iterates", action="store_false")
    algo.add_argument("--feature-norm", type=float, default=None,
                      help="dpsgd/dpgd and dpsgd-f practical: normalize every feature vector to this "
                           "norm (C_F); dpsgd-f theory: the public bound R (vectors clipped to it)")
    algo.add_argument("--rank", type=_positive_int, default=None,
                      help="dpgd: public bound on the feature rank, sets the number of steps (default d + 1)")
    algo.add_argument("--max-steps", type=_positive_int, default=2000, help="dpgd: cap on that number")
    algo.add_argument("--dpsgd-f-variant", choices=dpsgd_f.VARIANTS, default="practical")
    algo.add_argument("--preprocess-epsilon", type=float, default=None,
                      help="dpsgd-f: budget of the private preprocessing (default 5%% of epsilon "
                           "for practical, 2/3 for theory)")

    regression = train.add_argument_group("dp-ambssgd and ssp (linear regression)")
    regression.add_argument("--blocks", type=_positive_int, default=12, help="dp-ambssgd: T disjoint blocks")
    regression.add_argument("--stat-fraction", type=float, default=1 / 11,
                            help="dp-ambssgd: share of each block for the clip statistics (s/(b+s))")
    regression.add_argument("--expected-feature-norm", type=float, default=None,
                            help="dp-ambssgd: R_x, clip = R_x * residual threshold (default sqrt(d))")
    regression.add_argument("--residual-bound", type=float, default=1e4,
                            help="dp-ambssgd: largest residual the clip search considers")
    regression.add_argument("--label-bound", type=float, default=4.0, help="ssp: labels clamped to +-this")
    regression.add_argument("--ridge", type=float, default=None,
                            help="ssp: ridge penalty; default chosen privately (AdaSSP)")

    privacy = train.add_argument_group("privacy")
    budget = privacy.add_mutually_exclusive_group(required=True)
    budget.add_argument("--epsilon", type=float, help="target epsilon: the noise is calibrated to it")
    budget.add_argument("--noise-multiplier", type=float, help="report the epsilon this noise buys")
    privacy.add_argument("--delta", type=float, default=1e-5)
    privacy.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld")
    privacy.add_argument("--num-examples", type=_positive_int, default=None,
                         help="public dataset size; without it n is estimated with a Laplace count")
    privacy.add_argument("--count-epsilon", type=float, default=None,
                         help="budget of that count (default: 1%% of --epsilon, or 0.01)")
    privacy.add_argument("--seed", type=int, default=None,
                         help="fixed seed for tests and comparisons; default: OS secure randomness")

    run = train.add_argument_group("execution")
    run.add_argument("--runner", default=DEFAULT_BEAM_RUNNER,
                     help="'local' for the in-process numpy runner, else a Beam runner "
                          f"(default {DEFAULT_BEAM_RUNNER}, Beam's in-process runner)")
    run.add_argument("--steps-per-pipeline", type=_positive_int, default=25,
                     help="steps unrolled into one Beam pipeline; the driver checkpoints between them")
    run.add_argument("--checkpoint-dir", default=None,
                     help="save the (noised) state after every chunk and resume from it")

    st = sub.add_parser("stats", help="private statistics of a dataset (to choose clip norms)",
                        epilog="Unknown flags are passed to Beam's PipelineOptions.")
    st.add_argument("--input", required=True, help="glob of Parquet or CSV files")
    st.add_argument("--output", required=True, help="directory for stats_report.json")
    st.add_argument("--overwrite", action="store_true")
    st.add_argument("--label-column", default="label", help="excluded from the default features")
    st.add_argument("--feature-columns", type=_columns, default=None)
    st.add_argument("--quantiles", type=lambda t: tuple(float(q) for q in _columns(t)),
                    default=(0.05, 0.5, 0.95), help="comma-separated fractions")
    st.add_argument("--value-bound", type=float, default=1e6,
                    help="public bound on |values|; the quantile grids span it")
    st.add_argument("--epsilon", type=float, required=True)
    st.add_argument("--delta", type=float, default=1e-5)
    st.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld")
    st.add_argument("--num-examples", type=_positive_int, default=None, help="public dataset size")
    st.add_argument("--seed", type=int, default=None)
    st.add_argument("--runner", default=DEFAULT_BEAM_RUNNER)
    st.add_argument("--batch-rows", type=_positive_int, default=65536)

    predict = sub.add_parser("predict", help="apply a trained model to a dataset")
    predict.add_argument("--model", required=True, help="model.json or the training output directory")
    predict.add_argument("--input", required=True, help="glob of Parquet or CSV files")
    predict.add_argument("--output", required=True, help="predictions file (.csv or .parquet)")
    predict.add_argument("--batch-rows", type=_positive_int, default=65536)
    return parser


def main(argv: list[str] | None = None) -> int:
    from beam_dp.data import DataError

    parser = build_parser()
    args, beam_args = parser.parse_known_args(argv)
    if beam_args and args.command not in ("train", "stats"):
        parser.error(f"unrecognized arguments: {' '.join(beam_args)}")
    try:
        if args.command == "make-data":
            return _make_data(args)
        if args.command == "train":
            return _train(args, beam_args)
        if args.command == "stats":
            return _stats(args, beam_args)
        return _predict(args)
    except (DataError, ValueError, FileExistsError) as e:
        message = e.detail if isinstance(e, DataError) else str(e)
        print(f"beam-dp: error: {message}", file=sys.stderr)
        return 2
    except Exception as e:  # a Beam runner wraps worker errors; show our one line if it is there
        text = str(e)
        if DataError.MARKER in text:
            line = text[text.index(DataError.MARKER) + len(DataError.MARKER):].splitlines()[0]
            line = line.split(" [while running")[0]  # Beam appends the step's name
            print(f"beam-dp: error: {line.strip()}", file=sys.stderr)
            return 2
        raise


def _make_data(args) -> int:
    from beam_dp import report, synthetic

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


def _input(args, beam_args: list[str], loss, label_column):
    """The training files, their feature columns and the aggregator for the chosen runner."""
    from beam_dp import data

    files = data.list_files(args.input)
    if args.runner == "local":
        open_file = data.open_local
    else:
        from beam_dp.beam.transforms import open_file
    features = data.resolve_feature_columns(files[0], args.label_column, args.feature_columns,
                                            open_file, require_label=label_column is not None)
    if args.runner == "local":
        from beam_dp.local import LocalAggregator
        aggregator = LocalAggregator(data.load_blocks(files, label_column, features, loss, args.batch_rows))
    else:
        from beam_dp.beam.aggregator import BeamAggregator
        aggregator = BeamAggregator(files, label_column, features, loss, args.batch_rows,
                                    ["--runner", args.runner] + beam_args)
    return features, aggregator, open_file


def _privacy_report(ledger, delta: float, seed_fixed: bool, **fields) -> dict:
    from beam_dp import accounting, report

    return {
        "epsilon": ledger.epsilon(delta),
        "delta": delta,
        "accountant": ledger.accountant,
        "neighbouring": ledger.neighbouring,
        **fields,
        "mechanisms": ledger.mechanisms(),
        "dp_event": accounting.event_to_json(ledger.event()),
        "seed": "fixed by --seed (reproducible run, not for production)" if seed_fixed
                else "OS secure randomness",
        "trust_model": report.TRUST_MODEL,
    }


def _train(args, beam_args: list[str]) -> int:
    from beam_dp import accounting, data, features as feature_maps, losses, mechanisms, report
    from beam_dp.algorithms import dp_ambssgd, dpsgd_f, noisy_gd, ssp

    loss = losses.make_loss(args.model, args.num_classes, args.huber_delta)
    # dp-ambssgd: the paper's Theta(1/||H||) step, 1 on standardized features (0.5 leaves a bias
    # floor of ~1e-5 after 12 blocks; see the regression benchmark).
    default_rate = {"dpgd": 1.0, "dp-ambssgd": 1.0}.get(args.algorithm, 2.0)
    config = noisy_gd.NoisyGDConfig(
        algorithm=args.algorithm if args.algorithm in noisy_gd.ALGORITHMS else "dpsgd",
        clip_norm=args.clip_norm,
        learning_rate=args.learning_rate if args.learning_rate is not None else default_rate,
        batch_size=args.batch_size, epochs=args.epochs, steps=args.steps, epsilon=args.epsilon,
        delta=args.delta, noise_multiplier=args.noise_multiplier, accountant=args.accountant,
        num_examples=args.num_examples, count_epsilon=args.count_epsilon,
        average_iterates=args.average_iterates, fit_intercept=args.fit_intercept,
        steps_per_chunk=args.steps_per_pipeline, rank=args.rank, max_steps=args.max_steps)
    config.validate()
    if args.algorithm in ("dp-ambssgd", "ssp") and args.checkpoint_dir:
        raise ValueError(f"--checkpoint-dir is not supported by {args.algorithm} (one pass)")
    f_config = None
    if args.algorithm == "dpsgd-f":
        f_config = dpsgd_f.DpsgdFConfig(args.dpsgd_f_variant, args.preprocess_epsilon,
                                        args.feature_norm if args.feature_norm is not None else 1.0)
        f_config.validate()
    elif args.feature_norm is not None and args.algorithm not in ("ssp",) and not args.feature_norm > 0:
        raise ValueError("--feature-norm must be positive")
    validation_files = data.list_files(args.validation) if args.validation else []
    features, aggregator, open_file = _input(args, beam_args, loss, args.label_column)

    seed = args.seed if args.seed is not None else mechanisms.secure_seed()
    # The per-example map that the model expects of raw features (applied again by `predict`).
    if args.algorithm in ("dp-ambssgd", "ssp"):
        feature_transform = None
    elif f_config is not None and f_config.variant == "theory":
        feature_transform = {"clip_rows": f_config.feature_norm}
    elif args.feature_norm is not None:
        feature_transform = {"normalize_rows": args.feature_norm}
    else:
        feature_transform = None
    with report.atomic_directory(args.output, args.overwrite) as out:
        ledger = accounting.Ledger(args.accountant, accounting.ADD_REMOVE)
        if args.algorithm == "dp-ambssgd":
            result = dp_ambssgd.train(config, dp_ambssgd.AmbssgdConfig(
                args.blocks, args.stat_fraction, args.expected_feature_norm, args.residual_bound),
                loss, len(features), aggregator, seed, ledger, _progress_callback())
        elif args.algorithm == "ssp":
            result = ssp.train(config, ssp.SspConfig(args.feature_norm, args.label_bound, args.ridge),
                               loss, len(features), aggregator, seed, ledger)
        elif f_config is not None:
            result = dpsgd_f.train(config, f_config, loss, len(features), aggregator, seed, ledger,
                                   _progress_callback(), args.checkpoint_dir)
        else:
            normalize = (feature_maps.NormalizeRows(args.feature_norm)
                         if args.feature_norm is not None else None)
            result = noisy_gd.train(config, loss, len(features), aggregator, seed, ledger,
                                    _progress_callback(), args.checkpoint_dir,
                                    make_transform=(lambda pre: normalize) if normalize else None)

        artifact = report.model_artifact(loss, result.theta, features, args.label_column,
                                         args.algorithm, args.fit_intercept, feature_transform)
        report.write_json(out, "model.json", artifact)
        privacy = _privacy_report(
            ledger, args.delta, args.seed is not None,
            requested_epsilon=args.epsilon,
            algorithm=args.algorithm if f_config is None else f"dpsgd-f ({f_config.variant})",
            noise_multiplier=result.noise_multiplier,
            sampling_probability=result.sampling_probability,
            sampling={"dp-ambssgd": "one pass over disjoint blocks (data-independent assignment)",
                      "ssp": "one pass (sufficient statistics)"}.get(
                args.algorithm, "Poisson" if result.sampling_probability < 1 else "full batch"),
            steps=result.steps,
            clip_norm=result.clip_norm,
            expected_batch_size=result.preprocessing.get(
                "batch_size", result.sampling_probability * result.dataset_size["value"]),
            dataset_size=result.dataset_size,
            # dpsgd-f: the private preprocessing releases; dp-ambssgd / ssp: their public plan
            # and released ridge.
            **{"preprocessing" if f_config is not None else "algorithm_parameters": result.preprocessing},
            hyperparameters="public inputs; not privately tuned")
        report.write_json(out, "privacy_report.json", privacy)
        if validation_files:
            loss_v, theta_v, _ = report.load_model_dict(artifact)
            blocks = (b for f in validation_files for b in data.blocks_from_file(
                f, args.label_column, features, loss, args.batch_rows, open_file))
            metrics = report.evaluate(loss_v, theta_v, map(report.feature_map(artifact), blocks))
            metrics["covered_by_privacy_guarantee"] = False
            metrics["note"] = "computed on the validation data without noise; not differentially private"
            report.write_json(out, "metrics.json", metrics)
    print(f"trained {args.model} with {args.algorithm}: epsilon={privacy['epsilon']:.4g}, "
          f"delta={args.delta:g}; wrote {args.output}")
    return 0


def _stats(args, beam_args: list[str]) -> int:
    from beam_dp import accounting, losses, mechanisms, report, stats

    if not args.quantiles or not all(0.0 <= q <= 1.0 for q in args.quantiles):
        raise ValueError("--quantiles must be fractions in [0, 1]")
    if not (args.epsilon > 0 and 0 < args.delta < 1 and args.value_bound > 0):
        raise ValueError("--epsilon, --value-bound must be positive and --delta in (0, 1)")
    features, aggregator, _ = _input(args, beam_args, losses.SquaredLoss(), None)
    seed = args.seed if args.seed is not None else mechanisms.secure_seed()
    stages = stats.dataset_summary_stages(len(features), args.quantiles, args.epsilon, args.delta,
                                          seed, args.value_bound, count=args.num_examples is None,
                                          accountant=args.accountant)
    with report.atomic_directory(args.output, args.overwrite) as out:
        ledger = accounting.Ledger(args.accountant, accounting.ADD_REMOVE)
        stats.record_releases(stages, ledger)
        state = aggregator.run_stages(stages, {"n": args.num_examples} if args.num_examples else {})
        column_qs = sorted(set(args.quantiles) | {0.05, 0.95})
        norm_qs = sorted(set(args.quantiles))
        summary = {
            "count": state["n"],
            "count_source": "public (--num-examples)" if args.num_examples else "private estimate: Laplace count",
            "columns": {name: {"mean": float(state["column_means"][j]),
                               "quantiles": {str(q): float(state["column_quantiles"][j, i])
                                             for i, q in enumerate(column_qs)}}
                        for j, name in enumerate(features)},
            "feature_norm_quantiles": {str(q): float(state["norm_quantiles"][0, i])
                                       for i, q in enumerate(norm_qs)},
            "quantile_rank_error_95": {
                release["name"] + label:
                    stats.quantile_rank_error_bound(release["grid_size"], release["epsilon"], 0.05)
                for label, release in zip((" (columns)", " (norms)"),
                                          [r for r in ledger.mechanisms()
                                           if r["name"] == "exponential_mechanism_quantile"])},
            "notes": ("Quantiles are grid points of a symmetric log grid over +-value_bound "
                      "(relative resolution about 1.8%), chosen by the exponential mechanism: with "
                      "probability 0.95 each one's rank is within quantile_rank_error_95 examples "
                      "of its target. Means are of values clipped to the private 5th and 95th "
                      "percentiles."),
            "privacy": _privacy_report(ledger, args.delta, args.seed is not None,
                                       requested_epsilon=args.epsilon, value_bound=args.value_bound),
        }
        report.write_json(out, "stats_report.json", summary)
    print(f"private statistics of {len(features)} columns: epsilon={summary['privacy']['epsilon']:.4g}, "
          f"delta={args.delta:g}; wrote {args.output}")
    return 0


def _predict(args) -> int:
    from beam_dp import data, losses, report

    loss, theta, artifact = report.load_model(args.model)
    feature_map = report.feature_map(artifact)
    predictions, probabilities = [], []
    for path in data.list_files(args.input):
        for block in data.blocks_from_file(path, None, artifact["feature_columns"], loss, args.batch_rows):
            s = losses.scores(theta, feature_map(block).features)
            predictions.append(loss.predict(s))
            if loss.name == "logistic":
                probabilities.append(losses.expit(s[:, 0]))
    columns = {"prediction": np.concatenate(predictions)}
    if probabilities:
        columns["probability"] = np.concatenate(probabilities)
    # Written beside the target under a temporary name, then renamed: no partial file on failure.
    directory, name = os.path.split(os.path.abspath(args.output))
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{name}")
    try:
        data.write_table(tmp, columns)
        os.replace(tmp, args.output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {len(columns['prediction'])} predictions to {args.output}")
    return 0
