"""The commands about a dataset rather than a model: ``make-data`` (a synthetic one), ``stats``
(its private statistics) and ``vocabulary`` (its categorical values, released privately); the
releases themselves are ``beam_dp.dataset_releases``."""
from __future__ import annotations

import os
import sys

import numpy as np

from beam_dp.cli import releases, run_arguments
from beam_dp.cli.parsing import Formatter, columns, positive_int

SPARSE_MECHANISMS = ("gaussian", "laplace")   # beam_dp.stats.SPARSE_MEAN_VARIANTS (not imported here)


def add_make_data_parser(sub):
    from beam_dp import synthetic

    make = sub.add_parser("make-data", help="write a synthetic dataset (train and validation shards)",
                          formatter_class=Formatter)
    make.add_argument("--output", required=True, metavar="DIR", help="directory to write into")
    make.add_argument("--task", choices=synthetic.TASKS + ("click-log",), default="binary",
                      help="kind of labels; click-log: string columns user, item, site, a number "
                           "position and a 0/1 label (--d is ignored)")
    make.add_argument("--values", type=positive_int, default=1000,
                      help="distinct values per categorical column of --task click-log")
    make.add_argument("--n", type=positive_int, default=20000, help="training examples")
    make.add_argument("--d", type=positive_int, default=20, help="features")
    make.add_argument("--num-classes", type=int, default=3, help="classes for --task multiclass")
    make.add_argument("--validation-n", type=int, default=5000, help="validation examples")
    make.add_argument("--shards", type=positive_int, default=4, help="training files")
    make.add_argument("--format", choices=("parquet", "csv"), default="parquet", help="file format")
    make.add_argument("--seed", type=int, default=0, help="the data is synthetic: seeded by default")
    make.add_argument("--overwrite", action="store_true",
                      help="replace an existing --output directory that beam-dp wrote")
    return make


def add_stats_parser(sub):
    from beam_dp import accounting, api

    st = sub.add_parser("stats", help="private statistics of a dataset (to choose clip norms)",
                        epilog="Unknown flags are passed to Beam's PipelineOptions.",
                        formatter_class=Formatter)
    st.add_argument("--input", required=True, nargs="+", action="extend", metavar="FILES",
                    help="Parquet or CSV files (globs)")
    st.add_argument("--output", required=True, metavar="DIR", help="directory for stats_report.json")
    st.add_argument("--overwrite", action="store_true",
                    help="replace an existing --output directory that beam-dp wrote")
    st.add_argument("--label-column", default="label", metavar="COL",
                    help="excluded from the default features")
    st.add_argument("--feature-columns", type=columns, default=None, metavar="COLS",
                    help="comma-separated")
    st.add_argument("--quantiles", type=lambda t: tuple(float(q) for q in columns(t)),
                    default=(0.05, 0.5, 0.95), help="comma-separated fractions")
    st.add_argument("--value-bound", type=float, default=1e6, metavar="B",
                    help="public bound on |values|; the quantile grids span it")
    st.add_argument("--schema", default=None, metavar="FILE",
                    help="train's schema file: its declared bounds are checked against the "
                         "released quantiles (a range far wider than the data is said)")
    st.add_argument("--epsilon", type=float, required=True, help="total budget")
    st.add_argument("--delta", type=float, default=1e-5, help="total delta")
    st.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld",
                    help="privacy accountant")
    st.add_argument("--num-examples", type=positive_int, default=None, metavar="N",
                    help="public dataset size")
    st.add_argument("--noise", choices=("secure", "float"), default=None,
                    help="secure (the default): discrete noise and exact sampling from a "
                         "cryptographic generator; float: numpy's (the default falls back to it, "
                         "saying so, where secure noise's slack would pass 1e-3 delta)")
    st.add_argument("--seed", type=int, default=None, help="fixed seed (tests only)")
    st.add_argument("--runner", default=api.DEFAULT_BEAM_RUNNER, help="'local' or a Beam runner")
    st.add_argument("--batch-rows", type=positive_int, default=65536, metavar="N",
                    help="rows per block read")
    sparse = st.add_argument_group(
        "categorical frequencies",
        "With --categorical-columns, the frequency of each value or hash bucket of those columns\n"
        "instead of the numeric statistics (projection mechanism, paper 001; replace-one; float\n"
        "noise).")
    sparse.add_argument("--categorical-columns", type=columns, default=None, metavar="COLS",
                        help="comma-separated string or integer columns (as in train)")
    sparse.add_argument("--hash-buckets", type=positive_int, default=None, metavar="N",
                        help="hash each categorical column into N public buckets")
    sparse.add_argument("--hash-seed", type=int, default=0, metavar="S",
                        help="the hash's public seed")
    sparse.add_argument("--vocabulary", default=None, metavar="FILE",
                        help="JSON file: categorical column -> its public values (others share "
                             "an 'other' frequency)")
    sparse.add_argument("--sparse-mechanism", choices=SPARSE_MECHANISMS, default=None,
                        help="gaussian ((epsilon, delta)) or laplace (pure epsilon-DP); default "
                             "gaussian")
    run_arguments.add_ledger_arguments(st)
    return st


