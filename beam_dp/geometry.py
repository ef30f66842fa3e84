"""Geometry for constrained and non-Euclidean DP optimization (issue 13; paper note 004).

numpy/scipy only (no Beam import): these are driver-side kernels. The DP algorithms of note 004
release a noisy point and then post-process it (a Euclidean projection onto the public constraint
set C, or a mirror step), so nothing here touches private data directly; but their inputs are
private-until-noised values, so nothing here prints or echoes a value, and error messages name
only public quantities (shapes, exponents, the kind of constraint).

Contents, with the note's section:

* norms and duality (6.1): ``lp_norm`` (overflow-safe), ``dual_exponent``, ``dual_norm``, and the
  exponents of the l_p algorithms (``kappa_lp``, ``mirror_exponent``, ``noise_norm_exponent``);
* the p-norm mirror map Phi_r(x) = ||x||_r^2 / (2 (r - 1)), 1 < r <= 2 (6.2 with erratum 9.1);
* the exact generalized-Gaussian sampler GG_{||.||_r}(0, sigma^2) (Def. 4, 6.3);
* Euclidean projections onto the l2 ball, l1 ball, scaled simplex, box and convex hull (6.4);
* Gaussian widths G_C = E sup_{w in C} <xi, w> (Def. 12, 4.2, 6.6);
* ``Constraint``: one public, JSON-serialisable description of C used by all of the above.

Conventions. Vectors live on the last axis: norms, projections (except the hull, one QP per
point), mirror maps and support functions accept (d,) or (n, d). Overflow and underflow are
handled explicitly (a finite 1e200 entry must neither give inf/NaN nor lose the small entries),
so the kernels run under ``np.errstate`` and print nothing: a floating-point warning that
appears only for some inputs would itself say something about them.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.integrate
import scipy.special

KINDS = ("none", "l2-ball", "l1-ball", "simplex", "box", "hull")


def _quiet():
    """Over/underflow and 0/0 are expected below and handled explicitly (see the module doc)."""
    return np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore")


def _as_vectors(x) -> np.ndarray:
    """x as float64 with at least one axis; non-finite entries are refused (they come from a bug
    upstream, and a projection of NaN would silently release NaN)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 0:
        raise ValueError("expected a vector (or a stack of vectors on the last axis), got a scalar")
    if not np.all(np.isfinite(x)):
        raise ValueError("x has non-finite entries")
    return x


# ------------------------------------------------------------------------------------------------
# Norms and duality (note 6.1)


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


# ------------------------------------------------------------------------------------------------
# The p-norm mirror map (note 6.2, exponent per erratum 9.1)


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


# ------------------------------------------------------------------------------------------------
# Generalized Gaussian sampler (Def. 4, note 6.3)


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


# ------------------------------------------------------------------------------------------------
# Euclidean projections (note 6.4)


def _check_d(d: int) -> int:
    if int(d) != d or d < 1:
        raise ValueError("the dimension d must be a positive integer")
    return int(d)


def _check_radius(radius: float) -> float:
    radius = float(radius)
    if not (radius > 0.0 and math.isfinite(radius)):
        raise ValueError("the radius must be finite and positive")
    return radius


def project_l2_ball(x, radius: float) -> np.ndarray:
    """Proj onto {||w||_2 <= R}: x * min(1, R / ||x||_2), computed on x / max|x_i| so that a
    norm beyond the float range (entries ~1e308) still gives R times the right direction."""
    radius = _check_radius(radius)
    x = _as_vectors(x)
    with _quiet():
        m = np.max(np.abs(x), axis=-1, keepdims=True)
        u = x / np.where(m > 0, m, 1.0)
        nu = lp_norm(u, 2.0, keepdims=True)           # in [1, sqrt(d)] where m > 0
        outside = (m > 0) & (nu > radius / np.where(m > 0, m, 1.0))
        return np.where(outside, u * (radius / np.where(outside, nu, 1.0)), x)


