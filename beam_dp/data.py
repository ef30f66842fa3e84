"""Blocks of examples read from Parquet or CSV shards, with validation.

The Block type itself is ``beam_dp.block``; here are the readers that make Blocks from files
(and from in-memory arrays), and the checks every input gets: bad input is reported by file
and row, never by value.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import os
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import scipy.sparse as sp

from beam_dp import categorical, storage, user_level
from beam_dp import losses as losses_mod
from beam_dp.block import Block

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
    if not pattern.strip(","):
        raise DataError("no input files given")
    for part in [p for p in pattern.split(",") if p]:
        if "://" in part:
            # Remote file systems (gs://, s3://, hdfs://) are listed through Beam's FileSystems.
            from apache_beam.io.filesystems import FileSystems
            matched = [m.path for r in FileSystems.match([part]) for m in r.metadata_list]
        else:
            # realpath: a file reached twice (through a link) must be read once, or its rows
            # would count twice while the accounting assumes each row once.
            matched = [os.path.realpath(p) for p in glob.glob(os.path.expanduser(part))
                       if os.path.isfile(p)]
        if not matched:
            raise DataError(f"{part}: no input files match")
        files.extend(matched)
    return sorted(set(files))


def open_input(path: str) -> BinaryIO:
    """A reader of an input file on any file system (``beam_dp.storage``), a .gz one
    decompressed: pyarrow does not decompress a file object by itself."""
    if storage.is_remote(path):
        f = storage.open_read(path)
        return pa.CompressedInputStream(f, "gzip") if path.endswith(".gz") else f
    return pa.input_stream(path) if path.endswith(".gz") else open(path, "rb")


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def read_schema(path: str, opener: Callable[[str], BinaryIO] = open_input) -> pa.Schema:
    """A Parquet file's declared schema; for CSV, the header's names, every column float64.

    CSV columns are numbers by declaration: nothing is inferred from the cells, since a type
    inferred from them would let one row change the feature set (and the released model).
    """
    failure = None
    try:
        with opener(path) as f:
            if file_format(path) == "parquet":
                schema = pq.ParquetFile(f).schema_arrow
                _refuse_repeated(path, schema.names, "the Parquet file")
                return schema
            return pa.schema([(name, pa.float64()) for name in _csv_header(path, f)])
    except DataError:
        raise
    except (OSError, pa.ArrowException) as e:
        failure = f"{path}: cannot read ({_reason(path, e)})"
    # Raised outside the handler so that no exception chained to it carries pyarrow's text.
    raise DataError(failure)


def _skip_row(row) -> str:
    return "skip"


def _csv_header(path: str, f: BinaryIO) -> list[str]:
    """The column names in a CSV file's header line."""
    # Only the names are taken. Opening the reader makes pyarrow infer types from the first block;
    # they are ignored. Rows with a wrong number of fields are skipped here and reported, by row,
    # when the file is read.
    names = None
    try:
        reader = pa_csv.open_csv(f, read_options=pa_csv.ReadOptions(use_threads=False),
                                 parse_options=pa_csv.ParseOptions(invalid_row_handler=_skip_row))
        names = reader.schema.names
    except pa.ArrowInvalid:
        pass   # pyarrow's message may quote the file's text
    if names is None:
        raise DataError(f"{path}: cannot read a CSV header line (the file is empty or not CSV)")
    _refuse_repeated(path, names, "the CSV header")
    return names


def _refuse_repeated(path: str, names, where: str) -> None:
    repeated = sorted(name for name, count in collections.Counter(names).items() if count > 1)
    if repeated:
        raise DataError(f"{path}: {where} has more than one column named "
                        f"{', '.join(repr(n) for n in repeated)}")


