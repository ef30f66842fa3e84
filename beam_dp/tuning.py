"""Private hyperparameter selection: ``beam-dp tune`` and ``beam_dp.tune(...)``: the grid and its
setting law, the held-out split, the scores and the driver here; the public plan (the law of the
number of candidates and the noise calibration) in ``beam_dp.tuning_plan``.

Papernot & Steinke (ICLR 2022, "Hyperparameter tuning with Renyi differential privacy"): run a
*random* number K of candidates, each a setting drawn from one fixed public law over a small
public grid, trained and then scored on private rows with Gaussian noise, and release only the
best candidate's output (its model, its setting and its noisy score). K follows a truncated
negative binomial law of mean ``mean_candidates`` and shape ``shape`` (0: logarithmic, the
default, mean 3; 1: geometric), dp_accounting's ``RepeatAndSelectDpEvent(candidate, mean,
shape)``, which only its RDP accountant handles: the whole run is accounted by RDP.

The setting law (``setting_law``): train's own setting (each grid key at dpgd's default; the
logistic model's step 3x train's, as its candidates run 100 steps where train runs up to 300:
``center_step``) with probability ``default_share`` (default 1/2), else uniform over the grid.
Every candidate draws afresh from it, so the K candidates are i.i.d. runs of one randomized algorithm, which is what
the theorem needs (a first candidate fixed to the default would break it).

One candidate's releases:

* training (dpgd only): T full-batch Gaussian steps with multiplier sigma_train * sqrt(T) compose
  to one Gaussian mechanism of multiplier sigma_train (``accounting.self_composed``) whatever T
  the setting asks for, so every setting of the grid has the same privacy cost and one event
  stands for all of them (the theorem needs one RDP curve for every run);
* its score: the sum over the scored rows of a per-row score in [0, 1] (1 - clipped loss /
  bound, or accuracy) plus Gaussian noise of std sigma_score: a Gaussian mechanism of
  sensitivity 1 under add/remove given the candidate's model (adaptive composition: the score
  is computed after the model is released, so one row moves the sum by at most 1 whether or not
  it also trained). The scored rows are by default the training rows themselves
  (``holdout`` 0): the two releases are composed below anyway, so scoring on the rows that
  trained costs no privacy and leaves every row to training. A DP model's gap between training
  and test rows is small (the noise, not overfitting, limits it), so the training rows rank
  settings as held-out ones would; ``holdout`` > 0 or ``validation`` files score on rows that
  never trained instead.

A candidate's event is ComposedDpEvent([Gaussian(sigma_train), Gaussian(sigma_score)]), i.e.
one Gaussian with 1 / sigma^2 = 1 / sigma_train^2 + 1 / sigma_score^2; ``score_share`` of that
1 / sigma^2 goes to the score. (With a held-out part, a held-out row is never in training and
vice versa, so parallel composition would allow less; composing both is the safe side, covers
``--validation`` files, which are private rows too, and is what makes holdout 0 free.) Before
the candidates, the number of training rows is released once with Laplace noise (with a
held-out part, the pair of sizes, one mechanism: a row is in one part only, so the pair has
sensitivity 1 under add/remove); it sets dpgd's normalizer and the scores' denominator, both
post-processing. The run's event:

    ComposedDpEvent([Laplace(1 / count_epsilon), RepeatAndSelect(candidate, mean, shape)])

With ``scale_features`` "private" or "auto" (dpgd's private column scaling), the columns'
quantiles are released once, before the candidates, from the training rows (pure epsilon
``scale_epsilon``, default a tenth of epsilon, composed outside the selection like the counts),
and every candidate trains on the same scaled columns: the map is recorded in the chosen
model.json as ``beam-dp train`` records it. Where they release nothing (decided from public
values and the released count), the plan is calibrated again without their share before the
first candidate's noise (``_Splitter.replan``): every candidate runs with it, and the run spends
the epsilon asked for.

After the selection, train's private quality check (``beam_dp.quality``) runs once on the
chosen model over the training rows (``_check_chosen``; ``quality_check`` "off" skips it): one
more Gaussian release composed outside the selection like the count and the ranges, its
multiplier fixed from public constants by ``quality.reserve`` (its share of epsilon,
``quality_epsilon``, default a twentieth, calibrated alone) and recorded in the ledger before
anything else, so the run's event gains a ``GaussianDpEvent(quality_multiplier)`` beside the
count. Its verdict acts as in train: "worse" warns (QualityWarning, the report's warnings),
"inconclusive" is recorded only, "much worse" raises ModelQualityError and nothing is returned.

sigma is calibrated (dp_accounting's RDP accountant) so that this event meets the requested
(epsilon, delta); the ledger's epsilon of it is the reported one.

What is released, and what is not: the chosen model, its setting and its noisy score (and the
public plan: grid, setting law, law of K). Not K, not the other candidates' scores or settings,
not how many candidates ran: the theorem's bound
is for the best run alone, with K secret (knowing K = k turns it into the best of k runs, whose
cost can approach k-fold composition). So nothing is printed per candidate, and the run's
duration, which grows with K, is a side channel for whoever watches the job (as in any
implementation of the method).

The held-out rows (``holdout`` > 0): a keyed hash of each row's position (file, row) puts it in
the held-out part with probability ``holdout``; the key comes from the run's seed. It is
data-independent, so which rows are held out says nothing about their values. With ``validation`` files, those are
the held-out rows and all input rows train.

Neighbouring relation: add/remove one row of the training input (or of the validation files).
Randomness: every draw (K, the settings, the split's key, the counts' and scores' noise, each
candidate's training seed) derives from one root seed: ``seed``, or 128 bits of the OS's secure
randomness. Runs in-process (``runner="local"``): tuning trains K models over the same rows.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from typing import Callable, Sequence

import numpy as np
from dp_accounting import dp_event as events
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from beam_dp import accounting, data, features, losses, mechanisms, report
from beam_dp.algorithms import ignored_options, registry, spec
from beam_dp.block import Block
from beam_dp.tuning_plan import (DEFAULT_MEAN_CANDIDATES, DEFAULT_SCORE_SHARE, DEFAULT_SHAPE,
                                 NO_SCORE_BOUND, Plan, draw_candidates, label_score_bound, plan)

# Stream ids under the root seed (``mechanisms.secure_generator``): "tune" and a sub-stream.
_STREAM = 0x74756E65
_K, _SETTINGS, _SPLIT, _COUNT, _SCORE, _TRAIN, _SCALE, _QUALITY = range(8)

# The algorithms tuning supports, and for each the options a grid may vary: those that change
# neither the privacy cost nor the releases (the candidate's ledger is checked anyway).
TUNABLE = {"dpgd": ("clip_norm", "learning_rate", "steps", "max_steps", "feature_norm",
                    "average_iterates")}
# The default grid per algorithm: dpgd's default clip norm and step with a factor 2 either way in
# the clip norm and 3 either way in the step, 3 x 3 = 9 settings, dpgd's default steps. The step
# sizes are multiples of the model's default step (1, or 1/4 for the squared and Huber losses:
# ``noisy_gd``), so train's setting is always a candidate. Why this narrow: with few candidates
# (below) a lone candidate is released often, so every setting must be a reasonable one. The
# earlier grid (clip 0.3/1/3, steps 0.01/0.1/1 x the default) held settings that leave the model
# near zero (0.01 x the step for 100 steps): measured over 10 seeds at epsilon 1
# (bench_raw_tables' three tables, holdout 0, mean 3, logarithmic, default share 1/2), ISLR
# Default AUC 0.937 -> 0.943, AER CreditCard accuracy 0.939 -> 0.959, MASS Boston (declared
# ranges) RMSE 6.94 -> 6.46 with the narrow grid. (A raw table whose columns need a far smaller
# step, as MASS Boston without ranges, gains less from tuning now: give a --grid.)
DEFAULT_GRIDS = {"dpgd": {"clip_norm": (0.5, 1.0, 2.0), "learning_rate": (1 / 3, 1.0, 3.0)}}
RELATIVE_TO_DEFAULT_STEP = {"dpgd": ("learning_rate",)}
# The step the grid's relative steps multiply, per model, as a multiple of the model's default
# step, when tune sets the candidates' number of steps itself (100, ``_train_candidate``, against
# train's up to 300 on small tables): the logistic path (step x steps) then stays train's.
# Measured at epsilon 1 as tune's mean minus train's over the same seeds (bench_raw_tables'
# splits and schemas; 30 seeds CreditCard, 20 Default; se of the paired differences): the grid
# centered on 1x the step, CreditCard accuracy -0.0064 (se 0.0024), Default AUC -0.0027 (se
# 0.0011); on 3x, -0.0020 (se 0.0027) and -0.0004 (se 0.0003). Not for the squared loss: at a
# candidate's noise the shorter path regularizes (MASS Boston with ranges, 30 seeds: RMSE +0.62
# over train's at 1x, +1.91 at 3x).
CANDIDATE_STEP_FACTOR = {"logistic": 3.0}
MAX_SETTINGS = 10_000
# Scored on the training rows themselves: the plan composes every candidate's training and its
# score (no parallel composition), so a held-out part buys no privacy, and it costs a fifth of
# the rows (measured, 10 seeds, narrow grid: holdout 0.2 gave CreditCard 0.952 and Boston 6.77
# against 0.959 and 6.46 at 0; Default 0.946 against 0.943, within its seeds' noise). A DP model's train/test gap is small (the noise is what limits it), so the
# score on its training rows ranks settings as held-out rows would. --holdout / --validation
# remain for whoever wants the score on rows that never trained.
DEFAULT_HOLDOUT = 0.0
DEFAULT_SETTING_SHARE = 0.5    # P[a candidate takes train's setting] beyond uniform: setting_law
CLASSIFIER_SCORE_BOUND = 2.0   # log loss / hinge loss clipped here (ln 2 = the zero model's)
SCORES = ("loss", "accuracy")


# --------------------------------------------------------------------------------- the grid

def parse_grid(items: Sequence[str] | None) -> dict:
    """``["clip_norm=0.1,1", "steps=30,100"]`` (CLI spelling with dashes too) -> {name: values}.
    Values are numbers, or true/false; checked by ``check_grid``."""
    grid: dict = {}
    for item in items or ():
        key, sep, text = str(item).partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key or not text.strip():
            raise ValueError(f"--grid takes KEY=V1,V2,..., got {item!r}")
        if key in grid:
            raise ValueError(f"--grid names {key} twice")
        grid[key] = tuple(_value(v.strip(), key) for v in text.split(","))
    return grid


def _value(text: str, key: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"--grid {key}: values must be numbers or true/false") from None
    return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() \
        else number


def check_grid(grid: dict, algorithm: str, options: dict) -> list[dict]:
    """Every setting of ``grid`` (a product over its keys, in a fixed order) merged over the fixed
    ``options``; refuses an algorithm without tuning, an unknown or budget-spending key, an empty
    or repeated value list, a value the option refuses, and a grid of more than MAX_SETTINGS."""
    if algorithm not in TUNABLE:
        raise ValueError(f"tuning supports --algorithm {', '.join(TUNABLE)} (each candidate must "
                         f"cost the same privacy whatever its setting); got {algorithm}")
    chosen = registry.get(algorithm)
    if not grid:
        raise ValueError("the grid is empty: give --grid KEY=V1,V2,... (or none for the default)")
    settings = [{}]
    for key, values in grid.items():
        if key not in TUNABLE[algorithm]:
            raise ValueError(f"--grid {key}: not a tunable option of {algorithm}; tunable: "
                             f"{', '.join(TUNABLE[algorithm])}")
        if key in options and options[key] is not None:
            raise ValueError(f"{key} is both fixed and in the grid")
        values = tuple(values) if isinstance(values, (list, tuple)) else (values,)
        if not values:
            raise ValueError(f"--grid {key}: no values")
        if len(set(values)) != len(values):
            raise ValueError(f"--grid {key}: a value is repeated")
        for v in values:
            spec.make_options(chosen.options, {**options, key: v})   # the option's own check
        settings = [{**s, key: v} for s in settings for v in values]
        if len(settings) > MAX_SETTINGS:
            raise ValueError(f"the grid has more than {MAX_SETTINGS} settings")
    return settings


def default_setting(algorithm: str, model: str, options: dict, grid: dict,
                    step: float | None = None) -> dict | None:
    """The grid's setting that is what ``beam-dp train`` would run with the same fixed
    ``options``: each grid key at the algorithm's default (dpgd's learning rate: ``step``, else
    the model's default step; tune passes ``center_step``'s). None when the grid does not hold it
    (e.g. a grid over ``steps``, whose default depends on n)."""
    defaults = spec.make_options(registry.get(algorithm).options, options)
    setting = {}
    for key, values in grid.items():
        value = getattr(defaults, key)
        if key == "learning_rate" and value is None:
            from beam_dp.algorithms import noisy_gd
            value = noisy_gd.default_learning_rate(model) if step is None else step
        matches = [v for v in values if (v == value if isinstance(v, bool) or value is None
                                         or isinstance(value, bool)
                                         else math.isclose(v, value, rel_tol=1e-12))]
        if not matches:
            return None
        setting[key] = matches[0]
    return setting


def center_step(model: str, options: dict, grid: dict) -> float:
    """The step the default grid's relative steps multiply and the setting law's default step:
    the model's default step (train's), times ``CANDIDATE_STEP_FACTOR[model]`` unless the fixed
    ``options`` or the ``grid`` set the number of steps (then the candidates run what is asked,
    not tune's 100)."""
    from beam_dp.algorithms import noisy_gd
    step = noisy_gd.default_learning_rate(model)
    if any(options.get(k) is not None or k in grid for k in ("steps", "max_steps")):
        return step
    return step * CANDIDATE_STEP_FACTOR.get(model, 1.0)


def setting_law(settings: list[dict], default: dict | None, share: float) -> np.ndarray:
    """The public law each candidate draws its setting from: ``default`` (train's setting) with
    probability ``share``, else uniform over the grid (the default included), so
    P[default] = share + (1 - share) / len(settings). Uniform when the grid lacks the default.

    Why: a private run of train's defaults is already good on most tables, and every candidate
    here trains with ~1.5x its noise; weighting train's setting makes the best of K likely to
    include it (at mean 3, P[some candidate is the default] ~ 0.8 against ~0.3 uniform over 9)
    while the other settings can still win where the defaults are off. Each candidate draws its
    setting afresh from this one fixed law, so the K runs are i.i.d. runs of one randomized
    algorithm, as Papernot & Steinke's theorem needs (a fixed first candidate would not be)."""
    law = np.full(len(settings), (1.0 - share) / len(settings) if default in settings else
                  1.0 / len(settings))
    if default in settings:
        law[settings.index(default)] += share
    return law


def draw_setting(generator: np.random.Generator, law: np.ndarray) -> int:
    """An index drawn from ``setting_law``'s probabilities."""
    return int(generator.choice(len(law), p=law))


# ------------------------------------------------------------------------------ the split

def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic): a fast, well-mixed keyed hash."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def holdout_mask(block: Block, key: int, fraction: float) -> np.ndarray:
    """Which rows of ``block`` are held out: a keyed hash of (source, row position) below
    ``fraction``. Data-independent; the same rows on every read of the same files."""
    source = int.from_bytes(hashlib.blake2b(str(block.source).encode(), digest_size=8,
                                            key=key.to_bytes(16, "little")).digest(), "little")
    rows = np.arange(block.row_start, block.row_start + len(block), dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(rows ^ np.uint64(source)))
    return (h >> np.uint64(11)).astype(np.float64) / 2.0 ** 53 < fraction


