"""beam-dp tune: private hyperparameter selection (beam_dp.tuning)."""
from __future__ import annotations

import json
import math
import warnings as warnings_module

import numpy as np
import pytest

import beam_dp
from beam_dp import accounting, losses, synthetic, tuning, tuning_plan
from beam_dp.api import ModelQualityError, QualityWarning
from beam_dp.cli import main

EPSILON, DELTA = 1.0, 1e-5


def _data(n=3000, d=4, seed=0):
    return synthetic.make_dataset("binary", n=n, d=d, seed=seed)


def _event_classes(value) -> set:
    """Every DpEvent class named in a report's dp_event JSON."""
    found = set()
    if isinstance(value, dict):
        found.add(value.get("class_name"))
        for v in value.values():
            found |= _event_classes(v)
    elif isinstance(value, list):
        for v in value:
            found |= _event_classes(v)
    return found


@pytest.mark.parametrize("mean,shape", [(3.0, 1.0), (5.0, 0.0), (2.0, 0.5)])
def test_plan_meets_the_target_by_rdp(mean, shape):
    from dp_accounting import dp_event as events
    plan = tuning_plan.plan(EPSILON, DELTA, mean, shape)
    assert (plan.mean, plan.shape) == (mean, shape)
    # the run's event, spelled out here rather than taken from the plan
    run = events.ComposedDpEvent([
        events.LaplaceDpEvent(1.0 / plan.count_epsilon),
        events.RepeatAndSelectDpEvent(events.ComposedDpEvent([
            events.GaussianDpEvent(plan.sigma_train), events.GaussianDpEvent(plan.sigma_score)]),
            mean, shape)])
    spent = accounting.epsilon_of(run, DELTA, "rdp")
    assert spent <= EPSILON
    assert spent >= EPSILON * (1 - accounting.CALIBRATION_TOLERANCE)
    # the selection is what costs: one candidate alone would be far below the target
    alone = accounting.epsilon_of(plan.candidate_event(), DELTA, "rdp")
    assert alone < 0.8 * EPSILON


def test_tuned_model_reports_the_selection_inside_epsilon():
    X, y = _data()
    model = beam_dp.tune(X, y, epsilon=EPSILON, delta=DELTA, seed=1,
                         grid={"clip_norm": (0.5, 1.0), "steps": (10, 20)})
    report = model.privacy_report
    assert report["accountant"] == "rdp" and report["neighbouring"] == "add/remove"
    assert report["epsilon"] <= EPSILON
    assert "RepeatAndSelectDpEvent" in _event_classes(report["dp_event"])
    # the reported epsilon is the ledger's event's, recomputed
    event = accounting.event_from_json(report["dp_event"])
    assert accounting.epsilon_of(event, DELTA, "rdp") == pytest.approx(report["epsilon"])
    assert model.tuning["chosen"] in [{"clip_norm": c, "steps": s} for c in (0.5, 1.0)
                                      for s in (10, 20)]
    assert 0.0 <= model.tuning["chosen_noisy_score"] <= 1.0
    assert "realized" in model.tuning["number_of_candidates"]
    assert not isinstance(model.tuning["number_of_candidates"]["realized"], (int, float))


@pytest.mark.parametrize("mean,shape", [(3.0, 1.0), (4.0, 0.0), (2.5, 2.0)])
def test_number_of_candidates_follows_the_accounted_law(mean, shape):
    """K's draws against the truncated negative binomial law dp_accounting accounts: its mean
    within 4 standard errors, and each of P[K = 1..4] within 4 binomial standard errors."""
    generator = np.random.default_rng(7)
    draws = np.array([tuning_plan.draw_candidates(generator, mean, shape) for _ in range(4000)])
    assert draws.min() >= 1
    law = tuning_plan.candidates_law(mean, shape, 2000)
    assert law.sum() == pytest.approx(1.0, abs=1e-6)
    k = np.arange(1, 2001)
    # dp_accounting's gamma is a conservative inversion of the mean: the law's mean is close
    assert float(law @ k) == pytest.approx(mean, rel=1e-3)
    sd = math.sqrt(float(law @ k ** 2) - float(law @ k) ** 2)
    assert abs(draws.mean() - float(law @ k)) < 4 * sd / math.sqrt(len(draws))
    for value in range(1, 5):
        p = law[value - 1]
        assert abs(np.mean(draws == value) - p) < 4 * math.sqrt(p * (1 - p) / len(draws))


