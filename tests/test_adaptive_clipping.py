"""Issue 15 item 3: dpsgd's and dpgd's quantile-based adaptive clipping (Andrew et al. 2021,
``adaptive_clipping.AdaptiveClipStep``, --adaptive-clip-quantile) and dp-ambssgd's private step size
(``dp_ambssgd.private_curvature``) with its divergence guard (``AmbssgdStep.check_iterate``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as events

from beam_dp import accounting, features, losses
from beam_dp.algorithms import adaptive_clipping, dp_ambssgd, noisy_gd
from beam_dp.block import Block
from beam_dp.local import LocalAggregator
from beam_dp.sampling import PoissonSampler


def _blocks(x, y, rows=5000):
    return [Block(x[i:i + rows], y[i:i + rows], "mem", i) for i in range(0, len(y), rows)]


# ====================================================================== 1. adaptive clipping

def _norms_problem(n=5000, d=3, seed=0):
    """Linear regression rows whose gradient norms at theta = 0, |y| sqrt(||x||^2 + 1), spread
    over two orders of magnitude."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, d))
    y = np.exp(g.normal(0.0, 1.0, n)) * g.choice([-1.0, 1.0], n)
    return x, y, np.abs(y) * np.sqrt(np.sum(x * x, axis=1) + 1.0)


@pytest.mark.parametrize("target", [0.3, 0.7])
def test_clip_norm_converges_to_the_target_quantile_of_the_gradient_norms(target):
    # theta stays at ~0 (learning rate 1e-12), so the per-row gradient norms are fixed and known.
    # Starting 100x too high, the clip norm must settle where a fraction `target` of the norms
    # lies below it. Tolerance: with x_t = F(C_t) - gamma ~ kappa (log C_t - log C*),
    # x_{t+1} = (1 - eta kappa) x_t - eta kappa e_t, e_t the noisy fraction's error of std
    # s = sqrt(gamma / B + (sigma_b / B)^2); stationary std sqrt(eta kappa / (2 - eta kappa)) s,
    # kappa = dF / dlog C <= 0.5 here (log-normal norms), so 4 std at kappa = 1 bounds the last
    # iterate's error with room; the mean of the last 100 iterates is tighter still.
    x, y, norms = _norms_problem()
    n, batch = len(y), 500
    config = noisy_gd.NoisyGDConfig(algorithm="dpsgd", noise_multiplier=1.0, num_examples=n,
                                    batch_size=batch, steps=400, learning_rate=1e-12,
                                    clip_norm=100.0 * float(np.quantile(norms, target)),
                                    noise="float", adaptive_clip_quantile=target)
    result = noisy_gd.train(config, losses.SquaredLoss(), 3, LocalAggregator(_blocks(x, y)), 4,
                            accounting.Ledger())
    summary = result.preprocessing["adaptive_clipping"]
    sigma_b = summary["count_noise_std"]
    assert sigma_b == pytest.approx(max(batch / 20, 10 * 1.0))
    s = math.sqrt(target / batch + (sigma_b / batch) ** 2)
    eta = config.adaptive_clip_rate
    tolerance = 4 * math.sqrt(eta / (2 - eta)) * s
    final = summary["final_clip_norm"]
    assert abs(np.mean(norms <= final) - target) <= tolerance, (np.mean(norms <= final), tolerance)
    assert result.clip_norm is None and summary["initial_clip_norm"] == config.clip_norm


