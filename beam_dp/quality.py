"""A private check of a trained model against the best constant predictor on the training data.

Issue 15: no run that ends with exit code 0 may write a model worse than a constant predictor
on the training distribution without saying so. The check is one more stage over the training
data, through the run's own Aggregator, after training: per-row bounded quantities summed
exactly and released with Gaussian noise (a ``GaussianDpEvent`` under the run's neighbouring
relation, whose L2 sensitivity is derived below: under add/remove the bound on one row's vector,
under replace-one that of the change of one row's vector). Its noise depends on public
constants only, so its event goes into the ledger *before* training (``reserve``): every
algorithm that calibrates its noise against the releases already in the ledger then meets the
run's total (epsilon, delta) with the check included.

What is released (``QualityStage``; every figure a DP release, never an exact value):

* classifiers (logistic, hinge, softmax): per row the vector [c, e_y], e_y the one-hot of the
  label among the K classes (K = 2 for binary) and c in [0, 1] the model's score on the row:
  for logistic and softmax 1 - B / 2, B = sum_k (p_k - [k = y])^2 in [0, 2] the Brier score of
  its class probabilities (a proper scoring rule: a model that ranks a 3% class well but never
  predicts it still beats the constant, which an error rate did not see: ISLR Default's 0.95-AUC
  models were "not better" by error rate, held-out data included); for hinge (no
  probabilities) c = 1 if its prediction is the label. Its L2 norm is at most sqrt(1 + 1) =
  sqrt(2), so adding or removing one row moves the sum by at most sqrt(2): noise std per
  coordinate tau = m sqrt(2) for multiplier m. From the noisy sums C and N_k (class counts):
  n = sum N_k, the model's error n - C (half its Brier sum, or its errors), and the best
  constant's: for Brier the class frequencies pi_k = N_k / n, whose half Brier sum is
  (n - sum_k N_k^2 / n) / 2; for hinge the noisy majority class k*, n - N_k*.
* regression (linear, huber): labels and predictions clamped to [-L, L] (L public:
  ``label_bound``), a = clamp(y), p = clamp(y_hat). Per row [(p^2 - 2 a p) / (3 L^2), a / L,
  a^2 / L^2]: p^2 - 2ap lies in [-L^2, 3 L^2], so each coordinate lies in [-1, 1] and the row's
  L2 norm is at most sqrt(3): tau = m sqrt(3). With the sums Q, S1, S2 (in those units) and the
  run's n (public, or its released count): the model's squared error sum (a - p)^2 = 3 L^2 Q +
  L^2 S2, the best constant's (the mean of a) L^2 S2 - L^2 S1^2 / n. Clamping both sides is a
  1-Lipschitz projection, so the model's clamped error never exceeds its true error against the
  clamped labels.

Under replace-one (the relation of mirror-descent, heavy-tailed-md, objective-perturbation,
bias-reduced-sgd, output-perturbation) the event is recorded under the run's own relation (one
ledger, one relation), and the noise is set for a replaced row: one row's vector v becomes any
other v', the sum moves by v' - v. dp_accounting reads a replace-one ``GaussianDpEvent(m)`` as
noise std m against a unit where a replacement moves the sum by at most 2 units (PLD's REPLACE
adjacency, sensitivity 2; this library's RDP path halves the multiplier to match:
``rdp_accountant._rdp_replace_one_units``), so the noise std is m x (the bound on ||v' - v|| / 2):

* classifiers: v' - v = [c' - c, e_y' - e_y]; |c' - c| <= 1 and ||e_y' - e_y||^2 <= 2 (two
  one-hots differ in at most two places), so ||v' - v|| <= sqrt(3) (attained: a correct row
  replaced by a wrong one of another class), unit sqrt(3) / 2 ~ 0.87 (against sqrt(2) ~ 1.41
  under add/remove: a replacement needs less than twice the add/remove bound here).
* regression (in units of L, a, p in [-1, 1]): v = [(p^2 - 2ap) / 3, a, a^2]. The first
  coordinate lies in [-1/3, 1] (p^2 - 2ap >= p^2 - 2|p| >= -1), so its change is at most 4/3.
  The other two change by (s, s t) with s = a' - a, t = a' + a, |s| + |t| = 2 max(|a|, |a'|)
  <= 2: s^2 (1 + t^2) <= f(s) = s^2 (1 + (2 - s)^2) on [0, 2], whose derivative 2s (2s^2 - 6s
  + 5) is >= 0 (no real root of the quadratic), so at most f(2) = 4. Hence ||v' - v||^2 <= 16/9
  + 4 = 52/9, attained at (a, p) = (1, -1) replaced by (-1, -1): ||v' - v|| <= sqrt(52) / 3 ~
  2.40 (not 2 sqrt(3) ~ 3.46), unit sqrt(13) / 3 ~ 1.20 (against sqrt(3) ~ 1.73).

``sensitivity(loss, relation)`` is that unit; the stage's noise std is m times it.

How the replace-one algorithms leave room for it (each used to calibrate to the whole (epsilon,
delta) alone): they calibrate against the ledger, as the add/remove ones do, rather than to a
hand split (epsilon - share, delta - its share), because a split charges the check at basic
composition while dp_accounting's PLD composition of a small Gaussian costs far less (the
algorithms' noise rises by 0.2-0.8 percent, docs/benchmarks/privacy-features.md). ``accounting.prior_event`` is what the
ledger holds when training starts (the check's release), and each calibration measures
``accounting.after(prior, its own event)``: mirror-descent's steps, objective-perturbation's and
output-perturbation's output Gaussian (the objective's (eps1, delta1) stays the paper's split),
bias-reduced-sgd's plan of steps. heavy-tailed-md's one release is an (eps, delta_gg)
``ApproxDpEvent``, which cannot share delta unless told to: delta_gg is a share of delta
(``heavy_tailed_md.PRIOR_DELTA_SHARES``, the one needing least noise), the rest the check's. The
reported epsilon is the ledger's, by dp_accounting; tests check it is within the target.

The rule (``verdict``), on the noisy figures and the std of their noise (the delta method for
the regression's S1^2 / n term; the error of a released n and the noisy choice of k* are not
in the std), three outcomes and a refusal: "better" when (constant's error - model's error) is
above VERDICT_Z standard deviations, "worse" (a warning) when it is below -VERDICT_Z, and
"inconclusive" in between, or when the noise is too large against the data size to say
anything (INFORMATIVE): recorded with its noise level, never a warning, since a model as good as
the constant and a good model on a rare class (ISLR Default: 3% positives, the constant's error
small) land there alike, and a warning on them taught users to ignore the ones that mattered
(52 of 55 runs warned). "much worse" (the run stops, writing no model) when (model's error -
MUCH_WORSE x constant's error) is above MUCH_WORSE_Z standard deviations. A model with
non-finite coefficients is refused before any check (``check_finite``).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from dp_accounting import dp_event as events

from beam_dp import accounting, features, losses, mechanisms, stats, storage, user_level
from beam_dp.algorithms import spec


def sensitivity(loss: losses.GlmLoss, relation: str = accounting.ADD_REMOVE) -> float:
    """The L2 sensitivity of one row's vector in the units its ``GaussianDpEvent`` is read in
    under ``relation`` (module docstring): add/remove the bound on ||v||, and the same for one
    user, whose rows' vectors are averaged into one (``QualityStage.partial_sum``); replace-one
    half the bound on ||v' - v||."""
    if relation == accounting.REPLACE_ONE:
        return math.sqrt(3.0) / 2.0 if loss.is_classifier else math.sqrt(13.0) / 3.0
    return math.sqrt(2.0) if loss.is_classifier else math.sqrt(3.0)

