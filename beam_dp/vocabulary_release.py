"""A privately released vocabulary (``beam-dp vocabulary``): the values of categorical columns
that pipeline-dp's partition selection keeps, for ``--vocabulary`` (``beam_dp.categorical``).

A layer above the encoding and the readers: it counts values over the input files
(``beam_dp.data``) as the encoding reads them (``categorical.as_text``), then releases the kept
values with their DpEvent for the ledger. ``beam_dp.categorical`` itself only maps values to
column ids by a public map, and reads no files.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from beam_dp import accounting, categorical, data, mechanisms

STREAM_VOCABULARY = 9   # mechanisms stream of the partition selection's coins
VOCABULARY_RELEASE = "partition_selection_vocabulary"


def value_counts(files: Sequence[str], columns: Sequence[str], opener, batch_rows: int) -> dict:
    """Exact counts of every value of each categorical column over the files (rows, not users:
    one row is one privacy unit), as {column: (values: pa.Array, counts: np.ndarray)}. Arrow's
    vectorized value counts per block, merged by a group-by: no Python loop over rows or values.
    Missing cells are not values (they go to the "other" id)."""
    parts: dict = {c: [] for c in columns}
    for path in files:
        with opener(path) as f:
            for batch in data.record_batches(path, f, list(columns), batch_rows, None,
                                             tuple(columns)):
                for name in columns:
                    counted = pc.value_counts(categorical.as_text(batch.column(name)).drop_null())
                    parts[name].append(pa.table({"value": counted.field("values"),
                                                 "count": counted.field("counts")}))
    out = {}
    for name in columns:
        if not parts[name]:
            out[name] = (pa.array([], pa.large_string()), np.zeros(0, np.int64))
            continue
        merged = pa.concat_tables(parts[name]).group_by("value").aggregate([("count", "sum")])
        out[name] = (merged.column("value").combine_chunks(),
                     np.asarray(merged.column("count_sum"), dtype=np.int64))
    return out


def private_vocabulary(counts: dict, epsilon: float, delta: float, seed: int) -> tuple:
    """The values of each column that pipeline-dp's partition selection keeps (truncated
    geometric thresholding, Desfontaines, Voss, Gipson & Mandayam 2022), as the
    ``Encoding.vocabulary`` tuple, each column's values sorted (an order that says nothing of
    the counts).

    Each row is one value of each of the k columns, so it contributes to at most k partitions
    (column, value), once each: ``max_partitions_contributed`` = k, and the release is
    (epsilon, delta)-DP under add/remove of one row. pipeline-dp gives the probability of
    keeping a partition of count c; the coins are drawn here, from ``seed``'s generator (the OS's
    secure source without --seed), vectorized over the partitions."""
    import pipeline_dp   # (imported here: only this command needs pipeline-dp)
    from pipeline_dp import partition_selection

    strategy = partition_selection.create_partition_selection_strategy(
        pipeline_dp.PartitionSelectionStrategy.TRUNCATED_GEOMETRIC, epsilon, delta, len(counts))
    coins = mechanisms.secure_generator(seed, STREAM_VOCABULARY)
    vocabulary = []
    for name, (values, n) in counts.items():
        distinct, inverse = np.unique(n, return_inverse=True)
        keep_probability = np.array([strategy.probability_of_keep(int(c)) for c in distinct])
        keep = coins.random(len(n)) < keep_probability[inverse]
        kept = pc.sort_indices(values.filter(pa.array(keep)))
        vocabulary.append((name, tuple(values.filter(pa.array(keep)).take(kept).to_pylist())))
    return tuple(vocabulary)


def vocabulary_event(epsilon: float, delta: float):
    return accounting.ApproxDpEvent(epsilon, delta)
