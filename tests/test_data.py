"""Reading Parquet/CSV shards into validated Blocks, and the errors bad input gives."""
from __future__ import annotations

import gzip
import os

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from beam_dp import data, losses, synthetic
from beam_dp.block import Block

LOGISTIC = losses.make_loss("logistic")
LINEAR = losses.make_loss("linear")


def _source(seed=0, n=250, d=4):
    return synthetic.make_dataset("binary", n, d, seed)


def _write(path, columns: dict):
    """Writes a table by its extension: .parquet, .csv or .csv.gz (gzip-compressed CSV)."""
    table = pa.table(columns)
    path = str(path)
    if path.endswith(".parquet"):
        pq.write_table(table, path)
    elif path.endswith(".csv.gz"):
        raw = pa.BufferOutputStream()
        pa_csv.write_csv(table, raw)
        with gzip.open(path, "wb") as f:
            f.write(raw.getvalue().to_pybytes())
    else:
        pa_csv.write_csv(table, path)
    return path


def _columns(x, y):
    cols = {f"f{j}": x[:, j] for j in range(x.shape[1])}
    cols["label"] = y
    return cols


def _read_all(files, loss=LINEAR, features=None, batch_rows=data.DEFAULT_BATCH_ROWS):
    features = features or data.resolve_feature_columns(files[0], "label", None)
    blocks = data.load_blocks(files, "label", features, loss, batch_rows)
    return blocks, features


# ---------------------------------------------------------------------------------------------
# Round trips


def _beam_open_file(path):
    from beam_dp.beam.transforms import open_file
    return open_file(path)


@pytest.mark.parametrize("opener", [data.open_input, _beam_open_file], ids=["local", "beam"])
@pytest.mark.parametrize("ext", ["parquet", "csv", "csv.gz"])
def test_blocks_equal_source_arrays(tmp_path, ext, opener):
    """Both runners' file openers (plain files locally, Beam's FileSystems on Beam) read the same."""
    x, y = _source()
    files = [_write(tmp_path / f"part-{i}.{ext}", _columns(x[rows], y[rows]))
             for i, rows in enumerate(np.array_split(np.arange(len(y)), 3))]
    features = data.resolve_feature_columns(files[0], "label", None, opener)
    blocks = [b for f in sorted(files)
              for b in data.blocks_from_file(f, "label", features, LOGISTIC, 32, opener)]

    assert features == ["f0", "f1", "f2", "f3"]
    np.testing.assert_array_equal(np.vstack([b.features for b in blocks]), x)
    # Logistic labels come back encoded as -1/+1.
    np.testing.assert_array_equal(np.concatenate([b.labels for b in blocks]), 2.0 * y - 1.0)
    np.testing.assert_allclose(np.concatenate([b.sq_norms for b in blocks]), (x**2).sum(axis=1))
    # Blocks hold at most batch_rows rows and know where they start in their file.
    assert all(0 < len(b) <= 32 for b in blocks)
    for f in files:
        starts = [b.row_start for b in blocks if b.source == os.path.abspath(f)]
        sizes = [len(b) for b in blocks if b.source == os.path.abspath(f)]
        assert starts == list(np.cumsum([0] + sizes[:-1]))


def test_synthetic_write_shards_round_trip(tmp_path):
    x, y = synthetic.make_dataset("regression", 300, 3, seed=4)
    paths = synthetic.write_shards(str(tmp_path), "train", x, y, 4, "csv")
    assert len(paths) == 4
    blocks, _ = _read_all(data.list_files(str(tmp_path / "train-*")))
    np.testing.assert_allclose(np.vstack([b.features for b in blocks]), x, rtol=1e-15)
    np.testing.assert_allclose(np.concatenate([b.labels for b in blocks]), y, rtol=1e-15)


def test_default_features_are_numeric_columns_but_the_label(tmp_path):
    x, y = _source(n=20, d=2)
    path = _write(tmp_path / "a.parquet", {
        "id_text": [f"row{i}" for i in range(20)],
        "a": x[:, 0],
        "label": y,
        "count": np.arange(20, dtype=np.int32),
        "flag": np.arange(20) % 2 == 0,   # boolean: not numeric
        "b": x[:, 1].astype(np.float32),
    })
    assert data.resolve_feature_columns(path, "label", None) == ["a", "count", "b"]
    # An explicit list is kept in the order given.
    assert data.resolve_feature_columns(path, "label", ["b", "a"]) == ["b", "a"]
    (block,) = data.blocks_from_file(path, "label", ["b", "a"], LOGISTIC)
    np.testing.assert_array_equal(block.features[:, 1], x[:, 0])


