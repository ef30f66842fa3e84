"""The registered ``output-perturbation`` algorithm (paper 001, Algorithm 6 with Theorem 7.1's
lambda; beam_dp/algorithms/output_perturbation.py): it trains on dense rows and on categorical
(CSR) rows, its privacy report is a replace-one Gaussian whose epsilon dp_accounting recomputes,
its released model is the certified solution plus a Gaussian of the plan's scale, the GLM's
sparse gradient sum equals the dense one, and what it cannot serve is refused clearly. (The
Beam-free core ``release`` is tested in tests/test_sparse_mean.py.)"""
from __future__ import annotations

import math
import warnings

import dp_accounting
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
from dp_accounting.pld import privacy_loss_distribution

import beam_dp
from beam_dp import accounting, api, features, losses, synthetic
from beam_dp.algorithms import objective_perturbation as objective
from beam_dp.algorithms import output_perturbation as outp
from beam_dp.algorithms import registry, spec
from beam_dp.algorithms.spec import Privacy, Problem
from beam_dp.block import Block
from beam_dp.local import LocalAggregator

DELTA = 1e-5
NAME = "output-perturbation"


def _dense(n=2000, d=10, seed=0):
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, d))
    w = g.standard_normal(d)
    y = (x @ w + 0.3 * g.standard_normal(n) > 0).astype(float)
    return x, y


def _train(*args, **kw):
    kw.setdefault("epsilon", 1.0)
    kw.setdefault("seed", 1)
    kw.setdefault("runner", "local")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", api.PrivacyWarning)
        return beam_dp.train(*args, algorithm=NAME, **kw)


# ============================================================== 1. it trains

def test_trains_on_dense_rows_and_records_the_clip():
    x, y = _dense()
    # Its own releases alone (the quality check's: test_quality_check_replace_one.py).
    model = _train(x, y, quality_check="off")
    assert model.score(x, y) > 0.9          # a separable design (measured 0.955)
    d = x.shape[1]
    assert model.artifact["feature_transform"] == {"clip_rows": pytest.approx(math.sqrt(d))}
    report = model.privacy_report
    assert report["neighbouring"] == accounting.REPLACE_ONE
    (mechanism,) = report["mechanisms"]
    assert mechanism["name"] == outp.RELEASE and mechanism["relation"] == "replace-one"
    params = report["algorithm_parameters"]
    # lambda is Thm 7.1's lambda* with s = d + 1 (the intercept is a coordinate), D = sqrt(d + 1)
    # (the unit box's radius, default_model_norm)
    L = math.sqrt(d + 1)          # logistic: 1 * ||(z, 1)|| <= sqrt(F^2 + 1), F = sqrt(d)
    n = report["dataset_size"]["value"]
    assert params["lipschitz"] == pytest.approx(L, rel=1e-9)
    assert params["regularization"] == pytest.approx(
        outp.default_regularization(L, d + 1, d + 1, n, 1.0, DELTA, math.sqrt(d + 1)), rel=1e-12)
    assert params["diameter"] == pytest.approx(math.sqrt(d + 1), rel=1e-12)


def test_model_norm_sets_d_and_the_constraint_is_the_default_with_one():
    """D: --model-norm when given (with or without a constraint), else the set's l2 diameter,
    else sqrt(d + 1); lambda = sqrt(2K) / D in each case, so lambda * D is the same."""
    x, y = _dense(n=1000, d=8, seed=4)
    found = {}
    for name, kw in {"declared": dict(model_norm=7.0),
                     "box": dict(constraint="box", radius=0.5, fit_intercept=False),
                     "box-declared": dict(constraint="box", radius=0.5, fit_intercept=False,
                                          model_norm=7.0)}.items():
        found[name] = _train(x, y, **kw).privacy_report["algorithm_parameters"]
    assert found["declared"]["diameter"] == 7.0
    assert found["box"]["diameter"] == pytest.approx(2 * 0.5 * math.sqrt(8), rel=1e-12)
    assert found["box-declared"]["diameter"] == 7.0
    # without the intercept s and L differ, so compare the no-intercept runs with each other
    assert (found["box"]["regularization"] * found["box"]["diameter"]
            == pytest.approx(found["box-declared"]["regularization"] * 7.0, rel=1e-12))


@pytest.fixture(scope="module")
def click_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("clicks")
    train, test = synthetic.click_log(4000, 1, values=50), synthetic.click_log(1000, 1, split=1, values=50)
    pq.write_table(pa.table(train), root / "train.parquet")
    return str(root / "train.parquet"), test


