"""The privacy-budget ledger (beam_dp.ledger): events, the Renyi filter, budgets, idempotent
runs, the ``beam-dp ledger`` commands, and races between processes, on SQLite and on a real
PostgreSQL server started for the session (skipped, with the reason, only if the server's
binaries or psycopg are missing)."""
from __future__ import annotations

import argparse
import glob
import json
import math
import multiprocessing
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import uuid

import numpy as np
import pytest
from dp_accounting import dp_event as ev
from dp_accounting.rdp import rdp_privacy_accountant

from beam_dp import accounting
from beam_dp.accounting import rdp_accountant
from beam_dp.algorithms.base import TrainState, checkpoint_exists, save_checkpoint
from beam_dp.ledger import (
    COMMITTED, NEW, ORDERS, RESERVED, RESUME, VOID, BudgetExceeded, LedgerError, NoBudget,
    ReleaseIdCollision, ReleaseInProgress, SchemaTooNew, commands, event_from_json,
    event_to_json, filter as rdp_filter, open_ledger, runs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------ the stores

@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL server on a unix socket in a temporary directory; yields
    (socket directory, user). initdb refuses root, so as root the server runs as the
    ``postgres`` user (runuser); stopped at the end of the session, also after failures."""
    binaries = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not binaries:
        pytest.skip("PostgreSQL server binaries not found at /usr/lib/postgresql/*/bin/initdb "
                    "(apt-get install postgresql)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install 'beam-dp[postgres]')")
    bin_dir = os.path.dirname(binaries[-1])
    as_root = os.geteuid() == 0
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
    # Under /tmp, not pytest's tmp_path: the server's user must be able to reach it.
    base = tempfile.mkdtemp(prefix="beam-dp-pg-", dir="/tmp")
    data, sockets, log = (os.path.join(base, n) for n in ("data", "sockets", "server.log"))
    os.makedirs(sockets)
    if as_root:
        shutil.chown(base, "postgres")
        shutil.chown(sockets, "postgres")
    started = False
    try:
        subprocess.run(prefix + [os.path.join(bin_dir, "initdb"), "-D", data, "-U", "postgres",
                                 "--auth=trust", "--no-sync"],
                       check=True, capture_output=True)
        result = subprocess.run(
            prefix + [os.path.join(bin_dir, "pg_ctl"), "-D", data, "-l", log, "-w", "-t", "60",
                      "-o", f"-k {sockets} -c listen_addresses='' -c fsync=off", "start"],
            capture_output=True, text=True)
        started = result.returncode == 0
        if not started:
            server_log = open(log).read() if os.path.exists(log) else ""
            pytest.fail(f"PostgreSQL did not start: {result.stderr}\n{server_log}")
        yield sockets, "postgres"
    finally:
        if started:
            subprocess.run(prefix + [os.path.join(bin_dir, "pg_ctl"), "-D", data, "-m",
                                     "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _pg_url(sockets: str, user: str, database: str) -> str:
    return f"postgresql:///{database}?host={sockets}&user={user}"


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    """A fresh, empty ledger: a SQLite file, or a new database on the session's server."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db")
    import psycopg
    sockets, user = request.getfixturevalue("postgres_server")
    name = "ledger_" + uuid.uuid4().hex[:12]
    with psycopg.connect(_pg_url(sockets, user, "postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return _pg_url(sockets, user, name)


@pytest.fixture
def ledger(url):
    with open_ledger(url) as opened:
        yield opened


# ---------------------------------------------------------------------------------- events

def _all_events() -> list:
    gaussian = ev.GaussianDpEvent(1.1)
    return [
        gaussian,
        ev.GaussianDpEvent(0.1 + 0.2),                     # a float with no short decimal
        ev.LaplaceDpEvent(2.5),
        ev.PoissonSampledDpEvent(0.005, gaussian),
        ev.SampledWithoutReplacementDpEvent(60000, 256, gaussian),
        ev.SampledWithReplacementDpEvent(1000, 10, gaussian),
        ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(0.01, gaussian), 1000),
        ev.ComposedDpEvent([ev.LaplaceDpEvent(1.0), ev.SelfComposedDpEvent(gaussian, 3)]),
        ev.ComposedDpEvent((gaussian, ev.NoOpDpEvent())),   # a tuple, not a list
        ev.ComposedDpEvent([]),
        ev.NoOpDpEvent(),
        ev.NonPrivateDpEvent(),
        ev.GaussianDpEvent(math.inf),
        ev.GaussianDpEvent(np.float64(0.7)),
        ev.SelfComposedDpEvent(gaussian, np.int64(5)),
        accounting.PureDpEvent(0.5),
        ev.ComposedDpEvent([accounting.PureDpEvent(0.25), ev.ComposedDpEvent([gaussian])]),
    ]


@pytest.mark.parametrize("event", _all_events(), ids=repr)
def test_event_json_round_trip_is_lossless(event):
    text = event_to_json(event)
    back = event_from_json(text)
    assert back == event and type(back) is type(event)
    assert event_to_json(back) == text                  # and stable
    assert json.loads(text)                             # plain JSON text
    if isinstance(event, ev.ComposedDpEvent):
        assert type(back.events) is type(event.events)  # list stays list, tuple stays tuple


def test_event_json_reads_only_known_event_types():
    with pytest.raises(ValueError, match="unknown DpEvent type"):
        event_from_json('{"type": "Popen", "args": "rm -rf /"}')
    with pytest.raises(ValueError):
        event_to_json("GaussianDpEvent(1.0)")


# --------------------------------------------------------------------------------- the filter

@pytest.mark.parametrize("event,relation", [
    (ev.GaussianDpEvent(1.3), accounting.ADD_REMOVE),
    (ev.LaplaceDpEvent(0.7), accounting.ADD_REMOVE),
    (ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(0.9)), 300),
     accounting.ADD_REMOVE),
    (ev.ComposedDpEvent([ev.LaplaceDpEvent(2.0), ev.GaussianDpEvent(4.0)]), accounting.REPLACE_ONE),
    (ev.SampledWithoutReplacementDpEvent(10000, 100, ev.GaussianDpEvent(1.0)),
     accounting.REPLACE_ONE),
])
def test_rdp_curve_is_dp_accountings(event, relation):
    """dp_accounting's RDP, of the event in its units: under replace-one its Gaussian and Laplace
    multipliers halved (``rdp_accountant._rdp_replace_one_units``: the project states them against
    the add/remove sensitivity, as dp_accounting's PLD reads them)."""
    relations = {accounting.ADD_REMOVE: rdp_privacy_accountant.NeighborRel.ADD_OR_REMOVE_ONE,
                 accounting.REPLACE_ONE: rdp_privacy_accountant.NeighborRel.REPLACE_ONE}
    theirs = rdp_privacy_accountant.RdpAccountant(list(ORDERS), relations[relation])
    units = rdp_accountant._rdp_replace_one_units(event) if relation == accounting.REPLACE_ONE else event
    curve = rdp_filter.rdp_curve(event, relation)
    np.testing.assert_array_equal(curve[:-1], theirs.compose(units).rdp)
    assert curve[-1] == 0.0   # (the delta of (epsilon, delta) releases: none here)


