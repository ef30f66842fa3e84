"""Randomly stopped bias-reduced SGD with the subsampled bias-reduced gradient estimator (paper
001, Ghazi, Guzman, Kamath, Kumar & Manurangsi 2024, Algorithms 3 and 4, Lemmas 5.3-5.5; the
note /work/shared/papers/001, §1A "Algorithm 3" and "Algorithm 4", §4.3 "Alg. 3/4 in
data-parallel training", §4.4). A Beam-free numpy core: the per-step data access is "the
per-example gradients of the rows with these indices at x" (``gradients_fn(idx, x)``); the
registered algorithm (``bias_reduced_sgd.BIAS_REDUCED_SGD``, ``beam-dp train --algorithm
bias-reduced-sgd``) routes it through the Aggregator as one stage per step.

The estimator (Algorithm 3). ME is the sparse mean estimator of ``beam_dp.stats`` (Algorithm 1,
the projection mechanism: clip each row, average, add noise calibrated to (epsilon0, delta0),
project onto the l1 ball of radius L sqrt(s)); Gaussian noise by default, Laplace as an option.
With n = |S| and M = floor(log2 n):

1. J ~ TGeom(M): P(J = j) = p_j = C_M 2^-j on {1..M}, C_M = 1 / (1 - 2^-M) (public randomness);
2. B: 2^J indices drawn uniformly without replacement, in random order; O its odd positions,
   E its even positions (2^(J-1) each); z0 one index drawn uniformly, independently of B;
3. G = ME(z0) + (ME(B) - (ME(O) + ME(E)) / 2) / p_J, four ME calls with fresh independent
   noise (the sums are shared: sum_B = sum_O + sum_E).

Halves of a uniform batch are uniform batches of half the size, so E[ME(B) - (ME(O) + ME(E))/2 |
J = j] = mu_j - mu_(j-1), mu_j := E[ME(uniform batch of 2^j)], and dividing by p_J telescopes:
E[G] = mu_0 + (mu_M - mu_0) = E[ME(S)] when n = 2^M: the bias is the full-batch estimator's, at
an expected batch size of C_M M ~ log2 n (tests/test_bias_reduced.py checks it by Monte Carlo,
and that it catches a dropped 1/p_J or a dropped half). If n is not a power of two the top level
is a uniform subset of 2^M >= n/2 rows and E[G] = E[ME(that subset)] (not ME(S)).

The run (Algorithm 4): the levels J_1, J_2, ... are data-independent, so they are drawn ahead
of time (``sample_levels``), the privacy cost of every step is known before any data is touched,
and the number of steps is fixed by a standard accountant (``plan``) instead of the paper's
privacy filter (the note's §1A [IMPL] and §4.3): T is the largest number such that the first
T + 1 steps (the filter's T plus the paper's "one more step") fit the budget. ``run`` makes those
T + 1 projected steps x_t = Proj_X(x_(t-1) - eta G_t) with a constant step size and returns the
average of x_1 .. x_(T+1) (the note's [GUESS] averages x_1 .. x_T; the extra step is paid for,
so its iterate is used). Conditioned on the public levels the run is a fixed adaptive
composition, so composing the steps' events is valid.

Neighbouring relation: replace-one (the paper's), n public. Clipping every row to l2 norm L
(Gaussian; l1 norm L sqrt(s) for Laplace) bounds one replacement's effect on a mean of b rows by
2L / b. The noise multiplier of ME is calibrated once by dp_accounting's PLD under replace-one
(``stats.sparse_mean_noise_scale``: sigma_b = m L / b, whatever b, so every call of every size
is the same (epsilon0, delta0)-DP Gaussian mechanism).

Privacy accounting (``step_event``, ``plan``). One step at level J is the composition of the
triplet (ME(B), ME(O), ME(E)) on a batch of b = 2^J rows sampled without replacement from n, and
ME(z0) on a sample of one. A replaced row enters ME(B) and exactly one of ME(O), ME(E), so on the
batch the triplet is two Gaussian mechanisms (the third call's law does not change) — sharper
than the note's "(2 eps0, 2 delta0)" for the triplet, and the same argument.

* "wor-rdp" (default, Gaussian): each part is dp_accounting's ``SampledWithoutReplacementDpEvent``
  (n, b, ...) under REPLACE_ONE, accounted by dp_accounting's RDP accountant (Wang, Balle &
  Kasiviswanathan 2019, Thm 27). Why not PLD (the project's default): dp_accounting 0.6's PLD
  accountant refuses ``SampledWithoutReplacementDpEvent`` ("Unsupported event"); its REPLACE-
  adjacency subsampled Gaussian PLD is for Poisson sampling, and a PLD for sampling without
  replacement would rest on a dominating pair derived here by hand, which this module does not
  do. RDP is the only dp_accounting accountant that expresses the mechanism. Convention: the
  events carry the calibrated m, in the project's units (against the add/remove sensitivity L / b,
  as dp_accounting's PLD reads it); dp_accounting's RDP reads a GaussianDpEvent under REPLACE_ONE
  against the whole replace-one sensitivity (2L / b here), so the project's RDP accountant
  (``rdp_accountant._RdpAccountant``, which the vectors below are made with) halves the multipliers
  where an event enters it (``rdp_accountant._rdp_replace_one_units``). Checked in the tests: the
  unsampled triplet's RDP epsilon is not below the PLD epsilon of its two calls, as it would be
  read raw.
* "conservative" (the note's Lemma 5.3, Laplace or Gaussian): the triplet's (eps3, delta3) from
  dp_accounting (PLD of the two Gaussians at delta3 = 2 delta0; 2 eps0 pure for Laplace), amplified
  by sampling without replacement under replace-one (Balle, Barthe & Gaboardi 2018, Thm 10:
  log(1 + (b/n)(e^eps3 - 1)), (b/n) delta3), the singleton likewise with b = 1; the steps are
  ``ApproxDpEvent``s composed by the PLD accountant (optimal composition of (eps, delta)-DP
  mechanisms). The amplification is the one formula here that is not dp_accounting's; the
  composition and the epsilon are.

Steps with equal levels have equal events, so the composed event of T steps is a composition of
at most M self-compositions (``composed_event``): "wor-rdp" computes each level's RDP vector once
(by dp_accounting's accountant) and adds them (RDP composition is addition; the conversion is
dp_accounting's ``compute_epsilon``, as its accountant's ``get_epsilon``), so planning thousands
of steps costs a few seconds, most of it the per-level vectors (cached per process).

Small batches (the note's [IMPL] after Lemma 5.4): ``zero_below`` = k makes ME output the
data-independent 0 on batches of fewer than k rows. Unbiasedness survives (the telescoping only
needs the estimator to be a function of the batch size), the zeroed calls cost no privacy (they
are left out of the step's event) and their error is at most L. Default off (k = 1: the paper's
estimator), because the note's threshold (2^j eps0 <~ sqrt(s ln(d/s) ln(1/delta0))) has no
constant: the only certified one (Lemma 3.1's bound <= L^2) zeroes every batch below ~130 rows at
s = 4, d = 200, eps0 = 1, far too pessimistic (that bound is loose 3-5x, the note's §3); choosing
k is left to the caller.

Taken from the note: TGeom(M) on {1..M} with batch 2^J [RECON, §5 item 2], the estimator and its
odd/even halves, the singleton drawn independently of B, the telescoping argument, pre-sampling
the levels and composing with a standard accountant [IMPL], Lemma 5.3's per-step structure and
amplification form [DERIVED], the step size D / (G sqrt(T)) with the note's G^2 [RECON], the
averaged iterate [GUESS]. Reconstructed here: the two-Gaussian triplet, the RDP/WOR accounting and
its multiplier convention, T + 1 as "the filter's T plus one more step" on pre-planned levels,
the non-power-of-two n, the batched (vectorised) ME.

Secrecy: the levels are public; the batches and the noise must stay secret (amplification by
subsampling needs the batch hidden). ``run`` draws all three from separate ChaCha20 streams of
one root seed (``mechanisms.secure_generator``), so publishing the levels reveals nothing else.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable

import dp_accounting
import numpy as np
import scipy.sparse as sp
from dp_accounting import dp_event as events
from dp_accounting.rdp import rdp_privacy_accountant

from beam_dp import accounting, geometry, mechanisms, stats
from beam_dp.accounting import rdp_accountant

STREAM_LEVELS = 61
STREAM_BATCHES = 62
STREAM_NOISE = 63
METHODS = ("wor-rdp", "conservative")

RDP_ORDERS = tuple(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
_RDP_VECTORS: collections.OrderedDict = collections.OrderedDict()
_RDP_VECTORS_SIZE = 1024


# ----------------------------------------------------------------------------- levels: TGeom(M)

def max_level(n: int) -> int:
    """M = floor(log2 n): the top level's batch 2^M is the whole dataset when n is a power of 2."""
    n = int(n)
    if n < 2:
        raise ValueError("the bias-reduced estimator needs n >= 2")
    return n.bit_length() - 1


