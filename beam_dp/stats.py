"""Beam-free combiners (create / add / merge / extract) over blocks' partial results.

Each is the numpy core of a Beam CombineFn (``beam_dp.beam.combiners.CombinerFn`` wraps any of
them), in the manner of tf.Transform's analyzers, and is used directly by the local aggregator.
"""
from __future__ import annotations

import numpy as np


class ArraySum:
    """Sums arrays of a fixed shape; an empty input sums to zeros (so a step with an empty batch
    still releases a noisy zero)."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def create(self):
        return np.zeros(self.shape)

    def add(self, acc, value):
        acc += value
        return acc

    def merge(self, accs):
        accs = iter(accs)
        total = next(accs).copy()
        for acc in accs:
            total += acc
        return total

    def extract(self, acc):
        return acc
