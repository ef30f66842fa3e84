"""The accountant's work is bounded (issue 8, items 6, 8 and 11).

* Item 11: calibrating to epsilon 1e3 or 1e6 used to die with MemoryError or take 23 GB; item 6:
  reporting the epsilon of a run with noise multiplier 0.05-0.3 (after every chunk, as the driver
  does) took gigabytes. Both run here in a subprocess whose address space is capped at 1.5 GB,
  and must finish (or refuse with a clear ValueError).
* A coarser PLD discretization is still a valid, pessimistic upper bound: never below the fine
  grid's epsilon, and barely above it.
* ``Ledger.progress_epsilon``: a cheap upper bound on the epsilon spent so far for progress
  output, one PLD per run instead of one per chunk.
* Item 8: dp_accounting's RDP "failed to converge" messages no longer reach the output where RDP
  only brackets the PLD search; where RDP is the reporting accountant, the ledger says in words
  what they mean.
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import warnings

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event as ev
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from beam_dp import accounting
from beam_dp.accounting import pld_accountant

import dp_accounting_reference as reference

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
ADDRESS_SPACE = int(1.5 * 2**30)

# The setting: 20,000 rows, expected batch 256, 5 epochs, a 1% Laplace count.
Q = 256 / 20000
STEPS = math.ceil(5 / Q)
CHUNK = 25

_SCRIPT = textwrap.dedent("""
    import json, math, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    from dp_accounting import dp_event as ev
    from beam_dp import accounting

    q, steps, chunk, delta = {q}, {steps}, {chunk}, 1e-5
    results = []

    def record(name, run):
        start = time.time()
        try:
            value, error = run(), None
        except ValueError as e:    # a clear refusal is acceptable; anything else is not
            value, error = None, str(e)
        results.append(dict(name=name, value=value, error=error, seconds=time.time() - start))

    def dpsgd(epsilon):
        count = accounting.laplace_count_event(0.01 * epsilon)
        return lambda s: ev.ComposedDpEvent([count, accounting.gaussian_steps_event(s, q, steps)])

    def dpgd(epsilon):
        count = accounting.laplace_count_event(0.01 * epsilon)
        return lambda s: ev.ComposedDpEvent([count, accounting.gaussian_steps_event(s, 1.0, 100)])

    def ssp(epsilon):
        return lambda s: ev.SelfComposedDpEvent(ev.GaussianDpEvent(s), 3)

    for epsilon in (1e3, 1e6):
        for kind, make in {kinds}:
            for accountant in {accountants}:
                make_event = make(epsilon)
                def run(make_event=make_event, epsilon=epsilon, accountant=accountant):
                    sigma = accounting.calibrate_noise_multiplier(make_event, epsilon, delta, accountant)
                    return [sigma, accounting.epsilon_of(make_event(sigma), delta, accountant)]
                record(f"calibrate {{kind}} epsilon={{epsilon:g}} {{accountant}}", run)
    for sigma in {sigmas}:
        # The driver today: the ledger's epsilon after every chunk of steps.
        def run(sigma=sigma):
            ledger = accounting.Ledger("pld")
            ledger.record("count", accounting.laplace_count_event(0.01))
            step = ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma))
            for done in range(0, steps, chunk):
                ledger.record("steps", step, min(chunk, steps - done))
                epsilon = ledger.epsilon(delta)
            return epsilon
        record(f"noise multiplier {{sigma}}: epsilon after every chunk", run)
    rusage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps(dict(results=results, max_rss_mb=rusage.ru_maxrss / 1024)))
