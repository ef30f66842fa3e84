"""Benchmark: what a training run costs on each runner, side by side, with the jobs it launched,
the input files it opened and the share of privacy accounting.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/benchmark.py

Writes synthetic logistic data as Parquet shards into a temporary directory and prints (figures
only, nothing is asserted):

1. Full-batch DP-GD, n = ``--n``, d = ``--d``: the numpy floor (one pass of X @ w and one of
   X.T @ r), and the cost of one step on ``--runner local``, on Beam's in-process FnApiRunner and
   on Beam's portable machinery with an external worker pool of 1 and 2 processes (FnApiRunner
   with an EXTERNAL environment served by ``worker_pool_main`` and ``direct_num_workers`` 1 or 2:
   the engine Beam's portable job service runs, with real SDK worker processes) at
   n = ``--portable-n`` (there with 2K more steps). A step's cost is (t(4 + K) - t(4)) / K over
   a job of 4 and one of 4 + K steps (K = ``--steps``; each the faster of two), each on a fresh
   aggregator (so each job reads its input: the reads are in the fixed part). The worker pool's
   rows also time steps inside one job of 4 + 3K steps ("in job": the median interval between
   the ends of consecutive steps, from ``TimedStep``; the faster of two such jobs), which the
   ratio of 2 processes to 1 uses: the difference of two jobs' times carries the 1-2 s by which
   starting SDK workers varies. Throughput = rows per second of steps.
2. Whole commands, as a user runs them: ``beam-dp train --epsilon 1`` (private count, default
   flags) with DP-SGD (batch ``--batch-size``, ``--epochs`` epochs) and DP-GD on n = ``--n``
   rows, on each runner (``cli.main`` in this process): wall time, the local runner's reading
   of the files, privacy accounting, report.html, and the Beam jobs launched (kind and steps)
   with their input file opens. Then the default command as a fresh process (imports
   included), and scikit-learn's and diffprivlib's LogisticRegression on the same files as
   fresh processes (imports, reading, fitting), where installed, on ``--peer-n`` rows.
3. The example job of docs/guide/command-line.md (``beam-dp make-data``, ``beam-dp train --epsilon 1``, default
   algorithm and runner): wall time and accounting share.
4. Secure noise (exact integer sums and discrete Gaussian noise) against float noise: a
   full-batch DP-GD step at n = ``--secure-n``, d = ``--secure-d`` on ``--runner local``.
5. Memory (``--skip-memory``): the peak resident memory of a local DP-SGD command as a fresh
   process on n x d and on a wide table (``--wide``), over the same command's on 1,000 rows.

``--skip-portable`` leaves out the worker pool rows (they start processes and take a minute).
Per-step figures are differences of job times: at small sizes or few steps a job's fixed cost
(worker start-up varies by seconds) swamps them and they can even come out negative; use the
defaults. Beam warns that ``direct_num_workers`` 2 wants ``multi_processing``: with an EXTERNAL
environment the pool's processes are the workers (the warning is filtered out here), and the
2-process rows open twice the files (each process caches every shard it is handed).
On a small machine shared with other jobs, OpenBLAS's default threads make matrix products
erratic; ``OPENBLAS_NUM_THREADS=1`` gives steadier figures. The header prints the load average.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from beam_dp import accounting, batches, data, losses, sampling, synthetic
from beam_dp.algorithms import base
from beam_dp.algorithms.base import TrainState
from beam_dp.algorithms.gradient_step import NoisyGradientStep
from beam_dp.block import Block
from beam_dp.local import LocalAggregator
from beam_dp.sampling import PoissonSampler


class _NotAboutExternalWorkers(logging.Filter):
    """Drops FnApiRunner's advice to use multi_processing with direct_num_workers > 1: wrong for
    an EXTERNAL environment, whose workers are the pool's processes."""

    def filter(self, record) -> bool:
        return "direct_running_mode" not in record.getMessage()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="examples (sections 1 and 2)")
    p.add_argument("--d", type=int, default=50, help="features")
    p.add_argument("--portable-n", type=int, default=1_000_000,
                   help="examples of the worker-pool full-batch rows")
    p.add_argument("--steps", type=int, default=20,
                   help="K: the long full-batch job has K steps more than the short one")
    p.add_argument("--batch-size", type=int, default=1000, help="DP-SGD expected batch size")
    p.add_argument("--epochs", type=float, default=5.0, help="DP-SGD epochs")
    p.add_argument("--shards", type=int, default=4, help="Parquet files")
    p.add_argument("--skip-portable", action="store_true", help="no worker-pool rows")
    p.add_argument("--skip-example", action="store_true", help="skip the example job (docs/guide/command-line.md)")
    p.add_argument("--skip-secure", action="store_true", help="no secure-noise rows")
    p.add_argument("--secure-n", type=int, default=2000, help="examples (section 4)")
    p.add_argument("--secure-d", type=int, default=10_000, help="features (section 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the runs")
    p.add_argument("--peer-n", type=int, default=200_000,
                   help="examples of the fresh-process comparison with scikit-learn (section 2)")
    p.add_argument("--skip-memory", action="store_true", help="no memory rows (section 5)")
    p.add_argument("--wide", default="20000x10000",
                   help="rows x columns of section 5's wide table (1.6 GB at the default)")
    args = p.parse_args(argv)
    if min(args.n, args.d, args.shards, args.batch_size, args.portable_n, args.steps) < 1:
        p.error("sizes and --steps must be positive")
    return args


