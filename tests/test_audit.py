"""The one-run audit's statistics (``beam_dp.audit``; Steinke, Nasr & Jagielski 2023).

Simulated mechanisms with known guarantees, each canary included with probability 1/2 and every
run seeded, so each failure count below is a fixed number (stated next to its assertion). A valid
95% lower bound overstates the true epsilon in at most 5% of runs in expectation; the assertions
allow 10%. Reference values (the Gaussian mechanism's exact epsilon(delta), the theorem's bound)
are computed here with scipy, not with the helpers under test.
"""
from __future__ import annotations

import numpy as np
import pytest
from dp_accounting import gaussian_mechanism
from scipy import optimize
from scipy import stats as st

from beam_dp import audit

M = 1000
RUNS = 200
DELTA = 1e-5
ALLOWED_FAILURES = 0.10


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon(delta) of mu-GDP (one Gaussian release of sensitivity mu, unit noise):
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    def excess(eps):
        return (st.norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * st.norm.cdf(-eps / mu - mu / 2)
                - delta)
    return optimize.brentq(excess, 0.0, 500.0)


def randomized_response(included, epsilon, rng):
    """eps-DP per canary: the true bit with probability e^eps / (1 + e^eps), else its flip."""
    keep = rng.random(included.size) < 1 / (1 + np.exp(-epsilon))
    return np.where(keep, included, ~included).astype(float)


def audits(make_scores, delta, runs=RUNS, m=M):
    """The audit's bound over seeded runs; ``make_scores(included, rng)`` is the mechanism."""
    bounds = []
    for seed in range(runs):
        rng = np.random.default_rng([seed, 2305])
        included = rng.random(m) < 0.5
        bounds.append(audit.audit_from_scores(make_scores(included, rng), included, delta)
                      ["epsilon_lower_bound"])
    return np.array(bounds)


# --------------------------------------------------------------------- the bound from the theorem

def theorem_p_value(m, r, v, eps, delta):
    """Theorem 5.2 written out: f(v) + 2 m delta max_{1 <= i <= m} (f(v - i) - f(v)) / i."""
    q = np.exp(eps) / (1 + np.exp(eps))
    f = lambda t: st.binom.sf(t - 1, r, q)  # P[Binomial(r, q) >= t]; 1 for t <= 0
    i = np.arange(1, m + 1)
    return min(1.0, f(v) + 2 * m * delta * np.max((f(v - i) - f(v)) / i))


@pytest.mark.parametrize("m, r, v, eps, delta", [
    (1000, 100, 75, 0.5, 1e-4), (1000, 100, 75, 2.0, 1e-4), (200, 40, 40, 1.0, 1e-3),
    (1000, 1000, 600, 0.3, 1e-5), (50, 10, 3, 0.0, 0.01), (1000, 20, 20, 3.0, 0.0)])
