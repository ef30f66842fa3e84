"""User-level dpsgd (--privacy-unit-column with --algorithm dpsgd): each step a Poisson sample of
USERS (``user_level.in_step_batch``), each sampled user's summed gradient clipped to C, accounted
as PoissonSampledDpEvent(q, Gaussian(sigma)) per step under add/remove one user."""
from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
from dp_accounting import dp_event as events

import beam_dp
from beam_dp import accounting, data, losses, mechanisms, quality, synthetic, user_level, user_rows
from beam_dp.algorithms import gradient_step
from beam_dp.algorithms.base import TrainState
from beam_dp.block import Block
from beam_dp.sampling import PoissonSampler

from test_user_level import HEAVY, user_table  # noqa: F401 (the fixture)


def _keys(values) -> np.ndarray:
    return user_level.user_keys(pa.array([str(v) for v in values]))


def _step(rate: float, seed: int = 123, clip: float = 1.0) -> gradient_step.UserGradientStep:
    return gradient_step.UserGradientStep(
        loss=losses.make_loss("logistic", None, 1.0), clip_norm=clip, noise_std=0.0,
        normalizer=1.0, learning_rate=1.0, sampler=PoissonSampler(rate, seed), seed=None,
        shape=(1, 6))


def _heavy_and_rest(seed: int, others: int = 400):
    rng = np.random.default_rng(seed)
    d = 5
    heavy_x = np.tile(10 * rng.normal(size=d), (1000, 1)) + 0.01 * rng.normal(size=(1000, d))
    heavy = Block(heavy_x, np.ones(1000), users=_keys([HEAVY] * 1000))
    ids = np.repeat(np.arange(others), rng.integers(1, 6, others))
    rest = Block(rng.normal(size=(len(ids), d)), (rng.random(len(ids)) < 0.5).astype(float),
                 users=_keys(ids))
    return heavy, rest


def test_a_user_with_1000_rows_moves_a_sampled_step_sum_by_at_most_c():
    """The step's noisy-sum input (``partial_sum`` over the grouped blocks, the step's sampled
    users only) with and without a user holding 1,000 aligned rows: at most C apart at every
    step, and the user is sampled at some steps (so the bound is not vacuous)."""
    clip, q = 1.0, 0.3
    heavy, rest = _heavy_and_rest(0)
    with_user = user_level.group_by_user([rest, heavy], 5000, batch_rows=256)   # K above 1,000
    without = user_level.group_by_user([rest], 5000, batch_rows=256)
    step = _step(q, clip=clip)
    heavy_key = _keys([HEAVY])
    rng = np.random.default_rng(1)
    sampled = 0
    for t in range(20):
        state = TrainState(rng.normal(size=(1, 6)) * (t % 3), np.zeros((1, 6)), t)
        a = sum(step.partial_sum(b, state) for b in with_user)
        b = sum(step.partial_sum(b, state) for b in without)
        change = np.linalg.norm(a - b)
        assert change <= clip * (1 + 1e-9)
        in_batch = bool(user_level.in_step_batch(heavy_key, t, step.sampler.seed, q)[0])
        assert (change > 0.5 * clip) == in_batch   # its rows aligned: sampled, it adds ~C
        sampled += in_batch
    assert 0 < sampled < 20


def test_users_are_sampled_whole_at_rate_q():
    """Every row of a user in or out together, wherever the rows are; the share of users sampled
    is q within 5 binomial standard deviations at each step; two steps' samples overlap as
    independent draws do; another seed draws another sample."""
    q, users_n = 0.05, 20_000
    rng = np.random.default_rng(4)
    ids = np.repeat(np.arange(users_n), rng.integers(1, 6, users_n))
    keys = _keys(ids)
    shuffled = rng.permutation(len(keys))
    seed = mechanisms.sampling_seed(99)
    per_user = []
    for t in range(8):
        mask = user_level.in_step_batch(keys, t, seed, q)
        again = user_level.in_step_batch(keys[shuffled], t, seed, q)   # the rows reordered
        np.testing.assert_array_equal(again, mask[shuffled])
        starts = user_level.user_starts(keys)   # ids are sorted, so rows are grouped by user
        whole = np.add.reduceat(mask.astype(int), starts) / np.diff(np.r_[starts, len(keys)])
        assert set(np.unique(whole)) <= {0.0, 1.0}   # all of a user's rows, or none
        chosen = whole.astype(bool)
        assert abs(chosen.sum() - q * users_n) <= 5 * math.sqrt(users_n * q * (1 - q))
        per_user.append(chosen)
    # Over the 8 steps' 160,000 draws: a rate off by 10 percent is 9 standard deviations out.
    total = sum(c.sum() for c in per_user)
    trials = len(per_user) * users_n
    assert abs(total - q * trials) <= 5 * math.sqrt(trials * q * (1 - q))
    both = (per_user[0] & per_user[1]).sum()
    p = q * q
    assert abs(both - p * users_n) <= 5 * math.sqrt(users_n * p * (1 - p))
    other = user_level.in_step_batch(keys, 0, mechanisms.sampling_seed(100), q)
    assert (other != user_level.in_step_batch(keys, 0, seed, q)).any()
    assert user_level.in_step_batch(keys, 0, seed, 1.0).all()


@pytest.fixture(scope="module")
def users_pattern(user_table):  # noqa: F811 (the imported fixture)
    """test_user_level's table: ~600 light users and one holding 1,000 rows over two shards."""
    return user_table[0]


def _train(pattern, **kw):
    args = dict(input=pattern, privacy_unit_column="user_id", algorithm="dpsgd", epsilon=1.0,
                seed=11, noise="float", batch_size=60, steps=8, quality_check="off")
    args.update(kw)
    return beam_dp.train(**args)


