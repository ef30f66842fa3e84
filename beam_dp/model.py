"""A trained model (``beam_dp.train``'s result, or one loaded from its files): what it is
(coefficients, the recorded feature map and categorical encoding, the privacy report), how it
is applied to raw features (a matrix, a DataFrame or a dict of columns, through the recorded
encoding) and how it is saved and loaded.
"""
from __future__ import annotations

import numpy as np

from beam_dp import data, features, losses, report, storage
from beam_dp.block import Block
from beam_dp.categorical import Encoding


class Model:
    """A trained model: the artifact of model.json and, after training, the privacy report.

    ``predict``/``predict_proba``/``decision_function``/``score`` take a feature matrix (or a
    DataFrame with the feature columns) of raw features: the recorded feature map (e.g. the row
    normalization training used) is applied first, as training applied it.
    """

    def __init__(self, artifact: dict, privacy_report: dict | None = None):
        self.artifact = artifact
        self.privacy_report = privacy_report
        self.loss, self.theta, _ = report.load_model_dict(artifact)

    @property
    def encoding(self) -> Encoding | None:
        """How categorical columns become features (None: dense numeric features only)."""
        spec = self.artifact.get("encoding")
        return Encoding.from_spec(spec) if spec else None

    @property
    def feature_map(self):
        """The recorded raw-feature map (identity when none). Built on access, not stored: the
        identity is a lambda, and a stored lambda made Models (and fitted estimators) unpicklable."""
        return features.from_spec(self.artifact.get("feature_transform"))

    # -- what it is
    @property
    def feature_columns(self) -> list[str]:
        return list(self.artifact["feature_columns"])

    @property
    def coefficients(self) -> np.ndarray:
        return self.theta[:, :-1] if self.loss.outputs() > 1 else self.theta[0, :-1]

    @property
    def intercept(self):
        return self.theta[:, -1] if self.loss.outputs() > 1 else float(self.theta[0, -1])

    @property
    def epsilon(self) -> float | None:
        return None if self.privacy_report is None else self.privacy_report["epsilon"]

    def __repr__(self):
        budget = "" if self.privacy_report is None else (
            f", epsilon={self.privacy_report['epsilon']:.4g}, delta={self.privacy_report['delta']:g}")
        return (f"Model({self.artifact['model']} by {self.artifact['algorithm']}, "
                f"{len(self.feature_columns)} features{budget})")

    # -- applying it
    def block_scores(self, block: Block) -> np.ndarray:
        """(m, k) scores of a block of raw features."""
        return losses.scores(self.theta, self.feature_map(block).features)

    def _features(self, X):
        encoding = self.encoding
        if encoding is not None:
            return encode_columns(X, encoding)
        if hasattr(X, "columns") and set(self.feature_columns) <= {str(c) for c in X.columns}:
            X = X[self.feature_columns]
        elif isinstance(X, dict):   # columns by name, as a model with an encoding takes them
            absent = [c for c in self.feature_columns if c not in X]
            if absent:
                raise ValueError(f"X lacks the model's column(s): {', '.join(absent)}")
            X = np.column_stack([np.asarray(X[c]) for c in self.feature_columns])
        x = data.as_feature_matrix(X)
        if x.shape[1] != len(self.feature_columns):
            raise ValueError(f"X has {x.shape[1]} columns; the model has {len(self.feature_columns)} features")
        data.check_finite(x, "X")
        return x

    def _rows(self, X):
        """(features, rows a declared "drop" policy leaves out, or None)."""
        encoding = self.encoding
        return encode_rows(X, encoding) if encoding is not None else (self._features(X), None)

    def decision_function(self, X) -> np.ndarray:
        """Scores; NaN for a row a declared "drop" policy leaves out."""
        x, dropped = self._rows(X)
        s = self.block_scores(Block(x, np.zeros(x.shape[0])))
        if dropped is not None:
            s[dropped] = np.nan
        return s[:, 0] if s.shape[1] == 1 else s

    def predict(self, X) -> np.ndarray:
        """Predictions: class ids (or the declared class names, ``label_classes``), or values.
        A row that a declared "drop" policy would leave out of training gets None (NaN for a
        regression)."""
        x, dropped = self._rows(X)
        return self.labels_of(self._ids(x), dropped)

    def _ids(self, x) -> np.ndarray:
        """Predicted class ids (or values) of encoded features."""
        return self.loss.predict(self.block_scores(Block(x, np.zeros(x.shape[0]))))

    def labels_of(self, predicted: np.ndarray, dropped: np.ndarray | None = None) -> np.ndarray:
        """Predicted ids as the declared class names (if any); rows in ``dropped`` as None (or
        NaN for numbers)."""
        encoding = self.encoding
        classes = encoding.label_classes if encoding is not None else None
        if classes is not None:
            if len(classes) == 2 and encoding.positive_class is not None:
                negative = [c for c in classes if c != encoding.positive_class][0]
                names = np.array([negative, encoding.positive_class], dtype=object)
            else:
                names = np.array(classes, dtype=object)
            predicted = names[np.asarray(predicted, dtype=np.int64)]
        if dropped is not None and dropped.any():
            predicted = np.array(predicted, dtype=object if classes is not None or
                                 self.loss.is_classifier else np.float64)
            predicted[dropped] = None if predicted.dtype == object else np.nan
        return predicted

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities, (m, 2) for logistic (columns: class 0, class 1) and (m, K) for
        softmax. Hinge and regression models have none."""
        if self.loss.name not in ("logistic", "softmax"):
            raise ValueError(f"a {self.loss.name} model has no class probabilities")
        s = self.decision_function(X)
        if self.loss.name == "logistic":
            p = losses.expit(s)
            return np.column_stack([1.0 - p, p])
        from scipy.special import softmax
        return softmax(s, axis=1)

    def score(self, X, y) -> float:
        """Accuracy for classifiers, R^2 for regression (scikit-learn's conventions)."""
        x, dropped = self._rows(X)
        prediction = self.labels_of(self._ids(x))
        # Rows a declared "drop" policy leaves out are not scored (they have no prediction).
        scored = np.ones(len(prediction), dtype=bool) if dropped is None else ~dropped
        encoding = self.encoding
        if encoding is not None and encoding.label_classes is not None:
            truth = np.asarray(y, dtype=object).reshape(-1).astype(str)
            return float(np.mean(prediction[scored].astype(str) == truth[scored]))
        prediction = prediction[scored].astype(np.float64)
        y = np.asarray(y, dtype=np.float64).reshape(-1)[scored]
        if self.loss.is_classifier:
            truth = (y > 0).astype(np.int64) if self.loss.name in ("logistic", "hinge") else y
            return float(np.mean(prediction == truth))
        residual = float(np.sum((y - prediction) ** 2))
        total = float(np.sum((y - y.mean()) ** 2))
        return 1.0 - residual / total if total > 0 else 0.0

    # -- files
    def save(self, path: str, overwrite: bool = False) -> None:
        """Writes model.json and privacy_report.json into the directory ``path`` atomically."""
        with report.atomic_directory(path, overwrite) as out:
            report.write_json(out, "model.json", self.artifact)
            if self.privacy_report is not None:
                report.write_json(out, "privacy_report.json", self.privacy_report)

    @classmethod
    def load(cls, path: str) -> "Model":
        """From a directory written by ``save`` or ``beam-dp train``, or a model.json file."""
        if report.is_output_directory(path):   # (model and report of one published version)
            found = report.read_outputs(path, ["model.json"], optional=["privacy_report.json"])
            artifact = report.check_model(found["model.json"], storage.join(path, "model.json"))
            return cls(artifact, found.get("privacy_report.json"))
        artifact = report.read_model(path)
        privacy_path = storage.join(storage.parent(storage.normalize(path)), "privacy_report.json")
        privacy = report.read_json(privacy_path) if storage.exists(privacy_path) else None
        return cls(artifact, privacy)


def encode_columns(X, encoding: Encoding):
    """The features of in-memory columns (a DataFrame, or a dict of column -> values) through a
    model's encoding (``encode_rows``, whose flagged rows are left filled with zeros)."""
    return encode_rows(X, encoding)[0]


def encode_rows(X, encoding: Encoding):
    """(features, dropped rows or None) of in-memory columns (a DataFrame, or a dict of column ->
    values) through a model's encoding: its numeric columns as numbers (a missing cell by its
    declared policy, else checked finite), its categorical ones as text. A value the encoding
    has not seen takes its hash bucket or its column's "other" id. The features are CSR with
    categorical columns, else dense; a row a "drop" policy leaves out is filled with zeros and
    flagged in the second value."""
    import pyarrow as pa
    if not encoding.categorical and not hasattr(X, "columns") and not isinstance(X, dict):
        # No categorical columns: a matrix of the numeric columns, in order, will do.
        x = data.as_feature_matrix(X)
        if x.shape[1] != len(encoding.numeric):
            raise ValueError(f"X has {x.shape[1]} columns; the model has {len(encoding.numeric)} "
                             "features")
        X = {name: x[:, j] for j, name in enumerate(encoding.numeric)}
    try:
        table = pa.Table.from_pandas(X, preserve_index=False) if hasattr(X, "columns") else pa.table(X)
    except (TypeError, ValueError, pa.ArrowException):
        raise ValueError("a model with categorical columns predicts from a DataFrame or a dict "
                         "of columns") from None
    absent = [c for c in encoding.columns if c not in table.column_names]
    if absent:
        raise ValueError(f"X lacks the model's column(s): {', '.join(absent)}")
    m = table.num_rows
    numeric = np.empty((m, len(encoding.numeric)))
    for j, name in enumerate(encoding.numeric):
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                or pa.types.is_null(column.type)):
            raise ValueError(f"column '{name}' must hold numbers")
        numeric[:, j] = column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    dense, keep = encoding.fill(numeric)   # the declared missing-value policies
    data.check_finite(dense, "X", 0, encoding.dense_names)
    return (encoding.encode(dense, {c: table.column(c) for c in encoding.categorical}),
            None if keep.all() else ~keep)
