"""Blocks of examples read from Parquet or CSV shards, with validation.

A Block is a batch of examples as numpy arrays; it carries where it came from (file and first
row) so that sampling can be keyed by an example's position, reproducibly on every runner, and so
that bad input is reported by file and row.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from beam_dp import losses as losses_mod

DEFAULT_BATCH_ROWS = 65536


class DataError(Exception):
    """Bad input. The message is one line naming the file (and row where known)."""

    # The CLI finds this marker in errors that come back wrapped by a Beam runner.
    MARKER = "beam-dp input error: "

    def __init__(self, message: str):
        # Beam re-raises a worker's error as type(e)(e.args[0] + " [while running '<step>']"),
        # whose message already carries the marker: add it only once.
        super().__init__(message if message.startswith(self.MARKER) else self.MARKER + message)

    @property
    def detail(self) -> str:
        return str(self)[len(self.MARKER):]


@dataclasses.dataclass
class Block:
    """A batch of m examples: features (m, d) float64, encoded labels (m,), squared feature norms."""

    features: np.ndarray
    labels: np.ndarray
    source: str = ""
    row_start: int = 0
    sq_norms: np.ndarray | None = None
    tag: int = -1   # which part of a partitioned dataset the rows belong to (e.g. a block and role)

    def __post_init__(self):
        if self.sq_norms is None:
            self.sq_norms = np.einsum("ij,ij->i", self.features, self.features)

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def key(self) -> int:
        """A 63-bit integer naming this block's position (file path and first row)."""
        digest = hashlib.blake2b(f"{self.source}\0{self.row_start}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def take(self, rows: np.ndarray) -> "Block":
        return Block(self.features[rows], self.labels[rows], self.source, self.row_start,
                     self.sq_norms[rows], self.tag)


def file_format(path: str) -> str:
    lower = path.lower()
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    if lower.endswith((".csv", ".csv.gz")):
        return "csv"
    raise DataError(f"{path}: unknown file type (expected .parquet, .pq, .csv or .csv.gz)")


def list_files(pattern: str) -> list[str]:
    """The files matching a glob (or a comma-separated list of globs), sorted, as absolute paths."""
    files: list[str] = []
    for part in [p for p in pattern.split(",") if p]:
        if "://" in part:
            # Remote file systems (gs://, s3://, hdfs://) are listed through Beam's FileSystems.
            from apache_beam.io.filesystems import FileSystems
            matched = [m.path for r in FileSystems.match([part]) for m in r.metadata_list]
        else:
            matched = [os.path.abspath(p) for p in glob.glob(os.path.expanduser(part))
                       if os.path.isfile(p)]
        if not matched:
            raise DataError(f"{part}: no input files match")
        files.extend(matched)
    return sorted(set(files))


def open_local(path: str) -> BinaryIO:
    # pyarrow does not decompress a file object by itself; an input stream does, by extension.
    return pa.input_stream(path) if path.endswith(".gz") else open(path, "rb")


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def read_schema(path: str, opener: Callable[[str], BinaryIO] = open_local) -> pa.Schema:
    try:
        with opener(path) as f:
            if file_format(path) == "parquet":
                return pq.ParquetFile(f).schema_arrow
            return pa_csv.open_csv(f).schema
    except DataError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read ({_one_line(e)})") from None


def resolve_feature_columns(path: str, label_column: str, feature_columns: Sequence[str] | None,
                            opener: Callable[[str], BinaryIO] = open_local,
                            require_label: bool = True) -> list[str]:
    """Checks the label and features against the first file's schema; the default features are
    every numeric column but the label."""
    schema = read_schema(path, opener)
    names = set(schema.names)
    if require_label and label_column not in names:
        raise DataError(f"{path}: label column '{label_column}' not found (columns: {', '.join(schema.names)})")
    if feature_columns:
        missing = [c for c in feature_columns if c not in names]
        if missing:
            raise DataError(f"{path}: feature column(s) not found: {', '.join(missing)}")
        if label_column in feature_columns:
            raise DataError(f"the label column '{label_column}' is also listed as a feature")
        columns = list(feature_columns)
    else:
        columns = [f.name for f in schema if f.name != label_column and _numeric(f.type)]
        if not columns:
            raise DataError(f"{path}: no numeric feature columns besides the label '{label_column}'")
    for name in columns + ([label_column] if require_label else []):
        t = schema.field(name).type
        # CSV types are inferred from the first block only; later rows are checked on conversion.
        if not _numeric(t) and not (file_format(path) == "csv" and pa.types.is_null(t)):
            raise DataError(f"{path}: column '{name}' is not numeric ({t})")
    return columns


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _record_batches(path: str, f: BinaryIO, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    if file_format(path) == "parquet":
        yield from pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=columns)
    else:
        reader = pa_csv.open_csv(
            f,
            read_options=pa_csv.ReadOptions(block_size=1 << 24),
            convert_options=pa_csv.ConvertOptions(
                include_columns=columns,
                column_types={c: pa.float64() for c in columns}))
        # The CSV reader batches by bytes (block_size), not rows: cut to at most batch_rows.
        for batch in reader:
            for offset in range(0, batch.num_rows, batch_rows):
                yield batch.slice(offset, batch_rows)


def _column_as_float(path: str, batch: pa.RecordBatch, name: str) -> np.ndarray:
    # Nulls become NaN, which the finiteness checks then report by row.
    column = batch.column(name)
    if not (_numeric(column.type) or pa.types.is_null(column.type)):
        raise DataError(f"{path}: column '{name}' is not numeric ({column.type})")
    return column.cast(pa.float64()).to_numpy(zero_copy_only=False)


def blocks_from_file(path: str, label_column: str | None, feature_columns: Sequence[str],
                     loss: losses_mod.GlmLoss, batch_rows: int = DEFAULT_BATCH_ROWS,
                     opener: Callable[[str], BinaryIO] = open_local) -> Iterator[Block]:
    """Reads one file into validated Blocks of at most ``batch_rows`` rows.

    ``label_column`` None reads features only (for prediction); the labels are then zeros.
    Raises DataError naming the file (and the 1-based data row, header excluded) on a missing
    column, a non-numeric value, a missing or non-finite value, or a label the model cannot use.
    """
    columns = list(feature_columns) + ([label_column] if label_column is not None else [])
    row_start = 0
    try:
        with opener(path) as f:
            for batch in _record_batches(path, f, columns, batch_rows):
                m = batch.num_rows
                if m == 0:
                    continue
                features = np.empty((m, len(feature_columns)), dtype=np.float64)
                for j, name in enumerate(feature_columns):
                    features[:, j] = _column_as_float(path, batch, name)
                bad = np.flatnonzero(~np.isfinite(features).all(axis=1))
                if bad.size:
                    j = int(np.flatnonzero(~np.isfinite(features[bad[0]]))[0])
                    raise DataError(f"{path}, row {row_start + int(bad[0]) + 1}: feature "
                                    f"'{feature_columns[j]}' is missing or not finite")
                if label_column is None:
                    yield Block(features, np.zeros(m), path, row_start)
                    row_start += m
                    continue
                try:
                    labels = loss.encode_labels(_column_as_float(path, batch, label_column))
                except losses_mod.LabelError as e:
                    raise DataError(f"{path}, row {row_start + e.row + 1}: {e}") from None
                yield Block(features, labels, path, row_start)
                row_start += m
    except DataError:
        raise
    except KeyError as e:
        raise DataError(f"{path}: column {e} not found") from None
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read ({_one_line(e)})") from None


def load_blocks(files: Sequence[str], label_column: str, feature_columns: Sequence[str],
                loss: losses_mod.GlmLoss, batch_rows: int = DEFAULT_BATCH_ROWS) -> list[Block]:
    blocks = [b for path in files
              for b in blocks_from_file(path, label_column, feature_columns, loss, batch_rows)]
    if not blocks:
        raise DataError(f"{', '.join(files)}: the input has no rows")
    return blocks


def write_table(path: str, columns: dict[str, np.ndarray]) -> None:
    table = pa.table(columns)
    if file_format(path) == "parquet":
        pq.write_table(table, path)
    else:
        pa_csv.write_csv(table, path)
