"""User-level against row-level privacy with dpgd or dpsgd, on synthetic data with skewed users.

    python pipelines/bench_user_level.py [--rows 50000] [--seeds 3] [--epsilon 1]
    python pipelines/bench_user_level.py --algorithm dpsgd --batch-fraction 0.1 [--flip-heavy]

dpsgd: the expected batch is --batch-fraction of the rows (row-level) or of the users
(user-level, which samples users), so both take the same expected share of the data per step
and the same number of steps (5 epochs). --flip-heavy flips the labels of the user holding
1,000 rows (a heavy user who disagrees with everyone else).

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


def make_table(path: str, rows: int, d: int, seed: int, flip_heavy: bool = False):
    x, y = synthetic.make_dataset("binary", rows + 20000, d, seed=seed)
    rng = np.random.default_rng(seed + 1)
    users = rng.zipf(1.5, rows) % 20000
    heavy = rng.choice(rows, 1000, replace=False)
    users[heavy] = 10**9   # one user with 1,000 rows
    if flip_heavy:
        y = y.copy()
        y[heavy] = 1.0 - y[heavy]
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
    parser.add_argument("--algorithm", default="dpgd", choices=("dpgd", "dpsgd"))
    parser.add_argument("--batch-fraction", type=float, default=0.1,
                        help="dpsgd: the expected batch as a share of the rows or users")
    parser.add_argument("--flip-heavy", action="store_true")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.max_rows.split(",")]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            path = os.path.join(tmp, f"train-{seed}.parquet")
            x_test, y_test, users = make_table(path, args.rows, args.features, seed,
                                               args.flip_heavy)
            common = dict(input=path, runner="local", epsilon=args.epsilon, delta=args.delta,
                          seed=seed, noise="float", algorithm=args.algorithm)
            sgd = args.algorithm == "dpsgd"
            runs = {"row-level": beam_dp.train(**common, **(
                {"batch_size": max(1, round(args.batch_fraction * args.rows))} if sgd else {}))}
            for k in ks:
                runs[f"user-level K={k}"] = beam_dp.train(
                    **common, privacy_unit_column="user_id", max_rows_per_user=k, **(
                        {"batch_size": max(1, round(args.batch_fraction * users))} if sgd else {}))
            for name, model in runs.items():
                results.setdefault(name, []).append(model.score(x_test, y_test))
            if seed == 0:
                print(f"{args.algorithm}: {args.rows} rows, {users} users (largest: 1,000 rows"
                      f"{', labels flipped' if args.flip_heavy else ''}), d={args.features}, "
                      f"epsilon={args.epsilon:g}, delta={args.delta:g}")
    for name, scores in results.items():
        print(f"{name:20s} accuracy {np.mean(scores):.3f} (+-{np.std(scores):.3f} over {len(scores)} seeds)")
    print(f"(default --max-rows-per-user: {user_level.DEFAULT_MAX_ROWS_PER_USER})")


if __name__ == "__main__":
    main()
