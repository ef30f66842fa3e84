"""Which examples each step reads: Poisson sampling keyed by the example's position.

Sampling for step t of a block is drawn from ``rng(seed, STREAM_SAMPLING, t, block.key)``: a
Binomial(m, q) count followed by a uniform subset of that size, which gives every example an
independent Bernoulli(q) inclusion (Poisson sampling) while costing O(q m) per block rather than
m uniform draws. Because the draw depends only on the seed, the step and the block's position,
the local and Beam runners select the same examples.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from beam_dp import mechanisms
from beam_dp.block import Block


@dataclasses.dataclass(frozen=True)
class PoissonSampler:
    rate: float
    seed: int

    def __post_init__(self):
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"sampling rate must be in (0, 1], got {self.rate}")

    def rows(self, block: Block, step: int) -> np.ndarray | None:
        """Indices of the block's rows in step ``step``'s batch; None means every row."""
        if self.rate >= 1.0:
            return None
        m = len(block)
        g = mechanisms.rng(self.seed, mechanisms.STREAM_SAMPLING, step, block.key)
        k = int(g.binomial(m, self.rate))
        return np.sort(g.choice(m, size=k, replace=False))

    def select(self, block: Block, step: int) -> Block:
        rows = self.rows(block, step)
        return block if rows is None else block.take(rows)
