"""The private model-quality check (beam_dp.quality): a useless model is flagged on the default
path, a good one is not, its release is in the ledger within the target epsilon for every
algorithm that runs it, and a diverged model stops the run with no model written."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings

import numpy as np
import pytest

import beam_dp
from beam_dp.beam.aggregator import BeamAggregator
from beam_dp import api, cli, losses, quality, synthetic
from beam_dp.cli.exit_codes import EXIT_QUALITY
from beam_dp.algorithms import noisy_gd, registry


def _binary(n=4000, seed=0):
    return synthetic.make_dataset("binary", n, 5, seed)


def _train(x, y, **kwargs):
    if kwargs.get("model") == "linear" and kwargs.get("algorithm", "dpgd") in ("dpgd", "dpsgd"):
        # (synthetic columns and labels near the unit scale, on tables too small for private
        # ranges: used as given on purpose; the check is what these tests are about)
        kwargs.setdefault("scale_features", "none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = beam_dp.train(x, y, **kwargs)
    return model, [w for w in caught if issubclass(w.category, api.QualityWarning)]


def test_useless_model_is_never_called_better_and_warned_only_when_worse():
    """A huge clip norm at a tiny epsilon (private count, no validation data): the steps' noise
    swamps the gradient, and the check's own share is too small to vouch for the model either:
    never "better"; "inconclusive" is recorded with its noise level and is no warning, "worse"
    warns."""
    x, y = _binary()
    model, caught = _train(x, y, epsilon=0.05, clip_norm=1000.0, seed=3)
    check = model.privacy_report["quality_check"]
    assert check["status"] in ("worse", "inconclusive")
    assert check["covered_by_privacy_guarantee"] is True
    warned = any("quality check" in w for w in model.privacy_report.get("warnings", []))
    assert warned == (check["status"] == "worse") == (len(caught) == 1)
    if check["status"] == "inconclusive":
        assert check["summary"].startswith("inconclusive at this budget")


def test_model_of_labels_the_features_do_not_predict_is_never_called_better():
    """Labels independent of the features at epsilon 1: nothing beats the majority class, and
    the (informative) check never calls the model better; it warns only where the model is
    worse beyond the noise."""
    x, _ = _binary(6000, seed=2)
    y = (np.random.default_rng(7).random(6000) < 0.7).astype(float)
    for seed in range(3):
        model, caught = _train(x, y, epsilon=1.0, seed=seed)
        status = model.privacy_report["quality_check"]["status"]
        assert status in ("inconclusive", "worse")
        assert (len(caught) == 1) == (status == "worse")
        assert all("worse than a constant" in str(w.message) for w in caught)


def test_useless_model_cli_warns_on_stderr_and_writes_the_model(small_binary, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["train", "--input", small_binary["train_glob"], "--output", str(out),
                     "--runner", "local", "--epsilon", "0.05", "--clip-norm", "1000",
                     "--seed", "3"])
    err = capsys.readouterr().err
    assert code == 0
    report = json.loads((out / "privacy_report.json").read_text())
    check = report["quality_check"]
    assert check["status"] in ("worse", "inconclusive")
    text = quality.warning_text(check, report["hyperparameters"]["values"])
    assert (f"beam-dp: warning: {text}" in err) == (check["status"] == "worse")
    html = (out / "report.html").read_text()
    assert "Private quality check" in html and check["summary"].split(":")[0] in html


def test_good_model_is_not_flagged_and_its_figures_match_the_data_within_the_noise():
    x, y = _binary(n=6000, seed=1)
    model, caught = _train(x, y, epsilon=1.0, seed=5)
    check = model.privacy_report["quality_check"]
    assert check["status"] == "better" and not caught
    # The noisy figures against the exact ones (computed here, in the test only), within 4 of
    # their noise std (the count of rows is itself noisy: its error is added, about 1 percent
    # of eps's Laplace scale per row share, far below one std here).
    # Half the Brier score of the model's probabilities, and of the class frequencies'.
    p = model.predict_proba(x)[:, 1]
    model_brier = np.mean((p - y) ** 2)
    share = np.mean(y)
    constant_brier = 1 - share ** 2 - (1 - share) ** 2
    assert check["metric"].startswith("Brier score / 2")
    for key, exact in (("model", model_brier), ("constant", constant_brier / 2),
                       ("constant_minus_model", constant_brier / 2 - model_brier)):
        assert abs(check[key]["value"] - exact) <= 4 * check[key]["noise_std"], key
    # The std is the mechanism's: tau sqrt(3) / n on the model's (C and both counts), tau =
    # m sqrt(2).
    m = check["noise_multiplier"]
    assert check["model"]["noise_std"] == pytest.approx(m * math.sqrt(6) / check["rows"])


def test_regression_figures_match_the_data_within_the_noise():
    x, y = synthetic.make_dataset("regression", 6000, 5, 2)
    model, caught = _train(x, y, model="linear", epsilon=1.0, num_examples=6000, seed=2,
                           quality_label_bound=8.0)
    check = model.privacy_report["quality_check"]
    assert check["status"] == "better" and not caught and check["label_bound"] == 8.0
    a = np.clip(y, -8, 8)
    p = np.clip(model.predict(x), -8, 8)
    for key, exact in (("model", np.mean((a - p) ** 2)), ("constant", np.var(a))):
        assert abs(check[key]["value"] - exact) <= 4 * check[key]["noise_std"], key


@pytest.mark.parametrize("name", [n for n, a in registry.algorithms().items()
                                  if a.quality_check and a.relation != "replace-one"])
def test_ledger_holds_the_check_within_the_target_epsilon(name):
    # (the replace-one algorithms: tests/test_quality_check_replace_one.py)
    chosen = registry.get(name)
    model_name = "logistic" if "logistic" in chosen.models else "linear"
    x, y = _binary(2000) if model_name == "logistic" else synthetic.make_dataset(
        "regression", 2000, 5, 0)
    for noise in ("float", None):   # float noise, and the default (secure where it has it)
        model, _ = _train(x, y, algorithm=name, model=model_name, epsilon=1.0, noise=noise, seed=0)
        report = model.privacy_report
        names = [m["name"] for m in report["mechanisms"]]
        assert names[0] == quality.RELEASE, names   # reserved before every other release
        assert 0.99 <= report["epsilon"] <= 1.0
        assert report["quality_check"]["epsilon_share"] == pytest.approx(0.05)
        assert report["quality_check"]["noise"] == ("float" if noise == "float" else "secure")
        # Without the check the algorithm has the whole budget: its noise is smaller.
        off, _ = _train(x, y, algorithm=name, model=model_name, epsilon=1.0, noise=noise, seed=0,
                        quality_check="off")
        assert quality.RELEASE not in [m["name"] for m in off.privacy_report["mechanisms"]]
        assert off.privacy_report["quality_check"]["status"] == "off"
        assert off.privacy_report["epsilon"] <= 1.0
        assert (off.privacy_report["mechanisms"][-1]["noise_multiplier"]
                < report["mechanisms"][-1]["noise_multiplier"])


def test_a_resumed_run_counts_the_check_once(tmp_path):
    x, y = _binary(2000)
    first, _ = _train(x, y, epsilon=1.0, seed=0, checkpoint_dir=str(tmp_path / "ck"))
    again, _ = _train(x, y, epsilon=1.0, seed=0, checkpoint_dir=str(tmp_path / "ck"))
    assert again.privacy_report["mechanisms"] == first.privacy_report["mechanisms"]
    assert again.privacy_report["epsilon"] == pytest.approx(first.privacy_report["epsilon"])
    with pytest.raises(ValueError, match="releases before training differ"):
        _train(x, y, epsilon=1.0, seed=0, checkpoint_dir=str(tmp_path / "ck"),
               quality_epsilon=0.1)


def _far_labels(n=3000):
    """Labels near 1000 (spread 0.5): with the check's default bound L = 4 they all clamp to 4,
    where a constant is exact, and a model that predicts far below is much worse."""
    g = np.random.default_rng(0)
    x = g.standard_normal((n, 3))
    return x, 1000.0 + 0.5 * g.standard_normal(n)


def test_far_labels_model_is_much_worse_and_refused():
    x, y = _far_labels()
    # Clipped gradients at a step size of 0.01: the intercept cannot travel to 1000. Under a
    # public label bound that is "much worse": refused.
    with pytest.raises(quality.ModelQualityError, match="much worse than a constant"):
        _train(x, y, model="linear", epsilon=1.0, seed=1, learning_rate=0.01, steps=20,
               quality_label_bound=1100.0, quality_epsilon=0.5)
    # Under the assumed L = 4 (no label range known) it is warned of, naming the flag, never
    # refused: that clamp can make a good model look much worse as well (raw diamonds).
    model, caught = _train(x, y, model="linear", epsilon=1.0, seed=1, learning_rate=0.01,
                           steps=20)
    assert model.privacy_report["quality_check"]["status"] == "worse"
    assert len(caught) == 1 and "--quality-label-bound" in str(caught[0].message)
    # Turned off, the same run returns its model (and says the check was off).
    model, _ = _train(x, y, model="linear", epsilon=1.0, seed=1, learning_rate=0.01, steps=20,
                      quality_check="off")
    assert model.privacy_report["quality_check"]["status"] == "off"


def _diverging(monkeypatch, value):
    """dpgd returns ``value`` in every coefficient (a diverged optimizer), its check not yet
    run (as if its last job had not held it: api then checks that model)."""
    real = noisy_gd.DPGD

    def diverged(*args, **kwargs):
        result = real.train(*args, **kwargs)
        return dataclasses.replace(result, theta=np.full_like(result.theta, value),
                                   final_release=None)

    monkeypatch.setattr(noisy_gd, "DPGD", dataclasses.replace(real, train=diverged))


@pytest.mark.parametrize("value", [math.inf, 1e6])
def test_diverged_model_exits_non_zero_and_writes_nothing(monkeypatch, tmp_path, capsys, value):
    x, y = _far_labels()
    y = y - 1000.0   # labels of spread 0.5 around 0: a constant's error is small
    directory = tmp_path / "data"
    synthetic.write_shards(str(directory), "train", x, y, 1)
    _diverging(monkeypatch, value)
    out = tmp_path / "out"
    code = cli.main(["train", "--input", str(directory / "train-*"), "--output", str(out),
                     "--runner", "local", "--model", "linear", "--epsilon", "1", "--seed", "0",
                     "--scale-features", "none"])
    err = capsys.readouterr().err
    assert code == EXIT_QUALITY
    assert not os.path.exists(out) and not os.path.exists(out / "model.json")
    expected = "not finite" if value == math.inf else "much worse than a constant"
    assert expected in err and "no model was written" in err


def test_non_finite_coefficients_raise_in_python(monkeypatch):
    x, y = _binary(1000)
    _diverging(monkeypatch, math.nan)
    with pytest.raises(quality.ModelQualityError, match="not finite"):
        beam_dp.train(x, y, epsilon=1.0, seed=0, quality_check="off")


def test_bad_options_are_refused_before_training():
    x, y = _binary(500)
    with pytest.raises(ValueError, match="--quality-check must be one of"):
        beam_dp.train(x, y, epsilon=1.0, quality_check="maybe")
    with pytest.raises(ValueError, match="leaves nothing of epsilon"):
        beam_dp.train(x, y, epsilon=1.0, quality_epsilon=1.0)
    with pytest.raises(ValueError, match="--quality-label-bound must be above 0"):
        beam_dp.train(x, y, model="linear", epsilon=1.0, quality_label_bound=-1.0)


@pytest.mark.parametrize("model_name", ["logistic", "linear"])
def test_tiny_data_is_inconclusive_not_refused(model_name):
    """At 60 rows the check's noise dwarfs the data (and a noisy n of a few rows leaves the
    normalizations' linear range): inconclusive, recorded with its noise level; never a
    refusal, never a warning."""
    x, y = (_binary(60, seed=4) if model_name == "logistic"
            else synthetic.make_dataset("regression", 60, 5, 4))
    for seed in range(4):
        model, caught = _train(x, y, model=model_name, epsilon=1.0, seed=seed)
        check = model.privacy_report["quality_check"]
        assert check["status"] == "inconclusive" and caught == []
        assert "within the noise" in check["summary"]


def test_the_warnings_advice_fits_the_runs_options():
    # Every run was told to "try --scale-features auto": dpgd's default already, and a flag that
    # ssp or heavy-tailed-md does not have.
    assert quality.advice({"clip_norm": 1.0, "scale_features": "auto"}) == (
        "try declared column ranges (the schema's bounds), another --clip-norm or learning rate, "
        "or more epsilon")
    assert "--scale-features auto" in quality.advice({"clip_norm": 1.0, "scale_features": "none"})
    for values in ({"label_bound": 4.0, "ridge": None}, None):   # ssp; a report without values
        text = quality.advice(values)
        assert "--scale-features" not in text and "--clip-norm" not in text
        assert text.startswith("try standardized columns")


def test_the_largest_label_bound_gives_finite_noise_stds():
    # At --quality-label-bound 1e150 (the largest allowed) the gradients' entries are ~3e300:
    # np.linalg.norm squared them to inf, and privacy_report.json held "noise_std": Infinity.
    loss = losses.make_loss("linear")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # no overflow on the way either
        report = quality.verdict(loss, np.array([10.0, -30.0, 900.0]), 80.0, 1e150, 3000.0)
    stds = [report[k]["noise_std"] for k in ("model", "constant", "constant_minus_model")]
    assert all(math.isfinite(s) and s > 0 for s in stds)
    # The same figures in units of L^2 as at L = 1 (the std scales with L^2).
    unit = quality.verdict(loss, np.array([10.0, -30.0, 900.0]), 80.0, 1.0, 3000.0)
    assert report["model"]["noise_std"] == pytest.approx(unit["model"]["noise_std"] * 1e300)
    json.loads(json.dumps(report, allow_nan=False))


def test_three_outcomes_better_worse_and_inconclusive_within_the_noise():
    """A rare class (1,000 rows, 3% positives: the constant's error rate is 0.03): a model 0.005
    better is "better" where the gain's noise std is 0.002 and "inconclusive" (no warning, its
    noise level stated) where it is 0.01; a model 0.015 worse is "worse" at std 0.002. (Hinge:
    judged by error rate; logistic and softmax by the Brier score, the same rule.)"""
    from beam_dp import quality
    loss = losses.make_loss("hinge")

    def judge(correct, multiplier):   # noisy sums [correct, N_0, N_1]; gain std = 2 m / n
        return quality.verdict(loss, np.array([correct, 970.0, 30.0]), multiplier, None, 1000.0)

    better, unsure, worse = judge(975.0, 1.0), judge(975.0, 5.0), judge(955.0, 1.0)
    assert better["constant_minus_model"]["noise_std"] == pytest.approx(0.002)
    assert (better["status"], unsure["status"], worse["status"]) == (
        "better", "inconclusive", "worse")
    assert "within the noise" in quality.summary_text(unsure)
    assert "worse than a constant predictor" in quality.warning_text(worse)


def test_an_assumed_label_bound_refuses_only_labels_that_fit_inside_it():
    """A regression's L left at DEFAULT_LABEL_BOUND is a guess: where the labels pile up at it,
    sums that would read "much worse" give a warning naming --quality-label-bound, not a
    refusal; under a public bound, or with labels inside the assumed one, they still refuse."""
    from beam_dp import losses, quality
    loss = losses.make_loss("linear")
    # (q, s1, s2) over n = 1000: the model's error 10x the constant's; the labels' mean a^2/L^2
    # is 1 (all clamped to the bound: a raw price in dollars)
    piled = np.array([3000.0, 0.0, 1000.0])
    public = quality.Check(1e-6, 4.0, "float", 0.05)
    assumed = quality.Check(1e-6, 4.0, "float", 0.05, bound_assumed=True)
    assert quality.judged(loss, piled, public, 1000.0, "rows")["status"] == "much_worse"
    checked = quality.judged(loss, piled, assumed, 1000.0, "rows")
    assert checked["status"] == "worse"
    assert "--quality-label-bound" in quality.warning_text(checked)
    # labels inside the assumed bound (mean a^2/L^2 0.1): the clamp is harmless, still refused
    fitting = np.array([1000.0, 0.0, 100.0])
    assert quality.judged(loss, fitting, assumed, 1000.0, "rows")["status"] == "much_worse"
    # ... and close to it (labels near 3.5 of 4: mean a^2/L^2 0.77)
    close = np.array([3000.0, 875.0, 766.0])
    assert quality.judged(loss, close, assumed, 1000.0, "rows")["status"] == "much_worse"


def test_reserve_marks_the_default_bound_as_assumed():
    from beam_dp import accounting, losses, quality
    from beam_dp.algorithms import spec
    privacy = spec.Privacy(epsilon=1.0, delta=1e-5, accountant="pld")
    def reserve(model, bound=None):
        return quality.reserve(accounting.Ledger("pld"), losses.make_loss(model), privacy,
                               epsilon=None, label_bound=bound, secure=False)
    assumed, given, classifier = reserve("linear"), reserve("linear", 50.0), reserve("logistic")
    assert assumed.bound_assumed and not given.bound_assumed and not classifier.bound_assumed


def test_the_checks_options_with_the_check_off_are_refused_not_dropped():
    x, y = _binary(500, seed=1)
    with pytest.raises(ValueError, match="leave them out with --quality-check off"):
        beam_dp.train(x, y, epsilon=1.0, seed=0, quality_check="off", quality_epsilon=0.1)


@pytest.mark.parametrize("case", [
    dict(kind="binary", kwargs={}),                                  # averaged iterates
    dict(kind="binary", kwargs={"algorithm": "dpgd", "average_iterates": False}),
    dict(kind="regression", kwargs={"model": "linear", "scale_features": "private"}),
    # Poisson DP-SGD: over every row once more, which the batch job writes with the batches
    dict(kind="binary", kwargs={"algorithm": "dpsgd", "batch_size": 2000}),
    dict(kind="binary", kwargs={"algorithm": "dpsgd", "batch_size": 2000,
                                "runner": "FnApiRunner"}),
])
def test_the_check_in_the_last_training_job_releases_what_its_own_job_did(monkeypatch, tmp_path,
                                                                          case):
    """Full-batch runs sum the check in their last job (``base.FinalStage``), DP-SGD on the
    driver from the batch job's files: the same model (the averaged or last iterate, a scaled
    label's coefficients in its units), the same noise, so the same release as the job of its
    own it replaced, to the bit."""
    x, y = synthetic.make_dataset(case["kind"], 20_000, 4, 7)
    if case["kind"] == "regression":
        y = 3.0 * y + 5.0   # off the unit scale: the label's released range maps it
    steps = {} if case["kwargs"].get("algorithm") == "dpsgd" else {"steps": 60}
    kwargs = dict(epsilon=1.0, seed=11, **steps, **case["kwargs"])   # (equality, not accuracy)
    jobs = []
    if "runner" in kwargs:   # files, and the jobs each run launches
        synthetic.write_shards(str(tmp_path), "train", x, y, 3)
        x, y, kwargs["input"] = None, None, str(tmp_path / "train-*.parquet")
        real_run = BeamAggregator._run
        monkeypatch.setattr(BeamAggregator, "_run", lambda self, kind, *a, **kw: (
            jobs.append(kind), real_run(self, kind, *a, **kw))[1])
    fused, _ = _train(x, y, **kwargs)
    fused_jobs, jobs[:] = list(jobs), []
    ran = []
    original = noisy_gd.train

    def own_job(*args, **kw):   # the check left out of training: api runs it in a job after
        ran.append(kw.get("final_stage") is not None)
        return original(*args, **{**kw, "final_stage": None})

    monkeypatch.setattr(noisy_gd, "train", own_job)
    separate, _ = _train(x, y, **kwargs)
    assert ran == [True]
    if jobs:   # (the count is the footers'; 4 columns' private ranges are a job)
        assert fused_jobs == ["stages", "batches"] and jobs == fused_jobs + ["stages"]
    np.testing.assert_array_equal(fused.theta, separate.theta)
    a, b = fused.privacy_report["quality_check"], separate.privacy_report["quality_check"]
    assert a == b and a["status"] == "better"
    if case["kind"] == "regression":
        assert a["label_bound"] > 5.0   # the released range's, not the assumed default


def test_a_check_released_for_another_model_is_a_bug_never_a_second_release(monkeypatch):
    # The last job's release belongs to the model it summed; a model changed after it (here by
    # hand) stops the run rather than release the check again (it is charged once).
    real = noisy_gd.DPGD

    def changed(*args, **kwargs):
        result = real.train(*args, **kwargs)
        return dataclasses.replace(result, theta=result.theta + 1.0)

    monkeypatch.setattr(noisy_gd, "DPGD", dataclasses.replace(real, train=changed))
    x, y = _binary(2000)
    with pytest.raises(RuntimeError, match="another model"):
        beam_dp.train(x, y, epsilon=1.0, seed=0, algorithm="dpgd")


@pytest.mark.parametrize("algorithm", ["dpgd", "dpsgd"])
def test_a_run_resumed_after_its_last_job_finds_the_check_in_its_checkpoint(tmp_path, monkeypatch,
                                                                            algorithm):
    # The driver died after the last job (which held the check) and before quality.json was
    # written: the checkpoint holds the check's release with the state, so the resumed run
    # releases nothing again (no stage runs) and reports the same check.
    from beam_dp.local import LocalAggregator
    x, y = _binary(2000)
    first, _ = _train(x, y, epsilon=1.0, seed=0, checkpoint_dir=str(tmp_path / "ck"),
                      algorithm=algorithm)
    os.remove(tmp_path / "ck" / quality.SAVED)
    ran = []
    real = LocalAggregator.run_stages
    monkeypatch.setattr(LocalAggregator, "run_stages",
                        lambda self, stages, state: ran.append(len(stages)) or real(self, stages, state))
    again, _ = _train(x, y, epsilon=1.0, seed=0, checkpoint_dir=str(tmp_path / "ck"),
                      algorithm=algorithm)
    assert ran == []
    assert again.privacy_report["quality_check"] == first.privacy_report["quality_check"]
