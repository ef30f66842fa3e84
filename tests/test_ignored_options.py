"""Options given where they have no effect are refused, not dropped (``ignored_options.ACTS_ONLY_WHEN``).

One test per row of the table: through the CLI, the refusal (exit code 2, one line naming the
flag and why, no output directory), and the same flag with its condition met trains (exit 0).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import beam_dp
from beam_dp.algorithms import ignored_options, registry, spec

N = 300


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A tiny CSV: two numeric columns, a categorical one, a 0/1 label; and a vocabulary."""
    directory = tmp_path_factory.mktemp("ignored")
    g = np.random.default_rng(5)
    x = g.normal(size=(N, 2))
    city = g.choice(["a", "b", "c"], size=N)
    label = (x[:, 0] + (city == "a") + 0.3 * g.normal(size=N) > 0.5).astype(int)
    path = directory / "t.csv"
    with open(path, "w") as f:
        f.write("x1,x2,city,label\n")
        for i in range(N):
            f.write(f"{x[i, 0]:.6f},{x[i, 1]:.6f},{city[i]},{label[i]}\n")
    vocabulary = directory / "vocabulary.json"
    vocabulary.write_text(json.dumps({"city": ["a", "b", "c"]}))
    return {"csv": str(path), "vocabulary": str(vocabulary), "x": x, "y": label}


def _train(cli, table, out, *flags):
    numeric = [] if "--categorical-columns" in flags else ["--feature-columns", "x1,x2"]
    return cli("train", "--input", table["csv"], "--output", str(out), "--runner", "local",
               "--epsilon", "1", "--seed", "1", "--steps", "3", *numeric, *flags)


def _refused(cli, table, tmp_path, flag, *flags):
    out = tmp_path / "refused"
    result = _train(cli, table, out, *flags)
    assert result.code == 2, result
    line = result.err.strip()
    assert line.startswith("beam-dp: error: ") and "\n" not in line, line
    assert f"{flag} has no effect" in line, line
    assert not os.path.exists(out)   # nothing written


def _trains(cli, table, tmp_path, *flags):
    out = tmp_path / "trained"
    result = _train(cli, table, out, *flags)
    assert result.code == 0, result
    assert os.path.exists(out / "model.json")
    return json.loads((out / "model.json").read_text())


def test_huber_delta_only_with_the_huber_model(tmp_path, cli, table):
    _refused(cli, table, tmp_path, "--huber-delta", "--model", "logistic", "--huber-delta", "0.5")
    # the default value given explicitly is refused too (the flag's default is "not given")
    _refused(cli, table, tmp_path, "--huber-delta", "--model", "linear", "--huber-delta", "1")
    model = _trains(cli, table, tmp_path, "--model", "huber", "--huber-delta", "0.5")
    assert model["huber_delta"] == 0.5


def test_num_classes_only_with_the_softmax_model(tmp_path, cli, table):
    _refused(cli, table, tmp_path, "--num-classes", "--model", "logistic", "--num-classes", "2")
    model = _trains(cli, table, tmp_path, "--model", "softmax", "--num-classes", "2")
    assert model["num_classes"] == 2


def test_hash_seed_only_with_hashed_categorical_columns(tmp_path, cli, table):
    _refused(cli, table, tmp_path, "--hash-seed", "--hash-seed", "3")
    _refused(cli, table, tmp_path, "--hash-seed", "--hash-seed", "0",   # (the default value)
             "--categorical-columns", "city", "--feature-columns", "x1,x2",
             "--vocabulary", table["vocabulary"])
    model = _trains(cli, table, tmp_path, "--hash-seed", "3", "--categorical-columns", "city",
                    "--feature-columns", "x1,x2", "--hash-buckets", "8")
    assert model["encoding"]["hash_seed"] == 3


def test_count_epsilon_only_without_num_examples(tmp_path, cli, table):
    _refused(cli, table, tmp_path, "--count-epsilon", "--count-epsilon", "0.1",
             "--num-examples", str(N))
    _trains(cli, table, tmp_path, "--count-epsilon", "0.1")


@pytest.mark.parametrize("algorithm", ["dpgd", "dpsgd"])
def test_scale_epsilon_only_where_something_is_scaled(tmp_path, cli, table, algorithm):
    _refused(cli, table, tmp_path, "--scale-epsilon", "--algorithm", algorithm,
             "--scale-features", "none", "--scale-epsilon", "0.1")
    # auto with --feature-norm scales nothing either (the feature norm maps the features)
    _refused(cli, table, tmp_path, "--scale-epsilon", "--algorithm", algorithm,
             "--feature-norm", "1", "--scale-epsilon", "0.1")
    _trains(cli, table, tmp_path, "--algorithm", algorithm, "--scale-features", "private",
            "--scale-epsilon", "0.1")