def truncated_geometric_pmf(M: int) -> np.ndarray:
    """p_j = C_M 2^-j for j = 1..M (index j - 1), C_M = 1 / (1 - 2^-M)."""
    M = int(M)
    if not 1 <= M <= 60:
        raise ValueError("M must be in 1..60")
    return np.exp2(-np.arange(1, M + 1, dtype=np.float64)) / (1.0 - 2.0 ** -M)


def truncated_geometric_levels(count: int, M: int, generator: np.random.Generator) -> np.ndarray:
    """``count`` independent draws of J ~ TGeom(M) (int64 in 1..M), by inverting the CDF."""
    cdf = np.cumsum(truncated_geometric_pmf(M))
    cdf[-1] = 1.0
    u = generator.random(int(count))
    return np.searchsorted(cdf, u, side="right").astype(np.int64) + 1


def sample_levels(seed: int, count: int, n: int) -> np.ndarray:
    """The public levels of a run: ``count`` TGeom(max_level(n)) draws from the run's level stream
    (a ChaCha20 stream of its own, so that publishing them reveals nothing of the others)."""
    return truncated_geometric_levels(count, max_level(n),
                                      mechanisms.secure_generator(seed, STREAM_LEVELS))


# --------------------------------------------------------------------------- ME: Algorithm 1

