"""Sufficient-statistics perturbation for linear regression (AdaSSP-style, Wang 2018).

One pass computes Z^T Z for z = (Clip(x, C_x), 1, clamp(y, -C_y, C_y)), which holds X^T X,
X^T y (with the intercept column) and y^T y. The driver then releases, each with Gaussian noise
of std sigma times its add/remove sensitivity:

1. lambda_min(X^T X) (sensitivity K = C_x^2 + 1, the largest ||(x, 1)||^2), to choose the ridge;
2. X^T X with a symmetric noise matrix (iid upper triangle; the upper triangle of (x,1)(x,1)^T
   has L2 norm <= ||(x,1)||^2 = K);
3. X^T y (sensitivity sqrt(K) * C_y);

and solves (X^T X + E + lambda I) theta = X^T y + e. AdaSSP's ridge: lambda = max(0, B_E - L),
with B_E = sigma K (2 sqrt(d+1) + sqrt(2 ln(2/rho))) a bound on the spectral norm of the noise
matrix holding with probability 1 - rho/2 (Gaussian symmetric matrices), and L the released
lambda_min lowered by its own noise's 1 - rho/2 bound, rho = 0.05: the smallest ridge that keeps
the system positive definite with probability 1 - rho. Or a given ridge. The three releases share
one noise multiplier, calibrated so that their composition (with the dataset-size count when n is
private) meets (epsilon, delta).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.linalg
from dp_accounting import dp_event as events

from beam_dp import accounting, features, mechanisms
from beam_dp.algorithms import registry
from beam_dp.algorithms.noisy_gd import NoisyGDConfig, TrainResult, core_config, release_dataset_size
from beam_dp.algorithms.registry import Algorithm, Problem, option
from beam_dp.losses import GlmLoss

RHO = 0.05


@dataclasses.dataclass
class SspConfig:
    feature_norm: float | None = option(None, "C_x: feature vectors are clipped to this norm; "
                                              "default 2 sqrt(d) (standardized features)",
                                        low=0, low_open=True)
    label_bound: float = option(4.0, "C_y: labels are clamped to [-C_y, C_y]", low=0, low_open=True)
    ridge: float | None = option(None, "ridge penalty; default chosen privately (AdaSSP)", low=0)

    def validate(self) -> None:
        registry.validate(self)


@dataclasses.dataclass(frozen=True)
class GramStage:
    """Z^T Z of z = (Clip(x, C_x), 1, clamp(y, -C_y, C_y)) over all examples."""

    dim: int
    feature_norm: float
    label_bound: float

    @property
    def shape(self):
        return (self.dim + 2, self.dim + 2)

    def partial_sum(self, block, state):
        # ClipRows is overflow-safe (a row of 1e200 comes out with norm C_x, not NaN), so every
        # z is bounded and z z^T cannot overflow; tiny entries may underflow to 0, harmlessly
        # and silently (a warning only when such a row exists would reveal it).
        clipped = features.ClipRows(self.feature_norm)(block)
        z = np.column_stack([clipped.features, np.ones(len(block)),
                             np.clip(block.labels, -self.label_bound, self.label_bound)])
        with np.errstate(under="ignore"):
            return z.T @ z

    def canary_sum(self, state, canaries) -> np.ndarray:
        """The audit's white-box canaries (``beam_dp.audit``): each included canary is the row
        z = (C_x on its own feature column, 1, -C_y), the largest a row can be; it pulls its
        coordinate of the model down. (No ``canary_scores``: the releases are made after this
        stage, so the audit scores the released model.)"""
        columns = canaries.columns[canaries.included]
        z = np.zeros((columns.size, self.dim + 2))
        z[np.arange(columns.size), columns] = self.feature_norm
        z[:, self.dim] = 1.0
        z[:, self.dim + 1] = -self.label_bound
        return z.T @ z

    def apply(self, state, total):
        return {**state, "gram": total}


def _symmetric_noise(g: np.random.Generator, size: int, std: float) -> np.ndarray:
    upper = np.triu(mechanisms.gaussian_noise(g, (size, size), std))
    return upper + np.triu(upper, 1).T


def train(config: NoisyGDConfig, s_config: SspConfig, loss: GlmLoss, dim: int, aggregator,
          seed: int, ledger: accounting.Ledger) -> TrainResult:
    if loss.name != "linear":
        raise ValueError("ssp fits linear regression: use --model linear")
    config.validate()
    s_config.validate()
    dataset_size = release_dataset_size(config, aggregator, seed, ledger)
    c_x = s_config.feature_norm or 2.0 * math.sqrt(dim)
    c_y = s_config.label_bound
    k = c_x ** 2 + 1.0
    releases = 2 if s_config.ridge is not None else 3
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    else:
        prior = ledger.event()
        sigma = accounting.calibrate_noise_multiplier(
            lambda s: events.ComposedDpEvent(
                [prior, events.SelfComposedDpEvent(events.GaussianDpEvent(s), releases)]),
            config.epsilon, config.delta, config.accountant)
    ledger.record("gaussian_sufficient_statistics", events.GaussianDpEvent(sigma), releases,
                  noise_multiplier=sigma, feature_norm=c_x, label_bound=c_y,
                  sensitivities={"lambda_min": k, "xtx": k, "xty": math.sqrt(k) * c_y})

    gram = aggregator.run_stages([GramStage(dim, c_x, c_y)], {})["gram"]
    g = mechanisms.rng(seed, mechanisms.STREAM_NOISE, 0)
    xtx, xty = gram[:-1, :-1], gram[:-1, -1]
    size = dim + 1
    if s_config.ridge is None:
        lam_min = np.linalg.eigvalsh(xtx)[0] + mechanisms.gaussian_noise(g, (), sigma * k)
        tail = math.sqrt(2.0 * math.log(2.0 / RHO))
        noise_bound = sigma * k * (2.0 * math.sqrt(size) + tail)
        ridge = max(0.0, noise_bound - (lam_min - sigma * k * tail))
    else:
        ridge = s_config.ridge
    noisy_xtx = xtx + _symmetric_noise(g, size, sigma * k) + ridge * np.eye(size)
    noisy_xty = xty + mechanisms.gaussian_noise(g, size, sigma * math.sqrt(k) * c_y)
    try:
        theta = scipy.linalg.solve(noisy_xtx, noisy_xty, assume_a="sym")
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError):
        theta = np.linalg.lstsq(noisy_xtx, noisy_xty, rcond=None)[0]
    return TrainResult(theta[None, :], ledger, sigma, 1.0, 1, None, dataset_size,
                       sampling="one pass (sufficient statistics)",
                       details_name="algorithm_parameters",
                       preprocessing={"ridge": ridge, "ridge_source": "given" if s_config.ridge is not None
                        else "AdaSSP: from a private lambda_min", "feature_norm": c_x,
                        "label_bound": c_y})


def _train_registered(options: SspConfig, problem: Problem, aggregator, seed, ledger, progress):
    return train(core_config("dpsgd", options, problem), options, problem.loss, problem.dim,
                 aggregator, seed, ledger)


SSP = Algorithm(
    "ssp", "linear regression with few features (d up to ~100): one pass, no learning rate or "
           "steps to tune; its error grows like d^3 / (eps n)^2",
    ("linear",), SspConfig, _train_registered, checkpoints=False, no_intercept=False)
