"""Poisson sampling keyed by (seed, step, block position).

Every statistical check is seeded, so it is deterministic; its tolerance is what the sampling
distribution allows at a two-sided false-alarm probability of ALPHA, so that a correct sampler
would fail it with probability at most ALPHA for a random seed, while a wrong rate or a sampler
with the wrong variance (e.g. a fixed batch size) fails it by a wide margin.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from beam_dp.block import Block
from beam_dp.sampling import PoissonSampler

ALPHA = 1e-6


def _block(m, source="/data/part-0.parquet", row_start=0):
    return Block(np.zeros((m, 2)), np.zeros(m), source, row_start)


def test_rows_are_sorted_unique_and_in_range():
    block = _block(500)
    sampler = PoissonSampler(0.3, seed=1)
    for step in range(20):
        rows = sampler.rows(block, step)
        assert np.all(np.diff(rows) > 0)
        assert rows.size == 0 or (rows[0] >= 0 and rows[-1] < 500)
        selected = sampler.select(block, step)
        assert len(selected) == rows.size
        assert selected.source == block.source and selected.row_start == block.row_start


def test_inclusion_frequency_per_example_is_q():
    m, steps, q = 200, 2000, 0.1
    block = _block(m)
    sampler = PoissonSampler(q, seed=12345)
    counts = np.zeros(m)
    for step in range(steps):
        counts[sampler.rows(block, step)] += 1

    # Each example's inclusion count over the steps is Binomial(steps, q): mean steps*q, variance
    # steps*q*(1-q). Standardize and check (1) every example, with a Bonferroni-corrected normal
    # bound (the binomial with steps*q = 200 is close to normal), and (2) the sum of the squared
    # z-scores, which is chi-square with m degrees of freedom when the examples are independent.
    z = (counts - steps * q) / np.sqrt(steps * q * (1 - q))
    z_max = stats.norm.isf(ALPHA / (2 * m))
    assert np.max(np.abs(z)) < z_max
    chi2 = float(np.sum(z**2))
    assert stats.chi2.ppf(ALPHA / 2, m) < chi2 < stats.chi2.isf(ALPHA / 2, m)
    # Overall frequency: the total count is Binomial(m*steps, q).
    total_z = (counts.sum() - m * steps * q) / np.sqrt(m * steps * q * (1 - q))
    assert abs(total_z) < stats.norm.isf(ALPHA / 2)


def test_batch_size_distribution_over_seeds():
    m, q, seeds = 1000, 0.05, 4000
    block = _block(m)
    sizes = np.array([PoissonSampler(q, seed).rows(block, 0).size for seed in range(seeds)],
                     dtype=float)

    # Poisson sampling makes the batch size Binomial(m, q): mean mu = m*q, variance
    # var = m*q*(1-q) (a fixed-size sampler would give variance 0).
    mu, var = m * q, m * q * (1 - q)
    z = stats.norm.isf(ALPHA / 2)
    # Sample mean: standard error sqrt(var / seeds).
    assert abs(sizes.mean() - mu) < z * np.sqrt(var / seeds)
    # Sample variance s^2: Var(s^2) = var^2 * (2/(seeds-1) + kappa/seeds), where kappa is the
    # binomial's excess kurtosis (1 - 6q(1-q)) / (m q (1-q)).
    kappa = (1 - 6 * q * (1 - q)) / var
    se_var = var * np.sqrt(2 / (seeds - 1) + kappa / seeds)
    assert abs(sizes.var(ddof=1) - var) < z * se_var


def test_same_seed_step_and_block_give_same_rows():
    block = _block(1000, "/data/a.parquet", 65536)
    a = PoissonSampler(0.2, seed=7).rows(block, 3)
    # A new sampler and a new Block object at the same position (its content does not matter).
    other = Block(np.ones((1000, 2)), np.ones(1000), "/data/a.parquet", 65536)
    b = PoissonSampler(0.2, seed=7).rows(other, 3)
    np.testing.assert_array_equal(a, b)


def test_steps_blocks_and_seeds_draw_differently():
    sampler = PoissonSampler(0.2, seed=7)
    block = _block(1000, "/data/a.parquet", 0)
    base = sampler.rows(block, 0)
    # Two independent 20% samples of 1000 rows coincide with probability ~0.
    assert not np.array_equal(base, sampler.rows(block, 1))
    assert not np.array_equal(base, sampler.rows(_block(1000, "/data/a.parquet", 1000), 0))
    assert not np.array_equal(base, sampler.rows(_block(1000, "/data/b.parquet", 0), 0))
    assert not np.array_equal(base, PoissonSampler(0.2, seed=8).rows(block, 0))


def test_consecutive_steps_are_independent():
    # Overlap between the batches of steps t and t+1: for independent Poisson samples every row is
    # in both with probability q^2, so the total overlap over T step pairs is Binomial(m*T, q^2).
    m, q, steps = 500, 0.2, 400
    block = _block(m)
    sampler = PoissonSampler(q, seed=99)
    masks = np.zeros((steps + 1, m), dtype=bool)
    for t in range(steps + 1):
        masks[t, sampler.rows(block, t)] = True
    overlap = float(np.sum(masks[1:] & masks[:-1]))
    n, p = m * steps, q * q
    assert abs(overlap - n * p) < stats.norm.isf(ALPHA / 2) * np.sqrt(n * p * (1 - p))


def test_rate_one_selects_every_row():
    block = _block(10)
    sampler = PoissonSampler(1.0, seed=0)
    assert sampler.rows(block, 5) is None
    assert sampler.select(block, 5) is block


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5, float("nan")])
def test_rate_must_be_in_zero_one(rate):
    with pytest.raises(ValueError):
        PoissonSampler(rate, seed=0)


# ------------------------------------------------------- chunked draws (several steps at once)

def _batch_size_chi2(sizes: np.ndarray, m: int, q: float) -> tuple[float, int]:
    """Pearson's chi-square of observed batch sizes against Binomial(m, q), over bins of at least
    5 expected counts (the tails pooled): (statistic, degrees of freedom)."""
    n = len(sizes)
    edges = [k for k in range(m + 1) if n * stats.binom.pmf(k, m, q) >= 5]
    lo, hi = edges[0], edges[-1]
    observed = [np.sum(sizes <= lo)] + [np.sum(sizes == k) for k in range(lo + 1, hi)] + [np.sum(sizes >= hi)]
    expected = ([stats.binom.cdf(lo, m, q)] + [stats.binom.pmf(k, m, q) for k in range(lo + 1, hi)]
                + [stats.binom.sf(hi - 1, m, q)])
    observed, expected = np.array(observed, float), n * np.array(expected)
    return float(np.sum((observed - expected) ** 2 / expected)), len(observed) - 1


@pytest.mark.parametrize("q", [0.01, 0.3])
def test_batch_sizes_over_steps_are_binomial(q):
    # Every step's size, across many chunks (chunk_steps(0.01) = 100, chunk_steps(0.3) = 3), is
    # an independent Binomial(m, q) draw: Pearson's chi-square against it.
    m, steps = 1000, 20_000 if q < 0.1 else 6_000   # (a chunk of 3 steps each at q = 0.3)
    sampler = PoissonSampler(q, seed=2024)
    sizes = np.array([len(rows) for _, rows in sampler.rows_of_steps(_block(m), range(steps))])
    chi2, dof = _batch_size_chi2(sizes, m, q)
    assert chi2 < stats.chi2.isf(ALPHA, dof), (chi2, dof)
    # A fixed batch size (variance 0) or a rate 10% off fails by far:
    fixed = np.full(steps, int(m * q))
    assert _batch_size_chi2(fixed, m, q)[0] > stats.chi2.isf(ALPHA, dof)
    off = np.random.default_rng(0).binomial(m, 1.1 * q, size=steps)
    assert _batch_size_chi2(off, m, q)[0] > stats.chi2.isf(ALPHA, dof)


def test_inclusion_frequencies_across_chunks_are_q():
    # Rows' inclusion counts over 3,000 steps (150 chunks of 20): each Binomial(3000, q),
    # independent across rows: the sum of squared z-scores is chi-square with m degrees.
    m, steps, q = 400, 3000, 0.05
    sampler = PoissonSampler(q, seed=77)
    counts = np.zeros(m)
    for _, rows in sampler.rows_of_steps(_block(m), range(steps)):
        counts[rows] += 1
    z = (counts - steps * q) / np.sqrt(steps * q * (1 - q))
    chi2 = float(np.sum(z ** 2))
    assert stats.chi2.ppf(ALPHA / 2, m) < chi2 < stats.chi2.isf(ALPHA / 2, m)
    assert np.max(np.abs(z)) < stats.norm.isf(ALPHA / (2 * m))


def test_a_short_first_draw_of_gaps_still_gives_the_law(monkeypatch):
    # The first draw of geometric gaps rarely falls short of the chunk; force it to (negative
    # slack: a handful of gaps at a time) and the sizes must still be Binomial(m, q).
    from beam_dp import sampling
    monkeypatch.setattr(sampling, "SLACK_SDS", -1e9)
    m, q, steps = 500, 0.02, 4_000
    sizes = np.array([len(r) for _, r in PoissonSampler(q, 5).rows_of_steps(_block(m), range(steps))])
    chi2, dof = _batch_size_chi2(sizes, m, q)
    assert chi2 < stats.chi2.isf(ALPHA, dof), (chi2, dof)


def test_local_batches_are_the_batch_jobs_pieces_in_any_step_order():
    # The local runner's step-by-step batches (the current chunk kept) and the Beam batch job's
    # pieces (every step of a block in one pass) hold the same rows, in the same order, also
    # when steps are asked out of order (a resumed run).
    from beam_dp import batches
    rng = np.random.default_rng(3)
    blocks = [Block(rng.normal(size=(m, 3)), rng.normal(size=m), f"/d/part-{i % 2}.parquet", start)
              for i, (m, start) in enumerate([(700, 0), (300, 0), (650, 700), (20, 1350)])]
    plan = batches.PoissonPlan(PoissonSampler(0.04, seed=11), 0.04 * 1670)
    steps = 120   # 5 chunks of 25
    whole = {}
    for block in blocks:
        for step, piece in plan.pieces(block, range(steps)):
            whole.setdefault(step, []).append(piece)
    local = batches.LocalBatches(blocks, plan)
    for step in list(range(steps)) + [97, 3, 119, 50]:
        expected = batches.assemble(whole.get(step, []))
        got = local.get(step)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a.features, b.features)
            np.testing.assert_array_equal(a.labels, b.labels)
            np.testing.assert_array_equal(a.sq_norms, b.sq_norms)