def test_the_ledger_holds_the_counts_events_and_meets_the_target():
    x, y, _ = _norms_problem(n=4000)
    config = noisy_gd.NoisyGDConfig(algorithm="dpsgd", epsilon=1.0, delta=1e-5, num_examples=4000,
                                    batch_size=200, epochs=2, noise="float",
                                    adaptive_clip_quantile=0.5)
    ledger = accounting.Ledger()
    result = noisy_gd.train(config, losses.SquaredLoss(), 3, LocalAggregator(_blocks(x, y)), 1,
                            ledger)
    (steps,) = [r for r in ledger.releases if "clipped_gradient_sum" in r.name]
    sigma, q = result.noise_multiplier, result.sampling_probability
    sigma_b = max(200 / 20, 10 * sigma)
    assert steps.count == result.steps == 40
    assert steps.event == events.PoissonSampledDpEvent(q, events.ComposedDpEvent(
        [events.GaussianDpEvent(sigma), events.GaussianDpEvent(sigma_b)]))
    assert steps.params["count_noise_std"] == sigma_b
    epsilon = accounting.epsilon_of(ledger.event(), 1e-5)
    assert 1.0 * (1 - 2 * accounting.CALIBRATION_TOLERANCE) <= epsilon <= 1.0


def test_pld_composes_the_subsampled_pair_as_dp_accountings_rdp_does():
    # The PLD accountant reads PoissonSampled(Composed([Gaussian, Gaussian])) through
    # accounting.merged_gaussians; dp_accounting's own RDP accountant composes it natively.
    # Both must agree with the single Gaussian of multiplier (s1^-2 + s2^-2)^(-1/2), to the bit
    # for RDP, and the PLD must stay below the RDP bound and within its usual gap of it.
    import dp_accounting
    pair = events.SelfComposedDpEvent(events.PoissonSampledDpEvent(0.02, events.ComposedDpEvent(
        [events.GaussianDpEvent(1.1), events.GaussianDpEvent(4.0)])), 300)
    single = events.SelfComposedDpEvent(events.PoissonSampledDpEvent(
        0.02, events.GaussianDpEvent((1.1 ** -2 + 4.0 ** -2) ** -0.5)), 300)
    native = dp_accounting.rdp.RdpAccountant().compose(pair).get_epsilon(1e-5)
    assert native == dp_accounting.rdp.RdpAccountant().compose(single).get_epsilon(1e-5)
    assert accounting.epsilon_of(pair, 1e-5, "pld") == accounting.epsilon_of(single, 1e-5, "pld")
    assert 0.7 * native <= accounting.epsilon_of(pair, 1e-5, "pld") <= native


def test_the_realized_batch_size_never_enters_the_released_values():
    # Two batches with the same clipped sum and the same count of rows below C but different
    # sizes: batch B is batch A plus 40 pairs of rows whose gradients (norm 100 sqrt(2) > C)
    # cancel exactly after clipping. The releases (theta, next clip norm) must be identical:
    # a fraction divided by the realized size (A: 10 rows, B: 90) would differ by 9x.
    step = adaptive_clipping.AdaptiveClipStep(
        loss=losses.SquaredLoss(), clip_norm=1.0, noise_std=1.0, normalizer=50.0,
        learning_rate=0.5, sampler=PoissonSampler(0.1, 7), seed=3, shape=(1, 2),
        noise_multiplier=1.0, count_noise_std=2.5, target_quantile=0.5, clip_rate=0.2)
    g = np.random.default_rng(0)
    xa, ya = g.uniform(-0.3, 0.3, (10, 1)), g.uniform(-0.3, 0.3, 10)   # all below C = 1
    xb = np.vstack([xa, np.ones((80, 1))])
    yb = np.concatenate([ya, np.tile([100.0, -100.0], 40)])
    state = adaptive_clipping.AdaptiveClipState(np.zeros((1, 2)), np.zeros((1, 2)), 0, clip_norm=1.0)
    totals = [step.selected_sum(Block(x, y, "mem", 0), state) for x, y in ((xa, ya), (xb, yb))]
    assert totals[0][-1] == totals[1][-1] == 10
    after = [step.apply(state, t) for t in totals]
    np.testing.assert_allclose(after[0].theta, after[1].theta, rtol=0, atol=1e-12)
    assert after[0].clip_norm == after[1].clip_norm != 1.0
    # ... and the fraction is divided by the public normalizer: C exp(-eta ((10 + z) / 50 - 0.5))
    # with z the count's noise, |z| < 6 std.
    low, high = (math.exp(-0.2 * ((10 + z) / 50 - 0.5)) for z in (15.0, -15.0))
    assert low < after[0].clip_norm < high


