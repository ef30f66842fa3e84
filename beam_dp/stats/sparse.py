"""Statistics of sparse (CSR) blocks: the projection mechanism for the mean of sparse vectors
(paper 001, Algorithm 1), Gaussian counts of categorical columns, and the categorical
frequencies of ``beam-dp stats --categorical-columns`` (Algorithm 1 as a stage)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting, categorical, mechanisms, user_level
from beam_dp.stats.stages import CountStage, PackedStages, _flat_stages, _rng


# ----------------------------------------------------------------- sparse mean (paper 001, Alg. 1)
#
# The projection mechanism for the mean of sparse vectors (Ghazi, Guzman, Kamath, Kumar &
# Manurangsi 2024, Algorithm 1; the note /work/shared/papers/001, §1A): noise on the mean, then the
# Euclidean projection onto the l1 ball of radius L sqrt(s), which holds every s-sparse vector of
# l2 norm <= L. Replace-one neighbours (the paper's), n public. The rows stay sparse (scipy CSR):
# a block's contribution is one sparse sum, O(nnz + d); only the d-vector of the total is dense.
#
# * "gaussian": rows clipped to l2 norm L, so one replacement moves the mean by <= 2L / n in l2;
#   the Gaussian noise's multiplier is calibrated by dp_accounting (a GaussianDpEvent under
#   replace-one, unit L / n). Its privacy does not depend on s: s only sets the projection's
#   radius, a post-processing (a wrong s costs accuracy, never privacy).
# * "laplace": rows clipped to l1 norm L sqrt(s) (which the privacy needs: enforced, not assumed),
#   so a replacement moves the mean by <= 2 L sqrt(s) / n in l1; Laplace noise of scale that over
#   epsilon per coordinate: pure epsilon-DP (a PureDpEvent).
#
# Lemma 3.1 (almost surely): ||release - mean||_2^2 <= 2 L sqrt(s) ||noise||_inf, since the mean
# lies in the ball (the projection's obtuse angle with y = mean, then Hoelder); so the error grows
# like (s ln d)^(1/4) / sqrt(n eps) where the dense Gaussian's grows like sqrt(d) / (n eps).

SPARSE_MEAN_VARIANTS = ("gaussian", "laplace")


def clip_sparse_rows(rows, norm_order: float, bound: float):
    """The CSR matrix ``rows`` with each row scaled by min(1, bound / ||row||) in l1 or l2, sparse
    throughout (the scale is per stored entry's row). Overflow-safe: the norms come from each
    row's entries divided by its largest |entry|. Returns a new CSR matrix."""
    import scipy.sparse as sp

    rows = sp.csr_matrix(rows, dtype=np.float64, copy=True)
    if rows.nnz == 0:
        return rows
    lengths = np.diff(rows.indptr)
    owner = np.repeat(np.arange(rows.shape[0]), lengths)
    magnitude = np.abs(rows.data)
    largest = np.zeros(rows.shape[0])
    np.maximum.at(largest, owner, magnitude)
    safe = np.where(largest > 0, largest, 1.0)
    scaled = magnitude / safe[owner]
    if norm_order == 1:
        norms = safe * np.bincount(owner, scaled, minlength=rows.shape[0])
    else:
        norms = safe * np.sqrt(np.bincount(owner, scaled * scaled, minlength=rows.shape[0]))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        factor = np.where(norms > bound, bound / np.where(norms > 0, norms, 1.0), 1.0)
    # CLIP_MARGIN: the product of a row with its factor rounds; shrink a hair more so that every
    # clipped row's norm is <= bound as computed in floats.
    factor = np.where(norms > bound, factor * (1.0 - 2.0 ** -40), factor)
    rows.data = rows.data * factor[owner]
    return rows


def sparse_mean_bound(variant: str, lipschitz: float, sparsity: int) -> tuple[float, float]:
    """(the clip's norm order, its bound) for a variant: l2 <= L (gaussian), l1 <= L sqrt(s)
    (laplace)."""
    if variant == "gaussian":
        return 2.0, float(lipschitz)
    if variant == "laplace":
        return 1.0, float(lipschitz) * math.sqrt(sparsity)
    raise ValueError(f"variant must be one of {', '.join(SPARSE_MEAN_VARIANTS)}")


def sparse_clipped_sum(rows, variant: str, lipschitz: float, sparsity: int) -> np.ndarray:
    """The block kernel: the dense sum over the rows of a CSR block, each clipped as the variant
    needs. O(nnz + d)."""
    order, bound = sparse_mean_bound(variant, lipschitz, sparsity)
    clipped = clip_sparse_rows(rows, order, bound)
    return np.asarray(clipped.sum(axis=0), dtype=np.float64).ravel()


def sparse_mean_noise_scale(variant: str, n: int, lipschitz: float, sparsity: int,
                            epsilon: float, delta: float, accountant: str = "pld"):
    """(the noise's scale per coordinate, its DpEvent): gaussian, sigma = multiplier * L / n with
    the multiplier calibrated under replace-one; laplace, b = 2 L sqrt(s) / (n eps)."""
    if variant == "gaussian":
        multiplier = accounting.calibrate_noise_multiplier(
            lambda m: events.GaussianDpEvent(m), epsilon, delta, accountant,
            accounting.REPLACE_ONE, guess=2.0 * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon,
            slope=-1.0)
        return multiplier * lipschitz / n, events.GaussianDpEvent(multiplier)
    _, bound = sparse_mean_bound(variant, lipschitz, sparsity)
    return 2.0 * bound / (n * epsilon), accounting.PureDpEvent(epsilon)


def sparse_mean_release(total: np.ndarray, n: int, variant: str, lipschitz: float, sparsity: int,
                        scale: float, generator: np.random.Generator,
                        project: bool = True) -> tuple[np.ndarray, float]:
    """Algorithm 1 on the driver: (the release, ||noise||_inf). ``total`` is the clipped sum
    (``sparse_clipped_sum`` over the blocks), ``n`` the public size, ``scale`` the noise's
    (``sparse_mean_noise_scale``). ``project`` False: the dense mechanism (noise, no projection),
    the baseline the projection is measured against. ||noise||_inf is for Lemma 3.1's check; it
    must not leave the job."""
    from beam_dp import geometry

    d = total.shape[0]
    if variant == "gaussian":
        noise = mechanisms.gaussian_noise(generator, d, scale)
    elif variant == "laplace":
        noise = generator.laplace(0.0, scale * mechanisms.NOISE_SCALE_FOR_TESTS, size=d)
    else:
        raise ValueError(f"variant must be one of {', '.join(SPARSE_MEAN_VARIANTS)}")
    noisy = total / n + noise
    if project:
        noisy = geometry.project_l1_ball(noisy, lipschitz * math.sqrt(sparsity))
    return noisy, float(np.max(np.abs(noise)))


# ----------------------------------------------------- categorical column counts (sparse blocks)

@dataclasses.dataclass(frozen=True)
class ColumnCountStage:
    """Gaussian counts of the rows having a nonzero in each of the columns [first, dim) of CSR
    blocks (the categorical columns of ``beam_dp.categorical``): a row counts at most once per
    column and is in at most ``per_row`` of them (one per categorical column), so the counts'
    l2 sensitivity under add/remove is sqrt(per_row); Gaussian noise of std noise_multiplier
    sqrt(per_row) per column. Writes ``state[key]`` (dim - first,). O(nnz) per block."""

    key: str
    first: int
    dim: int
    per_row: int
    noise_multiplier: float
    seed: int
    stream: tuple = (0,)
    # User-level privacy: each row weighs 1 / its user's rows (blocks grouped by user), so a
    # user's vector is an average of rows' vectors, of norm at most one row's, sqrt(per_row).
    per_user: bool = False

    @property
    def shape(self):
        return (self.dim - self.first,)

    def partial_sum(self, block, state):
        x = block.features
        # One stored entry per (row, column) (the encoder sums duplicate entries), and the
        # categorical entries are >= 1: the entry's presence is the row's membership.
        categorical_entries = x.indices >= self.first
        columns = x.indices[categorical_entries] - self.first
        weights = None
        if self.per_user:
            per_entry = np.repeat(user_level.per_row_weights(block.users), np.diff(x.indptr))
            weights = per_entry[categorical_entries]
        return np.bincount(columns, weights=weights,
                           minlength=self.dim - self.first).astype(np.float64)

    def apply(self, state, total):
        noise = mechanisms.gaussian_noise(_rng(self), total.shape,
                                          self.noise_multiplier * math.sqrt(self.per_row))
        return {**state, self.key: total + noise}

    def releases(self):
        return [("gaussian_column_counts", events.GaussianDpEvent(self.noise_multiplier), 1,
                 {"noise_multiplier": self.noise_multiplier,
                  "sensitivity": f"sqrt({self.per_row}) (one count per categorical column)",
                  "columns": self.dim - self.first})]


# -------------------------------------------- categorical frequencies (Algorithm 1 as a stage)
#
# ``beam-dp stats --categorical-columns``: the private mean of the one-hot rows, i.e. each
# categorical value's (or hash bucket's) frequency, by the projection mechanism above. Every
# encoded row has exactly one 1 per categorical column (each column in its own block of ids:
# ``ColumnBlockHashing`` for hashing, a vocabulary's blocks already are), so s = k, the number of
# categorical columns, and L = sqrt(k) are public facts of the request: no data-dependent clip.
# The rows are still clipped inside the stage (l2 <= L, or l1 <= L sqrt(s) for Laplace), because
# the guarantee lives in the mechanism, not in what the encoder is believed to produce.

SPARSE_COUNT_SHARE = 0.05   # of epsilon, for the private count when --num-examples is not given
SPARSE_FAILURE = 0.05       # the failure probability of the error bound the report gives


@dataclasses.dataclass(frozen=True)
class ColumnBlockHashing(categorical.Encoding):
    """Feature hashing with each categorical column in its own ``hash_buckets`` ids (column j's
    bucket b is id j B + b; the bucket b is the one ``train --hash-buckets B`` gives that value).
    Training shares the B buckets between columns; frequencies are asked per column, and separate
    blocks keep every row's k ones apart (no collision makes a 2), so each row is exactly
    k-sparse and each column's frequencies sum to 1."""

    def __post_init__(self):
        super().__post_init__()
        if self.hash_buckets is None:
            raise categorical.EncodingError("ColumnBlockHashing needs --hash-buckets")

    @property
    def dim(self) -> int:
        return len(self.numeric) + len(self.categorical) * self.hash_buckets

    def column_ids(self, name: str, values) -> np.ndarray:
        return super().column_ids(name, values) + self.categorical.index(name) * self.hash_buckets


def frequency_encoding(columns, hash_buckets: int | None = None, hash_seed: int = 0,
                       vocabulary: str | None = None) -> categorical.Encoding:
    """The encoding of ``beam-dp stats --categorical-columns``: the categorical columns only (no
    numeric ones), hashed per column (``ColumnBlockHashing``) or through a vocabulary."""
    encoding = categorical.make_encoding((), columns, hash_buckets, hash_seed, vocabulary)
    if encoding is None:
        raise categorical.EncodingError("give --categorical-columns")
    if encoding.hash_buckets is not None:
        encoding = ColumnBlockHashing((), encoding.categorical, hash_buckets=encoding.hash_buckets,
                                      hash_seed=encoding.hash_seed)
    return encoding


@dataclasses.dataclass(frozen=True)
class ReplaceOneCountStage(CountStage):
    """The Laplace count of a replace-one release. Replacing a row leaves the count unchanged, so
    this charges nothing in truth; dp_accounting has no Laplace event under replace-one, and the
    ledger records it as what it is under add/remove, an epsilon-DP release (an upper bound)."""

    def releases(self):
        return [("laplace_count", accounting.PureDpEvent(self.epsilon), 1,
                 {"epsilon": self.epsilon, "sensitivity": "1 under add/remove; 0 under replace-one "
                  "(neighbours have the same n), so this charge is an upper bound"})]


@dataclasses.dataclass(frozen=True)
class SparseMeanStage:
    """Algorithm 1 (the projection mechanism) on the columns [first, dim) of CSR blocks: the sum
    of the rows clipped as ``variant`` needs (``sparse_clipped_sum``: O(nnz + d) per block, never
    a dense row), noise on the sum, division by the public ``state['n']`` (a declared size or a
    released count: post-processing), then the Euclidean projection onto the l1 ball of radius
    L sqrt(s). Writes ``state[key]`` (d,) and ``state[key + '_noise_scale']`` (the noise's scale
    per coordinate of the mean, public).

    ``noise_parameter``: the Gaussian's noise multiplier m (std m L on the sum: a replacement
    moves the sum by at most 2L in l2, the unit dp_accounting's replace-one Gaussian takes), or
    the Laplace variant's epsilon (scale 2 L sqrt(s) / epsilon on the sum: a replacement moves it
    by at most 2 L sqrt(s) in l1, once the rows are clipped to l1 <= L sqrt(s))."""

    key: str
    first: int
    dim: int
    variant: str
    lipschitz: float
    sparsity: int
    noise_parameter: float
    seed: int
    stream: tuple = (1,)

    def __post_init__(self):
        sparse_mean_bound(self.variant, self.lipschitz, self.sparsity)   # validates the variant
        if not (self.noise_parameter > 0 and math.isfinite(self.noise_parameter)):
            raise ValueError("the noise parameter must be a positive number")

    @property
    def shape(self):
        return (self.dim - self.first,)

    @property
    def radius(self) -> float:
        """The l1 ball's radius L sqrt(s): it holds every s-sparse row of l2 norm <= L."""
        return self.lipschitz * math.sqrt(self.sparsity)

    def sum_noise_scale(self) -> float:
        if self.variant == "gaussian":
            return self.noise_parameter * self.lipschitz
        return 2.0 * self.radius / self.noise_parameter

    def partial_sum(self, block, state):
        rows = block.features
        if self.first or rows.shape[1] != self.dim:
            rows = rows[:, self.first:self.dim]   # CSR column slice: O(nnz)
        return sparse_clipped_sum(rows, self.variant, self.lipschitz, self.sparsity)

    def apply(self, state, total):
        n = max(float(state["n"]), 1.0)
        scale = self.sum_noise_scale() / n
        # ||noise||_inf (the second value) stays here: only Lemma 3.1's tests look at it.
        release, _ = sparse_mean_release(total, n, self.variant, self.lipschitz, self.sparsity,
                                         scale, _rng(self))
        return {**state, self.key: release, f"{self.key}_noise_scale": scale}

    def error_bound(self, noise_scale: float, failure_probability: float = SPARSE_FAILURE) -> float:
        """With probability >= 1 - beta, the l2 distance of the release to the exact mean (n
        public) is at most this: the smaller of Lemma 3.1's sqrt(2 L sqrt(s) t), t a (1 - beta)
        bound on ||noise||_inf (the exact mean lies in the ball), and ||noise||_2 (the projection
        onto a convex set holding the mean moves nothing farther from it), the dense mechanism's
        error. Gaussian (each at beta / 2): t = sigma sqrt(2 ln(4d/beta)), ||noise||_2 <=
        sigma (sqrt(d) + sqrt(2 ln(2/beta))) (Lipschitz concentration); Laplace: t = b ln(d/beta)
        and ||noise||_2 <= sqrt(d) t on the same event. Public: the noise scale, d, s and L."""
        d = self.dim - self.first
        beta = failure_probability
        if self.variant == "gaussian":
            tail = noise_scale * math.sqrt(2.0 * math.log(4.0 * d / beta))
            dense = noise_scale * (math.sqrt(d) + math.sqrt(2.0 * math.log(2.0 / beta)))
        else:
            tail = noise_scale * math.log(d / beta)
            dense = math.sqrt(d) * tail
        return min(math.sqrt(2.0 * self.radius * tail), dense)

    def releases(self):
        if self.variant == "gaussian":
            return [("projection_mechanism_gaussian_mean",
                     events.GaussianDpEvent(self.noise_parameter), 1,
                     {"noise_multiplier": self.noise_parameter, "columns": self.dim - self.first,
                      "sparsity": self.sparsity, "l2_clip": self.lipschitz,
                      "l1_ball_radius": self.radius,
                      "sensitivity": "2 L in l2 on the sum of rows clipped to l2 <= L "
                                     "(replace-one); s sets only the projection's radius"})]
        return [("projection_mechanism_laplace_mean", accounting.PureDpEvent(self.noise_parameter), 1,
                 {"epsilon": self.noise_parameter, "columns": self.dim - self.first,
                  "sparsity": self.sparsity, "l1_clip": self.radius, "l1_ball_radius": self.radius,
                  "sensitivity": "2 L sqrt(s) in l1 on the sum of rows clipped to l1 <= L sqrt(s) "
                                 "(replace-one; the clip is enforced)"})]


def categorical_frequency_stages(encoding, variant: str, epsilon: float, delta: float, seed: int,
                                 count: bool = True, accountant: str = "pld") -> list:
    """The stages of ``beam-dp stats --categorical-columns`` (one pass over the data): a private
    count when n is not declared (SPARSE_COUNT_SHARE of epsilon; ``ReplaceOneCountStage``), then
    the projection mechanism on the encoded rows, s = k categorical columns, L = sqrt(k).
    Gaussian: the multiplier is calibrated with dp_accounting (replace-one) so that the count and
    the mean together meet (epsilon, delta). Laplace: the mean gets the rest of epsilon (less, if
    the accountant's epsilon of the two needs it), and the two pure releases compose to pure
    epsilon-DP (delta unused)."""
    if variant not in SPARSE_MEAN_VARIANTS:
        raise ValueError(f"--sparse-mechanism must be one of {', '.join(SPARSE_MEAN_VARIANTS)}")
    if not (epsilon > 0 and math.isfinite(epsilon) and 0 < delta < 1):
        raise ValueError("--epsilon must be positive and --delta in (0, 1)")
    k = len(encoding.categorical)
    first = len(encoding.numeric)
    count_epsilon = SPARSE_COUNT_SHARE * epsilon if count else 0.0
    head = [ReplaceOneCountStage(count_epsilon, seed, (0,))] if count else []
    count_events = [r[1] for s in head for r in s.releases()]
    if variant == "gaussian":
        def make(multiplier: float):
            mean = events.GaussianDpEvent(multiplier)
            return events.ComposedDpEvent(count_events + [mean]) if count_events else mean
        parameter = accounting.calibrate_noise_multiplier(
            make, epsilon, delta, accountant, accounting.REPLACE_ONE,
            guess=2.0 * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon, slope=-1.0)
    else:
        # Pure DP: count_epsilon + the mean's epsilon <= epsilon holds by basic composition; the
        # accountant's own epsilon must meet the target too (RDP's conversion of pure events is
        # looser than their sum), so the mean's share is lowered by the smallest factor >= 1
        # that makes it do so (1 with PLD).
        rest = epsilon - count_epsilon

        def make(inverse: float):
            mean = accounting.PureDpEvent(rest / inverse)
            return events.ComposedDpEvent(count_events + [mean]) if count_events else mean
        parameter = rest / accounting.calibrate_noise_multiplier(
            make, epsilon, delta, accountant, accounting.REPLACE_ONE, lower=1.0, guess=1.0)
    mean = SparseMeanStage("categorical_frequencies", first, encoding.dim, variant,
                           math.sqrt(k), k, parameter, seed, (1,))
    # One pass: the count's sum and the mean's are independent; the count is applied first, so
    # the mean divides by it.
    return [PackedStages(tuple(head + [mean]))] if head else [mean]


def frequency_layout(encoding) -> list:
    """(column, first id, width, value names or None for hash buckets) of each categorical
    column, in the encoding's ids (a vocabulary's column j: its values, then "other")."""
    first = len(encoding.numeric)
    if encoding.hash_buckets is not None:
        return [(name, first + j * encoding.hash_buckets, encoding.hash_buckets, None)
                for j, name in enumerate(encoding.categorical)]
    out, start = [], first
    for name, values in encoding.vocabulary:
        out.append((name, start, len(values) + 1, values))
        start += len(values) + 1
    return out


def categorical_summary(state: dict, stages, encoding, count_source: str) -> dict:
    """The stats report of the categorical frequencies (everything but the privacy report).
    Vocabulary columns: every listed value by name and "other" (public names). Hashed columns:
    only bucket ids (never a raw value), and only the buckets the release holds nonzero (the
    projection onto the l1 ball soft-thresholds, so at large d most are exactly 0: listing them
    would be a JSON of d numbers); a bucket not listed was released as 0."""
    stage = next(s for s in _flat_stages(stages) if isinstance(s, SparseMeanStage))
    count_stage = next((s for s in _flat_stages(stages) if isinstance(s, CountStage)), None)
    release = np.asarray(state[stage.key], float)
    scale = float(state[f"{stage.key}_noise_scale"])
    mechanism = (f"projection mechanism (paper 001, Algorithm 1), {stage.variant} noise, then the "
                 f"Euclidean projection onto the l1 ball of radius {stage.radius:g}")
    noise = ("gaussian_std" if stage.variant == "gaussian" else "laplace_scale")
    columns = {}
    for name, start, width, values in frequency_layout(encoding):
        part = release[start - stage.first:start - stage.first + width]
        entry = {"mechanism": mechanism, "noise_scale": scale, "noise": noise}
        if values is None:
            kept = np.flatnonzero(part)
            entry["buckets"] = {str(int(b)): float(part[b]) for b in kept}
            entry["buckets_total"] = width
            entry["buckets_listed"] = int(kept.size)
        else:
            entry["values"] = {v: float(part[i]) for i, v in enumerate(values)}
            entry["other"] = float(part[-1])
        entry["sum"] = float(part.sum())
        columns[name] = entry
    bound = stage.error_bound(scale)
    warnings = []
    if bound >= 1.0:
        warnings.append("categorical frequencies: the 95% l2 error bound is at least 1, the whole "
                        "of one column's frequencies; they are mostly noise. Use more rows or a "
                        "larger --epsilon.")
    out = {"count": state["n"], "count_source": count_source}
    if count_stage is not None:
        out["count_laplace_scale"] = 1.0 / count_stage.epsilon
        out["count_error_95"] = math.log(1 / 0.05) / count_stage.epsilon
    out.update({
        "categorical_frequencies": columns,
        "sparse_mechanism": {
            "variant": stage.variant, "columns": stage.dim - stage.first,
            "sparsity": stage.sparsity, "lipschitz": stage.lipschitz,
            "l1_ball_radius": stage.radius, "noise_scale": scale, "noise": noise,
            "l2_error_bound_95": bound,
            "encoding": ("hashing, each column in its own buckets" if encoding.hash_buckets
                         is not None else "vocabulary"),
        },
        "warnings": warnings,
        "notes": SPARSE_NOTES[stage.variant],
    })
    return out


SPARSE_NOTES = {
    "gaussian": (
        "Frequencies are the mean of the one-hot rows (one 1 per categorical column: s = k "
        "columns, L = sqrt(k)), released by the projection mechanism: Gaussian noise on the mean, "
        "then the Euclidean projection onto the l1 ball of radius L sqrt(s) = k, which holds the "
        "exact mean. The Gaussian variant's privacy does not depend on s: the rows are clipped to "
        "l2 norm L and the noise calibrated (dp_accounting, replace-one) to that alone; s only sets "
        "the projection's radius, a post-processing. With probability 0.95 the l2 distance to the "
        "exact frequencies (n public) is at most l2_error_bound_95 (Lemma 3.1); a released count "
        "scales it by n / count. Hashed columns list only the nonzero buckets; the projection "
        "releases the others as exactly 0."),
    "laplace": (
        "Frequencies are the mean of the one-hot rows (one 1 per categorical column: s = k "
        "columns, L = sqrt(k)), released by the projection mechanism: Laplace noise on the mean, "
        "then the Euclidean projection onto the l1 ball of radius L sqrt(s) = k. The Laplace "
        "variant's privacy needs every row's l1 norm to be at most L sqrt(s): that clip is "
        "enforced on every row inside the mechanism (not assumed of the encoder), and the noise "
        "is scaled to it (pure epsilon-DP). With probability 0.95 the l2 distance to the exact "
        "frequencies (n public) is at most l2_error_bound_95 (Lemma 3.1); a released count "
        "scales it by n / count. Hashed columns list only the nonzero buckets; the projection "
        "releases the others as exactly 0."),
}

SPARSE_PRIVACY = {
    "gaussian": ("Gaussian variant: its privacy does not depend on s (the sparsity): rows are "
                 "clipped to l2 norm L and the noise is calibrated to that; s only sets the l1 "
                 "ball the noisy mean is projected onto (post-processing)."),
    "laplace": ("Laplace variant: its privacy needs every row's l1 norm to be at most L sqrt(s); "
                "that l1 clip is enforced on every row inside the mechanism, and the Laplace "
                "noise is scaled to 2 L sqrt(s) / n (pure epsilon-DP)."),
}