def check_shards_agree(files: Sequence[str], opener: Callable[[str], BinaryIO] = open_input,
                       ) -> None:
    """Every input file declares each column of the first one with the same kind of type
    (numeric, or not): the default feature set is read from the first file's types, and a
    column numeric in one shard and text in another would otherwise be left out (or refused)
    depending on which file sorts first. Names the files and columns, never a value."""
    if len(files) < 2 or file_format(files[0]) != "parquet":
        return   # CSV columns are all numbers by declaration
    first = read_schema(files[0], opener)
    kinds = {f.name: _numeric(f.type) for f in first}
    for path in files[1:]:
        schema = read_schema(path, opener)
        differ = sorted(f.name for f in schema if f.name in kinds and _numeric(f.type) != kinds[f.name])
        if differ:
            raise DataError(
                f"{path} and {files[0]} declare column(s) {', '.join(differ)} with different "
                "types (a number in one, not in the other): write every shard with the same "
                "schema, or give the feature columns (--schema / --feature-columns) and fix the "
                "shards' types")


def resolve_feature_columns(path: str, label_column: str, feature_columns: Sequence[str] | None,
                            opener: Callable[[str], BinaryIO] = open_input,
                            require_label: bool = True,
                            categorical: Sequence[str] = (), ignore: Sequence[str] = (),
                            text_label: bool = False) -> list[str]:
    """Checks the label and features against the first file's schema; returns the numeric
    feature columns. The default features are every column but the label (and the declared
    ``categorical`` and ``ignore`` columns): for CSV every column of the header, for Parquet every
    column whose declared type is numeric. Never a function of the values."""
    schema = read_schema(path, opener)
    names = set(schema.names)
    absent = [c for c in ignore if c not in names]
    if absent:
        raise DataError(f"{path}: ignored column(s) not found: {', '.join(absent)}")
    clash = sorted(set(ignore) & (set(feature_columns or ()) | set(categorical) | {label_column}))
    if clash:
        raise DataError(f"column(s) {', '.join(clash)} are both ignored and used (as a feature "
                        "or the label)")
    check_categorical(path, schema, categorical)
    if label_column in categorical:
        raise DataError(f"the label column '{label_column}' is also listed as categorical")
    if require_label and label_column not in names:
        raise DataError(f"{path}: label column '{label_column}' not found (columns: {', '.join(schema.names)})")
    both = sorted(set(feature_columns or ()) & set(categorical))
    if both:
        raise DataError(f"column(s) {', '.join(both)} are listed as both numeric and categorical "
                        "(--feature-columns and --categorical-columns)")
    if feature_columns:
        missing = [c for c in feature_columns if c not in names]
        if missing:
            raise DataError(f"{path}: feature column(s) not found: {', '.join(missing)}")
        if label_column in feature_columns:
            raise DataError(f"the label column '{label_column}' is also listed as a feature")
        columns = list(feature_columns)
    else:
        columns = [f.name for f in schema if f.name != label_column and _numeric(f.type)
                   and f.name not in categorical and f.name not in ignore]
        if not columns and not categorical:
            raise DataError(f"{path}: no numeric feature columns besides the label '{label_column}'")
    if require_label and text_label and file_format(path) == "parquet" and not _categorical_type(
            schema.field(label_column).type):
        raise DataError(f"{path}: the label column '{label_column}' cannot hold declared classes "
                        f"(its Parquet type is {schema.field(label_column).type}; string, integer "
                        "or boolean expected)")
    for name in columns + ([label_column] if require_label and not text_label else []):
        t = schema.field(name).type
        if not _numeric(t):   # only Parquet declares non-numeric types
            raise DataError(f"{path}: column '{name}' is not numeric (its Parquet type is {t})")
    return columns


def check_categorical(path: str, schema: pa.Schema, categorical: Sequence[str]) -> None:
    """The declared categorical columns exist in ``path``'s schema and can be categorical."""
    missing = [c for c in categorical if c not in schema.names]
    if missing:
        raise DataError(f"{path}: categorical column(s) not found: {', '.join(missing)}")
    for name in categorical:
        t = schema.field(name).type
        # CSV columns have the types they are declared (every cell is text until parsed);
        # only Parquet declares a type that can refuse.
        if file_format(path) == "parquet" and not _categorical_type(t):
            raise DataError(f"{path}: column '{name}' cannot be categorical (its Parquet type is "
                            f"{t}; string or integer expected)")


