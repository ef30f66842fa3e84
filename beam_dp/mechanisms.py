"""Noise and randomness.

Every random draw of a job comes from one 128-bit root seed: from the OS's secure randomness
(``secrets``) unless the user passes ``--seed`` for a reproducible comparison. Draws are split
into independent streams by (purpose, step, block), with numpy's SeedSequence (``rng``: Poisson
sampling, statistics) or a keyed hash (``stream_key``: the ChaCha20 streams of the training
noise), so the local and the Beam runner draw identical noise and samples for the same seed,
whatever the order of execution.

Caveat (written in docs/secure-noise.md): ``gaussian_noise`` and ``laplace_noise`` are numpy's floating-point
samplers, not the discrete or snapping mechanisms that defend against floating-point attacks.
``discrete_gaussian`` and ``discrete_laplace`` draw integers from the exact laws (up to ~2^-50 in
total variation) with a ChaCha20 generator from ``secure_generator``, for integer-valued releases.
"""
from __future__ import annotations

import decimal
import functools
import hashlib
import math
import secrets
from typing import NamedTuple

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


def laplace_noise(generator: np.random.Generator, scale: float, size=None):
    """A Laplace draw of ``scale`` (a float), or an array of ``size`` independent ones."""
    if size is None:
        return float(generator.laplace(0.0, scale * NOISE_SCALE_FOR_TESTS))
    return generator.laplace(0.0, scale * NOISE_SCALE_FOR_TESTS, size=size)


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
    a discrete Gaussian costs ~0.03 us per draw (about one ChaCha word: ``_staircase``).
    randomgen's keystream is checked against the ChaCha20 reference vector in the tests.

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


def sampling_seed(seed: int) -> int:
    """The Poisson sampler's seed: a 128-bit key derived from the root seed (a PRF), so that the
    batch job's graph, which holds the sampler, holds nothing else of the run's randomness."""
    return stream_key(seed, STREAM_SAMPLING) >> 128


def step_keys(seed: int, first: int, count: int) -> tuple:
    """(first, the noise keys of steps first .. first + count - 1): what a Beam job's copy of a
    step function holds instead of the root seed (``step_noise_generator``)."""
    return first, tuple(stream_key(seed, STREAM_NOISE, t) for t in range(first, first + count))


