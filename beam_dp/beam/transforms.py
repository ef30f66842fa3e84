"""PTransforms over shards and blocks of examples."""
from __future__ import annotations

from typing import Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.shared import Shared
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import WindowedValue

from beam_dp import data, user_level
from beam_dp.algorithms.base import zero_sum
from beam_dp.beam.cache import ShardCache
from beam_dp.block import Block
from beam_dp.losses import GlmLoss
from beam_dp.stats import record_releases

METRICS_NAMESPACE = "beam_dp"
FILE_OPENS = "input_file_opens"   # counter: shards read from their file (each opens it once)
STEP_BUNDLES = "step_bundles"      # counter: a step's bundles, each holding one sum to the next


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
                 batch_rows: int = data.DEFAULT_BATCH_ROWS, encoding=None,
                 user_column: str | None = None):
        self.args = (label_column, list(feature_columns), loss, batch_rows)
        self.encoding = encoding
        self.user_column = user_column   # user-level privacy: read each row's user key

    def __call__(self, shard: data.Shard) -> list[Block]:
        Metrics.counter(METRICS_NAMESPACE, FILE_OPENS).inc()
        return list(data.blocks_from_shard(shard, *self.args, open_file, self.encoding,
                                           getattr(self, "user_column", None)))


def _user_buckets(block: Block, buckets: int):
    """(bucket, rows) pairs: the block's rows split by a hash bucket of their user key, so that
    a GroupByKey on the bucket brings every row of a user to one place."""
    tags = (block.users % np.uint64(buckets)).astype(np.int64)
    for part in block.parts(tags):
        yield part.tag, part


class _BoundUsers:
    """A bucket's rows, every user's bounded to K rows and kept in one block
    (``user_level.group_by_user``: the numpy core the in-process path uses too)."""

    def __init__(self, max_rows: int, batch_rows: int):
        self.max_rows, self.batch_rows = max_rows, batch_rows

    def __call__(self, keyed):
        bucket, parts = keyed
        # The bucket's parts sorted by where they were read, so the blocks are the same
        # whatever order the shuffle delivered them in (the user sort makes them so anyway).
        parts = sorted(parts, key=lambda b: (b.source, b.row_start))
        return user_level.group_by_user(parts, self.max_rows, self.batch_rows,
                                        source=f"users/{bucket}")


class GroupUsers(beam.PTransform):
    """Shards in, blocks grouped by user out (user-level privacy): each row keyed by a hash
    bucket of its user, one GroupByKey, and each bucket's users bounded (at most K rows each)
    and cut into blocks at user boundaries. Once per job: the steps then sum per user within
    a block, before the per-user clipping."""

    def __init__(self, reader: ShardReader, bounding, buckets: int, batch_rows: int):
        super().__init__()
        self.reader, self.bounding = reader, bounding
        self.buckets, self.batch_rows = buckets, batch_rows

    def expand(self, shards):
        return (shards
                | "ReadRows" >> beam.FlatMap(self.reader)
                | "UserBuckets" >> beam.FlatMap(_user_buckets, self.buckets)
                | "GroupByUser" >> beam.GroupByKey()
                | "BoundUsers" >> beam.FlatMap(_BoundUsers(self.bounding.max_rows, self.batch_rows)))


class ReadShards(beam.PTransform):
    """The shards, spread over the workers by a Reshuffle. What flows through a job's steps."""

    def __init__(self, shards: Sequence[data.Shard]):
        super().__init__()
        self.shards = list(shards)

    def expand(self, pbegin):
        return pbegin | "Shards" >> beam.Create(self.shards) | "Spread" >> beam.Reshuffle()


_UNSET = object()


def _state_after(stage, outputs):
    """The state after ``stage`` from the previous step's outputs, (first input of the bundle,
    state before it, partial sum) triples, one per bundle; ``stage`` None: the initial state.
    Every consumer computes it alike: the partial sums are added in the order of their bundles'
    first inputs (a side input's order is not fixed), and ``apply`` is a pure function of the
    state and the sum, its noise drawn from the seed. So the update needs no stage of its own."""
    outputs = sorted(outputs, key=lambda o: o[0])
    state, total = outputs[0][1], None
    if stage is None:
        return state
    for _, _, partial in outputs:
        total = partial if total is None else total + partial
    return stage.apply(state, total)


def _position(element) -> tuple:
    """Where an input element starts (file and first row): orders the bundles' sums."""
    return (element.source if isinstance(element, Block) else element.path,
            element.row_start)


