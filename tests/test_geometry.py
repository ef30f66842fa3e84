"""Tests of beam_dp.geometry: norms, mirror map, generalized-Gaussian sampler, projections,
Gaussian widths and the Constraint record (note 004, sections 1, 4.2, 6 and 9).

Every random draw is seeded, so each test is deterministic. Statistical tests (KS, chi-square,
Monte Carlo within 4 standard errors) use fixed seeds and thresholds that a correct
implementation passes with a wide margin; each was also checked to fail on a deliberately
broken implementation (a wrong radial law, a wrong direction law, a wrong projection).
"""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import scipy.integrate
import scipy.optimize
import scipy.stats

from beam_dp import geometry as geo


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(20240613, spawn_key=key))


# ------------------------------------------------------------------------------------------------
# Norms and duality


@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, 3.0, 20.0, math.inf])
def test_lp_norm_matches_numpy_row_wise(p):
    x = _rng(1).normal(size=(7, 9))
    expected = np.linalg.norm(x, ord=p, axis=-1)
    np.testing.assert_allclose(geo.lp_norm(x, p), expected, rtol=1e-13)
    np.testing.assert_allclose(geo.lp_norm(x, p, keepdims=True)[:, 0], expected, rtol=1e-13)
    np.testing.assert_allclose(geo.lp_norm(x.T, p, axis=0), expected, rtol=1e-13)


@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, 3.0, 19.4, math.inf])
def test_lp_norm_does_not_overflow_or_underflow(p):
    for scale in (1e200, 1e-200, 1e300):
        x = np.array([1.0, -0.5, 0.25]) * scale
        exact = (np.linalg.norm([1.0, -0.5, 0.25], ord=p)) * scale
        got = geo.lp_norm(x, p)
        assert np.isfinite(got) and got > 0
        assert got == pytest.approx(exact, rel=1e-14)
    assert geo.lp_norm(np.zeros(4), p) == 0.0
    assert geo.lp_norm(np.array([1e200, 1.0]), p) == pytest.approx(1e200, rel=1e-15)


def test_dual_exponent_and_invalid_exponents():
    assert geo.dual_exponent(1.0) == math.inf
    assert geo.dual_exponent(math.inf) == 1.0
    assert geo.dual_exponent(2.0) == 2.0
    assert geo.dual_exponent(1.5) == pytest.approx(3.0)
    assert geo.dual_exponent(geo.dual_exponent(1.3)) == pytest.approx(1.3)
    for bad in (0.5, -1.0, float("nan")):
        with pytest.raises(ValueError):
            geo.lp_norm(np.ones(2), bad)
        with pytest.raises(ValueError):
            geo.dual_exponent(bad)


@pytest.mark.parametrize("p", [1.0, 1.3, 2.0, 3.0, math.inf])
def test_dual_norm_is_the_supremum_and_attained(p):
    """||y||_* = sup_{||x||_p <= 1} <x, y>: Hoelder on random x, equality at the known maximiser
    x* = sign(y) |y|^(q-1) / ||y||_q^(q-1) (for q = inf / 1: a signed coordinate / sign(y))."""
    rng = _rng(2)
    q = geo.dual_exponent(p)
    for _ in range(20):
        y = rng.normal(size=6)
        dual = geo.dual_norm(y, p)
        x = rng.normal(size=(50, 6))
        assert np.all(x @ y <= geo.lp_norm(x, p) * dual * (1 + 1e-12))
        if q == math.inf:
            best = np.zeros(6)
            best[np.argmax(np.abs(y))] = np.sign(y[np.argmax(np.abs(y))])
        elif q == 1.0:
            best = np.sign(y)
        else:
            best = np.sign(y) * (np.abs(y) / geo.lp_norm(y, q)) ** (q - 1)
        assert geo.lp_norm(best, p) == pytest.approx(1.0, rel=1e-12)
        assert best @ y == pytest.approx(dual, rel=1e-12)


def test_lp_exponents_follow_the_errata():
    """kappa = min{1/(p-1), 2 ln d}; the mirror exponent is r = 1 + 1/kappa (erratum 9.1, not the
    paper's kappa/(kappa-1), which is 2 at p = 1.5); the noise norm is r_q = min{q, 2 ln d + 1}."""
    d = 10_000
    assert geo.kappa_lp(1.5, d) == pytest.approx(2.0)
    assert geo.mirror_exponent(1.5, d) == pytest.approx(1.5)
    assert geo.mirror_exponent(1.2, d) == pytest.approx(1.2)
    assert geo.mirror_exponent(1.01, d) == pytest.approx(1 + 1 / (2 * math.log(d)))
    assert geo.mirror_exponent(2.0, d) == pytest.approx(2.0)
    assert geo.noise_norm_exponent(1.5, d) == pytest.approx(3.0)
    assert geo.noise_norm_exponent(1.01, d) == pytest.approx(2 * math.log(d) + 1)
    assert geo.kappa_lp(1.5, 1) == 1.0 and geo.mirror_exponent(1.5, 1) == 2.0
    for bad in (1.0, 2.5, math.inf):
        with pytest.raises(ValueError):
            geo.mirror_exponent(bad, d)