def test_adaptive_clipping_is_dpsgds_option_and_refuses_secure_noise():
    import beam_dp
    x, y, _ = _norms_problem(n=2000)
    labels = (y > 0).astype(float)
    model = beam_dp.train(x, labels, algorithm="dpsgd", model="logistic", epsilon=1.0, seed=0,
                          batch_size=200, epochs=1, adaptive_clip_quantile=0.5,
                          num_examples=len(labels))
    report = model.privacy_report
    assert report["preprocessing"]["adaptive_clipping"]["target_quantile"] == 0.5
    assert any("float Gaussian" in note for note in report["accounting_notes"])
    with pytest.raises(ValueError, match="use --noise float"):
        beam_dp.train(x, labels, algorithm="dpsgd", model="logistic", epsilon=1.0, seed=0,
                      noise="secure", adaptive_clip_quantile=0.5)


# ------------------------------------------------- dpgd: the same kernel on every row (q = 1)

@pytest.mark.parametrize("target", [0.3, 0.8])
def test_dpgd_clip_norm_moves_to_the_target_quantile_of_every_rows_norms(target):
    # Full batch: no sampling error, only the count's Gaussian, of std sigma_b = max(n / 20,
    # 10 sigma) rows = n / 20 here (sigma = 1), so the noisy fraction's error has std
    # s = sigma_b / n = 0.05 (the public n). With the same linearization as above
    # (x_{t+1} = (1 - eta kappa) x_t - eta kappa e_t, kappa <= 1) the stationary std of
    # F(C_t) - gamma is at most sqrt(eta / (2 - eta)) s; 4 of them bound the last iterate.
    x, y, norms = _norms_problem()
    n = len(y)
    config = noisy_gd.NoisyGDConfig(algorithm="dpgd", noise_multiplier=1.0, num_examples=n,
                                    steps=150, learning_rate=1e-12,
                                    clip_norm=100.0 * float(np.quantile(norms, target)),
                                    noise="float", adaptive_clip_quantile=target)
    result = noisy_gd.train(config, losses.SquaredLoss(), 3, LocalAggregator(_blocks(x, y)), 5,
                            accounting.Ledger())
    summary = result.preprocessing["adaptive_clipping"]
    assert result.sampling_probability == 1.0 and summary["count_normalizer"] == n
    assert summary["count_noise_std"] == pytest.approx(n / 20)
    eta = config.adaptive_clip_rate
    tolerance = 4 * math.sqrt(eta / (2 - eta)) * (summary["count_noise_std"] / n)
    final = summary["final_clip_norm"]
    assert abs(np.mean(norms <= final) - target) <= tolerance, (np.mean(norms <= final), tolerance)


def test_dpgd_ledger_composes_each_steps_count_with_its_gaussian_and_meets_the_target():
    x, y, _ = _norms_problem(n=3000)
    ledger = accounting.Ledger()
    config = noisy_gd.NoisyGDConfig(algorithm="dpgd", epsilon=1.0, delta=1e-5, noise="float",
                                    steps=30, adaptive_clip_quantile=0.5)   # private count
    result = noisy_gd.train(config, losses.SquaredLoss(), 3, LocalAggregator(_blocks(x, y)), 2,
                            ledger)
    count, steps = ledger.releases
    assert count.name == "laplace_count"
    sigma, n = result.noise_multiplier, result.dataset_size["value"]
    sigma_b = max(n / 20, 10 * sigma)   # the normalizer is max(n, floor) = n at n = 3000
    assert steps.name == "gaussian_clipped_gradient_sum" and steps.count == result.steps == 30
    # q = 1: the pair itself, not Poisson-sampled.
    assert steps.event == events.ComposedDpEvent([events.GaussianDpEvent(sigma),
                                                  events.GaussianDpEvent(sigma_b)])
    assert steps.params["count_noise_std"] == pytest.approx(sigma_b)
    epsilon = accounting.epsilon_of(ledger.event(), 1e-5)
    assert 1.0 * (1 - 2 * accounting.CALIBRATION_TOLERANCE) <= epsilon <= 1.0


