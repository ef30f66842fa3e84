"""Beam execution: PTransforms, CombineFns and the Beam aggregator."""
