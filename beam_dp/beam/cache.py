"""The worker-side cache of parsed input: one per worker process, shared by every step of a job
(``apache_beam.utils.shared.Shared``, the idiom of Beam's RunInference), so that a job of K
full-batch steps reads and parses each shard once per process rather than K times, and a step
moves O(d) bytes per shard through the data plane instead of the data."""
from __future__ import annotations

import collections
import os
import threading
from typing import Callable

from beam_dp.block import Block
from beam_dp.data import Shard


def default_budget_bytes() -> int:
    """Half of the machine's memory shared among one SDK process per core (Dataflow runs one per
    core), at least 256 MiB. A shard that does not fit evicts the least recently used ones; a
    miss only costs a re-read."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 4 << 30
    return max(256 << 20, memory // (2 * (os.cpu_count() or 1)))


def _block_bytes(blocks: list[Block]) -> int:
    return sum(_features_bytes(b.features) + b.labels.nbytes + b.sq_norms.nbytes for b in blocks)


def _features_bytes(features) -> int:
    if hasattr(features, "indptr"):   # a CSR matrix (categorical columns)
        return features.data.nbytes + features.indices.nbytes + features.indptr.nbytes
    return features.nbytes


class ShardCache:
    """Parsed blocks by shard, least recently used evicted beyond ``budget`` bytes. Thread-safe:
    a runner may process several bundles of a process at once."""

    def __init__(self, budget: int | None = None):
        self.budget = default_budget_bytes() if budget is None else budget
        self._shards: collections.OrderedDict[str, list[Block]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def blocks(self, shard: Shard, read: Callable[[Shard], list[Block]],
               keep: bool = True) -> list[Block]:
        """The shard's blocks, read on a miss and kept unless ``keep`` is false (a job that
        reads each shard once, e.g. the batch job, uses what an earlier job of the run cached
        without filling the cache)."""
        with self._lock:
            hit = self._shards.get(shard.name)
            if hit is not None:
                self._shards.move_to_end(shard.name)
                return hit
        blocks = list(read(shard))   # outside the lock: other shards are read meanwhile
        if not keep:
            return blocks
        with self._lock:
            if shard.name not in self._shards:
                self._shards[shard.name] = blocks
                self._bytes += _block_bytes(blocks)
            while self._bytes > self.budget and len(self._shards) > 1:
                _, evicted = self._shards.popitem(last=False)
                self._bytes -= _block_bytes(evicted)
        return blocks

    def clear(self) -> None:
        with self._lock:
            self._shards.clear()
            self._bytes = 0
