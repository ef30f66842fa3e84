"""Test-only (tests/object_stores.py puts this directory on PYTHONPATH for CLI subprocesses):
Beam's GCS credentials are "none" when the test's GCS server is in use, without the credential
lookup's ~24 s of retries. Never installed with the product."""
import os

if os.environ.get("BEAM_DP_TEST_ANONYMOUS_GCS") == "1":
    try:
        from apache_beam.internal.gcp import auth

        auth._Credentials._credentials_init = True
        auth._Credentials._credentials = None
    except ImportError:
        pass
