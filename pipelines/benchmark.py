"""Benchmark: time per training step of the local and Beam runners against the memory-bandwidth
floor, on a synthetic logistic dataset.

    .venv/bin/python pipelines/benchmark.py --n 200000 --d 50

Writes the dataset as Parquet shards into a temporary directory, loads them into Blocks the way
``beam-dp train --runner local`` does, and prints (figures only, nothing is asserted):

* floor: one pass of ``X @ w`` and one of ``X.T @ r`` over the same in-memory blocks, the least
  a full-batch GLM gradient can cost (each pass reads the whole feature matrix once);
* local: ``LocalAggregator`` running a full-batch ``NoisyGradientStep`` (dpgd, q = 1),
  median over ``--steps`` single steps after a warm-up. Floor passes and local steps alternate,
  so that both see the same load on a shared machine: the median of the paired ratios (step /
  the floor pass just before it) is the robust figure, the ratio of medians and of minima are
  printed too;
* beam: ``BeamAggregator`` on ``--runner FnApiRunner`` over the Parquet shards, one pipeline
  each of 1, 2 and K = ``--steps`` steps; (t_K - t_2) / (K - 2) is the per-step cost and
  t_2 - 2 * that the fixed per-pipeline overhead (building and starting the pipeline, reading and
  materializing the blocks). With k = 1 Beam fuses the read into the step, so it is shown apart;
* the same for DP-SGD (q = batch size / n) unless ``--batch-size 0``.

On a small machine shared with other jobs, OpenBLAS's default threads make matrix-vector
products erratic (a thread waiting for a busy core); ``OPENBLAS_NUM_THREADS=1`` gives steadier
figures. The header prints the setting and the load average.

Everything Beam pickles (the step function, the sampler, the loss) is imported from ``beam_dp``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from beam_dp import data, losses, synthetic
from beam_dp.algorithms.base import TrainState
from beam_dp.algorithms.noisy_gd import NoisyGradientStep
from beam_dp.local import LocalAggregator
from beam_dp.sampling import PoissonSampler


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200_000, help="examples")
    p.add_argument("--d", type=int, default=50, help="features")
    p.add_argument("--steps", type=int, default=20,
                   help="timed local steps, and the steps K of the long Beam pipeline")
    p.add_argument("--warmup", type=int, default=2, help="untimed local steps first")
    p.add_argument("--block-rows", type=int, default=data.DEFAULT_BATCH_ROWS,
                   help="rows per block read (the CLI's --batch-rows)")
    p.add_argument("--shards", type=int, default=4, help="Parquet files")
    p.add_argument("--batch-size", type=int, default=1000,
                   help="expected batch size for the DP-SGD rows; 0 skips them")
    p.add_argument("--skip-beam", action="store_true", help="local runner and floor only")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.n, args.d, args.steps, args.block_rows, args.shards) < 1 or args.warmup < 0:
        p.error("--n, --d, --steps, --block-rows and --shards must be positive")
    if args.steps < 3 and not args.skip_beam:
        p.error("--steps must be at least 3 to separate the Beam per-step cost from its overhead")
    return args


def make_step(loss, n: int, d: int, q: float, seed: int) -> NoisyGradientStep:
    # sigma = 1, C = 1: the noise scale does not change the cost; no calibration needed.
    return NoisyGradientStep(loss=loss, clip_norm=1.0, noise_std=1.0, normalizer=q * n,
                             shape=(loss.outputs(), d + 1),
                             learning_rate=1.0, sampler=PoissonSampler(q, seed), seed=seed)


def run_steps(aggregator, step_fn, state: TrainState, k: int) -> TrainState:
    """k consecutive steps in one call (one pipeline on Beam)."""
    return aggregator.run_stages([step_fn] * k, state)


def floor_pass(blocks, w, rs) -> float:
    """Seconds for one pass of ``X @ w`` plus ``X.T @ r`` over every block."""
    t0 = time.perf_counter()
    for b, r in zip(blocks, rs):
        b.features @ w
        b.features.T @ r
    return time.perf_counter() - t0


def time_local_and_floor(aggregator, step_fn, state, steps: int, warmup: int, seed: int):
    """Per-step seconds of the local runner and of the floor, measured alternately (one floor pass,
    one step, ...) so that both see the same machine load; returns (local times, floor times)."""
    blocks = aggregator.blocks
    g = np.random.default_rng(seed)
    w = g.standard_normal(blocks[0].features.shape[1])
    rs = [g.standard_normal(len(b)) for b in blocks]
    local, floor = [], []
    for i in range(warmup + steps):
        f = floor_pass(blocks, w, rs)
        t0 = time.perf_counter()
        state = run_steps(aggregator, step_fn, state, 1)
        t = time.perf_counter() - t0
        if i >= warmup:
            local.append(t)
            floor.append(f)
    return local, floor


def time_beam(aggregator, step_fn, state, k: int) -> tuple[float, TrainState]:
    t0 = time.perf_counter()
    out = run_steps(aggregator, step_fn, state, k)
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    args = parse_args(argv)
    n, d = args.n, args.d
    loss = losses.LogisticLoss()
    features = [f"f{j}" for j in range(d)]
    tmp = tempfile.mkdtemp(prefix="beam-dp-bench-")
    try:
        x, y = synthetic.make_dataset("binary", n, d, args.seed)
        files = synthetic.write_shards(os.path.join(tmp, "data"), "train", x, y, args.shards)
        del x, y
        blocks = data.load_blocks(files, "label", features, loss, args.block_rows)
        local = LocalAggregator(blocks)
        sizes = sorted({len(b) for b in blocks})

        print(f"beam-dp benchmark: n={n:,} d={d} logistic; {len(blocks)} blocks of "
              f"{'/'.join(f'{s:,}' for s in sizes)} rows from {args.shards} Parquet shards; "
              f"{os.cpu_count()} CPUs; numpy {np.__version__}, OPENBLAS_NUM_THREADS="
              f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; load average {os.getloadavg()[0]:.2f}")
        print(f"feature matrix {n * d * 8 / 1e6:.0f} MB. local and floor: median of {args.steps} "
              f"steps after {args.warmup} warm-up, measured alternately; beam: one pipeline "
              f"each of k=1, 2 and {args.steps} steps")
        print()

        rows = []  # (runner, algorithm, seconds per step, note)
        configs = [("dpgd", 1.0)]
        if args.batch_size > 0:
            configs.append((f"dpsgd B={args.batch_size}", min(1.0, args.batch_size / n)))

        beam_agg = None
        if not args.skip_beam:
            from beam_dp.beam.aggregator import BeamAggregator
            beam_agg = BeamAggregator(files, "label", features, loss, args.block_rows,
                                      ["--runner", "FnApiRunner"],
                                      work_dir=os.path.join(tmp, "work"))

        # All local and floor timings first, then Beam: nothing of a Beam run can disturb them.
        floor_times, paired, best = [], None, None
        steps = {name: make_step(loss, n, d, q, args.seed) for name, q in configs}
        start = TrainState.zeros(1, d)
        for name, q in configs:
            times, floors = time_local_and_floor(local, steps[name], start, args.steps,
                                                 args.warmup, args.seed)
            floor_times += floors
            note = f"min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}"
            if q >= 1.0:
                paired = statistics.median(t / f for t, f in zip(times, floors))
                best = min(times) / min(floors)
                note += f"; paired ratio {paired:.2f}"
            rows.append(("local", name, statistics.median(times), note))

        checks = []
        for name, _ in (configs if beam_agg is not None else []):
            step_fn, k = steps[name], args.steps
            time_beam(beam_agg, step_fn, start, 1)  # warm-up: imports, first pipeline
            t1, _ = time_beam(beam_agg, step_fn, start, 1)
            t2, _ = time_beam(beam_agg, step_fn, start, 2)
            tk, beam_state = time_beam(beam_agg, step_fn, start, k)
            # k = 1 is special: Beam fuses the read into the only step and never materializes the
            # blocks, so the per-step cost and the fixed overhead come from k = 2 and k = K.
            per_step = (tk - t2) / (k - 2)
            rows.append(("beam FnApiRunner", name, per_step,
                         f"pipelines: k=1 {t1:.2f} s, k=2 {t2:.2f} s, k={k} {tk:.2f} s; "
                         f"fixed {t2 - 2 * per_step:.2f} s; k={k} amortized {tk / k * 1e3:.0f} ms/step"))
            local_state = run_steps(local, step_fn, start, k)
            diff = (np.max(np.abs(beam_state.theta - local_state.theta))
                    / np.max(np.abs(local_state.theta)))
            checks.append(f"{name}: theta after {k} steps, beam vs local: max relative "
                          f"difference {diff:.1e}")

        floor = statistics.median(floor_times)
        bandwidth = 2 * n * d * 8 / floor / 1e9
        rows.insert(0, ("floor", "X@w + X.T@r", floor,
                        f"min {min(floor_times) * 1e3:.2f}, max {max(floor_times) * 1e3:.2f}; "
                        f"{bandwidth:.1f} GB/s effective"))

        print(f"{'runner':<17} {'algorithm':<12} {'ms/step':>9} {'x floor':>8}  notes (ms unless s)")
        print("-" * 110)
        for runner, name, seconds, note in rows:
            print(f"{runner:<17} {name:<12} {seconds * 1e3:9.2f} {seconds / floor:8.2f}  {note}")
        print()
        local_full = next(s for r, a, s, _ in rows if r == "local" and a == "dpgd")
        print(f"local / floor (dpgd, full batch): ratio of medians {local_full / floor:.2f}, "
              f"median of paired ratios {paired:.2f}, ratio of minima {best:.2f}; "
              f"target <= 2 (paired): {'met' if paired <= 2 else 'NOT met'}")
        for r, a, s, _ in rows:
            if r.startswith("beam") and a == "dpgd":
                print(f"beam / floor (dpgd, per step after the fixed overhead): {s / floor:.1f}")
        for line in checks:
            print(line)
        print(f"load average at the end {os.getloadavg()[0]:.2f} (figures from a loaded machine are noisy)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