def _take(block: Block, rows: np.ndarray) -> Block:
    return dataclasses.replace(block, features=block.features[rows], labels=block.labels[rows],
                               sq_norms=block.sq_norms[rows],
                               dropped=None if block.dropped is None else block.dropped[rows])


def split_blocks(blocks, key: int, fraction: float) -> tuple[list, list]:
    """(training blocks, held-out blocks)."""
    train, held = [], []
    for b in blocks:
        mask = holdout_mask(b, key, fraction)
        if (~mask).any():
            train.append(_take(b, np.flatnonzero(~mask)))
        if mask.any():
            held.append(_take(b, np.flatnonzero(mask)))
    return train, held


# ------------------------------------------------------------------------------ the score

def row_scores(loss: losses.GlmLoss, s: np.ndarray, labels: np.ndarray, kind: str,
               bound: float | None) -> np.ndarray:
    """Per-row scores in [0, 1] (higher is better) of scores ``s`` (m, k) against encoded
    labels: ``accuracy`` (classifiers), or ``loss``: 1 - min(loss, bound) / bound for
    classifiers, 1 - min(|residual|, bound) / bound for regression (bound in label units)."""
    if kind == "accuracy":
        truth = (labels > 0).astype(np.int64) if loss.name in ("logistic", "hinge") else labels
        return (loss.predict(s) == truth).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        value = (np.abs(s[:, 0] - labels) if not loss.is_classifier else loss.value(s, labels))
    value = np.where(np.isnan(value), np.inf, value)
    return 1.0 - np.minimum(value, bound) / bound