def test_mean_one_is_one_candidate():
    assert tuning_plan.draw_candidates(np.random.default_rng(0), 1.0, 1.0) == 1


def test_selection_picks_the_good_setting(monkeypatch):
    """One grid point cannot learn (clip norm 1e-4: the model stays near zero, log loss ~ ln 2,
    score ~0.65; the other scores ~0.8). With ten candidates (drawn uniformly, so both settings
    are tried) the noisy scores' difference has std sqrt(2) sigma_score / m ~ 0.05 at m ~ 800
    held-out rows, against a gap of ~0.15: the good one is chosen. Uniform settings
    (default_share 0), a held-out part, and then the default law with the bad setting made the
    one it favours: the scores still choose."""
    monkeypatch.setattr(tuning, "draw_candidates", lambda generator, mean, shape: 10)
    X, y = _data(n=4000)
    for seed in (0, 1):
        model = beam_dp.tune(X, y, epsilon=EPSILON, delta=DELTA, seed=seed, holdout=0.2,
                             default_share=0.0, grid={"clip_norm": (1e-4, 1.0)}, steps=20)
        assert model.tuning["chosen"] == {"clip_norm": 1.0}
    monkeypatch.setattr(tuning, "default_setting", lambda *args: {"clip_norm": 1e-4})
    model = beam_dp.tune(X, y, epsilon=EPSILON, delta=DELTA, seed=2,
                         grid={"clip_norm": (1e-4, 1.0)}, steps=20)
    assert model.tuning["setting_law"]["default"] == {"clip_norm": 1e-4}
    assert model.tuning["chosen"] == {"clip_norm": 1.0}


def _spy_on_the_split(monkeypatch) -> list:
    """Each candidate's (training rows, scored rows) by their first feature, as the split made
    them."""
    seen = []
    original = tuning._Splitter.__call__

    def spy(self, problem, aggregator):
        problem, trained = original(self, problem, aggregator)
        seen.append((np.concatenate([b.features[:, 0] for b in trained.blocks]),
                     np.concatenate([b.features[:, 0] for b in self.state.held])))
        return problem, trained

    monkeypatch.setattr(tuning._Splitter, "__call__", spy)
    return seen


def test_held_out_rows_never_train(monkeypatch):
    """The rows each candidate trains on and the held-out rows the scores read are disjoint
    and together the input (the first feature is made a row id)."""
    X, y = _data(n=2000)
    X = X.copy()
    X[:, 0] = np.arange(len(X)) / len(X)
    seen = _spy_on_the_split(monkeypatch)
    beam_dp.tune(X, y, epsilon=EPSILON, seed=3, grid={"steps": (5, 10)}, batch_rows=300,
                 holdout=0.2)
    assert seen
    for trained, held in seen:
        assert len(np.intersect1d(trained, held)) == 0
        assert len(trained) + len(held) == len(X)
        # the share held out: binomial, within 4 standard deviations
        assert abs(len(held) - 0.2 * len(X)) < 4 * math.sqrt(0.2 * 0.8 * len(X))


def test_holdout_zero_scores_on_the_training_rows(monkeypatch):
    """The default, holdout 0: every row trains and the scores read those same rows; one count
    is released (not a pair), and the run stays within epsilon."""
    X, y = _data(n=1500)
    X = X.copy()
    X[:, 0] = np.arange(len(X)) / len(X)
    seen = _spy_on_the_split(monkeypatch)
    model = beam_dp.tune(X, y, epsilon=EPSILON, seed=3, grid={"steps": (5, 10)}, batch_rows=300)
    assert tuning.DEFAULT_HOLDOUT == 0
    assert seen
    for trained, held in seen:
        assert np.array_equal(np.sort(trained), np.sort(X[:, 0]))
        assert np.array_equal(np.sort(held), np.sort(X[:, 0]))
    names = [m["name"] for m in model.privacy_report["mechanisms"]]
    assert "laplace_count_of_training_rows" in names
    assert "laplace_counts_of_training_and_held_out_rows" not in names
    assert model.tuning["score"]["rows"] == "the training rows (holdout 0)"
    assert model.privacy_report["epsilon"] <= EPSILON


