"""The p-norm mirror map Phi_r(x) = ||x||_r^2 / (2 (r - 1)), 1 < r <= 2 (note 6.2, exponent per
erratum 9.1): the map, its gradient, conjugate, inverse gradient and Bregman divergence."""
from __future__ import annotations

import numpy as np

from beam_dp.geometry.checks import _quiet
from beam_dp.geometry.norms import lp_norm


def _check_r(r: float) -> float:
    r = float(r)
    if not 1.0 < r <= 2.0:
        raise ValueError("the mirror map Phi_r needs 1 < r <= 2 (it is 1-strongly convex w.r.t. "
                         "||.||_r only there)")
    return r


def _normalized_power(x: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """(||x||_t, sign(x) * (|x| / ||x||_t)^(t-1)) along the last axis, in the "normalised power"
    form of note 6.2: every base is in [0, 1], so nothing overflows even for t ~ 20."""
    n = lp_norm(x, t, keepdims=True)
    with _quiet():
        base = np.abs(x) / np.where(n > 0, n, 1.0)
        return n, np.sign(x) * base ** (t - 1.0)


def mirror_map(x, r: float):
    """Phi_r(x) = ||x||_r^2 / (2 (r - 1)), 1 < r <= 2: 1-strongly convex w.r.t. ||.||_r (because
    (1/2)||.||_r^2 is (r - 1)-strongly convex there), so Bregman steps with it work in l_r."""
    r = _check_r(r)
    n = lp_norm(x, r)
    with _quiet():
        return n * n / (2.0 * (r - 1.0))


def mirror_grad(x, r: float) -> np.ndarray:
    """grad Phi_r(x) = (||x||_r / (r - 1)) * sign(x) * (|x| / ||x||_r)^(r - 1) (0 at x = 0)."""
    r = _check_r(r)
    x = np.asarray(x, dtype=np.float64)
    n, direction = _normalized_power(x, r)
    with _quiet():
        return (n / (r - 1.0)) * direction


def mirror_conjugate(y, r: float):
    """Phi_r^*(y) = ((r - 1) / 2) ||y||_s^2 with s = r / (r - 1), the convex conjugate of Phi_r."""
    r = _check_r(r)
    n = lp_norm(y, r / (r - 1.0))
    with _quiet():
        return 0.5 * (r - 1.0) * n * n


def mirror_grad_inverse(y, r: float) -> np.ndarray:
    """(grad Phi_r)^{-1}(y) = grad Phi_r^*(y) = (r - 1) ||y||_s * sign(y) * (|y| / ||y||_s)^(s - 1),
    s = r / (r - 1) the dual exponent: the map back from the dual (gradient) space in a mirror
    step, e.g. w_{t+1} = grad Phi^*((beta grad Phi(w_t) - c_t) / (alpha + beta)) in Alg 3."""
    r = _check_r(r)
    s = r / (r - 1.0)
    y = np.asarray(y, dtype=np.float64)
    n, direction = _normalized_power(y, s)
    with _quiet():
        return (r - 1.0) * n * direction


def bregman_divergence(y, x, r: float):
    """D_Phi(y, x) = Phi(y) - Phi(x) - <grad Phi(x), y - x> >= (1/2) ||y - x||_r^2 (Def. 8)."""
    y = np.asarray(y, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    return (mirror_map(y, r) - mirror_map(x, r)
            - np.sum(mirror_grad(x, r) * (y - x), axis=-1))
