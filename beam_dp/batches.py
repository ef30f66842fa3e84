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
named in any output. Format: Arrow IPC files compressed with LZ4 (columnar, cheap to write and to
read back), each holding the batches of ``steps_per_file`` consecutive steps as one record batch
per (step, tag) with columns ``features`` (fixed-size list of d float64), ``label``, ``step``
and ``tag``. A step with no rows has no record batch.
"""
from __future__ import annotations

import dataclasses
import json
from typing import BinaryIO, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from beam_dp.data import Block
from beam_dp.sampling import PoissonSampler

# Files of about this many bytes of raw batches (before compression): a group of the batch job's
# shuffle holds one file's rows, and the driver holds one file at a time.
FILE_BYTES = 64 << 20
DONE = "_COMPLETE.json"   # written by the driver once the batch job has succeeded
COMPRESSION = "lz4"


@dataclasses.dataclass(frozen=True)
class PoissonPlan:
    """Poisson sampling (``beam_dp.sampling``): row i is in step t's batch with probability q,
    independently across rows and steps, drawn from (seed, t, block position)."""

    sampler: PoissonSampler
    expected_rows: float     # of a step's batch: q n (sizes the batch files)

    def pieces(self, block: Block, steps: Iterable[int]) -> Iterator[tuple[int, Block]]:
        for step in steps:
            rows = self.sampler.rows(block, step)
            if rows is None:
                yield step, block
            elif len(rows):
                yield step, block.take(rows)


def assemble(pieces: Iterable[Block]) -> list[Block]:
    """A step's batch from its pieces: one Block per tag, in tag order; within a tag the pieces
    in (file, first row) order."""
    by_tag: dict[int, list[Block]] = {}
    for piece in sorted(pieces, key=lambda b: (b.tag, b.source, b.row_start)):
        by_tag.setdefault(piece.tag, []).append(piece)
    return [_join(tag, parts) for tag, parts in by_tag.items()]


def _join(tag: int, parts: Sequence[Block]) -> Block:
    if len(parts) == 1:
        features, labels = parts[0].features, parts[0].labels
    else:
        features = np.concatenate([p.features for p in parts])
        labels = np.concatenate([p.labels for p in parts])
    # sq_norms are recomputed from the joined rows, as after reading a batch file back.
    return Block(np.ascontiguousarray(features), np.ascontiguousarray(labels), "batch", 0, None, tag)


class LocalBatches:
    """Batches computed step by step from blocks in memory (the local runner)."""

    location = None

    def __init__(self, blocks: Sequence[Block], plan):
        self.blocks, self.plan = list(blocks), plan

    def get(self, step: int) -> list[Block]:
        return assemble(piece for block in self.blocks
                        for _, piece in self.plan.pieces(block, (step,)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------- batch files

def steps_per_file(expected_batch_rows: float, dim: int) -> int:
    """How many consecutive steps share a file (FILE_BYTES of raw rows, at least one step)."""
    row_bytes = 8 * (dim + 2)
    return max(1, int(FILE_BYTES // max(1.0, expected_batch_rows * row_bytes)))


def file_name(index: int) -> str:
    return f"batches-{index:06d}.arrow"


FILE_PATTERN = "batches-*.arrow"


# A piece as it travels through the batch job's shuffle: plain arrays and its sort key.
Piece = tuple  # (step, tag, source, row_start, features, labels)


def as_piece(step: int, block: Block) -> Piece:
    return (step, block.tag, block.source, block.row_start, block.features, block.labels)


def write_file(f: BinaryIO, pieces: Iterable[Piece], dim: int) -> None:
    """Writes the pieces of some steps (d = ``dim`` features) as one record batch per (step,
    tag), in step order."""
    groups: dict[tuple[int, int], list[Piece]] = {}
    for piece in pieces:
        groups.setdefault((piece[0], piece[1]), []).append(piece)
    # Labels keep their encoded type (class ids are integers, for indexing).
    label_type = (pa.from_numpy_dtype(next(iter(groups.values()))[0][5].dtype) if groups
                  else pa.float64())
    schema = pa.schema([("features", pa.list_(pa.float64(), dim)), ("label", label_type),
                        ("step", pa.int64()), ("tag", pa.int64())])
    options = pa.ipc.IpcWriteOptions(compression=COMPRESSION)
    with pa.ipc.new_file(f, schema, options=options) as writer:
        for step, tag in sorted(groups):
            # The order ``assemble`` gives: by (file, first row) within a (step, tag).
            parts = sorted(groups[(step, tag)], key=lambda p: (p[2], p[3]))
            features = np.concatenate([p[4] for p in parts]).reshape(-1)
            labels = np.concatenate([p[5] for p in parts])
            m = len(labels)
            writer.write_batch(pa.record_batch([
                pa.FixedSizeListArray.from_arrays(pa.array(features), dim),
                pa.array(labels), pa.array(np.full(m, step)), pa.array(np.full(m, tag))],
                schema=schema))


def read_file(data: bytes) -> dict[int, list[Block]]:
    """The batches of a file, by step."""
    out: dict[int, list[Block]] = {}
    reader = pa.ipc.open_file(pa.BufferReader(data))
    dim = reader.schema.field("features").type.list_size
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        step, tag = int(batch.column(2)[0].as_py()), int(batch.column(3)[0].as_py())
        features = batch.column(0).flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
        labels = batch.column(1).to_numpy(zero_copy_only=False)
        out.setdefault(step, []).append(
            Block(np.ascontiguousarray(features), np.ascontiguousarray(labels), "batch", 0, None, tag))
    return out


@dataclasses.dataclass
class Manifest:
    """What the driver writes (``DONE``) once a batch job has succeeded: which run's plan the
    files hold, so that a resumed run reuses them only if they are complete and its own."""

    fingerprint: str
    steps: int
    steps_per_file: int
    files: list

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> "Manifest":
        return cls(**json.loads(text))


class FileBatches:
    """The driver's reader of a finished batch job's files, for steps in increasing order (one
    file in memory at a time). ``read(name) -> bytes`` reads a file of the batch directory."""

    def __init__(self, manifest: Manifest, read: Callable[[str], bytes]):
        self.manifest, self.read = manifest, read
        self._index, self._steps = None, {}

    def get(self, step: int) -> list[Block]:
        index = step // self.manifest.steps_per_file
        if index != self._index:
            name = file_name(index)
            self._steps = (read_file(self.read(name)) if name in self.manifest.files
                           else {})   # every step of a missing file had an empty batch
            self._index = index
        return self._steps.get(step, [])
