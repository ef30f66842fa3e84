"""User-level privacy (--privacy-unit-column): the per-user bound on a step's sum, the kept-rows
rule, end-to-end runs in-process and on Beam's in-process runner, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

import beam_dp
from beam_dp import accounting, clipping, data, losses, synthetic, user_level
from beam_dp.block import Block
from beam_dp.ledger import core

HEAVY = "heavy-user-7"   # the user holding 1,000 rows; must never appear in an output


def _keys(values) -> np.ndarray:
    return user_level.user_keys(pa.array([str(v) for v in values]))


def _rows_with_heavy_user(seed: int, others: int = 400, heavy_rows: int = 1000):
    """A heavy user's 1,000 nearly identical rows (their gradients add up, the worst case for a
    row-level bound) and ``others`` users with 1-5 rows each."""
    rng = np.random.default_rng(seed)
    d = 5
    heavy_x = np.tile(10 * rng.normal(size=d), (heavy_rows, 1)) + 0.01 * rng.normal(size=(heavy_rows, d))
    heavy = Block(heavy_x, np.ones(heavy_rows), users=_keys([HEAVY] * heavy_rows))
    counts = rng.integers(1, 6, others)
    ids = np.repeat(np.arange(others), counts)
    x = rng.normal(size=(len(ids), d))
    rest = Block(x, (rng.random(len(ids)) < 0.5).astype(float), users=_keys(ids))
    return heavy, rest


@pytest.mark.parametrize("seed", [0, 1])
def test_a_user_with_1000_rows_moves_a_step_sum_by_at_most_the_clip_norm(seed):
    clip = 1.0
    loss = losses.make_loss("logistic", None, 1.0)
    heavy, rest = _rows_with_heavy_user(seed)
    K = 5000   # above the heavy user's rows: the bound must come from the per-user clipping
    with_user = user_level.group_by_user([rest, heavy], K, batch_rows=256)
    without = user_level.group_by_user([rest], K, batch_rows=256)
    assert sum(len(b) for b in with_user) == len(rest) + len(heavy)   # nothing dropped
    rng = np.random.default_rng(100 + seed)
    for theta in [np.zeros((1, 6)), rng.normal(size=(1, 6)), -3.0 * rng.normal(size=(1, 6))]:
        a = sum(user_level.user_clipped_gradient_sum(theta, b, loss, clip) for b in with_user)
        b = sum(user_level.user_clipped_gradient_sum(theta, b, loss, clip) for b in without)
        change = np.linalg.norm(a - b)
        assert change <= clip * (1 + 1e-9)
    # Row-level clipping alone: at theta = 0 each of the user's rows adds a clipped gradient of
    # norm C, nearly aligned, so the user moves the sum by almost 1,000 C.
    theta = np.zeros((1, 6))
    row_level = np.linalg.norm(clipping.clipped_gradient_sum(
        theta, heavy.features, heavy.sq_norms, heavy.labels, loss, clip))
    assert row_level > 900 * clip


def test_a_users_sum_is_clipped_even_split_over_blocks_before_grouping():
    """The grouping puts a user's rows in one block whatever blocks they were read in."""
    heavy, rest = _rows_with_heavy_user(2, others=50)
    parts = [heavy.take(np.arange(0, 400)), rest, heavy.take(np.arange(400, 1000))]
    grouped = user_level.group_by_user(parts, 5000, batch_rows=64)
    owners = [set(b.users.tolist()) for b in grouped]
    heavy_key = int(_keys([HEAVY])[0])
    assert sum(heavy_key in o for o in owners) == 1
    assert sum(len(user_level.user_starts(b.users)) for b in grouped) == 51


def test_kept_rows_at_most_k_per_user_and_independent_of_other_users():
    K = 16
    heavy, rest = _rows_with_heavy_user(3)
    rng = np.random.default_rng(7)
    kept = user_level.bound_rows(data_concat([rest, heavy]), K)
    _, per_user = np.unique(kept.users, return_counts=True)
    assert per_user.max() <= K
    heavy_key = _keys([HEAVY])[0]

    def heavy_rows(block):
        rows = block.features[block.users == heavy_key]
        return rows[np.lexsort(rows.T[::-1])]

    base = heavy_rows(kept)
    assert len(base) == K
    # Other users removed, others added, and every row shuffled: the heavy user keeps the same rows.
    extra = Block(rng.normal(size=(300, 5)), np.zeros(300), users=_keys(rng.integers(10**6, 2 * 10**6, 300)))
    for blocks in ([heavy], [extra, heavy, rest]):
        whole = data_concat(blocks)
        shuffled = whole.take(rng.permutation(len(whole)))
        np.testing.assert_array_equal(heavy_rows(user_level.bound_rows(shuffled, K)), base)


def data_concat(blocks):
    return Block(np.concatenate([b.features for b in blocks]),
                 np.concatenate([b.labels for b in blocks]),
                 users=np.concatenate([b.users for b in blocks]))