def test_setting_law_favours_the_default_and_draws_from_it():
    """P[default] = share + (1 - share) / n, the rest uniform; uniform when the grid lacks the
    default; the default setting is train's (the model's default step); draws follow the law
    (each frequency within 4 binomial standard errors)."""
    grid = {"clip_norm": (0.5, 1.0, 2.0), "learning_rate": (1 / 3, 1.0, 3.0)}
    settings = tuning.check_grid(grid, "dpgd", {})
    default = tuning.default_setting("dpgd", "logistic", {}, grid)
    assert default == {"clip_norm": 1.0, "learning_rate": 1.0}
    assert tuning.default_setting("dpgd", "linear", {}, {"learning_rate": (0.25, 0.75)}) == {
        "learning_rate": 0.25}
    assert tuning.default_setting("dpgd", "logistic", {}, {"steps": (10, 20)}) is None
    law = tuning.setting_law(settings, default, 0.5)
    assert law.sum() == pytest.approx(1.0)
    assert law[settings.index(default)] == pytest.approx(0.5 + 0.5 / 9)
    assert np.allclose(np.delete(law, settings.index(default)), 0.5 / 9)
    assert np.allclose(tuning.setting_law(settings, None, 0.5), 1 / 9)
    assert np.allclose(tuning.setting_law(settings, default, 0.0), 1 / 9)
    generator = np.random.default_rng(11)
    n = 20000
    counts = np.bincount([tuning.draw_setting(generator, law) for _ in range(n)], minlength=9)
    assert np.all(np.abs(counts / n - law) < 4 * np.sqrt(law * (1 - law) / n))


def test_a_classifiers_candidates_center_on_three_times_the_step_over_their_100_steps(monkeypatch):
    """Tune's candidates run 100 steps (train: up to 300), so a logistic model's grid and
    default setting center on 3x its default step (``center_step``); not for the squared loss,
    nor when the steps are set (fixed or in the grid); a grid without steps still trains the
    center. What each candidate trains with is read from api.train's keywords."""
    assert tuning.center_step("logistic", {}, {}) == 3.0
    assert tuning.center_step("linear", {}, {}) == 0.25
    assert tuning.center_step("logistic", {"max_steps": 50}, {}) == 1.0
    assert tuning.center_step("logistic", {"steps": None}, {"steps": (10, 20)}) == 1.0
    from beam_dp import api
    seen = []
    real = api.train

    def recording(*args, **kwargs):
        seen.append((kwargs.get("learning_rate"), kwargs.get("max_steps"),
                     kwargs.get("clip_norm")))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "train", recording)
    X, y = _data(n=1000)
    model = beam_dp.tune(X, y, epsilon=EPSILON, seed=2, default_share=1.0, quality_check="off")
    assert model.tuning["grid"]["learning_rate"] == pytest.approx([1.0, 3.0, 9.0])
    assert model.tuning["setting_law"]["default"] == {"clip_norm": 1.0, "learning_rate": 3.0}
    assert seen and all(s == (3.0, 100, 1.0) for s in seen)   # share 1: every candidate
    seen.clear()
    beam_dp.tune(X, y, epsilon=EPSILON, seed=2, grid={"clip_norm": (1.0,)}, quality_check="off")
    assert seen and all(s == (3.0, 100, 1.0) for s in seen)
    seen.clear()
    beam_dp.tune(X, y, model="linear", epsilon=EPSILON, seed=2, default_share=1.0,
                 quality_check="off", score_bound_=4.0, scale_features="none")
    assert seen and all(s == (0.25, 100, 1.0) for s in seen)


def test_holdout_is_a_fixed_function_of_row_position():
    from beam_dp import data, losses
    X, y = _data(n=1000)
    blocks = data.blocks_from_arrays(X, y, losses.make_loss("logistic"), 250)
    first = np.concatenate([tuning.holdout_mask(b, 5, 0.3) for b in blocks])
    # the same rows in other block sizes (another read of the same input)
    again = np.concatenate([tuning.holdout_mask(b, 5, 0.3) for b in
                            data.blocks_from_arrays(X, y, losses.make_loss("logistic"), 400)])
    assert np.array_equal(first, again)
    other_key = np.concatenate([tuning.holdout_mask(b, 6, 0.3) for b in blocks])
    assert not np.array_equal(first, other_key)