# ------------------------------------------------------------------------------------------------
# Mirror map Phi_r(x) = ||x||_r^2 / (2 (r - 1))

MIRROR_EXPONENTS = [1.05, 1.3, 1.5, 1 + 1 / (2 * math.log(1e4)), 2.0]


@pytest.mark.parametrize("r", MIRROR_EXPONENTS)
def test_mirror_grad_inverse_round_trip(r):
    x = _rng(3).standard_t(3, size=(200, 12)) * np.exp(_rng(4).normal(size=(200, 1)) * 3)
    back = geo.mirror_grad_inverse(geo.mirror_grad(x, r), r)
    err = geo.lp_norm(back - x, math.inf) / geo.lp_norm(x, math.inf)
    assert np.max(err) < 1e-10
    y = _rng(5).normal(size=(50, 12))                       # and the other way round
    back = geo.mirror_grad(geo.mirror_grad_inverse(y, r), r)
    assert np.max(geo.lp_norm(back - y, math.inf) / geo.lp_norm(y, math.inf)) < 1e-10


@pytest.mark.parametrize("r", MIRROR_EXPONENTS)
def test_mirror_map_strong_convexity_and_gradient(r):
    """D_Phi(y, x) >= (1/2)||y - x||_r^2 on random pairs (1-strong convexity w.r.t. ||.||_r),
    the gradient against central finite differences, and Fenchel-Young with equality."""
    rng = _rng(6)
    x = rng.normal(size=(400, 8)) * rng.choice([0.01, 1.0, 100.0], size=(400, 1))
    y = x + rng.normal(size=(400, 8)) * rng.choice([1e-3, 0.1, 10.0], size=(400, 1))
    bregman = geo.bregman_divergence(y, x, r)
    half_sq = 0.5 * geo.lp_norm(y - x, r) ** 2
    scale = geo.mirror_map(x, r) + geo.mirror_map(y, r)
    assert np.all(bregman >= half_sq - 1e-12 * scale)
    x0 = rng.choice([-1.0, 1.0], size=8) * rng.uniform(0.2, 2.0, size=8)   # away from the kinks
    g = geo.mirror_grad(x0, r)
    h = 1e-6
    for i in range(8):
        e = np.zeros(8)
        e[i] = h
        fd = (geo.mirror_map(x0 + e, r) - geo.mirror_map(x0 - e, r)) / (2 * h)
        assert fd == pytest.approx(g[i], rel=1e-6)
    grads = geo.mirror_grad(x, r)
    np.testing.assert_allclose(geo.mirror_map(x, r) + geo.mirror_conjugate(grads, r),
                               np.sum(x * grads, axis=-1), rtol=1e-12)


def test_mirror_map_edge_cases():
    for r in (1.05, 1.5, 2.0):
        assert np.all(geo.mirror_grad(np.zeros(3), r) == 0)
        assert np.all(geo.mirror_grad_inverse(np.zeros(3), r) == 0)
        big = np.array([1e200, -3e199, 0.0])
        g = geo.mirror_grad(big, r)
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(geo.mirror_grad_inverse(g, r), big, rtol=1e-12)
        assert geo.mirror_grad(np.array([-2.0]), r)[0] == pytest.approx(-2.0 / (r - 1))
    np.testing.assert_allclose(geo.mirror_grad(np.arange(4.0), 2.0), np.arange(4.0))
    for bad in (1.0, 2.5):
        with pytest.raises(ValueError):
            geo.mirror_grad(np.ones(2), bad)


# ------------------------------------------------------------------------------------------------
# Generalized Gaussian sampler

GG_CASES = [(d, r) for d in (1, 3, 20) for r in (1.0, 1.5, 3.0, 19.4, math.inf)]


@pytest.mark.parametrize("d,r", GG_CASES)
def test_gg_radial_law_is_sigma_chi_d(d, r):
    """||z||_r / sigma ~ chi_d exactly (the radial density rho^(d-1) exp(-rho^2 / (2 sigma^2)))."""
    sigma = 1.7
    z = geo.sample_gg(_rng(7, d, int(r) if r < 100 else 100), d, r, sigma, size=3000)
    assert z.shape == (3000, d)
    radii = geo.lp_norm(z, r)
    assert scipy.stats.kstest(radii, scipy.stats.chi(d, scale=sigma).cdf).pvalue > 1e-3


