"""The statistics of a one-run privacy audit (Steinke, Nasr & Jagielski, "Privacy Auditing with
One (1) Training Run", NeurIPS 2023, arXiv:2305.08846). Beam-free: numpy and scipy only.

The experiment: each of m canaries is included in the training data independently with
probability 1/2 (S_i = +1 included, -1 excluded); the mechanism runs once; from its output alone
an auditor guesses T_i in {+1, -1, 0 = abstain}, with at most r non-abstentions, and W counts the
correct guesses (T_i = S_i). The paper's approximate-DP main theorem (Theorem 5.2; Theorem 3.1 is
its delta = 0 case) says: if the mechanism is (epsilon, delta)-DP with respect to adding or
removing any one canary, then for every v

    P[W >= v] <= f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v],

i.e. the guesses can beat eps-randomized response only through the delta slack, and that slack
costs at most a 2 m delta multiple of the binomial mass just below v (the max over i > v adds
nothing: f(v - i) = 1 there, so the ratio only falls). The right-hand side is therefore a valid
p-value for the hypothesis "(eps, delta)-DP" once v correct guesses are observed, and the audit's
epsilon lower bound is the largest eps it rejects, found by bisection as in the paper's App. D.

Why a lower bound at all: (eps', delta)-DP implies (eps, delta)-DP for every eps >= eps', so
rejecting eps rejects every eps' below it as well; and it needs one training run, not hundreds,
because the m canaries are m parallel coin flips whose dependence the theorem accounts for
without group privacy.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np
from scipy import special

from beam_dp import mechanisms
from beam_dp.algorithms import base
from beam_dp.block import Block

# The default numbers of guesses, as fractions of m: fixed before any score is seen.
DEFAULT_GUESS_FRACTIONS = (1 / 50, 1 / 20, 1 / 10, 1 / 5, 1 / 2, 1)

# Ties among scores are broken by keys from this fixed seed: independent of the inclusion bits
# whatever the canaries' order (breaking them by index would leak an order sorted by inclusion).
_TIE_BREAK_SEED = 20230515

_BISECTION_TOLERANCE = 1e-7


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer count, got {value!r}")
    return int(value)


def _check_delta_confidence(delta, confidence) -> tuple[float, float]:
    delta, confidence = float(delta), float(confidence)
    if not 0.0 <= delta < 1.0:  # also rejects NaN
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return delta, confidence


def _check_counts(m, r, v) -> tuple[int, int, int]:
    m, r, v = _check_count("m", m), _check_count("r", r), _check_count("v", v)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m (correct <= guesses <= canaries), "
                         f"got v={v}, r={r}, m={m}")
    return m, r, v


def _p_value_of_epsilon(m: int, r: int, v: int, delta: float):
    """eps -> Theorem 5.2's p-value for fixed counts. The binomial coefficients do not depend on
    eps, so bisection re-evaluates only k log q + (r - k) log(1 - q) over k = 0..r."""
    if v == 0:
        return lambda epsilon: 1.0  # W >= 0 always holds
    successes = np.arange(r + 1)
    log_coefficients = (special.gammaln(r + 1) - special.gammaln(successes + 1)
                        - special.gammaln(r - successes + 1))
    window_widths = np.arange(1, v + 1)

    def p_value_at(epsilon: float) -> float:
        # q = e^eps / (1 + e^eps), the accuracy of eps-randomized response
        log_q, log_not_q = special.log_expit(epsilon), special.log_expit(-epsilon)
        pmf = np.exp(log_coefficients + successes * log_q + (r - successes) * log_not_q)
        tail = float(np.sum(pmf[v:]))  # f(v) = P[Binomial(r, q) >= v]
        if delta == 0.0:
            return min(tail, 1.0)
        # (f(v - i) - f(v)) / i = P[v - i <= Binomial < v] / i for i = 1..v: one cumulative sum
        slope = float(np.max(np.cumsum(pmf[v - 1::-1]) / window_widths))
        return min(tail + 2.0 * m * delta * slope, 1.0)

    return p_value_at


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Theorem 5.2's bound on P[W >= v] for an (epsilon, delta)-DP mechanism: the p-value of v
    correct guesses out of r (m canaries) under that hypothesis. 1.0 when v = 0."""
    m, r, v = _check_counts(m, r, v)
    delta, _ = _check_delta_confidence(delta, 0.5)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    return _p_value_of_epsilon(m, r, v, delta)(float(epsilon))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The epsilon that v correct guesses out of r (m canaries, each included independently with
    probability 1/2) show to be violated at the given confidence: for every eps' below the returned
    value, a mechanism that were (eps', delta)-DP would produce >= v correct guesses with
    probability below 1 - confidence (Theorem 5.2's p-value, ``p_value``). 0.0 when even eps = 0
    is not rejected, i.e. nothing can be claimed.

    Bisection keeps p_value(lo) < 1 - confidence, so the returned ``lo`` is itself rejected (it
    lies within 1e-7 below the crossing) and never overstates; rejecting lo rejects each smaller eps
    because (eps', delta)-DP implies (lo, delta)-DP. The delta term grows with m * delta: with
    2 m delta comparable to 1 the bound is small whatever the guesses.
    """
    m, r, v = _check_counts(m, r, v)
    delta, confidence = _check_delta_confidence(delta, confidence)
    significance = 1.0 - confidence
    p_value_at = _p_value_of_epsilon(m, r, v, delta)
    if p_value_at(0.0) >= significance:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value_at(hi) < significance:  # ends: the p-value -> 1 as eps -> inf
        lo, hi = hi, 2.0 * hi
    while hi - lo > _BISECTION_TOLERANCE:
        middle = 0.5 * (lo + hi)
        if p_value_at(middle) < significance:
            lo = middle
        else:
            hi = middle
    return lo


def default_guesses(m: int) -> list[int]:
    """The fixed grid of guess counts r = 2k: m/50, m/20, m/10, m/5, m/2 and m, each rounded to an
    even number in [2, m]; duplicates dropped. Depends on m only, never on the scores."""
    m = _check_count("m", m)
    largest = m - m % 2
    if largest < 2:
        return []
    rounded = (2 * round(m * fraction / 2) for fraction in DEFAULT_GUESS_FRACTIONS)
    return sorted({min(max(r, 2), largest) for r in rounded})


def _check_guesses(guesses, m: int) -> list[int]:
    if isinstance(guesses, (str, bytes)) or not isinstance(guesses, Sequence) or not guesses:
        raise ValueError("guesses must be a non-empty list of even guess counts r = 2k")
    checked = {_check_count("each number of guesses", r) for r in guesses}
    bad = sorted(r for r in checked if r < 2 or r > m or r % 2)
    if bad:
        raise ValueError(f"each number of guesses must be even and in [2, m={m}], got {bad}")
    return sorted(checked)


def audit_from_scores(scores, included, delta: float, confidence: float = 0.95,
                      guesses: Sequence[int] | None = None) -> dict:
    """A one-run audit of m canaries from their scores (higher = more likely included) and their
    true inclusion bits, each of which must have been drawn independently with probability 1/2.

    For each candidate r = 2k the auditor guesses "included" for the k highest scores, "excluded"
    for the k lowest and abstains on the rest (ties broken by keys from a fixed seed, independent
    of the bits); v_r counts the correct guesses and ``epsilon_lower_bound`` turns (m, r, v_r)
    into a bound at confidence 1 - (1 - confidence) / len(grid). The reported bound is the
    largest of these.

    Why the union bound makes the choice of r honest: taking the best r after seeing the outcome
    would be a multiple test, and the best of several 95% bounds overstates more than 5% of the
    time. Here the grid is fixed in advance (``guesses``, or ``default_guesses(m)``) and each bound
    holds except with probability (1 - confidence) / len(grid), so all hold at once, and hence so
    does their maximum, except with probability at most 1 - confidence.

    Returns only counts and parameters: {"epsilon_lower_bound", "guesses" (the r reported),
    "correct" (its v), "canaries": m, "confidence", "delta", "method"}.
    """
    delta, confidence = _check_delta_confidence(delta, confidence)
    scores = np.asarray(scores, dtype=float)
    included = np.asarray(included)
    if scores.ndim != 1 or included.shape != scores.shape:
        raise ValueError(f"scores and included must be 1-D and of the same length, got shapes "
                         f"{scores.shape} and {included.shape}")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores must be finite")
    if not np.all((included == 0) | (included == 1)):
        raise ValueError("included must hold booleans or 0/1")
    m = scores.size
    if m < 2:
        raise ValueError(f"need at least 2 canaries (one guess in, one out), got {m}")
    grid = default_guesses(m) if guesses is None else _check_guesses(guesses, m)
    per_test_confidence = 1.0 - (1.0 - confidence) / len(grid)

    tie_keys = np.random.default_rng(_TIE_BREAK_SEED).random(m)
    ranked_bits = included.astype(bool)[np.lexsort((tie_keys, scores))]  # ascending score
    included_in_top = np.cumsum(ranked_bits[::-1])  # [k - 1]: included among the k highest
    excluded_in_bottom = np.cumsum(~ranked_bits)  # [k - 1]: excluded among the k lowest
    correct = [int(included_in_top[r // 2 - 1] + excluded_in_bottom[r // 2 - 1]) for r in grid]
    bounds = [epsilon_lower_bound(m, r, v, delta, per_test_confidence)
              for r, v in zip(grid, correct)]
    best = int(np.argmax(bounds))
    return {
        "epsilon_lower_bound": float(bounds[best]),
        "guesses": grid[best],
        "correct": correct[best],
        "canaries": m,
        "confidence": confidence,
        "delta": delta,
        "method": ("one-run audit (Steinke, Nasr & Jagielski 2023), union bound over the guess "
                   f"counts {grid}, each tested at confidence {per_test_confidence:.6g}; "
                   "Theorem 5.2's (epsilon, delta) p-value, inverted by bisection"),
    }


# --------------------------------------------------------------------------------------------
# The audit run: white-box canaries in a copy of a training configuration

DEFAULT_CANARIES = 1000   # with --noise-multiplier (no claimed epsilon to size them by)
# The canary counts ``default_canaries`` chooses from, and how far above the claimed epsilon the
# most an audit could show (``ceiling``: every guess right) must reach. At delta 1e-5 the ceiling
# is 5.3 with 1,000 canaries, 6.2 with 3,000, 6.4 with 5,000 and no higher after (the m delta term
# takes over): 1,000 canaries caught a tenth of dpsgd's noise at epsilon 4 on a 20,000-row table
# in 1 run of 5, 3,000 in 5 of 5 (docs/auditing.md: pipelines/bench_audit_canaries.py).
CANARY_COUNTS = (1000, 2000, 3000, 5000)
CEILING_OVER_CLAIM = 1.5


def ceiling(m: int, delta: float = 1e-5, confidence: float = 0.95) -> float:
    """The largest lower bound an audit with m canaries can report: every guess right at each
    count of the grid (``default_guesses``), at its per-guess-count confidence."""
    grid = default_guesses(m)
    per_test = 1.0 - (1.0 - confidence) / len(grid)
    return max(epsilon_lower_bound(m, r, r, delta, per_test) for r in grid)


def default_canaries(epsilon: float | None, delta: float = 1e-5,
                     confidence: float = 0.95) -> int:
    """The canary count for a claimed epsilon: the smallest of CANARY_COUNTS whose ``ceiling``
    reaches CEILING_OVER_CLAIM times the claim, else the one with the highest ceiling (public
    inputs only)."""
    if epsilon is None:
        return DEFAULT_CANARIES
    ceilings = {m: ceiling(m, delta, confidence) for m in CANARY_COUNTS}
    enough = [m for m in CANARY_COUNTS if ceilings[m] >= CEILING_OVER_CLAIM * epsilon]
    return enough[0] if enough else max(CANARY_COUNTS, key=ceilings.get)


# The audit's own randomness (inclusion bits, canaries' sampling and blocks): a stream of the
# root seed that no training stream uses.
_STREAM_AUDIT = 50
# Rows per block held in memory: each block is widened by m zero columns when it is read.
_AUDIT_BLOCK_ROWS = 2048


@dataclasses.dataclass(frozen=True)
class Canaries:
    """m white-box canaries. Canary i owns feature column ``first_column + i``: a column added
    to the data for the audit, zero in every real row, so no real example's gradient touches it
    and the canaries do not touch each other's. ``included[i]`` is S_i = +1, drawn with
    probability 1/2. Each training stage that sums per-example contributions (``canary_sum``)
    adds, for the included canaries, the largest contribution one example can make to it, on
    its column; each stage that releases a noisy sum scores them (``canary_scores``)."""

    first_column: int
    included: np.ndarray        # bool, (m,)
    key: int                    # the audit's randomness

    @property
    def count(self) -> int:
        return int(self.included.size)

    @property
    def columns(self) -> np.ndarray:
        return self.first_column + np.arange(self.count)

    def present(self, step: int, rate: float) -> np.ndarray:
        """The columns of the included canaries a step sampling rows at ``rate`` would take:
        each independently with that probability, as a row is (all of them at rate 1)."""
        if rate >= 1.0:
            return self.columns[self.included]
        taken = mechanisms.rng(self.key, _STREAM_AUDIT, 1, step).random(self.count) < rate
        return self.columns[self.included & taken]

    def blocks(self, count: int) -> np.ndarray:
        """Each canary's block among ``count`` disjoint blocks, uniform, as a row's is."""
        return mechanisms.rng(self.key, _STREAM_AUDIT, 2, count).integers(0, count, self.count)


def _widen(block: Block, extra: int) -> Block:
    """The block with ``extra`` zero feature columns at the end (norms unchanged)."""
    zeros = np.zeros((len(block), extra))
    return Block(np.hstack([block.features, zeros]), block.labels, block.source, block.row_start,
                 block.sq_norms, block.tag)


# The widened blocks are kept for the run while their total stays under this many bytes (more
# are widened again at every step). Widening every block at every step was ~40% of an audit's
# time (np.hstack of 2,000 rows x 1,005 columns per step: 1.1 of 2.2 s for dpgd at epsilon 4,
# 3.1 of 9.0 s for objective perturbation), and the same copy is made each time.
WIDENED_CACHE_BYTES = 1 << 29


class _Widened:
    """One run's widened blocks (``_widen``), keyed by the block object itself: the entry holds
    the block, so its id cannot pass to another block while the entry lives."""

    def __init__(self, extra: int):
        self.extra, self.entries, self.size = extra, {}, 0

    def __call__(self, block: Block) -> Block:
        entry = self.entries.get(id(block))
        if entry is not None and entry[0] is block:
            return entry[1]
        wide = _widen(block, self.extra)
        if self.size + wide.features.nbytes <= WIDENED_CACHE_BYTES:
            self.entries[id(block)] = (block, wide)
            self.size += wide.features.nbytes
        return wide


class _CanaryStage:
    """A training stage with the canaries injected into its sum, on the widened data."""

    def __init__(self, stage, canaries: Canaries, scores: "_Scores", widen: _Widened):
        self.stage, self.canaries, self.scores, self.widen = stage, canaries, scores, widen

    @property
    def shape(self):
        return self.stage.shape

    @property
    def batch_plan(self):
        return getattr(self.stage, "batch_plan", None)

    def zero_sum(self):
        return base.zero_sum(self.stage)

    def partial_sum(self, block, state):
        return self.stage.partial_sum(self.widen(block), state)

    def selected_sum(self, batch, state):
        return self.stage.selected_sum(self.widen(batch), state)

    def apply(self, state, total):
        inject = getattr(self.stage, "canary_sum", None)
        if inject is not None:
            total = total + inject(state, self.canaries)
            # The ledger releases this stage's canaries enter (None: not declared, so the audit
            # compares with the whole run's epsilon, which is sound but weaker).
            self.scores.releases.append(getattr(self.stage, "canary_releases", None))
        new_state = self.stage.apply(state, total)
        score = getattr(self.stage, "canary_scores", None)
        if score is not None:
            self.scores.add(score(state, new_state, self.canaries))
        return new_state


@dataclasses.dataclass
class _Scores:
    total: np.ndarray
    observed: bool = False
    releases: list = dataclasses.field(default_factory=list)

    def add(self, scores: np.ndarray) -> None:
        self.total = self.total + scores
        self.observed = True


class _CanaryAggregator:
    """The in-process aggregator with the canaries injected into every stage it sums, and into
    the steps the driver sums itself (``driver_stage``)."""

    def __init__(self, inner, canaries: Canaries, scores: _Scores):
        self.inner, self.canaries, self.scores = inner, canaries, scores
        self.widen = _Widened(canaries.count)

    def driver_stage(self, stage):
        return _CanaryStage(stage, self.canaries, self.scores, self.widen)

    def run_stages(self, stages, state):
        return self.inner.run_stages([self.driver_stage(s) for s in stages], state)

    def count(self) -> int:
        return self.inner.count()

    def steps_per_job(self, stage, remaining: int, state=None) -> int:
        return self.inner.steps_per_job(stage, remaining, state)

    def step_batches(self, plan, steps: int, resume=None, keep: bool = False,
                     every_row: bool = False, workers_may_sum: bool = True):
        return self.inner.step_batches(plan, steps, resume, keep, every_row, workers_may_sum)

    def close(self) -> None:
        self.inner.close()


def run(X=None, y=None, *, input=None, canaries: int | None = None,
        confidence: float = 0.95, algorithm: str = "dpgd", model: str = "logistic",
        epsilon: float | None = None, delta: float = 1e-5, noise_multiplier: float | None = None,
        accountant: str = "pld", num_examples: int | None = None,
        count_epsilon: float | None = None, noise: str | None = None,
        num_classes: int | None = None, huber_delta: float | None = None, fit_intercept: bool = True,
        label_column: str = "label", feature_columns=None, seed: int | None = None,
        progress=None, budget_gate=None, **options) -> dict:
    """A one-run audit of a training configuration (the arguments of ``beam_dp.train``): trains
    it once, in-process, with ``canaries`` white-box canaries, and returns the audit report:
    the claimed (epsilon, delta), the empirical lower bound at ``confidence`` and how it was
    found. Nothing else of the run is kept: not its model, not the scores.

    The copy differs from the configuration in three ways, all written in the report: m zero
    feature columns are added (the canaries' own), so that whatever an algorithm derives from
    the number of features d (a default clip or feature norm, a rank) is derived from d + m;
    it runs in-process (``runner="local"``: the sums are the same on every runner, bit for bit
    with secure noise, so this audits the same mechanism); and its blocks are small (each is
    widened by m columns in memory).

    Its output is a function of a training run on the data: it is a release like any model,
    and spends the run's epsilon where the data is private.
    """
    if canaries is None:   # sized by the claim (``default_canaries``)
        canaries = default_canaries(epsilon, delta, confidence)
    canaries = _check_count("canaries", canaries)
    if canaries < 2:
        raise ValueError(f"canaries must be at least 2, got {canaries}")
    _check_delta_confidence(delta, confidence)
    root = mechanisms.secure_seed() if seed is None else seed
    key = mechanisms.stream_key(root, _STREAM_AUDIT) >> 128
    included = mechanisms.rng(key, _STREAM_AUDIT, 0).random(canaries) < 0.5
    scores = _Scores(np.zeros(canaries))
    planted: dict = {}

    def instrument(problem, aggregator):
        planted["canaries"] = Canaries(problem.dim, included, key)
        wider = dataclasses.replace(problem, dim=problem.dim + canaries)
        return wider, _CanaryAggregator(aggregator, planted["canaries"], scores)

    from beam_dp import api
    audited = api._run(
        X, y, input=input, algorithm=algorithm, model=model, epsilon=epsilon, delta=delta,
        noise_multiplier=noise_multiplier, accountant=accountant, num_examples=num_examples,
        count_epsilon=count_epsilon, noise=noise, num_classes=num_classes,
        huber_delta=huber_delta, fit_intercept=fit_intercept, label_column=label_column,
        feature_columns=feature_columns, runner=api.LOCAL, pipeline_args=(),
        batch_rows=_AUDIT_BLOCK_ROWS, seed=None if seed is None else mechanisms.stream_key(
            root, _STREAM_AUDIT + 1) >> 128, progress=progress, options=options,
        instrument=instrument, budget_gate=budget_gate)
    if scores.observed:
        values = scores.total
    else:   # no stage releases its noisy sum before the model (ssp): score the model itself
        values = -audited.result.theta[0, planted["canaries"].columns]
    claimed = audited.ledger.epsilon(delta)
    # The claim the canaries test: the epsilon of the releases they take part in. A canary that
    # changes only those is protected by their composition alone, so comparing with the whole
    # run's epsilon (count, preprocessing included) would hide a leak worth the difference.
    if scores.releases and None not in scores.releases:
        names = {name for declared in scores.releases for name in declared}
        tested_claim = audited.ledger.epsilon_of_releases(names, delta)
    else:
        names, tested_claim = None, claimed
    mechanisms_used = audited.ledger.mechanisms()
    # Secure noise meets (epsilon, delta + its samplers' slack): the test takes the larger delta,
    # so that the slack cannot make a sound run look like a violation.
    tested_delta = delta + sum(m.get("sampler_delta_bound", 0.0) for m in mechanisms_used)
    found = audit_from_scores(values, included, tested_delta, confidence)
    return {
        "algorithm": audited.algorithm.name,
        "model": model,
        "claimed_epsilon": claimed,
        "claimed_delta": delta,
        "canary_releases": sorted(names) if names is not None else "every release of the run",
        "claimed_epsilon_of_canary_releases": tested_claim,
        "relation": audited.algorithm.relation,
        "mechanisms": mechanisms_used,
        **found,
        "verdict": ("consistent: the lower bound is below the claimed epsilon of the releases "
                    "the canaries enter" if found["epsilon_lower_bound"] <= tested_claim else
                    "VIOLATION: the releases the canaries enter leaked more than their claimed "
                    "epsilon allows"),
        "canary_scores_from": ("the noisy sums the steps released" if scores.observed
                               else "the released model"),
        "copy_of_the_configuration": (
            f"{canaries} zero feature columns added, one per canary (options derived from the "
            "number of features are derived from it); trained in-process"),
        "noise_scale_for_tests": mechanisms.NOISE_SCALE_FOR_TESTS,
        "seed": ("fixed by --seed: one audit per seed; auditing again with other seeds until one "
                 "bound is high is a multiple test the confidence does not cover")
                if seed is not None else "OS secure randomness",
    }
