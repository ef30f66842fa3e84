"""Finite but huge feature values (issue 8, item 1): a row holding 1e200, -1e300 or 1e154 in
several columns must neither turn anything into NaN nor change anything beyond what one row may
change under the clip norm, and must not make the code print a warning (a warning that appears
only when such a row exists reveals it).

1. The numpy kernels, row by row, against an independent high-precision oracle (Python's
   ``decimal`` with 50 digits and exponents up to 1e6, so nothing over- or underflows): every
   row's clipped contribution is finite, has norm <= C, and equals the exactly computed clipped
   gradient; under ``np.errstate(all="raise")`` and warnings as errors.
2. The feature maps and the private statistics' value functions and partial sums on such rows.
3. End to end through each algorithm's ``train`` with the local aggregator: the model is finite,
   a huge row changes the model by at most the sensitivity bound of one row (a rigorous bound for
   DP-SGD/DP-GD, below), behaves as the same row at a large but ordinary scale (1e12) does, and
   the run emits exactly the warnings the run without it emits.

Each check fails on the code before the fix (NaN sums, zero rows from NormalizeRows, overflow
warnings).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from decimal import Decimal, localcontext
from unittest import mock

import numpy as np
import pytest

from beam_dp import accounting, clipping, features, losses, stats
from beam_dp.algorithms import base, dp_ambssgd, dpsgd_f, noisy_gd, ssp
from beam_dp.block import Block
from beam_dp.local import LocalAggregator

D = 4
# One row of each kind that used to break the arithmetic, by (column -> value); the other
# columns are ordinary values.
HUGE_ROWS = {
    "1e200": {1: 1e200},
    "-1e300": {2: -1e300},
    "1e154x3": {0: 1e154, 1: -1e154, 3: 1e154},       # squares sum beyond the float range
    "1e308x4": {0: 1e308, 1: 1e308, 2: -1e308, 3: 1e308},  # the norm itself is not representable
    "mixed": {0: 1e200, 3: 1e-200},
}
# The same rows at an ordinary scale: the huge entries replaced by +-1e12 (same signs). Any
# gradient of such a row is clipped just as the huge one's, in a direction that differs by
# ~1e-12, so a model trained with it must match the huge row's up to that.
LARGE_ORDINARY = 1e12


def _set(row: np.ndarray, entries: dict, scale: float | None = None) -> np.ndarray:
    """The row with ``entries`` written in; with ``scale``, the huge ones as +-scale instead."""
    out = row.copy()
    for j, v in entries.items():
        out[j] = math.copysign(scale, v) if scale is not None and abs(v) > 1 else v
    return out


class _Strict:
    """Warnings as errors and every floating-point exception raising, around kernel calls."""

    def __enter__(self):
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error")
        self._old = np.seterr(all="raise")

    def __exit__(self, *exc):
        np.seterr(**self._old)
        self._w.__exit__(*exc)


# ============================================================ 1. kernels against an exact oracle


def _rows(g: np.random.Generator) -> np.ndarray:
    """Ordinary rows, every kind of extreme row, tiny and zero rows: (m, D)."""
    ordinary = g.standard_normal((12, D))
    extreme = np.array([_set(g.standard_normal(D), e) for e in HUGE_ROWS.values()])
    signs = np.where(g.random((len(HUGE_ROWS), D)) < 0.5, -1.0, 1.0)
    return np.vstack([
        ordinary, extreme, extreme * signs,           # the huge rows with other sign patterns
        1e-200 * g.standard_normal((2, D)),           # squares underflow
        np.full((1, D), 5e-324),                      # subnormal
        np.zeros((2, D)),
        np.array([[1.5e308, -1.5e308, 1e-300, 0.0]]),  # opposite huge entries
    ])


def _decimal_contribution(name, theta, x, y, clip_norm, fit_intercept):
    """The clipped per-example gradient of one row, computed with 50 significant digits and a
    huge exponent range: the GLM gradient l'(s) (x, 1), clipped to ``clip_norm``."""
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = 50, 10**6, -10**6
        xs = [Decimal(float(v)) for v in x] + [Decimal(1 if fit_intercept else 0)]
        s = sum(Decimal(float(w)) * xi for w, xi in zip(theta[0, :-1], xs)) + Decimal(float(theta[0, -1]))
        yd = Decimal(float(y))
        if name == "logistic":          # l' = -y sigmoid(-y s), evaluated without overflow
            z = -yd * s
            sig = 1 / (1 + (-z).exp()) if z >= 0 else z.exp() / (1 + z.exp())
            deriv = -yd * sig
        else:                           # squared loss: l' = s - y
            deriv = s - yd
        norm = abs(deriv) * sum(xi * xi for xi in xs).sqrt()
        factor = min(Decimal(1), Decimal(float(clip_norm)) / norm) if norm > 0 else Decimal(1)
        return np.array([float(factor * deriv * xi) for xi in xs])


