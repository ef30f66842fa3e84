"""The Python API (issue 9, item 2): ``beam_dp.train`` over arrays or files returns a ``Model``
with predict / predict_proba / decision_function / score / save / load / privacy_report /
feature_map; bad input gives clear errors without data values; the same configuration and seed
gives the same model through the CLI, ``beam_dp.train(input=...)``, ``beam_dp.train(X, y)`` and
the estimator.

Runs that are not about calibration use a public ``num_examples`` and few steps, so that each
takes well under a second.
"""
from __future__ import annotations

import pickle
import re
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy.special import expit

import beam_dp
from beam_dp import data, synthetic
from beam_dp.algorithms import registry, spec
from beam_dp.block import Block
from conftest import model_theta, read_json

N, D = 2000, 5
FAST = {"noise_multiplier": 2.0, "steps": 20, "num_examples": N, "seed": 4}
SECRET = 8765.4321   # planted in rows next to the bad cell: no message may contain it


@pytest.fixture(scope="module")
def binary():
    return synthetic.make_dataset("binary", N, D, seed=31)


@pytest.fixture(scope="module")
def regression():
    return synthetic.make_dataset("regression", N, D, seed=32)


@pytest.fixture(scope="module")
def fitted(binary):
    x, y = binary
    return beam_dp.train(x, y, algorithm="dpgd", **FAST)


def _no_secret(message: str) -> None:
    assert "8765" not in message and "4321" not in message, message


# ------------------------------------------------------------------------------ arrays -> Model


def test_arrays_in_model_out(fitted, binary):
    x, _ = binary
    assert isinstance(fitted, beam_dp.Model)
    assert fitted.coefficients.shape == (D,) and isinstance(fitted.intercept, float)
    assert fitted.feature_columns == [f"x{j}" for j in range(D)]
    assert fitted.privacy_report["epsilon"] == fitted.epsilon > 0
    assert fitted.privacy_report["steps"] == 20
    assert fitted.artifact["algorithm"] == "dpgd" and fitted.artifact["model"] == "logistic"
    assert "dpgd" in repr(fitted) and "epsilon=" in repr(fitted)
    # the feature map of a run without one is the identity
    block = Block(x[:5].copy(), np.zeros(5))
    np.testing.assert_array_equal(fitted.feature_map(block).features, x[:5])


def test_epsilon_target_is_met(binary):
    x, y = binary
    model = beam_dp.train(x, y, algorithm="dpgd", epsilon=0.5, num_examples=N, steps=10, seed=1)
    assert 0.45 < model.epsilon <= 0.5 + 1e-6
    assert model.privacy_report["requested_epsilon"] == 0.5


def test_predict_shapes_and_ranges(fitted, binary):
    x, y = binary
    prediction = fitted.predict(x)
    assert prediction.shape == (N,) and set(np.unique(prediction)) <= {0, 1}
    p = fitted.predict_proba(x)
    assert p.shape == (N, 2) and np.all((p >= 0) & (p <= 1))
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    s = fitted.decision_function(x)
    assert s.shape == (N,)
    np.testing.assert_allclose(p[:, 1], expit(x @ fitted.coefficients + fitted.intercept), rtol=1e-12)
    np.testing.assert_array_equal(prediction, (s > 0).astype(int))
    np.testing.assert_array_equal(prediction, np.argmax(p, axis=1))


def test_softmax_shapes():
    x, y = synthetic.make_dataset("multiclass", N, D, seed=33, num_classes=3)
    model = beam_dp.train(x, y, model="softmax", num_classes=3, algorithm="dpgd", **FAST)
    assert model.coefficients.shape == (3, D) and model.intercept.shape == (3,)
    p = model.predict_proba(x)
    assert p.shape == (N, 3)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    np.testing.assert_array_equal(model.predict(x), np.argmax(p, axis=1))
    assert model.decision_function(x).shape == (N, 3)
    assert model.score(x, y) == pytest.approx(np.mean(model.predict(x) == y))


