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
