"""DP-SGD past one machine (issue 35): steps over Poisson batches summed by the workers
(``--step_sums workers``: step jobs over the batch files, the driver reading back only the
model), the batch job's files bounded by the steps and not the shards, and ``--step_sums
auto``'s choice (``beam_dp.step_costs``).

Beam runs pin ``--runner FnApiRunner`` (in-process); the portable runner with a pool of worker
processes is tests/test_cluster_execution.py's.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import model_theta, read_json

from beam_dp import batches, data, losses, step_costs, synthetic
from beam_dp.beam import aggregator as beam_aggregator
from beam_dp.beam.aggregator import BeamAggregator
from beam_dp.sampling import PoissonSampler

LOGISTIC = losses.make_loss("logistic")
BATCH_ROWS = 25


def _parquet(directory, n, d, row_group, seed=41, files=2):
    """n rows in ``files`` Parquet files of row groups of ``row_group`` rows: with --batch-rows
    25 each row group of 100 rows or more is a shard (``data.SHARD_BLOCKS`` blocks)."""
    directory.mkdir(parents=True, exist_ok=True)
    x, y = synthetic.make_dataset("binary", n, d, seed=seed)
    paths = []
    for i, rows in enumerate(np.array_split(np.arange(n), files)):
        columns = {f"f{j}": x[rows, j] for j in range(d)}
        columns["label"] = y[rows]
        path = str(directory / f"train-{i}.parquet")
        pq.write_table(pa.table(columns), path, row_group_size=row_group)
        paths.append(path)
    return {"glob": str(directory / "train-*.parquet"), "files": paths}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return _parquet(tmp_path_factory.mktemp("worker-steps"), 2400, 5, 300)


def _train(cli, source, out, temp, mode, *extra):
    r = cli("train", "--input", source["glob"], "--output", out, "--algorithm", "dpsgd",
            "--epsilon", 2, "--seed", 11, "--batch-size", 120, "--epochs", 3,
            "--batch-rows", BATCH_ROWS, "--runner", "FnApiRunner", "--temp_location", temp,
            "--step_sums", mode, *extra)
    assert r.code == 0, r
    return r


@pytest.fixture
def jobs(monkeypatch):
    """The Beam jobs a test's runs launch (the aggregator's own record)."""
    recorded = []
    real_run = beam_aggregator.BeamAggregator._run

    def spied(self, kind, pipeline, steps=0):
        real_run(self, kind, pipeline, steps)
        recorded.append(self.jobs[-1])
    monkeypatch.setattr(beam_aggregator.BeamAggregator, "_run", spied)
    return recorded


@pytest.mark.parametrize("noise", ["float", pytest.param("secure", marks=pytest.mark.slow)])
def test_the_workers_sum_the_steps_to_the_drivers_model(tmp_path, cli, table, jobs, noise):
    """Same seed, the same model and the same quality-check release (its final stage runs in
    the last step job, over every row's files); the driver reads the model back, not the
    batches: at most 64 KB a step, against the batches' bytes in driver mode."""
    models, reports, read = {}, {}, {}
    for mode in ("driver", "workers"):
        before, first_job = beam_aggregator.DRIVER_BYTES_READ[0], len(jobs)
        _train(cli, table, tmp_path / mode, tmp_path / "temp", mode, "--noise", noise)
        read[mode] = beam_aggregator.DRIVER_BYTES_READ[0] - before
        models[mode] = model_theta(tmp_path / mode)
        reports[mode] = read_json(tmp_path / mode / "privacy_report.json")
        kinds = [j["kind"] for j in jobs[first_job:]]
        if mode == "driver":
            assert kinds == ["batches"], kinds
        else:   # the batch job, then the step jobs the plan needs (60 steps: one)
            assert kinds == ["batches", "steps"] and jobs[-1]["steps"] == 60 + 1, kinds
    assert reports["workers"]["step_sums"] == {"mode": "workers", "given": "workers",
                                               "reason": "given"}
    if noise == "secure":   # exact integer sums: the same bits whoever adds them
        np.testing.assert_array_equal(models["workers"], models["driver"])
    else:
        np.testing.assert_allclose(models["workers"], models["driver"], rtol=1e-9, atol=1e-12)
    checks = [reports[mode]["quality_check"] for mode in ("driver", "workers")]
    if noise == "secure":
        assert checks[0] == checks[1]
    else:   # (float sums in another order: the last bits)
        assert checks[0]["status"] == checks[1]["status"] and checks[0]["status"] != "not_run"
        for key in ("model", "constant_minus_model"):
            assert checks[1][key]["value"] == pytest.approx(checks[0][key]["value"], rel=1e-9)
    steps = reports["workers"]["steps"]
    assert read["workers"] / steps <= 64 << 10, read
    assert read["driver"] > 20 * read["workers"], read   # (the batches: ~10 KB a step here)
    assert os.listdir(tmp_path / "temp") == []   # batch files and results: all deleted


@pytest.mark.slow
def test_step_jobs_cut_at_groups_and_resume_from_a_checkpoint(tmp_path, cli, table, jobs,
                                                              monkeypatch):
    """Steps per job cut at a group's end (a job reads each of its files once); a run stopped
    between step jobs (--max-jobs) goes on from its checkpoint with the same batch files and
    ends with the uninterrupted run's model."""
    # 120 rows a step of 5 features: 3 steps per group of files; 20 steps, at most 8 a job.
    monkeypatch.setattr(batches, "FILE_BYTES", 3 * 120 * 8 * 7)
    monkeypatch.setattr(beam_aggregator, "MAX_STEPS_PER_JOB", 8)
    common = ["train", "--input", table["glob"], "--algorithm", "dpsgd", "--epsilon", 2,
              "--seed", 11, "--batch-size", 120, "--epochs", 1, "--batch-rows", BATCH_ROWS,
              "--runner", "FnApiRunner", "--temp_location", tmp_path / "temp",
              "--step_sums", "workers", "--quality-check", "off"]
    assert cli(*common, "--output", tmp_path / "whole").code == 0
    whole = model_theta(tmp_path / "whole")
    steps = [j["steps"] for j in jobs if j["kind"] == "steps"]
    assert steps == [6, 6, 8], steps   # 8 cut to 6 = 2 groups of 3; the last 8 whole

    del jobs[:]
    resumed = [*common, "--output", tmp_path / "resumed", "--checkpoint-dir", tmp_path / "ckpt",
               "--max-jobs", 3]
    r = cli(*resumed)
    assert r.code == 75, r   # stopped after the batch job and two step jobs
    r = cli(*resumed)
    assert r.code == 0, r
    assert [j["kind"] for j in jobs] == ["batches"] + ["steps"] * 3   # the files were reused
    np.testing.assert_array_equal(model_theta(tmp_path / "resumed"), whole)


@pytest.mark.parametrize("shards", [8, 64])
def test_the_batch_jobs_files_do_not_grow_with_the_shards(tmp_path, monkeypatch, shards):
    """The same rows cut into 8 or 64 shards: the job leaves PARTS files per group of steps
    (every step's batch still the local runner's), and none of the shards' files it merged."""
    n, d, steps = 6400, 5, 100
    source = _parquet(tmp_path / "data", n, d, n // shards, files=1)
    columns = [f"f{j}" for j in range(d)]
    assert len(data.plan_shards(source["files"], BATCH_ROWS)) == shards
    plan = batches.PoissonPlan(PoissonSampler(0.02, seed=5), 0.02 * n)
    monkeypatch.setattr(batches, "FILE_BYTES", int(10 * plan.expected_rows * 8 * (d + 2)))
    aggregator = BeamAggregator(source["files"], "label", columns, LOGISTIC, BATCH_ROWS,
                                ["--runner", "FnApiRunner", "--temp_location", str(tmp_path / "t")])
    local = batches.LocalBatches(data.load_blocks(source["files"], "label", columns, LOGISTIC,
                                                  BATCH_ROWS), plan)
    with aggregator.step_batches(plan, steps) as written:
        names = os.listdir(written.location)
        groups = -(-steps // written.manifest.steps_per_file)
        assert groups == 10
        group_files = [name for name in names if name.startswith("group-")]
        assert len(group_files) == batches.PARTS * groups, len(group_files)
        assert sorted(names) == sorted(group_files + [batches.DONE])   # no shard files left
        for step in range(0, steps, 7):
            got, expected = written.get(step), local.get(step)
            assert len(got) == len(expected) == 1
            np.testing.assert_array_equal(got[0].features, expected[0].features)
    aggregator.close()


def test_auto_sums_on_the_driver_in_process_and_follows_the_projection_elsewhere():
    """``--step_sums auto``: the driver for an in-process runner; elsewhere the cheaper mode of
    the projection, and the workers whenever a step's batch is too big for the driver."""
    assert step_costs.choose("auto", False, 1e6, 1000).mode == "driver"
    assert step_costs.choose("workers", False, 10, 5) == step_costs.Choice("workers", "workers",
                                                                             "given")
    too_big = step_costs.DRIVER_BATCH_BYTES / step_costs.row_bytes(1000) * 2
    assert step_costs.choose("auto", True, too_big, 1000).mode == "workers"
    for batch, dim in [(1e3, 50), (1e4, 50), (1e5, 50), (1e6, 50), (1e4, 1000), (1e5, 1000)]:
        projected = {mode: step_costs.project(1e8, dim, batch, 5, mode, 32).seconds
                     for mode in ("driver", "workers")}
        chosen = step_costs.choose("auto", True, batch, dim, 32)
        assert chosen.mode == min(projected, key=projected.get), (batch, dim, projected)
    # Small batches: a step job's latency outweighs the driver's reading; large: the reverse.
    assert step_costs.choose("auto", True, 1e3, 50, 32).mode == "driver"
    assert step_costs.choose("auto", True, 1e6, 50, 32).mode == "workers"


def test_projection_counts_jobs_files_and_driver_bytes():
    """The projection's counts (not its times, which are measured inputs): a step job per
    MAX_STEPS_PER_JOB steps, PARTS files per group of steps, the driver reading every sampled
    row in driver mode and only the model after each job in worker mode."""
    n, d, batch = 1e9, 1000, 1e5
    steps = 5 * n / batch
    driver = step_costs.project(n, d, batch, 5, "driver", 32)
    workers = step_costs.project(n, d, batch, 5, "workers", 32)
    assert driver.jobs == 1 and workers.jobs == 1 + steps / step_costs.MAX_STEPS_PER_JOB
    assert driver.driver_bytes == 5 * n * step_costs.row_bytes(d)
    assert workers.driver_bytes / steps < 1 << 16 < driver.driver_bytes / steps
    per_file = batches.steps_per_file(batch, d)
    assert driver.files == workers.files == -(-steps // per_file) * max(
        batches.PARTS, -(-batch * step_costs.row_bytes(d) * per_file // batches.FILE_BYTES))


@pytest.mark.slow
def test_steps_that_hold_the_root_seed_stay_on_the_driver(tmp_path, cli, table, jobs):
    """DP-AMBSSGD's steps draw their noise from the run's root seed (no ``for_steps``), which no
    job graph may hold: asked to sum on the workers, it stays on the driver and says why."""
    r = cli("train", "--input", table["glob"], "--output", tmp_path / "out", "--seed", 7,
            "--batch-rows", BATCH_ROWS, "--runner", "FnApiRunner", "--temp_location",
            tmp_path / "temp", "--step_sums", "workers", "--algorithm", "dp-ambssgd",
            "--model", "linear", "--blocks", 6, "--epsilon", 2)
    assert r.code == 0, r
    assert "steps" not in [j["kind"] for j in jobs], jobs
    report = read_json(tmp_path / "out" / "privacy_report.json")["step_sums"]
    assert report["mode"] == "driver" and "root seed" in report["reason"], report
    assert "steps summed by the driver (--step_sums: these steps draw their noise" in r.err


def test_step_jobs_memory_budget_counts_their_files_not_the_shards(tmp_path, monkeypatch):
    """A step job's sums are one per bundle, at most one per input: its batch files (a few per
    group), not the input's shards. With 64 shards and a budget that holds 20 steps' sums of
    the files, the step jobs run 20 steps where a shards' job would run fewer."""
    n, d = 6400, 5
    source = _parquet(tmp_path / "data", n, d, n // 64, files=1)
    columns = [f"f{j}" for j in range(d)]
    aggregator = BeamAggregator(source["files"], "label", columns, LOGISTIC, BATCH_ROWS,
                                ["--runner", "FnApiRunner"])
    assert len(aggregator.shards) == 64
    names = [batches.group_file_name(0, part, "a") for part in range(batches.PARTS)]
    files = beam_aggregator.BatchFiles(str(tmp_path), batches.Manifest("x", 100, 500, names),
                                       keep=True)
    from beam_dp.algorithms.base import TrainState
    state = TrainState.zeros(1, d)
    stage = _StageOfShape((1, d + 1))
    inputs = (1 + 2) * batches.PARTS   # one group of files spans 200 steps; and every row's
    per_step = (inputs + 2) * 8 * (d + 1) + 3 * 2 * 8 * (d + 1)   # sums; copies of the state
    monkeypatch.setattr(beam_aggregator, "JOB_MEMORY_BUDGET", 20 * per_step)
    assert aggregator.steps_per_job_over_batches(files, stage, 100, state) == 20
    assert aggregator.steps_per_job(_StageOfShape((1, d + 1)), 100, state) < 20
    aggregator.close()


class _StageOfShape:
    """A stage as the graph probes see it (its sums' shape; never run)."""

    def __init__(self, shape):
        self.shape = shape

    def partial_sum(self, block, state):
        return np.zeros(self.shape)

    def apply(self, state, total):
        return state


def test_a_wrong_step_sums_is_refused_in_one_line_before_any_job(tmp_path, cli, table, jobs):
    r = cli("train", "--input", table["glob"], "--output", tmp_path / "out", "--algorithm",
            "dpsgd", "--epsilon", 1, "--runner", "FnApiRunner", "--step_sums", "all")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r
    assert "--step_sums must be one of auto, driver, workers" in r.err
    assert jobs == [] and not (tmp_path / "out").exists()


def test_full_batch_steps_per_job_come_from_the_bundles_a_job_had(tmp_path, cli, jobs,
                                                                   monkeypatch):
    """A step holds one sum per bundle: once a job has counted its steps' bundles (a Beam
    counter), the steps per job come from them, not from the shards (64 here, which alone
    would allow 2 steps a job under this budget)."""
    n, d = 6400, 5
    source = _parquet(tmp_path / "data", n, d, n // 64, files=1)
    sums = 8 * (d + 1)
    state = 3 * 2 * 8 * (d + 1)
    monkeypatch.setattr(beam_aggregator, "JOB_MEMORY_BUDGET", 2 * ((64 + 2) * sums + state))
    r = cli("train", "--input", source["glob"], "--output", tmp_path / "out", "--algorithm",
            "dpgd", "--steps", 12, "--epsilon", 2, "--seed", 3, "--batch-rows", BATCH_ROWS,
            "--scale-features", "none", "--quality-check", "off", "--runner", "FnApiRunner")
    assert r.code == 0, r
    steps = [j["steps"] for j in jobs]
    bundles = max(-(-j["bundles"] // j["steps"]) for j in jobs)
    assert 1 <= bundles < 64 // 2, jobs
    # the first job by the shards; the rest by twice the bundles a step had
    assert steps[0] == 2 and steps[1] == min(10, (2 * ((64 + 2) * sums + state))
                                             // ((2 * bundles + 2) * sums + state)), steps
