"""What the daily DAG's task does, without Airflow: build the `beam-dp train` command for one
date, find the model to warm-start from, and run the command until it is done.

Standard library only: Airflow lives in its own virtualenv (its dependencies conflict with
Beam's), so the DAG runs the project's `beam-dp` executable and never imports beam_dp; and the
project's tests import this module to check the command with beam-dp's own parser.
"""
from __future__ import annotations

import re
import subprocess
from typing import Callable

NOT_FINISHED = 75      # --max-jobs reached and checkpointed: run the same command again
BUDGET_REFUSED = 3     # the ledger refused the run: rerunning cannot help
USAGE_ERROR = 2        # bad flags or bad data: rerunning cannot help
QUALITY_REFUSED = 6    # the model diverged or is much worse than a constant: rerunning spends
                       # budget on the same settings (a resumed one finds the same verdict)
IN_PROGRESS = 4        # the same release runs elsewhere: that run finishes it
CORRUPT_CHECKPOINT = 7   # the release's checkpoint is unreadable: a person must discard it
# Any other code (69: disk full, ledger locked or unreachable; a crash) fails the attempt and
# Airflow's retries resume from the checkpoint.
CANNOT_SUCCEED = (USAGE_ERROR, BUDGET_REFUSED, IN_PROGRESS, QUALITY_REFUSED, CORRUPT_CHECKPOINT)
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class CannotSucceed(RuntimeError):
    """beam-dp refused the run (budget, usage, data, or a model much worse than a constant): a
    retry would fail the same way."""


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def latest_model_before(executable: str, output_root: str, ds: str) -> str | None:
    """The output directory of the most recent date before ``ds`` that holds a published model
    (``beam-dp latest-model``: on any file system beam-dp reads, gs:// and s3:// included): a
    released model, so starting from it is post-processing and costs no budget."""
    found = subprocess.run([executable, "latest-model", output_root, "--before", ds],
                           capture_output=True, text=True, timeout=600)
    if found.returncode != 0:
        raise RuntimeError(f"beam-dp latest-model exited with code {found.returncode}: "
                           f"{found.stderr.strip()[-500:]}")
    return found.stdout.strip() or None


def train_command(executable: str, ds: str, *, data_root: str, output_root: str,
                  checkpoint_root: str, ledger: str, dataset_id: str, dag_id: str, run_id: str,
                  warm_start: str | None, train_args: list[str],
                  input_pattern: str = "*.parquet") -> list[str]:
    """`beam-dp train` on the partition ``ds``: its data under <data_root>/<ds>/, its output in
    <output_root>/<ds>/, its checkpoints in <checkpoint_root>/<ds>/ (so that a retry resumes)."""
    command = [executable, "train",
               "--input", _join(data_root, ds, input_pattern),
               # A rerun of a committed release writes the stored output again: replace the
               # directory beam-dp wrote (--overwrite never replaces anything else).
               "--output", _join(output_root, ds), "--overwrite",
               "--checkpoint-dir", _join(checkpoint_root, ds),
               "--ledger", ledger, "--dataset-id", dataset_id, "--partition", ds,
               "--orchestrator-id", f"airflow_dag_id={dag_id}",
               "--orchestrator-id", f"airflow_run_id={run_id}"]
    if warm_start:
        command += ["--warm-start", warm_start]
    return command + list(train_args)


def redacted(command: list[str]) -> str:
    """The command for the log, with any password in a URL masked."""
    return " ".join(re.sub(r"(://[^:/@\s]+):[^@\s]*@", r"\1:***@", c) for c in command)


def run_until_done(command: list[str], log: Callable[[str], None],
                   max_runs: int = 1000) -> int:
    """Runs ``command`` again while it exits 75; returns how many times it ran. Raises
    CannotSucceed on exit 2, 3, 4, 6 or 7 (with beam-dp's error line), RuntimeError on other failures
    (the task's retries then resume from the checkpoint)."""
    for run in range(1, max_runs + 1):
        log(f"running ({run}): {redacted(command)}")
        lines: list[str] = []
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)
        try:
            for line in process.stdout:   # beam-dp prints no data values: safe to log
                lines.append(line.rstrip("\n"))
                log(lines[-1])
            code = process.wait()
        finally:   # the task was killed: stop beam-dp too (SIGTERM deletes its raw batches)
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=120)
        if code == 0:
            return run
        if code != NOT_FINISHED:
            errors = [l for l in lines if l.startswith("beam-dp: error")] or lines[-1:]
            message = f"beam-dp exited with code {code}: {' '.join(errors)}"
            raise (CannotSucceed if code in CANNOT_SUCCEED else RuntimeError)(message)
        log("beam-dp: not finished (exit code 75): running the same command again")
    raise RuntimeError(f"beam-dp still not finished after {max_runs} runs")
