"""Private statistics (``beam_dp.stats``): noise calibration, the exponential-mechanism quantile's
rank guarantee, the adaptive mean, pure-DP accounting, and runner equivalence through ``beam-dp``.

Statistical checks are seeded. Each tolerance is the quantile, at a two-sided false-alarm
probability ALPHA, of the sampling distribution that the mechanism's documented noise implies (the
derivation is next to each check), so a correct implementation fails a check with probability at
most ALPHA and a wrong noise scale fails it almost surely. Reference values are computed here
directly (numpy, scipy, dp_accounting), not with the helpers under test.

Beam runs pin ``--runner FnApiRunner`` (Beam's in-process runner).
"""
from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from dp_accounting import dp_event as ev
from scipy import optimize
from scipy import stats as st

from beam_dp import accounting, stats, synthetic
from beam_dp.block import Block
from beam_dp.local import LocalAggregator
from conftest import model_theta, read_json

ALPHA = 1e-6
BEAM = ["--runner", "FnApiRunner"]
LOCAL = ["--runner", "local"]


def _blocks(x, rows_per_block=137, labels=None):
    """``x`` (n, d) as several Blocks of uneven size (the last one shorter)."""
    labels = np.zeros(len(x)) if labels is None else labels
    return [Block(x[i:i + rows_per_block], labels[i:i + rows_per_block], "mem", i)
            for i in range(0, len(x), rows_per_block)]


def _chi2_interval(dof):
    """Two-sided ALPHA acceptance interval of a chi-square variable with ``dof`` degrees."""
    return st.chi2.ppf(ALPHA / 2, dof), st.chi2.isf(ALPHA / 2, dof)


def _check_gaussian(errors, std):
    """``errors`` (seeds, d) should be i.i.d. N(0, std^2).

    * sum(e^2) / std^2 is chi-square with N = seeds * d degrees of freedom (the mean is known to
      be 0), so it must lie in the two-sided ALPHA interval of chi2(N). With N ~ 10^4 the
      interval is about +-5 sqrt(2/N) ~ +-7% of N: a noise std off by 4% fails it.
    * each coordinate's mean over the seeds is N(0, std^2 / seeds): |mean| < z std / sqrt(seeds),
      z the two-sided ALPHA / d normal quantile (Bonferroni over the d coordinates).
    """
    seeds, d = errors.shape
    n = errors.size
    lo, hi = _chi2_interval(n)
    chi2 = float(np.sum(errors ** 2) / std ** 2)
    assert lo < chi2 < hi, (chi2, lo, hi, np.sqrt(np.mean(errors ** 2)) / std)
    z = st.norm.isf(ALPHA / (2 * d))
    assert np.all(np.abs(errors.mean(axis=0)) < z * std / math.sqrt(seeds)), errors.mean(axis=0)


# ===================================================================== 1. noise calibration


def _clip_data(seed=5, n=400, d=3):
    """Points around CENTER, about half of them farther than RADIUS (so clipping matters), and a
    few far outliers."""
    g = np.random.default_rng(seed)
    direction = g.standard_normal((n, d))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    dist = g.uniform(0.0, 2 * RADIUS, n)
    dist[:10] = 1e4
    return CENTER + direction * dist[:, None]


CENTER = np.array([1.0, -1.0, 0.5])
RADIUS = 2.0


def _exact_clipped_mean(x, center, radius, n):
    """center + (1/n) sum_i clip(x_i - center, radius), one row at a time."""
    total = np.zeros(x.shape[1])
    for row in x:
        v = row - center
        norm = math.sqrt(float(v @ v))
        total += v if norm <= radius else v * (radius / norm)
    return center + total / n


def test_clipped_mean_without_noise_is_the_exact_clipped_mean():
    x = _clip_data()
    n = len(x)
    agg = LocalAggregator(_blocks(x))
    exact = _exact_clipped_mean(x, CENTER, RADIUS, n)
    # Wrong-center and no-clipping answers differ clearly from the right one.
    assert np.linalg.norm(exact - _exact_clipped_mean(x, 0 * CENTER, RADIUS, n)) > 0.5
    assert np.linalg.norm(exact - x.mean(axis=0)) > 0.5

    stage = stats.ClippedMeanStage("m", stats.Columns(), 3, CENTER, RADIUS, 0.0, seed=1)
    np.testing.assert_allclose(agg.run_stages([stage], {"n": n})["m"], exact, rtol=1e-12, atol=1e-12)
    # The center and the radius may be the names of earlier releases in the state; n is the
    # released (here deliberately different) count.
    by_name = stats.ClippedMeanStage("m", stats.Columns(), 3, "c", "r", 0.0, seed=1)
    state = agg.run_stages([by_name], {"n": 500, "c": CENTER.reshape(3, 1), "r": np.array([[RADIUS]])})
    np.testing.assert_allclose(state["m"], _exact_clipped_mean(x, CENTER, RADIUS, 500), rtol=1e-12)


def test_clipped_mean_noise_has_std_noise_multiplier_times_radius():
    # released = center + (clipped sum + N(0, (sigma R)^2 I)) / n, so over independent seeds
    # n * (released - exact clipped mean) is N(0, (sigma R)^2) in every coordinate.
    x = _clip_data()
    n = len(x)
    agg = LocalAggregator(_blocks(x))
    sigma = 1.7
    exact = _exact_clipped_mean(x, CENTER, RADIUS, n)
    seeds = 3000                                              # 9000 draws
    errors = np.stack([
        n * (agg.run_stages([stats.ClippedMeanStage("m", stats.Columns(), 3, CENTER, RADIUS, sigma,
                                                    seed=s)], {"n": n})["m"] - exact)
        for s in range(seeds)])
    _check_gaussian(errors, sigma * RADIUS)