def score_bound(loss: losses.GlmLoss, kind: str, bound: float | None) -> float | None:
    if kind not in SCORES:
        raise ValueError(f"the score must be one of {', '.join(SCORES)}")
    if kind == "accuracy":
        if not loss.is_classifier:
            raise ValueError("--score accuracy is for classifiers; a regression uses --score loss "
                             "with --score-bound")
        return None
    if bound is None:
        # a regression's: from its label's range (``label_score_bound``), once it is known
        return CLASSIFIER_SCORE_BOUND if loss.is_classifier else None
    if not (bound > 0 and math.isfinite(bound)):
        raise ValueError("--score-bound must be a positive number")
    return float(bound)


# ------------------------------------------------------------------------------ the driver

@dataclasses.dataclass
class _Data:
    """Filled by the first candidate's read of the input (``_Splitter``)."""

    held: list | None = None
    train: list | None = None          # the training rows (the quality check reads them)
    train_size: float | None = None    # noisy, released
    held_size: float | None = None
    bounds: dict | None = None         # the declared and released ranges (None: none)
    scaling: dict | None = None        # its release, for the report


class _Splitter:
    """The hook ``api.train`` calls with each candidate's problem and aggregator: keeps the
    training rows only, and gives the run its released size as a public n."""

    def __init__(self, key, fraction, validation_blocks, plan_, seed, ledger, state: _Data,
                 scale_features: str = "none"):
        self.key, self.fraction, self.validation = key, fraction, validation_blocks
        self.plan, self.seed, self.ledger, self.state = plan_, seed, ledger, state
        self.scale_features = scale_features
        self.announce = lambda: None   # the run's opening message, said on the first read
        # () -> the plan without the ranges' share, for when they release nothing (tune's)
        self.replan = None

    def __call__(self, problem, aggregator):
        from beam_dp import column_scaling
        from beam_dp.local import LocalAggregator
        if column_scaling.imputed_columns(problem):
            # Each candidate would release its own fills: they are not shared across the
            # candidates (as the ranges are) yet.
            raise ValueError("beam-dp tune does not take median/mean imputation yet; use "
                             "beam-dp train, or constant:V or indicator")
        blocks = list(aggregator.blocks)
        if self.validation is not None or self.fraction == 0:
            train, held = blocks, None
        else:
            train, held = split_blocks(blocks, self.key, self.fraction)
        if not train:
            raise data.DataError("tuning: no rows left to train on")
        if self.state.train_size is None:
            self.announce()   # (only now: the input's problem passed the checks above)
            self.state.train = train
            if self.validation is None and self.fraction == 0:
                # Scored on the training rows themselves: one count, the same rows.
                self._release_sizes(sum(len(b) for b in train), None)
                self.state.held = train
            else:
                held = held if held is not None else self.validation(problem)
                self._release_sizes(sum(len(b) for b in train), sum(len(b) for b in held))
                self.state.held = held
            ratio = 1.0
            if self.scale_features != "none":
                released = self.ledger.event()
                self._release_scaling(problem, train)
                if (self.ledger.event() == released and self.plan.scale_epsilon
                        and self.replan is not None):
                    # Nothing released (decided from public values and the released count):
                    # this first candidate, whose multiplier came from the old plan, and the
                    # others run with the plan calibrated without the ranges' share.
                    old, self.plan = self.plan, self.replan()
                    ratio = self.plan.sigma_train / old.sigma_train
            problem = dataclasses.replace(problem, privacy=dataclasses.replace(
                problem.privacy, noise_multiplier=problem.privacy.noise_multiplier * ratio))
        n = max(1, int(round(self.state.train_size)))
        privacy = dataclasses.replace(problem.privacy, num_examples=n)
        if self.state.bounds is not None:
            # The released ranges join the declared ones: each candidate scales its columns (and
            # a regression's label, mapping its coefficients back) as train does, at no cost.
            problem = dataclasses.replace(problem, source={**problem.source,
                                                           "bounds": self.state.bounds})
        return dataclasses.replace(problem, privacy=privacy), LocalAggregator(train)

    def _release_scaling(self, problem, train) -> None:
        """dpgd's private column scaling (``column_scaling.prepare``), once, on the training
        rows, recorded in the tuning's ledger."""
        from beam_dp import column_scaling
        from beam_dp.algorithms import noisy_gd
        from beam_dp.local import LocalAggregator
        options = noisy_gd.DpgdOptions(scale_features=self.scale_features,
                                       scale_epsilon=self.plan.scale_epsilon)
        preprocess, make_transform = column_scaling.prepare(
            options, problem, LocalAggregator(train),
            mechanisms.stream_key(self.seed, _STREAM, _SCALE) % (1 << 128), self.ledger)
        if preprocess is None:   # nothing to scale (no numeric column, a feature norm)
            return
        self.state.scaling = preprocess(max(1, int(round(self.state.train_size))))
        # The map train would apply (its auto rule, reach and label included), as bounds.
        transform = make_transform(self.state.scaling)
        if transform is not None:
            self.state.bounds = features.ranges_as_bounds(features.spec(transform)["scale_columns"])

    def _release_sizes(self, train_rows: int, held_rows: int | None) -> None:
        """The pair of counts (a row is in one part only: sensitivity 1), or with ``held_rows``
        None (holdout 0: the scores read the training rows) the one count, used for both."""
        scale = 1.0 / self.plan.count_epsilon
        self.ledger.record("laplace_counts_of_training_and_held_out_rows"
                           if held_rows is not None else "laplace_count_of_training_rows",
                           self.plan.count_event(), laplace_scale=scale)
        generator = mechanisms.secure_generator(self.seed, _STREAM, _COUNT)
        floor = math.log(20.0) * scale   # the count's 95% error bound, as train's normalizer floor
        self.state.train_size = max(train_rows + mechanisms.laplace_noise(generator, scale), floor, 1.0)
        self.state.held_size = self.state.train_size if held_rows is None else \
            max(held_rows + mechanisms.laplace_noise(generator, scale), floor, 1.0)