# The check's default share of epsilon: its noise multiplier is calibrated (dp_accounting) so
# that it alone would cost this share; the algorithm's calibration then fits the rest around it.
QUALITY_SHARE = 0.05
# Regression: the public bound L labels and predictions are clamped to, where the algorithm
# declares none (ssp's --label-bound is used where it exists).
DEFAULT_LABEL_BOUND = 4.0
# A verdict asks for this many noise std: "better" above +Z, "worse" below -Z, "inconclusive"
# between. A model at least as good as the constant is called worse with probability <= 2.3%
# (the Gaussian tail below -2 std), one exactly as good called better as rarely.
VERDICT_Z = 2.0
MUCH_WORSE = 4.0       # "much worse": an error above 4x the constant's
# Under the assumed DEFAULT_LABEL_BOUND, "much worse" stands unless the labels' noisy mean of
# a^2 / L^2 passes this: 1 when all are clamped to the bound (raw prices), so above 0.9 most
# labels sit at or near it (at least 72% with |a| >= 0.8 L); labels inside it, even close (3.5
# of 4: 0.77), keep the refusal: judged
ASSUMED_BOUND_FIT = 0.9
# A refusal costs the run its model, so it asks for more evidence than a warning: a model at
# exactly 4x the constant's error is refused with probability ~0.13%.
MUCH_WORSE_Z = 3.0
# Below this many rows per unit of noise the figures say nothing (and the normalizations by a
# noisy n leave their linear range): the check is "inconclusive" when the noise std of the
# model's per-row error passes this share of that error's range (1 for an error rate, 4 L^2
# for a clamped squared error). At epsilon 1 and the default share that is about n < 1,500.
INFORMATIVE = 0.1
RELEASE = "gaussian_model_quality_sums"
_STREAM = 31          # stats stream of the check's noise (other stages use 0-13)


