"""The algorithm registry: every optimizer declares itself here, once.

An algorithm is one module that builds an ``Algorithm``: its name, one line on when to use it,
the models it supports, the neighbouring relation its guarantee is for, an options dataclass
and a ``train`` function. The options dataclass declares each field with ``option(...)`` (type,
default, help, valid range), and everything else is generated from it: the CLI flags of
``beam-dp train --algorithm X`` (``add_arguments``), the keyword arguments of ``beam_dp.train``
and of the scikit-learn estimators (``make_options``), and the validation (``validate``).
``cli.py``, ``api.py`` and the estimators loop over ``ALGORITHMS``; none branches on a name.

``train(options, problem, aggregator, seed, ledger, progress) -> TrainResult`` gets the
algorithm's options and the shared ``Problem`` (model, privacy budget, execution settings).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import typing
from typing import Any, Callable

import numpy as np

from beam_dp import accounting
from beam_dp.losses import GlmLoss

# ------------------------------------------------------------------------------ declared options


def option(default: Any, help: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, choices: tuple | None = None) -> Any:
    """A declared option: ``default``, a help text, and the valid range [low, high] (``low_open``:
    (low, high]) or the valid ``choices``. None as a default means "derived", which the help text
    says how."""
    return dataclasses.field(default=default, metadata={
        "help": help, "low": low, "high": high, "low_open": low_open, "choices": choices})


def _base_type(hint) -> type:
    """float for ``float | None``, etc."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def fields(options_class) -> list[tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(options_class)
    return [(f, _base_type(hints[f.name])) for f in dataclasses.fields(options_class)]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(options) -> None:
    """Checks every declared field against its type and range; then the options' own ``check``
    (constraints between fields), if any. Raises ValueError naming the flag."""
    for f, kind in fields(type(options)):
        value = getattr(options, f.name)
        if value is None:
            continue
        meta, name = f.metadata, flag(f.name)
        if kind is bool:
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be true or false")
            continue
        if meta.get("choices") is not None:
            if value not in meta["choices"]:
                raise ValueError(f"{name} must be one of {', '.join(map(str, meta['choices']))}")
            continue
        if kind in (int, float):
            # numbers.Real: numpy scalars too (a GridSearchCV grid from np.arange holds np.int64)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number")
            if not math.isfinite(value):   # before int(value), which raises on inf and nan
                raise ValueError(f"{name} must be a finite number")
            if kind is int and value != int(value):
                raise ValueError(f"{name} must be a whole number")
            low, high = meta.get("low"), meta.get("high")
            if low is not None and (value <= low if meta.get("low_open") else value < low):
                raise ValueError(f"{name} must be {'above' if meta.get('low_open') else 'at least'} {low:g}")
            if high is not None and value > high:
                raise ValueError(f"{name} must be at most {high:g}")
    check = getattr(options, "check", None)
    if check is not None:
        check()


def make_options(options_class, values: dict):
    """The options dataclass from keyword values; unknown names are a TypeError listing the
    valid ones (so a typo in a notebook is not silently ignored)."""
    known = {f.name for f in dataclasses.fields(options_class)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the algorithm's options: "
                        f"{', '.join(sorted(known))} (and beam_dp.train's own keywords, e.g. "
                        "steps_per_job, runner, seed: see help(beam_dp.train))")
    options = options_class(**{name: _plain(value) for name, value in values.items()})
    validate(options)
    return options


def _plain(value):
    """numpy scalars as the Python values they hold (they reach model.json and the report, which
    are JSON); anything else unchanged, for ``validate`` to judge."""
    return value.item() if isinstance(value, np.generic) else value


