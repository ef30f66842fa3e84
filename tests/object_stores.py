"""Real object-store servers on this machine, for the tests of beam_dp.storage and beam_dp.publish:
a GCS server (``gcp-storage-emulator``, PyPI) and an S3 server (``moto`` in server mode, PyPI),
each started by a fixture on a loopback port, with a fresh bucket per test.

Beam's ``gs://`` file system talks to the GCS server through ``STORAGE_EMULATOR_HOST``,
anonymously: Beam's credential lookup would first retry for ~24 s (no metadata server here), so
it is patched to "no credentials" in the test process, and in CLI subprocesses by the test-only
``sitecustomize.py`` that ``SITE_DIR`` holds (put on ``PYTHONPATH`` by ``subprocess_env``). The
product is never patched. Beam's ``s3://`` file system reaches the S3 server through
``--s3_endpoint_url`` (a flag every beam-dp command takes), with dummy keys.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from worker_pool import _free_port, _wait_until_listening

SITE_DIR = Path(__file__).resolve().parent / "object_store_site"
S3_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}


def _start(argv: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_until_listening(port, proc, 30, what=f"the server ({log})")
    except BaseException:
        proc.kill()
        raise
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def anonymous_gcs() -> None:
    """Beam's GCS credentials: none (the server takes anonymous requests), without the lookup's
    retries. The same as object_store_site/sitecustomize.py does in a subprocess."""
    from apache_beam.internal.gcp import auth
    auth._Credentials._credentials_init = True
    auth._Credentials._credentials = None


class Store:
    """One server: its scheme, a fresh bucket per test (``bucket()``), and the environment and
    flags a beam-dp command needs to reach it."""

    def __init__(self, scheme: str, env: dict, flags: list[str], make_bucket):
        self.scheme, self.env, self.flags, self._make_bucket = scheme, env, flags, make_bucket

    def bucket(self) -> str:
        name = "t" + uuid.uuid4().hex[:20]
        self._make_bucket(name)
        return f"{self.scheme}://{name}"

    def subprocess_env(self) -> dict:
        env = dict(os.environ, **self.env)
        env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), env.get("PYTHONPATH", "")])
        return env


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    pytest.importorskip("gcp_storage_emulator")
    pytest.importorskip("google.cloud.storage")
    port = _free_port()
    log = tmp_path_factory.mktemp("gcs") / "server.log"
    proc = _start([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "localhost",
                   "--port", str(port), "--in-memory"], port, log)
    host = f"http://localhost:{port}"
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = host
    anonymous_gcs()

    def make_bucket(name):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(name)

    try:
        yield Store("gs", {"STORAGE_EMULATOR_HOST": host, "BEAM_DP_TEST_ANONYMOUS_GCS": "1"},
                    [], make_bucket)
    finally:
        _stop(proc)
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    port = _free_port()
    log = tmp_path_factory.mktemp("s3") / "server.log"
    proc = _start([sys.executable, "-m", "moto.server", "-H", "localhost", "-p", str(port)],
                  port, log)
    endpoint = f"http://localhost:{port}"
    flags = [f"--s3_endpoint_url={endpoint}", "--s3_access_key_id=testing",
             "--s3_secret_access_key=testing", "--s3_region_name=us-east-1"]
    from beam_dp import storage
    storage.configure(flags)
    client = boto3.client("s3", endpoint_url=endpoint, **{
        "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
        "region_name": "us-east-1"})
    try:
        yield Store("s3", dict(S3_KEYS), flags, lambda name: client.create_bucket(Bucket=name))
    finally:
        _stop(proc)


@pytest.fixture(params=["gs", "s3"])
def object_store(request):
    """Each test runs once against each server. The S3 flags are given to Beam's file systems
    again: every Beam pipeline built in this process sets the file systems' options to its own."""
    store = request.getfixturevalue({"gs": "gcs_server", "s3": "s3_server"}[request.param])
    from beam_dp import storage
    storage.configure(store.flags)
    return store
