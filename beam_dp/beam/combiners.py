"""Thin adapter from the Beam-free combiners in ``beam_dp.stats`` to Beam CombineFns."""
from __future__ import annotations

import apache_beam as beam


class CombinerFn(beam.CombineFn):
    def __init__(self, combiner):
        self.combiner = combiner

    def create_accumulator(self):
        return self.combiner.create()

    def add_input(self, accumulator, element):
        return self.combiner.add(accumulator, element)

    def merge_accumulators(self, accumulators):
        return self.combiner.merge(accumulators)

    def extract_output(self, accumulator):
        return self.combiner.extract(accumulator)
