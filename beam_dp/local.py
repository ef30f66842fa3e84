"""The in-process aggregator: the same block kernels as the Beam path, in a loop over blocks held
in memory. For data that fits in memory, and as the test oracle for the Beam aggregator."""
from __future__ import annotations

from typing import Sequence

from beam_dp.algorithms.base import Stage
from beam_dp.data import Block


class LocalAggregator:
    def __init__(self, blocks: Sequence[Block]):
        self.blocks = list(blocks)

    def with_block_map(self, block_map) -> "LocalAggregator":
        """An aggregator over the blocks that ``block_map`` (block -> blocks) makes of these."""
        return LocalAggregator([b for block in self.blocks for b in block_map(block)])

    def count(self) -> int:
        return sum(len(b) for b in self.blocks)

    def run_stages(self, stages: Sequence[Stage], state):
        for stage in stages:
            total = stage.partial_sum(self.blocks[0], state)
            for block in self.blocks[1:]:
                total += stage.partial_sum(block, state)
            state = stage.apply(state, total)
        return state
