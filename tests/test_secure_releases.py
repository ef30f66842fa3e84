"""Secure noise (issue 12) for the releases beyond DP-GD's and DP-SGD's steps: SSP's sufficient
statistics, DP-AMBSSGD's counts and level sums, and the private statistics of ``beam_dp.stats``
(DPSGD-F's preprocessing, ``beam-dp stats``).

What each secure release relies on, checked here: its sum is an exact integer on a public grid,
the same for any order and split of the rows (so any runner gives the same bits); every row
moves it by at most the sensitivity the noise is scaled to, rounding included (checked in exact
integer or rational arithmetic); what is released is an integer multiple of the grid; the
accounting records that sensitivity; the noise has the calibrated scale and the results the
float path's accuracy (seeded checks, tolerances from the sampling distributions at a two-sided
false-alarm probability ALPHA); the exactly sampled exponential mechanism has the exact law.
The bit-identical models on every runner are in test_cluster_execution.py (SECURE).
"""
from __future__ import annotations

import functools
import math
import operator
import warnings
from fractions import Fraction

import numpy as np
import pytest
import scipy.linalg
from scipy import stats as sps

from beam_dp import accounting, clipping, losses, mechanisms, secure_noise, stats
from beam_dp.algorithms import dp_ambssgd, ssp
from beam_dp.algorithms.base import TrainState
from beam_dp.algorithms.noisy_gd import NoisyGDConfig
from beam_dp.clipping import ExactSum
from beam_dp.block import Block
from beam_dp.local import LocalAggregator
from conftest import read_json

ALPHA = 1e-6
Z = sps.norm.isf(ALPHA / 2)          # two-sided normal quantile at ALPHA (~4.9)
Q = clipping.GRID_FEATURE_BITS
BIGGEST = np.finfo(np.float64).max


def as_ints(total: ExactSum) -> np.ndarray:
    return total.hi.astype(object) * 2**32 + total.lo.astype(object)


def mixed_rows(rng, m: int, d: int) -> np.ndarray:
    """Rows of very different scales, zeros and a few at the float range's edges."""
    x = rng.normal(size=(m, d)) * np.exp(rng.normal(0.0, 2.0, (m, 1)))
    x[rng.random((m, d)) < 0.05] = 0.0
    x[0] = 1e200
    x[1, :2] = (-1e300, 1e-300)
    x[2] = 0.0
    x[3, :2] = (BIGGEST, -BIGGEST)
    x[4] = 5e-324
    return x