@pytest.mark.parametrize("epsilon,expected", [(1.0, 3.7306), (0.1, 30.7496), (0.05, 57.771),
                                              (0.02, 131.797)])
def test_gaussian_noise_multiplier_is_the_analytic_gaussian(epsilon, expected):
    delta = 1e-5
    sigma = stats.gaussian_noise_multiplier(epsilon, delta)
    # The table of the paper note (section 2), given to 4-5 significant digits.
    assert sigma == pytest.approx(expected, abs=6e-4)

    # Balle & Wang (2018), Theorem 8, sensitivity 1: the Gaussian mechanism with std sigma is
    # (eps, delta(sigma))-DP exactly for delta(sigma) = Phi(1/(2 sigma) - eps sigma)
    # - e^eps Phi(-1/(2 sigma) - eps sigma), decreasing in sigma. The calibrated sigma is its root.
    def delta_of(s):
        return (st.norm.cdf(0.5 / s - epsilon * s)
                - math.exp(epsilon) * st.norm.cdf(-0.5 / s - epsilon * s))
    assert delta_of(sigma) == pytest.approx(delta, rel=1e-6)
    assert delta_of(sigma * (1 - 1e-4)) > delta  # no smaller multiplier would do


def test_count_stage_laplace_noise_has_variance_two_over_epsilon_squared():
    # The count is released as max(1, round(n + Laplace(b))), b = 1/epsilon. With n = 1000 and
    # b = 10 the floor at 1 never binds (P ~ e^-100). e = released - n has mean ~0 and
    # variance 2 b^2 + ~1/12 (rounding; negligible next to 200). Checks (CLT over the seeds):
    #   |mean e| < z sqrt(var / S);
    #   |mean e^2 - var| < z sqrt(Var(e^2) / S), with Var(L^2) = E L^4 - (E L^2)^2
    #   = 24 b^4 - 4 b^4 = 20 b^4 for a Laplace variable.
    # The second is a +-4.4% band on the variance at S = 20000: a scale off by 5% fails it.
    n, epsilon, seeds = 1000, 0.1, 20000
    agg = LocalAggregator(_blocks(np.zeros((n, 1))))
    released = np.array([agg.run_stages([stats.CountStage(epsilon, seed=s)], {})["n"]
                         for s in range(seeds)], dtype=float)
    e = released - n
    b = 1.0 / epsilon
    var = 2 * b ** 2 + 1 / 12
    z = st.norm.isf(ALPHA / 2)
    assert abs(e.mean()) < z * math.sqrt(var / seeds)
    assert abs(np.mean(e ** 2) - var) < z * math.sqrt(20 * b ** 4 / seeds), np.mean(e ** 2) / var


def test_count_stage_writes_its_key_and_records_laplace():
    agg = LocalAggregator(_blocks(np.zeros((7, 1)), rows_per_block=3))
    state = agg.run_stages([stats.CountStage(1e6, seed=0, key="rows")], {"other": 1})
    assert state == {"other": 1, "rows": 7}
    [(name, event, count, params)] = stats.CountStage(0.5, seed=0).releases()
    assert (name, event, count) == ("laplace_count", ev.LaplaceDpEvent(2.0), 1)


def _box_setup():
    g = np.random.default_rng(9)
    x = g.standard_normal((500, 3)) * np.array([1.0, 10.0, 0.1]) + np.array([0.0, 5.0, -1.0])
    # Released bounds as a QuantileStage writes them: (columns, quantiles), lo in column 0 and
    # hi in column 2. Column 2 has hi < lo (a possible noisy release): its range collapses to lo.
    bounds = np.array([[-1.5, 0.0, 1.0],
                       [-2.0, 5.0, 20.0],
                       [-0.9, -1.0, -1.2]])
    return x, bounds


def _exact_box_mean(x, bounds):
    lo = bounds[:, 0]
    hi = np.maximum(bounds[:, 2], lo)
    return np.array([np.mean([min(max(v, lo[j]), hi[j]) for v in x[:, j]]) for j in range(3)]), lo, hi


def test_box_mean_without_noise_is_the_exact_clipped_mean():
    x, bounds = _box_setup()
    exact, _, _ = _exact_box_mean(x, bounds)
    stage = stats.BoxMeanStage("m", stats.Columns(), 3, "b", 0, 2, 0.0, seed=0)
    state = LocalAggregator(_blocks(x)).run_stages([stage], {"n": len(x), "b": bounds})
    np.testing.assert_allclose(state["m"], exact, rtol=1e-12, atol=1e-12)


def test_box_mean_noise_std_is_noise_multiplier_times_half_range_norm():
    # One example moves the sum of values clipped to [lo, hi] (centered at the midpoints) by at
    # most ||(hi - lo)/2||_2, the sensitivity; n * (released - exact) is N(0, (sigma * that)^2)
    # before the release is clamped to [lo, hi] (where the exact clipped mean lies). Columns 0
    # and 1 are >= 60 noise stds (std / n = 0.018) inside their ranges, so the clamp never binds
    # there; column 2's range is a single point, so its release is exactly lo.
    x, bounds = _box_setup()
    n = len(x)
    exact, lo, hi = _exact_box_mean(x, bounds)
    sigma = 0.8
    std = sigma * math.sqrt(float(np.sum(((hi - lo) / 2) ** 2)))   # = 0.8 * sqrt(1.25^2 + 11^2)
    agg = LocalAggregator(_blocks(x))
    seeds = 3000
    released = np.stack([
        agg.run_stages([stats.BoxMeanStage("m", stats.Columns(), 3, "b", 0, 2, sigma, seed=s)],
                       {"n": n, "b": bounds})["m"]
        for s in range(seeds)])
    _check_gaussian(n * (released[:, :2] - exact[:2]), std)
    assert np.all(released[:, 2] == lo[2])


