"""Gaussian widths G_C = E sup_{w in C} <xi, w>, xi ~ N(0, I_d) (Def. 12, note 4.2 and 6.6): in
closed form or by quadrature for the balls, simplex and box, by Monte Carlo for any support
function."""
from __future__ import annotations

import math

import numpy as np
import scipy.integrate
import scipy.special

from beam_dp.geometry.checks import _check_d, _check_radius, _quiet
from beam_dp.geometry.projections import _box_bounds


def gaussian_width_l2_ball(d: int, radius: float = 1.0) -> float:
    """R E||xi||_2 = R sqrt(2) Gamma((d + 1)/2) / Gamma(d/2) (the chi_d mean), via log-gamma."""
    d = _check_d(d)
    return _check_radius(radius) * math.sqrt(2.0) * math.exp(
        math.lgamma((d + 1) / 2.0) - math.lgamma(d / 2.0))


def _quad(f, a: float, b: float, points) -> float:
    value, _ = scipy.integrate.quad(f, a, b, points=points, limit=400, epsabs=1e-13, epsrel=1e-12)
    return float(value)


def gaussian_width_l1_ball(d: int, radius: float = 1.0) -> float:
    """R E||xi||_inf = R * integral_0^inf (1 - erf(t / sqrt 2)^d) dt (tail formula for E of a
    non-negative variable; P(max|xi_i| <= t) = erf(t/sqrt 2)^d), by adaptive quadrature.

    1 - erf^d is evaluated as -expm1(d log1p(-erfc)) so that it keeps full relative precision in
    the tail and for d up to ~1e15. The integral is cut at t_max = sqrt(2 ln 2d) + 12, beyond which
    the integrand is below 2d * exp(-t^2 / 2) < 1e-31; quadrature error ~1e-12 absolute.
    Grows like sqrt(2 ln 2d) (note 4.2: G <= R sqrt(2 ln 2d)).
    """
    radius, d = _check_radius(radius), _check_d(d)
    center = math.sqrt(2.0 * math.log(2.0 * d))

    def tail(t):
        with _quiet():       # t = 0: log1p(-1) = -inf, and the integrand is then exactly 1
            return float(-np.expm1(d * np.log1p(-scipy.special.erfc(t / math.sqrt(2.0)))))
    return radius * _quad(tail, 0.0, center + 12.0, [center])


def gaussian_width_simplex(d: int, radius: float = 1.0) -> float:
    """R E max_i xi_i = R * (integral_0^inf (1 - Phi^d) - integral_{-inf}^0 Phi^d) dt, by adaptive
    quadrature with log Phi = scipy.special.log_ndtr (stable in both tails). Exact values for
    checks: 0 (d = 1), 1/sqrt(pi) (d = 2), 3/(2 sqrt(pi)) (d = 3). The lower integral is cut at
    t = -40 (integrand <= Phi(-40) < 1e-300)."""
    radius, d = _check_radius(radius), _check_d(d)
    center = math.sqrt(2.0 * math.log(d)) if d > 1 else 0.0

    def upper(t):
        return -math.expm1(d * scipy.special.log_ndtr(t))

    def lower(t):
        return math.exp(d * scipy.special.log_ndtr(t))
    above = _quad(upper, 0.0, center + 12.0, [center] if center > 0 else None)
    return radius * (above - _quad(lower, -40.0, 0.0, None))


def gaussian_width_box(low, high, d: int) -> float:
    """sum_i (high_i - low_i) / sqrt(2 pi): sup over the box is sum_i max(xi_i high_i, xi_i low_i),
    and E[xi 1{xi > 0}] = -E[xi 1{xi < 0}] = 1/sqrt(2 pi). ([-R, R]^d: R d sqrt(2/pi).)"""
    low, high = _box_bounds(low, high, _check_d(d))
    with _quiet():
        return float(np.sum(high - low) / math.sqrt(2.0 * math.pi))


def gaussian_width_mc(support, d: int, n_draws: int, rng: np.random.Generator,
                      chunk: int = 4096) -> tuple[float, float]:
    """Monte Carlo (mean, standard error) of E h_C(xi) for a support function ``support`` mapping
    an (m, d) array of xi's to their m values sup_{w in C} <xi, w> (exact per draw). In chunks,
    so that a hull with many vertices does not need an n_draws x k matrix."""
    if int(n_draws) < 2:
        raise ValueError("n_draws must be at least 2 (for a standard error)")
    values = []
    left = int(n_draws)
    while left > 0:
        m = min(chunk, left)
        values.append(np.asarray(support(rng.standard_normal((m, int(d)))), dtype=np.float64))
        left -= m
    values = np.concatenate(values)
    return float(np.mean(values)), float(np.std(values, ddof=1) / math.sqrt(values.size))