def step_noise_generator(seed: int | None, noise_keys: tuple | None, step: int) -> np.random.Generator:
    """The noise generator of training step ``step``: from the root seed on the driver, from the
    job's ``step_keys`` in a job's copy of the step function."""
    if seed is not None:
        return secure_generator(seed, STREAM_NOISE, step)
    first, keys = noise_keys
    if not first <= step < first + len(keys):
        raise ValueError(f"this copy of the step holds no noise key for step {step}")
    return keyed_generator(keys[step - first])


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

    The staircase rejection sampler of ``discrete_gaussian`` with f(k) = exp(-|k| / scale) (the
    body spans 16 scales on each side; the tails beyond are geometric with this very ratio, so
    their acceptance is a constant); the same exactness argument, within ~2^-50 in total
    variation per draw at every scale up to 2**50.
    """
    scale = _check_scale("scale", scale * NOISE_SCALE_FOR_TESTS)
    return _staircase_sample(generator, _staircase("laplace", scale, _LAPLACE_SPAN), size)


def discrete_gaussian(generator: np.random.Generator, sigma: float, size) -> np.ndarray:
    """Integers with P(k) proportional to f(k) = exp(-k^2 / (2 sigma^2)), as int64 of shape
    ``size``.

    Rejection sampling from a staircase proposal (``_staircase`` builds it once per sigma). The
    integers are cut into blocks of w = 2^j consecutive integers (w in (sigma/32, sigma/16]; w = 1
    below sigma = 32): a central block holding 0, 8 sigma worth of blocks on each side, and a
    geometric tail beyond them on each side. A trial takes ONE 64-bit ChaCha20 word and reads
    three disjoint bit fields of it, so three independent uniforms: 16 bits pick a cell of a table
    of 2^16 cells, in which block B owns c_B cells (so B is proposed with the exact dyadic
    probability c_B / 2^16), j bits pick an integer y of the block uniformly, and the remaining
    k = 48 - j bits (k >= 2) are the leading bits of the acceptance uniform. The trial is accepted
    with probability A f(y) / c_B, A a constant of the table, so

        P(y proposed and accepted) = (c_B / 2^16) (1 / w) (A f(y) / c_B) = A f(y) / (2^16 w),

    proportional to f(y) whatever the c_B: the accepted values follow the discrete Gaussian
    exactly. The c_B only need to keep the acceptance at most 1 (c_B > A f at the block's integer
    nearest 0, f decreasing in |y|); chosen just above that, they make ~97% of trials accepted.
    The tail cells propose y = +-(T + G), G geometric, accepted with probability A f(y) / (2^16 w)
    over that proposal's probability, which is again at most 1 (``_staircase``): the law is exact
    on all of Z, not truncated. Zero is in exactly one block, so it needs no correction (a sign
    bit and a magnitude would propose it twice).

    Exactness: the only inexact step is the acceptance test. Its uniform is exact on a grid of
    2^-(k+53): k bits from the trial's word decide the test unless they are the leading bits of
    the acceptance probability itself (probability 2^-k), and only then is a further 53-bit
    uniform drawn (``_staircase_trials``). The probability, exp(log(A / c_B) - (y/sigma)^2 / 2) in
    float64, has a relative error of a few ulps where it matters (the error grows with
    (y/sigma)^2, but the probability shrinks faster), so each draw's law is within total
    variation of order 2^-50 of the exact one, at every sigma up to 2**50. Trials are drawn in
    batches and the first accepted ones kept, in trial order: the accepted values of independent
    trials are independent draws from the law, whatever the pattern of acceptances, and dropping
    the surplus changes nothing. The outputs are integers: nothing released carries
    floating-point low bits, which the attack of Mironov 2012 on floating-point Laplace noise
    reads. The draws depend on the generator's words only: the table is computed in decimal
    arithmetic, the same on every machine; per trial, np.exp may differ between platforms by an
    ulp, which changes a decision with probability ~2^-53 (as with any float acceptance test).

    Cost: ~1.03 ChaCha20 words per draw from sigma 2^32 to 2^40 (k = 20 to 12), 1.10 at 2^48
    (k = 4), 1.29 at 2^50 (k = 2): ~0.027 us per draw in vectors of 10^4, against ~12 words and
    ~0.38 us for the previous sampler (Canonne, Kamath & Steinke 2020, Algorithm 3: a discrete
    Laplace proposal made of two geometric counts, each an exponential and a remainder drawn by
    rejection, then a 53-bit uniform, 76% of proposals accepted).

    Timing side channel: the number of rejection rounds depends on the values drawn; batching a
    whole vector hides individual values only partly, as the total time still leaks a little.
    """
    sigma = _check_scale("sigma", sigma * NOISE_SCALE_FOR_TESTS)
    return _staircase_sample(generator, _staircase("gaussian", sigma, _GAUSSIAN_SPAN), size)


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


# --------------------------------------------------------------------------------------------
# The staircase rejection sampler behind ``discrete_gaussian`` and ``discrete_laplace``

_TABLE_BITS = 16         # a trial's block is picked by the top 16 bits of its word
_GAUSSIAN_SPAN = 8.0     # the body of the Gaussian's staircase: |y| up to 8 sigma (~1e-15 beyond)
_LAPLACE_SPAN = 16.0     # the Laplace's: |y| up to 16 scales (~1e-7 beyond)
_PI = "3.14159265358979323846264338327950288419716939937510"


class _Staircase(NamedTuple):
    """A staircase proposal for f(y) decreasing in |y| (built by ``_staircase``)."""

    law: str                # "gaussian" or "laplace"
    scale: float            # sigma, or the Laplace scale
    width_bits: int         # j: a block holds w = 2^j consecutive integers
    prefix_bits: int        # k = 64 - _TABLE_BITS - j: leading bits of the acceptance uniform
    cells: np.ndarray       # cell (top _TABLE_BITS bits of a word) -> block id
    first: np.ndarray       # block id -> its smallest integer (0 for the ids below)
    log_ratio: np.ndarray   # block id -> log(A / c_B); -inf for the ids below
    body: int               # id of the positive tail; body + 1: negative tail; body + 2: reject
    tail_start: tuple       # (T+, T-): the tails propose T+ + G and -(T- + G)
    tail_scale: tuple       # the scale of each tail's geometric G
    tail_slope: tuple       # T / scale^2 - 1 / s_t >= 0 (Gaussian; 0 for the Laplace)
    tail_log_ratio: tuple   # log of each tail's acceptance at G = 0
    acceptance: float       # P(a trial is accepted): sizes the batches of trials, nothing else


def _log_density(law: str, scale: float, values):
    """log f(y) at float64 ``values``, as a new array: -(y / scale)^2 / 2 or -|y| / scale."""
    if law == "gaussian":
        t = values / scale
        t *= t
        t *= -0.5
        return t
    return np.abs(values) / -scale


@functools.lru_cache(maxsize=64)
def _staircase(law: str, scale: float, span: float) -> _Staircase:
    """The staircase proposal for f(y) = exp(-y^2 / (2 scale^2)) (``law`` "gaussian") or
    exp(-|y| / scale) ("laplace"), its body covering |y| up to ``span`` scales; see
    ``discrete_gaussian`` for how it is sampled and why the law is exact.

    Blocks of w = 2^j integers, j = max(0, floor(log2 scale) - 4), h = floor(w / 2): the central
    block [-h, w - h - 1]; for q = 0 .. n - 1, n = ceil(span scale / w), the positive blocks
    [w - h + q w, w - h + (q + 1) w - 1] and the negative ones [-h - (q + 1) w, -h - q w - 1];
    then the tails, y >= T+ = (n + 1) w - h and y <= -T-, T- = n w + h + 1 (T- = T+ when w = 1).
    Every integer is in exactly one of them. Let e_B = f at block B's integer nearest 0 (f's
    largest value on B) and, for each tail, tau = f(T) / (w (1 - r)), where r = exp(-1 / s_t) is
    the ratio of the tail's geometric G. With A = (2^16 - number of blocks - 2) / (sum of the
    e_B and the tau), block B gets c_B = floor(A e_B) + 1 cells and a tail floor(A tau) + 1, so
    that c_B > A e_B, c_tail > A tau, and the counts fit in the 2^16 cells (the cells left over
    reject outright). A block's acceptance A f(y) / c_B is then below 1.

    A tail proposal y = T + G (or -(T + G)) has probability (c_tail / 2^16) (1 - r) r^G, and is
    accepted with probability A f(y) / (2^16 w) over that (so that it joins the body's
    P(y proposed and accepted) = A f(y) / (2^16 w)): A f(T + G) / (w c_tail (1 - r) r^G).
    Gaussian: s_t = scale^2 / T rounded up to a float (and at least 2^-10), so that
    1 / s_t = T / scale^2 - slope with slope >= 0, and f(T + G) / r^G =
    f(T) exp(-G^2 / (2 scale^2) - slope G) <= f(T). Laplace: s_t = scale, so f(T + G) / r^G =
    f(T). Either way the acceptance is at most A tau / c_tail < 1. G comes from
    ``_geometric_failures`` (within ~2^-50 of its law, for the float s_t it is given, whose r
    the table uses). A tail is proposed with probability ~2^-16 per trial, and accepted with
    the law's mass beyond T.

    Bits: scale <= 2^50 gives j <= 46, so k = 48 - j >= 2 bits for the acceptance's prefix.
    """
    cells_total = 1 << _TABLE_BITS
    j = max(0, math.frexp(scale)[1] - 1 - 4)      # frexp: scale = m 2^e, 1/2 <= m < 1
    w, h = 1 << j, (1 << j) >> 1
    n = math.ceil(span * scale / w)
    q = np.arange(n, dtype=np.int64)
    first = np.concatenate([[-h], w - h + q * w, -h - (q + 1) * w, [0, 0, 0]]).astype(np.int64)
    nearest = [0, *(w - h + i * w for i in range(n)), *(h + 1 + i * w for i in range(n))]
    tail_start = ((n + 1) * w - h, n * w + h + 1)
    blocks = len(nearest)
    # Everything that decides an integer (the cell counts) or the batch sizes is computed in
    # 40-digit decimal arithmetic (software, correctly rounded), not with the platform's exp and
    # log: the table, hence the draws for a seed, are the same on every machine.
    with decimal.localcontext(decimal.Context(prec=40, Emin=decimal.MIN_EMIN,
                                              Emax=decimal.MAX_EMAX)):
        s = decimal.Decimal(scale)

        def log_f(y: int) -> decimal.Decimal:
            return -(decimal.Decimal(y) ** 2) / (2 * s * s) if law == "gaussian" else -y / s

        tail_scale, tail_slope, log_tau = [], [], []
        for t in tail_start:
            if law == "gaussian":     # s_t >= scale^2 / T: slope >= 0
                tail_s = max(scale * scale / t, 2.0 ** -10)
                if decimal.Decimal(tail_s) < s * s / t:
                    tail_s = float(np.nextafter(tail_s, np.inf))
                slope = t / (s * s) - 1 / decimal.Decimal(tail_s)
            else:
                tail_s, slope = scale, decimal.Decimal(0)     # f(T + G) / r^G = f(T) exactly
            tail_scale.append(tail_s)
            tail_slope.append(float(slope))
            one_minus_r = 1 - (-1 / decimal.Decimal(tail_s)).exp()
            log_tau.append(log_f(t) - (w * one_minus_r).ln())
        envelope = [log_f(y).exp() for y in nearest] + [lt.exp() for lt in log_tau]
        a = (cells_total - blocks - 2) / sum(envelope)
        counts = [int(a * e) + 1 for e in envelope]        # floor(A e) + 1 > A e
        rejects = cells_total - sum(counts)
        if not 0 <= rejects < cells_total:
            raise AssertionError("the staircase's cell counts do not fit its table")
        log_a = a.ln()
        log_ratio = np.array([float(log_a - decimal.Decimal(c).ln()) for c in counts[:blocks]]
                             + [-math.inf] * 3)
        tail_log_ratio = tuple(float(log_a + lt - decimal.Decimal(c).ln())
                               for lt, c in zip(log_tau, counts[blocks:]))
        # (At scales below ~1e-154 a tail's acceptance underflows to 0 and its slope overflows.)
        tail_slope = [0.0 if lr == -math.inf else sl for lr, sl in zip(tail_log_ratio, tail_slope)]
        # P(a trial is accepted) = A Z / (2^16 w), Z the sum of f over the integers: the batch
        # sizes only.
        if law == "laplace":
            r = (-1 / s).exp()
            z = (1 + r) / (1 - r)
        elif scale >= 4.0:
            z = s * (2 * decimal.Decimal(_PI)).sqrt()      # to within exp(-2 pi^2 scale^2)
        else:
            z = sum(log_f(k).exp() for k in range(-60, 61))
        acceptance = min(1.0, max(0.01, float(a * z / (cells_total * w))))
    cells = np.repeat(np.arange(blocks + 3, dtype=np.uint16), counts + [rejects])
    for array in (cells, first, log_ratio):
        array.flags.writeable = False
    return _Staircase(law, scale, j, 64 - _TABLE_BITS - j, cells, first, log_ratio, blocks,
                      tail_start, tuple(tail_scale), tuple(tail_slope), tail_log_ratio, acceptance)


def _staircase_trials(generator: np.random.Generator, st: _Staircase, count: int):
    """``count`` trials of the staircase ``st``: the proposed integers (int64) and whether each
    is accepted (bool). One word per trial: its top 16 bits pick a cell, hence a block; its low
    j bits the integer within the block; the k bits between them are the leading bits of the
    acceptance uniform U = (prefix + V) / 2^k, V a 53-bit uniform drawn only when the prefix does
    not decide U < p (prefix < 2^k p < prefix + 1: probability 2^-k). The tail proposals (~2^-16
    of the trials) draw their geometric and their acceptance uniform afresh."""
    j, k = st.width_bits, st.prefix_bits
    words = generator.bit_generator.random_raw(count)
    block = np.take(st.cells, words >> (64 - _TABLE_BITS))
    bits = words.view(np.int64)        # j + k <= 48: the fields below come out nonnegative
    values = np.take(st.first, block)
    values += bits & ((1 << j) - 1)
    prefix = ((bits >> j) & ((1 << k) - 1)).astype(np.float64)
    threshold = _log_density(st.law, st.scale, values.astype(np.float64))
    threshold += np.take(st.log_ratio, block)
    np.exp(threshold, out=threshold)
    threshold *= 2.0 ** k               # exact: 2^k times the acceptance probability
    accepted = prefix + 1.0 <= threshold            # U < (prefix + 1) / 2^k <= p
    undecided = np.flatnonzero((prefix < threshold) ^ accepted)
    if undecided.size:                  # threshold - prefix in (0, 1): exact (Sterbenz)
        accepted[undecided] = (generator.random(undecided.size)
                               < threshold[undecided] - prefix[undecided])
    special = np.flatnonzero(block >= st.body)
    for side, sign in ((0, 1), (1, -1)):
        tail = special[block[special] == st.body + side]
        if tail.size:
            g = _geometric_failures(generator, st.tail_scale[side], tail.size)
            values[tail] = sign * (st.tail_start[side] + g)
            log_p = np.full(tail.size, st.tail_log_ratio[side])
            if st.law == "gaussian":     # - G^2 / (2 sigma^2) - slope G
                log_p += _log_density("gaussian", st.scale, g.astype(np.float64))
                log_p -= st.tail_slope[side] * g
            accepted[tail] = generator.random(tail.size) < np.exp(log_p)
    return values, accepted


def _staircase_sample(generator: np.random.Generator, st: _Staircase, size) -> np.ndarray:
    """An int64 array of shape ``size`` from the staircase ``st``: batches of trials, sized to
    be accepted often enough in one go (the mean plus three standard deviations), each batch
    contributing its accepted values in trial order until the array is full."""
    shape = _shape(size)
    total = math.prod(shape)
    out = np.empty(total, dtype=np.int64)
    filled = 0
    while filled < total:
        need = total - filled
        values, accepted = _staircase_trials(
            generator, st, math.ceil((need + 3.0 * math.sqrt(need * (1.0 - st.acceptance)) + 1.0)
                                    / st.acceptance))
        got = values[accepted][:need]
        out[filled:filled + got.size] = got
        filled += got.size
    return out.reshape(shape)


def _shape(size) -> tuple:
    return (int(size),) if np.ndim(size) == 0 else tuple(int(n) for n in size)
