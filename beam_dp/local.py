"""The in-process aggregator: the same block kernels as the Beam path, in a loop over blocks held
in memory. For data that fits in memory, and as the test oracle for the Beam aggregator."""
from __future__ import annotations

from typing import Sequence

from beam_dp.algorithms.base import StepFunction, TrainState
from beam_dp.data import Block


class LocalAggregator:
    def __init__(self, blocks: Sequence[Block]):
        self.blocks = list(blocks)

    def count(self) -> int:
        return sum(len(b) for b in self.blocks)

    def run_steps(self, step_fn: StepFunction, state: TrainState, num_steps: int) -> TrainState:
        for _ in range(num_steps):
            total = step_fn.partial_sum(self.blocks[0], state)
            for block in self.blocks[1:]:
                total += step_fn.partial_sum(block, state)
            state = step_fn.apply(state, total)
        return state
