"""Privacy accounting: the ledger, calibration, and the DpEvents the DP-SGD/DP-GD driver records.

The reference values are computed here directly with dp_accounting's accountants from the
events the mechanisms are documented to be, never with the project's helpers (the slow PLD ones
cached on disk by ``dp_accounting_reference``, keyed by the event and dp_accounting's version).
"""
from __future__ import annotations

import math
import time

import dp_accounting
import numpy as np
import pytest
from scipy import stats
from dp_accounting import dp_event as ev
from dp_accounting.pld import pld_pmf, pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

from beam_dp import accounting, losses
from beam_dp.accounting import calibration, fast_pld, pld_accountant, rdp_accountant
from beam_dp.algorithms import noisy_gd
from beam_dp.block import Block
from beam_dp.local import LocalAggregator
from beam_dp.mechanisms import sampling_seed

import dp_accounting_reference as reference

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def _pld():
    return pld_privacy_accountant.PLDAccountant(neighboring_relation=ADD_REMOVE)


def _rdp():
    return rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_REMOVE)


def _step(sigma, q):
    return ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma))


# --------------------------------------------------------------------------------------- Ledger


def test_ledger_merges_consecutive_identical_releases():
    ledger = accounting.Ledger()
    step = _step(1.1, 0.01)
    ledger.record("count", ev.LaplaceDpEvent(100.0), epsilon=0.01)
    ledger.record("steps", step, count=4, noise_multiplier=1.1, sampling_probability=0.01)
    ledger.record("steps", step, count=4, noise_multiplier=1.1, sampling_probability=0.01)
    ledger.record("steps", step, count=0, noise_multiplier=1.1, sampling_probability=0.01)
    ledger.record("steps", step, count=2, noise_multiplier=1.1, sampling_probability=0.01)
    assert ledger.mechanisms() == [
        {"name": "count", "count": 1, "epsilon": 0.01},
        {"name": "steps", "count": 10, "noise_multiplier": 1.1, "sampling_probability": 0.01},
    ]
    assert ledger.event() == ev.ComposedDpEvent(
        [ev.LaplaceDpEvent(100.0), ev.SelfComposedDpEvent(step, 10)])


def test_ledger_keeps_different_or_interleaved_releases_apart():
    ledger = accounting.Ledger()
    ledger.record("steps", _step(1.1, 0.01), count=3, noise_multiplier=1.1)
    ledger.record("steps", _step(1.2, 0.01), count=3, noise_multiplier=1.2)   # other event
    ledger.record("steps", _step(1.2, 0.01), count=3, noise_multiplier=1.25)  # other params
    ledger.record("count", ev.LaplaceDpEvent(10.0))
    ledger.record("steps", _step(1.2, 0.01), count=3, noise_multiplier=1.25)  # not consecutive
    assert [(m["name"], m["count"]) for m in ledger.mechanisms()] == [
        ("steps", 3), ("steps", 3), ("steps", 3), ("count", 1), ("steps", 3)]


def test_empty_ledger_spends_nothing():
    assert accounting.Ledger().epsilon(1e-5) == 0.0


def test_ledger_rejects_unknown_accountant():
    with pytest.raises(ValueError):
        accounting.Ledger("moments")


@pytest.mark.parametrize("kind,make", [("pld", _pld), ("rdp", _rdp)])
def test_ledger_epsilon_equals_direct_composition(kind, make):
    sigma, q, steps, count_epsilon, delta = 1.4, 0.02, 30, 0.05, 1e-6
    ledger = accounting.Ledger(kind)
    ledger.record("laplace_count", accounting.laplace_count_event(count_epsilon))
    for chunk in (12, 12, 6):   # as the driver records it, one entry per chunk
        ledger.record("steps", _step(sigma, q), count=chunk)

    direct = make()
    direct.compose(ev.LaplaceDpEvent(1 / count_epsilon))
    direct.compose(_step(sigma, q), steps)
    expected = direct.get_epsilon(delta)
    assert ledger.epsilon(delta) == pytest.approx(expected, rel=1e-9)
    assert ledger.mechanisms()[1]["count"] == steps


def test_rdp_is_looser_than_pld_for_a_subsampled_gaussian():
    # The RDP-to-(epsilon, delta) conversion is not tight, PLD is: a check that the two
    # accountants really are different methods rather than one under two names.
    event = accounting.gaussian_steps_event(1.0, 0.01, 1000)
    pld = accounting.epsilon_of(event, 1e-5, "pld")
    rdp = accounting.epsilon_of(event, 1e-5, "rdp")
    assert pld < rdp < 1.5 * pld


# --------------------------------------------------------------------------------------- Events