class _Step(beam.DoFn):
    """One stage over the input elements: Blocks, or Shards whose blocks come from the worker's
    cache (read on a miss). The side input holds the previous stage's outputs, from which the
    state is made (once per bundle); the output is one (first input's position, state, partial
    sum over the bundle) per bundle, so that a step is a single fused stage of the job and its
    output O(d) per bundle."""

    # Beam validates a ParDo by inspecting the signature of every method ``dir`` lists
    # (``userstate.get_dofn_specs``, a few times per ParDo as a job is built and translated):
    # ~35 for a DoFn, mostly DoFn's own, ~8 ms per step of an unrolled job, a quarter of a
    # full-batch step's cost on the in-process runner. This DoFn has no state or timers to
    # find; ``dir`` lists the methods it implements.
    def __dir__(self):
        return ["finish_bundle", "process", "setup", "start_bundle"]

    def __init__(self, stage, previous, reader: ShardReader | None, cache: Shared | None,
                 first_position: tuple | None = None):
        self.stage, self.previous = stage, previous
        self.reader, self.cache_handle = reader, cache
        self.cache = None
        # The position of the job's first input, if known: only the bundle holding it sends the
        # state on (``_state_after`` reads the state of the first bundle only), the others None,
        # so a step moves one copy of the model rather than one per bundle (16 MB each at 2^20
        # categorical columns).
        self.first_position = first_position

    def setup(self):
        if self.cache_handle is not None:
            self.cache = self.cache_handle.acquire(ShardCache)

    def start_bundle(self):
        self.state, self.total, self.first = _UNSET, None, None

    def process(self, element, previous_outputs):
        if self.state is _UNSET:
            self.state = _state_after(self.previous, previous_outputs)
        position = _position(element)
        self.first = position if self.first is None else min(self.first, position)
        blocks = ([element] if isinstance(element, Block)
                  else self.cache.blocks(element, self.reader))
        for block in blocks:
            part = self.stage.partial_sum(block, self.state)
            self.total = part if self.total is None else self.total + part

    def finish_bundle(self):
        if self.state is not _UNSET:
            Metrics.counter(METRICS_NAMESPACE, STEP_BUNDLES).inc()
            total = self.total if self.total is not None else zero_sum(self.stage)
            carries = self.first_position is None or self.first == self.first_position
            yield WindowedValue((self.first, self.state if carries else None, total),
                                MIN_TIMESTAMP, [GlobalWindow()])


def _final_state(_, stage, outputs):
    return _state_after(stage, outputs)


class StateFile:
    """An initial state the job reads from a file (written by the driver under the temp
    location) instead of carrying it in its graph: a model of 2^20 categorical columns is 16 MB
    with its running sum, beyond what a graph should hold (Dataflow refuses graphs over 10 MB)."""

    def __init__(self, path: str):
        self.path = path


def _initial_from_file(path: str):
    import pickle
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return ((), pickle.loads(f.read()), None)


class RunStages(beam.PTransform):
    """Blocks (or shards, with ``reader`` and ``cache``) in, the final state out (a singleton
    PCollection). Each stage (see ``beam_dp.algorithms.base``) is one ParDo over the input with
    the previous stage's outputs as a side input: it makes the state (``apply``: the noise and
    the update) and the stage's partial sums (one per bundle). One fused stage of the job per
    step, and no shuffle: a CombineGlobally and a separate update made each step three stages
    and ~60 ms of the in-process runner's overhead."""

    def __init__(self, stages, initial_state, reader: ShardReader | None = None,
                 cache: Shared | None = None, first_position: tuple | None = None):
        super().__init__()
        self.stages = list(stages)
        self.initial_state = initial_state
        self.reader, self.cache = reader, cache
        self.first_position = first_position   # of the inputs (``_position``), if known

    def expand(self, inputs):
        if isinstance(self.initial_state, StateFile):
            outputs = (inputs.pipeline | "InitialStateFile" >> beam.Create([self.initial_state.path])
                       | "ReadInitialState" >> beam.Map(_initial_from_file))
        else:
            outputs = inputs.pipeline | "InitialState" >> beam.Create([((), self.initial_state, None)])
        previous = None
        for i, stage in enumerate(self.stages):
            outputs = inputs | f"Step{i}" >> beam.ParDo(
                _Step(stage, previous, self.reader, self.cache, self.first_position),
                beam.pvalue.AsList(outputs))
            previous = stage
        return (inputs.pipeline
                | "Last" >> beam.Create([None])
                | "FinalState" >> beam.Map(_final_state, previous, beam.pvalue.AsList(outputs)))


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
