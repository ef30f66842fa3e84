"""The bias-reduced gradient estimator and randomly stopped SGD (paper 001, Algorithms 3 and 4;
``beam_dp.algorithms.bias_reduced``): the truncated geometric levels, ME as ``stats``' sparse
mean release, the Monte Carlo check that E[G] is the full-batch estimator's expectation (the
note's §2.3 item 5 and §3 run 3) and that it catches a planted bug, the per-step privacy events
and the planned number of steps (dp_accounting, replace-one), and the run on a sparse least
squares problem."""
import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
import scipy.sparse as sp
from scipy import stats as scipy_stats

from dp_accounting import dp_event as events

from beam_dp import accounting, geometry, mechanisms, stats
from beam_dp.algorithms import bias_reduced as br


def shared_support_rows(n: int, d: int, s: int, seed: int) -> sp.csr_matrix:
    """The note's §3 run 3 design: every row on one support of s coordinates, values around a
    common centre (so batch means vary), norms around 1 (some clipped to L = 1)."""
    rng = np.random.default_rng(seed)
    support = np.sort(rng.choice(d, s, replace=False))
    values = np.array([0.9, 0.7, -0.6, 0.4])[:s] + 0.5 * rng.normal(size=(n, s))
    return sp.csr_matrix((values.ravel(), np.tile(support, n), np.arange(0, n * s + 1, s)),
                         shape=(n, d))


# ------------------------------------------------------------------------------ TGeom(M) levels

def chi_square_p_value(levels, pmf) -> float:
    observed = np.bincount(levels, minlength=pmf.size + 1)[1:]
    assert observed.sum() == levels.size          # nothing outside 1..M
    expected = levels.size * pmf
    return float(scipy_stats.chi2.sf(((observed - expected) ** 2 / expected).sum(), pmf.size - 1))


def test_levels_follow_the_truncated_geometric_law():
    """P(J = j) = C_M 2^-j on {1..M}: a chi-square test on 200,000 draws at p-value > 1e-3 (the
    stated tolerance: a correct sampler fails it with probability 1e-3; seeded). The same test
    rejects the nearby wrong law (an untruncated geometric clipped to M) by far."""
    M = 8
    pmf = br.truncated_geometric_pmf(M)
    c_m = 1.0 / (1.0 - 2.0 ** -M)
    np.testing.assert_allclose(pmf, c_m * 2.0 ** -np.arange(1, M + 1), rtol=1e-15)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-15)
    levels = br.truncated_geometric_levels(200_000, M, mechanisms.rng(1, 1))
    assert levels.min() >= 1 and levels.max() <= M
    assert chi_square_p_value(levels, pmf) > 1e-3
    # E[2^J] = C_M M (the note's expected batch size), within 5 standard errors
    sizes = 2.0 ** levels
    assert abs(sizes.mean() - c_m * M) < 5 * sizes.std() / math.sqrt(sizes.size)
    # power: an untruncated geometric clipped to M puts 2^-(M-1) on M instead of C_M 2^-M
    wrong = np.minimum(mechanisms.rng(1, 2).geometric(0.5, 200_000), M)
    assert chi_square_p_value(wrong, pmf) < 1e-6
    assert br.max_level(64) == 6 and br.max_level(100) == 6


def test_batches_are_disjoint_halves_of_uniform_samples():
    n, level = 24, 3
    oracle = br.BiasReducedOracle(n, 5, br.MeanEstimator(1.0, 2, 1.0, 1e-5))
    generator = mechanisms.rng(2, 1)
    counts = np.zeros(n)
    for _ in range(3000):
        odd, even, singleton = oracle.draw_batch(level, generator)
        assert odd.size == even.size == 4 and singleton.size == 1
        assert np.unique(np.concatenate([odd, even])).size == 8     # without replacement
        counts[np.concatenate([odd, even])] += 1
    odd, even, singleton = oracle.draw_batches(level, 3000, generator)
    assert odd.shape == even.shape == (3000, 4) and singleton.shape == (3000,)
    both = np.concatenate([odd, even], axis=1)
    assert all(np.unique(row).size == 8 for row in both)
    for hits in (counts, np.bincount(both.ravel(), minlength=n)):
        expected = 3000 * 8 / n                   # every index equally likely
        p = scipy_stats.chi2.sf(((hits - expected) ** 2 / expected).sum(), n - 1)
        assert p > 1e-3