@pytest.mark.parametrize("q", [0.1, 1.0])
def test_gaussian_steps_event(q):
    # Whatever form the event takes (k full-batch Gaussian steps may be written as one Gaussian
    # with multiplier sigma / sqrt(k), which is exactly equivalent), it must cost what k
    # Gaussian steps cost: Poisson-subsampled at rate q when q < 1, not subsampled at q = 1.
    step = ev.GaussianDpEvent(2.0) if q == 1.0 else _step(2.0, q)
    for make in (_pld, _rdp):
        expected = make().compose(step, 7).get_epsilon(1e-6)
        got = make().compose(accounting.gaussian_steps_event(2.0, q, 7)).get_epsilon(1e-6)
        assert got == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("epsilon", [0.01, 0.3, 1.0])
def test_laplace_count_event(epsilon):
    event = accounting.laplace_count_event(epsilon)
    # A count (sensitivity 1) with Laplace noise of scale b = 1/epsilon is epsilon-DP.
    assert event == ev.LaplaceDpEvent(1.0 / epsilon)
    # PLD's pessimistic discretization (interval 1e-4) may add a little; a tiny delta buys
    # almost nothing for a pure-DP mechanism.
    got = accounting.epsilon_of(event, 1e-12, "pld")
    assert epsilon - 1e-3 <= got <= epsilon + 1e-3
    # RDP's conversion is looser but must still be close to and at least the pure epsilon - 1e-3.
    assert epsilon - 1e-3 <= accounting.epsilon_of(event, 1e-12, "rdp")


def test_event_to_json_is_plain_json():
    import json
    event = ev.ComposedDpEvent([ev.LaplaceDpEvent(100.0), accounting.gaussian_steps_event(1.5, 0.1, 3)])
    as_json = json.loads(json.dumps(accounting.event_to_json(event)))
    assert as_json == {"class_name": "ComposedDpEvent", "events": [
        {"class_name": "LaplaceDpEvent", "noise_multiplier": 100.0},
        {"class_name": "SelfComposedDpEvent", "count": 3, "event": {
            "class_name": "PoissonSampledDpEvent", "sampling_probability": 0.1,
            "event": {"class_name": "GaussianDpEvent", "noise_multiplier": 1.5}}}]}


# ---------------------------------------------------------------------------------- Calibration


@pytest.mark.parametrize("kind,make", [("pld", _pld), ("rdp", _rdp)])
def test_calibrate_noise_multiplier(kind, make):
    q, steps, target, delta = 0.1, 10, 1.0, 1e-5
    prior = [ev.LaplaceDpEvent(100.0)]

    def make_event(sigma):
        return ev.ComposedDpEvent(prior + [accounting.gaussian_steps_event(sigma, q, steps)])

    sigma = accounting.calibrate_noise_multiplier(make_event, target, delta, kind)

    def epsilon(s):
        a = make()
        a.compose(ev.LaplaceDpEvent(100.0))
        a.compose(_step(s, q), steps)
        return a.get_epsilon(delta)

    got = epsilon(sigma)
    assert got <= target
    # Within the calibration's precision: its epsilon at most CALIBRATION_TOLERANCE (0.3%) below
    # the target, and so the smallest such sigma within that (epsilon falls at least as fast as
    # 1/sigma here): a little less noise overspends.
    assert got >= (1 - accounting.CALIBRATION_TOLERANCE) * target
    assert epsilon(sigma / (1 + accounting.CALIBRATION_TOLERANCE)) > target


# ------------------------------------------------------------------- What the driver records


