"""Real multi-process Beam execution: Beam's own portable runner, with the pipeline's bundles run by
SDK worker processes that a Python SDK worker pool (``worker_pool_main``) starts.

With ``--runner PortableRunner --job_endpoint embed`` Beam starts its Python job service in this
process (no Java job server) and hands the pipeline proto to an FnApiRunner; with
``--environment_type EXTERNAL --environment_config localhost:PORT`` that runner asks the worker
pool for a worker, and the pool (run as ``python -m ...worker_pool_main``, i.e. in process mode)
starts one ``python -c 'SdkHarness(...).run()'`` subprocess per pipeline. Blocks, step functions
and states then cross process boundaries over gRPC, as on a distributed runner.

The pool starts its workers as plain ``python`` from PATH, so PATH must lead to the virtualenv's
interpreter (the one that can import apache_beam and beam_dp); the fixture arranges that.

The fixture and the runner are tests/test_cluster_execution.py's (the same model on external
worker processes, every kind of stage); one pool serves a module's tests (each counts the
workers it started from the log's new lines).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from beam_dp.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120  # Beam waits for an external worker without a deadline; do not hang the suite.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _wait_until_listening(port: int, proc: subprocess.Popen, timeout: float,
                          what: str = "the worker pool") -> None:
    """Returns once something listens on ``port``; raises if ``proc`` (``what``) exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with socket.create_connection(("localhost", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    """Ends the pool and any worker it started. The pool was started as the leader of a new
    session, so its process group holds exactly the pool and its workers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        os.killpg(proc.pid, signal.SIGKILL)  # a worker that outlived the pool
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def worker_pool(tmp_path_factory):
    """A running worker pool; yields (its address, the path of its log)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    # The pool runs its workers as `python`: check that it is one that can run our pipelines.
    python = shutil.which("python", path=env["PATH"])
    assert python, "no `python` on PATH for the worker pool to start workers with"
    subprocess.run([python, "-c", "import apache_beam, beam_dp"], env=env, check=True,
                   capture_output=True, timeout=60)

    port = _free_port()
    log_path = tmp_path_factory.mktemp("worker-pool") / "worker_pool.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "apache_beam.runners.worker.worker_pool_main",
             f"--service_port={port}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_until_listening(port, proc, timeout=30)
            yield f"localhost:{port}", log_path
        finally:
            _stop(proc)


def _run_with_timeout(argv: list[str]) -> int:
    result: dict = {}

    def target():
        try:
            result["rc"] = main(argv)
        except BaseException as e:  # re-raised in the test's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    if thread.is_alive():
        pytest.fail(f"beam-dp train did not finish within {TIMEOUT_S} s: {' '.join(argv)}")
    if "error" in result:
        raise result["error"]
    return result["rc"]

