"""Benchmark of the paper-004 (non-Euclidean geometry) algorithms: one script, their tables.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/geometry_benchmark.py

Runs, in turn (figures only, nothing asserted; about eight minutes):

1. ``bench_mirror_descent``: mirror-descent (Algorithm 3) on the note's Huber design (l_1.5,
   d = 50) for n in 2e3, 2e4, 2e5, next to Euclidean DP-GD at the same (epsilon, delta);
2. ``bench_heavy_tails``: heavy-tailed-md (Algorithm 7) against clipped DP-SGD (its best clip
   norm from a small grid) on regression with Student-t(2.5) label noise, 5 seeds;
3. ``bench_objective_perturbation``: objective-perturbation (Algorithms 1/2) on the mean-point
   problem for d from 100 to 10,000 with the l1 and l2 balls (the Gaussian width's effect), and
   on sparse logistic regression next to dpgd.

Each is also a script of its own, with its own flags.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_heavy_tails  # noqa: E402
import bench_mirror_descent  # noqa: E402
import bench_objective_perturbation  # noqa: E402


def main(argv=None) -> int:
    if argv:
        raise SystemExit("geometry_benchmark.py takes no flags; run its parts for theirs")
    print("# 1. mirror-descent (paper 004, Algorithm 3) against dpgd\n", flush=True)
    code = bench_mirror_descent.main([])
    print("\n# 2. heavy-tailed-md (paper 004, Algorithm 7) against clipped dpsgd\n", flush=True)
    code = code or bench_heavy_tails.main([])
    print("\n# 3. objective-perturbation (paper 004, Algorithms 1/2): the constraint set's "
          "Gaussian width\n", flush=True)
    return code or bench_objective_perturbation.main([])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
