"""The constraint set of a constrained algorithm (paper 004), as declared options.

``ConstraintOptions`` is a mixin of an algorithm's options dataclass: ``--constraint``,
``--radius`` and ``--vertices`` (a file of the hull's vertices). The set constrains the model's
coefficients; the intercept, if any, is free (the set is C x R). It is public, part of the
model (recorded in model.json by ``TrainResult.constraint``), and checked when the options are
validated, before any data is read: a vertices file is read then (it is small and public).
"""
from __future__ import annotations

import dataclasses
import io
import json

import numpy as np

from beam_dp import geometry, storage
from beam_dp.algorithms.spec import option


@dataclasses.dataclass
class ConstraintOptions:
    constraint: str = option("l2-ball", "the set the coefficients must lie in: none, l2-ball, "
                                        "l1-ball (sparse models), simplex (weights summing to "
                                        "--radius), box ([-radius, radius] per coefficient) or "
                                        "hull (of --vertices)", choices=geometry.KINDS)
    radius: float = option(1.0, "the size of the set: the ball's radius, the simplex's sum, the "
                                "box's half width", low=0, low_open=True)
    vertices: str | None = option(None, "--constraint hull: a file of its vertices, one per row "
                                        "(.csv without a header, .npy or .json), as many columns "
                                        "as features")

    def check(self) -> None:
        if self.constraint == "hull" and not self.vertices:
            raise ValueError("--constraint hull needs --vertices (a file of the hull's vertices)")
        if self.vertices and self.constraint != "hull":
            raise ValueError("--vertices is only used with --constraint hull")
        if self.vertices:
            _read_vertices(self.vertices)   # a missing or unreadable file is refused now

    def constraint_set(self, dim: int) -> geometry.Constraint:
        """The validated set for ``dim`` coefficients."""
        vertices = _read_vertices(self.vertices) if self.vertices else None
        kind = self.constraint
        chosen = geometry.Constraint(kind, self.radius, vertices=vertices)
        chosen.validate(dim)
        return chosen


def _read_vertices(path: str) -> np.ndarray:
    """A k x d array of vertices from .npy, .json (a list of lists) or .csv (no header). Errors
    name the file, never a value in it."""
    try:
        content = storage.read_bytes(path)
    except FileNotFoundError:
        raise ValueError(f"--vertices {path}: no such file") from None
    except OSError:
        raise ValueError(f"--vertices {path}: cannot read") from None
    try:
        if path.endswith(".npy"):
            values = np.load(io.BytesIO(content), allow_pickle=False)
        elif path.endswith(".json"):
            values = np.asarray(json.loads(content), dtype=np.float64)
        else:
            values = np.loadtxt(io.StringIO(content.decode("utf-8")), delimiter=",",
                                dtype=np.float64, ndmin=2)
    except (OSError, ValueError, TypeError, UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"--vertices {path}: not a numeric table of vertices (one per row)") from None
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[0] < 1:
        raise ValueError(f"--vertices {path}: expected one vertex per row")
    if not np.all(np.isfinite(values)):
        raise ValueError(f"--vertices {path}: a vertex is not finite")
    return values
