"""The Beam aggregator. A run is planned as a handful of jobs, never one per few steps:

* full-batch stages (statistics, DP-GD steps): the stages unrolled into one job, as many as the
  job's pipeline can hold (``steps_per_job``: Dataflow refuses job graphs over 10 MB). What flows
  through the steps are shard descriptors; each worker process keeps the parsed blocks in a
  cache shared by all the steps (``beam_dp.beam.cache``), so a step moves O(d) bytes per shard;
* steps with batches fixed in advance (Poisson DP-SGD, DP-AMBSSGD): one job writes every step's
  batch (``beam_dp.beam.batches``), and the driver runs the steps over them with no other job;
* the dataset size: from Parquet metadata on the driver (exact, no scan), a job only for CSV.

The driver gets a job's result back through a file in a work directory (deleted once read) and
checkpoints between jobs. Each job is recorded in ``jobs`` (kind, steps, seconds, file opens
counted by a Beam metric) for the benchmark.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
import uuid
from typing import Callable, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, TestOptions
from apache_beam.utils.shared import Shared

from beam_dp import batches, data, step_costs
from beam_dp.algorithms.base import JobLimitReached, Stage
from beam_dp.beam.batches import BatchFile, WriteStepBatches, read_batch_file
from beam_dp.beam.cache import ShardCache
from beam_dp.beam.job_results import MISSING, JobResults
from beam_dp.beam.options import step_sums
from beam_dp.beam.transforms import (FILE_OPENS, METRICS_NAMESPACE, STEP_BUNDLES, ReadShards,
                                     RunStages,
                                     ShardReader, StateFile, _position, open_file)
from beam_dp.beam.transforms import GroupUsers
from beam_dp.data import DataError

# Dataflow refuses a job whose graph is over 10 MB; steps per job are chosen so that the
# pipeline proto stays within half of that (what a runner adds to it is not counted).
JOB_GRAPH_LIMIT = 10 << 20
JOB_GRAPH_BUDGET = JOB_GRAPH_LIMIT // 2
# ... and at most this many steps per job: long unrolled graphs cost the runner time to plan
# (measured with pipelines/benchmark.py; docs/guide/runners.md).
MAX_STEPS_PER_JOB = 200
# ... and at most as many steps as keep a job's states and sums within this many bytes: each step
# carries the state (the model and its running sum) and a sum per bundle, which a runner may hold
# until the job ends (an in-process FnApiRunner holds them all: with 2^20 categorical columns,
# 100 steps in one job, each bundle carrying the state, held 6.9 GB in the driver and 5 GB in
# each of two workers).
JOB_MEMORY_BUDGET = 512 << 20
# A state larger than this goes to the job in a file, not in its graph (``StateFile``).
STATE_IN_GRAPH_BYTES = 1 << 20
# Runners whose workers share this machine's file system: the system temp directory serves as
# the temp location. Any other runner needs a --temp_location that the driver and the workers
# can both reach (workers elsewhere would write the mini-batches where the driver cannot read).
IN_PROCESS_RUNNERS = (None, "FnApiRunner", "DirectRunner", "BundleBasedDirectRunner",
                      "SwitchingDirectRunner")


def _write_pickle(value, path):
    with FileSystems.create(path) as f:
        f.write(pickle.dumps(value))


# Bytes the driver has read from files (job results, batch files, manifests): what issue 35's
# worker-side steps bound per step (the benchmark and tests read it).
DRIVER_BYTES_READ = [0]


def _take_pickle(path):
    """Reads the value a pipeline saved for the driver and deletes the file: nothing the driver
    reads back (an exact count, a state) is left in the work directory after the job."""
    value = pickle.loads(_read_bytes(path, CompressionTypes.AUTO))
    FileSystems.delete([path])
    return value


def _read_bytes(path: str, compression=CompressionTypes.UNCOMPRESSED) -> bytes:
    with FileSystems.open(path, compression_type=compression) as f:
        data = f.read()
    DRIVER_BYTES_READ[0] += len(data)
    return data


def _delete_tree(location: str) -> None:
    """Deletes a directory of files on any Beam file system."""
    if "://" not in location:
        shutil.rmtree(location, ignore_errors=True)
        return
    matched = [m.path for r in FileSystems.match([FileSystems.join(location, "*")])
               for m in r.metadata_list]
    if matched:
        FileSystems.delete(matched)


def kept_batch_files(checkpoint_dir: str) -> str | None:
    """Where a checkpointed run's batch files wait for its rerun, if they still exist."""
    try:
        with FileSystems.open(checkpoint_dir.rstrip("/") + "/state.npz") as f, \
                np.load(io.BytesIO(f.read())) as z:
            location = json.loads(str(z["plan"])).get("batch_files")
    except (OSError, ValueError, KeyError):
        return None
    return location if location and FileSystems.exists(location) else None


