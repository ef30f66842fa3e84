"""dpgd's ``--gradient-estimator projection`` (paper 001, Algorithm 1 inside training): each step's
noisy mean gradient is projected onto the l1 ball of radius C sqrt(s), s the public bound on one
example's gradient nonzeros (``noisy_gd.gradient_sparsity``).

What is checked: the projection is exactly post-processing of the same Gaussian release (same
noise, same ledger, the plain step's update projected); s is read from the declared columns; the
estimator trains categorical data on both runners to the same model; secure noise is refused.
"""
from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import beam_dp
from beam_dp import api, geometry, losses, synthetic
from beam_dp.algorithms import gradient_step, noisy_gd, spec
from beam_dp.algorithms.base import TrainState
from beam_dp.categorical import Encoding
from beam_dp.sampling import PoissonSampler

LOGISTIC = losses.make_loss("logistic")
CATEGORICAL = list(synthetic.CLICK_COLUMNS)


def _train(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", api.PrivacyWarning)
        return beam_dp.train(**kwargs)


def _step(l1_radius, noise_std=50.0, shape=(1, 2001)):
    return gradient_step.NoisyGradientStep(
        loss=LOGISTIC, clip_norm=1.0, noise_std=noise_std, normalizer=100.0, learning_rate=1.0,
        sampler=PoissonSampler(1.0, 0), seed=7, shape=shape, l1_radius=l1_radius)


def test_the_projected_step_is_the_plain_steps_update_projected():
    """Same seed, same sum: the projected update is ``project_l1_ball`` of the plain update (the
    noise is drawn identically), so the release, and the privacy, is the plain step's."""
    shape = (1, 2001)
    total = np.zeros(shape)
    total[0, [3, 40, 2000]] = [60.0, -30.0, 80.0]     # an exact sum over 100 rows, 3 nonzeros
    start = TrainState.zeros(1, shape[1] - 1)
    plain = _step(None).apply(start, total)
    radius = 2.0
    projected = _step(radius).apply(start, total)
    plain_update = -(plain.theta - start.theta)
    expected = geometry.project_l1_ball(plain_update.ravel(), radius).reshape(shape)
    np.testing.assert_allclose(-(projected.theta - start.theta), expected, rtol=0, atol=1e-12)
    # The noise at 2,001 coordinates is far outside the ball: the projection is active and lands
    # on its boundary, while the plain update's l1 norm is of order d * noise.
    assert np.abs(plain_update).sum() > 100 * radius
    assert np.abs(expected).sum() == pytest.approx(radius, rel=1e-9)


def test_gradient_sparsity_counts_the_declared_columns_and_the_intercept():
    encoding = Encoding(("position",), tuple(CATEGORICAL), hash_buckets=1 << 20).spec()
    privacy = spec.Privacy(epsilon=1.0)
    sparse = spec.Problem(LOGISTIC, 1 << 20, privacy, source={"encoding": encoding}, sparse=True)
    assert noisy_gd.gradient_sparsity(sparse) == 1 + len(CATEGORICAL) + 1
    no_intercept = spec.Problem(LOGISTIC, 1 << 20, privacy, fit_intercept=False,
                                source={"encoding": encoding}, sparse=True)
    assert noisy_gd.gradient_sparsity(no_intercept) == 1 + len(CATEGORICAL)
    multinomial = losses.make_loss("softmax", num_classes=4)
    assert noisy_gd.gradient_sparsity(spec.Problem(
        multinomial, 1 << 20, privacy, source={"encoding": encoding}, sparse=True)) == 4 * 5
    # a missing indicator is one more nonzero per row
    indicated = Encoding(("position",), tuple(CATEGORICAL), hash_buckets=1 << 20,
                         missing=(("position", "indicator", 0.0),)).spec()
    assert noisy_gd.gradient_sparsity(spec.Problem(
        LOGISTIC, 1 << 20, privacy, source={"encoding": indicated}, sparse=True)) == 1 + 1 + 3 + 1
    # a dense problem: every coefficient
    assert noisy_gd.gradient_sparsity(spec.Problem(LOGISTIC, 7, privacy)) == 8


@pytest.fixture(scope="module")
def click_parquet(tmp_path_factory):
    directory = tmp_path_factory.mktemp("click")
    log = synthetic.click_log(3000, seed=5, values=30)
    table = pa.table(log)
    for i in range(2):
        pq.write_table(table.slice(i * 1500, 1500), directory / f"part-{i}.parquet",
                       row_group_size=500)
    test = synthetic.click_log(2000, seed=5, split=1, values=30)
    return str(directory / "part-*.parquet"), test


def test_projection_trains_categorical_data_with_the_same_privacy(click_parquet):
    """Defaults a user gets (private count, epsilon, default preconditioning), only the estimator
    changed: the same mechanisms and epsilon in the report, the radius C sqrt(s) applied, and a
    model above the majority class."""
    pattern, test = click_parquet
    common = dict(input=pattern, epsilon=2.0, seed=3, runner="local",
                  categorical_columns=CATEGORICAL, hash_buckets=1 << 12)
    plain = _train(**common)
    projected = _train(gradient_estimator="projection", **common)
    assert projected.privacy_report["epsilon"] == pytest.approx(plain.privacy_report["epsilon"])
    assert ([m["name"] for m in projected.privacy_report["mechanisms"]]
            == [m["name"] for m in plain.privacy_report["mechanisms"]])
    assert not np.allclose(projected.theta, plain.theta)
    x = {c: test[c] for c in ["position", *CATEGORICAL]}
    y = np.asarray(test["label"])
    majority = max(y.mean(), 1 - y.mean())
    accuracy = float(np.mean(projected.predict(x) == y))
    assert accuracy > majority + 0.02, (accuracy, majority)


def test_projection_gives_the_same_model_on_beam_and_local(click_parquet):
    pattern, _ = click_parquet
    common = dict(input=pattern, noise_multiplier=2.0, num_examples=3000, seed=4, steps=3,
                  steps_per_job=2, categorical_columns=CATEGORICAL, hash_buckets=256,
                  gradient_estimator="projection", batch_rows=700)
    local = _train(runner="local", **common)
    beam = _train(runner="FnApiRunner", **common)
    np.testing.assert_allclose(beam.theta, local.theta, rtol=0, atol=1e-9)


def test_projection_refuses_secure_noise(tmp_path):
    x = np.random.default_rng(0).normal(size=(200, 3))
    y = (x[:, 0] > 0).astype(np.int64)
    with pytest.raises(ValueError, match="projection post-processes float noise"):
        _train(X=x, y=y, noise_multiplier=1.0, num_examples=200, steps=2, runner="local",
               gradient_estimator="projection", noise="secure")
    with pytest.raises(ValueError, match="--gradient-estimator must be one of"):
        _train(X=x, y=y, noise_multiplier=1.0, num_examples=200, steps=2, runner="local",
               gradient_estimator="l1")