class SpyAggregator(LocalAggregator):
    """A LocalAggregator that remembers the step functions (full batch) or the batch plan and
    the steps whose batches were read (batches fixed in advance) the driver gave it."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.step_fns, self.chunks, self.plans, self.batch_steps = [], [], [], []

    def run_stages(self, stages, state):
        self.step_fns.extend(stages)
        self.chunks.append(len(stages))
        return super().run_stages(stages, state)

    def step_batches(self, plan, steps, resume=None, keep=False, every_row=False,
                     workers_may_sum=True):
        self.plans.append((plan, steps))
        batches = super().step_batches(plan, steps, resume, keep, every_row, workers_may_sum)
        get = batches.get

        def spy(step):
            self.batch_steps.append(step)
            return get(step)
        batches.get = spy
        return batches


def _blocks(n=600, d=3, seed=0):
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, d))
    y = np.where(x[:, 0] + 0.3 * g.standard_normal(n) > 0, 1.0, -1.0)
    return [Block(x[i:i + 200], y[i:i + 200], "/mem/train", i) for i in range(0, n, 200)]


@pytest.mark.parametrize("algorithm", ["dpsgd", "dpgd"])
@pytest.mark.parametrize("num_examples", [None, 600])
def test_driver_ledger_matches_its_sampling_and_noise(algorithm, num_examples):
    config = noisy_gd.NoisyGDConfig(algorithm=algorithm, batch_size=60, steps=7, steps_per_chunk=3,
                                    noise_multiplier=1.7, num_examples=num_examples,
                                    count_epsilon=0.05, clip_norm=0.8, delta=1e-6,
                                    noise="float")   # the float count and steps, recomputed below
    aggregator = SpyAggregator(_blocks())
    ledger = accounting.Ledger("pld")
    result = noisy_gd.train(config, losses.make_loss("logistic"), 3, aggregator, seed=5,
                            ledger=ledger)
    n = result.dataset_size["value"]
    q = result.sampling_probability
    assert q == (60 / n if algorithm == "dpsgd" else 1.0)

    # The driver sampled, noised and normalized with the same q and sigma it accounted for.
    if algorithm == "dpgd":
        assert len(aggregator.step_fns) == 7
        for step_fn in aggregator.step_fns:
            assert step_fn.sampler.rate == q
            assert step_fn.noise_std == pytest.approx(1.7 * 0.8)
            assert step_fn.normalizer == pytest.approx(q * n)
            # A job's copy holds its steps' noise keys, not the root seed (``for_steps``).
            assert step_fn.seed is None and step_fn.sampler.seed != 5
        assert aggregator.chunks == [3, 3, 1]
        assert [fn.noise_keys[0] for fn in aggregator.step_fns[::3]] == [0, 3, 6]
    else:   # Poisson batches fixed in advance: one plan for the run, each step's batch read once
        ((plan, steps),) = aggregator.plans
        # The batch job's sampler is keyed by a key derived from the root seed, not the seed.
        assert (plan.sampler.rate, plan.sampler.seed, steps) == (q, sampling_seed(5), 7)
        assert plan.expected_rows == pytest.approx(q * n)
        assert aggregator.batch_steps == list(range(7))
        assert aggregator.step_fns == []

    mechanisms = ledger.mechanisms()
    expected_events = []
    if num_examples is None:
        assert result.dataset_size["source"].startswith("private estimate")
        assert mechanisms[0] == {"name": "laplace_count", "count": 1, "epsilon": 0.05,
                                 "sensitivity": 1, "noise": "float Laplace"}
        expected_events.append(ev.LaplaceDpEvent(1 / 0.05))
        mechanisms = mechanisms[1:]
    else:
        assert result.dataset_size == {"source": "public (--num-examples)", "value": 600}
    (steps_entry,) = mechanisms
    assert steps_entry["count"] == 7
    assert steps_entry["sampling_probability"] == q
    assert steps_entry["noise_multiplier"] == 1.7
    step = ev.GaussianDpEvent(1.7) if q == 1.0 else _step(1.7, q)
    expected_events.append(ev.SelfComposedDpEvent(step, 7))

    direct = _pld()
    for e in expected_events:
        direct.compose(e)
    assert ledger.epsilon(1e-6) == pytest.approx(direct.get_epsilon(1e-6), rel=1e-9)


def test_count_alone_over_budget_is_refused():
    config = noisy_gd.NoisyGDConfig(epsilon=0.5, count_epsilon=1.0, steps=3, batch_size=50)
    with pytest.raises(ValueError, match="count"):
        noisy_gd.train(config, losses.make_loss("logistic"), 3, LocalAggregator(_blocks()), seed=1,
                       ledger=accounting.Ledger())


# ------------------------------------------------ Calibration and accounting off the critical path
# (issue 10, item 4). Costs are not asserted here (they are measured by pipelines/benchmark.py);
# what is asserted is what the speed must not cost: the guarantee, the precision, exactness.


def _count_then_steps(q, steps, count_epsilon):
    """The driver's calibration event: the ledger so far (a Laplace count), then the steps."""
    prior = ev.ComposedDpEvent([ev.LaplaceDpEvent(1 / count_epsilon)])
    return lambda s: ev.ComposedDpEvent([prior, accounting.gaussian_steps_event(s, q, steps)])


