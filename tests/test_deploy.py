"""deploy/: what can be checked without a cloud, a cluster or a Docker engine.

* the pinned requirements are what the venv (i.e. CI) has, and the Dockerfile installs exactly
  them and the project's wheel, on the SDK image of the installed Beam version;
* the wheel builds as the Dockerfile builds it, holds every module, and a Dataflow dry run
  (offline) stages it with --extra_package;
* every `beam-dp` command in deploy/ (READMEs, the CronJob's script, the DAG's and the Flex
  Template's command builders) parses with beam-dp's own parser;
* the manifests parse and have the fields that make them behave (sidecars, policies);
* the CronJob's script and the Flex Template's launch loop run for real, on local files.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from object_stores import gcs_server  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
BEAM_VERSION = importlib.metadata.version("apache-beam")
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
BIN = Path(sys.executable).parent
# The flags of the train command's contract that deploy/ relies on.
CONTRACT_FLAGS = ("--ledger", "--dataset-id", "--partition", "--orchestrator-id",
                  "--warm-start", "--max-jobs")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


flex_main = _load(REPO / "pipelines" / "flex_template_main.py")
dag_task = _load(DEPLOY / "airflow" / "beam_dp_task.py")


def _missing_contract_flags() -> list[str]:
    from beam_dp import cli
    train = cli.build_parser(["train"]).command_parsers["train"]
    known = {s for action in train._actions for s in action.option_strings}
    return [f for f in CONTRACT_FLAGS if f not in known]


def parse(argv: list[str]):
    """beam-dp's own parse of ``argv`` (beam-dp's flags, then Beam's for the rest)."""
    from beam_dp import cli
    if argv[0] == "train":
        missing = [f for f in _missing_contract_flags() if f in argv]
        assert not missing, f"beam-dp train does not have {missing} yet: {shlex.join(argv)}"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return cli._parse(cli.build_parser(argv), argv)
        except SystemExit:
            pytest.fail(f"`beam-dp {shlex.join(argv)}` does not parse: {err.getvalue().strip()}")


# ---------------------------------------------------------------------- commands in deploy/


def _logical_lines(text: str) -> list[str]:
    return re.sub(r"\\\n", " ", text).splitlines()


def beam_dp_commands(text: str) -> list[list[str]]:
    """Every `beam-dp ...` command (the arguments after the executable) in shell text."""
    commands = []
    for line in _logical_lines(text):
        if "beam-dp " not in line:
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, token in enumerate(tokens):
            if token.endswith("beam-dp") and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                end = next((j for j in range(i + 1, len(tokens))
                            if tokens[j] in ("&&", "||", ";", "|")), len(tokens))
                commands.append(tokens[i + 1:end])
    return commands


def _code_blocks(markdown: str) -> str:
    return "\n".join(re.findall(r"```[a-z]*\n(.*?)```", markdown, flags=re.S))


def cronjob() -> dict:
    return next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "cronjob.yaml").read_text())
                if d["kind"] == "CronJob")


