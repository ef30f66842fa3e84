"""Exit codes an orchestrator can act on (issue 31; the table in docs/guide/production.md): each
code of `beam-dp train` with a ledger, from the condition that makes it, with one line on stderr
and no traceback. (75 --max-jobs: test_budget_runs.py; 130 interrupted: test_interrupts.py; 6
the quality check's refusal: test_quality.py.)"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from beam_dp import storage
from beam_dp.cli.exit_codes import (EXIT_CORRUPT_CHECKPOINT, EXIT_IN_PROGRESS, EXIT_REFUSED,
                                    EXIT_TRANSIENT, EXIT_USAGE)
from beam_dp.ledger import core


@pytest.fixture
def data(tmp_path, cli):
    assert cli("make-data", "--output", tmp_path / "data", "--n", 400, "--d", 2,
               "--validation-n", 0).code == 0
    return str(tmp_path / "data" / "train-*.parquet")


def _ledger(tmp_path, cli, epsilon=3.0) -> str:
    path = str(tmp_path / "budget.db")
    assert cli("ledger", "budget", "--ledger", path, "--dataset-id", "ds", "--epsilon", epsilon,
               "--delta", 1e-5).code == 0
    return path


def _train(cli, data, out, ledger, *flags):
    runner = [] if "--runner" in flags else ["--runner", "local"]
    return cli("train", "--input", data, "--output", out, "--epsilon", 1, *runner,
               "--seed", 1, "--ledger", ledger, "--dataset-id", "ds", *flags)


def _one_line(err: str) -> bool:
    return "Traceback" not in err and all(line.startswith("beam-dp") for line in
                                          err.strip().splitlines())


def test_usage_and_budget_refusals(tmp_path, cli, data):
    ledger = _ledger(tmp_path, cli, epsilon=0.5)
    r = _train(cli, data, tmp_path / "a", ledger, "--steps", "not-a-number")
    assert r.code == EXIT_USAGE
    r = _train(cli, data, tmp_path / "a", ledger)
    assert r.code == EXIT_REFUSED and _one_line(r.err), r.err


def test_a_release_running_elsewhere_exits_4(tmp_path, cli, data, monkeypatch):
    from beam_dp.cli import train

    ledger = _ledger(tmp_path, cli)
    release = []
    real = train.release_id
    monkeypatch.setattr(train, "release_id", lambda *a: release.append(real(*a)) or release[-1])
    assert _train(cli, data, tmp_path / "a", ledger).code == 0   # (learns the release id)
    with core.open_ledger(ledger) as held, held.lock(release[0]):
        r = _train(cli, data, tmp_path / "b", ledger)
    assert r.code == EXIT_IN_PROGRESS and _one_line(r.err), r.err


def test_a_full_disk_at_the_output_is_temporary_and_the_retry_charges_nothing(tmp_path, cli,
                                                                             data, monkeypatch):
    """The release is committed before its output is written: a write failing for lack of space
    exits 69 (retry), and the retry writes the stored output, charging nothing new."""
    ledger = _ledger(tmp_path, cli)
    real = storage.write_bytes

    def full(path, content, tmp_dir=None):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(storage, "write_bytes", full)
    r = _train(cli, data, tmp_path / "out", ledger)
    assert r.code == EXIT_TRANSIENT and _one_line(r.err), r.err
    monkeypatch.setattr(storage, "write_bytes", real)
    r = _train(cli, data, tmp_path / "out", ledger)
    assert r.code == 0 and "already committed" in r.out, r
    with core.open_ledger(ledger) as l:
        (charge,) = l.charges("ds")
    assert charge.status == "committed"


def test_an_unreachable_or_locked_ledger_is_temporary(tmp_path, cli, data, monkeypatch):
    r = _train(cli, data, tmp_path / "a", "postgresql://beam_dp@127.0.0.1:1/ledger")
    assert r.code == EXIT_TRANSIENT and _one_line(r.err), r.err
    from beam_dp.ledger import sqlite
    ledger = _ledger(tmp_path, cli)
    monkeypatch.setattr(sqlite, "BUSY_TIMEOUT", 0.2)
    import sqlite3
    writer = sqlite3.connect(ledger, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")   # another process's long write
    try:
        r = _train(cli, data, tmp_path / "b", ledger)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert r.code == EXIT_TRANSIENT and "locked" in r.err and _one_line(r.err), r.err
    assert not (tmp_path / "b").exists()


def test_a_corrupt_checkpoint_exits_7_naming_the_file(tmp_path, cli, data):
    ledger = _ledger(tmp_path, cli)
    flags = ["--runner", "FnApiRunner", "--checkpoint-dir", str(tmp_path / "ck"),
             "--max-jobs", "1", "--steps", "6", "--steps-per-job", "2", "--algorithm", "dpgd"]
    assert _train(cli, data, tmp_path / "a", ledger, *flags).code == 75
    (state,) = Path(tmp_path / "ck").glob("*/state.npz")
    state.write_bytes(state.read_bytes()[:100])   # truncated
    r = _train(cli, data, tmp_path / "a", ledger, *flags)
    assert r.code == EXIT_CORRUPT_CHECKPOINT and _one_line(r.err), r.err
    assert str(state) in r.err and "delete" in r.err
    assert not os.path.exists(tmp_path / "a")