def test_score_is_accuracy_for_classifiers_and_r2_for_regression(fitted, binary, regression):
    from sklearn.metrics import r2_score

    x, y = binary
    assert fitted.score(x, y) == pytest.approx(np.mean(fitted.predict(x) == y))
    assert fitted.score(x, 2 * y - 1) == fitted.score(x, y)   # -1/+1 labels alike
    assert fitted.score(x, y) > 0.75
    xr, yr = regression
    model = beam_dp.train(xr, yr, model="linear", algorithm="ssp", epsilon=1.0, num_examples=N, seed=2)
    assert model.score(xr, yr) == pytest.approx(r2_score(yr, model.predict(xr)), rel=1e-12)
    assert model.score(xr, yr) > 0.5
    with pytest.raises(ValueError, match="no class probabilities"):
        model.predict_proba(xr)


def test_save_load_round_trip(tmp_path, binary):
    x, y = binary
    # dpsgd-f practical records a feature map: the round trip must keep it.
    model = beam_dp.train(x, y, algorithm="dpsgd-f", noise_multiplier=2.0, preprocess_epsilon=0.1,
                          num_examples=N, seed=3, steps=5)
    assert model.artifact["feature_transform"] == {"normalize_rows": 1.0}
    model.save(str(tmp_path / "m"))
    for path in (tmp_path / "m", tmp_path / "m" / "model.json"):
        loaded = beam_dp.Model.load(str(path))
        np.testing.assert_array_equal(loaded.predict(x), model.predict(x))
        np.testing.assert_array_equal(loaded.predict_proba(x), model.predict_proba(x))
        assert loaded.artifact == model.artifact
        assert loaded.privacy_report == read_json(tmp_path / "m" / "privacy_report.json")
        assert loaded.epsilon == model.epsilon
    with pytest.raises(FileExistsError):
        model.save(str(tmp_path / "m"))
    model.save(str(tmp_path / "m"), overwrite=True)
    # and pickling (joblib, multiprocessing) keeps it too
    again = pickle.loads(pickle.dumps(model))
    np.testing.assert_array_equal(again.predict_proba(x), model.predict_proba(x))


def test_dataframe_columns_by_name(binary):
    x, y = binary
    frame = pd.DataFrame(x, columns=[f"c{j}" for j in range(D)])
    model = beam_dp.train(frame, y, algorithm="dpgd", **FAST)
    assert model.feature_columns == list(frame.columns)
    shuffled = frame[list(reversed(frame.columns))].assign(extra=1.0)
    np.testing.assert_array_equal(model.predict(shuffled), model.predict(frame))


# --------------------------------------------------------------------------------- bad input


def _with_nan(x, row, column):
    bad = x.copy()
    bad[row, column] = np.nan
    bad[row, (column + 1) % bad.shape[1]] = SECRET
    return bad


def test_nan_in_x_names_row_and_column_only(binary):
    x, y = binary
    with pytest.raises(data.DataError) as e:
        beam_dp.train(_with_nan(x, 7, 3), y, algorithm="dpgd", **FAST)
    message = str(e.value)
    assert "row 8" in message and "x3" in message
    _no_secret(message)
    frame = pd.DataFrame(_with_nan(x, 7, 3), columns=[f"c{j}" for j in range(D)])
    with pytest.raises(data.DataError) as e:
        beam_dp.train(frame, y, algorithm="dpgd", **FAST)
    assert "row 8" in str(e.value)
    _no_secret(str(e.value))


def test_nan_at_predict_names_row_and_column_only(fitted, binary):
    x, _ = binary
    with pytest.raises(data.DataError) as e:
        fitted.predict(_with_nan(x[:20], 11, 0))
    assert "row 12" in str(e.value) and "x0" in str(e.value)
    _no_secret(str(e.value))


@pytest.mark.parametrize("kind", ["strings", "object_frame"])
def test_non_numeric_x_is_refused(binary, kind):
    x, y = binary
    if kind == "strings":
        bad = x.astype(str)
        bad[0, 0] = str(SECRET)
    else:
        bad = pd.DataFrame(x, columns=[f"c{j}" for j in range(D)]).astype({"c2": object})
        bad.loc[0, "c2"] = str(SECRET)
    with pytest.raises(ValueError, match="numbers") as e:
        beam_dp.train(bad, y, algorithm="dpgd", **FAST)
    _no_secret(str(e.value))


