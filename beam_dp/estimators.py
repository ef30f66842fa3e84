"""scikit-learn estimators over ``beam_dp.train`` (in-memory data, trained in-process).

    from beam_dp.estimators import DPLogisticRegression
    clf = DPLogisticRegression(epsilon=1.0, classes=[0, 1]).fit(X, y)
    clf.predict(X_test); clf.predict_proba(X_test); clf.privacy_report_["epsilon"]

The constructor stores parameters only; ``fit`` returns self; learned state ends in ``_``
(``coef_``, ``intercept_``, ``classes_``, ``model_``, ``privacy_report_``), so the estimators work
in ``Pipeline``s, ``ColumnTransformer``s and ``clone``. Algorithm options go in
``algorithm_options`` (a dict, e.g. ``{"clip_norm": 0.5}``): their names and defaults are those of
``beam-dp algorithms``. ``algorithm="auto"`` lets ``beam_dp.algorithms.choice`` pick (dpgd for
in-memory sizes; ``privacy_report_["algorithm_choice"]`` says what and why).

Class labels are public information in this design: pass ``classes``. Without it they are read
from ``y`` (as scikit-learn does), which reveals which labels occur; a ``PrivacyLeakWarning`` says
so (diffprivlib's convention), and ``privacy_report_["classes"]`` records it
(``covered``: False). ``random_state`` fixes the seed, for tests only: without it all
randomness comes from the OS's secure source. ``tune``: True, or a dict of ``beam_dp.tune``'s
keywords (``{"grid": {"clip_norm": (0.3, 1, 3)}, "mean_candidates": 10}``), selects the
algorithm's hyperparameters privately, inside ``epsilon`` (docs/guide/tuning.md, "Private hyperparameter
selection"); ``algorithm_options`` are then the fixed ones, and ``tuning_`` says what was
chosen. Preprocessing inside a ``Pipeline`` (a scaler, say)
is fitted on the data without privacy; use public bounds there or account for it separately.
``cross_val_score``, ``GridSearchCV`` and the like fit the estimator many times on the same
rows: each fit spends its ``epsilon``, and picking the best by their (non-private) scores is
not a private selection. Use ``tune=`` for a selection inside ``epsilon``.

``schema`` (``beam_dp.schema``: a dict or a JSON file): ``X`` is then a raw pandas DataFrame,
read as ``beam_dp.train(frame, schema=...)`` reads it (categorical text columns, missing cells
by their declared policies, the encoding recorded in the model and applied again by predict);
``y`` is added as the schema's label column. The classes stay the estimator's (``classes``):
the schema declares no ``label_classes``.
"""
from __future__ import annotations

import numbers
import warnings

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils import check_random_state
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted
from sklearn.utils.validation import validate_data as _sklearn_validate_data

from beam_dp import api, frames
from beam_dp import schema as schema_mod


# What a classifier fitted without classes= records in its privacy report.
CLASSES_NOT_COVERED = ("the class set was read from y: which labels occur is not covered by the "
                       "privacy guarantee (pass classes=[...] to keep it public)")


class PrivacyLeakWarning(api.PrivacyWarning):
    """A parameter that should be public was taken from the data."""


def validate_data(*args, **kwargs):
    """scikit-learn's input validation, whose conversion error quotes the offending cell
    ("could not convert string to float: '...'"): replaced by one that names no value."""
    try:
        return _sklearn_validate_data(*args, **kwargs)
    except ValueError as e:
        if "could not convert" in str(e) or "invalid literal" in str(e):
            raise ValueError("X (or y) holds a value that is not a number; encode text columns "
                             "first (e.g. with a OneHotEncoder)") from None
        raise


def _seed(random_state) -> int | None:
    """None (secure randomness), or a fixed seed from an int or a RandomState (tests only)."""
    if random_state is None:
        return None
    if isinstance(random_state, numbers.Integral):
        return int(random_state)
    return int(check_random_state(random_state).randint(0, 2 ** 31 - 1))