def test_p_value_is_the_theorems_bound(m, r, v, eps, delta):
    assert audit.p_value(m, r, v, eps, delta) == pytest.approx(
        theorem_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("m, r, v, delta, expected", [
    (1000, 100, 75, 1e-4, 0.673),  # the worked example of the paper's App. D routine
    (100000, 1510, 1439, 1e-5, 2.675)])  # a Sec. 7 setting (as pinned by a public port)
def test_epsilon_lower_bound_is_where_the_p_value_crosses(m, r, v, delta, expected):
    eps = audit.epsilon_lower_bound(m, r, v, delta, 0.95)
    assert eps == pytest.approx(expected, abs=1e-3)
    assert theorem_p_value(m, r, v, eps, delta) < 0.05  # rejected, and just above it is not
    assert theorem_p_value(m, r, v, eps + 1e-5, delta) >= 0.05


def test_nothing_claimed_without_evidence():
    assert audit.epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0  # chance accuracy
    assert audit.epsilon_lower_bound(1000, 0, 0, 1e-5) == 0.0  # no guesses
    assert audit.epsilon_lower_bound(10, 2, 2, 0.0) == 0.0  # 2 of 2 is not significant at 95%
    assert audit.epsilon_lower_bound(1000, 1000, 1000, 0.9) == 0.0  # 2 m delta swamps it
    assert audit.p_value(1000, 100, 0, 3.0, 1e-5) == 1.0


def test_more_correct_guesses_larger_bound():
    bounds = [audit.epsilon_lower_bound(M, 100, v, DELTA) for v in range(50, 101)]
    assert np.all(np.diff(bounds) >= 0) and bounds[0] == 0.0 and bounds[-1] > bounds[-2] > 1


def test_larger_delta_more_canaries_or_confidence_smaller_bound():
    deltas = (0, 1e-7, 1e-5, 1e-4, 1e-3, 1e-2)
    by_delta = [audit.epsilon_lower_bound(M, 200, 170, d) for d in deltas]
    assert np.all(np.diff(by_delta) <= 0) and by_delta[0] > by_delta[-1]
    # the delta term is 2 m delta: more canaries with the same guesses cost more
    by_m = [audit.epsilon_lower_bound(m, 200, 170, 1e-4) for m in (200, 1000, 5000, 20000)]
    assert np.all(np.diff(by_m) <= 0) and by_m[0] > by_m[-1]
    by_confidence = [audit.epsilon_lower_bound(M, 200, 170, DELTA, c) for c in (0.5, 0.9, 0.99)]
    assert np.all(np.diff(by_confidence) < 0)


@pytest.mark.parametrize("args, message", [
    ((10, 5, 6, 0.0), "v <= r <= m"), ((10, 11, 5, 0.0), "v <= r <= m"),
    ((10, 5, -1, 0.0), "v <= r <= m"), ((10, 5.0, 3, 0.0), "integer"),
    ((10, True, 1, 0.0), "integer"),
    ((10, 5, 3, -0.1), "delta"), ((10, 5, 3, 1.0), "delta"), ((10, 5, 3, float("nan")), "delta"),
    ((10, 5, 3, 0.0, 0.0), "confidence"), ((10, 5, 3, 0.0, 1.0), "confidence")])
def test_epsilon_lower_bound_validates(args, message):
    with pytest.raises(ValueError, match=message):
        audit.epsilon_lower_bound(*args)


# ------------------------------------------------------------------ audits of simulated mechanisms

@pytest.mark.parametrize("mu", [1.0, 4.0])
def test_gaussian_mechanism_bound_stays_below_its_true_epsilon(mu):
    true_epsilon = gaussian_epsilon(mu, DELTA)  # 4.38 (mu = 1), 24.4 (mu = 4)
    bounds = audits(lambda included, rng: included * mu + rng.standard_normal(included.size), DELTA)
    assert np.sum(bounds >= true_epsilon) <= ALLOWED_FAILURES * RUNS  # 0 of 200 for both
    if mu == 4.0:  # weakly private: the audit finds it (min 4.24; the one-run ceiling is ~5.8)
        assert bounds.min() > 2.0 and np.median(bounds) > 4.0


def test_randomized_response_is_audited_tightly():
    """Pure eps-DP randomized response makes each guess correct with probability exactly
    e^eps / (1 + e^eps), the theorem's worst case, so the bound overstates eps in nearly 5% of
    runs: 17 of 400 here, and 63 of 400 without the union bound over the guess counts."""
    bounds = audits(lambda included, rng: randomized_response(included, 1.0, rng), 0.0, runs=400)
    failures = np.sum(bounds >= 1.0)
    assert 4 <= failures <= ALLOWED_FAILURES * 400
    assert np.median(bounds) > 0.5  # and it is not vacuous


def test_delta_slack_is_paid_for():
    """(1, 0.02)-DP per canary: with probability delta the bit is revealed outright, otherwise
    1-randomized response. Those sure guesses overstate eps in 125 of 200 runs without the
    theorem's 2 m delta term; with it, in 0."""
    def reveal_with_probability_delta(included, rng):
        revealed = rng.random(included.size) < 0.02
        return np.where(revealed, np.where(included, 10.0, -10.0),
                        randomized_response(included, 1.0, rng))
    bounds = audits(reveal_with_probability_delta, 0.02)
    assert np.sum(bounds >= 1.0) <= ALLOWED_FAILURES * RUNS


def test_scores_without_information_give_no_bound():
    bounds = audits(lambda included, rng: rng.standard_normal(included.size), DELTA)
    assert np.sum(bounds > 0) <= ALLOWED_FAILURES * RUNS  # 4 of 200 (30 without the union bound)
    assert bounds.max() < 0.25  # 0.068 (0.39 without the union bound)


def test_broken_mechanism_is_caught():
    """Claimed (1, 1e-5)-DP, but with a tenth of the Gaussian noise that claim needs."""
    sigma = gaussian_mechanism.get_sigma_gaussian(1.0, DELTA)  # noise for sensitivity 1
    calibrated = audits(lambda inc, rng: inc + sigma * rng.standard_normal(inc.size), DELTA, 20)
    broken = audits(lambda inc, rng: inc + sigma / 10 * rng.standard_normal(inc.size), DELTA, 20)
    assert calibrated.max() < 1.0 and broken.min() > 1.0  # 0.52 and 3.58


# ------------------------------------------------------------------------------- audit_from_scores

def test_audit_reports_counts_only_and_applies_the_union_bound():
    rng = np.random.default_rng(3)
    included = rng.random(M) < 0.5
    scores = included * 1.5 + rng.standard_normal(M)
    report = audit.audit_from_scores(scores, included, DELTA)
    assert set(report) == {"epsilon_lower_bound", "guesses", "correct", "canaries", "confidence",
                           "delta", "method"}
    assert report["canaries"] == M and report["confidence"] == 0.95 and report["delta"] == DELTA
    assert report["guesses"] in audit.default_guesses(M) == [20, 50, 100, 200, 500, 1000]
    assert "union bound" in report["method"] and "Steinke" in report["method"]

    # by hand: k highest guessed in, k lowest out; each r tested at 1 - 0.05 / 6
    order = np.argsort(scores)
    def correct(r):
        return int(included[order[-(r // 2):]].sum() + (~included[order[:r // 2]]).sum())
    per_test = {r: audit.epsilon_lower_bound(M, r, correct(r), DELTA, 1 - 0.05 / 6)
                for r in audit.default_guesses(M)}
    assert report["epsilon_lower_bound"] == max(per_test.values()) > 0
    assert report["correct"] == correct(report["guesses"])

    single = audit.audit_from_scores(scores, included, DELTA, guesses=[100])
    assert single["epsilon_lower_bound"] == audit.epsilon_lower_bound(M, 100, correct(100), DELTA)
    assert single["epsilon_lower_bound"] > per_test[100]  # one test needs no correction


def test_ties_are_not_broken_by_the_canaries_order():
    """Canaries listed included-first with equal scores: breaking ties by index would guess every
    one right; the fixed-seed tie keys know nothing of the bits."""
    included = np.arange(M) < M // 2
    report = audit.audit_from_scores(np.zeros(M), included, DELTA)
    assert report["epsilon_lower_bound"] == 0.0


def test_default_guesses():
    assert audit.default_guesses(101) == [2, 6, 10, 20, 50, 100]
    assert audit.default_guesses(7) == [2, 4, 6]
    assert audit.default_guesses(2) == [2] and audit.default_guesses(1) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"scores": [1.0, 2.0, 3.0], "included": [1, 0]}, "same length"),
    ({"scores": [1.0, float("nan")], "included": [1, 0]}, "finite"),
    ({"scores": [1.0, 2.0], "included": [2, 0]}, "0/1"),
    ({"scores": [1.0], "included": [1]}, "at least 2"),
    ({"guesses": [3]}, "even"), ({"guesses": [12]}, "even"), ({"guesses": [0]}, "even"),
    ({"guesses": []}, "non-empty"), ({"guesses": [2.0]}, "integer"),
    ({"delta": 1.5}, "delta"), ({"confidence": 1.0}, "confidence")])
def test_audit_from_scores_validates(kwargs, message):
    arguments = {"scores": np.arange(10.0), "included": np.arange(10) % 2, "delta": DELTA}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        audit.audit_from_scores(**arguments)


def test_the_default_canary_count_follows_the_claimed_epsilon():
    """The most an audit can show (every guess right) grows with m until the m delta term takes
    over; the default count is the smallest whose ceiling reaches 1.5x the claim (1,000 canaries
    missed a tenth of dpsgd's noise at epsilon 4: docs/auditing.md)."""
    ceilings = [audit.ceiling(m) for m in audit.CANARY_COUNTS]
    assert ceilings == sorted(ceilings) and ceilings[0] == pytest.approx(5.27, abs=0.01)
    assert audit.ceiling(10_000) < ceilings[-1] + 0.05   # no gain past 5,000 at delta 1e-5
    assert [audit.default_canaries(e) for e in (None, 0.5, 1.0, 3.0, 4.0, 8.0)] == [
        1000, 1000, 1000, 1000, 3000, 5000]
    for epsilon in (1.0, 3.0, 4.0):
        assert audit.ceiling(audit.default_canaries(epsilon)) >= 1.5 * epsilon