@dataclasses.dataclass
class QualityOptions:
    """The check's options (flags of ``beam-dp train``, keywords of ``beam_dp.train``)."""

    quality_check: str = spec.option(
        "on", "on: warn when the model is not better than the constant, stop without "
              "writing it when much worse; off: skip the check",
        choices=("on", "off"))
    quality_epsilon: float | None = spec.option(
        None, "the check's share of epsilon (within the total); default epsilon / 20, "
              "or the run's noise multiplier with --noise-multiplier",
        low=0, low_open=True)
    quality_label_bound: float | None = spec.option(
        None, "regression: the bound L the check clamps labels and predictions to (the "
              "labels' scale); default the algorithm's --label-bound, else 4",
        low=0, low_open=True)

    def check(self) -> None:
        # Applied or refused, never dropped: the check's options do nothing with the check off.
        if self.quality_check == "off" and (self.quality_epsilon is not None
                                            or self.quality_label_bound is not None):
            raise ValueError("--quality-epsilon and --quality-label-bound set the private quality "
                             "check: leave them out with --quality-check off")


class ModelQualityError(RuntimeError):
    """The trained model is unusable (non-finite coefficients, or privately much worse than a
    constant predictor): no model is written. The message holds public and noisy figures only."""


def check_finite(theta: np.ndarray) -> None:
    if not np.all(np.isfinite(theta)):
        raise ModelQualityError(
            "the trained coefficients are not finite (the optimizer diverged); no model was "
            "written: lower the learning rate or the clip norm, scale the features "
            "(--scale-features auto or --feature-norm), or give more epsilon")


def _classes(loss: losses.GlmLoss) -> int:
    return loss.outputs() if loss.name == "softmax" else 2


def probabilistic(loss: losses.GlmLoss) -> bool:
    """Classifiers judged by the Brier score of their class probabilities (hinge has none)."""
    return loss.name in ("logistic", "softmax")