def add_arguments(group, options_class, defaults: bool = True, skip=()) -> None:
    """One CLI flag per declared field; the parsed value lands under the field's name.
    ``defaults=False``: a flag not given leaves no attribute (``--algorithm auto`` must know
    which options the user set); ``skip``: field names already added."""
    for f, kind in fields(options_class):
        if f.name in skip:
            continue
        meta = f.metadata
        kwargs: dict[str, Any] = {"dest": f.name,
                                  "default": f.default if defaults else argparse.SUPPRESS,
                                  "help": meta.get("help", "")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if meta.get("choices") is not None:
                kwargs["choices"] = meta["choices"]
        group.add_argument(flag(f.name), **kwargs)


def describe(options_class) -> list[tuple[str, str, str]]:
    """(flag, default, help) for each field, for ``beam-dp algorithms``."""
    return [(flag(f.name), "derived" if f.default is None else str(f.default), f.metadata.get("help", ""))
            for f, _ in fields(options_class)]


# ------------------------------------------------------------------------- the shared problem

@dataclasses.dataclass
class Privacy:
    """The privacy budget and how n is known, shared by every algorithm."""

    epsilon: float | None = None          # target; the noise is calibrated to it
    delta: float = 1e-5
    noise_multiplier: float | None = None  # instead of epsilon: report the epsilon it buys
    accountant: str = "pld"
    num_examples: int | None = None       # public dataset size; otherwise a private count
    count_epsilon: float | None = None    # budget of that count
    # "secure": integer noise on exact integer sums (refused where it cannot be used); "float":
    # numpy's float noise on float sums; None (the default): secure where the algorithm has it
    # (Algorithm.secure_noise), float otherwise, and float where secure noise's slack would pass
    # 1e-3 delta (``noisy_gd.float_instead``, said in the report).
    noise: str | None = None

    def validate(self) -> None:
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of epsilon or noise_multiplier")
        for name in ("epsilon", "noise_multiplier", "count_epsilon"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number")
        if not 0 < self.delta < 1:
            raise ValueError("delta must be in (0, 1)")
        if self.noise not in (None, "secure", "float"):
            raise ValueError(f"noise must be 'secure' or 'float', got {self.noise!r}")
        if self.num_examples is not None and not (
                isinstance(self.num_examples, numbers.Integral) and self.num_examples >= 1):
            raise ValueError("num_examples must be a whole number, at least 1")
        if (self.num_examples is None and self.epsilon is not None
                and self.count_epsilon is not None and self.count_epsilon >= self.epsilon):
            raise ValueError("count_epsilon is a share of epsilon: it must be smaller than epsilon")
        if self.accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {', '.join(accounting.ACCOUNTANTS)}")


@dataclasses.dataclass
class Problem:
    """What every algorithm is given besides its own options."""

    loss: GlmLoss
    dim: int                      # number of feature columns
    privacy: Privacy
    fit_intercept: bool = True
    steps_per_chunk: int | None = None   # full-batch steps per Beam job (None: as many as fit)
    checkpoint_dir: str | None = None
    # Public description of the input (file paths, label and feature columns), so that a
    # checkpoint is resumed only by a run over the same input. Never data values or sizes.
    source: dict = dataclasses.field(default_factory=dict)
    # Whether the run's seed was fixed (--seed): part of a checkpoint's configuration, so that a
    # run resumed with a secure seed cannot report as secure what a fixed one drew.
    seed_fixed: bool = False
    # A previous released model's coefficients to start from (--warm-start): post-processing of
    # an earlier release, public; None: zeros.
    initial_theta: "np.ndarray | None" = None
    # Categorical columns encoded into CSR blocks (``beam_dp.categorical``): a public fact of the
    # request (the declared columns), never of the values.
    sparse: bool = False
    # User-level privacy (``beam_dp.user_level.UserBounding``: the unit's column and the rows
    # kept per user); the aggregator's blocks are then grouped by user. None: a row is the unit.
    privacy_unit: "object | None" = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    use_when: str                 # one line, for a user choosing an algorithm
    models: tuple                 # the losses it supports (losses.MODEL_NAMES)
    options: type                 # the declared options dataclass
    train: Callable               # (options, problem, aggregator, seed, ledger, progress) -> TrainResult
    relation: str = accounting.ADD_REMOVE
    checkpoints: bool = True      # supports --checkpoint-dir (resuming between chunks)
    why_no_checkpoints: str = "it makes one pass"   # said when --checkpoint-dir is refused
    warm_start: bool = False      # supports --warm-start (starts from a released model)
    no_intercept: bool = True     # can fit a model without an intercept
    secure_noise: bool = False    # every release: integer noise on exact sums (--noise secure)
    sparse_input: bool = False    # takes CSR blocks (categorical columns), never densifying them
    # (privacy) -> None: refuses a privacy request the algorithm cannot serve (e.g. a mechanism
    # proven only for float noise under replace-one), before any data is read; None: any.
    check_privacy: Callable | None = None
    user_level: bool = False      # supports --privacy-unit-column (add/remove one user)
    # Calibrates its noise against the releases already in the ledger (whatever its relation),
    # so the private quality check (``beam_dp.quality``) can reserve its budget there before
    # training (every registered one does). Otherwise the check is skipped, with
    # ``why_no_quality_check`` in the report: a new algorithm opts in once it does.
    quality_check: bool = False
    why_no_quality_check: str = (
        "its noise is calibrated to the whole budget by itself, not against "
        "releases already in the ledger: a check there would spend more than the target epsilon")

    def check(self, problem: Problem) -> None:
        """Refuses a problem this algorithm cannot solve, with a message naming the choice."""
        if problem.loss.name not in self.models:
            raise ValueError(f"{self.name} does not fit --model {problem.loss.name}; "
                             f"it supports: {', '.join(self.models)}")
        if problem.checkpoint_dir and not self.checkpoints:
            raise ValueError(f"{self.name} does not support --checkpoint-dir "
                             f"({self.why_no_checkpoints})")
        if not problem.fit_intercept and not self.no_intercept:
            raise ValueError(f"{self.name} always fits an intercept; drop --no-intercept")
        if problem.sparse and not self.sparse_input:
            takers = ", ".join(a.name for a in algorithms().values() if a.sparse_input)
            raise ValueError(f"{self.name} needs dense features; with --categorical-columns use "
                             f"one of: {takers}")
        if problem.sparse and problem.privacy.noise == "secure":
            raise ValueError("secure noise needs dense features (its exact sums quantize dense "
                             "rows); with --categorical-columns use --noise float (the default "
                             "then)")
        if problem.privacy_unit is not None:
            self.check_user_level()
            if self.relation != accounting.ADD_REMOVE:
                raise ValueError("--privacy-unit-column is an add/remove relation (one user)")
            if problem.sparse:
                raise ValueError("--privacy-unit-column needs dense features (no "
                                 "--categorical-columns yet)")
        if problem.privacy.noise == "secure" and not self.secure_noise:
            raise ValueError(f"{self.name} has no secure noise yet (its releases add numpy's float "
                             "noise); use --noise float")

    def check_user_level(self) -> None:
        """Refuses --privacy-unit-column where the algorithm has no user-level bounding."""
        if not self.user_level:
            takers = ", ".join(a.name for a in algorithms().values() if a.user_level)
            raise ValueError(f"{self.name} has no user-level privacy yet; with "
                             f"--privacy-unit-column use: {takers}")

    def check_request(self, loss: GlmLoss, privacy: Privacy, options) -> None:
        """Refuses a request this algorithm cannot serve that is known before any data is read
        (called by ``beam_dp.train`` and the audit before the input is opened; ``check`` follows
        once the problem is known): a model it does not fit, and ``check_privacy``'s refusals.
        An algorithm may override it (e.g. a mechanism proven only for epsilon <= 1)."""
        if loss.name not in self.models:
            raise ValueError(f"{self.name} does not fit --model {loss.name}; it supports: "
                             f"{', '.join(self.models)}")
        if self.check_privacy is not None:
            self.check_privacy(privacy)


# ------------------------------------------------------------ options that act only sometimes

@dataclasses.dataclass(frozen=True)
class Request:
    """What a run request says before any data is read, for ``refuse_ignored``: the model, the
    privacy request, the algorithm's options (None: a run with no algorithm options to check),
    ``given`` (``beam_dp.train``'s own keywords, None where not given) and the declared input."""

    model: str
    privacy: Privacy
    options: object = None
    given: dict = dataclasses.field(default_factory=dict)
    categorical_columns: tuple = ()
    hash_buckets: int | None = None
    imputed: bool = False        # a column's missing-value policy is median or mean
    warm_start: bool = False
    user_level: bool = False     # --privacy-unit-column

    def value(self, name: str):
        """The option's value as given (None: not given, or not an option of this run)."""
        if name in self.given:
            return self.given[name]
        return getattr(self.options, name, None)


def _scale_releases(r: Request) -> bool:
    """Whether the column scaling may release anything with --scale-epsilon's budget
    (``noisy_gd._column_scaling``): private ranges (private, or auto but for the maps that turn
    auto off) or median/mean fills."""
    choice = r.value("scale_features")
    return r.imputed or choice == "private" or (
        choice == "auto" and not r.value("feature_norm") and not r.warm_start and not r.user_level)


def _preconditions(r: Request) -> bool:
    from beam_dp.algorithms import noisy_gd   # (it imports this module)
    return noisy_gd.preconditions(r.value("precondition"), bool(r.categorical_columns),
                                  r.privacy.epsilon)


@dataclasses.dataclass(frozen=True)
class ActsOnlyWhen:
    """Option ``name`` (a keyword of ``beam_dp.train``; its flag ``flag(name)``) has an effect
    only where ``acts(request)``; given elsewhere, it is refused with ``why``."""

    name: str
    acts: Callable[[Request], bool]
    why: str


# Options a run would otherwise accept and silently drop: a user who passes one believes it
# acted, so it is refused, not dropped. Every option here defaults to None ("not given"), so a
# value equal to the default is refused too. An option missing from a run's algorithm is its
# options dataclass's business (make_options refuses an unknown name).
ACTS_ONLY_WHEN: tuple[ActsOnlyWhen, ...] = (
    ActsOnlyWhen("huber_delta", lambda r: r.model == "huber",
                 "it is the threshold of --model huber's loss, and the model is another"),
    ActsOnlyWhen("num_classes", lambda r: r.model == "softmax",
                 "only --model softmax has a class count (the other models have one output)"),
    ActsOnlyWhen("hash_seed", lambda r: bool(r.categorical_columns) and r.hash_buckets is not None,
                 "it seeds the hash of --categorical-columns with --hash-buckets, and no column "
                 "is hashed"),
    ActsOnlyWhen("count_epsilon", lambda r: r.privacy.num_examples is None,
                 "with --num-examples n is public and no count is released"),
    ActsOnlyWhen("scale_epsilon", _scale_releases,
                 "it is the budget of the private column ranges (--scale-features private or "
                 "auto) and of median/mean fills, and none is released (--scale-features none, or "
                 "auto with --feature-norm, --warm-start or --privacy-unit-column, which turn "
                 "it off)"),
    ActsOnlyWhen("precondition_epsilon", _preconditions,
                 "it is the budget of --precondition counts' column counts, released only with "
                 "--categorical-columns and --precondition counts (or auto with --epsilon)"),
    ActsOnlyWhen("adaptive_clip_rate", lambda r: r.value("adaptive_clip_quantile") is not None,
                 "it is adaptive clipping's update rate, and adaptive clipping is off without "
                 "--adaptive-clip-quantile"),
)


def refuse_ignored(request: Request) -> None:
    """Refuses (ValueError naming the flag and why) an option given where it has no effect
    (``ACTS_ONLY_WHEN``): called by ``beam_dp.train``, the audit and ``beam_dp.tune`` before any
    data is read."""
    for row in ACTS_ONLY_WHEN:
        if request.value(row.name) is not None and not row.acts(request):
            raise ValueError(f"{flag(row.name)} has no effect here: {row.why}; drop it")


def check_replace_one_float_request(name: str, privacy: Privacy, noise: str, proof: str) -> None:
    """The refusals shared by the replace-one algorithms whose releases are float noise with an
    (epsilon, delta) guarantee (paper 004's): secure noise (not built for them), a count budget
    (n is public under replace-one) and the RDP accountant (an (epsilon, delta) release with delta
    > 0 bounds no Renyi divergence). ``proof`` names the result giving the (epsilon, delta)."""
    if privacy.noise == "secure":
        raise ValueError(f"{name} has no secure noise (its {noise} draws are float); use "
                         "--noise float")
    if privacy.count_epsilon is not None:
        raise ValueError(f"{name} spends no budget on a count: n is public under its replace-one "
                         "relation (--num-examples, or the row count); drop --count-epsilon")
    if privacy.accountant != "pld":
        raise ValueError(f"{name}'s release is an (epsilon, delta) guarantee ({proof}), which the "
                         "RDP accountant cannot account; use --accountant pld")


def algorithms() -> dict[str, Algorithm]:
    """Every registered algorithm by name, in the order `beam-dp algorithms` lists them.
    (Imported here, not at the top, because the algorithm modules import this one.)"""
    from beam_dp.algorithms import (bias_reduced, dp_ambssgd, dpsgd_f, heavy_tailed_md,
                                    mirror_descent, noisy_gd, objective_perturbation, ssp)
    registered = (
        noisy_gd.DPGD,
        noisy_gd.DPSGD,
        ssp.SSP,
        dp_ambssgd.DP_AMBSSGD,
        dpsgd_f.DPSGD_F,
        mirror_descent.MIRROR_DESCENT,
        heavy_tailed_md.HEAVY_TAILED_MD,
        objective_perturbation.OBJECTIVE_PERTURBATION,
        bias_reduced.BIAS_REDUCED_SGD,
        __import__("beam_dp.algorithms.output_perturbation", fromlist=["_"]).OUTPUT_PERTURBATION,
    )
    return {a.name: a for a in registered}


def get(name: str) -> Algorithm:
    registered = algorithms()
    if name not in registered:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(registered)}")
    return registered[name]