def test_precondition_epsilon_only_where_column_counts_are_released(tmp_path, cli, table):
    categorical = ("--categorical-columns", "city", "--feature-columns", "x1,x2",
                   "--hash-buckets", "8")
    _refused(cli, table, tmp_path, "--precondition-epsilon", "--precondition-epsilon", "0.1")
    _refused(cli, table, tmp_path, "--precondition-epsilon", *categorical,
             "--precondition", "none", "--precondition-epsilon", "0.1")
    _trains(cli, table, tmp_path, *categorical, "--precondition-epsilon", "0.1")


@pytest.mark.parametrize("algorithm", ["dpgd", "dpsgd"])
def test_adaptive_clip_rate_only_with_adaptive_clipping(tmp_path, cli, table, algorithm):
    _refused(cli, table, tmp_path, "--adaptive-clip-rate", "--algorithm", algorithm,
             "--adaptive-clip-rate", "0.2")
    _trains(cli, table, tmp_path, "--algorithm", algorithm, "--adaptive-clip-quantile", "0.5",
            "--adaptive-clip-rate", "0.1")


def test_the_api_refuses_an_ignored_keyword_before_reading_data(table):
    with pytest.raises(ValueError, match="--num-classes has no effect"):
        beam_dp.train(table["x"], table["y"], model="logistic", num_classes=2, epsilon=1.0,
                      runner="local")
    with pytest.raises(ValueError, match="--adaptive-clip-rate has no effect"):
        beam_dp.train(table["x"], table["y"], epsilon=1.0, adaptive_clip_rate=0.2)


def test_tune_refuses_a_scale_epsilon_it_would_spend_on_nothing(tmp_path, cli, table):
    """Before the refusal, tune's plan charged --scale-epsilon with --scale-features none, a
    release that never happened, and the candidates had that much less budget."""
    out = tmp_path / "tuned"
    result = cli("tune", "--input", table["csv"], "--output", str(out), "--epsilon", "1",
                 "--feature-columns", "x1,x2", "--scale-features", "none",
                 "--scale-epsilon", "0.1", "--seed", "1")
    assert result.code == 2 and "--scale-epsilon has no effect" in result.err, result
    assert not os.path.exists(out)


def test_tune_reads_the_schema_for_the_refusals(tmp_path, cli, table):
    """tune's check took the table from its keywords alone: a schema's categorical columns and
    hash_buckets did not count, so --hash-seed (and --precondition-epsilon) were refused as
    having no effect although the candidates hash with that seed."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"categorical": ["city"], "hash_buckets": 8,
                                  "numeric": ["x1", "x2"]}))
    out = tmp_path / "tuned"
    result = cli("tune", "--input", table["csv"], "--output", str(out), "--epsilon", "1",
                 "--schema", str(schema), "--hash-seed", "3", "--seed", "1",
                 "--grid", "clip_norm=1", "--steps", "3")
    assert result.code == 0, result
    assert json.loads((out / "model.json").read_text())["encoding"]["hash_seed"] == 3


@pytest.mark.parametrize("flags,refusal", [
    (("--adaptive-clip-quantile", "0.5"), "does not take --adaptive-clip-quantile"),
    (("--precondition", "counts", "--precondition-epsilon", "0.1"),
     "does not take --precondition counts")])
def test_tune_refuses_releases_outside_its_plan_before_reading(tmp_path, cli, table, flags,
                                                               refusal, monkeypatch):
    """Both had failed only at the first candidate, after the input was read and split."""
    from beam_dp import data, tuning

    def refuse(*args, **kwargs):
        raise AssertionError("the input was read although the request is refused")

    monkeypatch.setattr(data, "blocks_from_file", refuse)
    monkeypatch.setattr(tuning._Splitter, "__call__", refuse)
    out = tmp_path / "tuned"
    result = cli("tune", "--input", table["csv"], "--output", str(out), "--epsilon", "1",
                 "--categorical-columns", "city", "--hash-buckets", "8",
                 "--feature-columns", "x1,x2", "--seed", "1", *flags)
    assert result.code == 2 and refusal in result.err, result
    assert not os.path.exists(out)


def test_steps_per_job_acts_in_process_too(table):
    """Not in the table: with --runner local it sets how often progress is reported (and the
    state checkpointed), so it is kept."""
    def reported(**kwargs) -> list:
        done_at = []
        beam_dp.train(table["x"], table["y"], epsilon=1.0, num_examples=N, seed=1, steps=4,
                      runner="local", quality_check="off",
                      progress=lambda done, total, eps: done_at.append(done), **kwargs)
        return [done for done in done_at if done]

    assert reported() == [4]
    assert reported(steps_per_job=2) == [2, 4]


def test_every_row_names_a_real_option():
    """Each row's option is a keyword of beam_dp.train or an algorithm's declared option."""
    import inspect
    keywords = set(inspect.signature(beam_dp.train).parameters)
    declared = {f.name for a in registry.algorithms().values()
                for f, _ in spec.fields(a.options)}
    for row in ignored_options.ACTS_ONLY_WHEN:
        assert row.name in keywords | declared, row.name
