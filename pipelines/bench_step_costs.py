"""DP-SGD past one machine (issue 35): a step's sums on the driver against on the workers, the
cost model's inputs measured, and its projection to sizes no test machine holds.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/bench_step_costs.py

On Beam's portable machinery with an external worker pool of ``--workers`` SDK processes
(FnApiRunner with an EXTERNAL environment served by ``worker_pool_main``, as pipelines/
benchmark.py's worker-pool rows), the whole command a user runs, ``beam-dp train --algorithm
dpsgd --epsilon 1`` (private count, default flags, the quality check), at n = ``--n``, d =
``--d``, batch ``--batch-size``, ``--epochs`` epochs, with ``--step_sums driver`` and
``--step_sums workers``; prints for each the wall time, the jobs (kind, steps, seconds), the
bytes the driver read per step, and whether the two models are the same. Then the batch job's
files at 8 and 64 shards (same rows). Then the cost model's inputs (``beam_dp.step_costs.
Costs``), each from these runs:

* read bytes/s: the driver's reading of the batch files (``FileBatches.get``), bytes over time;
* row-feature seconds: the driver's clipped sums and updates (``base.run_step``) over rows x d;
* step stage and job seconds: the step jobs' total seconds in worker mode, with the jobs cut at
  groups (at most 200 steps) and with 50 steps a job (``--steps-per-job``): a job's seconds from
  the difference, a step's from the rest, less the step's compute over the workers;
* batch job bytes/s: the sampled bytes over the batch job's time, per worker.

Last, the projection (``step_costs.project``) for n = 10^7 to 10^9, d = 50 and 1,000, batch 10^3
to 10^7, 5 epochs, in each mode, with what ``--step_sums auto`` chooses; with ``--workers-for-
table`` workers. Nothing is asserted; docs/benchmarks/costs.md keeps a run.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark  # noqa: E402  (the worker pool and the data writer)

from beam_dp import batches, step_costs  # noqa: E402
from beam_dp.algorithms import base  # noqa: E402
from beam_dp.beam import aggregator as beam_aggregator  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=10_000)
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--workers", type=int, default=2, help="SDK worker processes")
    p.add_argument("--workers-for-table", type=int, default=32,
                   help="workers the projection table assumes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table-only", action="store_true",
                   help="only the projection from step_costs.MEASURED (no runs)")
    return p.parse_args(argv)


@contextlib.contextmanager
def _timed(owner, name, into: dict):
    real = getattr(owner, name)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - t0
    setattr(owner, name, call)
    try:
        yield
    finally:
        setattr(owner, name, real)


def run(pattern: str, out: str, temp: str, address: str, mode: str, args, *extra) -> dict:
    """The whole command on the pool; what it cost and what the driver read."""
    from beam_dp import cli
    made, aggregators, timings = beam_aggregator.BeamAggregator.__init__, [], {}

    def external(self, *a, **k):
        k["make_runner"] = benchmark.external_runner(address)
        made(self, *a, **k)
        aggregators.append(self)

    argv = ["train", "--input", pattern, "--output", out, "--overwrite", "--epsilon", "1",
            "--algorithm", "dpsgd", "--batch-size", str(args.batch_size), "--epochs",
            str(args.epochs), "--seed", str(args.seed), "--runner", "FnApiRunner",
            f"--direct_num_workers={args.workers}", "--temp_location", temp,
            "--step_sums", mode, *extra]
    beam_aggregator.BeamAggregator.__init__ = external
    before = beam_aggregator.DRIVER_BYTES_READ[0]
    try:
        with _timed(batches.FileBatches, "get", timings), _timed(base, "run_step", timings), \
                contextlib.redirect_stderr(io.StringIO()) as err:
            t0 = time.perf_counter()
            code = cli.main(argv)
            wall = time.perf_counter() - t0
    finally:
        beam_aggregator.BeamAggregator.__init__ = made
    if code != 0:
        raise RuntimeError(f"exit {code}: {err.getvalue()[-2000:]}")
    jobs = [j for a in aggregators for j in a.jobs]
    with open(os.path.join(out, "model.json")) as f:
        model = json.load(f)
    return {"wall": wall, "jobs": jobs, "driver_bytes": beam_aggregator.DRIVER_BYTES_READ[0] - before,
            "get": timings.get("get", 0.0), "run_step": timings.get("run_step", 0.0),
            "theta": np.array(model["coefficients"] + [model["intercept"]], dtype=float),
            "choice": aggregators[-1].step_sums}


def batch_files(pattern: str, temp: str, address: str, args) -> tuple[int, int]:
    """The batch job's files: the groups' it leaves for the steps (listed before the driver
    deletes them at the end of training) and the shards' it merged (which the driver deletes
    after the job)."""
    left, merged = [], []
    real_exit, real_delete = beam_aggregator.BatchFiles.__exit__, beam_aggregator.FileSystems.delete

    def exit_(self, *exc):
        left.extend(name for name in os.listdir(self.location) if name.startswith("group-"))
        return real_exit(self, *exc)

    def delete(paths):
        merged.extend(p for p in paths if os.path.basename(p).startswith("shard-"))
        return real_delete(paths)
    beam_aggregator.BatchFiles.__exit__ = exit_
    beam_aggregator.FileSystems.delete = staticmethod(delete)
    try:
        run(pattern, os.path.join(temp, "out-files"), temp, address, "driver", args)
    finally:
        beam_aggregator.BatchFiles.__exit__ = real_exit
        beam_aggregator.FileSystems.delete = real_delete
    return len(left), len(merged)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table_only:
        projection_table(args)
        return 0
    n, d, batch = args.n, args.d, args.batch_size
    steps = int(np.ceil(args.epochs * n / batch))
    tmp = tempfile.mkdtemp(prefix="beam-dp-costs-")
    try:
        files = benchmark.write_data(os.path.join(tmp, "data"), n, d, args.shards, args.seed)
        pattern = os.path.join(os.path.dirname(files[0]), "train-*.parquet")
        print(f"DP-SGD at n={n:,}, d={d}, batch {batch:,}, {args.epochs:g} epochs ({steps} steps), "
              f"{args.shards} Parquet files; a worker pool of {args.workers} processes; "
              f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
        results = {}
        with benchmark.worker_pool() as address:
            print(f"\n{'--step_sums':<10} {'wall s':>7} {'driver B/step':>14}  jobs (kind(steps): seconds)")
            for mode in ("driver", "workers"):
                r = results[mode] = run(pattern, os.path.join(tmp, f"out-{mode}"),
                                        os.path.join(tmp, "temp"), address, mode, args)
                jobs = ", ".join(f"{j['kind']}({j['steps']}): {j['seconds']:.1f}" for j in r["jobs"])
                print(f"{mode:<10} {r['wall']:7.1f} {r['driver_bytes'] / steps:14,.0f}  {jobs}")
            results["workers-50"] = run(pattern, os.path.join(tmp, "out-50"),
                                        os.path.join(tmp, "temp"), address, "workers", args,
                                        "--steps-per-job", "50")
            print(f"{'workers, 50 steps a job':<10} {results['workers-50']['wall']:7.1f}")
            same = np.array_equal(results["driver"]["theta"], results["workers"]["theta"])
            gap = np.abs(results["driver"]["theta"] - results["workers"]["theta"]).max()
            print(f"=> the same model in both modes: {same} (largest difference {gap:.3g}); "
                  f"auto here: {step_costs.choose('auto', True, batch, d, args.workers).line()}")

            print("\nThe batch job's files (same rows, driver mode)")
            for shards in (8, 64):
                sfiles = benchmark.write_data(os.path.join(tmp, f"data-{shards}"), n, d, shards,
                                              args.seed)
                spattern = os.path.join(os.path.dirname(sfiles[0]), "train-*.parquet")
                groups, merged = batch_files(spattern, os.path.join(tmp, f"temp-{shards}"),
                                             address, args)
                print(f"   {shards:>3} shards: {groups} group files left for {steps} steps "
                      f"({groups / steps:.2f} per step); {merged} shard files, merged and deleted")
                shutil.rmtree(os.path.dirname(sfiles[0]), ignore_errors=True)

        # ---------------------------------------------------------------- the model's inputs
        driver, workers = results["driver"], results["workers"]
        row_bytes = step_costs.row_bytes(d)
        sampled = args.epochs * n * row_bytes
        read_bps = driver["driver_bytes"] / driver["get"]
        row_feature = driver["run_step"] / (steps * batch * d)
        # Step jobs: T = jobs x job + steps x step, from the run's own jobs (cut at groups)
        # and the same run with 50 steps a job.
        def step_jobs(result):
            timed = [j for j in result["jobs"] if j["kind"] == "steps"]
            return len(timed), sum(j["seconds"] for j in timed)
        (k1, t1), (k2, t2) = step_jobs(workers), step_jobs(results["workers-50"])
        intercept = max(0.0, (t2 - t1) / (k2 - k1))
        slope = (t1 - k1 * intercept) / (steps + 1)   # (+1: the quality check's stage)
        stage = max(0.0, slope - batch * d * row_feature / args.workers)
        (batch_job,) = [j["seconds"] for j in driver["jobs"] if j["kind"] == "batches"]
        # (the whole batch job's time: its fixed part is small next to its bytes at scale,
        # and a difference of two noisy times here would overstate the rate)
        batch_bps = sampled / (batch_job * args.workers)
        costs = step_costs.Costs(read_bytes_per_s=read_bps, row_feature_seconds=row_feature,
                                 step_stage_seconds=stage, job_seconds=intercept,
                                 batch_job_bytes_per_s=batch_bps)
        print("\nThe cost model's inputs, from these runs (step_costs.Costs):")
        for field, value in vars(costs).items():
            print(f"   {field:<24} {value:.3g}")
        other = driver["wall"] - batch_job - driver["get"] - driver["run_step"]
        check = {m: step_costs.project(n, d, batch, args.epochs, m, args.workers, costs).seconds
                 for m in ("driver", "workers")}
        print(f"   projected back to this run: driver {check['driver']:.1f} s, workers "
              f"{check['workers']:.1f} s; measured {driver['wall']:.1f} / {workers['wall']:.1f} s, "
              f"of which {other:.1f} s the command's other jobs (count and ranges) and report")

        projection_table(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def projection_table(args) -> None:
    # ---------------------------------------------------------------- the projection
    w = args.workers_for_table
    print(f"\nProjected with these inputs (step_costs.MEASURED), {args.epochs:g} epochs, {w} "
          "workers: wall time, bytes the driver reads, jobs, batch files; auto's choice")
    print(f"   {'n':>7} {'d':>5} {'batch':>7} | {'driver: wall':>13} {'bytes':>9} | "
          f"{'workers: wall':>13} {'bytes':>9} {'jobs':>6} | {'files':>9}  auto")
    for pn in (1e7, 1e8, 1e9):
        for pd in (50, 1000):
            for pb in (1e3, 1e4, 1e5, 1e6, 1e7):
                if pb > pn / 10:
                    continue
                dr = step_costs.project(pn, pd, pb, args.epochs, "driver", w, step_costs.MEASURED)
                wk = step_costs.project(pn, pd, pb, args.epochs, "workers", w, step_costs.MEASURED)
                auto = step_costs.choose("auto", True, pb, pd, w).mode
                held = pb * step_costs.row_bytes(pd) > step_costs.DRIVER_BATCH_BYTES
                print(f"   {pn:7.0e} {pd:5d} {pb:7.0e} | "
                      f"{'(too big)' if held else _duration(dr.seconds):>13} {_bytes(dr.driver_bytes):>9} | "
                      f"{_duration(wk.seconds):>13} {_bytes(wk.driver_bytes):>9} {wk.jobs:6,d} | "
                      f"{wk.files:9,d}  {auto}")


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _bytes(count: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


if __name__ == "__main__":
    sys.exit(main())
