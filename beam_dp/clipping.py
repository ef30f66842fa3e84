"""Per-example gradient clipping for GLMs without per-example loops, overflow-safe.

For a GLM the per-example gradient with respect to theta (k x (d+1)) is the outer product
``l'(s_i) (x_i, 1)``, so its Frobenius norm is ``||l'(s_i)||_2 * ||(x_i, 1)||_2``. Clipping to C
is therefore a per-row scale ``min(1, C / norm_i)`` applied to the loss derivative, and the sum of
clipped gradients is one matrix product ``(scale * l')^T [X, 1]``.

Floating point. A finite input can have a squared norm (or a norm) beyond the float range: a
feature of 1e200 squares to inf, and 0 * inf = NaN would then turn the whole sum, and the model,
into NaN whenever that one row is present. So every row whose squared norm is outside
[2^-900, 2^900], or whose gradient norm is not comfortably representable, takes a second,
exact-scaling path: the row is written as ``u * 2^e`` (a power of two, so the scaling is exact),
norms are computed from ``u``, and a clipped row's contribution is assembled as
``C * (l' / ||l'||) (outer) (u, 2^-e) / ||(u, 2^-e)||`` so that no factor below the float range
ever multiplies a value above it. Every row's contribution then has norm at most C (up to a few
ulps of rounding), whatever its values:

* a row whose norm is finite gets exactly its clipped gradient;
* a row whose norm is not representable (e.g. 1e308 in several columns) gets the clipped gradient
  in the limit, norm C in the direction of its scaled row: still a function of that row alone,
  bounded by C, so the sensitivity of the sum is unchanged;
* a loss derivative of +-inf (a squared loss at an overflowing score) counts as a clipped
  gradient in the direction of its sign; a NaN derivative, or a NaN feature (never from validated
  input), contributes nothing.

Over- and underflow are expected and handled inside these functions, so they run under
``np.errstate`` and print nothing: a warning that appears only when some row is extreme would
itself reveal that row.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import scipy.sparse as sp

from beam_dp import losses as losses_mod

# Rows whose squared norm lies in [_SQ_LOW, _SQ_HIGH] take the plain path: their squares neither
# overflow nor lose their small entries to underflow (an entry below 2^-511 squares to at most
# 2^-1022, i.e. less than d * 2^-122 of such a row's squared norm).
_SQ_LOW, _SQ_HIGH = 2.0 ** -900, 2.0 ** 900
# A clip factor C / norm stays a normal float (full precision) while norm <= C * _FACTOR_RANGE.
_FACTOR_RANGE = 2.0 ** 1000
# ``clipped_gradient_sum`` reads every feature twice (the scores X theta, then the sum X^T r):
# over a whole block (65,536 rows: 26 MB at d = 50) the second read comes from memory again, and
# memory bandwidth, not arithmetic, bounds the kernel; in chunks of about this many bytes (a
# core's L2 cache here is 1 MiB) it comes from the cache. Measured on 10^6 x 50 rows, one core:
# 110 -> 74 ms per pass; two processes each on half the rows: 1.1x -> 1.76x the throughput of
# one (pipelines/benchmark.py shows the same on Beam's worker pool).
CHUNK_BYTES = 800_000


def _quiet():
    """Overflow, underflow and invalid operations are expected below and handled explicitly."""
    return np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore")


def _split(v: np.ndarray, extra: float | np.ndarray = 0.0):
    """Rows of ``v`` (m, j), each with one more entry ``extra``, written exactly as
    ``(u, u_extra) * 2^e`` with max(|u|, |u_extra|) in [0.5, 1).

    Returns (u, u_extra, e, nu) with nu = ||(u, u_extra)||_2, so the row norm is nu * 2^e (which
    may exceed the float range: ``np.ldexp`` then gives inf). Rows holding an infinity are
    represented by their direction (the signs of the infinite entries) with e = a huge exponent;
    rows holding a NaN become zero (nu = 0) so that they contribute nothing.
    """
    v = np.asarray(v, dtype=np.float64)
    extra = np.broadcast_to(np.asarray(extra, dtype=np.float64), v.shape[:1])
    with _quiet():
        biggest = np.maximum(np.max(np.abs(v), axis=1, initial=0.0), np.abs(extra))
        infinite = np.isinf(biggest)
        bad = np.isnan(biggest)
        e = np.frexp(np.where(infinite | bad, 1.0, biggest))[1].astype(np.int64)
        u = np.ldexp(v, -e[:, None])
        u_extra = np.ldexp(extra, -e)
        if infinite.any():
            u[infinite] = np.where(np.isinf(v[infinite]), np.sign(v[infinite]), 0.0)
            u_extra = np.where(infinite, np.where(np.isinf(extra), np.sign(extra), 0.0), u_extra)
            e = np.where(infinite, 4096, e)   # 2^4096 is inf: the norm is not representable
        if bad.any():
            u[bad] = 0.0
            u_extra = np.where(bad, 0.0, u_extra)
            e = np.where(bad, 0, e)
        nu = np.sqrt(np.einsum("ij,ij->i", u, u) + u_extra * u_extra)
    return u, u_extra, e, nu


def row_norms(v: np.ndarray, sq_norms: np.ndarray | None = None) -> np.ndarray:
    """The L2 norm of each row of ``v`` (m, j), finite whenever it is representable (squares may
    overflow where the norm does not: a row of 1e200 has norm 1e200). ``sq_norms``, if given, are
    the rows' squared norms as computed plainly (e.g. ``Block.sq_norms``, inf where they
    overflowed); they are used where they are accurate. NaN rows give NaN, rows with an infinity
    inf."""
    v = np.asarray(v, dtype=np.float64)
    if v.shape[1] == 1 and sq_norms is None:
        return np.abs(v[:, 0])   # exact, and the common case (a single-output loss derivative)
    with _quiet():
        sq = np.einsum("ij,ij->i", v, v) if sq_norms is None else np.asarray(sq_norms, np.float64)
        out = np.sqrt(sq)
        redo = ~((sq >= _SQ_LOW) & (sq <= _SQ_HIGH))
        if redo.any():
            _, _, e, nu = _split(v[redo])
            norms = np.ldexp(nu, e)
            norms[np.isnan(np.max(v[redo], axis=1, initial=0.0))] = np.nan
            out[redo] = norms
    return out


def scale_rows(v: np.ndarray, target: float, only_shrink: bool,
               sq_norms: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row of ``v`` scaled to norm ``target`` (zero rows stay zero), or with ``only_shrink``
    the rows outside the ball of radius ``target`` projected onto it. Returns the new rows and
    their squared norms.

    The result has norm at most ``target`` (``only_shrink``) or equal to it, up to rounding, for
    every finite row, including rows whose norm is not representable. Rows holding a NaN (never
    from validated input) become zero; a row holding an infinity is scaled in the direction of
    its infinite entries.
    """
    v = np.asarray(v, dtype=np.float64)
    target = float(target)
    with _quiet():
        sq = np.einsum("ij,ij->i", v, v) if sq_norms is None else np.asarray(sq_norms, np.float64)
        norms = np.sqrt(sq)
        # Plain path: accurate squares and a scale that is a normal float.
        plain = (sq >= _SQ_LOW) & (sq <= _SQ_HIGH) & (norms <= target * _FACTOR_RANGE) & (
            norms >= target / _FACTOR_RANGE)
        scale = np.where(plain, target / np.where(plain, norms, 1.0), 1.0)
        if only_shrink:
            scale = np.minimum(1.0, scale)
        out = v * scale[:, None]
        out_sq = sq * scale ** 2
        redo = np.flatnonzero(~plain)
        if redo.size:
            u, _, e, nu = _split(v[redo])
            if only_shrink:
                # Inside the ball (norm nu * 2^e <= target): unchanged; NaN rows become zero.
                keep = (np.ldexp(nu, e) <= target) & ~np.isnan(v[redo]).any(axis=1)
            else:
                keep = nu == 0
            safe_nu = np.where(nu > 0, nu, 1.0)
            rows = np.where(keep[:, None], np.where(np.isnan(v[redo]), 0.0, v[redo]),
                            u * (target / safe_nu)[:, None])
            rows[nu == 0] = 0.0
            out[redo] = rows
            out_sq[redo] = np.einsum("ij,ij->i", rows, rows)
    return out, out_sq