class MeanEstimator:
    """ME: ``stats``' sparse mean estimator (Algorithm 1) at (epsilon, delta) per call, for batches
    of any size, applied to many batches at once (``estimate``). The noise scale for a batch of b
    rows is ``stats.sparse_mean_noise_scale(variant, b, ...)`` (PLD calibration, replace-one);
    ``estimate`` is ``stats.sparse_mean_release`` row by row (the tests check it to the bit)."""

    def __init__(self, lipschitz: float, sparsity: int, epsilon: float, delta: float,
                 variant: str = "gaussian", zero_below: int = 1):
        if variant not in stats.SPARSE_MEAN_VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(stats.SPARSE_MEAN_VARIANTS)}")
        if not (lipschitz > 0 and math.isfinite(lipschitz)):
            raise ValueError("lipschitz must be a positive number")
        if int(sparsity) < 1:
            raise ValueError("sparsity must be a positive integer")
        if int(zero_below) < 1:
            raise ValueError("zero_below must be a positive integer (1: off)")
        self.lipschitz = float(lipschitz)
        self.sparsity = int(sparsity)
        self.epsilon = float(epsilon)
        self.delta = float(delta)
        self.variant = variant
        self.zero_below = int(zero_below)
        self.clip_order, self.clip_bound = stats.sparse_mean_bound(variant, self.lipschitz,
                                                                   self.sparsity)
        self.radius = self.lipschitz * math.sqrt(self.sparsity)
        self._scales: dict = {}
        _, self.call_event = stats.sparse_mean_noise_scale(
            variant, 1, self.lipschitz, self.sparsity, self.epsilon, self.delta, "pld")

    @property
    def noise_multiplier(self) -> float:
        """Gaussian: m, with sigma_b = m L / b (dp_accounting's PLD convention under replace-one:
        a replacement moves the mean by 2 units of L / b)."""
        if self.variant != "gaussian":
            raise ValueError("the Laplace variant has no noise multiplier")
        return float(self.call_event.noise_multiplier)

    def noise_scale(self, size: int) -> float:
        size = int(size)
        if size not in self._scales:
            self._scales[size] = stats.sparse_mean_noise_scale(
                self.variant, size, self.lipschitz, self.sparsity, self.epsilon, self.delta,
                "pld")[0]
        return self._scales[size]

    def clip(self, rows) -> sp.csr_matrix:
        """The rows clipped as the variant's privacy needs (l2 <= L, or l1 <= L sqrt(s))."""
        return stats.clip_sparse_rows(rows, self.clip_order, self.clip_bound)

    def active(self, size: int) -> bool:
        """Whether ME looks at a batch of this size (else it outputs 0: ``zero_below``)."""
        return int(size) >= self.zero_below

    def estimate(self, sums: np.ndarray, sizes, generator: np.random.Generator) -> np.ndarray:
        """ME on k batches at once: ``sums`` (k, d) their clipped sums, ``sizes`` (k,) their public
        sizes; fresh independent noise for each row (one draw of shape (k, d))."""
        sums = np.asarray(sums, dtype=np.float64)
        sizes = np.asarray(sizes, dtype=np.int64)
        if sums.ndim != 2 or sizes.shape != (sums.shape[0],):
            raise ValueError("sums must be (k, d) and sizes (k,)")
        if np.any(sizes < 1):
            raise ValueError("batch sizes must be positive")
        unique, inverse = np.unique(sizes, return_inverse=True)
        scales = np.array([self.noise_scale(b) for b in unique])[inverse][:, None]
        if self.variant == "gaussian":
            noise = mechanisms.gaussian_noise(generator, sums.shape, scales)
        else:
            noise = generator.laplace(0.0, scales * mechanisms.NOISE_SCALE_FOR_TESTS,
                                      size=sums.shape)
        noisy = sums / sizes[:, None] + noise
        out = geometry.project_l1_ball(noisy, self.radius)
        out[sizes < self.zero_below] = 0.0
        return out


