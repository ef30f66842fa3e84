"""``Constraint``: the public, JSON-serialisable description of the constraint set C of a
constrained DP run, and what the algorithms ask of it (validation, projection, diameter,
Gaussian width), built on the other geometry modules."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from beam_dp.geometry.checks import _as_vectors, _check_d, _check_radius, _quiet
from beam_dp.geometry.norms import lp_norm
from beam_dp.geometry.projections import (_box_bounds, _check_vertices, project_box, project_hull,
                                          project_l1_ball, project_l2_ball, project_simplex)
from beam_dp.geometry.widths import (gaussian_width_box, gaussian_width_l1_ball,
                                     gaussian_width_l2_ball, gaussian_width_mc,
                                     gaussian_width_simplex)


KINDS = ("none", "l2-ball", "l1-ball", "simplex", "box", "hull")


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