def test_non_numeric_labels_and_bad_labels(binary):
    x, y = binary
    with pytest.raises(ValueError, match="labels must be numbers"):
        beam_dp.train(x, np.where(y > 0, "yes", "no"), algorithm="dpgd", **FAST)
    bad = y.astype(float)
    bad[9] = 0.73125
    with pytest.raises(data.DataError) as e:
        beam_dp.train(x, bad, algorithm="dpgd", **FAST)
    assert "row 10" in str(e.value) and "0.73" not in str(e.value)
    with pytest.raises(ValueError, match="rows"):
        beam_dp.train(x, y[:-1], algorithm="dpgd", **FAST)


def test_wrong_number_of_columns_at_predict(fitted, binary):
    x, _ = binary
    with pytest.raises(ValueError, match=f"{D - 1} columns.*{D} features"):
        fitted.predict(x[:, :-1])
    with pytest.raises(ValueError, match="2-dimensional"):
        fitted.predict(x[0])


def test_unknown_option_is_a_type_error_listing_the_valid_ones(binary):
    x, y = binary
    with pytest.raises(TypeError) as e:
        beam_dp.train(x, y, algorithm="dpgd", clip_nrom=0.5, **FAST)
    message = str(e.value)
    assert "clip_nrom" in message
    for name in beam_dp.api.options_of("dpgd"):
        assert name in message
    with pytest.raises(TypeError, match="batch_size"):   # an option of dpsgd, not of dpgd
        beam_dp.train(x, y, algorithm="dpgd", batch_size=10, **FAST)


@pytest.mark.parametrize("budget", [{}, {"epsilon": 1.0, "noise_multiplier": 1.0}])
def test_exactly_one_of_epsilon_and_noise_multiplier(binary, budget):
    x, y = binary
    with pytest.raises(ValueError, match="exactly one of epsilon or noise_multiplier"):
        beam_dp.train(x, y, algorithm="dpgd", num_examples=N, **budget)


@pytest.mark.parametrize("kwargs,match", [
    ({"delta": 1.0}, "delta"), ({"epsilon": -1.0}, "epsilon"), ({"epsilon": float("nan")}, "epsilon"),
    ({"algorithm": "bogus"}, "unknown algorithm"), ({"model": "bogus"}, "model"),
    ({"algorithm": "ssp", "model": "logistic"}, "ssp"), ({"clip_norm": -1.0}, "clip-norm"),
    ({"steps": float("inf")}, "steps"), ({"steps": float("nan")}, "steps"), ({"steps": 2.5}, "steps"),
    ({"num_examples": 1.5}, "num_examples"), ({"num_examples": None, "count_epsilon": 1.0}, "count_epsilon"),
])
def test_bad_configuration_is_a_clear_value_error(binary, kwargs, match):
    x, y = binary
    config = {"algorithm": "dpgd", "epsilon": 1.0, "num_examples": N, **kwargs}
    with pytest.raises(ValueError, match=match):
        beam_dp.train(x, y, **config)


def test_numpy_scalars_are_accepted_as_options(binary, tmp_path):
    """A GridSearchCV grid from np.arange / np.linspace holds numpy scalars; they work and reach
    the JSON artifacts as plain numbers."""
    x, y = binary
    model = beam_dp.train(x, y, algorithm="dpgd", noise_multiplier=2.0, num_examples=np.int64(N),
                          steps=np.int64(3), clip_norm=np.float32(0.5), average_iterates=np.bool_(False),
                          seed=1)
    assert model.privacy_report["steps"] == 3 and model.privacy_report["clip_norm"] == 0.5
    model.save(str(tmp_path / "m"))
    assert read_json(tmp_path / "m" / "privacy_report.json")["hyperparameters"]["values"]["steps"] == 3


@pytest.mark.parametrize("given", [[], ""])
def test_no_input_files_is_a_data_error(given):
    with pytest.raises(data.DataError, match="no input files"):
        beam_dp.train(input=given, algorithm="dpgd", **FAST)


