"""Mini-batches fixed in advance: which rows each step reads, decided before training from the
seed and the rows' positions only, and the columnar files the Beam runner keeps them in.

A *batch plan* (``PoissonPlan``, DP-AMBSSGD's ``Assignment``) offers
``pieces(block, steps) -> iterable of (step, Block)``: the rows of ``block`` in each step's batch,
for the steps in ``steps``. It never looks at the model or at a value, so the batches of a whole
run can be made in one pass over the data (the Beam runner's batch job) or step by step (the local
runner); both give a step the same rows.

A step's batch is ``assemble(pieces)``: its pieces sorted by (tag, file, first row) and joined per
tag, so that every runner hands a step the same arrays in the same order. (The tag separates the
parts of a step that play different roles, e.g. DP-AMBSSGD's statistics and gradient rows.)

Batch files (Beam runner) hold the raw rows of the input: they are written under the job's temp
location, inside the same trust boundary as the input, deleted when training ends, and never
named in any output. Steps are grouped (``steps_per_file`` consecutive steps, about FILE_BYTES
of rows); a group is a few Arrow IPC files (``group_parts``: columnar and cheap to write and read
back; compressed with LZ4 on a remote temp location, see ``compression``), each holding the
pieces of a contiguous run of shards, a record batch per shard with columns ``features`` (a
fixed-size list of d float64), ``label``, ``step``, ``tag`` and ``piece``. The driver names the
files the job's output gives, so only committed work is read, never a failed and retried
attempt's.

A run that makes a final pass over the model it trained (the quality check, ``base.FinalStage``)
asks for *every row* as well: the batch job then also writes each shard's blocks whole, as one
more group after the steps' (``rows_group``), so that the pass runs over these files rather than
in a job of its own that reads the input again (issue 33: a DP-SGD run is then one job fewer).

The steps are summed by the driver (``FileBatches``: a step's batch at a time) or by the workers
(``StepOverFiles`` over ``step_blocks``: each file's rows per step, in step jobs whose only
output is the model; issue 35), as ``beam_dp.step_costs`` chooses.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import BinaryIO, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from beam_dp.algorithms.base import zero_sum
from beam_dp.block import Block
from beam_dp.sampling import PoissonSampler

# Files of about this many bytes of raw batches (before compression): a group of the batch job's
# shuffle holds one file's rows, and the driver holds one file at a time.
FILE_BYTES = 64 << 20
DONE = "_COMPLETE.json"   # written by the driver once the batch job has succeeded


def compression(location: str) -> str | None:
    """LZ4 for a remote temp location (gs://, s3://, ...), where the bytes cross the network and
    real tables compress well; none on a local disk, where compressing only costs CPU (measured
    on 5 epochs of a 200,000 x 50 table: LZ4 added 0.45 s to a 2.1 s run; zstd 1.5 s)."""
    return "lz4" if "://" in location else None


@dataclasses.dataclass(frozen=True)
class PoissonPlan:
    """Poisson sampling (``beam_dp.sampling``): row i is in step t's batch with probability q,
    independently across rows and steps, drawn from (seed, t, block position)."""

    sampler: PoissonSampler
    expected_rows: float     # of a step's batch: q n (sizes the batch files)

    @property
    def expected_total_rows(self) -> float:   # n, public (sizes the files of every row)
        return self.expected_rows / self.sampler.rate

    def pieces(self, block: Block, steps: Iterable[int]) -> Iterator[tuple[int, Block]]:
        for step, rows in self.sampler.rows_of_steps(block, steps):
            if rows is None:
                yield step, block
            elif len(rows):
                yield step, block.take(rows)


def plan_key(plan) -> str:
    """A description of a batch plan without its seed, for telling whether batch files were made
    for this run's plan: a run resumed without ``--seed`` draws a new seed for its noise, and
    still reuses the batches its first attempt made (they are Poisson samples of the same rate
    either way; resampling them is what the resume must not do)."""
    def strip(value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return (type(value).__name__, tuple((f.name, None if f.name == "seed" else
                                                 strip(getattr(value, f.name)))
                                                for f in dataclasses.fields(value)))
        return value
    return repr(strip(plan))


def assemble(pieces: Iterable[Block]) -> list[Block]:
    """A step's batch from its pieces: one Block per tag, in tag order; within a tag the pieces
    in (file, first row) order."""
    by_tag: dict[int, list[Block]] = {}
    for piece in sorted(pieces, key=_batch_order):
        by_tag.setdefault(piece.tag, []).append(piece)
    return [_join(tag, parts) for tag, parts in by_tag.items()]


def _batch_order(block: Block) -> tuple:
    return block.tag, block.source, block.row_start


def _join(tag: int, parts: Sequence[Block]) -> Block:
    # sq_norms are recomputed from the joined rows, as after reading a batch file back.
    return _join_arrays(tag, [(p.features, p.labels) for p in parts])


class LocalBatches:
    """Batches computed step by step from blocks in memory (the local runner). Under Poisson
    sampling the current chunk's draws of every block are kept (``PoissonSampler.chunk_rows``:
    about one index per row), so a step costs O(its batch + blocks), not a draw per block."""

    location = None

    def __init__(self, blocks: Sequence[Block], plan):
        self.blocks, self.plan = list(blocks), plan
        # assemble's order, so that the pieces below come out already in it
        self._ordered = sorted(self.blocks, key=_batch_order)
        self._chunk, self._draws = None, []

    def get(self, step: int) -> list[Block]:
        if not isinstance(self.plan, PoissonPlan) or self.plan.sampler.rate >= 1.0:
            return assemble(piece for block in self.blocks
                            for _, piece in self.plan.pieces(block, (step,)))
        sampler = self.plan.sampler
        chunk, offset = divmod(step, sampler.chunk)
        if chunk != self._chunk:
            self._draws = [sampler.chunk_rows(block, chunk) for block in self._ordered]
            self._chunk = chunk
        pieces = [(block, rows[starts[offset]:starts[offset + 1]])
                  for block, (starts, rows) in zip(self._ordered, self._draws)]
        pieces = [(block, rows) for block, rows in pieces if len(rows)]
        if any(block.sparse for block, _ in pieces):
            return assemble(block.take(rows) for block, rows in pieces)
        by_tag: dict[int, list] = {}
        for block, rows in pieces:
            by_tag.setdefault(block.tag, []).append((block, rows))
        return [_gather(tag, parts) for tag, parts in by_tag.items()]

    def __enter__(self):
        return self

    def every_row(self) -> Iterator[Block]:
        """The input's blocks, each once (for a pass after the steps, e.g. the quality check)."""
        return iter(self.blocks)

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------- batch files