def test_rdp_curve_of_a_pure_dp_event_and_of_unsupported_events():
    curve = rdp_filter.rdp_curve(accounting.PureDpEvent(0.5), "add_remove")
    orders = np.array(ORDERS)
    np.testing.assert_allclose(curve[:-1], np.minimum(0.5, orders * 0.5 ** 2 / 2))
    with pytest.raises(ValueError, match="cannot account"):
        rdp_filter.rdp_curve(ev.PoissonSampledDpEvent(0.1, ev.LaplaceDpEvent(1.0)), "add_remove")
    with pytest.raises(ValueError, match="unknown neighbouring relation"):
        rdp_filter.rdp_curve(ev.GaussianDpEvent(1.0), "swap")


def _admitted_by_theorem(one_run_rdp, epsilon, delta, per_order_delta) -> int:
    """k identical runs are admitted iff min over orders of dp_accounting's conversion of
    k * rdp at delta / len(ORDERS) is <= epsilon (filter.py's theorem), counted here from
    dp_accounting directly."""
    k = 0
    while rdp_privacy_accountant.compute_epsilon(
            list(ORDERS), (k + 1) * one_run_rdp, per_order_delta)[0] <= epsilon:
        k += 1
    return k


def test_filter_admits_exactly_as_many_runs_as_the_theorem_allows(ledger):
    sigma, epsilon, delta = 6.0, 2.5, 1e-6
    event = ev.GaussianDpEvent(sigma)
    one = rdp_privacy_accountant.RdpAccountant(list(ORDERS)).compose(event).rdp
    expected = _admitted_by_theorem(one, epsilon, delta, delta / len(ORDERS))
    # The test can tell the filter from its usual mistakes: the whole delta at every order,
    # and adding up epsilons.
    assert expected != _admitted_by_theorem(one, epsilon, delta, delta)
    assert expected != int(epsilon // rdp_privacy_accountant.RdpAccountant(
        list(ORDERS)).compose(event).get_epsilon(delta))
    ledger.set_budget("d", epsilon, delta)
    admitted = 0
    with pytest.raises(BudgetExceeded):
        for i in range(50):
            assert ledger.reserve(f"run-{i}", "d", ["p"], event).status == NEW
            ledger.commit(f"run-{i}", {"i": i})
            admitted += 1
    assert admitted == expected == 7
    x = ledger.explain("d", "p")
    np.testing.assert_allclose(x.spent_rdp, expected * one, rtol=1e-12)
    assert x.spent_epsilon <= epsilon < rdp_privacy_accountant.compute_epsilon(
        list(ORDERS), (expected + 1) * one, delta / len(ORDERS))[0]
    assert x.committed == expected and x.reserved == 0
    assert x.best_order in ORDERS and x.spent_epsilon == pytest.approx(min(x.order_epsilons))


