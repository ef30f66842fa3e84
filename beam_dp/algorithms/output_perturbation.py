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
(beta = 0.05), D the l2 diameter of X (the initial distance bound of (A.1)), unless given.

This module is the Beam-free core, run by ``pipelines/bench_sparse_mean.py``'s second table and
tests/test_sparse_mean.py on sparse linear losses (``SparseLinearGradient``); the registered
algorithm needs the sparse blocks of issue 14's first part, which do not exist yet.
"""
from __future__ import annotations

import math

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting, geometry, mechanisms
from beam_dp.algorithms import objective_perturbation as objective
from beam_dp.data import Block

# tau (the certified solution's distance to the exact one) as a fraction of L / (lambda n).
SOLVER_FRACTION = 0.01
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


def default_regularization(lipschitz: float, sparsity: int, dim: int, n: int, epsilon: float,
                           delta: float, diameter: float) -> float:
    """Thm 7.1's lambda* = sqrt(2K) / D."""
    k = (8.0 * lipschitz ** 2 * math.sqrt(sparsity * math.log(1.25 / delta)
                                          * math.log(2.0 * dim / FAILURE_PROBABILITY))
         / (n * epsilon))
    return math.sqrt(2.0 * k) / diameter


def release(aggregator, gradient, smooth: objective.Smoothness, constraint: geometry.Constraint,
            dim: int, n: int, epsilon: float, delta: float, sparsity: int, seed: int,
            regularization: float | None = None, accountant: str = "pld",
            project: bool = True) -> tuple[np.ndarray, dict, float]:
    """Algorithm 6 over ``aggregator``'s rows (coefficients only, no intercept): (the release,
    the public plan with its DpEvent, ||noise||_inf). ``project`` False: the Euclidean projection
    instead of the l_inf one (the dense baseline the benchmark compares with). ||noise||_inf is
    for the master bound's check in tests; it must not leave the job."""
    if constraint.kind not in LINF_KINDS:
        raise ValueError(f"output perturbation needs X in {', '.join(LINF_KINDS)}")
    diameter = constraint.diameter_l2(dim) if constraint.kind != "none" else objective.REFERENCE_DIAMETER
    lam = regularization if regularization is not None else default_regularization(
        smooth.lipschitz, sparsity, dim, n, epsilon, delta, diameter)
    spread = smooth.lipschitz / (lam * n)                 # half the exact minimizers' sensitivity
    tau = SOLVER_FRACTION * spread
    shape = (1, dim + 1)
    start = objective.project_model(constraint, np.zeros(shape), False)
    # J's ||theta||^2 coefficient is lambda / 2 (strong convexity lambda)
    plan = objective.solver_plan(smooth, dim, n, lam / 2.0, 0.0, 1.0, None, diameter, math.inf,
                                 float(np.linalg.norm(start)), epsilon, delta)
    accuracy = max(0.5 * plan["strong_convexity"] * tau ** 2, plan["accuracy_floor"])
    plan = objective.solver_plan(smooth, dim, n, lam / 2.0, 0.0, 1.0, accuracy, diameter,
                                 math.inf, float(np.linalg.norm(start)), epsilon, delta)
    tau = math.sqrt(2.0 * accuracy / plan["strong_convexity"])
    unit = spread + tau                                    # a replacement moves it by 2 units
    multiplier = accounting.calibrate_noise_multiplier(
        lambda m: events.GaussianDpEvent(m), epsilon, delta, accountant, accounting.REPLACE_ONE,
        guess=2.0 * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon, slope=-1.0)
    sigma = multiplier * unit
    solution = objective.certified_solve(aggregator, gradient, constraint, shape, False, n,
                                         lam / 2.0, np.zeros(shape), start, plan)
    noise = mechanisms.gaussian_noise(mechanisms.secure_generator(seed, STREAM_OUTPUT), dim, sigma)
    noisy = solution[0, :-1] + noise
    out = linf_projection(noisy, constraint) if project else constraint.project(noisy)
    plan.update(regularization=lam, sigma=sigma, noise_multiplier=multiplier, sensitivity_unit=unit,
                solver_distance=tau, event=events.GaussianDpEvent(multiplier))
    return out, plan, float(np.max(np.abs(noise)))


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
