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

from beam_dp import accounting, categorical, data, mechanisms, user_level

STREAM_VOCABULARY = 9   # mechanisms stream of the partition selection's coins
VOCABULARY_RELEASE = "partition_selection_vocabulary"
# --privacy-unit-column: the values of each column one user may count for (PipelineDP's
# max_partitions_contributed per column): the fewer, the lower the bar each value must clear.
DEFAULT_VALUES_PER_USER = 4


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


def user_value_counts(files: Sequence[str], columns: Sequence[str], opener, batch_rows: int,
                      user_column: str, max_values: int) -> dict:
    """As ``value_counts``, but of USERS (``user_column``, keyed as ``user_level.user_keys``):
    each user counts once for each of at most ``max_values`` of their distinct values per
    column, the ones of smallest keyed hash of (user, value), a choice that depends on that
    user's rows only. So one user is in at most ``max_values`` partitions per column, once each:
    the bound partition selection needs (``max_partitions_contributed`` = k ``max_values``).
    Vectorized: distinct (user, value) pairs by a group-by, the cap by a sort, no row loop."""
    parts: dict = {c: [] for c in columns}
    for path in files:
        with opener(path) as f:
            for batch in data.record_batches(path, f, [*columns, user_column], batch_rows, None,
                                             (*columns, user_column)):
                users = pa.array(user_level.user_keys(batch.column(user_column)))
                for name in columns:
                    text = categorical.as_text(batch.column(name))
                    parts[name].append(pa.table({"user": users, "value": text}).filter(
                        pc.is_valid(text)).group_by(["user", "value"]).aggregate([]))
    out = {}
    for name in columns:
        if not parts[name]:
            out[name] = (pa.array([], pa.large_string()), np.zeros(0, np.int64))
            continue
        pairs = pa.concat_tables(parts[name]).group_by(["user", "value"]).aggregate([])
        users = np.asarray(pairs.column("user"), dtype=np.uint64)
        values = pairs.column("value").combine_chunks()
        with np.errstate(over="ignore"):
            priority = user_level._mix(users ^ categorical.hash_text(values, np.uint64(0)))
        order = np.lexsort((priority, users))
        sorted_users = users[order]
        starts = np.flatnonzero(np.r_[True, sorted_users[1:] != sorted_users[:-1]])
        rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
        kept = values.take(pa.array(order[rank < max_values]))
        counted = pc.value_counts(kept)
        out[name] = (counted.field("values"), np.asarray(counted.field("counts"), np.int64))
    return out


def private_vocabulary(counts: dict, epsilon: float, delta: float, seed: int,
                       values_per_unit: int = 1) -> tuple:
    """The values of each column that pipeline-dp's partition selection keeps (truncated
    geometric thresholding, Desfontaines, Voss, Gipson & Mandayam 2022), as the
    ``Encoding.vocabulary`` tuple, each column's values sorted (an order that says nothing of
    the counts).

    Each row is one value of each of the k columns, so it contributes to at most k partitions
    (column, value), once each: ``max_partitions_contributed`` = k, and the release is
    (epsilon, delta)-DP under add/remove of one row (``values_per_unit`` 1); of users, each
    counted for at most ``values_per_unit`` values per column (``user_value_counts``): k times
    that, under add/remove of one user. pipeline-dp gives the probability of
    keeping a partition of count c; the coins are drawn here, from ``seed``'s generator (the OS's
    secure source without --seed), vectorized over the partitions."""
    import pipeline_dp   # (imported here: only this command needs pipeline-dp)
    from pipeline_dp import partition_selection

    strategy = partition_selection.create_partition_selection_strategy(
        pipeline_dp.PartitionSelectionStrategy.TRUNCATED_GEOMETRIC, epsilon, delta,
        len(counts) * values_per_unit)
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
