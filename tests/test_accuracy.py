"""Utility: DP-SGD at epsilon = 1 on Beam's default runner comes close to non-private logistic
regression on the same data (slow: 20,000 examples, 100 steps through Beam pipelines)."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.optimize import minimize
from scipy.special import log_expit

from beam_dp import data
from conftest import read_json


def _load(pattern):
    tables = [pq.read_table(p) for p in data.list_files(pattern)]
    x = np.vstack([np.column_stack([t[f"f{j}"].to_numpy() for j in range(20)]) for t in tables])
    y = np.concatenate([t["label"].to_numpy() for t in tables])
    return x, y


def _fit_logistic_regression(x, y):
    """Non-private logistic regression with an intercept, mean log loss, L-BFGS."""
    xi = np.column_stack([x, np.ones(len(x))])
    s = 2.0 * y - 1.0

    def objective(w):
        margin = s * (xi @ w)
        value = -np.mean(log_expit(margin))
        grad = -(xi.T @ (s * np.exp(log_expit(-margin)))) / len(y)
        return value, grad

    result = minimize(objective, np.zeros(xi.shape[1]), jac=True, method="L-BFGS-B",
                      options={"maxiter": 1000, "gtol": 1e-10})
    assert result.success, result.message
    return result.x


@pytest.mark.slow
def test_dpsgd_epsilon_1_is_within_3_points_of_non_private(tmp_path, cli):
    data_dir = tmp_path / "data"
    assert cli("make-data", "--output", data_dir).code == 0   # n = 20,000, d = 20 (defaults)
    out = tmp_path / "out"
    # The default runner (no --runner): Beam's in-process FnApiRunner.
    r = cli("train", "--input", data_dir / "train-*.parquet", "--validation",
            data_dir / "validation-*.parquet", "--output", out, "--algorithm", "dpsgd",
            "--epsilon", 1, "--delta", 1e-5, "--seed", 2024)
    assert r.code == 0, r
    privacy = read_json(out / "privacy_report.json")
    assert privacy["epsilon"] <= 1.0
    private_accuracy = read_json(out / "metrics.json")["accuracy"]

    x, y = _load(str(data_dir / "train-*.parquet"))
    assert len(y) == 20000 and x.shape[1] == 20
    x_val, y_val = _load(str(data_dir / "validation-*.parquet"))
    w = _fit_logistic_regression(x, y)
    baseline = float(np.mean(((x_val @ w[:-1] + w[-1]) > 0) == (y_val == 1)))

    assert abs(private_accuracy - baseline) <= 0.03, (private_accuracy, baseline)
