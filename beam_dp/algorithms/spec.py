"""What an algorithm declares, and what it is given and returns: the contract between an
optimizer module and everything that runs it (``registry`` lists the modules that fulfil it).

An algorithm is one module that builds an ``Algorithm``: its name, one line on when to use it,
the models it supports, the neighbouring relation its guarantee is for, an options dataclass
and a ``train`` function. The options dataclass declares each field with ``option(...)`` (type,
default, help, valid range), and everything else is generated from it: the CLI flags of
``beam-dp train --algorithm X`` (``add_arguments``), the keyword arguments of ``beam_dp.train``
and of the scikit-learn estimators (``make_options``), and the validation (``validate``).
The ``beam_dp.cli`` package, ``api.py`` and the estimators loop over ``registry.algorithms()``;
none branches on a name.

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
    # 1e-3 delta (``secure_noise.float_instead``, said in the report).
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
    # The private quality check, to run in the last training job where the algorithm can
    # (``base.FinalStage``; set by ``beam_dp.api``): ``final_check(feature_transform spec,
    # label range or None) -> (stage, to_state)``, the stage over rows and the map from the
    # model's coefficients to its state. None: no check, or the caller runs it in its own job.
    final_check: "Callable | None" = None


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
    # takes them under --privacy-unit-column only (dpsgd: its user-level steps are full-batch
    # stages over the grouped blocks; its row-level batch files hold dense rows)
    sparse_user_level: bool = False
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

    def check_request(self, loss: GlmLoss, privacy: Privacy, options) -> None:
        """Refuses a request this algorithm cannot serve that is known before any data is read
        (called by ``beam_dp.train`` and the audit before the input is opened;
        ``registry.check`` follows once the problem is known): a model it does not fit, and
        ``check_privacy``'s refusals. An algorithm may override it (e.g. a mechanism proven only
        for epsilon <= 1)."""
        if loss.name not in self.models:
            raise ValueError(f"{self.name} does not fit --model {loss.name}; it supports: "
                             f"{', '.join(self.models)}")
        if self.check_privacy is not None:
            self.check_privacy(privacy)


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


# ------------------------------------------------------------------------ what train returns

@dataclasses.dataclass
class TrainResult:
    """What every algorithm's ``train`` returns: the coefficients, the ledger of its releases and
    the public facts the report and model.json record."""

    theta: np.ndarray
    ledger: accounting.Ledger
    noise_multiplier: float
    sampling_probability: float
    steps: int
    clip_norm: float | None     # None where it is chosen privately per step (dp-ambssgd)
    dataset_size: dict          # how n was obtained, and the (public or noisy) value used
    preprocessing: dict         # public releases made before training (empty for dpsgd/dpgd)
    sampling: str = ""          # how examples were chosen per step, for the report
    expected_batch_size: float | None = None   # the public normalizer of a step's noisy sum
    # The per-example map the model expects of raw features, as training applied it (recorded
    # in model.json and applied again by predict), e.g. {"normalize_rows": 1.0}; None: identity.
    feature_transform: dict | None = None
    # Where the report puts ``preprocessing``: "preprocessing" (private releases before
    # training) or "algorithm_parameters" (a one-pass algorithm's public plan).
    details_name: str = "preprocessing"
    # The public constraint set the coefficients lie in (``geometry.Constraint.to_json``),
    # recorded in model.json; None: unconstrained.
    constraint: dict | None = None
    # User-level privacy: the unit's column name and the contribution bounds (public), for the
    # report; None: a row is the unit.
    privacy_unit: dict | None = None
    # The release of the problem's ``final_check`` where it ran in the last training job
    # (``base.FinalStage``); None: it did not (the caller runs the check itself).
    final_release: object = None
