"""Regularized output perturbation with an l_inf projection, for sparse gradients (paper 001,
Ghazi, Guzman, Kamath, Kumar & Manurangsi 2024, Algorithm 6 and Theorem 7.1; the note
/work/shared/papers/001, §1A "Algorithm 6", §4.2 "Solver exactness", §4.4).

The release (replace-one neighbours, the paper's; n public), Gaussian variant:

1. x_lambda = argmin_{x in X} F_S(x) + (lambda / 2) ||x||_2^2, solved to a CERTIFIED accuracy
   alpha through the Aggregator seam (``objective_perturbation.certified_solve``: V-FISTA with a
   number of passes fixed in advance from public constants, then a certificate pass; nothing of
   the solve is released);
2. x~ = x_lambda + N(0, sigma^2 I);
3. the output is an l_inf projection of x~ onto X: a point of X nearest in ||.||_inf. That
   is what makes the error scale with the sparsity s rather than d: ||output - x_lambda||_inf <=
   2 ||noise||_inf (x_lambda is in X), and a loss whose gradients are s-sparse of l2 norm <= L has
   ||grad F_S||_1 <= L sqrt(s), so F_S(output) - F_S(x_lambda) <= 2 L sqrt(s) ||noise||_inf,
   which grows like sqrt(ln d), where a Euclidean error would grow like sqrt(d).

Privacy. The objective is lambda-strongly convex and every loss L-Lipschitz, so the exact
minimizers of neighbours are within 2L / (lambda n) in l2 (Bousquet & Elisseeff); the certified
solution is within tau = sqrt(2 alpha / lambda) of the exact one on every run, so the released
point's sensitivity is 2L / (lambda n) + 2 tau (the note's §4.2). The Gaussian's multiplier is
calibrated by dp_accounting (a ``GaussianDpEvent`` under replace-one, unit L / (lambda n) + tau),
not by the classical formula. The l_inf projection is post-processing. alpha is chosen so that
tau is 1% of L / (lambda n) (never below what float64 can certify): the certificate costs 1% of
the noise. A refusal of the certificate (it cannot happen but with probability 2^-100, when the
solver's public pass count was planned for a smaller gradient) is as in objective perturbation.

The l_inf projection onto X (``linf_projection``): X = R^d, the identity; a box, the clip (also
the Euclidean projection); an l1 ball, soft-thresholding at the level whose l1 norm is the radius
(the Euclidean projection, which is also l_inf-nearest: the smallest t for which the box of
half-width t around x~ meets the ball); an l2 ball, soft-thresholding at the level found by
bisection whose l2 norm is the radius. Simplex and hull are refused.

lambda: Thm 7.1's lambda* = sqrt(2K) / D, K = 8 L^2 sqrt(s ln(1.25/delta) ln(2d/beta)) / (n eps)
(beta = 0.05), unless given. D is (A.1)'s bound on ||x*||_2 (x0 = 0), the size of the models the
release competes with: the master bound is F_S(output) - F_S(x*) <= lambda D^2 / 2 + K / lambda,
and lambda* balances the two terms for models of that size. D: a declared public bound
(``model_norm``) if given; else the l2 diameter of X with a constraint; else
(``default_model_norm``) the smaller of
* sqrt(d) (d counting the intercept), the l2 radius of the box where every coefficient is at most
  1 in magnitude. On standardized or one-hot features a coefficient is the change of the score
  per standard deviation or per category, and GLMs fitted on such data have most coefficients
  below 1 (a score change of 1 is a factor e in the odds): the unit box covers them without
  knowing which columns the data uses;
* the D at which the released Gaussian's standard deviation on a row's score, sigma L, is
  SCORE_NOISE = 1/2: sigma grows with D (sigma = m (L / (lambda n) + tau), lambda = sqrt(2K) / D),
  so competing with larger models buys a smaller bias only with noise that swamps every score.
  With many columns (2^18 hashed buckets) this is the one that binds: sqrt(d) = 512 put the noise
  at 2.75 per score on a 50,000-row click log (accuracy 0.569, below the majority class's 0.654;
  dpgd 0.751). On a few dense standardized columns the box binds.
Both are public (d, L, n, epsilon, delta; n is public under replace-one). The earlier default,
objective perturbation's REFERENCE_DIAMETER 2 (a model of norm 1), made lambda so large on the
click log that the model predicted about the base rate (0.655 against a majority class of 0.651
at 200,000 rows).

This module is the Beam-free core, run by ``pipelines/bench_sparse_mean.py``'s second table and
tests/test_sparse_mean.py on sparse linear losses (``SparseLinearGradient``); the registered
algorithm needs the sparse blocks of issue 14's first part, which do not exist yet.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.sparse as sp
from dp_accounting import dp_event as events

from beam_dp import accounting, features, geometry, mechanisms
from beam_dp.algorithms import objective_perturbation as objective
from beam_dp.algorithms import spec
from beam_dp.algorithms.spec import Algorithm, Privacy, Problem, TrainResult, option
from beam_dp.block import Block

# tau (the certified solution's distance to the exact one) as a fraction of L / (lambda n).
SOLVER_FRACTION = 0.01
# The default D's cap (``default_model_norm``): the released Gaussian's standard deviation on a
# row's score (a log-odds for logistic), sigma L, at most 1/2. Noise of std 1/2 on a score leaves
# the class of rows predicted with probability outside about (0.27, 0.73) to within 1 std, so a
# model whose scores are of order 1 keeps its confident predictions; a larger model (D) would buy
# a smaller bias term lambda D^2 / 2 only with noise that swamps every score (measured: on a click
# log of 2^18 hashed columns, D = sqrt(d) put the noise at 2.75 per score and the accuracy below
# the majority class).
SCORE_NOISE = 0.5
FAILURE_PROBABILITY = 0.05      # beta of Thm 7.1's lambda
STREAM_OUTPUT = 43
LINF_KINDS = ("none", "box", "l1-ball", "l2-ball")


def linf_projection(x: np.ndarray, constraint: geometry.Constraint) -> np.ndarray:
    """A point of ``constraint`` nearest to x in ||.||_inf (module docstring)."""
    kind = constraint.kind
    if kind == "none":
        return np.array(x, dtype=np.float64)
    if kind in ("box", "l1-ball"):
        return constraint.project(x)
    if kind != "l2-ball":
        raise ValueError(f"no l_inf projection onto a {kind} here; use one of {', '.join(LINF_KINDS)}")
    x = np.asarray(x, dtype=np.float64)
    magnitude = np.abs(x)
    if float(np.linalg.norm(x)) <= constraint.radius:
        return x.copy()
    lo, hi = 0.0, float(magnitude.max())        # ||soft(x, hi)|| = 0 <= radius
    for _ in range(200):                        # to float resolution
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if float(np.linalg.norm(np.maximum(magnitude - mid, 0.0))) > constraint.radius:
            lo = mid
        else:
            hi = mid
    out = np.sign(x) * np.maximum(magnitude - hi, 0.0)
    norm = float(np.linalg.norm(out))
    return out if norm <= constraint.radius else out * (constraint.radius / norm)


def noise_constant(lipschitz: float, sparsity: int, dim: int, n: int, epsilon: float,
                   delta: float) -> float:
    """Thm 7.1's K = 8 L^2 sqrt(s ln(1.25/delta) ln(2d/beta)) / (n eps): the master bound's noise
    term is K / lambda."""
    return (8.0 * lipschitz ** 2 * math.sqrt(sparsity * math.log(1.25 / delta)
                                             * math.log(2.0 * dim / FAILURE_PROBABILITY))
            / (n * epsilon))


def default_regularization(lipschitz: float, sparsity: int, dim: int, n: int, epsilon: float,
                           delta: float, diameter: float) -> float:
    """Thm 7.1's lambda* = sqrt(2K) / D."""
    return math.sqrt(2.0 * noise_constant(lipschitz, sparsity, dim, n, epsilon, delta)) / diameter