def cronjob_script() -> str:
    pod = cronjob()["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    return container["args"][0]


def _documented_commands() -> dict[str, list[str]]:
    found = {}
    sources = {p.relative_to(REPO).as_posix(): _code_blocks(p.read_text())
               for p in sorted(DEPLOY.rglob("README.md"))}
    sources["deploy/k8s/cronjob.yaml"] = cronjob_script()
    # The production guide's commands, and the README's short section that points at it.
    sources["docs/guide/production.md"] = _code_blocks((REPO / "docs" / "guide" / "production.md").read_text())
    readme = (REPO / "README.md").read_text()
    cluster = readme[readme.index("\n## On a cluster and on a schedule\n"):]
    sources["README.md#on-a-cluster-and-on-a-schedule"] = _code_blocks(cluster[:cluster.find("\n## ", 5)])
    for source, text in sources.items():
        for k, argv in enumerate(beam_dp_commands(text)):
            found[f"{source}:{k}"] = argv
    return found


DOCUMENTED = _documented_commands()


def test_deploy_documents_the_commands_it_needs():
    kinds = {(s.split(":")[0], a[0]) for s, a in DOCUMENTED.items()}
    for source in ("deploy/flink/README.md", "deploy/spark/README.md", "deploy/k8s/cronjob.yaml",
                   "deploy/dataflow/README.md", "docs/guide/production.md",
                   "README.md#on-a-cluster-and-on-a-schedule"):
        assert (source, "train") in kinds, source


@pytest.mark.parametrize("source", sorted(DOCUMENTED))
def test_documented_beam_dp_command_parses(source):
    argv = DOCUMENTED[source]
    args, beam_args = parse(argv)
    if "flink" in source or "spark" in source:
        assert args.runner == "PortableRunner"
        flags = dict(zip(beam_args[::2], beam_args[1::2]))
        assert flags["--environment_type"] == "EXTERNAL"
        assert flags["--environment_config"] == "localhost:50000"   # the sidecar, on each worker
        assert {"--job_endpoint", "--temp_location"} <= set(flags)


def test_cronjob_command_uses_the_ledger_secret_and_a_kept_checkpoint():
    (argv,) = beam_dp_commands(cronjob_script())
    args, _ = parse(argv)
    assert args.ledger == "$BEAM_DP_LEDGER" and args.partition == ["$PARTITION"]
    assert args.checkpoint_dir.startswith("/state/") and args.max_jobs >= 1


def test_airflow_task_command_parses():
    command = dag_task.train_command(
        "/opt/beam-dp/.venv/bin/beam-dp", "2026-03-02", data_root="/data", output_root="/models",
        checkpoint_root="/ckpt", ledger="postgresql://beam_dp@db/ledger", dataset_id="events",
        dag_id="beam_dp_daily", run_id="scheduled__2026-03-02T00:00:00+00:00",
        warm_start="/models/2026-03-01", train_args=["--epsilon", "1", "--delta", "1e-6"])
    assert command[0].endswith("beam-dp")
    args, beam_args = parse(command[1:])
    assert beam_args == []
    assert args.input == ["/data/2026-03-02/*.parquet"] and args.output == "/models/2026-03-02"
    assert args.partition == ["2026-03-02"] and args.warm_start == "/models/2026-03-01"
    assert args.orchestrator_id == ["airflow_dag_id=beam_dp_daily",
                                    "airflow_run_id=scheduled__2026-03-02T00:00:00+00:00"]


@pytest.mark.slow   # (three beam-dp processes: 7 s)
def test_airflow_task_warm_starts_from_the_newest_earlier_model(tmp_path):
    from beam_dp import publish

    for day, model in (("2026-02-27", True), ("2026-02-28", True), ("2026-03-01", False),
                       ("2026-03-02", True), ("2026-03-03", True)):
        if model:
            publish.publish(str(tmp_path / day), {"model.json": b"{}"})
        else:   # a run that died before publishing: files, but no manifest
            (tmp_path / day).mkdir()
            (tmp_path / day / "model.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    beam_dp = str(BIN / "beam-dp")
    # 2026-03-01 has no published model (its run failed), 03-02 and later are not earlier.
    assert dag_task.latest_model_before(beam_dp, str(tmp_path), "2026-03-02") == \
        f"{tmp_path}/2026-02-28"
    assert dag_task.latest_model_before(beam_dp, str(tmp_path), "2026-02-27") is None
    assert dag_task.latest_model_before(beam_dp, str(tmp_path / "none"), "2026-03-02") is None


def test_airflow_task_reruns_on_75_and_stops_on_3(tmp_path):
    """A real process: exits 75 twice (counting in a file), then 0; another exits 3."""
    counter = tmp_path / "runs"
    script = ("import pathlib, sys; c = pathlib.Path(sys.argv[1]); n = len(c.read_text()) "
              "if c.exists() else 0; c.write_text('x' * (n + 1)); sys.exit(75 if n < 2 else 0)")
    log: list[str] = []
    assert dag_task.run_until_done([sys.executable, "-c", script, str(counter)], log.append) == 3
    assert sum("not finished" in line for line in log) == 2
    refuse = ("import sys; print('beam-dp: error: refused: dataset events, partition p, "
              "remaining 0.1'); sys.exit(3)")
    with pytest.raises(dag_task.CannotSucceed, match="code 3: beam-dp: error: refused.*remaining"):
        dag_task.run_until_done([sys.executable, "-c", refuse], log.append)
    with pytest.raises(RuntimeError, match="code 1"):
        dag_task.run_until_done([sys.executable, "-c", "import sys; sys.exit(1)"], log.append)
    assert dag_task.redacted(["--ledger", "postgresql://u:secret@db/l"]) == \
        "--ledger postgresql://u:***@db/l"


LAUNCHER_ARGS = [   # what a Flex Template launcher passes: the parameters, then Dataflow's flags
    "--input=gs://b/data/2026-03-02/*.parquet", "--output=gs://b/models/2026-03-02",
    "--checkpoint_dir=gs://b/ckpt/2026-03-02", "--epsilon=1", "--delta=1e-6",
    "--ledger=postgresql://beam_dp@10.0.0.5/ledger", "--dataset_id=events",
    "--partition=2026-03-02", "--orchestrator_id=airflow_dag_id=d,airflow_run_id=r",
    "--train_args=--steps 50 --clip-norm 0.5", "--runner=DataflowRunner", "--project=p-123456",
    "--region=us-central1", "--temp_location=gs://b/tmp", "--staging_location=gs://b/staging",
    "--sdk_container_image=europe-docker.pkg.dev/p/r/beam-dp:1",
]


def test_flex_template_launch_runs_train_with_one_job_and_a_checkpoint():
    argv = flex_main.train_argv(LAUNCHER_ARGS)
    args, beam_args = parse(argv)
    assert args.command == "train" and args.max_jobs == 1
    assert args.checkpoint_dir == "gs://b/ckpt/2026-03-02" and args.runner == "DataflowRunner"
    assert args.partition == ["2026-03-02"] and len(args.orchestrator_id) == 2
    assert args.steps == 50 and args.clip_norm == 0.5
    assert "--sdk_container_image=europe-docker.pkg.dev/p/r/beam-dp:1" in beam_args


def test_metadata_json_declares_the_parameters_the_main_takes():
    metadata = json.loads((DEPLOY / "dataflow" / "metadata.json").read_text())
    declared = {p["name"]: p for p in metadata["parameters"]}
    actions = [a for a in flex_main._parser()._actions if a.option_strings != ["-h", "--help"]]
    assert set(declared) == {a.dest for a in actions}
    required = {n for n, p in declared.items() if not p.get("isOptional", False)}
    assert required == {"input", "output", "checkpoint_dir", "epsilon"}


# ---------------------------------------------------------------------- packaging


def test_requirements_file_is_what_the_venv_has():
    """deploy/requirements.txt pins the closure of the project's dependencies to the versions
    installed here, i.e. the ones CI tests."""
    result = subprocess.run([sys.executable, str(DEPLOY / "pin_requirements.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    pins = dict(l.split("==") for l in (DEPLOY / "requirements.txt").read_text().splitlines()
                if l and not l.startswith("#"))
    assert pins["apache-beam"] == BEAM_VERSION and "beam-dp" not in pins
    assert {"numpy", "scipy", "dp-accounting", "pyarrow", "tqdm", "google-cloud-storage"} <= set(pins)


def _dockerfile() -> list[str]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "dataflow" / "Dockerfile").read_text())
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


def test_dockerfile_installs_exactly_the_pins_and_the_wheel_on_the_installed_beam():
    lines = _dockerfile()
    images = [l.split()[1] for l in lines if l.startswith("FROM ")]
    sdk = f"apache/beam_python{PYTHON}_sdk:{BEAM_VERSION}"
    launcher = f"gcr.io/dataflow-templates-base/python{PYTHON.replace('.', '')}-template-launcher-base"
    assert images == [launcher, sdk, sdk]
    assert lines[-1] == 'ENTRYPOINT ["/opt/apache/beam/boot"]'   # Beam's worker boot
    pips = [l for l in lines if re.search(r"\bpip (install|wheel)\b", l)]
    assert pips == [
        "RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .",
        "RUN pip install --no-cache-dir --no-deps -r requirements.txt",
        "RUN pip install --no-cache-dir --no-deps /tmp/dist/beam_dp-*.whl && rm -rf /tmp/dist",
    ]
    copies = [l for l in lines if l.startswith("COPY ") and "--from=" not in l]
    assert copies == ["COPY pyproject.toml README.md ./", "COPY beam_dp beam_dp",
                      "COPY deploy/requirements.txt requirements.txt",
                      "COPY pipelines/flex_template_main.py flex_template_main.py"]
    assert "ENV FLEX_TEMPLATE_PYTHON_PY_FILE=/template/flex_template_main.py" in lines
    assert not any("FLEX_TEMPLATE_PYTHON_REQUIREMENTS_FILE" in l or "SETUP_FILE" in l for l in lines)
    # The build context sends what the COPYs need (and nothing else, e.g. not .venv).
    ignore = (DEPLOY / "dataflow" / "Dockerfile.dockerignore").read_text().splitlines()
    sent = {l[1:] for l in ignore if l.startswith("!")}
    assert sent == {"pyproject.toml", "README.md", "beam_dp", "deploy/requirements.txt",
                    "pipelines/flex_template_main.py"}


def test_every_beam_image_in_deploy_is_the_installed_beam_version():
    tags = {}
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in ("", ".yaml", ".md"):
            for image, tag in re.findall(r"(apache/beam_[a-z0-9_.]+):([0-9][^\s\"'`]*)", path.read_text()):
                tags[f"{path.relative_to(REPO)} {image}"] = tag.rstrip(".,)")
    assert len(tags) >= 5
    assert {k: v for k, v in tags.items() if v != BEAM_VERSION} == {}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built as the Dockerfile's first stage builds it: from a copy of
    pyproject.toml, README.md and beam_dp/ only, with pip (isolated build from PyPI)."""
    import shutil
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "beam_dp", source / "beam_dp",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir",
                             str(dist), str(source)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = dist.glob("beam_dp-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_every_module_and_the_command(wheel):
    assert wheel.name == f"beam_dp-{importlib.metadata.version('beam-dp')}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "beam-dp = beam_dp.cli:console_main" in z.read(entry_points).decode()
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "beam_dp").rglob("*.py")}
    assert {"beam_dp/cli/__init__.py", "beam_dp/beam/aggregator.py"} <= modules
    assert modules - names == set()
    # The documented commands name this very file.
    docs = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *DEPLOY.rglob("*.md"),
            *DEPLOY.rglob("*.yaml")]
    named = {m for d in docs for m in re.findall(r"beam_dp-[^\s/`'\"]+?\.whl", d.read_text())}
    assert named == {wheel.name}


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("test_deploy: network access attempted during a Dataflow dry run")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.slow
def test_dataflow_dry_run_stages_the_wheel(wheel, no_network):
    try:   # as in test_dataflow.py: the runner's API client comes with the dataflow extra
        import apache_beam.runners.dataflow.internal.apiclient  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the Dataflow runner needs the dataflow extra (apache-beam[gcp]): {e}")
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.portability.api import beam_runner_api_pb2

    from beam_dp import losses

    bucket = "gs://beam-dp-dry-run"
    options = PipelineOptions([
        "--runner=DataflowRunner", "--project=beam-dp-dry-run", "--region=us-central1",
        f"--temp_location={bucket}/tmp", f"--staging_location={bucket}/staging", "--no_auth",
        "--dry_run=True", "--sdk_location=container", f"--extra_package={wheel}"])
    pipeline = beam.Pipeline(options=options)
    _ = pipeline | beam.Create(["logistic"]) | beam.Map(losses.make_loss)   # calls into beam_dp
    result = pipeline.run()
    staged = {}
    for environment in result.job.proto_pipeline.components.environments.values():
        for artifact in environment.dependencies:
            role = beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(artifact.role_payload)
            path = beam_runner_api_pb2.ArtifactFilePayload.FromString(artifact.type_payload).path
            staged[role.staged_name] = path
    assert staged.get(wheel.name) == str(wheel)
    assert "extra_packages.txt" in staged   # the list the workers pip-install from


# ---------------------------------------------------------------------- manifests


def test_cronjob_policies():
    spec = cronjob()["spec"]
    assert spec["concurrencyPolicy"] == "Forbid" and spec["startingDeadlineSeconds"] > 0
    job = spec["jobTemplate"]["spec"]
    assert job["backoffLimit"] >= 1 and job["activeDeadlineSeconds"] > 0
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"   # podFailurePolicy requires it
    actions = {r["action"]: r for r in job["podFailurePolicy"]["rules"]}
    from beam_dp.cli.exit_codes import DO_NOT_RETRY, EXIT_TRANSIENT
    assert sorted(actions["FailJob"]["onExitCodes"]["values"]) == sorted(DO_NOT_RETRY)
    assert sorted(dag_task.CANNOT_SUCCEED) == sorted(DO_NOT_RETRY)   # (Airflow's venv: its own)
    assert EXIT_TRANSIENT not in DO_NOT_RETRY
    assert any(75 in r.get("onExitCodes", {}).get("values", [])       # not finished: retry
               for r in job["podFailurePolicy"]["rules"] if r["action"] == "Ignore")
    (container,) = pod["containers"]
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert env["BEAM_DP_LEDGER"]["secretKeyRef"] == {"name": "beam-dp-ledger", "key": "url"}
    # the password through the environment, never on the command line (/proc/*/cmdline)
    assert env["PGPASSWORD"]["secretKeyRef"] == {"name": "beam-dp-ledger", "key": "password"}
    assert "PASSWORD@" not in cronjob_script()
    assert "job-name" in env["JOB_NAME"]["fieldRef"]["fieldPath"]
    (mount,) = container["volumeMounts"]
    (volume,) = pod["volumes"]
    assert mount["name"] == volume["name"] and "persistentVolumeClaim" in volume


def _manifests(name: str) -> dict:
    return {d["kind"] + "/" + d["metadata"]["name"]: d
            for d in yaml.safe_load_all((DEPLOY / name).read_text())}


def _worker_pool(pod_spec: dict) -> dict:
    (sidecar,) = [c for c in pod_spec["containers"] if c["name"] == "beam-worker-pool"]
    assert sidecar["args"] == ["--worker_pool"]
    assert [p["containerPort"] for p in sidecar["ports"]] == [50000]
    return sidecar


def test_flink_manifest():
    objects = _manifests("flink/flink.yaml")
    flink = objects["FlinkDeployment/beam-dp-flink"]
    assert "job" not in flink["spec"]   # a session cluster: the job server submits the jobs
    _worker_pool(flink["spec"]["taskManager"]["podTemplate"]["spec"])
    server = objects["Deployment/beam-flink-job-server"]["spec"]["template"]["spec"]["containers"][0]
    flink_version = flink["spec"]["flinkVersion"].removeprefix("v").replace("_", ".")
    assert server["image"] == f"apache/beam_flink{flink_version}_job_server:{BEAM_VERSION}"
    assert "--flink-master=beam-dp-flink-rest:8081" in server["args"]
    assert {p["port"] for p in objects["Service/beam-flink-job-server"]["spec"]["ports"]} >= {8099, 8098}


def test_spark_manifest():
    objects = _manifests("spark/spark.yaml")
    _worker_pool(objects["Deployment/spark-worker"]["spec"]["template"]["spec"])
    server = objects["Deployment/beam-spark-job-server"]["spec"]["template"]["spec"]["containers"][0]
    assert server["image"] == f"apache/beam_spark3_job_server:{BEAM_VERSION}"
    assert "--spark-master-url=spark://spark-master:7077" in server["args"]
    assert {p["port"] for p in objects["Service/beam-spark-job-server"]["spec"]["ports"]} >= {8099, 8098}


# ---------------------------------------------------------------------- real runs, local files


def _beam_dp(*argv) -> subprocess.CompletedProcess:
    result = subprocess.run([str(BIN / "beam-dp"), *map(str, argv)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result
    return result


@pytest.mark.slow
def test_cronjob_script_trains_the_day_before_its_scheduled_time(tmp_path, gcs_server, cli):
    """The CronJob's own script, run by /bin/sh with the project's beam-dp: its bucket a bucket
    of the GCS server (tests/object_stores.py), a local directory for the volume, a SQLite
    ledger, a Job name as a CronJob makes it."""
    from beam_dp import publish

    partition = "2026-03-01"
    scheduled = datetime(2026, 3, 2, 2, 30, tzinfo=timezone.utc)
    bucket, state = gcs_server.bucket(), tmp_path / "state"
    assert cli("make-data", "--output", f"{bucket}/data/{partition}", "--n", 2000, "--d", 4,
               "--validation-n", 0, "--shards", 2).code == 0
    ledger = tmp_path / "ledger.sqlite"
    assert cli("ledger", "budget", "--ledger", ledger, "--dataset-id", "events",
               "--partition", partition, "--epsilon", 3, "--delta", 1e-5).code == 0
    script = cronjob_script().replace("gs://BUCKET", bucket).replace("/state/", f"{state}/")
    env = dict(gcs_server.subprocess_env(), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
               BEAM_DP_LEDGER=str(ledger),
               JOB_NAME=f"beam-dp-daily-{int(scheduled.timestamp()) // 60}")
    result = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result
    assert f"partition {partition}" in result.stdout
    assert "model.json" in publish.read(f"{bucket}/models/{partition}", ["model.json"])
    assert not (tmp_path / "gs:").exists()   # (where a model written past the store would land)
    shown = cli("ledger", "show", "--ledger", ledger, "--dataset-id", "events").out
    assert partition in shown


@pytest.mark.slow
def test_flex_template_launches_until_finished(tmp_path):
    """The orchestrator's loop over launches, in-process on Beam's local runner: every launch
    submits at most one Beam job, exits 0 with "launch_again" while the run is not finished,
    and the last one writes the model."""
    data = tmp_path / "data"
    _beam_dp("make-data", "--output", data, "--n", 2000, "--d", 4, "--validation-n", 0,
             "--shards", 2)
    ledger = tmp_path / "ledger.sqlite"
    _beam_dp("ledger", "budget", "--ledger", ledger, "--dataset-id", "events",
             "--partition", "2026-03-02", "--epsilon", 3, "--delta", 1e-5)
    status = tmp_path / "status.json"
    launch = [f"--input={data}/train-*.parquet", f"--output={tmp_path / 'model'}",
              f"--checkpoint_dir={tmp_path / 'ckpt'}", "--epsilon=1", "--delta=1e-6",
              f"--ledger={ledger}", "--dataset_id=events", "--partition=2026-03-02",
              "--train_args=--algorithm dpgd --steps 4 --steps-per-job 2",
              f"--status_file={status}", "--runner=FnApiRunner"]
    outcomes = []
    for _ in range(10):
        assert flex_main.main(launch) == 0
        outcomes.append(json.loads(status.read_text()))
        if outcomes[-1]["finished"]:
            break
    assert len(outcomes) >= 2 and outcomes[-1]["finished"]
    assert all(o["launch_again"] and o["exit_code"] == 75 for o in outcomes[:-1])
    assert (tmp_path / "model" / "model.json").is_file()
