"""Noise and randomness.

Every random draw of a job comes from one 128-bit root seed: from the OS's secure randomness
(``secrets``) unless the user passes ``--seed`` for a reproducible comparison. Draws are split
into independent streams by (purpose, step, block), with numpy's SeedSequence (``rng``: Poisson
sampling, statistics) or a keyed hash (``stream_key``: the ChaCha20 streams of the training
noise), so the local and the Beam runner draw identical noise and samples for the same seed,
whatever the order of execution.

Caveat (written in the README): ``gaussian_noise`` and ``laplace_noise`` are numpy's floating-point
samplers, not the discrete or snapping mechanisms that defend against floating-point attacks.
``discrete_gaussian`` and ``discrete_laplace`` draw integers from the exact laws (up to ~2^-50 in
total variation) with a ChaCha20 generator from ``secure_generator``, for integer-valued releases.
"""
from __future__ import annotations

import hashlib
import math
import secrets

import numpy as np
import randomgen

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


# A test-only hook: every noise draw of the product is scaled by this factor. The audit's tests
# set it to 0.1 (a "broken build" whose noise is 10x too small) and check that
# ``beam-dp audit`` then reports a lower bound above the claimed epsilon. No flag, option or
# environment variable sets it; an audit report records it, so a broken build cannot pass for
# a sound one.
NOISE_SCALE_FOR_TESTS = 1.0


def gaussian_noise(generator: np.random.Generator, shape, std: float) -> np.ndarray:
    return generator.normal(0.0, std * NOISE_SCALE_FOR_TESTS, size=shape)


def laplace_noise(generator: np.random.Generator, scale: float) -> float:
    return float(generator.laplace(0.0, scale * NOISE_SCALE_FOR_TESTS))


def gumbel_noise(generator: np.random.Generator, size) -> np.ndarray:
    """Standard Gumbel draws, for the exponential mechanism's Gumbel-max sampling."""
    return generator.gumbel(0.0, NOISE_SCALE_FOR_TESTS, size=size)


# --------------------------------------------------------------------------------------------
# A cryptographically secure generator and exact-law integer noise

# Above 2**50 the noise (whose tails reach ~90 scales, 2^57) nears the int64 range and the
# float64 arithmetic of the acceptance tests stops resolving single integers.
MAX_DISCRETE_SCALE = 2.0 ** 50
# Not rounding numpy's normal at large scales: its variates are 52-bit ziggurat values, so at
# 2^40-2^48 times sigma they sit on a grid of 1/32-1/16, and rounding them favours even integers
# (P(even) 0.511 at 2^47, found in review): the rejection sampler is used at every scale.


def secure_generator(seed: int, *stream: int) -> np.random.Generator:
    """An independent generator per stream, driven by ChaCha20 (``randomgen.ChaCha``, 20 rounds).

    Why ChaCha20: it is a stream cipher, so without the key its output is indistinguishable from
    uniform bits, and past outputs do not help predict future ones. numpy's PCG64 and Philox are
    fast statistical generators, not designed to resist an adversary who sees outputs (PCG64's
    state can be recovered from its output). Price: ~25 ns per 64-bit draw (~310 MB/s) against
    ~2.7 ns for PCG64 (~3 GB/s), measured on one core of an x86-64 machine (randomgen 2.5.1);
    a discrete Gaussian costs ~0.35 us per draw. randomgen's keystream is checked against the
    ChaCha20 reference vector in the tests.

    The 256-bit key is a keyed hash (a PRF) of the stream ids under the root seed:
    ``blake2b(ids as 8-byte little-endian words, key=seed as 16 bytes, digest_size=32)``, so the
    keys of different streams are independent and reveal nothing about the root. The root seed
    must come from ``secure_seed()``; a fixed seed (``--seed``) is for tests and comparisons only.
    """
    return keyed_generator(stream_key(seed, *stream))


def stream_key(seed: int, *stream: int) -> int:
    """The 256-bit key of one stream: ``blake2b(ids, key=seed)`` (see ``secure_generator``).
    What a component that draws only from this stream is given instead of the root seed."""
    if not 0 <= seed < 2 ** 128:
        raise ValueError("the root seed must be an integer in [0, 2**128)")   # (not echoed)
    if not all(0 <= s < 2 ** 64 for s in stream):
        raise ValueError(f"stream ids must be integers in [0, 2**64), got {stream!r}")
    message = b"".join(int(s).to_bytes(8, "little") for s in stream)
    digest = hashlib.blake2b(message, key=int(seed).to_bytes(16, "little"), digest_size=32)
    return int.from_bytes(digest.digest(), "little")


def keyed_generator(key: int) -> np.random.Generator:
    """A ChaCha20 generator from a stream key (``stream_key``)."""
    return np.random.Generator(randomgen.ChaCha(key=key, rounds=20))


