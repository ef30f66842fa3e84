"""DPSGD-F: DP-SGD with private feature preprocessing (paper 000, Sun, Suresh & Menon).

DP-SGD's error scales with the largest feature norm; centering the features at a private mean
first makes it scale with their spread. Two variants, both on top of ``noisy_gd.train``:

* ``practical`` (Algorithm 3, used in all the paper's experiments): every feature vector is
  normalized to norm C_F (``feature_norm``); a Gaussian mean of the normalized features (noise
  multiplier from the analytic Gaussian calibration at (epsilon_F, delta), noise std sigma_F * C_F
  on the sum, erratum 4 of the note); DP-SGD on x - mu with gradient clipping at C_G and an
  intercept; the intercept is un-shifted, b = b' - mu . w (the model then applies to normalized
  features, which ``model.json`` records).
* ``theory`` (Algorithm 2): features clipped to the public bound R (``feature_norm``); the adaptive
  private mean of ``stats.adaptive_mean_stages`` at epsilon_F / 2 (the role of Lemma 3); a private
  quantile tau of the distances ||x - mu|| (exponential mechanism, epsilon_F / 2); features
  x'' = Clip((x - mu, tau), sqrt(2) tau) with no separate intercept; DP-SGD with clip norm
  sqrt(2) G tau (G the loss's Lipschitz constant in the score) so that no gradient is clipped; the
  map back uses the corrected intercept b = theta[d] tau - w . mu (erratum 3).

Budget: the DP-SGD noise multiplier is calibrated so that the PLD composition of every release
(count, preprocessing, steps) meets the requested (epsilon, delta), rather than the paper's even
thirds with basic composition (tighter, and never looser). Target rank of tau: the paper's
n - (100/epsilon) log n is a constant of its proof (of the Dick et al. quantile algorithm); with
the exponential mechanism here we aim at n - E with E = (2/epsilon_tau) ln(G n), its rank error
at failure probability 1/n, so that with probability 1 - 1/n at most 2E points are shrunk.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from beam_dp import accounting, features, stats
from beam_dp.algorithms import noisy_gd
from beam_dp.losses import GlmLoss

VARIANTS = ("practical", "theory")
_STREAM = 10  # stats stream ids of the preprocessing


@dataclasses.dataclass
class DpsgdFConfig:
    variant: str = "practical"
    preprocess_epsilon: float | None = None   # default 5% of epsilon (practical), 2/3 (theory)
    feature_norm: float = 1.0                 # C_F (practical) or the public bound R (theory)
    grid_size: int = 1024

    def epsilon_for(self, total_epsilon: float | None) -> float:
        if self.preprocess_epsilon is not None:
            return self.preprocess_epsilon
        if total_epsilon is None:
            raise ValueError("give --preprocess-epsilon with --noise-multiplier")
        return total_epsilon * (0.05 if self.variant == "practical" else 2.0 / 3.0)

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown DPSGD-F variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if not (self.feature_norm > 0 and math.isfinite(self.feature_norm)):
            raise ValueError("--feature-norm must be a positive number")
        if self.preprocess_epsilon is not None and not self.preprocess_epsilon > 0:
            raise ValueError("--preprocess-epsilon must be positive")


def train(config: noisy_gd.NoisyGDConfig, f_config: DpsgdFConfig, loss: GlmLoss, dim: int,
          aggregator, seed: int, ledger: accounting.Ledger, on_progress=lambda *a: None,
          checkpoint_dir: str | None = None) -> noisy_gd.TrainResult:
    f_config.validate()
    eps_f = f_config.epsilon_for(config.epsilon)
    if config.epsilon is not None and eps_f >= config.epsilon:
        raise ValueError(f"--preprocess-epsilon {eps_f} leaves nothing of epsilon {config.epsilon} for training")
    bound = f_config.feature_norm

    if f_config.variant == "practical":
        normalize = features.NormalizeRows(bound)
        values = stats.Transformed(normalize)

        def preprocess(n: int) -> dict:
            sigma_f = stats.gaussian_noise_multiplier(eps_f, config.delta)
            stage = stats.ClippedMeanStage("mean", values, dim, 0.0, bound, sigma_f, seed, (_STREAM,))
            state = _release(aggregator, [stage], {"n": n}, ledger)
            return {"mean": state["mean"].tolist(), "mean_epsilon": eps_f,
                    "mean_noise_multiplier": sigma_f}

        def make_transform(pre: dict):
            return features.Chain((normalize, features.Center(tuple(pre["mean"]))))

        result = noisy_gd.train(config, loss, dim, aggregator, seed, ledger, on_progress,
                                checkpoint_dir, preprocess, make_transform)
        mean = np.asarray(result.preprocessing["mean"])
        theta = result.theta.copy()
        theta[:, -1] -= theta[:, :-1] @ mean
        return dataclasses.replace(result, theta=theta)

    # theory variant (Algorithm 2)
    if loss.score_lipschitz is None:
        raise ValueError(f"the theory variant needs a Lipschitz loss; '{loss.name}' is not")
    clip = features.ClipRows(bound)
    values = stats.Transformed(clip)

    def preprocess(n: int) -> dict:
        size = f_config.grid_size
        # Failure probability 1/n^2, as in the paper's Lemma 3: at 0.01 about 1% of runs pick a
        # radius on the scale of R and the mean error triples (measured over 300 seeds).
        mean_stages = stats.adaptive_mean_stages("mean", dim, bound, eps_f / 2, config.delta / 2,
                                                 seed, _STREAM, values, size,
                                                 failure_probability=1.0 / max(n, 2) ** 2)
        eps_tau = eps_f / 2
        tau_grid = stats.log_grid(bound / max(n, 2) ** 2, 2 * bound, size)
        tau_stage = stats.QuantileStage(
            "tau", stats.DistancesTo("mean", values), stats.FixedGrid(tau_grid), 1, size, (1.0,),
            eps_tau, seed, (_STREAM, 5), outliers=2.0 / eps_tau * math.log(size * n))
        state = _release(aggregator, mean_stages + [tau_stage], {"n": n}, ledger)
        return {"mean": state["mean"].tolist(), "tau": float(state["tau"][0, 0]),
                "mean_epsilon": eps_f / 2, "mean_delta": config.delta / 2, "tau_epsilon": eps_tau}

    def make_transform(pre: dict):
        return features.Chain((clip, features.CenterAugmentClip(tuple(pre["mean"]), pre["tau"])))

    # The model is fitted on d + 1 features (the last is the constant tau) without an intercept.
    # Its clip norm sqrt(2) G tau depends on tau, which is released during preprocessing.
    inner = dataclasses.replace(config, fit_intercept=False)
    result = noisy_gd.train(inner, loss, dim + 1, aggregator, seed, ledger, on_progress,
                            checkpoint_dir, preprocess, make_transform,
                            clip_norm_from=lambda pre: math.sqrt(2.0) * loss.score_lipschitz * pre["tau"])
    pre = result.preprocessing
    w = result.theta[:, :dim]
    b = result.theta[:, dim] * pre["tau"] - w @ np.asarray(pre["mean"])
    return dataclasses.replace(result, theta=np.column_stack([w, b]))


def _release(aggregator, stages, state, ledger):
    stats.record_releases(stages, ledger)
    return aggregator.run_stages(stages, state)
