"""Beam execution: the Beam aggregator, PTransforms over shards, the batch job, the worker cache."""
