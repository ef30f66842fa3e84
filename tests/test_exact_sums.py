"""Exact gradient sums on a public grid (``beam_dp.clipping``, secure noise).

Secure noise adds integer noise to an integer sum and calibrates it to the sum's sensitivity,
C / grid in grid units. The checks below pin down what that relies on: the sum is exact and
independent of the order and split of the rows (the same seed gives the same model on any
runner), each row moves it by at most C / grid (checked in exact integer arithmetic), it agrees
with the float kernel to the grid's resolution, the quantized rows keep their invariants for
any finite input, silently, and the 96-bit ``ExactSum`` carries correctly.
"""
from __future__ import annotations

import functools
import operator
import pickle
import warnings
from fractions import Fraction

import numpy as np
import pytest

from beam_dp import clipping, losses
from beam_dp.clipping import ExactSum
from beam_dp.block import Block

Q = clipping.GRID_FEATURE_BITS
U = clipping.GRID_SCALE_BITS
MODELS = ("logistic", "softmax", "linear", "huber", "hinge")
CLASSES = 3
BIGGEST = np.finfo(np.float64).max
TINIEST = 5e-324   # the smallest subnormal


def make_loss(name: str) -> losses.GlmLoss:
    return losses.make_loss(name, num_classes=CLASSES if name == "softmax" else None)


def raw_labels(rng, name: str, m: int) -> np.ndarray:
    if name == "softmax":
        return rng.integers(0, CLASSES, m).astype(float)
    if name in ("linear", "huber"):
        return 3.0 * rng.normal(size=m)
    return rng.integers(0, 2, m).astype(float)


def mixed_features(rng, m: int, d: int) -> np.ndarray:
    """Rows of very different scales, exact zeros, and a few rows at the float range's edges:
    the exact path must treat all of them like any other row."""
    x = rng.normal(size=(m, d)) * np.exp(rng.normal(0.0, 2.0, (m, 1)))
    x[rng.random((m, d)) < 0.05] = 0.0
    x[0] = 1e200
    x[1, :2] = (-1e300, 1e-300)
    x[2] = 0.0
    x[3] = 1e-300
    x[4, :2] = (BIGGEST, -BIGGEST)
    x[5] = TINIEST
    x[6, :3] = (1e308, TINIEST, -1e-200)
    return x


def as_ints(total: ExactSum) -> np.ndarray:
    """The exact value of an ExactSum as Python integers (object array)."""
    return total.hi.astype(object) * 2**32 + total.lo.astype(object)


def kernel(theta, x, labels, loss, clip_norm=1.0, fit_intercept=True, scale_bits=U):
    q, shift = clipping.quantized_rows(x, fit_intercept)
    norms = np.sqrt(np.einsum("ij,ij->i", q, q))
    return clipping.exact_clipped_gradient_sum(theta, q, shift, norms, labels, loss, clip_norm,
                                               scale_bits)


@pytest.fixture(params=["auto", "einsum", "blas-one-thread"])
def score_path(request, monkeypatch):
    """The kernel's scores come from BLAS (rows padded to groups of 8) where
    ``_blas_rows_stable`` holds for the model's number of outputs, else from np.einsum: order
    independence must hold on both. "auto" is this process's own choice; BLAS limited to one
    thread (skipped where even that fails the check for every count, e.g. on other OpenBLAS
    core types) covers the padding code where the threaded BLAS fails it."""
    if request.param == "einsum":
        monkeypatch.setattr(clipping, "_blas_rows_stable", lambda outputs=1: False)
    elif request.param == "blas-one-thread":
        threadpoolctl = pytest.importorskip("threadpoolctl")
        limits = threadpoolctl.threadpool_limits(1)
        request.addfinalizer(limits.restore_original_limits)
        stable = {k: clipping._blas_rows_stable.__wrapped__(k) for k in (1, 2, 3)}
        if not any(stable.values()):
            pytest.skip("BLAS rows depend on their position even on one thread")
        monkeypatch.setattr(clipping, "_blas_rows_stable", lambda outputs=1: stable[outputs])
    return request.param


