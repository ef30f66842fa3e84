"""Sufficient-statistics perturbation for linear regression (AdaSSP-style, Wang 2018).

One pass computes Z^T Z for z = (Clip(x, C_x), 1, clamp(y, -C_y, C_y)), which holds X^T X,
X^T y (with the intercept column) and y^T y. The driver then releases, each with Gaussian noise
of std sigma times its add/remove sensitivity:

1. lambda_min(X^T X) (sensitivity K = C_x^2 + 1, the largest ||(x, 1)||^2), to choose the ridge;
2. X^T X with a symmetric noise matrix (iid upper triangle; the upper triangle of (x,1)(x,1)^T
   has L2 norm <= ||(x,1)||^2 = K);
3. X^T y (sensitivity sqrt(K) * C_y);

and solves (X^T X + E + lambda I) theta = X^T y + e. AdaSSP's ridge: lambda = max(0, B_E - L),
with B_E = sigma K (2 sqrt(d+1) + sqrt(2 ln(2/rho))) a bound on the spectral norm of the noise
matrix holding with probability 1 - rho/2 (Gaussian symmetric matrices), and L the released
lambda_min lowered by its own noise's 1 - rho/2 bound, rho = 0.05: the smallest ridge that keeps
the system positive definite with probability 1 - rho. Or a given ridge. The three releases share
one noise multiplier, calibrated so that their composition (with the dataset-size count when n is
private) meets (epsilon, delta).

Secure noise (``--noise secure``, ``SspGrid``): z is put on public power-of-two grids, the
features and the intercept on g = 2^(e - b) (C_x <= 2^e, at most b = 20 bits), the label on
h = 2^(e_y - b) (C_y <= 2^e_y), each entry rounded to the nearest integer and every row's feature
part certified to norm at most R = C_x / g (1 + 2^-30) + sqrt(d) / 2 (``clipping.grid_rows``), so
Z^T Z is an exact integer matrix (``clipping.exact_gram``: float chunks whose sums stay below
2^52, added as 96-bit integers; the same for any blocks and workers). In grid units the
sensitivities, enlarged for the rounding, are K' = R^2 + (1/g)^2 (X^T X, upper triangle),
sqrt(K') C' (X^T y, C' = C_y / h) and ceil(K') for lambda_min, released as ceil(lambda_min) - 1
of the exact integer X^T X (an integer with the same sensitivity, computed exactly: a float
eigensolver's error grows with ||X^T X||, i.e. with n, and would break the sensitivity bound).
Each release adds ``mechanisms.discrete_gaussian`` noise of scale sigma times its sensitivity;
b is the largest (at most 20) keeping every scale within [2^32, 2^48]. The accounting is the
float path's three GaussianDpEvents plus ``sampler_delta_bound`` (``secure_release_note``).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.linalg
from dp_accounting import dp_event as events

from beam_dp import accounting, clipping, features, mechanisms, secure_noise
from beam_dp.algorithms import spec
from beam_dp.algorithms.noisy_gd import NoisyGDConfig, core_config
from beam_dp.algorithms.spec import Algorithm, Problem, TrainResult, option
from beam_dp.block import Block
from beam_dp.dataset_size import release_dataset_size
from beam_dp.losses import GlmLoss

RHO = 0.05


@dataclasses.dataclass
class SspConfig:
    feature_norm: float | None = option(None, "C_x: feature vectors are clipped to this norm; "
                                              "default 2 sqrt(d) (standardized features)",
                                        low=0, low_open=True)
    label_bound: float = option(4.0, "C_y: labels are clamped to [-C_y, C_y]", low=0, low_open=True)
    ridge: float | None = option(None, "ridge penalty; default chosen privately (AdaSSP)", low=0)

    def validate(self) -> None:
        spec.validate(self)


# the noise in grid units (secure_noise._SECURE_NOISE_BITS)
_SECURE_SCALES = (2.0 ** 32, 2.0 ** 48)
# Sensitivities are computed in float: 2^-50 above them covers the few roundings involved.
_UPWARD = 1.0 + 2.0 ** -50


@dataclasses.dataclass(frozen=True)
class SspGrid:
    """The public grids of secure SSP (module docstring), from C_x, C_y, d and the bits b."""

    bits: int
    dim: int
    feature_exponent: int    # g = 2^feature_exponent (features and intercept)
    label_exponent: int      # h = 2^label_exponent (labels)
    feature_limit: float     # R: the norm of a row's rounded features, in units of g
    label_limit: float       # C': |rounded label| <= C', in units of h

    @classmethod
    def make(cls, feature_norm: float, label_bound: float, dim: int, bits: int) -> "SspGrid":
        e_x = clipping.grid_exponent(max(float(feature_norm), 1.0))
        e_y = clipping.grid_exponent(label_bound)
        grid = math.ldexp(1.0, e_x - bits)
        return cls(bits, dim, e_x - bits, e_y - bits,
                   clipping.grid_row_bound(feature_norm, grid, dim),
                   float(np.rint(math.ldexp(float(label_bound), bits - e_y))))

    @property
    def feature_grid(self) -> float:
        return math.ldexp(1.0, self.feature_exponent)

    @property
    def label_grid(self) -> float:
        return math.ldexp(1.0, self.label_exponent)

    @property
    def intercept(self) -> float:
        """The intercept column's 1 in units of g (an integer: g <= 1)."""
        return math.ldexp(1.0, -self.feature_exponent)

    @property
    def xtx_sensitivity(self) -> float:
        """K' >= ||(p, 1/g)||^2 for every rounded row p: the L2 sensitivity (grid units g^2) of
        the upper triangle of X^T X, which has norm at most ||(p, 1/g)||^2."""
        return (self.feature_limit ** 2 + self.intercept ** 2) * _UPWARD

    @property
    def lambda_sensitivity(self) -> int:
        """Adding a row z moves lambda_min by between 0 and ||z||^2 <= K' (Weyl), so
        ceil(lambda_min) - 1 moves by at most ceil(K'), an integer."""
        return math.ceil(self.xtx_sensitivity)

    @property
    def xty_sensitivity(self) -> float:
        """||(p, 1/g)|| |c| <= sqrt(K') C' (grid units g h)."""
        return math.sqrt(self.xtx_sensitivity) * self.label_limit * _UPWARD

    @property
    def entry_bound(self) -> float:
        return max(self.feature_limit, self.intercept, self.label_limit)

    def scales(self, noise_multiplier: float) -> dict:
        """Each release's noise scale in its grid units."""
        return {"lambda_min": noise_multiplier * self.lambda_sensitivity,
                "xtx": noise_multiplier * self.xtx_sensitivity,
                "xty": noise_multiplier * self.xty_sensitivity}

    def sensitivities(self) -> dict:
        """The sensitivities the noise is scaled to, in data units (C_x^2 + 1 and
        sqrt(C_x^2 + 1) C_y, enlarged for the rounding)."""
        g, h = self.feature_grid, self.label_grid
        return {"lambda_min": self.lambda_sensitivity * g * g, "xtx": self.xtx_sensitivity * g * g,
                "xty": self.xty_sensitivity * g * h}

    def rows(self, block, feature_norm: float, label_bound: float) -> np.ndarray:
        """The rows z of a block as integers of the grids: (p, 1/g, c)."""
        clipped = features.ClipRows(feature_norm)(block).features
        p = clipping.grid_rows(clipped, self.feature_grid, self.feature_limit)
        with np.errstate(under="ignore"):   # tiny labels round to 0, silently
            c = np.rint(np.ldexp(np.clip(block.labels, -label_bound, label_bound),
                                 -self.label_exponent))
        return np.column_stack([p, np.full(len(block), self.intercept), c])


