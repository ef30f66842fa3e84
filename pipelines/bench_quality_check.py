"""Benchmark: what the private quality check (``beam_dp.quality``) costs a training run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/bench_quality_check.py [--seeds 5]

Prints, for dpgd logistic on make-data's default distribution (n = 20,000 training rows, d = 20,
5,000 held-out rows) at epsilon 1 and 0.1 (the check's default share: a twentieth of it), the
held-out accuracy with the check and without it (--quality-check off), the steps' noise
multiplier both ways, the check's noise std on (constant's error rate - model's), its verdicts
and the wall time of a run (figures only; tests/test_quality_check.py asserts the claims).
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import beam_dp
from beam_dp import synthetic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    seeds = parser.parse_args().seeds
    warnings.simplefilter("ignore")
    x, y = synthetic.make_dataset("binary", 25000, 20, 0)
    xt, yt, xv, yv = x[:20000], y[:20000], x[20000:], y[20000:]
    print("| epsilon | accuracy, check on | accuracy, off | steps' sigma on | off | check's std "
          "| verdicts | seconds on | off |")
    print("|---|---|---|---|---|---|---|---|---|")
    for epsilon in (1.0, 0.1):
        rows, verdicts = [], []
        for seed in range(seeds):
            t = time.perf_counter()
            on = beam_dp.train(xt, yt, epsilon=epsilon, seed=seed)
            t_on = time.perf_counter() - t
            t = time.perf_counter()
            off = beam_dp.train(xt, yt, epsilon=epsilon, seed=seed, quality_check="off")
            t_off = time.perf_counter() - t
            check = on.privacy_report["quality_check"]
            verdicts.append(check["status"])
            rows.append((on.score(xv, yv), off.score(xv, yv),
                         on.privacy_report["mechanisms"][-1]["noise_multiplier"],
                         off.privacy_report["mechanisms"][-1]["noise_multiplier"],
                         check["constant_minus_model"]["noise_std"], t_on, t_off))
        m = np.mean(rows, axis=0)
        print(f"| {epsilon:g} | {m[0]:.4f} | {m[1]:.4f} | {m[2]:.2f} | {m[3]:.2f} | {m[4]:.4f} | "
              f"{', '.join(sorted(set(verdicts)))} ({len(verdicts)}) | {m[5]:.2f} | {m[6]:.2f} |")


if __name__ == "__main__":
    main()