# ------------------------------------------------------------------------ Algorithm 3: the oracle

def combine(singleton, whole, odd, even, probability: float) -> np.ndarray:
    """G = ME(z0) + (ME(B) - (ME(O) + ME(E)) / 2) / p_J (rows: independent draws)."""
    return singleton + (whole - 0.5 * (odd + even)) / probability


def _row_sums(clipped: sp.csr_matrix, index: np.ndarray) -> np.ndarray:
    """(k, d): row i is the sum of the clipped rows index[i, :], by one sparse product."""
    k, h = index.shape
    selection = sp.csr_matrix((np.ones(k * h), index.ravel(), np.arange(0, k * h + 1, h)),
                              shape=(k, clipped.shape[0]))
    return np.asarray((selection @ clipped).toarray(), dtype=np.float64)


class BiasReducedOracle:
    """Algorithm 3 on n examples of dimension ``dim`` with the mean estimator ``estimator``.

    One step (``draw_batch`` then ``estimate``): the caller draws the indices, fetches the
    per-example gradients of those rows (CSR, rows O then E then z0) and gets G. ``sample``: many
    independent G at once on an in-memory gradient matrix (the Monte Carlo checks)."""

    def __init__(self, n: int, dim: int, estimator: MeanEstimator):
        self.n = int(n)
        self.dim = int(dim)
        self.estimator = estimator
        self.max_level = max_level(self.n)
        self.pmf = truncated_geometric_pmf(self.max_level)

    def probability(self, level: int) -> float:
        self._check_level(level)
        return float(self.pmf[int(level) - 1])

    def _check_level(self, level: int) -> None:
        if not 1 <= int(level) <= self.max_level:
            raise ValueError(f"level must be in 1..{self.max_level}")

    def draw_batch(self, level: int, generator: np.random.Generator):
        """(O, E, z0) index arrays: B of 2^J indices uniformly without replacement, in random
        order, O = B[0::2], E = B[1::2]; z0 (one index) uniform, independent of B."""
        self._check_level(level)
        batch = generator.choice(self.n, size=1 << int(level), replace=False, shuffle=True)
        singleton = generator.integers(0, self.n, size=1)
        return batch[0::2], batch[1::2], singleton

    def draw_batches(self, level: int, count: int, generator: np.random.Generator):
        """``count`` independent draws of ``draw_batch``'s law at once: (O (count, h), E (count,
        h), z0 (count,)), B from the first 2^J entries of uniform random permutations (O(n) per
        draw: for Monte Carlo on small n)."""
        self._check_level(level)
        batch = np.argsort(generator.random((int(count), self.n)), axis=1)[:, :1 << int(level)]
        singleton = generator.integers(0, self.n, size=int(count))
        return batch[:, 0::2], batch[:, 1::2], singleton

    def _estimates(self, clipped, odd, even, singleton, level, generator) -> np.ndarray:
        k, h = odd.shape
        sum_odd = _row_sums(clipped, odd)
        sum_even = _row_sums(clipped, even)
        single = np.asarray(clipped[singleton].toarray(), dtype=np.float64)
        stacked = np.concatenate([single, sum_odd + sum_even, sum_odd, sum_even])
        sizes = np.repeat(np.array([1, 2 * h, h, h], dtype=np.int64), k)
        me = self.estimator.estimate(stacked, sizes, generator)
        return combine(me[:k], me[k:2 * k], me[2 * k:3 * k], me[3 * k:],
                        self.probability(level))

    def estimate(self, rows, level: int, generator: np.random.Generator) -> np.ndarray:
        """G (d,) from the per-example gradients ``rows`` (CSR, 2^J + 1 rows: O's, E's, z0's, in
        ``draw_batch``'s order); ``generator`` gives the four ME calls' noise."""
        self._check_level(level)
        h = 1 << (int(level) - 1)
        rows = sp.csr_matrix(rows)
        if rows.shape != (2 * h + 1, self.dim):
            raise ValueError(f"expected {2 * h + 1} rows of dimension {self.dim}")
        local = np.arange(2 * h + 1)
        return self._estimates(self.estimator.clip(rows), local[None, :h], local[None, h:2 * h],
                               local[2 * h:], level, generator)[0]

    def sample(self, gradients, levels, batch_generator: np.random.Generator,
               noise_generator: np.random.Generator) -> np.ndarray:
        """One independent G per entry of ``levels`` (k, d), from the full per-example gradient
        matrix ``gradients`` (n, d), grouped by level (vectorised)."""
        gradients = sp.csr_matrix(gradients)
        if gradients.shape != (self.n, self.dim):
            raise ValueError(f"gradients must be ({self.n}, {self.dim})")
        levels = np.asarray(levels, dtype=np.int64)
        clipped = self.estimator.clip(gradients)
        out = np.empty((levels.size, self.dim))
        for level in np.unique(levels):
            where = np.flatnonzero(levels == level)
            odd, even, singleton = self.draw_batches(int(level), where.size, batch_generator)
            out[where] = self._estimates(clipped, odd, even, singleton, int(level),
                                         noise_generator)
        return out