def brier(loss: losses.GlmLoss, s: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per row sum_k (p_k - [k = y])^2, in [0, 2], of the model's probabilities from scores s."""
    if loss.name == "logistic":
        return 2.0 * (losses.expit(s[:, 0]) - truth) ** 2
    p = losses.softmax(s, axis=1)
    return (p * p).sum(axis=1) - 2.0 * p[np.arange(len(truth)), truth] + 1.0


THETA = "quality_theta"   # the state's key for the checked model's coefficients


def initial_state(theta) -> dict:
    """The check job's initial state: the model it checks."""
    return {THETA: np.array(theta, dtype=np.float64)}


@dataclasses.dataclass(frozen=True)
class QualityStage:
    """The check's sums (module docstring) with Gaussian noise: writes ``state[key]``, the
    noisy sums in the units of the docstring. The model's coefficients come in the state
    (``state[THETA]``, ``initial_state``), not in the stage: a job carries its state as a file
    when it is large (a model hashed to 2^20 columns made a 21.9 MB Dataflow job graph, over
    Dataflow's 10 MB). ``transform`` (the model's recorded feature map) and the coefficients are
    the released model: public."""

    loss: losses.GlmLoss
    transform: dict | None
    noise_multiplier: float
    seed: int
    label_bound: float | None = None   # L (regression only)
    stream: tuple = (_STREAM,)
    noise: str = "float"    # "secure": exact sum on a grid, discrete Gaussian (stats.mean_grid)
    key: str = "quality"
    relation: str = accounting.ADD_REMOVE   # the run's neighbouring relation (``sensitivity``)

    @property
    def columns(self) -> int:
        return 1 + _classes(self.loss) if self.loss.is_classifier else 3

    @property
    def shape(self):
        return (self.columns,)

    @property
    def sensitivity(self) -> float:
        """The L2 sensitivity of one row's vector under the run's relation (module docstring)."""
        return sensitivity(self.loss, self.relation)

    def zero_sum(self):
        return stats.stages.zeros_for(self.noise, self.shape)

    def rows(self, block, theta: np.ndarray) -> np.ndarray:
        s = losses.scores(theta, features.from_spec(self.transform)(block).features)
        if self.loss.is_classifier:
            k = _classes(self.loss)
            truth = ((block.labels > 0).astype(np.int64) if self.loss.name in ("logistic", "hinge")
                     else np.asarray(block.labels, dtype=np.int64))
            out = np.zeros((len(truth), 1 + k))
            out[:, 0] = (1.0 - brier(self.loss, s, truth) / 2.0 if probabilistic(self.loss)
                         else self.loss.predict(s) == truth)
            out[np.arange(len(truth)), 1 + truth] = 1.0
            return out
        # In units of L (a / L and p / L in [-1, 1]): no square of a large L is formed.
        bound = float(self.label_bound)
        a = np.clip(block.labels / bound, -1.0, 1.0)
        p = np.clip(s[:, 0] / bound, -1.0, 1.0)   # (clip maps +-inf scores to +-1)
        return np.column_stack([(p * p - 2.0 * a * p) / 3.0, a, a * a])

    def partial_sum(self, block, state):
        rows = self.rows(block, state[THETA])
        if self.relation == accounting.USER_ADD_REMOVE:
            # One user holds up to K rows (user_level.bound_rows): summed per row, a user would
            # move the sums by K times one row's bound. Each user's rows' vectors are averaged
            # instead (the blocks are grouped by user, no user spans two), one vector of at most
            # a row's norm per user, and the verdict's n is the (noisy) number of users.
            rows = user_level.per_user_means(rows, block.users)
        if self.noise == "secure":
            return stats.stages._secure_row_sum(rows, self.sensitivity, self.noise_multiplier)
        return rows.sum(axis=0)

    def apply(self, state, total):
        if self.noise == "secure":
            noisy = stats.stages._secure_noisy_sum(self, total, self.sensitivity, self.columns)
        else:
            noisy = total + mechanisms.gaussian_noise(stats.stages._rng(self), total.shape,
                                                      self.noise_multiplier * self.sensitivity)
        return {**state, self.key: np.asarray(noisy, dtype=np.float64)}

    def releases(self):
        params = {"noise_multiplier": self.noise_multiplier, "sensitivity": self.sensitivity,
                  "sums": ("[model 1 - Brier / 2, class counts]" if probabilistic(self.loss)
                           else "[model correct, class counts]" if self.loss.is_classifier else
                           "[(p^2 - 2ap) / 3L^2, a / L, a^2 / L^2], a and p the label and "
                           "prediction clamped to [-L, L]"),
                  "purpose": "the model-quality check against a constant predictor"}
        if self.relation == accounting.REPLACE_ONE:   # (add/remove's entries as they were)
            params["neighbouring"] = self.relation
        # (No label bound here: this entry is written when the check is reserved, before train
        # knows the label's range; the report's quality_check holds the L it used, and the
        # noise does not depend on it.)
        if self.noise == "secure":
            params.update(noise=stats.SECURE_MEAN_NOISE,
                          sampler_total_variation=stats.mean_sampler_variation(self.columns))
        else:
            params["noise"] = "float Gaussian (numpy)"
        return [(RELEASE, events.GaussianDpEvent(self.noise_multiplier), 1, params)]


@dataclasses.dataclass
class Check:
    """A reserved check: its noise and bound, fixed before training."""

    noise_multiplier: float
    label_bound: float | None
    noise: str
    epsilon_share: float | None   # the epsilon it was calibrated to alone (None: --noise-multiplier)
    relation: str = accounting.ADD_REMOVE   # the ledger's: the event's and the noise's relation
    # True while a regression's L is DEFAULT_LABEL_BOUND, a guess rather than a public fact about
    # the labels (train replaces it by the label's declared or released range where there is one)
    bound_assumed: bool = False

    def with_label_range(self, label_range) -> "Check":
        """The check with L taken from the label's declared or released range (public): the
        labels' own scale, no longer an assumed one. Its noise does not depend on L (the sums
        are normalized by it), so the reserved release stands."""
        return dataclasses.replace(self, label_bound=float(max(abs(v) for v in label_range)),
                                   bound_assumed=False)

    def stage(self, loss, transform, seed: int) -> QualityStage:
        return QualityStage(loss, transform, self.noise_multiplier, stats.stages_seed(seed), self.label_bound,
                            noise=self.noise, relation=self.relation)


SAVED = "quality.json"


def _fingerprint(theta: np.ndarray, check: Check) -> str:
    import hashlib
    digest = hashlib.sha256(np.ascontiguousarray(theta, dtype=np.float64).tobytes())
    digest.update(repr((check.noise_multiplier, check.label_bound, check.noise)).encode())
    if check.relation == accounting.REPLACE_ONE:   # (add/remove's fingerprints as they were)
        digest.update(check.relation.encode())
    return digest.hexdigest()


def load_saved(directory: str | None, theta: np.ndarray, check: Check) -> np.ndarray | None:
    """The check's noisy sums saved in a checkpoint directory for this very model and check
    (a run resumed after it finished: the data is not read again, nor the release repeated)."""
    if not directory:
        return None
    import json
    path = storage.join(directory, SAVED)
    if not storage.exists(path):
        return None
    saved = json.loads(storage.read_bytes(path))
    if saved.get("fingerprint") != _fingerprint(theta, check):
        return None
    return np.asarray(saved["noisy_sums"], dtype=np.float64)


def save(directory: str | None, theta: np.ndarray, check: Check, noisy: np.ndarray) -> None:
    """Beside the checkpoint: the noisy sums (a DP release, as the checkpointed state is)."""
    if not directory:
        return
    import json
    text = json.dumps({"fingerprint": _fingerprint(theta, check),
                       "noisy_sums": [float(v) for v in np.ravel(noisy)]})
    storage.write_bytes(storage.join(directory, SAVED), text.encode())


@dataclasses.dataclass
class RunCheck:
    """A reserved check as one run makes it. Its bound L becomes the run's label range (released
    or declared) where L was only assumed (``fixed_bound`` False: no --quality-label-bound, no
    algorithm's own label bound). Its release comes from the last training job where the
    algorithm ran it there (``final_check``, for ``spec.Problem.final_check``), else from beside
    the checkpoint (a run resumed after it finished), else from a job of its own (``release``)."""

    check: Check
    loss: losses.GlmLoss
    seed: int
    fixed_bound: bool
    _fused: dict = dataclasses.field(default_factory=dict)

    def labelled(self, label_range) -> Check:
        if self.check.label_bound is not None and label_range and not self.fixed_bound:
            return self.check.with_label_range(label_range)
        return self.check

    def final_check(self, transform, label_range):
        """(the stage, its state from the model's coefficients), to run after the last step."""
        check = self.labelled(label_range)
        stage = check.stage(self.loss, transform, self.seed)
        self._fused.update(check=check, stage=stage)
        return stage, initial_state

    def release(self, result, aggregator, checkpoint_dir: str | None) -> tuple[Check, np.ndarray]:
        """(the check as it ran, its noisy sums) for ``result``'s model, released once."""
        label_range = (getattr(result, "preprocessing", None) or {}).get("label_range")
        check, released = self.labelled(label_range), getattr(result, "final_release", None)
        if released is not None:
            if not np.array_equal(released[THETA], result.theta):
                # (never run again: the reserved release is charged once)
                raise RuntimeError("the quality check ran on another model (a bug)")
            check, noisy = self._fused["check"], released[self._fused["stage"].key]
        else:
            noisy = load_saved(checkpoint_dir, result.theta, check)
            if noisy is not None:
                return check, noisy
            stage = check.stage(self.loss, result.feature_transform, self.seed)
            noisy = aggregator.run_stages([stage], initial_state(result.theta))[stage.key]
        save(checkpoint_dir, result.theta, check, noisy)
        return check, noisy


def reserve(ledger: accounting.Ledger, loss: losses.GlmLoss, privacy, *, epsilon: float | None,
            label_bound: float | None, secure: bool) -> Check:
    """The check's noise (from public constants only), recorded in ``ledger`` before training.
    ``epsilon``: its share (default QUALITY_SHARE of the run's epsilon); with a noise multiplier
    instead of an epsilon, that multiplier unless ``epsilon`` is given."""
    if epsilon is not None and not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError("quality_epsilon (--quality-epsilon) must be a positive number")
    if privacy.epsilon is not None:
        share = epsilon if epsilon is not None else QUALITY_SHARE * privacy.epsilon
        if share >= privacy.epsilon:
            raise ValueError(f"--quality-epsilon {share:g} leaves nothing of epsilon "
                             f"{privacy.epsilon:g} for training")
    else:
        share = epsilon
    if share is not None:
        multiplier = accounting.calibrate_noise_multiplier(
            lambda m: events.GaussianDpEvent(m), share, privacy.delta, privacy.accountant,
            ledger.neighbouring, guess=math.sqrt(2.0 * math.log(1.25 / privacy.delta)) / share,
            slope=-1.0)
    else:
        multiplier = float(privacy.noise_multiplier)
    bound = None
    if not loss.is_classifier:
        bound = float(label_bound if label_bound is not None else DEFAULT_LABEL_BOUND)
        if not (bound > 0 and math.isfinite(bound) and bound <= 1e150):
            raise ValueError("quality_label_bound (--quality-label-bound) must be in (0, 1e150]")
    # The ledger's relation is the run's (one ledger composes one relation): the event is
    # recorded under it, and the stage's noise is scaled for it (``sensitivity``).
    check = Check(multiplier, bound, "secure" if secure else "float", share, ledger.neighbouring,
                  bound_assumed=not loss.is_classifier and label_bound is None)
    # The noise is decided here: only the stage's shape and bound matter to its releases.
    probe = QualityStage(loss, None, multiplier, 0, bound,
                         noise=check.noise, relation=check.relation)
    if check.noise == "secure":
        stats.mean_grid(probe.sensitivity, multiplier, probe.columns)   # refuses an odd multiplier
    stats.record_releases([probe], ledger)
    return check


def _std(tau: float, gradient) -> float:
    # The norm of the gradient scaled by its largest entry: its entries reach 3 L^2 (3e300 at
    # the largest --quality-label-bound, 1e150), whose squares overflow, and np.linalg.norm
    # squares them (the std was inf, written as Infinity into privacy_report.json).
    g = np.asarray(gradient, dtype=np.float64)
    top = float(np.max(np.abs(g))) if g.size else 0.0
    return float(tau * top * np.linalg.norm(g / top)) if top > 0 else 0.0


def judged(loss, noisy, check, n: float, over: str) -> dict:
    """``verdict`` on the check's released sums (``n`` the released count of rows, or users),
    with what the report says of them; ``over``: which rows were summed, in words."""
    checked = verdict(loss, noisy, check.noise_multiplier, check.label_bound, n, check.relation)
    if check.bound_assumed:
        # Labels clamped to an assumed [-4, 4] say nothing of a model of labels in the thousands
        # (dp-ambssgd on raw diamonds, RMSE 2,223 against the constant's 3,989, was refused as
        # "much worse": its labels all clamp to 4, and any prediction below 4 looks far off).
        # The released mean of a^2 / L^2 (a the clamped label) tells them apart: near 1 when
        # the labels pile up at the bound, small when they fit inside it and the clamp is
        # harmless (a diverged model of such labels is still refused). Post-processing.
        piled = float(np.asarray(noisy)[2]) / max(float(n), 1.0) > ASSUMED_BOUND_FIT
        if piled and checked["status"] == "much_worse":
            checked["status"] = "worse"
        checked["label_bound_assumed"] = (
            f"labels and predictions clamped to an assumed [-{check.label_bound:g}, "
            f"{check.label_bound:g}] (no declared or released label range)"
            + ("; the labels pile up at it, so the model is not refused on it" if piled else "")
            + ": give --quality-label-bound, a public bound on |label|")
    checked.update(
        covered_by_privacy_guarantee=True,
        note=(f"noisy sums over {over}: DP releases ({RELEASE} in the ledger), counted in the "
              "run's epsilon; never exact values"),
        noise_multiplier=check.noise_multiplier, epsilon_share=check.epsilon_share,
        noise=check.noise)
    if check.label_bound is not None:
        checked["label_bound"] = check.label_bound
    checked["summary"] = summary_text(checked)
    return checked


def verdict(loss: losses.GlmLoss, noisy: np.ndarray, noise_multiplier: float,
            label_bound: float | None, n: float,
            relation: str = accounting.ADD_REMOVE) -> dict:
    """The report of the check from its noisy sums (post-processing only): the figures with
    their noise std, and ``status``: "better", "inconclusive", "worse" or "much_worse"."""
    noisy = np.asarray(noisy, dtype=np.float64)
    if loss.is_classifier:
        tau = noise_multiplier * sensitivity(loss, relation)
        correct, counts = noisy[0], noisy[1:]
        k = len(counts)
        n = max(float(counts.sum()), 1.0)   # the noisy class counts' sum
        model_err = n - correct
        g_model = [-1.0] + [1.0] * k                                   # d/d(C, N_0..N_K-1)
        if probabilistic(loss):
            share = np.clip(counts / n, 0.0, 1.0)   # the noisy class frequencies
            squares = float(np.sum(share * share))
            const_err = (n - n * squares) / 2.0
            g_const = [0.0] + [(1.0 - 2.0 * share[j] + squares) / 2.0 for j in range(k)]
            what = ("Brier score / 2 (squared distance of the class probabilities from the "
                    "label's, in [0, 1])")
        else:
            top = int(np.argmax(counts))
            const_err = n - counts[top]
            g_const = [0.0] + [0.0 if j == top else 1.0 for j in range(k)]
            what = "error rate (share of rows misclassified)"
        span = 1.0
    else:
        L2 = float(label_bound) ** 2
        tau = noise_multiplier * sensitivity(loss, relation)
        q, s1, s2 = noisy
        n = max(float(n), 1.0)
        mean = float(np.clip(s1 / n, -1.0, 1.0))   # (the clamped labels' mean lies in [-1, 1] L)
        model_err = 3.0 * L2 * q + L2 * s2
        const_err = L2 * s2 - L2 * s1 * s1 / n
        g_model = [3.0 * L2, 0.0, L2]
        g_const = [0.0, -2.0 * L2 * mean, L2]
        what = f"mean squared error, labels and predictions clamped to [-{label_bound:g}, {label_bound:g}]"
        span = 4.0 * L2
    g_model, g_const = np.array(g_model), np.array(g_const)
    gain = const_err - model_err
    gain_std = _std(tau, g_const - g_model)
    worse = model_err - MUCH_WORSE * const_err
    worse_std = _std(tau, g_model - MUCH_WORSE * g_const)
    if _std(tau, g_model) / n > INFORMATIVE * span:
        status = "inconclusive"
    elif worse > MUCH_WORSE_Z * worse_std:
        status = "much_worse"
    elif gain < -VERDICT_Z * gain_std:
        status = "worse"
    elif gain > VERDICT_Z * gain_std:
        status = "better"
    else:
        status = "inconclusive"
    return {
        "status": status,
        "metric": what,
        "model": {"value": float(model_err / n), "noise_std": _std(tau, g_model) / n},
        "constant": {"value": float(const_err / n), "noise_std": _std(tau, g_const) / n,
                     "predictor": ("the noisy class frequencies" if probabilistic(loss) else
                                   "the noisy majority class" if loss.is_classifier else
                                   "the mean clamped label")},
        "constant_minus_model": {"value": float(gain / n), "noise_std": gain_std / n},
        "rule": (f"better when constant_minus_model > {VERDICT_Z:g} noise std, worse when it is "
                 f"below -{VERDICT_Z:g}, inconclusive between (or when the model's per-row noise "
                 f"std passes {INFORMATIVE:g} of its range); much worse (no model written) when "
                 f"the model's error exceeds {MUCH_WORSE:g}x the constant's by more than "
                 f"{MUCH_WORSE_Z:g} noise std"),
        "rows": float(n),
        "neighbouring": relation,
        "sensitivity": sensitivity(loss, relation),
    }


def advice(values: dict | None) -> str:
    """What to try after a model no better than a constant, from the run's public options
    (the privacy report's ``hyperparameters.values``): it used to suggest --scale-features auto
    to every run, though that is dpgd's and dpsgd's default and other algorithms have no such
    flag."""
    values = values or {}
    scale = values.get("scale_features")
    if scale is None:
        columns = "standardized columns (public bounds, or beam-dp stats)"
    elif scale == "none":
        columns = "--scale-features auto or declared column ranges (the schema's bounds)"
    else:
        columns = "declared column ranges (the schema's bounds)"
    knobs = ("another --clip-norm or learning rate" if "clip_norm" in values
             else "other options (beam-dp algorithms)")
    return f"try {columns}, {knobs}, or more epsilon"


def warning_text(report: dict, values: dict | None = None) -> str:
    """The stderr line of a model worse than a constant (noisy figures and stds only);
    ``values``: the run's public options, for ``advice``."""
    model, const = report["model"], report["constant"]
    return (f"the model is worse than a constant predictor on the training data by the "
            f"private quality check ({report['metric']}: model {model['value']:.4g}, constant "
            f"{const['value']:.4g}, each a DP release with noise std about "
            f"{report['constant_minus_model']['noise_std']:.2g} on their difference): "
            f"{advice(values)}"
            + (f"; the {report['label_bound_assumed']}" if report.get("label_bound_assumed")
               else ""))


def summary_text(report: dict) -> str:
    """The check's outcome in one neutral sentence, for the report (noisy figures only)."""
    status, model = report.get("status"), report.get("model") or {}
    if status == "better":
        return "better than the constant predictor (beyond the noise)"
    if status == "inconclusive":
        return (f"inconclusive at this budget: the difference from the constant predictor is "
                f"within the noise (std about {report['constant_minus_model']['noise_std']:.2g} "
                f"on the {report['metric']}, {model.get('noise_std', 0):.2g} on the model's); "
                "more rows or a larger --quality-epsilon would tell")
    if status == "worse":
        return "worse than the constant predictor (beyond the noise): see the warning"
    return str(status)


def refusal_text(report: dict) -> str:
    model, const = report["model"], report["constant"]
    return (f"the trained model is much worse than a constant predictor on the training data by "
            f"the private quality check ({report['metric']}: model {model['value']:.4g}, "
            f"constant {const['value']:.4g}, DP releases with noise std about "
            f"{model['noise_std']:.2g} and {const['noise_std']:.2g}): the run diverged or its "
            f"settings do not fit the data; no model was written (--quality-check off writes it "
            f"all the same)")