def add_vocabulary_parser(sub):
    voc = sub.add_parser(
        "vocabulary", formatter_class=Formatter,
        help="release the values of categorical columns privately (for train --vocabulary)",
        description="Release each categorical column's values that occur in enough rows "
                    "(pipeline-dp's partition selection; (epsilon, delta)-DP under add/remove of "
                    "one row). Writes vocabulary.json and privacy_report.json; a training run on "
                    "it spends its own budget on top, and its report states both composed.")
    voc.add_argument("--input", required=True, nargs="+", action="extend", metavar="FILES",
                     help="Parquet or CSV files (globs)")
    voc.add_argument("--output", required=True, metavar="DIR", help="directory for vocabulary.json")
    voc.add_argument("--overwrite", action="store_true",
                     help="replace an existing --output directory that beam-dp wrote")
    voc.add_argument("--categorical-columns", type=columns, required=True, metavar="COLS",
                     help="comma-separated")
    voc.add_argument("--epsilon", type=float, required=True, help="budget of the release")
    voc.add_argument("--delta", type=float, default=1e-6, help="delta of the release")
    voc.add_argument("--seed", type=int, default=None, help="fixed seed (tests only)")
    voc.add_argument("--batch-rows", type=positive_int, default=65536, metavar="N",
                     help="rows per block read")
    voc.add_argument("--privacy-unit-column", default=None, metavar="COLUMN",
                     help="protect each user (this column's value) with all their rows: a value "
                          "is kept only if enough users hold it")
    voc.add_argument("--max-values-per-user", type=positive_int, default=None, metavar="L",
                     help="values of each column one user counts for (with "
                          "--privacy-unit-column); default 4")
    run_arguments.add_ledger_arguments(voc)
    return voc


def make_data(args) -> int:
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


def stats(args, beam_args: list[str]) -> int:
    from beam_dp import accounting, data, dataset_releases

    if args.categorical_columns:
        if args.feature_columns or args.schema:
            raise ValueError("--feature-columns or --schema, and --categorical-columns: stats "
                             "releases the numeric statistics (whose ranges --schema checks) or "
                             "the categorical frequencies; run it once for each")
    else:
        if args.sparse_mechanism is not None:
            raise ValueError("--sparse-mechanism is the noise of the categorical frequencies: it "
                             "needs --categorical-columns")
        if args.hash_buckets is not None or args.vocabulary is not None:
            raise ValueError("--hash-buckets and --vocabulary need --categorical-columns")
    files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    common = dict(epsilon=args.epsilon, delta=args.delta, runner=args.runner,
                  pipeline_args=beam_args, overwrite=args.overwrite, batch_rows=args.batch_rows,
                  accountant=args.accountant, num_examples=args.num_examples, noise=args.noise,
                  seed=args.seed)

    def frequencies(release, gate, before_write) -> int:
        mechanism = args.sparse_mechanism or "gaussian"
        summary, encoding = dataset_releases.release_frequencies(
            args.input, args.output, categorical_columns=args.categorical_columns,
            hash_buckets=args.hash_buckets, hash_seed=args.hash_seed, vocabulary=args.vocabulary,
            mechanism=mechanism, gate=gate, before_write=before_write, **common)
        _print_warnings(summary)
        print(f"private frequencies of {len(encoding.categorical)} categorical columns "
              f"({mechanism} projection mechanism, {encoding.dim} columns): "
              f"epsilon={summary['privacy']['epsilon']:.4g}"
              + (f", delta={args.delta:g}" if mechanism == "gaussian" else " (pure)")
              + f"; wrote {args.output}")
        return 0

    bounds = None
    if args.schema is not None:
        from beam_dp import schema

        bounds = schema.read(args.schema).get("bounds") or {}

    def summary(release, gate, before_write) -> int:
        summary, columns_released = dataset_releases.release_summary(
            args.input, args.output, quantiles=args.quantiles, value_bound=args.value_bound,
            label_column=args.label_column, feature_columns=args.feature_columns, gate=gate,
            before_write=before_write, bounds=bounds, **common)
        _print_warnings(summary)
        print(f"private statistics of {columns_released} columns: "
              f"epsilon={summary['privacy']['epsilon']:.4g}, delta={args.delta:g}; "
              f"wrote {args.output}")
        return 0

    if args.categorical_columns:
        return releases.run(args, accounting.REPLACE_ONE, files, frequencies)
    return releases.run(args, accounting.ADD_REMOVE, files, summary)


def vocabulary(args) -> int:
    from beam_dp import accounting, data, dataset_releases, vocabulary_release

    files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    if args.max_values_per_user is not None and args.privacy_unit_column is None:
        raise ValueError("--max-values-per-user bounds each user's values: it needs "
                         "--privacy-unit-column")
    per_user = ({} if args.privacy_unit_column is None else dict(
        privacy_unit_column=args.privacy_unit_column,
        max_values_per_user=args.max_values_per_user or vocabulary_release.DEFAULT_VALUES_PER_USER))

    def release(release_id, gate, before_write) -> int:
        released, privacy = dataset_releases.release_vocabulary(
            args.input, args.output, categorical_columns=args.categorical_columns,
            epsilon=args.epsilon, delta=args.delta, batch_rows=args.batch_rows,
            overwrite=args.overwrite, seed=args.seed, gate=gate, release_id=release_id,
            before_write=before_write, **per_user)
        sizes = ", ".join(f"{c}: {len(v)}" for c, v in released)
        print(f"released a vocabulary ({sizes} values): epsilon={privacy['epsilon']:.4g}, "
              f"delta={args.delta:g}; wrote {args.output}")
        return 0

    relation = accounting.ADD_REMOVE
    if args.privacy_unit_column is not None:   # charged to the unit's own budget, as train's
        from beam_dp.ledger import core
        relation = accounting.USER_ADD_REMOVE
        if args.dataset_id is not None:
            args.dataset_id = core.budget_dataset(args.dataset_id, args.privacy_unit_column)
    return releases.run(args, relation, files, release)


def _print_warnings(summary: dict) -> None:
    for warning in summary["warnings"]:     # public bounds only, never a data value
        print(f"beam-dp: warning: {warning}", file=sys.stderr)
