"""The Beam aggregator: blocks in, one CombineGlobally per step, the state as a singleton side
input, several steps unrolled into one pipeline (a chunk). The driver gets the state back through
a file in a work directory and checkpoints between chunks."""
from __future__ import annotations

import logging
import os
import pickle
import tempfile
import uuid
from typing import Sequence

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from beam_dp.algorithms.base import Stage
from beam_dp.beam.transforms import ReadBlocks, RunStages
from beam_dp.data import DataError


def _write_pickle(value, path):
    with FileSystems.create(path) as f:
        f.write(pickle.dumps(value))


def _take_pickle(path):
    """Reads the value a pipeline saved for the driver and deletes the file: nothing the driver
    reads back (an exact count, a state) is left in the work directory after the job."""
    with FileSystems.open(path) as f:
        value = pickle.loads(f.read())
    FileSystems.delete([path])
    return value


class _DropOwnInputErrors(logging.Filter):
    """Beam's DoFn runner logs a failing worker's traceback before re-raising the error. Our
    input errors (value-free, one line) reach the caller as the exception itself, so that log
    would only repeat them as a traceback."""

    def filter(self, record) -> bool:
        return DataError.MARKER not in record.getMessage()


def _quiet_worker_input_errors() -> None:
    log = logging.getLogger("apache_beam.runners.common")
    if not any(isinstance(f, _DropOwnInputErrors) for f in log.filters):
        log.addFilter(_DropOwnInputErrors())


class BeamAggregator:
    """``pipeline_args`` are Beam's own flags (``--runner``, ``--project``, ...), passed through."""

    def __init__(self, files, label_column, feature_columns, loss, batch_rows,
                 pipeline_args: list[str], work_dir: str | None = None):
        _quiet_worker_input_errors()
        self.read_args = (files, label_column, feature_columns, loss, batch_rows)
        self.pipeline_args = list(pipeline_args)
        self.block_maps: list = []
        self.options = PipelineOptions(pipeline_args)
        if work_dir is None:
            temp = self.options.get_all_options().get("temp_location")
            work_dir = (FileSystems.join(temp, f"beam-dp-{uuid.uuid4().hex}") if temp
                        else tempfile.mkdtemp(prefix="beam-dp-"))
        self.work_dir = work_dir

    def with_block_map(self, block_map) -> "BeamAggregator":
        """An aggregator over the blocks that ``block_map`` (block -> blocks) makes of these."""
        other = BeamAggregator(*self.read_args, self.pipeline_args, self.work_dir)
        other.block_maps = self.block_maps + [block_map]
        return other

    def _path(self, name: str) -> str:
        if "://" not in self.work_dir:
            os.makedirs(self.work_dir, exist_ok=True)
        return FileSystems.join(self.work_dir, f"{name}-{uuid.uuid4().hex}.pkl")

    def count(self) -> int:
        """The exact number of examples (stays on the driver, which adds the noise). Reading every
        block also validates every file before training starts."""
        path = self._path("count")
        with beam.Pipeline(options=self.options) as p:
            (p | "ReadBlocks" >> ReadBlocks(*self.read_args, self.block_maps)
               | "Rows" >> beam.Map(len)
               | "Count" >> beam.CombineGlobally(sum)
               | "Save" >> beam.Map(_write_pickle, path))
        count = int(_take_pickle(path))
        if count == 0:  # as the local runner does (the README's trust model names this leak)
            raise DataError(f"{', '.join(self.read_args[0])}: the input has no rows")
        return count

    def run_stages(self, stages: Sequence[Stage], state):
        path = self._path("state")
        with beam.Pipeline(options=self.options) as p:
            (p | "ReadBlocks" >> ReadBlocks(*self.read_args, self.block_maps)
               | "Stages" >> RunStages(stages, state)
               | "SaveState" >> beam.Map(_write_pickle, path))
        return _take_pickle(path)