@pytest.mark.parametrize("q,steps,target", [
    (0.005, 1000, 1.0),    # the benchmark's DP-SGD run (n = 200,000, batch 1,000, 5 epochs)
    (1.0, 100, 1.0),       # the README's DP-GD run
    (0.05, 200, 4.0),
    (0.02, 100, 0.3),
    (0.001, 3000, 0.1),    # the search's coarse grid is furthest from the report's at small epsilon
    (1.0, 20, 8.0),
])
def test_calibrated_multiplier_meets_the_target_by_dp_accountings_own_pld(q, steps, target):
    delta = 1e-5
    make_event = _count_then_steps(q, steps, 0.01 * target)
    sigma = accounting.calibrate_noise_multiplier(make_event, target, delta)

    def library(s, interval):   # dp_accounting's PLD accountant, nothing of this project's
        return reference.pld_epsilon(make_event(s), delta, interval)

    at_default = library(sigma, 1e-4)
    # Never above the target: on dp_accounting's default grid (the report's) or a finer one.
    assert at_default <= target
    assert library(sigma, 5e-5) <= target
    # Within the chosen precision of the smallest multiplier that meets the target.
    assert at_default >= (1 - accounting.CALIBRATION_TOLERANCE) * target
    assert library(sigma / (1 + accounting.CALIBRATION_TOLERANCE), 1e-4) > target
    # And the epsilon the ledger reports for it is dp_accounting's default PLD's.
    assert accounting.epsilon_of(make_event(sigma), delta) == pytest.approx(at_default, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("sigma,q,interval", [
    (0.94, 0.005, 1e-4), (0.5, 0.3, 1e-3), (3.7, 1.0, 1e-4), (0.1, 0.01, 1e-2), (2.0, 0.999, 1e-3)])
def test_whole_grid_gaussian_pld_is_dp_accountings_to_the_bit(sigma, q, interval):
    assert fast_pld._fast_gaussian()
    ours = fast_pld._gaussian_pld(sigma, q, interval)
    theirs = privacy_loss_distribution.from_gaussian_mechanism(
        sigma, value_discretization_interval=interval, sampling_prob=q)
    grid = np.linspace(-1.0, 10.0, 2001)
    np.testing.assert_array_equal(ours.get_delta_for_epsilon(grid), theirs.get_delta_for_epsilon(grid))
    for delta in (1e-3, 1e-5, 1e-9):
        assert ours.get_epsilon_for_delta(delta) == theirs.get_epsilon_for_delta(delta)
    # Through the accountant, composed as the driver's events are.
    for event in (ev.SelfComposedDpEvent(_step(sigma, q) if q < 1 else ev.GaussianDpEvent(sigma), 7),
                  ev.ComposedDpEvent([ev.LaplaceDpEvent(30.0), ev.GaussianDpEvent(sigma)])):
        mine = pld_accountant._EagerPLDAccountant(ADD_REMOVE, interval).compose(event)
        assert mine.get_epsilon(1e-6) == reference.pld_epsilon(event, 1e-6, interval)


def test_whole_grid_gaussian_falls_back_to_the_library_if_it_ever_differs(monkeypatch):
    fast_pld._fast_gaussian.cache_clear()
    monkeypatch.setattr(fast_pld._GaussianPrivacyLoss, "_inverse_privacy_losses",
                        lambda self, losses: losses * 0.0)   # wrong on purpose
    try:
        assert not fast_pld._fast_gaussian()
        event = ev.SelfComposedDpEvent(_step(1.234, 0.03), 20)
        mine = pld_accountant._EagerPLDAccountant(ADD_REMOVE, 1e-3).compose(event).get_epsilon(1e-5)
        library = pld_privacy_accountant.PLDAccountant(ADD_REMOVE, 1e-3).compose(event)
        assert mine == library.get_epsilon(1e-5)
    finally:
        fast_pld._fast_gaussian.cache_clear()


class _CountPLDsByGrid:
    """The PLDs built (each is a calibration's or a report's real cost), by discretization."""

    def __init__(self, monkeypatch):
        self.intervals = []
        original = pld_accountant._EagerPLDAccountant.compose

        def compose(acc, event, count=1):
            if type(acc) is pld_accountant._EagerPLDAccountant:   # not the lazy subclass
                self.intervals.append(acc._value_discretization_interval)
            return original(acc, event, count)
        monkeypatch.setattr(pld_accountant._EagerPLDAccountant, "compose", compose)


def test_calibration_searches_coarse_grids_and_the_report_grid_is_built_once(monkeypatch):
    # The driver's pattern: calibrate against the ledger so far, record the steps, report.
    q, steps, delta, count_epsilon = 0.02, 150, 1e-6, 0.0131
    ledger = accounting.Ledger("pld")
    ledger.record("laplace_count", accounting.laplace_count_event(count_epsilon),
                  epsilon=count_epsilon)
    prior = ledger.event()

    def make_event(s):
        return ev.ComposedDpEvent([prior, accounting.gaussian_steps_event(s, q, steps)])

    counter = _CountPLDsByGrid(monkeypatch)
    sigma = accounting.calibrate_noise_multiplier(make_event, 1.3, delta)
    # The search ran on coarser grids; the report's grid is left to the background thread.
    searched = [i for i in counter.intervals if i != 1e-4]
    assert searched and all(i >= accounting.PROBE_FACTOR * 1e-4 for i in searched)
    # The report asks about the same releases, nested differently: it waits for that PLD (or
    # finds it done) and builds no other: one PLD on the report's grid in all.
    ledger.record("steps", _step(sigma, q), count=steps, noise_multiplier=sigma)
    reported = ledger.epsilon(delta)
    assert counter.intervals.count(1e-4) == 1
    built = len(counter.intervals)
    direct = _pld()
    direct.compose(ev.LaplaceDpEvent(1 / count_epsilon))
    direct.compose(_step(sigma, q), steps)
    assert reported == pytest.approx(direct.get_epsilon(delta), rel=1e-12) and reported <= 1.3
    # Calibrating again with the same inputs is memoized: no PLD at all, not even a search.
    searches = []
    search = calibration._search
    monkeypatch.setattr(calibration, "_search", lambda *a: searches.append(a) or search(*a))
    assert accounting.calibrate_noise_multiplier(make_event, 1.3, delta) == sigma
    assert len(counter.intervals) == built and not searches


def test_a_memoized_calibration_is_checked_before_it_is_returned():
    make_event = _count_then_steps(0.04, 60, 0.02)
    sigma = accounting.calibrate_noise_multiplier(make_event, 2.0, 1e-5)
    for key in list(calibration._CALIBRATIONS):
        calibration._CALIBRATIONS[key] = sigma / 2   # as if the memo were wrong
    again = accounting.calibrate_noise_multiplier(make_event, 2.0, 1e-5)
    assert again == pytest.approx(sigma, rel=accounting.CALIBRATION_TOLERANCE)
    assert accounting.epsilon_of(make_event(again), 1e-5) <= 2.0


def test_calibration_bounds():
    make_event = _count_then_steps(1.0, 10, 0.01)
    # An upper bound that does not meet the target is an error, not an answer.
    with pytest.raises(ValueError, match="meets the target"):
        accounting.calibrate_noise_multiplier(make_event, 1.0, 1e-5, lower=0.1, upper=0.5)
    # A lower bound that already meets it is returned (more noise than needed is within budget).
    assert accounting.calibrate_noise_multiplier(make_event, 1.0, 1e-5, lower=100.0) == 100.0
    with pytest.raises(ValueError):
        accounting.calibrate_noise_multiplier(make_event, 1.0, 1e-5, lower=2.0, upper=1.0)


def test_search_reaches_the_window_or_the_edge_of_a_jump():
    # A power law: the window [target (1 - tolerance), target] is reached.
    x = calibration._search(lambda s: 3.0 / s ** 2, 1.0, 1e-3, 1e-6, None, 1.0, {})
    assert 0.999 <= 3.0 / x ** 2 <= 1.0
    # A flat stretch then a drop (a prior release dominating), from far away.
    x = calibration._search(lambda s: 0.9 + 1e-3 / s, 0.95, 1e-3, 1e-6, None, 1e-6, {})
    assert 0.95 * 0.999 <= 0.9 + 1e-3 / x <= 0.95
    # A jump over the window: the smallest parameter past it, to 1e-9.
    x = calibration._search(lambda s: 2.0 if s < 1.7 else 0.5, 1.0, 1e-3, 1e-6, None, 1.0, {})
    assert 1.7 <= x <= 1.7 * (1 + 1e-8)
    # An epsilon that is never met below ``upper``.
    with pytest.raises(ValueError):
        calibration._search(lambda s: 5.0 / s, 1.0, 1e-3, 1e-6, 2.0, 1.0, {})


@pytest.mark.parametrize("event", [
    ev.SelfComposedDpEvent(_step(1.1, 0.01), 300),
    ev.SelfComposedDpEvent(_step(0.4, 0.05), 100),
    ev.SelfComposedDpEvent(_step(0.2, 0.005), 1000),   # fractional orders matter here
    ev.GaussianDpEvent(0.05),
    ev.ComposedDpEvent([ev.LaplaceDpEvent(0.01), accounting.PureDpEvent(30.0)]),
], ids=["ordinary", "epsilon-30", "small-noise", "gaussian", "pure"])
def test_discretization_interval_is_the_rule_over_all_rdp_orders(event):
    # The quick RDP (a few orders) only short-cuts the rule; the interval is the rule's, with
    # RDP over all of dp_accounting's orders.
    with rdp_accountant._quiet_rdp():
        estimate = rdp_accountant._RdpAccountant(neighboring_relation=ADD_REMOVE).compose(
            event).get_epsilon(1e-10)
    ratio = estimate / (accounting.PLD_POINTS * 1e-4)
    expected = 1e-4 if ratio <= 1 else 1e-4 * 2.0 ** math.ceil(math.log2(ratio))
    assert accounting.pld_discretization_interval(event) == expected


def test_rdp_steps_are_memoized_to_the_bit_and_keep_the_excluded_orders_note():
    step = _step(1.0, 0.1)   # orders 1.1-1.5 do not converge here (tests/test_accountant_limits.py)
    for count in (10, 37, 10):
        event = ev.ComposedDpEvent([ev.LaplaceDpEvent(20.0), ev.SelfComposedDpEvent(step, count),
                                    ev.GaussianDpEvent(3.0)])
        with rdp_accountant._quiet_rdp():
            ours = rdp_accountant._RdpAccountant().compose(event)
            theirs = _rdp().compose(event)
        np.testing.assert_array_equal(ours._rdp, theirs._rdp)
        assert ours.get_epsilon(1e-5) == theirs.get_epsilon(1e-5)
    # The step is memoized now (so dp_accounting prints nothing more about it); the report's
    # note that orders were left out must still be given.
    ledger = accounting.Ledger("rdp")
    ledger.record("steps", step, 3)
    ledger.epsilon(1e-5)
    assert ledger.notes == [accounting.RDP_EXCLUDED_ORDERS_NOTE]


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_stopwatch_counts_nested_calls_once(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(accounting.stopwatch, "time", clock)
    stopwatch = accounting.stopwatch._Stopwatch()

    @stopwatch
    def inner():
        clock.now += 2.0

    @stopwatch
    def outer():
        clock.now += 1.0
        inner()
        clock.now += 4.0

    outer()
    assert stopwatch.seconds == 7.0     # not 9: the inner call is inside the outer one
    clock.now += 100.0                  # outside accounting: not counted
    inner()
    assert stopwatch.seconds == 9.0
    stopwatch.reset()
    assert stopwatch.seconds == 0.0


def test_stopwatch_times_the_accounting_entry_points():
    accounting.STOPWATCH.reset()
    assert accounting.STOPWATCH.seconds == 0.0
    make_event = _count_then_steps(0.03, 70, 0.017)
    start = time.perf_counter()
    sigma = accounting.calibrate_noise_multiplier(make_event, 1.7, 1e-6)
    ledger = accounting.Ledger("pld")
    ledger.record("steps", _step(sigma, 0.03), 70)
    ledger.epsilon(1e-6)
    ledger.progress_epsilon(1e-6)
    elapsed = time.perf_counter() - start
    # Counted, and once: the epsilons inside the calibration are not added a second time (which
    # would make the total exceed the wall time around it).
    assert 0.0 < accounting.STOPWATCH.seconds <= elapsed
    accounting.STOPWATCH.reset()
    assert accounting.STOPWATCH.seconds == 0.0


def test_the_reports_pld_is_made_in_the_background_and_only_the_wait_is_timed(monkeypatch):
    make_event = _count_then_steps(0.01, 400, 0.01)
    accounting.STOPWATCH.reset()
    sigma = accounting.calibrate_noise_multiplier(make_event, 1.0, 1e-5)
    searched = accounting.STOPWATCH.seconds
    started = time.perf_counter()
    while accounting.ready_epsilon(make_event(sigma), 1e-5) is None:   # the background thread's
        assert time.perf_counter() - started < 60
        time.sleep(0.01)
    assert accounting.STOPWATCH.seconds == searched   # its work is not the driver's
    reported = accounting.epsilon_of(make_event(sigma), 1e-5)
    assert reported == accounting.ready_epsilon(make_event(sigma), 1e-5) <= 1.0
    assert reported == pytest.approx(reference.pld_epsilon(make_event(sigma), 1e-5), rel=1e-12)


@pytest.mark.parametrize("sigma,q,interval,steps", [
    (0.94, 0.005, 8e-4, 1000), (0.5, 0.1, 1e-4, 50), (3.0, 1.0, 4e-4, 100), (1.2, 0.01, 1e-3, 3000)])
def test_the_searchs_truncation_bounds_are_dp_accountings(sigma, q, interval, steps):
    from dp_accounting.pld import common
    pld = fast_pld._gaussian_pld(sigma, q, interval)
    for pmf in (pld._pmf_remove, pld._pmf_add):
        probs = np.asarray(pmf._probs, float)
        assert fast_pld._self_convolve_bounds(probs, steps, 1e-15) == \
            common.compute_self_convolve_bounds(probs, steps, 1e-15)
    mine = fast_pld._quick_self_compose(pld, steps)
    theirs = pld.self_compose(steps)
    for a, b in ((mine._pmf_remove, theirs._pmf_remove), (mine._pmf_add, theirs._pmf_add)):
        assert a._lower_loss == b._lower_loss and a._infinity_mass == b._infinity_mass
        # A real FFT where the library takes a complex one: the same up to rounding.
        np.testing.assert_allclose(a._probs, b._probs, rtol=0, atol=1e-15)
    for delta in (1e-5, 1e-9):   # within the margin the search adds (_QUICK_ROUNDING)
        assert mine.get_epsilon_for_delta(delta) == pytest.approx(
            theirs.get_epsilon_for_delta(delta), rel=calibration._QUICK_ROUNDING / 10)


def _assert_same_pld(mine, theirs):
    for a, b in ((mine._pmf_remove, theirs._pmf_remove), (mine._pmf_add, theirs._pmf_add)):
        assert type(a) is type(b)
        assert a._infinity_mass == b._infinity_mass
        if isinstance(a, pld_pmf.DensePLDPmf):
            assert a._lower_loss == b._lower_loss
            np.testing.assert_array_equal(a._probs, b._probs)
        else:
            assert a._loss_probs == b._loss_probs


@pytest.mark.parametrize("sigma,q,interval", [
    (0.94, 0.005, 1e-4), (0.94, 0.005, 8e-4), (0.5, 0.3, 1e-3), (3.7, 1.0, 1e-4), (40.0, 1.0, 1e-3)])
def test_the_gaussian_pmfs_are_dp_accountings_to_the_bit(sigma, q, interval):
    # The connect-the-dots PMF made dense at once (no dict round trip) and the scipy-free normal
    # law: the same PMFs, not only the same deltas.
    assert fast_pld._fast_gaussian()
    _assert_same_pld(fast_pld._gaussian_pld(sigma, q, interval),
                     privacy_loss_distribution.from_gaussian_mechanism(
                         sigma, value_discretization_interval=interval, sampling_prob=q))


def test_the_scaled_normal_is_scipys():
    rng = np.random.default_rng(5)
    for scale in (0.3, 0.94, 26.4, 1e3):
        ours, scipy_law = fast_pld._ScaledNormal(scale), stats.norm(scale=scale)
        x = np.concatenate([rng.normal(0, 5 * scale, 5000), [0.0, -0.0, np.inf, -np.inf, 40 * scale]])
        np.testing.assert_array_equal(ours.cdf(x), scipy_law.cdf(x))
        np.testing.assert_array_equal(ours.logcdf(x), scipy_law.logcdf(x))
        p = np.concatenate([rng.uniform(0, 1, 1000), [0.0, 1.0, 1e-300, 0.5 * math.exp(-50)]])
        np.testing.assert_array_equal(ours.ppf(p), scipy_law.ppf(p))
        for value in (0.1, -3.0, math.inf):
            assert ours.cdf(value) == scipy_law.cdf(value)
            assert ours.logcdf(value) == scipy_law.logcdf(value)


@pytest.mark.parametrize("sigma,q,interval,steps", [
    (0.94, 0.005, 8e-4, 1000), (0.5, 0.1, 1e-4, 50), (3.0, 1.0, 4e-4, 100)])
def test_the_searchs_composition_is_dp_accountings(sigma, q, interval, steps):
    # Dense with dense, and with the count's (sparse) Laplace PLD in either order, the tails cut
    # as the library cuts them (its Python loop; here cumulative sums).
    steps_pld = fast_pld._gaussian_pld(sigma, q, interval).self_compose(steps)
    other = fast_pld._gaussian_pld(sigma * 1.3, q, interval)
    count = fast_pld._laplace_pld(100.0, interval, 1)
    for a, b in ((steps_pld, other), (count, steps_pld), (steps_pld, count),
                 (count, fast_pld._laplace_pld(30.0, interval, 2))):
        _assert_same_pld(fast_pld._quick_compose(a, b), a.compose(b))


def test_a_memoized_calibration_is_not_another_problems():
    """Found by the kill-and-resume test: two DP-GD problems (100 and 12 full-batch steps, whose
    events are one Gaussian of sigma / sqrt(steps)) coincided at their own starting guesses, and
    the second got the first one's noise multiplier (3x the noise it needed)."""
    prior = ev.ComposedDpEvent([ev.LaplaceDpEvent(100.0)])
    answers = {}
    for steps in (100, 12):
        guess, slope = accounting.noise_multiplier_guess(1.0, steps, 0.99, 1e-5)

        def make_event(s, steps=steps):
            return ev.ComposedDpEvent([prior, accounting.gaussian_steps_event(s, 1.0, steps)])
        answers[steps] = accounting.calibrate_noise_multiplier(make_event, 1.0, 1e-5,
                                                               guess=guess, slope=slope)
        assert accounting.epsilon_of(make_event(answers[steps]), 1e-5) >= \
            (1 - accounting.CALIBRATION_TOLERANCE) * 1.0
    assert answers[100] / answers[12] == pytest.approx(math.sqrt(100 / 12), rel=1e-2)


# ------------------------------------------------------------- ApproxDpEvent: (epsilon, delta)

def test_an_approximate_dp_event_alone_gives_back_its_epsilon():
    event = accounting.ApproxDpEvent(1.0, 1e-6)
    assert accounting.epsilon_of(event, 1e-6, "pld") == pytest.approx(1.0, abs=1e-3)
    # at a smaller delta than its own, no finite epsilon holds
    assert accounting.epsilon_of(event, 1e-7, "pld") == math.inf


def test_approximate_dp_events_compose_no_worse_than_basic_or_advanced_composition():
    k, eps, delta = 50, 0.1, 1e-8
    total_delta = 1e-5
    composed = accounting.epsilon_of(
        ev.SelfComposedDpEvent(accounting.ApproxDpEvent(eps, delta), k), total_delta, "pld")
    basic = k * eps
    slack = total_delta - k * delta
    advanced = (math.sqrt(2 * k * math.log(1 / slack)) * eps + k * eps * (math.exp(eps) - 1))
    assert composed <= min(basic, advanced) + 1e-3
    # and not trivially: the optimal composition is above the mean privacy loss k eps tanh(eps/2)
    assert composed > k * eps * math.tanh(eps / 2)


def test_rdp_refuses_an_approximate_dp_event():
    with pytest.raises(Exception, match="(?i)unsupported|support"):
        accounting.epsilon_of(accounting.ApproxDpEvent(1.0, 1e-6), 1e-5, "rdp")


def test_an_approximate_dp_event_survives_json():
    event = ev.ComposedDpEvent([accounting.ApproxDpEvent(0.5, 1e-7),
                                    ev.GaussianDpEvent(2.0)])
    back = accounting.event_from_json(accounting.event_to_json(event))
    assert back == event
    from beam_dp.ledger import events as stored
    assert stored.event_from_json(stored.event_to_json(event)) == event


def test_generalized_gaussian_mechanism_matches_its_lemma():
    """Paper 004, Lemma 3: sigma^2 = 2 kappa ln(1/delta) s^2 / epsilon^2 gives (epsilon, delta)."""
    s, kappa, delta, eps = 0.02, 2.0, 1e-6, 0.5
    sigma = math.sqrt(2 * kappa * math.log(1 / delta) * s ** 2 / eps ** 2)
    event = accounting.generalized_gaussian_event(sigma, s, kappa, delta)
    assert event == accounting.ApproxDpEvent(pytest.approx(eps, rel=1e-12), delta)
    with pytest.raises(ValueError, match="beyond"):
        accounting.generalized_gaussian_event(sigma / 3, s, kappa, delta)   # epsilon 1.5
    with pytest.raises(ValueError, match="kappa"):
        accounting.generalized_gaussian_event(sigma, s, 0.5, delta)


@pytest.mark.parametrize("event", [
    ev.GaussianDpEvent(4.0),
    ev.SelfComposedDpEvent(ev.GaussianDpEvent(20.0), 50),
    ev.ComposedDpEvent([ev.GaussianDpEvent(6.0), ev.SelfComposedDpEvent(ev.GaussianDpEvent(9.0), 3)]),
])
def test_rdp_reads_replace_one_multipliers_as_pld_does(event):
    """A replace-one multiplier is stated against the add/remove sensitivity (a replacement moves
    a sum twice as far), as dp_accounting's PLD reads it; its RDP accountant ignores the
    relation, so passed as is, RDP claimed about half the epsilon (1.01 against PLD's 1.99 for
    GaussianDpEvent(4)). RDP is an upper bound: it must never be below PLD, and under
    replace-one it is the add/remove RDP of the event at half the multiplier."""
    rdp = accounting.epsilon_of(event, 1e-5, "rdp", accounting.REPLACE_ONE)
    pld = accounting.epsilon_of(event, 1e-5, "pld", accounting.REPLACE_ONE)
    assert rdp >= pld * (1 - 1e-6)
    halved = rdp_accountant._rdp_replace_one_units(event)
    assert rdp == pytest.approx(accounting.epsilon_of(halved, 1e-5, "rdp", accounting.ADD_REMOVE),
                                rel=1e-12)
    # and a replace-one calibration by RDP needs more noise than by PLD, never less
    make = lambda m: ev.GaussianDpEvent(m)  # noqa: E731
    assert (accounting.calibrate_noise_multiplier(make, 1.0, 1e-5, "rdp", accounting.REPLACE_ONE)
            >= accounting.calibrate_noise_multiplier(make, 1.0, 1e-5, "pld", accounting.REPLACE_ONE))
