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
of rows); per group, each shard's pieces are one Arrow IPC file (columnar and cheap to write and
read back; compressed with LZ4 on a remote temp location, see ``compression``), one record
batch per piece with columns ``features`` (a fixed-size list of d float64), ``label``, ``step``
and ``tag``; an index (JSON) names the group's piece files in shard order. The index is written
from the job's shuffle, so it names only the pieces of committed work, never those of a failed
and retried attempt.

A run that makes a final pass over the model it trained (the quality check, ``base.FinalStage``)
asks for *every row* as well: the batch job then also writes each shard's blocks whole, as one
more group after the steps' (``rows_group``), so that the pass runs on the driver from these
files rather than in a job of its own that reads the input again (issue 33: a DP-SGD run is then
one job fewer).
"""
from __future__ import annotations

import dataclasses
import json
from typing import BinaryIO, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

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


def pieces_name(group: int, shard: int, attempt: str) -> str:
    """A shard's pieces of a group's steps. Zero-padded, so that names sort by shard."""
    return f"pieces-{group:06d}-{shard:06d}-{attempt}.arrow"


def index_name(group: int) -> str:
    return f"batches-{group:06d}.json"


def rows_group(steps: int, steps_per_file: int) -> int:
    """The group after the steps' groups, which holds every row once when a run asks for them
    (its pieces are numbered ``steps``, a step no batch has)."""
    return -(-steps // steps_per_file)


PIECES_PATTERN, INDEX_PATTERN = "pieces-*.arrow", "batches-*.json"

# A piece as the batch job writes it: (step, tag, features, labels).
Piece = tuple
# The batch files' layout: part of a batch job's fingerprint, so that a resumed run never reads
# files an older version wrote (2: one record batch per file, with a piece column).
FILE_FORMAT = 2


def as_piece(step: int, block: Block) -> Piece:
    return (step, block.tag, block.features, block.labels)


def write_pieces(f: BinaryIO, pieces: Sequence[Piece], dim: int, codec: str | None = None) -> None:
    """The pieces (a shard's blocks in order) as one record batch, a ``piece`` column numbering
    them, compressed with ``codec`` (see ``compression``). One batch per file, not per piece:
    the batch job writes ~1,000 pieces per file, and a record batch each cost ~0.1 ms of Python
    and Arrow overhead (0.55 s of a 1.2 s DP-SGD run on Beam's in-process runner)."""
    # Labels keep their encoded type (class ids are integers, for indexing).
    label_type = pa.from_numpy_dtype(pieces[0][3].dtype) if pieces else pa.float64()
    schema = pa.schema([("features", pa.list_(pa.float64(), dim)), ("label", label_type),
                        ("step", pa.int64()), ("tag", pa.int64()), ("piece", pa.int64())])
    lengths = np.array([len(p[3]) for p in pieces], dtype=np.int64)
    steps = np.repeat(np.array([p[0] for p in pieces], dtype=np.int64), lengths)
    tags = np.repeat(np.array([p[1] for p in pieces], dtype=np.int64), lengths)
    numbers = np.repeat(np.arange(len(pieces), dtype=np.int64), lengths)
    features = (np.concatenate([np.asarray(p[2], dtype=np.float64).reshape(-1) for p in pieces])
                if pieces else np.zeros(0))
    labels = (np.concatenate([p[3] for p in pieces]) if pieces
              else np.zeros(0, label_type.to_pandas_dtype()))
    with pa.ipc.new_file(f, schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
        writer.write_batch(pa.record_batch([
            pa.FixedSizeListArray.from_arrays(pa.array(features), dim), pa.array(labels),
            pa.array(steps), pa.array(tags), pa.array(numbers)], schema=schema))


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


@dataclasses.dataclass
class Manifest:
    """What the driver writes (``DONE``) once a batch job has succeeded: which run's plan the
    files hold, so that a resumed run reuses them only if they are complete and its own, and the
    groups' index files (a group with no rows at all has none)."""

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


class FileBatches:
    """The driver's reader of a finished batch job's files, for steps in increasing order (one
    group of steps in memory at a time). ``read(name) -> bytes`` reads a file of the batch
    directory. A group's index names its piece files in shard order, and a piece file holds a
    shard's pieces in block order: joined per tag in that order, a step's batch has the arrays
    ``assemble`` makes (the local runner's)."""

    def __init__(self, manifest: Manifest, read: Callable[[str], bytes]):
        self.manifest, self.read = manifest, read
        self._group, self._steps = None, {}

    def get(self, step: int) -> list[Block]:
        group = step // self.manifest.steps_per_file
        if group != self._group:
            self._steps = {}
            name = index_name(group)
            names = json.loads(self.read(name)) if name in self.manifest.files else []
            for piece_file in names:
                for s, tag, features, labels in read_pieces(self.read(piece_file)):
                    self._steps.setdefault(s, {}).setdefault(tag, []).append((features, labels))
            self._group = group
        return [_join_arrays(tag, parts) for tag, parts in sorted(self._steps.get(step, {}).items())]

    def every_row(self) -> Iterator[Block]:
        """Every row of the input once, a shard's block at a time (one piece file in memory),
        in the job's shard and block order; only from a job that wrote them."""
        if not self.manifest.every_row:
            raise ValueError("this batch job did not write every row")
        name = index_name(rows_group(self.manifest.steps, self.manifest.steps_per_file))
        for piece_file in (json.loads(self.read(name)) if name in self.manifest.files else []):
            for _, tag, features, labels in read_pieces(self.read(piece_file)):
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