def test_refusal_names_dataset_partition_and_remaining_budget(ledger):
    ledger.set_budget("clicks", 1.0, 1e-6)
    ledger.reserve("a", "clicks", ["2026-11-23"], ev.GaussianDpEvent(8.0))
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("b", "clicks", ["2026-11-23"], ev.GaussianDpEvent(1.0))
    message = str(refused.value)
    spent = ledger.explain("clicks", "2026-11-23").spent_epsilon
    assert "'clicks'" in message and "'2026-11-23'" in message and "'b'" in message
    assert f"already spent epsilon={spent:.4g} of 1 at delta=1e-06" in message
    assert f"remaining {1.0 - spent:.4g}" in message
    assert refused.value.partition == "2026-11-23" and refused.value.spent_epsilon == spent
    assert ledger.charge("b") is None                   # nothing charged
    with pytest.raises(NoBudget, match="no budget is declared for dataset 'other'"):
        ledger.reserve("c", "other", ["p"], ev.GaussianDpEvent(8.0))


def test_budget_changes_are_deliberate_and_never_below_what_is_spent(ledger):
    ledger.set_budget("d", 2.0, 1e-6)
    ledger.set_budget("d", 2.0, 1e-6)                   # the same again: fine
    with pytest.raises(LedgerError, match="replace=True"):
        ledger.set_budget("d", 3.0, 1e-6)
    assert ledger.budget("d").epsilon == 2.0
    assert ledger.set_budget("d", 3.0, 1e-6, replace=True).epsilon == 3.0
    ledger.reserve("r", "d", ["p"], ev.GaussianDpEvent(2.0))
    spent = ledger.explain("d", "p").spent_epsilon
    with pytest.raises(LedgerError, match="below what is spent"):
        ledger.set_budget("d", spent * 0.9, 1e-6, replace=True)
    ledger.set_budget("d", spent * 1.1, 1e-6, replace=True)
    with pytest.raises(LedgerError, match="below what is spent"):   # a partition's own, too
        ledger.set_budget("d", spent * 0.5, 1e-6, partition="p", replace=True)
    # Runs on "p" were admitted under the dataset's default: a budget of its own is a change
    # of that budget (found in review: it raised a partition's budget without replace=True).
    with pytest.raises(LedgerError, match="replace=True"):
        ledger.set_budget("d", 10.0, 1e-6, partition="p")
    assert ledger.budget("d", "p").epsilon == spent * 1.1
    for bad in [(0.0, 1e-6), (-1.0, 1e-6), (math.inf, 1e-6), (1.0, 0.0), (1.0, 1.0)]:
        with pytest.raises(LedgerError):
            ledger.set_budget("e", *bad)


def test_the_same_release_never_charges_twice(ledger):
    ledger.set_budget("d", 4.0, 1e-6)
    event = ev.GaussianDpEvent(3.0)
    first = ledger.reserve("rel", "d", ["p"], event, orchestrator={"dag": "train"})
    assert first.status == NEW and first.charge.status == RESERVED
    spent = ledger.explain("d", "p").spent_rdp
    # The run died after reserving: the rerun resumes, charged once.
    again = ledger.reserve("rel", "d", ["p"], event, orchestrator={"dag": "train", "try": "2"})
    assert again.status == RESUME and ledger.explain("d", "p").spent_rdp == spent
    ledger.commit("rel", b"\x00model bytes")
    done = ledger.reserve("rel", "d", ["p"], event)
    assert done.status == COMMITTED and done.output == b"\x00model bytes"
    assert ledger.explain("d", "p").spent_rdp == spent
    ledger.commit("rel", b"\x00model bytes")             # committing the same again: no-op
    with pytest.raises(LedgerError, match="different output"):
        ledger.commit("rel", b"another model")
    with pytest.raises(LedgerError, match="committed"):
        ledger.void("rel")
    assert len(ledger.charges("d")) == 1


def test_a_release_id_names_one_run(ledger):
    ledger.set_budget("d", 4.0, 1e-6)
    ledger.set_budget("e", 4.0, 1e-6)
    ledger.reserve("rel", "d", ["p", "q"], ev.GaussianDpEvent(3.0))
    for other in [("d", ["p", "q"], ev.GaussianDpEvent(3.5)),
                  ("d", ["p"], ev.GaussianDpEvent(3.0)),
                  ("e", ["p", "q"], ev.GaussianDpEvent(3.0))]:
        with pytest.raises(ReleaseIdCollision, match="'rel'.*bug"):
            ledger.reserve("rel", *other)
    # The order partitions are listed in does not make another run.
    assert ledger.reserve("rel", "d", ["q", "p"], ev.GaussianDpEvent(3.0)).status == RESUME


def test_void_gives_budget_back_and_a_voided_release_can_run_again(ledger):
    ledger.set_budget("d", 4.0, 1e-6)
    ledger.reserve("rel", "d", ["p"], ev.GaussianDpEvent(3.0))
    assert ledger.void("rel").status == VOID
    assert ledger.explain("d", "p").spent_epsilon == 0.0
    assert [c.status for c in ledger.charges("d")] == [VOID]     # kept, not deleted
    assert ledger.reserve("rel", "d", ["p"], ev.GaussianDpEvent(3.0)).status == NEW
    assert ledger.explain("d", "p").spent_epsilon > 0.0
    with pytest.raises(LedgerError, match="no charge"):
        ledger.void("nothing")


