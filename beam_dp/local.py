"""The in-process aggregator: the same block kernels as the Beam path, in a loop over blocks held
in memory. For data that fits in memory, and as the test oracle for the Beam aggregator."""
from __future__ import annotations

from typing import Sequence

from beam_dp import user_level
from beam_dp.algorithms.base import Stage
from beam_dp.batches import LocalBatches
from beam_dp.block import Block

# Steps between progress reports (and checkpoints) of full-batch training: there are no jobs
# in-process, so this only sets how often the driver reports.
STEPS_PER_REPORT = 25


class LocalAggregator:
    def __init__(self, blocks: Sequence[Block]):
        self.blocks = list(blocks)

    def count(self) -> int:
        return sum(len(b) for b in self.blocks)

    def run_stages(self, stages: Sequence[Stage], state):
        for stage in stages:
            total = stage.partial_sum(self.blocks[0], state)
            for block in self.blocks[1:]:
                total = total + stage.partial_sum(block, state)
            state = stage.apply(state, total)
        return state

    def steps_per_job(self, stage: Stage, remaining: int, state=None) -> int:
        return STEPS_PER_REPORT

    def step_batches(self, plan, steps: int, resume: str | None = None, keep: bool = False,
                     every_row: bool = False, workers_may_sum: bool = True):
        """Each step's batch, drawn when the step asks for it (nothing is written; every row is
        at hand either way)."""
        return LocalBatches(self.blocks, plan)

    def cap_rows_per_user(self, max_rows: int) -> None:
        """User-level blocks (grouped by user) bounded to ``max_rows`` rows per user: each user
        is in one block, so the cap applies block by block (``user_level.bound_rows``)."""
        self.blocks = [user_level.bound_rows(b, max_rows) for b in self.blocks]

    def close(self) -> None:
        pass