def default_model_norm(dim: int, lipschitz: float, k: float, sigma_at) -> float:
    """D without a constraint or a declared bound (module docstring): the smaller of sqrt(dim),
    the l2 radius of the unit box [-1, 1]^dim, and the D at which the released noise's standard
    deviation on a row's score, sigma L, is SCORE_NOISE. ``sigma_at(lambda)``: the plan's sigma
    at lambda (m (L / (lambda n) + tau), tau the certified distance, which float64's rounding
    bound makes larger than 1% of L / (lambda n) at large n and d); it falls as lambda grows, and
    lambda = sqrt(2K) / D. Public: from d, L, n (public under replace-one), epsilon and delta
    only."""
    root = math.sqrt(2.0 * k)
    box = math.sqrt(dim)
    if sigma_at(root / box) * lipschitz <= SCORE_NOISE:
        return box
    low, high = root / box, 2.0 * root / box              # sigma L above, then below the target
    while sigma_at(high) * lipschitz > SCORE_NOISE:
        low, high = high, 2.0 * high
    for _ in range(60):                                   # to about 1e-12 in log lambda
        middle = math.sqrt(low * high)
        if sigma_at(middle) * lipschitz > SCORE_NOISE:
            low = middle
        else:
            high = middle
    return root / high


def plan_release(smooth: objective.Smoothness, constraint: geometry.Constraint, dim: int, n: int,
                 epsilon: float, delta: float, sparsity: int, regularization: float | None = None,
                 accountant: str = "pld", rows_per_n: float = 1.0,
                 model_norm: float | None = None, prior: events.DpEvent | None = None) -> dict:
    """The public plan of Algorithm 6 (public constants only, no data): lambda, the certified
    solve's plan (``objective.solver_plan``), tau, the sensitivity unit L / (lambda n) + tau, the
    calibrated multiplier, sigma and the ``GaussianDpEvent``. ``rows_per_n``: a public bound on
    (rows in the input) / n, for the solver's smoothness (the sensitivity is 2L / (lambda n)
    whatever the number of rows: one term of weight 1/n differs)."""
    if constraint.kind not in LINF_KINDS:
        raise ValueError(f"output perturbation needs X in {', '.join(LINF_KINDS)}")
    # the multiplier is for the unit sensitivity, whatever lambda: calibrated first, as the
    # default D needs it. ``prior``: the releases already in the run's ledger (the quality
    # check's, reserved before training); the Gaussian is calibrated so that it composed after
    # them (dp_accounting's PLD) meets the target, as the add/remove algorithms do. (lambda's
    # default and the solver's plan still read the whole epsilon: they are utility choices.)
    multiplier = accounting.calibrate_noise_multiplier(
        lambda m: accounting.after(prior, events.GaussianDpEvent(m)), epsilon, delta, accountant,
        accounting.REPLACE_ONE,
        guess=2.0 * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon, slope=-1.0)
    k = noise_constant(smooth.lipschitz, sparsity, dim, n, epsilon, delta)
    shape = (1, dim + 1)
    start_norm = float(np.linalg.norm(objective.project_model(constraint, np.zeros(shape), False)))

    def solve_plan(lam: float, diameter: float) -> tuple[dict, float, float]:
        """The certified solve's plan at lambda, tau and the sensitivity unit."""
        spread = smooth.lipschitz / (lam * n)             # half the exact minimizers' sensitivity
        # J's ||theta||^2 coefficient is lambda / 2 (strong convexity lambda)
        plan = objective.solver_plan(smooth, dim, n, lam / 2.0, 0.0, 1.0, None, diameter,
                                     math.inf, start_norm, epsilon, delta, rows_per_n)
        accuracy = max(0.5 * plan["strong_convexity"] * (SOLVER_FRACTION * spread) ** 2,
                       plan["accuracy_floor"])
        plan = objective.solver_plan(smooth, dim, n, lam / 2.0, 0.0, 1.0, accuracy, diameter,
                                     math.inf, start_norm, epsilon, delta, rows_per_n)
        tau = math.sqrt(2.0 * accuracy / plan["strong_convexity"])
        return plan, tau, spread + tau                    # a replacement moves it by 2 units

    if model_norm is not None:
        diameter, source = float(model_norm), "declared (--model-norm)"
    elif constraint.kind != "none":
        diameter, source = constraint.diameter_l2(dim), "the l2 diameter of the constraint set"
    else:
        diameter = default_model_norm(dim, smooth.lipschitz, k,
                                      lambda lam: multiplier * solve_plan(lam, 1.0)[2])
        source = ("the unit box's radius sqrt(d)" if diameter >= math.sqrt(dim) else
                  f"the cap where the noise's std on a row's score is {SCORE_NOISE:g}")
    lam = float(regularization) if regularization is not None else math.sqrt(2.0 * k) / diameter
    plan, tau, unit = solve_plan(lam, diameter)
    for unused in ("output_sigma", "noise_norm_bound"):    # (objective perturbation's)
        plan.pop(unused, None)
    plan.update(regularization=lam, sigma=multiplier * unit, noise_multiplier=multiplier,
                sensitivity_unit=unit, solver_distance=tau, diameter=diameter,
                diameter_source=source if regularization is None else "unused (--regularization)",
                event=events.GaussianDpEvent(multiplier))
    return plan