def test_a_run_charges_every_partition_it_reads_and_no_other(ledger):
    ledger.set_budget("d", 3.0, 1e-6)                          # default of every partition
    ledger.set_budget("d", 1.0, 1e-6, partition="small")
    event = ev.GaussianDpEvent(4.0)
    one = rdp_filter.rdp_curve(event, accounting.ADD_REMOVE)[:-1]
    ledger.reserve("two-days", "d", ["2026-11-23", "2026-11-24"], event)
    for day in ("2026-11-23", "2026-11-24"):
        np.testing.assert_array_equal(ledger.explain("d", day).spent_rdp, one)
    assert ledger.explain("d", "2026-11-25").spent_epsilon == 0.0
    assert ledger.budget("d", "2026-11-25").epsilon == 3.0     # a new partition: the default
    assert ledger.budget("d", "small").epsilon == 1.0
    ledger.reserve("one-day", "d", ["2026-11-24"], event)
    np.testing.assert_array_equal(ledger.explain("d", "2026-11-23").spent_rdp, one)
    np.testing.assert_array_equal(ledger.explain("d", "2026-11-24").spent_rdp, 2 * one)
    # Refused by one partition's budget: nothing is charged anywhere.
    with pytest.raises(BudgetExceeded, match="partition 'small'"):
        ledger.reserve("wide", "d", ["2026-11-25", "small"], ev.GaussianDpEvent(2.5))
    assert ledger.explain("d", "2026-11-25").spent_epsilon == 0.0
    assert ledger.partitions("d") == ["2026-11-23", "2026-11-24", "small"]


def test_unpartitioned_datasets_and_one_unit_of_privacy_per_dataset(ledger):
    ledger.set_budget("whole", 2.0, 1e-6)
    assert ledger.reserve("w1", "whole", None, ev.GaussianDpEvent(4.0)).status == NEW
    assert ledger.reserve("w2", "whole", [], ev.GaussianDpEvent(4.0)).status == NEW
    assert ledger.explain("whole").committed + ledger.explain("whole").reserved == 2
    with pytest.raises(LedgerError, match="unpartitioned"):
        ledger.reserve("w3", "whole", ["p"], ev.GaussianDpEvent(4.0))
    with pytest.raises(LedgerError, match="one neighbouring relation"):
        ledger.reserve("w4", "whole", None, ev.GaussianDpEvent(4.0), neighbouring="replace_one")
    ledger.set_budget("rep", 2.0, 1e-6)
    # (a replace-one Gaussian of multiplier m costs about what an add/remove one of m / 2 does)
    charge = ledger.reserve("r1", "rep", None, ev.GaussianDpEvent(8.0), "replace_one").charge
    assert charge.neighbouring == accounting.REPLACE_ONE
    np.testing.assert_array_equal(
        charge.rdp, rdp_filter.rdp_curve(ev.GaussianDpEvent(8.0), accounting.REPLACE_ONE))


def test_run_context_manager(ledger):
    ledger.set_budget("d", 4.0, 1e-6)
    event = ev.GaussianDpEvent(3.0)
    with ledger.run("rel", "d", ["p"], event, orchestrator={"k8s_job": "train-1"}) as run:
        assert run.status == NEW
        with pytest.raises(ReleaseInProgress, match="'rel' is already running"):
            with ledger.run("rel", "d", ["p"], event):
                pass
        run.commit({"coefficients": [1.0, 2.0]})
        assert run.status == COMMITTED
    with ledger.run("rel", "d", ["p"], event) as run:
        assert run.status == COMMITTED and run.output == {"coefficients": [1.0, 2.0]}
    # A run that fails leaves its charge reserved; the next one resumes it.
    with pytest.raises(RuntimeError):
        with ledger.run("crash", "d", ["p"], event):
            raise RuntimeError("worker lost")
    with ledger.run("crash", "d", ["p"], event) as run:
        assert run.status == RESUME
        run.void()
    assert ledger.charge("crash").status == VOID
    assert ledger.charge("rel").orchestrator == {"k8s_job": "train-1"}


def test_schema_is_versioned(url):
    open_ledger(url).close()
    if url.startswith("postgresql"):
        import psycopg
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    else:
        with sqlite3.connect(url) as conn:
            conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(SchemaTooNew, match="schema version 99, newer than this beam-dp"):
        open_ledger(url)


def test_open_ledger_urls(tmp_path):
    with open_ledger(f"sqlite:///{tmp_path}/a.db") as ledger:
        ledger.set_budget("d", 1.0, 1e-6)
    with open_ledger(str(tmp_path / "a.db")) as ledger:
        assert ledger.budget("d").epsilon == 1.0
    for bad in ["mysql://host/db", ":memory:", f"{tmp_path}/missing/a.db"]:
        with pytest.raises(LedgerError):
            open_ledger(bad)


# -------------------------------------------------------------------------------- commands

