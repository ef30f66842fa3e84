"""The noise the drivers add: the Gaussian on each step's clipped sum and the Laplace count.

Seeded checks; each tolerance is the sampling distribution's quantile at a two-sided false-alarm
probability ALPHA (see the derivation next to each check).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from beam_dp import accounting, clipping, dataset_size, losses, mechanisms
from beam_dp.algorithms import gradient_step, noisy_gd
from beam_dp.algorithms.base import TrainState
from beam_dp.sampling import PoissonSampler

ALPHA = 1e-6

CLIP_NORM = 0.5
NOISE_MULTIPLIER = 1.3
NORMALIZER = 40.0         # the public expected batch size q * n
LEARNING_RATE = 2.0
CLASSES, DIM = 3, 50      # theta is (3, 51): 153 coordinates per step


# Both kinds of noise: "secure" (discrete Gaussian on the exact integer sum, scaled back by the
# grid) and "float" (numpy's Gaussian on a float sum). With the grid at 2^-39 C the discrete
# Gaussian's scale is ~4e11 grid units: its variance is sigma^2 to within 1e-20, so the same
# tolerances hold for both.
NOISES = pytest.mark.parametrize("noise", noisy_gd.NOISE_KINDS)


def _step(seed=2024, fit_intercept=True, noise="float"):
    return gradient_step.NoisyGradientStep(
        loss=losses.make_loss("softmax", num_classes=CLASSES), clip_norm=CLIP_NORM,
        noise_std=NOISE_MULTIPLIER * CLIP_NORM, normalizer=NORMALIZER,
        learning_rate=LEARNING_RATE, sampler=PoissonSampler(0.1, seed), seed=seed,
        shape=(CLASSES, DIM + 1), fit_intercept=fit_intercept, noise=noise)


def _theta0():
    return np.random.default_rng(0).standard_normal((CLASSES, DIM + 1))


def _as_total(step_fn, values):
    """A step's sum holding ``values`` (gradient units): for secure noise the exact integer sum
    nearest them on the step's grid."""
    if not step_fn.secure:
        return values
    grid = clipping.gradient_grid(step_fn.clip_norm, step_fn.scale_bits)
    return clipping.ExactSum.of(np.rint(values / grid))


def _noise_on_theta(step_fn, step, total=None):
    """theta_after - theta_before for one step from a state at ``step``."""
    theta0 = _theta0()
    state = TrainState(theta0.copy(), np.zeros_like(theta0), step)
    total = step_fn.zero_sum() if total is None else _as_total(step_fn, total)
    new = step_fn.apply(state, total)
    assert new.step == step + 1
    np.testing.assert_array_equal(new.theta_sum, new.theta)  # theta_sum was zero
    return new.theta - theta0


@NOISES
def test_noise_on_theta_has_the_calibrated_std(noise):
    step_fn = _step(noise=noise)
    steps = 40
    noise = np.stack([_noise_on_theta(step_fn, t) for t in range(steps)]).ravel()
    n = noise.size                                   # 40 * 153 = 6120 draws

    # With a zero total the update is theta -= lr * N(0, (sigma*C)^2) / normalizer, so every
    # coordinate is N(0, s^2) with s = lr * sigma * C / normalizer, independently.
    s = LEARNING_RATE * NOISE_MULTIPLIER * CLIP_NORM / NORMALIZER
    # The mean is known (0), so sum(x^2) / s^2 is chi-square with n degrees of freedom.
    chi2 = float(np.sum(noise**2) / s**2)
    assert stats.chi2.ppf(ALPHA / 2, n) < chi2 < stats.chi2.isf(ALPHA / 2, n)
    # And the sample mean is N(0, s^2 / n).
    assert abs(noise.mean()) < stats.norm.isf(ALPHA / 2) * s / np.sqrt(n)


@NOISES
def test_noise_is_added_to_the_total_and_normalized_by_the_public_constant(noise):
    step_fn = _step(noise=noise)
    total = np.random.default_rng(5).standard_normal((CLASSES, DIM + 1)) * 10
    with_total = _noise_on_theta(step_fn, 7, total)
    without = _noise_on_theta(step_fn, 7)
    # (Secure: the total on the grid, 2^-40 here, so within 1e-12 of it.)
    np.testing.assert_allclose(with_total - without, -LEARNING_RATE * total / NORMALIZER,
                               rtol=1e-11, atol=1e-11)


@NOISES
def test_same_seed_same_noise_other_seed_other_noise(noise):
    a = _noise_on_theta(_step(seed=31, noise=noise), 3)
    np.testing.assert_array_equal(a, _noise_on_theta(_step(seed=31, noise=noise), 3))
    assert not np.allclose(a, _noise_on_theta(_step(seed=32, noise=noise), 3))