def noiseless_solution(aggregator, gradient, constraint: geometry.Constraint, dim: int, n: int,
                       plan: dict, steps_per_chunk: int | None = None,
                       progress=None) -> np.ndarray:
    """x_lambda, certified to plan["accuracy"] (never released; the noise is added by
    ``execute``): the coefficients, a vector of ``dim``."""
    shape = (1, dim + 1)
    start = objective.project_model(constraint, np.zeros(shape), False)
    solution = objective.certified_solve(aggregator, gradient, constraint, shape, False, n,
                                         plan["regularization"] / 2.0, np.zeros(shape), start,
                                         plan, steps_per_chunk, progress,
                                         stage_type=OutputSolverPass)
    return solution[0, :-1]


class OutputSolverPass(objective.SolverPass):
    """The certified solve's pass (``objective.SolverPass``), with this algorithm's canaries for
    the one-run audit (beam_dp.audit): the canaries are examples of every pass, and they enter
    one release, the Gaussian on the solution (RELEASE)."""

    @property
    def canary_releases(self) -> tuple:
        return (RELEASE,)

    def canary_sum(self, state: objective.SolverState, canaries) -> np.ndarray:
        """The canaries' gradients at this pass's query point: canary i is the row (F e_i, label
        -1) if included, else its replacement (F e_i, label +1) (replace-one: one example
        differs, the worst case for a logistic or Huber loss up to the derivative's size), on its
        own column. With the intercept a coordinate of x (``InterceptAsCoordinate``) the row is
        (F e_i, 1), of norm sqrt(F^2 + 1) = L, and its gradient enters that coordinate too."""
        wrapped = isinstance(self.gradient, InterceptAsCoordinate)
        glm = self.gradient.glm if wrapped else self.gradient
        y = self.query(state)
        bound = glm.transform.norm
        columns = canaries.columns
        # the solver's x: coefficients, then (wrapped) the intercept, then an unused column
        intercept = self.shape[1] - 2
        scores = bound * y[0, columns] + (y[0, intercept] if wrapped else 0.0)
        # encoded labels: -1 (logistic's negative class; huber's target -1) pushes the column
        # down, +1 up
        labels = np.where(canaries.included, -1.0, 1.0)
        derivative = glm.loss.derivative(scores[:, None], labels)[:, 0]
        out = np.zeros(self.shape)
        out[0, columns] = derivative * bound
        if wrapped:
            out[0, intercept] = derivative.sum()
        return out