@pytest.mark.parametrize("grid,message", [
    ({"clip_nrm": (1.0,)}, "not a tunable option"),
    ({"scale_features": ("auto",)}, "not a tunable option"),
    ({"clip_norm": ()}, "no values"),
    ({"clip_norm": (1.0, 1.0)}, "repeated"),
    ({"clip_norm": (-1.0, 1.0)}, "clip-norm"),
    ({"steps": (2.5,)}, "whole number"),
    ({}, None),   # empty: the default grid
])
def test_bad_grids_are_refused(grid, message):
    if message is None:
        assert len(tuning.check_grid(tuning.DEFAULT_GRIDS["dpgd"], "dpgd", {})) == 9
        return
    with pytest.raises(ValueError, match=message):
        tuning.check_grid(grid, "dpgd", {})


def test_grid_refusals_beyond_the_values():
    with pytest.raises(ValueError, match="supports --algorithm dpgd"):
        tuning.check_grid({"clip_norm": (1.0,)}, "dpsgd", {})
    with pytest.raises(ValueError, match="both fixed and in the grid"):
        tuning.check_grid({"clip_norm": (1.0, 2.0)}, "dpgd", {"clip_norm": 3.0})
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        tuning.parse_grid(["clip_norm"])
    with pytest.raises(ValueError, match="numbers or true/false"):
        tuning.parse_grid(["clip_norm=small"])
    assert tuning.parse_grid(["clip-norm=0.1,1", "steps=10,20"]) == {
        "clip_norm": (0.1, 1), "steps": (10, 20)}
    X, y = _data(n=500)
    said = []
    with pytest.raises(ValueError, match="--score-bound"):   # no label range will be known
        beam_dp.tune(X, y, model="linear", epsilon=1.0, scale_features="none", progress=said.append)
    assert said == []   # (refused before the data is read)
    with pytest.raises(ValueError, match="and of the label 'label'"):   # 500 rows: no range
        beam_dp.tune(X, y, model="linear", epsilon=1.0)
    with pytest.raises(ValueError, match="float noise"):
        beam_dp.tune(X, y, epsilon=1.0, noise="secure")


def test_cli_tune_writes_the_model_its_report_and_tuning(tmp_path, capsys):
    assert main(["make-data", "--output", str(tmp_path / "d"), "--n", "2000", "--d", "4",
                 "--validation-n", "500", "--shards", "2"]) == 0
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["tune", "--input", str(tmp_path / "d" / "train-*.parquet"), "--output", str(out),
                 "--validation", str(tmp_path / "d" / "validation-*.parquet"), "--epsilon", "1",
                 "--seed", "2", "--grid", "clip-norm=0.5,1", "--grid", "steps=10,20",
                 "--learning-rate", "2", "--mean-candidates", "4"])
    err = capsys.readouterr().err
    assert code == 0, err
    report = json.loads((out / "privacy_report.json").read_text())
    tuned = json.loads((out / "tuning.json").read_text())
    assert report["epsilon"] <= 1.0
    assert "RepeatAndSelectDpEvent" in _event_classes(report["dp_event"])
    assert report["hyperparameters"]["values"]["learning_rate"] == 2.0
    assert tuned["score"]["rows"] == "validation files"
    assert set(tuned) == {"method", "algorithm", "grid", "setting_law", "chosen",
                          "chosen_noisy_score", "score", "number_of_candidates", "not_released"}
    # Nothing per candidate on stderr: its length would tell K.
    assert len(err.strip().splitlines()) == 2
    assert (out / "model.json").exists()
    assert main(["tune", "--input", str(tmp_path / "d" / "train-*.parquet"), "--output",
                 str(tmp_path / "o2"), "--epsilon", "1", "--grid", "clip-nrm=1"]) == 2
    assert "not a tunable option" in capsys.readouterr().err