""")


def _run_limited(kinds, accountants, sigmas):
    script = _SCRIPT.format(limit=ADDRESS_SPACE, q=Q, steps=STEPS, chunk=CHUNK, kinds=kinds,
                            accountants=accountants, sigmas=sigmas)
    # One BLAS thread: its per-thread buffers would otherwise eat into the address-space cap.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, f"ran out of memory or crashed:\n{done.stderr[-2000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # Resident memory, the python + numpy + dp_accounting baseline (~150 MB) included.
    assert report["max_rss_mb"] < 1024, report
    for r in report["results"]:
        if r["error"] is not None:
            assert "epsilon" in r["error"] or "noise" in r["error"], r
            continue
        if r["name"].startswith("calibrate"):
            sigma, epsilon = r["value"]
            target = float(r["name"].split("epsilon=")[1].split()[0])
            # Within the budget, and not wastefully far below it.
            assert sigma > 0 and 0.9 * target <= epsilon <= target, r
        else:
            assert math.isfinite(r["value"]) and r["value"] > 0, r
    # The figures, for the record (pytest -s shows them): seconds per item.
    print({r["name"]: round(r["seconds"], 2) for r in report["results"]}, report["max_rss_mb"])


@pytest.mark.slow
def test_large_epsilon_every_release_shape_and_accountant_within_bounded_memory():
    # The cases: DP-SGD calibrated to epsilon 1e3 and 1e6; noise multipliers 0.05 and
    # 0.1 with the epsilon recomputed after every chunk (before: MemoryError under the cap), and
    # the same for every release shape and accountant. (Slow: a minute; one subprocess for all.)
    _run_limited('(("dpsgd", dpsgd), ("dpgd", dpgd), ("ssp", ssp))', '("pld", "rdp")', "(0.05, 0.1, 0.2)")


@pytest.mark.parametrize("event", [
    ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(0.05, ev.GaussianDpEvent(0.4)), 100),
    pytest.param(ev.GaussianDpEvent(0.1), marks=pytest.mark.slow),   # 1e-4 grid: 5 s
], ids=["poisson-steps", "gaussian"])
def test_coarser_discretization_is_still_a_pessimistic_bound(event):
    # Events whose epsilon (about 30 and 90) puts them past the default grid, yet small enough
    # for dp_accounting's default 1e-4 grid to be computed here as the reference.
    interval = accounting.pld_discretization_interval(event)
    assert interval > 1e-4
    fine = reference.pld_epsilon(event, 1e-5, 1e-4)
    coarse = accounting.epsilon_of(event, 1e-5, "pld")
    # Rounding every loss up to a coarser grid (a subset of the fine one) can only raise epsilon.
    assert fine <= coarse <= fine * (1 + 1e-4)
    rdp = rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_REMOVE).compose(event).get_epsilon(1e-5)
    assert coarse < rdp


def test_epsilon_beyond_dp_accountings_float_range_is_still_finite_and_pld():
    # Noise multiplier 0.1, 325 steps: dp_accounting's PLD epsilon overflows to inf (masses
    # near exp(-700) divided), while 300 and 350 steps give 681 and 743. The same PLD evaluated
    # in log space gives the value in between, no RDP fallback is needed, nothing is printed.
    step = ev.PoissonSampledDpEvent(Q, ev.GaussianDpEvent(0.1))
    event = ev.SelfComposedDpEvent(step, 325)
    interval = accounting.pld_discretization_interval(event)
    with np.errstate(over="ignore"):
        direct = pld_privacy_accountant.PLDAccountant(ADD_REMOVE, interval).compose(event).get_epsilon(1e-5)
    assert direct == math.inf
    notes = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = accounting.epsilon_of(event, 1e-5, notes=notes)
    below = accounting.epsilon_of(ev.SelfComposedDpEvent(step, 300), 1e-5)
    above = accounting.epsilon_of(ev.SelfComposedDpEvent(step, 350), 1e-5)
    assert below < got < above and notes == []


@pytest.mark.parametrize("event", [
    ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(0.05, ev.GaussianDpEvent(0.8)), 50),
    ev.GaussianDpEvent(0.1),
    ev.ComposedDpEvent([ev.LaplaceDpEvent(2.0), accounting.PureDpEvent(0.3)]),
], ids=["poisson-steps", "gaussian", "laplace-and-pure"])
@pytest.mark.parametrize("delta", [1e-9, 1e-5, 0.3])
def test_log_space_epsilon_is_dp_accountings_formula(event, delta):
    # The formula does not depend on the grid; a coarse one keeps the Gaussian PLD quick.
    eager = pld_accountant._EagerPLDAccountant(ADD_REMOVE, 1e-3)
    eager.compose(event)
    assert pld_accountant._log_space_epsilon(eager._pld, delta) == pytest.approx(
        eager.get_epsilon(delta), rel=1e-9, abs=1e-12)


def test_discretization_keeps_the_default_at_ordinary_epsilon():
    # Reports at ordinary budgets are exactly what dp_accounting's default PLD gives.
    event = ev.SelfComposedDpEvent(ev.PoissonSampledDpEvent(0.01, ev.GaussianDpEvent(1.1)), 300)
    assert accounting.pld_discretization_interval(event) == 1e-4
    expected = reference.pld_epsilon(event, 1e-5)
    assert accounting.epsilon_of(event, 1e-5) == pytest.approx(expected, rel=1e-12)


class _CountPLDs:
    """Counts the PLDs built (each costs seconds and memory at small noise)."""

    def __init__(self, monkeypatch):
        self.built = 0
        original = pld_accountant._EagerPLDAccountant.compose

        def compose(acc, event, count=1):
            if type(acc) is pld_accountant._EagerPLDAccountant:   # not the lazy subclass
                self.built += 1
            return original(acc, event, count)
        monkeypatch.setattr(pld_accountant._EagerPLDAccountant, "compose", compose)


def test_progress_epsilon_is_a_cheap_upper_bound(monkeypatch):
    delta, sigma, steps, chunk = 1e-5, 0.8, 200, 25
    step = ev.PoissonSampledDpEvent(0.02, ev.GaussianDpEvent(sigma))
    params = dict(noise_multiplier=sigma, sampling_probability=0.02)
    ledger = accounting.Ledger("pld")
    ledger.record("laplace_count", accounting.laplace_count_event(0.02), epsilon=0.02)
    planned = ledger.event_after("steps", step, steps, **params)
    counter = _CountPLDs(monkeypatch)
    shown = [ledger.progress_epsilon(delta, planned)]
    prefixes = []
    for done in range(0, steps, chunk):
        ledger.record("steps", step, chunk, **params)
        shown.append(ledger.progress_epsilon(delta, planned))
        prefixes.append(ledger.event())
    # Progress builds no PLD at all (RDP over a few orders), the report one, once.
    assert counter.built == 0
    final = ledger.epsilon(delta)
    assert counter.built == 1 and ledger.event() == planned
    assert shown[-1] >= final
    # Once the plan's PLD is known (a calibration starts it in the background), progress shows
    # it where it is lower: the last chunk shows the reported value.
    assert ledger.progress_epsilon(delta, planned) == final
    # Never below the spent epsilon (the PLD of the prefix; two of them, each is a PLD to build),
    # and non-decreasing.
    for k in (0, len(prefixes) // 2):
        assert shown[k + 1] >= accounting.epsilon_of(prefixes[k], delta)
    assert all(b >= a for a, b in zip(shown, shown[1:]))
    # Early progress is RDP's, below the plan's total.
    assert shown[1] < final


def test_ledger_epsilon_is_memoized(monkeypatch):
    ledger = accounting.Ledger("pld")
    ledger.record("steps", ev.PoissonSampledDpEvent(0.05, ev.GaussianDpEvent(1.3)), 40)
    counter = _CountPLDs(monkeypatch)
    first = ledger.epsilon(1e-6)
    assert ledger.epsilon(1e-6) == first and counter.built == 1


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def absl_messages():
    logger = logging.getLogger("absl")
    handler = _Capture()
    logger.addHandler(handler)
    filters_before = list(logger.filters)
    yield handler.messages
    accounting.settle()   # the report's PLD that a calibration started in the background
    logger.removeHandler(handler)
    assert logger.filters == filters_before     # the filter was only there during the calls


# The messages come from RDP orders 1.1-1.5 at sampling rate 0.1 and multiplier ~1: the setting
# of test_accounting.test_calibrate_noise_multiplier, where calibration starts at 1.
_Q, _STEPS = 0.1, 10


def _make_event(sigma):
    return ev.ComposedDpEvent([ev.LaplaceDpEvent(100.0),
                               accounting.gaussian_steps_event(sigma, _Q, _STEPS)])


def test_rdp_convergence_messages_do_not_reach_the_output_of_a_pld_calibration(absl_messages):
    sigma = accounting.calibrate_noise_multiplier(_make_event, 1.0, 1e-5, "pld")
    assert not [m for m in absl_messages if "failed to converge" in m]
    # RDP only bracketed the search: the result is PLD's alone, recomputed with dp_accounting.
    direct = reference.pld_epsilon(_make_event(sigma), 1e-5)
    assert 0.99 <= direct <= 1.0
    # Targeted: other absl messages still get through.
    logging.getLogger("absl").warning("some other message")
    assert absl_messages == ["some other message"]


def test_rdp_reporting_states_what_the_messages_mean(absl_messages):
    ledger = accounting.Ledger("rdp")
    ledger.record("steps", ev.PoissonSampledDpEvent(_Q, ev.GaussianDpEvent(1.0)), _STEPS)
    epsilon = ledger.epsilon(1e-5)
    assert not [m for m in absl_messages if "failed to converge" in m]
    assert ledger.notes == [accounting.RDP_EXCLUDED_ORDERS_NOTE]
    # The value is dp_accounting's own (orders it could not evaluate are simply not used).
    with_logging = rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_REMOVE).compose(
        ev.PoissonSampledDpEvent(_Q, ev.GaussianDpEvent(1.0)), _STEPS).get_epsilon(1e-5)
    assert epsilon == with_logging


def test_a_tiny_noise_multiplier_reports_a_finite_upper_bound():
    """Found in review: --noise-multiplier 1e-6 made dp_accounting overflow (exp of a huge
    discretization interval). Past MAX_DISCRETIZATION no PLD is built; RDP's bound is reported
    and the notes say so."""
    from dp_accounting import dp_event as events

    notes: list[str] = []
    epsilon = accounting.epsilon_of(events.GaussianDpEvent(1e-6), 1e-5, notes=notes)
    assert math.isfinite(epsilon) and epsilon > 1e9
    assert notes and "RDP" in notes[0]


def test_a_pure_release_beyond_plds_float_range_is_a_clear_error_not_an_overflow():
    # (epsilon 1e6 gave the private ranges a pure 1e5: OverflowError inside dp_accounting)
    with pytest.raises(ValueError, match="beyond dp_accounting's PLD"):
        accounting.epsilon_of(ev.ComposedDpEvent([accounting.PureDpEvent(1e4),
                                                  ev.GaussianDpEvent(1.0)]), 1e-5, "pld")
    assert math.isfinite(accounting.epsilon_of(accounting.PureDpEvent(1e4), 1e-5, "rdp"))
