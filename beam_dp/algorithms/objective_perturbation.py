"""Approximate objective perturbation over a constraint set C (paper 004, Su, Zhao & Wang,
Algorithms 1 and 2 with Theorems 1-4; the note /work/shared/papers/004, §2.1-2.3, §3, §4.2-4.3,
§6.5, §7, §9.5-9.8).

The release (replace-one neighbours, the paper's Def. 1; n is public under it):

1. G ~ N(0, sigma1^2 I_D), drawn once, on the driver, before the solve;
2. J(theta) = (1/n) sum_i l(theta, x_i) + <G, theta> / n + lambda ||theta||_2^2, minimized over
   C x R (the coefficients in C, the intercept free) by a solver whose accuracy is CERTIFIED:
   J(theta2) - min J <= alpha on every run, not on average (§6.5: the privacy proof needs it);
3. H ~ N(0, sigma2^2 I_D); the model is Proj_{C x R}(theta2 + H) (the projection is what makes
   the error scale with the Gaussian width G_C of C instead of sqrt(D): Remark 1).

The solver's iterates, G and H never leave the job: no report, log, checkpoint or progress line
holds them (progress shows passes out of a number fixed in advance).

Privacy. The pair (theta1, theta2 - theta1 + H) is released by basic composition, theta1 =
argmin_C J the exact objective perturbation (Alg 5), then the model is post-processing:

* theta1: Lemma 5 (Iyengar et al. 2019, Thm 1) for a convex loss, L-Lipschitz and beta-smooth in
  l2, whose per-example Hessian has rank <= r/2: (eps1, delta1)-DP with sigma1^2 = 32 L^2
  ln(1.25/delta1) / eps1^2 (Alg 5's constant at (eps1, delta1); the paper's Alg 1 writes
  ln(2.5/delta) for delta1 = delta/2, the same thing) and lambda >= r beta / (eps1 n). That is
  Lemma 5's condition; Alg 5 prints half of it (erratum §9.5): we are unsure which the cited
  theorem needs, so the larger is used. The loss's own strong convexity counts towards it (a
  loss Delta-strongly convex in l2 contributes Delta (n - 1) / (2n): the n - 1 rows the
  neighbours share), which the mean-point benchmark uses (Alg 2, with the note's §2.2 fix: Delta
  in l2, not in ||.||_C). eps1 = min(eps / 2, 1) (the paper's half, capped at 1: its Gaussian-
  tail proof is the classical one, proven for eps <= 1), delta1 = delta / 2. Recorded as an
  ``ApproxDpEvent(eps1, delta1)``: what the theorem proves, nothing finer.
* theta2 - theta1 + H: J is mu-strongly convex (mu = 2 lambda + Delta), so the certificate J(theta2)
  - J(theta1) <= alpha gives ||theta2 - theta1||_2 <= r0 = sqrt(2 alpha / mu) on every dataset: a
  replacement moves it by at most 2 r0 (the paper's sqrt(8 alpha / lambda), without its extra
  factor 2 on mu). H is Gaussian of multiplier sigma2 / r0 (a ``GaussianDpEvent`` under
  replace-one: dp_accounting's exact Gaussian accounting, not the paper's classical bound), its
  multiplier calibrated by PLD so that the composition of both meets the target (eps, delta):
  H takes what the objective perturbation leaves.
* The certificate holds by construction (below) except if ||G|| exceeds a bound that fails with
  probability 2^-100; then the run refuses (writing nothing). That event changes the output law by
  at most 2^-100 in total variation, i.e. (eps, delta + (1 + e^eps) 2^-100)-DP, reported as
  ``solver_delta_bound``.

The solver (§6.5, §7): V-FISTA (Beck, First-Order Methods in Optimization, §10.7.7: accelerated
projected gradient with momentum (sqrt(kappa) - 1) / (sqrt(kappa) + 1), step 1 / L_s), each
gradient one full pass through the Aggregator seam (``SolverPass``: Beam or local; the G term and
the update on the driver's side of the stage). Its number of passes K is fixed in advance from
public constants only (kappa = L_s / mu, a bound on the initial gap), so that it reveals nothing:
F(x_K) - F* <= 2 (1 - 1/sqrt(kappa))^K gap0 <= alpha / (16 kappa). One more pass, a plain projected
gradient step from x_K, gives the released theta2 = x+ and the certificate (2 ||G_map|| + e)^2 /
(2 mu) >= J(x+) - min J (v = G_map - grad f(x_K) + grad f(x+) is a subgradient at x+, ||v|| <= 2
||G_map||; e bounds the rounding of the summed gradient, any summation order), which is <= alpha /
2 + e^2 / mu when the accelerated bound holds ((a + b)^2 <= 2a^2 + 2b^2, ||G_map||^2 <= 2 L_s
(F(x_K) - F*)), and alpha is never below 64 e^2 / mu. The run refuses unless the certificate is <= alpha.

Defaults: lambda = max(L / (sqrt(n) ||C||_2), the privacy minimum) (Thm 2; ||C||_2 = 2, the unit
ball's, for an unconstrained run), alpha = the smaller of Thm 2's and the alpha whose output noise
is 1% of the objective noise's effect (sigma2 = 0.01 sigma1 / (n mu)), never below what float64
can certify. GLMs only (logistic, huber, softmax): a GLM's per-example Hessian l''(s) x x^T has
rank 1 (softmax: k - 1), so r = min(D, 2 rank); rows' features are clipped to l2 norm F (recorded
in model.json; ``predict`` clips too), which makes L = (loss's Lipschitz constant in the score) *
||(z, 1)||_2 and beta = (its curvature) * ||(z, 1)||_2^2 hold on any data.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import scipy.sparse as sp
from dp_accounting import dp_event as events

from beam_dp import accounting, clipping, features, geometry, mechanisms
from beam_dp import losses as losses_mod
from beam_dp.algorithms.base import run_chunks
from beam_dp.algorithms.constrained import ConstraintOptions
from beam_dp.algorithms.mirror_descent import CURVATURE, public_dataset_size
from beam_dp.algorithms import spec
from beam_dp.algorithms.spec import Algorithm, Privacy, Problem, TrainResult, option
from beam_dp.block import Block

OBJECTIVE_RELEASE = "objective_perturbation"
OUTPUT_RELEASE = "objective_perturbation_output_noise"
MODELS = ("logistic", "huber", "softmax")
# The objective perturbation's share of the budget: the paper's half, at most 1 (module docstring).
OBJECTIVE_SHARE = 0.5
OBJECTIVE_EPSILON_CAP = 1.0
# P[||G|| > its bound] <= 2^-TAIL_BITS (Gaussian concentration: ||G|| <= sigma1 (sqrt(D) + t)
# but with probability exp(-t^2 / 2)).
TAIL_BITS = 100
# Default alpha: the output noise's standard deviation is this fraction of the objective
# noise's effect on the minimizer, sigma1 / (n mu).
OUTPUT_NOISE_FRACTION = 0.01
# The diameter the defaults use for an unconstrained run (the unit l2 ball's).
REFERENCE_DIAMETER = 2.0
# A row's feature bound as used by the constants: the clip's bound times this (the clip rounds).
BOUND_MARGIN = 1.0 + 2.0 ** -40
UNIT_ROUNDOFF = 2.0 ** -53
DEFAULT_MAX_PASSES = 5000
# A count rounded to two significant digits, n, is below ROUNDED_COUNT_RATIO * n rows
# (mirror_descent.public_dataset_size: n >= 10 units of its last digit, the count within half a
# unit of it).
ROUNDED_COUNT_RATIO = 1.05


# ------------------------------------------------------------------------------ the options

@dataclasses.dataclass
class ObjectivePerturbationOptions(ConstraintOptions):
    regularization: float | None = option(
        None, "lambda of lambda ||theta||_2^2 (intercept included); default the larger "
              "of Thm 2's L / (sqrt(n) ||C||_2) and the least the guarantee allows", low=0)
    accuracy: float | None = option(
        None, "alpha: the solver's certified accuracy (the output noise grows as "
              "sqrt(alpha)); default the smaller of Thm 2's and one whose output noise "
              "is a hundredth of the objective noise's effect", low=0, low_open=True)
    feature_bound: float | None = option(
        None, "F: every row's features are clipped to l2 norm F (applied again by "
              "predict); default --feature-norm if given, else sqrt(d)",
        low=0, low_open=True)
    feature_norm: float | None = option(
        None, "normalize every feature vector to this l2 norm instead of clipping (recorded in "
              "model.json, applied again by predict)", low=0, low_open=True)
    max_passes: int = option(DEFAULT_MAX_PASSES, "refuse a run whose certified solve needs more "
                                                 "full passes than this (a larger "
                                                 "--regularization needs fewer)", low=1)


# ------------------------------------------------------------------------------ the objective

@dataclasses.dataclass(frozen=True)
class Smoothness:
    """The public constants of (1/n) sum_i l(theta, x_i) over C x R, all in l2."""

    lipschitz: float          # L: every per-example gradient has norm <= L
    beta: float               # every per-example Hessian <= beta I
    strong_convexity: float   # Delta: every per-example Hessian >= Delta I (0 for a GLM)
    rank: int                 # r = min(D, 2 * the per-example Hessian's rank)


class GlmGradient:
    """Sums of a GLM's per-example loss gradients at theta (k, d + 1), rows' features clipped to
    l2 norm F first (``features.ClipRows``; or normalized, ``features.NormalizeRows``), so that the
    constants of ``smoothness`` hold on any data. Beam-free and picklable."""

    def __init__(self, loss: losses_mod.GlmLoss, transform, fit_intercept: bool):
        self.loss, self.transform, self.fit_intercept = loss, transform, fit_intercept

    def partial_sum(self, block: Block, theta: np.ndarray) -> np.ndarray:
        block = self.transform(block)
        out = np.zeros(theta.shape)
        m, d = block.features.shape
        if m == 0:
            return out
        if sp.issparse(block.features):
            # CSR rows (categorical columns): the block's sum in one sparse product, O(nnz k + d k)
            derivative = self.loss.derivative(losses_mod.scores(theta, block.features), block.labels)
            out[:, :-1] = np.asarray(block.features.T @ derivative).T
            if self.fit_intercept:
                out[:, -1] = derivative.sum(axis=0)
            return out
        rows = max(256, clipping.CHUNK_BYTES // (8 * (d + 1)))
        for start in range(0, m, rows):
            x = block.features[start:start + rows]
            derivative = self.loss.derivative(losses_mod.scores(theta, x),
                                              block.labels[start:start + rows])
            out[:, :-1] += derivative.T @ x
            if self.fit_intercept:
                out[:, -1] += derivative.sum(axis=0)
        return out


def glm_smoothness(loss: losses_mod.GlmLoss, feature_bound: float, dim: int,
                   fit_intercept: bool) -> Smoothness:
    """L, beta and r of a GLM on rows with ||z||_2 <= F: B = ||(z, 1)||_2 <= sqrt(F^2 + 1)."""
    bound = feature_bound * BOUND_MARGIN
    row = math.sqrt(bound ** 2 + (1.0 if fit_intercept else 0.0))
    k = loss.outputs()
    coordinates = k * (dim + int(fit_intercept))
    hessian_rank = max(1, k - 1) if loss.name == "softmax" else 1
    return Smoothness(loss.score_lipschitz * row, CURVATURE[loss.name] * row ** 2, 0.0,
                      min(coordinates, 2 * hessian_rank))


# ------------------------------------------------------------------------------ the plan

def split_budget(epsilon: float, delta: float) -> tuple[float, float]:
    """(eps1, delta1) of the objective perturbation (module docstring)."""
    return min(OBJECTIVE_SHARE * epsilon, OBJECTIVE_EPSILON_CAP), delta / 2.0


def objective_sigma(smooth: Smoothness, epsilon1: float, delta1: float) -> float:
    """sigma1 of G: sqrt(32 ln(1.25 / delta1)) L / eps1 (Alg 5 at (eps1, delta1))."""
    return math.sqrt(32.0 * math.log(1.25 / delta1)) * smooth.lipschitz / epsilon1


def least_regularization(smooth: Smoothness, epsilon1: float, n: int) -> float:
    """The least lambda for the objective perturbation's guarantee: r beta / (eps1 n), less the
    loss's own strong convexity over the n - 1 rows neighbours share, at least 0."""
    needed = smooth.rank * smooth.beta / (epsilon1 * n)
    return max(0.0, needed - smooth.strong_convexity * (n - 1) / (2.0 * n))


