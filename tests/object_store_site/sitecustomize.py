"""Test-only (tests/object_stores.py puts this directory on PYTHONPATH for CLI subprocesses):
Beam's GCS credentials are "none" when the test's GCS server is in use, without the credential
lookup's ~24 s of retries. Never installed with the product.

Set when Beam's auth module is first imported, not here: importing it at start-up cost every
Python process of a test ~2.9 s (Beam's GCP modules), most of which never touch GCS."""
import importlib.abc
import importlib.util
import os
import sys

AUTH = "apache_beam.internal.gcp.auth"


def _anonymous(auth) -> None:
    auth._Credentials._credentials_init = True
    auth._Credentials._credentials = None


class _AnonymousWhenImported(importlib.abc.MetaPathFinder):
    """Finds Beam's auth module as the other finders do, and sets its credentials once it has
    run."""

    def find_spec(self, name, path=None, target=None):
        if name != AUTH:
            return None
        sys.meta_path.remove(self)   # (the real spec, from the finders after this one)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _anonymous(module)

        loader.exec_module = exec_module
        return spec


if os.environ.get("BEAM_DP_TEST_ANONYMOUS_GCS") == "1":
    if AUTH in sys.modules:
        _anonymous(sys.modules[AUTH])
    else:
        sys.meta_path.insert(0, _AnonymousWhenImported())