def secure_grid(noise_multiplier: float, feature_norm: float, label_bound: float,
                dim: int) -> SspGrid:
    """The finest grid (b <= GRID_FEATURE_BITS) whose noise scales stay within _SECURE_SCALES;
    ValueError where none does (a noise multiplier far from 1, or C_x above ~2^20, where the
    intercept's 1 would fall off a grid coarser than 1)."""
    low, high = _SECURE_SCALES
    e_x = clipping.grid_exponent(max(float(feature_norm), 1.0))
    for bits in range(clipping.GRID_FEATURE_BITS, max(e_x, 1) - 1, -1):
        grid = SspGrid.make(feature_norm, label_bound, dim, bits)
        scales = grid.scales(noise_multiplier).values()
        if max(scales) <= high:
            if min(scales) >= low:
                return grid
            break
    raise secure_noise.SecureNoiseUnavailable(
        f"noise multiplier {noise_multiplier:.3g} with --feature-norm {feature_norm:.3g} is outside "
        "what ssp's secure noise handles")


@dataclasses.dataclass(frozen=True)
class GramStage:
    """Z^T Z of z = (Clip(x, C_x), 1, clamp(y, -C_y, C_y)) over all examples: a float matrix, or
    with a ``grid`` (secure noise) an exact integer one on it (``SspGrid``)."""

    dim: int
    feature_norm: float
    label_bound: float
    grid: SspGrid | None = None

    @property
    def shape(self):
        return (self.dim + 2, self.dim + 2)

    def partial_sum(self, block, state):
        if self.grid is not None:
            return clipping.exact_gram(self.grid.rows(block, self.feature_norm, self.label_bound),
                                       self.grid.entry_bound)
        # ClipRows is overflow-safe (a row of 1e200 comes out with norm C_x, not NaN), so every
        # z is bounded and z z^T cannot overflow; tiny entries may underflow to 0, harmlessly
        # and silently (a warning only when such a row exists would reveal it).
        clipped = features.ClipRows(self.feature_norm)(block)
        z = np.column_stack([clipped.features, np.ones(len(block)),
                             np.clip(block.labels, -self.label_bound, self.label_bound)])
        with np.errstate(under="ignore"):
            return z.T @ z

    # The ledger release the audit's canaries enter (all three of its statistics).
    canary_releases = ("gaussian_sufficient_statistics",)

    def canary_sum(self, state, canaries):
        """The audit's white-box canaries (``beam_dp.audit``): each included canary is the row
        x = C_x on its own feature column, y = -C_y, the largest a row can be (with secure noise,
        put on the grid as any row is); it pulls its coordinate of the model down. (No
        ``canary_scores``: the releases are made after this stage, so the audit scores the
        released model.)"""
        columns = canaries.columns[canaries.included]
        x = np.zeros((columns.size, self.dim))
        x[np.arange(columns.size), columns] = self.feature_norm
        rows = Block(x, np.full(columns.size, -self.label_bound))
        if self.grid is not None:
            return clipping.exact_gram(self.grid.rows(rows, self.feature_norm, self.label_bound),
                                       self.grid.entry_bound)
        z = np.column_stack([rows.features, np.ones(columns.size), rows.labels])
        return z.T @ z

    def zero_sum(self):
        """The sum over no rows."""
        return clipping.ExactSum.zeros(self.shape) if self.grid is not None else np.zeros(self.shape)

    def apply(self, state, total):
        return {**state, "gram": total}


