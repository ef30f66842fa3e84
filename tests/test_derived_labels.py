"""Binary labels derived in the schema (``label_positive``, issue 34): "rating >= 4" or a set of
positive values, applied by train and predict alike, with the errors a user meets."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

import beam_dp
from beam_dp import categorical, data


def _table(tmp_path, suffix="csv", rating=None):
    rng = np.random.default_rng(0)
    n = 600
    x = rng.normal(size=n)
    if rating is None:
        rating = np.clip(np.round(3 + 1.5 * x + rng.normal(size=n)) / 2 * 2, 1, 5) / 1.0
    path = str(tmp_path / f"r.{suffix}")
    data.write_table(path, {"x0": x, "rating": rating})
    return path, x, rating


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_at_least_trains_the_model_a_0_1_label_column_trains(tmp_path, suffix):
    """The same seed, the label derived by the schema or written as a 0/1 column: the same
    model, to the bit; predict names the derived classes."""
    path, x, rating = _table(tmp_path, suffix)
    derived = beam_dp.train(input=path, schema={"label": "rating",
                                                "label_positive": {"at_least": 4}},
                            epsilon=1.0, seed=3, runner="local", num_examples=600)
    plain = str(tmp_path / f"plain.{suffix}")
    data.write_table(plain, {"x0": x, "like": (rating >= 4).astype(float)})
    expected = beam_dp.train(input=plain, label_column="like", epsilon=1.0, seed=3,
                             runner="local", num_examples=600)
    np.testing.assert_array_equal(derived.theta, expected.theta)
    assert set(derived.predict(np.array([[-3.0], [3.0]]))) == {"below 4", "at least 4"}
    spec = derived.artifact["encoding"]
    assert spec["label_positive"] == {"at_least": 4.0} and "label_classes" not in spec


def test_one_of_and_the_model_file_round_trip(tmp_path, cli):
    path = str(tmp_path / "t.csv")
    rng = np.random.default_rng(1)
    grade = rng.choice(["A", "B", "C", "D"], 500)
    data.write_table(path, {"x0": (grade <= "B") + rng.normal(size=500) * 0.3, "grade": grade})
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"label": "grade", "label_positive": {"one_of": ["A", "B"]}}))
    r = cli("train", "--input", path, "--schema", schema, "--output", tmp_path / "out",
            "--epsilon", 2, "--runner", "local", "--seed", 1)
    assert r.code == 0, r.err
    r = cli("predict", "--model", tmp_path / "out", "--input", path, "--output",
            tmp_path / "p.csv")
    assert r.code == 0, r.err
    predictions = (tmp_path / "p.csv").read_text().splitlines()[1:]
    labels = {line.split(",")[0].strip('"') for line in predictions}
    assert labels <= {"listed", "not listed"} and len(labels) == 2


def test_a_value_that_is_not_a_number_is_named_by_row_never_shown(tmp_path):
    path = str(tmp_path / "bad.csv")
    for bad in ("secret", "1e400", "inf"):   # (1e400 parses to inf: finite is asked for)
        data.write_table(path, {"x0": np.arange(4.0), "rating": np.array(["4", "2.5", bad, "5"])})
        with pytest.raises(data.DataError, match=r"row 3.*'rating'.*not a finite number") as e:
            beam_dp.train(input=path, schema={"label": "rating",
                                              "label_positive": {"at_least": 4}},
                          epsilon=1.0, runner="local", num_examples=4)
        assert bad not in str(e.value)


def test_rules_are_checked_and_exclusive():
    for bad in ({"at_least": "4"}, {"at_least": float("nan")}, {"one_of": []},
                {"one_of": ["a", "a"]}, {"above": 4}, {"at_least": 4, "one_of": ["5"]}):
        with pytest.raises(categorical.EncodingError, match="label_positive"):
            categorical.label_rule_of(bad)
    with pytest.raises(categorical.EncodingError, match="leave label_classes"):
        categorical.make_encoding(["x0"], [], label_classes=["a", "b"],
                                  label_positive={"at_least": 1})
    rule = categorical.label_rule_of({"at_least": 4})
    ids, unknown = categorical._derived_label(rule, pa.array([3.5, None, 4.0, 7.0, np.nan]))
    np.testing.assert_array_equal(ids, [0.0, np.nan, 1.0, 1.0, np.nan])
    assert unknown is None
    assert categorical._derived_label(rule, pa.array([5.0, -np.inf]))[1] == 1   # not bounded
