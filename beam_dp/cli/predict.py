"""The commands over a trained model: ``predict`` (``beam_dp.predictions``) and ``report``
(report.html again from a training output's JSON files, ``beam_dp.report_html``)."""
from __future__ import annotations

import textwrap

from beam_dp.cli.interrupts import stop_if_interrupted
from beam_dp.cli.parsing import Formatter, columns, positive_int


def add_predict_parser(sub):
    predict = sub.add_parser("predict", help="apply a trained model to a dataset",
                             formatter_class=Formatter)
    predict.add_argument("--model", required=True, help="model.json or the training output directory")
    predict.add_argument("--input", required=True, nargs="+", action="extend", metavar="FILES",
                         help="Parquet or CSV files (globs)")
    predict.add_argument("--output", required=True, metavar="FILE",
                         help="predictions file (.csv or .parquet)")
    predict.add_argument("--overwrite", action="store_true",
                         help="replace an existing predictions file that beam-dp wrote")
    predict.add_argument("--batch-rows", type=positive_int, default=65536, metavar="N",
                         help="rows per block read")
    predict.add_argument("--vocabulary", default=None, metavar="FILE",
                         help="check that this vocabulary file is the one the model was trained "
                              "with (the model carries its own copy)")
    predict.add_argument("--id-columns", type=columns, default=None, metavar="COLS",
                         help="comma-separated columns copied from the input into the "
                              "predictions; default the --schema's id_columns")
    predict.add_argument("--schema", default=None, metavar="FILE",
                         help="the training's schema file, for its id_columns")
    return predict


def add_report_parser(sub):
    rep = sub.add_parser(
        "report", formatter_class=Formatter,
        help="write a training output's report.html again from its JSON files",
        description=textwrap.fill(
            "Write OUT/report.html again from OUT's model.json, privacy_report.json and "
            "metrics.json alone. Reads no data and spends no budget.", 78))
    rep.add_argument("output", metavar="OUT", help="a training output directory")
    return rep


def predict(args) -> int:
    from beam_dp import data, predictions, report
    from beam_dp.model import Model

    id_columns = predictions.id_columns_of(args.id_columns, args.schema)
    report.check_output_file(args.output, args.overwrite, id_columns)
    model = Model.load(args.model)
    if args.vocabulary is not None:
        predictions.check_vocabulary(model, args.vocabulary)
    files = sorted({f for pattern in args.input for f in data.list_files(pattern)})
    columns_out = predictions.predict_columns(model, files, id_columns, args.batch_rows)
    predictions.write_predictions(args.output, columns_out, before_replace=stop_if_interrupted)
    print(f"wrote {len(columns_out['prediction'])} predictions to {args.output}")
    return 0


def report(args) -> int:
    from beam_dp import report_html

    path = report_html.write(args.output)
    print(f"wrote {path}")
    return 0