def test_ledger_holds_poisson_sampled_user_steps_within_epsilon(users_pattern):
    model = _train(users_pattern, runner="local", steps=None, epochs=1.0, count_epsilon=0.5,
                   epsilon=2.0)
    report = model.privacy_report
    assert report["neighbouring"] == accounting.USER_ADD_REMOVE
    assert report["sampling"] == "Poisson over users"
    n_users = report["dataset_size"]["value"]
    assert report["dataset_size"]["unit"] == "users" and abs(n_users - 601) < 40   # users, not rows
    q, sigma = report["sampling_probability"], report["noise_multiplier"]
    assert q == pytest.approx(60 / n_users)
    assert report["steps"] == math.ceil(1.0 / q)
    assert report["expected_batch_size"] == pytest.approx(q * n_users)   # the public normalizer
    steps = [m for m in report["mechanisms"]
             if m["name"] == "poisson_sampled_gaussian_clipped_gradient_sum"]
    assert len(steps) == 1 and steps[0]["count"] == report["steps"]
    # The ledger's event, rebuilt from dp_accounting's own classes: the count, the cap's cost
    # (CAP_SHARE of epsilon) and the steps.
    expected = events.ComposedDpEvent([
        accounting.laplace_count_event(0.5),
        accounting.laplace_count_event(user_rows.CAP_SHARE * 2.0),
        events.SelfComposedDpEvent(events.PoissonSampledDpEvent(
            q, events.GaussianDpEvent(sigma)), report["steps"])])
    assert accounting.event_from_json(report["dp_event"]) == expected
    epsilon = accounting.epsilon_of(expected, report["delta"], "pld", accounting.USER_ADD_REMOVE)
    assert epsilon <= 2.0 * (1 + 1e-9) and report["epsilon"] <= 2.0 * (1 + 1e-9)
    assert epsilon > 1.9   # calibrated to the target, not far below it
    assert HEAVY not in json.dumps(report) and HEAVY not in json.dumps(model.artifact)


def test_in_process_and_beam_give_the_same_model(users_pattern):
    local = _train(users_pattern, runner="local", num_examples=600)
    on_beam = _train(users_pattern, num_examples=600)   # Beam's in-process FnApiRunner
    assert on_beam.privacy_report["sampling"] == "Poisson over users"
    np.testing.assert_allclose(on_beam.theta, local.theta, rtol=1e-9, atol=1e-12)
    # The sampling moves the model: not a full-batch run in disguise.
    full = _train(users_pattern, runner="local", num_examples=600, batch_size=600)
    assert full.privacy_report["sampling_probability"] == 1.0
    assert not np.allclose(full.theta, local.theta)


def test_a_table_with_heavy_users_trains_a_sane_model(tmp_path):
    """3,000 light users (1-4 rows, ~7,500 in all) and 20 users holding 2,000 rows each whose
    labels are all flipped: row-level dpsgd learns their flipped rule (accuracy on clean
    held-out rows below the constant's); user-level, where they weigh 20 users of ~3,000, is
    far above it."""
    rng = np.random.default_rng(8)
    d = 4
    counts = np.r_[rng.integers(1, 5, 3000), np.full(20, 2000)]
    n = int(counts.sum())
    x, y = synthetic.make_dataset("binary", n + 4000, d, seed=9)
    test_x, test_y = x[n:], y[n:]
    x, y = x[:n], y[:n].copy()
    users = np.repeat(np.arange(len(counts)), counts)
    heavy_rows = users >= 3000
    y[heavy_rows] = 1.0 - y[heavy_rows]
    path = str(tmp_path / "t.parquet")
    data.write_table(path, {**{f"x{j}": x[:, j] for j in range(d)}, "label": y,
                            "user_id": np.array([f"id{u}" for u in users])})
    model = beam_dp.train(input=path, runner="local", privacy_unit_column="user_id",
                          algorithm="dpsgd", epsilon=1.0, seed=2, noise="float", batch_size=300,
                          epochs=5, max_rows_per_user=2000, quality_check="off")
    accuracy = float(np.mean(model.predict(test_x) == test_y))
    constant = max(test_y.mean(), 1 - test_y.mean())
    assert accuracy > constant + 0.15
    rows = beam_dp.train(input=path, runner="local", algorithm="dpsgd", epsilon=1.0, seed=2,
                         noise="float", batch_size=1700, epochs=5, quality_check="off")
    assert float(np.mean(rows.predict(test_x) == test_y)) < constant


def test_quality_check_moves_by_one_rows_bound_per_user():
    """Under user-level privacy the check's sums take each user's mean vector, so a user with
    1,000 rows moves them by at most the per-row bound (sqrt 2 for a classifier), not 1,000
    times it (found while adding dpsgd: the sums were per row)."""
    loss = losses.make_loss("logistic", None, 1.0)
    heavy, rest = _heavy_and_rest(3)
    stage = quality.QualityStage(loss, None, 1.0, 0, relation=accounting.USER_ADD_REMOVE)
    state = quality.initial_state(np.zeros((1, 6)))
    with_user = user_level.group_by_user([rest, heavy], 5000, batch_rows=256)
    without = user_level.group_by_user([rest], 5000, batch_rows=256)
    a = sum(stage.partial_sum(b, state) for b in with_user)
    b = sum(stage.partial_sum(b, state) for b in without)
    assert 1.0 <= np.linalg.norm(a - b) <= stage.sensitivity * (1 + 1e-9)
    assert b[1:].sum() == pytest.approx(400)   # the class counts count users
