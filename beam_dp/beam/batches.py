"""The batch job: one Beam pipeline that reads the input once, assigns each row to the steps
whose batch holds it (``beam_dp.batches``: from the seed and the row's position, exactly the
sampling the accounting assumes), groups the rows by step with a shuffle (GroupByKey) and writes
each group of consecutive steps' batches to one file under the job's temp location."""
from __future__ import annotations

import collections
import itertools

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from beam_dp import batches


def _pieces_by_file(shard, reader, plan, steps: int, steps_per_file: int):
    """(file index, the shard's pieces of that file's steps): one element per (shard, file), not
    per row or per step, so the shuffle moves a few large elements."""
    by_file = collections.defaultdict(list)
    for block in reader(shard):
        for step, piece in plan.pieces(block, range(steps)):
            by_file[step // steps_per_file].append(batches.as_piece(step, piece))
    yield from by_file.items()


def _write_file(keyed, location: str, dim: int):
    index, groups = keyed
    path = FileSystems.join(location, batches.file_name(index))
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        batches.write_file(f, itertools.chain.from_iterable(groups), dim)
    yield batches.file_name(index)


class WriteStepBatches(beam.PTransform):
    """Shards in, the names of the batch files written under ``location`` out."""

    def __init__(self, reader, plan, steps: int, steps_per_file: int, location: str, dim: int):
        super().__init__()
        self.reader, self.plan, self.steps = reader, plan, steps
        self.steps_per_file, self.location, self.dim = steps_per_file, location, dim

    def expand(self, shards):
        return (shards
                | "AssignRowsToSteps" >> beam.FlatMap(_pieces_by_file, self.reader, self.plan,
                                                      self.steps, self.steps_per_file)
                | "GroupByFile" >> beam.GroupByKey()
                | "WriteBatches" >> beam.FlatMap(_write_file, self.location, self.dim))