def test_csv_cells_parsed_as_pyarrow_parses_numbers(tmp_path):
    """CSV cells are read as text and parsed by us: blanks around a number, signs, exponents and
    quotes are accepted as pyarrow's CSV number parser accepts them; empty and NA cells are
    missing values, reported by row."""
    path = str(tmp_path / "a.csv")
    with open(path, "w") as f:
        f.write('a,label\n 1.5 ,0\n+2,1\n"3e2",0\n\t-.5\t,1\n007,0\n')
    (block,) = data.blocks_from_file(path, "label", ["a"], LINEAR)
    np.testing.assert_array_equal(block.features[:, 0], [1.5, 2.0, 300.0, -0.5, 7.0])
    for missing in ["", "NA", "NaN", "null"]:
        with open(path, "w") as f:
            f.write(f"a,label\n1,0\n{missing},1\n")
        message = _error(data.blocks_from_file, path, "label", ["a"], LINEAR)
        assert message == f"{path}, row 2: feature 'a' is missing or not finite"


def test_features_only_for_prediction(tmp_path):
    x, _ = _source(n=30, d=3)
    path = _write(tmp_path / "p.parquet", {f"f{j}": x[:, j] for j in range(3)})
    (block,) = data.blocks_from_file(path, None, ["f0", "f1", "f2"], LOGISTIC)
    np.testing.assert_array_equal(block.features, x)


def test_list_files_sorted_absolute_and_comma_separated(tmp_path):
    for name in ["b.parquet", "a.parquet", "c.csv"]:
        _write(tmp_path / name, {"f": [1.0], "label": [0]})
    got = data.list_files(f"{tmp_path}/*.parquet,{tmp_path}/c.csv,{tmp_path}/a.parquet")
    assert got == [str(tmp_path / n) for n in ["a.parquet", "b.parquet", "c.csv"]]


def test_block_key_differs_across_files_and_row_start():
    f = np.zeros((2, 1))
    keys = {Block(f, np.zeros(2), source, start).key
            for source in ["/d/a.parquet", "/d/b.parquet"] for start in [0, 2, 65536]}
    assert len(keys) == 6
    assert all(0 <= k < 2**63 for k in keys)
    # The key is a function of the position only, not of the content.
    assert Block(f, np.zeros(2), "/d/a.parquet", 2).key == \
        Block(np.ones((2, 1)), np.ones(2), "/d/a.parquet", 2).key


