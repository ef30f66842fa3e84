"""How often ``beam-dp audit`` catches a build with a tenth of the noise, by canary count: the
audit of a broken build (every noise draw scaled by 0.1, ``mechanisms.NOISE_SCALE_FOR_TESTS``,
the hook the tests use) run over seeds, printed side by side for each algorithm, epsilon and
number of canaries, with the sound build's bound next to it (it must stay below its claim).

    .venv/bin/python pipelines/bench_audit_canaries.py [--rows 20000] [--seeds 5]
        [--canaries 1000,default] [--epsilons 1,4] [--algorithms dpgd,dpsgd]

"default" is ``audit.default_canaries(epsilon)``. The table: n rows of 5 standard normal
columns and a logistic label (seeded), as the audit tests' synthetic table but larger. Also
printed: the most any audit with m canaries can show (every guess right, ``audit.ceiling``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--canaries", default="1000,default")
    parser.add_argument("--epsilons", default="1,4")
    parser.add_argument("--algorithms", default="dpgd,dpsgd")
    parser.add_argument("--no-sound", action="store_true", help="skip the sound build's runs")
    args = parser.parse_args(argv)
    from beam_dp import audit, mechanisms

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 5))
    y = (x @ rng.normal(size=5) + rng.logistic(size=args.rows) > 0).astype(float)
    print(f"{args.rows:,} rows, {args.seeds} seeds; caught = lower bound above the canaries' "
          "claim")
    print(f"{'algorithm':>10} {'epsilon':>7} {'canaries':>8} {'ceiling':>7} "
          f"{'claim':>6} {'broken: caught':>15} {'bounds (min-max)':>17} "
          f"{'sound: max bound':>17} {'s/run':>6}")
    for algorithm in args.algorithms.split(","):
        for epsilon in (float(e) for e in args.epsilons.split(",")):
            for spec in args.canaries.split(","):
                m = audit.default_canaries(epsilon) if spec == "default" else int(spec)
                bounds, sound, claim, started = [], [], None, time.perf_counter()
                for seed in range(args.seeds):
                    mechanisms.NOISE_SCALE_FOR_TESTS = 0.1
                    try:
                        found = audit.run(x, y, algorithm=algorithm, epsilon=epsilon, seed=seed,
                                          canaries=m)
                    finally:
                        mechanisms.NOISE_SCALE_FOR_TESTS = 1.0
                    claim = found["claimed_epsilon_of_canary_releases"]
                    bounds.append(found["epsilon_lower_bound"])
                    if not args.no_sound:
                        sound.append(audit.run(x, y, algorithm=algorithm, epsilon=epsilon,
                                               seed=seed, canaries=m)["epsilon_lower_bound"])
                runs = args.seeds * (1 if args.no_sound else 2)
                caught = sum(b > claim for b in bounds)
                print(f"{algorithm:>10} {epsilon:7g} {m:8d} {audit.ceiling(m):7.2f} "
                      f"{claim:6.3f} {f'{caught} of {len(bounds)}':>15} "
                      f"{f'{min(bounds):.2f}-{max(bounds):.2f}':>17} "
                      f"{(f'{max(sound):.2f}' if sound else '-'):>17} "
                      f"{(time.perf_counter() - started) / runs:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
