"""DPSGD-F: DP-SGD with private feature preprocessing (paper 000, Sun, Suresh & Menon).

DP-SGD's error scales with the largest feature norm; centering the features at a private mean
first makes it scale with their spread. Two variants, both on top of ``noisy_gd.train``:

* ``practical`` (Algorithm 3, used in all the paper's experiments): every feature vector is
  normalized to norm C_F (``feature_norm``); a Gaussian mean of the normalized features (noise
  multiplier from the analytic Gaussian calibration at (epsilon_F, delta), noise std sigma_F * C_F
  on the sum, erratum 4 of the note); DP-SGD on x - mu with gradient clipping at C_G and an
  intercept; the intercept is un-shifted, b = b' - mu . w (the model then applies to normalized
  features, which ``model.json`` records).
* ``theory`` (Algorithm 2): features clipped to the bound R: ``feature_norm`` if given (public),
  else derived privately (see below); the adaptive private mean of ``stats.adaptive_mean_stages``
  at epsilon_F / 2 (the role of Lemma 3); a private quantile tau of the distances ||x - mu||
  (exponential mechanism, epsilon_F / 2, or epsilon_F / 4 when R is derived); features
  x'' = Clip((x - mu, tau), sqrt(2) tau) with no separate intercept; DP-SGD with clip norm
  sqrt(2) G tau (G the loss's Lipschitz constant in the score) so that no gradient is clipped; the
  map back uses the corrected intercept b = theta[d] tau - w . mu (erratum 3).

Budget: the DP-SGD noise multiplier is calibrated so that the PLD composition of every release
(count, preprocessing, steps) meets the requested (epsilon, delta), rather than the paper's even
thirds with basic composition (tighter, and never looser). Target rank of tau: the paper's
n - (100/epsilon) log n is a constant of its proof (of the Dick et al. quantile algorithm); with
the exponential mechanism here we aim at E = (2/epsilon_tau) ln(G n) points above tau (its rank
error at failure probability 1/n), counted from the top of the distances' histogram, so that
with probability 1 - 1/n between 0 and 2E points are shrunk whatever the released count says.
(Aiming at rank n_noisy - E, as before, failed whenever the count overshot by more than E:
every grid cell above the largest distance then scored the same, and tau was drawn almost
uniformly from its grid, in ~3 of 10 runs at the default count budget.)

Without ``feature_norm`` the theory variant derives R privately rather than assume a scale (a
default of 1.0 silently clipped real data to norm 1): an exponential-mechanism quantile of the
row norms aiming at (2/epsilon_R) ln(G n) rows above it, on a public log grid over
[NORM_GRID_LOW, NORM_GRID_HIGH] (4% relative steps), with epsilon_R = epsilon_F / 4 taken from
tau's share (so the adaptive mean, whose medians are its fragile part, keeps its budget).
Deriving it rather than requiring it: R only sets the range of the mean's grids and what the
clipped rows are shrunk to, so a data-driven scale is what a user would have to look up anyway
(``beam-dp stats`` would spend budget outside this run's ledger to find it). The
preprocessing dict (and so the privacy report) says which bound was used and where it came
from, and what the two clippings aim at (rows above R, rows farther than tau), never an exact
count of clipped rows.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from beam_dp import accounting, features, secure_noise, stats
from beam_dp.algorithms import noisy_gd, spec
from beam_dp.algorithms.spec import Algorithm, Problem, option
from beam_dp.losses import MODEL_NAMES, GlmLoss

VARIANTS = ("practical", "theory")
_STREAM = 10  # stats stream ids of the preprocessing
# theory variant without --feature-norm: the public log grid the private bound R is chosen from
# (feature vectors of norm above NORM_GRID_HIGH are clipped to it at most).
NORM_GRID_LOW, NORM_GRID_HIGH = 1e-6, 1e12


@dataclasses.dataclass
class DpsgdFConfig:
    variant: str = option("practical", "practical: Algorithm 3 (normalize, private mean, center); "
                                       "theory: Algorithm 2 (adaptive mean, private radius)",
                          choices=VARIANTS)
    preprocess_epsilon: float | None = option(
        None, "budget of the private preprocessing; default a twentieth of epsilon "
              "(practical) or two thirds (theory)", low=0, low_open=True)
    feature_norm: float | None = option(
        None, "practical: feature vectors are normalized to this norm C_F (default 1); "
              "theory: the public bound R they are clipped to (default: a private "
              "quantile of the row norms; the report's feature_clip says which)", low=0, low_open=True)
    grid_size: int = option(1024, "candidate points of each private quantile", low=3)

    def epsilon_for(self, total_epsilon: float | None) -> float:
        if self.preprocess_epsilon is not None:
            return self.preprocess_epsilon
        if total_epsilon is None:
            raise ValueError("give --preprocess-epsilon with --noise-multiplier")
        return total_epsilon * (0.05 if self.variant == "practical" else 2.0 / 3.0)

    def validate(self) -> None:
        spec.validate(self)


def train(config: noisy_gd.NoisyGDConfig, f_config: DpsgdFConfig, loss: GlmLoss, dim: int,
          aggregator, seed: int, ledger: accounting.Ledger, on_progress=lambda *a: None,
          checkpoint_dir: str | None = None,
          checkpoint_key: dict | None = None) -> spec.TrainResult:
    f_config.validate()
    eps_f = f_config.epsilon_for(config.epsilon)
    if config.epsilon is not None and eps_f >= config.epsilon:
        raise ValueError(f"--preprocess-epsilon {eps_f} leaves nothing of epsilon {config.epsilon} for training")
    bound = f_config.feature_norm
    # Secure noise (the default; --noise float turns it off): the preprocessing's releases too
    # (stats module docstring): the means exact sums on a grid with discrete Gaussian noise, the
    # quantiles an exact exponential mechanism, and noisy_gd.train's steps and count as for
    # dpsgd (which fall back to float noise, saying so, where secure noise cannot be used).
    noise = "float" if config.noise == "float" else "secure"
    # The preprocessing's stages go into Beam jobs: they hold a key derived from the seed.
    stats_seed = stats.stages_seed(seed)

    if f_config.variant == "practical":
        bound = 1.0 if bound is None else bound   # the paper's C_F = 1
        normalize = features.NormalizeRows(bound)
        values = stats.Transformed(normalize)

        def preprocess(n: int) -> dict:
            sigma_f = stats.gaussian_noise_multiplier(eps_f, config.delta)
            stage = stats.ClippedMeanStage("mean", values, dim, 0.0, bound, sigma_f, stats_seed, (_STREAM,),
                                           noise=noise)
            state = _release(aggregator, [stage], {"n": n}, ledger)
            return {"mean": state["mean"].tolist(), "mean_epsilon": eps_f,
                    "mean_noise_multiplier": sigma_f}

        def make_transform(pre: dict):
            return features.Chain((normalize, features.Center(tuple(pre["mean"]))))

        result = noisy_gd.train(config, loss, dim, aggregator, seed, ledger, on_progress,
                                checkpoint_dir, preprocess, make_transform,
                                checkpoint_key=checkpoint_key)
        mean = np.asarray(result.preprocessing["mean"])
        theta = result.theta.copy()
        theta[:, -1] -= theta[:, :-1] @ mean
        return dataclasses.replace(result, theta=theta, feature_transform=features.spec(normalize))

    # theory variant (Algorithm 2)
    if loss.score_lipschitz is None:
        raise ValueError(f"the theory variant needs a Lipschitz loss; '{loss.name}' is not")
    size = f_config.grid_size

    def feature_bound(pre: dict) -> float:
        return float(bound) if bound is not None else float(pre["feature_clip"]["bound"])

    def preprocess(n: int) -> dict:
        # n is the released (public or noisy) count. It enters only through logarithms (failure
        # probabilities 1/n, 1/n^2) and the tau grid's resolution R/n^2; every quantile's target
        # rank is counted from the top of its own histogram (stats.QuantileStage), so a count
        # that over- or undershoots cannot move it (with n_noisy - E it did: an overshoot of
        # ~50 at epsilon 1 made tau uniform on its grid in ~3 of 10 runs).
        n = max(n, 2)
        pre, state = {}, {"n": n}
        if bound is None:
            # R is derived privately: an exponential-mechanism quantile of the row norms aiming
            # at k rows above it (failure probability 1/n), on a public log grid over
            # [NORM_GRID_LOW, NORM_GRID_HIGH], with half of tau's share of the budget (the
            # adaptive mean keeps its half: its per-coordinate medians get the smallest epsilon
            # of all, and a wrong coarse median is its one catastrophic failure; taking the
            # quarter from the mean and tau evenly made that happen in 1 of the first 20 seeds
            # of the paper's counterexample).
            eps_r = eps_f / 4
            k_r = stats.quantile_rank_error_bound(size, eps_r, 1.0 / n)
            r_grid = stats.log_grid(NORM_GRID_LOW, NORM_GRID_HIGH, size)
            r_stage = stats.QuantileStage("feature_bound", stats.Norms(), stats.FixedGrid(r_grid), 1,
                                          size, (1.0,), eps_r, stats_seed, (_STREAM, 6), outliers=k_r,
                                          noise=noise)
            state = _release(aggregator, [r_stage], state, ledger)
            r = max(float(state["feature_bound"][0, 0]), float(r_grid[0, 1]))
            pre["feature_clip"] = {
                "bound": r,
                "source": ("private: exponential-mechanism quantile of the feature-vector norms "
                           f"(epsilon {eps_r:.6g}, {size}-point log grid over "
                           f"[{NORM_GRID_LOW:g}, {NORM_GRID_HIGH:g}]), no --feature-norm given"),
                "epsilon": eps_r,
                "target_rows_above": k_r,
                "rows_above": (f"about {k_r:.0f} rows aimed at, between 0 and {2 * k_r:.0f} with "
                               f"probability 1 - 1/n; their vectors are shrunk to norm {r:.6g} "
                               "(not counted exactly: that would be an un-noised release)"),
            }
        else:
            pre["feature_clip"] = {
                "bound": float(bound), "source": "public (--feature-norm)",
                "rows_above": ("vectors of larger norm are shrunk to it; how many is not released "
                               "(that would be an un-noised count)")}
        r = feature_bound(pre)
        values = stats.Transformed(features.ClipRows(r))
        # Failure probability 1/n^2, as in the paper's Lemma 3: at 0.01 about 1% of runs pick a
        # radius on the scale of R and the mean error triples (measured over 300 seeds).
        mean_stages = stats.adaptive_mean_stages("mean", dim, r, eps_f / 2, config.delta / 2,
                                                 stats_seed, _STREAM, values, size,
                                                 failure_probability=1.0 / n ** 2, noise=noise)
        eps_tau = eps_f / 2 if bound is not None else eps_f / 4
        k_tau = stats.quantile_rank_error_bound(size, eps_tau, 1.0 / n)
        tau_grid = stats.log_grid(r / n ** 2, 2 * r, size)
        tau_stage = stats.QuantileStage(
            "tau", stats.DistancesTo("mean", values), stats.FixedGrid(tau_grid), 1, size, (1.0,),
            eps_tau, stats_seed, (_STREAM, 5), outliers=k_tau, noise=noise)
        state = _release(aggregator, mean_stages + [tau_stage], state, ledger)
        tau = max(float(state["tau"][0, 0]), float(tau_grid[0, 1]))   # never 0 (grid[0] = 0)
        pre.update({
            "mean": state["mean"].tolist(), "tau": tau, "mean_epsilon": eps_f / 2,
            "mean_delta": config.delta / 2, "tau_epsilon": eps_tau,
            "tau_clip": {
                "target_rows_farther": k_tau,
                "rows_farther": (f"about {k_tau:.0f} rows aimed at, between 0 and {2 * k_tau:.0f} "
                                 f"with probability 1 - 1/n, are farther than tau from the mean; "
                                 "(x - mean, tau) is shrunk to norm sqrt(2) tau for them (not "
                                 "counted exactly)")},
        })
        return pre

    def make_transform(pre: dict):
        return features.Chain((features.ClipRows(feature_bound(pre)),
                               features.CenterAugmentClip(tuple(pre["mean"]), pre["tau"])))

    # The model is fitted on d + 1 features (the last is the constant tau) without an intercept.
    # Its clip norm sqrt(2) G tau depends on tau, which is released during preprocessing.
    inner = dataclasses.replace(config, fit_intercept=False)
    result = noisy_gd.train(inner, loss, dim + 1, aggregator, seed, ledger, on_progress,
                            checkpoint_dir, preprocess, make_transform, checkpoint_key=checkpoint_key,
                            clip_norm_from=lambda pre: math.sqrt(2.0) * loss.score_lipschitz * pre["tau"])
    pre = result.preprocessing
    w = result.theta[:, :dim]
    b = result.theta[:, dim] * pre["tau"] - w @ np.asarray(pre["mean"])
    # The model maps back to the clipped raw features: w . clip(x) + b equals theta . (x - mu, tau)
    # unless the second clip (at sqrt(2) tau) shrinks the vector, which rescales the score by a
    # positive factor, so the predicted class is the same.
    return dataclasses.replace(result, theta=np.column_stack([w, b]),
                               feature_transform=features.spec(features.ClipRows(feature_bound(pre))))


def _release(aggregator, stages, state, ledger):
    stats.record_releases(stages, ledger)
    if any(getattr(s, "noise", "float") == "secure" for s in stages) and \
            secure_noise.secure_release_note() not in ledger.notes:
        ledger.notes.append(secure_noise.secure_release_note())
    return aggregator.run_stages(stages, state)


@dataclasses.dataclass
class DpsgdFOptions(DpsgdFConfig, noisy_gd.DpsgdOptions):
    """The DP-SGD options and the preprocessing's (feature_norm is the preprocessing's)."""


def _train_registered(options: DpsgdFOptions, problem: Problem, aggregator, seed, ledger, progress):
    config = noisy_gd.core_config("dpsgd", options, problem, secure=True)
    f_config = DpsgdFConfig(options.variant, options.preprocess_epsilon, options.feature_norm,
                            options.grid_size)
    return train(config, f_config, problem.loss, problem.dim, aggregator, seed, ledger, progress,
                 problem.checkpoint_dir,
                 checkpoint_key={"input": problem.source, "seed_fixed": problem.seed_fixed})


DPSGD_F = Algorithm(
    "dpsgd-f", "features far from the origin or of very different norms (paper 000): DP-SGD "
               "after a private mean-centering of the features",
    MODEL_NAMES, DpsgdFOptions, _train_registered, secure_noise=True,
    quality_check=True)