def _rdp(event: events.DpEvent) -> np.ndarray:
    acc = rdp_lib.RdpAccountant()
    acc.compose(event)
    return acc._rdp


def tune(X=None, y=None, *, input=None, validation=None, algorithm: str = "dpgd",
         model: str = "logistic", epsilon: float, delta: float = 1e-5,
         grid: dict | Sequence[str] | None = None, mean_candidates: float = DEFAULT_MEAN_CANDIDATES,
         shape: float = DEFAULT_SHAPE, holdout: float = DEFAULT_HOLDOUT,
         default_share: float = DEFAULT_SETTING_SHARE, score: str = "loss", score_bound_: float | None = None,
         score_share: float = DEFAULT_SCORE_SHARE, count_epsilon: float | None = None,
         seed: int | None = None, noise: str | None = None,
         progress: Callable[[str], None] | None = None, quality_check: str = "on",
         quality_epsilon: float | None = None, quality_label_bound: float | None = None,
         **fixed):
    """Private selection of one setting of ``grid`` (see the module docstring); returns the
    chosen ``api.Model`` whose ``privacy_report`` accounts for the whole tuning (RDP) and whose
    ``tuning`` holds the grid, the chosen setting and its noisy score. ``X, y`` or ``input``
    (files, read in-process) as ``beam_dp.train`` takes them; ``holdout``: 0 (default) scores
    the candidates on their training rows, a share in (0, 1) on that share of the input held
    out; ``validation``: files of held-out rows (private too) instead. ``default_share``: the
    probability a candidate takes train's setting (``setting_law``). ``grid``: {option: values}
    or ["option=v1,v2", ...]; None: ``DEFAULT_GRIDS[algorithm]``. ``score_bound_`` (the CLI's
    --score-bound): see ``row_scores``. ``fixed``: ``beam_dp.train``'s other keywords and the
    algorithm's fixed options; ``budget_gate`` among them as train takes it (the budget across
    runs), which admits the whole plan before any data is read. ``progress(message)``: run-level
    messages only (nothing per candidate: K is secret). ``quality_check`` / ``quality_epsilon`` / ``quality_label_bound``:
    train's private quality check (``beam_dp.quality``), run once on the chosen model over the
    training rows (``_check_chosen``)."""
    from beam_dp import api, quality

    budget_gate = fixed.pop("budget_gate", None)
    for name in ("noise_multiplier", "accountant", "num_examples", "runner", "checkpoint_dir",
                 "warm_start", "max_jobs", "steps_per_job", "pipeline_args"):
        if fixed.get(name) is not None:
            raise ValueError(f"tuning sets {name} itself (it trains in-process, with the noise "
                             "its plan calibrates)")
    _refuse_user_level(fixed)
    if noise not in (None, "float"):
        raise ValueError("tuning uses float noise: secure noise's sampler slack is an (epsilon, "
                         "delta) term that the RDP analysis of random stopping does not cover")
    if not 0 <= holdout < 1:
        raise ValueError("holdout must be a share in [0, 1) (0: score on the training rows)")
    if not 0 <= default_share <= 1:
        raise ValueError("default_share must be a probability in [0, 1]")
    if validation is not None and X is not None:
        raise ValueError("validation files go with input files; for arrays hold rows out with "
                         "holdout")
    grid = parse_grid(grid) if grid is None or not isinstance(grid, dict) else dict(grid)
    step = center_step(model, fixed, grid)
    if not grid:
        grid = {k: tuple(v * step if k in RELATIVE_TO_DEFAULT_STEP.get(algorithm, ()) else v
                         for v in values)
                for k, values in DEFAULT_GRIDS.get(algorithm, {}).items()}
    if (algorithm in RELATIVE_TO_DEFAULT_STEP and "learning_rate" not in grid
            and fixed.get("learning_rate") is None):
        fixed["learning_rate"] = step   # a grid without learning rates: still the center step
    scale_features = fixed.pop("scale_features", None) or "auto"   # as train's default
    scale_epsilon = fixed.pop("scale_epsilon", None)
    if scale_features not in ("none", "private", "auto"):
        raise ValueError("scale_features must be none, private or auto")
    if scale_features == "auto" and (fixed.get("feature_norm") is not None
                                     or "feature_norm" in (grid or {})):
        scale_features = "none"   # as train's auto: a feature norm maps the features instead
    if scale_features != "none" and scale_epsilon is None:
        scale_epsilon = 0.1 * epsilon   # as train's default
    if fixed.get("feature_norm") is not None and scale_features != "none":
        raise ValueError("--scale-features and --feature-norm are two maps of the same features: "
                         "choose one")
    chosen = registry.get(algorithm)
    algo_names = {f.name for f in dataclasses.fields(chosen.options)}
    options = {k: v for k, v in fixed.items() if k in algo_names}
    settings = check_grid(grid, algorithm, options)
    # Releases a candidate would add outside the plan (which accounts for its steps, the count
    # and the ranges): refused before any data is read. They had failed only at the first
    # candidate, after the input was read ("released more than the tuning plan accounts for").
    if options.get("adaptive_clip_quantile") is not None:
        raise ValueError("tuning does not take --adaptive-clip-quantile yet: a candidate's noisy "
                         "clip counts are not in the tuning plan; fix --clip-norm or tune it "
                         "(--grid clip_norm=...)")
    if options.get("precondition") == "counts":
        raise ValueError("tuning does not take --precondition counts yet: a candidate's column "
                         "counts are not in the tuning plan; use --precondition auto or none")
    # Options given where they have no effect (ignored_options.ACTS_ONLY_WHEN), before any release,
    # as the candidates will run them: with a noise multiplier (their precondition auto releases no
    # counts), the column scaling resolved here (once, by the splitter); tune's own count is always
    # released. The table as declared by the keywords and the schema together (a schema's
    # categorical columns, hash_buckets, hash_seed or missing policies count as flags' do: checking
    # the keywords alone refused --precondition-epsilon or --hash-seed with a schema's categorical
    # columns).
    table = _with_schema(fixed)
    ignored_options.refuse_ignored(ignored_options.Request(
        model, spec.Privacy(noise_multiplier=1.0, delta=delta),
        spec.make_options(chosen.options, {
            **options, **({"scale_features": scale_features, "scale_epsilon": scale_epsilon}
                          if "scale_features" in algo_names else {})}),
        given={k: table.get(k) for k in ("num_classes", "huber_delta", "hash_seed")},
        categorical_columns=tuple(table.get("categorical_columns") or ()),
        hash_buckets=table.get("hash_buckets"),
        imputed=api._imputed_policies(table.get("missing"))))
    loss = losses.make_loss(model, fixed.get("num_classes"), fixed.get("huber_delta"))
    bound = score_bound(loss, score, score_bound_)
    if bound is None and scale_features == "none" and (
            table.get("label_column", "label") not in (table.get("bounds") or {})):
        raise ValueError(NO_SCORE_BOUND)   # (no label range will be known: before any read)
    if scale_features != "none" and "feature_norm" in grid:
        raise ValueError("--grid feature_norm and --scale-features: choose one")
    quality_options = spec.make_options(quality.QualityOptions, dict(
        quality_check=quality_check, quality_epsilon=quality_epsilon,
        quality_label_bound=quality_label_bound))
    ledger = accounting.Ledger("rdp", chosen.relation)
    check = None
    if quality_options.quality_check == "on":
        # As train reserves it: its noise from public constants (its share alone calibrated by
        # the ledger's accountant, RDP here), recorded before any release; the plan then fits
        # the candidates' noise around it. Float noise, as the candidates'.
        check = quality.reserve(ledger, loss, spec.Privacy(epsilon=epsilon, delta=delta,
                                                           accountant="rdp"),
                                epsilon=quality_options.quality_epsilon,
                                label_bound=quality_options.quality_label_bound, secure=False)
    the_plan = plan(epsilon, delta, mean_candidates, shape, score_share, count_epsilon,
                    scale_epsilon or 0.0,
                    check.noise_multiplier if check is not None else 0.0)
    if budget_gate is not None:
        # The budget across runs admits the whole plan (which bounds every release recorded
        # below) before any data is read: one reservation, refused or not before the count.
        ledger.gate = budget_gate
        ledger.admit(the_plan.event(), whole_run=True)
    root = seed if seed is not None else mechanisms.secure_seed()
    split_key = mechanisms.stream_key(root, _STREAM, _SPLIT) % (1 << 128)
    state = _Data()
    validation_reader = None
    if validation is not None:
        files = sorted({f for p in ([validation] if isinstance(validation, str) else validation)
                        for f in data.list_files(p)})
        if not files:
            raise data.DataError("no validation files given")
        validation_reader = _validation_reader(files, fixed.get("batch_rows", data.DEFAULT_BATCH_ROWS))
    splitter = _Splitter(split_key, holdout, None, the_plan, root, ledger, state, scale_features)
    # Where the ranges turn out to release nothing (no numeric column to scale, or a count too
    # small for them), their share goes back to the candidates: the plan is calibrated again
    # without it, the count's share kept (released already), before the first candidate's noise.
    splitter.replan = lambda: plan(epsilon, delta, mean_candidates, shape, score_share,
                                   the_plan.count_epsilon, 0.0,
                                   check.noise_multiplier if check is not None else 0.0)
    splitter.validation = validation_reader
    say = progress or (lambda message: None)
    k = draw_candidates(mechanisms.secure_generator(root, _STREAM, _K), mean_candidates, shape)
    picker = mechanisms.secure_generator(root, _STREAM, _SETTINGS)
    default = default_setting(algorithm, model, options, grid, step)
    law = setting_law(settings, default, default_share)
    splitter.announce = lambda: say(f"tuning {algorithm} over {len(settings)} settings (mean "
                                    f"candidates {mean_candidates:g}, shape {shape:g})")
    best = None
    for i in range(k):
        setting = settings[draw_setting(picker, law)]
        try:
            candidate, steps = _train_candidate(api, X, y, input, algorithm, model, delta,
                                                setting, options, fixed, splitter,
                                                mechanisms.stream_key(root, _STREAM, _TRAIN, i)
                                                % (1 << 128))
        except quality.ModelQualityError:
            # A candidate whose coefficients are not finite scores lowest: it is released only
            # if every candidate diverged, and then refused below. Stopping here would reveal a
            # candidate that is never released (and that this many ran), outside the
            # selection's accounting.
            candidate, steps = None, None
        if bound is None:   # a regression's, from the label range released or declared
            bound = label_score_bound(state.scaling)
            if bound is None:
                raise ValueError(NO_SCORE_BOUND)
        noisy = -math.inf if candidate is None else _noisy_score(
            candidate, state, loss, score, bound, splitter.plan,
            mechanisms.secure_generator(root, _STREAM, _SCORE, i))
        if best is None or noisy > best[0]:
            best = (noisy, setting, candidate, steps)
    the_plan = splitter.plan   # (calibrated again if the ranges released nothing)
    # The releases: the counts (recorded by the splitter) and the selection.
    ledger.record("repeat_and_select_best_candidate", the_plan.selection_event(),
                  mean_candidates=the_plan.mean, shape=the_plan.shape,
                  training_noise_multiplier=the_plan.sigma_train,
                  score_noise_std=the_plan.sigma_score)
    noisy, setting, chosen_model, steps = best
    if chosen_model is None:   # every candidate diverged: no model (as train's check refuses)
        raise quality.ModelQualityError(
            "beam-dp tune: the chosen model's coefficients are not finite (it diverged); "
            "nothing was written: try a smaller --grid of learning rates or clip norms")
    tuning = {
        "method": "random stopping, Papernot & Steinke 2022 (dp_accounting "
                  "RepeatAndSelectDpEvent, RDP accountant)",
        "algorithm": algorithm,
        "grid": {k: list(v) for k, v in grid.items()},
        # The public law each candidate's setting is drawn from (``setting_law``).
        "setting_law": {"default": default, "default_share": default_share if default in
                        settings else 0.0, "else": "uniform over the grid"},
        "chosen": setting,
        # Sum + noise over a noisy count: both noisy, so the ratio may leave [0, 1] on a small
        # held-out part; clamped for the reader (post-processing; the selection used the ratio).
        "chosen_noisy_score": min(max(noisy, 0.0), 1.0),
        "score": {"kind": score, "bound": bound,
                  "rows": "validation files" if validation is not None else
                          "the training rows (holdout 0)" if holdout == 0 else
                          f"held out from the input by a keyed hash of row position "
                          f"(share {holdout:g})",
                  "noisy_size": state.held_size},
        "number_of_candidates": {"law": "truncated negative binomial", "mean": the_plan.mean,
                                 "shape": the_plan.shape,
                                 "realized": "not released (the guarantee needs it secret)"},
        "not_released": "the other candidates, their scores and their number",
    }
    privacy = report.release_report(
        ledger, delta, seed is not None, requested_epsilon=epsilon, algorithm=algorithm,
        noise_multiplier=the_plan.sigma_train * math.sqrt(steps), steps=steps,
        clip_norm=setting.get("clip_norm", options.get("clip_norm")),
        dataset_size={"kind": "laplace_count", "value": int(round(state.train_size)),
                      "laplace_scale": 1.0 / the_plan.count_epsilon},
        preprocessing={"scale_features": scale_features, **(state.scaling or {})},
        hyperparameters={"status": "privately tuned (beam-dp tune): the selection is inside "
                                   "epsilon", "values": {**options, **setting,
                                                                "scale_features": scale_features},
                         "tuning": tuning})
    if check is None:
        checked = {"status": "off", "reason": "quality_check off (--quality-check off)"}
    else:
        checked = _check_chosen(quality, check, loss, chosen_model, state, quality_options,
                                mechanisms.stream_key(root, _STREAM, _QUALITY) % (1 << 128))
    if checked.get("status") == "much_worse":
        raise quality.ModelQualityError(quality.refusal_text(checked))
    privacy["quality_check"] = checked
    if checked.get("status") == "worse":   # (inconclusive: recorded, never an alarm)
        message = quality.warning_text(checked, privacy["hyperparameters"]["values"])
        privacy.setdefault("warnings", []).append(message)
        warnings.warn(message, api.QualityWarning, stacklevel=2)
    report.compose_with_inputs(privacy, table.get("vocabulary"))
    chosen_model.privacy_report = privacy
    chosen_model.tuning = tuning
    say(f"chose {setting}: noisy score {tuning['chosen_noisy_score']:.4g}; epsilon "
        f"{privacy['epsilon']:.4g}")
    return chosen_model


