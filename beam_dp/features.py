"""Per-example feature transforms applied to blocks (numpy; no per-example loops).

They are public, data-independent maps (or maps whose parameters were released privately), so
applying them costs no privacy. A training step applies its transform to the sampled rows only.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from beam_dp import clipping
from beam_dp.data import Block


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
    """x_j -> (clip(x_j, low_j, high_j) - mid_j) / half_j, into [-1, 1] (a column with
    low_j == high_j becomes 0): each column on its own privately released range
    (``--scale-features private``), so that a column in dollars and a 0/1 column weigh alike
    against the clip norm. Bounded by construction: no value, however large, passes 1."""

    low: tuple
    high: tuple

    def __call__(self, block: Block) -> Block:
        low, high = np.asarray(self.low), np.asarray(self.high)
        half = (high - low) / 2.0
        mid = low + half
        clipped = np.clip(block.features, low, high)   # NaN never reaches here (checked)
        scaled = np.divide(clipped - mid, half, out=np.zeros_like(clipped), where=half > 0)
        return Block(scaled, block.labels, block.source, block.row_start, tag=block.tag)


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
    if type(transform) is ScaleColumns:
        return {"scale_columns": {"low": [float(v) for v in transform.low],
                                  "high": [float(v) for v in transform.high]}}
    for name, cls in _RECORDABLE.items():
        if type(transform) is cls:
            return {name: float(transform.norm)}
    raise ValueError(f"{type(transform).__name__} cannot be recorded in a model")


def from_spec(recorded: dict | None):
    """The map a recorded spec names (the identity for None or {})."""
    if not recorded:
        return lambda block: block
    (name, norm), = recorded.items()
    if name == "scale_columns":
        return ScaleColumns(tuple(float(v) for v in norm["low"]),
                            tuple(float(v) for v in norm["high"]))
    if name not in _RECORDABLE:
        raise ValueError(f"unknown feature_transform {name!r} in the model")
    return _RECORDABLE[name](float(norm))