def execute(aggregator, gradient, constraint: geometry.Constraint, dim: int, n: int, plan: dict,
            seed: int, project: bool = True, steps_per_chunk: int | None = None,
            progress=None) -> tuple[np.ndarray, float]:
    """Steps 1-4 of Algorithm 6 with ``plan`` (``plan_release``): (the release, ||noise||_inf)."""
    solution = noiseless_solution(aggregator, gradient, constraint, dim, n, plan,
                                  steps_per_chunk, progress)
    noise = mechanisms.gaussian_noise(mechanisms.secure_generator(seed, STREAM_OUTPUT), dim,
                                      plan["sigma"])
    noisy = solution + noise
    out = linf_projection(noisy, constraint) if project else constraint.project(noisy)
    return out, float(np.max(np.abs(noise)))


def release(aggregator, gradient, smooth: objective.Smoothness, constraint: geometry.Constraint,
            dim: int, n: int, epsilon: float, delta: float, sparsity: int, seed: int,
            regularization: float | None = None, accountant: str = "pld",
            project: bool = True, rows_per_n: float = 1.0) -> tuple[np.ndarray, dict, float]:
    """Algorithm 6 over ``aggregator``'s rows (coefficients only, no intercept): (the release,
    the public plan with its DpEvent, ||noise||_inf). ``project`` False: the Euclidean projection
    instead of the l_inf one (the dense baseline the benchmark compares with). ||noise||_inf is
    for the master bound's check in tests; it must not leave the job."""
    plan = plan_release(smooth, constraint, dim, n, epsilon, delta, sparsity, regularization,
                        accountant, rows_per_n)
    out, noise_inf = execute(aggregator, gradient, constraint, dim, n, plan, seed, project)
    return out, plan, noise_inf


