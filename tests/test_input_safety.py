"""Bad input never changes the schema silently and never shows up in an error message.

The CSV feature set comes from the header names only, never from the cells; a cell that is not a
number, a ragged row or a bad label stops the job with one line naming the file, the 1-based data
row (header excluded) and the column, and with no part of the offending value. The same holds for
errors raised inside Beam workers and shown by ``beam-dp``, and for everything Beam prints on the
way (its log of the worker's traceback included).
"""
from __future__ import annotations

import gzip
import os
import subprocess
import sys
import traceback

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from beam_dp import data, losses

BEAM_DP = os.path.join(os.path.dirname(sys.executable), "beam-dp")
# A short DP-SGD run: the input error happens while the first pipeline reads the files.
FAST = ["--algorithm", "dpsgd", "--noise-multiplier", "1.2", "--steps", "2",
        "--batch-size", "50", "--seed", "1"]
SECRET = "SECRETVALUE987"
LOGISTIC = losses.make_loss("logistic")


def _csv_text(n: int = 40, seed: int = 0, cells: dict | None = None, extra_rows: dict | None = None,
              header=("a", "b", "c", "label")) -> str:
    """A numeric CSV; ``cells`` maps (0-based data row, column name) to the raw text of a cell,
    ``extra_rows`` maps a 0-based data row to the raw text of the whole line."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(header) - 1))
    lines = [",".join(header)]
    for i in range(n):
        fields = [repr(float(v)) for v in x[i]] + [str(int(x[i, 0] > 0))]
        for (row, column), text in (cells or {}).items():
            if row == i:
                fields[header.index(column)] = text
        lines.append((extra_rows or {}).get(i, ",".join(fields)))
    return "\n".join(lines) + "\n"


def _write(path, text: str) -> str:
    path = str(path)
    if path.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
    return path


def _data_error(fn, *args) -> data.DataError:
    with pytest.raises(data.DataError) as info:
        result = fn(*args)
        if hasattr(result, "__next__"):
            list(result)
    error = info.value
    assert "\n" not in error.detail
    return error


def _assert_value_free(error: BaseException, *fragments: str) -> None:
    """Neither the message nor any exception chained to it (cause or context), nor the printed
    traceback, holds any of the fragments."""
    printed = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    seen = error
    while seen is not None:
        for fragment in fragments:
            assert fragment not in str(seen), (fragment, str(seen))
        seen = seen.__cause__ or seen.__context__
    for fragment in fragments:
        assert fragment not in printed, printed


# ------------------------------------------------------------------- the CSV feature set


def test_default_csv_features_are_the_header_minus_the_label(tmp_path):
    """A column whose cells are mostly text is still a feature by default: the feature set does
    not depend on what the cells hold (it would, if types were inferred from them)."""
    numeric = _write(tmp_path / "numeric.csv", _csv_text())
    one_bad = _write(tmp_path / "one_bad.csv", _csv_text(cells={(3, "b"): SECRET}))
    all_text = _write(tmp_path / "all_text.csv",
                      _csv_text(cells={(i, "b"): "text" for i in range(40)}))
    empty_column = _write(tmp_path / "empty_column.csv",
                          _csv_text(cells={(i, "c"): "" for i in range(40)}))
    header_only = _write(tmp_path / "header_only.csv", "a,b,c,label\n")
    for path in [numeric, one_bad, all_text, empty_column, header_only]:
        assert data.resolve_feature_columns(path, "label", None) == ["a", "b", "c"], path
    # The label's position in the header does not matter; it is the only column left out.
    reordered = _write(tmp_path / "reordered.csv",
                       _csv_text(header=("label", "a", "b", "c"), cells={(0, "a"): "text"}))
    assert data.resolve_feature_columns(reordered, "label", None) == ["a", "b", "c"]


# ------------------------------------------------------------------ bad cells, data level


@pytest.mark.parametrize("value", [SECRET, "0.73125xyz", "1,5"])
@pytest.mark.parametrize("ext", ["csv", "csv.gz"])
@pytest.mark.parametrize("batch_rows", [7, 65536])
def test_unparsable_csv_cell_names_file_row_and_column_only(tmp_path, value, ext, batch_rows):
    quoted = f'"{value}"' if "," in value else value
    path = _write(tmp_path / f"a.{ext}", _csv_text(cells={(22, "b"): quoted}))   # data row 23
    features = data.resolve_feature_columns(path, "label", None)
    error = _data_error(data.load_blocks, [path], "label", features, LOGISTIC, batch_rows)
    assert error.detail == f"{path}, row 23: column 'b' is not a number"
    _assert_value_free(error, value, "SECRET", "73125", "xyz", "1,5")


def test_unparsable_cell_far_into_a_big_csv(tmp_path):
    """Past the first MiB (where pyarrow's type inference looks) and in a later reader block."""
    n = 60000
    path = _write(tmp_path / "big.csv", _csv_text(n=n, cells={(n - 5, "c"): SECRET}))
    assert os.path.getsize(path) > 2 << 20
    error = _data_error(data.load_blocks, [path], "label", ["a", "b", "c"], LOGISTIC, 4096)
    assert error.detail == f"{path}, row {n - 4}: column 'c' is not a number"
    _assert_value_free(error, SECRET, "SECRET")


def test_unparsable_label_cell(tmp_path):
    path = _write(tmp_path / "a.csv", _csv_text(cells={(8, "label"): "0.73125xyz"}))
    error = _data_error(data.load_blocks, [path], "label", ["a", "b", "c"], LOGISTIC)
    assert error.detail == f"{path}, row 9: column 'label' is not a number"
    _assert_value_free(error, "73125", "xyz")


@pytest.mark.parametrize("line", [f"1.0,2.0,{SECRET},0,9", f"1.0,{SECRET}", f'1.0,"{SECRET},2.0,0'])
def test_ragged_csv_row_names_file_and_row(tmp_path, line):
    path = _write(tmp_path / "a.csv", _csv_text(extra_rows={30: line}))        # data row 31
    error = _data_error(data.load_blocks, [path], "label", ["a", "b", "c"], LOGISTIC, 8)
    assert error.detail.startswith(f"{path}, row 31: ")
    _assert_value_free(error, SECRET, "SECRET")


def test_parquet_integers_beyond_2_to_the_53_are_read_not_quoted(tmp_path):
    """A safe int64 -> float64 cast refuses such integers with an error quoting the value; they
    are numbers, read with float64 rounding."""
    big = 2**53 + 1
    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"a": pa.array([1, big, 3], pa.int64()),
                             "label": pa.array([0, 1, 0], pa.int64())}), path)
    (block,) = data.blocks_from_file(path, "label", ["a"], LOGISTIC)
    np.testing.assert_array_equal(block.features[:, 0], [1.0, float(big), 3.0])


