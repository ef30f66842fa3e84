"""Airflow DAG: every day, train on that day's partition with `beam-dp train`.

Airflow runs in its own virtualenv; this DAG calls the project's `beam-dp` executable (param
``beam_dp`` or $BEAM_DP_EXECUTABLE, e.g. /opt/beam-dp/.venv/bin/beam-dp) and never imports
beam_dp. For the logical date ds, the task trains on <data_root>/<ds>/*.parquet, writes
<output_root>/<ds>/, checkpoints in <checkpoint_root>/<ds>/, charges the budget of partition ds
of dataset ``dataset_id`` in the ledger, records the DAG and run ids with the charge, and starts
from the newest earlier date's model (post-processing of a released model: free).

Settings come from the DAG's params, else from the environment ($BEAM_DP_LEDGER, ...). Params
are visible in Airflow's UI: keep passwords out of the ledger URL (PostgreSQL reads PGPASSWORD
or ~/.pgpass) or set it in the environment only. Roots are local paths, gs:// or s3:// URLs
(beam-dp reads and writes them; the newest earlier model is found by `beam-dp latest-model`).
"""
from __future__ import annotations

import os
import shlex
import sys
from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException
from airflow.timetables.interval import CronDataIntervalTimetable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:   # beam_dp_task lies beside this file
    sys.path.insert(0, HERE)
import beam_dp_task  # noqa: E402

SETTINGS = {   # param: (environment variable, default, description)
    "beam_dp": ("BEAM_DP_EXECUTABLE", "beam-dp", "the project's beam-dp executable"),
    "ledger": ("BEAM_DP_LEDGER", "", "budget ledger: SQLite path or postgresql://USER@HOST/DB"),
    "dataset_id": ("BEAM_DP_DATASET_ID", "", "the ledger's dataset id"),
    "data_root": ("BEAM_DP_DATA_ROOT", "", "daily partitions: <data_root>/<ds>/*.parquet"),
    "output_root": ("BEAM_DP_OUTPUT_ROOT", "", "models: <output_root>/<ds>/"),
    "checkpoint_root": ("BEAM_DP_CHECKPOINT_ROOT", "", "checkpoints: <checkpoint_root>/<ds>/"),
    "train_args": ("BEAM_DP_TRAIN_ARGS", "--epsilon 1 --delta 1e-6",
                   "more beam-dp train flags, shell-quoted (budget, algorithm, Beam runner)"),
}


def _setting(params, name: str) -> str:
    variable, default, _ = SETTINGS[name]
    value = params.get(name) or os.environ.get(variable) or default
    if not value:
        raise AirflowFailException(f"set the DAG param {name!r} or ${variable}")
    return value


@dag(
    # Data intervals of one day: the run for ds starts after ds has ended (ds = the interval's
    # start), once its partition is complete.
    schedule=CronDataIntervalTimetable("0 0 * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,   # dates in order: each warm-starts from the one before
    params={name: Param("", type="string", description=about)
            for name, (_, _, about) in SETTINGS.items()},
    tags=["beam-dp"],
)
def beam_dp_daily():
    @task(retries=2, retry_delay=timedelta(minutes=10), execution_timeout=timedelta(hours=20))
    def train() -> dict:
        context = get_current_context()
        params, ds = context["params"], context["ds"]
        output_root = _setting(params, "output_root")
        warm_start = beam_dp_task.latest_model_before(_setting(params, "beam_dp"), output_root, ds)
        command = beam_dp_task.train_command(
            _setting(params, "beam_dp"), ds,
            data_root=_setting(params, "data_root"), output_root=output_root,
            checkpoint_root=_setting(params, "checkpoint_root"),
            ledger=_setting(params, "ledger"), dataset_id=_setting(params, "dataset_id"),
            dag_id=context["dag"].dag_id, run_id=context["run_id"], warm_start=warm_start,
            train_args=shlex.split(_setting(params, "train_args")))
        try:
            runs = beam_dp_task.run_until_done(command, print)
        except beam_dp_task.CannotSucceed as e:   # budget refused or usage error: no retry
            raise AirflowFailException(str(e)) from None
        return {"partition": ds, "output": f"{output_root.rstrip('/')}/{ds}",
                "warm_start": warm_start, "runs": runs}

    train()


beam_dp_daily()