def saturating_difference(a: np.ndarray, b) -> np.ndarray:
    """``a - b``, with differences beyond the float range (finite inputs of opposite signs near
    1e308) saturated at +-float max rather than inf: the rows they occur in are clipped or
    normalized afterwards, so only their direction matters, and it stays finite."""
    big = np.finfo(np.float64).max
    with _quiet():
        return np.clip(np.asarray(a, np.float64) - b, -big, big)


def gradient_norms(derivative: np.ndarray, sq_norms: np.ndarray, fit_intercept: bool) -> np.ndarray:
    """Per-example gradient norms ``||l'|| * sqrt(||x||^2 + 1)`` from the loss derivative (m, k)
    and squared feature norms (m,): +inf where the norm (or the squared norm given) is not
    representable, 0 where the derivative is 0, never NaN. (``clipped_gradient_sum`` recomputes
    the norms of rows whose squares overflowed from the features themselves.)"""
    a = row_norms(derivative)
    with _quiet():
        b = np.sqrt(np.asarray(sq_norms, np.float64) + float(fit_intercept))
        out = a * b
    out[(a == 0) | (b == 0)] = 0.0
    out[np.isnan(out)] = np.inf
    return out


def clip_factors(norms: np.ndarray, clip_norm: float) -> np.ndarray:
    """min(1, C / norm), with 1 for zero-norm rows and 0 for rows whose norm is inf or NaN."""
    with _quiet():  # a zero norm gives inf, i.e. a factor of 1
        factors = np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(np.float64).tiny))
    return np.where(np.isnan(factors), 0.0, factors)