LOSS = losses.LogisticLoss()


def write_data(directory: str, n: int, d: int, shards: int, seed: int) -> list[str]:
    x, y = synthetic.make_dataset("binary", n, d, seed)
    return synthetic.write_shards(directory, "train", x, y, shards)


def features(d: int) -> list[str]:
    return [f"f{j}" for j in range(d)]


def full_batch_step(n: int, d: int, seed: int) -> NoisyGradientStep:
    # sigma = 1, C = 1: the noise scale does not change the cost; no calibration needed.
    return NoisyGradientStep(loss=LOSS, clip_norm=1.0, noise_std=1.0, normalizer=float(n),
                             shape=(1, d + 1), learning_rate=1.0,
                             sampler=PoissonSampler(1.0, seed), seed=seed)


@dataclasses.dataclass(frozen=True)
class TimedStep(NoisyGradientStep):
    """The full-batch step, timed where it runs (this script only): each block's sum appends
    (step, wall time) to a file of its process in ``log_dir``, so that the worker pool's step
    time comes from inside a job (the last block of each step, steps WARM_STEPS on), free of the
    start-up of its SDK workers, which varies by seconds from job to job."""

    log_dir: str = ""

    def partial_sum(self, block, state):
        total = super().partial_sum(block, state)
        with open(os.path.join(self.log_dir, f"{os.getpid()}.log"), "a") as f:
            f.write(f"{state.step} {time.time()}\n")
        return total


def in_job_step(make_aggregator, step: NoisyGradientStep, d: int, k: int) -> float:
    """Median seconds between the ends of consecutive steps of one job of WARM_STEPS + k steps,
    after the first WARM_STEPS (the shards are in every worker's cache by then)."""
    log_dir = tempfile.mkdtemp(prefix="beam-dp-bench-steps-")
    try:
        timed = TimedStep(**{f.name: getattr(step, f.name) for f in dataclasses.fields(step)},
                          log_dir=log_dir)
        aggregator = make_aggregator()
        aggregator.run_stages([timed] * (WARM_STEPS + k), TrainState.zeros(1, d))
        aggregator.close()
        ends: dict = {}
        for name in os.listdir(log_dir):
            with open(os.path.join(log_dir, name)) as f:
                for line in f:
                    s, t = line.split()
                    ends[int(s)] = max(ends.get(int(s), 0.0), float(t))
        last = [ends[s] for s in sorted(ends) if s >= WARM_STEPS]
        return statistics.median(b - a for a, b in zip(last, last[1:]))
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def floor_seconds(blocks, repeats: int = 7) -> float:
    """Median seconds of one pass of ``X @ w`` plus one of ``X.T @ r`` over every block."""
    g = np.random.default_rng(0)
    w = g.standard_normal(blocks[0].features.shape[1])
    rs = [g.standard_normal(len(b)) for b in blocks]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b, r in zip(blocks, rs):
            b.features @ w
            b.features.T @ r
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def beam_aggregator(files, d: int, pipeline_args=(), make_runner=None):
    from beam_dp.beam.aggregator import BeamAggregator
    return BeamAggregator(files, "label", features(d), LOSS, data.DEFAULT_BATCH_ROWS,
                          ["--runner", "FnApiRunner", *pipeline_args], make_runner=make_runner)