def blocks_of(x, y, cuts, source="mem"):
    """Blocks of the rows split at ``cuts`` (their positions kept as row_start)."""
    edges = [0, *cuts, len(y)]
    return [Block(x[a:b], y[a:b], source, a) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def quietly(function, *args, **kwargs):
    """Every floating-point event and every warning an error: a warning printed only for an
    extreme row would reveal that the row is there."""
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        return function(*args, **kwargs)


def chi2_ratio_bounds(k: int) -> tuple[float, float]:
    """The ALPHA quantiles of sqrt(chi2(k) / k): the sample std over the true one."""
    return tuple(math.sqrt(sps.chi2.ppf(q, k) / k) for q in (ALPHA / 2, 1 - ALPHA / 2))


# ============================================================ 1. rows on a grid, exact sums


@pytest.mark.parametrize("width", [1, 5, 40])
def test_grid_rows_never_exceed_their_bound_whatever_the_input(width):
    """Rows clipped to a bound (as the callers do) keep their rounded integers; rows beyond it
    (here inflated by up to 1%, or extreme) are shrunk until certified: in exact integer
    arithmetic every row's norm is at most the bound the noise is scaled to."""
    rng = np.random.default_rng([1, width])
    bound = 3.7
    grid = 2.0 ** -18
    limit = clipping.grid_row_bound(bound, grid, width)
    raw = mixed_rows(rng, 600, width) if width > 1 else rng.normal(size=(600, 1)) * 10
    clipped, _ = clipping.scale_rows(raw, bound, only_shrink=True)
    inflated = clipped[:200] * (1.0 + 0.01 * rng.random((200, 1)))
    rows = np.vstack([clipped, inflated, np.full((2, width), BIGGEST), np.zeros((1, width))])
    p = quietly(clipping.grid_rows, rows, grid, limit)
    assert np.array_equal(p, np.trunc(p)) and np.all(np.abs(p) < 2.0 ** 50)
    ints = p.astype(np.int64).astype(object)
    limit_sq = Fraction(limit) ** 2
    assert all(Fraction(int((r * r).sum())) <= limit_sq for r in ints)
    # The clipped rows are only rounded (no row of them needed shrinking) ...
    np.testing.assert_array_equal(p[:600], np.rint(clipped / grid))
    # ... and their norms reach the bound: the check has teeth.
    assert max(int((r * r).sum()) for r in ints[:600]) > 0.99 * limit ** 2
    # The sensitivity's rounding share: sqrt(width) / 2 grid units, and 2^-30 of the bound.
    assert limit == pytest.approx(bound / grid + math.sqrt(width) / 2, rel=2e-9)


def test_exact_row_sums_and_grams_are_the_same_for_any_split_and_order():
    rng = np.random.default_rng(2)
    m, d = 20000, 6
    # Entries near the bound 2^20, all positive: the whole sums pass 2^53, so summing them in
    # float64 at once (without the chunks) would round.
    z = rng.integers(2**19, 2**20, (m, d)).astype(np.float64)
    z[:, 0] = 2.0 ** 20                           # an intercept column at the entry bound
    total = clipping.exact_gram(z, 2.0 ** 20 + 1)
    truth = z.astype(np.int64).astype(object)
    assert np.array_equal(as_ints(total), truth.T @ truth)
    order = rng.permutation(m)
    parts = [clipping.exact_gram(z[rows], 2.0 ** 20 + 1) for rows in np.array_split(order, 7)]
    assert functools.reduce(operator.add, [parts[i] for i in rng.permutation(7)]) == total
    sums = clipping.exact_row_sum(z, 2.0 ** 20 + 1)
    assert np.array_equal(as_ints(sums), truth.sum(axis=0))
    assert functools.reduce(operator.add, [clipping.exact_row_sum(z[r], 2.0 ** 20 + 1)
                                           for r in np.array_split(order, 5)]) == sums


# =========================================================================== 2. SSP


def _ssp_data(seed, n, d, noise=0.3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    w = rng.standard_normal(d)
    w /= np.linalg.norm(w)
    return x, x @ w + 0.5 + noise * rng.standard_normal(n), w


def test_ssp_gram_is_an_exact_integer_matrix_for_any_blocks():
    """The secure Gram matrix: the same integers whatever the blocks and their order (extreme
    rows included, silently), equal to Z^T Z of the rows on the grid computed with Python
    integers, and the float path's Z^T Z to the grid's resolution."""
    rng = np.random.default_rng(3)
    n, d, c_x, c_y = 3000, 5, 2.5, 3.0
    x = mixed_rows(rng, n, d)
    y = 4.0 * rng.standard_normal(n)
    y[5] = -1e300
    grid = ssp.secure_grid(1.3, c_x, c_y, d)
    stage = ssp.GramStage(d, c_x, c_y, grid)
    one = quietly(stage.partial_sum, Block(x, y), {})
    cuts = np.sort(rng.choice(np.arange(1, n), 9, replace=False))
    parts = [stage.partial_sum(b, {}) for b in blocks_of(x, y, cuts)]
    assert functools.reduce(operator.add, [parts[i] for i in rng.permutation(len(parts))]) == one
    z = grid.rows(Block(x, y), c_x, c_y).astype(np.int64).astype(object)
    assert np.array_equal(as_ints(one), z.T @ z)
    # Against the float Gram (ordinary rows only: the extreme ones clip alike in both).
    ordinary = slice(10, None)
    float_gram = ssp.GramStage(d, c_x, c_y).partial_sum(Block(x[ordinary], y[ordinary]), {})
    exact = stage.partial_sum(Block(x[ordinary], y[ordinary]), {}).to_float()
    g, h = grid.feature_grid, grid.label_grid
    units = np.ones((d + 2, d + 2)) * g * g
    units[-1, :] = units[:, -1] = g * h
    units[-1, -1] = h * h
    scale = np.abs(float_gram).max()
    np.testing.assert_allclose(exact * units, float_gram, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("sigma, c_x, c_y", [(1.3, 2.5, 3.0), (40.0, 0.3, 100.0), (1.0, 9.0, 0.5)])
def test_ssp_rows_stay_within_the_sensitivities_the_noise_and_the_ledger_use(sigma, c_x, c_y):
    """Every row, extreme or not, satisfies ||(p, 1/g)||^2 <= K' and ||(p, 1/g)|| |c| <= the X^T y
    sensitivity, exactly (Python integers and Fractions); the noise scales are sigma times
    those; the ledger records them in data units, enlarged (never reduced) against the float
    path's C_x^2 + 1 and sqrt(C_x^2 + 1) C_y by the rounding only."""
    rng = np.random.default_rng([4, int(sigma * 100)])
    d = 4
    x = np.vstack([mixed_rows(rng, 400, d), rng.normal(size=(400, d)) * 50])
    y = np.concatenate([rng.normal(size=400) * 1e6, rng.normal(size=400)])
    grid = ssp.secure_grid(sigma, c_x, c_y, d)
    z = quietly(grid.rows, Block(x, y), c_x, c_y).astype(np.int64).astype(object)
    k_grid = Fraction(grid.xtx_sensitivity)
    for row in z:
        features_sq = Fraction(int((row[:-1] ** 2).sum()))
        assert features_sq <= k_grid
        assert abs(row[-1]) <= grid.label_limit
        assert features_sq * int(row[-1]) ** 2 <= Fraction(grid.xty_sensitivity) ** 2
    assert max(int((r[:-1] ** 2).sum()) for r in z) > 0.99 * grid.xtx_sensitivity
    scales = grid.scales(sigma)
    assert all(2.0 ** 32 <= s <= 2.0 ** 48 for s in scales.values())
    assert scales["xtx"] == sigma * grid.xtx_sensitivity
    assert scales["lambda_min"] == sigma * math.ceil(grid.xtx_sensitivity)
    # The ledger: the sensitivities in data units, the float path's plus the rounding.
    ledger, drawn = accounting.Ledger(), []
    real = mechanisms.discrete_gaussian

    def spy(generator, scale, size):
        drawn.append(scale)
        return real(generator, scale, size)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mechanisms, "discrete_gaussian", spy)
        ssp.train(NoisyGDConfig(noise_multiplier=sigma, num_examples=800, noise="secure"),
                  ssp.SspConfig(feature_norm=c_x, label_bound=c_y), losses.SquaredLoss(), d,
                  LocalAggregator([Block(x, y)]), 5, ledger)
    assert drawn == [scales["lambda_min"], scales["xtx"], scales["xty"]]
    (release,) = [r for r in ledger.releases if r.name == "gaussian_sufficient_statistics"]
    recorded = release.params["sensitivities"]
    assert recorded == grid.sensitivities()
    k = c_x ** 2 + 1.0
    for name, nominal in (("lambda_min", k), ("xtx", k), ("xty", math.sqrt(k) * c_y)):
        assert nominal < recorded[name] < nominal * (1 + 1e-4), name
    assert release.params["sampler_delta_bound"] > 0
    assert release.params["noise"].startswith("discrete Gaussian on exact integer sums")
    assert secure_noise.secure_release_note() in ledger.notes


def test_lambda_min_floor_is_exact_and_moves_by_at_most_the_sensitivity():
    """ceil(lambda_min) - 1 of integer matrices, exactly: against exact integer eigenvalues
    (diagonal and Q D Q^T with an integer orthogonal-up-to-scale Q), against float eigenvalues
    where they are accurate, and between neighbours S, S + z z^T it moves by 0 to ceil(||z||^2)."""
    def floor_of(values):
        return [math.ceil(v) - 1 for v in values]

    assert ssp.lambda_min_floor(np.diag([5, 7, 9]).astype(object)) == 4
    assert ssp.lambda_min_floor(np.zeros((3, 3), dtype=object)) == -1
    assert ssp.lambda_min_floor(np.array([[2, 1], [1, 2]], dtype=object)) == 0   # eigenvalues 1, 3
    # Q = [[3, -4], [4, 3]] / 5: Q diag(50, 1250) Q^T has integer entries and eigenvalues.
    q = np.array([[3, -4], [4, 3]], dtype=object)
    a = (q @ np.diag([50, 1250]).astype(object) @ q.T) // 25
    assert ssp.lambda_min_floor(a) == 49
    rng = np.random.default_rng(5)
    for d in (3, 8):
        x = rng.integers(-2**20, 2**20, (500, d)).astype(object)
        s = x.T @ x * 7
        estimate = np.linalg.eigvalsh(np.array(s, float))[0]
        slack = 1e-12 * float(np.linalg.norm(np.array(s, float))) + 2
        assert abs(ssp.lambda_min_floor(s) - floor_of([estimate])[0]) <= slack
        for _ in range(5):
            z = rng.integers(-2**20, 2**20, d).astype(object)
            moved = ssp.lambda_min_floor(s + np.outer(z, z)) - ssp.lambda_min_floor(s)
            assert 0 <= moved <= int((z * z).sum())
    # Nearly singular: a repeated row direction (lambda_min ~ 0 exactly representable).
    v = np.array([1, 2, 3], dtype=object)
    assert ssp.lambda_min_floor(np.outer(v, v) * 1000) == -1


def _capture_solve(monkeypatch):
    calls = []
    real = scipy.linalg.solve

    def solve(a, b, **kwargs):
        calls.append((np.array(a), np.array(b)))
        return real(a, b, **kwargs)
    monkeypatch.setattr(ssp.scipy.linalg, "solve", solve)
    return calls


def test_ssp_secure_releases_are_integer_multiples_of_the_grid(monkeypatch):
    """X^T X + E (without the public ridge) is an integer matrix times g^2, X^T y + e an integer
    vector times g h, symmetric, and the noise is not zero."""
    n, d = 2000, 4
    x, y, _ = _ssp_data(6, n, d)
    calls = _capture_solve(monkeypatch)
    result = ssp.train(NoisyGDConfig(noise_multiplier=1.0, num_examples=n, noise="secure"),
                       ssp.SspConfig(ridge=0.0), losses.SquaredLoss(), d,
                       LocalAggregator(blocks_of(x, y, [700])), 7, accounting.Ledger())
    grid = ssp.secure_grid(1.0, 2.0 * math.sqrt(d), 4.0, d)
    assert result.preprocessing["grid_bits"] == grid.bits
    (a, b), = calls
    units_xx = a / grid.feature_grid ** 2
    units_xy = b / (grid.feature_grid * grid.label_grid)
    assert np.array_equal(units_xx, np.trunc(units_xx)) and np.array_equal(a, a.T)
    assert np.array_equal(units_xy, np.trunc(units_xy))
    exact = ssp.GramStage(d, 2.0 * math.sqrt(d), 4.0, grid).partial_sum(Block(x, y), {}).to_float()
    assert np.all(units_xx != exact[:-1, :-1]) and np.all(units_xy != exact[:-1, -1])


def test_ssp_secure_noise_has_the_calibrated_scale(monkeypatch):
    """As the float path's test: XtX's noise (upper triangle) has std sigma K', Xty's sigma
    sqrt(K') C'; 40 seeds; the sample std over the nominal one within the sqrt(chi2(k)/k)
    ALPHA quantiles."""
    n, d, sigma, c_y = 300, 12, 0.8, 3.0
    c_x = 2 * math.sqrt(d)
    x, y, _ = _ssp_data(9, n, d, 1.0)
    grid = ssp.secure_grid(sigma, c_x, c_y, d)
    gram = ssp.GramStage(d, c_x, c_y, grid).partial_sum(Block(x, y), {}).to_float()
    g, h = grid.feature_grid, grid.label_grid
    calls = _capture_solve(monkeypatch)
    for seed in range(40):
        ssp.train(NoisyGDConfig(noise_multiplier=sigma, num_examples=n, noise="secure"),
                  ssp.SspConfig(label_bound=c_y, ridge=0.0), losses.SquaredLoss(), d,
                  LocalAggregator([Block(x, y)]), seed, accounting.Ledger())
    upper = np.triu_indices(d + 1)
    xtx = np.concatenate([(a / g ** 2 - gram[:-1, :-1])[upper] for a, _ in calls])
    xty = np.concatenate([b / (g * h) - gram[:-1, -1] for _, b in calls])
    scales = grid.scales(sigma)
    for noise, nominal in ((xtx, scales["xtx"]), (xty, scales["xty"])):
        lo, hi = chi2_ratio_bounds(noise.size)
        assert lo < math.sqrt(np.mean(noise ** 2)) / nominal < hi
        assert abs(noise.mean()) < Z * nominal / math.sqrt(noise.size)


def test_ssp_secure_accuracy_matches_float():
    """Seeded: over 40 seeds each, the secure and the float runs' squared distance to OLS have
    the same mean within Z standard errors of the difference (both are the same mechanism up
    to a 2^-20 grid and a total variation of ~1e-14)."""
    n, d = 4000, 5
    x, y, _ = _ssp_data(10, n, d)
    ols = np.linalg.lstsq(np.column_stack([x, np.ones(n)]), y, rcond=None)[0]
    errors = {}
    for noise in ("float", "secure"):
        errors[noise] = np.array([
            np.sum((ssp.train(NoisyGDConfig(noise_multiplier=2.0, num_examples=n, noise=noise),
                              ssp.SspConfig(), losses.SquaredLoss(), d,
                              LocalAggregator([Block(x, y)]), seed, accounting.Ledger()).theta[0]
                    - ols) ** 2) for seed in range(40)])
    a, b = errors["float"], errors["secure"]
    se = math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    assert abs(a.mean() - b.mean()) < Z * se
    assert b.mean() < 0.1 * np.sum(ols ** 2)     # and it learned something


def test_ssp_refuses_secure_noise_outside_its_grid():
    with pytest.raises(ValueError, match="--noise float"):
        ssp.secure_grid(1.0, 2.0 ** 30, 1.0, 3)   # C_x far above 2^20: 1 falls off the grid
    with pytest.raises(ValueError, match="--noise float"):
        ssp.secure_grid(1e-9, 2.0, 1.0, 3)        # noise below 2^32 grid units


# ====================================================================== 3. DP-AMBSSGD

LINEAR = losses.SquaredLoss()


def _amb_step(noise="secure", levels=8, resolution=0.125, feature_norm=1.0, bound=16.0,
              sigma_stat=6.0, sigma_grad=2.0, stat_size=200.0, batch_size=1.0,
              learning_rate=1.0, margin=0.0, d=4):
    secure = {}
    if noise == "secure":
        secure = dict(noise="secure", count_bits=dp_ambssgd.count_bits(sigma_stat),
                      scale_bits=secure_noise.secure_scale_bits(sigma_grad))
    return dp_ambssgd.AmbssgdStep(d, levels, resolution, bound, feature_norm, sigma_stat,
                                  sigma_grad, stat_size, batch_size, learning_rate, margin, 0, 11,
                                  **secure)


def test_every_level_of_the_multi_level_kernel_is_the_single_level_kernel():
    """exact_clipped_gradient_sums at L clip norms: level l is exact_clipped_gradient_sum at
    clip norm l, integer for integer, on extreme rows too, and the same for any split."""
    rng = np.random.default_rng(12)
    m, d = 5000, 5
    x = mixed_rows(rng, m, d)
    y = 3.0 * rng.standard_normal(m)
    theta = rng.normal(size=(1, d + 1))
    q, shift = clipping.quantized_rows(x, True)
    norms = np.sqrt(np.einsum("ij,ij->i", q, q))
    clip_norms = 0.7 * np.minimum(0.01 * 2.0 ** np.arange(12), 9.0)
    bits = secure_noise.secure_scale_bits(1.5)
    clipping._blas_rows_stable()   # the once-per-process check, on ordinary data
    levels = quietly(clipping.exact_clipped_gradient_sums, theta, q, shift, norms, y, LINEAR,
                     clip_norms, bits)
    assert levels.shape == (12, 1, d + 1)
    for l, c in enumerate(clip_norms):
        single = clipping.exact_clipped_gradient_sum(theta, q, shift, norms, y, LINEAR, c, bits)
        assert np.array_equal(as_ints(levels)[l], as_ints(single))
    order = rng.permutation(m)
    parts = [clipping.exact_clipped_gradient_sums(theta, q[r], shift[r], norms[r], y[r], LINEAR,
                                                  clip_norms, bits)
             for r in np.array_split(order, 6)]
    assert functools.reduce(operator.add, parts) == levels


def test_ambssgd_each_row_adds_at_most_the_sensitivity_at_every_level():
    """One row alone, at every level: its gradient sum has squared norm at most
    2^(2 (Q - 1 + U)) grid units (checked exactly), whatever the row or theta; and most
    ordinary rows reach it at the small levels (the check has teeth)."""
    rng = np.random.default_rng(13)
    m, d = 60, 4
    x = np.vstack([mixed_rows(rng, m, d), rng.normal(size=(m, d))])
    y = 5.0 * rng.standard_normal(2 * m)
    bits = secure_noise.secure_scale_bits(1.0)
    bound = 2 ** (2 * (Q - 1 + bits))
    clipping._blas_rows_stable()
    clip_norms = 2.0 * np.minimum(0.001 * 2.0 ** np.arange(10), 0.3)
    for theta in (rng.normal(size=(1, d + 1)), np.full((1, d + 1), 1e300)):
        q, shift = clipping.quantized_rows(x, True)
        norms = np.sqrt(np.einsum("ij,ij->i", q, q))
        reached = 0
        for i in range(len(x)):
            one = quietly(clipping.exact_clipped_gradient_sums, theta, q[i:i + 1],
                          shift[i:i + 1], norms[i:i + 1], y[i:i + 1], LINEAR, clip_norms, bits)
            sq = (as_ints(one) ** 2).sum(axis=(1, 2))
            assert all(int(v) <= bound for v in sq)
            reached += int(sq[0]) > 0.9 * bound
        assert reached > m // 2


def test_ambssgd_secure_partial_sums_are_exact_and_block_independent():
    """A step's secure sum (counts and every level's gradient sum) is the same for any split of
    its parts into blocks and any order; the counts are the histogram's integers."""
    rng = np.random.default_rng(14)
    m, d = 3000, 4
    x = mixed_rows(rng, m, d)
    y = 2.0 * rng.standard_normal(m)
    step = _amb_step(d=d)
    state = TrainState(rng.normal(size=(1, d + 1)) * 0.3, np.zeros((1, d + 1)), 2)
    clipping._blas_rows_stable()
    sums = {}
    for tag in (2 * 2 + dp_ambssgd.STAT, 2 * 2 + dp_ambssgd.GRAD):
        whole = Block(x, y, tag=tag)
        total = quietly(step.partial_sum, whole, state)
        cuts = np.sort(rng.choice(np.arange(1, m), 5, replace=False))
        parts = []
        for b in blocks_of(x, y, cuts):
            b.tag = tag
            parts.append(step.partial_sum(b, state))
        assert functools.reduce(operator.add, [parts[i] for i in rng.permutation(len(parts))]) == total
        sums[tag] = as_ints(total).reshape(step.levels + 1, d + 2)
    counts = sums[4][:, 0]
    q, shift = clipping.quantized_rows(x, True)
    residual = clipping.quantized_scores(state.theta, q, shift)[:, 0] - y
    expected = np.bincount(np.searchsorted(step.thresholds(), np.abs(residual)),
                           minlength=step.levels + 2)[:step.levels + 1]
    assert np.array_equal(counts.astype(np.int64), expected)
    assert np.all(sums[4][:, 1:] == 0) and np.all(sums[5][:, 0] == 0)
    # Another step's parts add nothing.
    other = Block(x, y, tag=0)
    assert step.partial_sum(other, state) == step.zero_sum()


def test_ambssgd_secure_update_is_an_integer_multiple_of_the_grid():
    """With power-of-two clip norms and learning rate = batch size, the update is the noisy sum
    itself: an integer times the selected level's grid, with non-zero noise."""
    d = 4
    step = _amb_step(d=d, stat_size=0.0, margin=1e9)       # the search stops at level 0
    hi = np.zeros((step.levels + 1, d + 2), np.int64)
    lo = np.zeros_like(hi)
    lo[:, 1:] = 1000
    state = TrainState.zeros(1, d)
    new = step.apply(state, ExactSum(hi.ravel(), lo.ravel()))
    grid = clipping.gradient_grid(float(step.clip_norms()[0]), step.scale_bits)
    assert math.frexp(grid)[0] == 0.5                       # a power of two here
    units = -new.theta[0] / grid
    assert np.array_equal(units, np.trunc(units)) and np.all(units != 1000)
    assert np.all(np.abs(units - 1000) < 10 * step.gradient_scale())


def test_ambssgd_secure_search_noise_is_sigma_stat_per_count(monkeypatch):
    """The doubling search's noise on a count has std sigma_stat (in counts): with the first
    cumulative count half a sigma_stat below the threshold, the search stops at level 0 with
    probability 1 - Phi(1/2); 1500 seeds, within Z binomial standard errors. (The level is read
    from the clip norm whose grid the update uses.)"""
    d, sigma_stat = 3, 6.0
    trials = 1500
    hi = np.zeros((9, d + 2), np.int64)
    lo = np.zeros_like(hi)
    lo[0, 0] = 100
    used, real = [], clipping.gradient_grid
    monkeypatch.setattr(clipping, "gradient_grid", lambda c, *a: used.append(c) or real(c, *a))
    base = _amb_step(d=d, sigma_stat=sigma_stat, stat_size=103.0)
    for seed in range(trials):
        dataclass_replace(base, seed=seed).apply(TrainState.zeros(1, d),
                                                  ExactSum(hi.ravel(), lo.ravel()))
    assert len(used) == trials
    stops = sum(c == base.clip_norms()[0] for c in used)
    p = sps.norm.sf(0.5)
    assert abs(stops / trials - p) < Z * math.sqrt(p * (1 - p) / trials)


def dataclass_replace(obj, **changes):
    import dataclasses
    return dataclasses.replace(obj, **changes)


def test_ambssgd_secure_accuracy_and_accounting_match_float():
    """Seeded: over 20 seeds each, secure and float DP-AMBSSGD reach the same excess risk
    (difference of means within Z standard errors), without observation noise, where the
    privacy noise is the error (twice the gradient noise quadruples it: the check has teeth);
    the ledger holds the same Gaussian event with the secure noise's description and bound."""
    n, d = 24000, 4
    rng = np.random.default_rng(15)
    x = rng.standard_normal((n, d))
    w = rng.standard_normal(d)
    w /= np.linalg.norm(w)
    y = x @ w
    blocks = blocks_of(x, y, [6000, 12000, 18000])
    risks, ledgers = {}, {}
    for noise in ("float", "secure"):
        values = []
        for seed in range(20):
            ledger = accounting.Ledger()
            result = dp_ambssgd.train(NoisyGDConfig(noise_multiplier=1.0, num_examples=n,
                                                    noise=noise),
                                      dp_ambssgd.AmbssgdConfig(blocks=6), LINEAR, d,
                                      LocalAggregator(blocks), seed, ledger)
            values.append(0.5 * (np.sum((result.theta[0, :-1] - w) ** 2) + result.theta[0, -1] ** 2))
        risks[noise], ledgers[noise] = np.array(values), ledger
    a, b = risks["float"], risks["secure"]
    se = math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    assert abs(a.mean() - b.mean()) < Z * se and b.mean() < 1e-6
    (fl,), (se_,) = ([r for r in ledgers[k].releases if r.name.startswith("dp_ambssgd")]
                     for k in ("float", "secure"))
    assert fl.event == se_.event
    assert se_.params["noise"].startswith("discrete Gaussian on exact integer sums")
    assert fl.params["noise"] == "float Gaussian (numpy) on float sums"
    assert 0 < se_.params["sampler_delta_bound"] < 1e-3 * 1e-5


# =================================================== 4. exact exponential mechanism, means


@pytest.mark.parametrize("gamma", [Fraction(0), Fraction(1, 3), Fraction(1), Fraction(7, 3),
                                   Fraction(11, 2)])
def test_bernoulli_exp_has_the_exact_probability(gamma):
    g = mechanisms.secure_generator(7, 99, gamma.numerator, gamma.denominator)
    trials = 20000
    hits = sum(stats.bernoulli_exp(g, gamma) for _ in range(trials))
    p = math.exp(-gamma)
    assert abs(hits / trials - p) <= Z * math.sqrt(p * (1 - p) / trials) + (p in (0, 1))
    assert stats.bernoulli_exp(g, Fraction(0))   # exp(0) = 1: always


@pytest.mark.slow
def test_exact_exponential_mechanism_has_the_exponential_mechanisms_law():
    """30,000 draws over 6 candidates against P(i) proportional to exp(eps u_i / 2): a
    chi-square goodness-of-fit at ALPHA (a sampler off by a few percent in any cell fails)."""
    utilities = [Fraction(-3), Fraction(0), Fraction(-1, 2), Fraction(-7), Fraction(-2), Fraction(0)]
    epsilon = 0.8
    weights = np.array([math.exp(epsilon * float(u) / 2) for u in utilities])
    probabilities = weights / weights.sum()
    g = mechanisms.secure_generator(8, 1)
    draws = 30000
    counts = np.bincount([stats.exact_exponential_mechanism(g, utilities, epsilon)
                          for _ in range(draws)], minlength=len(utilities))
    chi2 = float(np.sum((counts - draws * probabilities) ** 2 / (draws * probabilities)))
    assert chi2 < sps.chi2.isf(ALPHA, len(utilities) - 1)


def test_exact_quantile_utility_is_the_float_one_with_sensitivity_exactly_one():
    rng = np.random.default_rng(16)
    for trial in range(60):
        size = int(rng.integers(3, 40))
        # Half the trials with few values, so that the margin often exceeds T / 2.
        counts = rng.integers(0, 50 if trial % 2 else 2, size + 1).astype(float)
        rank, quantile, margin = float(-rng.random() * 30), float(rng.random()), float(rng.random() * 20)
        exact = stats.exact_quantile_utility(counts, size, rank, quantile, margin)
        np.testing.assert_allclose([float(u) for u in exact],
                                   stats.quantile_utility(counts, size, rank, quantile, margin),
                                   rtol=0, atol=1e-9)
        cell = int(rng.integers(0, size + 1))
        bigger = counts.copy()
        bigger[cell] += 1                       # one more value, in any cell
        after = stats.exact_quantile_utility(bigger, size, rank, quantile, margin)
        assert max(abs(a - b) for a, b in zip(after, exact)) <= 1


def test_secure_quantile_stage_draws_from_the_exact_law():
    """QuantileStage with secure noise: over 400 seeds, the chosen grid points' frequencies
    against the exponential mechanism's probabilities (chi-square at ALPHA, cells pooled to an
    expected count of at least 5). Few values and a small epsilon, so that the law spreads
    over the grid."""
    values = np.random.default_rng(17).normal(size=(40, 1))
    grid = np.linspace(-2, 2, 9)[None, :]
    epsilon = 0.3
    counts = stats.histogram(values, grid)
    utilities = stats.quantile_utility(counts[0], 9, 0.0, 0.5)
    weights = np.exp(epsilon * utilities / 2)
    probabilities = weights / weights.sum()
    seeds = 400
    chosen = []
    for seed in range(seeds):
        stage = stats.QuantileStage("m", stats.Columns(), stats.FixedGrid(grid), 1, 9, (0.5,),
                                    epsilon, seed, noise="secure")
        out = stage.apply({}, counts)["m"][0, 0]
        chosen.append(int(np.flatnonzero(grid[0] == out)[0]))
    observed = np.bincount(chosen, minlength=9)
    expected = seeds * probabilities
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp_ = np.append(expected[keep], expected[~keep].sum())
    obs, exp_ = obs[exp_ > 0], exp_[exp_ > 0]
    chi2 = float(np.sum((obs - exp_) ** 2 / exp_))
    assert chi2 < sps.chi2.isf(ALPHA, len(obs) - 1)
    (release,) = stage.releases()
    assert release[1] == accounting.PureDpEvent(epsilon)
    assert release[3]["sampler_total_variation"] == 0.0


def test_secure_clipped_mean_is_exact_bounded_and_noised_on_its_grid():
    """The secure clipped mean's sum: exact and block-independent; its noisy sum an integer
    multiple of the grid with noise of std sigma R g (R the enlarged sensitivity), 300 seeds."""
    rng = np.random.default_rng(18)
    m, d, radius, sigma = 2000, 5, 1.5, 0.9
    x = mixed_rows(rng, m, d)
    y = np.zeros(m)
    stage = stats.ClippedMeanStage("mean", stats.Columns(), d, 0.25, radius, sigma, 3,
                                   noise="secure")
    state = {"n": m}
    whole = quietly(stage.partial_sum, Block(x, y), state)
    parts = [stage.partial_sum(b, state) for b in blocks_of(x, y, [100, 999, 1500])]
    assert functools.reduce(operator.add, parts[::-1]) == whole
    grid, limit = stats.mean_grid(radius, sigma, d)
    assert 2.0 ** 36 <= sigma * limit <= 2.0 ** 37 + sigma * math.sqrt(d)
    assert limit == pytest.approx(radius / grid, rel=1e-9)
    noises = []
    for seed in range(300):
        noisy = stats.stages._secure_noisy_sum(dataclass_replace(stage, seed=seed), whole, radius, d)
        units = noisy / grid
        assert np.array_equal(units, np.trunc(units))
        noises.append(units - whole.to_float())
    noises = np.concatenate(noises)
    lo, hi = chi2_ratio_bounds(noises.size)
    assert lo < math.sqrt(np.mean(noises ** 2)) / (sigma * limit) < hi
    (release,) = stage.releases()
    assert release[3]["sampler_total_variation"] == stats.mean_sampler_variation(d)
    assert release[3]["noise"].startswith("discrete Gaussian on exact integer sums")


@pytest.mark.slow
def test_secure_adaptive_mean_accuracy_matches_float():
    """DPSGD-F's theory preprocessing (the adaptive mean: exponential-mechanism medians and
    radius, then the clipped mean), secure against float over 80 seeds each: the same mean
    squared error within Z standard errors of the difference."""
    rng = np.random.default_rng(19)
    n, d = 3000, 3
    x = rng.normal(size=(n, d)) + np.array([3.0, -1.0, 0.5])
    truth = x.mean(axis=0)
    blocks = blocks_of(x, np.zeros(n), [1000, 2000])
    errors = {}
    for noise in ("float", "secure"):
        values = []
        for seed in range(80):
            stages = stats.adaptive_mean_stages("mean", d, 10.0, 1.0, 1e-6, seed, 4,
                                                grid_size=257, noise=noise)
            state = LocalAggregator(blocks).run_stages(stages, {"n": n})
            values.append(float(np.sum((state["mean"] - truth) ** 2)))
        errors[noise] = np.array(values)
    a, b = errors["float"], errors["secure"]
    se = math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    assert abs(a.mean() - b.mean()) < Z * se and b.mean() < 0.05


def test_secure_count_stage_is_a_discrete_laplace_count():
    stage = stats.CountStage(0.5, 1, noise="secure")
    draws = np.array([stats.CountStage(0.5, s, noise="secure").apply({}, np.array([1000.0]))["n"]
                      for s in range(3000)]) - 1000
    assert draws.dtype.kind == "i"
    # Discrete Laplace of scale b = 2: variance 2 q / (1 - q)^2, q = exp(-1/b).
    q = math.exp(-0.5)
    variance = 2 * q / (1 - q) ** 2
    lo, hi = chi2_ratio_bounds(draws.size)
    assert lo < math.sqrt(np.mean(draws ** 2.0) / variance) < hi
    (release,) = stage.releases()
    assert release[0] == "discrete_laplace_count" and release[1] == accounting.PureDpEvent(0.5)


# ============================================================== 5. beam-dp stats, end to end


@pytest.mark.slow
def test_beam_dp_stats_secure_gives_the_same_report_on_local_and_beam(tmp_path, cli):
    rng = np.random.default_rng(20)
    import pyarrow as pa
    import pyarrow.parquet as pq
    x = rng.normal(size=(3000, 3)) * np.array([1.0, 50.0, 0.01])
    for i, rows in enumerate(np.array_split(np.arange(3000), 2)):
        pq.write_table(pa.table({f"f{j}": x[rows, j] for j in range(3)} | {"label": x[rows, 0]}),
                       tmp_path / f"d-{i}.parquet", row_group_size=500)
    common = ["stats", "--input", str(tmp_path / "d-*.parquet"), "--epsilon", "4", "--seed", "3",
              "--noise", "secure", "--batch-rows", "400"]
    assert cli(*common, "--output", tmp_path / "local", "--runner", "local").code == 0
    r = cli(*common, "--output", tmp_path / "beam", "--runner", "FnApiRunner")
    assert r.code == 0, r
    local, beam = (read_json(tmp_path / k / "stats_report.json") for k in ("local", "beam"))
    assert local == beam
    assert local["count_source"] == "private estimate: discrete Laplace count"
    privacy = local["privacy"]
    assert 0 < privacy["sampler_delta_bound"] < 1e-3 * privacy["delta"]
    assert privacy["epsilon"] <= 4.0
    names = {m["name"] for m in privacy["mechanisms"]}
    assert "discrete_laplace_count" in names
    assert secure_noise.secure_release_note() in privacy["accounting_notes"]
    assert abs(local["columns"]["f1"]["mean"] - float(x[:, 1].mean())) < 10