def output_multiplier(epsilon: float, delta: float, epsilon1: float, delta1: float,
                      accountant: str, prior: events.DpEvent | None = None) -> float:
    """H's noise multiplier sigma2 / r0: the least whose Gaussian, composed with the objective
    perturbation's (eps1, delta1) and ``prior`` (the releases already in the run's ledger: the
    quality check's, reserved before training), meets (epsilon, delta) by ``accountant``
    (replace-one). The output Gaussian is the part calibrated, so it is the one that makes room
    for the check: eps1 and delta1 stay the paper's split, the composition is dp_accounting's."""
    objective = accounting.ApproxDpEvent(epsilon1, delta1)

    def make(multiplier):
        return accounting.after(prior, events.ComposedDpEvent(
            [objective, events.GaussianDpEvent(multiplier)]))
    rest = max(epsilon - epsilon1, 1e-3)
    guess = 2.0 * math.sqrt(2.0 * math.log(1.25 / (delta - delta1))) / rest
    return accounting.calibrate_noise_multiplier(make, epsilon, delta, accountant,
                                                 accounting.REPLACE_ONE, guess=guess, slope=-1.0)


def solver_plan(smooth: Smoothness, dim: int, n: int, regularization: float, sigma1: float,
                multiplier2: float, accuracy: float | None, diameter: float, width: float,
                start_norm: float, epsilon: float, delta: float, rows_per_n: float = 1.0) -> dict:
    """The public plan of the certified solve: mu, L_s, kappa, alpha (the default of the module
    docstring, never below what float64 can certify), the rounding allowance e, the number of
    passes. ``rows_per_n``: a public bound on (rows in the input) / n, for the loss term's
    smoothness and gradient (ROUNDED_COUNT_RATIO when n is the rounded count); the number of
    accelerated passes K (then one certificate pass), r0 and sigma2."""
    lam = regularization
    mu = 2.0 * lam + smooth.strong_convexity
    if mu <= 0.0:
        raise ValueError("the objective is not strongly convex: give --regularization above 0")
    smoothness = rows_per_n * smooth.beta + 2.0 * lam
    kappa = max(1.0, smoothness / mu)
    noise_bound = sigma1 * (math.sqrt(dim) + math.sqrt(2.0 * TAIL_BITS * math.log(2.0)))
    initial_gradient = rows_per_n * smooth.lipschitz + noise_bound / n + 2.0 * lam * start_norm
    gap0 = initial_gradient ** 2 / (2.0 * mu)
    # ||theta|| <= ||x0|| + 2 ||grad J(x0)|| / mu on the iterates' region (strong convexity), so
    # the rounding allowance has a public bound: summing n gradients of norm <= L in any order is
    # off by <= (n - 1) u sum ||g_i||, the scores by <= (d + 1) u ||theta|| ||x||, and so on;
    # n is doubled (the public n may be a rounded count) and all of it doubled again.
    radius = start_norm + 2.0 * initial_gradient / mu
    allowance = 2.0 * (2.0 * n + 2.0 * dim + 64.0) * UNIT_ROUNDOFF * (
        rows_per_n * smooth.lipschitz + smoothness * radius + noise_bound / n)
    floor = 64.0 * allowance ** 2 / mu + 1e-30
    if accuracy is None:
        theorem = smooth.lipschitz * diameter / n ** 1.5
        if math.isfinite(width) and width > 0:
            theorem = min(theorem, epsilon ** 2 * smooth.lipschitz * diameter ** 3
                          / (width ** 2 * math.log(1.0 / delta) * n ** 2.5))
        # sigma2 = multiplier2 sqrt(2 alpha / mu) = fraction * sigma1 / (n mu)
        quiet = 0.5 * mu * (OUTPUT_NOISE_FRACTION * sigma1 / (n * mu * multiplier2)) ** 2
        alpha = max(min(theorem, quiet), floor)
    else:
        alpha = float(accuracy)
        if alpha < floor:
            raise ValueError("--accuracy is below what float64 sums can certify at this n and "
                             "regularization; raise it (or leave it to its default)")
    target = alpha / (16.0 * kappa)
    if kappa <= 1.0:
        passes = 1
    else:
        rate = -math.log1p(-1.0 / math.sqrt(kappa))
        passes = max(1, math.ceil(math.log(max(2.0 * gap0 / target, 1.0)) / rate))
    momentum = (math.sqrt(kappa) - 1.0) / (math.sqrt(kappa) + 1.0)
    radius0 = math.sqrt(2.0 * alpha / mu)
    return {"regularization": lam, "strong_convexity": mu, "smoothness": smoothness,
            "condition_number": kappa, "momentum": momentum, "accuracy": alpha,
            "accuracy_floor": floor, "rounding_allowance": allowance,
            "accelerated_passes": passes, "passes": passes + 1, "initial_gap_bound": gap0,
            "noise_norm_bound": noise_bound, "solution_distance_bound": radius0,
            "output_sigma": multiplier2 * radius0}


