"""Per-example feature transforms applied to blocks (numpy; no per-example loops).

They are public, data-independent maps (or maps whose parameters were released privately), so
applying them costs no privacy. A training step applies its transform to the sampled rows only.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from beam_dp.data import Block


def _row_scale(sq_norms: np.ndarray, target: float, only_shrink: bool) -> np.ndarray:
    norms = np.sqrt(sq_norms)
    scale = target / np.maximum(norms, np.finfo(float).tiny)
    if only_shrink:
        scale = np.minimum(1.0, scale)
    return np.where(norms > 0, scale, 1.0)


def _scale_rows(block: Block, target: float, only_shrink: bool) -> Block:
    scale = _row_scale(block.sq_norms, target, only_shrink)
    return Block(block.features * scale[:, None], block.labels, block.source, block.row_start,
                 block.sq_norms * scale ** 2, block.tag)


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
        return Block(block.features - np.asarray(self.mean), block.labels, block.source, block.row_start)


@dataclasses.dataclass(frozen=True)
class CenterAugmentClip:
    """x -> Clip((x - mu, tau), sqrt(2) tau) (paper 000, Algorithm 2, steps 3-4): the appended
    constant tau carries the bias, and only points farther than tau from mu are shrunk."""

    mean: tuple
    tau: float

    def __call__(self, block: Block) -> Block:
        centered = block.features - np.asarray(self.mean)
        augmented = np.column_stack([centered, np.full(len(block), self.tau)])
        sq = np.einsum("ij,ij->i", centered, centered) + self.tau ** 2
        scale = _row_scale(sq, np.sqrt(2.0) * self.tau, only_shrink=True)
        return Block(augmented * scale[:, None], block.labels, block.source, block.row_start,
                     sq * scale ** 2)


@dataclasses.dataclass(frozen=True)
class Chain:
    """Transforms applied in order."""

    steps: tuple

    def __call__(self, block: Block) -> Block:
        for step in self.steps:
            block = step(block)
        return block