# Steps of the short job: with several worker processes, the runner hands each a different part
# of the shards at each step, so every process fills its cache over the first few steps; the
# per-step figure is taken after them.
WARM_STEPS = 4


def per_step(make_aggregator, step, d: int, k: int, repeats: int = 1) -> dict:
    """Per-step seconds from jobs of WARM_STEPS and of WARM_STEPS + k steps, each on a fresh
    aggregator (so each job reads its input: that cost is in the fixed part); with ``repeats``,
    the fastest of that many jobs of each length (a worker pool's start-up varies by seconds)."""
    runs = {}
    for steps in (WARM_STEPS, WARM_STEPS + k):
        for _ in range(repeats):
            aggregator = make_aggregator()
            t0 = time.perf_counter()
            aggregator.run_stages([step] * steps, TrainState.zeros(1, d))
            seconds = time.perf_counter() - t0
            if steps not in runs or seconds < runs[steps][0]:
                runs[steps] = (seconds, getattr(aggregator, "jobs", []))
            aggregator.close()
    seconds = (runs[WARM_STEPS + k][0] - runs[WARM_STEPS][0]) / k
    jobs = runs[WARM_STEPS + k][1]
    return {"step": seconds, "fixed": runs[WARM_STEPS][0] - WARM_STEPS * seconds,
            "jobs": len(jobs), "opens": [j["file_opens"] for j in jobs]}


@contextlib.contextmanager
def worker_pool():
    """Beam's Python SDK worker pool (``worker_pool_main``) in its own process group; yields
    its address. Its workers are started as ``python`` from PATH: this interpreter's."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    here = os.path.dirname(os.path.abspath(__file__))   # pipelines/: TimedStep's module
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here])
    proc = subprocess.Popen([sys.executable, "-m", "apache_beam.runners.worker.worker_pool_main",
                             f"--service_port={port}"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("localhost", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the worker pool did not start")
                time.sleep(0.1)
        yield f"localhost:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def external_runner(address: str):
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.transforms import environments
    return lambda: FnApiRunner(default_environment=environments.ExternalEnvironment(address))


class _Split:
    """What one whole command spent where, measured in-process: the Beam jobs it launched (from
    each aggregator's record: kind, steps, seconds, file opens), the local runner's reading of
    the files (``data.load_blocks``), report.html (``report_html.build``) and privacy
    accounting (``accounting.STOPWATCH``, the driver's time in it)."""

    def __init__(self):
        self.jobs, self.read, self.report, self.sample, self.step = [], 0.0, 0.0, 0.0, 0.0
        self.draw = 0.0

    @contextlib.contextmanager
    def watching(self):
        from beam_dp import report_html
        from beam_dp.beam import aggregator as beam_aggregator_module
        aggregators = []
        real_init = beam_aggregator_module.BeamAggregator.__init__
        real_load, real_build = data.load_blocks, report_html.build

        def init(agg, *args, **kwargs):
            real_init(agg, *args, **kwargs)
            aggregators.append(agg)

        def timed(into):
            def wrap(function):
                def call(*args, **kwargs):
                    t0 = time.perf_counter()
                    try:
                        return function(*args, **kwargs)
                    finally:
                        setattr(self, into, getattr(self, into) + time.perf_counter() - t0)
                return call
            return wrap

        real_get, real_step = batches.LocalBatches.get, base.run_step
        real_draw = sampling.PoissonSampler.chunk_rows
        sampling.PoissonSampler.chunk_rows = timed("draw")(real_draw)
        beam_aggregator_module.BeamAggregator.__init__ = init
        data.load_blocks = timed("read")(real_load)
        report_html.build = timed("report")(real_build)
        batches.LocalBatches.get = timed("sample")(real_get)
        base.run_step = timed("step")(real_step)
        try:
            yield self
        finally:
            beam_aggregator_module.BeamAggregator.__init__ = real_init
            data.load_blocks, report_html.build = real_load, real_build
            batches.LocalBatches.get, base.run_step = real_get, real_step
            sampling.PoissonSampler.chunk_rows = real_draw
            self.jobs = [j for agg in aggregators for j in agg.jobs]


def whole_command(argv: list[str]) -> dict:
    """``beam-dp train ...`` as a user runs it, in this process (``cli.main``: its checks, the
    private count and ranges, training, the quality check, model.json, the report), with the
    accounting caches cleared first (each command pays its own calibration, as a fresh process
    does); where its time went (``_Split``)."""
    from beam_dp import cli
    accounting.clear_caches()
    accounting.STOPWATCH.reset()
    split, err = _Split(), io.StringIO()
    with split.watching(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(err):
        t0 = time.perf_counter()
        code = cli.main(argv)
        wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"beam-dp {' '.join(map(str, argv))} exited {code}: "
                           f"{err.getvalue()[-2000:]}")
    return {"wall": wall, "jobs": split.jobs, "read": split.read, "report": split.report,
            "sample": split.sample, "step": split.step, "draw": split.draw,
            "accounting": accounting.STOPWATCH.seconds or 0.0}


def subprocess_seconds(argv: list[str], env: dict | None = None) -> float:
    """Wall seconds of a fresh interpreter running ``argv`` (imports included)."""
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, **(env or {})})
    return time.perf_counter() - t0