@pytest.mark.parametrize("d,r", [(d, r) for d, r in GG_CASES if d > 1 and r < math.inf])
def test_gg_direction_is_cone_measure(d, r):
    """Under the cone measure of the unit r-sphere, (|theta_i|^r) is Dirichlet(1/r, ..., 1/r), so
    |z_1|^r / ||z||_r^r ~ Beta(1/r, (d - 1)/r): an exact law of the direction, independent of the
    radial one (a sampler that normalised Gaussian coordinates would fail it for r != 2)."""
    z = geo.sample_gg(_rng(8, d, int(r)), d, r, 0.3, size=3000)
    share = (np.abs(z[:, 0]) / geo.lp_norm(z, r)) ** r
    law = scipy.stats.beta(1.0 / r, (d - 1.0) / r)
    assert scipy.stats.kstest(share, law.cdf).pvalue > 1e-3


def test_gg_with_r_2_is_the_isotropic_gaussian():
    sigma = 0.7
    z = geo.sample_gg(_rng(9), 10, 2.0, sigma, size=4000)
    normal = scipy.stats.norm(scale=sigma).cdf
    assert scipy.stats.kstest(z[:, 3], normal).pvalue > 1e-3
    a = _rng(10).normal(size=10)
    assert scipy.stats.kstest(z @ a / np.linalg.norm(a), normal).pvalue > 1e-3
    cov = np.cov(z.T) / sigma ** 2
    assert np.max(np.abs(cov - np.eye(10))) < 0.1


@pytest.mark.parametrize("r", [1.0, 3.0, math.inf])
def test_gg_in_one_dimension_is_normal(r):
    z = geo.sample_gg(_rng(11, int(min(r, 9))), 1, r, 2.0, size=4000)[:, 0]
    assert scipy.stats.kstest(z, scipy.stats.norm(scale=2.0).cdf).pvalue > 1e-3


@pytest.mark.parametrize("r", [1.0, 4.0])
def test_gg_density_against_quadrature_in_two_dimensions(r):
    """A check independent of the polar decomposition: the normaliser of exp(-||z||_r^2 / 2) on
    R^2 (gg_log_normalizer, i.e. Def. 4 with the cone measure) and the law of z_1 in 6 bins, both
    by numerical integration of the density itself, against 20,000 draws (chi-square test)."""
    def density(z2, z1):
        return math.exp(-0.5 * (abs(z1) ** r + abs(z2) ** r) ** (2.0 / r))

    def marginal(z1):
        return 2.0 * scipy.integrate.quad(lambda z2: density(z2, z1), 0, np.inf)[0]
    total = 2.0 * scipy.integrate.quad(marginal, 0, np.inf)[0]
    assert math.log(total) == pytest.approx(geo.gg_log_normalizer(2, r), rel=1e-8)
    edges = [-np.inf, -1.2, -0.5, 0.0, 0.5, 1.2, np.inf]
    probs = np.array([scipy.integrate.quad(marginal, a, b)[0] for a, b in itertools.pairwise(edges)])
    probs /= total
    z = geo.sample_gg(_rng(12, int(r)), 2, r, 1.0, size=20_000)
    counts = np.histogram(z[:, 0], bins=edges)[0]
    assert scipy.stats.chisquare(counts, probs * counts.sum()).pvalue > 1e-3


def test_gg_normalizer_closed_forms():
    assert geo.gg_log_normalizer(3, 2.0, 1.3) == pytest.approx(1.5 * math.log(2 * math.pi * 1.3 ** 2))
    assert geo.gg_log_normalizer(2, 1.0) == pytest.approx(math.log(4.0))   # 2 vol(B_1^2) 2^0 0!
    assert geo.gg_log_normalizer(2, math.inf) == pytest.approx(math.log(8.0))


def test_gg_second_moment_determinism_and_edge_cases():
    d, sigma = 7, 0.5
    z = geo.sample_gg(_rng(13), d, 3.0, sigma, size=20_000)
    sq = geo.lp_norm(z, 3.0) ** 2
    assert abs(sq.mean() - d * sigma ** 2) < 4 * sq.std() / math.sqrt(sq.size)   # E = d sigma^2
    a = geo.sample_gg(np.random.default_rng(5), 4, 1.5, 1.0, size=3)
    b = geo.sample_gg(np.random.default_rng(5), 4, 1.5, 1.0, size=3)
    assert np.array_equal(a, b)
    assert geo.sample_gg(np.random.default_rng(5), 4, 1.5, 1.0).shape == (4,)
    assert np.all(geo.sample_gg(np.random.default_rng(5), 4, 1.5, 0.0, size=2) == 0)
    huge_r = geo.sample_gg(np.random.default_rng(5), 1, 1e6, 1.0, size=2000)
    assert np.all(np.isfinite(huge_r))
    for bad in ({"d": 0}, {"r": 0.5}, {"sigma": -1.0}, {"sigma": math.inf}):
        kwargs = {"d": 3, "r": 2.0, "sigma": 1.0} | bad
        with pytest.raises(ValueError):
            geo.sample_gg(np.random.default_rng(0), **kwargs)