class _DropOwnInputErrors(logging.Filter):
    """Beam's DoFn runner logs a failing worker's traceback before re-raising the error. Our
    input errors (value-free, one line) and an interrupt (Ctrl-C, SIGTERM) reach the caller as
    the exception itself, so that log would only repeat them as a traceback."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        return DataError.MARKER not in message and not message.startswith("KeyboardInterrupt")


def _quiet_worker_input_errors() -> None:
    log = logging.getLogger("apache_beam.runners.common")
    if not any(isinstance(f, _DropOwnInputErrors) for f in log.filters):
        log.addFilter(_DropOwnInputErrors())


def _counter(result, name: str) -> int | None:
    """A job's committed (else attempted) Beam counter, None where the runner reports none."""
    try:
        found = result.metrics().query(
            MetricsFilter().with_namespace(METRICS_NAMESPACE).with_name(name))["counters"]
    except Exception:   # a runner without metrics support
        return None
    if not found:
        return 0
    return sum((c.committed if c.committed is not None else c.attempted) or 0 for c in found)


class BatchFiles(batches.FileBatches):
    """A finished batch job's files, deleted on exit: when training ends, and when it fails
    unless ``keep`` (a checkpointed run, which resumes with them)."""

    def __init__(self, location: str, manifest: batches.Manifest, keep: bool):
        super().__init__(manifest, lambda name: _read_bytes(FileSystems.join(location, name)))
        self.location, self.keep = location, keep

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or not self.keep:
            _delete_tree(self.location)
        return False


# A job is followed by a collection only once the process has grown by this much since the
# last one: a full collection costs ~0.2 s in a process holding Beam (which a small job, a few
# steps on a small table, never repaid; ~0.2 s of every job in the test suite), while a job
# that leaves ~80 MB behind (2^20 categorical columns) is collected after every second job.
COLLECT_AFTER_GROWTH = 128 << 20
_collected_at = [0]   # the process's resident bytes after the last collection


