"""The Block: a batch of examples as numpy arrays (or a CSR matrix), and where they came from.

Its own module because every layer uses it: the readers that make Blocks (``beam_dp.data``),
user-level bounding (``beam_dp.user_level``), the samplers, the algorithms and the Beam
transforms. Keeping it apart from the file readers lets each of them depend on the type alone.

A Block carries where it came from (file and first row) so that sampling can be keyed by an
example's position, reproducibly on every runner, and so that bad input is reported by file and
row.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import scipy.sparse as sp


@dataclasses.dataclass
class Block:
    """A batch of m examples: features (m, d) float64, encoded labels (m,), squared feature norms.

    ``features`` is a numpy array, or a scipy CSR matrix for data with categorical columns
    (``beam_dp.categorical``): only the algorithms that declare ``sparse_input`` take those.

    ``sq_norms`` are computed plainly, so they are +inf for a row whose squared norm overflows
    (any entry beyond ~1e154) even though its norm is finite: use ``clipping.row_norms(features,
    sq_norms)`` for norms. The kernels that consume them (``beam_dp.clipping``) recompute such
    rows exactly.
    """

    features: np.ndarray
    labels: np.ndarray
    source: str = ""
    row_start: int = 0
    sq_norms: np.ndarray | None = None
    tag: int = -1   # which part of a partitioned dataset the rows belong to (e.g. a block and role)
    # Read for prediction only (no label): the rows a declared "drop" policy would leave out of
    # training, which get no prediction (None: none).
    dropped: np.ndarray | None = None
    # User-level privacy (``beam_dp.user_level``): each row's privacy unit as a 64-bit key
    # (a hash of the --privacy-unit-column value, never the value); None: rows are the unit.
    users: np.ndarray | None = None
    # Each row's user's number of rows before the cap on rows per user (``user_level.
    # group_by_user`` sets it): what the private histogram of rows per user counts.
    user_rows: np.ndarray | None = None
    # A batch file's rows (``beam_dp.batches``, summed by the workers): the step whose batch
    # they are in, or ``steps`` for every row once (``rows_group``); None: rows of the input.
    step: int | None = None

    def __post_init__(self):
        if self.sq_norms is None:
            # Overflow to inf is expected (and handled downstream) for huge rows; say nothing.
            with np.errstate(over="ignore", under="ignore"):
                if sp.issparse(self.features):
                    self.sq_norms = np.asarray(self.features.multiply(self.features).sum(axis=1)).ravel()
                else:
                    self.sq_norms = np.einsum("ij,ij->i", self.features, self.features)

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def sparse(self) -> bool:
        return sp.issparse(self.features)

    @property
    def key(self) -> int:
        """A 63-bit integer naming this block's position (file path and first row)."""
        digest = hashlib.blake2b(f"{self.source}\0{self.row_start}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def take(self, rows: np.ndarray) -> "Block":
        return Block(self.features[rows], self.labels[rows], self.source, self.row_start,
                     self.sq_norms[rows], self.tag,
                     users=self.users[rows] if self.users is not None else None,
                     user_rows=self.user_rows[rows] if self.user_rows is not None else None)

    def parts(self, tags: np.ndarray):
        """The rows grouped by ``tags`` (one int per row): a Block per tag present, in tag order,
        its ``tag`` set, its rows in their order (a batch plan's parts of this block)."""
        order = np.argsort(tags, kind="stable")
        bounds = np.flatnonzero(np.diff(tags[order])) + 1
        for rows in np.split(order, bounds):
            if rows.size:
                part = self.take(rows)
                part.tag = int(tags[rows[0]])
                yield part