# ------------------------------------------------------------------------------ ME = Algorithm 1

@pytest.mark.parametrize("variant", ["gaussian", "laplace"])
def test_the_mean_estimator_is_stats_release_to_the_bit(variant):
    """ME on k batches at once is ``stats.sparse_mean_release`` called k times in a row on the
    same generator (same noise, same projection), with ``stats``' noise scale for each size."""
    d, s = 60, 3
    estimator = br.MeanEstimator(1.0, s, 0.8, 1e-6, variant)
    totals = np.random.default_rng(3).normal(size=(4, d))
    sizes = [1, 8, 4, 4]
    ours = estimator.estimate(totals, sizes, mechanisms.rng(4, 1))
    generator = mechanisms.rng(4, 1)
    for total, size, out in zip(totals, sizes, ours):
        scale = stats.sparse_mean_noise_scale(variant, size, 1.0, s, 0.8, 1e-6)[0]
        assert estimator.noise_scale(size) == scale
        reference, _ = stats.sparse_mean_release(total, size, variant, 1.0, s, scale, generator)
        np.testing.assert_array_equal(out, reference)
    # zero_below: ME is 0 on batches below it, whatever the data
    zeroed = br.MeanEstimator(1.0, s, 0.8, 1e-6, variant, zero_below=4).estimate(
        totals, sizes, mechanisms.rng(4, 1))
    assert not zeroed[0].any() and zeroed[1:].any(axis=1).all()


# ---------------------------------------------------------------------------- E[G] = E[ME(S)]

MC_N, MC_D, MC_S, MC_DRAWS = 64, 200, 4, 40_000


def monte_carlo(rows, estimator, draws, seed, chunk=10_000):
    """Per-coordinate means and variances of G, ME(S) and ME(z) (z uniform), ``draws`` each."""
    n, d = rows.shape
    oracle = br.BiasReducedOracle(n, d, estimator)
    clipped = estimator.clip(rows)
    total = np.asarray(clipped.sum(axis=0)).ravel()
    moments = {name: [np.zeros(d), np.zeros(d)] for name in ("G", "S", "z")}
    for start in range(0, draws, chunk):
        k = min(chunk, draws - start)
        levels = br.truncated_geometric_levels(k, oracle.max_level, mechanisms.rng(seed, 1, start))
        draws_of = {
            "G": oracle.sample(rows, levels, mechanisms.rng(seed, 2, start),
                               mechanisms.rng(seed, 3, start)),
            "S": estimator.estimate(np.broadcast_to(total, (k, d)), np.full(k, n),
                                    mechanisms.rng(seed, 4, start)),
            "z": estimator.estimate(
                clipped[mechanisms.rng(seed, 5, start).integers(0, n, k)].toarray(),
                np.ones(k, dtype=np.int64), mechanisms.rng(seed, 6, start)),
        }
        for name, x in draws_of.items():
            moments[name][0] += x.sum(axis=0)
            moments[name][1] += (x * x).sum(axis=0)
    out = {}
    for name, (first, second) in moments.items():
        mean = first / draws
        out[name] = (mean, (second - draws * mean * mean) / (draws - 1))
    out["mean_of_rows"] = total / n
    return out


def unbiasedness_check(mc, draws, support):
    """E[G] = E[ME(S)] within Monte Carlo error: z_k = (mean G_k - mean ME(S)_k) / se_k with
    se_k^2 = var(G_k) / N + var(ME(S)_k) / N, estimated from the draws. Passes when every
    support coordinate (where the bias lives) has |z_k| <= 4 and the sum of z_k^2 over all d
    coordinates is within 4 standard deviations of its null mean d (chi-square, d dof)."""
    (g_mean, g_var), (s_mean, s_var) = mc["G"], mc["S"]
    se = np.sqrt(g_var / draws + s_var / draws)
    z = (g_mean - s_mean) / se
    d = z.size
    chi = float((z * z).sum())
    passed = bool(np.abs(z[support]).max() <= 4.0 and chi <= d + 4.0 * math.sqrt(2.0 * d))
    return passed, {"max_abs_z_support": float(np.abs(z[support]).max()), "chi_square": chi,
                    "norm_difference": float(np.linalg.norm(g_mean - s_mean)),
                    "norm_standard_error": float(np.linalg.norm(se))}


@pytest.fixture(scope="module")
def mc_setup():
    rows = shared_support_rows(MC_N, MC_D, MC_S, seed=3)
    support = np.unique(rows.indices)
    return rows, support, br.MeanEstimator(1.0, MC_S, 1.0, 1e-5)