def _cli(capsys, *argv):
    parser = argparse.ArgumentParser(prog="beam-dp")
    commands.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    capsys.readouterr()
    code = commands.run(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_ledger_commands(url, capsys):
    code, out, _ = _cli(capsys, "ledger", "budget", "--ledger", url, "--dataset-id", "clicks",
                        "--epsilon", 4, "--delta", 1e-6)
    assert code == 0 and "epsilon=4, delta=1e-06" in out
    code, _, err = _cli(capsys, "ledger", "budget", "--ledger", url, "--dataset-id", "clicks",
                        "--epsilon", 5, "--delta", 1e-6)
    assert code == 2 and "--replace" in err   # a usage error: exit 2, as every CLI error
    assert _cli(capsys, "ledger", "budget", "--ledger", url, "--dataset-id", "clicks",
                "--partition", "2026-11-24", "--epsilon", 2, "--delta", 1e-6)[0] == 0
    with open_ledger(url) as ledger:
        ledger.reserve("run-a", "clicks", ["2026-11-23"], ev.GaussianDpEvent(3.0),
                       orchestrator={"dag_id": "train", "run_id": "scheduled-1"})
        ledger.commit("run-a", {"model": 1})
        ledger.reserve("run-b", "clicks", ["2026-11-23", "2026-11-24"], ev.GaussianDpEvent(6.0))
        spent = ledger.explain("clicks", "2026-11-23").spent_epsilon
    code, out, _ = _cli(capsys, "ledger", "show", "--ledger", url)
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("release id"))
    row = next(line for line in lines if line.startswith("run-a"))
    assert row.index("committed") == header.index("status")              # aligned columns
    assert "dag_id=train, run_id=scheduled-1" in row
    assert any(line.startswith("run-b") and "2026-11-23,2026-11-24" in line and "reserved" in line
               for line in lines)
    partition_row = next(line for line in lines if line.startswith("clicks   2026-11-23"))
    assert f"{spent:.4g}" in partition_row and f"{4 - spent:.4g}" in partition_row
    code, out, _ = _cli(capsys, "ledger", "explain", "--ledger", url, "--dataset-id", "clicks",
                        "--partition", "2026-11-23")
    assert code == 0
    assert "lifetime budget   epsilon=4, delta=1e-06 (the dataset's default)" in out
    assert "1 committed, 1 reserved" in out and f"epsilon={spent:.4g} at delta=1e-06" in out
    assert out.count("\n* ") + out.count("  * ") == 1                      # the best order
    assert "Why this is valid" in out and "Feldman & Zrnic" in out
    code, out, _ = _cli(capsys, "ledger", "explain", "--ledger", url, "--dataset-id", "clicks")
    assert code == 0 and "partition '2026-11-23'" in out and "partition '2026-11-24'" in out


# ------------------------------------------------------------ a charge's history, and voiding it

def _history(ledger, release_id) -> list[tuple]:
    return [(row["action"], row["detail"]) for row in ledger.history(release_id)]


def _column(lines: list[str], header_start: str, row_start: str, column: str) -> str:
    """The cell of ``column`` in the row starting with ``row_start`` of an aligned table."""
    header = next(line for line in lines if line.startswith(header_start))
    row = next(line for line in lines if line.startswith(row_start))
    start = header.index(column)
    return row[start:].split("  ")[0].strip()


def test_history_after_reserve_extend_and_commit(ledger, url, capsys):   # SQLite and PostgreSQL
    ledger.set_budget("d", 8.0, 1e-6)
    count = ev.GaussianDpEvent(20.0)
    ledger.reserve("rel", "d", ["q", "p"], count, orchestrator={"dag_id": "train"})
    ledger.extend("rel", ev.ComposedDpEvent([count, ev.GaussianDpEvent(6.0)]))
    ledger.extend("rel", count)                       # nothing above the charge: no change
    with pytest.raises(BudgetExceeded):               # refused: rolled back, its row too
        ledger.extend("rel", ev.GaussianDpEvent(0.1))
    ledger.commit("rel", {"model": 1})
    ledger.commit("rel", {"model": 1})                # the same again: no change
    assert _history(ledger, "rel") == [
        ("reserved", {"partitions": ["p", "q"], "orchestrator": {"dag_id": "train"}}),
        ("extended", {"starts_over": False}),
        ("committed", {"with_output": True})]
    charge, history = ledger.charge("rel"), ledger.history("rel")
    assert (history[0]["at"], history[-1]["at"]) == (charge.reserved_at, charge.committed_at)
    assert history[0]["at"] < history[1]["at"] < history[2]["at"]

    code, out, err = _cli(capsys, "ledger", "history", "--ledger", url, "--release-id", "rel")
    assert code == 0, err
    lines = out.splitlines()
    for expected in ("release id     rel", "dataset        d", "partitions     p,q",
                     "status         committed", f"neighbouring   {accounting.ADD_REMOVE}",
                     "orchestrator   dag_id=train"):
        assert expected in lines, expected
    # The charge's epsilon as `ledger show` reads it.
    shown = _column(_cli(capsys, "ledger", "show", "--ledger", url)[1].splitlines(),
                    "release id", "rel ", "epsilon")
    assert f"epsilon        {shown} (the run alone" in out
    assert _column(lines, "at  ", "20", "action") == "reserved"            # aligned columns
    assert _column(lines, "at  ", history[1]["at"], "detail") == "starts_over=false"
    assert _column(lines, "at  ", history[2]["at"], "detail") == "with_output=true"

    code, out, err = _cli(capsys, "ledger", "history", "--ledger", url, "--release-id", "nothing")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "no charge with release id 'nothing'" in err