# ------------------------------------------------------------------------------ the solver

def project_model(constraint: geometry.Constraint, theta: np.ndarray,
                  fit_intercept: bool) -> np.ndarray:
    """Onto C x R: each output's coefficients onto C, the intercept free (0 if absent)."""
    out = theta.copy()
    out[:, :-1] = constraint.project(theta[:, :-1])
    if not fit_intercept:
        out[:, -1] = 0.0
    return out


@dataclasses.dataclass
class SolverState:
    """The solver's iterates x_k, x_{k-1} (never released, never written), the pass count, and
    the certificate after the last pass."""

    x: np.ndarray
    previous: np.ndarray
    step: int = 0
    certificate: float | None = None


@dataclasses.dataclass(frozen=True)
class SolverPass:
    """One gradient pass of the certified solve as a full-batch stage (module docstring)."""

    gradient: object            # .partial_sum(block, theta) -> sum of per-example gradients
    shape: tuple
    fit_intercept: bool
    constraint: geometry.Constraint
    linear_term: np.ndarray     # b = G / n (shaped like theta; 0 for an absent intercept)
    regularization: float
    normalizer: float           # the public n
    smoothness: float           # L_s
    strong_convexity: float     # mu
    momentum: float
    accelerated_passes: int     # K; pass K (0-based) is the certificate pass
    rounding_allowance: float

    def project(self, theta: np.ndarray) -> np.ndarray:
        return project_model(self.constraint, theta, self.fit_intercept)

    def query(self, state: SolverState) -> np.ndarray:
        if 0 < state.step < self.accelerated_passes:
            return state.x + self.momentum * (state.x - state.previous)
        return state.x

    def partial_sum(self, block: Block, state: SolverState) -> np.ndarray:
        return self.gradient.partial_sum(block, self.query(state))

    def zero_sum(self) -> np.ndarray:
        return np.zeros(self.shape)

    def apply(self, state: SolverState, total: np.ndarray) -> SolverState:
        y = self.query(state)
        gradient = total / self.normalizer + self.linear_term + 2.0 * self.regularization * y
        if not self.fit_intercept:
            gradient[:, -1] = 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            x_next = self.project(y - gradient / self.smoothness)
        if state.step < self.accelerated_passes:
            return SolverState(x_next, state.x, state.step + 1)
        mapping = float(np.linalg.norm(self.smoothness * (y - x_next)))
        certificate = (2.0 * mapping + self.rounding_allowance) ** 2 / (2.0 * self.strong_convexity)
        if not math.isfinite(certificate):
            certificate = math.inf
        return SolverState(x_next, state.x, state.step + 1, certificate)

    # -- the one-run audit (beam_dp.audit): canaries are examples of every pass

    @property
    def canary_releases(self) -> tuple:
        return (OBJECTIVE_RELEASE, OUTPUT_RELEASE)

    def canary_sum(self, state: SolverState, canaries) -> np.ndarray:
        """The canaries' gradients at this pass's query point: canary i is the row (F e_i, label
        -1) if included, else its replacement (F e_i, label +1) (replace-one: the same size, one
        example differs), on its own column. Single-output GLMs (the audit's models)."""
        gradient = self.gradient
        y = self.query(state)
        bound = gradient.transform.norm
        columns = canaries.columns
        scores = bound * y[0, columns] + (y[0, -1] if self.fit_intercept else 0.0)
        # Encoded labels: -1 (logistic's negative class; huber's target -1) pushes the column
        # down, +1 up.
        labels = np.where(canaries.included, -1.0, 1.0)
        derivative = gradient.loss.derivative(scores[:, None], labels)[:, 0]
        out = np.zeros(self.shape)
        out[0, columns] = derivative * bound
        if self.fit_intercept:
            out[0, -1] = derivative.sum()
        return out