def _resident_bytes() -> int | None:
    """This process's resident set (Linux's /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _release_job_memory() -> None:
    """Frees what a finished job left in this process. An in-process runner (FnApiRunner, also
    behind the portable runner's embedded job service) holds a job's PCollections in cycles that
    only the collector frees, and glibc keeps the freed buffers: with 2^20 categorical columns
    the driver grew by ~80 MB a job (100 steps in 21 jobs: 2.3 GB); collecting and trimming after
    each job kept it at 1.2 GB for 30 steps where it had reached 1.5 GB (now after the job that
    grew it by COLLECT_AFTER_GROWTH: at most that much more)."""
    resident = _resident_bytes()
    if resident is not None and resident - _collected_at[0] < COLLECT_AFTER_GROWTH:
        return
    gc.collect()
    data.release_free_memory()
    _collected_at[0] = _resident_bytes() or 0


def _state_bytes(state) -> int:
    """The bytes of the arrays in a stage's state (a TrainState, or a statistics dict)."""
    values = state.values() if isinstance(state, dict) else vars(state).values() if state is not None else ()
    return sum(v.nbytes for v in values if isinstance(v, np.ndarray))


class BeamAggregator:
    """``pipeline_args`` are Beam's own flags (``--runner``, ``--project``, ...), passed through;
    ``make_runner``, if given, makes the runner object of each job instead (e.g. an FnApiRunner
    whose workers an external worker pool starts, in the benchmark). The Parquet footers are read
    here, on the driver (shards and row counts)."""

    def __init__(self, files, label_column, feature_columns, loss, batch_rows,
                 pipeline_args: list[str], work_dir: str | None = None,
                 make_runner: Callable[[], object] | None = None, encoding=None,
                 user_bounding=None):
        _quiet_worker_input_errors()
        self.files = list(files)
        self.dim = encoding.dim if encoding is not None else len(feature_columns)
        # User-level privacy (``beam_dp.user_level.UserBounding``): every job groups the rows
        # by user (``GroupUsers``) before its stages; None: the stages run over the shards.
        self.user_bounding = user_bounding
        self.batch_rows = batch_rows
        self.reader = ShardReader(label_column, feature_columns, loss, batch_rows, encoding,
                                  user_bounding.column if user_bounding is not None else None)
        self.shards = data.plan_shards(self.files, batch_rows, open_file)
        self.cache = Shared()   # the handle of this run's worker caches
        self.pipeline_args = list(pipeline_args)
        # Beam's construction-time type inference reads the bytecode of every step's DoFn
        # (~8 ms a step of an unrolled job) to type elements that are pickled either way; a
        # user's --pipeline_type_check, later on the line, still turns it on.
        self.options = PipelineOptions(["--no_pipeline_type_check", *pipeline_args])
        given = self.options.get_all_options()
        temp = given.get("temp_location") or given.get("staging_location")
        if not temp and make_runner is None and given.get("runner") not in IN_PROCESS_RUNNERS:
            raise ValueError(
                f"--runner {given.get('runner')} runs the workers apart from this driver: give "
                "--temp_location, a location both can read and write (e.g. gs://bucket/tmp); the "
                "jobs' results and the run's mini-batches are written there, and deleted after")
        self.temp_root = temp or tempfile.gettempdir()
        self._work_dir = work_dir
        self.jobs: list[dict] = []
        self.max_jobs: int | None = None   # JobLimitReached before launching one more
        self._steps_per_job: dict[int, tuple] = {}
        self.make_runner = make_runner
        # --template_location (a Flex Template launch): Beam writes each job there instead of
        # running it; its result is left for the next launch (``keep_job_results``).
        self.writes_templates = bool(given.get("template_location"))
        self.job_results: JobResults | None = None
        self.step_sums: step_costs.Choice | None = None   # who sums the steps (step_batches)
        # The most bundles a step of a finished job had (its Beam counter; None until then):
        # the sums a step holds, which bound the steps per job rather than the shards.
        self.bundles_per_step: int | None = None
        step_sums(self.options)   # (a wrong --step_sums is refused before any job)

    def cap_rows_per_user(self, max_rows: int) -> None:
        """The jobs from here on bound each user to ``max_rows`` rows (--max-rows-per-user auto,
        once the cap is chosen)."""
        self.user_bounding = dataclasses.replace(self.user_bounding, max_rows=max_rows,
                                                 auto=False)

    def keep_job_results(self, directory: str, checkpoint_file: str) -> JobResults:
        """Template launches: each job leaves its result under ``directory`` (beam_dp.beam.
        job_results); a job whose result is there is not built again."""
        self.job_results = JobResults(directory, checkpoint_file)
        return self.job_results

    # ------------------------------------------------------------------ building and running jobs

    @property
    def work_dir(self) -> str:
        """Where jobs leave results for the driver (made on first use, removed by ``close``)."""
        if self._work_dir is None:
            self._work_dir = FileSystems.join(self.temp_root, f"beam-dp-{uuid.uuid4().hex}")
        if "://" not in self._work_dir:
            os.makedirs(self._work_dir, mode=0o700, exist_ok=True)
        return self._work_dir

    def _pipeline(self) -> beam.Pipeline:
        runner = self.make_runner() if self.make_runner is not None else None
        return beam.Pipeline(runner=runner, options=self.options)

    def _path(self, name: str) -> str:
        return FileSystems.join(self.work_dir, f"{name}-{uuid.uuid4().hex}.pkl")

    def _next_job(self, kind: str, steps: int = 0) -> tuple[str, object, str | None]:
        """Where the next job leaves its result for the driver, that result if an earlier
        launch's job already left it (else MISSING), and the job's key among the kept results
        (None: results are not kept, the job runs here)."""
        if self.job_results is None:
            return self._path(kind), MISSING, None
        key = self.job_results.next_key(kind, steps)
        return self.job_results.path(key), self.job_results.load(key), key

    def _side_file(self, key: str | None, name: str) -> str:
        """A file a job reads (its initial state): kept with the job's result when the job runs
        after this launch, else in the work directory."""
        return self.job_results.path(key, name) if key is not None else self._path(name)

    def count_pipeline(self, path: str) -> beam.Pipeline:
        p = self._pipeline()
        (p | "ReadShards" >> ReadShards(self.shards)
           | "Read" >> beam.FlatMap(self.reader)
           | "Rows" >> beam.Map(len)
           | "Count" >> beam.CombineGlobally(sum)
           | "Save" >> beam.Map(_write_pickle, path))
        return p

    def stages_pipeline(self, stages: Sequence[Stage], state, path: str) -> beam.Pipeline:
        p = self._pipeline()
        if self.user_bounding is not None:
            # One shuffle per job: a bucket per shard (at least 2) spreads the users' blocks
            # over the workers; the steps then read the grouped blocks, not the shards.
            buckets = max(2, len(self.shards))
            (p | "ReadShards" >> ReadShards(self.shards)
               | "GroupUsers" >> GroupUsers(self.reader, self.user_bounding, buckets, self.batch_rows)
               | "Stages" >> RunStages(stages, state)
               | "SaveState" >> beam.Map(_write_pickle, path))
            return p
        (p | "ReadShards" >> ReadShards(self.shards)
           | "Stages" >> RunStages(stages, state, self.reader, self.cache,
                                   min(_position(s) for s in self.shards) if self.shards else None)
           | "SaveState" >> beam.Map(_write_pickle, path))
        return p

    def batches_pipeline(self, plan, steps: int, location: str, written: str,
                         every_row: bool = False) -> beam.Pipeline:
        """The batch job; ``written`` receives the names of the index files it wrote, which the
        driver checks it can see (a worker elsewhere writes to its own disk)."""
        p = self._pipeline()
        per_file = batches.steps_per_file(plan.expected_rows, self.dim)
        (p | "StepBatches" >> WriteStepBatches(self.shards, self.reader, self.cache, plan, steps,
                                               per_file, location, self.dim, every_row)
           | "Written" >> beam.combiners.ToList()
           | "SaveWritten" >> beam.Map(_write_pickle, written))
        return p

    def _run(self, kind: str, pipeline: beam.Pipeline, steps: int = 0) -> None:
        if self.max_jobs is not None and len(self.jobs) >= self.max_jobs:
            raise JobLimitReached(f"{len(self.jobs)} job(s) launched, the most allowed (--max-jobs)")
        if self.writes_templates and self.job_results is None:
            raise ValueError("--template_location: each launch writes one job, which runs after "
                             "it; give --checkpoint-dir, where the job leaves its result for the "
                             "next launch")
        start = time.perf_counter()
        result = None
        try:
            result = pipeline.run()   # an in-process runner runs the whole job here
            if not self.writes_templates:   # (a template's job runs after this launch)
                result.wait_until_finish()
        except BaseException as e:
            # A remote job outlives an interrupted driver unless cancelled (it would go on
            # writing into a directory the driver is about to delete).
            if result is not None:
                with contextlib.suppress(Exception):
                    result.cancel()
            if not isinstance(e, KeyboardInterrupt) and str(e).startswith("KeyboardInterrupt"):
                raise KeyboardInterrupt from None   # Beam wraps an interrupt of its bundle
            raise
        if pipeline.options.view_as(TestOptions).dry_run:
            # DataflowRunner's --dry_run translates the job and returns without running it: no
            # result will ever come. The run stops there, as after --max-jobs (how a Flex
            # Template launch is tested offline: tests/test_deploy.py).
            self.jobs.append({"kind": kind, "steps": steps, "seconds": 0.0, "file_opens": None})
            raise JobLimitReached("--dry_run: the job was translated, not run")
        if self.writes_templates:
            self.jobs.append({"kind": kind, "steps": steps, "seconds": 0.0, "file_opens": None})
            raise JobLimitReached(f"the {kind} job was written to --template_location; it runs "
                                  "after this launch, and the next launch goes on from its result")
        bundles = _counter(result, STEP_BUNDLES) if steps else None
        if bundles:   # what a step's sums really are: one per bundle (the runner's choice)
            self.bundles_per_step = max(self.bundles_per_step or 0, -(-bundles // steps))
        self.jobs.append({"kind": kind, "steps": steps, "seconds": time.perf_counter() - start,
                          "file_opens": _counter(result, FILE_OPENS), "bundles": bundles})
        _release_job_memory()

    # ------------------------------------------------------------------ the Aggregator seam

    def count(self) -> int:
        """The exact number of examples (stays on the driver, which adds the noise): Parquet
        footers' row counts, else one job that reads every row (and so validates the input)."""
        # Footers count rows as stored; declared row drops (--missing drop) make the count a
        # job's, like CSV's.
        encoding = self.reader.encoding
        dropping = encoding is not None and encoding.drops_rows
        count = None if dropping else data.counted_rows(self.shards)
        if count is None:
            path, count, _ = self._next_job("count")
            if count is MISSING:
                self._run("count", self.count_pipeline(path))
                count = _take_pickle(path)
            count = int(count)
        if count == 0:  # as the local runner does (docs/trust-model.md names this leak)
            raise DataError(f"{', '.join(self.files)}: the input has no rows")
        return count

    def run_stages(self, stages: Sequence[Stage], state):
        return self._stages_job(stages, state,
                                lambda initial, path: self.stages_pipeline(stages, initial, path))

    def _stages_job(self, stages: Sequence[Stage], state, build, kind: str = "stages"):
        """Runs ``build(initial state, result path)``'s job and returns its final state; a state
        too large for the job's graph goes to the job in a file (``StateFile``)."""
        path, found, key = self._next_job(kind, len(stages))
        if found is not MISSING:
            return found
        initial = state
        if _state_bytes(state) > STATE_IN_GRAPH_BYTES:
            initial = StateFile(self._side_file(key, "initial-state"))
            _write_pickle(state, initial.path)
        try:
            self._run(kind, build(initial, path), steps=len(stages))
        finally:
            # (a template's job reads its state file after this launch: kept with its result)
            if initial is not state and key is None:
                with contextlib.suppress(Exception):   # (a job that failed early never read it)
                    FileSystems.delete([initial.path])
        return _take_pickle(path)

    def steps_per_job(self, stage: Stage, remaining: int, state=None,
                      inputs: int | None = None) -> int:
        """As many copies of ``stage`` as keep the job's pipeline within JOB_GRAPH_BUDGET (from
        the serialized size of a 1- and a 2-step pipeline), at most MAX_STEPS_PER_JOB, and its
        sums within JOB_MEMORY_BUDGET: one per bundle, at most one per input (``inputs``: the
        job's input elements; None: the shards), and once a job has run, at most twice the most
        bundles a step of it had (a runner bundles many shards together: at 10^4 shards and
        d = 1,000 the shards alone allowed 6 steps a job)."""
        inputs = len(self.shards) if inputs is None else inputs
        if self.bundles_per_step:
            inputs = min(inputs, 2 * self.bundles_per_step)
        known = self._steps_per_job.get(id(stage))
        if known is None or known[0] is not stage:   # (the stage is kept: its id stays its own)
            # The graph's bytes per step, measured once per stage (two pipelines built and
            # serialized: ~0.5 s); the memory bound below is recomputed as bundles are counted.
            initial = StateFile("unused") if _state_bytes(state) > STATE_IN_GRAPH_BYTES else state
            probes = [self.stages_pipeline([stage] * k, initial, "unused") for k in (1, 2)]
            one, two = (self.graph_bytes(p) for p in probes)
            for p in probes:   # never run, so Beam would not remove their temp directories
                shutil.rmtree(p.local_tempdir, ignore_errors=True)
            per_step = max(1, two - one)
            known = self._steps_per_job[id(stage)] = (
                stage, (JOB_GRAPH_BUDGET - (one - per_step)) // per_step)
        # a sum per bundle and a few copies of the state per step
        held = (inputs + 2) * 8 * int(np.prod(stage.shape)) + 3 * _state_bytes(state)
        fits = min(known[1], JOB_MEMORY_BUDGET // max(1, held))
        return min(int(max(1, min(MAX_STEPS_PER_JOB, fits))), max(1, remaining))

    @staticmethod
    def graph_bytes(pipeline: beam.Pipeline) -> int:
        return len(pipeline.to_runner_api().SerializeToString())

    def step_batches(self, plan, steps: int, resume: str | None = None,
                     keep: bool = False, every_row: bool = False,
                     workers_may_sum: bool = True) -> BatchFiles:
        """Every step's batch, written by one job under the temp location (``resume``: where an
        earlier attempt of this run wrote them; reused if complete and made by the same plan),
        and with ``every_row`` every row once more (``BatchFiles.every_row``)."""
        fingerprint = hashlib.blake2b(repr((batches.FILE_FORMAT, batches.plan_key(plan), steps,
                                            self.shards, every_row)).encode(),
                                      digest_size=16).hexdigest()
        if resume:
            manifest = self._manifest(resume)
            if manifest is not None and manifest.fingerprint == fingerprint:
                return self._batch_files(resume, manifest, keep, plan, workers_may_sum)
            _delete_tree(resume)   # incomplete, or another plan's: made anew
        written, found, key = self._next_job("batches", steps)
        # (where a template's job will write them: named by its key, for the next launch)
        location = FileSystems.join(self.temp_root,
                                    f"beam-dp-batches-{key or uuid.uuid4().hex}")
        if "://" not in location:   # raw rows: readable by this user only, as the input may be
            os.makedirs(location, mode=0o700, exist_ok=key is not None)
        try:
            if found is MISSING:
                self._run("batches", self.batches_pipeline(plan, steps, location, written,
                                                           every_row), steps=steps)
                found = _take_pickle(written) if FileSystems.exists(written) else None
            names = {os.path.basename(m.path) for r in FileSystems.match(
                [FileSystems.join(location, batches.GROUP_PATTERN)]) for m in r.metadata_list}
            # (a retried worker's unfinished attempt may have left more: never named, never read)
            if found is None or not set(found) <= names:
                raise RuntimeError(
                    f"the workers' mini-batches are not all readable here under {self.temp_root}: "
                    "give --temp_location, a location this driver and the workers share")
            # The shards' files, merged into the groups' by the job: deleted before the job
            # counts as done (a resume then finds only the groups' files).
            spent = [m.path for r in FileSystems.match(
                [FileSystems.join(location, batches.SHARD_PATTERN)]) for m in r.metadata_list]
            if spent:
                FileSystems.delete(spent)
            manifest = batches.Manifest(fingerprint, steps,
                                        batches.steps_per_file(plan.expected_rows, self.dim),
                                        sorted(found), every_row)
            with FileSystems.create(FileSystems.join(location, batches.DONE)) as f:
                f.write(manifest.dumps().encode())
        except BaseException as e:
            # A dry run's job never writes there, a template's only after this launch.
            if not (isinstance(e, JobLimitReached) and
                    (self.writes_templates or self.options.view_as(TestOptions).dry_run)):
                _delete_tree(location)
            raise
        return self._batch_files(location, manifest, keep, plan, workers_may_sum)

    def _batch_files(self, location, manifest, keep, plan, workers_may_sum) -> BatchFiles:
        """The batch files, and who sums their steps (``step_costs.choose``: from public values
        only, so a resumed run chooses alike)."""
        files = BatchFiles(location, manifest, keep)
        given, options = step_sums(self.options), self.options.get_all_options()
        remote = self.make_runner is not None or options.get("runner") not in IN_PROCESS_RUNNERS
        # (the workers the options name, if any: Dataflow's, or a local pool's processes; Beam's
        # direct_num_workers defaults to 1, which names none)
        direct = options.get("direct_num_workers") or 1
        workers = (options.get("max_num_workers") or options.get("num_workers")
                   or (direct if direct > 1 else None))
        self.step_sums = step_costs.choose(given, remote, plan.expected_rows, self.dim, workers,
                                           workers_may_sum)
        files.on_workers = self.step_sums.mode == "workers"
        return files

    def run_stages_over_batches(self, files: BatchFiles, stages: Sequence[Stage], state,
                                final: Stage | None = None):
        """Steps over batches fixed in advance (``stages``: consecutive steps from
        ``state.step``), summed by the workers from the batch files (``batches.
        StepOverFiles``), and ``final`` after them over every row: one job, whose inputs are the
        files of the groups its steps read; the driver gets back only the state."""
        manifest = files.manifest
        groups = list(manifest.groups_of_steps(state.step, len(stages)))
        if final is not None:
            groups.append(batches.rows_group(manifest.steps, manifest.steps_per_file))
        inputs = [BatchFile(FileSystems.join(files.location, name))
                  for group in groups for name in manifest.group_files(group)]
        wrapped = [batches.StepOverFiles(stage) for stage in stages]
        if final is not None:
            wrapped.append(batches.StepOverFiles(final, rows_step=manifest.steps))
        if not inputs:   # no rows in these steps' batches: nothing for a job to read
            for stage in wrapped:
                state = stage.apply(state, stage.zero_sum())
            return state

        def build(initial, path):
            p = self._pipeline()
            (p | "BatchFiles" >> ReadShards(inputs)
               | "Steps" >> RunStages(wrapped, initial, read_batch_file, self.cache,
                                      min(_position(f) for f in inputs))
               | "SaveState" >> beam.Map(_write_pickle, path))
            return p
        return self._stages_job(wrapped, state, build, kind="steps")

    def steps_per_job_over_batches(self, files: BatchFiles, stage: Stage, remaining: int,
                                   state=None) -> int:
        """``steps_per_job``, cut at a group's end where that leaves a whole group or more:
        a job then reads each of its files once (a worker's cache does not outlive its job)."""
        per_file, first = files.manifest.steps_per_file, state.step
        # The job's inputs: the files of the groups its steps may span, and every row's.
        groups = -(-MAX_STEPS_PER_JOB // per_file) + 2
        k = self.steps_per_job(stage, remaining, state, groups * files.manifest.files_per_group)
        aligned = (first + k) // per_file * per_file - first
        return aligned if k < remaining and aligned >= per_file else k

    @staticmethod
    def _manifest(location: str) -> batches.Manifest | None:
        try:
            return batches.Manifest.loads(_read_bytes(FileSystems.join(location, batches.DONE)).decode())
        except Exception:   # missing or unreadable: not a finished batch job
            return None

    def close(self) -> None:
        """Frees this process's cache (the in-process runner's workers are this process) and
        removes the work directory."""
        self.cache.acquire(ShardCache).clear()
        if self._work_dir is not None:
            if not self.options.view_as(TestOptions).dry_run:   # a dry run wrote nothing there
                _delete_tree(self._work_dir)
            self._work_dir = None
