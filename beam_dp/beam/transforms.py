"""PTransforms over shards and blocks of examples."""
from __future__ import annotations

from typing import Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.utils.shared import Shared

from beam_dp import data
from beam_dp.beam.cache import ShardCache
from beam_dp.beam.combiners import CombinerFn
from beam_dp.losses import GlmLoss
from beam_dp.stats import ArraySum, record_releases

METRICS_NAMESPACE = "beam_dp"
FILE_OPENS = "input_file_opens"   # counter: shards read from their file (each opens it once)


def open_file(path: str):
    """Opens local and remote (gs://, s3://, ...) files alike. A .gz file is decompressed by
    pyarrow: Beam's own decompressing reader has a ``closed`` method where pyarrow expects a
    property, so pyarrow takes every such file for closed."""
    f = FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    return pa.CompressedInputStream(f, "gzip") if path.endswith(".gz") else f


class ShardReader:
    """Reads a shard into validated Blocks (picklable: it travels to the workers), counting the
    file opens in a Beam metric."""

    def __init__(self, label_column: str | None, feature_columns: Sequence[str], loss: GlmLoss,
                 batch_rows: int = data.DEFAULT_BATCH_ROWS):
        self.args = (label_column, list(feature_columns), loss, batch_rows)

    def __call__(self, shard: data.Shard) -> list[data.Block]:
        Metrics.counter(METRICS_NAMESPACE, FILE_OPENS).inc()
        return list(data.blocks_from_shard(shard, *self.args, open_file))


class ReadShards(beam.PTransform):
    """The shards, spread over the workers by a Reshuffle. What flows through a job's steps."""

    def __init__(self, shards: Sequence[data.Shard]):
        super().__init__()
        self.shards = list(shards)

    def expand(self, pbegin):
        return pbegin | "Shards" >> beam.Create(self.shards) | "Spread" >> beam.Reshuffle()


class _StageSums(beam.DoFn):
    """A stage's partial sum per input element: a Block, or a Shard whose blocks come from the
    worker's cache (read on a miss). Emits one array of the stage's shape per element."""

    def __init__(self, stage, reader: ShardReader | None, cache: Shared | None):
        self.stage, self.reader, self.cache_handle = stage, reader, cache
        self.cache = None

    def setup(self):
        if self.cache_handle is not None:
            self.cache = self.cache_handle.acquire(ShardCache)

    def process(self, element, state):
        blocks = ([element] if isinstance(element, data.Block)
                  else self.cache.blocks(element, self.reader))
        total = None
        for block in blocks:
            part = self.stage.partial_sum(block, state)
            total = part if total is None else total + part
        yield total if total is not None else np.zeros(self.stage.shape)


def _apply(total, stage, state):
    return stage.apply(state, total)


class RunStages(beam.PTransform):
    """Blocks (or shards, with ``reader`` and ``cache``) in, the final state out (a singleton
    PCollection). Each stage (see ``beam_dp.algorithms.base``) is a ParDo to partial sums with
    the current state as a side input, one CombineGlobally, and a Map that adds the noise and
    updates the state."""

    def __init__(self, stages, initial_state, reader: ShardReader | None = None,
                 cache: Shared | None = None):
        super().__init__()
        self.stages = list(stages)
        self.initial_state = initial_state
        self.reader, self.cache = reader, cache

    def expand(self, inputs):
        current = inputs.pipeline | "InitialState" >> beam.Create([self.initial_state])
        for i, stage in enumerate(self.stages):
            side = beam.pvalue.AsSingleton(current)
            partial = inputs | f"PartialSums{i}" >> beam.ParDo(
                _StageSums(stage, self.reader, self.cache), side)
            # without_defaults: every element yields a sum, so the input is never empty, and the
            # default-value branch would add a stage (and a side input) to every step.
            total = partial | f"Sum{i}" >> beam.CombineGlobally(
                CombinerFn(ArraySum(stage.shape))).without_defaults()
            current = total | f"Apply{i}" >> beam.Map(_apply, stage, side)
        return current


class PrivateStatistics(beam.PTransform):
    """Private statistics of blocks (stages from ``beam_dp.stats``, e.g. a CountStage, a
    QuantileStage, ``adaptive_mean_stages(...)``); outputs one dict of the released values.
    Every release is recorded in ``ledger`` when the transform is applied to a pipeline."""

    def __init__(self, stages, ledger, initial_state=None):
        super().__init__()
        self.stages = list(stages)
        self.ledger = ledger
        self.initial_state = dict(initial_state or {})

    def expand(self, blocks):
        record_releases(self.stages, self.ledger)
        return blocks | RunStages(self.stages, self.initial_state)
