"""DP-SGD and full-batch DP-GD for GLMs.

* ``dpsgd`` (paper 000 §1.1 with the errata applied): Poisson sampling with rate q = B / n, every
  per-example gradient clipped to C, Gaussian noise of std sigma*C added once to the sum, and the
  sum divided by the *public* expected batch size q*n. Accounted as a Poisson-subsampled Gaussian.
* ``dpgd`` (paper 002, Algorithm 1 with clipping, eq. 7): the same with q = 1, noise on the full
  sum divided by n, and the average of the iterates theta_1..theta_T as the output by default.
  Clipping at C optimizes the Huberized loss of Lemma 5.1, which equals the original loss when
  C bounds every gradient.

* ``--adaptive-clip-quantile`` (Andrew et al. 2021; dpsgd and dpgd): the clip norm follows a
  quantile of the per-example gradient norms from a noisy count made in the same pass
  (``adaptive_clipping.AdaptiveClipStep``): over the step's Poisson sample (dpsgd) or over every row (dpgd, q = 1:
  the same step with the sampling rate 1, the count normalized by the public n).

Both are one driver because DP-GD is DP-SGD with q = 1; a separate module would repeat it. This
module is the driver (the plan, the calibration, the loop, the options and the registry entries);
the step itself is ``gradient_step``'s, and the releases before training are their own modules':
the dataset size (``beam_dp.dataset_size``), the column scaling and imputation
(``beam_dp.column_scaling``), the column counts of ``--precondition`` (``beam_dp.preconditioning``).
Secure noise's grid and slack are ``beam_dp.secure_noise``'s.

Neighbouring relation: add/remove one example. Under it the dataset size is private, so n (for
q and the normalizer) is either given as public (``num_examples``) or estimated with a Laplace
count that is recorded in the ledger and composed with the training steps. Every use of it is a
smooth function of it that stays sane over the count's error range (``_plan``): the normalizer is
q * max(n, floor) with floor the count's own error bound, so an undershooting count cannot blow
up a step.

With ``--privacy-unit-column`` (dpgd and dpsgd) the relation is add/remove one user with all
their rows: the blocks are grouped by user and bounded to K rows each, each step clips every
user's summed gradient to C (``gradient_step.UserGradientStep``, ``beam_dp.user_level``), n is a count of
users, and dpsgd's Poisson sampling samples users (a user's rows in or out together).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import (accounting, column_scaling, features, mechanisms, preconditioning,
                     secure_noise, user_level, user_rows)
from beam_dp.algorithms.adaptive_clipping import (ADAPTIVE_FLOAT_NOTE, AdaptiveClipState,
                                                  AdaptiveClipStep, UserAdaptiveClipStep,
                                                  adaptive_clipping_summary,
                                                  count_noise_std)
from beam_dp.algorithms.base import (Aggregator, FinalStage, TrainState, load_checkpoint, run_chunks,
                                     save_checkpoint)
from beam_dp.algorithms.gradient_step import NoisyGradientStep, UserGradientStep
from beam_dp.algorithms.spec import Algorithm, Problem, TrainResult, option
from beam_dp.categorical import Encoding
from beam_dp.dataset_size import release_dataset_size
from beam_dp.losses import MODEL_NAMES, GlmLoss
from beam_dp.preconditioning import ColumnStepScale
from beam_dp.sampling import PoissonSampler

ALGORITHMS = ("dpsgd", "dpgd")
NOISE_KINDS = ("secure", "float")


@dataclasses.dataclass
class NoisyGDConfig:
    algorithm: str = "dpsgd"
    clip_norm: float = 1.0
    learning_rate: float = 1.0
    batch_size: int = 256              # expected batch size (dpsgd only)
    epochs: float | None = None        # passes over the data; steps = ceil(epochs / q)
    steps: int | None = None           # overrides epochs
    epsilon: float | None = None       # target; calibrates the noise multiplier
    delta: float = 1e-5
    noise_multiplier: float | None = None  # instead of epsilon: report the epsilon it buys
    accountant: str = "pld"
    # "secure": integer noise on exact integer sums; "float" (or None): numpy's float noise.
    noise: str | None = None
    num_examples: int | None = None    # public dataset size; otherwise a Laplace count
    count_epsilon: float | None = None  # budget of that count (default 5% of epsilon, or 0.01)
    average_iterates: bool | None = None  # default: on for dpgd, off for dpsgd
    fit_intercept: bool = True
    steps_per_chunk: int | None = None   # steps per job (full batch); None: the aggregator's choice
    rank: int | None = None            # dpgd: public bound on the feature rank (min(d + 1, n))
    # dpgd: cap on the rank-based number of steps; None: ``default_max_steps`` of the released n
    max_steps: int | None = None
    # dpgd --gradient-estimator projection: the l1 radius C sqrt(s) the noisy mean gradient is
    # projected onto (paper 001, Algorithm 1); None: the plain Gaussian estimate.
    projection_radius: float | None = None
    # --adaptive-clip-quantile (dpsgd, dpgd): the target quantile gamma of the per-row gradient norms
    # that the clip norm tracks (Andrew et al. 2021), from ``clip_norm``; None: a fixed clip.
    adaptive_clip_quantile: float | None = None
    adaptive_clip_rate: float = 0.2     # eta_C of the geometric update

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}")
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of --epsilon or --noise-multiplier")
        positive = {"clip norm": self.clip_norm, "learning rate": self.learning_rate,
                    "delta": self.delta}
        if self.steps_per_chunk is not None:
            positive["steps per job"] = self.steps_per_chunk
        if self.epsilon is not None:
            positive["epsilon"] = self.epsilon
        if self.noise_multiplier is not None:
            positive["noise multiplier"] = self.noise_multiplier
        if self.algorithm == "dpsgd":
            positive["batch size"] = self.batch_size
        for name, value in positive.items():
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if not self.delta < 1:
            raise ValueError("delta must be below 1")
        if self.noise is not None and self.noise not in NOISE_KINDS:
            raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}, got {self.noise!r}")
        if self.rank is not None and self.rank < 1:
            raise ValueError("--rank must be at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("--max-steps must be at least 1")
        if self.steps is not None and self.steps < 1:
            raise ValueError("steps must be at least 1")
        if self.num_examples is not None and self.num_examples < 1:
            raise ValueError("--num-examples must be at least 1")
        if self.count_epsilon is not None and not self.count_epsilon > 0:
            raise ValueError("--count-epsilon must be positive")
        if self.projection_radius is not None and not (self.projection_radius > 0
                                                       and math.isfinite(self.projection_radius)):
            raise ValueError("the gradient projection's radius must be a positive number")
        if self.adaptive_clip_quantile is not None:
            if not 0.0 < self.adaptive_clip_quantile < 1.0:
                raise ValueError("--adaptive-clip-quantile must be a fraction in (0, 1)")
            if not (self.adaptive_clip_rate > 0 and math.isfinite(self.adaptive_clip_rate)):
                raise ValueError("--adaptive-clip-rate must be a positive number")
            if self.noise == "secure":
                raise ValueError("--adaptive-clip-quantile adds float noise (its clip norm "
                                 "changes the exact sums' grid every step); use --noise float")
            if self.projection_radius is not None:
                raise ValueError("--adaptive-clip-quantile and --gradient-estimator projection "
                                 "(whose radius is the fixed clip norm) do not combine")

    def adaptive(self) -> bool:
        return self.adaptive_clip_quantile is not None

    def averaging(self) -> bool:
        return self.algorithm == "dpgd" if self.average_iterates is None else self.average_iterates


def _step_event(noise_multiplier: float, q: float,
                count_noise_std: float | None = None) -> events.DpEvent:
    """A step's event; with adaptive clipping (``count_noise_std``) the clipped sum's Gaussian
    composed with the count's (sensitivity 1, std ``count_noise_std``), both on the step's
    sample. dp_accounting composes them (its PLD through ``accounting.merged_gaussians``)."""
    step = events.GaussianDpEvent(noise_multiplier)
    if count_noise_std is not None:
        step = events.ComposedDpEvent([step, events.GaussianDpEvent(count_noise_std)])
    return step if q >= 1.0 else events.PoissonSampledDpEvent(q, step)


def _step_release_name(q: float) -> str:
    return "gaussian_clipped_gradient_sum" if q >= 1.0 else "poisson_sampled_gaussian_clipped_gradient_sum"


def _recorded_before(ledger: accounting.Ledger, saved: list) -> int:
    """How many of a checkpoint's saved releases the ledger already holds: those recorded before
    ``train`` was called (the quality check's reservation, ``beam_dp.quality``) are recorded
    again by the resumed run's caller, and must not be counted twice."""
    held = [{"name": r.name, "event": accounting.event_to_json(r.event), "count": r.count,
             "params": r.params} for r in ledger.releases]
    if json.loads(json.dumps(saved[:len(held)], default=str)) != json.loads(json.dumps(held, default=str)):
        raise ValueError("the checkpoint was written by a run whose releases before training "
                         "differ from this one's (e.g. other quality-check settings); use another "
                         "--checkpoint-dir or the same settings")
    return len(held)


def train(config: NoisyGDConfig, loss: GlmLoss, dim: int, aggregator: Aggregator, seed: int,
          ledger: accounting.Ledger,
          on_progress: Callable[[int, int, float], None] = lambda done, total, eps: None,
          checkpoint_dir: str | None = None,
          preprocess: Callable[[int], dict] | None = None,
          make_transform: Callable[[dict], Callable] | None = None,
          clip_norm_from: Callable[[dict], float] | None = None,
          checkpoint_key: dict | None = None,
          initial_theta: np.ndarray | None = None,
          make_step_scale: Callable[[dict, dict], ColumnStepScale] | None = None,
          user_bounding: "user_level.UserBounding | None" = None,
          final_stage: "Callable[[dict], FinalStage] | None" = None) -> TrainResult:
    """Trains a GLM with DP-SGD or DP-GD over ``dim`` model features, from ``initial_theta``
    (a released model's coefficients: public) or zeros.

    ``preprocess(n)``, if given, makes private releases (recorded in the ledger) before training
    and returns them as a dict of public values; ``make_transform(preprocessing)`` turns them into
    the per-example feature map of every step, and ``clip_norm_from(preprocessing)``, if given,
    the clip norm (replacing ``config.clip_norm``). The noise multiplier is calibrated so that the
    composition of everything in the ledger and all the steps meets (epsilon, delta).
    ``on_progress(steps_done, steps_total, epsilon_so_far)`` is called after every chunk; the
    epsilon there is the ledger's, never a data statistic. ``final_stage(preprocessing)``, if
    given, makes a stage over the trained model that full-batch runs add to their last job
    (``run_chunks``' ``final``); its release is the result's ``final_release``.

    ``user_bounding`` (user-level privacy: the aggregator's blocks are grouped by user and
    bounded to K rows each, ``user_level.group_by_user``): n is then the number of USERS
    (public ``num_examples``, or a noisy count of them, sensitivity 1 per user), so q = B / n
    samples users (dpsgd: ``--batch-size`` is an expected number of users), the normalizer is
    q max(noisy users, floor) and each update the mean over (expected) users of their clipped
    sums, at most C in norm as in a row-level run; the steps are ``UserGradientStep``s, each
    accounted as the row-level step is (PoissonSampledDpEvent(q, Gaussian) for dpsgd) under
    add/remove one user.
    """
    config.validate()
    public_config = {k: v for k, v in dataclasses.asdict(config).items() if k != "steps_per_chunk"}
    public_config.update(model=loss.name, dim=dim, outputs=loss.outputs(), **(checkpoint_key or {}))

    resumed = load_checkpoint(checkpoint_dir, public_config) if checkpoint_dir else None
    if resumed is not None:
        state, plan = resumed
        for r in plan["releases"][_recorded_before(ledger, plan["releases"]):]:
            ledger.record(r["name"], accounting.event_from_json(r["event"]), r["count"], **r["params"])
        if user_bounding is not None and user_bounding.auto:   # the cap its first attempt chose
            aggregator.cap_rows_per_user(plan["rows_per_user"]["max_rows_per_user"])
    else:
        state = TrainState.zeros(loss.outputs(), dim)
        if initial_theta is not None:
            if np.shape(initial_theta) != state.theta.shape:
                raise ValueError(f"the warm-start model has coefficients of shape "
                                 f"{np.shape(initial_theta)}, this run {state.theta.shape}")
            state.theta = np.array(initial_theta, dtype=np.float64)
        if user_bounding is not None:
            if config.noise != "float":
                raise ValueError("user-level privacy is built for dpgd and dpsgd with float noise")
            dataset_size, rows_per_user = user_rows.release_users(
                config, aggregator, user_bounding, seed, ledger)
        else:
            dataset_size = release_dataset_size(config, aggregator, seed, ledger)
            rows_per_user = None
        preprocessing = preprocess(dataset_size["value"]) if preprocess else {}
        plan = _plan(config, dataset_size, ledger, dim)
        if rows_per_user is not None:
            plan["rows_per_user"] = rows_per_user
        plan.update(preprocessing=preprocessing, releases=[
            {"name": r.name, "event": accounting.event_to_json(r.event), "count": r.count,
             "params": r.params} for r in ledger.releases])
    q, sigma, total_steps = plan["sampling_probability"], plan["noise_multiplier"], plan["steps"]
    clip_norm = clip_norm_from(plan["preprocessing"]) if clip_norm_from else config.clip_norm
    noise = "float" if config.noise == "float" or config.adaptive() else "secure"   # None: secure
    count_std = plan.get("count_noise_std") if config.adaptive() else None
    sampler_delta = None
    if noise == "secure":
        try:
            # The ledger holds the releases before training (a resumed run's too): with all
            # the steps, the run's epsilon.
            epsilon = config.epsilon if config.epsilon is not None else accounting.epsilon_of(
                ledger.event_after(_step_release_name(q), _step_event(sigma, q), total_steps),
                config.delta, config.accountant)
            # The releases before the steps (DPSGD-F's secure preprocessing) count in it too.
            sampler_delta = secure_noise.sampler_delta_bound(
                sigma, int(np.prod(state.theta.shape)), total_steps, epsilon,
                secure_noise.prior_total_variation(ledger))
            if sampler_delta > 1e-3 * config.delta:
                raise secure_noise.SecureNoiseUnavailable(
                    f"secure noise's samplers could add {sampler_delta:.2g} to delta at epsilon "
                    f"{epsilon:.3g} over these steps")
        except secure_noise.SecureNoiseUnavailable as why:
            noise, sampler_delta = secure_noise.float_instead(config.noise, why, ledger), None
    step_event = _step_event(sigma, q, count_std)
    step_params = dict(noise_multiplier=sigma, sampling_probability=q, clip_norm=clip_norm,
                       sensitivity=clip_norm, noise=secure_noise.noise_description(noise, sigma))
    if count_std is not None:
        step_params.update(
            clip_norm=f"adaptive from {clip_norm:g} (target quantile "
                      f"{config.adaptive_clip_quantile:g}, rate {config.adaptive_clip_rate:g})",
            sensitivity="the step's clip norm C_t for the sum, 1 for the count",
            count_noise_std=count_std,
            normalizer=f"public expected batch size {plan['normalizer']:.6g}")
    if sampler_delta is not None:
        step_params["sampler_delta_bound"] = sampler_delta
        if secure_noise.secure_noise_note() not in ledger.notes:
            ledger.notes.append(secure_noise.secure_noise_note())
    if checkpoint_dir and resumed is None:
        # The plan (its count and noise) is saved before the steps are charged: the charge's
        # extension depends on the noisy count, so once it is in the ledger a rerun must find
        # the same count here and resume, never make a new one (charged on top).
        save_checkpoint(checkpoint_dir, state, public_config, plan)
    ledger.record(_step_release_name(q), step_event, count=state.step, **step_params)
    # The whole run's event, for a cheap progress epsilon (one PLD per run, not one per chunk).
    planned = ledger.event_after(_step_release_name(q), step_event, total_steps - state.step,
                                 **step_params)
    # The steps are recorded after each chunk: admitted before the first.
    ledger.admit(planned, whole_run=True)

    step_class = UserGradientStep if user_bounding is not None else NoisyGradientStep
    adaptive = {}
    if count_std is not None:
        step_class = UserAdaptiveClipStep if user_bounding is not None else AdaptiveClipStep
        adaptive = dict(noise_multiplier=sigma, count_noise_std=count_std,
                        target_quantile=config.adaptive_clip_quantile,
                        clip_rate=config.adaptive_clip_rate)
        released = tuple(plan.get("clip_norms", ()))   # a resumed run's, from its checkpoint
        state = AdaptiveClipState(state.theta, state.theta_sum, state.step, state.final,
                                  clip_norm=released[-1] if released else clip_norm,
                                  clip_norms=released)
    step_fn = step_class(
        **adaptive,
        loss=loss, clip_norm=clip_norm, noise_std=sigma * clip_norm,
        normalizer=plan["normalizer"], learning_rate=config.learning_rate,
        sampler=PoissonSampler(q, mechanisms.sampling_seed(seed)), seed=seed,
        shape=state.theta.shape,
        fit_intercept=config.fit_intercept,
        transform=make_transform(plan["preprocessing"]) if make_transform else None,
        noise=noise,
        step_scale=make_step_scale(plan["preprocessing"], plan) if make_step_scale else None,
        l1_radius=config.projection_radius)

    def after_chunk(new_state: TrainState, k: int) -> None:
        ledger.record(_step_release_name(q), step_event, count=k, **step_params)
        if count_std is not None:
            plan["clip_norms"] = list(new_state.clip_norms)
        if checkpoint_dir:
            save_checkpoint(checkpoint_dir, new_state, public_config, plan)
        on_progress(new_state.step, total_steps, ledger.progress_epsilon(config.delta, planned))

    on_progress(state.step, total_steps, ledger.progress_epsilon(config.delta, planned))
    state = run_chunks(aggregator, step_fn, state, total_steps, config.steps_per_chunk, after_chunk,
                       plan if checkpoint_dir else None, keep_batches=bool(checkpoint_dir),
                       final=final_stage(plan["preprocessing"]) if final_stage else None)
    theta = state.averaged() if config.averaging() else state.theta
    details = plan["preprocessing"]
    if count_std is not None:
        details = {**details, "adaptive_clipping": adaptive_clipping_summary(
            config.adaptive_clip_quantile, config.adaptive_clip_rate, clip_norm, count_std,
            plan["normalizer"], state.clip_norms)}
        clip_norm = None
    return TrainResult(theta, ledger, sigma, q, total_steps, clip_norm, plan["dataset_size"],
                       details, sampling=("full batch" if q >= 1 else "Poisson over users"
                                          if user_bounding is not None else "Poisson"),
                       expected_batch_size=plan["normalizer"],
                       privacy_unit=_privacy_unit(user_bounding, plan),
                       final_release=state.final)



def _privacy_unit(bounding, plan: dict) -> dict | None:
    """The report's privacy unit: the bounds, the cap the run used and its released cost."""
    if bounding is None:
        return None
    cost = plan["rows_per_user"]
    return {**bounding.describe(), "max_rows_per_user": cost["max_rows_per_user"], "cap": cost}


# dpgd's default cap on the number of steps (``default_max_steps``): DEFAULT_MAX_STEPS[1] steps
# on small tables, falling as DEFAULT_STEP_ROWS / n to DEFAULT_MAX_STEPS[0], the earlier fixed
# cap, from n = 300,000 on, so a default run reads at most max(DEFAULT_STEP_ROWS, 100 n) rows
# and no large-n run is slower than before (at n = 10^6 docs/benchmarks/speed.md puts a local step
# at ~46 ms: 100 steps, ~5 s). Why more steps where n is small: at 100 steps dpgd is
# under-converged on columns mapped onto [-1, 1] by their ranges (not standardized, so
# ill-conditioned), and with the iterates averaged the extra steps cost little in noise.
# Measured with pipelines/bench_raw_tables.py at epsilon 1 (MASS Boston with its declared ranges,
# 10 seeds, mean RMSE; OLS 4.31): cap 100 6.54, 200 6.38, 300 6.25, 500 6.40 (fixed 200 steps
# 6.17, 300 6.23, 500 6.81: past ~300 the noise per step, sigma ~ sqrt(T), wins); ISLR Default
# ROC AUC 0.946 -> 0.948 and AER CreditCard accuracy 0.955 -> 0.970 at 300 (3 seeds).
DEFAULT_MAX_STEPS = (100, 300)
DEFAULT_STEP_ROWS = 3e7


def default_max_steps(n: int) -> int:
    """dpgd's cap on the number of steps without --max-steps, from n (the public or released
    count: post-processing, nothing spent): DEFAULT_STEP_ROWS / n within DEFAULT_MAX_STEPS,
    i.e. 300 up to n = 100,000, 200 at 150,000, 100 from 300,000 on; non-increasing in n."""
    low, high = DEFAULT_MAX_STEPS
    return int(min(high, max(low, math.ceil(DEFAULT_STEP_ROWS / max(int(n), 1)))))


def dpgd_steps(n: int, epsilon: float | None, delta: float, rank: int, max_steps: int) -> int:
    """Paper 002 (note §2.3): the excess-risk bound of averaged DP-GD is
    ||theta*||_M sqrt(L^2/T + 2 L^2 rank log(1/delta) / (n eps)^2), so any
    T >= (n eps)^2 / (2 rank log(1/delta)) is within sqrt(2) of the T -> infinity limit (the paper's
    T = (n eps)^2 is far more than needed). Capped at ``max_steps`` full passes (whatever default
    the caller passes); with only a noise multiplier given, epsilon is unknown and the cap is
    used. With a noisy n, T moves by a factor (1 +- err/n)^2 below the cap, continuously: the
    count's error changes the run time a little, never the privacy (sigma is calibrated to T)."""
    if epsilon is None:
        return max_steps
    return int(min(max_steps, max(1, math.ceil((n * epsilon) ** 2 / (2 * rank * math.log(1 / delta))))))


DEFAULT_EPOCHS = 5.0   # dpsgd without --epochs / --steps


def _plan(config: NoisyGDConfig, dataset_size: dict, ledger: accounting.Ledger, dim: int) -> dict:
    """The public plan: q, the number of steps, the normalizer and sigma (calibrated against the
    ledger so far). Each is a smooth (continuous up to a ceiling), documented function of the
    released n, so that a count that is off by a little changes the run by a little:

    * q = 1 for dpgd; min(1, B / n) for dpsgd;
    * steps: ``steps`` if given; else ceil(epochs / q) with epochs = ``epochs`` or, for dpsgd,
      DEFAULT_EPOCHS (so n = 999 and 1001 with B = 1000 give 5 and 6 steps; the rank-based count
      below used to take over for dpsgd whenever q reached 1, i.e. 2,000 full-batch steps at
      n = 999); else, for dpgd only, ``dpgd_steps`` (continuous in n up to the ``max_steps`` cap,
      by default ``default_max_steps`` of the released n);
    * normalizer of the noisy sums: q * max(n, floor), floor the count's ``normalizer_floor`` (1 for
      a public n); for dpsgd with n above the floor that is the expected batch size B.
    """
    n = dataset_size["value"]
    q = 1.0 if config.algorithm == "dpgd" else min(1.0, config.batch_size / n)
    if config.steps is not None:
        steps = int(config.steps)
    elif config.epochs is not None or config.algorithm == "dpsgd":
        steps = max(1, math.ceil((config.epochs if config.epochs is not None else DEFAULT_EPOCHS) / q))
    else:
        cap = config.max_steps if config.max_steps is not None else default_max_steps(n)
        # The features' rank is at most d + 1, and at most the number of units (n) whose
        # gradients span the steps: hashed or one-hot columns make d + 1 far above n (2^15
        # buckets over 689 users: 1 step at epsilon 1, where n bounds it to 30).
        rank = config.rank or min(dim + 1, max(1, math.ceil(n)))
        steps = dpgd_steps(n, config.epsilon, config.delta, rank, cap)
    normalizer = q * max(float(n), float(dataset_size.get("normalizer_floor", 1.0)))
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    else:
        prior = ledger.event()
        spent = ledger.epsilon(config.delta)
        if spent >= config.epsilon:
            raise ValueError(f"the releases before training already spend epsilon {spent:.3g} of the "
                             f"{config.epsilon} budget; lower --count-epsilon / --preprocess-epsilon "
                             "or give --num-examples")

        def make_event(s: float) -> events.DpEvent:
            if config.adaptive():
                return events.ComposedDpEvent([prior, accounting.self_composed(
                    _step_event(s, q, count_noise_std(s, normalizer)), steps)])
            return events.ComposedDpEvent([prior, accounting.gaussian_steps_event(s, q, steps)])
        guess, slope = accounting.noise_multiplier_guess(q, steps, config.epsilon - spent,
                                                         config.delta)
        sigma = accounting.calibrate_noise_multiplier(make_event, config.epsilon, config.delta,
                                                      config.accountant, guess=guess, slope=slope)
    plan = {"sampling_probability": q, "steps": steps, "noise_multiplier": sigma,
            "normalizer": normalizer, "dataset_size": dataset_size}
    if config.adaptive():
        plan["count_noise_std"] = count_noise_std(sigma, normalizer)
    return plan


# ------------------------------------------------------------------------------ registry entries

_CLIP = option(1.0, "per-example gradient clip norm C",
               low=0, low_open=True)
_SCALE = option("auto", "columns without declared bounds: 'private' maps them onto "
                        "[-1, 1] by private quantiles; 'auto' where accurate, else as "
                        "given (a small regression stops); 'none' leaves them",
                choices=("none", "private", "auto"))
_SCALE_EPSILON = option(None, "budget of --scale-features' quantiles; default epsilon /"
                              " 10", low=0, low_open=True)
_FEATURE_NORM = option(None, "normalize every feature vector to this norm (applied "
                             "again by predict); default as given",
                       low=0, low_open=True)
# Adaptive clipping's options, shared by dpgd and dpsgd (one kernel, ``AdaptiveClipStep``).
_ADAPTIVE_QUANTILE = option(
    None, "adaptive clipping (Andrew et al. 2021): the clip norm follows this quantile "
          "of the gradient norms; default off", low=0, low_open=True, high=1)
# (None when not given, so that one given without --adaptive-clip-quantile is refused:
# ignored_options.ACTS_ONLY_WHEN; NoisyGDConfig's 0.2 applies)
_ADAPTIVE_RATE = option(None, "adaptive clipping's update rate; default 0.2", low=0, low_open=True)


@dataclasses.dataclass
class DpgdOptions:
    clip_norm: float = _CLIP
    learning_rate: float | None = option(
        None, "step size; default 1, or 1/4 for --model linear and huber", low=0, low_open=True)
    steps: int | None = option(None, "full-batch steps; default ceil((n eps)^2 / (2 "
                                     "rank ln(1/delta))), up to --max-steps",
                               low=1)
    rank: int | None = option(None, "public bound on the features' rank, for the "
                                    "default steps; default the smaller of d + 1 and n", low=1)
    max_steps: int | None = option(
        None, "cap on the default steps; default 300 up to n = 100,000 rows, then fewer"
              " (at most 3e7 rows read, at least 100)", low=1)
    average_iterates: bool | None = option(
        None, "average the iterates (paper 002) rather than output the last; default "
              "on, off with --precondition counts")
    feature_norm: float | None = _FEATURE_NORM
    scale_features: str = _SCALE
    scale_epsilon: float | None = _SCALE_EPSILON
    precondition: str = option("auto", "scale categorical columns' steps by n / (their "
                                       "private count): counts, none, or auto (counts "
                                       "with --categorical-columns and --epsilon)",
                               choices=("auto", "counts", "none"))
    precondition_epsilon: float | None = option(
        None, "budget of those counts; default epsilon / 10", low=0, low_open=True)
    gradient_estimator: str = option(
        "gaussian", "projection: project each noisy mean gradient onto the l1 ball of "
                    "radius C sqrt(s) (paper 001; same privacy); gaussian: as is",
        choices=("gaussian", "projection"))
    adaptive_clip_quantile: float | None = _ADAPTIVE_QUANTILE
    adaptive_clip_rate: float | None = _ADAPTIVE_RATE


@dataclasses.dataclass
class DpsgdOptions:
    clip_norm: float = _CLIP
    learning_rate: float = option(2.0, "step size", low=0, low_open=True)
    batch_size: int = option(1000, "expected batch size B: each example (or user) is in"
                                   " a step's batch with probability B / n (Poisson "
                                   "sampling)", low=1)
    epochs: float = option(5.0, "passes over the data: steps = ceil(epochs n / B)", low=0,
                           low_open=True)
    steps: int | None = option(None, "number of steps; overrides --epochs", low=1)
    average_iterates: bool = option(False, "output the average of the iterates rather than the last")
    feature_norm: float | None = _FEATURE_NORM


@dataclasses.dataclass
class ScaledDpsgdOptions(DpsgdOptions):
    """dpsgd's options: DpsgdOptions (which dpsgd-f shares, with its own private preprocessing
    instead of this one) and the private column scaling."""

    # (dpsgd-f keeps DpsgdOptions' fixed 2: its preprocessing and tables were measured with it)
    learning_rate: float | None = option(
        None, "step size; default 2, or 1/2 for --model linear and huber (dpgd's "
              "curvature rule)", low=0, low_open=True)
    scale_features: str = _SCALE
    scale_epsilon: float | None = _SCALE_EPSILON
    adaptive_clip_quantile: float | None = _ADAPTIVE_QUANTILE
    adaptive_clip_rate: float | None = _ADAPTIVE_RATE


def core_config(name: str, options, problem: Problem, exclude=(), secure: bool = False) -> NoisyGDConfig:
    """The driver's configuration from an algorithm's declared options (fields of the same name)
    and the shared problem; the noise as asked, else secure only if the algorithm has it."""
    shared = {k: v for k, v in dataclasses.asdict(options).items()
              if k not in exclude and k in NoisyGDConfig.__dataclass_fields__}
    if shared.get("adaptive_clip_rate", 0) is None:
        del shared["adaptive_clip_rate"]   # not given: the config's default
    privacy = dataclasses.asdict(problem.privacy)
    if not secure:
        privacy["noise"] = "float"   # (registry.check refused an explicit "secure")
    return NoisyGDConfig(algorithm=name, **privacy, **shared,
                         fit_intercept=problem.fit_intercept, steps_per_chunk=problem.steps_per_chunk)


# The squared and Huber losses' curvature is at most ||x||^2, the logistic loss's ||x||^2 / 4 (the
# softmax's ||x||^2 / 2): dpgd's default step is scaled by the same factor.
_SQUARED_CURVATURE_STEP = 0.25


# dpsgd's base step (for the logistic loss); scaled by the same curvature rule as dpgd's. At 2
# on a regression it was below the constant predictor (Table C: diamonds R^2 -0.09, Computers
# 0.30; MASS Boston with ranges RMSE 23.9 against the constant's 8.6).
_BASE_STEP = {"dpgd": 1.0, "dpsgd": 2.0}


def default_learning_rate(model: str, algorithm: str = "dpgd") -> float:
    """dpgd's (or dpsgd's) default step for a model (``--model``)."""
    return _BASE_STEP[algorithm] * (_SQUARED_CURVATURE_STEP if model in ("linear", "huber") else 1.0)



def _train_noisy(name: str, options, problem: Problem, aggregator, seed: int, ledger, progress):
    if getattr(options, "learning_rate", 1.0) is None:
        options = dataclasses.replace(options,
                                      learning_rate=default_learning_rate(problem.loss.name, name))
    # Sparse (categorical) input: float noise, since the exact sums quantize dense rows.
    bounding = problem.privacy_unit
    if bounding is not None:
        _check_user_level(options, problem)
    config = core_config(name, options, problem, exclude=("feature_norm",),
                         secure=not problem.sparse and bounding is None)
    if config.adaptive():
        if config.noise == "secure":
            raise ValueError("--adaptive-clip-quantile adds float noise (its clip norm changes "
                             "the exact sums' grid every step); use --noise float")
        if config.noise is None and ADAPTIVE_FLOAT_NOTE not in ledger.notes:
            ledger.notes.append(ADAPTIVE_FLOAT_NOTE)
        config = dataclasses.replace(config, noise="float")
    if getattr(options, "gradient_estimator", "gaussian") == "projection":
        if config.noise == "secure":
            raise ValueError("--gradient-estimator projection post-processes float noise; "
                             "use --noise float")
        config = dataclasses.replace(config, noise="float", projection_radius=options.clip_norm
                                     * math.sqrt(gradient_sparsity(problem)))
    if problem.sparse and options.feature_norm:
        raise ValueError("--feature-norm needs dense features; categorical rows have one 1 per "
                         "column, so scale the numeric columns instead")
    normalize = features.NormalizeRows(options.feature_norm) if options.feature_norm else None
    preprocess = make_step_scale = None
    make_transform = (lambda pre: normalize) if normalize else None
    counts = ()
    scaled = False
    if preconditioning.preconditioned(options, problem):
        preprocess, make_step_scale, counted = preconditioning.column_counts(
            options, problem, aggregator, seed, ledger)
        counts = (counted,)
        if options.average_iterates is None:
            config = dataclasses.replace(config, average_iterates=False)
    if (getattr(options, "scale_features", "none") != "none" or problem.source.get("bounds")
            or column_scaling.imputed_columns(problem)):
        # (categorical columns next to numeric ones: their counts in the ranges' pass)
        scaling = column_scaling.prepare(options, problem, aggregator, seed, ledger, also=counts)
        if scaling[0] is not None:
            preprocess, make_transform = scaling
            scaled = True
    initial_theta = problem.initial_theta
    if initial_theta is not None and make_transform is not None and preprocess is not None:
        # (a warm start's ranges are all declared: the map is known before any release)
        start_map = make_transform({})
        if isinstance(start_map, features.ScaleColumns):
            initial_theta = start_map.scale_label(initial_theta)
    def final_stage(pre: dict) -> FinalStage:
        """The quality check over the model as this function returns it (below: the averaged
        or last iterate, a scaled label's coefficients back in its units), with the map
        training applied to the rows."""
        applied = make_transform(pre) if make_transform else None
        scaled = isinstance(applied, features.ScaleColumns) and applied.label_low is not None

        def model_of(state: TrainState):
            theta = state.averaged() if config.averaging() else state.theta
            return applied.unscale_label(theta) if scaled else theta

        inner, to_state = problem.final_check(features.spec(applied),
                                              applied.label_range() if scaled else None)
        return FinalStage(inner, model_of, to_state)

    result = train(config, problem.loss, problem.dim, aggregator, seed, ledger, progress,
                   problem.checkpoint_dir, preprocess=preprocess, make_transform=make_transform,
                   checkpoint_key={"input": problem.source, "seed_fixed": problem.seed_fixed,
                                   "scale_features": options.scale_features,
                                   "scale_epsilon": options.scale_epsilon,
                                   **({"privacy_unit": dataclasses.asdict(bounding)}
                                      if bounding is not None else {})},
                   initial_theta=initial_theta, make_step_scale=make_step_scale,
                   user_bounding=bounding,
                   final_stage=final_stage if problem.final_check is not None else None)
    applied = make_transform(result.preprocessing) if make_transform else None
    theta, preprocessing = result.theta, result.preprocessing
    if isinstance(applied, features.ScaleColumns) and applied.label_low is not None:
        theta = applied.unscale_label(result.theta)
        preprocessing = {**preprocessing, "label_range": applied.label_range()}
    if not options.feature_norm and (scaled or getattr(options, "scale_features", "none") != "none"):
        # by column name, for stderr and the top of report.html
        preprocessing = {**preprocessing, "scaling": column_scaling.describe(
            problem, applied, preprocessing, getattr(options, "scale_features", "none"))}
    return dataclasses.replace(result, theta=theta, preprocessing=preprocessing,
                               feature_transform=features.spec(applied))


def _check_user_level(options, problem: Problem) -> None:
    """What user-level privacy does not cover yet, refused by name: secure noise (its exact sums
    quantize rows, not users' sums). The ranges, fills and column counts weigh each row 1 / its
    user's rows; adaptive clipping counts users."""
    if problem.privacy.noise == "secure":
        raise ValueError("--privacy-unit-column has float noise only (the secure noise's exact "
                         "sums are per row); use --noise float or leave --noise out")


def gradient_sparsity(problem: Problem) -> int:
    """s, a public bound on the nonzeros of one example's gradient: per output, one per numeric
    column, one per categorical column (its value's or bucket's, exactly one whatever the value)
    and the intercept; a dense problem's s is every coefficient. From the declared columns only."""
    spec = problem.source.get("encoding")
    per_output = ((Encoding.from_spec(spec).nonzeros_per_row if spec else problem.dim)
                  + int(problem.fit_intercept))
    return problem.loss.outputs() * max(per_output, 1)


def _train_dpgd(options, problem, aggregator, seed, ledger, progress):
    return _train_noisy("dpgd", options, problem, aggregator, seed, ledger, progress)


def _train_dpsgd(options, problem, aggregator, seed, ledger, progress):
    return _train_noisy("dpsgd", options, problem, aggregator, seed, ledger, progress)


DPGD = Algorithm(
    "dpgd", "classification or regression on up to a few million rows: full-batch noisy "
            "gradient descent; accurate at small epsilon, each step reads all the data",
    MODEL_NAMES, DpgdOptions, _train_dpgd, warm_start=True, secure_noise=True, sparse_input=True,
    user_level=True, quality_check=True)
DPSGD = Algorithm(
    "dpsgd", "large data where a full pass per step is too slow: Poisson-sampled mini-batches, "
             "each step reads only its batch; needs more tuning than dpgd",
    MODEL_NAMES, ScaledDpsgdOptions, _train_dpsgd, warm_start=True, secure_noise=True,
    user_level=True, sparse_user_level=True, quality_check=True)