class _DPEstimator(BaseEstimator):
    _model: str = ""            # the loss, for regressors

    def __init__(self, epsilon=1.0, delta=1e-5, algorithm="dpgd", algorithm_options=None,
                 accountant="pld", num_examples=None, count_epsilon=None, fit_intercept=True,
                 random_state=None, tune=None, schema=None):
        self.epsilon = epsilon
        self.delta = delta
        self.algorithm = algorithm
        self.algorithm_options = algorithm_options
        self.accountant = accountant
        self.num_examples = num_examples
        self.count_epsilon = count_epsilon
        self.fit_intercept = fit_intercept
        self.random_state = random_state
        self.tune = tune
        self.schema = schema

    def _loss_options(self) -> dict:
        """The loss's own keywords (DPHuberRegressor's huber_delta), only where given."""
        return {}

    def _validated(self, X, y=None, reset=True, **checks):
        """scikit-learn's validation (``validate_data``); with a ``schema``, of the shape and
        column names only, X kept a raw DataFrame for ``beam_dp.train`` to read as a table."""
        if self.schema is None:
            return validate_data(self, X, y, **checks) if reset else validate_data(self, X, reset=False)
        if not frames.is_frame(X):
            raise ValueError("with a schema, X is a pandas DataFrame (its columns by name)")
        raw = dict(dtype=None, ensure_all_finite=False)   # text and missing cells are the table's
        if not reset:
            validate_data(self, X, reset=False, **raw)
            return X
        declared = (schema_mod.read(self.schema) if isinstance(self.schema, str)
                    else schema_mod.from_dict(self.schema))
        if "label_classes" in declared or "positive_class" in declared:
            raise ValueError("an estimator's classes are its own (classes=): leave label_classes "
                             "and positive_class out of its schema")
        _, y = validate_data(self, X, y, **raw, **checks)
        return X, y

    def _table(self) -> dict:
        return {} if self.schema is None else {"schema": self.schema}

    def _train(self, X, labels, model: str, num_classes=None):
        if self.tune:
            return self._tuned(X, labels, model, num_classes)
        self.model_ = api.train(
            X, labels, algorithm=self.algorithm, model=model, epsilon=self.epsilon,
            delta=self.delta, accountant=self.accountant, num_examples=self.num_examples,
            count_epsilon=self.count_epsilon, num_classes=num_classes,
            fit_intercept=self.fit_intercept, seed=_seed(self.random_state), **self._table(),
            **self._loss_options(), **(self.algorithm_options or {}))
        self.coef_ = np.atleast_2d(self.model_.coefficients)
        self.intercept_ = np.atleast_1d(self.model_.intercept)
        self.privacy_report_ = self.model_.privacy_report
        return self

    def _tuned(self, X, labels, model: str, num_classes=None):
        """``beam_dp.tune`` in place of ``train`` (its own accountant, RDP, and its own count:
        ``accountant`` and ``num_examples`` are not used and ``num_examples`` is refused)."""
        from beam_dp import tuning
        if self.num_examples is not None:
            raise ValueError("tune counts the rows it trains and scores on: drop num_examples")
        keywords = {} if self.tune is True else dict(self.tune)
        self.model_ = tuning.tune(
            X, labels, algorithm=self.algorithm, model=model, epsilon=self.epsilon,
            delta=self.delta, count_epsilon=self.count_epsilon, num_classes=num_classes,
            fit_intercept=self.fit_intercept, seed=_seed(self.random_state),
            **keywords, **self._table(), **self._loss_options(), **(self.algorithm_options or {}))
        self.coef_ = np.atleast_2d(self.model_.coefficients)
        self.intercept_ = np.atleast_1d(self.model_.intercept)
        self.privacy_report_ = self.model_.privacy_report
        self.tuning_ = self.model_.tuning
        return self

    def _scores(self, X):
        check_is_fitted(self)
        return self.model_.decision_function(self._validated(X, reset=False))