# ---------------------------------------------------------------------------------------------
# Errors: DataError, one line naming the file and (where it applies) the 1-based data row


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(data.DataError) as info:
        result = fn(*args, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
    message = info.value.detail
    assert "\n" not in message
    assert str(info.value) == data.DataError.MARKER + message
    return message


def _good_columns(n=10):
    x, y = _source(n=n, d=2)
    return _columns(x, y)


@pytest.mark.parametrize("ext", ["parquet", "csv"])
def test_missing_label_column(tmp_path, ext):
    path = _write(tmp_path / f"a.{ext}", _good_columns())
    message = _error(data.resolve_feature_columns, path, "target", None)
    assert path in message and "'target'" in message


@pytest.mark.parametrize("ext", ["parquet", "csv"])
def test_missing_feature_column(tmp_path, ext):
    path = _write(tmp_path / f"a.{ext}", _good_columns())
    message = _error(data.resolve_feature_columns, path, "label", ["f0", "nope"])
    assert path in message and "nope" in message
    # The same when a later file lacks a column the first one had.
    message = _error(data.blocks_from_file, path, "label", ["f0", "nope"], LOGISTIC)
    assert path in message and "nope" in message


def test_non_numeric_parquet_column_requested(tmp_path):
    """A Parquet column declared as text is not a default feature; listing it is an error naming
    the column and its declared type (and never a value)."""
    cols = _good_columns()
    cols["city"] = ["Xanadu"] * 10
    path = _write(tmp_path / "a.parquet", cols)
    assert data.resolve_feature_columns(path, "label", None) == ["f0", "f1"]
    message = _error(data.resolve_feature_columns, path, "label", ["f0", "city"])
    assert path in message and "'city'" in message and "not numeric" in message
    assert "string" in message and "Xanadu" not in message
    message = _error(data.blocks_from_file, path, "label", ["f0", "city"], LOGISTIC)
    assert path in message and "'city'" in message and "Xanadu" not in message


def test_text_csv_column_is_a_feature_and_stops_the_read(tmp_path):
    """CSV columns are numbers by declaration: a column of text is still a default feature (the
    feature set comes from the header), and reading it stops at its first cell."""
    cols = _good_columns()
    cols["city"] = ["Xanadu"] * 10
    path = _write(tmp_path / "a.csv", cols)
    assert data.resolve_feature_columns(path, "label", None) == ["f0", "f1", "city"]
    message = _error(data.blocks_from_file, path, "label", ["f0", "city"], LOGISTIC)
    assert message == f"{path}, row 1: column 'city' is not a number"


@pytest.mark.parametrize("ext", ["parquet", "csv", "csv.gz"])
@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("batch_rows", [4, 65536])
def test_non_finite_feature_reports_row(tmp_path, ext, bad_value, batch_rows):
    cols = _good_columns(n=12)
    cols["f1"] = cols["f1"].copy()
    cols["f1"][9] = bad_value                      # 0-based 9: data row 10
    path = _write(tmp_path / f"a.{ext}", cols)
    message = _error(data.blocks_from_file, path, "label", ["f0", "f1"], LOGISTIC, batch_rows)
    assert message.startswith(f"{path}, row 10: ")
    assert "'f1'" in message


@pytest.mark.parametrize("ext", ["parquet", "csv"])
@pytest.mark.parametrize("column", ["f0", "label"])
def test_null_value_reports_row(tmp_path, ext, column):
    cols = _good_columns(n=8)
    values = cols[column].tolist()
    values[5] = None                                 # data row 6
    cols[column] = pa.array(values, type=pa.float64() if column == "f0" else pa.int64())
    path = _write(tmp_path / f"a.{ext}", cols)
    message = _error(data.blocks_from_file, path, "label", ["f0", "f1"], LOGISTIC)
    assert message.startswith(f"{path}, row 6: ")


@pytest.mark.parametrize("ext", ["parquet", "csv"])
@pytest.mark.parametrize("model,label,num_classes", [
    ("logistic", 2, None), ("logistic", 0.5, None), ("softmax", 3, 3), ("softmax", -1, 3)])
def test_bad_label_reports_row(tmp_path, ext, model, label, num_classes):
    cols = _good_columns(n=20)
    y = cols["label"].astype(float)
    y[13] = label                                    # data row 14
    cols["label"] = y
    path = _write(tmp_path / f"a.{ext}", cols)
    loss = losses.make_loss(model, num_classes)
    message = _error(data.blocks_from_file, path, "label", ["f0", "f1"], loss, 8)
    assert message.startswith(f"{path}, row 14: ")
    assert "label" in message


@pytest.mark.parametrize("name", ["garbage.parquet", "garbage.csv.gz"])
def test_unreadable_file(tmp_path, name):
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(os.urandom(64) + b"\x00\xff not a real file")
    message = _error(data.resolve_feature_columns, path, "label", None)
    assert message.startswith(f"{path}: ")
    message = _error(data.blocks_from_file, path, "label", ["f0"], LOGISTIC)
    assert message.startswith(f"{path}: ")


def test_unknown_extension(tmp_path):
    path = str(tmp_path / "a.json")
    with open(path, "w") as f:
        f.write("{}")
    assert path in _error(data.resolve_feature_columns, path, "label", None)


def test_empty_glob(tmp_path):
    pattern = str(tmp_path / "nothing-*.parquet")
    message = _error(data.list_files, pattern)
    assert pattern in message


def test_input_without_rows(tmp_path):
    path = _write(tmp_path / "empty.csv", {"f0": pa.array([], pa.float64()),
                                           "label": pa.array([], pa.int64())})
    message = _error(data.load_blocks, [path], "label", ["f0"], LOGISTIC)
    assert path in message


@pytest.mark.parametrize("text_first", [True, False], ids=["text-first", "number-first"])
def test_shards_that_disagree_on_a_column_type_stop_the_run_naming_them(tmp_path, cli, text_first):
    """One shard declares 'x2' a string, the other a double: whichever sorts first, the run stops
    naming both files and the column (it used to drop 'x2' from the features when the text shard
    came first), and no value of the column is shown."""
    rng = np.random.default_rng(0)
    n = 200
    columns = {"x1": rng.normal(size=n), "label": (rng.random(n) < 0.5).astype(float)}
    text = pa.table({**columns, "x2": pa.array([f"v{i}" for i in range(n)])})
    number = pa.table({**columns, "x2": rng.normal(size=n)})
    first, second = (text, number) if text_first else (number, text)
    pq.write_table(first, tmp_path / "part-0.parquet")
    pq.write_table(second, tmp_path / "part-1.parquet")
    r = cli("train", "--input", tmp_path / "part-*.parquet", "--output", tmp_path / "out",
            "--epsilon", 1, "--algorithm", "dpgd", "--steps", 2, "--runner", "local")
    assert r.code == 2, r
    (line,) = r.err.strip().splitlines()
    assert "part-0.parquet" in line and "part-1.parquet" in line and "x2" in line, line
    assert "v1" not in line
    assert not os.path.exists(tmp_path / "out")


def test_a_parquet_file_with_a_repeated_column_name_is_a_one_line_error(tmp_path, cli):
    rng = np.random.default_rng(0)
    table = pa.Table.from_arrays([pa.array(rng.normal(size=50)), pa.array(rng.normal(size=50)),
                                  pa.array((rng.random(50) < 0.5).astype(float))],
                                 names=["x", "x", "label"])
    pq.write_table(table, tmp_path / "dup.parquet")
    r = cli("train", "--input", tmp_path / "dup.parquet", "--output", tmp_path / "out",
            "--epsilon", 1, "--algorithm", "dpgd", "--steps", 2, "--runner", "local")
    assert r.code == 2, r
    (line,) = r.err.strip().splitlines()
    assert "more than one column named 'x'" in line, line
