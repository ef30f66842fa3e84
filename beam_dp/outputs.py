"""A training run's output directory: its files written all at once (``report.atomic_directory``)
with report.html made from the JSON files alone, and the validation metrics (not private)."""
from __future__ import annotations

import json
import os

from beam_dp import data, report, report_html

METRICS_NOTE = "computed on the validation data without noise; not differentially private"


def write_outputs(output: str, overwrite: bool, files: dict) -> list[str]:
    """Writes ``files`` (file name -> text) as the directory ``output``; a training run's (with
    model.json and privacy_report.json) also gets report.html unless it is among ``files``.
    Returns the warnings to show (report.html could not be made: the model is written all the
    same)."""
    files, warnings = with_report_html(files)
    with report.atomic_directory(output, overwrite) as out:
        report.write_texts(out, files)
    return warnings


def with_report_html(files: dict) -> tuple[dict, list[str]]:
    """``files`` with report.html made from them, for a training run's (model.json and
    privacy_report.json) that has none yet; and the warnings to show."""
    if report_html.REPORT_HTML in files or not all(
            name in files for name in ("model.json", "privacy_report.json")):
        return files, []
    html, warning = _report_html(files)
    return {**files, **html}, [warning] if warning else []


def _report_html(files: dict) -> tuple[dict, str | None]:
    """({"report.html": text}, None) from the output's JSON texts; ({}, a warning) if it cannot
    be made (`beam-dp report OUT` makes it later). The warning names the error's type only: its
    text is not ours."""
    try:
        metrics = json.loads(files["metrics.json"]) if "metrics.json" in files else None
        text = report_html.build(json.loads(files["model.json"]),
                                 json.loads(files["privacy_report.json"]), metrics)
    except Exception as e:  # noqa: BLE001 - the report must not cost the run its model
        return {}, (f"report.html not written ({type(e).__name__}); run `beam-dp report OUT` on "
                    "the output directory to make it")
    return {report_html.REPORT_HTML: text}, None


def validation_metrics(model, validation_files, runner: str | None, batch_rows: int) -> dict:
    """Validation metrics of ``model`` (a ``beam_dp.Model``): computed without noise, so outside
    the guarantee (and said so in the file); never kept in the budget ledger."""
    if runner == "local":
        open_file = data.open_input
    else:
        from beam_dp.beam.transforms import open_file   # (Beam's file systems: gs://, s3://)
    blocks = (model.feature_map(b) for f in validation_files for b in data.blocks_from_file(
        f, model.artifact["label_column"], model.feature_columns, model.loss, batch_rows,
        open_file, model.encoding))
    metrics = report.evaluate(model.loss, model.theta, blocks)
    metrics["covered_by_privacy_guarantee"] = False
    metrics["note"] = METRICS_NOTE
    return metrics