# ----------------------------------------------------------------------------- privacy accounting

def _method(estimator: MeanEstimator, method: str | None) -> str:
    method = method or ("wor-rdp" if estimator.variant == "gaussian" else "conservative")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}")
    if method == "wor-rdp" and estimator.variant != "gaussian":
        raise ValueError("dp_accounting's SampledWithoutReplacementDpEvent takes Gaussian events "
                         "only: use method='conservative' for the Laplace variant")
    return method


def _touched_calls(level: int, estimator: MeanEstimator) -> tuple[int, bool]:
    """(how many of ME(B), ME(half) look at the data, whether ME(z0) does): the calls a replaced
    row can reach, zeroed calls left out."""
    b = 1 << int(level)
    return (int(estimator.active(b)) + int(estimator.active(b // 2)),
            estimator.active(1))


def step_event(level: int, n: int, estimator: MeanEstimator, method: str | None = None
               ) -> events.DpEvent:
    """The DpEvent of one step at level J, under replace-one with n public (module docstring)."""
    method = _method(estimator, method)
    n = int(n)
    if not 1 <= int(level) <= max_level(n):
        raise ValueError(f"level must be in 1..{max_level(n)}")
    b = 1 << int(level)
    triplet_calls, singleton = _touched_calls(level, estimator)
    parts = []
    if method == "wor-rdp":
        gaussian = events.GaussianDpEvent(estimator.noise_multiplier)   # the project's units
        if triplet_calls:
            inner = gaussian if triplet_calls == 1 else events.ComposedDpEvent(
                [gaussian] * triplet_calls)
            parts.append(events.SampledWithoutReplacementDpEvent(n, b, inner))
        if singleton:
            parts.append(events.SampledWithoutReplacementDpEvent(n, 1, gaussian))
    else:
        if triplet_calls:
            eps3, delta3 = _calls_privacy(estimator, triplet_calls)
            parts.append(_amplified(eps3, delta3, b, n))
        if singleton:
            parts.append(_amplified(*_calls_privacy(estimator, 1), 1, n))
    if not parts:
        return events.NoOpDpEvent()
    return events.ComposedDpEvent(parts)


def _calls_privacy(estimator: MeanEstimator, calls: int) -> tuple[float, float]:
    """(eps, delta) of ``calls`` ME calls that one replaced row reaches, on the batch."""
    if estimator.variant == "laplace":
        return calls * estimator.epsilon, 0.0
    delta = calls * estimator.delta
    gaussian = events.GaussianDpEvent(estimator.noise_multiplier)          # PLD convention
    event = gaussian if calls == 1 else events.ComposedDpEvent([gaussian] * calls)
    return accounting.epsilon_of(event, delta, "pld", accounting.REPLACE_ONE), delta


def _amplified(epsilon: float, delta: float, sample: int, n: int) -> accounting.ApproxDpEvent:
    """Sampling ``sample`` of n without replacement, replace-one (Balle, Barthe & Gaboardi 2018,
    Thm 10)."""
    q = sample / n
    return accounting.ApproxDpEvent(float(math.log1p(q * math.expm1(epsilon))), float(q * delta))


def composed_event(levels, n: int, estimator: MeanEstimator, method: str | None = None
                   ) -> events.DpEvent:
    """The composition of the steps at ``levels``, equal levels grouped (self-compositions)."""
    levels = np.asarray(levels, dtype=np.int64)
    counts = np.bincount(levels, minlength=max_level(n) + 1)
    parts = [events.SelfComposedDpEvent(step_event(j, n, estimator, method), int(c))
             for j, c in enumerate(counts) if c > 0]
    return events.ComposedDpEvent(parts)


def _rdp_vector(event: events.DpEvent) -> np.ndarray:
    """The project's RDP (dp_accounting's, replace-one, RDP_ORDERS) of one event, cached per process (a step's
    parts: its triplet's and its singleton's, the latter shared by every level)."""
    key = repr(event)
    if key not in _RDP_VECTORS:
        acc = rdp_accountant._RdpAccountant(
            list(RDP_ORDERS), neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        acc.compose(event)   # (halves the multipliers into dp_accounting's RDP units)
        _RDP_VECTORS[key] = np.array(acc._rdp, dtype=np.float64)   # the accountant's own sum
        while len(_RDP_VECTORS) > _RDP_VECTORS_SIZE:
            _RDP_VECTORS.popitem(last=False)
    _RDP_VECTORS.move_to_end(key)
    return _RDP_VECTORS[key]


def _step_rdp(level: int, n: int, estimator: MeanEstimator) -> np.ndarray:
    event = step_event(level, n, estimator, "wor-rdp")
    parts = event.events if isinstance(event, events.ComposedDpEvent) else []
    return sum((_rdp_vector(part) for part in parts), np.zeros(len(RDP_ORDERS)))


def composed_epsilon(levels, n: int, delta: float, estimator: MeanEstimator,
                     method: str | None = None, prior: events.DpEvent | None = None) -> float:
    """Epsilon at ``delta`` of the steps at ``levels``, composed after ``prior`` (the releases
    already in the run's ledger, e.g. the quality check's Gaussian reserved before training:
    the steps that fit are those that fit with it), from dp_accounting: "wor-rdp", the sum of
    the per-level RDP vectors (what its RDP accountant composes) through its ``compute_epsilon``
    (what its ``get_epsilon`` returns); "conservative", its PLD accountant."""
    method = _method(estimator, method)
    levels = np.asarray(levels, dtype=np.int64)
    if levels.size == 0:
        return 0.0
    if method == "conservative":
        return accounting.epsilon_of(
            accounting.after(prior, composed_event(levels, n, estimator, method)), delta, "pld",
            accounting.REPLACE_ONE)
    counts = np.bincount(levels, minlength=max_level(n) + 1)
    rdp = np.zeros(len(RDP_ORDERS)) if prior is None else _rdp_vector(prior).copy()
    for j, c in enumerate(counts):
        if c > 0:
            rdp += c * _step_rdp(j, n, estimator)
    return float(rdp_privacy_accountant.compute_epsilon(list(RDP_ORDERS), rdp, delta)[0])


@dataclasses.dataclass
class Plan:
    """The pre-planned run: ``steps`` = T (the filter's T), ``calls`` = T + 1 oracle calls (with
    the paper's one more step), ``levels`` their levels, ``epsilon`` their composed epsilon at
    ``delta``; ``next_epsilon`` that of T + 2 calls (None when ``capped``: every pre-sampled
    level fits, T + 1 = len(levels))."""

    steps: int
    calls: int
    levels: np.ndarray
    epsilon: float
    next_epsilon: float | None
    delta: float
    target_epsilon: float
    method: str
    capped: bool
    event: events.DpEvent


def plan(levels, n: int, epsilon: float, delta: float, estimator: MeanEstimator,
         method: str | None = None, prior: events.DpEvent | None = None) -> Plan:
    """T such that the first T + 1 steps of ``levels`` (pre-sampled, public) compose to at most
    (epsilon, delta) and the first T + 2 do not (or T + 1 = len(levels), ``capped``). Galloping
    and binary search: the composed epsilon grows with the number of steps. ValueError if even
    one step exceeds the budget."""
    method = _method(estimator, method)
    if not (epsilon > 0 and math.isfinite(epsilon)) or not 0 < delta < 1:
        raise ValueError("the budget needs epsilon > 0 and delta in (0, 1)")
    levels = np.asarray(levels, dtype=np.int64)
    if levels.ndim != 1 or levels.size == 0:
        raise ValueError("levels must be a non-empty sequence")
    if np.any(levels < 1) or np.any(levels > max_level(n)):
        raise ValueError(f"levels must be in 1..{max_level(n)}")

    def at(calls: int) -> float:
        return composed_epsilon(levels[:calls], n, delta, estimator, method, prior)

    if at(1) > epsilon:
        raise ValueError("even one step exceeds the budget: lower epsilon0 or raise the budget")
    # Galloping, then bisection: the probes stay near the budget (a PLD far beyond it is slow).
    lo, hi = 1, None                 # at(lo) <= epsilon < at(hi)
    while hi is None and lo < levels.size:
        probe = min(2 * lo, levels.size)
        if at(probe) <= epsilon:
            lo = probe
        else:
            hi = probe
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid) <= epsilon:
            lo = mid
        else:
            hi = mid
    capped = lo == levels.size
    return Plan(steps=lo - 1, calls=lo, levels=levels[:lo].copy(), epsilon=at(lo),
                next_epsilon=None if capped else at(lo + 1), delta=float(delta),
                target_epsilon=float(epsilon), method=method, capped=capped,
                event=composed_event(levels[:lo], n, estimator, method))


# ------------------------------------------------------------------------------ Algorithm 4: run

def theory_learning_rate(diameter: float, n: int, dim: int, estimator: MeanEstimator,
                         calls: int) -> float:
    """eta = D / (G sqrt(calls)), G^2 = L^2 (1 + log2 n sqrt(s ln(d/s) ln(1/delta0)) / eps0): the
    note's §4.4 [RECON] second-moment bound of G (Lemma 5.4, constants dropped)."""
    s, L = estimator.sparsity, estimator.lipschitz
    log_ratio = max(math.log(dim / s), 1.0)
    g2 = L * L * (1.0 + math.log2(n) * math.sqrt(s * log_ratio * math.log(1.0 / estimator.delta))
                  / estimator.epsilon)
    return diameter / math.sqrt(g2 * calls)


@dataclasses.dataclass
class RunResult:
    average: np.ndarray           # the average of x_1 .. x_calls: the output
    last: np.ndarray
    calls: int
    levels: np.ndarray
    iterates: np.ndarray | None   # (calls, d) when asked for


def run(gradients_fn: Callable[[np.ndarray, np.ndarray], object], x0, steps: int,
        learning_rate: float, projection, *, levels, n: int, estimator: MeanEstimator,
        seed: int, keep_iterates: bool = False) -> RunResult:
    """Algorithm 4 with the pre-planned T = ``steps`` (``plan(...).steps``): T + 1 projected
    steps x_t = Proj(x_(t-1) - eta G_t), G_t the oracle at level ``levels[t-1]``, on an in-memory
    dataset of n rows. ``gradients_fn(idx, x)``: the per-example gradients (CSR, one row per
    index, in order, repeats allowed) of the rows ``idx`` at x. ``projection``: a callable, a
    ``geometry.Constraint``, or None (R^d); x0 should lie in X (it is not projected). Step t's
    batch and noise come from the ChaCha20 streams (STREAM_BATCHES, t) and (STREAM_NOISE, t) of
    ``seed``; ``levels`` from ``sample_levels`` with another seed or stream, public."""
    x = np.array(x0, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError("x0 must be a vector")
    if projection is None:
        project = np.array
    elif isinstance(projection, geometry.Constraint):
        project = projection.project
    else:
        project = projection
    calls = int(steps) + 1
    levels = np.asarray(levels, dtype=np.int64)
    if steps < 0 or levels.size < calls:
        raise ValueError("steps must be >= 0 and levels must hold steps + 1 levels")
    if not (learning_rate > 0 and math.isfinite(learning_rate)):
        raise ValueError("learning_rate must be a positive number")
    oracle = BiasReducedOracle(n, x.size, estimator)
    total = np.zeros_like(x)
    iterates = np.empty((calls, x.size)) if keep_iterates else None
    for t in range(calls):
        level = int(levels[t])
        odd, even, singleton = oracle.draw_batch(
            level, mechanisms.secure_generator(seed, STREAM_BATCHES, t))
        rows = gradients_fn(np.concatenate([odd, even, singleton]), x)
        g = oracle.estimate(rows, level, mechanisms.secure_generator(seed, STREAM_NOISE, t))
        x = np.asarray(project(x - learning_rate * g), dtype=np.float64).reshape(x.shape)
        total += x
        if keep_iterates:
            iterates[t] = x
    return RunResult(average=total / calls, last=x, calls=calls, levels=levels[:calls].copy(),
                     iterates=iterates)
