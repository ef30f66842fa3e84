"""Per-example feature transforms applied to blocks (numpy; no per-example loops).

They are public, data-independent maps (or maps whose parameters were released privately), so
applying them costs no privacy. A training step applies its transform to the sampled rows only.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from beam_dp import clipping
from beam_dp.block import Block


def _scale_rows(block: Block, target: float, only_shrink: bool) -> Block:
    # Overflow-safe (clipping.scale_rows): a row of 1e200 comes out with norm ``target``, not as
    # zeros or NaN, and nothing is printed.
    features, sq_norms = clipping.scale_rows(block.features, target, only_shrink, block.sq_norms)
    return Block(features, block.labels, block.source, block.row_start, sq_norms, block.tag)


@dataclasses.dataclass(frozen=True)
class NormalizeRows:
    """x -> x * C / ||x|| (zero rows stay zero): every feature vector gets norm C (paper 000, App. C)."""

    norm: float

    def __call__(self, block: Block) -> Block:
        return _scale_rows(block, self.norm, only_shrink=False)


@dataclasses.dataclass(frozen=True)
class ClipRows:
    """x -> x * min(1, R / ||x||): feature vectors outside the public ball of radius R are shrunk."""

    norm: float

    def __call__(self, block: Block) -> Block:
        return _scale_rows(block, self.norm, only_shrink=True)


@dataclasses.dataclass(frozen=True)
class Center:
    """x -> x - mu (paper 000, Algorithm 3, step 2)."""

    mean: tuple

    def __call__(self, block: Block) -> Block:
        # Saturating: a difference beyond the float range stays finite (+-float max).
        return Block(clipping.saturating_difference(block.features, np.asarray(self.mean)),
                     block.labels, block.source, block.row_start)


@dataclasses.dataclass(frozen=True)
class CenterAugmentClip:
    """x -> Clip((x - mu, tau), sqrt(2) tau) (paper 000, Algorithm 2, steps 3-4): the appended
    constant tau carries the bias, and only points farther than tau from mu are shrunk."""

    mean: tuple
    tau: float

    def __call__(self, block: Block) -> Block:
        centered = clipping.saturating_difference(block.features, np.asarray(self.mean))
        augmented = np.column_stack([centered, np.full(len(block), self.tau)])
        out, sq = clipping.scale_rows(augmented, np.sqrt(2.0) * self.tau, only_shrink=True)
        return Block(out, block.labels, block.source, block.row_start, sq)


@dataclasses.dataclass(frozen=True)
class ScaleColumns:
    """x_j -> clip((x_j - mid_j) / half_j, -reach_j, reach_j): each column's range [low_j, high_j]
    mapped onto [-1, 1] (a column with low_j == high_j becomes 0; a column whose bounds are NaN
    is left as it is), so that a column in dollars and a 0/1 column weigh alike against the clip
    norm. ``reach`` (default 1 for every column): how far past its range a column may go. A
    declared range is the column's domain (reach 1); a privately released 2nd-98th percentile
    range keeps the tails up to ``reach`` times its half-width (4: the rare large values that
    carry a rare class's signal are not all made equal). Bounded by construction: no value,
    however large, passes its reach.

    On CSR rows (categorical columns) the ``len(low)`` entries are the numeric columns that come
    first (``categorical.Encoding.dense_names``); the one-hot columns after them are left as
    they are and the rows stay CSR.

    ``label_low``/``label_high`` (a regression label's range) map the label the same way during
    training only: the trained coefficients are mapped back to the label's units
    (``unscale_label``), so the recorded transform (``spec``) and predict leave labels alone.

    ``fill`` (per column, NaN for none): a column's privately released median/mean imputation
    value, put in its missing (NaN) cells before anything else, so that training, the quality
    check and predict scale the same filled value. (predict's encoding has filled them already:
    the fill is recorded there too.)"""

    low: tuple
    high: tuple
    label_low: float | None = None
    label_high: float | None = None
    reach: tuple | None = None
    label_reach: float = 1.0   # the label's reach (1: a declared range is its domain)
    fill: tuple | None = None

    def __call__(self, block: Block) -> Block:
        if sp.issparse(block.features):
            features = self._scaled_sparse(block.features)
        else:
            features = self._scaled(block.features)
        labels = block.labels
        if self.label_low is not None:
            label_half = (self.label_high - self.label_low) / 2.0
            label_mid = self.label_low + label_half
            labels = np.clip((np.clip(labels, label_mid - self.label_reach * label_half,
                                      label_mid + self.label_reach * label_half) - label_mid)
                             / label_half, -self.label_reach, self.label_reach)
        return Block(features, labels, block.source, block.row_start, tag=block.tag)

    def _scaled_sparse(self, x):
        """CSR rows (``beam_dp.categorical``: the m numeric columns first, then the one-hot
        ones): the map applies to columns 0..m-1 (m = len(low)), the one-hot columns are left
        as they are (0/1 already), and the result stays CSR. A numeric column's unstored cells
        are zeros and are mapped like any other value (a zero rarely maps to zero), so the first
        m columns are taken densely: (rows, m) per block, bounded in rows, never rows x d."""
        x = sp.csr_matrix(x)
        m = len(self.low)
        if m > x.shape[1]:
            raise ValueError(f"the column map has {m} columns; the rows have {x.shape[1]}")
        numeric = sp.csr_matrix(self._scaled(x[:, :m].toarray()))
        out = sp.hstack([numeric, x[:, m:]], format="csr")
        out.eliminate_zeros()   # (a value mapped to 0 need not be stored)
        return out

    def _scaled(self, x: np.ndarray) -> np.ndarray:
        """The map of dense columns, one per entry of ``low``."""
        if self.fill is not None:
            fill = np.asarray(self.fill, dtype=np.float64)
            x = np.where(np.isnan(x) & ~np.isnan(fill), fill, x)
        low, high = np.asarray(self.low, dtype=np.float64), np.asarray(self.high, dtype=np.float64)
        keep = np.isnan(low) | np.isnan(high)
        low, high = np.where(keep, -1.0, low), np.where(keep, 1.0, high)
        half = (high - low) / 2.0
        mid = low + half
        reach = np.ones_like(low) if self.reach is None else np.asarray(self.reach, dtype=np.float64)
        # Clipped to the reach in the raw units first, so no difference overflows; NaN never
        # reaches here (checked at input, or filled above).
        clipped = np.clip(x, mid - reach * half, mid + reach * half)
        scaled = np.divide(clipped - mid, half, out=np.zeros_like(clipped), where=half > 0)
        scaled = np.clip(scaled, -reach, reach)   # (rounding)
        if keep.any():
            scaled = np.where(keep, x, scaled)
        return scaled

    def label_range(self) -> list:
        """The label's values as training saw them (clipped to its reach), in its units."""
        half = (self.label_high - self.label_low) / 2.0
        mid = self.label_low + half
        return [mid - self.label_reach * half, mid + self.label_reach * half]

    def scale_label(self, theta: np.ndarray) -> np.ndarray:
        """The inverse of ``unscale_label``: coefficients in the label's units, on the scaled
        label (a warm start's)."""
        if self.label_low is None:
            return theta
        label_half = (self.label_high - self.label_low) / 2.0
        out = np.array(theta, dtype=np.float64)
        out[:, -1] -= self.label_low + label_half
        return out / label_half

    def unscale_label(self, theta: np.ndarray) -> np.ndarray:
        """Coefficients trained on the scaled label, in the label's units: y = mid + half * y'
        (a post-processing of the released model)."""
        if self.label_low is None:
            return theta
        label_half = (self.label_high - self.label_low) / 2.0
        out = np.array(theta, dtype=np.float64) * label_half
        out[:, -1] += self.label_low + label_half
        return out


@dataclasses.dataclass(frozen=True)
class Chain:
    """Transforms applied in order."""

    steps: tuple

    def __call__(self, block: Block) -> Block:
        for step in self.steps:
            block = step(block)
        return block


# The maps a model can record in model.json ("feature_transform") and predict applies again.
# Training returns the transform object it applied; its spec is derived from that object, never
# from which flags were typed, so training and serving cannot disagree.
_RECORDABLE = {"normalize_rows": NormalizeRows, "clip_rows": ClipRows}


def spec(transform) -> dict | None:
    """The model.json form of a raw-feature map (None for the identity)."""
    if transform is None:
        return None
    if type(transform) is ScaleColumns:   # (the label's scale is folded into the coefficients)
        def listed(values):   # JSON has no NaN: None marks a column left as it is
            return [None if np.isnan(v) else float(v) for v in values]
        recorded = {"low": listed(transform.low), "high": listed(transform.high)}
        if transform.reach is not None:
            recorded["reach"] = [float(v) for v in transform.reach]
        if transform.fill is not None:
            recorded["fill"] = listed(transform.fill)
        if transform.label_low is not None:
            # Not applied by predict (the coefficients are in the label's units): kept so a
            # warm start can continue on the same scale.
            recorded["label"] = [float(transform.label_low), float(transform.label_high),
                                 float(transform.label_reach)]
        return {"scale_columns": recorded}
    for name, cls in _RECORDABLE.items():
        if type(transform) is cls:
            return {name: float(transform.norm)}
    raise ValueError(f"{type(transform).__name__} cannot be recorded in a model")


def ranges_as_bounds(recorded: dict) -> dict:
    """A recorded ``scale_columns`` map as declared bounds (``problem.source["bounds"]``: columns
    [index, low, high, reach], and the label's [low, high] with its reach), for a warm start."""
    reach = recorded.get("reach") or [1.0] * len(recorded["low"])
    columns = [[j, lo, hi, r] for j, (lo, hi, r) in enumerate(zip(recorded["low"], recorded["high"],
                                                                  reach)) if lo is not None]
    label = recorded.get("label")
    return {"columns": columns, "label": None if label is None else label[:2],
            **({"label_reach": label[2]} if label is not None else {})}


def from_spec(recorded: dict | None):
    """The map a recorded spec names (the identity for None or {})."""
    if not recorded:
        return lambda block: block
    (name, norm), = recorded.items()
    if name == "scale_columns":
        return ScaleColumns(tuple(np.nan if v is None else float(v) for v in norm["low"]),
                            tuple(np.nan if v is None else float(v) for v in norm["high"]),
                            reach=tuple(float(v) for v in norm["reach"]) if "reach" in norm
                            else None,
                            fill=tuple(np.nan if v is None else float(v) for v in norm["fill"])
                            if "fill" in norm else None)
    if name not in _RECORDABLE:
        raise ValueError(f"unknown feature_transform {name!r} in the model")
    return _RECORDABLE[name](float(norm))
