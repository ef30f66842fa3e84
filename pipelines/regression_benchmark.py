"""Benchmark: private linear regression against OLS, and DP-GD's dimension independence.

    .venv/bin/python pipelines/regression_benchmark.py --seeds 3 > /tmp/regression_tables.md

Prints Markdown tables (figures only, nothing is asserted); progress goes to stderr. Everything
runs in-process on ``LocalAggregator`` over ``Block``s built from numpy arrays; no Beam.

Table A (paper 003, note §3.5): x ~ N(0, I_d), y = <x, w*> + z, z ~ N(0, s^2), ||w*|| = 1, no
true intercept. The excess (population) risk of an estimate (w, b) is 0.5 (||w - w*||^2 + b^2),
since H = I. Columns: OLS (``np.linalg.lstsq`` with an intercept column, on the same data),
DP-AMBSSGD (``dp_ambssgd.train`` with ``AmbssgdConfig()`` defaults, learning rate 1), SSP
(``ssp.train`` with ``SspConfig()`` defaults, AdaSSP ridge) and DP-SGD (``noisy_gd.train``,
algorithm ``dpsgd``, one fixed setting given in the caption). The dataset size is public
(``num_examples = n``), so no budget goes to a count. Median over seeds. One (x, w*, z0) draw per
(d, n, seed) is shared by every noise level (y = <x, w*> + s z0), epsilon and algorithm.

Table B (paper 002, note §5): rank-5 logistic data embedded in R^p (z rows N(0, I_5) normalized to
norm 1, U from the QR of a Gaussian p x 5 matrix, x = U z, P(y = +1) = sigmoid(<w0, z>) with
||w0|| = 2; the same z, y for every p), DP-GD (``noisy_gd.train``, ``dpgd``, no intercept,
clip 1, learning rate 1, rank 5, steps from n, epsilon and the rank, capped at 2000) and its
excess empirical risk L(theta) - L*, with L* from BFGS on the 5-dimensional problem. Mean over
seeds (each seed draws new z, y, w0, U and DP noise).
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time

import numpy as np
import scipy.optimize
from dp_accounting import dp_event as events
from scipy.special import expit, log_expit

from beam_dp import accounting, losses
from beam_dp.algorithms import dp_ambssgd, noisy_gd, ssp
from beam_dp.block import Block
from beam_dp.local import LocalAggregator

BLOCK_ROWS = 65536
DELTA = 1e-5


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3,
                   help="runs per configuration (median in A, mean in B)")
    p.add_argument("--seeds-large", type=int, default=None,
                   help="seeds for the n = 1e6 rows of table A (default: --seeds)")
    p.add_argument("--seeds-b", type=int, default=None,
                   help="seeds for table B (default: --seeds)")
    p.add_argument("--quick", action="store_true",
                   help="reduced grid: A with d = 10, n in {1e4, 1e5}, eps = 1; "
                        "B with p in {5, 50, 500}")
    p.add_argument("--only", choices=("A", "B"), default=None, help="print only one table")
    p.add_argument("--dpsgd-clip", type=float, default=2.0,
                   help="DP-SGD clip norm as a multiple of sqrt(d)")
    p.add_argument("--dpsgd-epochs", type=float, default=5.0, help="DP-SGD passes over the data")
    p.add_argument("--dpsgd-lr", type=float, default=0.5, help="DP-SGD learning rate")
    p.add_argument("--ambssgd-lr", type=float, default=1.0,
                   help="DP-AMBSSGD learning rate (the CLI's default for dp-ambssgd)")
    p.add_argument("--dpsgd-average", action=argparse.BooleanOptionalAction, default=True,
                   help="DP-SGD: output the average of all iterates (default) or the last one")
    p.add_argument("--tune-dpsgd", action="store_true",
                   help="print only the light DP-SGD tuning grid (24 settings on d = 10, n = 1e5, "
                        "eps = 1, s in {0.1, 1}, seeds not used by table A) and exit")
    args = p.parse_args(argv)
    if min(args.seeds, args.seeds_large or 1, args.seeds_b or 1) < 1:
        p.error("--seeds must be at least 1")
    return args


# ---------------------------------------------------------------------------------------------
# Table A


def regression_data(n: int, d: int, seed: int):
    """x ~ N(0, I_d) (float64), w* uniform on the unit sphere, z0 ~ N(0, 1)."""
    g = np.random.default_rng([1003, d, n, seed])
    w = g.standard_normal(d)
    w /= np.linalg.norm(w)
    x = g.standard_normal((n, d))
    z0 = g.standard_normal(n)
    return x, w, z0


def make_blocks(x: np.ndarray, y: np.ndarray, sq_norms: np.ndarray) -> list[Block]:
    return [Block(x[i:i + BLOCK_ROWS], y[i:i + BLOCK_ROWS], source="synthetic", row_start=i,
                  sq_norms=sq_norms[i:i + BLOCK_ROWS]) for i in range(0, len(y), BLOCK_ROWS)]


def excess(theta: np.ndarray, w_star: np.ndarray) -> float:
    theta = np.asarray(theta).reshape(-1)
    return 0.5 * (float(np.sum((theta[:-1] - w_star) ** 2)) + float(theta[-1]) ** 2)


def ols(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on [X, 1] (``np.linalg.lstsq``): (w, b) as one (d + 1)-vector."""
    return np.linalg.lstsq(np.column_stack([x, np.ones(len(y))]), y, rcond=None)[0]