def _check_chosen(quality, check, loss, model, state: _Data, quality_options, seed) -> dict:
    """train's private quality check on the chosen model over the training rows: the release
    ``check`` reserved in the tuning's ledger (outside the selection: it reads the one released
    model), its verdict by ``quality.verdict`` against the noisy count of training rows. A
    regression's L: the label range the chosen candidate trained with (public: declared or
    released), as train takes it, unless ``quality_label_bound`` is given."""
    from beam_dp.local import LocalAggregator
    label_range = (model.privacy_report.get("preprocessing") or {}).get("label_range")
    if check.label_bound is not None and label_range and quality_options.quality_label_bound is None:
        check = check.with_label_range(label_range)
    stage = check.stage(loss, model.artifact.get("feature_transform"), seed)
    noisy = LocalAggregator(state.train).run_stages([stage], quality.initial_state(model.theta))[
        stage.key]
    return quality.judged(loss, noisy, check, state.train_size, "the training rows")


def _validation_reader(files, batch_rows):
    """Reads the validation files with the first candidate's columns (its problem's source)."""
    def read(problem):
        from beam_dp.categorical import Encoding
        source = problem.source
        spec = source.get("encoding")
        encoding = Encoding.from_spec(spec) if spec else None
        return [b for f in files for b in data.blocks_from_file(
            f, source["label_column"], source["feature_columns"], problem.loss, batch_rows,
            data.open_input, encoding)]
    return read


