"""Benchmark: noisy regularized mirror descent in l_1.5 (paper 004, Algorithm 3) against Euclidean
DP-GD, on the note's Huber design.

    .venv/bin/python pipelines/bench_mirror_descent.py [--seeds 3] [--epsilon 1] > /tmp/md.md

Prints a Markdown table (figures only, nothing asserted; progress on stderr). Data:
``mirror_descent.lp_huber_design`` (note §4.3(d)): d = 50, z = g / ||g||_3 (so ||z||_q = 1 for
q = 3, the dual of p = 1.5), w* = 0.55 on 5 coordinates, y = <w*, z> + N(0, 0.25), the Huber loss
(threshold 1), no intercept. The excess population risk of an estimate w is E H(<w, z> - y) -
E H(<w*, z> - y) on 100,000 fresh rows (w* is the population minimizer: the noise is symmetric).
Every run goes through ``beam_dp.train(..., runner="local")`` with n public (``num_examples``),
epsilon as given, delta 1e-5; mean over seeds (each seed draws new data and noise).

Columns:
* ``md`` mirror-descent with its defaults (p = 1.5, F = 1, so L = 1 and beta = 1; T and alpha
  from n, epsilon, delta, D: ``mirror_descent.default_steps``);
* ``md b=.1`` the same with --smoothness 0.1, a public choice closer to this design's curvature
  (the loss's worst case, beta = 1, makes the mirror step short here);
* ``md p=2`` --p 2: the Euclidean special case, Gaussian noise accounted exactly;
* ``dpgd`` the project's DP-GD with its defaults (clip 1, learning rate 1, at most 100 steps),
  at the same epsilon; its guarantee is for add/remove neighbours, which at epsilon implies
  replace-one at 2 epsilon only;
* ``dpgd e/2`` DP-GD at epsilon / 2, whose add/remove guarantee implies replace-one at epsilon:
  the same guarantee as mirror-descent's;
* ``ERM`` the non-private empirical minimizer (L-BFGS), ``w=0`` the trivial predictor.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np
import scipy.optimize

import beam_dp
from beam_dp.algorithms import mirror_descent as md

D = 50
DELTA = 1e-5
SIZES = (2_000, 20_000, 200_000)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def huber_risk(z: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    r = z @ w - y
    a = np.abs(r)
    return float(np.mean(np.where(a <= 1.0, 0.5 * r * r, a - 0.5)))


def erm(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    n = len(y)
    return scipy.optimize.minimize(
        lambda w: huber_risk(z, y, w), np.zeros(z.shape[1]),
        jac=lambda w: z.T @ np.clip(z @ w - y, -1.0, 1.0) / n, method="L-BFGS-B",
        options={"gtol": 1e-10, "maxiter": 5000}).x


def configurations(epsilon: float) -> dict:
    md_common = dict(algorithm="mirror-descent", feature_bound=1.0, epsilon=epsilon)
    return {
        "md": md_common,
        "md b=.1": dict(md_common, smoothness=0.1),
        "md p=2": dict(md_common, p=2.0),
        "dpgd": dict(algorithm="dpgd", epsilon=epsilon),
        "dpgd e/2": dict(algorithm="dpgd", epsilon=epsilon / 2),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per n (n = 2e5: at most 2)")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--sizes", default=",".join(str(n) for n in SIZES),
                        help="comma-separated n")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")   # (PrivacyWarning: delta vs 1/n at n = 2e5)
    sizes = [int(float(n)) for n in args.sizes.split(",")]
    z_test, y_test, w_star = md.lp_huber_design(100_000, D, seed=999)
    base = huber_risk(z_test, y_test, w_star)
    configs = configurations(args.epsilon)
    started = time.time()
    print(f"Algorithm 3 (mirror-descent, l_1.5) vs DP-GD: excess population risk on the note's Huber "
          f"design (d = {D}, ||z||_3 = 1), epsilon = {args.epsilon:g}, delta = {DELTA:g}, mean over "
          "seeds\n")
    print("| n | seeds | T (md) | " + " | ".join(configs) + " | ERM | w=0 |")
    print("|---" * (len(configs) + 5) + "|")
    for n in sizes:
        seeds = min(args.seeds, 2) if n >= 100_000 else args.seeds
        found = {name: [] for name in list(configs) + ["ERM"]}
        steps = None
        for seed in range(seeds):
            z, y, _ = md.lp_huber_design(n, D, seed=seed)
            for name, options in configs.items():
                t = time.time()
                model = beam_dp.train(z, y, model="huber", delta=DELTA, seed=seed + 1000,
                                      runner="local", fit_intercept=False, num_examples=n,
                                      **options)
                w = np.ravel(model.artifact["coefficients"])
                found[name].append(huber_risk(z_test, y_test, w) - base)
                if name == "md":
                    steps = model.privacy_report["steps"]
                log(f"n={n} seed={seed} {name}: {found[name][-1]:.5f} ({time.time() - t:.1f} s)")
            found["ERM"].append(huber_risk(z_test, y_test, erm(z, y)) - base)
        cells = [f"{np.mean(v):.4f}" for v in found.values()]
        print(f"| {n:,} | {seeds} | {steps} | " + " | ".join(cells)
              + f" | {huber_risk(z_test, y_test, np.zeros(D)) - base:.4f} |", flush=True)
    print(f"\n({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