def _symmetric_noise(g: np.random.Generator, size: int, std: float) -> np.ndarray:
    upper = np.triu(mechanisms.gaussian_noise(g, (size, size), std))
    return upper + np.triu(upper, 1).T


def _symmetric_discrete_noise(g: np.random.Generator, size: int, scale: float) -> np.ndarray:
    """Symmetric int64 noise: iid discrete Gaussian draws on and above the diagonal."""
    rows, columns = np.triu_indices(size)
    upper = np.zeros((size, size), dtype=np.int64)
    upper[rows, columns] = mechanisms.discrete_gaussian(g, scale, rows.size)
    return upper + np.triu(upper, 1).T


def exact_integers(total: clipping.ExactSum) -> np.ndarray:
    """An ExactSum's value as Python integers (an object array)."""
    return total.hi.astype(object) * (1 << 32) + total.lo.astype(object)


def _positive_definite(matrix: np.ndarray) -> bool:
    """Whether a symmetric integer matrix (object array of Python ints) is positive definite,
    exactly: Sylvester's criterion on the leading principal minors, which fraction-free
    (Bareiss) elimination yields as its pivots; every division is exact. O(d^3) operations on
    integers of up to ~d times the entries' bits (~1 s at d = 100)."""
    m = np.array(matrix, dtype=object)
    size = m.shape[0]
    previous = 1
    for k in range(size):
        pivot = m[k, k]
        if pivot <= 0:
            return False
        for i in range(k + 1, size):   # the upper triangle of the (symmetric) rest
            m[i, i:] = (pivot * m[i, i:] - m[k, i] * m[k, i:]) // previous
        previous = pivot
    return True


