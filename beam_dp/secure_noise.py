"""Secure noise: integer noise on exact integer sums, and what it adds to the guarantee.

A secure release draws discrete Gaussian (or discrete Laplace) noise on an exact sum over a
public grid (``beam_dp.clipping``) and is accounted as its float mechanism plus the samplers'
slack (``sampler_delta_bound``, ``secure_delta_bound``); ``secure_noise_note`` and
``secure_release_note`` say why. Where the slack would pass 1e-3 delta, or the grid cannot hold
the noise, the release refuses secure noise (``SecureNoiseUnavailable``) or, where secure was
only the default, falls back to float noise with a note in the report (``float_instead``).
"""
from __future__ import annotations

import math

from beam_dp import accounting, clipping


# The noise's scale in grid units stays within [2^32, 2^48]: from 2^32 the discrete Gaussian is
# within 2^-69 of the rounded Gaussian (``secure_noise_note``); below 2^48 its samples and the
# sums stay exact in int64 and float64.
_SECURE_NOISE_BITS = (32, 48)


class SecureNoiseUnavailable(ValueError):
    """Secure noise cannot keep its guarantee's slack (``sampler_delta_bound``) within 1e-3 delta,
    or its grid cannot hold the noise, at these (public) settings."""

    def __str__(self):
        return super().__str__() + "; use --noise float"


# Said in the report when the default noise had to be the float one (``float_instead``).
FLOAT_FALLBACK_NOTE = ("secure noise is the default, but it could not be used at these settings "
                       "({why}): these releases add numpy's float noise instead (--noise float "
                       "says so up front; --noise secure refuses such a run)")


def float_instead(requested: str | None, why: SecureNoiseUnavailable, ledger) -> str:
    """"float" where secure noise was the default (``requested`` None) and cannot be used,
    with a note in the report; with an explicit --noise secure, the refusal stands."""
    if requested == "secure":
        raise why
    note = FLOAT_FALLBACK_NOTE.format(why=ValueError.__str__(why))
    if note not in ledger.notes:
        ledger.notes.append(note)
    return "float"


def secure_scale_bits(noise_multiplier: float) -> int:
    """The exact grid's ``scale_bits`` for a noise multiplier; ValueError where none keeps the
    noise in grid units within _SECURE_NOISE_BITS."""
    low, high = _SECURE_NOISE_BITS
    room = high - (clipping.GRID_FEATURE_BITS - 1) - math.ceil(math.log2(max(noise_multiplier, 1e-300)))
    bits = min(clipping.GRID_SCALE_BITS, room)
    if bits < 1 or noise_multiplier * 2.0 ** (clipping.GRID_FEATURE_BITS - 1 + bits) < 2.0 ** low:
        raise SecureNoiseUnavailable(f"noise multiplier {noise_multiplier:.3g} is outside what "
                                     "the secure noise handles (about 2^-7 to 2^28)")
    return bits


def noise_description(noise: str, noise_multiplier: float) -> str:
    """How a step's noise is drawn, for the report; ``secure_noise_note`` says why the Gaussian
    events account for the secure kind."""
    if noise == "secure":
        bits = clipping.GRID_FEATURE_BITS - 1 + secure_scale_bits(noise_multiplier)
        return (f"discrete Gaussian on exact integer sums (grid 2^-{bits} of the clip norm; "
                "ChaCha20 randomness; accounted as the Gaussian plus sampler_delta_bound)")
    return "float Gaussian (numpy) on float sums"


def secure_noise_note() -> str:
    """Why a secure step is accounted as the Gaussian mechanism, plus ``sampler_delta_bound``.

    A step releases S + Z: S the exact integer sum of the per-example contributions (each an
    integer vector of L2 norm at most Delta = C / grid, ``beam_dp.clipping``), Z a vector of
    draws of ``mechanisms.discrete_gaussian`` at scale s = sigma Delta >= 2^32 per coordinate.
    Compare with S + round(N(0, s^2 I)) = round(S + N(0, s^2 I)): a post-processing of the
    Gaussian mechanism of noise multiplier sigma, so its GaussianDpEvent (PoissonSampledDpEvent
    under Poisson sampling, whose randomness is the same in both) gives its (epsilon, delta), by
    either accountant. Each draw's law is within total variation tau of round(N(0, s^2)): the
    exact discrete Gaussian is within 1/(48 s^2) of it (each unit interval's mass against the
    density at its centre: Taylor's remainder), and the sampler within ~2^-50 of the exact law
    (its floating-point acceptance tests). Total variations add over the T D draws of a run,
    whatever the adaptivity, so for every set of outputs the run's probabilities move by at most
    T D tau from the Gaussian's (plus 2^-50 for the count's discrete Laplace draw): the
    guarantee holds with delta + (1 + e^eps) (T D tau + 2^-50)
    (``sampler_delta_bound``, in the report). A run refuses secure noise where that passes
    1e-3 delta (large epsilon, or very many coordinates and steps). Not claimed: that the
    discrete Gaussian is dominated by the Gaussian's PLD or (under subsampling) its RDP curve."""
    return " ".join(secure_noise_note.__doc__.split())