def model_noise(seed: int, stream: int, shape: tuple, sigma: float,
                fit_intercept: bool) -> np.ndarray:
    """N(0, sigma^2) shaped like theta (0 for an absent intercept), from its own stream of the
    root seed: G (STREAM_OBJECTIVE) or H (STREAM_OUTPUT)."""
    noise = mechanisms.gaussian_noise(mechanisms.secure_generator(seed, stream), shape, sigma)
    if not fit_intercept:
        noise[:, -1] = 0.0
    return noise


def certified_solve(aggregator, gradient, constraint: geometry.Constraint, shape: tuple,
                    fit_intercept: bool, n: int, regularization: float, linear_term: np.ndarray,
                    start: np.ndarray, plan: dict, steps_per_chunk: int | None = None,
                    progress: Callable | None = None, stage_type: type | None = None) -> np.ndarray:
    """theta2 with J(theta2) - min_{C x R} J <= plan["accuracy"], J = (1/n) sum of the losses +
    <linear_term, theta> + regularization ||theta||^2: ``plan["passes"]`` passes (``solver_plan``,
    public), then the certificate's check. Raises RuntimeError, saying no value, if it fails.
    ``stage_type``: a subclass of ``SolverPass`` (another algorithm's canaries and releases for
    the audit, e.g. output perturbation's), ``SolverPass`` by default."""
    stage = (stage_type or SolverPass)(gradient, shape, fit_intercept, constraint, linear_term, regularization,
                       float(n), plan["smoothness"], plan["strong_convexity"], plan["momentum"],
                       plan["accelerated_passes"], plan["rounding_allowance"])
    total = plan["passes"]

    def after_chunk(new_state: SolverState, k: int) -> None:
        if progress is not None:
            progress(new_state.step, total, 0.0)

    if progress is not None:
        progress(0, total, 0.0)
    state = run_chunks(aggregator, stage, SolverState(start, start.copy()), total,
                       steps_per_chunk, after_chunk)
    if state.certificate is None or not state.certificate <= plan["accuracy"]:
        # (No value is said: the certificate is a function of the data.)
        raise RuntimeError("the solver did not certify its accuracy within the planned passes; "
                           "nothing is released (this should not happen: please report it)")
    return state.x


