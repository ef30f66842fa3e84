"""Benchmark: ``beam-dp stats --categorical-columns`` (the projection mechanism, paper 001,
Algorithm 1) against the dense Gaussian mechanism, on a click log (``beam-dp make-data --task
click-log``) hashed to 2^20 buckets per column.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/bench_categorical_stats.py \
        [--n 200000] [--values 100000] [--buckets 1048576] [--reps 5]

Writes the click log as CSV (``make-data``), reads it through the stats command's encoding and
blocks (``stats.frequency_encoding``, ``data.load_blocks``), and for each of --reps seeds releases
the frequencies with the command's own stages (``stats.categorical_frequency_stages``: public n,
epsilon 1, delta 1e-6) and, from the same noise, the dense mechanism (no projection). Prints the
l2 and l_inf errors against the exact frequencies (computed here, on the driver, for the
benchmark only), for the three columns together (d = 3 x buckets, s = 3) and for one column alone
(d = buckets, s = 1). The exact sums are a benchmark's oracle: nothing here is a release.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

import numpy as np

from beam_dp import cli, data, losses, stats
from beam_dp.local import LocalAggregator

EPSILON, DELTA = 1.0, 1e-6


def run(pattern: str, columns: list[str], buckets: int, variant: str, reps: int) -> dict:
    encoding = stats.frequency_encoding(columns, hash_buckets=buckets)
    blocks = data.load_blocks(sorted(glob.glob(pattern)), None, encoding.columns,
                              losses.SquaredLoss(), 65536, encoding)
    n = sum(len(b) for b in blocks)
    exact = sum(np.asarray(b.features.sum(axis=0)).ravel() for b in blocks) / n
    found = {"projection_l2": [], "dense_l2": [], "projection_inf": [], "dense_inf": [],
             "seconds": []}
    for seed in range(reps):
        stages = stats.categorical_frequency_stages(encoding, variant, EPSILON, DELTA,
                                                    stats.stages_seed(seed), count=False)
        start = time.perf_counter()
        state = LocalAggregator(blocks).run_stages(stages, {"n": n})
        found["seconds"].append(time.perf_counter() - start)
        stage = stages[0]
        released = state["categorical_frequencies"]
        # the dense mechanism: the same noise (the stage's generator), no projection
        dense, _ = stats.sparse_mean_release(exact * n, n, variant, stage.lipschitz,
                                             stage.sparsity, stage.sum_noise_scale() / n,
                                             stats.stages._rng(stage), project=False)
        for name, value in (("projection", released), ("dense", dense)):
            found[f"{name}_l2"].append(float(np.linalg.norm(value - exact)))
            found[f"{name}_inf"].append(float(np.max(np.abs(value - exact))))
    out = {k: float(np.mean(v)) for k, v in found.items()}
    out.update(n=n, d=encoding.dim, s=len(columns), noise_scale=stage.sum_noise_scale() / n,
               bound=stage.error_bound(stage.sum_noise_scale() / n),
               nonzero=int(np.count_nonzero(released)), exact_nonzero=int(np.count_nonzero(exact)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--values", type=int, default=100_000)
    parser.add_argument("--buckets", type=int, default=2 ** 20)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as parent:
        directory = os.path.join(parent, "clicks")
        code = cli.main(["make-data", "--task", "click-log", "--format", "csv", "--n", str(args.n),
                         "--values", str(args.values), "--output", directory])
        if code:
            return code
        pattern = os.path.join(directory, "train-*.csv")
        print(f"click log: n = {args.n}, {args.values} values per column (Zipf), "
              f"{args.buckets} hash buckets per column; epsilon {EPSILON}, delta {DELTA} "
              f"(Gaussian), public n; mean of {args.reps} seeds\n")
        print("| columns | variant | d | s | noise scale | l2 error, projection | l2 error, dense | "
              "dense / projection | 95% bound | l_inf, projection | l_inf, dense | nonzero released "
              "(exact) | seconds |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for columns in (["user", "item", "site"], ["user"]):
            for variant in stats.SPARSE_MEAN_VARIANTS:
                r = run(pattern, columns, args.buckets, variant, args.reps)
                print(f"| {','.join(columns)} | {variant} | {r['d']} | {r['s']} | "
                      f"{r['noise_scale']:.3g} | {r['projection_l2']:.4f} | {r['dense_l2']:.4f} | "
                      f"{r['dense_l2'] / r['projection_l2']:.1f} | {r['bound']:.4f} | "
                      f"{r['projection_inf']:.4f} | {r['dense_inf']:.4f} | {r['nonzero']} "
                      f"({r['exact_nonzero']}) | {r['seconds']:.2f} |")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