# ------------------------------------------------------------------------ order independence


@pytest.mark.parametrize("m", [600, 9000])   # 9000 rows: three chunks of at most 4096
@pytest.mark.parametrize("name", MODELS)
def test_sum_is_independent_of_order_and_split(name, m, score_path):
    """The same rows, split into uneven parts in any order and added in any order, give the same
    integers: otherwise the released model would depend on the runner's blocks and workers."""
    rng = np.random.default_rng([1, m, MODELS.index(name)])
    d = 6
    loss = make_loss(name)
    x = mixed_features(rng, m, d)
    y = loss.encode_labels(raw_labels(rng, name, m))
    theta = rng.normal(size=(loss.outputs(), d + 1))
    q, shift = clipping.quantized_rows(x, True)
    norms = np.sqrt(np.einsum("ij,ij->i", q, q))

    def exact(rows):
        return clipping.exact_clipped_gradient_sum(theta, q[rows], shift[rows], norms[rows],
                                                   y[rows], loss, 1.0)

    total = exact(np.arange(m))
    assert total.shape == theta.shape
    assert np.any(total.to_float() != 0)
    order = rng.permutation(m)
    assert exact(order) == total
    cuts = np.sort(rng.choice(np.arange(1, m), 6, replace=False))
    parts = [exact(rows) for rows in np.split(order, cuts)]
    assert len(parts) == 7
    shuffled = [parts[i] for i in rng.permutation(len(parts))]
    assert functools.reduce(operator.add, shuffled) == total
    # Also across the chunk boundary: split right after the first chunk, and off by one row.
    chunk = clipping._EXACT_CHUNK_ROWS
    assert chunk == 4096
    for cut in (chunk, chunk - 1, chunk + 1):
        if cut < m:
            assert exact(order[:cut]) + exact(order[cut:]) == total


@pytest.mark.parametrize("outputs", [1, 3])
def test_scores_do_not_depend_on_the_rows_around_a_row(outputs, score_path):
    """Each row's score has the same bits wherever the row sits (any offset, length or copy):
    the integers above are robust to a last-bit change only almost always, so this is checked
    on the scores themselves, at a width (51) where unpadded BLAS products differ."""
    rng = np.random.default_rng([2, outputs])
    m, d = 3000, 50
    q, shift = clipping.quantized_rows(mixed_features(rng, m, d), True)
    theta = rng.normal(size=(outputs, d + 1))
    whole = clipping.quantized_scores(theta, q, shift)
    for start, length in ((0, 1), (3, 5), (1, 64), (17, 255), (5, 1960), (7, 2993)):
        rows = slice(start, start + length)
        for part in (q[rows], np.array(q[rows])):
            assert np.array_equal(clipping.quantized_scores(theta, part, shift[rows]),
                                  whole[rows], equal_nan=True)


# ----------------------------------------------------------------------------- sensitivity


def one_row_sq_norms(theta, x, labels, loss, clip_norm, fit_intercept, scale_bits):
    """Each row's contribution alone: its squared L2 norm in grid units, as Python integers."""
    q, shift = clipping.quantized_rows(x, fit_intercept)
    norms = np.sqrt(np.einsum("ij,ij->i", q, q))
    out = []
    for i in range(len(x)):
        part = clipping.exact_clipped_gradient_sum(theta, q[i:i + 1], shift[i:i + 1],
                                                   norms[i:i + 1], labels[i:i + 1], loss,
                                                   clip_norm, scale_bits)
        ints = as_ints(part)
        values = part.to_float()
        assert np.array_equal(values, np.trunc(values))          # grid points, exactly
        assert np.array_equal(values, ints.astype(float))        # below 2^53: to_float exact
        out.append(int((ints * ints).sum()))
    return out