# Stream ids of G and H (other algorithms use mechanisms.STREAM_* 1-4 and per-step streams).
STREAM_OBJECTIVE = 41
STREAM_OUTPUT = 42


def perturbed_minimizer(aggregator, gradient, smooth: Smoothness, constraint: geometry.Constraint,
                        shape: tuple, fit_intercept: bool, n: int, privacy: Privacy,
                        regularization: float | None, accuracy: float | None, seed: int,
                        steps_per_chunk: int | None = None, max_passes: int = DEFAULT_MAX_PASSES,
                        progress: Callable | None = None, ledger: accounting.Ledger | None = None,
                        rows_per_n: float = 1.0):
    """Algorithms 1/2 end to end over ``aggregator``'s data: returns (model theta, public plan).
    Records both releases in ``ledger`` once the model exists (admitted before the solve).
    ``rows_per_n``: a public bound on the input's rows over n (``solver_plan``)."""
    epsilon, delta = privacy.epsilon, privacy.delta
    epsilon1, delta1 = split_budget(epsilon, delta)
    dim = int(np.prod(shape)) - (0 if fit_intercept else shape[0])
    d = shape[1] - 1
    sigma1 = objective_sigma(smooth, epsilon1, delta1)
    least = least_regularization(smooth, epsilon1, n)
    diameter = constraint.diameter_l2(d) if constraint.kind != "none" else REFERENCE_DIAMETER
    diameter = math.sqrt(shape[0]) * (diameter if diameter > 0 else REFERENCE_DIAMETER)
    width = shape[0] * constraint.gaussian_width(d)
    if regularization is None:
        lam = max(smooth.lipschitz / (math.sqrt(n) * diameter), least)
    else:
        lam = float(regularization)
        if lam < least * (1.0 - 1e-12):
            raise ValueError("--regularization is below the least the objective perturbation's "
                             "guarantee allows at this epsilon and n (r beta / (eps1 n)); raise "
                             "it or leave it to its default")
    multiplier2 = output_multiplier(epsilon, delta, epsilon1, delta1, privacy.accountant,
                                    accounting.prior_event(ledger))
    start = project_model(constraint, np.zeros(shape), fit_intercept)
    plan = solver_plan(smooth, dim, n, lam, sigma1, multiplier2, accuracy, diameter, width,
                       float(np.linalg.norm(start)), epsilon, delta, rows_per_n)
    if plan["passes"] > max_passes:
        raise ValueError(f"the certified solve needs {plan['passes']} full passes over the data, "
                         f"more than --max-passes {max_passes}: raise --regularization (fewer "
                         "passes) or --max-passes")
    plan.update(sigma1=sigma1, epsilon1=epsilon1, delta1=delta1, least_regularization=least,
                output_multiplier=multiplier2, diameter=diameter,
                gaussian_width=width if math.isfinite(width) else None,
                solver_delta_bound=(1.0 + math.exp(epsilon)) * 2.0 ** -TAIL_BITS)
    objective_event = accounting.ApproxDpEvent(epsilon1, delta1)
    output_event = events.GaussianDpEvent(multiplier2)
    if ledger is not None:
        ledger.admit(events.ComposedDpEvent([ledger.event(), objective_event, output_event])
                     if ledger.releases else events.ComposedDpEvent([objective_event, output_event]))

    noise = model_noise(seed, STREAM_OBJECTIVE, shape, sigma1, fit_intercept)
    solution = certified_solve(aggregator, gradient, constraint, shape, fit_intercept, n, lam,
                               noise / n, start, plan, steps_per_chunk, progress)
    del noise
    output = model_noise(seed, STREAM_OUTPUT, shape, plan["output_sigma"], fit_intercept)
    theta = project_model(constraint, solution + output, fit_intercept)
    if ledger is not None:
        common = dict(relation="replace-one", regularization=lam)
        ledger.record(OBJECTIVE_RELEASE, objective_event,
                      mechanism="objective perturbation (paper 004, Lemma 5 / Iyengar et al. "
                                "2019): G ~ N(0, sigma1^2 I) in the objective",
                      sigma1=sigma1, epsilon=epsilon1, delta=delta1, lipschitz=smooth.lipschitz,
                      smoothness=smooth.beta, hessian_rank_bound=smooth.rank,
                      noise="float Gaussian (numpy)", **common)
        ledger.record(OUTPUT_RELEASE, output_event,
                      mechanism="Gaussian mechanism on the certified solution: H ~ N(0, sigma2^2 "
                                "I), sensitivity 2 sqrt(2 alpha / mu) (replace-one)",
                      noise_multiplier=multiplier2, sigma=plan["output_sigma"],
                      accuracy=plan["accuracy"], solver_delta_bound=plan["solver_delta_bound"],
                      noise="float Gaussian (numpy)", **common)
    return theta, plan


