"""Private preprocessing per user (issue 34): under --privacy-unit-column the ranges' quantiles
and the median/mean fills weigh each row 1 / its user's rows, so adding or removing one user
moves their sums as adding or removing one row does (the same noise, the same events)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import beam_dp
from beam_dp import data, stats, user_level
from beam_dp.block import Block

from test_user_level import HEAVY, user_table  # noqa: F401 (the fixture)


def _grouped(with_heavy: bool):
    rng = np.random.default_rng(5)
    ids = np.repeat(np.arange(300), rng.integers(1, 6, 300))
    x = rng.normal(size=(len(ids), 3))
    x[rng.random(x.shape) < 0.1] = np.nan   # missing cells, as imputation sees them
    users = [f"u{i}" for i in ids]
    if with_heavy:
        x = np.vstack([x, np.tile([50.0, -50.0, np.nan], (1000, 1))])
        users += [HEAVY] * 1000
    keys = user_level.user_keys(pa.array(users))
    block = Block(x, np.zeros(len(x)), users=keys)
    return user_level.group_by_user([block], 5000, batch_rows=128)   # no cap: the heavy user whole


@pytest.mark.parametrize("per_user", [True, False])
def test_one_user_moves_the_quantiles_and_means_sums_as_one_row(per_user):
    grid = np.tile(np.linspace(-60, 60, 41), (3, 1))
    quantiles = stats.QuantileStage("q", stats.Selected((0, 1, 2)), stats.FixedGrid(grid), 3, 41,
                                    (0.5,), 1.0, 0, per_user=per_user)
    means = stats.ImputeMeanStage("m", (0, 1, 2), (-60.0,) * 3, (60.0,) * 3, 1.0, 0,
                                  per_user=per_user)
    change = {}
    for stage in (quantiles, means):
        a, b = ([sum(stage.partial_sum(blk, {}) for blk in _grouped(w))] for w in (True, False))
        change[stage.key] = np.abs(a[0] - b[0])
    if per_user:
        assert change["q"].sum(axis=1).max() <= 1 + 1e-9      # a column's counts: 1 in all
        assert change["m"].max() <= 1 + 1e-9                  # each sum and count: at most 1
        assert change["q"].sum() > 1.5                         # (it is there: 2 columns)
    else:   # row by row the same user moves them by its 1,000 rows
        assert change["q"].sum(axis=1).max() >= 999 and change["m"].max() >= 999


def test_per_user_quantiles_refuse_the_exact_mechanism():
    with pytest.raises(ValueError, match="float noise only"):
        stats.QuantileStage("q", stats.Selected((0,)), stats.FixedGrid(np.zeros((1, 3))), 1, 3,
                            (0.5,), 1.0, 0, noise="secure", per_user=True)


def test_user_level_runs_scale_and_fill_privately_in_process_and_on_beam(user_table, tmp_path):
    pattern, d = user_table
    common = dict(input=pattern, privacy_unit_column="user_id", epsilon=5.0, steps=3, seed=11,
                  num_examples=601, noise="float", scale_features="private")
    local = beam_dp.train(runner="local", **common)
    bounds = local.privacy_report["preprocessing"]["column_bounds"]
    assert len(bounds["columns"]) == d and local.privacy_report["neighbouring"].startswith(
        "add/remove one user")
    on_beam = beam_dp.train(**common)   # Beam's in-process runner: the users grouped first
    np.testing.assert_allclose(on_beam.theta, local.theta, rtol=1e-9, atol=1e-12)
    # --scale-epsilon acts under user-level privacy with the default auto (it was refused as
    # having no effect when auto was off per user)
    auto = beam_dp.train(runner="local", **{**common, "scale_features": "auto",
                                            "scale_epsilon": 0.5})
    assert auto.privacy_report["neighbouring"].startswith("add/remove one user")
    # A median fill of a column with missing cells, per user.
    path = str(tmp_path / "gaps.parquet")
    rng = np.random.default_rng(2)
    x = rng.normal(3.0, 1.0, 4000)
    x[rng.random(4000) < 0.2] = np.nan
    data.write_table(path, {"x0": x, "label": (rng.random(4000) < 0.5).astype(float),
                            "user_id": np.array([f"u{i}" for i in rng.integers(0, 900, 4000)])})
    model = beam_dp.train(input=path, privacy_unit_column="user_id", epsilon=5.0, steps=3,
                          seed=1, num_examples=900, noise="float", missing={"x0": "median"},
                          bounds={"x0": (-10.0, 10.0)}, runner="local")
    fill = model.privacy_report["preprocessing"]["imputation"]["x0"]["fill"]
    assert abs(fill - 3.0) < 0.5


def test_adaptive_clipping_counts_users_and_one_user_moves_it_by_one():
    """Per user, the step's (sum, count) with and without a user holding 1,000 aligned rows:
    the sum moves by at most C_t, the count by at most 1 (it counts users, not rows)."""
    from beam_dp import losses
    from beam_dp.algorithms.adaptive_clipping import AdaptiveClipState, UserAdaptiveClipStep
    from beam_dp.sampling import PoissonSampler
    rng = np.random.default_rng(9)
    ids = np.repeat(np.arange(200), rng.integers(1, 6, 200))
    rest = Block(rng.normal(size=(len(ids), 3)), (rng.random(len(ids)) < .5).astype(float),
                 users=user_level.user_keys(pa.array([f"u{i}" for i in ids])))
    heavy = Block(np.tile([4.0, -4.0, 2.0], (1000, 1)), np.ones(1000),
                  users=user_level.user_keys(pa.array([HEAVY] * 1000)))
    step = UserAdaptiveClipStep(loss=losses.make_loss("logistic"), clip_norm=1.0, noise_std=0.0,
                                normalizer=1.0, learning_rate=1.0,
                                sampler=PoissonSampler(1.0, 3), seed=None, shape=(1, 4))
    with_user = user_level.group_by_user([rest, heavy], 5000, batch_rows=100)
    without = user_level.group_by_user([rest], 5000, batch_rows=100)
    for clip in (0.05, 1.0, 1e4):
        state = AdaptiveClipState(np.zeros((1, 4)), np.zeros((1, 4)), 0, clip_norm=clip)
        a = sum(step.partial_sum(b, state) for b in with_user)
        b = sum(step.partial_sum(b, state) for b in without)
        assert np.linalg.norm(a[:-1] - b[:-1]) <= clip * (1 + 1e-9)
        assert abs(a[-1] - b[-1]) <= 1
        assert b[-1] <= len(np.unique(rest.users))   # users, not rows
    assert a[-1] - b[-1] == 1   # at a huge C_t the heavy user is below it: counted once


def test_user_level_adaptive_clipping_runs_in_process_and_on_beam(user_table):
    pattern, _ = user_table
    common = dict(input=pattern, privacy_unit_column="user_id", epsilon=2.0, steps=4, seed=5,
                  num_examples=601, noise="float", adaptive_clip_quantile=0.5)
    local = beam_dp.train(runner="local", **common)
    summary = local.privacy_report["preprocessing"]["adaptive_clipping"]
    assert len(summary["clip_norm_after_step"]) == 4
    on_beam = beam_dp.train(**common)
    np.testing.assert_allclose(on_beam.theta, local.theta, rtol=1e-9, atol=1e-12)


def test_column_counts_weigh_a_user_as_one_row():
    """--precondition's counts per user: a user with 1,000 rows on one hashed item moves them by
    at most one row's sqrt(per_row) in l2 (by 1,000 row by row)."""
    import scipy.sparse as sp
    rng = np.random.default_rng(4)
    ids = np.repeat(np.arange(200), rng.integers(1, 6, 200))

    def rows(items):
        m = len(items)
        return sp.csr_matrix((np.ones(2 * m), (np.repeat(np.arange(m), 2),
                                               np.c_[np.zeros(m, int), 1 + items].ravel())),
                             shape=(m, 41))
    rest = Block(rows(rng.integers(0, 40, len(ids))), np.zeros(len(ids)),
                 users=user_level.user_keys(pa.array([f"u{i}" for i in ids])))
    heavy = Block(rows(np.full(1000, 7)), np.zeros(1000),
                  users=user_level.user_keys(pa.array([HEAVY] * 1000)))
    for per_user, most in ((True, 1.0 + 1e-9), (False, None)):
        stage = stats.ColumnCountStage("c", 1, 41, 1, 1.0, 0, per_user=per_user)
        a, b = (sum(stage.partial_sum(blk, {}) for blk in
                    user_level.group_by_user(blocks, 5000, batch_rows=100))
                for blocks in ([rest, heavy], [rest]))
        change = np.linalg.norm(a - b)
        assert change <= most if per_user else change == 1000
