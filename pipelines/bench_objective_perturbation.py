"""Benchmark: approximate objective perturbation over a constraint set (paper 004, Algorithms 1/2).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/bench_objective_perturbation.py [--reps 5]

Prints two Markdown tables (figures only; the slow test tests/test_objective_perturbation.py
asserts the first one's claims; progress on stderr):

1. The mean-point problem of the note §4.3(b), the lower bound's hard instance: l(theta; x) =
   1/2 ||theta - x||^2, x_i = +-e_j (j uniform), n = 50,000, epsilon = 1, delta = 1e-5,
   lambda = 0, through ``objective_perturbation.perturbed_minimizer`` (the algorithm's own
   solver, noise and accounting) for C = the l1 ball and the l2 ball of radius 1 (the same l2
   radius) and no constraint; the excess empirical loss 1/2 ||theta - xbar||^2, mean over
   repetitions, next to the projection lemma's bound 1/2 (sigma1 / n) G_C. With the l2 ball (or
   none) it grows like d: the noise's d sigma^2 / 2. With the l1 ball it is capped by the bound,
   which grows like sqrt(ln d); at small d the noise lies inside the ball, the projection does
   nothing and the error is d sigma^2 / 2 there too, below the bound.
2. Logistic regression with a sparse true model (5 of d coefficients nonzero), n = 20,000,
   standardized features, epsilon = 1: objective-perturbation with the l1 ball (radius ||w*||_1,
   a public choice a user makes from domain knowledge), with the l2 ball of the same radius, and
   unconstrained, next to dpgd at epsilon / 2 (its add/remove guarantee implies replace-one at
   epsilon: the same guarantee) and the non-private ERM; test accuracy, mean over seeds. For a
   GLM the gap between the sets is small: its loss is flat in most directions (the note §4.3(c)).
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np

import beam_dp
from beam_dp.algorithms import objective_perturbation as op

DIMENSIONS = (100, 300, 1_000, 3_000, 10_000)
KINDS = ("l1-ball", "l2-ball", "none")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mean_point_table(reps: int) -> None:
    print("Mean-point problem (note §4.3(b)): excess empirical loss 1/2 ||theta - xbar||^2, "
          f"n = 50,000, epsilon = 1, delta = 1e-5, mean of {reps} repetitions (standard error)\n")
    print("| d | l1 ball | bound (l1) | l2 ball | bound (l2) | none | G_C l1 | G_C l2 |")
    print("|---|---|---|---|---|---|---|---|")
    found = {kind: [] for kind in KINDS}
    for d in DIMENSIONS:
        cells, widths = {}, {}
        for kind in KINDS:
            runs = [op.mean_point_excess(d, kind, seed=rep) for rep in range(reps)]
            excess = np.array([r["excess"] for r in runs])
            found[kind].append(excess.mean())
            cells[kind] = f"{excess.mean():.3g} ({excess.std(ddof=1) / np.sqrt(reps):.1g})"
            cells[kind + " bound"] = f"{runs[0]['bound']:.3g}"
            widths[kind] = runs[0]["width"]
            log(f"d={d} {kind}: {excess.mean():.4g}")
        print(f"| {d:,} | {cells['l1-ball']} | {cells['l1-ball bound']} | {cells['l2-ball']} | "
              f"{cells['l2-ball bound']} | {cells['none']} | {widths['l1-ball']:.2f} | "
              f"{widths['l2-ball']:.1f} |", flush=True)
    l1, l2 = np.array(found["l1-ball"]), np.array(found["l2-ball"])
    print(f"\nl1 ball: d = {DIMENSIONS[-1]:,} over d = {DIMENSIONS[0]} {l1[-1] / l1[0]:.2f}x, "
          f"largest over smallest {l1.max() / l1.min():.2f}x, over d >= 1,000 "
          f"{l1[2:].max() / l1[2:].min():.2f}x; l2 ball: d = {DIMENSIONS[-1]:,} over d = "
          f"{DIMENSIONS[0]} {l2[-1] / l2[0]:.1f}x")


def sparse_logistic(n: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    w = np.zeros(d)
    w[:5] = [1.5, -1.2, 1.0, -0.8, 0.6]
    x = rng.normal(size=(2 * n, d))
    y = (rng.random(2 * n) < 1.0 / (1.0 + np.exp(-(x @ w)))).astype(float)
    return x[:n], y[:n], x[n:], y[n:], w


def glm_table(seeds: int, n: int = 20_000) -> None:
    from sklearn.linear_model import LogisticRegression

    print(f"\nSparse logistic regression (5 of d coefficients nonzero), n = {n:,}, epsilon = 1, "
          f"delta = 1e-5: test accuracy, mean over {seeds} seeds\n")
    names = ["objp l1", "objp l2", "objp none", "dpgd e/2", "ERM"]
    print("| d | " + " | ".join(names) + " | passes (objp l1) |")
    print("|---" * (len(names) + 2) + "|")
    for d in (100, 1_000):
        found = {name: [] for name in names}
        passes = None
        for seed in range(seeds):
            x, y, x_test, y_test, w = sparse_logistic(n, d, seed)
            radius = float(np.abs(w).sum())
            configs = {
                "objp l1": dict(algorithm="objective-perturbation", constraint="l1-ball",
                                radius=radius),
                "objp l2": dict(algorithm="objective-perturbation", constraint="l2-ball",
                                radius=radius),
                "objp none": dict(algorithm="objective-perturbation", constraint="none"),
                "dpgd e/2": dict(algorithm="dpgd", epsilon=0.5),
            }
            for name, options in configs.items():
                t = time.time()
                options = dict(dict(epsilon=1.0), **options)
                model = beam_dp.train(x, y, runner="local", seed=seed + 100, num_examples=n,
                                      **options)
                found[name].append(float(np.mean(model.predict(x_test) == y_test)))
                if name == "objp l1":
                    passes = model.privacy_report["steps"]
                log(f"d={d} seed={seed} {name}: {found[name][-1]:.4f} ({time.time() - t:.1f} s)")
            erm = LogisticRegression(C=1e4, max_iter=2000).fit(x, y)
            found["ERM"].append(float(erm.score(x_test, y_test)))
        print(f"| {d:,} | " + " | ".join(f"{np.mean(v):.4f}" for v in found.values())
              + f" | {passes} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the mean-point runs")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of the logistic runs")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    started = time.time()
    mean_point_table(args.reps)
    glm_table(args.seeds)
    print(f"\n({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