PEER_SCRIPT = """
import sys, glob, numpy as np, pyarrow.parquet as pq, pyarrow as pa
peer, pattern, d = sys.argv[1], sys.argv[2], int(sys.argv[3])
table = pa.concat_tables([pq.read_table(f) for f in sorted(glob.glob(pattern))])
x = np.column_stack([table.column(f"f{j}").to_numpy() for j in range(d)])
y = table.column("label").to_numpy()
if peer == "sklearn":
    from sklearn.linear_model import LogisticRegression
    model = LogisticRegression(max_iter=200).fit(x, y)
else:
    from diffprivlib.models import LogisticRegression
    model = LogisticRegression(epsilon=1.0, data_norm=float(np.sqrt(d)) * 4).fit(x, y)
np.save(sys.argv[4], model.coef_)
"""


def peers(pattern: str, d: int, tmp: str) -> list[tuple[str, float | None]]:
    """Whole-command seconds of scikit-learn's and diffprivlib's LogisticRegression on the same
    files (a fresh interpreter: imports, reading the Parquet files, fitting, saving); None where
    the package is not installed."""
    import importlib.util
    script = os.path.join(tmp, "peer.py")
    with open(script, "w") as f:
        f.write(PEER_SCRIPT)
    out = []
    for peer, module in (("sklearn", "sklearn"), ("diffprivlib", "diffprivlib")):
        if importlib.util.find_spec(module) is None:
            out.append((peer, None))
            continue
        out.append((peer, subprocess_seconds([sys.executable, script, peer, pattern, str(d),
                                              os.path.join(tmp, f"{peer}.npy")])))
    return out


# VmHWM, not getrusage's ru_maxrss: Linux keeps a process's maxrss across exec, so a child of
# this (large) process would report this process's peak.
PEAK_SCRIPT = """
import sys
from beam_dp import cli
code = cli.main(sys.argv[1:])
with open("/proc/self/status") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024)
sys.exit(code)
"""


def peak_mib(files: list[str]) -> float:
    """Peak resident MiB of a fresh process running a local one-epoch DP-SGD command."""
    pattern = os.path.join(os.path.dirname(files[0]), "train-*.parquet")
    out = os.path.join(os.path.dirname(files[0]), "out")
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, "train", "--input", pattern,
                           "--output", out, "--overwrite", "--epsilon", "1", "--runner", "local",
                           "--algorithm", "dpsgd", "--epochs", "1"],
                          check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def read_seconds(files: list[str], d: int) -> dict:
    """Seconds to read ``files`` into training's blocks and into an Arrow table, each the
    faster of two (the second read of a file is from the page cache either way)."""
    import pyarrow.parquet as pq

    def best(read) -> float:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            read()
            times.append(time.perf_counter() - t0)
        return min(times)
    return {"ours": best(lambda: data.load_blocks(files, "label", features(d), LOSS)),
            "arrow": best(lambda: [pq.read_table(f) for f in files])}


