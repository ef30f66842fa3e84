"""Dataflow translation, offline: every kind of job a training run makes is built with the
DataflowRunner in dry-run mode, which translates the pipeline into the job Dataflow would receive
and returns without submitting (or staging) anything. Each job must translate, and its pipeline
proto must stay under Dataflow's job graph limit (``JOB_GRAPH_LIMIT``), full-batch steps at the
steps per job that ``BeamAggregator.steps_per_job`` chooses.

Needs the ``dataflow`` extra (``pip install -e '.[dataflow]'``, i.e. apache-beam[gcp]); skipped
without it. CI installs it. Nothing here touches the network: the bucket and project names only
have to be well formed (a malformed temp or staging location makes Beam try to create a default
bucket), and every socket connection is refused while a test runs, so an accidental call to
Google Cloud fails loudly instead of depending on the network.

Runner v2 stages the pipeline proto rather than putting steps in the job request, so its
serialized size is what the limit applies to.
"""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

# The runner imports its API client (google.cloud.dataflow, the GCS file system, ...) only when
# a job is run, so that is what is imported here: without it the tests would fail, not skip.
# (Not pytest.importorskip: a missing piece of the extra can show as a plain ImportError, e.g.
# "cannot import name 'dataflow' from 'google.cloud'", which newer pytest no longer skips on.)
try:
    import apache_beam.runners.dataflow.dataflow_runner  # noqa: F401
    import apache_beam.runners.dataflow.internal.apiclient  # noqa: F401
except ImportError as e:
    pytest.skip(f"the Dataflow runner needs the dataflow extra (apache-beam[gcp]): {e}",
                allow_module_level=True)

from apache_beam.portability import common_urns  # noqa: E402

from beam_dp import batches, data, losses, stats, synthetic  # noqa: E402
from beam_dp.algorithms.base import TrainState  # noqa: E402
from beam_dp.algorithms.dp_ambssgd import Assignment  # noqa: E402
from beam_dp.algorithms.gradient_step import NoisyGradientStep  # noqa: E402
from beam_dp.algorithms.ssp import GramStage  # noqa: E402
from beam_dp.beam.aggregator import (JOB_GRAPH_BUDGET, JOB_GRAPH_LIMIT,  # noqa: E402
                                     MAX_STEPS_PER_JOB, BeamAggregator)
from beam_dp.sampling import PoissonSampler  # noqa: E402

# Syntactically valid names (a project ID of 6-30 characters, buckets of 3+): nothing is created.
PROJECT = "beam-dp-dry-run"
BUCKET = "gs://beam-dp-dry-run"
DATAFLOW_ARGS = [
    "--runner=DataflowRunner", f"--project={PROJECT}", "--region=us-central1",
    f"--temp_location={BUCKET}/tmp", f"--staging_location={BUCKET}/staging",
    "--no_auth", "--dry_run=True", "--sdk_location=container",
]
# Where the jobs would leave their results: never written, as a dry run executes nothing.
RESULT = f"{BUCKET}/tmp/beam-dp-dry-run/result.pkl"

N = 2000
D = 8
SEED = 5


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """A dry run must not need the network: every connection attempt fails at once."""
    def refuse(*args, **kwargs):
        raise OSError("test_dataflow: network access attempted during a Dataflow dry run")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _aggregator(directory, task: str, d: int, loss, label: str | None = "label",
                file_format: str = "parquet", **dataset) -> BeamAggregator:
    x, y = synthetic.make_dataset(task, N, d, seed=SEED, **dataset)
    files = synthetic.write_shards(str(directory), "train", x, y, 2, file_format)
    return BeamAggregator(files, label, [f"f{j}" for j in range(d)], loss, 500, DATAFLOW_ARGS)


