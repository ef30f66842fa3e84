"""Noisy regularized mirror descent in l_p, 1 < p <= 2 (paper 004, Su, Zhao & Wang, Algorithm 3
and Theorems 6-7; the note /work/shared/papers/004, §1, §2.4, §6.1-6.3, §7).

The problem: unconstrained DP-ERM for a GLM whose loss is convex, L-Lipschitz and beta-smooth
w.r.t. ||.||_p (assumption A3), where the model's geometry is l_p with 1 < p < 2 (p near 1: many
features, a model with few large coefficients); p = 2 is the Euclidean special case. The
coefficients (and the intercept, if any) form one vector w in R^D, D = k (d + 1) (k outputs;
D = k d without an intercept); a row's features are x = (z, 1) (or z).

Each step t = 1..T is one full pass (a stage of the Aggregator seam):

* the pass (``partial_sum``): sum over the rows of their loss gradients at w_t, each CLIPPED in
  the dual norm ||.||_q, q = p / (p - 1), to L (``dual_clipped_gradient_sum``). For a GLM the
  gradient is l'(s) (outer) x, whose dual norm is ||l'(s)||_q ||x||_q, so clipping is a per-row
  scale and the sum one matrix product. L is the loss's Lipschitz constant times the public
  feature bound, so on rows within the bound nothing changes (the note §7: the sensitivity 2L/n
  then holds on any data, not only where the Lipschitz assumption does);
* on the driver (``apply``): c_t = sum / n + g_t, n the PUBLIC dataset size, g_t one draw of
  GG_{||.||_{r_q}}(0, sigma^2) (``geometry.sample_gg``), r_q = min{q, 2 ln D + 1} (the smooth
  norm of the dual l_q); then the closed-form step of (1) (note §2.4):
  w_{t+1} = grad Phi^*((beta grad Phi(w_t) - c_t) / (alpha + beta)), Phi(w) = ||w||_r^2 / (2 (r-1)),
  r = 1 + 1/kappa (erratum §9.1: r = p unless p < 1 + 1/(2 ln D));
* the output: sum_t rho^t w_{t+1} / sum_t rho^t, rho = (2 beta + alpha) / (2 beta), kept as a
  running weighted average with weights from log-space (§6.2): no rho^T overflow.

Privacy (replace-one neighbours, the paper's Def. 1; n is public under it). Replacing a row
changes the clipped sum by at most 2L in ||.||_q, so c_t's query has sensitivity s = 2L/n.
Lemma 3 (the generalized Gaussian mechanism, Bassily, Guzman & Nandi): with ||.||_{r_q}
kappa-regular for the dual space, GG noise of scale sigma is (eps0, delta0)-DP with eps0 =
s sqrt(2 kappa ln(1/delta0)) / sigma (``accounting.generalized_gaussian_event``, which refuses
eps0 > 1: the range of the Gaussian bound it generalizes). Each step is recorded as that
``ApproxDpEvent`` and the T steps are composed by the ledger's PLD accountant, i.e. the OPTIMAL
composition of (eps0, delta0)-DP mechanisms; sigma is calibrated (``calibrate``) so that it meets
the target (eps, delta). This is tighter than the paper's advanced composition (Lemma 1), and the
paper's printed sigma^2 = 64 L^2 kappa T log(1/delta) / (n^2 eps^2) drops a log factor against
its own lemmas (erratum §9.3), so it is not used. For p = 2 (r_q = 2) the noise is the isotropic
Gaussian N(0, sigma^2 I) and the step is accounted exactly as ``GaussianDpEvent`` (dp_accounting's
replace-one Gaussian: a row moves the mean by at most L/n, a replacement by 2L/n).

kappa: computed for the pair (q, r_q) as Def. 3 defines it, kappa = (r_q - 1) D^(2/r_q - 2/q)
(||.||_r is (r - 1)-smooth and ||x||_q <= ||x||_r <= D^(1/r - 1/q) ||x||_q), which is 1/(p - 1)
when q <= 2 ln D + 1 and at most 2e ln D otherwise; ``geometry.kappa_lp``'s 2 ln D (note §1) is
below it in the second case (erratum §9.2), so it is not used for the noise.

Randomness: step t's noise comes from ChaCha20 keyed by ``stream_key(seed, STREAM_NOISE, t)``; a
Beam job's copy of the step holds only its own steps' keys (``for_steps``), never the root seed,
so the local and Beam runners give the same model (to float tolerance: the sums are float). The
noise is numpy float arithmetic (no secure variant: ``--noise secure`` is refused).

Defaults (``default_steps``, measured): T = ceil(0.3 n eps / sqrt(D kappa ln(1/delta))) within
[10, --max-steps = 200], alpha = beta / (2T), L and beta from the loss and the feature bound F.
The paper's alpha = (4 beta / T) log2(n / T) and Thm 7's T are not the defaults: at practical n
the regularizer then dominates (note §4.3(d)) and the run is optimization-limited.

Not implemented: Algorithm 6 (phased DP-SGD, the paper's route for p >= 2). Each phase is
one-pass SGD, a sequential loop over single examples whose privacy comes from the
non-expansiveness of the averaged iterate (noise on the phase's model, not on a sum): it is not
a sum over rows that the Aggregator seam could compute in parallel (note §7: "not a CombineFn");
run here it would be n single-row steps on one machine. For p >= 2 the paper reduces l_p to l_2,
which dpgd / dpsgd already cover (p = 2 here is that Euclidean case, with exact accounting).
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting, clipping, features, geometry, mechanisms
from beam_dp import losses as losses_mod
from beam_dp.algorithms.base import TrainState, load_checkpoint, run_chunks, save_checkpoint
from beam_dp.algorithms.spec import Algorithm, Problem, TrainResult, option
from beam_dp.block import Block

GG_RELEASE = "generalized_gaussian_mirror_descent_step"
GAUSSIAN_RELEASE = "gaussian_mirror_descent_step"
MODELS = ("logistic", "huber", "softmax")
# Bounds on the second derivative of each supported loss in the score (its Hessian's spectral
# norm for softmax): beta = curvature * (bound on ||x||_q)^2 w.r.t. ||.||_p. Hinge is not smooth
# and the squared loss not Lipschitz (use huber), so neither is offered.
CURVATURE = {"logistic": 0.25, "huber": 1.0, "softmax": 0.5}
# A clipped row's dual norm is at most CLIP_MARGIN * L as computed, so that rounding (a few
# ulps) cannot take it above L.
CLIP_MARGIN = 1.0 - 2.0 ** -40
# The per-step delta0 is DELTA_SHARE * delta / T for the share (of these) that needs the least
# noise (``calibrate``).
DELTA_SHARES = (0.02, 0.05, 0.1, 0.2, 0.4)


# Constants of the defaults, chosen by measurement (``default_steps``):
# T = ceil(STEPS_CONSTANT n eps / sqrt(D kappa ln(1/delta))) within [MIN_STEPS, max_steps] and
# alpha = ALPHA_CONSTANT beta / T.
STEPS_CONSTANT = 0.3
MIN_STEPS = 10
ALPHA_CONSTANT = 0.5
DEFAULT_MAX_STEPS = 200


# ------------------------------------------------------------------------------ the options

@dataclasses.dataclass
class MirrorDescentOptions:
    p: float = option(1.5, "the geometry l_p, 1 < p <= 2 (gradients are clipped in the "
                           "dual norm l_q); p near 1 suits many features and few large "
                           "coefficients, p = 2 is Euclidean",
                      low=1, low_open=True, high=2)
    steps: int | None = option(None, "T: full-batch steps (each reads all the data); default "
                                     "ceil(0.3 n eps / sqrt(D kappa ln(1/delta))) within [10, "
                                     "--max-steps], D the number of coefficients",
                               low=1)
    max_steps: int = option(DEFAULT_MAX_STEPS, "cap on the default number of steps", low=1)
    alpha: float | None = option(None, "the regularization alpha Phi(w) of each step (alpha > 0; "
                                       "smaller: closer to the unregularized optimum, more noise "
                                       "and slower); default beta / (2 T)", low=0,
                                 low_open=True)
    feature_bound: float | None = option(
        None, "F: public bound on ||z||_q of a row's features, which sets L and beta; "
              "default --feature-norm if given, else the typical norm of d standardized"
              " features", low=0, low_open=True)
    clip_norm: float | None = option(
        None, "L: every per-example gradient is clipped to dual norm L (a step's "
              "sensitivity is 2L); default the loss's Lipschitz constant times the "
              "bound on ||(z, 1)||_q", low=0, low_open=True)
    smoothness: float | None = option(
        None, "beta: the loss's smoothness w.r.t. ||.||_p (the mirror step's curvature); default "
              "the loss's curvature bound times the squared bound on ||(z, 1)||_q", low=0,
        low_open=True)
    feature_norm: float | None = option(
        None, "normalize every feature vector to this L2 norm before training (recorded in "
              "model.json, applied again by predict); default: features used as given", low=0,
        low_open=True)


def _default_feature_bound(q: float, d: int) -> float:
    """(d E|g|^q)^(1/q), g standard normal: E|g|^q = 2^(q/2) Gamma((q + 1)/2) / sqrt(pi)."""
    moment = 2.0 ** (q / 2.0) * math.gamma((q + 1.0) / 2.0) / math.sqrt(math.pi)
    return (max(d, 1) * moment) ** (1.0 / q)


# ------------------------------------------------------------------------------ the geometry

def kappa_of(q: float, r: float, dim: int) -> float:
    """Def. 3's kappa for the dual space l_q^D with the smooth norm ||.||_r, 2 <= r <= q:
    (r - 1) D^(2/r - 2/q) (module docstring); at least 1."""
    return max(1.0, (r - 1.0) * float(dim) ** max(0.0, 2.0 / r - 2.0 / q))


def geometry_plan(options: MirrorDescentOptions, problem: Problem) -> dict:
    """Everything the run's geometry and the loss's constants give, from public inputs only
    (no n yet): D, q, r_q, kappa, the mirror exponent and its strong convexity w.r.t. ||.||_p,
    F, the row bound B = ||(z, 1)||_q, L and beta (relative to Phi)."""
    p = float(options.p)
    loss = problem.loss
    k, d = loss.outputs(), problem.dim
    dim = k * (d + int(problem.fit_intercept))
    q = geometry.dual_exponent(p)
    noise_norm = geometry.noise_norm_exponent(p, dim)
    kappa = kappa_of(q, noise_norm, dim)
    mirror = geometry.mirror_exponent(p, dim)
    # Phi_r is 1-strongly convex w.r.t. ||.||_r, r >= p, and ||v||_r >= D^-(1/p - 1/r) ||v||_p.
    strong_convexity = float(dim) ** (-2.0 * max(0.0, 1.0 / p - 1.0 / mirror))
    if options.feature_bound is not None:
        feature_bound = float(options.feature_bound)
    elif options.feature_norm is not None:
        feature_bound = float(options.feature_norm)   # ||z||_q <= ||z||_2 for q >= 2
    else:
        feature_bound = _default_feature_bound(q, d)
    row_bound = float(geometry.lp_norm(np.array([feature_bound, float(problem.fit_intercept)]), q))
    lipschitz = float(options.clip_norm) if options.clip_norm is not None else (
        loss.score_lipschitz * row_bound)
    beta = float(options.smoothness) if options.smoothness is not None else (
        CURVATURE[loss.name] * row_bound ** 2)
    return {"p": p, "q": q, "dim": dim, "noise_norm": noise_norm, "kappa": kappa,
            "mirror_exponent": mirror, "strong_convexity": strong_convexity,
            "feature_bound": feature_bound, "row_bound": row_bound, "clip_norm": lipschitz,
            "beta": beta, "beta_relative": beta / strong_convexity,
            "gaussian": noise_norm == 2.0}


# ------------------------------------------------------------------------------ the pass

# Rows' ||(z, 1)||_q by the feature array they were computed from (id, weakly referenced): a
# block's rows are the same at every step (the local aggregator's blocks, a Beam worker's
# cached shards), and the q-th powers cost ~15x the rest of the pass at d = 50.
_ROW_NORMS: dict = {}


def row_dual_norms(features_: np.ndarray, q: float, fit_intercept: bool) -> np.ndarray:
    """||(z, 1)||_q (or ||z||_q) of every row, overflow-safe (``geometry.lp_norm``), memoized
    for the lifetime of ``features_``."""
    key = id(features_)
    found = _ROW_NORMS.get(key)
    if found is not None and found[0]() is features_ and found[1] == (q, fit_intercept):
        return found[2]
    norms = geometry.lp_norm(features_, q)
    if fit_intercept:
        norms = geometry.lp_norm(np.stack([norms, np.ones_like(norms)], axis=1), q)
    try:
        ref = weakref.ref(features_, lambda _, key=key: _ROW_NORMS.pop(key, None))
    except TypeError:   # (an array view that cannot be weakly referenced: not memoized)
        return norms
    _ROW_NORMS[key] = (ref, (q, fit_intercept), norms)
    return norms


def dual_clipped_gradient_sum(theta: np.ndarray, features_: np.ndarray, labels: np.ndarray,
                              loss: losses_mod.GlmLoss, clip_norm: float, q: float,
                              fit_intercept: bool = True) -> np.ndarray:
    """Sum over the rows of their gradients l'(s) (outer) (z, 1), each scaled by min(1, L /
    (||l'(s)||_q ||(z, 1)||_q)): clipped to dual norm L (times CLIP_MARGIN). Shaped like theta
    (k, d + 1); the intercept column is 0 without ``fit_intercept``.

    Overflow-safe and silent: norms by ``geometry.lp_norm`` (scaled, so a row of 1e200 has its
    finite norm); a row whose gradient norm is beyond the float range, or so large that L / norm
    would be subnormal (imprecise), contributes nothing (still within the bound); a zero
    derivative contributes nothing. Every row adds a matrix whose flattened ||.||_q is <= L."""
    m, d = features_.shape
    out = np.zeros(theta.shape)
    if m == 0:
        return out
    rows = max(256, clipping.CHUNK_BYTES // (8 * (d + 1)))
    limit = clip_norm * CLIP_MARGIN
    tiny = np.finfo(np.float64).tiny
    row_norms = row_dual_norms(features_, q, fit_intercept)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        for start in range(0, m, rows):
            x = features_[start:start + rows]
            derivative = loss.derivative(losses_mod.scores(theta, x), labels[start:start + rows])
            d_norm = np.abs(derivative[:, 0]) if derivative.shape[1] == 1 else geometry.lp_norm(derivative, q)
            norm = d_norm * row_norms[start:start + rows]
            factor = np.where(norm > limit, limit / np.where(norm > 0, norm, 1.0), 1.0)
            usable = np.isfinite(norm) & (factor >= tiny) & np.isfinite(derivative).all(axis=1)
            weighted = np.where(usable[:, None], derivative * factor[:, None], 0.0)   # (m, k)
            out[:, :-1] += weighted.T @ x
            if fit_intercept:
                out[:, -1] += weighted.sum(axis=0)
    return out


# ------------------------------------------------------------------------------ the step

@dataclasses.dataclass(frozen=True)
class MirrorDescentStep:
    """One step of Algorithm 3 as a full-batch stage (module docstring). Picklable, Beam-free."""

    loss: losses_mod.GlmLoss
    shape: tuple                # of theta: (outputs, features + 1)
    fit_intercept: bool
    q: float                    # the dual exponent: gradients clipped in ||.||_q
    clip_norm: float            # L
    normalizer: float           # the public n
    sigma: float                # the noise's scale on c_t = sum / n + g_t
    noise_norm: float           # r_q of GG_{||.||_{r_q}} (2: the Gaussian)
    mirror_exponent: float      # r of Phi_r
    alpha: float
    beta: float                 # smoothness relative to Phi (beta / strong convexity)
    log_rho: float              # ln rho, rho = (2 beta + alpha) / (2 beta)
    seed: int | None            # the root seed; None in the copies sent to Beam jobs
    transform: Callable | None = None   # per-example feature map (--feature-norm)
    noise_keys: tuple | None = None     # (first step, keys of steps first, first + 1, ...)

    # -- the job's copy: its own steps' noise keys, never the root seed

    def for_steps(self, first: int, count: int) -> "MirrorDescentStep":
        if self.seed is None:
            return self
        return dataclasses.replace(self, seed=None,
                                   noise_keys=mechanisms.step_keys(self.seed, first, count))

    def _noise_generator(self, step: int) -> np.random.Generator:
        return mechanisms.step_noise_generator(self.seed, self.noise_keys, step)

    # -- coordinates: the model as the vector w of l_p^D

    def coordinates(self, theta: np.ndarray) -> np.ndarray:
        return (theta if self.fit_intercept else theta[:, :-1]).ravel()

    def model(self, w: np.ndarray) -> np.ndarray:
        k = self.shape[0]
        if self.fit_intercept:
            return w.reshape(self.shape).copy()
        theta = np.zeros(self.shape)
        theta[:, :-1] = w.reshape(k, self.shape[1] - 1)
        return theta

    def noise(self, step: int) -> np.ndarray:
        """Step ``step``'s one draw g_t ~ GG_{||.||_{r_q}}(0, sigma^2) over the D coordinates,
        shaped like theta (0 for an absent intercept). The audit's test hook scales it like
        every noise draw of the product."""
        dim = int(np.prod(self.shape)) - (0 if self.fit_intercept else self.shape[0])
        z = geometry.sample_gg(self._noise_generator(step), dim, self.noise_norm,
                               self.sigma * mechanisms.NOISE_SCALE_FOR_TESTS)
        return self.model(z)

    # -- the stage

    def partial_sum(self, block: Block, state: TrainState) -> np.ndarray:
        if self.transform is not None:
            block = self.transform(block)
        return dual_clipped_gradient_sum(state.theta, block.features, block.labels, self.loss,
                                         self.clip_norm, self.q, self.fit_intercept)

    def zero_sum(self) -> np.ndarray:
        return np.zeros(self.shape)

    def mirror_step(self, theta: np.ndarray, noisy_gradient: np.ndarray) -> np.ndarray:
        """w_{t+1} = grad Phi^*((beta grad Phi(w_t) - c_t) / (alpha + beta)) (note §2.4)."""
        r = self.mirror_exponent
        w = self.coordinates(theta)
        c = self.coordinates(noisy_gradient)
        dual = (self.beta * geometry.mirror_grad(w, r) - c) / (self.alpha + self.beta)
        return self.model(geometry.mirror_grad_inverse(dual, r))

    def average_weight(self, step: int) -> float:
        """rho^t / sum_{k <= t} rho^k for the t-th iterate (t = step + 1), from log-space:
        (1 - rho^-1) / (1 - rho^-t) = expm1(-ln rho) / expm1(-t ln rho); 1/t when rho = 1."""
        t = step + 1
        if self.log_rho <= 0.0:
            return 1.0 / t
        return math.expm1(-self.log_rho) / math.expm1(-self.log_rho * t)

    def apply(self, state: TrainState, total: np.ndarray) -> TrainState:
        noisy = total / self.normalizer + self.noise(state.step)
        theta = self.mirror_step(state.theta, noisy)
        a = self.average_weight(state.step)
        # theta_sum holds the running weighted average of w_2..w_{t+1}, not a sum.
        average = theta if state.step == 0 else state.theta_sum + a * (theta - state.theta_sum)
        return TrainState(theta, average, state.step + 1)

    # -- the one-run audit (beam_dp.audit)

    @property
    def canary_releases(self) -> tuple:
        return (GAUSSIAN_RELEASE if self.noise_norm == 2.0 else GG_RELEASE,)

    def canary_sum(self, state: TrainState, canaries) -> np.ndarray:
        """The audit's white-box canaries at this step: an included canary adds a gradient of
        dual norm exactly L on its own column, +L e_j; an excluded one is replaced by its mirror
        image, -L e_j. The relation is replace-one: the two datasets have the same size and
        differ in one example, the change the guarantee covers (and the largest one replacement
        can make to the sum, 2L in ||.||_q, lies along the canary's column)."""
        out = np.zeros(self.shape)
        out[0, canaries.columns] = np.where(canaries.included, self.clip_norm, -self.clip_norm)
        return out

    def canary_scores(self, before: TrainState, after: TrainState, canaries) -> np.ndarray:
        """Each canary's coordinate of the step's released noisy gradient c_t, recovered from
        the two iterates (a post-processing of the release): c_t = beta grad Phi(w_t) - (alpha +
        beta) grad Phi(w_{t+1}), i.e. minus the column's update in the mirror map's (dual)
        coordinates, where c_t enters linearly. An included canary pushes it up."""
        r = self.mirror_exponent
        w0, w1 = self.coordinates(before.theta), self.coordinates(after.theta)
        c = self.beta * geometry.mirror_grad(w0, r) - (self.alpha + self.beta) * geometry.mirror_grad(w1, r)
        return self.model(c)[0, canaries.columns]


# ------------------------------------------------------------------------------ the plan

def public_dataset_size(num_examples: int | None, aggregator) -> dict:
    """n, public under replace-one: ``num_examples`` if given, else the row count rounded to two
    significant digits, so that no report, log or checkpoint holds the exact count. Any public
    n keeps the guarantee (the sensitivity of sum / n is 2L / n whatever n is): it only sets the
    normalizer, off by at most 0.5% of a learning rate."""
    if num_examples is not None:
        return {"source": "public (--num-examples)", "value": int(num_examples)}
    count = int(aggregator.count())
    rounded = max(1, int(float(f"{count:.2g}"))) if count > 0 else 1
    return {"source": "public under the replace-one relation: the row count, rounded to two "
                      "significant digits (the exact count is not written)", "value": rounded}


def default_steps(n: int, epsilon: float | None, delta: float, geo: dict, max_steps: int) -> int:
    """T = ceil(STEPS_CONSTANT n eps / sqrt(D kappa ln(1/delta))) within [MIN_STEPS, max_steps]
    (with only a noise multiplier given: max_steps). n eps / sqrt(D kappa ln(1/delta)) is the
    signal-to-noise scale of one step's noisy mean (its GG noise has E||g||^2 = D sigma^2, and
    sigma grows as sqrt(T kappa ln(1/delta)) / (n eps)).

    Why not Thm 7's T = (n eps sqrt(kappa) / sqrt(d ln(1/delta)))^(2/5), and why these
    constants (measured on the note's Huber design, l_1.5, d = 50, ||z||_3 = 1, eps = 1, delta =
    1e-5, w* = 0.55 on 5 coordinates, excess risk of w = 0: 0.0386; mean over seeds): at the
    loss's worst-case beta = 1 the mirror step is short against this design's curvature (the
    Hessian's eigenvalues are ~0.05), so the run is limited by optimization, not noise, from n ~
    10^4: at n = 2e5 the excess falls from 0.0111 (T = 100) to 0.0042 (200) and 0.0019 (300),
    while Thm 7 gives T = 42; at n = 2e4 from 0.0149 (100) to 0.0095 (200) and 0.0087 (300);
    at n = 2e3 nothing beats w = 0 and T above ~20 makes it worse (0.0358 at T = 10, 0.046 at
    30). STEPS_CONSTANT 0.3 gives T = 18, 177 and the cap at these n; the cap (200 full passes,
    one Beam job) bounds the cost. alpha T / beta = 0.25, 0.5, 1, 2 gave 0.0095, 0.0097, 0.0104,
    0.0122 (n = 2e4, T = 200) and 0.0042, 0.0048, 0.0061, 0.0087 (n = 2e5), and the reverse order
    at n = 2e3 (larger alpha: closer to w = 0): 0.5 is the compromise. The paper's alpha =
    (4 beta / T) log2(n / T) is 5-50 times larger and makes the regularizer dominate (note
    §4.3(d): no better than w = 0 at these n)."""
    if epsilon is None:
        return max_steps
    scale = n * epsilon / math.sqrt(geo["dim"] * geo["kappa"] * math.log(1.0 / delta))
    return int(min(max_steps, max(MIN_STEPS, math.ceil(STEPS_CONSTANT * scale))))


def step_event(geo: dict, multiplier: float, delta0: float, capped: bool = True) -> events.DpEvent:
    """One step's release at noise ``multiplier`` = sigma / (L / n) (the noise in units of one
    row's largest contribution to the mean; a replacement moves it by 2). GG: the ApproxDpEvent
    of Lemma 3 at delta0 (``capped``: refused beyond eps0 = 1); Gaussian: exact."""
    if geo["gaussian"]:
        return events.GaussianDpEvent(multiplier)
    if capped:
        return accounting.generalized_gaussian_event(multiplier, 2.0, geo["kappa"], delta0)
    return accounting.ApproxDpEvent(
        accounting.generalized_gaussian_epsilon(multiplier, 2.0, geo["kappa"], delta0), delta0)


def gg_floor(kappa: float, delta0: float) -> float:
    """The smallest multiplier whose GG release has eps0 <= 1 (Lemma 3's range)."""
    return 2.0 * math.sqrt(2.0 * kappa * math.log(1.0 / delta0))


def calibrate(geo: dict, steps: int, epsilon: float, delta: float, accountant: str,
              prior: events.DpEvent | None = None) -> tuple:
    """(multiplier, delta0): the noise whose T-fold composition meets (epsilon, delta) by the
    PLD accountant (replace-one), with ``accounting.calibrate_noise_multiplier``. Gaussian:
    delta0 is None. GG: delta0 = share * delta / T for the share in DELTA_SHARES that needs the
    least noise (public inputs only); the multiplier is never below ``gg_floor`` (eps0 <= 1): where
    even that meets the target, it is used, and the run spends less than asked. ``prior``: the
    releases already in the run's ledger (the quality check's, reserved before training): the
    steps are calibrated so that, composed after them by the accountant, they meet the target
    (as the add/remove algorithms calibrate against the ledger; the GG's delta0 shares leave the
    rest of delta to the prior's Gaussian)."""
    if geo["gaussian"]:
        def make(m):
            return accounting.after(prior, accounting.gaussian_steps_event(m, 1.0, steps))
        guess = 2.0 * math.sqrt(steps * 2.0 * math.log(1.25 / delta)) / epsilon
        return accounting.calibrate_noise_multiplier(
            make, epsilon, delta, accountant, accounting.REPLACE_ONE, guess=guess, slope=-1.0), None
    best = None
    for share in DELTA_SHARES:
        delta0 = share * delta / steps
        floor = gg_floor(geo["kappa"], delta0)

        def make(m, delta0=delta0):
            return accounting.after(
                prior, accounting.self_composed(step_event(geo, m, delta0, capped=False), steps))
        # advanced composition's multiplier as the starting point (PLD needs less)
        guess = max(floor, 2.0 * math.sqrt(2.0 * geo["kappa"] * math.log(1.0 / delta0))
                    * 2.0 * math.sqrt(2.0 * steps * math.log(2.0 / delta)) / epsilon * 0.5)
        found = accounting.calibrate_noise_multiplier(
            make, epsilon, delta, accountant, accounting.REPLACE_ONE, lower=floor, guess=guess,
            slope=-1.0)
        found = _refine(make, found, floor, epsilon, delta, accountant)
        if best is None or found < best[0]:
            best = (found, delta0)
    return best


# The refinement's precision: the multiplier returned is within this factor of the smallest one
# that meets the target on the reporting accountant's grid.
REFINE_TOLERANCE = 1e-3


def _refine(make, found: float, floor: float, epsilon: float, delta: float,
            accountant: str) -> float:
    """``found`` (which meets the target) lowered by bisection on the reporting accountant's
    own epsilon (``accounting.epsilon_of``, memoized, the ledger's value). Why: the calibration's
    search runs on a grid PROBE_FACTOR times coarser, and an (eps0, delta0) event's PLD rounds
    eps0 up to that grid: for eps0 ~ 0.04 (tens of steps) by up to 2% a step, so its answer can
    carry ~1% more noise than the target needs. Each bisection step costs one PLD of T two-point
    distributions (~10-40 ms)."""
    def meets(m: float) -> bool:
        return accounting.epsilon_of(make(m), delta, accountant, accounting.REPLACE_ONE) <= epsilon
    hi = found
    while True:   # a bracket [lo, hi]: hi meets the target, lo does not (or is the floor)
        lo = max(floor, hi * 0.8)
        if lo >= hi:
            return hi
        if not meets(lo):
            break
        hi = lo
        if lo == floor:
            return floor
    while hi / lo - 1.0 > REFINE_TOLERANCE:
        middle = math.sqrt(lo * hi)
        if meets(middle):
            hi = middle
        else:
            lo = middle
    return hi


def plan(options: MirrorDescentOptions, geo: dict, n: int, privacy,
         prior: events.DpEvent | None = None) -> dict:
    """The public plan: T, alpha, rho, and the noise (calibrated to the target)."""
    steps = int(options.steps) if options.steps is not None else default_steps(
        n, privacy.epsilon, privacy.delta, geo, options.max_steps)
    beta = geo["beta_relative"]
    alpha = float(options.alpha) if options.alpha is not None else ALPHA_CONSTANT * beta / steps
    if privacy.noise_multiplier is not None:
        multiplier = float(privacy.noise_multiplier)
        delta0 = None if geo["gaussian"] else DELTA_SHARES[2] * privacy.delta / steps
    else:
        multiplier, delta0 = calibrate(geo, steps, privacy.epsilon, privacy.delta,
                                       privacy.accountant, prior)
    return {"steps": steps, "alpha": alpha, "log_rho": math.log1p(alpha / (2.0 * beta)),
            "noise_multiplier": multiplier, "delta_per_step": delta0,
            "sigma": multiplier * geo["clip_norm"] / n}


# ------------------------------------------------------------------------------ train

def train(options: MirrorDescentOptions, problem: Problem, aggregator, seed: int,
          ledger: accounting.Ledger, progress) -> TrainResult:
    privacy = problem.privacy
    if ledger.neighbouring != accounting.REPLACE_ONE:
        raise ValueError("mirror-descent's guarantee is for replace-one neighbours")
    geo = geometry_plan(options, problem)
    prior = accounting.prior_event(ledger)
    if not geo["gaussian"] and privacy.accountant != "pld":
        raise ValueError("mirror-descent with p < 2 releases generalized Gaussian noise, known only "
                         "to be (epsilon, delta)-DP: the RDP accountant cannot compose it; use "
                         "--accountant pld (or --p 2)")
    public_config = {"algorithm": "mirror-descent", **dataclasses.asdict(options),
                     **{k: v for k, v in dataclasses.asdict(privacy).items()},
                     "model": problem.loss.name, "dim": problem.dim,
                     "outputs": problem.loss.outputs(), "fit_intercept": problem.fit_intercept,
                     "input": problem.source, "seed_fixed": problem.seed_fixed,
                     # The releases before training (the quality check's) set the noise: a
                     # checkpoint's plan is resumed only with the same ones.
                     "prior_releases": (accounting.event_to_json(prior) if prior is not None
                                        else None)}
    checkpoint_dir = problem.checkpoint_dir
    resumed = load_checkpoint(checkpoint_dir, public_config) if checkpoint_dir else None
    if resumed is not None:
        state, public = resumed
    else:
        state = TrainState.zeros(problem.loss.outputs(), problem.dim)
        dataset_size = public_dataset_size(privacy.num_examples, aggregator)
        public = plan(options, geo, dataset_size["value"], privacy, prior)
        public["dataset_size"] = dataset_size
    n = public["dataset_size"]["value"]
    steps, multiplier, delta0 = public["steps"], public["noise_multiplier"], public["delta_per_step"]
    event = step_event(geo, multiplier, delta0)
    name = GAUSSIAN_RELEASE if geo["gaussian"] else GG_RELEASE
    params = dict(noise_multiplier=multiplier, sigma=public["sigma"], clip_norm=geo["clip_norm"],
                  sensitivity=2.0 * geo["clip_norm"] / n, sensitivity_norm=f"l_{geo['q']:.6g}",
                  noise=(f"float Gaussian (numpy), std {public['sigma']:.6g} per coordinate"
                         if geo["gaussian"] else
                         f"float generalized Gaussian GG_(l_{geo['noise_norm']:.6g})(0, sigma^2) "
                         "(numpy, exact sampler geometry.sample_gg)"))
    if not geo["gaussian"]:
        params.update(kappa=geo["kappa"], epsilon_per_step=event.epsilon, delta_per_step=delta0)
    if checkpoint_dir and resumed is None:   # the plan before its steps are charged
        save_checkpoint(checkpoint_dir, state, public_config, public)
    ledger.record(name, event, count=state.step, **params)
    planned = ledger.event_after(name, event, steps - state.step, **params)
    ledger.admit(planned, whole_run=True)
    # The plan's epsilon (memoized: progress output reads it, as RDP cannot bound these events).
    planned_epsilon = accounting.epsilon_of(planned, privacy.delta, privacy.accountant,
                                            accounting.REPLACE_ONE)
    if privacy.epsilon is not None and planned_epsilon > privacy.epsilon * (1 + 1e-9):
        raise RuntimeError("the calibrated noise does not meet the target epsilon")   # (a bug)

    normalize = features.NormalizeRows(options.feature_norm) if options.feature_norm else None
    step_fn = MirrorDescentStep(
        loss=problem.loss, shape=state.theta.shape, fit_intercept=problem.fit_intercept,
        q=geo["q"], clip_norm=geo["clip_norm"], normalizer=float(n), sigma=public["sigma"],
        noise_norm=geo["noise_norm"], mirror_exponent=geo["mirror_exponent"],
        alpha=public["alpha"], beta=geo["beta_relative"], log_rho=public["log_rho"], seed=seed,
        transform=normalize)

    def after_chunk(new_state: TrainState, k: int) -> None:
        ledger.record(name, event, count=k, **params)
        if checkpoint_dir:
            save_checkpoint(checkpoint_dir, new_state, public_config, public)
        progress(new_state.step, steps, ledger.progress_epsilon(privacy.delta, planned))

    progress(state.step, steps, ledger.progress_epsilon(privacy.delta, planned))
    state = run_chunks(aggregator, step_fn, state, steps, problem.steps_per_chunk, after_chunk)
    theta = state.theta_sum if state.step > 0 else state.theta
    details = {k: geo[k] for k in ("p", "q", "noise_norm", "kappa", "mirror_exponent",
                                   "strong_convexity", "feature_bound", "row_bound", "clip_norm",
                                   "beta")}
    details.update(
        beta_relative_to_mirror_map=geo["beta_relative"], alpha=public["alpha"],
        rho=math.exp(public["log_rho"]), steps=steps, sigma=public["sigma"],
        noise_multiplier=multiplier, delta_per_step=delta0,
        epsilon_per_step=None if geo["gaussian"] else event.epsilon,
        accounting=("each step a GaussianDpEvent (exact, replace-one)" if geo["gaussian"] else
                    "each step the generalized Gaussian mechanism's (epsilon, delta) (Lemma 3) "
                    "as an ApproxDpEvent, composed by PLD (the optimal composition of (epsilon, "
                    "delta)-DP mechanisms; tighter than the paper's advanced composition)"),
        dataset_size="public under replace-one (the paper's relation); see dataset_size",
        output="weighted average sum_t rho^t w_{t+1} / sum_t rho^t")
    return TrainResult(theta, ledger, multiplier, 1.0, steps, geo["clip_norm"],
                       public["dataset_size"], details, sampling="full batch",
                       expected_batch_size=float(n), feature_transform=features.spec(normalize),
                       details_name="algorithm_parameters")


# ------------------------------------------------------------------------------ a test design

def lp_huber_design(n: int, d: int = 50, p: float = 1.5, seed: int = 0,
                    noise: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The note's Huber design (§4.3(d), §4.4: assumption A3 with a finite minimizer): features
    z = g / ||g||_q (g ~ N(0, I_d), so ||z||_q = 1), w* = 0.55 on its first 5 coordinates
    (||w*||_1.5 = 1.6), y = <w*, z> + N(0, noise^2). With the Huber loss (threshold 1) it is
    L = 1-Lipschitz and beta = 1-smooth w.r.t. ||.||_p, and w* is the population minimizer
    (symmetric noise), where the excess risk of w = 0 is ~0.039 (p = 1.5, d = 50). Returns
    (z, y, w*). For tests and pipelines/bench_mirror_descent.py."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(n, d))
    z = g / geometry.lp_norm(g, geometry.dual_exponent(p), keepdims=True)
    w = np.zeros(d)
    w[:min(5, d)] = 0.55
    return z, z @ w + noise * rng.normal(size=n), w


MIRROR_DESCENT = Algorithm(
    "mirror-descent", "many features and a model with few large coefficients (l_p geometry, "
                      "1 < p < 2): noisy regularized mirror descent, full batch, replace-one "
                      "neighbours (n public)",
    MODELS, MirrorDescentOptions, train, relation=accounting.REPLACE_ONE, quality_check=True)
