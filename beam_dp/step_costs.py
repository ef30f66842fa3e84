"""What a DP-SGD run over Poisson batches costs on Beam, with its steps summed by the driver or by
the workers (issue 35): the projection the benchmark prints (``pipelines/benchmark.py --costs``)
and the choice ``--step_sums auto`` makes from it.

* **driver mode**: the batch job writes every step's sample; the driver reads each step's batch
  (its bytes through one process) and sums it. No job per step, but a step costs the driver the
  batch's bytes and compute, and the driver must hold a step's batch.
* **worker mode**: the same batch files; step jobs of up to ``MAX_STEPS_PER_JOB`` unrolled steps,
  in which the workers read the files (each once per job, into their cache) and sum each step's
  rows in parallel (``batches.group_parts`` files per group); the driver reads only the model
  after each job. A step costs a stage's latency whatever its batch.

The inputs are measured, not assumed: ``MEASURED`` is what ``pipelines/benchmark.py --costs``
printed on this project's reference machine (2 cores; the portable runner with an external worker
pool of 2 SDK processes), and docs/benchmarks/costs.md keeps its command and table. Only public
quantities go in (n from the noisy count, the batch from q n, d, the runner): the choice is a
post-processing of public values, and the same on a resume.
"""
from __future__ import annotations

import dataclasses
import math

from beam_dp import batches


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-process costs of the pieces of a run (seconds; bytes per second)."""

    read_bytes_per_s: float          # reading and decoding batch files (driver or worker)
    row_feature_seconds: float       # a clipped gradient, per row and feature
    step_stage_seconds: float        # a step of a step job, over and above its sums
    job_seconds: float               # a job's fixed cost (launch, plan, start its workers)
    batch_job_bytes_per_s: float     # the batch job: sampled bytes written (input read, merged)


# Measured with `pipelines/bench_step_costs.py` on 2026-11-29 (docs/benchmarks/costs.md has the
# run): n = 10^6, d = 50, batch 10^4, 5 epochs, a pool of 2 worker processes on 2 cores, the batch
# files on a local disk (a remote temp location reads slower: see that page). Runs on this
# machine vary by up to ~20% in each input.
MEASURED = Costs(
    read_bytes_per_s=1.38e9,
    row_feature_seconds=1.16e-8,
    step_stage_seconds=0.0549,
    job_seconds=4.07,
    batch_job_bytes_per_s=1.31e8,
)

# A step's batch the driver may hold: beyond this only the workers can sum it.
DRIVER_BATCH_BYTES = 2 << 30
# The workers assumed when the options name none (``--num_workers``, ``--max_num_workers``...):
# the fewest a runner that runs them apart from the driver has.
DEFAULT_WORKERS = 2
MAX_STEPS_PER_JOB = 200   # as the Beam aggregator's (``beam.aggregator.MAX_STEPS_PER_JOB``)
STATE_BYTES_PER_COLUMN = 2 * 8 * 2   # the model and its running sum, pickled (generously)
FILE_NAME_BYTES = 64                 # a batch file's name in the job's pickled list


def row_bytes(dim: int) -> int:
    return 8 * (dim + 2)


@dataclasses.dataclass(frozen=True)
class Projection:
    mode: str
    seconds: float          # wall time, the batch job included
    driver_bytes: float     # read by the driver over the run
    jobs: int               # the batch job and the step jobs
    files: int              # the groups' files the batch job leaves


def project(n: float, dim: int, batch: float, epochs: float, mode: str,
            workers: int = DEFAULT_WORKERS, costs: Costs = MEASURED) -> Projection:
    """The projected run: ``n`` rows of ``dim`` features, ``batch`` expected rows a step,
    ``epochs`` passes, steps summed in ``mode`` ("driver" or "workers") with ``workers``
    worker processes."""
    steps = max(1, math.ceil(epochs * n / batch))
    batch_bytes = batch * row_bytes(dim)
    sampled = epochs * n * row_bytes(dim)
    per_file = batches.steps_per_file(batch, dim)
    parts = batches.group_parts(batch_bytes * per_file, shards=10 ** 9)   # (shards: many)
    files = math.ceil(steps / per_file) * parts
    batch_job = costs.job_seconds + sampled / (costs.batch_job_bytes_per_s * workers)
    compute = batch * dim * costs.row_feature_seconds
    if mode == "driver":
        step = batch_bytes / costs.read_bytes_per_s + compute
        return Projection(mode, batch_job + steps * step, sampled, 1, files)
    parallel = max(1, min(workers, parts))
    jobs = math.ceil(steps / MAX_STEPS_PER_JOB)
    seconds = (batch_job + jobs * costs.job_seconds + sampled / (costs.read_bytes_per_s * parallel)
               + steps * (costs.step_stage_seconds + compute / parallel))
    # The driver reads the batch job's list of its files, and the model after each step job.
    driver_bytes = files * FILE_NAME_BYTES + jobs * STATE_BYTES_PER_COLUMN * (dim + 1)
    return Projection(mode, seconds, driver_bytes, 1 + jobs, files)


IN_PROCESS = "the runner's workers run in this process"   # (auto's reason; not worth a line)
ROOT_SEED = "these steps draw their noise from the run's root seed, which no job graph holds"


@dataclasses.dataclass(frozen=True)
class Choice:
    mode: str     # "driver" or "workers"
    given: str    # --step_sums: "auto", "driver" or "workers"
    reason: str   # one line, for stderr and the report

    def line(self) -> str:
        how = "chosen by --step_sums auto" if self.given == "auto" else "--step_sums"
        return f"steps summed by the {'workers' if self.mode == 'workers' else 'driver'} " \
               f"({how}: {self.reason})"


def choose(given: str, remote_workers: bool, batch: float, dim: int,
           workers: int | None = None, workers_may_sum: bool = True,
           costs: Costs = MEASURED) -> Choice:
    """``--step_sums``: the driver for steps that may not leave it (``workers_may_sum`` false:
    their noise comes from the run's root seed, which no job graph may hold), whatever was
    given; else ``given`` unless "auto". Auto sums on the driver when the runner's
    workers share this process (an in-process runner: a step job only adds its latency); on
    the workers when a step's batch is more than the driver should hold; else in the mode whose
    projected step is cheaper (``project``, per step: the batch job is the same in both)."""
    if not workers_may_sum:
        return Choice("driver", given, ROOT_SEED)
    if given in ("driver", "workers"):
        return Choice(given, given, "given")
    if not remote_workers:
        return Choice("driver", given, IN_PROCESS)
    if batch * row_bytes(dim) > DRIVER_BATCH_BYTES:
        return Choice("workers", given, "a step's batch is more than the driver should hold")
    workers = workers or DEFAULT_WORKERS
    steps = 10_000   # (per step: the batch job's cost, the same in both, cancels)
    seconds = {mode: project(steps * batch, dim, batch, 1, mode, workers, costs).seconds
               for mode in ("driver", "workers")}
    mode = min(seconds, key=seconds.get)
    other = "workers" if mode == "driver" else "driver"
    return Choice(mode, given, f"projected {seconds[other] / seconds[mode]:.2g}x faster than "
                               f"the {other} at a batch of {batch:,.0f} x {dim} features "
                               f"on {workers} workers")