def clipped_outer_sums(derivative: np.ndarray, features: np.ndarray, sq_norms: np.ndarray | None,
                       clip_norms, fit_intercept: bool = True) -> np.ndarray:
    """For each clip norm C_l, the sum over rows of ``min(1, C_l / ||g_i||) g_i`` with
    ``g_i = derivative_i (outer) (x_i, 1)`` (the 1 only with ``fit_intercept``).

    ``derivative`` (m, k), ``features`` (m, d), ``sq_norms`` (m,) their plain squared norms (or
    None), ``clip_norms`` (L,) positive. Returns (L, k, d + 1); the intercept column is zero
    without ``fit_intercept``. Every row adds at most C_l in norm to sum l (see the module
    docstring for rows at the edge of the float range).
    """
    derivative = np.asarray(derivative, dtype=np.float64)
    features = np.asarray(features, dtype=np.float64)
    clip_norms = np.atleast_1d(np.asarray(clip_norms, dtype=np.float64))
    m, d = features.shape
    k = derivative.shape[1]
    out = np.zeros((len(clip_norms), k, d + 1))
    if m == 0:
        return out
    fit = float(fit_intercept)
    with _quiet():
        sq = np.einsum("ij,ij->i", features, features) if sq_norms is None else np.asarray(sq_norms, np.float64)
        a = row_norms(derivative)
        norms = a * np.sqrt(sq + fit)
        # Plain rows: accurate squares, a finite derivative, and clip factors C / norm that are
        # normal floats (>= 2^-1000), so factor * l' * x is computed to full precision. With an
        # intercept a tiny x is harmless (||(x, 1)|| >= 1), without one its norm must be accurate.
        sq_ok = (sq <= _SQ_HIGH) & ((sq >= _SQ_LOW) | fit_intercept)
        # (Divide rather than multiply: C * 2^1000 overflows to inf for C >= 2^24, and then an
        # infinite norm would pass and meet a zero factor: 0 * inf = NaN.)
        plain = sq_ok & np.isfinite(norms) & (norms / clip_norms.min() <= _FACTOR_RANGE)
        if plain.all():
            rows, special = slice(None), None
        else:
            rows, special = np.flatnonzero(plain), np.flatnonzero(~plain)
        deriv, x, n = derivative[rows], features[rows], norms[rows]
        factors = np.minimum(1.0, clip_norms[:, None] / np.maximum(n, np.finfo(np.float64).tiny)[None, :])
        weighted = factors[:, :, None] * deriv[None, :, :]                    # (L, m, k)
        out[:, :, :-1] = np.matmul(weighted.transpose(0, 2, 1), x)        # (L, k, d), BLAS
        if fit_intercept:
            out[:, :, -1] = weighted.sum(axis=1)
        if special is not None and special.size:
            out += _special_rows(derivative[special], features[special], clip_norms, fit)
    return out


def _special_rows(derivative: np.ndarray, features: np.ndarray, clip_norms: np.ndarray,
                  fit: float) -> np.ndarray:
    """``clipped_outer_sums`` for rows outside the plain path, from exactly scaled rows:
    contribution = min(C, ||l'|| ||x~||) (l' / ||l'||) (outer) x~ / ||x~||, x~ = (x, fit) =
    (u, u_extra) 2^e, with ||x~|| = nu 2^e possibly not representable (then the minimum is C)."""
    u, u_extra, e, nu = _split(features, fit)
    direction, a = _unit_rows(derivative)
    b = np.ldexp(nu, e)
    ab = a * b
    ab[(a == 0) | (b == 0)] = 0.0          # a zero derivative or a zero row: no gradient
    r = np.minimum(clip_norms[:, None], ab[None, :])                           # (L, m)
    weighted = (r / np.where(nu > 0, nu, 1.0))[:, :, None] * direction[None, :, :]
    out = np.zeros((len(clip_norms), derivative.shape[1], features.shape[1] + 1))
    out[:, :, :-1] = np.matmul(weighted.transpose(0, 2, 1), u)
    if fit:
        out[:, :, -1] = np.matmul(weighted.transpose(0, 2, 1), u_extra)
    return out


def _unit_rows(v: np.ndarray):
    """(v / ||v||, ||v||) per row, computed without overflow: rows with an infinity point along
    its signs (norm inf), zero and NaN rows give a zero direction and norm 0."""
    u, _, e, nu = _split(v)
    norms = np.ldexp(nu, e)
    direction = u / np.where(nu > 0, nu, 1.0)[:, None]
    norms[nu == 0] = 0.0
    return direction, norms


