"""Sparse categorical data end to end (issue 14): a logistic regression on a synthetic click log
of hashed categorical columns, trained with beam-dp's defaults on the local runner and on Beam's
portable worker setup (an FnApiRunner whose two SDK worker processes a ``worker_pool_main``
starts, as tests/test_cluster_execution.py runs them), against a non-private logistic regression
(scikit-learn) on the same hashed features.

    python pipelines/bench_click_log.py                       # 10^6 rows, 3 x 10^5 values, 2^20 buckets
    python pipelines/bench_click_log.py --rows 100000 --runners local   # a quick look

Each training runs in a child process; its peak memory is the child's maximum resident set
(``wait4``), and the Beam workers' is the largest VmHWM seen among the SDK worker processes.
The accuracy is on a held-out split of new rows from the same model. The non-private baseline
gets the best test accuracy over C in {0.01, 0.1, 1} (tuned on the test split: optimistic for
the baseline, so the gap printed is an upper bound on the tuned gap).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from beam_dp import api, data, synthetic  # noqa: E402
from beam_dp.model import encode_columns  # noqa: E402

CATEGORICAL = list(synthetic.CLICK_COLUMNS)
FEATURES = ["position", *CATEGORICAL]
SHARDS = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--values", type=int, default=100_000, help="distinct values per column")
    p.add_argument("--buckets", type=int, default=1 << 20, help="--hash-buckets")
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--runners", default="local,portable")
    p.add_argument("--workdir", default=None)
    p.add_argument("--seed", type=int, default=1, help="the data's seed (the training's noise is "
                                                       "fixed too, for a reproducible table)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_data(directory: str, rows: int, values: int, seed: int) -> tuple[str, str]:
    train = synthetic.click_log(rows, seed, values=values)
    os.makedirs(os.path.join(directory, "train"), exist_ok=True)
    for i, part in enumerate(np.array_split(np.arange(rows), SHARDS)):
        data.write_table(os.path.join(directory, "train", f"part-{i}.parquet"),
                         {k: v[int(part[0]):int(part[-1]) + 1] for k, v in train.items()})
    test = synthetic.click_log(max(rows // 5, 1000), seed, split=1, values=values)
    data.write_table(os.path.join(directory, "test.parquet"), test)
    return os.path.join(directory, "train", "*.parquet"), os.path.join(directory, "test.parquet")


def child(args) -> int:
    """One training run (in its own process, so that its peak memory is its own)."""
    import benchmark   # pipelines/benchmark.py: the worker pool and its external runner

    warnings.simplefilter("ignore")
    kwargs = dict(input=os.path.join(args.workdir, "train", "*.parquet"), algorithm="dpgd",
                  epsilon=args.epsilon, seed=11, categorical_columns=CATEGORICAL,
                  hash_buckets=args.buckets)
    t0 = time.perf_counter()
    if args.child == "local":
        model = api.train(runner="local", **kwargs)
    else:
        from beam_dp.beam import aggregator as beam_aggregator
        made = beam_aggregator.BeamAggregator.__init__
        with benchmark.worker_pool() as address:
            def external(self, *a, **kw):
                kw["make_runner"] = benchmark.external_runner(address)
                made(self, *a, **kw)
            beam_aggregator.BeamAggregator.__init__ = external
            temp = tempfile.mkdtemp(prefix="bench-click-")
            model = api.train(runner="FnApiRunner", pipeline_args=[
                "--direct_num_workers", "2", "--temp_location", temp], **kwargs)
    wall = time.perf_counter() - t0
    model.save(os.path.join(args.workdir, f"model-{args.child}"), overwrite=True)
    import resource
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    print(json.dumps({"wall": wall, "peak_mb": peak_mb}))
    return 0


class WorkerMemory:
    """The largest VmHWM (peak resident set) among Beam SDK worker processes while running."""

    def __init__(self):
        self.peak_kb, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        command = f.read()
                    if b"SdkHarness" not in command and b"sdk_worker_main" not in command:
                        continue
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("VmHWM:"):
                                self.peak_kb = max(self.peak_kb, int(line.split()[1]))
                except OSError:
                    continue
            self._stop.wait(0.25)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_child(args, runner: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", runner, "--workdir", args.workdir,
            "--epsilon", str(args.epsilon), "--buckets", str(args.buckets)]
    with WorkerMemory() as workers:
        proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {runner} run failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]),
            "worker_peak_mb": workers.peak_kb / 1024}


def accuracy(model, test) -> float:
    x = {c: test[c] for c in FEATURES}
    return float(np.mean(model.predict(x) == np.asarray(test["label"])))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    import pyarrow.parquet as pq
    from sklearn.linear_model import LogisticRegression

    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench-click-log-")
    t0 = time.perf_counter()
    train_glob, test_path = write_data(args.workdir, args.rows, args.values, args.seed)
    print(f"click log: {args.rows:,} rows, {len(CATEGORICAL)} categorical columns of "
          f"{args.values:,} values (Zipf 1.1) + 1 numeric, hashed to {args.buckets:,} columns; "
          f"epsilon {args.epsilon:g}, delta 1e-5, dpgd defaults, private count "
          f"(data written in {time.perf_counter() - t0:.0f} s to {args.workdir})", flush=True)
    table = pq.read_table(test_path)
    test = dict(zip(table.column_names, table.columns))
    rows = []
    for runner in args.runners.split(","):
        measured = run_child(args, runner)
        model = api.Model.load(os.path.join(args.workdir, f"model-{runner}"))
        rows.append((runner, accuracy(model, test), measured["wall"], measured["peak_mb"],
                     measured["worker_peak_mb"], model))
        print(f"  trained on {runner}: {measured['wall']:.0f} s", flush=True)
    encoding = rows[0][5].encoding
    full = synthetic.click_log(args.rows, args.seed, values=args.values)
    x_train = encode_columns({c: full[c] for c in FEATURES}, encoding)
    x_test = encode_columns({c: test[c] for c in FEATURES}, encoding)
    y_test = np.asarray(test["label"])
    baseline = {}
    for c in (0.01, 0.1, 1.0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fitted = LogisticRegression(C=c, max_iter=300).fit(x_train, full["label"])
        baseline[c] = float(np.mean(fitted.predict(x_test) == y_test))
    best_c = max(baseline, key=baseline.get)
    majority = max(y_test.mean(), 1 - y_test.mean())
    print("\nnon-private logistic regression (scikit-learn, same hashed features): "
          + ", ".join(f"C={c:g}: {a:.4f}" for c, a in baseline.items())
          + f"; majority class {majority:.4f}")
    print(f"{'runner':<10} {'accuracy':>9} {'non-private':>12} {'gap (points)':>13} "
          f"{'peak MB (training process)':>27} {'peak MB (a Beam worker)':>24} {'wall s':>7}")
    for runner, acc, wall, peak, worker, _ in rows:
        print(f"{runner:<10} {acc:>9.4f} {baseline[best_c]:>12.4f} "
              f"{100 * (baseline[best_c] - acc):>13.2f} {peak:>27.0f} "
              f"{(f'{worker:.0f}' if worker else '-'):>24} {wall:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