def test_trains_on_categorical_columns(click_files):
    path, test = click_files
    columns = ["user", "item", "site"]
    model = _train(input=path, categorical_columns=columns, hash_buckets=64, regularization=0.01)
    encoding = model.artifact["encoding"]
    assert encoding["categorical_columns"] == columns
    # sparse rows: the clip is not recorded (predict does not clip); F = sqrt(s), s = 3 + 1
    # (the numeric column "position" is a feature too)
    assert not model.artifact.get("feature_transform")
    params = model.privacy_report["algorithm_parameters"]
    s = len(encoding["numeric_columns"]) + len(columns)
    assert params["feature_bound"] == pytest.approx(math.sqrt(s))
    assert params["sparsity"] == s + 1
    assert model.privacy_report["neighbouring"] == accounting.REPLACE_ONE
    frame = pa.table({k: v for k, v in test.items() if k != "label"}).to_pandas()
    accuracy = float(np.mean(model.predict(frame) == test["label"]))
    base = max(test["label"].mean(), 1 - test["label"].mean())
    assert accuracy > base + 0.02, (accuracy, base)


def test_sparse_gradient_sum_equals_the_dense_one():
    """GlmGradient.partial_sum's CSR branch (one sparse product) against the dense chunked loop,
    rows clipped by SparseClipRows / ClipRows to the same bound, with and without intercept."""
    g = np.random.default_rng(3)
    dense = g.standard_normal((300, 40)) * (g.random((300, 40)) < 0.1) * 3.0
    labels = np.where(g.random(300) < 0.5, -1.0, 1.0)
    loss = losses.make_loss("logistic")
    for intercept in (True, False):
        theta = g.standard_normal((1, 41))
        a = objective.GlmGradient(loss, outp.SparseClipRows(1.5), intercept).partial_sum(
            Block(sp.csr_matrix(dense), labels), theta)
        b = objective.GlmGradient(loss, features.ClipRows(1.5), intercept).partial_sum(
            Block(dense, labels), theta)
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
        assert np.abs(b).max() > 1.0
        if not intercept:
            assert a[0, -1] == 0.0


# ============================================================== 2. privacy

@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_reported_epsilon_recomputed_with_dp_accounting(epsilon):
    x, y = _dense(n=1500, d=6, seed=2)
    # Its own releases alone (the quality check's: test_quality_check_replace_one.py).
    report = _train(x, y, epsilon=epsilon, quality_check="off").privacy_report
    assert report["neighbouring"] == accounting.REPLACE_ONE and report["delta"] == DELTA
    (mechanism,) = report["mechanisms"]
    multiplier = mechanism["noise_multiplier"]
    params = report["algorithm_parameters"]
    assert mechanism["sigma"] == pytest.approx(multiplier * params["sensitivity_unit"], rel=1e-12)
    # the unit is L / (lambda n) + tau, tau = sqrt(2 alpha / lambda)
    n = report["dataset_size"]["value"]
    lam = params["regularization"]
    tau = math.sqrt(2 * params["accuracy"] / lam)
    assert params["sensitivity_unit"] == pytest.approx(params["lipschitz"] / (lam * n) + tau,
                                                       rel=1e-12)
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=multiplier,
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    recomputed = pld.get_epsilon_for_delta(DELTA)
    # the same as a Gaussian of sensitivity 2 units (a replacement moves the solution by 2 units)
    shifted = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=multiplier, sensitivity=2.0).get_epsilon_for_delta(DELTA)
    assert recomputed == pytest.approx(shifted, rel=1e-3)
    assert recomputed <= epsilon * (1 + 1e-3)
    assert recomputed == pytest.approx(report["epsilon"], rel=2e-3)
    assert 0.99 * epsilon <= report["epsilon"] <= epsilon