def _simplex_threshold(y: np.ndarray) -> np.ndarray:
    """tau such that sum(max(y - tau, 0)) = 1, along the last axis (sort-based, Duchi et al. 2008;
    note 6.4): u = sort(y) descending, css = cumsum(u) - 1, rho = max{j : u_j - css_j / j > 0},
    tau = css_rho / rho. Vectorised over leading axes; j = 1 always qualifies."""
    d = y.shape[-1]
    u = -np.sort(-y, axis=-1)
    css = np.cumsum(u, axis=-1) - 1.0
    j = np.arange(1, d + 1, dtype=np.float64)
    qualifies = u - css / j > 0
    rho = d - np.argmax(qualifies[..., ::-1], axis=-1)          # the last qualifying j
    return np.take_along_axis(css, (rho - 1)[..., None], axis=-1) / rho[..., None]


def project_simplex(x, radius: float = 1.0) -> np.ndarray:
    """Proj onto {w >= 0, sum w = R}: max(x - tau, 0) with the threshold tau of Duchi et al.

    Overflow and cancellation: the projection is invariant under x -> x + c 1, and an entry more
    than R below the largest one is 0 in the result (tau >= max x - R), so we work on
    y = clip(x - max x, -R, 0) / R in [-1, 0]. Nothing then overflows (entries of 1e200, or
    +-1e308 whose differences are inf, are fine), and the entries that matter keep full precision,
    whereas scaling by max|x| first would leave the answer (entries up to R) below the rounding
    error of the scaled entries (~1e-16) when max|x| = 1e200 and R = 1.
    """
    radius = _check_radius(radius)
    x = _as_vectors(x)
    with _quiet():
        y = np.clip(x - np.max(x, axis=-1, keepdims=True), -radius, 0.0) / radius
        return radius * np.maximum(y - _simplex_threshold(y), 0.0)


def project_l1_ball(x, radius: float) -> np.ndarray:
    """Proj onto {||w||_1 <= R}: x itself if inside (exactly), else sign(x) * Proj_simplex(|x|, R)
    (soft-thresholding, Duchi et al. 2008). The inside test compares ||x / m||_1 with R / m,
    m = max |x_i|, so that an l1 norm beyond the float range is not an issue."""
    radius = _check_radius(radius)
    x = _as_vectors(x)
    with _quiet():
        m = np.max(np.abs(x), axis=-1, keepdims=True)
        safe = np.where(m > 0, m, 1.0)
        inside = lp_norm(x / safe, 1.0, keepdims=True) <= radius / safe
        return np.where(inside, x, np.sign(x) * project_simplex(np.abs(x), radius))


def _box_bounds(low, high, d: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        low = np.broadcast_to(np.asarray(low, dtype=np.float64), (d,))
        high = np.broadcast_to(np.asarray(high, dtype=np.float64), (d,))
    except ValueError:
        raise ValueError(f"box bounds must be scalars or have length {d}") from None
    if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high))):
        raise ValueError("box bounds must be finite")
    if np.any(low > high):
        raise ValueError("box bound low exceeds high at some coordinate")
    return low, high


def project_box(x, low, high) -> np.ndarray:
    """Proj onto the box [low, high] (scalars or per-coordinate arrays): coordinate-wise clipping,
    exact in floating point."""
    x = _as_vectors(x)
    low, high = _box_bounds(low, high, x.shape[-1])
    return np.clip(x, low, high)


# Projection onto a convex hull. Coordinates: centroid of the vertices at 0, farthest vertex at
# distance 1 ("hull units"). The point x is NOT translated into the vertices: a_j = v_j - x would
# lose the vertices to rounding once |x| >> |v| (1e200 - 1 == 1e200), and makes the columns nearly
# parallel, i.e. ill-conditioned, well before that (an NNLS on them, tried first, lost ~1e-6 of the
# hull's size at a distance of 1e6 sizes). A point farther than _HULL_FAR hull units from the
# centroid is first moved along the ray from the centroid to that distance, only to keep the
# arithmetic in range (squares of 1e20 are fine, of 1e200 not). This changes nothing float64 can
# resolve: Proj(c + t u) is constant for t beyond t0 ~ size / (tangential part of u), and a
# tangential part of at least 1e-16 (what float64 can represent relative to |x|) gives t0 <=
# 1e16 < _HULL_FAR units; below that, the answer is not determined by the input's precision
# anyway (see project_hull).
_HULL_FAR = 1e20
# Stop when the Frank-Wolfe gap is below this times (1 + ||x - z||) (hull units): the gap's own
# rounding noise is ~1e-16 (1 + ||x - z||) sqrt(d).
_HULL_GAP_TOL = 1e-12
_HULL_APG_MAX_ITER = 20_000