def steps_per_file(expected_batch_rows: float, dim: int) -> int:
    """How many consecutive steps form a group (FILE_BYTES of raw rows, at least one step)."""
    row_bytes = 8 * (dim + 2)
    return max(1, int(FILE_BYTES // max(1.0, expected_batch_rows * row_bytes)))


# Each group of steps is written as a few files ("parts"), whatever the number of shards: at least
# PARTS (so that the workers can sum a step's rows in parallel, ``StepOverFiles``) and more only
# where a group's rows pass FILE_BYTES, never more than there are shards. A part holds the pieces
# of a contiguous run of shards, so the parts in order hold the pieces in shard order. (At 10^9
# rows a file per step and shard made ~1.9 x 10^8 small files: issue 35.)
PARTS = 8


def group_parts(expected_bytes: float, shards: int) -> int:
    """How many files a group of about ``expected_bytes`` of rows is written as."""
    return max(1, min(shards, max(PARTS, math.ceil(expected_bytes / FILE_BYTES))))


def part_of_shard(index: int, shards: int, parts: int) -> int:
    """The part of a group that shard ``index`` (of ``shards``) writes its pieces into."""
    return index * parts // max(1, shards)


def group_file_name(group: int, part: int, attempt: str) -> str:
    """A part of a group's steps. Zero-padded, so that names sort by group, then part."""
    return f"group-{group:06d}-{part:05d}-{attempt}.arrow"


def group_of_file(name: str) -> int:
    return int(name.split("-")[1])


def shard_file_name(shard: int, attempt: str) -> str:
    """A shard's pieces of every group (a record batch per group), until the job merges them
    into the groups' files and the driver deletes it."""
    return f"shard-{shard:06d}-{attempt}.arrow"


def rows_group(steps: int, steps_per_file: int) -> int:
    """The group after the steps' groups, which holds every row once when a run asks for them
    (its pieces are numbered ``steps``, a step no batch has)."""
    return -(-steps // steps_per_file)


GROUP_PATTERN, SHARD_PATTERN = "group-*.arrow", "shard-*.arrow"

# A piece as the batch job writes it: (step, tag, features, labels).
Piece = tuple
# The batch files' layout: part of a batch job's fingerprint, so that a resumed run never reads
# files an older version wrote (2: one record batch per file, with a piece column; 3: a few
# files per group of steps, one record batch per shard).
FILE_FORMAT = 3


def as_piece(step: int, block: Block) -> Piece:
    return (step, block.tag, block.features, block.labels)


def write_pieces(f: BinaryIO, groups: Sequence[Sequence[Piece]], dim: int,
                 codec: str | None = None) -> None:
    """Each group's pieces (a shard's blocks in order) as one record batch, a ``piece`` column
    numbering them, compressed with ``codec`` (see ``compression``). A batch per group, not per
    piece: the batch job writes ~1,000 pieces per group, and a record batch each cost ~0.1 ms of
    Python and Arrow overhead (0.55 s of a 1.2 s DP-SGD run on Beam's in-process runner)."""
    # Labels keep their encoded type (class ids are integers, for indexing).
    first = next((p for pieces in groups for p in pieces), None)
    label_type = pa.from_numpy_dtype(first[3].dtype) if first is not None else pa.float64()
    schema = pa.schema([("features", pa.list_(pa.float64(), dim)), ("label", label_type),
                        ("step", pa.int64()), ("tag", pa.int64()), ("piece", pa.int64())])
    with pa.ipc.new_file(f, schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
        for pieces in groups:
            writer.write_batch(_record_batch(pieces, dim, schema))


def _record_batch(pieces: Sequence[Piece], dim: int, schema) -> pa.RecordBatch:
    label_type = schema.field("label").type
    lengths = np.array([len(p[3]) for p in pieces], dtype=np.int64)
    steps = np.repeat(np.array([p[0] for p in pieces], dtype=np.int64), lengths)
    tags = np.repeat(np.array([p[1] for p in pieces], dtype=np.int64), lengths)
    numbers = np.repeat(np.arange(len(pieces), dtype=np.int64), lengths)
    features = (np.concatenate([np.asarray(p[2], dtype=np.float64).reshape(-1) for p in pieces])
                if pieces else np.zeros(0))
    labels = (np.concatenate([p[3] for p in pieces]) if pieces
              else np.zeros(0, label_type.to_pandas_dtype()))
    return pa.record_batch([
        pa.FixedSizeListArray.from_arrays(pa.array(features), dim), pa.array(labels),
        pa.array(steps), pa.array(tags), pa.array(numbers)], schema=schema)


def merge_pieces(f: BinaryIO, sources: Sequence[tuple[BinaryIO, int]],
                 codec: str | None = None) -> None:
    """One file of record batches from other files, in the given order: ``sources`` are
    (seekable file, batch number) pairs, each file a ``write_pieces`` file (only the footer and
    the batch are read). ``read_pieces`` reads the result as one sequence of pieces."""
    writer = None
    try:
        for source, number in sources:
            reader = pa.ipc.open_file(source)
            if writer is None:
                writer = pa.ipc.new_file(f, reader.schema,
                                         options=pa.ipc.IpcWriteOptions(compression=codec))
            writer.write_batch(reader.get_batch(number))
    finally:
        if writer is not None:
            writer.close()


def read_pieces(data: bytes) -> Iterator[Piece]:
    """The pieces ``write_pieces`` wrote, in order (a piece without rows is not kept: it adds
    nothing to a sum)."""
    reader = pa.ipc.open_file(pa.BufferReader(data))
    dim = reader.schema.field("features").type.list_size
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        if batch.num_rows == 0:
            continue
        features = batch.column(0).flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
        labels = batch.column(1).to_numpy(zero_copy_only=False)
        steps, tags = batch.column(2).to_numpy(), batch.column(3).to_numpy()
        numbers = batch.column(4).to_numpy()
        starts = np.concatenate([[0], np.flatnonzero(np.diff(numbers)) + 1, [len(numbers)]])
        for a, b in zip(starts[:-1], starts[1:]):
            yield int(steps[a]), int(tags[a]), features[a:b], labels[a:b]


def step_blocks(data: bytes, source: str) -> list[Block]:
    """A batch file's rows as the workers sum them: a Block per (step, tag), its pieces joined
    in the file's order, its ``step`` set."""
    by_step: dict[tuple, list] = {}
    for step, tag, features, labels in read_pieces(data):
        by_step.setdefault((step, tag), []).append((features, labels))
    blocks = []
    for (step, tag), parts in sorted(by_step.items()):
        block = _join_arrays(tag, parts)
        block.source, block.step = source, step
        blocks.append(block)
    return blocks


@dataclasses.dataclass(frozen=True)
class StepOverFiles:
    """A step over batches fixed in advance, summed by the workers over the batch files' blocks
    (``step_blocks``) rather than by the driver over the step's batch: a block counts only in
    the step whose batch it is in (its ``step``). With ``rows_step``: a final stage (``base.
    FinalStage``) over every row, the blocks of that step (``rows_group``)."""

    stage: object
    rows_step: int | None = None

    @property
    def shape(self):
        return self.stage.shape

    def zero_sum(self):
        return zero_sum(self.stage)

    def partial_sum(self, block: Block, state):
        if self.rows_step is not None:
            return (self.stage.partial_sum(block, state) if block.step == self.rows_step
                    else self.zero_sum())
        if block.step != state.step:
            return self.zero_sum()
        return self.stage.selected_sum(block, state)

    def apply(self, state, total):
        return self.stage.apply(state, total)


@dataclasses.dataclass
class Manifest:
    """What the driver writes (``DONE``) once a batch job has succeeded: which run's plan the
    files hold, so that a resumed run reuses them only if they are complete and its own, and the
    groups' files (a group with no rows at all has none)."""

    fingerprint: str
    steps: int
    steps_per_file: int
    files: list
    every_row: bool = False   # the job also wrote every row once (``rows_group``)

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> "Manifest":
        return cls(**json.loads(text))

    def group_files(self, group: int) -> list[str]:
        """A group's files in part order (so its pieces come in shard order)."""
        return self._by_group.get(group, [])

    @functools.cached_property
    def _by_group(self) -> dict[int, list[str]]:   # (once: a run may have millions of files)
        by_group: dict[int, list[str]] = {}
        for name in sorted(self.files):
            by_group.setdefault(group_of_file(name), []).append(name)
        return by_group

    @property
    def files_per_group(self) -> int:
        return max((len(names) for names in self._by_group.values()), default=0)

    def groups_of_steps(self, first: int, count: int) -> range:
        return range(first // self.steps_per_file, (first + count - 1) // self.steps_per_file + 1)


class FileBatches:
    """The driver's reader of a finished batch job's files, for steps in increasing order (one
    group of steps in memory at a time). ``read(name) -> bytes`` reads a file of the batch
    directory. A group's parts hold the shards' pieces in shard order, and a shard's pieces are
    in block order: joined per tag in that order, a step's batch has the arrays ``assemble``
    makes (the local runner's)."""

    on_workers = False   # the driver sums the steps (the Beam aggregator's may set it: workers)

    def __init__(self, manifest: Manifest, read: Callable[[str], bytes]):
        self.manifest, self.read = manifest, read
        self._group, self._steps = None, {}

    def get(self, step: int) -> list[Block]:
        group = step // self.manifest.steps_per_file
        if group != self._group:
            self._steps = {}
            for name in self.manifest.group_files(group):
                for s, tag, features, labels in read_pieces(self.read(name)):
                    self._steps.setdefault(s, {}).setdefault(tag, []).append((features, labels))
            self._group = group
        return [_join_arrays(tag, parts) for tag, parts in sorted(self._steps.get(step, {}).items())]

    def every_row(self) -> Iterator[Block]:
        """Every row of the input once, a shard's block at a time (one file in memory), in the
        job's shard and block order; only from a job that wrote them."""
        if not self.manifest.every_row:
            raise ValueError("this batch job did not write every row")
        group = rows_group(self.manifest.steps, self.manifest.steps_per_file)
        for name in self.manifest.group_files(group):
            for _, tag, features, labels in read_pieces(self.read(name)):
                yield _join_arrays(tag, [(features, labels)])


def _gather(tag: int, parts: list) -> Block:
    """``_join`` of the pieces ``(block, rows)`` without making each piece: the rows are taken
    straight into the batch's arrays (a Block per piece cost ~10 us of 25 us a block and step)."""
    total = sum(len(rows) for _, rows in parts)
    first = parts[0][0]
    features = np.empty((total, first.features.shape[1]), dtype=first.features.dtype)
    labels = np.empty(total, dtype=first.labels.dtype)
    at = 0
    for block, rows in parts:
        block.features.take(rows, axis=0, out=features[at:at + len(rows)])
        block.labels.take(rows, axis=0, out=labels[at:at + len(rows)])
        at += len(rows)
    return Block(features, labels, "batch", 0, None, tag)


def _join_arrays(tag: int, parts: list) -> Block:
    features = parts[0][0] if len(parts) == 1 else np.concatenate([f for f, _ in parts])
    labels = parts[0][1] if len(parts) == 1 else np.concatenate([lab for _, lab in parts])
    return Block(np.ascontiguousarray(features), np.ascontiguousarray(labels), "batch", 0, None, tag)