# ------------------------------------------------------------------------------ train

def check_privacy(privacy: Privacy) -> None:
    """What the mechanism cannot serve, known before any data is read."""
    if privacy.epsilon is None:
        raise ValueError("objective-perturbation calibrates two mechanisms to a target: give "
                         "--epsilon (not --noise-multiplier)")
    spec.check_replace_one_float_request(
        "objective-perturbation", privacy, "Gaussian",
        "objective perturbation (Lemma 5)")


def train(options: ObjectivePerturbationOptions, problem: Problem, aggregator, seed: int,
          ledger: accounting.Ledger, progress) -> TrainResult:
    privacy = problem.privacy
    check_privacy(privacy)
    if ledger.neighbouring != accounting.REPLACE_ONE:
        raise ValueError("objective-perturbation's guarantee is for replace-one neighbours")
    loss, d = problem.loss, problem.dim
    constraint = options.constraint_set(d)
    if options.feature_norm is not None:
        transform = features.NormalizeRows(float(options.feature_norm))
        bound = float(options.feature_norm)
    else:
        bound = float(options.feature_bound) if options.feature_bound is not None else math.sqrt(d)
        transform = features.ClipRows(bound)
    smooth = glm_smoothness(loss, bound, d, problem.fit_intercept)
    dataset_size = public_dataset_size(privacy.num_examples, aggregator)
    n = dataset_size["value"]
    # The solve's plan assumes the loss term (1/n) sum over the rows is beta-smooth: at most n
    # rows. The row count is public under replace-one, so a declared n below it is refused here
    # (rather than by a certificate that cannot hold after every planned pass).
    if privacy.num_examples is not None and aggregator.count() > n:
        raise ValueError("--num-examples is below the number of rows in the input: "
                         "objective-perturbation's solver is planned for at most that many rows")
    # n rounded to two significant digits: the rows are fewer than 1.05 n, a public bound (the
    # exact ratio would reveal the count through the plan in the report).
    rows_per_n = 1.0 if privacy.num_examples is not None else ROUNDED_COUNT_RATIO
    shape = (loss.outputs(), d + 1)
    gradient = GlmGradient(loss, transform, problem.fit_intercept)

    theta, plan = perturbed_minimizer(
        aggregator, gradient, smooth, constraint, shape, problem.fit_intercept, n, privacy,
        options.regularization, options.accuracy, seed, problem.steps_per_chunk,
        options.max_passes, progress, ledger, rows_per_n)
    details = dict(plan)
    details.update(
        constraint=constraint.kind, feature_bound=bound, lipschitz=smooth.lipschitz,
        loss_smoothness=smooth.beta, hessian_rank_bound=smooth.rank,
        budget_split=(f"objective perturbation (eps1, delta1) = ({plan['epsilon1']:.6g}, "
                      f"{plan['delta1']:.6g}) (the paper's half, capped at 1); the output "
                      "Gaussian takes the rest by PLD composition"),
        accounting=("the objective perturbation as an ApproxDpEvent (Lemma 5: what it proves) "
                    "and the output noise as a GaussianDpEvent, composed by PLD (tighter than "
                    "the paper's basic composition with the classical Gaussian bound)"),
        relation="replace-one (the paper's Def. 1); n is public under it",
        solver=("V-FISTA, a number of passes fixed in advance from public constants, then one "
                "certificate pass; the iterates are never released"),
        gaussian_width_note=("G_C of the coefficients' set (times the number of outputs): the "
                             "projection makes the output noise's error scale with it"))
    return TrainResult(theta, ledger, plan["output_multiplier"], 1.0, plan["passes"], None,
                       dataset_size, details, sampling="full batch", expected_batch_size=float(n),
                       feature_transform=features.spec(transform),
                       details_name="algorithm_parameters", constraint=constraint.to_json())