def clipped_gradient_sum(theta: np.ndarray, features: np.ndarray, sq_norms: np.ndarray,
                         labels: np.ndarray, loss: losses_mod.GlmLoss, clip_norm: float,
                         fit_intercept: bool = True) -> np.ndarray:
    """Sum over the rows of the per-example gradients, each clipped to L2 norm ``clip_norm``.

    Returns an array shaped like theta (k, d + 1); the intercept column is zero when
    ``fit_intercept`` is off. Finite for any finite theta and finite rows; each row adds at most
    ``clip_norm`` in norm (the module docstring says how rows at the edge of the float range are
    handled).
    """
    if sp.issparse(features):
        return sparse_clipped_gradient_sum(theta, features, labels, loss, clip_norm, fit_intercept)
    m, d = features.shape
    if m == 0:
        return np.zeros_like(theta)
    rows = max(256, CHUNK_BYTES // (8 * (d + 1)))
    total = None
    for start in range(0, m, rows):   # cache-sized chunks of rows (CHUNK_BYTES says why)
        chunk = slice(start, start + rows)
        with _quiet():
            derivative = loss.derivative(losses_mod.scores(theta, features[chunk]), labels[chunk])
        part = clipped_outer_sums(derivative, features[chunk], sq_norms[chunk], [clip_norm],
                                  fit_intercept)[0]
        total = part if total is None else total + part
    return total


def clipped_gradient_sum_and_count(theta: np.ndarray, features, sq_norms: np.ndarray,
                                   labels: np.ndarray, loss: losses_mod.GlmLoss, clip_norm: float,
                                   fit_intercept: bool = True) -> tuple[np.ndarray, int]:
    """``clipped_gradient_sum`` and, from the same scores, the number of rows whose unclipped
    gradient norm is at most ``clip_norm`` (adaptive clipping's count, Andrew et al. 2021; a
    row whose norm is not representable counts as above). One pass: the scores are computed
    once per cache-sized chunk for both."""
    if sp.issparse(features):
        with _quiet():
            derivative = loss.derivative(losses_mod.scores(theta, features), labels)
        below = int(np.count_nonzero(gradient_norms(derivative, sq_norms, fit_intercept) <= clip_norm))
        return sparse_clipped_gradient_sum(theta, features, labels, loss, clip_norm,
                                           fit_intercept), below
    m, d = features.shape
    if m == 0:
        return np.zeros_like(theta), 0
    rows = max(256, CHUNK_BYTES // (8 * (d + 1)))
    total, below = None, 0
    for start in range(0, m, rows):
        chunk = slice(start, start + rows)
        with _quiet():
            derivative = loss.derivative(losses_mod.scores(theta, features[chunk]), labels[chunk])
        part = clipped_outer_sums(derivative, features[chunk], sq_norms[chunk], [clip_norm],
                                  fit_intercept)[0]
        # (A squared norm that overflowed gives an infinite norm: above any clip norm, as the
        # row's true norm is.)
        below += int(np.count_nonzero(gradient_norms(derivative, sq_norms[chunk], fit_intercept)
                                      <= clip_norm))
        total = part if total is None else total + part
    return total, below


def sparse_clipped_gradient_sum(theta: np.ndarray, x, labels: np.ndarray, loss: losses_mod.GlmLoss,
                                clip_norm: float, fit_intercept: bool = True) -> np.ndarray:
    """``clipped_gradient_sum`` of CSR rows, in O(nnz + d k): never densified.

    Every row is first written exactly as ``(x, fit) = (u, fit 2^-e) 2^e`` with entries of ``u``
    in [-1, 1] and the largest one at least 1/2 (``losses.split_sparse_rows``), so
    ``t = ||(u, fit 2^-e)||`` lies in [1/2, sqrt(nnz + 1)] and a clipped row's contribution
    ``min(C, ||l'|| ||(x, fit)||) (l' / ||l'||) (outer) (u, fit 2^-e) / t`` is assembled from
    bounded factors only: each row adds at most C in norm, whatever its values (the dense
    kernel's ``_special_rows`` argument, for every row at once)."""
    k, d1 = theta.shape
    out = np.zeros((k, d1))
    if x.shape[0] == 0:
        return out
    u, extra, weights = sparse_clipped_row_weights(theta, x, labels, loss, clip_norm, fit_intercept)
    out[:, :-1] = np.asarray(u.T @ weights).T
    if fit_intercept:
        out[:, -1] = weights.T @ extra
    return out


def sparse_clipped_row_weights(theta: np.ndarray, x, labels: np.ndarray,
                               loss: losses_mod.GlmLoss, clip_norm: float,
                               fit_intercept: bool = True):
    """(u, extra, weights) of CSR rows (``sparse_clipped_gradient_sum``'s factors): row i's
    clipped gradient is ``weights_i (outer) (u_i, extra_i)``, ``u`` CSR (m, d) with entries in
    [-1, 1], ``extra`` (m,) the intercept's entry, ``weights`` (m, k); each at most C in norm."""
    fit = float(fit_intercept)
    u, e = losses_mod.split_sparse_rows(x, floor=fit)
    with _quiet():
        extra = np.ldexp(np.full(len(e), fit), -e)                     # the intercept's entry
        t = np.sqrt(np.asarray(u.multiply(u).sum(axis=1)).ravel() + extra ** 2)
        scores = np.ldexp(np.asarray(u @ theta[:, :-1].T), e[:, None]) + theta[:, -1]
        direction, a = _unit_rows(loss.derivative(scores, labels))
        norms = a * np.ldexp(t, e)                                     # may overflow to inf
        norms[(a == 0) | (t == 0)] = 0.0
        weights = (np.minimum(clip_norm, norms) / np.where(t > 0, t, 1.0))[:, None] * direction
    return u, extra, weights


# ---------------------------------------------------------------- exact sums on a public grid
#
# Secure noise (issue 12) needs sums that are exact and independent of the order of addition:
# then the noise is added to an integer, nothing released carries floating-point low bits of the
# data, and the same seed gives the same model bit for bit on every runner and any number of
# workers. A GLM's per-example gradient is an outer product u_i (x_i, 1), so rather than
# rounding every coordinate of every gradient (three more passes over the rows per step, ~2x
# the cost) the two factors are put on grids and multiplied exactly:
#
# * each row (x_i, 1) is written in block floating point: q_i 2^(e_i - Q) with q_i integers,
#   |q_ij| <= 2^Q, the row's largest entry scaled into [2^(Q-1), 2^Q] (Q = GRID_FEATURE_BITS):
#   each row keeps Q bits relative to its largest entry, whatever the features' scale. These
#   quantized rows are the features training sees (computed once per block, ``quantized_rows``).
# * the clipped loss derivative u_i (k outputs; |u_i| ||q_i|| <= C, hence |u_i| <= C 2^-(Q-1))
#   is truncated towards zero to the grid ``gradient_grid(C)`` = C 2^-(Q-1+U): at most 2^U
#   levels (U = GRID_SCALE_BITS), and truncation only shrinks, so each row's contribution has
#   norm at most C: the sensitivity is C exactly, in grid units C / gradient_grid(C).
# * products are integers below 2^(Q+U) = 2^40, so a chunk of up to 2^12 rows sums to below
#   2^52 in float64, exactly, in any order (BLAS included); chunks are added as 96-bit integers
#   (``ExactSum``), exact for any number of rows.
# The scores theta . q_i must not depend on the rows around a row (which differ between runners'
# blocks and batches): BLAS's matrix-vector product does, in its last bits, for the rows of an
# incomplete group of 8 at the end of a matrix (measured); chunks are therefore padded to a
# multiple of 8 rows, which makes this BLAS's rows independent of their position, as checked
# once per process and number of outputs (``_blas_rows_stable``); where it is not, np.einsum
# (about 2x slower for one output: 121 against 62 us for 4,096 x 51 rows).
GRID_FEATURE_BITS = 20
GRID_SCALE_BITS = 20
_EXACT_CHUNK_ROWS = 1 << (52 - GRID_FEATURE_BITS - GRID_SCALE_BITS)


def gradient_grid(clip_norm: float, scale_bits: int = GRID_SCALE_BITS) -> float:
    """The grid (in gradient units) of exact sums clipped at ``clip_norm``: a power of two times
    it, so that dividing by it is exact. ``scale_bits`` (U, at most GRID_SCALE_BITS) levels of
    the clipped loss derivative; the sensitivity in grid units is 2^(GRID_FEATURE_BITS - 1 + U)."""
    if not 1 <= scale_bits <= GRID_SCALE_BITS:
        raise ValueError(f"scale_bits must be in [1, {GRID_SCALE_BITS}]")
    return math.ldexp(float(clip_norm), -(GRID_FEATURE_BITS - 1 + scale_bits))


class ExactSum:
    """An exact integer array, hi * 2^32 + lo with int64 hi and lo (|lo| <= 2^31): sums of up to
    2^63 * 2^32 in magnitude, added in any order with the same result."""

    __slots__ = ("hi", "lo")
    __array_ufunc__ = None   # ndarray + ExactSum: numpy defers to ExactSum.__radd__

    def __init__(self, hi: np.ndarray, lo: np.ndarray):
        carry = (lo + (1 << 31)) >> 32   # |lo| <= 2^33 here: no overflow
        self.hi, self.lo = hi + carry, lo - (carry << 32)

    @staticmethod
    def _split(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 values as (hi, lo) with lo in [0, 2^32): exact over the whole int64 range."""
        return values >> 32, values & np.int64(0xFFFFFFFF)

    @classmethod
    def of(cls, values: np.ndarray) -> "ExactSum":
        """From integers: int64, or float64 holding integer values (a chunk's sum, < 2^53)."""
        values = np.asarray(values)
        if values.dtype.kind == "u":
            raise TypeError("an exact sum takes signed integers")
        return cls(*cls._split(values.astype(np.int64)))

    @classmethod
    def zeros(cls, shape) -> "ExactSum":
        return cls(np.zeros(shape, np.int64), np.zeros(shape, np.int64))

    @property
    def shape(self) -> tuple:
        return self.lo.shape

    def __add__(self, other: "ExactSum") -> "ExactSum":
        if isinstance(other, ExactSum):
            return ExactSum(self.hi + other.hi, self.lo + other.lo)
        other = np.asarray(other)
        if other.dtype.kind != "i":
            raise TypeError("an exact sum adds only signed integers")
        hi, lo = self._split(other.astype(np.int64))
        return ExactSum(self.hi + hi, self.lo + lo)

    __radd__ = __add__

    def to_float(self) -> np.ndarray:
        """The value in float64 (one rounding, a function of the exact value alone)."""
        return np.ldexp(self.hi.astype(np.float64), 32) + self.lo.astype(np.float64)

    def __eq__(self, other) -> bool:
        return (isinstance(other, ExactSum) and np.array_equal(self.hi, other.hi)
                and np.array_equal(self.lo, other.lo))

    def __reduce__(self):
        return (ExactSum, (self.hi, self.lo))


def quantized_rows(features: np.ndarray, fit_intercept: bool) -> tuple[np.ndarray, np.ndarray]:
    """(q, shift): the rows (x_i, fit_intercept) as q_i 2^shift_i with q_i integer-valued float64
    (m, d + 1), |q_ij| <= 2^GRID_FEATURE_BITS and the largest at least half that (a zero row:
    q_i = 0). Exact scaling by powers of two and one rounding per entry; no overflow for any
    finite input."""
    m, d = features.shape
    rows = np.empty((m, d + 1))
    rows[:, :d] = features
    rows[:, d] = float(fit_intercept)
    _, exponents = np.frexp(np.max(np.abs(rows), axis=1) if d + 1 else np.zeros(m))
    shift = exponents.astype(np.int64) - GRID_FEATURE_BITS
    with _quiet():   # entries far below their row's largest underflow to 0: rounded away anyway
        if shift.size and -1022 <= -shift.max() and -shift.min() <= 1023:
            # Times 2^-shift, a normal float: IEEE multiplication rounds the exact product as
            # ldexp does (the same bits), at ~2.5x its speed; in place, on the copy made above.
            rows *= np.ldexp(1.0, -shift)[:, None]
            q = np.rint(rows, out=rows)
        else:
            q = np.rint(np.ldexp(rows, -shift[:, None]))
    return q, shift


def block_quantized_rows(block, fit_intercept: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantized_rows`` of a Block's features and the rows' norms ||q_i||, kept on the block:
    a full-batch run quantizes each cached block once, not at every step."""
    memo = getattr(block, "_quantized", None)
    if memo is None or memo[0] != fit_intercept:
        q, shift = quantized_rows(block.features, fit_intercept)
        memo = (fit_intercept, q, shift, np.sqrt(np.einsum("ij,ij->i", q, q)))
        block._quantized = memo
    return memo[1], memo[2], memo[3]


_ROW_GROUP = 8
# 1 - 2^-24: above the relative rounding error of C / ||q|| and of ||direction|| (a few ulps),
# and of ||q|| itself (a float sum of d + 1 squares: at most (d + 1) 2^-53 relative) for any
# d below 2^28; 6e-8 of the clip norm, far below anything a model can show.
_CLIP_MARGIN = 1.0 - 2.0 ** -24


def _padded_matvec(rows: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """rows @ theta.T by BLAS, the rows padded with zeros to a multiple of _ROW_GROUP."""
    m = rows.shape[0]
    padded = -(-m // _ROW_GROUP) * _ROW_GROUP
    if padded != m:
        full = np.zeros((padded, rows.shape[1]))
        full[:m] = rows
        rows = full
    return (rows @ theta.T)[:m]


@functools.lru_cache(maxsize=None)
def _blas_rows_stable(outputs: int = 1) -> bool:
    """Whether ``_padded_matvec`` gives each row the same bits wherever it sits (other offsets,
    lengths, copies), on integer rows like the quantized ones, at widths and lengths like the
    kernel's chunks, for a model of ``outputs`` rows: checked once per process and count
    (~10 ms). The count matters: one output is a matrix-vector product (OpenBLAS's gemv, found
    stable), several a matrix product, whose small-matrix kernels sum short and long matrices'
    rows in other orders (found on OpenBLAS 0.3.31, where the one-output check passes)."""
    generator = np.random.default_rng(12345)
    for width in (9, 52, 257, 2049):
        rows = np.rint(generator.normal(0, 2.0 ** 18, (1200, width)))
        theta = generator.normal(0, 1, (outputs, width))
        whole = _padded_matvec(rows, theta)
        for start, length in ((0, 1), (3, 5), (1, 64), (17, 255), (5, 1000), (0, 1200)):
            part = rows[start:start + length]
            for candidate in (part, np.array(part)):
                if not np.array_equal(_padded_matvec(candidate, theta), whole[start:start + length]):
                    return False
    return True


def _row_scores(rows: np.ndarray, theta: np.ndarray) -> np.ndarray:
    if _blas_rows_stable(theta.shape[0]):
        return _padded_matvec(rows, theta)
    return np.einsum("ij,kj->ik", rows, theta)


def _unit_derivatives(derivative: np.ndarray):
    """``_unit_rows`` of the loss derivatives (m, k); for one output (every loss but softmax)
    simply (sign, |l'|), NaN counting as 0 as there."""
    if derivative.shape[1] != 1:
        return _unit_rows(derivative)
    values = np.where(np.isnan(derivative), 0.0, derivative)
    return np.sign(values), np.abs(values[:, 0])


def exact_clipped_gradient_sum(theta: np.ndarray, q: np.ndarray, shift: np.ndarray,
                               q_norms: np.ndarray, labels: np.ndarray,
                               loss: losses_mod.GlmLoss, clip_norm: float,
                               scale_bits: int = GRID_SCALE_BITS) -> ExactSum:
    """The sum of the clipped per-example gradients of the quantized rows (q, shift) (from
    ``quantized_rows``; ``q_norms`` their norms ||q_i||, as ``block_quantized_rows`` keeps
    them), in units of ``gradient_grid(clip_norm, scale_bits)``: exact, the same for any split
    of the rows into blocks and any order. Each row adds at most C / grid in norm (see above)."""
    m = q.shape[0]
    if m == 0:
        return ExactSum.zeros(theta.shape)
    grid = gradient_grid(clip_norm, scale_bits)
    rows = min(_EXACT_CHUNK_ROWS, max(256, CHUNK_BYTES // (8 * q.shape[1])))
    total = None
    for start in range(0, m, rows):
        chunk = slice(start, start + rows)
        qc, sc = q[chunk], shift[chunk]
        with _quiet():
            scores = np.ldexp(_row_scores(qc, theta), sc[:, None])
            derivative = loss.derivative(scores, labels[chunk])
            direction, size = _unit_derivatives(derivative)
            # ||gradient_i|| = size * ||q_i|| 2^shift; clipped: size 2^shift <= C / ||q_i||,
            # less _CLIP_MARGIN: the float quotient, the norm (a float sum of d squares) and the
            # unit direction each carry a few roundings, which must not carry a row past C
            # (found by a test: 1 part in 1e16 over, at an exact integer level).
            magnitude = np.minimum(np.ldexp(size, sc),
                                   clip_norm / np.maximum(q_norms[chunk], 1.0)) * _CLIP_MARGIN
            u = np.trunc(direction * (magnitude / grid)[:, None])      # |u| <= 2^U, integers
        part = ExactSum.of(u.T @ qc)   # integers below 2^52: exact in float64, any order
        total = part if total is None else total + part
    return total


# ------------------------------------------------ exact sums of bounded vectors on a public grid
#
# The other secure releases (SSP's Gram matrix, DP-AMBSSGD's levels, the clipped means of
# ``beam_dp.stats``) sum vectors that were clipped (or normalized, or clamped) to a public L2
# bound B. They are put on a public grid g, a power of two (so that x / g is exact), by rounding
# each entry to the nearest integer: an entry moves by at most 1/2, a row of j entries by at
# most sqrt(j) / 2 in L2, so the rounded rows have norm at most
#     B / g (1 + 2^-30) + sqrt(j) / 2              (``grid_row_bound``)
# in grid units, the 2^-30 allowing for the clipping's own float rounding (a few ulps: the
# clipped norm is B up to rounding). That bound, not B / g, is the sensitivity the noise is
# scaled to ("the sensitivity enlarged for the rounding"). It is not taken on trust:
# ``grid_rows`` certifies every row against it in float arithmetic with a proven error margin,
# and shrinks (then zeroes) a row that fails, a function of that row alone, so that the bound
# holds for every input whatever the float rounding upstream did.

_GRID_MARGIN = 2.0 ** -30
_UNIT_ROUNDOFF = 2.0 ** -53


def grid_exponent(bound: float) -> int:
    """The e with 2^(e-1) < bound <= 2^e, for a positive finite ``bound`` (exact: frexp)."""
    mantissa, exponent = math.frexp(float(bound))
    if not (mantissa > 0 and math.isfinite(bound)):
        raise ValueError("a grid's bound must be positive and finite")
    return exponent - 1 if mantissa == 0.5 else exponent


def grid_row_bound(bound: float, grid: float, width: int) -> float:
    """The L2 norm, in units of ``grid``, that rows of norm at most ``bound`` (up to the float
    rounding of a clip) can have once rounded to the grid (see above)."""
    return float(bound) / float(grid) * (1.0 + _GRID_MARGIN) + math.sqrt(width) / 2.0


def grid_rows(rows: np.ndarray, grid: float, limit: float) -> np.ndarray:
    """``rows`` (m, j), each of L2 norm about ``grid_row_bound`` or less, as integers of the
    power-of-two ``grid``: integer-valued float64 p (m, j) with ||p_i|| <= ``limit`` for every
    row, guaranteed (see above). ``limit`` must be below 2^50, so that every entry and every
    partial sum of squares here is far inside float64's exact integers.

    The certificate: the float sum of squares s of a row of j integers has relative error at
    most j u / (1 - j u) (u = 2^-53); a row passes when s (1 + 2 (j + 2) u) <= limit^2 (1 - 4u),
    which implies ||p_i||^2 <= limit^2 exactly. A row that fails (none does when the rows were
    clipped to the bound, as the callers do) is scaled by limit / sqrt(s) (1 - 2^-20) and
    truncated towards zero (which only shrinks), and zeroed if it still fails; NaN or infinite
    rows (never from validated input) become zero. Silent for any input."""
    if not (grid > 0 and math.frexp(grid)[0] == 0.5):
        raise ValueError("the grid must be a positive power of two")
    if not 0 < limit < 2.0 ** 50:
        raise ValueError("a grid row bound must be in (0, 2^50)")
    rows = np.asarray(rows, dtype=np.float64)
    width = rows.shape[1] if rows.ndim == 2 else 1
    exponent = math.frexp(grid)[1] - 1
    with _quiet():
        p = np.rint(np.ldexp(rows, -exponent))
        p[~np.isfinite(p).all(axis=1)] = 0.0
        p = np.clip(p, -2.0 ** 51, 2.0 ** 51)   # a row beyond the bound fails below anyway
        ceiling = limit * limit * (1.0 - 4 * _UNIT_ROUNDOFF)
        slack = 1.0 + 2 * (width + 2) * _UNIT_ROUNDOFF
        squares = np.einsum("ij,ij->i", p, p)
        failed = np.flatnonzero(squares * slack > ceiling)
        if failed.size:
            factor = limit / np.sqrt(squares[failed]) * (1.0 - 2.0 ** -20)
            shrunk = np.trunc(p[failed] * factor[:, None])
            again = np.einsum("ij,ij->i", shrunk, shrunk) * slack > ceiling
            shrunk[again] = 0.0
            p[failed] = shrunk
    return p


def exact_row_sum(p: np.ndarray, limit: float) -> ExactSum:
    """The exact sum over the rows of ``grid_rows``' integers p (entries at most ``limit`` in
    magnitude): int64 sums of chunks small enough not to overflow, added as ``ExactSum``s. The
    same integers for any order and split of the rows."""
    m = p.shape[0]
    if m == 0:
        return ExactSum.zeros(p.shape[1:])
    chunk = max(1, int(2.0 ** 62 // max(math.ceil(limit), 1)))
    ints = p.astype(np.int64)
    total = None
    for start in range(0, m, chunk):
        part = ExactSum.of(ints[start:start + chunk].sum(axis=0))
        total = part if total is None else total + part
    return total


def exact_gram(z: np.ndarray, entry_bound: float) -> ExactSum:
    """Z^T Z of integer-valued float64 rows z (m, j) with |z_ik| <= ``entry_bound``, exactly:
    chunks of rows whose products sum to below 2^52 in float64 (exact in any order, BLAS and its
    fused multiply-adds included), added as ``ExactSum``s."""
    m, j = z.shape
    if m == 0:
        return ExactSum.zeros((j, j))
    chunk = int(2.0 ** 52 // max(float(entry_bound) ** 2, 1.0))
    if chunk < 1:
        raise ValueError("grid entries too large for an exact Gram matrix")
    total = None
    for start in range(0, m, chunk):
        rows = z[start:start + chunk]
        part = ExactSum.of(rows.T @ rows)
        total = part if total is None else total + part
    return total


def quantized_scores(theta: np.ndarray, q: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """The scores (m, k) of the quantized rows (q, shift) (``quantized_rows``, with the intercept
    column), each a function of its row alone (``_row_scores``), as the exact kernels see them;
    +-inf where they overflow, silently."""
    with _quiet():
        return np.ldexp(_row_scores(q, theta), shift[:, None])


def exact_clipped_gradient_sums(theta: np.ndarray, q: np.ndarray, shift: np.ndarray,
                                q_norms: np.ndarray, labels: np.ndarray,
                                loss: losses_mod.GlmLoss, clip_norms,
                                scale_bits: int = GRID_SCALE_BITS) -> ExactSum:
    """``exact_clipped_gradient_sum`` at several clip norms at once (the scores computed once):
    (L, k, d + 1), level l in units of ``gradient_grid(clip_norms[l], scale_bits)`` and equal to
    ``exact_clipped_gradient_sum(..., clip_norms[l], scale_bits)``, integer for integer (the same
    per-row integers; one BLAS product for all levels, exact as every sum stays below 2^52).
    Each row adds at most 2^(GRID_FEATURE_BITS - 1 + scale_bits) in norm to every level."""
    clip_norms = [float(c) for c in np.atleast_1d(clip_norms)]
    levels, m = len(clip_norms), q.shape[0]
    if m == 0:
        return ExactSum.zeros((levels,) + theta.shape)
    grids = [gradient_grid(c, scale_bits) for c in clip_norms]
    k = theta.shape[0]
    rows = min(_EXACT_CHUNK_ROWS, max(256, CHUNK_BYTES // (8 * q.shape[1])))
    total = None
    for start in range(0, m, rows):
        chunk = slice(start, start + rows)
        qc, sc = q[chunk], shift[chunk]
        with _quiet():
            scores = np.ldexp(_row_scores(qc, theta), sc[:, None])
            derivative = loss.derivative(scores, labels[chunk])
            direction, size = _unit_derivatives(derivative)
            level_size = np.ldexp(size, sc)
            u = np.empty((qc.shape[0], levels, k))
            for l, (clip_norm, grid) in enumerate(zip(clip_norms, grids)):
                # As in exact_clipped_gradient_sum, expression for expression.
                magnitude = np.minimum(level_size,
                                       clip_norm / np.maximum(q_norms[chunk], 1.0)) * _CLIP_MARGIN
                u[:, l, :] = np.trunc(direction * (magnitude / grid)[:, None])
        part = ExactSum.of((u.reshape(len(qc), levels * k).T @ qc).reshape(levels, k, -1))
        total = part if total is None else total + part
    return total
