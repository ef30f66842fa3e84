"""Euclidean projections onto the l2 ball, scaled simplex, l1 ball, box and convex hull (note
6.4); the hull's is a small QP per point (Wolfe's active set, accelerated projected gradient as
the fallback)."""
from __future__ import annotations

import math

import numpy as np

from beam_dp.geometry.checks import _as_vectors, _check_radius, _quiet
from beam_dp.geometry.norms import lp_norm





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
