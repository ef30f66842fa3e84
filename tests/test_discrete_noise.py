"""The exact-law integer noise samplers and the ChaCha20 generator behind them.

Goodness of fit is checked by chi-square against the exact probability mass functions (seeded,
so each test either always passes or never does), against OpenDP's exact samplers (two-sample,
unseeded on OpenDP's side, so with a looser threshold), and for power against wrong laws.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from scipy import stats

from beam_dp import mechanisms

SEED = 20240611
SAMPLES = 200_000


def discrete_gaussian_pmf(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Support and probabilities, normalized over |k| <= 12 sigma + 10 (the rest is < 1e-31)."""
    support = np.arange(-math.ceil(12 * sigma + 10), math.ceil(12 * sigma + 10) + 1)
    weights = np.exp(-(support.astype(float) ** 2) / (2 * sigma * sigma))
    return support, weights / weights.sum()


def discrete_laplace_pmf(scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Support |k| <= 60 scale + 10 (the rest is < 1e-26) and the closed-form probabilities."""
    support = np.arange(-math.ceil(60 * scale + 10), math.ceil(60 * scale + 10) + 1)
    q = math.exp(-1 / scale)
    return support, (1 - q) / (1 + q) * np.exp(-np.abs(support) / scale)


def merged_bins(support: np.ndarray, samples, weights: np.ndarray, minimum: float):
    """Counts of ``samples`` per integer of ``support`` (outliers into the end bins), with the
    tails merged into the outermost bins whose ``weights`` reach ``minimum`` (unimodal laws);
    returns the counts and the merged weights."""
    counts = np.bincount(np.clip(samples, support[0], support[-1]) - support[0],
                         minlength=support.size)
    (central,) = np.nonzero(weights >= minimum)
    low, high = central[0], central[-1]

    def merge(values):
        return np.concatenate([[values[:low + 1].sum()], values[low + 1:high],
                               [values[high:].sum()]])

    return merge(counts), merge(weights)


def chi_square_p(samples, support, pmf) -> float:
    observed, expected = merged_bins(support, np.asarray(samples), len(samples) * pmf, 5.0)
    assert observed.size >= 3, "too few bins for a meaningful test"
    return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def two_sample_p(first, second) -> float:
    """Chi-square test that two integer samples of equal size come from the same law."""
    first, second = np.asarray(first, dtype=np.int64), np.asarray(second, dtype=np.int64)
    support = np.arange(min(first.min(), second.min()), max(first.max(), second.max()) + 1)
    pooled = np.bincount(np.concatenate([first, second]) - support[0], minlength=support.size)
    first_counts, _ = merged_bins(support, first, pooled.astype(float), 10.0)
    second_counts, _ = merged_bins(support, second, pooled.astype(float), 10.0)
    table = np.stack([first_counts, second_counts])
    # A bin inside the central range that neither sample reached (a tail's gap: opendp's draws
    # are unseeded) holds no information; scipy refuses its zero expected count, so it goes.
    return stats.chi2_contingency(table[:, table.sum(axis=0) > 0]).pvalue


# --------------------------------------------------------------------------------------------
# Goodness of fit against the exact laws


@pytest.mark.parametrize("sigma", [0.5, 1, 3, 10, 100])
def test_discrete_gaussian_fits_exact_pmf(sigma):
    generator = mechanisms.secure_generator(SEED, 1, int(sigma * 10))
    samples = mechanisms.discrete_gaussian(generator, sigma, SAMPLES)
    assert chi_square_p(samples, *discrete_gaussian_pmf(sigma)) > 1e-3


@pytest.mark.parametrize("scale", [0.5, 1, 5, 50])
def test_discrete_laplace_fits_exact_pmf(scale):
    generator = mechanisms.secure_generator(SEED, 2, int(scale * 10))
    samples = mechanisms.discrete_laplace(generator, scale, SAMPLES)
    assert chi_square_p(samples, *discrete_laplace_pmf(scale)) > 1e-3


def test_secure_root_seed_path_fits():
    """Production path: an unpredictable root seed, so a looser threshold."""
    generator = mechanisms.secure_generator(mechanisms.secure_seed(), mechanisms.STREAM_NOISE, 0)
    assert chi_square_p(mechanisms.discrete_gaussian(generator, 3.0, SAMPLES),
                        *discrete_gaussian_pmf(3.0)) > 1e-4
    assert chi_square_p(mechanisms.discrete_laplace(generator, 5.0, SAMPLES),
                        *discrete_laplace_pmf(5.0)) > 1e-4


def test_large_scales_have_the_right_spread():
    """sigma up to 1e12 and 2**50: exact int64 values, standard deviation within 1%."""
    generator = mechanisms.secure_generator(SEED, 3)
    for sigma in [1e6, 1e12, 2.0 ** 50]:
        gaussian = mechanisms.discrete_gaussian(generator, sigma, 50_000)
        laplace = mechanisms.discrete_laplace(generator, sigma, 50_000)
        assert gaussian.dtype == laplace.dtype == np.int64
        assert gaussian.std() / sigma == pytest.approx(1.0, rel=0.01)
        assert laplace.std() / (math.sqrt(2) * sigma) == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("wrong_law", ["rounded continuous Gaussian", "proposal, no acceptance"])
def test_chi_square_detects_a_wrong_law(wrong_law):
    """The goodness-of-fit test has power: near misses of the discrete Gaussian fail it."""
    generator = mechanisms.secure_generator(SEED, 4)
    if wrong_law == "rounded continuous Gaussian":
        samples = np.rint(generator.normal(0.0, 1.0, SAMPLES)).astype(np.int64)
    else:
        # (Canonne, Kamath & Steinke's proposal at sigma = 1: t = floor(1) + 1)
        samples = mechanisms.discrete_laplace(generator, 2.0, SAMPLES)
    assert chi_square_p(samples, *discrete_gaussian_pmf(1.0)) < 1e-6


# --------------------------------------------------------------------------------------------
# The staircase sampler's building blocks (``mechanisms._staircase``)

STAIRCASE_SCALES = [1e-6, 0.3, 1.0, 2.5, 31.9, 32.0, 33.0, 1000.0, 2.0 ** 32 + 12345.5,
                    2.0 ** 39, 1.7 * 2.0 ** 47, 2.0 ** 50]


@pytest.mark.parametrize("law", ["gaussian", "laplace"])
@pytest.mark.parametrize("scale", STAIRCASE_SCALES)
def test_staircase_tables_are_sound(law, scale):
    """At every scale from tiny to 2**50: the word's three fields fit in 64 bits, the blocks
    and tails hold every integer exactly once, the cells number 2^16, and no acceptance
    probability exceeds 1 (body: at each block's point nearest 0, where f is largest; tails:
    at G = 0)."""
    span = mechanisms._GAUSSIAN_SPAN if law == "gaussian" else mechanisms._LAPLACE_SPAN
    st = mechanisms._staircase(law, scale, span)
    j, k = st.width_bits, st.prefix_bits
    assert mechanisms._TABLE_BITS + j + k == 64 and k >= 2
    assert st.cells.size == 2 ** mechanisms._TABLE_BITS and st.cells.max() <= st.body + 2
    assert np.bincount(st.cells, minlength=st.body + 3)[:st.body + 2].min() >= 1
    w = 2 ** j
    lows = np.sort(st.first[:st.body])
    np.testing.assert_array_equal(np.diff(lows), w)       # contiguous blocks of w integers
    t_pos, t_neg = st.tail_start
    assert lows[0] == -t_neg + 1 and lows[-1] + w == t_pos
    nearest = np.minimum(np.abs(st.first[:st.body]), np.abs(st.first[:st.body] + w - 1))
    nearest[(st.first[:st.body] <= 0) & (st.first[:st.body] + w - 1 >= 0)] = 0
    log_f = mechanisms._log_density(law, scale, nearest.astype(float))
    assert np.all(st.log_ratio[:st.body] + log_f < 0)
    assert max(st.tail_log_ratio) < 0
    # The acceptance estimate that sizes the batches: P(accept) = A Z / (2^16 w).
    assert 0.9 < st.acceptance <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("law,scale,span", [
    ("gaussian", 1.5, 0.1), ("gaussian", 3.0, 0.5), ("gaussian", 40.0, 0.5),
    ("gaussian", 100.0, 1.0), ("gaussian", 40.0, 0.0), ("laplace", 0.5, 0.1),
    ("laplace", 5.0, 0.5), ("laplace", 40.0, 0.5), ("laplace", 100.0, 1.0), ("laplace", 5.0, 0.0)])
def test_staircase_tails_fit_exact_pmf(law, scale, span):
    """A body that ends within a scale or two of 0 (or at the central block: span 0) sends a
    good share of the draws through the geometric tails (both signs, unequal starts when the
    blocks are wider than 1): the law must still be exact."""
    st = mechanisms._staircase(law, scale, span)
    generator = mechanisms.secure_generator(SEED, 8, int(scale * 10), int(span * 10))
    samples = mechanisms._staircase_sample(generator, st, SAMPLES)
    t_pos, t_neg = st.tail_start
    assert np.sum(samples >= t_pos) > 1000 and np.sum(samples <= -t_neg) > 1000
    pmf = discrete_gaussian_pmf(scale) if law == "gaussian" else discrete_laplace_pmf(scale)
    assert chi_square_p(samples, *pmf) > 1e-3


# Scales of the training noise (2^32-2^48 grid units) and the largest allowed. There the
# discrete Gaussian's mass on [a, b) is the normal's to within ~1/sigma, and its residues modulo
# small numbers are uniform to within exp(-2 pi^2 sigma^2 / m^2): any visible departure is the
# sampler's.
LARGE_SIGMAS = [2.0 ** 32 + 12345.5, 2.0 ** 39, 1.7 * 2.0 ** 47, 2.0 ** 50]


@pytest.mark.parametrize("law", ["gaussian", "laplace"])
@pytest.mark.parametrize("sigma", LARGE_SIGMAS)
def test_large_scales_fit_the_continuous_law_in_bins(law, sigma):
    """64 bins of a scale / 8 over +-4 scales and two tail bins, against the normal (the
    Laplace) law, which the discrete one matches there to within ~1/scale per bin. At 2**50 the
    acceptance prefix has 2 bits, so a quarter of the trials need the further 53-bit uniform: a
    wrong decision in that case would show here."""
    generator = mechanisms.secure_generator(SEED, 9, int(math.log2(sigma) * 10), law == "laplace")
    sampler = mechanisms.discrete_gaussian if law == "gaussian" else mechanisms.discrete_laplace
    samples = sampler(generator, sigma, SAMPLES)
    edges = np.concatenate([[-np.inf], np.linspace(-4, 4, 65), [np.inf]])
    observed = np.histogram(samples / sigma, edges)[0]
    expected = SAMPLES * np.diff((stats.norm if law == "gaussian" else stats.laplace).cdf(edges))
    assert stats.chisquare(observed, expected * SAMPLES / expected.sum()).pvalue > 1e-3


@pytest.mark.parametrize("sigma", LARGE_SIGMAS)
def test_large_sigma_residues_are_uniform(sigma):
    """Parity and residues: y mod 8 and mod 3, and bits j - 3 .. j - 1 of y, blocks holding
    2^j integers (in the trial's word, the bits just below the acceptance prefix)."""
    generator = mechanisms.secure_generator(SEED, 10, int(math.log2(sigma) * 10))
    samples = mechanisms.discrete_gaussian(generator, sigma, SAMPLES)
    j = mechanisms._staircase("gaussian", sigma, mechanisms._GAUSSIAN_SPAN).width_bits
    for residues, m in [(samples % 8, 8), (samples % 3, 3), ((samples >> (j - 3)) % 8, 8)]:
        assert stats.chisquare(np.bincount(residues, minlength=m)).pvalue > 1e-3
    assert abs(np.mean(samples % 2) - 0.5) < 5 * 0.5 / math.sqrt(SAMPLES)


def test_discrete_gaussian_uses_about_one_word_per_draw():
    """The cost that matters at d = 10^4: ChaCha20 words (the counter counts 32-bit halves).
    ~1.03 per draw at 2^39 (a 3% rejection rate, k = 13 prefix bits); the previous sampler
    used ~12."""
    generator = mechanisms.secure_generator(SEED, 11)
    start = int(generator.bit_generator.state["state"]["ctr"][0])
    mechanisms.discrete_gaussian(generator, 2.0 ** 39, 100_000)
    words = (int(generator.bit_generator.state["state"]["ctr"][0]) - start) / 2
    assert words / 100_000 < 1.1


# --------------------------------------------------------------------------------------------
# Against OpenDP's exact samplers


def opendp_samples(kind: str, scale: float, count: int) -> np.ndarray:
    dp = pytest.importorskip("opendp.prelude")
    dp.enable_features("contrib")
    domain = dp.vector_domain(dp.atom_domain(T=int))
    if kind == "gaussian":
        measurement = dp.m.make_gaussian(domain, dp.l2_distance(T=int), scale=scale)
    else:
        measurement = dp.m.make_laplace(domain, dp.l1_distance(T=int), scale=scale)
    return np.asarray(measurement([0] * count), dtype=np.int64)


@pytest.mark.parametrize("kind,scale", [("gaussian", 2.0), ("gaussian", 20.0),
                                        ("laplace", 2.0), ("laplace", 20.0)])
def test_same_law_as_opendp(kind, scale):
    count = 20_000
    generator = mechanisms.secure_generator(SEED, 5, int(scale))
    sampler = mechanisms.discrete_gaussian if kind == "gaussian" else mechanisms.discrete_laplace
    assert two_sample_p(sampler(generator, scale, count), opendp_samples(kind, scale, count)) > 1e-4


# --------------------------------------------------------------------------------------------
# The generator


def test_randomgen_chacha_is_chacha20():
    """Known answer: the ChaCha20 keystream for the all-zero key and nonce (Bernstein's
    reference; also the first test vector of draft-agl-tls-chacha20poly1305)."""
    from randomgen import ChaCha

    keystream = ChaCha(key=0, rounds=20).random_raw(8).astype("<u8").tobytes()
    assert keystream.hex() == (
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")


def test_stream_key_is_keyed_blake2b_of_the_stream_ids():
    seed = 2 ** 127 + 12345
    digest = hashlib.blake2b((7).to_bytes(8, "little") + (3).to_bytes(8, "little"),
                             key=seed.to_bytes(16, "little"), digest_size=32).digest()
    state = mechanisms.secure_generator(seed, 7, 3).bit_generator.state["state"]
    assert state["keysetup"].astype("<u4").tobytes() == digest
    assert state["rounds"] == 20


def test_secure_generator_streams():
    def uniforms(seed, *stream):
        return mechanisms.secure_generator(seed, *stream).random(100_000)

    base = uniforms(SEED, mechanisms.STREAM_NOISE, 0)
    np.testing.assert_array_equal(base, uniforms(SEED, mechanisms.STREAM_NOISE, 0))
    for other in [uniforms(SEED, mechanisms.STREAM_NOISE, 1),
                  uniforms(SEED, mechanisms.STREAM_SAMPLING, 0),
                  uniforms(SEED, mechanisms.STREAM_NOISE),
                  uniforms(SEED + 1, mechanisms.STREAM_NOISE, 0)]:
        assert not np.array_equal(base[:8], other[:8])
        assert abs(np.corrcoef(base, other)[0, 1]) < 0.02


def test_secure_generator_rejects_bad_seeds_and_streams():
    for seed in [-1, 2 ** 128]:
        with pytest.raises(ValueError, match="root seed"):
            mechanisms.secure_generator(seed, 1)
    for stream in [-1, 2 ** 64]:
        with pytest.raises(ValueError, match="stream ids"):
            mechanisms.secure_generator(1, stream)


# --------------------------------------------------------------------------------------------
# Shapes, types and bad scales


@pytest.mark.parametrize("sampler", [mechanisms.discrete_gaussian, mechanisms.discrete_laplace])
def test_shapes_types_and_determinism(sampler):
    for size, shape in [(5, (5,)), ((3, 4), (3, 4)), (0, (0,)), ((), ())]:
        out = sampler(mechanisms.secure_generator(SEED, 6), 2.5, size)
        assert out.dtype == np.int64 and out.shape == shape
    first = sampler(mechanisms.secure_generator(SEED, 6), 2.5, 1000)
    np.testing.assert_array_equal(first, sampler(mechanisms.secure_generator(SEED, 6), 2.5, 1000))


@pytest.mark.parametrize("sampler", [mechanisms.discrete_gaussian, mechanisms.discrete_laplace])
@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, -math.inf, 2.0 ** 51])
def test_bad_scales_raise(sampler, scale):
    with pytest.raises(ValueError, match="finite, positive and at most 2\\*\\*50"):
        sampler(mechanisms.secure_generator(SEED, 7), scale, 3)