def _categorical_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
            or pa.types.is_boolean(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _reason(path: str, e: BaseException) -> str:
    """Why a file could not be read, for a message. pyarrow's CSV errors quote the offending
    line or cell, so for CSV only file-system errors (OSError) are passed on; Parquet's errors
    describe the file's structure."""
    if isinstance(e, OSError) or file_format(path) == "parquet":
        return _one_line(e)
    return "not valid CSV"


class _FirstInvalidRow:
    """Given to pyarrow's CSV parser, which calls it for a row whose number of fields differs
    from the header's: keeps the first such row's record number (the header is record 1, so it
    is the 1-based data row plus one; pyarrow numbers rows only when parsing on one thread)."""

    def __init__(self):
        self.seen = False
        self.number: int | None = None
        self.expected = 0

    def __call__(self, row) -> str:
        if not self.seen:
            self.seen, self.number, self.expected = True, row.number, row.expected_columns
        return "error"


def _csv_batches(path: str, f: BinaryIO, columns: list[str],
                 text_columns: Sequence[str] = ()) -> Iterator[pa.RecordBatch]:
    """The columns of a CSV file as float64 (null for an empty or NA cell), in batches of about
    16 MiB of text.

    Every cell is read as text and then parsed as a number (``_parse_csv_batch``), so that what a
    column is never depends on its cells, and a cell that is not a number is found by row.
    """
    invalid = _FirstInvalidRow()
    rows_read = 0
    reader = None
    while True:
        failed = False
        try:
            if reader is None:
                reader = pa_csv.open_csv(
                    f,
                    read_options=pa_csv.ReadOptions(block_size=1 << 24, use_threads=False),
                    parse_options=pa_csv.ParseOptions(invalid_row_handler=invalid),
                    convert_options=pa_csv.ConvertOptions(
                        include_columns=columns,
                        column_types={c: pa.string() for c in columns},
                        # Every cell as text, none null: which texts mean "missing" is decided
                        # per column kind (``_parse_csv_batch``), so that a categorical value
                        # "NA" stays a value while an "NA" number is missing.
                        strings_can_be_null=False,
                        # Bytes that are not UTF-8 fail the number parser, which reports the row.
                        check_utf8=False))
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid:
            failed = True   # pyarrow's message quotes the line: dropped, raised below unchained
        if failed:
            if reader is None and not invalid.seen:
                raise DataError(f"{path}: cannot read a CSV header line (the file is empty or "
                                "not CSV)")
            if invalid.seen and invalid.number is not None:
                raise DataError(f"{path}, row {invalid.number - 1}: wrong number of fields (the "
                                f"header has {invalid.expected})")
            raise DataError(f"{path}: not valid CSV after data row {rows_read}"
                            + (f" (a row does not have the header's {invalid.expected} fields)"
                               if invalid.seen else ""))
        yield _parse_csv_batch(path, batch, rows_read, text_columns)
        rows_read += batch.num_rows


def record_batches(path: str, f: BinaryIO, columns: list[str], batch_rows: int,
                    row_groups: Sequence[int] | None = None,
                    text_columns: Sequence[str] = ()) -> Iterator[pa.RecordBatch]:
    if file_format(path) == "parquet":
        # (the few label, key or categorical columns read this way; training's numeric columns
        # are read by _row_batches, a few at a time)
        yield from pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=columns,
                                                  row_groups=row_groups)
    else:
        # The CSV reader batches by bytes (block_size), not rows: cut to at most batch_rows.
        for batch in _csv_batches(path, f, columns, text_columns):
            for offset in range(0, batch.num_rows, batch_rows):
                yield batch.slice(offset, batch_rows)


# A Parquet row group is decoded this many bytes of columns at a time (PARQUET_READ_BYTES // 8 /
# rows columns a read). Why not ``ParquetFile.iter_batches``: its reader holds buffers for every
# requested column at once; on a 20,000 x 10,000 table (one row group, 1.5 GB of doubles) it
# peaked at 7.6 GB before the first batch. Read 32 MB at a time into the rows
# (``_row_batches``), a local one-epoch DP-SGD command peaked at 1.26x that table's features
# over its imports, and at 1.29x on a 10^6 x 50 table (1.56x at 64 MB a read, 1.24x at 16 MB,
# where the wide table took 7 s to read rather than 4).
PARQUET_READ_BYTES = 32 << 20


