"""Optimizer drivers. Each talks to an Aggregator (``base``) and never imports Beam."""
