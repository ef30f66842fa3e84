"""Heavy-tailed private linear regression: truncated DP batched mirror descent (paper 004,
Su, Zhao & Wang, Algorithm 7 and Theorem 16; the note /work/shared/papers/004, §2.7).

The problem: the squared loss 0.5 (<w, x> - y)^2 over the l_p ball C = {||w||_p <= R}, 1 < p < 2,
where the labels (hence the gradients) may be heavy-tailed: only a second moment is assumed
(assumption A4), so a clipped mean is biased and a plain mean has no useful tail bound. The
coefficients and the intercept form one vector w in R^D (D = d + 1; D = d without an
intercept), the rows x = (z, 1) (or z), and the ball bounds all of w: the set must be bounded for
the algorithm (its diameter M = 2R sets the truncation threshold), so the intercept is inside it.
beta is a declared bound on the smoothness of the population loss L(w) = E 0.5 (<w, x> - y)^2
w.r.t. ||.||_p, ||E[x x^T]||_{p->q} (1 for standardized uncorrelated features): what the analysis
uses it for is ||grad L(w)||_q <= beta M on C (Lemma 17's truncation bias, with grad L(w*) = 0)
and the step's stability; an example's own deviation from grad L is A4's heavy-tailed part. (The
per-example bound ||x||_q^2 is also valid, and far larger: ~20 for 50 standardized features.)

* Batches. Every example is assigned, from a key derived from the seed and its position only
  (data-independently, ``BatchAssignment``), to one of T disjoint batches, and step t reads
  batch t only: one pass over the data.
* Step t (on the driver, over batch t; one Beam job writes every batch before the first step):
  each example's gradient g = (<w_{t-1}, x> - y) x is TRUNCATED TO ZERO, not clipped, when its
  dual norm ||g||_q = |<w_{t-1}, x> - y| ||x||_q (q = p / (p - 1)) exceeds the threshold
  tau = beta M + lambda. The test is made per example, before aggregation, overflow-safely: a
  residual or norm beyond the float range, or NaN, fails it (``truncated_gradient_sum``). The
  batch's sum is divided by the public nominal batch size b = n / T (never by its realized size),
  and ONE generalized-Gaussian vector Z ~ GG_{||.||_r}(0, sigma^2) is added (note §7: a batch's
  noise once, on the driver). The mirror step with Phi(w) = ||w||_p^2 / (2 (p - 1)) is
  grad Phi(u) = grad Phi(w_{t-1}) - (S / b + Z) / gamma, and w_t is the Bregman projection of u
  onto C, which for this ball and this map is radial, exact: w_t = u min(1, R / ||u||_p)
  (note §6.2; proof in ``bregman_project``).
* Output: the average of w_1..w_T weighted by 1 / gamma_t (note §2.7 step 3); gamma_t = gamma
  is constant (Thm 16), so it is the plain average.

Privacy (replace-one neighbours, the paper's Def. 1). Replacing one example changes only its
batch's sum, by at most 2 tau in ||.||_q (each truncated gradient has dual norm <= tau), so the
noisy mean S / b + Z has sensitivity s = 2 tau / b. Lemma 3 (the generalized Gaussian mechanism of
Bassily, Guzman & Nandi): with ||.||_r kappa-regular for the dual space, noise GG_{||.||_r}(0,
sigma^2) gives (eps, delta)-DP for sigma^2 = 2 kappa ln(1/delta) s^2 / eps^2, i.e. the note's §2.7
sigma^2 = 8 kappa tau^2 ln(1/delta) / (b^2 eps^2), for eps <= 1 (``accounting.
generalized_gaussian_event`` refuses more). Every example is in exactly one batch and each batch
has one release: parallel composition over disjoint batches (the later steps depend on it only
through w_t, a post-processing), so the whole run is (eps, delta)-DP, recorded as ONE
``generalized_gaussian_event``. sigma is calibrated with the library's calibration (PLD over the
event; within 0.3% above the closed form, never below it). The dataset size n is public under
this relation: ``--num-examples``, else the row count rounded to two significant digits (the
exact count, a batch's realized size and the number of truncated examples are never written).

kappa: the note has three versions (2e log d, 2 ln d, log d; erratum §9.2). We use none of them:
for the noise norm r = min{q, 2 ln D + 1} (clamped at 2) kappa is computed for that norm as
Def. 3 defines it, kappa = (r - 1) D^(2/r - 2/q) (||.||_r is (r - 1)-smooth, and ||x||_q <=
||x||_r <= D^(1/r - 1/q) ||x||_q): q - 1 = 1/(p - 1) when r = q, else at most 2e ln D.
(``geometry.kappa_lp``'s 2 ln D is below it when r < q, e.g. by 1.6x at p = 1.05, D = 100, which
would under-noise; not used here.) The mirror exponent is p itself, not the note's 1 + 1/kappa
(the same unless p < 1 + 1/(2 ln D)): Phi_p is 1-strongly convex w.r.t. ||.||_p for every p in
(1, 2], and only with the ball's own exponent is the Bregman projection radial and exact.
Privacy does not depend on the map.

The defaults of lambda, T and gamma (``plan``, ``step_size``) are public functions of n, eps,
delta, D, p, R and the declared smoothness beta: Thm 16's forms for lambda and T with constants
chosen by measurement, and the stochastic mirror-descent step for gamma; the measurements are in
``plan``'s docstring.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting, geometry, mechanisms
from beam_dp.algorithms import spec
from beam_dp.algorithms.base import TrainState, run_chunks
# n under replace-one (the count rounded, never written exactly) and Def. 3's kappa for (q, r):
# the sibling l_p algorithm's, so that the two compute them alike.
from beam_dp.algorithms.mirror_descent import kappa_of, public_dataset_size
from beam_dp.algorithms.spec import Algorithm, Problem, TrainResult, option
from beam_dp.block import Block
from beam_dp.losses import scores
from beam_dp.mechanisms import sampling_seed

RELEASE = "heavy_tailed_md_batches_parallel_composition"
# The only set whose Bregman projection (for Phi_p) is implemented: exact and radial.
CONSTRAINTS = ("lp-ball",) + tuple(k for k in geometry.KINDS)
# A kept gradient's dual norm is at most TRUNCATION_MARGIN * tau as computed, so that rounding in
# the norm (a few ulps) cannot take the sum's sensitivity above tau.
TRUNCATION_MARGIN = 1.0 - 2.0 ** -40


# ------------------------------------------------------------------------------ the options

@dataclasses.dataclass
class HeavyTailedMdOptions:
    p: float = option(1.5, "the geometry: the model lies in an l_p ball, 1 < p < 2 "
                           "(gradients are truncated in the dual norm l_q); p near 1 "
                           "suits many features and few large coefficients",
                      low=1, low_open=True, high=2)
    constraint: str = option("lp-ball", "the set the coefficients and intercept lie in:"
                                        " only lp-ball (radius --radius, p = --p) is "
                                        "supported, the others are refused with the "
                                        "reason",
                             choices=CONSTRAINTS)
    radius: float = option(1.0, "R: the l_p ball's radius (its diameter M = 2R sets the "
                                "truncation threshold beta M + lambda)", low=0, low_open=True)
    smoothness: float = option(
        1.0, "beta: declared smoothness of the population loss w.r.t. ||.||_p (1 for "
             "standardized uncorrelated features); it sets the truncation threshold "
             "beta M + lambda, not the privacy guarantee", low=0, low_open=True)
    truncation_slack: float | None = option(
        None, "lambda: gradients whose dual norm exceeds beta M + lambda are truncated to zero; "
              "default Thm 16's (sqrt(n eps) M / (kappa (D ln(1/delta))^(1/4)))^(2/3)", low=0)
    batches: int | None = option(None, "T: disjoint batches, one mirror step each (one "
                                       "pass); default 0.12 n eps / (M lambda sqrt(D "
                                       "ln(1/delta))) (Thm 16), at least 1",
                                 low=1)
    learning_rate: float | None = option(
        None, "1 / gamma, the mirror step's size; default from the variance bound of the noisy "
              "mean, at most 1 / ((p - 1) beta)", low=0, low_open=True)

    def check(self) -> None:
        if not self.p < 2.0:
            raise ValueError("--p must be below 2 (the paper's 1 < p < 2; for p = 2 use an l2 "
                             "algorithm such as dpsgd)")
        if self.constraint != "lp-ball":
            why = ("it needs a bounded set: the truncation threshold beta M + lambda is set from "
                   "its diameter M" if self.constraint == "none" else
                   "the Bregman projection of its mirror map onto that set has no closed form "
                   "and is not implemented (onto the l_p ball of the same exponent it is radial "
                   "and exact)")
            raise ValueError(f"--constraint {self.constraint}: heavy-tailed-md supports only "
                             f"--constraint lp-ball (the l_p ball of --radius, p = --p): {why}")


# ------------------------------------------------------------------------------ geometry

def regularity(p: float, dim: int) -> tuple[float, float]:
    """(r, kappa): the generalized-Gaussian noise norm ||.||_r for the dual space l_q of l_p^dim,
    r = min{q, 2 ln dim + 1} clamped at 2 (``geometry.noise_norm_exponent``), and the regularity
    constant of Def. 3 for that pair: ||.||_r is (r - 1)-smooth and ||x||_q <= ||x||_r <=
    dim^(1/r - 1/q) ||x||_q, so kappa = (r - 1) dim^(2/r - 2/q) (>= 1; = q - 1 when r = q; at most
    2e ln dim otherwise). See the module docstring for why not ``geometry.kappa_lp``."""
    r = geometry.noise_norm_exponent(p, dim)
    return r, kappa_of(geometry.dual_exponent(p), r, dim)


def bregman_project(u: np.ndarray, p: float, radius: float) -> np.ndarray:
    """The Bregman projection of u onto {||w||_p <= R} for Phi_p = ||.||_p^2 / (2 (p - 1)):
    u min(1, R / ||u||_p). Proof (note §6.2): for ||w||_p = rho, <grad Phi(u), w> <=
    ||grad Phi(u)||_q rho = ||u||_p rho / (p - 1) with equality at w = rho u / ||u||_p (Hoelder),
    so the projection minimizes rho^2 / 2 - ||u||_p rho over rho <= R: rho = min(||u||_p, R)."""
    norm = float(geometry.lp_norm(u, p))
    return u if norm <= radius else u * (radius / norm)


def mirror_step(w: np.ndarray, direction: np.ndarray, gamma: float, p: float,
                radius: float) -> np.ndarray:
    """argmin_{w' in C} <direction, w'> + gamma D_Phi(w', w) for Phi = Phi_p and C the l_p ball:
    the unconstrained step grad Phi(u) = grad Phi(w) - direction / gamma, then the Bregman
    projection of u onto C (the two-stage form is exact for Bregman projections)."""
    dual = geometry.mirror_grad(w, p) - direction / gamma
    return bregman_project(geometry.mirror_grad_inverse(dual, p), p, radius)


# ------------------------------------------------------------------------------ the kernel

def _row_norms_q(features: np.ndarray, q: float, fit_intercept: bool) -> np.ndarray:
    """||(z, 1)||_q (or ||z||_q) per row, overflow-safe (``geometry.lp_norm`` scales by the
    largest entry): inf only where the norm itself is beyond the float range."""
    norms = geometry.lp_norm(features, q) if features.shape[1] else np.zeros(len(features))
    if not fit_intercept:
        return norms
    return geometry.lp_norm(np.column_stack([norms, np.ones(len(features))]), q)


def truncation_mask(theta: np.ndarray, features: np.ndarray, labels: np.ndarray, q: float,
                    threshold: float, fit_intercept: bool) -> tuple[np.ndarray, np.ndarray]:
    """(keep, residual): keep[i] when example i's gradient (s_i - y_i) (z_i, 1) has dual norm
    |s_i - y_i| ||(z_i, 1)||_q at most the threshold (times TRUNCATION_MARGIN). A residual or a
    norm that overflows, or NaN anywhere, fails the test: such a row is truncated, like any row
    whose gradient is too large. Silent (no floating-point warnings)."""
    residual = scores(theta, features)[:, 0] - labels
    norms = _row_norms_q(features, q, fit_intercept)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        keep = np.abs(residual) * norms <= threshold * TRUNCATION_MARGIN
    return keep, residual


def truncated_gradient_sum(theta: np.ndarray, features: np.ndarray, labels: np.ndarray, q: float,
                           threshold: float, fit_intercept: bool) -> np.ndarray:
    """The sum over the rows of their squared-loss gradients (s - y)(z, 1), each TRUNCATED TO
    ZERO (not clipped) when its dual norm ||.||_q exceeds the threshold; a (d + 1,) vector, the
    last entry the intercept's (0 without one). Only kept rows enter the products, and each has
    |r z_j| <= threshold, so nothing overflows; every row adds a vector of dual norm <= threshold
    (the sum's replace-one sensitivity is 2 threshold)."""
    keep, residual = truncation_mask(theta, features, labels, q, threshold, fit_intercept)
    out = np.zeros(features.shape[1] + 1)
    if keep.any():
        r = residual[keep]
        out[:-1] = r @ features[keep]
        if fit_intercept:
            out[-1] = float(np.sum(r))
    return out


# ------------------------------------------------------------------------------ the batches

@dataclasses.dataclass(frozen=True)
class BatchAssignment:
    """The batch of every example, uniform over T, from the seed and the example's position only
    (DP-AMBSSGD's ``Assignment`` without roles): the batch plan (``beam_dp.batches``); step t reads
    the rows tagged t. ``seed`` is a key derived from the root seed (``mechanisms.sampling_seed``):
    the batch job's graph holds this plan, and nothing from which the noise could be derived."""

    seed: int
    batches: int
    expected_rows: float = 0.0     # of a step: n / T (sizes the batch files)

    def pieces(self, block: Block, steps):
        wanted = set(steps)
        if len(wanted) == 1:   # one step's rows (the local runner asks step by step): no sort
            (step,) = wanted
            rows = np.flatnonzero(self.tags(block) == step)
            if rows.size:
                part = block.take(rows)
                part.tag = int(step)
                yield step, part
            return
        for part in self(block):
            if part.tag in wanted:
                yield part.tag, part

    def tags(self, block: Block) -> np.ndarray:
        """Each row's batch."""
        g = mechanisms.rng(self.seed, mechanisms.STREAM_SAMPLING, block.key)
        return g.integers(0, self.batches, size=len(block))

    def __call__(self, block: Block):
        yield from block.parts(self.tags(block))


# ------------------------------------------------------------------------------ the step

@dataclasses.dataclass(frozen=True)
class TruncatedMirrorStep:
    """One batch of Algorithm 7 as a stage (module docstring). Picklable and Beam-free; it runs on
    the driver (its batches are fixed in advance), so it may hold the root seed."""

    dim: int                    # feature columns d
    p: float                    # the ball's and the mirror map's exponent
    noise_norm: float           # r of GG_{||.||_r}
    sigma: float                # the GG scale, in units of the batch mean
    threshold: float            # tau = beta M + lambda
    batch_size: float           # the public nominal b = n / T
    gamma: float
    radius: float
    fit_intercept: bool
    seed: int
    batch_plan: BatchAssignment | None = None

    canary_releases = (RELEASE,)

    @property
    def shape(self):
        return (self.dim + 1,)

    @property
    def q(self) -> float:
        return geometry.dual_exponent(self.p)

    def selected_sum(self, batch: Block, state: TrainState) -> np.ndarray:
        return truncated_gradient_sum(state.theta, batch.features, batch.labels, self.q,
                                      self.threshold, self.fit_intercept)

    def partial_sum(self, block: Block, state: TrainState) -> np.ndarray:
        total = np.zeros(self.shape)
        for _, part in self.batch_plan.pieces(block, (state.step,)):
            total = total + self.selected_sum(part, state)
        return total

    def noise(self, step: int) -> np.ndarray:
        """Step ``step``'s one GG draw (ChaCha20 stream of the root seed), (d + 1,), with 0 for the
        intercept when there is none. The audit's test hook scales it like every noise draw."""
        g = mechanisms.secure_generator(self.seed, mechanisms.STREAM_NOISE, step)
        size = self.dim + int(self.fit_intercept)
        z = geometry.sample_gg(g, size, self.noise_norm, self.sigma * mechanisms.NOISE_SCALE_FOR_TESTS)
        return z if self.fit_intercept else np.append(z, 0.0)

    def _coordinates(self, theta: np.ndarray) -> np.ndarray:
        """The model as the vector w of the ball (the intercept dropped when there is none)."""
        return theta[0] if self.fit_intercept else theta[0, :-1]

    def _theta(self, w: np.ndarray) -> np.ndarray:
        return (w if self.fit_intercept else np.append(w, 0.0))[None, :]

    def apply(self, state: TrainState, total: np.ndarray) -> TrainState:
        noisy = total / self.batch_size + self.noise(state.step)
        direction = noisy if self.fit_intercept else noisy[:-1]
        w = mirror_step(self._coordinates(state.theta), direction, self.gamma, self.p, self.radius)
        theta = self._theta(w)
        return TrainState(theta, state.theta_sum + theta, state.step + 1)

    # -- the one-run audit (beam_dp.audit)

    def _in_this_batch(self, step: int, canaries) -> np.ndarray:
        return canaries.blocks(self.batch_plan.batches) == step

    def canary_sum(self, state: TrainState, canaries) -> np.ndarray:
        """The audit's white-box canaries in this batch (each assigned to a batch uniformly, from
        the audit's randomness, as a row is): an included canary adds a gradient of dual norm
        exactly the threshold on its own column, +tau e_j; an excluded one is replaced by its
        mirror image, -tau e_j. The relation is replace-one: the two datasets have the same size
        and differ in one example, which is what the guarantee covers (and the largest change one
        replacement can make to the sum, 2 tau, is along the canary's column)."""
        out = np.zeros(self.shape)
        here = self._in_this_batch(state.step, canaries)
        out[canaries.columns[here]] = np.where(canaries.included[here], self.threshold, -self.threshold)
        return out

    def canary_scores(self, before: TrainState, after: TrainState, canaries) -> np.ndarray:
        """Minus the update of each canary's column at its own batch's step, in the mirror map's
        (dual) coordinates, grad Phi(w_{t-1}) - grad Phi(w_t), where the noisy mean enters
        linearly (0 for the canaries of other batches). The assignment of examples to batches is
        data-independent and the guarantee holds for each assignment (parallel composition), so
        the audit may use it."""
        here = self._in_this_batch(before.step, canaries)
        change = (geometry.mirror_grad(self._coordinates(before.theta), self.p)
                  - geometry.mirror_grad(self._coordinates(after.theta), self.p))
        return np.where(here, change[canaries.columns], 0.0)


# ------------------------------------------------------------------------------ the plan

# Constants of the defaults, chosen by measurement (``plan``).
SLACK_CONSTANT = 1.0
BATCHES_CONSTANT = 0.12
STEP_CONSTANT = 0.5
FLOOR_CONSTANT = 1.0


def plan(options: HeavyTailedMdOptions, n: int, epsilon: float, delta: float, dim: int,
         fit_intercept: bool) -> dict:
    """The public plan: every parameter of the run from public inputs only.

    * D = d + 1 (d without an intercept), q = p / (p - 1), (r, kappa) = ``regularity(p, D)``;
      beta = --smoothness; M = 2R;
    * lambda = --truncation-slack, or Thm 16's c_lambda (sqrt(n eps) M / (kappa (D ln(1/delta))^(1/4)))^(2/3);
      the threshold tau = beta M + lambda;
    * T = --batches, or Thm 16's c_T n eps / (M lambda sqrt(D ln(1/delta))), within [1, n];
      b = n / T, the public nominal batch size;
    * sigma: the GG scale of (eps, delta) at the sensitivity 2 tau / b (``calibrate_sigma``);
    * gamma = 1 / --learning-rate, or ``step_size``.

    Thm 16's forms are in the paper's units (gradients of order 1: standardized features and
    labels). The constants (c_lambda = 1, c_T = 0.12, c_gamma = 0.5, the floor's 1) were measured
    (scratch sweeps, 2-3 seeds, epsilon 1, delta 1e-5, Student-t(2.5) label noise, intercept
    fitted) on: d = 50 standardized features, ||w*||_1.5 = 1, p = 1.5, R = 1.5, n = 2e4 and 2e5,
    independent or Toeplitz(0.6)-correlated; d = 2000 and 1000 sign features with w* 1- or
    5-sparse, p = 1.1 / 1.2; and the note's §4.3(d) design (rows with ||z||_3 = 1). Over the grid
    c_lambda in {0.5, 0.7, 1, 2}, c_T in {0.06 .. 2}, c_gamma in {0.25 .. 2}, the chosen ones are
    within a geometric mean of 1.13x of each design's best excess risk. Thm 16's literal T (c_T =
    1) and its gamma were 2-15x worse: more batches mean more noise per batch (sigma grows
    as T), which the averaging does not win back at these n. Excess risks with the defaults
    (w = 0 in brackets): d = 50, n = 2e4: 0.056 (0.176); n = 2e5: 0.0078; correlated 0.044 /
    0.013 (0.144); the note's design: 0.170 / 0.158 (0.176), as the note found (its §4.3(d):
    Alg 7 barely beats w = 0 there); sparse, d = 2000, n = 1e4, w* = 3 e_1: 0.19 (4.5).
    """
    D = dim + int(fit_intercept)
    p = float(options.p)
    q = geometry.dual_exponent(p)
    r, kappa = regularity(p, D)
    beta = float(options.smoothness)
    M = 2.0 * options.radius
    log_delta = math.log(1.0 / delta)
    if options.truncation_slack is not None:
        slack = float(options.truncation_slack)
    else:
        slack = SLACK_CONSTANT * (math.sqrt(n * epsilon) * M
                                  / (kappa * (D * log_delta) ** 0.25)) ** (2.0 / 3.0)
    threshold = beta * M + slack
    if options.batches is not None:
        T = int(options.batches)
    else:
        T = BATCHES_CONSTANT * n * epsilon / (M * max(slack, 1e-300) * math.sqrt(D * log_delta))
        T = int(round(min(max(T, 1.0), float(n))))
    T = max(1, min(T, n))
    return {"dim": D, "p": p, "q": q, "noise_norm": r, "kappa": kappa, "beta": beta,
            "diameter": M, "truncation_slack": slack, "threshold": threshold, "batches": T,
            "batch_size": n / T, "sensitivity": 2.0 * threshold / (n / T),
            "phi_max": options.radius ** 2 / (2.0 * (p - 1.0))}


def step_size(options: HeavyTailedMdOptions, public: dict, sigma: float) -> float:
    """gamma: 1 / --learning-rate, or c_gamma sqrt(T V / (2 Phi_max)), the stochastic
    mirror-descent step for T steps from w_0 = 0 (Phi_max = R^2 / (2 (p - 1)), the largest Phi
    on C) with V = tau^2 / b + D sigma^2 bounding E||noisy mean - gradient||_q^2 (a truncated
    gradient has dual norm <= tau; E||Z||_q^2 <= E||Z||_r^2 = D sigma^2 by Lemma 4, r <= q).
    Floored at (p - 1) beta: near w, Phi_p's dual step moves w by about (p - 1) / gamma times the
    gradient, so the floor keeps that step within 1 / beta (stable gradient descent on a
    beta-smooth loss), also when n is so large that V is tiny. (Thm 16's gamma = sqrt(T) is this
    rule in its units, up to constants.)"""
    if options.learning_rate is not None:
        return 1.0 / float(options.learning_rate)
    T, b = public["batches"], public["batch_size"]
    variance = public["threshold"] ** 2 / b + public["dim"] * sigma ** 2
    return max(FLOOR_CONSTANT * (public["p"] - 1.0) * public["beta"],
               STEP_CONSTANT * math.sqrt(T * variance / (2.0 * public["phi_max"])))


# ------------------------------------------------------------------------------ privacy

def check_privacy(privacy: spec.Privacy) -> None:
    """Refuses what the mechanism cannot serve, known before any data is read: secure noise (the
    GG draws are float), a count budget (n is public under replace-one), the RDP accountant (an
    (epsilon, delta) release bounds no Renyi divergence) and a target epsilon above 1 (Lemma 3's
    range)."""
    spec.check_replace_one_float_request("heavy-tailed-md", privacy, "generalized Gaussian",
                                         "the generalized Gaussian lemma")
    if privacy.epsilon is not None and privacy.epsilon > 1.0:
        raise ValueError(f"heavy-tailed-md needs --epsilon at most 1 (got {privacy.epsilon:g}): "
                         "its generalized Gaussian mechanism (paper 004, Lemma 3) is proven only "
                         "for epsilon <= 1, and every batch is released at the full epsilon "
                         "(parallel composition)")


def check_budget(privacy: spec.Privacy, p: float, dim: int, fit_intercept: bool) -> None:
    """``check_privacy``, and the epsilon a noise multiplier buys (it needs D): at most 1."""
    check_privacy(privacy)
    if privacy.epsilon is not None:
        return
    _, kappa = regularity(p, dim + int(fit_intercept))
    epsilon = accounting.generalized_gaussian_epsilon(privacy.noise_multiplier, 1.0, kappa, privacy.delta)
    if epsilon > 1.0:
        raise ValueError(f"--noise-multiplier {privacy.noise_multiplier:g} buys epsilon "
                         f"{epsilon:.3g} per batch, above the 1 its generalized Gaussian "
                         "mechanism is proven for: use a larger multiplier")


# With releases already in the ledger (the quality check's Gaussian, reserved before training),
# the batches' (eps, delta_gg) release cannot take the whole delta: delta_gg is this share of it,
# the one (of these) that needs the least noise, and the rest of delta is the prior's.
PRIOR_DELTA_SHARES = (0.5, 0.75, 0.9)


def release_delta(delta: float, prior: events.DpEvent | None, share: float | None = None) -> float:
    """delta_gg of the batches' release: delta without a prior, else ``share`` of it."""
    return delta if prior is None else (share if share is not None else PRIOR_DELTA_SHARES[0]) * delta


def calibrate_sigma(epsilon: float, delta: float, kappa: float, accountant: str,
                    prior: events.DpEvent | None = None) -> tuple[float, float]:
    """(multiplier, delta_gg): the noise multiplier (GG scale / sensitivity) whose event at
    delta_gg, composed after ``prior`` (the releases already in the ledger), meets (epsilon,
    delta) by the accountant (replace-one), found by the library's calibration over Lemma 3's
    event; at or above the closed form sqrt(2 kappa ln(1/delta_gg)) / epsilon."""
    best = None
    for share in (PRIOR_DELTA_SHARES if prior is not None else (None,)):
        delta_gg = release_delta(delta, prior, share)

        def event(multiplier: float, delta_gg=delta_gg):
            return accounting.after(prior, accounting.ApproxDpEvent(
                accounting.generalized_gaussian_epsilon(multiplier, 1.0, kappa, delta_gg),
                delta_gg))
        closed = math.sqrt(2.0 * kappa * math.log(1.0 / delta_gg)) / epsilon
        found = max(closed, accounting.calibrate_noise_multiplier(
            event, epsilon, delta, accountant, accounting.REPLACE_ONE, guess=closed, slope=-1.0))
        if best is None or found < best[0]:
            best = (found, delta_gg)
    return best


# ------------------------------------------------------------------------------ training

def train(options: HeavyTailedMdOptions, problem: Problem, aggregator, seed: int,
          ledger: accounting.Ledger,
          on_progress: Callable[[int, int, float], None] = lambda *a: None) -> TrainResult:
    """Algorithm 7 on ``problem`` (squared loss; the options' l_p ball); see the module
    docstring. Everything is checked before the aggregator is first used."""
    if problem.loss.name != "linear":
        raise ValueError("heavy-tailed-md fits linear regression: use --model linear")
    spec.validate(options)
    privacy = problem.privacy
    privacy.validate()
    check_budget(privacy, options.p, problem.dim, problem.fit_intercept)
    if ledger.neighbouring != accounting.REPLACE_ONE:
        raise ValueError("heavy-tailed-md's guarantee is for replace-one neighbours: give it a "
                         "replace-one ledger")
    dataset_size = public_dataset_size(privacy.num_examples, aggregator)
    n = dataset_size["value"]
    delta = privacy.delta
    prior = accounting.prior_event(ledger)   # the quality check's release, if reserved
    if privacy.epsilon is not None:
        _, kappa = regularity(options.p, problem.dim + int(problem.fit_intercept))
        multiplier, delta_gg = calibrate_sigma(privacy.epsilon, delta, kappa, privacy.accountant,
                                               prior)
        epsilon_for_plan = privacy.epsilon
    else:
        multiplier = float(privacy.noise_multiplier)
        delta_gg = release_delta(delta, prior)
        _, kappa = regularity(options.p, problem.dim + int(problem.fit_intercept))
        epsilon_for_plan = accounting.generalized_gaussian_epsilon(multiplier, 1.0, kappa, delta_gg)
    public = plan(options, n, epsilon_for_plan, delta, problem.dim, problem.fit_intercept)
    sensitivity = public["sensitivity"]
    sigma = multiplier * sensitivity
    event = accounting.generalized_gaussian_event(sigma, sensitivity, public["kappa"], delta_gg)
    gamma = step_size(options, public, sigma)
    T = public["batches"]
    params = dict(noise_multiplier=multiplier, sigma=sigma, sensitivity=sensitivity,
                  kappa=public["kappa"], noise_norm_exponent=public["noise_norm"], batches=T,
                  noise="generalized Gaussian GG_{||.||_r}(0, sigma^2), one draw per batch "
                        "(float, numpy on a ChaCha20 stream)",
                  composition="parallel composition over disjoint batches: each example is in "
                              "exactly one batch, and each batch is one generalized Gaussian "
                              "release (paper 004, Lemma 3) of sensitivity 2 tau / b")
    ledger.record(RELEASE, event, 1, **params)
    step = TruncatedMirrorStep(
        dim=problem.dim, p=public["p"], noise_norm=public["noise_norm"], sigma=sigma,
        threshold=public["threshold"], batch_size=public["batch_size"], gamma=gamma,
        radius=float(options.radius), fit_intercept=problem.fit_intercept, seed=seed,
        # The batch job's graph holds the plan: a key derived from the seed, not the root seed.
        batch_plan=BatchAssignment(sampling_seed(seed), T, public["batch_size"]))
    state = TrainState.zeros(1, problem.dim)
    epsilon = ledger.epsilon(delta)
    on_progress(0, T, epsilon)
    state = run_chunks(aggregator, step, state, T, problem.steps_per_chunk,
                       lambda s, k: on_progress(s.step, T, epsilon))
    theta = state.theta_sum / T
    details = {k: public[k] for k in ("p", "q", "noise_norm", "kappa", "beta", "diameter",
                                      "truncation_slack", "threshold", "batches")}
    details.update(radius=float(options.radius), mirror_exponent=public["p"],
                   nominal_batch_size=public["batch_size"], gamma=gamma, sigma=sigma,
                   output="average of w_1..w_T (gamma constant)")
    constraint = {"kind": "lp-ball", "p": public["p"], "radius": float(options.radius),
                  "includes_intercept": bool(problem.fit_intercept)}
    return TrainResult(theta, ledger, multiplier, 1.0, T, None, dataset_size,
                       details, sampling="one pass over disjoint batches (data-independent "
                                         "assignment from the seed and each row's position)",
                       expected_batch_size=public["batch_size"],
                       details_name="algorithm_parameters", constraint=constraint)


@dataclasses.dataclass(frozen=True)
class _HeavyTailedAlgorithm(Algorithm):
    """The registry entry. ``check_request`` refuses, before the input is opened, what is known
    then: a model other than linear, a budget beyond the lemma's range (epsilon <= 1), the RDP
    accountant, secure noise, a count budget; ``train`` checks a noise multiplier's epsilon (it
    needs D)."""

    def check_request(self, loss, privacy: spec.Privacy, options) -> None:
        if loss.name not in self.models:
            raise ValueError(f"{self.name} does not fit --model {loss.name}; it supports: "
                             f"{', '.join(self.models)}")
        check_privacy(privacy)


def _train_registered(options: HeavyTailedMdOptions, problem: Problem, aggregator, seed, ledger,
                      progress):
    return train(options, problem, aggregator, seed, ledger, progress)


HEAVY_TAILED_MD = _HeavyTailedAlgorithm(
    "heavy-tailed-md", "linear regression with heavy-tailed labels (only a finite variance), "
                       "coefficients in an l_p ball (1 < p < 2), epsilon <= 1: truncated "
                       "mirror descent, one pass (paper 004, Algorithm 7)",
    ("linear",), HeavyTailedMdOptions, _train_registered, relation=accounting.REPLACE_ONE,
    checkpoints=False, quality_check=True)