def _hull_gap(B: np.ndarray, t: np.ndarray, lam: np.ndarray) -> tuple[float, float]:
    """(Frank-Wolfe gap, ||r||) of f(lam) = (1/2)||B lam - t||^2 over the simplex, r = B lam - t:
    gap = <r, B lam> - min_j <r, b_j> >= 0.

    A certificate for the point z = B lam (z* the exact projection): f(lam) - f* <= gap, hence
    ||z - t||^2 - ||z* - t||^2 <= 2 gap and ||z - z*||^2 <= 2 gap (z* is a projection, so
    ||z - t||^2 >= ||z* - t||^2 + ||z - z*||^2).
    """
    z = B @ lam
    r = z - t
    return float(r @ z - np.min(B.T @ r)), float(lp_norm(r, 2.0))


def _gap_ok(gap_norm: tuple[float, float]) -> bool:
    gap, norm = gap_norm
    return gap <= _HULL_GAP_TOL * (1.0 + norm)


def _affine_minimizer(B: np.ndarray, t: np.ndarray, support: np.ndarray) -> np.ndarray:
    """argmin ||B_S mu - t||_2 over {sum mu = 1} (the closest point of the affine hull of the
    columns in S), by least squares in the null space of 1^T: mu = 1/m + N w with N orthonormal,
    N^T 1 = 0 (from a QR). The matrix B_S N holds only vertex differences and does not depend on
    t, so its conditioning does not degrade as x moves away; the solve is backward stable, with an
    error ~1e-16 (1 + ||t||). Affinely dependent columns are fine (minimum-norm w)."""
    m = support.size
    if m == 1:
        return np.ones(1)
    Bs = B[:, support]
    basis = np.linalg.qr(np.ones((m, 1)), mode="complete")[0][:, 1:]
    base = np.full(m, 1.0 / m)
    w = np.linalg.lstsq(Bs @ basis, t - Bs @ base, rcond=None)[0]
    return base + basis @ w


def _hull_wolfe(B: np.ndarray, t: np.ndarray, max_iter: int) -> np.ndarray:
    """Wolfe's (1976) minimum-norm-point algorithm, a primal active-set method, for
    min_{lam in simplex} (1/2)||B lam - t||^2.

    Major cycle: add the vertex j minimising <b_j, r> (the Frank-Wolfe vertex) while the gap is
    above tolerance. Minor cycle: move to the affine minimiser on the current support; if some of
    its weights are <= 0, go only as far as the first weight hits 0, drop it, and repeat. Why
    this method: it terminates finitely at the exact support and then returns an exact affine
    minimiser, so a point inside the hull comes back as itself to rounding, where first-order
    methods only approach the answer at an O(1/k^2) rate; it needs no tuning; and it is written
    in untranslated coordinates (see _affine_minimizer), unlike the NNLS reformulation
    [A; 1^T] mu ~ [0; 1] with A = V - x, which we tried first and which loses ~1e-6 of the hull's
    size at a distance of 1e6 sizes. Returns the last iterate; the caller checks its gap.
    """
    k = B.shape[1]
    lam = np.zeros(k)
    lam[int(np.argmin(0.5 * np.sum(B * B, axis=0) - B.T @ t))] = 1.0     # the nearest vertex
    for _ in range(max_iter):
        r = B @ lam - t
        scores = B.T @ r
        j = int(np.argmin(scores))
        if _gap_ok(_hull_gap(B, t, lam)) or lam[j] > 0:    # optimal, or no progress possible
            return lam
        support = np.append(np.flatnonzero(lam > 0), j)
        for _ in range(support.size):                      # minor cycles: each drops a vertex
            mu = _affine_minimizer(B, t, support)
            current = lam[support]
            if np.all(mu > 0):
                lam = np.zeros(k)
                lam[support] = mu / np.sum(mu)
                break
            falling = mu <= 0
            theta = float(np.min(current[falling] / (current[falling] - mu[falling])))
            if not theta > 0:      # the new vertex would leave at once: rounding; stop here
                return lam
            step = current + theta * (mu - current)
            keep = step > 0
            keep[np.argmin(np.where(falling, step, np.inf))] = False   # at least one leaves
            lam = np.zeros(k)
            lam[support[keep]] = step[keep] / np.sum(step[keep])
            support = support[keep]
    return lam