class SparseLinearGradient:
    """Sparse linear losses f(x; z) = <z, x>, each z s-sparse with ||z||_2 <= L (the paper's
    (A.5), (A.7)): the gradient sum is the sum of the rows, whatever x. Blocks hold dense
    features only (until issue 14's sparse blocks), so this test design holds the CSR rows itself
    and each Block stands for rows [row_start, row_start + len). The rows are l2-clipped to L
    (``stats.clip_sparse_rows``), so the bound holds on any rows."""

    def __init__(self, rows, lipschitz: float):
        from beam_dp import stats
        self.rows = stats.clip_sparse_rows(rows, 2, lipschitz)

    def partial_sum(self, block: Block, theta: np.ndarray) -> np.ndarray:
        out = np.zeros(theta.shape)
        part = self.rows[block.row_start:block.row_start + len(block)]
        out[0, :-1] = np.asarray(part.sum(axis=0)).ravel()
        return out

    def blocks(self, size: int) -> list[Block]:
        """Placeholder Blocks (one zero feature column) that index the rows in ranges of
        ``size``: what the local aggregator loops over."""
        n = self.rows.shape[0]
        return [Block(np.zeros((min(size, n - start), 1)), np.zeros(min(size, n - start)),
                      row_start=start) for start in range(0, n, size)]


def sparse_linear_smoothness(lipschitz: float, dim: int) -> objective.Smoothness:
    """A linear loss: L-Lipschitz, 0-smooth, rank 0 (no Hessian)."""
    return objective.Smoothness(lipschitz, 0.0, 0.0, 0)


# ------------------------------------------------------------------------------ the registered algorithm
#
# ``output-perturbation``: Algorithm 6 on a GLM (logistic, huber), dense rows or CSR rows
# (categorical columns), through the Aggregator seam (Beam or local). Softmax is left out: the core
# releases one coefficient vector (k = 1).
#
# * Rows. Every row's features are l2-clipped to F (--feature-bound): dense rows by
#   ``features.ClipRows`` (recorded in model.json; predict clips too); CSR rows by
#   ``SparseClipRows`` (``stats.clip_sparse_rows``, never densified), which is NOT recorded in
#   model.json (the recorded transforms are dense-only), so predict does not clip sparse rows. With
#   only categorical columns a row is one-hot per column, norm sqrt(#columns) <= sqrt(s) = the
#   default F, so the clip is the identity there and predict agrees with training; numeric columns
#   whose row norm exceeds F are clipped in training only (give a larger --feature-bound, or scale
#   them, to avoid it). F's default: sqrt(s) for sparse rows (s = nonzeros per row, from the
#   encoding), sqrt(d) for dense ones.
# * The intercept. The core solves coefficients only; with an intercept the model is solved as
#   d + 1 coordinates x = (w, b), the intercept a constant feature 1 of every row, so the row bound
#   is ||(z, 1)||_2 <= sqrt(F^2 + 1) (``glm_smoothness`` with the intercept), the sparsity s + 1,
#   and the Gaussian and the l_inf projection act on all d + 1 coordinates. That is exact for X =
#   R^d (--constraint none, the default). With a constraint the intercept would have to lie in X
#   too, which is not what the other algorithms mean by a constraint (the intercept free), so a
#   constrained run needs --no-intercept (refused otherwise).
# * n: public under replace-one, --num-examples or the row count rounded to two significant digits
#   (as objective-perturbation; the solver is then planned for up to 1.05 n rows).
# * The ledger: one ``GaussianDpEvent`` of the calibrated multiplier under replace-one.

RELEASE = "output_perturbation_gaussian"
MODELS = ("logistic", "huber")


