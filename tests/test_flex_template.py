"""The Flex Template protocol end to end, offline, on the GCS server (tests/object_stores.py).

Google's launcher runs the entry point (pipelines/flex_template_main.py) with
``--template_location``: Beam writes the job there and returns, and the job runs only once the
launching process has exited. The test plays the launcher and the service: each launch runs the
entry point with the DataflowRunner and ``--template_location`` on the GCS server and exits;
the job it wrote is then run as the service would, in another process
(tests/dataflow_service.py: the staged pipeline proto on Beam's in-process runner); the next
launch resumes from that job's result. The model at the end must equal an uninterrupted local
run's with the same seed, for dpgd (jobs of steps) and dpsgd (one job writes the batches).
"""
from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

try:   # the dataflow extra (apache-beam[gcp]), as in tests/test_dataflow.py
    import apache_beam.runners.dataflow.dataflow_runner  # noqa: F401
    import apache_beam.runners.dataflow.internal.apiclient  # noqa: F401
except ImportError as e:
    pytest.skip(f"the Dataflow runner needs the dataflow extra (apache-beam[gcp]): {e}",
                allow_module_level=True)

from beam_dp import publish, storage  # noqa: E402

from object_stores import gcs_server  # noqa: E402,F401  (fixture)

HERE = Path(__file__).resolve().parent
# Well-formed names: nothing here reaches Google (the GCS server takes the staging uploads).
DATAFLOW = ["--runner=DataflowRunner", "--project=beam-dp-template-test", "--region=us-central1",
            "--sdk_location=container", "--no_auth"]
SEED = 7


def _flex_main():
    spec = importlib.util.spec_from_file_location(
        "flex_template_main", HERE.parent / "pipelines" / "flex_template_main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def service(gcs_server):
    """The Dataflow service's stand-in: one process that runs each template it is given."""
    proc = subprocess.Popen([sys.executable, str(HERE / "dataflow_service.py")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=gcs_server.subprocess_env())

    def run(template: str) -> None:
        proc.stdin.write(template + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline().strip()
        assert answer == "ran", answer[-4000:]

    try:
        yield run
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, flags, jobs", [
    ("dpgd", "--steps 6 --steps-per-job 3", ["stages-3", "stages-4"]),   # (the check in the last)
    ("dpsgd", "--steps 40 --batch-size 64", ["batches-40"]),   # (the check from its files)
])
def test_template_launches_train_to_the_end_and_match_a_local_run(gcs_server, service, cli,
                                                                  tmp_path, algorithm, flags,
                                                                  jobs):
    root = gcs_server.bucket()
    assert cli("make-data", "--output", f"{root}/data", "--n", 600, "--d", 3, "--shards", 2,
               "--seed", 1, "--validation-n", 0).code == 0
    common = ["--epsilon", 1, "--delta", 1e-6, "--algorithm", algorithm, "--seed", SEED,
              *flags.split()]
    local = cli("train", "--input", f"{root}/data/train-*.parquet", "--output",
                tmp_path / "local", *common)
    assert local.code == 0, local.err[-3000:]

    flex_main = _flex_main()
    template, status_file = f"{root}/templates/job.json", f"{root}/status.json"
    checkpoints = f"{root}/checkpoints"
    launch = [f"--input={root}/data/train-*.parquet", f"--output={root}/model",
              f"--checkpoint_dir={checkpoints}", "--epsilon=1", "--delta=1e-6",
              f"--algorithm={algorithm}", f"--train_args=--seed {SEED} {flags}",
              f"--status_file={status_file}", f"--template_location={template}",
              f"--temp_location={root}/tmp", f"--staging_location={root}/staging", *DATAFLOW]
    written = []
    for _ in range(len(jobs) + 3):
        before = set(storage.list_files(checkpoints))
        assert flex_main.main(launch) == 0
        status = json.loads(storage.read_text(status_file))
        # Every launch wrote exactly one job and ran nothing itself: no job's result appeared.
        assert storage.exists(template)
        results = [n for n in set(storage.list_files(checkpoints)) - before
                   if n.endswith(".result.pkl")]
        assert results == [], results
        if status["finished"]:
            service(template)   # the placeholder job the launcher needs: it does nothing
            break
        assert status["launch_again"] and status["exit_code"] == 75
        service(template)
        storage.delete_files([template])
        found = [n for n in set(storage.list_files(checkpoints)) - before
                 if n.endswith(".result.pkl")]
        assert len(found) == 1, found   # the job's result, where the next launch looks
        _digest, _ordinal, kind, steps = found[0].rsplit("/", 1)[-1].split(".")[0].split("-")
        written.append(f"{kind}-{steps}")
    assert status["finished"], status
    assert written == jobs

    ours = json.loads(publish.read(f"{root}/model", ["model.json"])["model.json"])
    theirs = json.loads((tmp_path / "local" / "model.json").read_text())
    assert ours["coefficients"] == pytest.approx(theirs["coefficients"], rel=1e-9, abs=1e-12)
    # The run is over: its jobs' results (and, without --seed, its seed) are gone.
    assert not [n for n in storage.list_files(checkpoints) if "template-jobs" in n]


def test_job_results_are_found_by_checkpoint_and_ordinal_and_go_with_the_run(tmp_path):
    """beam_dp.beam.job_results on its own: a key names the checkpoint the driver was at and the
    job's ordinal since; a newer checkpoint drops the older results; the seed is drawn once and
    read back by every later launch; ``remove`` leaves nothing."""
    from beam_dp.beam.job_results import MISSING, SEED_FILE, JobResults

    checkpoint = tmp_path / "state.npz"
    first = JobResults(str(tmp_path / "jobs"), str(checkpoint))
    seed = first.seed()
    # as sensitive as the input: on a local disk, its owner's only
    assert (tmp_path / "jobs" / SEED_FILE).stat().st_mode & 0o077 == 0
    a, b = first.next_key("count"), first.next_key("stages", 3)
    assert a.split("-")[:2] != b.split("-")[:2] and b.endswith("-stages-3")
    storage.write_bytes(first.path(b), pickle.dumps({"theta": 1}))
    # the next launch, from the same checkpoint, finds the same jobs under the same names
    again = JobResults(str(tmp_path / "jobs"), str(checkpoint))
    assert again.seed() == seed
    assert again.next_key("count") == a and again.load(a) is MISSING
    assert again.next_key("stages", 3) == b and again.load(b) == {"theta": 1}
    # a new checkpoint: its jobs are new, the older results deleted
    storage.write_bytes(str(checkpoint), b"step 3")
    c = again.next_key("stages", 3)
    assert c != b and again.load(b) is MISSING
    assert sorted(storage.list_files(str(tmp_path / "jobs"))) == [SEED_FILE]
    again.remove()
    assert not (tmp_path / "jobs").exists()


def test_a_template_launch_without_a_checkpoint_directory_is_refused(tmp_path, cli):
    """Its job would run after it, with nowhere to leave the result for the next launch."""
    assert cli("make-data", "--output", tmp_path / "data", "--n", 400, "--d", 2,
               "--validation-n", 0).code == 0
    r = cli("train", "--input", tmp_path / "data" / "train-*.parquet", "--output",
            tmp_path / "out", "--epsilon", 1, "--template_location=gs://beam-dp-t/job.json",
            "--temp_location=gs://beam-dp-t/tmp", *DATAFLOW)
    assert r.code == 2 and "--checkpoint-dir" in r.err, r
    assert not (tmp_path / "out").exists()