def _hull_apg(B: np.ndarray, t: np.ndarray, lam: np.ndarray, max_iter: int) -> np.ndarray:
    """Accelerated projected gradient (FISTA, restarted by the gradient criterion of O'Donoghue
    and Candes, which needs no function values: those lose their precision for far points) for
    the same problem, warm-started at lam. Every 50 steps the affine minimiser on the identified
    support is tried (projected gradient finds the support long before the weights converge).
    The fallback when the active set stalls: slower, but every iterate is a point of the hull.
    Returns the iterate with the smallest gap seen."""
    L = float(np.linalg.norm(B, 2) ** 2)
    best, best_gap = lam, _hull_gap(B, t, lam)
    y, tk = lam.copy(), 1.0
    for it in range(1, max_iter + 1):
        new = project_simplex(y - (B.T @ (B @ y - t)) / L)
        if float((y - new) @ (new - lam)) > 0:        # momentum points uphill: restart
            y, tk = new, 1.0
        else:
            t_next = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * tk * tk))
            y = new + ((tk - 1.0) / t_next) * (new - lam)
            tk = t_next
        lam = new
        if it % 50 == 0 or it == max_iter:
            support = np.flatnonzero(lam > 0)
            mu = _affine_minimizer(B, t, support)
            polished = None
            if np.all(mu >= 0):
                polished = np.zeros_like(lam)
                polished[support] = mu / np.sum(mu)
            for candidate in (lam, polished):
                if candidate is not None:
                    gap = _hull_gap(B, t, candidate)
                    if gap[0] < best_gap[0]:
                        best, best_gap = candidate, gap
            if _gap_ok(best_gap):
                break
    return best


def _hull_weights(x: np.ndarray, V: np.ndarray, method: str) -> np.ndarray:
    """Simplex weights lam with V^T lam = Proj_conv(V)(x) for one point x (d,), V (k, d)."""
    k, d = V.shape
    with _quiet():
        vmax = float(np.max(np.abs(V)))
        Vc = V / vmax - np.mean(V / vmax, axis=0) if vmax > 0 else np.zeros_like(V)
        size = float(np.max(lp_norm(Vc, 2.0)))       # in units of vmax
        if k == 1 or size == 0.0:                   # the hull is one point
            return np.full(k, 1.0 / k)
        # Hull units (see above). Scale by m = max(|x|, |V|) first, so nothing overflows.
        m = max(float(np.max(np.abs(x))), vmax)
        u = x / m - np.mean(V / m, axis=0)          # (x - centroid) / m
        nu = float(lp_norm(u, 2.0))
        rel = size * (vmax / m)                     # the hull's size / m
        if nu > _HULL_FAR * rel:
            t = u * (_HULL_FAR / nu)
        else:
            t = u / rel if nu > 0 else np.zeros(d)
        B = (Vc / size).T
        lam = None
        if method == "active-set":
            lam = _hull_wolfe(B, t, max_iter=10 * (k + d) + 50)
        if lam is None or not _gap_ok(_hull_gap(B, t, lam)):
            start = lam if lam is not None else np.full(k, 1.0 / k)
            lam = _hull_apg(B, t, start, _HULL_APG_MAX_ITER)
    return lam