# ================================================================ 2. quantile rank error


def _ranks(values, grid, i):
    """(#{v <= g_{i-1}}, #{v <= g_i}) counted directly (no histogram); #{v <= g_{-1}} = 0."""
    upper = int(np.count_nonzero(values <= grid[i]))
    lower = int(np.count_nonzero(values <= grid[i - 1])) if i > 0 else 0
    return lower, upper


def _run_mechanism(values, grid, rank, epsilon, trials, seed):
    """Indices of the grid points chosen in ``trials`` independent runs."""
    counts = stats.histogram(values[:, None], grid[None, :])[0]
    gen = np.random.default_rng(seed)
    index = {float(g): i for i, g in enumerate(grid)}
    return [index[stats.exponential_mechanism_quantile(counts, grid, rank, epsilon, gen)]
            for _ in range(trials)]


def test_exponential_mechanism_samples_exp_epsilon_utility_over_two():
    # Values 10 per cell in 5 cells: cell i covers the ranks [10 i, 10 (i + 1)]. Target rank 25:
    # utilities u = -(15, 5, 0, 5, 15); the exponential mechanism with sensitivity 1 picks cell i
    # with probability exp(eps u_i / 2) / sum_j exp(eps u_j / 2). Pearson's chi-square statistic
    # of the cell frequencies has 4 degrees of freedom; it must be under the ALPHA quantile.
    # (With exp(eps u) instead, i.e. the /2 dropped and twice the budget spent, the expected
    # frequencies move by ~0.1 and the statistic is in the thousands.)
    grid = np.arange(5.0)
    values = np.repeat(grid, 10)
    epsilon, rank, trials = 0.2, 25.0, 20000
    utility = -np.array([15.0, 5.0, 0.0, 5.0, 15.0])
    p = np.exp(epsilon * utility / 2)
    p /= p.sum()
    chosen = np.bincount(_run_mechanism(values, grid, rank, epsilon, trials, seed=3), minlength=5)
    chi2 = float(np.sum((chosen - trials * p) ** 2 / (trials * p)))
    assert chi2 < st.chi2.isf(ALPHA, 4), (chosen / trials, p)


def _tight_below(epsilon, zeta, size=64, n=1000, rank=500.0):
    """All but one cell violate the lower side by the least possible amount: a points (the
    largest integer below rank - E) sit in cell 0, the rest in the last cell. Cells 0..G-2 then
    have #{v <= g_i} = a < rank - E and utility -(rank - a) in (-E - 1, -E]; the last cell holds
    the rank. The violation probability is (G-1) e^{-eps (rank - a)/2} / (1 + that) <~ zeta, so
    this instance nearly attains the bound."""
    e = stats.quantile_rank_error_bound(size, epsilon, zeta)
    a = math.ceil(rank - e) - 1
    grid = np.arange(float(size))
    values = np.concatenate([np.zeros(a), np.full(n - a, size - 1.0)])
    bad = (size - 1) * math.exp(-epsilon * (rank - a) / 2)
    return values, grid, rank, bad / (1 + bad)


def _tight_above(epsilon, zeta, size=64, n=1000, rank=500.0):
    """The mirror image: b points (the smallest integer above rank + E) in cell 0, so every other
    cell has #{v <= g_{i-1}} = b > rank + E."""
    e = stats.quantile_rank_error_bound(size, epsilon, zeta)
    b = math.floor(rank + e) + 1
    grid = np.arange(float(size))
    values = np.concatenate([np.zeros(b), np.full(n - b, size - 1.0)])
    bad = (size - 1) * math.exp(-epsilon * (b - rank) / 2)
    return values, grid, rank, bad / (1 + bad)


def _continuous(epsilon, zeta):
    values = np.random.default_rng(1).standard_normal(2000)
    return values, np.linspace(-4, 4, 256), 0.1 * 2000, None


def _point_masses(epsilon, zeta):
    # 40% of the values exactly at 0 and 20% exactly at 1.0, both grid points (ties with the
    # grid: #{v <= g} must count them), the rest continuous; rank 1000 lies inside the mass at 0
    # (it covers the ranks ~[400, 1200]).
    g = np.random.default_rng(2)
    values = np.concatenate([np.zeros(800), np.ones(400), g.standard_normal(800)])
    return values, np.linspace(-4, 4, 257), 1000.0, None


@pytest.mark.parametrize("instance", [_continuous, _point_masses, _tight_below, _tight_above],
                         ids=["continuous", "point-masses", "tight-below", "tight-above"])
def test_quantile_rank_error_guarantee(instance):
    # Guarantee: with probability >= 1 - zeta the chosen g_i has #{v <= g_i} >= rank - E and
    # #{v <= g_{i-1}} <= rank + E, E = quantile_rank_error_bound(G, eps, zeta). The number of
    # violating trials is Binomial(trials, p) with p <= zeta; it must not exceed the
    # (1 - ALPHA) quantile of Binomial(trials, zeta).
    epsilon, zeta, trials = 1.0, 0.1, 4000
    values, grid, rank, exact_rate = instance(epsilon, zeta)
    e = stats.quantile_rank_error_bound(len(grid), epsilon, zeta)
    assert e == pytest.approx(2.0 / epsilon * math.log(len(grid) / zeta))
    violations = 0
    for i in _run_mechanism(values, grid, rank, epsilon, trials, seed=7):
        lower, upper = _ranks(values, grid, i)
        violations += not (upper >= rank - e and lower <= rank + e)
    assert violations <= st.binom.isf(ALPHA, trials, zeta), violations / trials
    if exact_rate is not None:
        # The tight instances: the violation rate is the exponential mechanism's exactly
        # (two-sided binomial ALPHA interval), and close to zeta, so the bound is not vacuous.
        assert exact_rate > 0.8 * zeta
        assert (st.binom.ppf(ALPHA / 2, trials, exact_rate) <= violations
                <= st.binom.isf(ALPHA / 2, trials, exact_rate)), (violations / trials, exact_rate)


