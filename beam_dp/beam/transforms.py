"""PTransforms over blocks of examples."""
from __future__ import annotations

from typing import Sequence

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from beam_dp import data
from beam_dp.losses import GlmLoss


def open_file(path: str):
    """Opens local and remote (gs://, s3://, ...) files alike; Beam decompresses .gz by name."""
    return FileSystems.open(path)


def _read_file(path: str, label_column: str, feature_columns: Sequence[str], loss: GlmLoss,
               batch_rows: int):
    return data.blocks_from_file(path, label_column, feature_columns, loss, batch_rows, open_file)


class ReadBlocks(beam.PTransform):
    """File paths in, validated Blocks out. Files are spread over workers by a Reshuffle; each
    file is read in batches of ``batch_rows`` rows, so no per-row Python objects are made."""

    def __init__(self, files: Sequence[str], label_column: str, feature_columns: Sequence[str],
                 loss: GlmLoss, batch_rows: int = data.DEFAULT_BATCH_ROWS):
        super().__init__()
        self.files = list(files)
        self.args = (label_column, list(feature_columns), loss, batch_rows)

    def expand(self, pbegin):
        return (pbegin
                | "Files" >> beam.Create(self.files)
                | "Spread" >> beam.Reshuffle()
                | "Read" >> beam.FlatMap(_read_file, *self.args))
