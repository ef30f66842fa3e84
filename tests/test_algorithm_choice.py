"""Issue 15 item 3: ``--algorithm auto`` (``beam_dp.algorithms.choice``): a rule on public
inputs only (the model, the options given, a declared size), named with its reason in the report
and on stderr."""
from __future__ import annotations

import numpy as np
import pytest

import beam_dp
from beam_dp.algorithms import choice
from conftest import read_json

LARGE = 20_000_000   # the README: dpgd up to a few million rows, dpsgd from 10 million


@pytest.mark.parametrize("model, keywords, expected, said", [
    # Without a declared size: dpgd, the best or within 0.02 on every table measured.
    ("logistic", {}, "dpgd", "no size declared"),
    ("linear", {}, "dpgd", "no size declared"),
    ("logistic", {"rows_hint": 50_000}, "dpgd", "50,000 rows (--rows-hint) are below"),
    ("logistic", {"rows_hint": 5_000_000}, "dpgd", "are below 10,000,000"),
    # A full pass per step too slow: dpsgd for classification ...
    ("logistic", {"rows_hint": LARGE}, "dpsgd", "too slow"),
    ("softmax", {"num_examples": LARGE}, "dpsgd", "(--num-examples)"),
    # ... but not for a regression, where dpsgd's defaults were behind.
    ("huber", {"rows_hint": LARGE}, "dpgd", "behind on regression (R^2 0.912"),
    # What only one of them serves decides.
    ("logistic", {"given": ["batch_size"]}, "dpsgd", "dpgd: it has no --batch-size"),
    ("logistic", {"given": ["rank"], "rows_hint": LARGE}, "dpgd", "dpsgd: it has no --rank"),
    ("logistic", {"user_level": True, "rows_hint": LARGE}, "dpgd", "--privacy-unit-column"),
    ("logistic", {"sparse": True, "rows_hint": LARGE}, "dpgd", "categorical columns"),
])
def test_the_rule(model, keywords, expected, said):
    keywords = dict(keywords)
    chosen = choice.choose(model, keywords.pop("given", ()), **keywords)
    assert chosen.algorithm == expected
    assert said in chosen.reason


def test_num_examples_with_the_hint_and_a_request_neither_serves_are_refused():
    chosen = choice.choose("logistic", num_examples=1000)
    assert (chosen.algorithm, chosen.rows, chosen.rows_source) == ("dpgd", 1000, "--num-examples")
    with pytest.raises(ValueError, match="--rows-hint and --num-examples: give one"):
        choice.choose("logistic", num_examples=1000, rows_hint=LARGE)   # (the hint was ignored)
    with pytest.raises(ValueError, match="dpgd: it has no --batch-size; dpsgd: it has no --rank"):
        choice.choose("logistic", ["batch_size", "rank"])
    with pytest.raises(ValueError, match="--rows-hint must be a whole number"):
        choice.choose("logistic", rows_hint=0)


def _data(n=1500, seed=0):
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, 3))
    return x, (x[:, 0] - 0.5 * x[:, 1] > 0).astype(float)


def test_train_auto_trains_the_choice_and_the_report_names_it():
    x, y = _data()
    model = beam_dp.train(x, y, algorithm="auto", epsilon=1.0, seed=0, num_examples=len(y),
                          quality_check="off")
    assert model.artifact["algorithm"] == "dpgd" == model.privacy_report["algorithm"]
    chose = model.privacy_report["algorithm_choice"]
    assert chose["requested"] == "auto" and chose["chosen"] == "dpgd"
    assert chose["rows"] == len(y) and chose["rows_source"] == "--num-examples"
    hinted = beam_dp.train(x, y, algorithm="auto", epsilon=1.0, seed=0, rows_hint=LARGE,
                           batch_size=300, epochs=1, quality_check="off")
    assert hinted.artifact["algorithm"] == "dpsgd"
    assert hinted.privacy_report["algorithm_choice"]["rows_source"] == "--rows-hint"
    # Named algorithms are untouched: no choice in the report, and the hint is refused.
    named = beam_dp.train(x, y, algorithm="dpgd", epsilon=1.0, seed=0, num_examples=len(y),
                          quality_check="off")
    assert "algorithm_choice" not in named.privacy_report
    with pytest.raises(ValueError, match="read by algorithm 'auto' only"):
        beam_dp.train(x, y, algorithm="dpgd", epsilon=1.0, seed=0, rows_hint=LARGE)


def test_cli_auto_says_its_choice_on_stderr_and_in_the_reports(tmp_path, cli, small_binary):
    out = tmp_path / "out"
    done = cli("train", "--input", small_binary["train_glob"], "--output", out, "--epsilon", 1,
               "--runner", "local", "--seed", 0, "--algorithm", "auto", "--rows-hint", LARGE,
               "--clip-norm", 0.5, "--epochs", 1)
    assert done.code == 0, done
    assert "--algorithm auto chose dpsgd: " in done.err
    assert "trained logistic with dpsgd" in done.out
    report = read_json(out / "privacy_report.json")
    assert report["algorithm_choice"]["chosen"] == "dpsgd"
    assert report["hyperparameters"]["values"]["clip_norm"] == 0.5   # a flag given reaches it
    # dpsgd's default step (2 for logistic, 1/2 for linear and huber): None, as given
    assert report["hyperparameters"]["values"]["learning_rate"] is None
    assert "--algorithm auto chose dpsgd" in (out / "report.html").read_text()
    # The default stays dpgd, and says nothing about a choice.
    plain = cli("train", "--input", small_binary["train_glob"], "--output", tmp_path / "plain",
                "--epsilon", 1, "--runner", "local", "--seed", 0, "--steps", 5)
    assert plain.code == 0 and "auto chose" not in plain.err
    assert "algorithm_choice" not in read_json(tmp_path / "plain" / "privacy_report.json")


@pytest.mark.parametrize("hint, said", [("1e200", "takes a whole number, got '1e200'"),
                                        ("nan", "takes a whole number, got 'nan'"),
                                        ("0", "must be at least 1, got 0")])
def test_a_rows_hint_that_is_not_a_whole_number_is_refused_in_words(tmp_path, cli, hint, said):
    # (argparse had said "invalid _positive_int value", naming a function of this module)
    done = cli("train", "--input", "x.csv", "--output", tmp_path / "out", "--epsilon", 1,
               "--algorithm", "auto", "--rows-hint", hint)
    assert done.code == 2 and said in done.err and "_positive_int" not in done.err


def test_a_rows_hint_far_from_the_private_count_is_warned():
    from beam_dp import api

    def warned(hint, n, source="--rows-hint"):
        report = {"delta": 1e-9, "epsilon": 1.0, "algorithm_choice": {
            "chosen": "dpsgd", "rows": hint, "rows_source": source}}
        return [w for w in api._warnings(report, {"value": n, "error_bound_95": 300.0})
                if "--rows-hint" in w]
    assert warned(20_000_000, 9965)          # hinted 2,000x the table
    assert warned(1_000, 100_000)            # hinted 100x too few
    assert not warned(20_000_000, 15_000_000) and not warned(50_000, 100_000)
    assert not warned(20_000_000, 9965, "--num-examples")   # the public n: nothing to compare
