"""Which examples each step reads: Poisson sampling keyed by the example's position.

Every example is in step t's batch independently with probability q (Poisson sampling, the law
the accounting's PoissonSampledDpEvent assumes). The draws are made per block and per *chunk* of
``chunk_steps(q)`` consecutive steps, from ``rng(seed, STREAM_SAMPLING, CHUNKED, chunk,
block.key)``: the chunk's steps x rows grid (step-major) is one sequence of independent
Bernoulli(q) cells, whose selected cells are found by geometric skips (the gaps between
successes of Bernoulli trials are i.i.d. Geometric(q)). So a chunk costs O(q x rows x steps),
the rows its steps select, and never a draw per row or a generator per step: the per-step
generator this replaced cost ~45 us per block and step, O(n) per step (2 ms a step at
n = 10^6, twice the step's arithmetic).

Because the draws depend only on the seed, the chunk and the block's position, the local runner
(step by step, one chunk in memory) and the Beam batch job (every step of a block in one pass)
select the same examples.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Iterator

import numpy as np

from beam_dp import mechanisms
from beam_dp.block import Block

CHUNKED = 1 << 32        # marks the chunked stream apart from any (step, ...) stream
MAX_CHUNK_STEPS = 1024   # a chunk of one block holds at most ~min(1024 q, 1) x its rows indices
# Geometric gaps drawn at once: the expected number of successes plus this many standard
# deviations (more are drawn in the rare case they fall short).
SLACK_SDS = 6.0


def chunk_steps(rate: float) -> int:
    """Steps drawn together: about 1/q (a chunk then selects each row about once, so a block's
    chunk holds ~its row count of indices), at most MAX_CHUNK_STEPS. A function of q alone, so
    every runner cuts the steps into the same chunks."""
    return int(min(MAX_CHUNK_STEPS, max(1, math.floor(1.0 / rate))))


def bernoulli_cells(generator: np.random.Generator, cells: int, rate: float) -> np.ndarray:
    """The sorted positions in [0, cells) of independent Bernoulli(rate) successes, by geometric
    skips: vectorized, O(rate x cells) draws (a few more, then cut at ``cells``)."""
    mean = cells * rate
    found, last = [], -1
    while True:
        size = max(1, int(mean + SLACK_SDS * math.sqrt(mean) + 16))
        positions = last + np.cumsum(generator.geometric(rate, size=size))
        if positions[-1] >= cells:
            found.append(positions[:np.searchsorted(positions, cells)])
            return np.concatenate(found) if len(found) > 1 else found[0]
        found.append(positions)
        last = int(positions[-1])


@dataclasses.dataclass(frozen=True)
class PoissonSampler:
    rate: float
    seed: int

    def __post_init__(self):
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"sampling rate must be in (0, 1], got {self.rate}")

    @property
    def chunk(self) -> int:
        return chunk_steps(self.rate)

    def chunk_rows(self, block: Block, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``chunk``'s draws for ``block``: ``starts`` (chunk + 1 offsets, per step of
        the chunk) into ``rows`` (each step's selected rows, sorted)."""
        m, size = len(block), self.chunk
        g = mechanisms.rng(self.seed, mechanisms.STREAM_SAMPLING, CHUNKED, chunk, block.key)
        cells = bernoulli_cells(g, size * m, self.rate) if m else np.zeros(0, np.int64)
        steps, rows = np.divmod(cells, max(m, 1))
        return np.searchsorted(steps, np.arange(size + 1)), rows

    def rows_of_steps(self, block: Block, steps: Iterable[int]) -> Iterator[tuple[int, np.ndarray | None]]:
        """(step, rows) for ``steps`` (increasing), each chunk drawn once; rows None: every row."""
        if self.rate >= 1.0:
            for step in steps:
                yield step, None
            return
        size, drawn, starts, rows = self.chunk, None, None, None
        for step in steps:
            chunk, offset = divmod(step, size)
            if chunk != drawn:
                starts, rows = self.chunk_rows(block, chunk)
                drawn = chunk
            yield step, rows[starts[offset]:starts[offset + 1]]

    def rows(self, block: Block, step: int) -> np.ndarray | None:
        """Indices of the block's rows in step ``step``'s batch; None means every row. (Draws
        the step's whole chunk: for many steps use ``rows_of_steps``.)"""
        return next(self.rows_of_steps(block, (step,)))[1]

    def select(self, block: Block, step: int) -> Block:
        rows = self.rows(block, step)
        return block if rows is None else block.take(rows)
