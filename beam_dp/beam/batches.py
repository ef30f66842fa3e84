"""The batch job: one Beam pipeline that reads the input once, assigns each row to the steps
whose batch holds it (``beam_dp.batches``: from the seed and the row's position, exactly the
sampling the accounting assumes), groups the rows by step with a shuffle (GroupByKey) and writes
each group of consecutive steps' batches under the job's temp location.

The rows travel through files and the shuffle groups the files' names, as Spark's map-side
spills do: each shard's pieces of a group of steps are one file, written once by the worker that
read the shard and read once by the driver. Beam's in-process runner copies a shuffled
element's bytes several times: moving 5 epochs of a 200,000 x 50 table (400 MB) through its
GroupByKey cost 5-7 s, against about 1 s for the whole local run (measured with
pipelines/benchmark.py); a rewrite of the grouped rows into one file per group, another 0.6 s.
"""
from __future__ import annotations

import collections
import json
import uuid

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from beam_dp import batches
from beam_dp.beam.cache import ShardCache


class _WritePieces(beam.DoFn):
    """Reads a shard once (from the worker's cache if an earlier job of the run left it there,
    e.g. DPSGD-F's preprocessing; without filling it) and writes its pieces of each group's
    steps to one file, and with ``every_row`` its blocks whole to one more (``batches.
    rows_group``); emits (group, file name): one element per (shard, group), never a row or a
    step."""

    def __init__(self, reader, cache, plan, steps: int, steps_per_file: int, location: str,
                 dim: int, every_row: bool = False):
        self.reader, self.cache_handle, self.plan = reader, cache, plan
        self.steps, self.steps_per_file, self.location, self.dim = steps, steps_per_file, location, dim
        self.every_row = every_row

    def setup(self):
        self.cache = self.cache_handle.acquire(ShardCache)

    def process(self, indexed_shard):
        index, shard = indexed_shard
        by_group = collections.defaultdict(list)
        for block in self.cache.blocks(shard, self.reader, keep=False):
            for step, piece in self.plan.pieces(block, range(self.steps)):
                by_group[step // self.steps_per_file].append(batches.as_piece(step, piece))
            if self.every_row:
                by_group[batches.rows_group(self.steps, self.steps_per_file)].append(
                    batches.as_piece(self.steps, block))
        attempt = uuid.uuid4().hex   # a retried bundle writes new files; its index names only these
        for group, pieces in by_group.items():
            name = batches.pieces_name(group, index, attempt)
            with FileSystems.create(FileSystems.join(self.location, name),
                                    compression_type=CompressionTypes.UNCOMPRESSED) as f:
                batches.write_pieces(f, pieces, self.dim, batches.compression(self.location))
            yield group, name


def _write_index(keyed, location: str):
    group, names = keyed
    with FileSystems.create(FileSystems.join(location, batches.index_name(group)),
                            compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(json.dumps(sorted(names)).encode())
    yield batches.index_name(group)


class WriteStepBatches(beam.PTransform):
    """The batch job's body: pipeline begin in, the names of the groups' index files out."""

    def __init__(self, shards, reader, cache, plan, steps: int, steps_per_file: int,
                 location: str, dim: int, every_row: bool = False):
        super().__init__()
        self.shards = list(enumerate(shards))   # the index orders a group's pieces by shard
        self.reader, self.cache, self.plan, self.steps = reader, cache, plan, steps
        self.steps_per_file, self.location, self.dim = steps_per_file, location, dim
        self.every_row = every_row

    def expand(self, pbegin):
        return (pbegin
                | "Shards" >> beam.Create(self.shards)
                | "Spread" >> beam.Reshuffle()
                | "AssignRowsToSteps" >> beam.ParDo(_WritePieces(
                    self.reader, self.cache, self.plan, self.steps, self.steps_per_file,
                    self.location, self.dim, self.every_row))
                | "GroupByStepGroup" >> beam.GroupByKey()
                | "WriteIndex" >> beam.FlatMap(_write_index, self.location))