def test_arrays_and_input_are_exclusive(binary, tmp_path):
    x, y = binary
    with pytest.raises(ValueError, match="either"):
        beam_dp.train(x, y, input=str(tmp_path / "*.parquet"), algorithm="dpgd", **FAST)
    with pytest.raises(ValueError, match="either"):
        beam_dp.train(algorithm="dpgd", **FAST)
    with pytest.raises(ValueError, match="in-process"):
        beam_dp.train(x, y, runner="FnApiRunner", algorithm="dpgd", **FAST)


def test_delta_not_small_against_1_over_n_warns(binary):
    x, y = binary
    with pytest.warns(beam_dp.PrivacyWarning, match="1/n"):
        model = beam_dp.train(x, y, algorithm="dpgd", noise_multiplier=2.0, steps=3,
                              num_examples=N, delta=1.0 / N, seed=1)
    assert len(model.privacy_report["warnings"]) == 1 and "delta" in model.privacy_report["warnings"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", beam_dp.PrivacyWarning)
        model = beam_dp.train(x, y, algorithm="dpgd", noise_multiplier=2.0, steps=3,
                              num_examples=N, delta=0.1 / N, seed=1)
    assert "warnings" not in model.privacy_report


# --------------------------------------------------- the same model through every entry point


@pytest.fixture(scope="module")
def files(tmp_path_factory, binary, regression):
    directory = tmp_path_factory.mktemp("api-files")
    return {
        "binary": synthetic.write_shards(str(directory / "b"), "train", *binary, 3),
        "binary_glob": str(directory / "b" / "train-*.parquet"),
        "regression": synthetic.write_shards(str(directory / "r"), "train", *regression, 2),
        "regression_glob": str(directory / "r" / "train-*.parquet"),
    }


CONFIGS = {
    # full-batch dpgd and one-pass ssp: neither result depends on how the rows are cut into
    # blocks, so files and arrays must agree (up to the order of floating-point sums).
    "dpgd-logistic": ("binary", {"algorithm": "dpgd", "model": "logistic", "epsilon": 1.0,
                                 "steps": 30, "clip_norm": 0.5}),
    "ssp-linear": ("regression", {"algorithm": "ssp", "model": "linear", "epsilon": 1.0,
                                  "label_bound": 5.0}),
}


def _flags(config: dict) -> list[str]:
    return [token for key, value in config.items() for token in (spec.flag(key), str(value))]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_model_through_cli_api_arrays_and_estimator(tmp_path, cli, files, binary, regression, name):
    from beam_dp.estimators import DPLinearRegression, DPLogisticRegression

    task, config = CONFIGS[name]
    x, y = binary if task == "binary" else regression
    seed = 17
    r = cli("train", "--input", files[f"{task}_glob"], "--output", tmp_path / "cli", "--runner", "local",
            "--num-examples", N, "--seed", seed, *_flags(config))
    assert r.code == 0, r
    reference = model_theta(tmp_path / "cli")
    reference_report = read_json(tmp_path / "cli" / "privacy_report.json")

    def same(theta):
        np.testing.assert_allclose(theta, reference, rtol=1e-9, atol=1e-12)

    from_glob = beam_dp.train(input=files[f"{task}_glob"], runner="local", num_examples=N,
                              seed=seed, **config)
    same(np.append(from_glob.coefficients, from_glob.intercept))
    assert from_glob.epsilon == reference_report["epsilon"]
    from_list = beam_dp.train(input=list(reversed(files[task])), num_examples=N, seed=seed,
                              runner="local", **config)
    same(np.append(from_list.coefficients, from_list.intercept))
    from_arrays = beam_dp.train(x, y, num_examples=N, seed=seed, **config)
    same(np.append(from_arrays.coefficients, from_arrays.intercept))
    assert from_arrays.epsilon == reference_report["epsilon"]

    options = {k: v for k, v in config.items() if k not in ("algorithm", "model", "epsilon")}
    if task == "binary":
        estimator = DPLogisticRegression(algorithm=config["algorithm"], epsilon=config["epsilon"],
                                         random_state=seed, classes=[0, 1], num_examples=N,
                                         algorithm_options=options)
    else:
        estimator = DPLinearRegression(algorithm=config["algorithm"], epsilon=config["epsilon"],
                                       random_state=seed, num_examples=N, algorithm_options=options)
    estimator.fit(x, y)
    same(np.append(estimator.coef_.ravel(), estimator.intercept_))
    assert estimator.privacy_report_["epsilon"] == reference_report["epsilon"]


@pytest.mark.slow
def test_files_on_beam_match_arrays(files, binary):
    """train(input=..., runner=Beam's in-process runner) equals train(X, y) for dpgd."""
    x, y = binary
    config = {"algorithm": "dpgd", "noise_multiplier": 2.0, "steps": 4, "num_examples": N, "seed": 8}
    beam = beam_dp.train(input=files["binary_glob"], steps_per_job=2, **config)
    arrays = beam_dp.train(x, y, **config)
    np.testing.assert_allclose(beam.theta, arrays.theta, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------- 7. the recorded map, through the API


def _by_hand(model: beam_dp.Model, x: np.ndarray) -> np.ndarray:
    recorded = model.artifact.get("feature_transform") or {}
    norms = np.sqrt(np.sum(x ** 2, axis=1))
    safe = np.where(norms > 0, norms, 1.0)
    if "normalize_rows" in recorded:
        x = x * np.where(norms > 0, recorded["normalize_rows"] / safe, 1.0)[:, None]
    elif "clip_rows" in recorded:
        x = x * np.where(norms > 0, np.minimum(1.0, recorded["clip_rows"] / safe), 1.0)[:, None]
    else:
        assert not recorded
    return x @ np.asarray(model.artifact["coefficients"]) + model.artifact["intercept"]


# Few steps: the map does not depend on them (the CLI test runs every algorithm's defaults).
API_SKEW = [
    ("dpsgd", {"feature_norm": 2.0, "steps": 5}, {"normalize_rows": 2.0}),
    ("dpsgd-f", {"steps": 5}, {"normalize_rows": 1.0}),
    ("dpsgd-f", {"variant": "theory", "steps": 5}, "clip_rows"),
    ("dpgd", {}, None),
]


@pytest.mark.parametrize("algorithm,options,expected", API_SKEW,
                         ids=["dpsgd-feature-norm", "dpsgd-f", "dpsgd-f-theory", "dpgd"])
def test_model_predict_applies_the_recorded_map(binary, algorithm, options, expected):
    x, y = binary
    model = beam_dp.train(x, y, algorithm=algorithm, epsilon=1.0, seed=6, **options)
    recorded = model.artifact.get("feature_transform")
    if expected is None:
        assert not recorded
    elif isinstance(expected, str):
        assert list(recorded) == [expected] and recorded[expected] > 0
    else:
        assert recorded == expected
    g = np.random.default_rng(5)
    serve = g.standard_normal((200, D)) * np.exp(g.uniform(-3, 3, size=(200, 1)))
    serve[0] = 0.0
    scores = _by_hand(model, serve)
    np.testing.assert_allclose(model.decision_function(serve), scores, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(model.predict_proba(serve)[:, 1], expit(scores), rtol=1e-9, atol=1e-12)
    confident = np.abs(scores) > 1e-9
    np.testing.assert_array_equal(model.predict(serve)[confident], (scores[confident] > 0).astype(int))


def test_options_of_lists_declared_defaults():
    for name, algorithm in registry.algorithms().items():
        options = beam_dp.api.options_of(name)
        assert options == {f.name: f.default for f, _ in spec.fields(algorithm.options)}
        assert all(re.fullmatch(r"[a-z_]+", k) for k in options)


# ------------------------------------------ a raw DataFrame read as a table (issue 29, item 2)

FRAME_SCHEMA = {"label": "default", "label_classes": ["No", "Yes"], "categorical": ["student"],
                "hash_buckets": 8, "missing": {"income": "indicator"}}
FRAME_FAST = {"algorithm": "dpgd", "noise_multiplier": 2.0, "steps": 20, "num_examples": 600,
              "seed": 4}


@pytest.fixture(scope="module")
def raw_frame():
    """Text labels, a text categorical column and missing cells (NaN and None), as a raw table
    holds them; the label follows the columns so that a model has something to learn."""
    g = np.random.default_rng(41)
    n = 600
    balance = g.normal(0.0, 1.0, n)
    income = g.normal(0.0, 1.0, n)
    student = g.choice(np.array(["yes", "no"], dtype=object), n)
    score = 2.0 * balance - income + np.where(student == "yes", 1.0, -1.0)
    default = np.where(score + g.logistic(size=n) > 0, "Yes", "No").astype(object)
    income[g.random(n) < 0.1] = np.nan
    student[g.random(n) < 0.05] = None
    return pd.DataFrame({"balance": balance, "income": income, "student": student,
                         "default": default})


def test_raw_dataframe_trains_and_predicts(raw_frame):
    model = beam_dp.train(raw_frame, schema=FRAME_SCHEMA, **FRAME_FAST)
    encoding = model.artifact["encoding"]
    assert encoding["categorical_columns"] == ["student"]
    assert encoding["numeric_columns"] == ["balance", "income"]
    assert encoding["label_classes"] == ["No", "Yes"] and encoding["indicator_columns"] == ["income_missing"]
    prediction = model.predict(raw_frame.drop(columns="default"))
    assert set(prediction) <= {"No", "Yes"}
    assert model.score(raw_frame.drop(columns="default"), raw_frame["default"]) > 0.7
    # the labels apart, as y: the same model
    apart = beam_dp.train(raw_frame.drop(columns="default"), raw_frame["default"],
                          schema=FRAME_SCHEMA, **FRAME_FAST)
    np.testing.assert_array_equal(apart.theta, model.theta)


def test_raw_dataframe_equals_the_same_rows_as_csv(raw_frame, tmp_path):
    path = tmp_path / "table.csv"
    raw_frame.to_csv(path, index=False)
    from_csv = beam_dp.train(input=str(path), runner="local", schema=FRAME_SCHEMA, **FRAME_FAST)
    from_frame = beam_dp.train(raw_frame, schema=FRAME_SCHEMA, **FRAME_FAST)
    np.testing.assert_array_equal(from_frame.theta, from_csv.theta)
    assert from_frame.artifact == from_csv.artifact
    assert from_frame.epsilon == from_csv.epsilon
    assert from_frame.privacy_report["dp_event"] == from_csv.privacy_report["dp_event"]


def test_raw_dataframe_errors_name_the_frame_not_a_value(raw_frame):
    with pytest.raises(data.DataError, match="DataFrame: categorical column.*not found: student"):
        beam_dp.train(raw_frame.drop(columns="student"), schema=FRAME_SCHEMA, **FRAME_FAST)
    with pytest.raises(data.DataError, match="DataFrame: label column 'default' not found"):
        beam_dp.train(raw_frame.drop(columns="default"), schema=FRAME_SCHEMA, **FRAME_FAST)
    bad = raw_frame.copy()
    bad.loc[7, "balance"] = np.nan
    bad.loc[7, "income"] = SECRET
    with pytest.raises(data.DataError) as e:
        beam_dp.train(bad, schema=FRAME_SCHEMA, **FRAME_FAST)
    assert str(e.value).endswith("DataFrame, row 8: feature 'balance' is missing or not finite")
    _no_secret(str(e.value))
    with pytest.raises(ValueError, match="in-process"):
        beam_dp.train(raw_frame, schema=FRAME_SCHEMA, runner="FnApiRunner", **FRAME_FAST)


def test_the_size_warnings_call_a_noisy_count_an_estimate():
    """A 25-row table's private count can come out as 1: the warnings say "the noisy estimate
    of n" with its error, never "n ~ 1" as if it were the table's size; a public n is n."""
    from beam_dp.api import _warnings
    report = {"delta": 0.5, "epsilon": 1.0}
    noisy = _warnings(report, {"value": 4, "error_bound_95": 300.0, "source": "private"})
    assert any("noisy estimate of n (4)" in w for w in noisy)
    assert any("the noisy estimate of n, 4 +-300" in w for w in noisy)   # (delta vs 1/n)
    assert not any("n ~" in w for w in noisy)
    public = _warnings(report, {"value": 25, "source": "public (--num-examples)"})
    assert [w for w in public if "delta" in w][0].count("n = 25") == 1