@dataclasses.dataclass(frozen=True)
class SparseClipRows:
    """x -> x * min(1, F / ||x||_2) for CSR rows (``stats.clip_sparse_rows``, sparse throughout);
    dense rows as ``features.ClipRows``. Picklable (Beam ships it to the workers)."""

    norm: float

    def __call__(self, block: Block) -> Block:
        if not sp.issparse(block.features):
            return features.ClipRows(self.norm)(block)
        from beam_dp import stats
        return Block(stats.clip_sparse_rows(block.features, 2, self.norm), block.labels,
                     block.source, block.row_start, tag=block.tag)


class InterceptAsCoordinate:
    """A GLM's gradient sums for the core's solver with the intercept as coordinate d of x: the
    solver's theta is (1, d + 2) (coefficients, intercept, the core's unused last column), the
    GLM's (1, d + 1) (coefficients, intercept)."""

    def __init__(self, glm: objective.GlmGradient):
        self.glm = glm

    def partial_sum(self, block: Block, theta: np.ndarray) -> np.ndarray:
        out = np.zeros(theta.shape)
        out[:, :-1] = self.glm.partial_sum(block, theta[:, :-1])
        return out


@dataclasses.dataclass
class OutputPerturbationOptions:
    constraint: str = option("none", "the set the noisy solution is projected onto (in "
                                     "l_inf): none, l2-ball, l1-ball or box ([-radius, "
                                     "radius] per coefficient); a constraint needs "
                                     "--no-intercept", choices=LINF_KINDS)
    radius: float = option(1.0, "the size of the set: the ball's radius, the box's half width",
                           low=0, low_open=True)
    regularization: float | None = option(
        None, "lambda of (lambda / 2) ||x||_2^2; default Thm 7.1's lambda* = sqrt(2K) /"
              " D, D the --model-norm",
        low=0, low_open=True)
    model_norm: float | None = option(
        None, "D: public bound on the l2 norm of the models to compete with, which sets"
              " the default --regularization (smaller: more regularization, less "
              "noise); default the --constraint set's l2 diameter, else sqrt(d + 1)", low=0, low_open=True)
    feature_bound: float | None = option(
        None, "F: every row's features are clipped to l2 norm F (dense rows: applied "
              "again by predict); default sqrt(s) for categorical columns (s nonzeros "
              "per row), else sqrt(d)", low=0, low_open=True)
    max_passes: int = option(objective.DEFAULT_MAX_PASSES,
                             "refuse a run whose certified solve needs more full passes than "
                             "this (a larger --regularization needs fewer)", low=1)

    def constraint_set(self, dim: int) -> geometry.Constraint:
        chosen = geometry.Constraint(self.constraint, self.radius)
        chosen.validate(dim)
        return chosen


def check_privacy(privacy: Privacy) -> None:
    """What the mechanism cannot serve, known before any data is read."""
    if privacy.epsilon is None:
        raise ValueError("output-perturbation calibrates its Gaussian to a target: give --epsilon "
                         "(not --noise-multiplier)")
    spec.check_replace_one_float_request(
        "output-perturbation", privacy, "Gaussian",
        "the Gaussian mechanism on a certified solution, calibrated by PLD")


def sparsity(problem: Problem) -> int:
    """s: nonzeros per row (the encoding's, for categorical columns; d for dense rows)."""
    if problem.sparse:
        encoding = problem.source.get("encoding") or {}
        columns = (len(encoding.get("numeric_columns", ()))
                   + len(encoding.get("categorical_columns", ())))
        if columns < 1:
            raise ValueError("output-perturbation needs the categorical encoding's columns to "
                             "know the rows' sparsity")
        return columns
    return problem.dim