# ------------------------------------------------------------------------------ bad labels


@pytest.mark.parametrize("model,num_classes,label,fragments", [
    ("logistic", None, "0.73125", ["73125"]),
    ("hinge", None, "0.73125", ["73125"]),
    ("softmax", 3, "7", ["7"]),
    ("softmax", 3, "-2", ["-2"]),
    ("logistic", None, "NaN", ["nan", "NaN"]),
    ("linear", None, "inf", ["inf)", "'inf", " inf"]),
])
@pytest.mark.parametrize("ext", ["csv", "parquet"])
def test_bad_label_names_file_and_row_only(tmp_path, model, num_classes, label, fragments, ext):
    text = _csv_text(n=30, cells={(12, "label"): label})                       # data row 13
    path = _write(tmp_path / "a.csv", text)
    if ext == "parquet":
        table = pa_csv.read_csv(path)
        path = str(tmp_path / "a.parquet")
        pq.write_table(table, path)
    error = _data_error(data.load_blocks, [path], "label", ["a", "b", "c"],
                        losses.make_loss(model, num_classes), 8)
    assert error.detail.startswith(f"{path}, row 13: ")
    assert "label" in error.detail
    # The path (a pytest temporary directory) may hold any digit: look at the rest only.
    rest = error.detail[len(path):]
    for fragment in fragments:
        assert fragment not in rest, rest


@pytest.mark.parametrize("loss,labels", [
    (losses.make_loss("logistic"), [0.0, 1.0, 0.73125]),
    (losses.make_loss("softmax", 3), [0.0, 7.0]),
    (losses.make_loss("linear"), [0.0, float("nan")]),
])
def test_label_error_messages_hold_no_value(loss, labels):
    with pytest.raises(losses.LabelError) as info:
        loss.encode_labels(np.array(labels))
    assert info.value.row == len(labels) - 1
    for fragment in ["73125", "7", "nan"]:
        assert fragment not in str(info.value).lower()


# ------------------------------------------------------------------- through beam-dp on Beam


def _beam_train(tmp_path, files: dict) -> subprocess.CompletedProcess:
    directory = tmp_path / "data"
    directory.mkdir()
    for name, text in files.items():
        _write(directory / name, text)
    return subprocess.run(
        [BEAM_DP, "train", "--input", str(directory / "*.csv"), "--output", str(tmp_path / "out"),
         "--runner", "FnApiRunner", *FAST],
        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["first_file", "second_file"])
def test_bad_cell_on_beam_prints_our_line_and_no_value(tmp_path, where):
    """First file: the column must stay a feature (no silent drop), so the worker stops. Second
    file: the worker's error must not carry pyarrow's text (which quotes the cell)."""
    bad = _csv_text(n=150, seed=2, cells={(76, "b"): SECRET})                 # data row 77
    good = _csv_text(n=150, seed=1)
    files = {"p1.csv": bad, "p2.csv": good} if where == "first_file" else \
        {"p1.csv": good, "p2.csv": bad}
    r = _beam_train(tmp_path, files)
    bad_path = str(tmp_path / "data" / ("p1.csv" if where == "first_file" else "p2.csv"))
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("beam-dp: error:")]
    assert lines == [f"beam-dp: error: {bad_path}, row 77: column 'b' is not a number"], r.stderr
    for fragment in [SECRET, "SECRET", "VALUE987"]:
        assert fragment not in r.stderr and fragment not in r.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bad_label_on_beam_prints_file_and_row_only(tmp_path):
    r = _beam_train(tmp_path, {"p1.csv": _csv_text(n=150, seed=1),
                               "p2.csv": _csv_text(n=150, seed=2, cells={(40, "label"): "0.73125"})})
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("beam-dp: error:")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"beam-dp: error: {tmp_path / 'data' / 'p2.csv'}, row 41: "), r.stderr
    assert "73125" not in r.stderr and "73125" not in r.stdout


@pytest.mark.slow
def test_ragged_row_on_beam_prints_file_and_row(tmp_path):
    r = _beam_train(tmp_path, {"p1.csv": _csv_text(n=150, seed=1),
                               "p2.csv": _csv_text(n=150, seed=2,
                                                   extra_rows={99: f"1.0,{SECRET},2.0,0,5"})})
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("beam-dp: error:")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"beam-dp: error: {tmp_path / 'data' / 'p2.csv'}, row 100: "), r.stderr
    assert "SECRET" not in r.stderr and "SECRET" not in r.stdout