def _with_schema(fixed: dict) -> dict:
    """``fixed``'s table keywords merged over its ``schema``'s (file or dict) as
    ``beam_dp.train`` merges them for each candidate: what the run declares, before any data is
    read (a keyword left at its default takes the schema's value)."""
    from beam_dp import api
    from beam_dp import schema as schema_mod
    declared = fixed.get("schema")
    if declared is None:
        return dict(fixed)
    declared = (schema_mod.read(declared) if isinstance(declared, str)
                else schema_mod.from_dict(declared))
    declared.pop("id_columns", None)   # predict's
    return schema_mod.merge(declared, fixed, api._SCHEMA_DEFAULTS)


def _refuse_user_level(fixed: dict) -> None:
    """A privacy unit (keyword or the schema's ``privacy_unit``) is refused before any release:
    the candidates train on the splitter's row-level blocks, never grouped or bounded by user,
    and the selection is accounted under add/remove one row. It had been dropped silently (the
    CLI did not pass the flag on, so the user column became a feature)."""
    table = _with_schema(fixed)
    if (table.get("privacy_unit_column") is not None
            or fixed.get("max_rows_per_user") is not None):
        raise ValueError("beam-dp tune does not take user-level privacy yet (--privacy-unit-column, "
                         "--max-rows-per-user, the schema's privacy_unit): its candidates train "
                         "and are scored per row; use beam-dp train")


