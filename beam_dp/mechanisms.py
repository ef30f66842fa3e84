"""Noise and randomness.

Every random draw of a job comes from one 128-bit root seed: from the OS's secure randomness
(``secrets``) unless the user passes ``--seed`` for a reproducible comparison. Draws are split
into independent streams by (purpose, step, block) with numpy's SeedSequence, so the local and the
Beam runner draw identical noise and samples for the same seed, whatever the order of execution.

Caveat (written in the README): the Gaussian and Laplace samplers are numpy's floating-point
samplers, not the discrete or snapping mechanisms that defend against floating-point attacks.
"""
from __future__ import annotations

import secrets

import numpy as np

# Stream identifiers: the first element of a SeedSequence spawn key.
STREAM_SAMPLING = 1
STREAM_NOISE = 2
STREAM_COUNT = 3
STREAM_STATS = 4


def secure_seed() -> int:
    return secrets.randbits(128)


def rng(seed: int, *stream: int) -> np.random.Generator:
    """An independent generator for one stream (e.g. ``rng(seed, STREAM_NOISE, step)``)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=stream)))


def gaussian_noise(generator: np.random.Generator, shape, std: float) -> np.ndarray:
    return generator.normal(0.0, std, size=shape)


def laplace_noise(generator: np.random.Generator, scale: float) -> float:
    return float(generator.laplace(0.0, scale))