def project_hull(x, vertices, *, method: str = "active-set") -> np.ndarray:
    """Proj onto conv(vertices), vertices (k, d): V^T lam* with
    lam* = argmin_{lam in simplex} ||V^T lam - x||_2^2 (a small QP, note 6.4).

    ``method``: "active-set" (default): Wolfe's minimum-norm-point algorithm (see _hull_wolfe),
    checked by its Frank-Wolfe gap, with accelerated projected gradient as the fallback if the
    check fails; "apg" runs only the fallback (for tests). The result is V^T lam with lam on the
    simplex, so it is in the hull by construction (up to rounding).

    Accuracy: the returned weights are an exact affine minimiser on the final support, computed
    backward-stably in hull units (see _affine_minimizer), so the result is the exact projection
    of a point within ~1e-15 (size + ||x - centroid||) of x, and therefore (projections are
    1-Lipschitz) within that distance of Proj(x); size = the largest vertex distance from the
    centroid. In the tests: points inside the hull come back as themselves to ~3e-15 size, and
    the distance matches a generic solver to 1e-9 relative. For |x| >> |V| this is all float64
    can say: e.g. x = (1e200, 1e200) and the triangle conv{0, e1, e2} may give any point of the
    exposed edge, since the input's direction is only known to ~1e-16. The gap check alone
    certifies ||z - z*|| <= sqrt(2e-12 (1 + dist)) size at worst. x (d,) or (n, d): one QP per
    point.
    """
    if method not in ("active-set", "apg"):
        raise ValueError("method must be 'active-set' or 'apg'")
    x = _as_vectors(x)
    V = _check_vertices(vertices, x.shape[-1])
    if x.ndim == 1:
        return _hull_weights(x, V, method) @ V
    flat = x.reshape(-1, x.shape[-1])
    out = np.stack([_hull_weights(row, V, method) @ V for row in flat])
    return out.reshape(x.shape)


def _check_vertices(vertices, d: int) -> np.ndarray:
    if vertices is None:
        raise ValueError("a hull constraint needs vertices (a k x d array)")
    V = np.asarray(vertices, dtype=np.float64)
    if V.ndim != 2 or V.shape[0] < 1:
        raise ValueError("hull vertices must be a non-empty k x d array")
    if V.shape[1] != d:
        raise ValueError(f"hull vertices have {V.shape[1]} columns but the dimension is {d}")
    if not np.all(np.isfinite(V)):
        raise ValueError("a vertex of the hull is not finite")
    return V


# ------------------------------------------------------------------------------------------------
# Gaussian widths G_C = E sup_{w in C} <xi, w>, xi ~ N(0, I_d) (Def. 12, note 4.2 and 6.6)


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


# ------------------------------------------------------------------------------------------------
# Constraint: the public description of C