# ------------------------------------------------------------------------------------------------
# Projections: against a generic solver, and their defining properties

KINDS_WITH_SETS = ["l2-ball", "l1-ball", "simplex", "box", "hull"]


def _constraint(kind: str, d: int, rng: np.random.Generator) -> geo.Constraint:
    if kind == "box":
        low = rng.uniform(-2, 0.5, size=d)
        return geo.Constraint("box", low=low, high=low + rng.uniform(0, 2, size=d))
    if kind == "hull":
        return geo.Constraint("hull", vertices=rng.normal(size=(int(rng.integers(1, 9)), d)) + 0.3)
    return geo.Constraint(kind, radius=float(rng.uniform(0.5, 2.0)))


def _generic_projection(c: geo.Constraint, x: np.ndarray) -> np.ndarray:
    """The projection by scipy's SLSQP on the defining constraints (a reference that shares no
    code with geometry)."""
    d = x.size
    opts = {"ftol": 1e-15, "maxiter": 1000}

    def sq(w):
        return float(np.sum((w - x) ** 2)), 2 * (w - x)
    if c.kind == "l2-ball":
        cons = [{"type": "ineq", "fun": lambda w: c.radius ** 2 - w @ w, "jac": lambda w: -2 * w}]
        res = scipy.optimize.minimize(sq, np.zeros(d), jac=True, method="SLSQP",
                                      constraints=cons, options=opts)
        return res.x
    if c.kind == "l1-ball":          # w = u - v with u, v >= 0 and sum(u + v) <= R
        def obj(uv):
            r = uv[:d] - uv[d:] - x
            return float(r @ r), np.concatenate([2 * r, -2 * r])
        cons = [{"type": "ineq", "fun": lambda uv: c.radius - np.sum(uv),
                 "jac": lambda uv: -np.ones(2 * d)}]
        res = scipy.optimize.minimize(obj, np.zeros(2 * d), jac=True, method="SLSQP",
                                      bounds=[(0, None)] * (2 * d), constraints=cons, options=opts)
        return res.x[:d] - res.x[d:]
    if c.kind == "simplex":
        cons = [{"type": "eq", "fun": lambda w: np.sum(w) - c.radius, "jac": lambda w: np.ones(d)}]
        res = scipy.optimize.minimize(sq, np.full(d, c.radius / d), jac=True, method="SLSQP",
                                      bounds=[(0, None)] * d, constraints=cons, options=opts)
        return res.x
    if c.kind == "box":
        res = scipy.optimize.minimize(sq, (c.low + c.high) / 2, jac=True, method="SLSQP",
                                      bounds=list(zip(c.low, c.high)), options=opts)
        return res.x
    V = c.vertices
    k = V.shape[0]

    def obj(lam):
        r = lam @ V - x
        return float(r @ r), 2 * V @ r
    cons = [{"type": "eq", "fun": lambda lam: np.sum(lam) - 1, "jac": lambda lam: np.ones(k)}]
    res = scipy.optimize.minimize(obj, np.full(k, 1.0 / k), jac=True, method="SLSQP",
                                  bounds=[(0, None)] * k, constraints=cons, options=opts)
    return res.x @ V