def test_private_scaling_is_released_once_and_recorded_in_the_model():
    """--scale-features private: the columns' quantiles are one release before the candidates
    (in the ledger once, whatever K), the chosen model.json maps raw features as training saw
    them, and the whole run stays within epsilon."""
    X, y = _data(n=3000)
    X = X * np.array([1000.0, 1.0, 0.01, 50.0]) + 7.0   # raw columns on very different scales
    model = beam_dp.tune(X, y, epsilon=EPSILON, seed=4, scale_features="private",
                         grid={"clip_norm": (0.5, 1.0)}, steps=20)
    report = model.privacy_report
    assert report["epsilon"] <= EPSILON
    names = [m["name"] for m in report["mechanisms"]]
    assert names[-1] == "repeat_and_select_best_candidate"
    scaling = [m for m in report["mechanisms"] if m["name"] not in (
        "repeat_and_select_best_candidate", "laplace_count_of_training_rows",
        "gaussian_model_quality_sums")]
    assert scaling and sum(m["count"] for m in scaling) == 2 * X.shape[1]   # 2 quantiles a column
    assert "scale_columns" in model.artifact["feature_transform"]
    assert model.score(X, y) > 0.7   # it predicts from raw features


def test_readme_example_runs():
    """The Python block of the tuning guide (docs/guide/tuning.md), with the Python API
    page's X, y (smaller here)."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "guide", "tuning.md")) as f:
        section = f.read()
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    X, y = _data(n=3000)
    namespace = {"beam_dp": beam_dp, "X": X, "y": y}
    exec(compile(blocks[0], "docs/guide/tuning.md", "exec"), namespace)
    assert namespace["model"].tuning["chosen"]["learning_rate"] in (0.1, 1.0)


def test_a_candidate_that_releases_more_than_the_plan_stops_the_run(monkeypatch):
    from beam_dp import api
    original = api.train

    def leaky(*args, **kwargs):   # 10% less noise than the plan gave the candidate
        kwargs["noise_multiplier"] *= 0.9
        return original(*args, **kwargs)

    monkeypatch.setattr(api, "train", leaky)
    X, y = _data(n=500)
    with pytest.raises(ValueError, match="released more than the tuning plan"):
        beam_dp.tune(X, y, epsilon=EPSILON, seed=0, grid={"steps": (5, 10)})


def test_estimator_tune_parameter(monkeypatch):
    """DPLogisticRegression(tune=...): the same selection, its report inside epsilon; the
    estimator contract holds (tune is a parameter, clone keeps it)."""
    pytest.importorskip("sklearn")
    from sklearn.base import clone
    from beam_dp.estimators import DPLinearRegression, DPLogisticRegression
    monkeypatch.setattr(tuning, "draw_candidates", lambda generator, mean, shape: 10)
    X, y = _data(n=4000)
    clf = DPLogisticRegression(epsilon=EPSILON, classes=[0, 1], random_state=0,
                               algorithm_options={"steps": 20},
                               tune={"grid": {"clip_norm": (1e-4, 1.0)}})
    assert clone(clf).get_params()["tune"] == {"grid": {"clip_norm": (1e-4, 1.0)}}
    clf.fit(X, y)
    assert clf.tuning_["chosen"] == {"clip_norm": 1.0}
    assert clf.privacy_report_["epsilon"] <= EPSILON
    assert "RepeatAndSelectDpEvent" in _event_classes(clf.privacy_report_["dp_event"])
    assert clf.score(X, y) > 0.7
    with pytest.raises(ValueError, match="num_examples"):
        DPLinearRegression(tune=True, num_examples=100).fit(X, y)


# ------------------------------------------------------- the chosen model's private quality check

def test_plan_composes_the_quality_check_outside_the_selection_and_meets_the_target():
    """The check is one more fixed release beside the count (its Gaussian, spelled out here):
    the run meets (epsilon, delta) by RDP with it, and the candidates get less of the budget."""
    from dp_accounting import dp_event as events
    from beam_dp import quality
    ledger = accounting.Ledger("rdp", accounting.ADD_REMOVE)
    from beam_dp.algorithms import spec
    check = quality.reserve(ledger, losses.make_loss("linear"),
                            spec.Privacy(epsilon=EPSILON, delta=DELTA, accountant="rdp"),
                            epsilon=None, label_bound=None, secure=False)
    with_check = tuning_plan.plan(EPSILON, DELTA, quality_multiplier=check.noise_multiplier)
    without = tuning_plan.plan(EPSILON, DELTA)
    assert with_check.quality_multiplier == check.noise_multiplier
    run = events.ComposedDpEvent([
        events.LaplaceDpEvent(1.0 / with_check.count_epsilon),
        events.GaussianDpEvent(check.noise_multiplier),
        events.RepeatAndSelectDpEvent(with_check.candidate_event(), 3.0, 0.0)])
    spent = accounting.epsilon_of(run, DELTA, "rdp")
    assert EPSILON * (1 - accounting.CALIBRATION_TOLERANCE) <= spent <= EPSILON
    assert with_check.sigma_train > without.sigma_train   # the check's share is not free


def test_tune_checks_the_chosen_model_and_leaves_a_good_one_unflagged():
    """A good tune (seeded, n large enough for the check to be informative): status better, no
    QualityWarning, the check's release in the ledger once; off: no release, status off."""
    X, y = _data(n=20000, d=4, seed=5)
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error", QualityWarning)
        model = beam_dp.tune(X, y, epsilon=EPSILON, seed=6, grid={"clip_norm": (0.5, 1.0)},
                             steps=20)
    report = model.privacy_report
    assert report["quality_check"]["status"] == "better"
    assert report["quality_check"]["epsilon_share"] == pytest.approx(0.05 * EPSILON)
    names = [m["name"] for m in report["mechanisms"]]
    assert names.count("gaussian_model_quality_sums") == 1
    assert "warnings" not in report
    assert report["epsilon"] <= EPSILON
    off = beam_dp.tune(X, y, epsilon=EPSILON, seed=6, grid={"clip_norm": (0.5, 1.0)}, steps=20,
                       quality_check="off")
    assert off.privacy_report["quality_check"]["status"] == "off"
    assert "gaussian_model_quality_sums" not in [m["name"] for m in
                                                 off.privacy_report["mechanisms"]]
    assert off.privacy_report["epsilon"] <= EPSILON
    # the freed share goes to the candidates
    assert off.privacy_report["noise_multiplier"] < report["noise_multiplier"]


