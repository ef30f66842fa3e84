"""The registered algorithm ``bias-reduced-sgd``: ``bias_reduced``'s randomly stopped SGD
(paper 001, Algorithm 4) on a GLM through the Aggregator seam: its row layout, its step stage,
its options and ``train``. The estimator, the levels, the accounting and the plan are
``bias_reduced``'s (a Beam-free numpy core).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from beam_dp import accounting, clipping, geometry, mechanisms
from beam_dp.algorithms import spec
from beam_dp.algorithms.base import TrainState, run_chunks
from beam_dp.algorithms.bias_reduced import (STREAM_BATCHES, BiasReducedOracle, MeanEstimator,
                                             combine, max_level, plan, sample_levels, step_event,
                                             truncated_geometric_pmf)
from beam_dp.algorithms.spec import TrainResult
from beam_dp.losses import MODEL_NAMES

# ``beam-dp train --algorithm bias-reduced-sgd``: Algorithm 4 on a GLM through the Aggregator seam.
#
# The gradient is theta's (k, d + 1) per-example gradient, flattened (D = k (d + 1)); every row is
# clipped to l2 norm L (--clip-norm) by ``clipping.clipped_gradient_sum`` (which takes CSR blocks
# as they are); ME is ``MeanEstimator`` on the four sums of a step (z0, B = O + E, O, E).
#
# Which rows a step reads: the oracle's own draws (``BiasReducedOracle.draw_batch``, one ChaCha20
# stream per step) of *global row indices* 0..n-1, made on the driver before training. A row's
# global index is its block's offset plus its place in the block, the offsets from one layout
# stage (``LayoutStage``: each block's (source, first row, rows), sorted), which every runner makes
# of the same blocks (so both runners give a step the same rows, and the same model). Why not
# Poisson-style per-row keys as DP-SGD's plan: a batch of exactly 2^J rows, uniformly without
# replacement, is what the accounting (SampledWithoutReplacementDpEvent) and the telescoping need,
# and only a global index gives it without a global sort.
#
# Why stages (each step a full pass that keeps only its few rows) and not ``step_batches``'s batch
# files: those files hold dense rows (a fixed-size list of d float64 per row), and this algorithm
# is for CSR blocks with up to ~10^6 columns, where a dense row is megabytes. A step's pass costs a
# searchsorted per block (the worker keeps the parsed blocks in its cache between steps). Batch
# files for CSR rows would make a step read only its rows; not built.
#
# Neighbouring relation: replace-one with n public (the paper's). n is the exact row count: the
# sampling draws from exactly n indices, and the per-step events name n; under replace-one the
# count is not private (``dataset_size`` in the report says so).
#
# Privacy accounting: every step's DpEvent is known before training (the levels are public), so
# the whole run is recorded in the ledger before any data is read, one entry per level (the steps
# at a level are a self-composition), and the reported epsilon is the ledger's (dp_accounting).
# --accountant rdp: ``step_event(..., "wor-rdp")`` (SampledWithoutReplacementDpEvent, dp_accounting's
# RDP accountant); --accountant pld (the default): ``step_event(..., "conservative")`` (Lemma 5.3's
# amplified ApproxDpEvents, dp_accounting's PLD accountant), because dp_accounting's PLD accountant
# does not take a SampledWithoutReplacementDpEvent. T is ``plan``'s, with the ledger's method.

RELEASE = "bias_reduced_sgd_step"
_CANARY_STREAM = 64


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """The blocks seen by a layout pass: ((source, first row, rows), ...), added by concatenation
    (a stage's partial sums are added, in any order). Public under replace-one: block sizes are
    set by the input's files and --batch-rows, never by a value."""

    blocks: tuple = ()

    def __add__(self, other: "RowLayout") -> "RowLayout":
        return RowLayout(self.blocks + other.blocks)


class LayoutStage:
    """One pass that lists the blocks (no value is read): the state becomes {"offsets": ...},
    each block's (source, first row) -> its first global index, blocks sorted by (source, first
    row), and {"rows": n}."""

    shape = (0,)

    def partial_sum(self, block, state) -> RowLayout:
        return RowLayout(((str(block.source), int(block.row_start), len(block)),))

    def zero_sum(self) -> RowLayout:
        return RowLayout()

    def apply(self, state, total: RowLayout) -> dict:
        blocks = sorted(total.blocks)
        keys = [(s, r) for s, r, _ in blocks]
        if len(set(keys)) != len(keys):
            raise ValueError("two blocks start at the same row of the same source: the row layout "
                             "is ambiguous")
        sizes = np.array([m for _, _, m in blocks], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return {"offsets": {k: int(s) for k, s in zip(keys, starts)}, "rows": int(sizes.sum())}


@dataclasses.dataclass(frozen=True)
class BiasReducedStep:
    """Step t of Algorithm 4 as a stage: ``partial_sum`` the block's clipped gradient sums of
    the step's O, E and z0 rows ((3, k, d + 1)); ``apply`` ME on the four sums (fresh noise each),
    G = ME(z0) + (ME(B) - (ME(O) + ME(E)) / 2) / p_J, theta <- Proj(theta - eta G). Holds the
    steps ``first .. first + len(levels) - 1`` (a job's copy holds only its own: ``for_steps``)."""

    loss: object
    clip_norm: float
    shape: tuple                  # (3, k, d + 1)
    fit_intercept: bool
    offsets: dict                 # (source, first row) -> first global index
    n: int
    estimator: MeanEstimator
    learning_rate: float
    radius: float | None          # l2 ball of the coefficients (intercept included); None: R^D
    first: int
    levels: tuple                 # of steps first, first + 1, ...
    indices: tuple                # per step: global indices O, then E, then z0 (int64 arrays)
    seed: int | None              # the root seed (driver); None in a job's copy
    noise_keys: tuple | None = None

    # The ledger release the audit's canaries enter.
    canary_releases = (RELEASE,)

    def for_steps(self, first: int, count: int) -> "BiasReducedStep":
        """The steps first .. first + count - 1 only, with their noise keys instead of the root
        seed (a Beam job's graph holds nothing from which other steps' noise could be derived)."""
        a, b = first - self.first, first - self.first + count
        if a < 0 or b > len(self.levels):
            raise ValueError("this step holds no plan for those steps")
        keys = (mechanisms.step_keys(self.seed, first, count) if self.seed is not None else
                (first, self.noise_keys[1][first - self.noise_keys[0]:
                                           first - self.noise_keys[0] + count]))
        return dataclasses.replace(self, first=first, levels=self.levels[a:b],
                                   indices=self.indices[a:b], seed=None, noise_keys=keys)

    def _step(self, step: int):
        i = step - self.first
        if not 0 <= i < len(self.levels):
            raise ValueError(f"this copy of the step holds no plan for step {step}")
        return int(self.levels[i]), self.indices[i]

    def partial_sum(self, block, state) -> np.ndarray:
        level, index = self._step(state.step)
        h = 1 << (level - 1)
        out = np.zeros(self.shape)
        start = self.offsets.get((str(block.source), int(block.row_start)))
        if start is None:
            raise ValueError("a block that the layout pass did not see: the input changed "
                             "during the run")
        inside = (index >= start) & (index < start + len(block))
        if not inside.any():
            return out
        for role, part in enumerate((slice(0, h), slice(h, 2 * h), slice(2 * h, None))):
            rows = index[part][inside[part]] - start
            if rows.size:
                chosen = block.take(rows)   # rows of one role are distinct (z0 is its own role)
                out[role] = clipping.clipped_gradient_sum(
                    state.theta, chosen.features, chosen.sq_norms, chosen.labels, self.loss,
                    self.clip_norm, self.fit_intercept)
        return out

    def zero_sum(self) -> np.ndarray:
        return np.zeros(self.shape)

    def gradient(self, step: int, total: np.ndarray) -> np.ndarray:
        """G (k, d + 1) of step ``step`` from its three summed roles (the noise drawn here)."""
        level, _ = self._step(step)
        h = 1 << (level - 1)
        odd, even, single = (np.asarray(total[r], dtype=np.float64).reshape(-1) for r in range(3))
        sums = np.stack([single, odd + even, odd, even])
        sizes = np.array([1, 2 * h, h, h], dtype=np.int64)
        me = self.estimator.estimate(
            sums, sizes, mechanisms.step_noise_generator(self.seed, self.noise_keys, step))
        p = float(truncated_geometric_pmf(max_level(self.n))[level - 1])
        g = combine(me[0], me[1], me[2], me[3], p).reshape(self.shape[1:])
        if not self.fit_intercept:
            g[:, -1] = 0.0   # (post-processing: the intercept stays 0)
        return g

    def apply(self, state: TrainState, total) -> TrainState:
        theta = state.theta - self.learning_rate * self.gradient(state.step, total)
        if self.radius is not None:
            theta = geometry.project_l2_ball(theta.reshape(-1), self.radius).reshape(theta.shape)
        return TrainState(theta, state.theta_sum + theta, state.step + 1)

    # ----------------------------------------------------------------- the audit's canaries

    def canary_sum(self, state: TrainState, canaries) -> np.ndarray:
        """The audit's canaries as rows of this step: each included canary is in B with
        probability 2^J / n (then in O or E with probability 1/2) and is z0 with probability
        1 / n, from the audit's own randomness, as a row is; each adds L, the most one row can
        add, on its own column of the roles it is in."""
        level, _ = self._step(state.step)
        g = mechanisms.rng(canaries.key, _CANARY_STREAM, state.step)
        m = canaries.count
        in_batch = canaries.included & (g.random(m) < (1 << level) / self.n)
        odd = g.random(m) < 0.5
        single = canaries.included & (g.random(m) < 1.0 / self.n)
        out = np.zeros(self.shape)
        out[0, 0, canaries.columns[in_batch & odd]] = self.clip_norm
        out[1, 0, canaries.columns[in_batch & ~odd]] = self.clip_norm
        out[2, 0, canaries.columns[single]] = self.clip_norm
        return out

    def canary_scores(self, before: TrainState, after: TrainState, canaries) -> np.ndarray:
        columns = canaries.columns
        return before.theta[0, columns] - after.theta[0, columns]


def accounting_method(accountant: str) -> str:
    """The step events the ledger's accountant can compose (the comment at the top)."""
    return "wor-rdp" if accountant == "rdp" else "conservative"


def default_sparsity(problem) -> int:
    """A public bound s on the nonzeros of a per-example gradient (k outputs x (nonzeros of a row
    + the intercept)): dense rows, d + 1; categorical rows (one entry per categorical column, a
    hash collision only merges two), the numeric and categorical columns + 1."""
    outputs = problem.loss.outputs()
    encoding = problem.source.get("encoding") if problem.sparse else None
    if encoding:
        per_row = len(encoding.get("numeric_columns", ())) + len(encoding.get("categorical_columns", ()))
    else:
        per_row = problem.dim
    return outputs * (min(per_row, problem.dim) + int(problem.fit_intercept))


@dataclasses.dataclass
class BiasReducedOptions:
    clip_norm: float = spec.option(1.0, "per-example gradient clip norm L (l2): every ME call's "
                                        "sensitivity is 2L / b under replace-one", low=0,
                                   low_open=True)
    learning_rate: float = spec.option(0.5, "constant step size eta", low=0, low_open=True)
    call_epsilon: float = spec.option(
        1.0, "epsilon0 of each ME call; the steps run while their composed, subsampled "
             "cost fits --epsilon",
        low=0, low_open=True)
    call_delta: float | None = spec.option(
        None, "delta0 of each ME call; default delta / 100",
                                               low=0, low_open=True, high=0.5)
    max_steps: int = spec.option(1000, "at most this many oracle calls (T + 1); fewer when "
                                       "the budget runs out first", low=1, high=1_000_000)
    sparsity: int | None = spec.option(
        None, "public bound s on a per-example gradient's nonzeros (ME projects onto "
              "the l1 ball of radius L sqrt(s)); default the columns a row can use, "
              "plus 1", low=1)
    radius: float | None = spec.option(None, "project the coefficients (intercept included) "
                                             "onto the l2 ball of this radius after each "
                                             "step; default: no projection", low=0,
                                       low_open=True)
    zero_below: int = spec.option(1, "ME outputs 0 (no data read, no privacy spent) on "
                                     "batches of fewer rows; 1: off (the paper's estimator)",
                                  low=1)


def _check_privacy(privacy: spec.Privacy) -> None:
    if privacy.noise == "secure":
        raise ValueError("bias-reduced-sgd has no secure noise (its Gaussian draws are float); "
                         "use --noise float")
    if privacy.count_epsilon is not None:
        raise ValueError("bias-reduced-sgd spends no budget on a count: n is public under its "
                         "replace-one relation (--num-examples, or the row count); drop "
                         "--count-epsilon")
    if privacy.epsilon is None:
        raise ValueError("bias-reduced-sgd plans its number of steps to a budget: give --epsilon "
                         "(its noise is set by --call-epsilon), not --noise-multiplier")


def train(options: BiasReducedOptions, problem: spec.Problem, aggregator, seed: int,
          ledger: accounting.Ledger, on_progress=lambda *a: None):
    """Algorithm 4 on ``problem`` (the comment at the top of this module)."""
    spec.validate(options)
    privacy = problem.privacy
    privacy.validate()
    _check_privacy(privacy)
    if ledger.neighbouring != accounting.REPLACE_ONE:
        raise ValueError("bias-reduced-sgd's guarantee is for replace-one neighbours: give it a "
                         "replace-one ledger")
    delta, epsilon = float(privacy.delta), float(privacy.epsilon)
    method = accounting_method(ledger.accountant)
    sparsity = options.sparsity or default_sparsity(problem)
    call_delta = options.call_delta if options.call_delta is not None else delta / 100.0
    estimator = MeanEstimator(options.clip_norm, sparsity, options.call_epsilon, call_delta,
                              "gaussian", options.zero_below)
    layout = aggregator.run_stages([LayoutStage()], {})   # block sizes only: no value is read
    n = layout["rows"]
    if privacy.num_examples is not None and int(privacy.num_examples) != n:
        raise ValueError("--num-examples differs from the input's row count: bias-reduced-sgd "
                         "samples row indices from exactly n rows; drop --num-examples or fix it")
    if n < 2:
        raise ValueError("bias-reduced-sgd needs at least 2 rows")
    levels = sample_levels(seed, options.max_steps, n)
    try:
        # Against the ledger: the steps that fit with the releases already there (the
        # quality check's, reserved before training).
        planned = plan(levels, n, epsilon, delta, estimator, method,
                       accounting.prior_event(ledger))
    except ValueError as e:
        raise ValueError(f"bias-reduced-sgd: {e} (--call-epsilon, --epsilon)") from None
    calls = planned.calls
    oracle = BiasReducedOracle(n, 1, estimator)
    indices = []
    for t in range(calls):   # the batches: public randomness of the run's secret stream, drawn
        odd, even, single = oracle.draw_batch(   # before any data is read
            int(planned.levels[t]), mechanisms.secure_generator(seed, STREAM_BATCHES, t))
        indices.append(np.concatenate([odd, even, single]).astype(np.int64))
    counts = np.bincount(planned.levels, minlength=max_level(n) + 1)
    for j, c in enumerate(counts):   # every step's event, before the first step's release
        if c > 0:
            ledger.record(RELEASE, step_event(j, n, estimator, method), count=int(c), level=j,
                          batch_size=1 << j, noise_multiplier=estimator.noise_multiplier,
                          call_epsilon=estimator.epsilon, call_delta=estimator.delta,
                          accounting=method, neighbouring=accounting.REPLACE_ONE,
                          noise="float Gaussian (numpy) on float sums")
    reported = ledger.epsilon(delta)
    outputs = problem.loss.outputs()
    shape = (3, outputs, problem.dim + 1)
    step = BiasReducedStep(
        loss=problem.loss, clip_norm=float(options.clip_norm), shape=shape,
        fit_intercept=problem.fit_intercept, offsets=layout["offsets"], n=n, estimator=estimator,
        learning_rate=float(options.learning_rate), radius=options.radius, first=0,
        levels=tuple(int(v) for v in planned.levels), indices=tuple(indices), seed=seed)
    state = TrainState.zeros(outputs, problem.dim)
    on_progress(0, calls, reported)
    state = run_chunks(aggregator, step, state, calls, problem.steps_per_chunk,
                       lambda s, k: on_progress(s.step, calls, reported))
    theta = state.averaged()
    details = {"oracle_calls": calls, "steps_T": planned.steps, "accounting": method,
               "call_epsilon": estimator.epsilon, "call_delta": estimator.delta,
               "noise_multiplier": estimator.noise_multiplier, "sparsity": sparsity,
               "l1_radius": estimator.radius, "max_level": max_level(n),
               "levels": {str(j): int(c) for j, c in enumerate(counts) if c > 0},
               "learning_rate": float(options.learning_rate), "radius": options.radius,
               "output": "average of x_1 .. x_(T+1)",
               "planned_epsilon": planned.epsilon, "capped_by_max_steps": planned.capped}
    dataset_size = {"source": "public under the replace-one relation: the row count (the batches "
                              "are drawn without replacement from exactly n rows)", "value": n}
    expected = float(np.sum(np.exp2(np.arange(1, max_level(n) + 1)) * oracle.pmf)) + 1.0
    return TrainResult(theta, ledger, estimator.noise_multiplier, expected / n, calls,
                       float(options.clip_norm), dataset_size, details,
                       sampling="per step: a level J ~ TGeom(log2 n) (public), 2^J rows without "
                                "replacement split into halves, and one more row",
                       expected_batch_size=expected, details_name="algorithm_parameters")


BIAS_REDUCED_SGD = spec.Algorithm(
    "bias-reduced-sgd", "sparse gradients (categorical columns) with a theory-grade bias bound: "
                        "randomly stopped SGD on the bias-reduced sparse mean estimator (paper "
                        "001, Algorithms 3-4); batches of very uneven sizes, a theory device",
    MODEL_NAMES, BiasReducedOptions, train, relation=accounting.REPLACE_ONE,
    checkpoints=False,
    why_no_checkpoints="its whole run is planned and recorded in the ledger before the first "
                       "step, from one seed; a resume would need that plan and those batches kept",
    sparse_input=True, check_privacy=_check_privacy, quality_check=True)