@pytest.mark.parametrize("rank", [0.0, 1.0, 333.0, 1000.0, 1199.5, 2000.0])
def test_large_epsilon_picks_the_cell_holding_the_rank(rank):
    # With eps = 200 any cell whose rank interval misses the target by >= 1 is e^{-100} times as
    # likely as the right one: every trial must return a g_i with
    # #{v <= g_{i-1}} <= rank <= #{v <= g_i}, including ranks inside the point mass at 0.
    values, grid, _, _ = _point_masses(200.0, 0.1)
    for i in _run_mechanism(values, grid, rank, 200.0, 200, seed=11):
        lower, upper = _ranks(values, grid, i)
        assert lower <= rank <= upper, (rank, lower, upper)


def test_quantile_stage_targets_rank_p_n_minus_outliers():
    # Two columns, quantiles p in {0, 0.25, 0.5, 1}; the target rank is clamp(p n - outliers, 0, n)
    # with n the released count in the state. Large eps: every release is the exact cell.
    g = np.random.default_rng(4)
    x = np.column_stack([g.standard_normal(1500), g.exponential(2.0, 1500)])
    grid = np.vstack([np.linspace(-4, 4, 300), np.linspace(0, 20, 300)])
    qs, outliers, n = (0.0, 0.25, 0.5, 1.0), 30.0, 1500
    stage = stats.QuantileStage("q", stats.Columns(), stats.FixedGrid(grid), 2, 300, qs, 200.0,
                                seed=0, outliers=outliers)
    out = LocalAggregator(_blocks(x)).run_stages([stage], {"n": n})["q"]
    assert out.shape == (2, 4)
    for c in range(2):
        for k, p in enumerate(qs):
            rank = min(max(p * n - outliers, 0.0), n)
            i = int(np.flatnonzero(grid[c] == out[c, k])[0])
            lower, upper = _ranks(x[:, c], grid[c], i)
            assert lower <= rank <= upper, (c, p, rank, lower, upper)
    [(name, event, count, params)] = stage.releases()
    assert (name, event, count) == ("exponential_mechanism_quantile", accounting.PureDpEvent(200.0), 8)


# ===================================================================== 3. adaptive mean

BALL_CENTER = np.array([3.0, -2.0])


def _ball(n=2000, seed=0):
    """n points uniform in the unit disc around BALL_CENTER: diameter 2 whatever R is."""
    g = np.random.default_rng(seed)
    u = g.standard_normal((n, 2))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    return BALL_CENTER + u * np.sqrt(g.random(n))[:, None]


def test_adaptive_mean_error_does_not_grow_with_the_bound_while_plain_clipping_does():
    # Expected error. The adaptive mean's last stage adds N(0, (sigma r)^2 I_d) to the sum of
    # the points clipped to a private radius r around a private center (sigma: analytic Gaussian
    # at (eps/4, delta)); when r covers nearly every point the error is ~ ||N(0, I_d)|| sigma r / n,
    # whose mean is sigma r c_d / n with c_d = E||N(0, I_d)|| = sqrt(pi/2) for d = 2. r tracks the
    # spread (~1 here: the distances' upper quantile, plus the center's error), not R, so
    #     E err(R) ~ sigma_{eps/4} * 1 * c_d / n ~ 0.0083                   for every R.
    # The plain stage's radius must be the public R (centered at the origin, which every point is
    # within 4.7 <= R of): E err = sigma_eps R c_d / n, linear in R.
    #
    # Over S seeds the mean of ||N(0, I_2)|| (Rayleigh, sd/mean = 0.52) has relative sd
    # 0.52 / sqrt(S) = 0.095 for S = 30, so 1.5 times the expected error is a >3 sd margin even with
    # the center's grid error at R = 1e5 (~0.24: the refined grid's step is 4R/G^2) inflating r
    # to ~1.25. Hence the checks: adaptive mean error <= 2 x the expected error for every R, and
    # err(1e5) <= 2 err(10). The same seeds draw the same standard normals at every R, so the
    # plain errors scale exactly with R: err(1e5) / err(10) = 1e4.
    #
    # Failure probability zeta = 1/n^2, as in the paper's Lemma 3: with probability zeta the
    # radius quantile may land anywhere on its grid up to 2 R sqrt(d), which adds ~zeta R to the
    # expected error; 1/n^2 makes that negligible (R / n^2 = 0.025 at R = 1e5, times sigma / n).
    n, epsilon, delta, seeds = 2000, 1.0, 1e-5, 30
    x = _ball(n)
    agg = LocalAggregator(_blocks(x, rows_per_block=512))
    true_mean = x.mean(axis=0)
    c_d = math.sqrt(math.pi / 2)
    sigma_adaptive = stats.gaussian_noise_multiplier(epsilon / 4, delta)
    sigma_plain = stats.gaussian_noise_multiplier(epsilon, delta)
    expected_adaptive = sigma_adaptive * 1.0 * c_d / n

    adaptive, plain = {}, {}
    for bound in (10.0, 1e3, 1e5):
        errs, plain_errs = [], []
        for s in range(seeds):
            stages = stats.adaptive_mean_stages("m", 2, bound, epsilon, delta, seed=s, stream=0,
                                                failure_probability=1.0 / n ** 2)
            errs.append(np.linalg.norm(agg.run_stages(stages, {"n": n})["m"] - true_mean))
            simple = stats.ClippedMeanStage("m", stats.Columns(), 2, 0.0, bound, sigma_plain, seed=s)
            plain_errs.append(np.linalg.norm(agg.run_stages([simple], {"n": n})["m"] - true_mean))
        adaptive[bound], plain[bound] = np.mean(errs), np.mean(plain_errs)
        assert adaptive[bound] <= 2 * expected_adaptive, (bound, adaptive[bound], expected_adaptive)
        # The plain error is as large as its derivation says (>= half of it: a >5 sd margin).
        assert plain[bound] >= 0.5 * sigma_plain * bound * c_d / n, (bound, plain[bound])
    assert adaptive[1e5] <= 2 * adaptive[10.0], adaptive
    assert plain[1e5] / plain[10.0] == pytest.approx(1e4, rel=1e-6)
    assert plain[1e5] > 1000 * adaptive[1e5]


