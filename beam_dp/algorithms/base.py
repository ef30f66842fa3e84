"""What every optimizer driver shares: the training state, the Aggregator seam, the chunked loop.

An algorithm never imports Beam. It hands an Aggregator *stages*: objects with

* ``shape``: the shape of the stage's sum;
* ``partial_sum(block, state) -> ndarray``: the exact, per-example-bounded sum over one block's
  examples (for a training step: the step ``state.step``'s sample); and
* ``apply(state, total) -> state``: the noise and the update or release, a function of the summed
  blocks and of the public state only.

A stage that subsamples (``subsamples`` true) also offers ``select(block, step)`` (the rows of step
``step``) and ``selected_sum(rows, state)``, with ``partial_sum(block, state) == selected_sum(select(block,
state.step), state)``; an aggregator may then sample a whole chunk of steps in one pass and hand
each step only its own rows, so that the work per step is proportional to the batch.

The aggregator evaluates ``state = apply(state, sum over blocks of partial_sum(block, state))`` for
each stage in turn: the local aggregator in a loop, the Beam aggregator as one pipeline with the
stages unrolled. Both are pure functions of (data, seed), so the two agree to float tolerance.
Training steps (``TrainState``) and private statistics (``beam_dp.stats``, a dict state) are both
stages.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Callable, Protocol, Sequence

import numpy as np


@dataclasses.dataclass
class TrainState:
    """Driver state between steps. Everything in it is a post-processing of noised releases, so
    it may be checkpointed to files that outlive the job."""

    theta: np.ndarray          # (k, d + 1), last column the intercept
    theta_sum: np.ndarray      # sum of the iterates theta_1..theta_step, for iterate averaging
    step: int = 0              # steps done

    @classmethod
    def zeros(cls, outputs: int, dim: int) -> "TrainState":
        return cls(np.zeros((outputs, dim + 1)), np.zeros((outputs, dim + 1)), 0)

    def averaged(self) -> np.ndarray:
        return self.theta_sum / max(self.step, 1)


class Stage(Protocol):
    shape: tuple

    def partial_sum(self, block, state) -> np.ndarray: ...

    def apply(self, state, total: np.ndarray): ...


class Aggregator(Protocol):
    """Exact sums over the data; the stages add the noise."""

    def count(self) -> int: ...

    def run_stages(self, stages: Sequence[Stage], state): ...

    def with_block_map(self, block_map) -> "Aggregator": ...


def save_checkpoint(directory: str, state: TrainState, config: dict, plan: dict) -> None:
    """Writes the state and the public plan atomically (temporary file, then rename)."""
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".npz.tmp")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, theta=state.theta, theta_sum=state.theta_sum, step=state.step,
                 config=json.dumps(config, sort_keys=True), plan=json.dumps(plan, sort_keys=True))
    os.replace(tmp, os.path.join(directory, "state.npz"))


def load_checkpoint(directory: str, config: dict) -> tuple[TrainState, dict] | None:
    """The saved state and plan, if a checkpoint was written for the same public configuration."""
    path = os.path.join(directory, "state.npz")
    if not os.path.exists(path):
        return None
    with np.load(path) as z:
        if json.loads(str(z["config"])) != json.loads(json.dumps(config, sort_keys=True)):
            raise ValueError(f"{path} was written for a different configuration; "
                             "remove it or use another --checkpoint-dir")
        return (TrainState(z["theta"], z["theta_sum"], int(z["step"])), json.loads(str(z["plan"])))


def run_chunks(aggregator: Aggregator, step_fn: Stage, state: TrainState, total_steps: int,
               steps_per_chunk: int, after_chunk: Callable[[TrainState, int], None]) -> TrainState:
    """Runs the steps ``state.step .. total_steps - 1`` in chunks, calling ``after_chunk(state,
    steps_in_chunk)`` after each (to record releases, checkpoint and report progress)."""
    while state.step < total_steps:
        k = min(steps_per_chunk, total_steps - state.step)
        state = aggregator.run_stages([step_fn] * k, state)
        after_chunk(state, k)
    return state
