"""Synthetic datasets for examples, tests and benchmarks (real data cannot be downloaded here)."""
from __future__ import annotations

import os

import numpy as np
from scipy.special import expit, softmax

from beam_dp.data import write_table

TASKS = ("binary", "multiclass", "regression")


def make_dataset(task: str, n: int, d: int, seed: int, num_classes: int = 3,
                 signal: float = 3.0, noise: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Features x ~ N(0, I_d); labels from a random linear model whose weights have norm ``signal``:
    binary 0/1 labels from a logistic model, integer classes from a softmax model, or real targets
    y = <x, w> + 0.5 + N(0, noise^2)."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, d))
    if task == "binary":
        w = g.standard_normal(d)
        w *= signal / np.linalg.norm(w)
        y = (g.random(n) < expit(x @ w + 0.5)).astype(np.int64)
    elif task == "multiclass":
        w = g.standard_normal((num_classes, d))
        w *= signal / np.linalg.norm(w, axis=1, keepdims=True)
        p = softmax(x @ w.T, axis=1)
        y = (g.random(n)[:, None] > np.cumsum(p, axis=1)).sum(axis=1).astype(np.int64)
    elif task == "regression":
        w = g.standard_normal(d)
        w *= signal / np.linalg.norm(w)
        y = x @ w + 0.5 + noise * g.standard_normal(n)
    else:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return x, y


def write_shards(directory: str, prefix: str, x: np.ndarray, y: np.ndarray, shards: int,
                 file_format: str = "parquet") -> list[str]:
    """Writes columns f0..f{d-1} and 'label' into ``shards`` files; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, rows in enumerate(np.array_split(np.arange(len(y)), shards)):
        path = os.path.join(directory, f"{prefix}-{i:05d}-of-{shards:05d}.{file_format}")
        columns = {f"f{j}": x[rows, j] for j in range(x.shape[1])}
        columns["label"] = y[rows]
        write_table(path, columns)
        paths.append(path)
    return paths
