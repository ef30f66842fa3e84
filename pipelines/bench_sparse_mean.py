"""Benchmark: the projection mechanism for sparse means (paper 001, Algorithm 1) against the dense
Gaussian mechanism.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/bench_sparse_mean.py [--reps 3]

Prints Markdown tables (figures only; tests/test_sparse_mean.py asserts the claims at n = 10^3
and 10^4): the l2 error of the released mean, s = 10, epsilon = 1, delta = 1e-6 (Gaussian
variants; the Laplace variant is pure epsilon-DP), n and d from 10^3 to 10^6, mean of --reps
draws, for the note's two designs (§1B): "sparse", rows with s random coordinates of +-1/sqrt(s);
"block", K groups of rows each on its own s coordinates with 1/sqrt(s), K s ~ sqrt(s) / theta
(theta = sigma sqrt(2 ln d), the soft-threshold level), the design on which Algorithm 1 meets its
worst-case rate. Columns: the projection mechanism (Gaussian, Laplace), the dense Gaussian
mechanism (the same noise, no projection), their ratio, and the paper's n* = d sqrt(ln(1/delta)) /
(sqrt(s) eps): below it (the high-dimensional regime) the projection wins, above it both are the
dense error.

Then a third table: regularized output perturbation with an l_inf projection (paper 001,
Algorithm 6; ``beam_dp.algorithms.output_perturbation``) on sparse linear losses <z, x> over the
unit l2 ball (the block design's rows, 10 groups), n = 10^4: the excess empirical risk with the
l_inf projection, with the Euclidean one (the same noise), and the master bound lambda / 2 +
2 L sqrt(s) E||noise||_inf, which grows like sqrt(ln d) where a Euclidean error grows like sqrt(d).
Next to each measured risk, the two rates it could follow (issue 14's done-when): the sparse rate
(s ln d)^{1/4} / sqrt(n eps) (Thm 7.1) and the dense rate sqrt(d) / (n eps), and the risk divided
by each: the ratio that stays flat across d is the scaling the risk follows. (On the unit l2 ball
with a linear loss the optimum is on the sphere and the risk is quadratic in the error where the
error is small, so at small d the measured risk sits well below the master bound and its ratio to
the sparse rate rises towards the bound's, which is flat; the Euclidean risk saturates at
2 ||zbar||, the most any point of the ball can lose.)

    OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/bench_sparse_mean.py --output-perturbation-only --reps 3
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import scipy.sparse as sp

from beam_dp import geometry, mechanisms, stats
from beam_dp.algorithms import output_perturbation as outp
from beam_dp.local import LocalAggregator

S, EPSILON, DELTA = 10, 1.0, 1e-6
SIZES = (1_000, 10_000, 100_000, 1_000_000)


def sparse_design(n: int, d: int, seed: int) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    columns = np.sort(rng.integers(0, d, (n, S)), axis=1)
    values = rng.choice([-1.0, 1.0], (n, S)) / math.sqrt(S)
    rows = sp.csr_matrix((values.ravel(), columns.ravel(), np.arange(0, n * S + 1, S)), shape=(n, d))
    rows.sum_duplicates()
    return rows


def block_design(n: int, d: int, sigma: float | None = None, groups: int | None = None) -> sp.csr_matrix:
    """K groups of rows on disjoint supports: K = ``groups``, or K s ~ sqrt(s) / theta."""
    if groups is None:
        theta = sigma * math.sqrt(2.0 * math.log(d))
        groups = max(1, min(n, d // S, round(math.sqrt(S) / theta / S)))
    group = np.arange(n) % groups
    columns = group[:, None] * S + np.arange(S)[None, :]
    values = np.full((n, S), 1.0 / math.sqrt(S))
    return sp.csr_matrix((values.ravel(), columns.ravel(), np.arange(0, n * S + 1, S)), shape=(n, d))


def errors(rows, n: int, seed: int) -> dict:
    mean = np.asarray(rows.sum(axis=0)).ravel() / n
    found = {}
    for variant in stats.SPARSE_MEAN_VARIANTS:
        total = stats.sparse_clipped_sum(rows, variant, 1.0, S)
        scale, _ = stats.sparse_mean_noise_scale(variant, n, 1.0, S, EPSILON, DELTA)
        for project in ((True, False) if variant == "gaussian" else (True,)):
            out, _ = stats.sparse_mean_release(total, n, variant, 1.0, S, scale,
                                               mechanisms.rng(seed, 7), project=project)
            name = f"{variant} {'projection' if project else 'dense'}"
            found[name] = float(np.linalg.norm(out - mean))
    return found


def output_perturbation_table(reps: int, n: int = 10_000) -> None:
    print(f"\nOutput perturbation (Algorithm 6), sparse linear losses over the unit l2 ball, n = {n:,}, "
          f"s = {S}, epsilon = {EPSILON:g}, delta = {DELTA:g}: excess empirical risk, mean of "
          f"{reps} draws\n")
    print("| d | l_inf projection | Euclidean projection | master bound | lambda | sparse rate "
          "(s ln d)^(1/4)/sqrt(n eps) | l_inf / sparse rate | Euclidean / sparse rate | dense rate "
          "sqrt(d)/(n eps) | l_inf / dense rate | Euclidean / dense rate | master bound / sparse rate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ball = geometry.Constraint("l2-ball", 1.0)
    for d in SIZES:
        rows = block_design(n, d, groups=10)
        gradient = outp.SparseLinearGradient(rows, 1.0)
        zbar = np.asarray(gradient.rows.sum(axis=0)).ravel() / n
        found = {True: [], False: []}
        bounds = []
        for rep in range(reps):
            for project in (True, False):
                x, plan, noise_inf = outp.release(
                    LocalAggregator(gradient.blocks(4096)), gradient,
                    outp.sparse_linear_smoothness(1.0, d), ball, d, n, EPSILON, DELTA, S, seed=rep,
                    project=project)
                found[project].append(float(zbar @ x + np.linalg.norm(zbar)))
                if project:
                    bounds.append(plan["regularization"] / 2 + 2 * math.sqrt(S) * noise_inf)
        linf, euclid = float(np.mean(found[True])), float(np.mean(found[False]))
        sparse_rate = (S * math.log(d)) ** 0.25 / math.sqrt(n * EPSILON)
        dense_rate = math.sqrt(d) / (n * EPSILON)
        print(f"| {d:,} | {linf:.4g} | {euclid:.4g} | {np.mean(bounds):.4g} | "
              f"{plan['regularization']:.3g} | {sparse_rate:.4g} | {linf / sparse_rate:.3g} | "
              f"{euclid / sparse_rate:.3g} | {dense_rate:.4g} | {linf / dense_rate:.3g} | "
              f"{euclid / dense_rate:.3g} | {np.mean(bounds) / sparse_rate:.3g} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output-perturbation-only", action="store_true",
                        help="only the output-perturbation table across d")
    args = parser.parse_args(argv)
    started = time.time()
    for design in () if args.output_perturbation_only else ("sparse", "block"):
        print(f"\n{design} design: l2 error of the released mean, s = {S}, epsilon = {EPSILON:g}, "
              f"delta = {DELTA:g}, mean of {args.reps} draws\n")
        print("| n | d | projection (Gaussian) | projection (Laplace) | dense Gaussian | dense / "
              "projection | n* |")
        print("|---|---|---|---|---|---|---|")
        for n in SIZES:
            sigma = stats.sparse_mean_noise_scale("gaussian", n, 1.0, S, EPSILON, DELTA)[0]
            for d in SIZES:
                runs = []
                for rep in range(args.reps):
                    rows = sparse_design(n, d, rep) if design == "sparse" else block_design(n, d, sigma)
                    runs.append(errors(rows, n, rep))
                mean = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
                star = d * math.sqrt(math.log(1.0 / DELTA)) / (math.sqrt(S) * EPSILON)
                print(f"| {n:,} | {d:,} | {mean['gaussian projection']:.4g} | "
                      f"{mean['laplace projection']:.4g} | {mean['gaussian dense']:.4g} | "
                      f"{mean['gaussian dense'] / mean['gaussian projection']:.1f} | {star:,.0f} |",
                      flush=True)
    output_perturbation_table(args.reps)
    print(f"\n({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