@pytest.fixture(scope="module")
def user_table(tmp_path_factory):
    """Two Parquet shards, a user holding 1,000 rows split over both, and ~600 light users."""
    directory = tmp_path_factory.mktemp("users")
    n, d = 4000, 4
    x, y = synthetic.make_dataset("binary", n, d, seed=5)
    rng = np.random.default_rng(6)
    users = np.array([f"u{u}" for u in rng.integers(0, 600, n)], dtype=object)
    users[rng.choice(n, 1000, replace=False)] = HEAVY
    paths = []
    for i, rows in enumerate((slice(0, n // 2), slice(n // 2, n))):
        path = str(directory / f"train-{i}.parquet")
        columns = {f"x{j}": x[rows, j] for j in range(d)}
        columns.update(label=y[rows], user_id=users[rows].astype(str))
        data.write_table(path, columns)
        paths.append(path)
    return str(directory / "train-*.parquet"), d


def _train(pattern, **kw):
    args = dict(input=pattern, privacy_unit_column="user_id", epsilon=1.0, steps=3, seed=11,
                num_examples=600, noise="float")
    args.update(kw)
    return beam_dp.train(**args)


@pytest.mark.slow
def test_user_level_run_in_process_and_on_beam(user_table):
    pattern, d = user_table
    local = _train(pattern, runner="local")
    on_beam = _train(pattern)   # the default runner for files: Beam's in-process FnApiRunner
    report = local.privacy_report
    assert report["neighbouring"] == accounting.USER_ADD_REMOVE
    assert report["privacy_unit"]["column"] == "user_id"
    assert report["privacy_unit"]["max_rows_per_user"] == user_level.DEFAULT_MAX_ROWS_PER_USER
    assert "one user" in report["trust_model"]
    assert local.feature_columns == [f"x{j}" for j in range(d)]   # the key is not a feature
    np.testing.assert_allclose(on_beam.theta, local.theta, rtol=1e-9, atol=1e-12)
    assert on_beam.privacy_report["neighbouring"] == accounting.USER_ADD_REMOVE
    assert HEAVY not in json.dumps(report) and HEAVY not in json.dumps(local.artifact)


def test_user_count_is_the_noisy_count_of_users(user_table):
    pattern, _ = user_table
    model = _train(pattern, runner="local", num_examples=None, count_epsilon=0.5, epsilon=2.0)
    size = model.privacy_report["dataset_size"]
    assert size["unit"] == "users"
    # 601 users (not 4,000 rows): the Laplace count of scale 2 is within 40 of it (p ~ 2e-9).
    assert abs(size["value"] - 601) < 40


def test_refusals(user_table, tmp_path):
    pattern, _ = user_table
    with pytest.raises(ValueError, match="use: dpgd, dpsgd"):
        _train(pattern, runner="local", algorithm="dpsgd-f")
    with pytest.raises(ValueError, match="float noise"):
        _train(pattern, runner="local", noise="secure")
    with pytest.raises(ValueError, match="privacy_unit_column"):
        beam_dp.train(input=pattern, runner="local", epsilon=1.0, max_rows_per_user=4)
    with pytest.raises(ValueError, match="listed as a numeric"):
        _train(pattern, runner="local", feature_columns=["x0", "user_id"])
    with pytest.raises(data.DataError, match="privacy unit column 'uid' not found"):
        _train(pattern, runner="local", privacy_unit_column="uid")
    # A row without a user: an error naming the column and row, never a value.
    path = str(tmp_path / "nulls.parquet")
    data.write_table(path, {"x0": np.arange(3.0), "label": np.array([0.0, 1.0, 0.0]),
                            "user_id": pa.array(["secret-a", None, "secret-b"])})
    with pytest.raises(data.DataError, match=r"row 2: column 'user_id' \(the privacy unit\)") as e:
        _train(path, runner="local")
    assert "secret" not in str(e.value)


def test_csv_user_column_is_a_key_and_max_rows_applies(tmp_path):
    path = str(tmp_path / "t.csv")
    n = 300
    rng = np.random.default_rng(0)
    data.write_table(path, {"x0": rng.normal(size=n), "label": (rng.random(n) < .5).astype(float),
                            "user_id": np.array([str(i % 3) for i in range(n)])})
    blocks = data.load_blocks([path], "label", ["x0"], losses.make_loss("logistic", None, 1.0),
                              user_column="user_id")
    grouped = user_level.group_by_user(blocks, 7, 1000)
    assert sum(len(b) for b in grouped) == 21
    model = _train(path, runner="local", max_rows_per_user=7, num_examples=3)
    assert model.privacy_report["privacy_unit"]["max_rows_per_user"] == 7


def test_cli_flags_and_schema_key(user_table, tmp_path, cli):
    pattern, _ = user_table
    out = tmp_path / "out"
    run = cli("train", "--input", pattern, "--output", out, "--runner", "local", "--epsilon", 1,
              "--steps", 2, "--seed", 3, "--num-examples", 600, "--privacy-unit-column", "user_id",
              "--max-rows-per-user", 5)
    assert run.code == 0, run.err
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["neighbouring"] == accounting.USER_ADD_REMOVE
    assert report["privacy_unit"]["max_rows_per_user"] == 5
    assert HEAVY not in run.out + run.err
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"privacy_unit": "user_id"}))
    model = _train(pattern, runner="local", privacy_unit_column=None, schema=str(schema))
    assert model.privacy_report["privacy_unit"]["column"] == "user_id"
    run = cli("train", "--input", pattern, "--output", tmp_path / "o2", "--runner", "local",
              "--epsilon", 1, "--algorithm", "dpsgd-f", "--privacy-unit-column", "user_id")
    assert run.code != 0 and "user-level" in run.err and HEAVY not in run.err
    # With the budget ledger, a user-level run is charged to its unit's own budget
    # (dataset d@user_id): the row-level budget of d does not admit it, and is left untouched.
    ledger = str(tmp_path / "budget.db")
    assert cli("ledger", "budget", "--ledger", ledger, "--dataset-id", "d", "--epsilon", 5,
               "--delta", 1e-5).code == 0
    flags = ("train", "--input", pattern, "--output", tmp_path / "o3", "--runner", "local",
             "--epsilon", 1, "--steps", 2, "--privacy-unit-column", "user_id", "--ledger", ledger,
             "--dataset-id", "d")
    run = cli(*flags)
    assert run.code == 2 and "no budget is declared for dataset 'd@user_id'" in run.err
    assert not (tmp_path / "o3").exists()
    assert cli("ledger", "budget", "--ledger", ledger, "--dataset-id", "d", "--privacy-unit",
               "user_id", "--epsilon", 2, "--delta", 1e-5).code == 0
    run = cli(*flags)
    assert run.code == 0, run.err
    with core.open_ledger(ledger) as opened:
        assert opened.charges("d") == []
        (charge,) = opened.charges("d@user_id")
        assert charge.status == "committed" and charge.neighbouring == accounting.USER_ADD_REMOVE
    report = json.loads((tmp_path / "o3" / "privacy_report.json").read_text())
    assert report["ledger"]["dataset_id"] == "d@user_id"


