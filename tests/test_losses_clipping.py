"""GLM losses and GLM-identity clipping against brute force.

The brute force is deliberately independent of ``beam_dp.clipping``: every per-example gradient
with respect to the full parameter matrix theta (k, d + 1) is computed by central differences of
``loss.value`` in a per-example loop, the intercept column is dropped when the model has no
intercept, each gradient is clipped to C with ``np.linalg.norm`` and the clipped gradients are
summed.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit

from beam_dp import clipping, losses

D = 5

# (id, model name, loss kwargs, raw labels generator)
MODELS = [
    ("logistic-01", "logistic", {}, lambda g, m: g.integers(0, 2, m).astype(float)),
    ("logistic-pm1", "logistic", {}, lambda g, m: g.choice([-1.0, 1.0], m)),
    ("hinge", "hinge", {}, lambda g, m: g.integers(0, 2, m).astype(float)),
    ("linear", "linear", {}, lambda g, m: 2.0 * g.standard_normal(m)),
    ("huber", "huber", {"huber_delta": 0.7}, lambda g, m: 2.0 * g.standard_normal(m)),
    ("softmax4", "softmax", {"num_classes": 4}, lambda g, m: g.integers(0, 4, m).astype(float)),
]


def _make_loss(name, kwargs):
    return losses.make_loss(name, **kwargs)


def _rows(g: np.random.Generator) -> np.ndarray:
    """Rows of very different norms: zero rows, small (~1e-2), unit and large (~1e2)."""
    return np.vstack([
        np.zeros((3, D)),
        1e-2 * g.standard_normal((8, D)),
        g.standard_normal((12, D)),
        1e2 * g.standard_normal((8, D)),
    ])


def _per_example_gradient(loss, theta, x, y) -> np.ndarray:
    """d loss(theta; x, y) / d theta by central differences, one example, every entry of theta.

    The step is scaled so that the score moves by about 1e-6 whatever the row's norm: the
    truncation error is then O(1e-12) relative, far below the tolerance used below.
    """
    h = 1e-6 / np.sqrt(1.0 + x @ x)
    grad = np.zeros_like(theta)
    for idx in np.ndindex(*theta.shape):
        plus, minus = theta.copy(), theta.copy()
        plus[idx] += h
        minus[idx] -= h
        f_plus = loss.value(losses.scores(plus, x[None, :]), y[None])[0]
        f_minus = loss.value(losses.scores(minus, x[None, :]), y[None])[0]
        grad[idx] = (f_plus - f_minus) / (2 * h)
    return grad


def _brute_force(loss, theta, x, y, fit_intercept):
    """Per-example gradients (intercept column zeroed when not fitted) and their norms."""
    grads = []
    for i in range(x.shape[0]):
        gi = _per_example_gradient(loss, theta, x[i], y[i])
        if not fit_intercept:
            gi[:, -1] = 0.0
        grads.append(gi)
    return grads, np.array([np.linalg.norm(gi) for gi in grads])


def _setup(model_id, name, kwargs, make_labels):
    g = np.random.default_rng(sum(map(ord, model_id)))
    loss = _make_loss(name, kwargs)
    x = _rows(g)
    y = loss.encode_labels(make_labels(g, x.shape[0]))
    theta = 0.5 * g.standard_normal((loss.outputs(), D + 1))
    if name == "hinge":
        # The hinge loss has a kink at margin 1, where central differences are meaningless: no
        # row may have its margin within 1e-3 of it (the differences move scores by ~1e-6).
        margin = y * losses.scores(theta, x)[:, 0]
        assert not np.any(np.abs(1.0 - margin) < 1e-3)
    if name == "huber":
        # Same for Huber's switch between quadratic and linear at |r| = delta (a kink in the
        # second derivative only, but keep the differences on one piece).
        r = np.abs(losses.scores(theta, x)[:, 0] - y)
        assert not np.any(np.abs(r - loss.delta) < 1e-3)
    return loss, x, y, theta


@pytest.mark.parametrize("fit_intercept", [True, False], ids=["intercept", "no-intercept"])
@pytest.mark.parametrize("model_id,name,kwargs,make_labels", MODELS, ids=[m[0] for m in MODELS])
def test_clipped_gradient_sum_matches_brute_force(model_id, name, kwargs, make_labels, fit_intercept):
    loss, x, y, theta = _setup(model_id, name, kwargs, make_labels)
    grads, norms = _brute_force(loss, theta, x, y, fit_intercept)

    # A clip norm at the median of the nonzero per-example norms: about half the rows are clipped
    # and half are not, whatever the model.
    clip_norm = float(np.median(norms[norms > 0]))
    clipped = norms > clip_norm * (1 + 1e-6)
    assert clipped.sum() >= 5 and (~clipped).sum() >= 5, "need both clipped and unclipped rows"
    if name == "hinge":
        assert np.any(norms == 0) and np.any(norms > 0)  # rows past the margin have no gradient

    expected = np.zeros_like(theta)
    for gi, ni in zip(grads, norms):
        expected += gi * min(1.0, clip_norm / ni) if ni > 0 else gi

    sq_norms = np.einsum("ij,ij->i", x, x)
    got = clipping.clipped_gradient_sum(theta, x, sq_norms, y, loss, clip_norm, fit_intercept)

    assert got.shape == theta.shape
    if not fit_intercept:
        assert np.all(got[:, -1] == 0.0)
    # Central differences with a score step of 1e-6 are accurate to ~1e-9 relative here; 1e-6 is
    # loose for that and tight against any mistake in the norm (a missing +1 changes the clip
    # factors of clipped rows with small x by a factor of order 1).
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7 * clip_norm)

    # The per-example norms of the GLM identity are the brute-force norms.
    derivative = loss.derivative(losses.scores(theta, x), y)
    np.testing.assert_allclose(clipping.gradient_norms(derivative, sq_norms, fit_intercept), norms,
                               rtol=1e-6, atol=1e-9)


def test_clip_factors():
    norms = np.array([0.0, 0.5, 1.0, 2.0, 8.0])
    np.testing.assert_allclose(clipping.clip_factors(norms, 2.0), [1.0, 1.0, 1.0, 1.0, 0.25])


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_clipped_gradient_sum_of_empty_block_is_zero(fit_intercept):
    loss = losses.make_loss("softmax", num_classes=3)
    theta = np.ones((3, D + 1))
    out = clipping.clipped_gradient_sum(theta, np.zeros((0, D)), np.zeros(0),
                                        np.zeros(0, dtype=np.int64), loss, 1.0, fit_intercept)
    assert out.shape == theta.shape and not out.any()


@pytest.mark.parametrize("model_id,name,kwargs,make_labels", MODELS, ids=[m[0] for m in MODELS])
def test_derivative_matches_finite_differences_of_value(model_id, name, kwargs, make_labels):
    g = np.random.default_rng(sum(map(ord, model_id)) + 1)
    loss = _make_loss(name, kwargs)
    m = 40
    y = loss.encode_labels(make_labels(g, m))
    s = 3.0 * g.standard_normal((m, loss.outputs()))
    if name == "hinge":
        s[np.abs(1.0 - y * s[:, 0]) < 1e-3, 0] += 0.1
    if name == "huber":
        s[np.abs(np.abs(s[:, 0] - y) - loss.delta) < 1e-3, 0] += 0.1
    h = 1e-6
    numeric = np.zeros_like(s)
    for j in range(s.shape[1]):
        plus, minus = s.copy(), s.copy()
        plus[:, j] += h
        minus[:, j] -= h
        numeric[:, j] = (loss.value(plus, y) - loss.value(minus, y)) / (2 * h)
    np.testing.assert_allclose(loss.derivative(s, y), numeric, rtol=1e-6, atol=1e-8)
    # The Lipschitz constant in the score bounds every derivative.
    if loss.score_lipschitz is not None:
        assert np.all(np.linalg.norm(loss.derivative(s, y), axis=1) <= loss.score_lipschitz + 1e-12)


def test_values_match_textbook_formulas():
    g = np.random.default_rng(3)
    m = 50
    s1 = 2.0 * g.standard_normal((m, 1))
    labels01 = g.integers(0, 2, m).astype(float)
    pm = 2 * labels01 - 1

    logistic = losses.make_loss("logistic")
    p = expit(s1[:, 0])
    cross_entropy = -(labels01 * np.log(p) + (1 - labels01) * np.log(1 - p))
    np.testing.assert_allclose(logistic.value(s1, logistic.encode_labels(labels01)), cross_entropy,
                               rtol=1e-10)
    np.testing.assert_array_equal(logistic.encode_labels(labels01), logistic.encode_labels(pm))

    hinge = losses.make_loss("hinge")
    np.testing.assert_allclose(hinge.value(s1, hinge.encode_labels(labels01)),
                               np.maximum(0, 1 - pm * s1[:, 0]))

    r = 2.0 * g.standard_normal(m)
    linear = losses.make_loss("linear")
    np.testing.assert_allclose(linear.value(s1, s1[:, 0] - r), 0.5 * r**2)
    huber = losses.make_loss("huber", huber_delta=0.7)
    expected = np.where(np.abs(r) <= 0.7, 0.5 * r**2, 0.7 * np.abs(r) - 0.5 * 0.7**2)
    np.testing.assert_allclose(huber.value(s1, s1[:, 0] - r), expected)

    softmax = losses.make_loss("softmax", num_classes=4)
    s4 = 2.0 * g.standard_normal((m, 4))
    y4 = g.integers(0, 4, m)
    probs = np.exp(s4) / np.exp(s4).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(softmax.value(s4, softmax.encode_labels(y4.astype(float))),
                               -np.log(probs[np.arange(m), y4]), rtol=1e-10)


@pytest.mark.parametrize("model,labels,bad_row", [
    ("logistic", [0, 1, 1, 2, 0], 3),
    ("logistic", [1, 0.5, 0], 1),
    ("logistic", [0, 1, np.nan], 2),
    ("hinge", [1, -1, 0, 3], 3),
])
def test_binary_label_validation(model, labels, bad_row):
    with pytest.raises(losses.LabelError) as info:
        losses.make_loss(model).encode_labels(np.array(labels, dtype=float))
    assert info.value.row == bad_row
    # The message says what was expected, never the value (it may be sensitive).
    message = str(info.value)
    assert "does not fit" in message or "not finite" in message
    assert repr(float(labels[bad_row])) not in message and "np." not in message


@pytest.mark.parametrize("labels,bad_row", [
    ([0, 1, 2, -1], 3),
    ([3, 0, 1], 0),
    ([0, 1.5, 2], 1),
    ([0, 1, np.inf], 2),
])
def test_softmax_label_validation(labels, bad_row):
    loss = losses.make_loss("softmax", num_classes=3)
    with pytest.raises(losses.LabelError) as info:
        loss.encode_labels(np.array(labels, dtype=float))
    assert info.value.row == bad_row
    assert "np." not in str(info.value)
    np.testing.assert_array_equal(loss.encode_labels(np.array([0.0, 1.0, 2.0])), [0, 1, 2])


def test_regression_labels_must_be_finite():
    with pytest.raises(losses.LabelError) as info:
        losses.make_loss("linear").encode_labels(np.array([0.5, -3.0, np.nan]))
    assert info.value.row == 2


@pytest.mark.parametrize("model,labels", [("logistic", lambda g, m: g.integers(0, 2, m)),
                                          ("softmax", lambda g, m: g.integers(0, 3, m))])
def test_a_block_larger_than_a_chunk_sums_its_chunks(model, labels):
    """clipped_gradient_sum works on cache-sized chunks of rows (clipping.CHUNK_BYTES): the sum
    over a block of several chunks, with rows on the exact-scaling path in more than one chunk,
    is the one-pass sum over the whole block, to rounding."""
    g = np.random.default_rng(3)
    d = 40
    rows = clipping.CHUNK_BYTES // (8 * (d + 1))
    m = 3 * rows + 17
    x = g.standard_normal((m, d))
    x[[5, rows + 3, 2 * rows + 9]] *= 1e200          # the special path, in three chunks
    sq = np.einsum("ij,ij->i", x, x)
    y = labels(g, m) if model == "softmax" else labels(g, m).astype(float)
    loss = losses.make_loss(model, num_classes=3 if model == "softmax" else None)
    theta = g.standard_normal((loss.outputs(), d + 1)) * 0.1
    chunked = clipping.clipped_gradient_sum(theta, x, sq, y, loss, 0.7)
    with np.errstate(all="ignore"):
        derivative = loss.derivative(losses.scores(theta, x), y)
    whole = clipping.clipped_outer_sums(derivative, x, sq, [0.7])[0]
    np.testing.assert_allclose(chunked, whole, rtol=1e-12, atol=1e-12 * m)
    assert np.all(np.isfinite(chunked))
