"""Issue 13's Gaussian-width claim for objective-perturbation (paper 004, Thm 2 and Remark 1), on
the note's mean-point problem (§4.3(b)): l(theta; x) = 1/2 ||theta - x||^2, x_i = +-e_j, n =
50,000, epsilon = 1, delta = 1e-5, five seeded repetitions per (d, C), through the algorithm's own
solver, noise and accounting (``objective_perturbation.mean_point_excess``).

What the mechanism gives, and what is asserted:
* C = l2 ball (radius 1): the projection rarely binds, the error is the objective noise's
  d sigma^2 / 2 (sigma = sigma1 / n), so it grows like d: >= 30x from d = 100 to 10,000 (measured
  ~106x).
* C = l1 ball (radius 1, the same l2 radius): the error is at most the projection lemma's
  1/2 sigma G_C, and G_C grows like sqrt(ln d): the bound itself changes by 1.46x over the range.
  Once the noise is large against the ball (d >= 1,000 here) the error stays within 3x (measured
  1.46x); at d = 100 the noise lies inside the ball, nothing is projected and the error is
  d sigma^2 / 2, below the bound. So from d = 100 to 10,000 the l1 error grows 5.2x (measured):
  issue 13 asks for 3x there, which the paper's noise scale (Lemma 5's sigma1 at eps1 = eps / 2)
  cannot give at this n: any correct implementation has the d = 100 error d sigma^2 / 2 and the
  d = 10,000 one near the bound's scale. The 3x is asserted where the projection binds, and the
  lemma's bound at every d; the README and the issue's closing note say so.
"""
import numpy as np
import pytest

from beam_dp.algorithms import objective_perturbation as op

REPS = 5


def _excess(d: int, kind: str) -> tuple[float, float, float]:
    runs = [op.mean_point_excess(d, kind, seed=rep) for rep in range(REPS)]
    values = np.array([r["excess"] for r in runs])
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(REPS)), runs[0]["bound"]


def test_l1_ball_error_follows_the_gaussian_width_and_l2_ball_error_grows_like_d():
    l1 = {d: _excess(d, "l1-ball") for d in (100, 1_000, 10_000)}
    l2 = {d: _excess(d, "l2-ball") for d in (100, 10_000)}
    for d, (mean, stderr, bound) in l1.items():
        # the projection lemma: E excess <= 1/2 sigma G_C (plus the output noise's ~1e-6 share),
        # with 3 standard errors of slack for the 5-run mean
        assert mean - 3 * stderr <= bound, (d, mean, bound)
    assert max(l1[1_000][0], l1[10_000][0]) <= 3 * min(l1[1_000][0], l1[10_000][0])
    # at d = 100 nothing is projected: the error is d sigma^2 / 2 (plus the sampling's ~1/(2n)),
    # within 4 standard errors of the chi-square mean
    sigma = op.mean_point_excess(100, "l1-ball", seed=0)["sigma1"] / 50_000
    assert abs(l1[100][0] - 100 * sigma ** 2 / 2) <= 4 * l1[100][1] + 1e-5
    assert l2[10_000][0] >= 30 * l2[100][0]
    # and at d = 10,000 the l1 ball beats the l2 ball by an order of magnitude
    assert l1[10_000][0] * 10 <= l2[10_000][0]


def test_mean_point_passes_and_noise_match_the_paper():
    """lambda = 0 is allowed (the loss is 1-strongly convex and n >= 2d / eps), kappa = 1 so the
    solve is one exact projected step plus the certificate pass, and sigma1 is the note's 79.8
    (sqrt(128 L^2 ln(2.5 / delta)) / eps with L = 2)."""
    run = op.mean_point_excess(100, "l1-ball", seed=0)
    assert run["passes"] == 2
    assert run["sigma1"] == pytest.approx(np.sqrt(128 * 4 * np.log(2.5 / 1e-5)), rel=1e-12)
    assert run["sigma1"] == pytest.approx(79.8, abs=0.05)
