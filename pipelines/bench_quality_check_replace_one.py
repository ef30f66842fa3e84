"""The quality check's cost on the replace-one algorithms: each algorithm with the check (its
release reserved in the ledger before training) and without (--quality-check off), epsilon 1,
make-data's binary task (linear regression for heavy-tailed-md), 4,000 rows, seed 0: the
reported epsilon, the algorithm's noise multiplier, the check's verdict and the training accuracy
(or R^2). Usage: OPENBLAS_NUM_THREADS=1 .venv/bin/python pipelines/bench_quality_check_replace_one.py"""
from __future__ import annotations

import sys
import time
import warnings

import beam_dp
from beam_dp import synthetic

NAMES = ("mirror-descent", "heavy-tailed-md", "objective-perturbation", "bias-reduced-sgd",
         "output-perturbation")


def main(names) -> None:
    for name in names:
        model_name = "linear" if name == "heavy-tailed-md" else "logistic"
        x, y = synthetic.make_dataset("regression" if model_name == "linear" else "binary",
                                      4000, 5, 0)
        for check in ("on", "off"):
            start = time.time()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = beam_dp.train(x, y, algorithm=name, model=model_name, epsilon=1.0,
                                      seed=0, quality_check=check)
            report = model.privacy_report
            print(f"{name:24s} check {check:3s} epsilon {report['epsilon']:.4f} noise multiplier "
                  f"{report['mechanisms'][-1].get('noise_multiplier') or 0:.4g} verdict "
                  f"{report['quality_check']['status']:12s} score {model.score(x, y):.4f} "
                  f"({time.time() - start:.1f} s)")


if __name__ == "__main__":
    main(sys.argv[1:] or NAMES)