def test_released_model_is_the_certified_solution_plus_the_planned_gaussian():
    """Seed fixed: the model minus the noiseless certified solution (the same deterministic
    solve, rerun) is N(0, sigma^2) per coordinate, sigma the plan's; over D = 401 coordinates the
    mean square / sigma^2 is 1 within 5 of its standard deviations sqrt(2 / D)."""
    g = np.random.default_rng(5)
    n, d = 600, 400
    x = g.standard_normal((n, d)) / math.sqrt(d)
    y = np.where(g.random(n) < 0.5, -1.0, 1.0)
    block = Block(x, y)
    loss = losses.make_loss("logistic")
    problem = Problem(loss, d, Privacy(epsilon=1.0, delta=DELTA, num_examples=n), fit_intercept=True)
    options = spec.make_options(outp.OutputPerturbationOptions, {"feature_bound": 1.0})
    ledger = accounting.Ledger("pld", accounting.REPLACE_ONE)
    result = outp.train(options, problem, LocalAggregator([block]), 11, ledger, lambda *a: None)
    plan = result.preprocessing
    gradient = outp.InterceptAsCoordinate(objective.GlmGradient(loss, features.ClipRows(1.0), True))
    solution = outp.noiseless_solution(LocalAggregator([block]), gradient,
                                       options.constraint_set(d), d + 1, n, plan)
    z = (result.theta[0] - solution) / plan["sigma"]
    assert z.size == d + 1
    assert abs(float(np.mean(z ** 2)) - 1.0) < 5 * math.sqrt(2.0 / z.size), np.mean(z ** 2)
    assert abs(float(np.mean(z))) < 5 / math.sqrt(z.size)
    # the noise dominates the solver's error tau by construction (1%)
    assert plan["solver_distance"] <= 0.011 * plan["sensitivity_unit"]
    (entry,) = ledger.releases
    assert entry.name == outp.RELEASE
    # another seed: another draw of the same law
    ledger2 = accounting.Ledger("pld", accounting.REPLACE_ONE)
    other = outp.train(options, problem, LocalAggregator([block]), 12, ledger2, lambda *a: None)
    assert not np.allclose(other.theta, result.theta)


# ============================================================== 3. refusals

@pytest.mark.parametrize("request_,match", [
    (dict(noise="secure"), "output-perturbation has no secure noise"),
    (dict(count_epsilon=0.1), "spends no budget on a count"),
    (dict(accountant="rdp"), "use --accountant pld"),
    (dict(epsilon=None, noise_multiplier=1.0), "give --epsilon"),
    (dict(model="softmax", num_classes=3), "does not fit --model softmax"),
    (dict(model="linear"), "does not fit --model linear"),
    (dict(constraint="simplex"), "--constraint must be one of"),
    (dict(constraint="l1-ball"), "needs --no-intercept"),
])
def test_refusals_are_clear(request_, match):
    x, y = _dense(n=200, d=3)
    with pytest.raises(ValueError, match=match):
        _train(x, y, **request_)


def test_constraint_without_intercept_projects_in_linf():
    x, y = _dense(n=1000, d=8, seed=4)
    model = _train(x, y, constraint="box", radius=0.05, fit_intercept=False)
    assert model.intercept == 0.0
    assert np.abs(model.coefficients).max() <= 0.05 + 1e-15
    assert model.artifact["constraint"]["kind"] == "box"


def test_listed_by_beam_dp_algorithms_and_takes_categorical_columns(cli):
    assert registry.get(NAME).sparse_input
    r = cli("algorithms")
    assert r.code == 0 and NAME in r.out, r


@pytest.mark.parametrize("dim,n,binds", [(2 ** 18, 200_000, "noise"), (2 ** 18, 50_000, "noise"),
                                         (11, 50_000, "box")])
def test_default_model_norm_is_the_unit_box_capped_by_the_score_noise(dim, n, binds):
    """Without a constraint or --model-norm, D = min(sqrt(d), the D whose Gaussian has std
    SCORE_NOISE on a row's score): with 2^18 columns the cap binds and sigma L is 1/2, the
    certified distance tau included (float64's rounding bound makes tau far above 1% of
    L / (lambda n) there: at 200,000 rows, 3 times it); with 11 columns the box binds and the
    noise on a score is below 1/2."""
    L = math.sqrt(5.0)
    smooth = objective.Smoothness(L, L ** 2 / 4, 0.0, 1)
    plan = outp.plan_release(smooth, outp.geometry.Constraint("none", 1.0), dim, n, 1.0, DELTA,
                             5, rows_per_n=objective.ROUNDED_COUNT_RATIO)
    spread = L / (plan["regularization"] * n)
    assert plan["solver_distance"] >= outp.SOLVER_FRACTION * spread * (1 - 1e-9)
    assert plan["sigma"] == pytest.approx(plan["noise_multiplier"]
                                          * (spread + plan["solver_distance"]), rel=1e-12)
    k = outp.noise_constant(L, 5, dim, n, 1.0, DELTA)
    assert plan["regularization"] == pytest.approx(math.sqrt(2 * k) / plan["diameter"], rel=1e-12)
    if binds == "noise":
        assert plan["diameter"] < math.sqrt(dim)
        assert plan["sigma"] * L == pytest.approx(outp.SCORE_NOISE, rel=1e-9)
        assert plan["diameter_source"].startswith("the cap")
    else:
        assert plan["diameter"] == pytest.approx(math.sqrt(dim), rel=1e-12)
        assert plan["sigma"] * L < outp.SCORE_NOISE
        assert plan["diameter_source"].startswith("the unit box")
