"""Private statistics on blocks: counts, clipped means, exponential-mechanism quantiles.

Each statistic is a *stage*: ``partial_sum(block, state)`` is the exact sum over one block (an
array of the fixed ``shape``), ``apply(state, total)`` adds the noise and writes the release into
the state (a dict of public values), and ``releases()`` names its DpEvents for the ledger. Stages
run through the same Aggregator seam as training steps (in-process, or as one fused Beam stage
each: ``beam_dp.beam.transforms.RunStages``), so a statistic computed on either runner is the
same for the same seed (to float rounding: sums are added in another order).

Categorical columns (``beam-dp stats --categorical-columns``): ``categorical_frequency_stages``,
the frequencies of their values or hash buckets by the projection mechanism (paper 001,
Algorithm 1: ``SparseMeanStage``), under replace-one; see ``stats.sparse``.

Why not pipeline-dp's MEAN / PERCENTILE / VECTOR_SUM: its noise comes from PyDP's C++ samplers,
which cannot be seeded, so the same-seed-same-result contract between runners and the seeded
statistical tests could not hold; its PERCENTILE (a quantile tree) has no simple rank-error
guarantee; and its budget accountant is separate from this project's dp_accounting ledger. The
mechanisms here are a few lines each on top of numpy and dp_accounting.

Secure noise (``noise="secure"`` on a stage; ``beam-dp stats --noise secure``, DPSGD-F's
preprocessing with ``--noise secure``): the count gets discrete Laplace noise (pure DP, as the
training count); the clipped and box means are exact integer sums of the clipped rows on a public
power-of-two grid (``mean_grid``: the noise's scale in grid units in [2^36, 2^37), every rounded
row certified to norm at most the clip radius plus the rounding, ``clipping.grid_rows``) plus
discrete Gaussian noise scaled to that enlarged sensitivity; the exponential-mechanism quantiles
are sampled exactly (``exact_exponential_mechanism``: utilities as exact rationals, a uniform
candidate accepted with an exact Bernoulli(exp(-gamma)) coin, Canonne, Kamath & Steinke 2020,
Algorithms 1-2), all from ChaCha20 streams. ``secure_noise.secure_release_note`` has the accounting.

One concept per module, from the bottom up (each imports only those above it):

* ``primitives``: the mechanisms on numpy arrays (exponential-mechanism quantiles, float and
  exact; the Gaussian's multiplier) and the public grids;
* ``values``: what a statistic is computed on, per example (columns, norms, distances);
* ``stages``: the stages themselves (count, quantiles, means, second moments, packed stages);
* ``composite``: the adaptive mean and ``beam-dp stats``'s dataset summary and its report;
* ``sparse``: CSR blocks: the sparse mean (paper 001, Algorithm 1), categorical counts and
  frequencies.

Why a package whose ``__init__`` names the public API: the algorithms, the quality check, the
Beam transforms, the CLI and the pipelines read these names as ``stats.X``, one obvious place,
whichever module defines them. Private helpers (``_rng``, ``_secure_noisy_sum``, ...) are read
from their submodule (``stats.stages._rng``).
"""
from beam_dp.stats.composite import (SUMMARY_FAILURE, WIDE_RANGE_SPAN, FixedGrid,
                                     adaptive_mean_stages, check_declared_ranges,
                                     dataset_summary_stages, summary, symmetric_log_grid)
from beam_dp.stats.primitives import (bernoulli_exp, exact_exponential_mechanism,
                                      exact_quantile_utility, exponential_mechanism_quantile,
                                      gaussian_noise_multiplier, histogram, log_grid,
                                      quantile_rank_error_bound, quantile_utility, uniform_grid)
from beam_dp.stats.sparse import (SPARSE_COUNT_SHARE, SPARSE_FAILURE, SPARSE_MEAN_VARIANTS,
                                  SPARSE_NOTES, SPARSE_PRIVACY, ColumnBlockHashing,
                                  ColumnCountStage, ReplaceOneCountStage, SparseMeanStage,
                                  categorical_frequency_stages, categorical_summary,
                                  clip_sparse_rows, frequency_encoding, frequency_layout,
                                  sparse_clipped_sum, sparse_mean_bound, sparse_mean_noise_scale,
                                  sparse_mean_release)
from beam_dp.stats.stages import (SECURE_MEAN_NOISE, SECURE_MOMENT_NOISE, SECURE_QUANTILE_NOISE,
                                  BoxMeanStage, ClippedMeanStage, CountStage, ImputeMeanStage,
                                  PackedStages, QuantileStage, SecondMomentStage, mean_grid,
                                  mean_sampler_variation, record_releases,
                                  secure_moment_variation, stages_seed)
from beam_dp.stats.values import Columns, DistancesTo, Norms, Selected, Transformed

__all__ = [
    "bernoulli_exp", "exact_exponential_mechanism", "exact_quantile_utility",
    "exponential_mechanism_quantile", "gaussian_noise_multiplier", "histogram", "log_grid",
    "quantile_rank_error_bound", "quantile_utility", "uniform_grid",
    "Columns", "DistancesTo", "Norms", "Selected", "Transformed",
    "SECURE_MEAN_NOISE", "SECURE_MOMENT_NOISE", "SECURE_QUANTILE_NOISE", "BoxMeanStage",
    "ClippedMeanStage", "CountStage", "ImputeMeanStage", "PackedStages", "QuantileStage",
    "SecondMomentStage", "mean_grid", "mean_sampler_variation", "record_releases",
    "secure_moment_variation", "stages_seed",
    "SUMMARY_FAILURE", "WIDE_RANGE_SPAN", "FixedGrid", "adaptive_mean_stages",
    "check_declared_ranges", "dataset_summary_stages", "summary", "symmetric_log_grid",
    "SPARSE_COUNT_SHARE", "SPARSE_FAILURE", "SPARSE_MEAN_VARIANTS", "SPARSE_NOTES",
    "SPARSE_PRIVACY", "ColumnBlockHashing", "ColumnCountStage", "ReplaceOneCountStage",
    "SparseMeanStage", "categorical_frequency_stages", "categorical_summary", "clip_sparse_rows",
    "frequency_encoding", "frequency_layout", "sparse_clipped_sum", "sparse_mean_bound",
    "sparse_mean_noise_scale", "sparse_mean_release",
]