def test_history_of_a_voided_then_re_reserved_release(tmp_path):
    with open_ledger(str(tmp_path / "ledger.db")) as ledger:
        ledger.set_budget("d", 8.0, 1e-6)
        event = ev.GaussianDpEvent(8.0)
        ledger.reserve("rel", "d", None, event, orchestrator={"try": "1"})
        ledger.void("rel")
        ledger.void("rel")                                     # already void: no change
        ledger.reserve("rel", "d", None, event, orchestrator={"try": "2"})
        assert ledger.reserve("rel", "d", None, event).status == RESUME    # no change
        # An attempt that starts over without the earlier one's checkpoint, then is refused
        # after its first releases (committed without output to keep them charged).
        ledger.extend("rel", ev.LaplaceDpEvent(2.0), base=event)
        ledger.commit("rel", None)
        assert _history(ledger, "rel") == [
            ("reserved", {"partitions": None, "orchestrator": {"try": "1"}}),
            ("voided", {"by": "run"}),
            ("re-reserved", {"partitions": None, "orchestrator": {"try": "2"}}),
            ("extended", {"starts_over": True}),
            ("committed", {"with_output": False})]
        with pytest.raises(LedgerError, match="voided by one of run, operator"):
            ledger.void("rel", by="someone")


def test_history_of_charges_from_before_the_history_table(tmp_path, capsys):
    url = str(tmp_path / "ledger.db")
    with open_ledger(url) as ledger:
        ledger.set_budget("d", 8.0, 1e-6)
        event = ev.GaussianDpEvent(8.0)
        ledger.reserve("old", "d", ["p"], event)
        ledger.commit("old", {"model": 1})
        ledger.reserve("gone", "d", ["p"], event)
        ledger.void("gone")
        ledger.reserve("half", "d", ["p"], event)
    connection = sqlite3.connect(url)   # the ledger as an older beam-dp wrote it
    connection.execute("DROP TABLE charge_history")
    connection.commit()
    connection.close()
    with open_ledger(url) as ledger:    # gains the table on open, its schema version unchanged
        ledger.commit("half", {"model": 2})
        old, gone, half = (ledger.charge(r) for r in ("old", "gone", "half"))
        timestamps = {"from": "charge timestamps"}
        assert ledger.history("old") == [
            {"at": old.reserved_at, "action": "reserved", "detail": timestamps},
            {"at": old.committed_at, "action": "committed", "detail": timestamps}]
        assert _history(ledger, "gone") == [("reserved", timestamps), ("voided", timestamps)]
        assert ledger.history("gone")[1]["at"] == gone.voided_at
        assert _history(ledger, "half") == [("reserved", timestamps),
                                            ("committed", {"with_output": True})]
        assert ledger.history("half")[0]["at"] == half.reserved_at
    code, out, _ = _cli(capsys, "ledger", "history", "--ledger", url, "--release-id", "old")
    assert code == 0 and out.count("from=charge timestamps") == 2


def _reserve_checkpointed(ledger, release_id, directory, event=ev.GaussianDpEvent(8.0)):
    """A reservation as ``runs.RunCharge`` makes it for a run with --checkpoint-dir."""
    return ledger.reserve(release_id, "d", ["p"], event,
                          orchestrator={runs.CHECKPOINT_KEY: str(directory), "dag_id": "train"})


def _void_command(capsys, url, release_id):
    return _cli(capsys, "ledger", "void", "--ledger", url, "--release-id", release_id)


def _refused(result, reason: str) -> None:
    code, out, err = result
    assert (code, out) == (2, "") and err.count("\n") == 1 and reason in err, result


def test_void_refuses_committed_charges_and_charges_without_a_checkpoint_dir(tmp_path, capsys):
    url = str(tmp_path / "ledger.db")
    with open_ledger(url) as ledger:
        ledger.set_budget("d", 8.0, 1e-6)
        _reserve_checkpointed(ledger, "done", tmp_path / "checkpoints" / "done")
        ledger.commit("done", {"model": 1})
        ledger.reserve("no-dir", "d", ["p"], ev.GaussianDpEvent(8.0),
                       orchestrator={"dag_id": "train"})
        ledger.reserve("gone", "d", ["p"], ev.GaussianDpEvent(8.0))
        ledger.void("gone")
    _refused(_void_command(capsys, url, "done"), "committed; what was released stays spent")
    _refused(_void_command(capsys, url, "no-dir"),
             "recorded no checkpoint directory (its run had no --checkpoint-dir), so the ledger "
             "cannot tell whether it released anything")
    _refused(_void_command(capsys, url, "nothing"), "no charge with release id 'nothing'")
    code, out, _ = _void_command(capsys, url, "gone")
    assert code == 0 and out.startswith("release gone is already void")
    with open_ledger(url) as ledger:
        assert [ledger.charge(r).status for r in ("done", "no-dir")] == [COMMITTED, RESERVED]
        assert _history(ledger, "gone")[-1] == ("voided", {"by": "run"})   # not again