def _dry_run(pipeline, record_property, name: str):
    """Translates ``pipeline`` for Dataflow without submitting it; returns the size
    ``BeamAggregator.graph_bytes`` gives it, the size of the pipeline proto Dataflow would
    receive and that proto, after checking the size against the limit."""
    ours = BeamAggregator.graph_bytes(pipeline)   # before run(): the runner rewrites the graph
    result = pipeline.run()
    result.wait_until_finish()   # returns at once in a dry run
    assert result.job is not None, "the DataflowRunner made no job"
    proto = result.job.proto_pipeline
    sent = len(proto.SerializeToString())
    record_property(f"{name}_graph_bytes", ours)
    record_property(f"{name}_dataflow_bytes", sent)
    print(f"{name}: graph_bytes {ours}, Dataflow pipeline proto {sent}")
    assert proto.components.transforms and proto.root_transform_ids
    assert 0 < sent < JOB_GRAPH_LIMIT, (name, sent)
    # steps_per_job keeps graph_bytes within half the limit, leaving the other half for what a
    # runner adds: the translated proto must fit in that margin.
    assert sent <= 2 * ours, (name, sent, ours)
    return ours, sent, proto


def _count_pardos(pipeline_proto) -> int:
    return sum(t.spec.urn == common_urns.primitives.PAR_DO.urn
               for t in pipeline_proto.components.transforms.values())


def _full_batch_step(loss, d: int) -> NoisyGradientStep:
    """A DP-GD step as ``noisy_gd.train`` builds it (q = 1: every row, every step)."""
    return NoisyGradientStep(loss=loss, clip_norm=1.0, noise_std=1.3, normalizer=float(N),
                             learning_rate=1.0, sampler=PoissonSampler(1.0, SEED), seed=SEED,
                             shape=(loss.outputs(), d + 1))


def _mid_run_state(outputs: int, d: int) -> TrainState:
    """A state as a later job starts from: noisy iterates, which do not compress as zeros do."""
    state = TrainState.zeros(outputs, d)
    g = np.random.default_rng(SEED)
    return TrainState(g.standard_normal(state.theta.shape),
                      g.standard_normal(state.theta_sum.shape), 40)


# ------------------------------------------------------------------------------- the jobs


def test_count_job_on_csv_input_translates(tmp_path, record_property):
    aggregator = _aggregator(tmp_path, "binary", D, losses.make_loss("logistic"), file_format="csv")
    assert data.counted_rows(aggregator.shards) is None   # CSV: the count needs this job
    _dry_run(aggregator.count_pipeline(RESULT), record_property, "count")


@pytest.mark.parametrize("task, model, d, classes", [
    ("binary", "logistic", D, None),
    # A bigger state (10 x 51) and a bigger stage: the largest full-batch graph here.
    ("multiclass", "softmax", 50, 10),
], ids=["logistic-d8", "softmax-d50-k10"])
@pytest.mark.slow
def test_dpgd_job_at_the_chosen_steps_per_job_fits(tmp_path, record_property, task, model, d,
                                                   classes):
    extra = {"num_classes": classes} if classes else {}
    loss = losses.make_loss(model, **extra)
    aggregator = _aggregator(tmp_path, task, d, loss, **extra)
    step = _full_batch_step(loss, d)
    state = _mid_run_state(loss.outputs(), d)

    steps = aggregator.steps_per_job(step, 10 ** 6, state)
    one, two = (aggregator.graph_bytes(aggregator.stages_pipeline([step] * k, state, RESULT))
                for k in (1, 2))
    per_step = two - one
    record_property("steps_per_job", steps)
    record_property("per_step_bytes", per_step)
    print(f"{model} d={d}: {per_step} bytes per step, {one} for one step; "
          f"{steps} steps per job")
    assert 1 < steps <= MAX_STEPS_PER_JOB

    pipeline = aggregator.stages_pipeline([step] * steps, state, RESULT)
    ours, _, proto = _dry_run(pipeline, record_property, f"dpgd-{model}-{steps}-steps")
    assert ours <= JOB_GRAPH_BUDGET   # what steps_per_job promised, from its 1- and 2-step sizes
    # ... by extrapolating linearly, which holds: the graph grows by the same bytes every step.
    assert ours <= 1.1 * (one + (steps - 1) * per_step), (ours, one, per_step)
    # Every step made it into the job: each is at least one ParDo, however RunStages lays it out.
    assert _count_pardos(proto) >= steps


def test_statistics_job_translates(tmp_path, record_property):
    """``beam-dp stats``: its stages as the CLI builds them (count, quantiles, means), no label."""
    aggregator = _aggregator(tmp_path, "regression", D, losses.make_loss("linear"), label=None)
    stages = stats.dataset_summary_stages(D, (0.5,), 1.0, 1e-5, SEED)
    _dry_run(aggregator.stages_pipeline(stages, {}, RESULT), record_property, "stats")


