"""PTransforms over blocks of examples."""
from __future__ import annotations

from typing import Sequence

import apache_beam as beam
import pyarrow as pa
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from beam_dp import data
from beam_dp.beam.combiners import CombinerFn
from beam_dp.losses import GlmLoss
from beam_dp.stats import ArraySum, record_releases


def open_file(path: str):
    """Opens local and remote (gs://, s3://, ...) files alike. A .gz file is decompressed by
    pyarrow: Beam's own decompressing reader has a ``closed`` method where pyarrow expects a
    property, so pyarrow takes every such file for closed."""
    f = FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    return pa.CompressedInputStream(f, "gzip") if path.endswith(".gz") else f


def _read_file(path: str, label_column: str, feature_columns: Sequence[str], loss: GlmLoss,
               batch_rows: int):
    return data.blocks_from_file(path, label_column, feature_columns, loss, batch_rows, open_file)


class ReadBlocks(beam.PTransform):
    """File paths in, validated Blocks out. Files are spread over workers by a Reshuffle; each
    file is read in batches of ``batch_rows`` rows, so no per-row Python objects are made."""

    def __init__(self, files: Sequence[str], label_column: str, feature_columns: Sequence[str],
                 loss: GlmLoss, batch_rows: int = data.DEFAULT_BATCH_ROWS, block_maps=()):
        super().__init__()
        self.files = list(files)
        self.args = (label_column, list(feature_columns), loss, batch_rows)
        self.block_maps = list(block_maps)

    def expand(self, pbegin):
        blocks = (pbegin
                  | "Files" >> beam.Create(self.files)
                  | "Spread" >> beam.Reshuffle()
                  | "Read" >> beam.FlatMap(_read_file, *self.args))
        for i, block_map in enumerate(self.block_maps):
            blocks = blocks | f"MapBlocks{i}" >> beam.FlatMap(block_map)
        return blocks


def _partial_sum(block, stage, state):
    return stage.partial_sum(block, state)


def _apply(total, stage, state):
    return stage.apply(state, total)


def _select_for_steps(block, stages, first_step):
    """Each step's sample of the block, tagged with the step's index in the chunk."""
    for i, stage in enumerate(stages):
        rows = stage.select(block, first_step + i)
        if len(rows):
            yield i, rows


def _by_step(tagged, num_partitions):
    return tagged[0]


def _selected_sum(tagged, stage, state):
    return stage.selected_sum(tagged[1], state)


class RunStages(beam.PTransform):
    """Blocks in, the final state out (a singleton PCollection). Each stage (see
    ``beam_dp.algorithms.base``) is a Map to partial sums per block with the current state as a
    side input, one CombineGlobally, and a Map that adds the noise and updates the state."""

    def __init__(self, stages, initial_state):
        super().__init__()
        self.stages = list(stages)
        self.initial_state = initial_state

    def expand(self, blocks):
        current = blocks.pipeline | "InitialState" >> beam.Create([self.initial_state])
        # Sampling steps of a training state: sample the whole chunk in one pass over the blocks
        # and route each step's rows to that step only (Partition), so a step's work is
        # proportional to its batch rather than to the dataset.
        # (Full-batch steps read everything anyway: routing each block to each step would only
        # copy it.)
        presample = (len(self.stages) > 1 and hasattr(self.initial_state, "step")
                     and all(getattr(s, "subsamples", False) for s in self.stages))
        if presample:
            parts = (blocks
                     | "SampleSteps" >> beam.FlatMap(_select_for_steps, self.stages, self.initial_state.step)
                     | "ByStep" >> beam.Partition(_by_step, len(self.stages)))
        for i, stage in enumerate(self.stages):
            side = beam.pvalue.AsSingleton(current)
            partial = (parts[i] | f"PartialSums{i}" >> beam.Map(_selected_sum, stage, side)
                       if presample else
                       blocks | f"PartialSums{i}" >> beam.Map(_partial_sum, stage, side))
            total = partial | f"Sum{i}" >> beam.CombineGlobally(CombinerFn(ArraySum(stage.shape)))
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