_SIGMA_CACHE: dict = {}


def dpsgd_noise_multiplier(q: float, steps: int, epsilon: float) -> float:
    """The multiplier ``noisy_gd.train`` would calibrate for (q, steps, epsilon) with a public n
    (same event, same accountant); cached, since it does not depend on the data."""
    key = (q, steps, epsilon)
    if key not in _SIGMA_CACHE:
        _SIGMA_CACHE[key] = accounting.calibrate_noise_multiplier(
            lambda s: events.ComposedDpEvent([events.ComposedDpEvent([]),
                                              accounting.gaussian_steps_event(s, q, steps)]),
            epsilon, DELTA, "pld")
    return _SIGMA_CACHE[key]


def run_ambssgd(agg, n, d, eps, seed, lr):
    cfg = noisy_gd.NoisyGDConfig(epsilon=eps, delta=DELTA, learning_rate=lr, num_examples=n)
    return dp_ambssgd.train(cfg, dp_ambssgd.AmbssgdConfig(), losses.SquaredLoss(), d, agg, seed,
                            accounting.Ledger())


def run_ambssgd_nonprivate(agg, n, d, seed, lr):
    """The same one-pass algorithm (T, eta, tail average, clipping rule) with a negligible noise
    multiplier: its optimization and sampling error, the floor under the private runs."""
    cfg = noisy_gd.NoisyGDConfig(noise_multiplier=1e-9, delta=DELTA, learning_rate=lr,
                                 num_examples=n, accountant="rdp")
    return dp_ambssgd.train(cfg, dp_ambssgd.AmbssgdConfig(), losses.SquaredLoss(), d, agg, seed,
                            accounting.Ledger("rdp"))


def run_ssp(agg, n, d, eps, seed):
    cfg = noisy_gd.NoisyGDConfig(epsilon=eps, delta=DELTA, num_examples=n)
    return ssp.train(cfg, ssp.SspConfig(), losses.SquaredLoss(), d, agg, seed, accounting.Ledger())