@pytest.mark.slow
def test_the_estimator_is_unbiased_for_the_full_batch_estimator(mc_setup):
    """The note's §3 run 3 (n = 64, M = 6, d = 200, s = 4, ME = Alg. 1 Gaussian at (1, 1e-5),
    40,000 draws, one shared support): E[G] matches E[ME(S)] within its standard error, so G's
    bias is the full-batch bias, and the single-sample estimator's bias is visibly larger."""
    rows, support, estimator = mc_setup
    mc = monte_carlo(rows, estimator, MC_DRAWS, seed=7)
    passed, figures = unbiasedness_check(mc, MC_DRAWS, support)
    assert passed, figures
    x_bar = mc["mean_of_rows"]
    full_bias = np.linalg.norm(mc["S"][0] - x_bar)
    single_bias = np.linalg.norm(mc["z"][0] - x_bar)
    g_bias = np.linalg.norm(mc["G"][0] - x_bar)
    assert abs(g_bias - full_bias) <= 4 * figures["norm_standard_error"]
    assert single_bias > 1.5 * full_bias
    # the two biases' Monte Carlo error: at most the norms of their means' standard errors
    error = sum(math.sqrt(mc[name][1].sum() / MC_DRAWS) for name in ("S", "z"))
    assert single_bias - full_bias > 10 * error
    print(f"\n||E G - E ME(S)|| = {figures['norm_difference']:.4f} (||se|| "
          f"{figures['norm_standard_error']:.4f}, max|z| on the support "
          f"{figures['max_abs_z_support']:.2f}, chi-square {figures['chi_square']:.1f} on "
          f"{MC_D} dof); bias: full batch {full_bias:.3f}, G {g_bias:.3f}, single sample "
          f"{single_bias:.3f}; E||G||^2 = {mc['G'][1].sum() + (mc['G'][0] ** 2).sum():.1f}")


def _without_the_inverse_probability(singleton, whole, odd, even, probability):
    return singleton + (whole - 0.5 * (odd + even))


def _without_the_halves(singleton, whole, odd, even, probability):
    return singleton + whole / probability


