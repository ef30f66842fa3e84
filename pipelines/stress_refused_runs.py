"""Stress: many `beam-dp train` runs racing for a budget that admits few, each its own process.

No run may die by a signal (a refused run used to abort, exit 134, when the interpreter ended
the accounting thread inside scipy's FFT: beam_dp.accounting.accountants.shutdown), and every
exit code must be one of the table's (docs/guide/production.md). Prints the exit codes counted;
exits 1 if any run died by a signal or ended with an unexpected code.

    .venv/bin/python pipelines/stress_refused_runs.py --runs 200 --parallel 8
"""
from __future__ import annotations

import argparse
import collections
import os
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

BEAM_DP = os.path.join(os.path.dirname(sys.executable), "beam-dp")
EXPECTED = {0, 3, 4}   # done, refused by the budget, the same release running elsewhere


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=8)
    # The default: each run passes the pre-check (its stand-in reads 1.278) and is refused once
    # its plan is known (this DP-SGD reads 1.31), after its count: the path that aborted, with
    # the accounting thread at work. --budget 1.02: refused at the pre-check.
    parser.add_argument("--budget", type=float, default=1.29,
                        help="the dataset's lifetime epsilon (each run asks for 1)")
    parser.add_argument("--train-args", default="--algorithm dpsgd --batch-size 64",
                        help="more `beam-dp train` flags, shell-quoted")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        data, ledger = os.path.join(work, "data"), os.path.join(work, "ledger.db")
        subprocess.run([BEAM_DP, "make-data", "--output", data, "--n", "3000", "--d", "4",
                        "--validation-n", "0"], check=True, capture_output=True)
        subprocess.run([BEAM_DP, "ledger", "budget", "--ledger", ledger, "--dataset-id", "ds",
                        "--epsilon", str(args.budget), "--delta", "1e-5"], check=True,
                       capture_output=True)

        def run(k: int) -> int:
            # A seed per run: each is its own release, racing the others for the budget.
            return subprocess.run(
                [BEAM_DP, "train", "--input", os.path.join(data, "train-*.parquet"), "--output",
                 os.path.join(work, f"out{k}"), "--epsilon", "1", "--ledger", ledger,
                 "--dataset-id", "ds", "--seed", str(k), *shlex.split(args.train_args)],
                capture_output=True).returncode

        with ThreadPoolExecutor(args.parallel) as pool:
            codes = collections.Counter(pool.map(run, range(args.runs)))
    for code, count in sorted(codes.items()):
        what = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        print(f"{what:>22}: {count} of {args.runs} runs")
    bad = {c: n for c, n in codes.items() if c not in EXPECTED}
    if bad:
        print(f"unexpected: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
