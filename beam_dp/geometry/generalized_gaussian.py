"""The exact generalized-Gaussian sampler GG_{||.||_r}(0, sigma^2) (Def. 4, note 6.3) and its
log normalizer: the noise of the non-Euclidean algorithms."""
from __future__ import annotations

import math

import numpy as np

from beam_dp.geometry.checks import _check_d
from beam_dp.geometry.norms import lp_norm


def _check_r_any(r: float) -> float:
    r = float(r)
    if not r >= 1.0:
        raise ValueError("the generalized Gaussian needs a norm exponent r in [1, inf]")
    return r


def sample_gg(rng: np.random.Generator, d: int, r: float, sigma: float = 1.0,
              size: int | None = None) -> np.ndarray:
    """Exact draws from GG_{||.||_r}(0, sigma^2): density proportional to exp(-||z||_r^2/(2 sigma^2)).

    The law (polar decomposition w.r.t. the norm, note 6.3): z = R * theta with, independently,

    * R = ||z||_r = sigma * chi_d, i.e. R has density proportional to rho^(d-1) exp(-rho^2/(2 sigma^2))
      (so E ||z||_r^2 = d sigma^2 exactly: Lemma 4 is tight);
    * theta = g / ||g||_r on the unit r-sphere under its cone measure, where g has i.i.d.
      generalized-normal coordinates with density proportional to exp(-|g_i|^r) (Schechtman-Zinn,
      Rachev-Rueschendorf: then g / ||g||_r is cone-distributed and independent of ||g||_r).

    Together: for any f, integral f(||z||) dz = d vol(B_r) integral_0^inf f(rho) rho^(d-1) drho
    (polar formula with the cone measure), which gives the stated density.

    Coordinates: |g_i|^r ~ Gamma(1/r); we draw it as Gamma(1 + 1/r) * U^r (Stuart's identity
    Gamma(a) = Gamma(a + 1) * U^(1/a), exact), i.e. |g_i| = Gamma(1 + 1/r)^(1/r) * U with U uniform on
    (0, 1]. Why: a Gamma(1/r) draw underflows to 0 for large r (shape 1e-6 is below 1e-308 with
    probability ~0.999), this form does not, and r = inf needs no special case (|g_i| = U:
    the uniform cube of note 6.3). U is in (0, 1], so g is never 0 and theta is always defined.

    Returns shape (d,) for size=None, else (size, d). ``rng`` is the caller's generator (the
    driver's private one, note 7 rule 2); the draws are deterministic given its state.
    """
    d = _check_d(d)
    r = _check_r_any(r)
    sigma = float(sigma)
    if not (sigma >= 0.0 and math.isfinite(sigma)):
        raise ValueError("sigma must be finite and non-negative")
    shape = (d,) if size is None else (int(size), d)
    radius = sigma * np.sqrt(2.0 * rng.gamma(d / 2.0, size=shape[:-1] + (1,)))
    inv_r = 0.0 if r == math.inf else 1.0 / r
    magnitude = rng.gamma(1.0 + inv_r, size=shape) ** inv_r * (1.0 - rng.random(size=shape))
    sign = np.where(rng.integers(0, 2, size=shape) == 1, 1.0, -1.0)
    g = sign * magnitude
    return radius * g / lp_norm(g, r, keepdims=True)


def gg_log_normalizer(d: int, r: float, sigma: float = 1.0) -> float:
    """log of integral exp(-||z||_r^2 / (2 sigma^2)) dz = vol(B_r^d) (2 sigma^2)^(d/2) Gamma(d/2 + 1).

    This is 1/C(sigma, d) of Def. 4 with "Area({||x|| = 1})" read as the total cone measure
    d vol(B_r^d); the Euclidean surface area of the unit r-sphere, read literally, is wrong for
    r != 2 (e.g. 4 sqrt(2) instead of 4 for the l1 circle). vol(B_r^d) = (2 Gamma(1 + 1/r))^d /
    Gamma(1 + d/r).
    """
    d = _check_d(d)
    r = _check_r_any(r)
    inv_r = 0.0 if r == math.inf else 1.0 / r
    log_vol = d * math.log(2.0 * math.gamma(1.0 + inv_r)) - math.lgamma(1.0 + d * inv_r)
    return log_vol + 0.5 * d * math.log(2.0 * float(sigma) ** 2) + math.lgamma(d / 2.0 + 1.0)
