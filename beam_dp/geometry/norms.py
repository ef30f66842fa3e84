"""Norms and duality (note 6.1): ``lp_norm`` (overflow-safe), ``dual_exponent``, ``dual_norm``,
and the exponents of the l_p algorithms (``kappa_lp``, ``mirror_exponent``,
``noise_norm_exponent``)."""
from __future__ import annotations

import math

import numpy as np

from beam_dp.geometry.checks import _quiet


def _check_p(p: float) -> float:
    p = float(p)
    if not p >= 1.0:        # also refuses NaN
        raise ValueError("the exponent p of an l_p norm must be in [1, inf]")
    return p


def lp_norm(x, p: float, axis: int = -1, keepdims: bool = False):
    """||x||_p along ``axis`` for p in [1, inf], computed as m * ||x / m||_p with m = max |x_i|.

    Why the scaling: |x_i|^p overflows for x_i = 1e200 already at p = 2 (and underflows for
    1e-200), and the exponents used here reach p ~ 2 ln d + 1 ~ 20 (note 6.1). After scaling every
    term is in [0, 1] and the largest is 1, so the sum neither overflows nor loses the largest
    entry; the result is inf only when the norm itself exceeds the float range.
    """
    p = _check_p(p)
    a = np.abs(np.asarray(x, dtype=np.float64))
    if a.ndim == 0:
        raise ValueError("expected a vector (or a stack of vectors on the last axis), got a scalar")
    with _quiet():
        m = np.max(a, axis=axis, keepdims=True, initial=0.0)
        if p == math.inf:
            out = m
        else:
            u = a / np.where((m > 0) & np.isfinite(m), m, 1.0)
            if p == 1.0:
                s = np.sum(u, axis=axis, keepdims=True)
            elif p == 2.0:
                s = np.sqrt(np.sum(u * u, axis=axis, keepdims=True))
            else:
                s = np.sum(u ** p, axis=axis, keepdims=True) ** (1.0 / p)
            out = np.where(np.isinf(m), np.inf, m * s)
    return out if keepdims else np.squeeze(out, axis=axis)


def dual_exponent(p: float) -> float:
    """q with 1/p + 1/q = 1 (1 <-> inf): ||.||_q is the dual norm of ||.||_p (note 1)."""
    p = _check_p(p)
    if p == 1.0:
        return math.inf
    if p == math.inf:
        return 1.0
    return p / (p - 1.0)


def dual_norm(y, p: float, axis: int = -1, keepdims: bool = False):
    """||y||_* = sup_{||x||_p <= 1} <x, y> = ||y||_q, the norm gradients are measured in."""
    return lp_norm(y, dual_exponent(p), axis=axis, keepdims=keepdims)


def _check_p_mirror(p: float, d: int) -> None:
    if not 1.0 < float(p) <= 2.0:
        raise ValueError("the l_p mirror-descent exponents are defined for 1 < p <= 2 (note 2.4; "
                         "for p >= 2 the paper reduces to l_2)")
    if int(d) < 1:
        raise ValueError("the dimension d must be at least 1")


def kappa_lp(p: float, d: int) -> float:
    """kappa = min{1/(p-1), 2 ln d}: the regularity constant of the dual space l_q, q > 2.

    Note 9.2 lists three variants in the paper (2e log d, 2 ln d, log d); we use 2 ln d (the one
    of Alg 3/4 and of the derivation in note 1). Clamped at 1 because Def. 3 requires kappa >= 1:
    only d = 1 is affected (2 ln 1 = 0), where all norms coincide anyway.

    It sets the mirror map's exponent only. It is NOT the constant to calibrate noise with: for
    the pair (q, r_q) with r_q < q, Def. 3's kappa is (r_q - 1) d^(2/r_q - 2/q), up to 2e ln d,
    above this 2 ln d (``mirror_descent.kappa_of``, which the noise uses).
    """
    _check_p_mirror(p, d)
    return max(1.0, min(1.0 / (float(p) - 1.0), 2.0 * math.log(d)))


def mirror_exponent(p: float, d: int) -> float:
    """r = 1 + 1/kappa: the exponent of the mirror map Phi_r for the l_p geometry, 1 < p <= 2.

    This is the corrected exponent of note 9.1 (the paper's literal kappa_+ = kappa/(kappa - 1)
    gives r = 2 at p = 1.5, the Euclidean map). It equals p unless p < 1 + 1/(2 ln d), where
    r = 1 + 1/(2 ln d) and Phi_r is still e^{-1}-strongly convex w.r.t. ||.||_p.
    """
    return 1.0 + 1.0 / kappa_lp(p, d)


def noise_norm_exponent(p: float, d: int) -> float:
    """r_q = min{q, 2 ln d + 1}: the norm ||.||_+ of the generalized-Gaussian noise (note 2.4),
    the smooth norm of the dual l_q. Clamped at 2 (the smooth range; only d = 1 is affected)."""
    _check_p_mirror(p, d)
    return max(2.0, min(dual_exponent(p), 2.0 * math.log(d) + 1.0))