# The samplers' distance to their exact laws per draw (``mechanisms.discrete_gaussian``).
_SAMPLER_TV = 2.0 ** -50


def sampler_delta_bound(noise_multiplier: float, coordinates: int, steps: int,
                        epsilon: float, prior_variation: float = 0.0) -> float:
    """(1 + e^eps) (T D tau + tau_count + prior): what the secure noise can add to the Gaussian's
    delta (``secure_noise_note``), the count's one discrete Laplace draw (accounted as pure DP)
    included, as if there were one, and ``prior_variation``, the total variation of secure
    releases made before the steps (``sampler_total_variation`` of e.g. DPSGD-F's private mean)."""
    s = noise_multiplier * 2.0 ** (clipping.GRID_FEATURE_BITS - 1 + secure_scale_bits(noise_multiplier))
    tau = 1.0 / (48.0 * s * s) + _SAMPLER_TV
    return (1.0 + math.exp(min(epsilon, 700.0))) * (steps * coordinates * tau + _SAMPLER_TV
                                                     + prior_variation)


def draws_total_variation(draws) -> float:
    """The total variation between the discrete Gaussian draws ``draws`` ((count, scale in grid
    units) pairs, every scale at least 2^32 here) of ``mechanisms.discrete_gaussian`` and the
    rounded Gaussians of the same scales: per draw 1/(48 s^2) + 2^-50 (``secure_noise_note``)."""
    total = 0.0
    for count, scale in draws:
        if count:
            total += count * (1.0 / (48.0 * float(scale) ** 2) + _SAMPLER_TV)
    return total


def secure_delta_bound(variation: float, epsilon: float) -> float:
    """(1 + e^eps) (variation + tau_count): what the secure noise of a run whose draws are within
    total variation ``variation`` of the rounded Gaussians can add to delta, the dataset-size
    count's discrete Laplace draw included as if there were one (``secure_release_note``)."""
    return (1.0 + math.exp(min(epsilon, 700.0))) * (variation + _SAMPLER_TV)


def prior_total_variation(ledger: accounting.Ledger) -> float:
    """The ``sampler_total_variation`` of the secure releases in the ledger so far."""
    return sum(float(r.params.get("sampler_total_variation", 0.0)) * r.count
               for r in ledger.releases)


def secure_release_note() -> str:
    """Why a secure release other than a gradient step (SSP's statistics, DP-AMBSSGD's counts
    and sums, the private means and counts of ``beam_dp.stats``) is accounted as its float
    mechanism.

    Gaussian releases: the release is S + Z, S an integer vector that is a function of the data
    (an exact sum of per-example integer vectors on a public power-of-two grid, or an exact
    integer function of such a sum, e.g. ceil(lambda_min) - 1 of an integer Gram matrix, found
    by exact rational arithmetic), whose L2 sensitivity in grid units is at most Delta *after*
    the rounding to the grid (each entry moves by 1/2 at most, and every rounded row is
    certified against that bound), and Z discrete Gaussian draws at scale s = sigma Delta >=
    2^32 per coordinate. S + round(N(0, s^2 I)) = round(S + N(0, s^2 I)) is a post-processing of
    the Gaussian mechanism of multiplier sigma, so its GaussianDpEvent accounts for it, and each
    draw is within total variation 1/(48 s^2) + 2^-50 of round(N(0, s^2)); over every draw of
    the run the probabilities of any set of outputs move by at most the sum (whatever the
    adaptivity), so the guarantee holds with delta + (1 + e^eps) x (that sum + 2^-50 for the
    count's discrete Laplace draw): ``sampler_delta_bound`` in the report (each release's total
    variation is its ``sampler_total_variation``). A run refuses secure noise where that passes
    1e-3 delta. Counts (sensitivity 1) are put on the grid 2^-k with 2^k >= 2^32 / sigma before
    the noise, as a discrete Gaussian of scale sigma itself (tens) would be ~1e-4 in total
    variation from the rounded Gaussian, and dp_accounting's Gaussian PLD is not proven to
    bound the discrete Gaussian's own. Pure-DP releases: a discrete Laplace count of scale
    1/eps is eps-DP exactly (PureDpEvent); the exponential mechanism is sampled exactly (rational
    utilities, exact Bernoulli(exp(-x)) coins on ChaCha20 bits), so it is eps-DP as accounted."""
    return " ".join(secure_release_note.__doc__.split())
