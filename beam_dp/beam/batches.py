"""The batch job: one Beam pipeline that reads the input once, assigns each row to the steps
whose batch holds it (``beam_dp.batches``: from the seed and the row's position, exactly the
sampling the accounting assumes), and writes each group of consecutive steps' batches under the
job's temp location as a few files (``batches.group_parts``), whatever the number of shards.

The rows travel through files, never through the runner's shuffle, as Spark's map-side spills
do: each worker writes a shard's pieces of every group as one file (a record batch per group);
the shuffle (GroupByKey) brings the names of a group part's record batches together, and one
worker copies them, in shard order, into the part's file; the driver then deletes the shards'
files. With no more shards than files per group, each shard writes its part's file whole and
nothing is copied. Beam's local runners move a shuffled element's bytes through the driver's process:
shuffling the pieces themselves made the batch job of 5 epochs at n = 10^6, d = 50 (2.5 GB)
take 58 s on a pool of 2 worker processes, against 7.3 s with the per-shard files alone. (Issue
35: a file per step and shard, the layout before, made ~1.9 x 10^8 files at n = 10^9.)
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import uuid

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from beam_dp import batches
from beam_dp.beam.cache import ShardCache
from beam_dp.beam.transforms import METRICS_NAMESPACE


class _ShardPieces(beam.DoFn):
    """Reads a shard once (from the worker's cache if an earlier job of the run left it there,
    e.g. DPSGD-F's preprocessing; without filling it), writes its pieces of each group's steps
    (with ``every_row`` also its blocks whole, as one more group: ``batches.rows_group``) to one
    file, a record batch per group, and emits ((group, part), (shard index, file name, record
    batch number)) per group: a few bytes per (shard, group), never a row. Where a group has a
    part per shard, the shard writes that part's file whole instead (record batch None)."""

    def __init__(self, reader, cache, plan, steps: int, steps_per_file: int, shards: int,
                 location: str, dim: int, every_row: bool = False):
        self.reader, self.cache_handle, self.plan = reader, cache, plan
        self.steps, self.steps_per_file, self.shards = steps, steps_per_file, shards
        self.location, self.dim, self.every_row = location, dim, every_row
        row_bytes = 8 * (dim + 2)
        self.parts = batches.group_parts(plan.expected_rows * steps_per_file * row_bytes, shards)
        total = getattr(plan, "expected_total_rows", None)
        self.rows_parts = (batches.group_parts(total * row_bytes, shards) if total is not None
                           else shards)

    def setup(self):
        self.cache = self.cache_handle.acquire(ShardCache)

    def process(self, indexed_shard):
        index, shard = indexed_shard
        by_group = collections.defaultdict(list)
        rows = batches.rows_group(self.steps, self.steps_per_file)
        for block in self.cache.blocks(shard, self.reader, keep=False):
            for step, piece in self.plan.pieces(block, range(self.steps)):
                by_group[step // self.steps_per_file].append(batches.as_piece(step, piece))
            if self.every_row:
                by_group[rows].append(batches.as_piece(self.steps, block))
        codec = batches.compression(self.location)
        # A retried bundle writes new files; only the names the job's shuffle carries are read.
        merged = []
        for group in sorted(by_group):
            parts = self.rows_parts if group == rows else self.parts
            part = batches.part_of_shard(index, self.shards, parts)
            if parts < self.shards:
                merged.append((group, part))
                continue
            # A part per shard (no more shards than parts): the shard writes the part's file
            # itself, with nothing to merge (the local runner's usual case: no copy).
            name = batches.group_file_name(group, part, uuid.uuid4().hex)
            with FileSystems.create(FileSystems.join(self.location, name),
                                    compression_type=CompressionTypes.UNCOMPRESSED) as f:
                batches.write_pieces(f, [by_group[group]], self.dim, codec)
            yield (group, part), (index, name, None)
        if merged:
            name = batches.shard_file_name(index, uuid.uuid4().hex)
            with FileSystems.create(FileSystems.join(self.location, name),
                                    compression_type=CompressionTypes.UNCOMPRESSED) as f:
                batches.write_pieces(f, [by_group[g] for g, _ in merged], self.dim, codec)
            for number, key in enumerate(merged):
                yield key, (index, name, number)


def _write_group_file(keyed, location: str):
    """A part of a group: its shards' record batches, in shard order, copied into one file
    (a part its one shard wrote whole is that file)."""
    (group, part), sources = keyed
    sources = list(sources)
    if len(sources) == 1 and sources[0][2] is None:   # written whole by its one shard
        yield sources[0][1]
        return
    name = batches.group_file_name(group, part, uuid.uuid4().hex)
    with contextlib.ExitStack() as opened:
        files = [(opened.enter_context(FileSystems.open(
                     FileSystems.join(location, shard_file),
                     compression_type=CompressionTypes.UNCOMPRESSED)), number)
                 for _, shard_file, number in sorted(sources)]
        with FileSystems.create(FileSystems.join(location, name),
                                compression_type=CompressionTypes.UNCOMPRESSED) as f:
            batches.merge_pieces(f, files, batches.compression(location))
    yield name


class WriteStepBatches(beam.PTransform):
    """The batch job's body: pipeline begin in, the names of the files it wrote out."""

    def __init__(self, shards, reader, cache, plan, steps: int, steps_per_file: int,
                 location: str, dim: int, every_row: bool = False):
        super().__init__()
        self.shards = list(enumerate(shards))   # a group's parts hold its pieces by shard
        self.reader, self.cache, self.plan, self.steps = reader, cache, plan, steps
        self.steps_per_file, self.location, self.dim = steps_per_file, location, dim
        self.every_row = every_row

    def expand(self, pbegin):
        return (pbegin
                | "Shards" >> beam.Create(self.shards)
                | "Spread" >> beam.Reshuffle()
                | "AssignRowsToSteps" >> beam.ParDo(_ShardPieces(
                    self.reader, self.cache, self.plan, self.steps, self.steps_per_file,
                    len(self.shards), self.location, self.dim, self.every_row))
                | "GroupByStepGroup" >> beam.GroupByKey()
                | "WriteGroupFiles" >> beam.FlatMap(_write_group_file, self.location))


# ------------------------------------------------------------- steps summed by the workers

BATCH_FILE_READS = "batch_file_reads"   # counter: batch files a step job's workers read


@dataclasses.dataclass(frozen=True)
class BatchFile:
    """A batch file as a step job's input element (what flows through its steps, as shards do
    through a full-batch job's): its blocks come from the worker's cache, read on a miss."""

    path: str
    row_start: int = 0   # (orders the bundles' sums, with the path: ``transforms._position``)

    @property
    def name(self) -> str:   # the worker cache's key
        return self.path


def read_batch_file(batch_file: BatchFile) -> list:
    """A batch file's blocks, one per (step, tag) (``batches.step_blocks``)."""
    Metrics.counter(METRICS_NAMESPACE, BATCH_FILE_READS).inc()
    with FileSystems.open(batch_file.path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return batches.step_blocks(f.read(), batch_file.path)