@pytest.mark.parametrize("scale_bits", [20, 8])
@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("clip_norm", [1.0, 0.37])
@pytest.mark.parametrize("name", MODELS)
def test_each_row_adds_at_most_the_clip_norm(name, clip_norm, fit_intercept, scale_bits):
    """The noise is calibrated to C / grid = 2^(Q-1+U) grid units per row: a single row beyond
    it, however extreme its values, would break the privacy guarantee. Checked exactly."""
    rng = np.random.default_rng([2, MODELS.index(name), int(fit_intercept), scale_bits])
    m, d = 40, 5
    loss = make_loss(name)
    x = mixed_features(rng, m, d)
    y = loss.encode_labels(raw_labels(rng, name, m))
    theta = rng.normal(0.0, 3.0, (loss.outputs(), d + 1))
    bound = 2 ** (2 * (Q - 1 + scale_bits))
    assert clip_norm / clipping.gradient_grid(clip_norm, scale_bits) == 2.0 ** (Q - 1 + scale_bits)
    sq = one_row_sq_norms(theta, x, y, loss, clip_norm, fit_intercept, scale_bits)
    assert max(sq) <= bound
    if not fit_intercept:
        assert sq[2] == 0   # the zero row (with an intercept it is (0, ..., 0, 1))
    # Most ordinary rows are clipped at C = 1 and nearly reach the bound: the check has teeth.
    assert max(sq) > 0.9 * bound


@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("scale_bits", [20, 8])
def test_infinite_derivatives_are_clipped_along_their_sign(fit_intercept, scale_bits):
    """A squared loss at an overflowing score has derivative +-inf: the row must still add at
    most C / grid (and, for a positive row, about that much along its sign, not NaN or 0)."""
    rng = np.random.default_rng([3, int(fit_intercept), scale_bits])
    m, d = 30, 4
    loss = make_loss("linear")
    # Positive rows (a score of +inf, not inf - inf), none tiny: with theta = 1e300 each score
    # is at least ~1e296 and the rows of 1e200 and beyond overflow it to +inf.
    x = np.abs(mixed_features(rng, m, d))
    x[[2, 3, 5]] = 1.0
    y = loss.encode_labels(raw_labels(rng, "linear", m))
    theta = np.full((1, d + 1), 1e300)
    bound = 2 ** (2 * (Q - 1 + scale_bits))
    sq = one_row_sq_norms(theta, x, y, loss, 1.0, fit_intercept, scale_bits)
    assert max(sq) <= bound
    # Truncation to the grid loses at most ||q|| <= sqrt(d + 1) 2^Q grid units of 2^(Q-1+U).
    assert min(sq) >= (1.0 - np.sqrt(d + 1) * 2.0 ** (1 - scale_bits)) ** 2 * bound
    total = kernel(theta, x, y, loss, 1.0, fit_intercept, scale_bits).to_float()
    assert np.all(total[:, :d] > 0)
    assert (total[0, d] > 0) if fit_intercept else (total[0, d] == 0)


def test_a_row_exactly_at_an_integer_level_does_not_exceed_the_clip_norm():
    """A row whose exact clipped level 2^39 / ||q|| lies within rounding below an integer n:
    the float quotient rounds up to n, truncation keeps n, and n^2 ||q||^2 > 2^78 = (C/grid)^2.
    q was found by searching n with n^2 S - 2^78 small (S = ||q||^2 a sum of 7 squares)."""
    q = np.array([1048575, 1048575, 1048575, 764532, 1005, 28, 7], dtype=float)
    x = q[None, :] * 2.0 ** -Q      # quantized_rows gives back exactly q (fit_intercept off)
    loss = make_loss("linear")
    theta = np.zeros((1, len(q) + 1))
    (sq,) = one_row_sq_norms(theta, x, np.array([-1e6]), loss, 1.0, False, U)
    assert sq <= 2 ** (2 * (Q - 1 + U))


