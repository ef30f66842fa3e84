"""A pandas DataFrame trained on as a table: ``beam_dp.train(frame, schema=...)`` reads it as
``input=`` reads a Parquet file with the same schema.

The frame becomes an Arrow table column by column from its declared dtypes (pyarrow's pandas
conversion, the one ``Model.predict`` applies to a frame: a NaN or None cell is missing, a text
column stays text), is written as Parquet bytes held in memory, and the data layer's Parquet
reader reads them through an opener of that buffer. So the column checks, the default features
(every numeric column but the label and the declared ones), the categorical encoding, the
missing-value policies, the privacy unit and every error are the files' own, and no row is
written to disk. The in-memory file has one fixed name, so a fixed seed gives the same model on
every run (a block's position, which keys sampling, names its file).
"""
from __future__ import annotations

import functools
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from beam_dp import data

# The in-memory file's name: what the data layer reads (its suffix picks the Parquet reader) and
# what its messages say, given back as ``SOURCE``.
PATH = "DataFrame.parquet"
SOURCE = "DataFrame"


def is_frame(X) -> bool:
    """A pandas DataFrame (duck-typed: pandas is an optional dependency)."""
    return hasattr(X, "columns") and hasattr(X, "dtypes")


class FrameTable:
    """A DataFrame (with its labels ``y`` as the column ``label_column``, if given apart) as an
    in-memory Parquet file; converted on first read, after every check of the request."""

    def __init__(self, frame, y, label_column: str):
        self.frame, self.y, self.label_column = frame, y, label_column

    @functools.cached_property
    def buffer(self) -> pa.Buffer:
        sink = pa.BufferOutputStream()
        pq.write_table(self.table(), sink)
        return sink.getvalue()

    def table(self) -> pa.Table:
        names = [str(c) for c in self.frame.columns]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"the DataFrame has more than one column named {', '.join(repeated)}")
        arrays = [_column(name, self.frame.iloc[:, j]) for j, name in enumerate(names)]
        if self.y is not None:
            if self.label_column in names:
                raise ValueError(f"y is given and the DataFrame has a column '{self.label_column}' "
                                 "(the label column) too: give the labels once")
            labels = np.asarray(self.y).reshape(-1)
            if len(labels) != len(self.frame):
                raise ValueError(f"X has {len(self.frame)} rows but y has {len(labels)}")
            arrays.append(_column(self.label_column, labels))
            names.append(self.label_column)
        return pa.Table.from_arrays(arrays, names=names)

    def open(self, path: str) -> BinaryIO:
        """The data layer's opener (``data.open_input``'s role) for ``PATH``."""
        if path != PATH:
            raise FileNotFoundError(path)
        return pa.BufferReader(self.buffer)


def _column(name: str, values) -> pa.Array:
    """One column by its dtype; pyarrow's message for a column it cannot convert (an object column
    of mixed types) quotes a cell, so it is replaced by one naming the column only."""
    try:
        return pa.Array.from_pandas(values) if hasattr(values, "dtype") and hasattr(
            values, "index") else pa.array(values, from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError):
        failure = (f"{SOURCE}: column '{name}' cannot be read as one type (its dtype is "
                   f"{getattr(values, 'dtype', 'unknown')}): give each column numbers, or text")
    raise data.DataError(failure)


def renamed(error: data.DataError) -> data.DataError:
    """A data error about the in-memory file, naming the DataFrame instead."""
    return data.DataError(error.detail.replace(PATH, SOURCE))