def _points_of(c: geo.Constraint, d: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n points of C, drawn directly from its definition."""
    if c.kind == "l2-ball":
        u = rng.normal(size=(n, d))
        return u / np.linalg.norm(u, axis=1, keepdims=True) * c.radius * rng.uniform(size=(n, 1))
    if c.kind == "l1-ball":
        return (rng.choice([-1.0, 1.0], size=(n, d)) * rng.dirichlet(np.ones(d), size=n)
                * c.radius * rng.uniform(size=(n, 1)))
    if c.kind == "simplex":
        return rng.dirichlet(np.ones(d), size=n) * c.radius
    if c.kind == "box":
        return rng.uniform(c.low, c.high, size=(n, d))
    return rng.dirichlet(np.ones(c.vertices.shape[0]), size=n) @ c.vertices


@pytest.mark.parametrize("kind", KINDS_WITH_SETS)
def test_projection_matches_a_generic_solver(kind):
    """On random constraint sets and points (d = 1..6, inside and far outside): our distance is
    within 1e-6 relative of SLSQP's optimum, and our point is in C (SLSQP's is only to ~1e-8, so
    "never worse than SLSQP" holds only up to that)."""
    rng = _rng(20, KINDS_WITH_SETS.index(kind))
    worst = 0.0
    for trial in range(30):
        d = int(rng.integers(1, 7))
        c = _constraint(kind, d, rng)
        x = rng.normal(size=d) * rng.choice([0.1, 1.0, 3.0, 30.0])
        ours = c.project(x)
        reference = _generic_projection(c, x)
        assert c.contains(ours, tol=1e-12)
        assert c.contains(reference, tol=1e-5)          # SLSQP converged (to its ~1e-6 accuracy)
        mine, theirs = np.linalg.norm(ours - x), np.linalg.norm(reference - x)
        scale = c.scale(d)
        assert abs(mine - theirs) <= 1e-6 * theirs + 1e-7 * scale     # inside: both ~0
        worst = max(worst, abs(mine - theirs) / max(theirs, 0.1 * scale))
    assert worst < 1e-6


@pytest.mark.parametrize("kind", KINDS_WITH_SETS)
def test_projection_variational_inequality_and_idempotence(kind):
    """P(x) is the projection iff <x - P(x), w - P(x)> <= 0 for every w in C; checked on 200
    points of C drawn from its definition. Also P(P(x)) = P(x), and batches equal rows."""
    rng = _rng(21, KINDS_WITH_SETS.index(kind))
    for trial in range(15):
        d = int(rng.integers(1, 9))
        c = _constraint(kind, d, rng)
        x = rng.normal(size=(6, d)) * 4
        p = c.project(x)
        np.testing.assert_array_equal(p, np.stack([c.project(row) for row in x]))
        w = _points_of(c, d, 200, rng)
        scale = c.scale(d)
        for xi, pi in zip(x, p):
            assert np.max((w - pi) @ (xi - pi)) <= 1e-10 * scale * (scale + np.linalg.norm(xi))
        np.testing.assert_allclose(c.project(p), p, rtol=0, atol=1e-12 * scale)
        assert np.all(c.contains(p, tol=1e-12))


@pytest.mark.parametrize("kind", KINDS_WITH_SETS)
def test_points_inside_stay_fixed(kind):
    rng = _rng(22, KINDS_WITH_SETS.index(kind))
    for trial in range(15):
        d = int(rng.integers(1, 9))
        c = _constraint(kind, d, rng)
        w = _points_of(c, d, 20, rng)
        p = c.project(w)
        if kind in ("l2-ball", "l1-ball", "box"):
            np.testing.assert_array_equal(p, w)                    # exactly
        else:
            np.testing.assert_allclose(p, w, rtol=0, atol=1e-13 * c.scale(d))
        assert np.all(c.contains(w, tol=1e-12))


def test_projection_closed_form_values():
    np.testing.assert_allclose(geo.project_l2_ball(np.array([3.0, 4.0]), 1.0), [0.6, 0.8])
    np.testing.assert_allclose(geo.project_l1_ball(np.array([3.0, -1.0, 0.5]), 2.0), [2.0, 0, 0])
    np.testing.assert_allclose(geo.project_l1_ball(np.array([2.0, -2.0, 0.0]), 2.0), [1, -1, 0])
    np.testing.assert_allclose(geo.project_simplex(np.array([0.3, 0.3, 0.3]), 1.5), [0.5] * 3)
    np.testing.assert_allclose(geo.project_simplex(np.array([5.0, -5.0])), [1.0, 0.0])
    np.testing.assert_array_equal(geo.project_box(np.array([-3.0, 0.5, 9.0]), [-1, 0, 0], 1.0),
                                  [-1.0, 0.5, 1.0])
    tri = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    np.testing.assert_allclose(geo.project_hull(np.array([2.0, 2.0]), tri), [0.5, 0.5], atol=1e-15)
    np.testing.assert_allclose(geo.project_hull(np.array([-1.0, 0.3]), tri), [0.0, 0.3],
                               atol=1e-15)
    np.testing.assert_allclose(geo.project_hull(np.array([1e5, 1e5 + 0.3]), tri), [0.35, 0.65],
                               atol=1e-10)


@pytest.mark.parametrize("kind", KINDS_WITH_SETS)
def test_projection_edge_cases_zero_and_one_dimension(kind):
    rng = _rng(23, KINDS_WITH_SETS.index(kind))
    c = _constraint(kind, 4, rng)
    zero = np.zeros(4)
    np.testing.assert_allclose(c.project(zero), _generic_projection(c, zero), atol=1e-7)
    c1 = _constraint(kind, 1, rng)
    for x in (-5.0, 0.0, 0.4, 7.0):
        ref = _generic_projection(c1, np.array([x]))
        np.testing.assert_allclose(c1.project(np.array([x])), ref, atol=1e-7)
    assert geo.project_simplex(np.array([-3.0]), 2.5)[0] == 2.5
    np.testing.assert_allclose(geo.project_hull(np.array([5.0]), [[1.0], [-2.0]]), [1.0])
    np.testing.assert_allclose(geo.project_hull(np.array([0.5]), [[1.0], [-2.0]]), [0.5])


@pytest.mark.parametrize("kind", KINDS_WITH_SETS)
@pytest.mark.parametrize("scale", [1e200, 1e-200])
def test_projection_is_homogeneous_at_extreme_scales(kind, scale):
    """P_{sC}(s x) = s P_C(x): with s = 1e200 nothing may overflow (squares of 1e200 do), with
    s = 1e-200 nothing may underflow."""
    rng = _rng(24, KINDS_WITH_SETS.index(kind))
    for trial in range(5):
        d = int(rng.integers(1, 6))
        c = _constraint(kind, d, rng)
        record = c.to_json()
        for key in ("radius", "vertices", "low", "high"):
            if record[key] is not None:
                record[key] = (np.asarray(record[key]) * scale).tolist()
        big = geo.Constraint.from_json(record)
        x = rng.normal(size=d) * 5
        got = big.project(x * scale)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got / scale, c.project(x), rtol=1e-12, atol=1e-12 * c.scale(d))


def test_huge_points_against_small_sets():
    """A finite 1e200 point (its squared norm overflows) projects without inf/NaN."""
    x = np.array([1e200, 1e199, -1e200])
    np.testing.assert_allclose(geo.project_l2_ball(x, 1.0), x / np.linalg.norm(x / 1e200) / 1e200)
    np.testing.assert_allclose(geo.project_l1_ball(x, 1.0), [0.5, 0.0, -0.5])
    np.testing.assert_allclose(geo.project_simplex(x, 1.0), [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(geo.project_box(x, -1.0, 2.0), [2.0, 2.0, -1.0])
    extreme = np.array([1e308, 1e308, -1e308])          # differences and norms overflow
    np.testing.assert_allclose(geo.project_l2_ball(extreme, 1.0), [1, 1, -1] / np.sqrt(3))
    np.testing.assert_allclose(geo.project_l1_ball(extreme, 3.0), [1.0, 1.0, -1.0])
    np.testing.assert_allclose(geo.project_simplex(extreme, 1.0), [0.5, 0.5, 0.0])
    tri = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    np.testing.assert_allclose(geo.project_hull(np.array([1e200, 1e199]), tri), [1.0, 0.0])
    np.testing.assert_allclose(geo.project_hull(np.array([-1e300, -1e299]), tri), [0.0, 0.0])
    np.testing.assert_allclose(geo.project_hull(np.array([1e7, 1e7 + 10.0]), tri), [0.0, 1.0])
    on_edge = geo.project_hull(np.array([1e200, 1e200]), tri)       # any point of the exposed
    assert np.sum(on_edge) == pytest.approx(1.0) and np.all(on_edge >= -1e-15)   # edge is right


def test_hull_fallback_agrees_with_the_active_set():
    """The accelerated projected-gradient fallback reaches the active set's answer."""
    rng = _rng(25)
    for trial in range(30):
        d, k = int(rng.integers(1, 7)), int(rng.integers(1, 15))
        V = rng.normal(size=(k, d))
        x = rng.normal(size=d) * rng.choice([0.3, 3.0, 300.0])
        np.testing.assert_allclose(geo.project_hull(x, V, method="apg"), geo.project_hull(x, V),
                                   rtol=0, atol=1e-9)
    V = rng.normal(size=(12, 3))
    inside = rng.dirichlet(np.ones(12)) @ V
    np.testing.assert_allclose(geo.project_hull(inside, V, method="apg"), inside, atol=1e-12)