@NOISES
def test_different_steps_draw_independent_noise(noise):
    step_fn = _step(noise=noise)
    steps = 60
    noise = np.stack([_noise_on_theta(step_fn, t).ravel() for t in range(steps)])
    # Pairs (step t, step t+1) of the same coordinate: for independent draws their sample
    # correlation over N pairs is approximately N(0, 1/N).
    x, y = noise[:-1].ravel(), noise[1:].ravel()
    r = np.corrcoef(x, y)[0, 1]
    assert abs(r) < stats.norm.isf(ALPHA / 2) / np.sqrt(x.size)
    # No two steps draw the same vector.
    assert len({row.tobytes() for row in noise}) == steps


@NOISES
def test_no_intercept_means_no_noise_on_the_intercept(noise):
    step_fn = _step(fit_intercept=False, noise=noise)
    for t in range(5):
        noise = _noise_on_theta(step_fn, t)
        assert np.all(noise[:, -1] == 0.0)
        assert np.all(noise[:, :-1] != 0.0)


def test_laplace_count_has_the_calibrated_scale():
    # The dataset size is released as round(count + Laplace(1/count_epsilon)). Over independent
    # seeds, e = released - count has mean 0 and variance 2 b^2 + 1/12 (b = 1/count_epsilon; the
    # rounding adds at most about 1/12, negligible next to 2 b^2 = 200).
    class Counts:
        def count(self):
            return 1000

    count_epsilon, seeds = 0.1, 4000
    config = noisy_gd.NoisyGDConfig(algorithm="dpsgd", batch_size=100, steps=1,
                                    noise_multiplier=1.0, count_epsilon=count_epsilon)
    released = np.array([
        dataset_size.release_dataset_size(config, Counts(), seed, accounting.Ledger())["value"]
        for seed in range(seeds)], dtype=float)
    errors = released - 1000
    b = 1.0 / count_epsilon
    var = 2 * b**2 + 1 / 12
    z = stats.norm.isf(ALPHA / 2)
    assert abs(errors.mean()) < z * np.sqrt(var / seeds)
    # E[e^2] estimated by the mean of e^2; a Laplace variable has E e^4 = 24 b^4, so
    # Var(e^2) = 24 b^4 - (2 b^2)^2 = 20 b^4 (rounding ignored, as above).
    assert abs(np.mean(errors**2) - var) < z * np.sqrt(20 * b**4 / seeds)


def test_rng_streams_are_independent_and_reproducible():
    a = mechanisms.rng(5, mechanisms.STREAM_NOISE, 0).standard_normal(4)
    np.testing.assert_array_equal(a, mechanisms.rng(5, mechanisms.STREAM_NOISE, 0).standard_normal(4))
    assert not np.allclose(a, mechanisms.rng(5, mechanisms.STREAM_SAMPLING, 0).standard_normal(4))
    assert not np.allclose(a, mechanisms.rng(5, mechanisms.STREAM_NOISE, 1).standard_normal(4))


def test_secure_seed_is_128_bits_and_fresh():
    seeds = {mechanisms.secure_seed() for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**128 for s in seeds)
    assert max(seeds) >= 2**64   # with probability 1 - 2^-512


# --------------------------------------------------- secure noise by default, float where it can't

def test_secure_noise_is_the_default_and_stands_back_where_it_cannot_be_used():
    """Default (no noise=): secure noise; where its grid cannot hold the noise (a noise multiplier
    of 0.001), float noise with a note in the report; an explicit noise="secure" refuses."""
    import beam_dp
    from beam_dp import secure_noise
    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, 3))
    y = (x[:, 0] > 0).astype(float)
    common = dict(algorithm="dpgd", num_examples=400, steps=3, seed=1)
    default = beam_dp.train(x, y, noise_multiplier=1.0, **common).privacy_report
    assert default["mechanisms"][-1]["noise"].startswith("discrete Gaussian on exact integer sums")
    assert not any("could not be used" in note for note in default["accounting_notes"])

    fallback = beam_dp.train(x, y, noise_multiplier=0.001, **common).privacy_report
    assert fallback["mechanisms"][-1]["noise"] == "float Gaussian (numpy) on float sums"
    assert any(note.startswith("secure noise is the default, but it could not be used")
               for note in fallback["accounting_notes"])
    with pytest.raises(secure_noise.SecureNoiseUnavailable, match="use --noise float"):
        beam_dp.train(x, y, noise_multiplier=0.001, noise="secure", **common)
