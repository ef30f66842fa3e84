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


CLICK_COLUMNS = ("user", "item", "site")


def click_log(n: int, seed: int, split: int = 0, values: int = 100_000, zipf: float = 1.1,
              columns: tuple = CLICK_COLUMNS) -> dict:
    """A synthetic click log: ``columns`` categorical columns of ``values`` distinct strings
    each, drawn with Zipf-like popularity (probability of the r-th most popular value
    proportional to r^-``zipf``; ids are shuffled, so popularity is not in the name), one
    numeric column ``position`` in [0, 1], and a 0/1 ``label`` from a logistic model with one
    N(0, 1) weight per value. The model (names, popularity, weights) comes from ``seed``; the
    rows from (``seed``, ``split``), so a test split is new rows of the same model. Columns are
    Arrow arrays: the strings are dictionary-decoded views of one vocabulary per column, never
    built row by row."""
    import pyarrow as pa

    model = np.random.default_rng(seed)
    rows = np.random.default_rng([seed, split, 1])
    popularity = np.arange(1, values + 1, dtype=np.float64) ** -zipf
    popularity /= popularity.sum()
    logit = np.full(n, -0.5)
    out = {}
    for name in columns:
        names = pa.array([f"{name}-{i:06d}" for i in model.permutation(values)])
        weights = model.standard_normal(values)
        ids = rows.choice(values, size=n, p=popularity)
        logit += weights[ids]
        out[name] = pa.DictionaryArray.from_arrays(pa.array(ids.astype(np.int32)), names).dictionary_decode()
    position = rows.random(n)
    logit += 1.5 - 3.0 * position
    out["position"] = position
    out["label"] = (rows.random(n) < expit(logit)).astype(np.int64)
    return out