def test_statistics_job_with_a_public_count_translates(tmp_path, record_property):
    aggregator = _aggregator(tmp_path, "regression", D, losses.make_loss("linear"), label=None)
    stages = stats.dataset_summary_stages(D, (0.25, 0.5, 0.75), 1.0, 1e-5, SEED, count=False)
    _dry_run(aggregator.stages_pipeline(stages, {"n": N}, RESULT), record_property, "stats-public-n")


def test_ssp_gram_job_translates(tmp_path, record_property):
    aggregator = _aggregator(tmp_path, "regression", D, losses.make_loss("linear"))
    stage = GramStage(D, 2.0 * np.sqrt(D), 4.0)
    _dry_run(aggregator.stages_pipeline([stage], {}, RESULT), record_property, "ssp-gram")


def test_dpsgd_batch_job_translates(tmp_path, record_property):
    """Poisson DP-SGD: one job writes every step's batch, however many steps."""
    aggregator = _aggregator(tmp_path, "binary", D, losses.make_loss("logistic"))
    q = 0.05
    plan = batches.PoissonPlan(PoissonSampler(q, SEED), q * N)
    _dry_run(aggregator.batches_pipeline(plan, 2000, f"{BUCKET}/tmp/batches", f"{BUCKET}/tmp/written.pkl"), record_property,
             "dpsgd-batches")


def test_dp_ambssgd_batch_job_translates(tmp_path, record_property):
    aggregator = _aggregator(tmp_path, "binary", D, losses.make_loss("logistic"))
    blocks = 40
    plan = Assignment(SEED, blocks, 0.1, N / blocks)
    _dry_run(aggregator.batches_pipeline(plan, blocks, f"{BUCKET}/tmp/batches", f"{BUCKET}/tmp/written.pkl"), record_property,
             "dp-ambssgd-batches")


def test_the_quality_check_job_of_a_2_to_the_20_column_model_carries_no_model(tmp_path,
                                                                              record_property):
    """The private quality check of a model hashed to 2^20 columns: its coefficients (8 MB) go
    to the job as a state file, as a training job's state does, not inside the stage; the
    job's graph then stays far below Dataflow's 10 MB (it was 21.9 MB with the model in the
    stage)."""
    from beam_dp import quality
    from beam_dp.beam.aggregator import STATE_IN_GRAPH_BYTES, _state_bytes
    from beam_dp.beam.transforms import StateFile

    loss = losses.make_loss("logistic")
    aggregator = _aggregator(tmp_path, "binary", D, loss)
    check = quality.Check(1.0, None, "float", None)
    stage = check.stage(loss, None, SEED)
    theta = np.random.default_rng(SEED).standard_normal((1, (1 << 20) + 1))
    state = quality.initial_state(theta)
    assert _state_bytes(state) > STATE_IN_GRAPH_BYTES   # run_stages sends it as a file
    pipeline = aggregator.stages_pipeline([stage], StateFile(f"{BUCKET}/tmp/initial-state"),
                                          RESULT)
    ours, sent, _ = _dry_run(pipeline, record_property, "quality-check-2^20")
    assert sent < 1 << 20, sent


@pytest.mark.parametrize("algorithm", ["dpsgd"])   # (dpgd's: tests/test_flex_template.py)
def test_a_dry_run_of_the_default_command_exits_75_without_the_network(tmp_path, cli, algorithm):
    """`beam-dp train` with DataflowRunner's --dry_run: the first job is translated, the run
    stops there with exit 75 (as after --max-jobs), and nothing reached for the network (the
    autouse fixture refuses every connection): a dry run of dpsgd used to exit 2 after 160 s,
    its cleanup listing gs:// and retrying credentials."""
    x, y = synthetic.make_dataset("binary", N, D, seed=SEED)
    synthetic.write_shards(str(tmp_path / "data"), "train", x, y, 2, "parquet")
    started = time.monotonic()
    r = cli("train", "--input", tmp_path / "data" / "train-*.parquet", "--output",
            tmp_path / "out", "--epsilon", 1, "--algorithm", algorithm, *DATAFLOW_ARGS)
    assert r.code == 75, r
    assert time.monotonic() - started < 60
    assert not (tmp_path / "out").exists()