@dataclasses.dataclass(eq=False)
class Constraint:
    """The constraint set C of a constrained DP run: one of KINDS.

    * "none": R^d (no projection);
    * "l2-ball" / "l1-ball": {||w|| <= radius};
    * "simplex": {w >= 0, sum w = radius};
    * "box": [low, high] (scalars or length-d arrays); with neither given, [-radius, radius]^d;
    * "hull": conv(vertices), vertices a k x d array (radius unused).

    C is public (it is part of the model, recorded by ``to_json`` in model.json) but the messages
    of ``validate`` still never echo its numbers. Vertices and bounds are copied to float arrays.
    """

    kind: str
    radius: float = 1.0
    vertices: object = None
    low: object = None
    high: object = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind; choose one of {', '.join(KINDS)}")
        for name in ("vertices", "low", "high"):
            value = getattr(self, name)
            if value is not None:
                try:
                    setattr(self, name, np.array(value, dtype=np.float64))
                except (TypeError, ValueError):     # numpy's message would quote the value
                    raise ValueError(f"constraint {name} must be numeric") from None
        try:
            self.radius = float(self.radius)
        except (TypeError, ValueError):
            raise ValueError("the constraint radius must be a number") from None

    # -- checks ----------------------------------------------------------------------------------

    def validate(self, d: int) -> None:
        """Raise ValueError, with a message naming the problem but no value, unless C is a valid
        non-empty set in dimension d."""
        _check_d(d)
        if self.kind in ("l2-ball", "l1-ball", "simplex") or (
                self.kind == "box" and self.low is None and self.high is None):
            _check_radius(self.radius)
        if self.kind == "box":
            if (self.low is None) != (self.high is None):
                raise ValueError("a box needs both low and high, or neither ([-radius, radius])")
            if self.low is not None:
                for name, bound in (("low", self.low), ("high", self.high)):
                    if bound.ndim > 1 or (bound.ndim == 1 and bound.shape[0] != d):
                        raise ValueError(f"box bound {name} must be a scalar or have length {d}")
                _box_bounds(self.low, self.high, d)
        if self.kind == "hull":
            _check_vertices(self.vertices, d)
        elif self.vertices is not None:
            raise ValueError("vertices are only used by a hull constraint")
        if self.kind != "box" and (self.low is not None or self.high is not None):
            raise ValueError("low and high are only used by a box constraint")

    def _bounds(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        if self.low is None:
            return _box_bounds(-self.radius, self.radius, d)
        return _box_bounds(self.low, self.high, d)

    # -- operations ------------------------------------------------------------------------------

    def project(self, x, *, method: str = "active-set") -> np.ndarray:
        """Euclidean projection onto C of x (d,) or (n, d); identity for "none"."""
        x = _as_vectors(x)
        d = x.shape[-1]
        self.validate(d)
        if self.kind == "none":
            return x.copy()
        if self.kind == "l2-ball":
            return project_l2_ball(x, self.radius)
        if self.kind == "l1-ball":
            return project_l1_ball(x, self.radius)
        if self.kind == "simplex":
            return project_simplex(x, self.radius)
        if self.kind == "box":
            return project_box(x, *self._bounds(d))
        return project_hull(x, self.vertices, method=method)

    def scale(self, d: int) -> float:
        """A size of C, the unit of ``contains``'s tolerance: the radius; the largest |bound| of a
        box; the largest vertex norm of a hull (1 if all are 0); 1 for "none"."""
        self.validate(d)
        if self.kind in ("l2-ball", "l1-ball", "simplex"):
            return self.radius
        if self.kind == "box":
            low, high = self._bounds(d)
            return float(max(np.max(np.abs(low)), np.max(np.abs(high)))) or 1.0
        if self.kind == "hull":
            return float(np.max(lp_norm(self.vertices, 2.0))) or 1.0
        return 1.0

    def contains(self, x, tol: float = 1e-9):
        """Whether dist_2(x, C) <= tol * scale(d) (per row for (n, d)). One definition for every
        kind, through the projection, so that it agrees with ``project`` by construction."""
        x = _as_vectors(x)
        if self.kind == "none":
            self.validate(x.shape[-1])
            return np.ones(x.shape[:-1], dtype=bool) if x.ndim > 1 else True
        dist = lp_norm(x - self.project(x), 2.0)
        inside = dist <= tol * self.scale(x.shape[-1])
        return inside if x.ndim > 1 else bool(inside)

    def support(self, xi) -> np.ndarray:
        """h_C(xi) = sup_{w in C} <xi, w> for xi (d,) or (m, d), exactly (inf for "none")."""
        xi = np.asarray(xi, dtype=np.float64)
        d = xi.shape[-1]
        self.validate(d)
        if self.kind == "l2-ball":
            return self.radius * lp_norm(xi, 2.0)
        if self.kind == "l1-ball":
            return self.radius * lp_norm(xi, math.inf)
        if self.kind == "simplex":
            return self.radius * np.max(xi, axis=-1)
        if self.kind == "box":
            low, high = self._bounds(d)
            return np.sum(np.maximum(xi * high, xi * low), axis=-1)
        if self.kind == "hull":
            return np.max(xi @ self.vertices.T, axis=-1)
        with _quiet():
            return np.where(np.any(xi != 0, axis=-1), np.inf, 0.0)

    def gaussian_width_mc(self, d: int, n_draws: int, rng: np.random.Generator):
        """(mean, standard error) of a Monte Carlo estimate of G_C (exact support per draw)."""
        self.validate(d)
        return gaussian_width_mc(self.support, d, n_draws, rng)

    def gaussian_width(self, d: int, *, n_draws: int = 100_000, seed: int = 0) -> float:
        """G_C: closed form for balls, simplex and box (exact up to quadrature ~1e-12); for a hull
        the Monte Carlo mean with a fixed seed (deterministic; its standard error is
        ``gaussian_width_mc``'s); inf for "none". Data-independent, so computing it is free."""
        self.validate(d)
        if self.kind == "none":
            return math.inf
        if self.kind == "l2-ball":
            return gaussian_width_l2_ball(d, self.radius)
        if self.kind == "l1-ball":
            return gaussian_width_l1_ball(d, self.radius)
        if self.kind == "simplex":
            return gaussian_width_simplex(d, self.radius)
        if self.kind == "box":
            return gaussian_width_box(*self._bounds(d), d)
        return self.gaussian_width_mc(d, n_draws, np.random.default_rng(seed))[0]

    def diameter_l2(self, d: int) -> float:
        """||C||_2 = max ||w - w'||_2 over C (Thm 2's diameter): 2R for both balls, R sqrt 2 for the
        simplex (0 if d = 1), ||high - low||_2 for a box, the largest vertex-to-vertex distance for a
        hull (a convex function's max over a polytope is at vertices), inf for "none"."""
        self.validate(d)
        if self.kind == "none":
            return math.inf
        if self.kind in ("l2-ball", "l1-ball"):
            return 2.0 * self.radius
        if self.kind == "simplex":
            return self.radius * math.sqrt(2.0) if d > 1 else 0.0
        if self.kind == "box":
            low, high = self._bounds(d)
            with _quiet():
                return float(lp_norm(high - low, 2.0))
        return _max_pairwise_distance(self.vertices)

    # -- serialisation ---------------------------------------------------------------------------

    def to_json(self) -> dict:
        """A JSON-ready dict (floats and lists) for model.json; ``from_json`` inverts it exactly
        (float64 values survive a JSON round trip through repr)."""
        def listed(a):
            return None if a is None else a.tolist()
        return {"kind": self.kind, "radius": self.radius, "vertices": listed(self.vertices),
                "low": listed(self.low), "high": listed(self.high)}

    @classmethod
    def from_json(cls, data: dict) -> Constraint:
        unknown = set(data) - {"kind", "radius", "vertices", "low", "high"}
        if unknown or "kind" not in data:
            raise ValueError("a constraint record needs 'kind' and may have only 'radius', "
                             "'vertices', 'low' and 'high'")
        return cls(data["kind"], data.get("radius", 1.0), data.get("vertices"),
                   data.get("low"), data.get("high"))


def _max_pairwise_distance(V: np.ndarray, chunk: int = 1024) -> float:
    """max_{i,j} ||v_i - v_j||_2 by rows of the squared-distance matrix, in chunks. Centred and
    scaled by the largest entry first, so squares neither overflow nor cancel badly."""
    with _quiet():
        vmax = float(np.max(np.abs(V)))
        if vmax == 0.0:
            return 0.0
        C = V / vmax - np.mean(V / vmax, axis=0)     # no overflow even for entries near 1e308
        s = float(np.max(np.abs(C)))
        if s == 0.0:
            return 0.0
        C = C / s
        s *= vmax
        sq = np.sum(C * C, axis=1)
        best = 0.0
        for start in range(0, C.shape[0], chunk):
            block = C[start:start + chunk]
            d2 = sq[start:start + chunk, None] + sq[None, :] - 2.0 * block @ C.T
            best = max(best, float(np.max(d2)))
        return s * math.sqrt(max(best, 0.0))