def test_projections_refuse_bad_input():
    with pytest.raises(ValueError, match="non-finite"):
        geo.project_l2_ball(np.array([1.0, np.nan]), 1.0)
    with pytest.raises(ValueError, match="radius"):
        geo.project_l1_ball(np.ones(2), 0.0)
    with pytest.raises(ValueError):
        geo.project_box(np.ones(3), [0.0, 0.0], 1.0)
    with pytest.raises(ValueError):
        geo.project_hull(np.ones(3), np.ones((2, 3)), method="slsqp")


# ------------------------------------------------------------------------------------------------
# Gaussian widths


def test_gaussian_width_exact_small_cases():
    sqrt_pi = math.sqrt(math.pi)
    assert geo.gaussian_width_l2_ball(1) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-14)
    assert geo.gaussian_width_l2_ball(2, 3.0) == pytest.approx(3 * math.sqrt(math.pi / 2), rel=1e-14)
    assert geo.gaussian_width_l2_ball(10 ** 6) == pytest.approx(1e3, rel=1e-6)
    assert geo.gaussian_width_l1_ball(1) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-11)
    assert geo.gaussian_width_l1_ball(2, 2.0) == pytest.approx(4 / sqrt_pi, rel=1e-11)  # E max|.|
    assert abs(geo.gaussian_width_simplex(1)) < 1e-12
    assert geo.gaussian_width_simplex(2) == pytest.approx(1 / sqrt_pi, rel=1e-11)
    assert geo.gaussian_width_simplex(3, 2.0) == pytest.approx(3 / sqrt_pi, rel=1e-11)
    assert geo.gaussian_width_box(-2.0, 2.0, 5) == pytest.approx(2 * 5 * math.sqrt(2 / math.pi))
    assert geo.Constraint("none").gaussian_width(3) == math.inf


