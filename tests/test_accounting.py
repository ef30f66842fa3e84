"""Privacy accounting: the ledger, calibration, and the DpEvents the DP-SGD/DP-GD driver records.

The reference values are computed here directly with dp_accounting's accountants from the
events the mechanisms are documented to be, never with the project's helpers.
"""
from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event as ev
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from beam_dp import accounting, losses
from beam_dp.algorithms import noisy_gd
from beam_dp.data import Block
from beam_dp.local import LocalAggregator

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
    assert got >= 0.99 * target
    # Smallest such sigma (the search tolerance is 1e-4): a little less noise overspends.
    assert epsilon(sigma - 5e-4) > target


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

    def step_batches(self, plan, steps, resume=None, keep=False):
        self.plans.append((plan, steps))
        batches = super().step_batches(plan, steps, resume, keep)
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
                                    count_epsilon=0.05, clip_norm=0.8, delta=1e-6)
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
        assert aggregator.chunks == [3, 3, 1]
    else:   # Poisson batches fixed in advance: one plan for the run, each step's batch read once
        ((plan, steps),) = aggregator.plans
        assert (plan.sampler.rate, plan.sampler.seed, steps) == (q, 5, 7)
        assert plan.expected_rows == pytest.approx(q * n)
        assert aggregator.batch_steps == list(range(7))
        assert aggregator.step_fns == []

    mechanisms = ledger.mechanisms()
    expected_events = []
    if num_examples is None:
        assert result.dataset_size["source"].startswith("private estimate")
        assert mechanisms[0] == {"name": "laplace_count", "count": 1, "epsilon": 0.05,
                                 "sensitivity": 1}
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