def lambda_min_floor(gram: np.ndarray) -> int:
    """ceil(lambda_min(A)) - 1, the largest integer t with A - t I positive definite, for a
    symmetric positive semidefinite integer matrix A (object array of Python ints), exactly.

    A float eigensolver gives lambda_min to within ~d 2^-53 ||A||, an error that grows with the
    data (||A|| ~ n K) and moves with it unpredictably; a release computed so would not have the
    sensitivity its noise is scaled to. Here: the float eigenvector v of the smallest eigenvalue,
    rounded to integers w, gives the exact Rayleigh quotient r = w^T A w / w^T w >= lambda_min,
    so t = ceil(r) - 1 is an upper bound; it is the answer when A - t I is positive definite
    (exact test), which it is unless lambda_min lies within the Rayleigh quotient's (tiny) error
    of an integer. Otherwise the exact tests search below (A is semidefinite: t = -1 always
    passes)."""
    size = gram.shape[0]
    approx = np.array(gram, dtype=np.float64)
    _, vectors = np.linalg.eigh(approx)
    v = vectors[:, 0]
    w = np.array([int(x) for x in np.rint(np.ldexp(v / np.max(np.abs(v)), 52))], dtype=object)
    numerator, denominator = int(w @ (gram @ w)), int(w @ w)
    top = -((-numerator) // denominator) - 1          # ceil(r) - 1, exactly

    def passes(t: int) -> bool:
        return _positive_definite(gram - t * np.eye(size, dtype=int).astype(object))

    if passes(top):
        return top
    failed, step = top, 1                              # lambda_min <= top: gallop down
    while True:
        candidate = max(top - step, -1)
        if candidate == -1 or passes(candidate):
            break
        failed, step = candidate, 2 * step
    low = candidate                                    # passes; failed does not
    while failed - low > 1:
        middle = (low + failed) // 2
        if passes(middle):
            low = middle
        else:
            failed = middle
    return low


def train(config: NoisyGDConfig, s_config: SspConfig, loss: GlmLoss, dim: int, aggregator,
          seed: int, ledger: accounting.Ledger) -> TrainResult:
    if loss.name != "linear":
        raise ValueError("ssp fits linear regression: use --model linear")
    config.validate()
    s_config.validate()
    dataset_size = release_dataset_size(config, aggregator, seed, ledger)
    c_x = s_config.feature_norm or 2.0 * math.sqrt(dim)
    c_y = s_config.label_bound
    k = c_x ** 2 + 1.0
    releases = 2 if s_config.ridge is not None else 3
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    else:
        prior = ledger.event()
        sigma = accounting.calibrate_noise_multiplier(
            lambda s: events.ComposedDpEvent(
                [prior, events.SelfComposedDpEvent(events.GaussianDpEvent(s), releases)]),
            config.epsilon, config.delta, config.accountant)
    size = dim + 1
    if config.noise != "float":   # None: secure by default, float where it cannot be used
        try:
            return _train_secure(config, s_config, dim, aggregator, seed, ledger, dataset_size,
                                 sigma, releases, c_x, c_y)
        except secure_noise.SecureNoiseUnavailable as why:   # (raised before any release)
            secure_noise.float_instead(config.noise, why, ledger)
    ledger.record("gaussian_sufficient_statistics", events.GaussianDpEvent(sigma), releases,
                  noise_multiplier=sigma, feature_norm=c_x, label_bound=c_y,
                  sensitivities={"lambda_min": k, "xtx": k, "xty": math.sqrt(k) * c_y},
                  noise=secure_noise.noise_description("float", sigma))

    gram = aggregator.run_stages([GramStage(dim, c_x, c_y)], {})["gram"]
    g = mechanisms.rng(seed, mechanisms.STREAM_NOISE, 0)
    xtx, xty = gram[:-1, :-1], gram[:-1, -1]
    if s_config.ridge is None:
        lam_min = np.linalg.eigvalsh(xtx)[0] + mechanisms.gaussian_noise(g, (), sigma * k)
        tail = math.sqrt(2.0 * math.log(2.0 / RHO))
        noise_bound = sigma * k * (2.0 * math.sqrt(size) + tail)
        ridge = max(0.0, noise_bound - (lam_min - sigma * k * tail))
    else:
        ridge = s_config.ridge
    noisy_xtx = xtx + _symmetric_noise(g, size, sigma * k) + ridge * np.eye(size)
    noisy_xty = xty + mechanisms.gaussian_noise(g, size, sigma * math.sqrt(k) * c_y)
    return _solve(noisy_xtx, noisy_xty, ledger, sigma, dataset_size, ridge, s_config, c_x, c_y)


def _solve(noisy_xtx, noisy_xty, ledger, sigma, dataset_size, ridge, s_config, c_x, c_y,
           **details) -> TrainResult:
    try:
        theta = scipy.linalg.solve(noisy_xtx, noisy_xty, assume_a="sym")
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError):
        theta = np.linalg.lstsq(noisy_xtx, noisy_xty, rcond=None)[0]
    return TrainResult(theta[None, :], ledger, sigma, 1.0, 1, None, dataset_size,
                       sampling="one pass (sufficient statistics)",
                       details_name="algorithm_parameters",
                       preprocessing={"ridge": ridge, "ridge_source": "given" if s_config.ridge is not None
                        else "AdaSSP: from a private lambda_min", "feature_norm": c_x,
                        "label_bound": c_y, **details})