@pytest.mark.parametrize("model", ["softmax", "linear"])
def test_without_binding_clips_the_user_sum_is_the_row_level_sum(model):
    """With a clip norm no gradient reaches, the per-user path sums the same gradients as the
    row-level kernel (softmax's k outputs and the intercept laid out alike)."""
    rng = np.random.default_rng(9)
    n, d = 500, 4
    loss = losses.make_loss(model, 3 if model == "softmax" else None, 1.0)
    labels = rng.integers(0, 3, n).astype(float) if model == "softmax" else rng.normal(size=n)
    block = Block(rng.normal(size=(n, d)), loss.encode_labels(labels),
                  users=_keys(rng.integers(0, 40, n)))
    grouped = user_level.group_by_user([block], n, batch_rows=100)
    theta = rng.normal(size=(loss.outputs(), d + 1))
    for fit in (True, False):
        ours = sum(user_level.user_clipped_gradient_sum(theta, b, loss, 1e6, fit) for b in grouped)
        rows = clipping.clipped_gradient_sum(theta, block.features, block.sq_norms, block.labels,
                                             loss, 1e6, fit)
        np.testing.assert_allclose(ours, rows, rtol=1e-10, atol=1e-9)


def test_one_run_audit_of_canary_users_holding_1000_rows_each():
    """A seeded distinguishing check (``beam_dp.audit``'s one-run audit): 64 canary users, each
    with 1,000 rows on its own feature column, included with probability 1/2 in one noisy
    step. The audit's 95% lower bound on epsilon must stay within the step's accounted epsilon
    (it is ~0: each canary moves the sum by C against noise sigma C); the same test on row-level
    sums (each canary moving it by 1,000 C) finds every canary, a bound far above it."""
    from dp_accounting import dp_event

    from beam_dp import audit

    m, rows, clip, sigma, delta = 64, 1000, 1.0, 5.0, 1e-5
    accounted = accounting.epsilon_of(dp_event.GaussianDpEvent(sigma), delta)
    rng = np.random.default_rng(2024)
    included = rng.random(m) < 0.5
    members = np.flatnonzero(included)
    features = np.zeros((len(members) * rows, m))
    features[np.arange(len(features)), np.repeat(members, rows)] = 2.0
    block = Block(features, np.ones(len(features)), users=_keys(np.repeat(members, rows)))
    loss = losses.make_loss("logistic", None, 1.0)
    theta = np.zeros((1, m + 1))
    grouped = user_level.group_by_user([block], rows, batch_rows=8192)
    user_sum = sum(user_level.user_clipped_gradient_sum(theta, b, loss, clip, False) for b in grouped)
    row_sum = clipping.clipped_gradient_sum(theta, block.features, block.sq_norms, block.labels,
                                            loss, clip, False)
    noise = rng.normal(0.0, sigma * clip, theta.shape)
    # A canary's gradient pushes its coordinate down: its score is minus the noisy sum there.
    user_level_bound = audit.audit_from_scores(-(user_sum + noise)[0, :m], included, delta)
    row_level_bound = audit.audit_from_scores(-(row_sum + noise)[0, :m], included, delta)
    assert user_level_bound["epsilon_lower_bound"] <= accounted
    assert row_level_bound["epsilon_lower_bound"] > 2 * accounted