def test_dpgd_takes_adaptive_clipping_with_float_noise_and_says_so():
    import beam_dp
    x, y, _ = _norms_problem(n=2000)
    labels = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(float)
    model = beam_dp.train(x, labels, algorithm="dpgd", model="logistic", epsilon=1.0, seed=0,
                          adaptive_clip_quantile=0.5, num_examples=len(labels))
    report = model.privacy_report
    assert report["preprocessing"]["adaptive_clipping"]["target_quantile"] == 0.5
    assert report["epsilon"] <= 1.0
    assert any("float Gaussian" in note for note in report["accounting_notes"])
    with pytest.raises(ValueError, match="use --noise float"):
        beam_dp.train(x, labels, algorithm="dpgd", epsilon=1.0, seed=0, noise="secure",
                      adaptive_clip_quantile=0.5)


# ============================================================ 2. dp-ambssgd's private step size

def _diamonds_like(n=40000, seed=0):
    """Unstandardized, strongly correlated columns of norms ~10-1000 (as ggplot2's diamonds: a
    size, three lengths proportional to it, two percentages near 60), and a label driven by the
    size: the fixed step size 1 is ~10^5 times too large for their curvature."""
    g = np.random.default_rng(seed)
    size = g.gamma(4.0, 0.2, n)
    lengths = 6.0 * size[:, None] ** (1 / 3) * g.normal(1.0, 0.02, (n, 3))
    x = np.column_stack([size, lengths, g.normal(62.0, 1.5, n), g.normal(57.0, 2.0, n),
                         g.normal(800.0, 100.0, n) + 200.0 * size])
    y = 4000.0 * size + 300.0 * g.standard_normal(n) - 800.0
    return x, y


def test_dp_ambssgd_private_step_size_fits_unscaled_correlated_features():
    # Before (learning rate 1) this diverged (the guard now stops it, below); with the private
    # step size it must beat the constant predictor on held-out rows, at each of 3 seeds.
    x, y = _diamonds_like()
    xt, yt = _diamonds_like(5000, seed=99)
    held_out = Block(xt, yt, "mem", 0)
    constant = float(np.sqrt(np.mean((yt - y.mean()) ** 2)))
    for seed in range(3):
        config = noisy_gd.NoisyGDConfig(epsilon=1.0, delta=1e-5, num_examples=len(y),
                                        noise="float")
        ledger = accounting.Ledger()
        result = dp_ambssgd.train(config, dp_ambssgd.AmbssgdConfig(), losses.SquaredLoss(), x.shape[1],
                                  LocalAggregator(_blocks(x, y)), seed, ledger,
                                  private_step_size=True)
        # The model's own map (private standardization, recorded in model.json) on raw rows.
        mapped = features.from_spec(result.feature_transform)(held_out).features
        rmse = float(np.sqrt(np.mean((mapped @ result.theta[0, :-1] + result.theta[0, -1] - yt) ** 2)))
        assert rmse < 0.9 * constant, (seed, rmse, constant)
        names = [r.name for r in ledger.releases]
        assert {"exponential_mechanism_quantile", "gaussian_second_moment_matrix"} <= set(names)
        assert ledger.epsilon(1e-5) <= 1.0
        assert result.preprocessing["private_step_size"]["standardize"].startswith("private")