def _check_scale(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and 0.0 < value <= MAX_DISCRETE_SCALE):
        raise ValueError(f"{name} must be finite, positive and at most 2**50, got {value!r}")
    return value


def discrete_laplace(generator: np.random.Generator, scale: float, size) -> np.ndarray:
    """Integers with P(k) proportional to exp(-|k| / scale), as int64 of shape ``size``.

    The difference of two independent geometric counts with ratio exp(-1/scale) has exactly this
    law; see ``_geometric_failures`` for why these are not numpy's ``geometric``.
    """
    scale = _check_scale("scale", scale * NOISE_SCALE_FOR_TESTS)
    return _geometric_failures(generator, scale, size) - _geometric_failures(generator, scale, size)


def discrete_gaussian(generator: np.random.Generator, sigma: float, size) -> np.ndarray:
    """Integers with P(k) proportional to exp(-k^2 / (2 sigma^2)), as int64 of shape ``size``.

    Rejection sampling from a discrete Laplace proposal (Canonne, Kamath & Steinke 2020, "The
    Discrete Gaussian for Differential Privacy", Algorithm 3): with t = floor(sigma) + 1, draw
    Y ~ discrete Laplace(t) and accept with probability exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)),
    redrawing the rejected entries, all at once, until every entry is accepted.

    Exactness: each acceptance compares a float64 uniform (a multiple of 2^-53) with a float64
    probability computed to a relative error of a few ulps where it matters (the error grows
    with the exponent, but the probability shrinks faster), so each draw's law is within total
    variation of order 2^-50 of the exact one, at every sigma up to 2**50 (and so is the
    proposal's). The outputs are integers: nothing released carries floating-point low bits,
    which the attack of Mironov 2012 on floating-point Laplace noise reads.

    Timing side channel: the number of rejection rounds depends on the values drawn; batching a
    whole vector hides individual values only partly, as the total time still leaks a little.
    """
    sigma = _check_scale("sigma", sigma * NOISE_SCALE_FOR_TESTS)
    proposal_scale = math.floor(sigma) + 1
    center = sigma * sigma / proposal_scale

    def propose(count: int) -> np.ndarray:
        return (_geometric_failures(generator, proposal_scale, count)
                - _geometric_failures(generator, proposal_scale, count))

    def log_acceptance(candidates: np.ndarray) -> np.ndarray:
        return -((np.abs(candidates) - center) ** 2) / (2.0 * sigma * sigma)

    return _rejection_sample(generator, size, propose, log_acceptance)


def _geometric_failures(generator: np.random.Generator, scale: float, size) -> np.ndarray:
    """Counts k >= 0 with P(k) = (1 - q) q^k, q = exp(-1/scale), as int64.

    Why not numpy's ``geometric`` (or floor(scale * exponential), its inversion): a float64
    exponential cannot resolve the ~45 * 2^50 integers a large scale reaches, which moves the
    law by ~scale * 2^-52 in total variation; numpy's inversion can also return 0 (-1 failures)
    when the exponential is exactly 0. Instead, with block = max(1, floor(scale)), split
    k = block * quotient + remainder: the two are independent (memorylessness); the quotient is
    geometric with ratio exp(-block/scale), i.e. floor(exponential * scale/block) with
    scale/block < 2, which float64 resolves to ~2^-50; the remainder, on {0, ..., block - 1}
    with P(r) proportional to exp(-r/scale), is an exact uniform integer accepted with
    probability exp(-r/scale) >= 1/e.
    """
    block = max(1, math.floor(scale))
    quotient = np.floor(generator.standard_exponential(_shape(size)) * (scale / block))
    quotient = quotient.astype(np.int64)
    if block == 1:
        return quotient
    remainder = _rejection_sample(generator, size, lambda n: generator.integers(0, block, n),
                                  lambda candidates: -candidates / scale)
    return block * quotient + remainder


def _rejection_sample(generator: np.random.Generator, size, propose, log_acceptance) -> np.ndarray:
    """Fills an int64 array of shape ``size`` with proposals ``propose(count)``, each accepted
    with probability exp(log_acceptance(proposal)); the rejected entries are redrawn together,
    so the Python loop runs over rounds (a few dozen at most), not over elements."""
    out = np.empty(_shape(size), dtype=np.int64)
    flat = out.reshape(-1)
    pending = np.arange(flat.size)
    while pending.size:
        candidates = propose(pending.size)
        accepted = generator.random(pending.size) < np.exp(log_acceptance(candidates))
        flat[pending[accepted]] = candidates[accepted]
        pending = pending[~accepted]
    return out


def _shape(size) -> tuple:
    return (int(size),) if np.ndim(size) == 0 else tuple(int(n) for n in size)