def train(options: OutputPerturbationOptions, problem: Problem, aggregator, seed: int,
          ledger: accounting.Ledger, progress) -> TrainResult:
    privacy = problem.privacy
    check_privacy(privacy)
    if ledger.neighbouring != accounting.REPLACE_ONE:
        raise ValueError("output-perturbation's guarantee is for replace-one neighbours")
    loss, d = problem.loss, problem.dim
    if loss.name not in MODELS:
        raise ValueError(f"output-perturbation does not fit --model {loss.name}; it supports: "
                         f"{', '.join(MODELS)}")
    constraint = options.constraint_set(d)
    intercept = bool(problem.fit_intercept)
    if intercept and constraint.kind != "none":
        raise ValueError("output-perturbation with --constraint needs --no-intercept (its "
                         "intercept is a coordinate of x, which would have to lie in the set too)")
    s = sparsity(problem)
    if options.feature_bound is not None:
        bound = float(options.feature_bound)
    else:
        bound = math.sqrt(s)
    transform = SparseClipRows(bound) if problem.sparse else features.ClipRows(bound)
    smooth = objective.glm_smoothness(loss, bound, d, intercept)
    dataset_size = objective.public_dataset_size(privacy.num_examples, aggregator)
    n = dataset_size["value"]
    if privacy.num_examples is not None and aggregator.count() > n:
        raise ValueError("--num-examples is below the number of rows in the input: "
                         "output-perturbation's solver is planned for at most that many rows")
    rows_per_n = 1.0 if privacy.num_examples is not None else objective.ROUNDED_COUNT_RATIO
    dim = d + int(intercept)
    glm = objective.GlmGradient(loss, transform, intercept)
    gradient = InterceptAsCoordinate(glm) if intercept else glm
    plan = plan_release(smooth, constraint, dim, n, privacy.epsilon, privacy.delta,
                        s + int(intercept), options.regularization, privacy.accountant, rows_per_n,
                        options.model_norm, accounting.prior_event(ledger))
    if plan["passes"] > options.max_passes:
        raise ValueError(f"the certified solve needs {plan['passes']} full passes over the data, "
                         f"more than --max-passes {options.max_passes}: raise --regularization "
                         "(fewer passes) or --max-passes")
    event = plan.pop("event")
    ledger.admit(events.ComposedDpEvent([ledger.event(), event]) if ledger.releases else event)
    released, _ = execute(aggregator, gradient, constraint, dim, n, plan, seed,
                          steps_per_chunk=problem.steps_per_chunk, progress=progress)
    theta = np.zeros((1, d + 1))
    theta[0, :dim] = released             # (the intercept, if any, is coordinate d)
    ledger.record(RELEASE, event,
                  mechanism="Gaussian mechanism on the certified regularized minimizer (paper "
                            "001, Algorithm 6), then an l_inf projection onto X "
                            "(post-processing); sensitivity 2 (L / (lambda n) + tau) "
                            "(replace-one)",
                  relation="replace-one", noise_multiplier=plan["noise_multiplier"],
                  sigma=plan["sigma"], regularization=plan["regularization"],
                  accuracy=plan["accuracy"], noise="float Gaussian (numpy)")
    details = dict(plan)
    details.update(
        constraint=constraint.kind, feature_bound=bound, lipschitz=smooth.lipschitz,
        loss_smoothness=smooth.beta, sparsity=s + int(intercept),
        intercept=("a coordinate of x (a constant feature 1 of every row, inside the row bound "
                   "sqrt(F^2 + 1))" if intercept else "none"),
        feature_clip=("features.ClipRows, recorded in model.json" if not problem.sparse else
                      "stats.clip_sparse_rows in training only (not recorded: predict does not "
                      "clip; the identity on one-hot rows within F)"),
        relation="replace-one (the paper's); n is public under it",
        accounting="one GaussianDpEvent under replace-one, its multiplier calibrated by PLD",
        solver=("V-FISTA, a number of passes fixed in advance from public constants, then one "
                "certificate pass; the iterates are never released"))
    return TrainResult(theta, ledger, plan["noise_multiplier"], 1.0, plan["passes"], None,
                       dataset_size, details, sampling="full batch", expected_batch_size=float(n),
                       feature_transform=None if problem.sparse else features.spec(transform),
                       details_name="algorithm_parameters",
                       constraint=None if constraint.kind == "none" else constraint.to_json())


OUTPUT_PERTURBATION = Algorithm(
    "output-perturbation", "sparse rows (categorical columns, s nonzeros of d): a regularized "
                           "certified solve, Gaussian noise, an l_inf projection; the error grows "
                           "with sqrt(s) and ln d, not sqrt(d); replace-one (n public)",
    MODELS, OutputPerturbationOptions, train, relation=accounting.REPLACE_ONE,
    checkpoints=False, sparse_input=True,
    why_no_checkpoints="its solver's iterates are not private, so they are never written; a run "
                       "that stops is rerun from the start", check_privacy=check_privacy,
    quality_check=True)
