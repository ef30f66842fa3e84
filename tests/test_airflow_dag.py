"""deploy/airflow's DAG, run for real by Airflow: a virtualenv with apache-airflow from PyPI
(Airflow's dependencies conflict with Beam's, so it cannot share the project's), a migrated
SQLite metadata database, and `dag.test()` for each date, the task running the project's
`beam-dp` executable on that date's Parquet partition. Data, models and checkpoints are on a GCS
server on this machine (tests/object_stores.py): every path of the DAG is a gs:// URL.

Three daily partitions, each trained from the model of the date before (date 1 in two runs of
the command: --max-jobs 1 makes it exit 75 after the first job's two steps; dates 2 and 3
in one, the DAG's train_args param given in the run's conf). Then what a scheduler's operators do:
one date's input uploaded again (same bytes, a new object generation), then all three dates
cleared and backfilled in reverse order (date 3 runs again after the model it warm-started from,
dates 2 and 1 before the dates that warm-started from them). Every one of those runs succeeds,
charges nothing and writes each date's model again byte for byte (a model rewritten with the
same bytes is the same release input). Three dates hold every case a longer chain has (a first
date, a middle one, a last one); each dag.test costs ~15 s on CI's two cores, so the chain was
cut from five. Re-running days in forward order is tests/test_budget_runs.py's (the CLI alone).
Last, date 4, whose partition budget is too small: refused, the task failed without retries,
with beam-dp's message naming the dataset, the partition and what remains.

The virtualenv (tests/airflow_venv.py) is kept in .airflow-venv/ (gitignored) and reused while
complete; CI makes it ahead, beside the project's install.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_venv import airflow_python
from object_stores import gcs_server  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent   # the project's venv: beam-dp
DATASET = "events"
DATES = ["2026-03-01", "2026-03-02", "2026-03-03"]
REFUSED = "2026-03-04"   # its partition's budget cannot afford a run
SETTINGS = "--epsilon 1 --delta 1e-6 --algorithm dpgd --steps 4 --steps-per-job 2"
# Date 1 on Beam's runner, stopped by --max-jobs (neither is part of a release's id); the other
# runs on the local runner, whose model is the same (tests/test_cluster_execution.py) and which
# spares each of them its Beam jobs' start-up.
# (Two jobs in all: two steps, then two and the private quality check in the last job.)
TRAIN_ARGS = SETTINGS + " --max-jobs 1"
ONE_RUN = SETTINGS + " --runner local"

# Run with the Airflow venv's Python: loads the DAG folder and runs dag.test for each date given,
# in order and in one process (Airflow's start-up and its in-process API server cost ~9 s each),
# printing one JSON line per run with the task's state, tries and return value (its XCom). A "--"
# among the dates makes it print PAUSED and wait for a line on stdin (the test looks at the store
# meanwhile); a date written DATE=ARGS runs with the DAG param train_args set to ARGS.
DRIVER = r'''
import datetime, json, sys, time
from airflow.models.dagbag import DagBag
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from sqlalchemy import select


bag = DagBag()
print("IMPORT_ERRORS " + json.dumps(bag.import_errors), flush=True)
dag = bag.get_dag("beam_dp_daily")
for day in sys.argv[1:]:
    if day == "--":
        print("PAUSED", flush=True)
        sys.stdin.readline()
        continue
    day, _, train_args = day.partition("=")
    logical = datetime.datetime.fromisoformat(day).replace(tzinfo=datetime.timezone.utc)
    started = time.monotonic()
    run = dag.test(logical_date=logical, run_conf={"train_args": train_args} if train_args else None)
    (ti,) = run.get_task_instances()
    with create_session() as session:
        xcom = session.scalars(select(XComModel).where(
            XComModel.dag_id == dag.dag_id, XComModel.run_id == run.run_id,
            XComModel.key == "return_value")).first()
    print("RESULT " + json.dumps({"date": day, "run_state": str(run.state), "state": str(ti.state),
                                  "try_number": ti.try_number, "run_id": run.run_id,
                                  "value": xcom.value if xcom else None,
                                  "seconds": round(time.monotonic() - started, 1)}), flush=True)
'''


def _beam_dp(*argv) -> str:
    """The test's own beam-dp commands (data, budgets, the ledger's view), in-process: what the
    DAG runs goes through the executable, these need not pay its start-up eight times."""
    from beam_dp.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([str(a) for a in argv])
    assert code == 0, out.getvalue()
    return out.getvalue()


@pytest.mark.slow
def test_daily_dag_trains_each_partition_once_through_reruns_and_backfills(tmp_path, gcs_server):
    from apache_beam.io.filesystems import FileSystems

    from beam_dp import publish

    python = airflow_python()
    bucket = gcs_server.bucket()
    data, out, ckpt = f"{bucket}/data", f"{bucket}/models", f"{bucket}/checkpoints"
    ledger = tmp_path / "ledger.sqlite"
    for seed, day in enumerate(DATES + [REFUSED]):
        _beam_dp("make-data", "--output", f"{data}/{day}", "--n", 3000, "--d", 5,
                 "--validation-n", 0, "--shards", 2, "--seed", seed)
        # Room for one run at epsilon 1 on each date (whatever the composition's slack); the
        # refused date cannot afford one.
        _beam_dp("ledger", "budget", "--ledger", ledger, "--dataset-id", DATASET,
                 "--partition", day, "--epsilon", 3 if day != REFUSED else 0.2, "--delta", 1e-5)

    env = {k: v for k, v in gcs_server.subprocess_env().items()
           if not k.startswith(("AIRFLOW", "VIRTUAL_ENV"))}
    env.update(
        AIRFLOW_HOME=str(tmp_path / "airflow"),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "deploy" / "airflow"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        BEAM_DP_EXECUTABLE=str(BIN / "beam-dp"), BEAM_DP_LEDGER=str(ledger),
        BEAM_DP_DATASET_ID=DATASET, BEAM_DP_DATA_ROOT=data, BEAM_DP_OUTPUT_ROOT=out,
        BEAM_DP_CHECKPOINT_ROOT=ckpt, BEAM_DP_TRAIN_ARGS=TRAIN_ARGS)
    migrate = subprocess.run([str(python), "-m", "airflow", "db", "migrate"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stdout[-3000:] + migrate.stderr[-3000:]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)

    # The three dates; a pause (the test keeps their models and uploads date 2's input
    # again); the backfill of all three in reverse; the refused date.
    dates = [DATES[0], *(f"{d}={ONE_RUN}" for d in DATES[1:]), "--",
             *(f"{d}={ONE_RUN}" for d in DATES[::-1]), f"{REFUSED}={ONE_RUN}"]
    process = subprocess.Popen([str(python), str(driver), *dates],
                               env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines, models = [], {}
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("PAUSED"):
                break
        if sum(l.startswith("RESULT ") for l in lines) == len(DATES):
            models = {day: publish.read(f"{out}/{day}") for day in DATES}
            charged = _beam_dp("ledger", "show", "--ledger", ledger, "--dataset-id", DATASET)
            for shard in FileSystems.match([f"{data}/{DATES[1]}/*"])[0].metadata_list:
                with FileSystems.open(shard.path) as f:
                    content = f.read()
                with FileSystems.create(shard.path) as f:   # a re-upload: same bytes
                    f.write(content)
        with contextlib.suppress(BrokenPipeError):   # (a driver that failed before the pause)
            process.stdin.write("go\n")
            process.stdin.close()
        lines += process.stdout.readlines()
        assert process.wait(timeout=600) == 0, "".join(lines)[-5000:]
    finally:
        if process.poll() is None:
            process.kill()
    log = "".join(lines)
    print("dag.test seconds:", [json.loads(l.split(" ", 1)[1]).get("seconds") for l in lines
                                if l.startswith("RESULT ")])
    (errors,) = [l for l in lines if l.startswith("IMPORT_ERRORS ")]
    assert json.loads(errors.split(" ", 1)[1]) == {}, errors
    results = [json.loads(l.split(" ", 1)[1]) for l in lines if l.startswith("RESULT ")]
    assert len(results) == len(dates) - 1, log[-5000:]
    first, reruns, refused = results[:len(DATES)], results[len(DATES):-1], results[-1]
    assert [(r["date"], r["state"]) for r in first] == [(d, "success") for d in DATES], log[-5000:]
    values = [r["value"] for r in first]
    assert [v["warm_start"] for v in values] == [None] + [f"{out}/{d}" for d in DATES[:-1]]
    assert values[0]["runs"] == 2   # exit 75, then the same command again
    assert [v["runs"] for v in values[1:]] == [1] * (len(DATES) - 1)
    assert all("model.json" in models[day] for day in DATES)

    # Backfilled: each run one command that found its release committed.
    assert [(r["date"], r["state"], r["value"]["runs"]) for r in reruns] == \
        [(d, "success", 1) for d in DATES[::-1]], log[-5000:]
    assert log.count("was already committed") == len(reruns), log[-5000:]
    assert {day: publish.read(f"{out}/{day}") for day in DATES} == models

    assert (refused["date"], refused["state"], refused["try_number"]) == (REFUSED, "failed", 1), \
        log[-5000:]
    (message,) = {l.strip() for l in log.splitlines() if "beam-dp exited with code 3" in l}
    assert DATASET in message and REFUSED in message and "remaining" in message.lower(), message
    assert not publish.is_published(f"{out}/{REFUSED}")

    # 3 + 3 successful task runs made three charges, unchanged since the first three runs.
    shown = _beam_dp("ledger", "show", "--ledger", ledger, "--dataset-id", DATASET)
    assert _charges(shown) == _charges(charged)
    committed = [c for c in _charges(shown) if c["status"] == "committed"]
    assert sorted(c["partitions"] for c in committed) == DATES, shown
    assert len(_charges(shown)) == len(DATES), shown
    assert all("airflow_dag_id=beam_dp_daily" in c["orchestrator"] for c in committed), shown
    assert not list(Path.cwd().glob("gs:*"))   # nothing written to a local "gs:" directory


def _charges(shown: str) -> list[dict[str, str]]:
    """The rows of `beam-dp ledger show`'s charges table (columns apart by 2+ spaces)."""
    lines = shown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("charges"))
    header = re.split(r"\s{2,}", lines[start + 1].strip())
    rows = []
    for line in lines[start + 2:]:
        if not line.strip() or line.strip() == "(none)":
            break
        rows.append(dict(zip(header, re.split(r"\s{2,}", line.strip()))))
    return rows