OBJECTIVE_PERTURBATION = Algorithm(
    "objective-perturbation", "a model that must lie in a known convex set (l1 ball for sparse "
                              "models, simplex, box, hull of given points): noise on the "
                              "objective, a certified solve, projection; its error grows with "
                              "the set's Gaussian width, not sqrt(d); replace-one (n public)",
    MODELS, ObjectivePerturbationOptions, train, relation=accounting.REPLACE_ONE,
    checkpoints=False,
    why_no_checkpoints="its solver's iterates are not private, so they are never written; a run "
                       "that stops is rerun from the start", check_privacy=check_privacy,
    quality_check=True)


# ------------------------------------------------------------------------------ a test design

class MeanPointGradient:
    """The mean-point problem of the note §4.3(b) (the lower bound's hard instance): l(theta; x)
    = 1/2 ||theta - x||^2, each example x_i = s_i e_{j_i} given as the row (j_i, s_i) (1-sparse:
    d = 10^4 and n = 5 * 10^4 would not fit densely). Its gradient is theta - x; on C within the
    unit l2 ball L = 2, beta = Delta = 1 and r = d. For pipelines/geometry_benchmark.py and its
    slow test: theta is (1, d + 1) without an intercept."""

    def __init__(self, dim: int):
        self.dim = dim

    def partial_sum(self, block: Block, theta: np.ndarray) -> np.ndarray:
        index = block.features[:, 0].astype(np.int64)
        sign = np.clip(block.features[:, 1], -1.0, 1.0)
        out = np.zeros(theta.shape)
        out[0, :-1] = len(block) * theta[0, :-1] - np.bincount(index, sign, minlength=self.dim)
        return out