def dpsgd_batch(n: int) -> int:
    return max(1000, n // 100)


def run_dpsgd(agg, n, d, eps, seed, args, clip=None, epochs=None, lr=None, average=None,
              private=True):
    clip = args.dpsgd_clip if clip is None else clip
    epochs = args.dpsgd_epochs if epochs is None else epochs
    lr = args.dpsgd_lr if lr is None else lr
    average = args.dpsgd_average if average is None else average
    batch = dpsgd_batch(n)
    q = min(1.0, batch / n)
    steps = max(1, math.ceil(epochs / q))
    # private=False: the same sampling, clipping and steps with a negligible noise multiplier
    # (RDP ledger: a PLD of so little noise would not fit in memory).
    sigma = dpsgd_noise_multiplier(q, steps, eps) if private else 1e-9
    cfg = noisy_gd.NoisyGDConfig(algorithm="dpsgd", clip_norm=clip * math.sqrt(d), learning_rate=lr,
                                 batch_size=batch, epochs=epochs, noise_multiplier=sigma,
                                 delta=DELTA, num_examples=n, average_iterates=average,
                                 steps_per_chunk=10 ** 6, accountant="pld" if private else "rdp")
    ledger = accounting.Ledger("pld" if private else "rdp")
    result = noisy_gd.train(cfg, losses.SquaredLoss(), d, agg, seed, ledger)
    spent = ledger.epsilon(DELTA)
    if private and spent > eps * 1.001:
        raise RuntimeError(f"DP-SGD spent epsilon {spent} > {eps}")
    return result


def fmt(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "diverged" if v is not None else "-"
    return f"{v:.2e}"


def table_a(args) -> None:
    quick = args.quick
    ds = [10] if quick else [10, 50]
    ns = [10_000, 100_000] if quick else [10_000, 100_000, 1_000_000]
    epss = [1.0] if quick else [0.5, 1.0, 2.0]
    noises = [0.0, 0.1, 1.0]
    algos = ("DP-AMBSSGD", "SSP", "DP-SGD")
    results: dict = {}      # (d, n, eps, s) -> {name: [values]}
    amb_info: dict = {}     # (n, eps) -> public DP-AMBSSGD parameters
    seeds_used: dict = {}
    t0 = time.time()
    for d in ds:
        for n in ns:
            seeds = args.seeds_large if (n >= 1_000_000 and args.seeds_large) else args.seeds
            seeds_used[n] = seeds
            for seed in range(seeds):
                x, w_star, z0 = regression_data(n, d, seed)
                sq = np.einsum("ij,ij->i", x, x)
                for s in noises:
                    y = x @ w_star + s * z0
                    agg = LocalAggregator(make_blocks(x, y, sq))
                    base = {}
                    base["OLS"] = excess(ols(x, y), w_star)
                    base["SGD-np"] = excess(run_dpsgd(agg, n, d, None, 7919 * seed + 1, args,
                                                      private=False).theta, w_star)
                    base["AMB-np"] = excess(run_ambssgd_nonprivate(agg, n, d, 7919 * seed + 1, args.ambssgd_lr).theta,
                                            w_star)
                    for eps in epss:
                        cell = results.setdefault(
                            (d, n, eps, s), {k: [] for k in ("OLS", "AMB-np", "SGD-np") + algos})
                        for k, v in base.items():
                            cell[k].append(v)
                        alg_seed = 7919 * seed + 1
                        t = time.time()
                        r = run_ambssgd(agg, n, d, eps, alg_seed, args.ambssgd_lr)
                        cell["DP-AMBSSGD"].append(excess(r.theta, w_star))
                        pre = r.preprocessing
                        levels = pre["residual_levels"]
                        sigma_stat = r.noise_multiplier * math.sqrt(levels)
                        margin = sigma_stat * math.sqrt(2 * math.log(levels / 0.01))
                        amb_info[(n, eps)] = dict(s=pre["stat_size"], b=pre["batch_size"],
                                                  sigma=r.noise_multiplier, levels=levels,
                                                  margin=margin,
                                                  resolution=pre["residual_resolution"])
                        ta = time.time() - t
                        t = time.time()
                        r = run_ssp(agg, n, d, eps, alg_seed)
                        cell["SSP"].append(excess(r.theta, w_star))
                        ts = time.time() - t
                        t = time.time()
                        r = run_dpsgd(agg, n, d, eps, alg_seed, args)
                        cell["DP-SGD"].append(excess(r.theta, w_star))
                        tg = time.time() - t
                        log(f"[A {time.time() - t0:7.1f}s] d={d} n={n} seed={seed} s={s} eps={eps}: "
                            + " ".join(f"{k}={v[-1]:.2e}" for k, v in cell.items())
                            + f"  (amb {ta:.1f}s ssp {ts:.1f}s sgd {tg:.1f}s)")
                    del agg, y
                del x, z0, sq

    large = [n for n in ns if seeds_used.get(n) != args.seeds]
    seed_note = (f"median over {args.seeds} seeds" if not large else
                 f"median over {args.seeds} seeds ({seeds_used[large[0]]} for n = "
                 f"{', '.join(f'{n:.0e}' for n in large)} to bound the wall time)")
    sgd = (f"DP-SGD: Poisson sampling, expected batch max(1000, n/100), {args.dpsgd_epochs:g} epochs, "
           f"clip {args.dpsgd_clip:g}*sqrt(d), learning rate {args.dpsgd_lr:g}, "
           f"{'averaged iterates' if args.dpsgd_average else 'last iterate'}, PLD-calibrated noise "
           "multiplier; fixed for every row (chosen by the light tuning of `--tune-dpsgd`: "
           "24 settings on d = 10, n = 1e5, eps = 1, s in {0.1, 1}, seeds not used here)")
    amb, sspc = dp_ambssgd.AmbssgdConfig(), ssp.SspConfig()
    print("## Table A: excess risk, private linear regression vs OLS\n")
    print(f"x ~ N(0, I_d), y = <x, w*> + N(0, s^2), ||w*|| = 1, no true intercept; excess risk "
          f"0.5 (||w - w*||^2 + b^2) (H = I); delta = {DELTA:g}, n public; {seed_note}. "
          "The trivial estimate w = 0 has excess 0.5. OLS: least squares with an intercept "
          "column on the same data (expected s^2 d / (2 (n - d - 1)) + intercept). DP-AMBSSGD: "
          f"`AmbssgdConfig()` defaults (T = {amb.blocks} blocks, s/(b+s) = {amb.stat_fraction:.3g}, "
          f"R_x = sqrt(d), B = {amb.residual_bound:g}, Delta = B/n), learning rate {args.ambssgd_lr:g}. SSP: "
          f"`SspConfig()` defaults (C_x = 2 sqrt(d), C_y = {sspc.label_bound:g}, AdaSSP ridge). "
          f"{sgd}. Last two columns (not private, references that do not depend on eps): the "
          "same DP-AMBSSGD code and block assignment, and the same DP-SGD code, sampling and "
          "clipping, with noise multiplier 1e-9, i.e. their optimization and sampling error "
          f"alone (DP-AMBSSGD: T = 12 one-pass steps, eta = {args.ambssgd_lr:g}, tail average of the last 6 "
          "iterates). A private column minus its no-noise column is the cost of privacy; SSP's "
          "no-noise counterpart is essentially OLS.\n")
    print("| d | n | eps | noise s | OLS | DP-AMBSSGD | SSP | DP-SGD | AMBSSGD, no noise | "
          "SGD, no noise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in ds:
        for n in ns:
            for eps in epss:
                for s in noises:
                    cell = results[(d, n, eps, s)]
                    med = {k: statistics.median(v) for k, v in cell.items()}
                    print(f"| {d} | {n:.0e} | {eps:g} | {s:g} | "
                          + " | ".join(fmt(med[k]) for k in ("OLS",) + algos + ("AMB-np", "SGD-np"))
                          + " |")
    print()
    print("Ratios to OLS (median excess / median OLS excess; rows with s > 0, OLS is exact "
          "at s = 0):\n")
    print("| d | n | eps | noise s | DP-AMBSSGD / OLS | SSP / OLS | DP-SGD / OLS |")
    print("|---|---|---|---|---|---|---|")
    for d in ds:
        for n in ns:
            for eps in epss:
                for s in noises:
                    if s == 0:
                        continue
                    cell = results[(d, n, eps, s)]
                    o = statistics.median(cell["OLS"])
                    print(f"| {d} | {n:.0e} | {eps:g} | {s:g} | "
                          + " | ".join(f"{statistics.median(cell[k]) / o:.3g}" for k in algos) + " |")
    print()
    print("DP-AMBSSGD public parameters per (n, eps) (nominal stat size s and batch b per block, "
          "noise multiplier sigma, L + 1 residual levels, robust stopping margin Gamma' = "
          "sigma sqrt(L+1) sqrt(2 ln((L+1)/0.01)); when s < Gamma' the DP-STAT search can stop "
          "at the first level whatever the residuals are; the realized stat part of a block is "
          "random, Binomial with mean s and std ~ sqrt(s), while the stopping rule compares with "
          "the nominal s: when sqrt(s) is not small against Gamma' the search often cannot stop "
          "and falls back to the largest level, gamma = B; gamma is never below the grid's "
          "first level Delta = B/n, so neither is the clip R_x gamma nor the noise):\n")
    print("| n | eps | s | sqrt(s) | b | sigma | L + 1 | Gamma' | Delta |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (n, eps), v in sorted(amb_info.items()):
        print(f"| {n:.0e} | {eps:g} | {v['s']:.0f} | {math.sqrt(v['s']):.0f} | {v['b']:.0f} | "
              f"{v['sigma']:.3g} | {v['levels']} | {v['margin']:.0f} | {v['resolution']:g} |")
    print()
    print("DP-SGD noise multipliers (q = expected batch / n, steps = ceil(epochs / q)):\n")
    print("| q | steps | eps | sigma |")
    print("|---|---|---|---|")
    for (q, steps, eps), sigma in sorted(_SIGMA_CACHE.items()):
        print(f"| {q:g} | {steps} | {eps:g} | {sigma:.3g} |")
    print()
    log(f"table A done in {time.time() - t0:.0f}s")


def tune_dpsgd(args) -> None:
    """The light tuning grid behind the fixed DP-SGD setting: one configuration (d = 10, n = 1e5,
    eps = 1) at s = 0.1 and s = 1, on held-out seeds; ranked by the geometric mean of the two."""
    d, n, eps = 10, 100_000, 1.0
    noises = (0.1, 1.0)
    grid = [(c, e, lr, av) for c in (0.5, 1.0, 2.0) for e in (2.0, 5.0) for lr in (0.25, 0.5)
            for av in (False, True)]
    scores: dict = {(k, s): [] for k in grid for s in noises}
    for seed in (100, 101):
        x, w_star, z0 = regression_data(n, d, seed)
        sq = np.einsum("ij,ij->i", x, x)
        for s in noises:
            agg = LocalAggregator(make_blocks(x, x @ w_star + s * z0, sq))
            for k in grid:
                c, e, lr, av = k
                r = run_dpsgd(agg, n, d, eps, 7919 * seed + 1, args, clip=c, epochs=e, lr=lr,
                              average=av)
                scores[(k, s)].append(excess(r.theta, w_star))
                log(f"[tune] seed={seed} s={s} clip={c}*sqrt(d) epochs={e} lr={lr} avg={av}: "
                    f"{scores[(k, s)][-1]:.2e}")

    def mean(k, s):
        return statistics.mean(scores[(k, s)])

    def rank(k):
        return math.prod(mean(k, s) for s in noises) ** (1 / len(noises))
    print(f"## DP-SGD tuning (d = {d}, n = {n:.0e}, eps = {eps:g}, delta = {DELTA:g}, expected batch "
          "max(1000, n/100); mean excess over held-out seeds 100 and 101; sorted by the geometric "
          "mean over the noise levels)\n")
    print("| clip / sqrt(d) | epochs | lr | averaged | " + " | ".join(f"s = {s:g}" for s in noises)
          + " | geometric mean |")
    print("|---|---|---|---|" + "---|" * (len(noises) + 1))
    for k in sorted(grid, key=rank):
        print(f"| {k[0]:g} | {k[1]:g} | {k[2]:g} | {'yes' if k[3] else 'no'} | "
              + " | ".join(f"{mean(k, s):.2e}" for s in noises) + f" | {rank(k):.2e} |")
    print()


# ---------------------------------------------------------------------------------------------
# Table B


def logistic_loss(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(-log_expit(y * (x @ theta))))


def rank_data(n: int, r: int, seed: int):
    """Note 002 §5: z rows N(0, I_r) normalized to norm 1, ||w0|| = 2, y = +-1 with
    P(+1) = sigmoid(<w0, z>)."""
    g = np.random.default_rng([2002, n, r, seed])
    z = g.standard_normal((n, r))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    w0 = g.standard_normal(r)
    w0 *= 2.0 / np.linalg.norm(w0)
    y = np.where(g.random(n) < expit(z @ w0), 1.0, -1.0)
    return z, y


def optimum(z: np.ndarray, y: np.ndarray) -> float:
    """L* of the r-dimensional problem (BFGS with the analytic gradient)."""
    def f(w):
        return logistic_loss(w, z, y)

    def grad(w):
        return z.T @ (-y * expit(-y * (z @ w))) / len(y)
    res = scipy.optimize.minimize(f, np.zeros(z.shape[1]), jac=grad, method="BFGS",
                                  options={"gtol": 1e-10, "maxiter": 10_000})
    return float(res.fun)


def table_b(args) -> None:
    n, r, eps = 500, 5, 1.0
    ps = [5, 50, 500] if args.quick else [5, 20, 100, 500, 2000]
    rows: dict = {p: {"excess": [], "steps": None, "l0": []} for p in ps}
    seeds = args.seeds_b or args.seeds
    t0 = time.time()
    for seed in range(seeds):
        z, y = rank_data(n, r, seed)
        l_star = optimum(z, y)
        for p in ps:
            g = np.random.default_rng([2002, p, seed, 1])
            u, _ = np.linalg.qr(g.standard_normal((p, r)))
            x = z @ u.T
            agg = LocalAggregator([Block(x, y.copy(), source="synthetic", row_start=0)])
            cfg = noisy_gd.NoisyGDConfig(algorithm="dpgd", epsilon=eps, delta=DELTA, learning_rate=1.0,
                                         num_examples=n, fit_intercept=False, rank=r, clip_norm=1.0,
                                         steps_per_chunk=10 ** 6)
            result = noisy_gd.train(cfg, losses.LogisticLoss(), p, agg, 31 * seed + 5,
                                    accounting.Ledger())
            theta = result.theta[0, :-1]
            assert result.theta[0, -1] == 0.0
            rows[p]["excess"].append(logistic_loss(theta, x, y) - l_star)
            rows[p]["l0"].append(math.log(2.0) - l_star)
            rows[p]["steps"] = result.steps
            log(f"[B {time.time() - t0:6.1f}s] seed={seed} p={p} steps={result.steps} "
                f"sigma={result.noise_multiplier:.3g} excess={rows[p]['excess'][-1]:.4f} "
                f"L(0)-L*={rows[p]['l0'][-1]:.4f}")
    print("## Table B: DP-GD excess empirical risk vs ambient dimension (rank-5 logistic data)\n")
    print(f"n = {n}, rank r = {r}, eps = {eps:g}, delta = {DELTA:g}; note 002 §5 generator (same "
          "z, y for every p within a seed; U from the QR of a Gaussian p x r matrix); DP-GD = "
          "`noisy_gd.train` with algorithm dpgd, no intercept, clip 1 (= the Lipschitz bound, so "
          "nothing is clipped), learning rate 1, rank 5, steps from (n, eps, rank) capped at 2000, "
          f"averaged iterates; mean over {seeds} seeds (each a new z, y, w0, U and noise). "
          "L(0) - L* is the excess of the trivial output 0.\n")
    print("| p | steps | excess empirical risk | L(0) - L* |")
    print("|---|---|---|---|")
    for p in ps:
        v = rows[p]
        sd = statistics.stdev(v["excess"]) if len(v["excess"]) > 1 else float("nan")
        print(f"| {p} | {v['steps']} | {statistics.mean(v['excess']):.4f} (sd {sd:.4f}) | "
              f"{statistics.mean(v['l0']):.4f} |")
    print()
    log(f"table B done in {time.time() - t0:.0f}s")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging
        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass
    t0 = time.time()
    if args.tune_dpsgd:
        tune_dpsgd(args)
        return
    if args.only in (None, "A"):
        table_a(args)
    if args.only in (None, "B"):
        table_b(args)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