@pytest.mark.parametrize("fit_intercept", [True, False], ids=["intercept", "no-intercept"])
@pytest.mark.parametrize("clip_norm", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("name", ["logistic", "linear"])
def test_each_row_adds_exactly_its_clipped_gradient(name, clip_norm, fit_intercept):
    g = np.random.default_rng(1)
    x = _rows(g)
    loss = losses.make_loss(name)
    m = len(x)
    if name == "logistic":
        y = loss.encode_labels(g.integers(0, 2, m).astype(float))
    else:   # regression labels, some of them huge too
        y = g.standard_normal(m)
        y[[3, 7]] = [1e250, -1e300]
    with np.errstate(over="ignore"):
        sq = np.einsum("ij,ij->i", x, x)      # as Block computes them: inf where they overflow
    for theta_scale in (1.0, 1e3):
        theta = theta_scale * g.standard_normal((1, D + 1))
        with _Strict():
            total = clipping.clipped_gradient_sum(theta, x, sq, y, loss, clip_norm, fit_intercept)
            # One call per row (the oracle must see each row's contribution on its own).
            per_row = np.array([clipping.clipped_gradient_sum(theta, x[i:i + 1], sq[i:i + 1],
                                                              y[i:i + 1], loss, clip_norm,
                                                              fit_intercept)[0] for i in range(m)])
        assert np.isfinite(per_row).all() and np.isfinite(total).all()
        norms = np.linalg.norm(per_row, axis=1)
        # Bounded by C up to a few ulps of rounding: the sensitivity of the sum is C.
        assert norms.max() <= clip_norm * (1 + 1e-12)
        expected = np.array([_decimal_contribution(name, theta, x[i], y[i], clip_norm, fit_intercept)
                             for i in range(m)])
        np.testing.assert_allclose(per_row, expected, rtol=0, atol=1e-9 * clip_norm)
        np.testing.assert_allclose(total[0], per_row.sum(axis=0), rtol=1e-12, atol=1e-12 * clip_norm * m)


@pytest.mark.parametrize("model,kwargs", [("hinge", {}), ("huber", {"huber_delta": 0.5}),
                                          ("softmax", {"num_classes": 3})])
def test_other_losses_stay_bounded_on_extreme_rows(model, kwargs):
    # Softmax at scores beyond the float range (two classes at +inf) has no exact float answer;
    # its contribution must still be finite and bounded by C.
    g = np.random.default_rng(2)
    x = _rows(g)
    loss = losses.make_loss(model, **kwargs)
    raw = g.integers(0, 3 if model == "softmax" else 2, len(x)).astype(float)
    y = loss.encode_labels(raw)
    sq = Block(x, y).sq_norms
    for theta_scale in (1.0, 1e6):
        theta = theta_scale * g.standard_normal((loss.outputs(), D + 1))
        with _Strict():
            per_row = np.array([clipping.clipped_gradient_sum(theta, x[i:i + 1], sq[i:i + 1], y[i:i + 1],
                                                              loss, 0.7) for i in range(len(x))])
            scores = losses.scores(theta, x)
            values = loss.value(scores, y)
        assert np.isfinite(per_row).all()
        assert np.linalg.norm(per_row.reshape(len(x), -1), axis=1).max() <= 0.7 * (1 + 1e-12)
        assert not np.isnan(scores).any() and not np.isnan(values).any()


def test_gradient_norms_and_clip_factors_never_nan():
    derivative = np.array([[0.0], [1.0], [np.inf], [-2.0]])
    with np.errstate(over="ignore"):
        sq = np.array([np.inf, np.inf, 4.0, 1e300 * 1e10])
    with _Strict():
        norms = clipping.gradient_norms(derivative, sq, True)
        factors = clipping.clip_factors(norms, 1.0)
    assert not np.isnan(norms).any() and norms[0] == 0.0 and np.isinf(norms[1:]).all()
    np.testing.assert_array_equal(factors, [1.0, 0.0, 0.0, 0.0])


def test_block_and_row_norms():
    x = np.array([[1e200, 0.0, 0.0], [1e154, -1e154, 1e154], [3.0, 4.0, 0.0], [1e-200, 0, 0],
                  [1.5e308, 1.5e308, 1.5e308], [0.0, 0.0, 0.0]])
    with _Strict():
        block = Block(x, np.zeros(len(x)))
        got = clipping.row_norms(block.features, block.sq_norms)
    assert np.isinf(block.sq_norms[[0, 1, 4]]).all()        # squares overflow, quietly
    np.testing.assert_allclose(got[:4], [1e200, math.sqrt(3) * 1e154, 5.0, 1e-200], rtol=1e-15)
    assert got[4] == np.inf and got[5] == 0.0               # norm not representable; zero row


# ================================================================ 2. feature maps and statistics


def _extreme_block(g):
    x = np.vstack([g.standard_normal((5, D))] + [_set(g.standard_normal(D), e)[None, :]
                                                 for e in HUGE_ROWS.values()])
    return Block(x, np.zeros(len(x)), "mem", 0)


def test_feature_maps_bound_every_row():
    g = np.random.default_rng(3)
    block = _extreme_block(g)
    with _Strict():
        normalized = features.NormalizeRows(2.0)(block)
        clipped = features.ClipRows(2.0)(block)
        centered = features.Chain((features.ClipRows(2.0), features.Center((0.5, -0.5, 0.0, 1.0))))(block)
        augmented = features.CenterAugmentClip((1e308, -1e308, 0.0, 1.0), 0.8)(block)
        raw_center = features.Center((-1e308, 1e308, 0.0, 0.0))(block)
    for out, bound in ((normalized, 2.0), (clipped, 2.0), (augmented, math.sqrt(2) * 0.8)):
        norms = np.linalg.norm(out.features, axis=1)
        assert np.isfinite(out.features).all() and norms.max() <= bound * (1 + 1e-12)
        np.testing.assert_allclose(out.sq_norms, norms ** 2, rtol=1e-12)
    # NormalizeRows: every nonzero row, however large, gets norm C exactly (it used to become 0).
    np.testing.assert_allclose(np.linalg.norm(normalized.features, axis=1), 2.0, rtol=1e-14)
    # The huge rows point where they did: along their huge entries.
    for i, entries in enumerate(HUGE_ROWS.values(), start=5):
        big = [j for j, v in entries.items() if abs(v) > 1]
        direction = np.zeros(D)
        direction[big] = np.sign([entries[j] for j in big])
        np.testing.assert_allclose(normalized.features[i], 2.0 * direction / np.linalg.norm(direction),
                                   atol=1e-12)
    assert np.isfinite(centered.features).all() and np.isfinite(raw_center.features).all()


def test_statistics_value_functions_and_partial_sums():
    g = np.random.default_rng(4)
    block = _extreme_block(g)
    # Bounds near the float range: their midpoint must not overflow.
    state = {"c": np.array([1e308, -1e308, 0.0, 0.0]), "r": 1.5, "n": 10,
             "b": np.array([[1e308, 1.5e308]] * D)}
    mean = stats.ClippedMeanStage("m", stats.Columns(), D, "c", "r", 1.0, seed=0)
    box = stats.BoxMeanStage("bm", stats.Columns(), D, "b", 0, 1, 1.0, seed=0)
    quantile = stats.QuantileStage("q", stats.Norms(), stats.FixedGrid(stats.log_grid(1e-3, 1e3, 64)),
                                   1, 64, (0.5,), 1.0, seed=0)
    with _Strict():
        norms = stats.Norms()(block, state)
        distances = stats.DistancesTo("c")(block, state)
        clipped_sum = mean.partial_sum(block, state)
        box_sum = box.partial_sum(Block(block.features[:5], np.zeros(5)), state)
        hist = quantile.partial_sum(block, state)
    beyond = list(HUGE_ROWS).index("1e308x4") + 5            # its norm is beyond the float range
    assert np.isfinite(np.delete(norms, beyond)).all() and norms[beyond, 0] == np.inf
    np.testing.assert_allclose(norms[5, 0], 1e200, rtol=1e-15)
    assert not np.isnan(distances).any()
    # Each of the m rows adds at most the radius: the sum is finite and within m * radius.
    assert np.isfinite(clipped_sum).all() and np.linalg.norm(clipped_sum) <= len(block) * 1.5 * (1 + 1e-12)
    assert np.isfinite(box_sum).all()
    assert hist.sum() == len(block) and hist[0, -1] == 5    # the huge rows land above the grid


# ====================================================================== 3. end to end, per algorithm


N, BLOCK_ROWS, ROW = 600, 200, 217   # the row that is replaced sits in the second block


def _dataset(seed, regression=False):
    g = np.random.default_rng(seed)
    x = g.standard_normal((N, D))
    w = g.standard_normal(D)
    if regression:
        y = x @ w + 0.5 + 0.3 * g.standard_normal(N)
        y[ROW] = 1.3     # a label far from 0, so the row's gradient is clipped from the start
    else:
        y = np.where(x @ w + 0.3 * g.standard_normal(N) > 0, 1.0, 0.0)
    return x, y


def _blocks(x, y, loss):
    return [Block(x[i:i + BLOCK_ROWS], loss.encode_labels(y[i:i + BLOCK_ROWS]), "/mem/train", i)
            for i in range(0, N, BLOCK_ROWS)]


class _Spy(LocalAggregator):
    """The local aggregator, remembering the step functions it ran: full-batch steps through
    ``run_stages``, steps over batches fixed in advance through ``base.run_step`` (patched by
    ``recording``)."""

    def __init__(self, blocks, log=None):
        super().__init__(blocks)
        self.log = [] if log is None else log

    def run_stages(self, stages, state):
        self.log.extend(stages)
        return super().run_stages(stages, state)

    def recording(self):
        run_step = base.run_step

        def spy(step_fn, batch, state):
            self.log.append(step_fn)
            return run_step(step_fn, batch, state)
        return mock.patch.object(base, "run_step", spy)


def _noisy_gd_config(algorithm, **more):
    # A given noise multiplier and a public n: no calibration, so the runs stay quick; the noise
    # draws come from the seed and are the same in every run.
    # The float path: a huge row must act exactly as the same row at an ordinary scale. (With
    # secure noise, the default, a row is rounded to 20 bits of its largest entry, so its small
    # entries round differently at the two scales; its overflow safety is tested with the exact
    # sums, tests/test_exact_sums.py and tests/test_secure_releases.py.)
    more.setdefault("noise", "float")
    return noisy_gd.NoisyGDConfig(algorithm=algorithm, noise_multiplier=1.0, delta=1e-5,
                                  clip_norm=0.5, learning_rate=1.0, batch_size=60,
                                  num_examples=N, **more)


def _train_dpsgd(blocks, algorithm="dpsgd", transform=None):
    config = _noisy_gd_config(algorithm, **({"steps": 12} if algorithm == "dpgd" else {"epochs": 1.0}))
    aggregator = _Spy(blocks)
    make_transform = (lambda pre: transform) if transform is not None else None
    with aggregator.recording():
        result = noisy_gd.train(config, losses.make_loss("logistic"), D, aggregator, 7,
                                accounting.Ledger(), make_transform=make_transform)
    return result.theta, aggregator.log


def _train_dpsgd_f(blocks, variant):
    config = _noisy_gd_config("dpsgd", epochs=1.0)
    f_config = dpsgd_f.DpsgdFConfig(variant=variant, preprocess_epsilon=1.0, feature_norm=3.0)
    result = dpsgd_f.train(config, f_config, losses.make_loss("hinge" if variant == "theory" else "logistic"),
                           D, LocalAggregator(blocks), 7, accounting.Ledger())
    return result.theta, []


def _train_ambssgd(blocks):
    config = _noisy_gd_config("dpsgd")
    result = dp_ambssgd.train(config, dp_ambssgd.AmbssgdConfig(blocks=6), losses.make_loss("linear"),
                              D, LocalAggregator(blocks), 7, accounting.Ledger())
    return result.theta, []


def _train_ssp(blocks):
    result = ssp.train(_noisy_gd_config("dpsgd"), ssp.SspConfig(), losses.make_loss("linear"), D,
                       LocalAggregator(blocks), 7, accounting.Ledger())
    return result.theta, []


ALGORITHMS = {
    "dpsgd": (lambda b: _train_dpsgd(b), False, "logistic"),
    "dpgd": (lambda b: _train_dpsgd(b, "dpgd"), False, "logistic"),
    "dpsgd-normalized": (lambda b: _train_dpsgd(b, transform=features.NormalizeRows(1.0)), False, "logistic"),
    "dpsgd-f-practical": (lambda b: _train_dpsgd_f(b, "practical"), False, "logistic"),
    "dpsgd-f-theory": (lambda b: _train_dpsgd_f(b, "theory"), False, "hinge"),
    "dp-ambssgd": (_train_ambssgd, True, "linear"),
    "ssp": (_train_ssp, True, "linear"),
}


def _run(train, x, y, model):
    """Trains, returning (theta, step functions run, the warnings the run emitted)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theta, log = train(_blocks(x, y, losses.make_loss(model)))
    return theta, log, sorted({f"{w.category.__name__}: {w.message}" for w in caught})


def _sensitivity_bound(log, block_key, index):
    """For DP-SGD/DP-GD: lr * 2C / normalizer summed over the steps whose sample holds the row.

    Why this bounds the change of the model: the runs share the seed, hence every sample and
    every noise draw; they differ in one row's clipped gradient, by at most 2C per step that
    samples it. All other rows' clipped gradients are gradients of a convex loss (clipping a GLM
    gradient is Huberizing its loss, paper 002 Lemma 5.1) whose smoothness is at most
    (1/4) lambda_max(sum x~ x~^T) / normalizer ~ 0.5 here, so with learning rate 1 (< 2 / 0.5)
    each step's map is non-expansive and differences do not grow. The iterate average obeys the
    bound of the last iterate.
    """
    total = 0.0
    for step, step_fn in enumerate(log):     # the driver runs step 0, 1, ... in this order
        rows = step_fn.sampler.rows(_KeyOnly(block_key, BLOCK_ROWS), step)
        if rows is None or index in rows:
            total += step_fn.learning_rate * 2 * step_fn.clip_norm / step_fn.normalizer
    return total


@dataclasses.dataclass
class _KeyOnly:
    """What PoissonSampler.rows reads of a block: its key and its length."""

    key: int
    rows: int

    def __len__(self):
        return self.rows


@pytest.mark.parametrize("kind", list(HUGE_ROWS)[:3] + ["1e308x4"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_one_huge_row_changes_the_model_as_one_ordinary_row(algorithm, kind):
    train, regression, model = ALGORITHMS[algorithm]
    x, y = _dataset(20 + len(kind), regression)
    entries = HUGE_ROWS[kind]
    x_huge, x_large = x.copy(), x.copy()
    x_huge[ROW] = _set(x[ROW], entries)
    x_large[ROW] = _set(x[ROW], entries, LARGE_ORDINARY)

    base, log, warned_base = _run(train, x, y, model)
    huge, _, warned_huge = _run(train, x_huge, y, model)
    large, _, _ = _run(train, x_large, y, model)

    assert np.isfinite(huge).all(), "a huge feature value made the model non-finite"
    # No warning whose presence depends on the data.
    assert warned_huge == warned_base
    # The huge row acts as the same row at an ordinary large scale: both are clipped alike.
    scale = max(1.0, float(np.abs(base).max()))
    np.testing.assert_allclose(huge, large, rtol=0, atol=1e-9 * scale)
    if algorithm in ("dpsgd", "dpgd", "dpsgd-normalized"):
        block = _blocks(x, y, losses.make_loss(model))[ROW // BLOCK_ROWS]
        bound = _sensitivity_bound(log, block.key, ROW % BLOCK_ROWS)
        assert 0 < bound
        assert np.linalg.norm(huge - base) <= bound * (1 + 1e-9)


@pytest.mark.parametrize("clip_norm", [1e10, 1e300])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_huge_clip_norms_keep_infinite_derivatives_bounded(clip_norm, fit_intercept):
    """An infinite loss derivative (squared loss, |s - y| beyond the float range) is a clipped
    gradient along its sign for every clip norm; C * 2^1000 overflowing must not let it through
    the plain path as 0 * inf = NaN (found in review)."""
    derivative = np.array([[np.inf], [-np.inf], [1.0]])
    x = np.array([[-1e-10], [3.0], [2.0]])
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = clipping.clipped_outer_sums(derivative, x, None, [clip_norm], fit_intercept)
        per_row = [clipping.clipped_outer_sums(derivative[i:i + 1], x[i:i + 1], None, [clip_norm],
                                               fit_intercept)[0] for i in range(3)]
    assert np.all(np.isfinite(out))
    for contribution in per_row:   # norms taken after scaling by C (squares of 1e300 overflow)
        assert np.linalg.norm(contribution / clip_norm) <= 1 + 1e-12
    # The infinite rows saturate at C along their sign; the finite row is not clipped.
    assert np.linalg.norm(per_row[0] / clip_norm) == pytest.approx(1.0, rel=1e-12)
    np.testing.assert_allclose(per_row[2][0, 0], 2.0)