def test_the_divergence_guard_stops_a_diverging_run_without_data_values(monkeypatch):
    # Forced: the private step size times 1000, far beyond 2 / lambda_max. Every gradient is
    # clipped, so the iterate swings (amplitude ~ eta R_x B) rather than explodes; the guard
    # stops the run once ||theta|| r passes 10 B, with public numbers only (r the mapped rows'
    # nominal norm under --standardize private: sqrt(PERCENTILE_SPAN^2 d + 1)).
    x, y = _diamonds_like()
    monkeypatch.setattr(dp_ambssgd, "STEP_FACTOR", 1e3)
    config = noisy_gd.NoisyGDConfig(epsilon=1.0, delta=1e-5, num_examples=len(y), noise="float")
    with pytest.raises(dp_ambssgd.DivergenceError, match="diverged at step") as caught:
        dp_ambssgd.train(config, dp_ambssgd.AmbssgdConfig(), losses.SquaredLoss(), x.shape[1],
                         LocalAggregator(_blocks(x, y)), 0, accounting.Ledger(),
                         private_step_size=True)
    message = str(caught.value)
    radius = math.sqrt(dp_ambssgd.PERCENTILE_SPAN ** 2 * x.shape[1] + 1)
    assert f"{10 * 1e4 / radius:.3g}" in message
    assert not any(f"{v:.3g}" in message for v in (float(y.mean()), float(np.abs(x).max())))


def test_the_guard_lets_converging_runs_through():
    # The guard's bound is public and generous: standardized Gaussian data at the old default
    # step size 1 (paper 003's setting) and the private one both finish.
    g = np.random.default_rng(2)
    x = g.standard_normal((20000, 5))
    y = 1000.0 * (x @ np.full(5, 0.4)) + 50.0 * g.standard_normal(20000)
    for private, rate in ((False, 1.0), (True, 1.0)):
        config = noisy_gd.NoisyGDConfig(epsilon=1.0, delta=1e-5, num_examples=len(y),
                                        noise="float", learning_rate=rate)
        result = dp_ambssgd.train(config, dp_ambssgd.AmbssgdConfig(), losses.SquaredLoss(), 5,
                                  LocalAggregator(_blocks(x, y)), 0, accounting.Ledger(),
                                  private_step_size=private)
        assert np.all(np.isfinite(result.theta))


def test_secure_second_moment_matrix_is_exact_and_bundling_free():
    # --noise secure (the default): the shrunk rows on a power-of-two grid, an exact integer
    # Gram matrix, discrete Gaussian noise of scale sigma L^2 grid units = sigma r^2 in data
    # units. At sigma = 1e-3 the release is the clipped rows' second moment within 6 std of the
    # noise (plus the grid's rounding, below 1e-9 here), and any split of the rows into blocks
    # gives the same bits.
    from beam_dp import stats
    g = np.random.default_rng(5)
    x = g.normal(0.0, 2.0, (2000, 3))
    radius = 3.0
    stage = stats.SecondMomentStage("h", 3, radius, 1e-3, 11, (0,), noise="secure")
    whole = stage.partial_sum(Block(x, np.zeros(2000), "mem", 0), {})
    parts = [stage.partial_sum(Block(x[a:b], np.zeros(b - a), "mem", a), {})
             for a, b in ((0, 700), (700, 2000))]
    assert parts[0] + parts[1] == whole
    released = stage.apply({"n": 2000}, whole)["h"]
    z = np.column_stack([x, np.ones(2000)])
    norms = np.linalg.norm(z, axis=1)
    z = z * np.minimum(1.0, radius / norms)[:, None]
    exact = z.T @ z / 2000
    np.testing.assert_allclose(released, exact, rtol=0, atol=6 * 1e-3 * radius ** 2 / 2000 + 1e-9)
    np.testing.assert_array_equal(released, released.T)
    (name, event, count, params), = stage.releases()
    assert event == events.GaussianDpEvent(1e-3) and params["sampler_total_variation"] > 0