def test_void_refuses_when_the_checkpoint_exists_or_an_attempt_started_over(tmp_path, capsys):
    url = str(tmp_path / "ledger.db")
    saved, elsewhere, old = (tmp_path / "checkpoints" / name for name in ("saved", "else", "old"))
    with open_ledger(url) as ledger:
        ledger.set_budget("d", 8.0, 1e-6)
        _reserve_checkpointed(ledger, "saved", saved)
        _reserve_checkpointed(ledger, "elsewhere", elsewhere)
        # A later attempt without that checkpoint directory: charged on top, its state not there.
        ledger.extend("elsewhere", ev.GaussianDpEvent(9.0), base=ev.GaussianDpEvent(8.0))
        _reserve_checkpointed(ledger, "old", old)
    # The run saved its plan: the project's own checkpoint, as a run writes it.
    save_checkpoint(str(saved), TrainState.zeros(1, 2), {"algorithm": "dpgd"}, {"steps": 3})
    assert checkpoint_exists(str(saved))
    _refused(_void_command(capsys, url, "saved"), f"saved a checkpoint in {saved}")
    _refused(_void_command(capsys, url, "elsewhere"),
             f"started over without the checkpoint in {elsewhere}")
    connection = sqlite3.connect(url)   # "old" as reserved by a beam-dp without histories
    connection.execute("DELETE FROM charge_history WHERE release_id = 'old'")
    connection.commit()
    connection.close()
    _refused(_void_command(capsys, url, "old"), "reserved before the ledger kept charge histories")
    with open_ledger(url) as ledger:
        assert {c.status for c in ledger.charges("d")} == {RESERVED}


def _hold_release_lock(url, release_id, locked, done) -> None:
    """In a forked process: holds the release's lock, as a live run does, until told."""
    with open_ledger(url) as ledger, ledger.lock(release_id):
        locked.set()
        done.wait(60)


def test_void_refuses_while_another_process_runs_the_release(tmp_path, capsys):
    url = str(tmp_path / "ledger.db")
    with open_ledger(url) as ledger:
        ledger.set_budget("d", 8.0, 1e-6)
        _reserve_checkpointed(ledger, "rel", tmp_path / "checkpoints" / "rel")
    fork = multiprocessing.get_context("fork")   # (no import of beam_dp again: fast)
    locked, done = fork.Event(), fork.Event()
    holder = fork.Process(target=_hold_release_lock, args=(url, "rel", locked, done))
    holder.start()
    try:
        assert locked.wait(30)
        _refused(_void_command(capsys, url, "rel"), "'rel' is running in another process")
        with open_ledger(url) as ledger:
            assert ledger.charge("rel").status == RESERVED
    finally:
        done.set()
        holder.join(30)
    assert holder.exitcode == 0
    assert _void_command(capsys, url, "rel")[0] == 0    # its lock went with it


def test_void_gives_back_the_budget_of_a_run_that_saved_no_checkpoint(tmp_path, capsys):
    url = str(tmp_path / "ledger.db")
    directory = tmp_path / "checkpoints" / "rel"
    directory.mkdir(parents=True)                     # there, but no checkpoint in it
    with open_ledger(url) as ledger:
        ledger.set_budget("d", 4.0, 1e-6)
        _reserve_checkpointed(ledger, "rel", directory, ev.GaussianDpEvent(6.0))
        ledger.extend("rel", ev.GaussianDpEvent(5.0))   # the same attempt: its state goes there
        assert ledger.explain("d", "p").remaining_epsilon < 4.0
    code, out, err = _void_command(capsys, url, "rel")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "voided release rel (its run released nothing): its budget is given back"
    assert "status         void" in lines
    assert _column(lines, "dataset  partition", "d  ", "remaining") == "4"
    with open_ledger(url) as ledger:
        assert ledger.charge("rel").status == VOID
        assert ledger.explain("d", "p").remaining_epsilon == 4.0
        assert _history(ledger, "rel")[-1] == ("voided", {"by": "operator"})
    code, out, _ = _void_command(capsys, url, "rel")
    assert code == 0 and out.startswith("release rel is already void")


# ------------------------------------------------------------------ races between processes

# A process of its own: opens the ledger, waits for the start signal (so that all of them
# race at once, imports done), then reserves (through ``run`` or ``reserve``) and commits.
_WORKER = textwrap.dedent("""
    import os, sys, time
    from dp_accounting import dp_event
    from beam_dp.ledger import open_ledger, BudgetExceeded, ReleaseInProgress
    url, release_id, go, mode, hold = sys.argv[1:6]
    ledger = open_ledger(url)
    event = dp_event.GaussianDpEvent(5.0)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.002)
    try:
        if mode == "run":
            with ledger.run(release_id, "d", ["p"], event) as run:
                status = run.status
                if status == "new":
                    time.sleep(float(hold))
                    run.commit({"by": os.getpid()})
        elif mode == "hold":
            with ledger.run(release_id, "d", ["p"], event) as run:
                print("locked", run.status, flush=True)
                time.sleep(600)
        else:
            status = ledger.reserve(release_id, "d", ["p"], event).status
            if status == "new":
                ledger.commit(release_id, {"by": os.getpid()})
    except BudgetExceeded:
        status = "refused"
    except ReleaseInProgress:
        status = "in-progress"
    print(status, flush=True)
""")