def test_adaptive_mean_spends_at_most_its_budget():
    stages = stats.adaptive_mean_stages("m", 3, 100.0, 0.9, 1e-6, seed=0, stream=0)
    ledger = accounting.Ledger()
    stats.record_releases(stages, ledger)
    names = [m["name"] for m in ledger.mechanisms()]
    # The coarse and the refined medians are the same kind of release: one entry of 2 d.
    assert names == ["exponential_mechanism_quantile"] * 2 + ["gaussian_clipped_mean"]
    assert [m["count"] for m in ledger.mechanisms()] == [6, 1, 1]
    # (eps/2 over the 2 d medians) + eps/4 (radius) + Gaussian at (eps/4, delta), composed.
    assert ledger.mechanisms()[-1]["noise_multiplier"] == stats.gaussian_noise_multiplier(0.225, 1e-6)
    assert ledger.epsilon(1e-6) <= 0.9


# ======================================================================= 4. accounting


def _exact_pure_composition_epsilon(k, epsilon, delta):
    """Exact epsilon(delta) of k-fold composition of epsilon-DP mechanisms (Kairouz, Oh &
    Viswanath 2015): the worst case is randomized response, whose privacy loss is
    eps (2B - k) with B ~ Binomial(k, e^eps / (1 + e^eps)); delta(e) = E[(1 - e^{e - L})_+]."""
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    b = np.arange(k + 1)
    pmf = st.binom.pmf(b, k, p)
    loss = epsilon * (2 * b - k)

    def delta_of(e):
        return float(np.sum(pmf * np.maximum(0.0, 1 - np.exp(e - loss))))
    return optimize.brentq(lambda e: delta_of(e) - delta, 0.0, k * epsilon)


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 3.0])
def test_one_pure_dp_event_costs_at_most_its_epsilon(epsilon):
    ledger = accounting.Ledger("pld")
    ledger.record("q", accounting.PureDpEvent(epsilon))
    spent = ledger.epsilon(1e-12)
    assert spent <= epsilon
    assert spent == pytest.approx(epsilon, rel=1e-6)


@pytest.mark.parametrize("k,epsilon", [(5, 1.0), (20, 0.5), (50, 0.1), (200, 0.05)])
def test_composed_pure_dp_events_pld_is_the_optimal_composition(k, epsilon):
    delta = 1e-5
    ledger = accounting.Ledger("pld")
    ledger.record("q", accounting.PureDpEvent(epsilon), k)
    spent = ledger.epsilon(delta)
    assert spent <= k * epsilon                                  # basic composition
    # Advanced composition (Dwork, Rothblum & Vadhan 2010) at the same delta.
    advanced = math.sqrt(2 * k * math.log(1 / delta)) * epsilon + k * epsilon * math.expm1(epsilon)
    assert spent <= advanced
    if k >= 50:
        assert spent < 0.6 * k * epsilon                         # far below basic composition
    # The tight value.
    assert spent == pytest.approx(_exact_pure_composition_epsilon(k, epsilon, delta), abs=1e-6)


@pytest.mark.parametrize("k,epsilon", [(1, 1.0), (20, 0.5), (200, 0.05)])
def test_pure_dp_events_through_the_rdp_accountant(k, epsilon):
    # epsilon-DP implies D_alpha <= min(eps, alpha eps^2 / 2) for every order alpha (Bun & Steinke
    # 2016, Prop. 3.3); composition adds RDP; dp_accounting converts RDP to (eps, delta).
    from dp_accounting.rdp import rdp_privacy_accountant
    delta = 1e-5
    ledger = accounting.Ledger("rdp")
    ledger.record("q", accounting.PureDpEvent(epsilon), k)
    spent = ledger.epsilon(delta)
    orders = np.asarray(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, float)
    rdp = k * np.minimum(epsilon, orders * epsilon ** 2 / 2)
    assert spent == pytest.approx(rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)[0],
                                  rel=1e-9)
    # RDP is never tighter than the exact (PLD) answer and, at the largest order alpha_max,
    # never looser than k eps + log(1/delta) / (alpha_max - 1).
    assert spent >= _exact_pure_composition_epsilon(k, epsilon, delta) - 1e-9
    assert spent <= k * epsilon + math.log(1 / delta) / (orders.max() - 1)
    if k == 200:
        assert spent < 0.5 * k * epsilon


def test_pure_dp_event_composes_with_other_events_and_round_trips_to_json():
    delta = 1e-5
    events = [ev.LaplaceDpEvent(100.0), ev.SelfComposedDpEvent(accounting.PureDpEvent(0.05), 6),
              ev.GaussianDpEvent(10.0)]
    for kind in ("pld", "rdp"):
        ledger = accounting.Ledger(kind)
        ledger.record("count", events[0], epsilon=0.01)
        ledger.record("quantile", accounting.PureDpEvent(0.05), 4, epsilon=0.05)
        ledger.record("quantile", accounting.PureDpEvent(0.05), 2, epsilon=0.05)  # merged: 6
        ledger.record("mean", events[2], noise_multiplier=10.0)
        assert [m["count"] for m in ledger.mechanisms()] == [1, 6, 1]
        assert ledger.epsilon(delta) == pytest.approx(
            accounting.make_accountant(kind).compose(ev.ComposedDpEvent(events)).get_epsilon(delta),
            rel=1e-9)
        # Each part alone costs less than the whole.
        assert ledger.epsilon(delta) > accounting.epsilon_of(events[1], delta, kind)
    as_json = accounting.event_to_json(ev.ComposedDpEvent(events))
    assert accounting.event_from_json(as_json) == ev.ComposedDpEvent(events)


