"""What a statistic is computed on, per example: the feature columns, a selection or transform
of them, the feature norms, or the distances to a released center (``state`` holds releases)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import scipy.sparse as sp

from beam_dp import clipping


@dataclasses.dataclass(frozen=True)
class Columns:
    """The feature columns, (m, d)."""

    def __call__(self, block, state) -> np.ndarray:
        return block.features


@dataclasses.dataclass(frozen=True)
class Selected:
    """Some feature columns, then the label if ``label`` (a regression label's range is chosen
    with the columns'), (m, len(columns) + label)."""

    columns: tuple
    label: bool = False

    def __call__(self, block, state) -> np.ndarray:
        picked = block.features[:, list(self.columns)]
        if sp.issparse(picked):
            # CSR rows' numeric columns (the first ones, ``beam_dp.categorical``): a zero is
            # not stored, and is a value like any other here, so the few selected columns are
            # taken densely, (rows, len(columns)) per block.
            picked = picked.toarray()
        if self.label:
            picked = np.column_stack([picked, np.asarray(block.labels, dtype=np.float64)])
        return picked


@dataclasses.dataclass(frozen=True)
class Transformed:
    """The feature columns after a per-example transform (``beam_dp.features``), (m, d)."""

    transform: Callable

    def __call__(self, block, state) -> np.ndarray:
        return self.transform(block).features


@dataclasses.dataclass(frozen=True)
class Norms:
    """The L2 norm of each feature vector, (m, 1)."""

    def __call__(self, block, state) -> np.ndarray:
        # Overflow-safe: a row of 1e200 has norm 1e200 (sqrt of the overflowed square is inf).
        return clipping.row_norms(block.features, block.sq_norms)[:, None]


@dataclasses.dataclass(frozen=True)
class DistancesTo:
    """The L2 distance of each vector of ``values`` to the released point ``state[key]``, (m, 1)."""

    key: str
    values: Callable = Columns()

    def __call__(self, block, state) -> np.ndarray:
        diff = clipping.saturating_difference(self.values(block, state),
                                              np.asarray(state[self.key], float).reshape(-1))
        return clipping.row_norms(diff)[:, None]