def _train_candidate(api, X, y, input, algorithm, model, delta, setting, options, fixed,
                     splitter, seed):
    chosen = registry.get(algorithm)
    merged = {**options, **setting}
    steps = merged.get("steps") or merged.get("max_steps") or \
        spec.make_options(chosen.options, merged).max_steps
    if steps is None:
        # Not train's default cap (``noisy_gd.default_max_steps``, up to 300 steps on small
        # tables): with a candidate's 1.5x noise more steps hurt (default grid, 3 seeds: AER
        # CreditCard accuracy 0.958 / 0.955 / 0.950 at 100 / 150 / 200 steps, 0.953 at 300; MASS
        # Boston with ranges RMSE 5.57 / 5.69 / 6.19, 8.36 at 300), so a candidate keeps the
        # earlier fixed cap, given explicitly (with a noise multiplier dpgd runs exactly
        # max_steps steps).
        from beam_dp.algorithms import noisy_gd
        steps = noisy_gd.DEFAULT_MAX_STEPS[0]
        setting_steps = {"max_steps": steps}
    else:
        setting_steps = {}
    # T steps of multiplier sigma sqrt(T) compose to one Gaussian of multiplier sigma; the tiny
    # excess keeps rounding in sqrt from ever putting the composition below sigma_train.
    multiplier = splitter.plan.sigma_train * math.sqrt(steps) * (1.0 + 1e-9)
    rest = {k: v for k, v in fixed.items() if k not in setting}   # (fixed options included)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        candidate = api.train(X, y, input=input, algorithm=algorithm, model=model,
                              noise_multiplier=multiplier, delta=delta, accountant="rdp",
                              noise="float", runner="local", seed=seed, _instrument=splitter,
                              scale_features="none",   # (the splitter released the ranges once)
                              quality_check="off",     # (the held-out score is the check here)
                              **setting_steps, **rest, **setting)
    # The candidate must have released no more than the plan's training event.
    spent = _rdp(_candidate_ledger_event(candidate))
    planned = _rdp(events.GaussianDpEvent(splitter.plan.sigma_train))   # (the plan it ran with)
    if not np.all(spent <= planned):
        raise ValueError(f"a candidate ({setting}) released more than the tuning plan accounts "
                           "for; this setting cannot be tuned")
    return candidate, steps


def _candidate_ledger_event(candidate) -> events.DpEvent:
    from beam_dp.accounting import event_from_json
    return event_from_json(candidate.privacy_report["dp_event"])


def _noisy_score(candidate, state: _Data, loss, kind, bound, the_plan: Plan, generator) -> float:
    total = 0.0
    for block in state.held:
        total += float(np.sum(row_scores(loss, candidate.block_scores(block), block.labels, kind,
                                         bound)))
    noisy = total + float(mechanisms.gaussian_noise(generator, (), the_plan.sigma_score))
    return noisy / state.held_size