def _row_batches(path: str, f: BinaryIO, columns: list[str], numeric: list[str], batch_rows: int,
                 row_groups: Sequence[int] | None, text_columns: Sequence[str]):
    """(record batch of ``columns``, its ``numeric`` columns as (m, d) float64 rows) for at most
    ``batch_rows`` rows at a time. Parquet: the record batch holds only the other columns (the
    label, categorical and key columns), and each row group's numeric columns are decoded a few
    at a time straight into the rows, each read dropped once copied: the rows, not a decoded
    copy of them too (a 10^6 x 50 table peaked at 1.63x its features while reading, with the
    row group decoded whole; a 20,000 x 10,000 one at 2.4x)."""
    if file_format(path) != "parquet":
        for batch in record_batches(path, f, columns, batch_rows, row_groups, text_columns):
            yield batch, _row_major(path, batch, numeric)
        return
    parquet = pq.ParquetFile(f)
    wanted = set(numeric)
    others = [c for c in columns if c not in wanted]
    for group in range(parquet.num_row_groups) if row_groups is None else row_groups:
        rows = parquet.metadata.row_group(group).num_rows
        features = np.empty((rows, len(numeric)), dtype=np.float64)
        step = max(1, PARQUET_READ_BYTES // max(1, 8 * rows))
        for a in range(0, len(numeric), step):
            part = parquet.read_row_group(group, columns=numeric[a:a + step])
            _row_major(path, part, numeric[a:a + step], out=features[:, a:a + step])
            del part
        rest = parquet.read_row_group(group, columns=others)
        for start in range(0, rows, batch_rows):
            yield (rest.slice(start, batch_rows).combine_chunks().to_batches()[0]
                   if others else pa.record_batch([], schema=pa.schema([]))
                   ), features[start:start + batch_rows]


def read_columns(path: str, columns: Sequence[str], batch_rows: int = DEFAULT_BATCH_ROWS,
                 opener: Callable[[str], BinaryIO] = open_input) -> dict[str, pa.ChunkedArray]:
    """Columns of one file as they are (predict's id columns): Parquet's declared types, CSV's
    cells as text (no type is guessed from the cells)."""
    columns = list(columns)
    absent = [c for c in columns if c not in read_schema(path, opener).names]
    if absent:
        raise DataError(f"{path}: id column(s) not found: {', '.join(absent)}")
    failure = None
    try:
        with opener(path) as f:
            batches = list(record_batches(path, f, columns, batch_rows, None, tuple(columns)))
        return {c: pa.chunked_array([b.column(c) for b in batches],
                                    type=batches[0].schema.field(c).type if batches else pa.string())
                for c in columns}
    except (OSError, pa.ArrowException) as e:
        failure = f"{path}: cannot read ({_reason(path, e)})"
    raise DataError(failure)


def _parse_numbers(text: pa.Array) -> pa.Array:
    """Text cells as float64; raises ArrowInvalid if one is not a number. The cast takes the
    literals pyarrow's own CSV number parser takes (sign, decimals, exponent, inf)."""
    try:
        return pc.cast(text, pa.float64())
    except pa.ArrowInvalid:
        # Blanks around a number are allowed, as in pyarrow's CSV parser. Trimmed only when
        # needed: the trim costs about a quarter of the cast.
        return pc.cast(pc.ascii_trim_whitespace(text), pa.float64())


def _first_non_number(text: pa.Array) -> int:
    """Index of the first cell of ``text`` that ``_parse_numbers`` refuses, given one does: a
    bisection whose probes are vectorized casts of halving slices (about one pass in all)."""
    lo, hi = 0, len(text)   # the first refused cell is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            _parse_numbers(text.slice(lo, mid - lo))
            lo = mid
        except pa.ArrowInvalid:
            hi = mid
    return lo


@functools.cache
def _null_tokens() -> pa.Array:
    # Made on first use, not at import: an Arrow array at import time starts Arrow's memory pool,
    # whose address-space reservation broke tests/test_accountant_limits.py's 1.5 GB cap.
    return pa.array(pa_csv.ConvertOptions().null_values, type=pa.string())


def _parse_csv_batch(path: str, batch: pa.RecordBatch, row_start: int,
                     text_columns: Sequence[str] = ()) -> pa.RecordBatch:
    """A batch of CSV text columns parsed as float64, one vectorized cast per column, except the
    ``text_columns`` (categorical), kept as text. A cell that is not a number stops the read,
    naming the earliest such row (and its column)."""
    parsed, refused = [], []
    for name, column in zip(batch.schema.names, batch.columns):
        if name in text_columns:
            parsed.append(column)   # an empty cell is missing (``categorical.as_text``)
            continue
        # pyarrow's own missing-number tokens ("", "NA", "nan", ...) as nulls, as its CSV
        # number parser would read them (a null is then reported as missing, by row).
        column = pc.if_else(pc.is_in(column, value_set=_null_tokens()), pa.scalar(None, pa.string()),
                            column)
        try:
            parsed.append(_parse_numbers(column))
        except pa.ArrowInvalid:
            refused.append(name)   # pyarrow's message quotes the cell: it is dropped
    if refused:
        row, name = min(((_first_non_number(batch.column(name)), name) for name in refused),
                        key=lambda found: found[0])   # the earliest row; on a tie, the first column
        # Raised outside the handler so that no exception chained to it carries pyarrow's text.
        raise DataError(f"{path}, row {row_start + row + 1}: column '{name}' is not a number")
    return pa.RecordBatch.from_arrays(parsed, names=batch.schema.names)


def _row_major(path: str, batch, names: Sequence[str], out: np.ndarray | None = None) -> np.ndarray:
    """The columns ``names`` of ``batch`` (a record batch or table) as one (m, d) float64 array,
    rows contiguous (written into ``out`` if given). Copied a group of columns at a time
    through a (group, m) buffer: written one by one, a column's stores land a row (8 d bytes)
    apart, a page apart on a wide table (4.1 s of 7.8 s reading a 20,000 x 10,000 table;
    np.stack of 64 columns 3.1 s, this ~1 s)."""
    m = batch.num_rows
    features = np.empty((m, len(names)), dtype=np.float64) if out is None else out
    width = int(min(128, max(8, (32 << 20) // max(1, 8 * m))))   # a buffer of <= ~32 MB
    for a in range(0, len(names), width):
        group = names[a:a + width]
        buffer = np.empty((len(group), m))
        for k, name in enumerate(group):
            buffer[k] = _column_as_float(path, batch, name)
        features[:, a:a + len(group)] = buffer.T
    return features


def _column_as_float(path: str, batch: pa.RecordBatch, name: str) -> np.ndarray:
    # Nulls become NaN, which the finiteness checks then report by row.
    column = batch.column(name)
    if not (_numeric(column.type) or pa.types.is_null(column.type)):
        raise DataError(f"{path}: column '{name}' is not numeric (its Parquet type is {column.type})")
    # safe=False: a safe cast refuses integers beyond 2**53 with a message quoting the value;
    # rounding them to float64 is what reading them as features means.
    return column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)


def _missing_columns(path: str, columns: list[str], opener: Callable[[str], BinaryIO]) -> str:
    """The message for a file that lacks some of ``columns`` (which it names)."""
    names = set(read_schema(path, opener).names)
    missing = [c for c in columns if c not in names]
    return f"{path}: column(s) not found: {', '.join(missing) if missing else 'some requested'}"


@dataclasses.dataclass(frozen=True)
class Shard:
    """A unit of input a worker reads: a whole file, or (Parquet) a run of its row groups.
    Shards are what flows through a job's steps (a few bytes each), never the rows themselves."""

    path: str
    row_groups: tuple[int, ...] | None = None   # None: the whole file
    row_start: int = 0                          # the shard's first row within its file
    rows: int | None = None                     # from Parquet metadata; None for CSV

    @property
    def name(self) -> str:
        """Names the shard in a cache (one per run: the input is not expected to change
        during a run)."""
        return f"{self.path}\0{self.row_groups}\0{self.row_start}"


# A Parquet file is cut into shards of whole row groups holding at least this many blocks'
# worth of rows: large enough that the per-shard overhead of a step is small, small enough that
# a file of many row groups spreads over workers.
SHARD_BLOCKS = 4


def plan_shards(files: Sequence[str], batch_rows: int = DEFAULT_BATCH_ROWS,
                opener: Callable[[str], BinaryIO] = open_input) -> list["Shard"]:
    """The shards of ``files``: CSV files whole; Parquet files cut at row-group boundaries, with
    their row counts from the footer (exact, and no scan). Reads each Parquet footer once."""
    shards = []
    for path in files:
        if file_format(path) != "parquet":
            shards.append(Shard(path))
            continue
        failure = None
        try:
            with opener(path) as f:
                meta = pq.ParquetFile(f).metadata
                sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        except (OSError, pa.ArrowException) as e:
            failure = f"{path}: cannot read ({_reason(path, e)})"
        if failure:
            raise DataError(failure)
        start, groups, rows = 0, [], 0
        for i, size in enumerate(sizes):
            groups.append(i)
            rows += size
            if rows >= SHARD_BLOCKS * batch_rows or i == len(sizes) - 1:
                shards.append(Shard(path, tuple(groups), start, rows))
                start, groups, rows = start + rows, [], 0
        if not sizes:
            shards.append(Shard(path, (), 0, 0))
    return shards


def counted_rows(shards: Sequence["Shard"]) -> int | None:
    """The exact number of rows, if every shard's is known from metadata (else None)."""
    if any(s.rows is None for s in shards):
        return None
    return sum(s.rows for s in shards)


def blocks_from_file(path: str, label_column: str | None, feature_columns: Sequence[str],
                     loss: losses_mod.GlmLoss, batch_rows: int = DEFAULT_BATCH_ROWS,
                     opener: Callable[[str], BinaryIO] = open_input,
                     encoding=None) -> Iterator[Block]:
    """Reads one file into validated Blocks of at most ``batch_rows`` rows, shard by shard (so
    the blocks are those every runner makes of the file)."""
    for shard in plan_shards([path], batch_rows, opener):
        yield from blocks_from_shard(shard, label_column, feature_columns, loss, batch_rows, opener,
                                     encoding)


def blocks_from_shard(shard: Shard, label_column: str | None, feature_columns: Sequence[str],
                      loss: losses_mod.GlmLoss, batch_rows: int = DEFAULT_BATCH_ROWS,
                      opener: Callable[[str], BinaryIO] = open_input,
                      encoding=None, user_column: str | None = None) -> Iterator[Block]:
    """Reads one shard into validated Blocks of at most ``batch_rows`` rows.

    ``user_column`` (user-level privacy): that column is read as each row's privacy unit, a
    key (``Block.users``), never a feature; a row without one is an error naming the column.

    With an ``encoding`` (``beam_dp.categorical.Encoding``) the features are its numeric
    columns then its categorical ones, encoded into a CSR matrix; ``feature_columns`` is then
    ``encoding.columns``. ``label_column`` None reads features only (for prediction); the labels
    are then zeros.
    Raises DataError naming the file (and the 1-based data row, header excluded, and the column)
    on a missing column, a cell that is not a number, a CSV row with the wrong number of fields,
    a missing or non-finite value, or a label the model cannot use. No message holds a value.
    """
    path = shard.path
    if encoding is not None:
        feature_columns = encoding.columns
    numeric = list(encoding.numeric) if encoding is not None else list(feature_columns)
    text = tuple(encoding.categorical) if encoding is not None else ()
    class_labels = (encoding is not None and encoding.label_classes is not None
                    and label_column is not None)
    if class_labels:
        text = text + (label_column,)   # read as text (CSV too), matched to the declared classes
    columns = list(feature_columns) + ([label_column] if label_column is not None else [])
    if user_column is not None:
        # (once: it may be a categorical feature too, then read as text as those are)
        columns += [user_column] * (user_column not in columns)
        text = text + (user_column,)   # CSV: the key as text, never parsed as a number
    row_start = shard.row_start
    failure = None
    if shard.row_groups == ():
        return   # a Parquet file without row groups: no rows
    try:
        with opener(path) as f:
            for batch, features in _row_batches(path, f, columns, numeric, batch_rows,
                                                shard.row_groups, text):
                m = features.shape[0]
                if m == 0:
                    continue
                keep = None
                pending = None
                if encoding is not None:
                    features, keep = encoding.fill(features)
                    # A "median"/"mean" column's missing cells stay NaN until its fill is
                    # released (training's transform fills them); an infinity is still an error.
                    pending = encoding.pending if encoding.imputed else None
                    check_finite(features, path, row_start, encoding.dense_names, pending)
                    features = _encoded(encoding, features, batch, path)
                labels = None
                if class_labels:
                    labels, unknown = _class_ids(encoding, batch, label_column, path)
                    if unknown is not None:
                        what = ("a finite number (the schema's label_positive at_least)"
                                if encoding.label_rule is not None else
                                "one of the declared classes (--label-classes)")
                        raise DataError(f"{path}, row {row_start + unknown + 1}: column "
                                        f"'{label_column}' holds a value that is not {what}")
                elif label_column is not None:
                    labels = _column_as_float(path, batch, label_column)
                if labels is not None and encoding is not None and encoding.label_missing == "drop":
                    absent = np.isnan(labels)
                    keep &= ~absent
                    # (a new array: Arrow's may be read-only) the dropped rows' labels, left out below
                    labels = np.where(absent, 0.0, labels)
                block = validated_block(features, labels, loss, path, row_start, feature_columns,
                                        label_column, pending)
                if user_column is not None:
                    block.users = _user_keys(batch, user_column, path, row_start)
                if keep is not None and not keep.all():
                    if label_column is None:   # prediction: every row kept, in its place
                        block.dropped = ~keep
                    else:
                        # Declared row drops (--missing drop): a per-row rule, so the privacy
                        # unit is unchanged; rows keep their order for the samplers.
                        block = block.take(np.flatnonzero(keep))
                if len(block):
                    yield block
                row_start += m
        return
    except DataError:
        raise
    except KeyError:   # a requested column is not in this file
        failure = None
    except (OSError, pa.ArrowException) as e:
        failure = f"{path}: cannot read ({_reason(path, e)})"
    # Raised outside the handlers so that no exception chained to it carries pyarrow's text.
    raise DataError(failure or _missing_columns(path, columns, opener))


def _user_keys(batch: pa.RecordBatch, user_column: str, path: str, row_start: int) -> np.ndarray:
    column = batch.column(user_column)
    missing = user_level.first_missing_key(column)
    if missing is not None:
        raise DataError(f"{path}, row {row_start + missing + 1}: column '{user_column}' (the "
                        "privacy unit) is missing: a row without a user cannot be bounded")
    return user_level.user_keys(column)


def _class_ids(encoding, batch: pa.RecordBatch, label_column: str, path: str):
    try:
        return encoding.label_ids(batch.column(label_column))
    except categorical.EncodingError as e:
        failure = f"{path}: column '{label_column}': {e}"
    raise DataError(failure)


def _encoded(encoding, numeric: np.ndarray, batch: pa.RecordBatch, path: str):
    try:
        return encoding.encode(numeric, {c: batch.column(c) for c in encoding.categorical})
    except categorical.EncodingError as e:
        failure = f"{path}: {e}"
    raise DataError(failure)


def load_blocks(files: Sequence[str], label_column: str | None, feature_columns: Sequence[str],
                loss: losses_mod.GlmLoss, batch_rows: int = DEFAULT_BATCH_ROWS,
                encoding=None, user_column: str | None = None,
                opener: Callable[[str], BinaryIO] = open_input) -> list[Block]:
    """Every block of ``files``, in-process (``opener``: where the files are read from, e.g. a
    DataFrame's in-memory file, ``beam_dp.frames``)."""
    blocks = []
    for shard in plan_shards(files, batch_rows, opener):
        blocks.extend(blocks_from_shard(shard, label_column, feature_columns, loss, batch_rows,
                                        opener, encoding=encoding, user_column=user_column))
        release_free_memory()   # after each shard: the peak is then the blocks and one shard
    if not blocks:
        raise DataError(f"{', '.join(files)}: the input has no rows")
    return blocks


def release_free_memory() -> None:
    """Hands back to the system what this process freed but still holds: Arrow's memory pool
    (mimalloc) keeps the decoded pages of every file read, glibc the freed buffers (the
    per-column ones of reading; a finished Beam job's, ``beam.aggregator``). Measured on a
    10^6 x 50 table (381 MB of features, 4 files): 806 MB resident after reading, 599 MB after
    Arrow's release, 507 MB after glibc's trim as well; released after each file, the peak
    while reading fell from 925 MB to ~600 MB."""
    pa.default_memory_pool().release_unused()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim
        pass


def write_table(path: str, columns: dict[str, np.ndarray]) -> None:
    """Parquet, CSV, or gzipped CSV (.csv.gz), by the file name."""
    table = pa.table(columns)
    if file_format(path) == "parquet":
        pq.write_table(table, path)
    elif path.lower().endswith(".gz"):
        with pa.CompressedOutputStream(path, "gzip") as f:
            pa_csv.write_csv(table, f)
    else:
        pa_csv.write_csv(table, path)


# ----------------------------------------------------------------------- in-memory arrays (API)

def as_feature_matrix(X) -> np.ndarray:
    """A 2-D float64 matrix from an array-like (numpy array, list of rows, DataFrame). Columns
    that are not numbers by their declared dtype are an error: nothing is guessed from values."""
    array = np.asarray(X)
    if array.ndim != 2:
        raise ValueError(f"X must be 2-dimensional (rows x features), got {array.ndim} dimension(s)")
    if array.dtype.kind not in "biuf":
        raise ValueError("X must hold numbers (its dtype is not numeric); encode categorical "
                         "columns first")
    return np.ascontiguousarray(array, dtype=np.float64)


def validated_block(features: np.ndarray, raw_labels: np.ndarray | None, loss: losses_mod.GlmLoss,
                    source: str, row_start: int, feature_names: Sequence[str] | None = None,
                    label_column: str | None = "label", pending: np.ndarray | None = None) -> Block:
    """A Block after the checks every input gets, from files or arrays alike: finite features
    and labels the model can use (None: features only, labels zero, for prediction). Errors
    name the source, the 1-based row and the column, never the value."""
    if not sp.issparse(features):   # (encoded rows: their numeric columns were checked)
        check_finite(features, source, row_start, feature_names, pending)
    if raw_labels is None:
        return Block(features, np.zeros(features.shape[0]), source, row_start)
    try:
        labels = loss.encode_labels(raw_labels)
    except losses_mod.LabelError as e:
        raise DataError(f"{source}, row {row_start + e.row + 1}: column '{label_column}': {e}") from None
    return Block(features, labels, source, row_start)


def check_finite(x: np.ndarray, source: str, row_start: int = 0, names: Sequence[str] | None = None,
                 pending: np.ndarray | None = None) -> None:
    """DataError naming the first row (1-based) and column holding a NaN or an infinity.
    ``pending`` (per column): a NaN is allowed there (a missing cell whose private fill is not
    released yet, ``Encoding.pending``), an infinity is not."""
    fine = np.isfinite(x)
    if pending is not None and pending.any():
        fine |= np.isnan(x) & pending[None, :]
    bad = np.flatnonzero(~fine.all(axis=1))
    if bad.size:
        j = int(np.flatnonzero(~fine[bad[0]])[0])
        column = names[j] if names is not None else f"x{j}"
        raise DataError(f"{source}, row {row_start + int(bad[0]) + 1}: feature '{column}' is "
                        "missing or not finite")


def blocks_from_arrays(x: np.ndarray, labels: np.ndarray, loss: losses_mod.GlmLoss,
                       batch_rows: int = DEFAULT_BATCH_ROWS, source: str = "arrays",
                       feature_names: Sequence[str] | None = None) -> list[Block]:
    """Validated Blocks of at most ``batch_rows`` rows from in-memory features and raw labels."""
    return [validated_block(x[i:i + batch_rows], labels[i:i + batch_rows], loss, source, i,
                            feature_names, "y") for i in range(0, len(x), batch_rows)]
