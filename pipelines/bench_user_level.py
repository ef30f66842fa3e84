"""User-level against row-level privacy with dpgd, on synthetic data with skewed users.

    python pipelines/bench_user_level.py [--rows 50000] [--seeds 3] [--epsilon 1]

Rows come from ``synthetic.make_dataset("binary", ...)``; users are Zipf(1.5)-distributed over
20,000 ids (a few users hold most rows) and one user holds 1,000 rows. Prints the held-out
accuracy (mean over seeds) of row-level dpgd (the guarantee covers one row) and of user-level
dpgd at a few --max-rows-per-user (the guarantee covers one user with all their rows), all at
the same epsilon and delta, and the number of users and rows kept. Accuracy is computed on
held-out synthetic rows without noise: a benchmark figure, not a release.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

import beam_dp
from beam_dp import data, synthetic, user_level


def make_table(path: str, rows: int, d: int, seed: int):
    x, y = synthetic.make_dataset("binary", rows + 20000, d, seed=seed)
    rng = np.random.default_rng(seed + 1)
    users = rng.zipf(1.5, rows) % 20000
    users[rng.choice(rows, 1000, replace=False)] = 10**9   # one user with 1,000 rows
    columns = {f"x{j}": x[:rows, j] for j in range(d)}
    columns.update(label=y[:rows], user_id=np.array([f"u{u}" for u in users]))
    data.write_table(path, columns)
    return x[rows:], y[rows:], len(np.unique(users))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50000)
    parser.add_argument("--features", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--max-rows", default="8,64,1000")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.max_rows.split(",")]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            path = os.path.join(tmp, f"train-{seed}.parquet")
            x_test, y_test, users = make_table(path, args.rows, args.features, seed)
            common = dict(input=path, runner="local", epsilon=args.epsilon, delta=args.delta,
                          seed=seed, noise="float")
            runs = {"row-level": beam_dp.train(**common)}
            for k in ks:
                runs[f"user-level K={k}"] = beam_dp.train(
                    **common, privacy_unit_column="user_id", max_rows_per_user=k)
            for name, model in runs.items():
                results.setdefault(name, []).append(model.score(x_test, y_test))
            if seed == 0:
                print(f"{args.rows} rows, {users} users (largest: 1,000 rows), d={args.features}, "
                      f"epsilon={args.epsilon:g}, delta={args.delta:g}")
    for name, scores in results.items():
        print(f"{name:20s} accuracy {np.mean(scores):.3f} (+-{np.std(scores):.3f} over {len(scores)} seeds)")
    print(f"(default --max-rows-per-user: {user_level.DEFAULT_MAX_ROWS_PER_USER})")


if __name__ == "__main__":
    main()