def _job_summary(jobs: list[dict]) -> str:
    if not jobs:
        return "none"
    return "+".join(f"{j['kind']}({j['steps']})" for j in jobs) + \
        f"; opens {_opens([j['file_opens'] for j in jobs])}"


def readme_example(tmp: str) -> dict:
    from beam_dp import cli
    out = os.path.join(tmp, "example")
    with contextlib.redirect_stdout(io.StringIO()):   # the commands' own lines
        cli.main(["make-data", "--output", out, "--overwrite"])
    accounting.clear_caches()
    accounting.STOPWATCH.reset()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["train", "--input", os.path.join(out, "train-*.parquet"), "--validation",
                         os.path.join(out, "validation-*.parquet"), "--output",
                         os.path.join(tmp, "example-out"), "--overwrite", "--epsilon", "1",
                         "--delta", "1e-5"])
    return {"wall": time.perf_counter() - t0, "code": code,
            "accounting": accounting.STOPWATCH.seconds}


def _opens(opens) -> str:
    return "/".join("?" if o is None else str(o) for o in opens) or "-"


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("apache_beam.runners.portability.fn_api_runner.fn_runner").addFilter(
        _NotAboutExternalWorkers())
    n, d = args.n, args.d
    tmp = tempfile.mkdtemp(prefix="beam-dp-bench-")
    try:
        files = write_data(os.path.join(tmp, "data"), n, d, args.shards, args.seed)
        blocks = data.load_blocks(files, "label", features(d), LOSS)
        print(f"beam-dp benchmark: logistic, d={d}; {os.cpu_count()} CPUs; numpy {np.__version__}; "
              f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; load "
              f"average {os.getloadavg()[0]:.2f}")
        print()

        # ------------------------------------------------------------- 1. full-batch DP-GD
        print(f"1. Full-batch DP-GD step, n={n:,} in {args.shards} Parquet files "
              f"({n * d * 8 / 1e6:.0f} MB of features); per step from jobs of {WARM_STEPS} and {WARM_STEPS + args.steps} steps")
        step = full_batch_step(n, d, args.seed)
        floor = floor_seconds(blocks)
        rows = [("numpy floor (X@w + X.T@r)", floor, None, "")]
        # Each the faster of two jobs of each length, as for the worker pool below: a shared
        # machine's other tenants slow whole jobs at a time.
        local = per_step(lambda: LocalAggregator(blocks), step, d, args.steps, repeats=2)
        rows.append(("--runner local", local["step"], None, ""))
        beam = per_step(lambda: beam_aggregator(files, d), step, d, args.steps, repeats=2)
        rows.append(("Beam in-process (FnApiRunner)", beam["step"], beam,
                     f"fixed {beam['fixed']:.2f} s/job"))
        print(f"   {'runner':<44} {'ms/step':>9} {'x floor':>8} {'x local':>8}  jobs, file opens per job, notes")
        for name, seconds, info, note in rows:
            extra = f"{info['jobs']}, {_opens(info['opens'])}, {note}" if info else note
            print(f"   {name:<44} {seconds * 1e3:9.2f} {seconds / floor:8.2f} "
                  f"{seconds / local['step']:8.2f}  {extra}")
        print(f"   => Beam in-process step / local step: {beam['step'] / local['step']:.2f} (target <= 3)")

        portable_rows = []
        if not args.skip_portable:
            pn = args.portable_n
            pfiles = write_data(os.path.join(tmp, "portable"), pn, d, max(args.shards, 8), args.seed)
            pstep = full_batch_step(pn, d, args.seed)
            plocal = per_step(lambda: LocalAggregator(data.load_blocks(pfiles, "label", features(d), LOSS)),
                              pstep, d, args.steps)
            print(f"\n   n={pn:,} in {len(pfiles)} Parquet files, worker pool "
                  f"(FnApiRunner, EXTERNAL environment, worker_pool_main):")
            print(f"   {'runner':<44} {'ms/step':>9} {'in job':>8} {'rows/s':>12}  jobs, file opens per job")
            print(f"   {'--runner local':<44} {plocal['step'] * 1e3:9.2f} {'':>8} "
                  f"{pn / plocal['step']:12.3g}")
            with worker_pool() as address:
                for workers in (1, 2):
                    def make(workers=workers):
                        return beam_aggregator(pfiles, d, [f"--direct_num_workers={workers}"],
                                               external_runner(address))
                    result = per_step(make, pstep, d, 2 * args.steps, repeats=2)
                    # The faster of two jobs: another tenant of a shared machine slows a
                    # whole job's steps at a time (seen as steps twice as long for seconds).
                    result["in_job"] = min(in_job_step(make, pstep, d, 3 * args.steps)
                                           for _ in range(2))
                    portable_rows.append((workers, result))
                    print(f"   {f'worker pool, {workers} process(es)':<44} {result['step'] * 1e3:9.2f} "
                          f"{result['in_job'] * 1e3:8.2f} {pn / result['in_job']:12.3g}  "
                          f"{result['jobs']}, {_opens(result['opens'])}, "
                          f"fixed {result['fixed']:.2f} s/job")
            one, two = (r["in_job"] for _, r in portable_rows)
            print(f"   => throughput of 2 worker processes / 1 (in job): {one / two:.2f} "
                  "(target >= 1.5)")

        # ------------------------------------------------------------- 2. whole commands
        pattern = os.path.join(tmp, "data", "train-*.parquet")
        print(f"\n2. Whole commands (`beam-dp train --input ... --epsilon 1`, private count, default "
              f"flags), n={n:,}, d={d}: DP-SGD batch {args.batch_size}, {args.epochs:g} epochs; "
              "DP-GD with its default steps")
        runners = [("local", ["--runner", "local"]), ("Beam in-process", ["--runner", "FnApiRunner"])]
        pool = worker_pool() if not args.skip_portable else contextlib.nullcontext()
        with pool as address:
            if address:
                runners.append(("worker pool, 1 process", [
                    "--runner", "PortableRunner", "--job_endpoint", "embed", "--environment_type",
                    "EXTERNAL", "--environment_config", address,
                    "--temp_location", os.path.join(tmp, "beam-temp")]))
            print(f"   {'algorithm, runner':<34} {'wall s':>7} {'read':>6} {'acct':>6} {'acct %':>7} "
                  f"{'report':>7}  jobs (kind(steps)), file opens per job")
            whole = {}
            for algorithm, extra in (("dpsgd", ["--batch-size", str(args.batch_size), "--epochs",
                                                str(args.epochs)]), ("dpgd", [])):
                for name, runner in runners:
                    r = whole[algorithm, name] = whole_command(
                        ["train", "--input", pattern, "--output", os.path.join(tmp, "out"),
                         "--overwrite", "--epsilon", "1", "--algorithm", algorithm, *extra,
                         *runner])
                    print(f"   {algorithm + ', ' + name:<34} {r['wall']:7.2f} {r['read']:6.2f} "
                          f"{r['accounting']:6.2f} {100 * r['accounting'] / r['wall']:6.1f}% "
                          f"{r['report']:7.2f}  {_job_summary(r['jobs'])}")
        local, beam = whole["dpsgd", "local"], whole["dpsgd", "Beam in-process"]
        steps = local["sample"] + local["step"]
        print(f"   local DP-SGD's steps {steps:.2f} s: drawing the Poisson samples "
              f"{local['draw']:.2f} s ({100 * local['draw'] / steps:.0f}%; target <= 20%), "
              f"gathering their rows {local['sample'] - local['draw']:.2f} s, the clipped sums "
              f"and updates {local['step']:.2f} s")
        print(f"   => DP-SGD Beam in-process / local: {beam['wall'] / local['wall']:.2f}; "
              f"accounting on local DP-SGD {100 * local['accounting'] / local['wall']:.1f}% "
              f"(target <= 10%); report <= {max(r['report'] for r in whole.values()):.2f} s "
              "(target <= 1 s)")
        # A fresh process, as a user's shell starts it: imports included; and the peers.
        peer_files = write_data(os.path.join(tmp, "peer-data"), args.peer_n, d, args.shards,
                                args.seed)
        peer_pattern = os.path.join(os.path.dirname(peer_files[0]), "train-*.parquet")
        command = [os.path.join(os.path.dirname(sys.executable), "beam-dp"), "train", "--input",
                   peer_pattern, "--output", os.path.join(tmp, "out"), "--overwrite",
                   "--epsilon", "1", "--runner", "local"]
        ours = subprocess_seconds(command)
        print(f"\n   n={args.peer_n:,}, fresh processes: `beam-dp train --runner local --epsilon 1` "
              f"(default algorithm) {ours:.2f} s")
        for peer, seconds in peers(peer_pattern, d, tmp):
            print(f"   {peer:<12} " + ("not installed" if seconds is None else
                                      f"{seconds:.2f} s = {seconds / ours:.2f}x beam-dp's "
                                      "(imports, read, fit; target >= 0.5x for scikit-learn)"))

        # ------------------------------------------------------------- 3. the docs' example job
        if not args.skip_example:
            r = readme_example(tmp)
            acct = r["accounting"]
            print(f"\n3. the example job (make-data; train --epsilon 1, default dpgd on "
                  f"FnApiRunner): wall {r['wall']:.2f} s, exit {r['code']}, accounting "
                  + (f"{acct:.2f} s = {100 * acct / r['wall']:.1f}% (target <= 10%)"
                     if acct is not None else "n/a"))

        # ------------------------------------------------------------- 4. secure noise's cost
        if not args.skip_secure:
            sn, sd = args.secure_n, args.secure_d
            x, y = synthetic.make_dataset("binary", sn, sd, seed=args.seed)
            sblocks = [Block(x, LOSS.encode_labels(y), "secure-bench", 0)]
            print(f"\n4. Secure noise: a full-batch DP-GD step, n={sn:,}, d={sd:,}, --runner local "
                  f"(the exact sums' quantized rows are made once per block, outside the steps)")
            print(f"   {'noise':<44} {'ms/step':>9} {'x float':>8}")
            timed = {}
            for noise in ("float", "secure"):
                stepper = dataclasses.replace(full_batch_step(sn, sd, args.seed), noise=noise)
                timed[noise] = per_step(lambda: LocalAggregator(sblocks), stepper, sd, args.steps,
                                        repeats=2)["step"]
                print(f"   {noise:<44} {timed[noise] * 1e3:9.2f} {timed[noise] / timed['float']:8.2f}")
            print(f"   => secure / float: {timed['secure'] / timed['float']:.2f} (target <= 1.2)")
        # ------------------------------------------------------------- 5. memory
        if not args.skip_memory:
            rows, cols = (int(v) for v in args.wide.split("x"))
            print("\n5. Peak memory of `beam-dp train --runner local --epsilon 1 --algorithm dpsgd "
                  "--epochs 1` as a fresh process, over the same command's on 1,000 rows (the "
                  "imports), against the features' float64 bytes (target <= 1.5x)")
            tables = [(n, d, write_data(os.path.join(tmp, "memory-n"), n, d, args.shards,
                                        args.seed)),
                      (rows, cols, write_data(os.path.join(tmp, "memory-wide"), rows, cols, 1,
                                              args.seed))]
            small = write_data(os.path.join(tmp, "memory-small"), 1000, d, 1, args.seed)
            base = peak_mib(small)
            for rows_, cols_, files_ in tables:
                peak = peak_mib(files_)
                features_mib = rows_ * cols_ * 8 / 2 ** 20
                print(f"   {rows_:,} x {cols_:,} ({features_mib:,.0f} MiB): peak {peak:,.0f} MiB, "
                      f"imports {base:,.0f} MiB: {(peak - base) / features_mib:.2f}x")
                if cols_ != d:
                    read = read_seconds(files_, cols_)
                    print(f"   reading it into blocks (data.load_blocks) {read['ours']:.2f} s, "
                          f"pyarrow.parquet.read_table {read['arrow']:.2f} s: "
                          f"{read['ours'] / read['arrow']:.2f}x (target <= 3x; each the faster "
                          "of two)")
                    for f in files_:
                        os.remove(f)

        print(f"\nload average at the end {os.getloadavg()[0]:.2f} (figures from a loaded machine are noisy)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