# ====================================================== 5. runners and the privacy report


def recompute_epsilon(privacy: dict) -> float:
    """The report's epsilon from its ``mechanisms`` list alone: each entry's documented DpEvent,
    self-composed ``count`` times, composed in order with a PLD accountant (the project's, since
    dp_accounting has no event for an epsilon-DP mechanism)."""
    accountant = accounting.make_accountant("pld")
    for m in privacy["mechanisms"]:
        name, count = m["name"], m["count"]
        if name == "laplace_count":
            event = ev.LaplaceDpEvent(1.0 / m["epsilon"])
        elif name == "exponential_mechanism_quantile":
            event = accounting.PureDpEvent(m["epsilon"])
        elif name in ("gaussian_clipped_mean", "gaussian_bounded_mean",
                      "gaussian_clipped_gradient_sum",
                      "gaussian_model_quality_sums"):   # (a training run's quality check)
            event = ev.GaussianDpEvent(m["noise_multiplier"])
        elif name == "poisson_sampled_gaussian_clipped_gradient_sum":
            event = ev.PoissonSampledDpEvent(m["sampling_probability"],
                                             ev.GaussianDpEvent(m["noise_multiplier"]))
        else:
            raise AssertionError(f"unknown mechanism {name!r} in the report")
        accountant.compose(event, count)
    return accountant.get_epsilon(privacy["delta"])


@pytest.fixture(scope="module")
def stats_data(tmp_path_factory):
    """1200 examples, 3 features, 3 Parquet shards."""
    directory = tmp_path_factory.mktemp("stats-data")
    x, y = synthetic.make_dataset("binary", 1200, 3, seed=21)
    synthetic.write_shards(str(directory), "train", x, y, 3)
    return {"glob": str(directory / "train-*.parquet"), "x": x, "y": y}