@pytest.mark.parametrize("kind", ["l2-ball", "l1-ball", "simplex", "box"])
@pytest.mark.parametrize("d", [1, 5, 60, 400])
def test_gaussian_width_closed_form_against_monte_carlo(kind, d):
    rng = _rng(30, d)
    c = _constraint(kind, d, rng)
    mean, se = c.gaussian_width_mc(d, 20_000, rng)
    assert abs(mean - c.gaussian_width(d)) < 4 * se + 1e-12


def test_l1_width_grows_like_sqrt_2_ln_d():
    """G(l1 ball) = E||xi||_inf <= sqrt(2 ln 2d), and G / sqrt(2 ln 2d) increases towards 1; at
    large d it is within 1% of the extreme-value asymptotics for the max of N = 2d half-normals:
    a_N - (ln ln N + ln 4 pi - 2 gamma) / (2 a_N), a_N = sqrt(2 ln N)."""
    ds = [10, 100, 10 ** 4, 10 ** 6, 10 ** 9]
    widths = [geo.gaussian_width_l1_ball(d) for d in ds]
    ratios = [w / math.sqrt(2 * math.log(2 * d)) for w, d in zip(widths, ds)]
    assert all(r < 1 for r in ratios)
    assert all(a < b for a, b in itertools.pairwise(ratios))
    assert ratios[-1] > 0.93
    for d, w in zip(ds[2:], widths[2:]):
        a = math.sqrt(2 * math.log(2 * d))
        gumbel = a - (math.log(math.log(2 * d)) + math.log(4 * math.pi) - 2 * np.euler_gamma) / (2 * a)
        assert w == pytest.approx(gumbel, rel=0.01)


def test_hull_width_by_monte_carlo():
    """conv{+-R e_i} is the l1 ball and conv{R e_i} the simplex: their Monte Carlo widths match the
    closed forms; the default estimate is deterministic; conv of N unit vectors <= sqrt(2 ln N)."""
    d, R = 30, 1.5
    cross = geo.Constraint("hull", vertices=np.vstack([np.eye(d), -np.eye(d)]) * R)
    mean, se = cross.gaussian_width_mc(d, 20_000, _rng(31))
    assert abs(mean - geo.gaussian_width_l1_ball(d, R)) < 4 * se
    corners = geo.Constraint("hull", vertices=np.eye(d) * R)
    mean, se = corners.gaussian_width_mc(d, 20_000, _rng(32))
    assert abs(mean - geo.gaussian_width_simplex(d, R)) < 4 * se
    assert cross.gaussian_width(d) == cross.gaussian_width(d)
    assert cross.gaussian_width(d, n_draws=20_000) == pytest.approx(
        geo.gaussian_width_l1_ball(d, R), rel=0.02)
    units = _rng(33).normal(size=(50, 80))
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    assert geo.Constraint("hull", vertices=units).gaussian_width(80) <= math.sqrt(2 * math.log(50))


# ------------------------------------------------------------------------------------------------
# Constraint: diameters, validation, JSON


def test_diameters_against_brute_force():
    rng = _rng(40)
    d, R = 4, 1.7
    assert geo.Constraint("l2-ball", R).diameter_l2(d) == 2 * R
    cross = np.vstack([np.eye(d), -np.eye(d)]) * R
    assert geo.Constraint("l1-ball", R).diameter_l2(d) == pytest.approx(
        geo.Constraint("hull", vertices=cross).diameter_l2(d))
    assert geo.Constraint("simplex", R).diameter_l2(d) == pytest.approx(R * math.sqrt(2))
    assert geo.Constraint("simplex", R).diameter_l2(1) == 0.0
    low, high = rng.uniform(-2, 0, size=d), rng.uniform(0, 3, size=d)
    corners = np.array([np.where(bits, high, low) for bits in itertools.product([0, 1], repeat=d)])
    brute = max(np.linalg.norm(a - b) for a in corners for b in corners)
    assert geo.Constraint("box", low=low, high=high).diameter_l2(d) == pytest.approx(brute)
    assert geo.Constraint("box", 2.0).diameter_l2(d) == pytest.approx(4.0 * math.sqrt(d))
    V = rng.normal(size=(40, d)) * 1e150
    brute = max(np.linalg.norm((a - b) / 1e150) for a in V for b in V) * 1e150
    assert geo.Constraint("hull", vertices=V).diameter_l2(d) == pytest.approx(brute, rel=1e-12)
    assert geo.Constraint("none").diameter_l2(d) == math.inf


