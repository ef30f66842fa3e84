"""What every geometry kernel shares: its inputs checked (vectors, dimension, radius), and the
floating-point context in which over/underflow is handled explicitly (``beam_dp.geometry``)."""
from __future__ import annotations

import math

import numpy as np


def _quiet():
    """Over/underflow and 0/0 are expected in the kernels and handled explicitly (see
    ``beam_dp.geometry``)."""
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


def _check_d(d: int) -> int:
    if int(d) != d or d < 1:
        raise ValueError("the dimension d must be a positive integer")
    return int(d)


def _check_radius(radius: float) -> float:
    radius = float(radius)
    if not (radius > 0.0 and math.isfinite(radius)):
        raise ValueError("the radius must be finite and positive")
    return radius