# -------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_agrees_with_the_float_kernel(name, fit_intercept):
    """On ordinary data the exact sum is the float kernel's to the grid's resolution: each row
    loses < 1 grid unit per derivative level times |q| <= 2^Q, plus 2^-Q of relative feature
    quantization; anything larger would be a wrong gradient, not rounding."""
    rng = np.random.default_rng([4, MODELS.index(name), int(fit_intercept)])
    m, d, clip_norm = 3000, 8, 2.0
    loss = make_loss(name)
    x = rng.normal(size=(m, d))
    y = loss.encode_labels(raw_labels(rng, name, m))
    theta = rng.normal(0.0, 0.5, (loss.outputs(), d + 1))
    if not fit_intercept:
        theta[:, -1] = 0.0   # as in training; the float kernel's scores would still add it
    grid = clipping.gradient_grid(clip_norm)
    exact = kernel(theta, x, y, loss, clip_norm, fit_intercept).to_float() * grid
    sq_norms = np.einsum("ij,ij->i", x, x)
    reference = clipping.clipped_gradient_sum(theta, x, sq_norms, y, loss, clip_norm,
                                              fit_intercept)
    slack = m * grid * 2.0 ** Q
    assert np.linalg.norm(exact - reference) <= 1e-5 * np.linalg.norm(reference) + slack
    if not fit_intercept:
        assert np.all(exact[:, -1] == 0)


# --------------------------------------------------------------------------- quantized rows


