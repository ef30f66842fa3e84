"""Per-example gradient clipping for GLMs without per-example loops.

For a GLM the per-example gradient with respect to theta (k x (d+1)) is the outer product
``l'(s_i) (x_i, 1)``, so its Frobenius norm is ``||l'(s_i)||_2 * sqrt(||x_i||^2 + 1)``. Clipping
to C is therefore a per-row scale ``min(1, C / norm_i)`` applied to the loss derivative, and the
sum of clipped gradients is one matrix product ``(scale * l')^T [X, 1]``.
"""
from __future__ import annotations

import numpy as np

from beam_dp import losses as losses_mod


def gradient_norms(derivative: np.ndarray, sq_norms: np.ndarray, fit_intercept: bool) -> np.ndarray:
    """Per-example gradient norms from the loss derivative (m, k) and squared feature norms (m,)."""
    return np.sqrt(np.einsum("ij,ij->i", derivative, derivative) * (sq_norms + float(fit_intercept)))


def clip_factors(norms: np.ndarray, clip_norm: float) -> np.ndarray:
    """min(1, C / norm), with 1 for zero-norm rows."""
    with np.errstate(over="ignore"):  # a zero norm gives inf, i.e. a factor of 1
        return np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(np.float64).tiny))


def clipped_gradient_sum(theta: np.ndarray, features: np.ndarray, sq_norms: np.ndarray,
                         labels: np.ndarray, loss: losses_mod.GlmLoss, clip_norm: float,
                         fit_intercept: bool = True) -> np.ndarray:
    """Sum over the rows of the per-example gradients, each clipped to L2 norm ``clip_norm``.

    Returns an array shaped like theta (k, d + 1); the intercept column is zero when
    ``fit_intercept`` is off.
    """
    out = np.zeros_like(theta)
    if features.shape[0] == 0:
        return out
    derivative = loss.derivative(losses_mod.scores(theta, features), labels)
    scale = clip_factors(gradient_norms(derivative, sq_norms, fit_intercept), clip_norm)
    weighted = derivative * scale[:, None]
    out[:, :-1] = weighted.T @ features
    if fit_intercept:
        out[:, -1] = weighted.sum(axis=0)
    return out