def _same_report(a, b, path="report"):
    """Equal JSON values; floats that are sums of floats over blocks may be reassociated by Beam's
    combiner, so they are compared at 1e-12 relative (everything else, including every quantile,
    which is a grid point chosen from integer counts, exactly)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            _same_report(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _same_report(u, v, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _check_stats_report(report, x, epsilon, delta, value_bound=1e6):
    privacy = report["privacy"]
    assert privacy["requested_epsilon"] == epsilon and privacy["delta"] == delta
    assert privacy["epsilon"] == pytest.approx(recompute_epsilon(privacy), rel=1e-9)
    assert privacy["epsilon"] <= epsilon
    assert privacy["epsilon"] >= 0.99 * epsilon   # calibrated to the budget, not overspent
    # The column release is the one with (columns x quantiles) = 3 x 3 draws, the norm release 3.
    releases = {m["count"]: m for m in privacy["mechanisms"]
                if m["name"] == "exponential_mechanism_quantile"}
    assert sorted(releases) == [3, 9]
    # The rank-error bound printed for each set of quantiles is that of its own release.
    for label, count in (("columns", 9), ("norms", 3)):
        release = releases[count]
        assert report["quantile_rank_error_95"][f"exponential_mechanism_quantile ({label})"] == \
            pytest.approx(stats.quantile_rank_error_bound(release["grid_size"], release["epsilon"], 0.05))
    # Every released quantile meets the rank guarantee (section 2) at failure probability ALPHA
    # per release, on the public grids, with target rank p * n (n the number of rows, which the
    # mechanism takes from its own histogram, not the released count), kept the release's
    # ``margin`` (its 95% rank error) inside either end.
    n, d = len(x), x.shape[1]
    column_grid = stats.symmetric_log_grid(value_bound, releases[9]["grid_size"])[0]
    norm_grid = stats.log_grid(value_bound / 1e8, value_bound * math.sqrt(d), releases[3]["grid_size"])[0]
    checks = [(x[:, j], column_grid, report["columns"][f"f{j}"]["quantiles"], releases[9])
              for j in range(d)]
    checks.append((np.linalg.norm(x, axis=1), norm_grid, report["feature_norm_quantiles"], releases[3]))
    for values, grid, released, release in checks:
        e = stats.quantile_rank_error_bound(len(grid), release["epsilon"], ALPHA)
        margin = release["margin"]
        assert margin == pytest.approx(
            stats.quantile_rank_error_bound(release["grid_size"], release["epsilon"], 0.05))
        for q, g in released.items():
            rank = min(max(float(q) * n, margin), n - margin)
            lower, upper = _ranks(values, grid, int(np.flatnonzero(grid == g)[0]))
            assert upper >= rank - e and lower <= rank + e, (q, rank, lower, upper, e)


@pytest.mark.slow
def test_stats_on_local_and_beam_runners_give_the_same_report(tmp_path, cli, stats_data):
    # --noise float: the float releases, whose accounting this test recomputes (the secure
    # ones, the default: tests/test_secure_releases.py)
    common = ["stats", "--input", stats_data["glob"], "--epsilon", 5.0, "--seed", 77,
              "--batch-rows", 250, "--noise", "float"]
    assert cli(*common, "--output", tmp_path / "local", *LOCAL).code == 0
    assert cli(*common, "--output", tmp_path / "beam", *BEAM).code == 0
    local = read_json(tmp_path / "local" / "stats_report.json")
    beam = read_json(tmp_path / "beam" / "stats_report.json")
    _same_report(local, beam)
    _check_stats_report(local, stats_data["x"], 5.0, 1e-5)
    assert local["count_source"].startswith("private")
    # round(n + Laplace(b)): P(|L| > b ln(1/ALPHA)) = ALPHA.
    [count] = [m for m in local["privacy"]["mechanisms"] if m["name"] == "laplace_count"]
    assert abs(local["count"] - 1200) <= math.log(1 / ALPHA) / count["epsilon"] + 0.5


def test_stats_with_a_public_count_labels_each_rank_error(tmp_path, cli, stats_data):
    out = tmp_path / "out"
    assert cli("stats", "--input", stats_data["glob"], "--output", out, "--epsilon", 2.0,
               "--num-examples", 1200, "--seed", 1, *LOCAL).code == 0
    report = read_json(out / "stats_report.json")
    assert report["count"] == 1200 and report["count_source"].startswith("public")
    assert "laplace_count" not in [m["name"] for m in report["privacy"]["mechanisms"]]
    _check_stats_report(report, stats_data["x"], 2.0, 1e-5)


def test_stats_default_runner_is_beams_in_process_runner():
    from beam_dp import cli as cli_mod
    args, _ = cli_mod.build_parser().parse_known_args(
        ["stats", "--input", "x", "--output", "y", "--epsilon", "1"])
    assert args.runner == "FnApiRunner"


def test_private_statistics_ptransform_matches_the_local_aggregator(tmp_path):
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from beam_dp.beam.transforms import PrivateStatistics

    x = _ball(600, seed=3)
    blocks = _blocks(x, rows_per_block=100)
    stages = [stats.CountStage(0.5, seed=8)] + stats.adaptive_mean_stages(
        "m", 2, 100.0, 1.0, 1e-5, seed=8, stream=0, grid_size=256)
    expected = LocalAggregator(blocks).run_stages(stages, {})
    ledger = accounting.Ledger()
    path = str(tmp_path / "state.pkl")

    def save(state):
        with open(path, "wb") as f:
            pickle.dump(state, f)

    with beam.Pipeline(options=PipelineOptions(["--runner", "FnApiRunner"])) as p:
        (p | beam.Create(blocks) | PrivateStatistics(stages, ledger) | beam.Map(save))
    with open(path, "rb") as f:
        got = pickle.load(f)
    assert got.keys() == expected.keys()
    assert got["n"] == expected["n"]
    for key in ("m_center_coarse", "m_center", "m_radius"):
        np.testing.assert_array_equal(got[key], expected[key])
    np.testing.assert_allclose(got["m"], expected["m"], rtol=1e-12)
    # Applying the transform recorded every release: the count and the adaptive mean's four.
    assert [m["name"] for m in ledger.mechanisms()] == [
        "laplace_count", "exponential_mechanism_quantile", "exponential_mechanism_quantile",
        "gaussian_clipped_mean"]
    assert ledger.epsilon(1e-5) <= 1.5 + 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["practical", "theory"])
def test_dpsgd_f_on_local_and_beam_runners_gives_the_same_model(tmp_path, cli, stats_data, variant):
    common = ["train", "--input", stats_data["glob"], "--algorithm", "dpsgd-f",
              "--variant", variant, "--feature-norm", 5.0, "--model", "hinge",
              "--epsilon", 1.0, "--seed", 31, "--steps", 4, "--steps-per-job", 2,
              "--batch-size", 300, "--batch-rows", 250, "--noise", "float"]   # float accounting below
    assert cli(*common, "--output", tmp_path / "local", *LOCAL).code == 0
    assert cli(*common, "--output", tmp_path / "beam", *BEAM).code == 0
    local, beam = model_theta(tmp_path / "local"), model_theta(tmp_path / "beam")
    assert np.linalg.norm(local) > 0
    np.testing.assert_allclose(beam, local, rtol=1e-6, atol=1e-9 * np.abs(local).max())

    reports = [read_json(tmp_path / r / "privacy_report.json") for r in ("local", "beam")]
    for key in ["epsilon", "dataset_size", "noise_multiplier", "sampling_probability", "steps",
                "clip_norm", "mechanisms"]:
        assert reports[0][key] == reports[1][key], key
    _same_report(reports[0]["preprocessing"], reports[1]["preprocessing"])
    privacy = reports[0]
    assert privacy["algorithm"] == f"dpsgd-f ({variant})"
    names = [m["name"] for m in privacy["mechanisms"]]
    assert names[1] == "laplace_count" and names[-1] == "poisson_sampled_gaussian_clipped_gradient_sum"
    if variant == "theory":
        assert names.count("exponential_mechanism_quantile") == 3   # medians, radius, tau
        assert privacy["clip_norm"] == pytest.approx(math.sqrt(2) * privacy["preprocessing"]["tau"])
    else:
        assert names[2] == "gaussian_clipped_mean"
    assert privacy["epsilon"] == pytest.approx(recompute_epsilon(privacy), rel=1e-9)
    assert privacy["epsilon"] <= privacy["requested_epsilon"] == 1.0
    assert privacy["epsilon"] >= 0.99


def _tiny_summary(seed, rearrange=True, monkeypatch=None):
    x = np.random.default_rng(seed).normal(size=(40, 3)) * [1.0, 100.0, 1e4]
    stages = stats.dataset_summary_stages(3, (0.05, 0.5, 0.95), 0.5, 1e-5, seed)
    if not rearrange:
        import dataclasses
        stages = [stats.PackedStages(tuple(dataclasses.replace(s, rearrange=False)
                                           if isinstance(s, stats.QuantileStage) else s
                                           for s in stages[0].stages))] + stages[1:]
    state = LocalAggregator(_blocks(x)).run_stages(stages, {})
    return state, stats.summary(state, stages, ["a", "b", "c"], "laplace")


def test_stats_quantiles_never_cross_and_mean_intervals_keep_their_order():
    """At 40 rows and epsilon 0.5 the independent quantile releases are mostly noise and cross
    (a 5th percentile above the 95th, then a zero-width clipping range for the mean) in most
    runs; rearranged (sorted per column, post-processing) they never do."""
    crossed = 0
    for seed in range(20):
        raw, _ = _tiny_summary(seed, rearrange=False)
        crossed += int(np.any(np.diff(raw["column_quantiles"], axis=1) < 0))
        state, report = _tiny_summary(seed)
        assert np.all(np.diff(state["column_quantiles"], axis=1) >= 0)
        # the same releases, only their order within a column changed
        np.testing.assert_array_equal(np.sort(raw["column_quantiles"], axis=1),
                                      state["column_quantiles"])
        for column in report["columns"].values():
            low, high = column["mean_interval_95"]
            clip_low, clip_high = column["mean_clipped_to"]
            assert clip_low <= clip_high and clip_low <= low <= column["mean"] <= high <= clip_high
            q = [column["quantiles"][k] for k in ("0.05", "0.5", "0.95")]
            assert q == sorted(q)
    assert crossed >= 5   # (the test would see a crossing without the rearrangement)


def test_a_noisy_mean_past_its_clipping_range_is_projected_onto_it():
    """The noise can carry a clipped mean past its range (then its interval was crossed); the
    true clipped mean lies in the range, so the summary projects the release onto it."""
    state, _ = _tiny_summary(3)
    stages = stats.dataset_summary_stages(3, (0.05, 0.5, 0.95), 0.5, 1e-5, 3)
    q = state["column_quantiles"]
    means = np.array(state["column_means"], dtype=float)
    means[0] = q[0, -1] + 1e3 * (q[0, -1] - q[0, 0] + 1.0)   # far above the 95th percentile
    means[1] = q[1, 0] - 1e3 * (q[1, -1] - q[1, 0] + 1.0)    # far below the 5th
    report = stats.summary({**state, "column_means": means}, stages, ["a", "b", "c"], "laplace")
    a, b = report["columns"]["a"], report["columns"]["b"]
    assert a["mean"] == a["mean_clipped_to"][1] == a["mean_interval_95"][1]
    assert b["mean"] == b["mean_clipped_to"][0] == b["mean_interval_95"][0]
    for column in (a, b):
        low, high = column["mean_interval_95"]
        assert column["mean_clipped_to"][0] <= low <= high <= column["mean_clipped_to"][1]


def test_stats_checks_a_schemas_declared_ranges_against_its_quantiles(tmp_path, cli):
    """``beam-dp stats --schema``: a range far wider than where the column's values lie (values
    near 0 declared [0, 5000], as AER CreditCard's expenditure is documented) is said, and so
    is one the values pass (clipped in training); a fitting range is not, nor a 0/1 column's
    [0, 1] (its 1 released as the grid point just above), and a rare 0/1 column's span (a point
    mass) is not judged; at a small n, where the quantiles are unresolved, the check says it
    cannot tell. Shares only: no released value in the messages. Nothing more is spent than
    the summary's own releases."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    g = np.random.default_rng(8)
    n = 20000
    table = {"spend": g.exponential(20.0, n), "age": g.uniform(20, 80, n),
             "rate": g.uniform(0, 10, n), "flag": (g.random(n) < 0.3).astype(float),
             "rare": (g.random(n) < 0.01).astype(float)}
    pq.write_table(pa.table(table), tmp_path / "t.parquet")
    pq.write_table(pa.table({k: v[:300] for k, v in table.items()}), tmp_path / "small.parquet")
    (tmp_path / "schema.json").write_text(json.dumps(
        {"bounds": {"spend": [0, 5000], "age": [0, 100], "rate": [0, 1], "flag": [0, 1],
                    "rare": [0, 1], "label": [0, 1]}}))
    common = ["stats", "--epsilon", 2.0, "--seed", 3, "--feature-columns",
              "spend,age,rate,flag,rare",
              "--schema", tmp_path / "schema.json", *LOCAL]
    r = cli(*common, "--input", tmp_path / "t.parquet", "--output", tmp_path / "out")
    assert r.code == 0, r
    report = read_json(tmp_path / "out" / "stats_report.json")
    verdicts = {k: v["verdict"] for k, v in report["declared_ranges"].items()}
    assert verdicts == {"spend": "wide", "age": "fits", "rate": "beyond", "flag": "fits",
                        "rare": "cannot tell", "label": "not checked"}, report["declared_ranges"]
    assert report["declared_ranges"]["spend"]["span_share"] < stats.WIDE_RANGE_SPAN
    said = [w for w in report["warnings"] if w.startswith(("'spend'", "'rate'"))]
    assert len(said) == 2 and any("sliver" in w for w in said) and any("clipped" in w for w in said)
    assert all(w in r.err for w in said)
    for value in table["spend"][:100]:
        assert f"{value:.4g}" not in " ".join(said)
    r = cli(*common, "--input", tmp_path / "small.parquet", "--output", tmp_path / "small")
    assert r.code == 0, r
    small = read_json(tmp_path / "small" / "stats_report.json")
    assert {v["verdict"] for v in small["declared_ranges"].values()} == {"cannot tell",
                                                                       "not checked"}
    assert cli("stats", "--input", tmp_path / "t.parquet", "--output", tmp_path / "c",
               "--epsilon", 1.0, "--categorical-columns", "spend", "--schema",
               tmp_path / "schema.json", *LOCAL).code != 0
