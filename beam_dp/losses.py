"""GLM losses: value and derivative with respect to the score, label encoding, prediction.

A model's parameters are a matrix ``theta`` of shape (k, d + 1): one row per output (k = 1 for
binary and regression models, k = K classes for softmax), the last column is the intercept.
Scores are ``X @ theta[:, :d].T + theta[:, d]`` with shape (m, k). Every loss here is a function
of the score only, so the per-example gradient is ``derivative(score) (outer) (x, 1)`` and its
norm is ``||derivative|| * ||(x, 1)||``: that is what makes clipping a per-row scale on a block.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.special import expit, log_expit, logsumexp, softmax


class LabelError(ValueError):
    """A label that the model cannot use; ``row`` is the index in the block. The message says
    what was expected and never quotes the label."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


class GlmLoss:
    """Interface: ``encode_labels`` maps raw labels to the loss's encoding, ``value`` and
    ``derivative`` take scores of shape (m, k)."""

    name: str
    is_classifier: bool
    # Upper bound on ||d loss / d score||_2 per example (the Lipschitz constant in the score),
    # None where the loss is not Lipschitz (squared loss).
    score_lipschitz: float | None

    def outputs(self) -> int:
        return 1

    def encode_labels(self, labels: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def value(self, scores: np.ndarray, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def derivative(self, scores: np.ndarray, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def predict(self, scores: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def _check_finite_labels(labels: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(labels))
    if bad.size:
        # Errors never quote the value: messages reach logs and terminals outside the trust boundary.
        raise LabelError("label is missing or not finite", int(bad[0]))


class _SignedBinaryLoss(GlmLoss):
    """Binary margin losses; labels 0/1 or -1/+1, encoded as -1/+1."""

    is_classifier = True
    score_lipschitz = 1.0

    def encode_labels(self, labels):
        labels = np.asarray(labels, dtype=np.float64)
        _check_finite_labels(labels)
        bad = np.flatnonzero((labels != 0) & (labels != 1) & (labels != -1))
        if bad.size:
            raise LabelError(f"label does not fit model '{self.name}' (expected 0/1 or -1/+1)",
                             int(bad[0]))
        return np.where(labels > 0, 1.0, -1.0)

    def predict(self, scores):
        return (scores[:, 0] > 0).astype(np.int64)


class LogisticLoss(_SignedBinaryLoss):
    name = "logistic"

    def value(self, scores, y):
        return -log_expit(y * scores[:, 0])

    def derivative(self, scores, y):
        # d/ds log(1 + exp(-y s)) = -y * sigmoid(-y s)
        return (-y * expit(-y * scores[:, 0]))[:, None]


class HingeLoss(_SignedBinaryLoss):
    name = "hinge"

    def value(self, scores, y):
        return np.maximum(0.0, 1.0 - y * scores[:, 0])

    def derivative(self, scores, y):
        # Subgradient 0 at the kink (margin exactly 1), as in the papers' proofs.
        return np.where(y * scores[:, 0] < 1.0, -y, 0.0)[:, None]


class SquaredLoss(GlmLoss):
    """Linear regression: 0.5 * (s - y)^2. Not Lipschitz: clipping bounds the gradient."""

    name = "linear"
    is_classifier = False
    score_lipschitz = None

    def encode_labels(self, labels):
        labels = np.asarray(labels, dtype=np.float64)
        _check_finite_labels(labels)
        return labels

    def value(self, scores, y):
        with _extremes_ok():  # a residual beyond ~1e154 squares to inf: the loss is inf
            return 0.5 * (scores[:, 0] - y) ** 2

    def derivative(self, scores, y):
        # An infinite score (or s - y beyond the float range) gives +-inf: the clipping treats it
        # as a clipped gradient along its sign (beam_dp.clipping).
        with _extremes_ok():
            return (scores[:, 0] - y)[:, None]

    def predict(self, scores):
        return scores[:, 0]


class HuberLoss(SquaredLoss):
    """Huber regression loss with threshold ``delta``: quadratic inside, linear outside."""

    name = "huber"

    def __init__(self, delta: float = 1.0):
        if not delta > 0:
            raise ValueError("huber delta must be positive")
        self.delta = float(delta)
        self.score_lipschitz = self.delta

    def value(self, scores, y):
        with _extremes_ok():
            r = np.abs(scores[:, 0] - y)
            return np.where(r <= self.delta, 0.5 * r**2, self.delta * (r - 0.5 * self.delta))

    def derivative(self, scores, y):
        with _extremes_ok():
            return np.clip(scores[:, 0] - y, -self.delta, self.delta)[:, None]


class SoftmaxLoss(GlmLoss):
    """Multinomial cross-entropy over ``num_classes`` integer classes 0..K-1 (K is public)."""

    name = "softmax"
    is_classifier = True
    # ||softmax(s) - e_y||_2 <= sqrt(2)
    score_lipschitz = float(np.sqrt(2.0))

    def __init__(self, num_classes: int):
        if num_classes < 2:
            raise ValueError("softmax needs --num-classes of at least 2")
        self.num_classes = int(num_classes)

    def outputs(self):
        return self.num_classes

    def encode_labels(self, labels):
        labels = np.asarray(labels, dtype=np.float64)
        _check_finite_labels(labels)
        bad = np.flatnonzero((labels != np.round(labels)) | (labels < 0) | (labels >= self.num_classes))
        if bad.size:
            raise LabelError(
                f"label does not fit model 'softmax' (expected an integer class in "
                f"0..{self.num_classes - 1})", int(bad[0]))
        return labels.astype(np.int64)

    def value(self, scores, y):
        finite = np.isfinite(scores).all(axis=1)
        if finite.all():
            with _extremes_ok():  # exp of very negative scores underflows to 0, as it should
                return logsumexp(scores, axis=1) - scores[np.arange(len(y)), y]
        # Infinite scores (a huge feature value): logsumexp - s_y can be inf - inf. The loss is
        # -log p_y with p the softmax's limit (``_softmax``).
        out = np.empty(len(y))
        out[finite] = self.value(scores[finite], y[finite])
        with _extremes_ok():
            out[~finite] = -np.log(_softmax(scores[~finite])[np.arange(int((~finite).sum())), y[~finite]])
        return out

    def derivative(self, scores, y):
        p = _softmax(scores)
        p[np.arange(len(y)), y] -= 1.0
        return p

    def predict(self, scores):
        return np.argmax(scores, axis=1)


def _extremes_ok():
    """Over/underflow and inf - inf are expected where a finite but huge value meets a loss, and
    handled by the clipping; a warning printed only when such a row exists would reveal it."""
    return np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore")


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Row-wise softmax, also for rows whose largest score is +inf or -inf (a huge feature value;
    scipy's softmax gives NaN there, inf - inf): uniform over the entries equal to that largest
    score, the limit when it is a single +inf entry, and in any case a probability vector, so the
    derivative stays bounded by sqrt(2)."""
    biggest = np.max(scores, axis=1, keepdims=True)
    rows = np.isinf(biggest[:, 0])
    with _extremes_ok():  # exp of very negative scores underflows to 0, as it should
        if not rows.any():
            return softmax(scores, axis=1)
        p = np.empty(scores.shape)
        p[~rows] = softmax(scores[~rows], axis=1)
    top = scores[rows] == biggest[rows]
    p[rows] = top / top.sum(axis=1, keepdims=True)
    return p


MODEL_NAMES = ("logistic", "softmax", "linear", "huber", "hinge")


DEFAULT_HUBER_DELTA = 1.0


def make_loss(model: str, num_classes: int | None = None,
              huber_delta: float | None = None) -> GlmLoss:
    """``huber_delta``: --model huber's threshold (None: DEFAULT_HUBER_DELTA)."""
    if model == "logistic":
        return LogisticLoss()
    if model == "hinge":
        return HingeLoss()
    if model == "linear":
        return SquaredLoss()
    if model == "huber":
        return HuberLoss(DEFAULT_HUBER_DELTA if huber_delta is None else huber_delta)
    if model == "softmax":
        if num_classes is None:
            raise ValueError("--model softmax needs --num-classes (the class count is public)")
        return SoftmaxLoss(num_classes)
    raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODEL_NAMES)}")


def scores(theta: np.ndarray, features: np.ndarray) -> np.ndarray:
    """(m, k) scores of a (k, d + 1) parameter matrix whose last column is the intercept.

    Never NaN for finite theta and features, and silent: where the product overflows (a feature
    near 1e300, say) the score is +-inf with the right sign, not the inf - inf = NaN that a plain
    product can give when two huge terms have opposite signs.
    """
    if sp.issparse(features):
        u, e = split_sparse_rows(features)
        with _extremes_ok():
            return np.ldexp(np.asarray(u @ theta[:, :-1].T), e[:, None]) + theta[:, -1]
    with _extremes_ok():
        out = features @ theta[:, :-1].T + theta[:, -1]
        bad = ~np.isfinite(out).all(axis=1)
        if bad.any():
            # Rescore those rows from x = u * 2^e (exact, |u| <= 1): u . w is finite, and
            # 2^e (u . w) overflows to a signed infinity, never to NaN.
            x = features[bad]
            biggest = np.max(np.abs(x), axis=1, initial=0.0)
            e = np.frexp(np.where(np.isfinite(biggest), biggest, 1.0))[1]
            u = np.ldexp(x, -e[:, None])
            out[bad] = np.ldexp(u @ theta[:, :-1].T, e[:, None]) + theta[:, -1]
    return out


def split_sparse_rows(x, floor: float = 0.0):
    """A CSR matrix's rows written exactly as ``u * 2^e``: ``u`` (CSR, same pattern) with
    entries in [-1, 1], ``e`` (m,) ints, so that no product of ``u`` overflows or loses a row to
    underflow, whatever the values. ``floor``: the scale never goes below it (an intercept's 1
    keeps 2^e >= 1, so its own entry ``2^-e`` stays <= 1 too)."""
    x = sp.csr_matrix(x)
    counts = np.diff(x.indptr)
    top = np.full(x.shape[0], float(floor))
    nonempty = counts > 0
    if nonempty.any():
        top[nonempty] = np.maximum(top[nonempty],
                                   np.maximum.reduceat(np.abs(x.data), x.indptr[:-1][nonempty]))
    # 2^e >= top: frexp gives top = f 2^e with f in [0.5, 1); an empty row gets e = 0.
    e = np.frexp(np.where(top > 0, top, 1.0))[1].astype(np.int64)
    e[top == 0] = 0
    with _extremes_ok():   # a subnormal entry of a large row underflows to 0: expected, silent
        data = np.ldexp(x.data, -np.repeat(e, counts))
    u = sp.csr_matrix((data, x.indices, x.indptr), shape=x.shape)
    return u, e