def secure_description(grid: SspGrid) -> str:
    return (f"discrete Gaussian on exact integer sums (feature grid 2^{grid.feature_exponent}, "
            f"label grid 2^{grid.label_exponent}; lambda_min as ceil(lambda_min) - 1 of the exact "
            "integer X^T X; ChaCha20 randomness; accounted as the Gaussian plus "
            "sampler_delta_bound)")


def _train_secure(config, s_config, dim, aggregator, seed, ledger, dataset_size, sigma, releases,
                  c_x, c_y) -> TrainResult:
    """The three releases with integer noise on the exact integer Gram matrix (module
    docstring); the same public steps as the float path otherwise."""
    grid = secure_grid(sigma, c_x, c_y, dim)
    scales = grid.scales(sigma)
    size = dim + 1
    draws = [(size * (size + 1) // 2, scales["xtx"]), (size, scales["xty"])]
    if s_config.ridge is None:
        draws.append((1, scales["lambda_min"]))
    # (With the secure releases already in the ledger, e.g. the quality check's reserved sums.)
    variation = (secure_noise.draws_total_variation(draws)
                 + secure_noise.prior_total_variation(ledger))
    event = events.GaussianDpEvent(sigma)
    epsilon = config.epsilon if config.epsilon is not None else accounting.epsilon_of(
        ledger.event_after("gaussian_sufficient_statistics", event, releases), config.delta,
        config.accountant)
    sampler_delta = secure_noise.secure_delta_bound(variation, epsilon)
    if sampler_delta > 1e-3 * config.delta:
        raise secure_noise.SecureNoiseUnavailable(
            f"secure noise's samplers could add {sampler_delta:.2g} to delta at epsilon "
            f"{epsilon:.3g}")
    sensitivities = grid.sensitivities()
    ledger.record("gaussian_sufficient_statistics", event, releases,
                  noise_multiplier=sigma, feature_norm=c_x, label_bound=c_y,
                  sensitivities=sensitivities, noise=secure_description(grid),
                  sampler_total_variation=variation, sampler_delta_bound=sampler_delta)
    if secure_noise.secure_release_note() not in ledger.notes:
        ledger.notes.append(secure_noise.secure_release_note())

    gram = aggregator.run_stages([GramStage(dim, c_x, c_y, grid)], {})["gram"]
    g = mechanisms.secure_generator(seed, mechanisms.STREAM_NOISE, 0)
    xtx = clipping.ExactSum(gram.hi[:-1, :-1], gram.lo[:-1, :-1])
    xty = clipping.ExactSum(gram.hi[:-1, -1], gram.lo[:-1, -1])
    unit_xx = grid.feature_grid ** 2
    k = sensitivities["xtx"]
    if s_config.ridge is None:
        # An integer with sensitivity ceil(K') plus integer noise, scaled back (exactly: a power
        # of two) to the float path's units.
        noisy = lambda_min_floor(exact_integers(xtx)) + int(
            mechanisms.discrete_gaussian(g, scales["lambda_min"], ()))
        lam_min = math.ldexp(float(noisy), 2 * grid.feature_exponent)
        tail = math.sqrt(2.0 * math.log(2.0 / RHO))
        k_lambda = sensitivities["lambda_min"]
        noise_bound = sigma * k * (2.0 * math.sqrt(size) + tail)
        ridge = max(0.0, noise_bound - (lam_min - sigma * k_lambda * tail))
    else:
        ridge = s_config.ridge
    noise = _symmetric_discrete_noise(g, size, scales["xtx"])
    noisy_xtx = (xtx + noise).to_float() * unit_xx + ridge * np.eye(size)
    noisy_xty = ((xty + mechanisms.discrete_gaussian(g, scales["xty"], size)).to_float()
                 * (grid.feature_grid * grid.label_grid))
    return _solve(noisy_xtx, noisy_xty, ledger, sigma, dataset_size, ridge, s_config, c_x, c_y,
                  grid_bits=grid.bits)


def _train_registered(options: SspConfig, problem: Problem, aggregator, seed, ledger, progress):
    return train(core_config("dpsgd", options, problem, secure=True), options, problem.loss,
                 problem.dim, aggregator, seed, ledger)


SSP = Algorithm(
    "ssp", "linear regression with few features (d up to ~100): one pass, no learning rate or "
           "steps to tune; its error grows like d^3 / (eps n)^2",
    ("linear",), SspConfig, _train_registered, checkpoints=False, no_intercept=False,
    secure_noise=True, quality_check=True)