class _DPClassifier(ClassifierMixin, _DPEstimator):
    _binary_model = "logistic"

    def __init__(self, epsilon=1.0, delta=1e-5, algorithm="dpgd", algorithm_options=None,
                 accountant="pld", num_examples=None, count_epsilon=None, fit_intercept=True,
                 random_state=None, classes=None, tune=None, schema=None):
        super().__init__(epsilon, delta, algorithm, algorithm_options, accountant, num_examples,
                         count_epsilon, fit_intercept, random_state, tune, schema)
        self.classes = classes

    def fit(self, X, y):
        X, y = self._validated(X, y)
        # A continuous target is refused as scikit-learn's classifiers refuse it ("Unknown label
        # type"), rather than being read as one class per distinct value.
        check_classification_targets(y)
        if self.classes is None:
            warnings.warn("classes were read from the training labels, which reveals which "
                          "labels occur; pass classes=[...] to keep them public",
                          PrivacyLeakWarning, stacklevel=2)
            classes = np.unique(y)
        else:
            classes = np.unique(np.asarray(self.classes))   # sorted, as scikit-learn keeps them
        if len(classes) < 2:
            raise ValueError(f"a classifier needs at least 2 classes; got {len(classes)} class(es)")
        index = np.clip(np.searchsorted(classes, y), 0, len(classes) - 1)
        if not np.array_equal(classes[index], y):
            raise ValueError("y has a label that is not in classes")
        self.classes_ = classes
        if len(classes) != 2 and self._binary_model != "logistic":
            raise ValueError(f"Only binary classification is supported by {type(self).__name__}; "
                             f"use DPLogisticRegression for {len(classes)} classes")
        if len(classes) == 2:
            self._train(X, index, self._binary_model)
        else:
            self._train(X, index, "softmax", num_classes=len(classes))
        # Kept in the report (what outlives the fit), not only warned: which labels occur is
        # read from the data, outside the guarantee, and one relabelled row can change the
        # class set and with it the coefficients' shape.
        self.privacy_report_["classes"] = (
            {"source": "classes= (public)", "covered": True} if self.classes is not None else
            {"source": "read from the training labels (classes=None)", "covered": False,
             "note": CLASSES_NOT_COVERED})
        return self

    def decision_function(self, X):
        return self._scores(X)

    def predict(self, X):
        check_is_fitted(self)
        return self.classes_[self.model_.predict(self._validated(X, reset=False))]


class DPLogisticRegression(_DPClassifier):
    """Logistic regression (softmax for more than 2 classes) with differential privacy."""

    def predict_proba(self, X):
        check_is_fitted(self)
        return self.model_.predict_proba(self._validated(X, reset=False))

    def predict_log_proba(self, X):
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X))


class DPLinearSVC(_DPClassifier):
    """A binary linear SVM (hinge loss) with differential privacy."""

    _binary_model = "hinge"

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False   # binary only (fit refuses 3+ classes)
        return tags


class _DPRegressor(RegressorMixin, _DPEstimator):
    def fit(self, X, y):
        X, y = self._validated(X, y, y_numeric=True)
        return self._train(X, y, self._model)

    def predict(self, X):
        return self._scores(X)


class DPLinearRegression(_DPRegressor):
    """Least-squares regression with differential privacy (default algorithm dpgd; ``ssp`` is
    the one-pass alternative for few features: see docs/guide/algorithms.md). Its defaults suit
    standardized features and targets: scale the target too (e.g. a TransformedTargetRegressor
    with public bounds), since clipping bounds each example's influence."""

    _model = "linear"


class DPHuberRegressor(_DPRegressor):
    """Huber regression (robust to outlying targets) with differential privacy. ``huber_delta``:
    the loss's threshold between squared and absolute error (``beam-dp train --huber-delta``;
    None: its default 1). (scikit-learn's HuberRegressor calls it ``epsilon``, which here is
    the privacy budget.)"""

    _model = "huber"

    def __init__(self, epsilon=1.0, delta=1e-5, algorithm="dpgd", algorithm_options=None,
                 accountant="pld", num_examples=None, count_epsilon=None, fit_intercept=True,
                 random_state=None, tune=None, huber_delta=None, schema=None):
        super().__init__(epsilon=epsilon, delta=delta, algorithm=algorithm,
                         algorithm_options=algorithm_options, accountant=accountant,
                         num_examples=num_examples, count_epsilon=count_epsilon,
                         fit_intercept=fit_intercept, random_state=random_state, tune=tune,
                         schema=schema)
        self.huber_delta = huber_delta

    def _loss_options(self) -> dict:
        return {} if self.huber_delta is None else {"huber_delta": self.huber_delta}