SECRET = 123.456789


@pytest.mark.parametrize("make,match", [
    (lambda: geo.Constraint("l2-ball", -SECRET), "radius"),
    (lambda: geo.Constraint("l1-ball", math.inf), "radius"),
    (lambda: geo.Constraint("simplex", float("nan")), "radius"),
    (lambda: geo.Constraint("hull"), "vertices"),
    (lambda: geo.Constraint("hull", vertices=[[SECRET, 1.0]]), "columns"),
    (lambda: geo.Constraint("hull", vertices=[[SECRET, 1.0, np.nan]]), "not finite"),
    (lambda: geo.Constraint("hull", vertices=[[SECRET, 1.0, np.inf]]), "not finite"),
    (lambda: geo.Constraint("hull", vertices=[]), "non-empty"),
    (lambda: geo.Constraint("box", low=[0.0, SECRET, 0.0], high=[1.0, 1.0, 1.0]), "low exceeds"),
    (lambda: geo.Constraint("box", low=[0.0, 0.0], high=[1.0, 1.0]), "length 3"),
    (lambda: geo.Constraint("box", low=0.0), "both"),
    (lambda: geo.Constraint("box", low=[0.0, -np.inf, 0.0], high=SECRET), "finite"),
    (lambda: geo.Constraint("l2-ball", 1.0, vertices=[[SECRET] * 3]), "only used by a hull"),
    (lambda: geo.Constraint("l2-ball", 1.0, low=SECRET), "only used by a box"),
])
def test_validate_messages_name_the_problem_but_no_value(make, match):
    c = make()
    with pytest.raises(ValueError, match=match) as info:
        c.validate(3)
    message = str(info.value)
    assert "123" not in message and "nan" not in message and "inf " not in message
    with pytest.raises(ValueError):
        c.project(np.zeros(3))


def test_non_numeric_fields_are_refused_without_echo():
    for kwargs, kind in (({"vertices": [["secret-a", 1.0]]}, "hull"), ({"radius": "secret-b"}, "l2-ball"),
                         ({"low": ["secret-c"], "high": [1.0]}, "box")):
        with pytest.raises(ValueError, match="numeric|a number") as info:
            geo.Constraint(kind, **kwargs)
        assert "secret" not in str(info.value)
    for width in (geo.gaussian_width_l1_ball, geo.gaussian_width_simplex, geo.gaussian_width_l2_ball):
        with pytest.raises(ValueError, match="dimension"):
            width(0)


def test_constraint_kind_and_dimension_checks():
    with pytest.raises(ValueError, match="unknown constraint kind"):
        geo.Constraint("l3-ball")
    with pytest.raises(ValueError, match="positive integer"):
        geo.Constraint("l2-ball").validate(0)
    c = geo.Constraint("none")
    x = _rng(41).normal(size=(3, 4))
    np.testing.assert_array_equal(c.project(x), x)
    assert c.contains(x[0]) is True and np.all(c.contains(x))
    assert geo.Constraint("l2-ball", 1.0).contains(np.array([0.6, 0.8 + 1e-12]))
    assert not geo.Constraint("l2-ball", 1.0).contains(np.array([0.6, 0.8 + 1e-6]))
    assert not geo.Constraint("simplex", 1.0).contains(np.array([0.5, 0.4]))


@pytest.mark.parametrize("kind", KINDS_WITH_SETS + ["none"])
def test_json_round_trip(kind):
    rng = _rng(42, (KINDS_WITH_SETS + ["none"]).index(kind))
    c = _constraint(kind, 5, rng) if kind != "none" else geo.Constraint("none")
    text = json.dumps(c.to_json())
    back = geo.Constraint.from_json(json.loads(text))
    assert back.to_json() == c.to_json()
    x = rng.normal(size=(4, 5)) * 3
    np.testing.assert_array_equal(back.project(x), c.project(x))
    with pytest.raises(ValueError, match="may have only"):
        geo.Constraint.from_json(c.to_json() | {"colour": "red"})