@pytest.mark.parametrize("broken", [_without_the_inverse_probability, _without_the_halves])
def test_the_monte_carlo_check_catches_a_planted_bug(mc_setup, monkeypatch, broken):
    """The check above fails when the estimator drops the 1/p_J factor or the -1/2 halves (on a
    quarter of the draws: less power than the real check has, and still caught)."""
    rows, support, estimator = mc_setup
    monkeypatch.setattr(br, "combine", broken)
    mc = monte_carlo(rows, estimator, MC_DRAWS // 4, seed=8)
    passed, figures = unbiasedness_check(mc, MC_DRAWS // 4, support)
    assert not passed, figures


@pytest.mark.slow
def test_zeroing_small_batches_keeps_the_estimator_unbiased(mc_setup):
    """The note's [IMPL] small-batch option: ME = 0 below 8 rows (levels 1-2 and the singleton
    look at no data); E[G] is still E[ME(S)]."""
    rows, support, _ = mc_setup
    estimator = br.MeanEstimator(1.0, MC_S, 1.0, 1e-5, zero_below=8)
    mc = monte_carlo(rows, estimator, MC_DRAWS, seed=9)
    passed, figures = unbiasedness_check(mc, MC_DRAWS, support)
    assert passed, figures


# ------------------------------------------------------------------------------------- privacy

def test_step_events_and_the_rdp_convention():
    """One step at level J: the triplet on 2^J rows sampled without replacement, of which a
    replaced row reaches two Gaussian calls, and the singleton on one row. dp_accounting's RDP
    reads a GaussianDpEvent's multiplier against the replace-one sensitivity, its PLD (the
    calibration) against half of it: at the top level (b = n, no amplification) the RDP epsilon
    of the triplet must not be below the PLD epsilon of the same two Gaussian calls; with the PLD
    multiplier carried over unchanged it would be."""
    n, delta = 64, 1e-5
    estimator = br.MeanEstimator(1.0, 4, 1.0, 1e-5)
    m = estimator.noise_multiplier
    gaussian = events.GaussianDpEvent(m)   # the project's units; its RDP accountant halves them
    for level in (1, 4, 6):
        assert br.step_event(level, n, estimator) == events.ComposedDpEvent([
            events.SampledWithoutReplacementDpEvent(n, 2 ** level,
                                                    events.ComposedDpEvent([gaussian, gaussian])),
            events.SampledWithoutReplacementDpEvent(n, 1, gaussian)])
    two_calls = accounting.epsilon_of(
        events.ComposedDpEvent([events.GaussianDpEvent(m)] * 2), delta, "pld",
        accounting.REPLACE_ONE)
    triplet = br.step_event(br.max_level(n), n, estimator).events[0]
    rdp = accounting.epsilon_of(triplet, delta, "rdp", accounting.REPLACE_ONE)
    assert two_calls <= rdp <= 1.3 * two_calls
    # read raw by dp_accounting's RDP (without the project's conversion) it would claim too little
    raw = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=rdp_privacy_accountant.NeighborRel.REPLACE_ONE).compose(triplet)
    assert raw.get_epsilon(delta) < 0.6 * two_calls
    # the note's conservative accounting: Lemma 5.3's amplified (eps, delta) per part
    conservative = br.step_event(4, n, estimator, "conservative").events
    q = 16 / n
    assert conservative[0].delta == pytest.approx(q * 2e-5, rel=1e-12)
    assert conservative[0].epsilon == pytest.approx(math.log1p(q * math.expm1(
        accounting.epsilon_of(events.ComposedDpEvent([events.GaussianDpEvent(m)] * 2), 2e-5,
                              "pld", accounting.REPLACE_ONE))), rel=1e-12)
    assert conservative[1].epsilon == pytest.approx(math.log1p(math.expm1(1.0) / n), rel=3e-3)
    assert conservative[1].delta == pytest.approx(1e-5 / n, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["wor-rdp", "conservative"])
def test_step_events_grow_with_the_level(method):
    n, delta = 64, 1e-5
    estimator = br.MeanEstimator(1.0, 4, 0.5, 1e-6)
    costs = [br.composed_epsilon([j], n, delta, estimator, method)
             for j in range(1, br.max_level(n) + 1)]
    assert all(a < b for a, b in zip(costs, costs[1:])), costs
    # zeroed calls cost nothing: below 8 rows, levels 1-2 and the singleton are free
    zeroed = br.MeanEstimator(1.0, 4, 0.5, 1e-6, zero_below=8)
    assert isinstance(br.step_event(2, n, zeroed, method), events.NoOpDpEvent)
    assert br.composed_epsilon([2, 1, 2], n, delta, zeroed, method) == 0.0
    assert len(br.step_event(3, n, zeroed, method).events) == 1       # ME(B) only
    assert 0 < br.composed_epsilon([3], n, delta, zeroed, method) < costs[2]


@pytest.mark.slow
def test_the_plan_spends_the_budget_and_one_more_step_exceeds_it():
    """T from ``plan``: the first T + 1 steps compose (dp_accounting's RDP accountant, replace-
    one, on the full event) to at most the target epsilon, the first T + 2 to more."""
    n, target, delta = 64, 1.0, 1e-5
    estimator = br.MeanEstimator(1.0, 4, 0.15, 1e-6)
    levels = br.sample_levels(5, 5000, n)
    plan = br.plan(levels, n, target, delta, estimator)
    assert not plan.capped and plan.calls == plan.steps + 1 > 100
    np.testing.assert_array_equal(plan.levels, levels[:plan.calls])
    acc = accounting.make_accountant("rdp", accounting.REPLACE_ONE)
    acc.compose(br.composed_event(levels[:plan.calls], n, estimator))
    within = acc.get_epsilon(delta)
    acc.compose(br.step_event(int(levels[plan.calls]), n, estimator))
    beyond = acc.get_epsilon(delta)
    assert within <= target < beyond
    assert within == pytest.approx(plan.epsilon, rel=1e-9)
    assert beyond == pytest.approx(plan.next_epsilon, rel=1e-9)


@pytest.mark.slow
def test_the_plan_cap_and_refusals():
    n, delta = 64, 1e-5
    estimator = br.MeanEstimator(1.0, 4, 0.15, 1e-6)
    levels = br.sample_levels(5, 30, n)
    plan = br.plan(levels, n, 1.0, delta, estimator)          # all 30 fit: T = 29
    assert plan.capped and plan.steps == 29 and plan.next_epsilon is None
    assert plan.epsilon <= 1.0
    with pytest.raises(ValueError, match="one step"):
        br.plan([br.max_level(n)], n, 0.05, delta, estimator)
    with pytest.raises(ValueError, match="conservative"):
        br.plan(levels, n, 1.0, delta, br.MeanEstimator(1.0, 4, 0.15, 1e-6, "laplace"),
                "wor-rdp")


def test_the_conservative_plan_is_within_budget_and_not_longer():
    """The note's Lemma 5.3 accounting (amplified (eps, delta) per step, PLD composition): within
    budget at T + 1, over at T + 2, and no more steps than the RDP accounting of the same
    Gaussian mechanism allows."""
    n, target, delta = 64, 1.0, 1e-5
    estimator = br.MeanEstimator(1.0, 4, 0.15, 1e-6)
    levels = br.sample_levels(5, 5000, n)
    plan = br.plan(levels, n, target, delta, estimator, "conservative")
    event = br.composed_event(levels[:plan.calls], n, estimator, "conservative")
    assert accounting.epsilon_of(event, delta, "pld", accounting.REPLACE_ONE) <= target
    more = br.composed_event(levels[:plan.calls + 1], n, estimator, "conservative")
    assert accounting.epsilon_of(more, delta, "pld", accounting.REPLACE_ONE) > target
    assert plan.steps <= br.plan(levels, n, target, delta, estimator).steps
    laplace = br.MeanEstimator(1.0, 4, 0.15, 1e-6, "laplace")
    assert br.plan(levels, n, target, delta, laplace).method == "conservative"


# ----------------------------------------------------------------------------------------- run

@pytest.mark.slow
def test_the_run_decreases_a_sparse_least_squares_objective():
    """Algorithm 4 on F(x) = (1/2n) sum (<a_i, x> - y_i)^2, a_i 4-sparse (two groups of rows on
    their own 4 coordinates, d = 64), over the l2 ball of radius 1.2 ||x*||, from x0 = 0 with the
    planned T at (2, 1e-5) and eta = D / (G sqrt(T + 1)): the average iterate's objective is on
    average over seeds well below F(x0), and every iterate stays in the ball."""
    n, d, s, groups = 1024, 64, 4, 2
    rng = np.random.default_rng(11)
    columns = (np.arange(n) % groups)[:, None] * s + np.arange(s)[None, :]
    values = rng.choice([-1.0, 1.0], (n, s)) / math.sqrt(s)
    a = sp.csr_matrix((values.ravel(), columns.ravel(), np.arange(0, n * s + 1, s)), shape=(n, d))
    x_star = np.zeros(d)
    x_star[:groups * s] = 0.9 * rng.choice([-1.0, 1.0], groups * s)
    y = a @ x_star + 0.05 * rng.normal(size=n)

    def objective(x):
        r = a @ x - y
        return 0.5 * float(r @ r) / n

    def gradients(idx, x):
        rows = a[idx]
        return sp.csr_matrix(rows.multiply((rows @ x - y[idx])[:, None]))

    radius = 1.2 * float(np.linalg.norm(x_star))
    ball = geometry.Constraint("l2-ball", radius=radius)
    estimator = br.MeanEstimator(1.0, s, 0.5, 1e-6)
    x0 = np.zeros(d)
    finals = []
    for seed in range(3):
        levels = br.sample_levels(seed, 20_000, n)
        plan = br.plan(levels, n, 2.0, 1e-5, estimator)
        eta = br.theory_learning_rate(2 * radius, n, d, estimator, plan.calls)
        result = br.run(gradients, x0, plan.steps, eta, ball, levels=levels, n=n,
                        estimator=estimator, seed=seed, keep_iterates=True)
        assert result.calls == plan.calls and result.iterates.shape == (plan.calls, d)
        assert np.linalg.norm(result.iterates, axis=1).max() <= radius * (1 + 1e-12)
        np.testing.assert_allclose(result.average, result.iterates.mean(axis=0), rtol=1e-12)
        finals.append(objective(result.average))
    start, best = objective(x0), objective(x_star)
    assert np.mean(finals) < start - 0.2 * (start - best), (finals, start, best)
    # the same seed gives the same run (the batches and noise come from the seed's streams)
    levels = br.sample_levels(0, 50, n)
    again = [br.run(gradients, x0, 20, 0.01, ball, levels=levels, n=n, estimator=estimator,
                    seed=0).average for _ in range(2)]
    np.testing.assert_array_equal(*again)