def _useless_regression(n=20000, seed=0):
    """A regression whose labels sit far from 0 while every setting of the grid below leaves
    the model near 0: all candidates are far worse than the constant."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    return X, 3.5 + 0.1 * rng.normal(size=n)


def test_tune_refuses_a_chosen_model_much_worse_than_a_constant(tmp_path, capsys):
    X, y = _useless_regression()
    grid = {"clip_norm": (1e-4, 1e-3), "learning_rate": (1e-3, 1e-2)}
    with pytest.raises(ModelQualityError, match="much worse than a constant"):
        beam_dp.tune(X, y, model="linear", epsilon=EPSILON, seed=1, grid=grid, steps=10,
                     score_bound_=5.0, scale_features="none")
    # the CLI: exit code 6 and nothing written
    import pandas as pd
    frame = pd.DataFrame(X, columns=["a", "b", "c"]).assign(label=y)
    frame.to_csv(tmp_path / "rows.csv", index=False)
    out = tmp_path / "out"
    code = main(["tune", "--input", str(tmp_path / "rows.csv"), "--output", str(out),
                 "--model", "linear", "--epsilon", "1", "--seed", "1", "--score-bound", "5",
                 "--scale-features", "none", "--steps", "10",
                 "--grid", "clip-norm=0.0001,0.001", "--grid", "learning-rate=0.001,0.01"])
    assert code == 6, capsys.readouterr().err
    assert not out.exists()
    # a bound that makes the constant's error as noisy as the model's: no refusal; recorded as
    # inconclusive (no warning), or warned of where the noisy figures show it worse
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        model = beam_dp.tune(X, y, model="linear", epsilon=EPSILON, seed=1, grid=grid,
                             steps=10, score_bound_=5.0, scale_features="none",
                             quality_label_bound=1e4)
    status = model.privacy_report["quality_check"]["status"]
    assert status in ("worse", "inconclusive")
    warned = [w for w in caught if issubclass(w.category, QualityWarning)]
    assert (len(warned) == 1) == (status == "worse") == bool(model.privacy_report.get("warnings"))


def test_a_diverged_candidate_scores_lowest_and_never_stops_the_loop(monkeypatch):
    """A candidate whose coefficients are not finite is not an exception out of the loop (that
    would reveal a candidate never released, and that this many ran): it scores lowest, and only
    when every candidate diverged is the run refused, after the selection."""
    X, y = _data(n=2000)
    original = tuning._train_candidate
    tried = []

    def diverging(api, X, y, input, algorithm, model, delta, setting, *rest):
        tried.append(setting["learning_rate"])
        if setting["learning_rate"] == 0.5:
            raise ModelQualityError("the model's coefficients are not finite")
        return original(api, X, y, input, algorithm, model, delta, setting, *rest)

    monkeypatch.setattr(tuning, "_train_candidate", diverging)
    # (seed 5 draws K = 2: the diverging setting first, then the default)
    model = beam_dp.tune(X, y, epsilon=EPSILON, seed=5, grid={"learning_rate": (0.5, 1.0)},
                         mean_candidates=10, batch_rows=500)
    assert tried == [0.5, 1.0]
    assert model.tuning["chosen"] == {"learning_rate": 1.0}
    with pytest.raises(ModelQualityError, match="not finite"):
        beam_dp.tune(X, y, epsilon=EPSILON, seed=2, grid={"learning_rate": (0.5,)},
                     batch_rows=500)


def test_user_level_privacy_is_refused_not_dropped(tmp_path, capsys):
    """tune's candidates read row-level blocks (its splitter), so a privacy unit asked for by
    flag, keyword or schema must stop the run before any release: the CLI used to drop
    --privacy-unit-column (the user column then became a feature and the guarantee was per
    row), and beam_dp.tune reported "add/remove" rows for privacy_unit_column=."""
    assert main(["make-data", "--output", str(tmp_path / "d"), "--n", "300", "--d", "3",
                 "--validation-n", "10", "--shards", "1"]) == 0
    files = str(tmp_path / "d" / "train-*.parquet")
    for keywords in ({"privacy_unit_column": "f0"}, {"max_rows_per_user": 4},
                     {"schema": {"label": "label", "privacy_unit": "f0"}}):
        with pytest.raises(ValueError, match="user-level"):
            beam_dp.tune(input=files, epsilon=1.0, seed=0, **keywords)
    capsys.readouterr()
    out = tmp_path / "out"
    code = main(["tune", "--input", files, "--output", str(out), "--epsilon", "1",
                 "--privacy-unit-column", "f0"])
    err = capsys.readouterr().err
    assert code == 2 and "user-level" in err and "tuning dpgd" not in err, err
    assert not out.exists()


def test_ranges_that_release_nothing_give_their_share_back_to_the_candidates(monkeypatch):
    """In-memory arrays at 2,000 rows: --scale-features auto releases no ranges (too few rows
    for them, decided from the released count), so the plan is calibrated again without their
    tenth of epsilon: the report's epsilon is the one asked for (0.8999 of 1 before), and every
    candidate, the first included, ran with the recalibrated noise."""
    X, y = _data(n=2000)
    multipliers = []
    original = tuning._train_candidate

    def recording(*args, **kwargs):
        candidate, steps = original(*args, **kwargs)
        multipliers.append(candidate.privacy_report["noise_multiplier"] / math.sqrt(steps))
        return candidate, steps

    monkeypatch.setattr(tuning, "_train_candidate", recording)
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("ignore")
        model = beam_dp.tune(X, y, epsilon=1.0, seed=3, grid={"steps": (5, 10)},
                             mean_candidates=3)
    report = model.privacy_report
    assert report["epsilon"] <= 1.0 and report["epsilon"] == pytest.approx(1.0, abs=0.005)
    assert not any("scale" in m["name"] or "quantile" in m["name"] for m in report["mechanisms"])
    selection = report["mechanisms"][-1]
    assert multipliers and all(m == pytest.approx(selection["training_noise_multiplier"], rel=1e-6)
                               for m in multipliers)