def _race(url, tmp_path, release_ids, mode="reserve", hold=0.0) -> list[str]:
    go = str(tmp_path / f"go-{uuid.uuid4().hex}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, url, rid, go, mode, str(hold)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for rid in release_ids]
    try:
        for worker in workers:   # every one has imported and opened the ledger: start
            assert worker.stdout.readline().strip() == "ready", worker.communicate()[1]
        open(go, "w").close()
        results = []
        for worker in workers:
            out, err = worker.communicate(timeout=120)
            assert worker.returncode == 0, err
            results.append(out.strip().splitlines()[-1])
        return results
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()


@pytest.mark.slow   # 8 processes, each importing beam_dp: ~10 s on 2 cores
def test_racing_runs_never_overspend(url, tmp_path):
    with open_ledger(url) as ledger:
        ledger.set_budget("d", 1.8, 1e-5)
        one = rdp_filter.rdp_curve(ev.GaussianDpEvent(5.0), accounting.ADD_REMOVE)[:-1]
    assert _admitted_by_theorem(one, 1.8, 1e-5, 1e-5 / len(ORDERS)) == 3
    results = _race(url, tmp_path, [f"run-{i}" for i in range(8)])
    assert sorted(results) == ["new"] * 3 + ["refused"] * 5
    with open_ledger(url) as ledger:
        charges = ledger.charges("d")
        assert [c.status for c in charges] == [COMMITTED] * 3
        assert ledger.explain("d", "p").spent_epsilon <= 1.8


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["run", "reserve"])
def test_racing_the_same_release_charges_once(url, tmp_path, mode):
    with open_ledger(url) as ledger:
        ledger.set_budget("d", 10.0, 1e-5)
    # "run": the per-release lock, held while the winner "trains" for a second: the other
    # fails fast (or, if it came later, finds the release committed). "reserve": no lock, and
    # still one charge: the loser is told to resume or that it is committed.
    results = _race(url, tmp_path, ["same", "same"], mode=mode, hold=1.0)
    assert results.count("new") == 1
    other = next(r for r in results if r != "new")
    assert other in (("in-progress", "committed") if mode == "run" else ("resume", "committed"))
    with open_ledger(url) as ledger:
        assert [(c.release_id, c.status) for c in ledger.charges("d")] == [("same", COMMITTED)]


@pytest.mark.slow
def test_a_killed_run_frees_its_release(url, tmp_path):
    with open_ledger(url) as ledger:
        ledger.set_budget("d", 10.0, 1e-5)
    go = str(tmp_path / "go")
    open(go, "w").close()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, url, "rel", go, "hold", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert worker.stdout.readline().strip() == "ready"
        assert worker.stdout.readline().split() == ["locked", "new"]
        with open_ledger(url) as ledger:
            event = ev.GaussianDpEvent(5.0)
            with pytest.raises(ReleaseInProgress):
                with ledger.run("rel", "d", ["p"], event, wait=0.2):
                    pass
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=30)
            with ledger.run("rel", "d", ["p"], event, wait=30) as run:
                assert run.status == RESUME                     # charged once, resumed
            assert len(ledger.charges("d")) == 1
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.communicate()


# ------------------------------------------------------------------- runs racing for a budget

@pytest.mark.slow
def test_of_5_runs_racing_for_a_budget_that_admits_2_the_others_charge_nothing(url, tmp_path):
    """5 `beam-dp train` processes (each its own release: its own seed) start together on a
    partition whose budget admits two runs of epsilon 1 (the filter reads 1.28 for one, 1.85
    for two, 2.28 for three: budget 2). Admission is one run at a time up to its plan
    (``Ledger.admission``), each pre-checked against what the runs before it reserved: exactly
    2 charges, both committed; the other 3 are refused before reading data (exit 3), nothing
    charged. Before, each made and paid for its count first. (5 processes, not 8: on CI's two
    cores they start within the same second either way, and each costs ~3 s of imports.)"""
    beam_dp = os.path.join(os.path.dirname(sys.executable), "beam-dp")
    subprocess.run([beam_dp, "make-data", "--output", str(tmp_path / "data"), "--n", "400",
                    "--d", "2", "--validation-n", "0"], check=True, capture_output=True)
    with open_ledger(url) as ledger:
        ledger.set_budget("ds", 2.0, 1e-5)
    runs = [subprocess.Popen([beam_dp, "train", "--input", str(tmp_path / "data" / "train-*"),
                              "--output", str(tmp_path / f"out{k}"), "--epsilon", "1",
                              "--ledger", url, "--dataset-id", "ds", "--seed", str(k),
                              "--runner", "local"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for k in range(5)]
    results = [(run.wait(timeout=600), run.stderr.read()) for run in runs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 0] + [3] * 3, results
    assert all("before reading any data" in err for code, err in results if code == 3), results
    with open_ledger(url) as ledger:
        charges = ledger.charges("ds")
    assert sorted(c.status for c in charges) == ["committed", "committed"], charges