def mean_point_smoothness(dim: int) -> Smoothness:
    return Smoothness(lipschitz=2.0, beta=1.0, strong_convexity=1.0, rank=dim)


def mean_point_design(n: int, dim: int, seed: int) -> tuple[Block, np.ndarray]:
    """n examples x_i = s_i e_j (j uniform, s = +-1 with equal probability: the mean is 0), as one
    block of (j, s) rows, and their empirical mean (dense)."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, dim, n)
    sign = rng.choice(np.array([-1.0, 1.0]), n)
    mean = np.bincount(index, sign, minlength=dim) / n
    return Block(np.column_stack([index.astype(np.float64), sign]), np.zeros(n)), mean


def mean_point_excess(dim: int, kind: str, n: int = 50_000, epsilon: float = 1.0,
                      delta: float = 1e-5, seed: int = 0) -> dict:
    """One run of the note's §4.3(b) experiment: the mean-point problem over C = ``kind`` of
    radius 1 (the l1 and l2 balls have the same l2 radius), lambda = 0 (the loss is 1-strongly
    convex, which the guarantee allows once n >= 2d / eps), through ``perturbed_minimizer`` on
    the local aggregator. Returns the excess empirical loss 1/2 ||theta - xbar||^2 (xbar lies in
    C, so min_C of the loss is at xbar) and the projection lemma's bound on its mean,
    1/2 (sigma1 / n) G_C (the note §4.2: E||P_C(xbar + h) - xbar||^2 <= sigma G_C for h ~
    N(0, sigma^2 I)), which ignores the tiny output noise."""
    from beam_dp.local import LocalAggregator

    block, mean = mean_point_design(n, dim, seed)
    constraint = geometry.Constraint(kind, 1.0)
    theta, plan = perturbed_minimizer(
        LocalAggregator([block]), MeanPointGradient(dim), mean_point_smoothness(dim), constraint,
        (1, dim + 1), False, n, Privacy(epsilon=epsilon, delta=delta), 0.0, None,
        seed=mechanisms.stream_key(seed, 7) >> 128)
    width = constraint.gaussian_width(dim)
    return {"excess": 0.5 * float(np.sum((theta[0, :-1] - mean) ** 2)),
            "bound": 0.5 * plan["sigma1"] / n * width if math.isfinite(width) else math.inf,
            "width": width, "sigma1": plan["sigma1"], "passes": plan["passes"]}
