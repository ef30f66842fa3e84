"""What every optimizer driver shares: the training state, the Aggregator seam, the chunked loop.

An algorithm never imports Beam. It hands an Aggregator *stages*: objects with

* ``shape``: the shape of the stage's sum;
* ``partial_sum(block, state) -> ndarray``: the exact, per-example-bounded sum over one block's
  examples (for a training step: the step ``state.step``'s sample); and
* ``apply(state, total) -> state``: the noise and the update or release, a function of the summed
  blocks and of the public state only.

A stage whose batches are fixed in advance (``batch_plan`` not None: Poisson DP-SGD, DP-AMBSSGD's
blocks) is instead run over ``aggregator.step_batches(plan, steps)``: its rows for every step
are chosen before training from the seed and the rows' positions (``beam_dp.batches``), and each
step sums ``selected_sum(batch, state)`` over its own batch, on the driver. On Beam one job
writes every step's batch, so a run of thousands of steps is one job, not one per few steps.

The aggregator evaluates ``state = apply(state, sum over blocks of partial_sum(block, state))`` for
each stage in turn: the local aggregator in a loop, the Beam aggregator as one job with the
stages unrolled. Both are pure functions of (data, seed), so the two agree to float tolerance.
Training steps (``TrainState``) and private statistics (``beam_dp.stats``, a dict state) are both
stages.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import zipfile
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from beam_dp import storage


@dataclasses.dataclass
class TrainState:
    """Driver state between steps. Everything in it is a post-processing of noised releases, so
    it may be checkpointed to files that outlive the job."""

    theta: np.ndarray          # (k, d + 1), last column the intercept
    theta_sum: np.ndarray      # sum of the iterates theta_1..theta_step, for iterate averaging
    step: int = 0              # steps done
    final: object = None       # what run_chunks' ``final`` stage released (a FinalStage's)

    @classmethod
    def zeros(cls, outputs: int, dim: int) -> "TrainState":
        return cls(np.zeros((outputs, dim + 1)), np.zeros((outputs, dim + 1)), 0)

    def averaged(self) -> np.ndarray:
        return self.theta_sum / max(self.step, 1)


@dataclasses.dataclass
class FinalStage:
    """A stage over the trained model, run by ``run_chunks`` in the last training job (or on the
    driver, over every row the batch job wrote, after steps over batches fixed in advance)
    rather than a job of its own (issue 33: one job less per run; the private quality check).
    ``inner`` sums over the rows with ``to_state(model)`` as its state, where ``model =
    model_of(train state)`` is the model as the algorithm outputs it; its release
    (``inner.apply``'s) goes to the TrainState's ``final``."""

    inner: object
    model_of: Callable
    to_state: Callable

    def __getattr__(self, name):   # shape, key, zero_sum, ...: the inner stage's
        if name in ("inner", "model_of", "to_state") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def partial_sum(self, block, state):
        return self.inner.partial_sum(block, self.to_state(self.model_of(state)))

    def apply(self, state, total):
        released = self.inner.apply(self.to_state(self.model_of(state)), total)
        return dataclasses.replace(state, final=released)


class Stage(Protocol):
    shape: tuple

    def partial_sum(self, block, state) -> np.ndarray: ...

    def apply(self, state, total: np.ndarray): ...


class StepBatches(Protocol):
    """A run's batches (context manager: they are deleted on exit unless kept for a resume)."""

    location: str | None   # where they are kept between jobs (None: computed in memory)

    def get(self, step: int) -> list: ...

    def every_row(self) -> Iterator: ...   # the input's blocks once (asked for with every_row)


class Aggregator(Protocol):
    """Exact sums over the data; the stages add the noise."""

    def count(self) -> int: ...

    def run_stages(self, stages: Sequence[Stage], state): ...

    def steps_per_job(self, stage: Stage, remaining: int, state=None) -> int: ...

    def step_batches(self, plan, steps: int, resume: str | None = None,
                     keep: bool = False, every_row: bool = False,
                     workers_may_sum: bool = True) -> StepBatches: ...

    def close(self) -> None: ...


class JobLimitReached(Exception):
    """The run launched as many jobs as it was allowed (``max_jobs``, --max-jobs): its state is
    checkpointed; the same command again goes on from there (a Flex Template's launcher, or any
    orchestrator that runs one job per invocation)."""


CHECKPOINT_FILE = "state.npz"   # in a release's checkpoint directory


def checkpoint_exists(directory: str) -> bool:
    return storage.exists(storage.join(directory, CHECKPOINT_FILE))


def save_checkpoint(directory: str, state: TrainState, config: dict, plan: dict) -> None:
    """Writes the state and the public plan as one file, atomically on every file system
    (``storage.write_bytes``: the old checkpoint or the new one, never a part)."""
    buffer = io.BytesIO()
    # The final stage's release (the last job's quality check: noisy sums and the model they
    # are of) is kept with the state that made it, so that a run resumed once its last job ran
    # finds it here rather than release it again.
    final = ({k: np.asarray(v).tolist() for k, v in state.final.items()}
             if isinstance(state.final, dict) else None)
    np.savez(buffer, theta=state.theta, theta_sum=state.theta_sum, step=state.step,
             config=json.dumps(config, sort_keys=True), plan=json.dumps(plan, sort_keys=True),
             final=json.dumps(final))
    storage.write_bytes(storage.join(directory, CHECKPOINT_FILE), buffer.getvalue())


class CorruptCheckpoint(Exception):
    """A release's checkpoint that cannot be read (truncated, overwritten by hand): running the
    same command again cannot help (``beam-dp`` exits 7)."""


def load_checkpoint(directory: str, config: dict) -> tuple[TrainState, dict] | None:
    """The saved state and plan, if a checkpoint was written for the same public configuration."""
    if not checkpoint_exists(directory):
        return None
    path = storage.join(directory, CHECKPOINT_FILE)
    content = storage.read_bytes(path)   # (a failing read is the file system's error)
    try:
        with np.load(io.BytesIO(content)) as z:
            saved = json.loads(str(z["config"]))
            final = json.loads(str(z["final"])) if "final" in z.files else None
            state = TrainState(z["theta"], z["theta_sum"], int(z["step"]),
                               None if final is None else {k: np.asarray(v, dtype=np.float64)
                                                           for k, v in final.items()})
            plan = json.loads(str(z["plan"]))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise CorruptCheckpoint(
            f"{path} is not a readable checkpoint ({type(e).__name__}): delete {directory} (or "
            f"give another --checkpoint-dir) to start this release over; what its earlier "
            f"attempts released stays charged in the ledger") from None
    if saved != json.loads(json.dumps(config, sort_keys=True)):
        raise ValueError(f"{path} was written for a different configuration; "
                         "remove it or use another --checkpoint-dir")
    return state, plan


def run_chunks(aggregator: Aggregator, step_fn: Stage, state: TrainState, total_steps: int,
               steps_per_job: int | None, after_chunk: Callable[[TrainState, int], None],
               plan: dict | None = None, keep_batches: bool = False,
               final: FinalStage | None = None) -> TrainState:
    """Runs the steps ``state.step .. total_steps - 1``, calling ``after_chunk(state,
    steps_in_chunk)`` after each chunk (to record releases, checkpoint and report progress).

    Full-batch steps run ``steps_per_job`` at a time in one job each (None: as many as the
    aggregator's job can hold). Steps with batches fixed in advance (``step_fn.batch_plan``) run
    on the driver over the aggregator's ``step_batches``, one job for the whole run; a chunk is
    then only how often ``after_chunk`` is called. ``plan`` (the checkpointed plan) records where
    the batches are kept, and a resumed run finds them there; ``keep_batches`` keeps them when
    the run fails, for that resume (they are deleted once training ends). ``final`` runs after
    the last step: in its job (full-batch steps), or on the driver over every row, which the
    batch job then writes once as well; the returned state's ``final`` is its release (None
    where it did not run: no step was left)."""
    batch_plan = getattr(step_fn, "batch_plan", None)
    if batch_plan is None:
        while state.step < total_steps:
            remaining = total_steps - state.step
            k = min(steps_per_job or aggregator.steps_per_job(step_fn, remaining, state), remaining)
            # A job's copy of the step holds only what its steps draw (``for_steps``), if the
            # stage can say so; the root seed stays on the driver.
            restrict = getattr(step_fn, "for_steps", None)
            stage = restrict(state.step, k) if restrict is not None else step_fn
            last = final is not None and state.step + k >= total_steps
            state = aggregator.run_stages([stage] * k + [final] * last, state)
            after_chunk(state, k)
        return state
    if state.step >= total_steps:   # a finished run resumed: its batches are gone, none needed
        return state
    chunk = steps_per_job or max(25, math.ceil(total_steps / 20))
    resume = plan.get("batch_files") if plan is not None else None
    # These steps are summed and applied here, on the driver, not by the aggregator: it may
    # still see them (the audit's aggregator injects its canaries into each step's sum).
    driver_stage = getattr(aggregator, "driver_stage", lambda stage: stage)
    step_fn = driver_stage(step_fn)
    # A step job's graph holds its copy of the step: only a step that can trade the root seed
    # for its own steps' noise keys (``for_steps``) may be summed by the workers (dp-ambssgd's
    # and heavy-tailed-md's draw their noise from the root seed: they stay on the driver).
    with aggregator.step_batches(batch_plan, total_steps, resume, keep_batches,
                                 every_row=final is not None,
                                 workers_may_sum=hasattr(step_fn, "for_steps")) as batches:
        if plan is not None and batches.location is not None:
            # Checkpointed at once, so that a run that dies from here on resumes with these.
            plan["batch_files"] = batches.location
            after_chunk(state, 0)
        while state.step < total_steps and getattr(batches, "on_workers", False):
            # Summed by the workers (issue 35): a job per chunk of steps, the model its only
            # output; the final stage in the last job, over every row's files.
            remaining = total_steps - state.step
            k = min(steps_per_job or
                    aggregator.steps_per_job_over_batches(batches, step_fn, remaining, state),
                    remaining)
            restrict = getattr(step_fn, "for_steps", None)
            stage = restrict(state.step, k) if restrict is not None else step_fn
            last = final is not None and state.step + k >= total_steps
            state = aggregator.run_stages_over_batches(batches, [stage] * k, state,
                                                       final if last else None)
            after_chunk(state, k)
        while state.step < total_steps:
            k = min(chunk, total_steps - state.step)
            for _ in range(k):
                state = run_step(step_fn, batches.get(state.step), state)
            if final is not None and state.step >= total_steps:
                # (before the chunk's checkpoint, which keeps the release with the model)
                check = driver_stage(final)
                total = zero_sum(check)
                for block in batches.every_row():
                    total = total + check.partial_sum(block, state)
                state = check.apply(state, total)
            after_chunk(state, k)
    return state


def zero_sum(stage: Stage):
    """A stage's sum over no rows: its own ``zero_sum()`` (e.g. an exact integer sum), else
    float zeros."""
    make = getattr(stage, "zero_sum", None)
    return make() if make is not None else np.zeros(stage.shape)


def run_step(step_fn: Stage, batch: Sequence, state: TrainState) -> TrainState:
    """One step over its batch (a list of Blocks, one per tag), on the driver."""
    total = zero_sum(step_fn)
    for block in batch:
        total = total + step_fn.selected_sum(block, state)
    return step_fn.apply(state, total)