EXTREME_ROWS = np.array([
    [1e308, -1e308, 1.0, 0.0],
    [BIGGEST, -BIGGEST, BIGGEST, BIGGEST],
    [BIGGEST, TINIEST, -1e-300, 0.0],
    [TINIEST, -TINIEST, 0.0, TINIEST],
    [2.2250738585072014e-308, 3 * TINIEST, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [-0.0, 0.0, -0.0, 0.0],
    [1e-300, 1e300, 1e-10, 1e10],
    [1.0 - 2.0 ** -53, 0.5, 2.0 ** -21, 3 * 2.0 ** -22],   # rounds up to 2^Q exactly
    [1.5, -1.5, 0.75, 2.0 ** 100],
])


def quantized_quietly(x, fit_intercept):
    """quantized_rows with every floating-point event an error and every warning an error: a
    warning printed only for an extreme row would reveal that the row is there."""
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        return clipping.quantized_rows(x, fit_intercept)


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_quantized_rows_invariants_and_exactness(fit_intercept):
    """Every row keeps Q bits relative to its largest entry (the features training sees), as
    integers in [-2^Q, 2^Q] with the largest in [2^(Q-1), 2^Q]; the kernel's bound on the
    derivative level (<= 2^U) and on the chunk sums (< 2^52) rest on these bounds."""
    rng = np.random.default_rng([5, int(fit_intercept)])
    x = np.vstack([mixed_features(rng, 2000, 4), EXTREME_ROWS])
    q, shift = quantized_quietly(x, fit_intercept)
    assert q.dtype == np.float64 and q.shape == (len(x), 5) and shift.shape == (len(x),)
    assert np.issubdtype(shift.dtype, np.integer)
    assert np.all(np.isfinite(q)) and np.array_equal(q, np.trunc(q))
    assert np.all(np.abs(q) <= 2.0 ** Q)
    rows = np.column_stack([x, np.full(len(x), float(fit_intercept))])
    top = np.max(np.abs(q), axis=1)
    zero = np.max(np.abs(rows), axis=1) == 0
    assert np.all(q[zero] == 0)
    assert np.all((top[~zero] >= 2.0 ** (Q - 1)) & (top[~zero] <= 2.0 ** Q))
    assert np.any(top == 2.0 ** Q)   # the rounded-up row is in the data
    # Exactness, scaled by the (exact) power of two 2^-(shift + Q): the rows then lie in [-1, 1]
    # and q 2^-Q is within 2^-Q of the row's largest entry of them (the grid's half step is
    # 2^-(Q+1); ldexp's own underflow adds at most 2^-1075).
    with np.errstate(under="ignore"):
        scaled = np.ldexp(rows, -(shift + Q)[:, None])
    error = np.abs(q * 2.0 ** -Q - scaled)
    largest = np.max(np.abs(scaled), axis=1, keepdims=True)
    assert np.all(error <= 2.0 ** -Q * largest + 2.0 ** -1070)
    # The extreme rows in exact rational arithmetic (a small array: a Python loop is fine).
    k = len(EXTREME_ROWS)
    for row, qi, si in zip(rows[-k:], q[-k:], shift[-k:]):
        largest = max(abs(Fraction(v)) for v in row)
        for v, qv in zip(row, qi):
            assert abs(Fraction(int(qv)) * Fraction(2) ** int(si) - Fraction(v)) \
                <= largest * Fraction(1, 2 ** Q)


def test_quantized_rows_are_silent_for_any_finite_input():
    """Random bit patterns (every finite float64, subnormals included), rows of one extreme value
    and an empty block: no warning and no floating-point error, and still bounded integers."""
    rng = np.random.default_rng(6)
    bits = rng.integers(0, 2**63, (3000, 6), dtype=np.int64) ^ (rng.integers(0, 2, (3000, 6))
                                                               << 63)
    x = bits.view(np.float64)
    x[~np.isfinite(x)] = 1e308
    for fit_intercept in (True, False):
        for features in (x, np.full((3, 2), BIGGEST), np.full((3, 2), -TINIEST),
                         np.zeros((0, 3)), np.zeros((4, 0))):
            q, shift = quantized_quietly(features, fit_intercept)
            assert q.shape == (len(features), features.shape[1] + 1)
            assert shift.shape == (len(features),)
            assert np.all(np.abs(q) <= 2.0 ** Q) and np.array_equal(q, np.trunc(q))
            top = np.max(np.abs(q), axis=1, initial=0.0)
            assert np.all((top >= 2.0 ** (Q - 1)) | (np.max(np.abs(features), axis=1,
                                                            initial=0.0) == 0))


@pytest.mark.parametrize("name", MODELS)
def test_kernel_is_silent_on_extreme_rows(name):
    """The kernel handles overflow internally: with every floating-point event an error and
    every warning an error it still runs on the extreme rows (and huge theta)."""
    rng = np.random.default_rng([7, MODELS.index(name)])
    loss = make_loss(name)
    x = np.vstack([mixed_features(rng, 50, 4), EXTREME_ROWS])
    y = loss.encode_labels(raw_labels(rng, name, len(x)))
    clipping._blas_rows_stable(loss.outputs())   # the once-per-process check, on ordinary data
    for theta in (rng.normal(size=(loss.outputs(), 5)), np.full((loss.outputs(), 5), 1e300)):
        with warnings.catch_warnings(), np.errstate(all="raise"):
            warnings.simplefilter("error")
            total = kernel(theta, x, y, loss)
        assert np.all(np.isfinite(total.to_float()))


# -------------------------------------------------------------------------------- ExactSum


def test_exact_sum_carries_beyond_int64():
    """Thousands of values near 2^52 (and near 2^62) add up far beyond 2^63, positive and
    negative: the 32-bit carry into ``hi`` must keep the total exact (Python ints as truth)."""
    rng = np.random.default_rng(8)
    signs = np.array([1, -1, 1])
    total, truth = ExactSum.zeros(3), np.zeros(3, dtype=object)
    for i in range(5000):
        values = signs * (2**52 - rng.integers(0, 2**20, 3))
        # half as float64 integer values (as the kernel's chunk sums), half as int64 noise
        total = total + ExactSum.of(values.astype(np.float64)) if i % 2 else total + values
        truth = truth + values.astype(object)
    assert np.all(np.abs(truth) > 2**63)
    assert np.array_equal(as_ints(total), truth)
    assert np.all(np.abs(total.lo) <= 2**31)
    for _ in range(40):
        values = signs * (2**62 - rng.integers(0, 2**40, 3))
        total, truth = total + ExactSum.of(values), truth + values.astype(object)
    assert np.all(np.abs(truth) > 2**67)
    assert np.array_equal(as_ints(total), truth)
    # to_float: one rounding of the exact value (hi < 2^53 here), as Python's float(int).
    assert np.array_equal(total.to_float(), np.array([float(v) for v in truth]))


def random_sums(rng, count, shape=(2, 3)):
    """ExactSums of random int64 values over (nearly) the whole int64 range."""
    edge = 2**63 - 2**32
    return [ExactSum.of(rng.integers(-edge, edge, shape)) + rng.integers(-edge, edge, shape)
            for _ in range(count)]


def test_exact_sum_is_commutative_and_associative():
    """Any order and grouping of the partial sums (as Beam's combiners do) gives the same
    value and the same representation, so == compares values."""
    rng = np.random.default_rng(9)
    a, b, c = random_sums(rng, 3)
    assert a + b == b + a
    assert (a + b) + c == a + (b + c) == (c + a) + b
    assert np.array_equal(as_ints(a + b + c), as_ints(a) + as_ints(b) + as_ints(c))
    many = random_sums(rng, 50)
    forward = functools.reduce(operator.add, many)
    assert functools.reduce(operator.add, [many[i] for i in rng.permutation(50)]) == forward
    assert sum(many, ExactSum.zeros((2, 3))) == forward == sum(many)   # sum() starts at 0
    assert np.array_equal(as_ints(forward), sum(as_ints(s) for s in many))
    # One value, two representations: hi * 2^32 + lo with lo unnormalized equals the canonical.
    assert ExactSum(np.array([0]), np.array([5 * 2**40 + 7])) \
        == ExactSum(np.array([5 * 2**8]), np.array([7]))
    assert a != b


def test_exact_sum_pickles_and_adds_integer_arrays_only():
    """Partial sums cross process boundaries (Beam pickles them); noise is added as int64."""
    rng = np.random.default_rng(10)
    (a,) = random_sums(rng, 1)
    copy = pickle.loads(pickle.dumps(a))
    assert copy == a and copy.hi.dtype == copy.lo.dtype == np.int64
    assert np.array_equal(as_ints(copy), as_ints(a))
    noise = rng.integers(-2**62, 2**62, a.shape)
    assert np.array_equal(as_ints(a + noise), as_ints(a) + noise.astype(object))
    assert a + noise.astype(np.int32) == a + noise.astype(np.int32).astype(np.int64)
    assert a + 7 == a + np.full(a.shape, 7)
    for bad in (np.ones(a.shape), 1.0, np.ones(a.shape, np.float32), np.array([1.5])):
        with pytest.raises(TypeError):
            a + bad
    assert ExactSum.zeros((2, 3)).shape == (2, 3) and ExactSum.of(np.ones(4) * 3).shape == (4,)


def test_exact_sum_of_int64_extremes():
    """``ExactSum.of`` and ``+`` take int64 arrays: the whole int64 range must come out exact."""
    extremes = np.array([2**63 - 1, -2**63, 2**63 - 2**31])
    assert np.array_equal(as_ints(ExactSum.of(extremes)), extremes.astype(object))
    assert np.array_equal(as_ints(ExactSum.zeros(3) + extremes), extremes.astype(object))


# ------------------------------------------------------------------------ block memoization


def test_block_quantized_rows_memoizes_per_fit_intercept():
    """A full-batch run quantizes each cached block once, not at every step; changing
    fit_intercept must not reuse rows quantized with the other intercept column."""
    rng = np.random.default_rng(11)
    block = Block(mixed_features(rng, 50, 3), np.zeros(50))
    first = clipping.block_quantized_rows(block, True)
    second = clipping.block_quantized_rows(block, True)
    assert all(a is b for a, b in zip(first, second))
    q, shift = clipping.quantized_rows(block.features, True)
    assert np.array_equal(first[0], q) and np.array_equal(first[1], shift)
    assert np.array_equal(first[2], np.sqrt(np.einsum("ij,ij->i", q, q)))
    other = clipping.block_quantized_rows(block, False)
    q, shift = clipping.quantized_rows(block.features, False)
    assert np.array_equal(other[0], q) and np.array_equal(other[1], shift)
    assert np.all(other[0][:, -1] == 0) and np.any(first[0][:, -1] != 0)
    again = clipping.block_quantized_rows(block, True)
    assert np.array_equal(again[0], first[0]) and np.array_equal(again[1], first[1])
