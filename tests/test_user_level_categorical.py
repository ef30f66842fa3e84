"""User-level privacy over categorical and hashed columns (CSR rows, issue 34): each user's summed
gradient clipped to C without densifying the rows, the kept-rows rule on sparse rows, the unit
column as a categorical feature too, and whole runs where a user holding 1,000 rows moves the
model by less than the noise."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

import beam_dp
from beam_dp import data, losses, user_level
from beam_dp.algorithms import gradient_step
from beam_dp.algorithms.base import TrainState
from beam_dp.block import Block
from beam_dp.sampling import PoissonSampler

HEAVY = "heavy-user-7"


def _keys(values) -> np.ndarray:
    return user_level.user_keys(pa.array([str(v) for v in values]))


def _make_loss(model: str):
    return losses.make_loss(model, num_classes=3 if model == "softmax" else None)


@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("model", ["logistic", "softmax", "linear"])
def test_sparse_user_sums_are_the_dense_kernels_sums(model, fit_intercept):
    """The same rows as CSR and as a dense array: the same per-user clipped sum (to float
    rounding), at clip norms that clip every user, some, and none; and in any row order."""
    rng = np.random.default_rng([4, fit_intercept])
    m, d = 400, 12
    dense = np.where(rng.random((m, d)) < 0.3, 3.0 * rng.normal(size=(m, d)), 0.0)
    users = _keys(rng.integers(0, 30, m))
    loss = _make_loss(model)
    labels = (rng.integers(0, 3, m) if model == "softmax" else
              (rng.random(m) < 0.5).astype(float) if model == "logistic" else 5 * rng.normal(size=m))
    theta = rng.normal(size=(loss.outputs(), d + 1))
    grouped = np.argsort(users, kind="stable")   # (the dense kernel's rows come grouped by user)
    for clip in (0.1, 1.0, 1e3):
        expected = user_level.user_clipped_gradient_sum(
            theta, Block(dense[grouped], labels[grouped], users=users[grouped]), loss, clip,
            fit_intercept)
        for rows in (grouped, rng.permutation(m)):
            got = user_level.user_clipped_gradient_sum(
                theta, Block(sp.csr_matrix(dense[rows]), labels[rows], users=users[rows]), loss,
                clip, fit_intercept)
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12 * clip)
        if not fit_intercept:
            assert np.all(expected[:, -1] == 0)


def _heavy_and_rest(seed: int, others: int = 400, items: int = 60):
    """One-hot item rows (CSR) plus a numeric column: a heavy user's 1,000 rows all on one item
    with label 1 (their gradients aligned: the worst case for a row-level bound) and ``others``
    users with 1-5 rows on random items."""
    rng = np.random.default_rng(seed)

    def rows(item_ids, values):
        one_hot = sp.csr_matrix((np.ones(len(item_ids)), (np.arange(len(item_ids)), item_ids)),
                                shape=(len(item_ids), items))
        return sp.hstack([sp.csr_matrix(values[:, None]), one_hot], format="csr")

    heavy = Block(rows(np.full(1000, 3), np.full(1000, 2.0)), np.ones(1000),
                  users=_keys([HEAVY] * 1000))
    ids = np.repeat(np.arange(others), rng.integers(1, 6, others))
    rest = Block(rows(rng.integers(0, items, len(ids)), rng.normal(size=len(ids))),
                 (rng.random(len(ids)) < 0.5).astype(float), users=_keys(ids))
    return heavy, rest


@pytest.mark.parametrize("rate", [1.0, 0.3])   # dpgd's full batch; dpsgd's Poisson sample of users
def test_a_categorical_user_with_1000_rows_moves_a_step_sum_by_at_most_c(rate):
    clip = 1.0
    heavy, rest = _heavy_and_rest(0)
    with_user = user_level.group_by_user([rest, heavy], 5000, batch_rows=256)   # K above 1,000
    without = user_level.group_by_user([rest], 5000, batch_rows=256)
    assert all(b.sparse for b in with_user) and sum(map(len, with_user)) == len(rest) + 1000
    step = gradient_step.UserGradientStep(
        loss=_make_loss("logistic"), clip_norm=clip, noise_std=0.0, normalizer=1.0,
        learning_rate=1.0, sampler=PoissonSampler(rate, 5), seed=None, shape=(1, 62))
    rng = np.random.default_rng(1)
    moved = 0
    for t in range(12):
        state = TrainState(rng.normal(size=(1, 62)) * (t % 3), np.zeros((1, 62)), t)
        change = np.linalg.norm(sum(step.partial_sum(b, state) for b in with_user)
                                - sum(step.partial_sum(b, state) for b in without))
        assert change <= clip * (1 + 1e-9)
        moved += change > 0.5 * clip   # sampled: its aligned rows add about C
    assert moved == 12 if rate == 1.0 else 0 < moved < 12
    # Row-level clipping alone lets the same rows move the sum by about 1,000 C.
    from beam_dp import clipping
    row_level = clipping.sparse_clipped_gradient_sum(np.zeros((1, 62)), heavy.features,
                                                     heavy.labels, _make_loss("logistic"), clip)
    assert np.linalg.norm(row_level) > 900 * clip


def test_kept_rows_of_sparse_rows_are_the_users_own_choice():
    """The K rows a user keeps depend on that user's rows only: the same after other users are
    removed or added and the rows shuffled, and a stored zero is no different from none."""
    K = 16
    heavy, rest = _heavy_and_rest(3)
    rng = np.random.default_rng(8)
    varied = heavy.features.tolil()
    varied[:, 0] = rng.normal(size=(1000, 1))   # distinct rows, so the choice shows
    heavy = Block(varied.tocsr(), heavy.labels, users=heavy.users)
    heavy_key = _keys([HEAVY])[0]

    def kept_values(blocks):
        whole = user_level._concat(blocks)
        whole = whole.take(rng.permutation(len(whole)))
        kept = user_level.bound_rows(whole, K)
        return np.sort(kept.features[kept.users == heavy_key][:, 0].toarray().ravel())

    base = kept_values([heavy, rest])
    assert len(base) == K
    np.testing.assert_array_equal(kept_values([heavy]), base)
    padded = heavy.features.copy()
    padded = sp.csr_matrix((np.r_[padded.data, 0.0], np.r_[padded.indices, 5],
                            np.r_[padded.indptr[:-1], padded.indptr[-1] + 1]), shape=padded.shape)
    padded.has_sorted_indices = False   # a stored zero at the end of the last row
    np.testing.assert_array_equal(
        kept_values([Block(padded, heavy.labels, users=heavy.users), rest]), base)


@pytest.fixture(scope="module")
def rated(tmp_path_factory):
    """A ratings table as such tables come: user and item ids, a 0/1 label from the item's
    appeal, 300 light users (1-8 rows) and, in a second file, one user with 1,000 rows."""
    directory = tmp_path_factory.mktemp("rated")
    rng = np.random.default_rng(11)
    appeal = rng.normal(size=40)
    ids = np.repeat(np.arange(300), rng.integers(1, 9, 300))
    items = rng.integers(0, 40, len(ids))
    label = (rng.random(len(ids)) < 1 / (1 + np.exp(-2 * appeal[items]))).astype(float)
    light = str(directory / "light.csv")
    # "appeal": the item's appeal as a numeric column, for the same runs on dense features
    data.write_table(light, {"user": np.array([f"u{i}" for i in ids]), "item": items,
                             "appeal": appeal[items], "label": label})
    heavy = str(directory / "heavy.csv")
    data.write_table(heavy, {"user": np.array([HEAVY] * 1000), "item": np.full(1000, 7),
                             "appeal": np.full(1000, -2.0), "label": np.ones(1000)})
    return light, heavy


def _fit(files, **kw):
    args = dict(input=files, label_column="label", categorical_columns=["item"], hash_buckets=64,
                feature_columns=[], epsilon=1.0, num_examples=300, seed=3, runner="local",
                learning_rate=2.0)
    args.update(kw)
    return beam_dp.train(**args)


DENSE = dict(categorical_columns=None, hash_buckets=None, feature_columns=["appeal"],
             bounds={"appeal": (-4.0, 4.0)})


@pytest.mark.parametrize("columns", ["categorical", "dense"])
@pytest.mark.parametrize("algorithm", ["dpgd", "dpsgd"])
def test_a_user_with_1000_rows_moves_the_model_by_less_than_its_noise(rated, algorithm, columns):
    """Same seed (the same noise draws) with and without the heavy user (1,000 rows, all
    liking an item the others dislike): under user-level privacy the model moves by less than
    the noise's own spread (two seeds' models apart, over sqrt 2); at row level the same user
    moves it by several times that."""
    light, heavy = rated
    extra = dict(algorithm=algorithm, **({"batch_size": 100, "epochs": 3}
                                          if algorithm == "dpsgd" else {"steps": 30}),
                 **(DENSE if columns == "dense" else {}))
    # (a cap above the user's 1,000 rows: the bound must come from the per-user clipping)
    user = dict(privacy_unit_column="user", max_rows_per_user=2000, **extra)

    def models(**kw):
        with_heavy = _fit([light, heavy], **kw).theta
        without = _fit([light], **kw).theta
        other_seed = _fit([light], **{**kw, "seed": 4}).theta
        noise = np.linalg.norm(without - other_seed) / np.sqrt(2)
        return np.linalg.norm(with_heavy - without) / noise

    assert models(**user) < 1.0   # 0.008-0.17 measured; 1.9-51 without the per-user clipping
    if algorithm == "dpgd" or columns == "dense":   # (row-level dpsgd: no categorical columns)
        # rows: the 1,000 rows count 1,000 times
        assert models(**extra, num_examples=None, ignore_columns=["user"]) > 3.0   # 4.8-27


def test_the_unit_column_may_be_a_categorical_feature_too(rated):
    """A user's own id as a categorical column (common in recommendation) next to its use as
    the unit: allowed (each user's summed gradient is clipped whatever it touches), the same
    run in-process and on Beam (the cap chosen by auto, then applied by the later jobs); as a
    numeric feature it is refused."""
    light, _ = rated
    kw = dict(privacy_unit_column="user", categorical_columns=["item", "user"], steps=5,
              max_rows_per_user="auto")
    local = _fit([light], **kw)
    assert local.privacy_report["neighbouring"].startswith("add/remove one user")
    trust = local.privacy_report["trust_model"]
    assert "any one user" in trust and "contributes several rows" not in trust
    on_beam = _fit([light], **{**kw, "runner": "FnApiRunner"})
    np.testing.assert_allclose(on_beam.theta, local.theta, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="an id is not a quantity"):
        _fit([light], privacy_unit_column="user", feature_columns=["user"],
             categorical_columns=["item"])
