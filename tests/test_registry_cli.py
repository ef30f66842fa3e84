"""Acceptance tests of the algorithm registry and the CLI over it (issue 9, item 1) and of the CLI
items of issue 8: training/serving skew (7), the dpgd default step count (9), --overwrite (10),
unquoted globs (12) and rough edges (13).

Every CLI run is in-process (``beam_dp.cli.main``) with ``--runner local`` unless the Beam path is
the point. ``main`` returns the exit code of every error, argparse's included (``run`` also
accepts a ``SystemExit``, as the console script sees one).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.special import expit

from beam_dp import cli as cli_mod
from beam_dp import data, synthetic
from beam_dp.algorithms import registry, spec
from conftest import model_theta, read_json

ALGORITHMS = registry.algorithms()
LOCAL = ["--runner", "local"]


class Result:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("beam-dp: error:")]

    def __repr__(self):   # never holds data values: the CLI's messages are tested not to
        return f"Result(code={self.code}, out={self.out!r}, err={self.err[-2000:]!r})"


@pytest.fixture
def run(capsys):
    def run(*argv) -> Result:
        capsys.readouterr()
        try:
            code = cli_mod.main([str(a) for a in argv])
        except SystemExit as e:   # argparse's own errors and --help
            code = e.code
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)
    return run


def _no_temporary_leftovers(parent) -> None:
    assert [n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n] == []


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A small binary dataset in 3 Parquet shards and a regression one in 2 (n = 2000, d = 5)."""
    directory = tmp_path_factory.mktemp("registry-cli")
    x, y = synthetic.make_dataset("binary", 2000, 5, seed=21)
    xr, yr = synthetic.make_dataset("regression", 2000, 5, seed=22)
    binary = synthetic.write_shards(str(directory / "binary"), "train", x, y, 3)
    regression = synthetic.write_shards(str(directory / "regression"), "train", xr, yr, 2)
    return {"binary": binary, "binary_glob": str(directory / "binary" / "train-*.parquet"),
            "regression": regression,
            "regression_glob": str(directory / "regression" / "train-*.parquet"),
            "x": x, "y": y, "n": 2000, "d": 5}


# ====================================================================== 1. help and the registry


def _subparser(command: str, argv: list[str]) -> argparse.ArgumentParser:
    parser = cli_mod.build_parser(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _help_entries(text: str) -> dict[str, str]:
    """Option name -> its whole help entry (invocation and help text, whitespace-normalized),
    parsed from argparse's output: an entry starts with '  -' and continues on deeper-indented
    lines."""
    entries, current = {}, None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            current = line.strip()
            entries[current.split()[0].rstrip(",")] = current
        elif current is not None and re.match(r"^ {4,}\S", line):
            entries[current.split()[0].rstrip(",")] += " " + line.strip()
        else:
            current = None
    return entries


def _help(run, monkeypatch, *argv) -> str:
    monkeypatch.setenv("COLUMNS", "100")   # stable wrapping; entries are re-joined anyway
    r = run(*argv, "--help")
    assert r.code == 0, r
    return r.out


def _default_text(action) -> str | None:
    """The '(default: ...)' that must appear for an action; None where none is due (a None
    default is 'derived', explained by the help text; a switch like --overwrite is off)."""
    if isinstance(action, argparse.BooleanOptionalAction) and action.default is not None \
            and action.default is not argparse.SUPPRESS:
        return f"(default: {'on' if action.default else 'off'})"
    if action.default is None or action.nargs == 0 or action.default is argparse.SUPPRESS:
        return None
    return f"(default: {action.default})"


def _check_help(text: str, parser: argparse.ArgumentParser) -> None:
    entries = _help_entries(text)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        name = action.option_strings[0]
        assert name in entries, f"{name} is missing from the help"
        entry = entries[name]
        invocation = formatter._format_action_invocation(action)
        assert entry.startswith(invocation), (name, entry)
        help_text = re.sub(r"\(default: [^)]*\)", "", entry[len(invocation):]).strip()
        assert help_text, f"{name} has no help text"
        expected = _default_text(action)
        if expected is not None:
            assert expected in entry, f"{name}: {expected} not shown in {entry!r}"


@pytest.mark.parametrize("algorithm", [None, *ALGORITHMS])
def test_train_help_shows_every_default_and_help_text(run, monkeypatch, algorithm):
    argv = ["train"] + (["--algorithm", algorithm] if algorithm else [])
    text = _help(run, monkeypatch, *argv)
    _check_help(text, _subparser("train", argv + ["--help"]))


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_train_help_of_an_algorithm_lists_its_declared_options(run, monkeypatch, algorithm):
    chosen = ALGORITHMS[algorithm]
    entries = _help_entries(_help(run, monkeypatch, "train", "--algorithm", algorithm))
    declared = spec.describe(chosen.options)
    assert declared, f"{algorithm} declares no options"
    for flag, default, text in declared:
        assert flag in entries, f"{flag} of {algorithm} missing from its --help"
        assert text and " ".join(text.replace("%%", "%").split()) in entries[flag]
        if default not in ("derived", "True", "False"):
            assert f"(default: {default})" in entries[flag]
    # Only its own: no flag another algorithm declares and it does not.
    own = {f for f, _, _ in declared}
    others = {f for a in ALGORITHMS.values() for f, _, _ in spec.describe(a.options)} - own
    assert not others & set(entries), f"{algorithm}'s help shows {sorted(others & set(entries))}"


def test_a_switch_whose_default_depends_on_other_options_shows_no_default(run, monkeypatch):
    """dpgd's --average-iterates defaults to None (on, but off with --precondition counts, as its
    help says): the formatter printed "(default: off)" after that text."""
    entries = _help_entries(_help(run, monkeypatch, "train", "--algorithm", "dpgd"))
    entry = entries["--average-iterates"]
    assert "default on" in entry and "(default:" not in entry, entry
    entries = _help_entries(_help(run, monkeypatch, "train", "--algorithm", "dpsgd"))
    assert "(default: off)" in entries["--average-iterates"]   # dpsgd's is a plain False
    # Under auto (dpgd's on or dpsgd's off, whichever is chosen) and as tune's fixed option (the
    # grid's or dpgd's default) it has no single default either: it had shown "(default: on)".
    for argv in (("train", "--algorithm", "auto"), ("tune",)):
        entry = _help_entries(_help(run, monkeypatch, *argv))["--average-iterates"]
        assert "(default:" not in entry, (argv, entry)


@pytest.mark.slow
def test_python_dash_m_runs_the_command():
    """``python -m beam_dp.cli ...`` (how the module is run without the console script) did
    nothing and exited 0: the module had no __main__ guard."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "beam_dp.cli", "train", "--input", "x.csv"],
                       capture_output=True, text=True, timeout=120, env=os.environ)
    assert r.returncode == 2 and "beam-dp: error:" in r.stderr, r


@pytest.mark.parametrize("command", [
    "stats", "predict",
    "make-data",
])
def test_other_commands_show_their_defaults(run, monkeypatch, command):
    text = _help(run, monkeypatch, command)
    _check_help(text, _subparser(command, [command, "--help"]))


def test_algorithms_lists_every_algorithm_with_its_flags(run):
    r = run("algorithms")
    assert r.code == 0, r
    blocks, current = {}, None
    for line in r.out.splitlines():
        if line and not line.startswith(" "):
            current = line.split(":", 1)[0]
            blocks[current] = [line]
        elif current is not None and line.strip():
            blocks[current].append(" ".join(line.split()))
    assert list(blocks) == list(ALGORITHMS)
    for name, algorithm in ALGORITHMS.items():
        lines = blocks[name]
        assert lines[0] == f"{name}: {algorithm.use_when}"
        assert any(", ".join(algorithm.models) in line for line in lines)
        for flag, default, text in spec.describe(algorithm.options):
            (line,) = [l for l in lines if l.split()[0] == flag]
            assert " ".join(text.replace("%%", "%").split()) in line
            assert line.endswith(f"(default: {default})")


def _out_of_range_values():
    """(algorithm, flag, value) for every declared option: below its low bound, above its high
    bound, not finite, or not one of its choices."""
    cases = []
    for name, algorithm in ALGORITHMS.items():
        for f, kind in spec.fields(algorithm.options):
            meta, flag = f.metadata, spec.flag(f.name)
            if meta.get("choices"):
                cases.append((name, flag, "bogus"))
            elif kind in (int, float):
                if meta.get("low") is not None:
                    low = meta["low"]
                    cases.append((name, flag, f"{low:g}" if meta.get("low_open") else f"{low - 1:g}"))
                if meta.get("high") is not None:
                    cases.append((name, flag, f"{meta['high'] + 1:g}"))
                if kind is float:
                    cases.append((name, flag, "nan"))
    return cases


@pytest.mark.parametrize("algorithm,flag,value", _out_of_range_values())
def test_out_of_range_option_is_one_line_error_naming_the_flag(run, tmp_path, shards, algorithm, flag, value):
    out = tmp_path / "out"
    r = run("train", "--input", shards["binary_glob"], "--output", out, "--epsilon", "1",
            "--algorithm", algorithm, flag, value, *LOCAL)
    assert r.code == 2, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r
    assert lines[0].startswith("beam-dp: error:") and flag in lines[0], r
    assert not out.exists()


@pytest.mark.parametrize("value", ["1.5", "ten"])
def test_mistyped_whole_number_is_one_line_error(run, tmp_path, shards, value):
    r = run("train", "--input", shards["binary_glob"], "--output", tmp_path / "out",
            "--epsilon", "1", "--algorithm", "dpgd", "--steps", value, *LOCAL)
    assert r.code == 2, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("beam-dp: error:") and "--steps" in lines[0], r


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_flags_of_other_algorithms_are_refused(run, tmp_path, shards, monkeypatch, algorithm):
    from beam_dp import api

    def no_training(*args, **kwargs):
        raise AssertionError("trained although a flag of another algorithm was given")

    monkeypatch.setattr(api, "train", no_training)
    own = {f.name for f in dataclasses.fields(ALGORITHMS[algorithm].options)}
    foreign = {}
    for other in ALGORITHMS.values():
        for f, kind in spec.fields(other.options):
            if f.name not in own:
                foreign[f.name] = (f, kind)
    assert foreign or len(ALGORITHMS) == 1
    for name, (f, kind) in sorted(foreign.items()):
        if kind is bool:
            tokens = [spec.flag(name)]
        elif f.metadata.get("choices"):
            tokens = [spec.flag(name), str(f.metadata["choices"][0])]
        else:
            tokens = [spec.flag(name), "10"]
        r = run("train", "--input", shards["binary_glob"], "--output", tmp_path / "out",
                "--epsilon", "1", "--algorithm", algorithm, *tokens, *LOCAL)
        assert r.code == 2, (tokens, r)
        (line,) = r.error_lines
        assert spec.flag(name) in line and algorithm in line, line
        assert not (tmp_path / "out").exists()


def test_batch_size_with_dpgd_is_refused(run, tmp_path, shards):
    r = run("train", "--input", shards["binary_glob"], "--output", tmp_path / "out",
            "--epsilon", "1", "--algorithm", "dpgd", "--batch-size", "10", *LOCAL)
    assert r.code == 2
    (line,) = r.error_lines
    assert "--batch-size" in line and "dpgd" in line
    assert not (tmp_path / "out").exists()


def _string_constants(tree) -> list[ast.Constant]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_cli_has_no_branch_on_an_algorithm_name():
    """No module of the CLI names an algorithm except in DEFAULT_ALGORITHM's definition:
    everything algorithm-specific comes from the registry."""
    import pathlib

    from beam_dp.cli import parsing

    allowed, named = set(), []
    for path in sorted(pathlib.Path(cli_mod.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DEFAULT_ALGORITHM"
                                                    for t in node.targets):
                allowed |= {id(c) for c in _string_constants(node)}
        named += [(path.name, c.lineno, c.value) for c in _string_constants(tree)
                  if c.value in ALGORITHMS and id(c) not in allowed]
    assert allowed, "DEFAULT_ALGORITHM is not defined in the CLI"
    assert named == []
    assert parsing.DEFAULT_ALGORITHM in ALGORITHMS


@pytest.mark.parametrize("module", ["beam_dp.api", "beam_dp.estimators"])
def test_api_and_estimators_do_not_compare_algorithm_names(module):
    """Defaults may name an algorithm; no comparison (a branch) may."""
    import importlib

    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    compared = [(c.lineno, c.value) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                for c in _string_constants(node) if c.value in ALGORITHMS]
    assert compared == []


# ------------------------------------------------------- a new algorithm needs no CLI edit


@dataclasses.dataclass
class _ToyOptions:
    shrink: float = spec.option(0.5, "toy: the intercept it outputs", low=0, high=1)


def _toy_train(options, problem, aggregator, seed, ledger, progress):
    from dp_accounting import dp_event

    from beam_dp.algorithms import spec

    ledger.record("toy_release", dp_event.GaussianDpEvent(10.0), 1, noise_multiplier=10.0)
    theta = np.zeros((problem.loss.outputs(), problem.dim + 1))
    theta[:, -1] = options.shrink
    return spec.TrainResult(theta=theta, ledger=ledger, noise_multiplier=10.0,
                            sampling_probability=1.0, steps=1, clip_norm=1.0,
                            dataset_size={"source": "public", "value": 1}, preprocessing={})


def test_a_registered_algorithm_gets_flags_help_and_training_without_touching_cli(
        run, tmp_path, shards, monkeypatch):
    toy = spec.Algorithm("toy", "testing the registry", ("logistic",), _ToyOptions, _toy_train)
    original = registry.algorithms

    def with_toy():
        return {**original(), "toy": toy}

    monkeypatch.setattr(registry, "algorithms", with_toy)
    entries = _help_entries(_help(run, monkeypatch, "train", "--algorithm", "toy"))
    assert "--shrink" in entries and "(default: 0.5)" in entries["--shrink"]
    assert "toy: testing the registry" in run("algorithms").out
    r = run("train", "--input", shards["binary_glob"], "--output", tmp_path / "out",
            "--noise-multiplier", "10", "--num-examples", "2000", "--algorithm", "toy",
            "--shrink", "0.25", *LOCAL)
    assert r.code == 0, r
    assert read_json(tmp_path / "out" / "model.json")["intercept"] == 0.25
    r = run("train", "--input", shards["binary_glob"], "--output", tmp_path / "out2",
            "--noise-multiplier", "10", "--algorithm", "toy", "--shrink", "2", *LOCAL)
    assert r.code == 2 and "--shrink" in r.error_lines[0]


# ====================================================================== 12. several input paths


def _train_dpgd(run, inputs, output, *extra, steps=20):
    return run("train", "--input", *inputs, "--output", output, "--algorithm", "dpgd",
               "--epsilon", "1", "--num-examples", "2000", "--seed", "5", "--steps", steps, *extra)


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["local", "FnApiRunner"])
def test_unquoted_glob_trains_on_every_file(run, tmp_path, shards, runner):
    """`--input a.parquet b.parquet c.parquet` (a glob the shell expanded) gives the model of the
    quoted glob; the first file alone gives another one."""
    steps = 20 if runner == "local" else 2   # one Beam pipeline per run
    extra = ["--runner", runner, "--steps-per-job", "20"]
    assert _train_dpgd(run, [shards["binary_glob"]], tmp_path / "glob", *extra, steps=steps).code == 0
    r = _train_dpgd(run, shards["binary"], tmp_path / "expanded", *extra, steps=steps)
    assert r.code == 0, r
    glob_theta, expanded_theta = model_theta(tmp_path / "glob"), model_theta(tmp_path / "expanded")
    np.testing.assert_allclose(expanded_theta, glob_theta, rtol=1e-9, atol=1e-12)
    assert _train_dpgd(run, shards["binary"][:1], tmp_path / "first", *extra, steps=steps).code == 0
    assert np.max(np.abs(model_theta(tmp_path / "first") - glob_theta)) > 1e-3


def test_comma_separated_and_repeated_paths_are_one_set_of_files(run, tmp_path, shards):
    files = shards["binary"]
    assert _train_dpgd(run, [shards["binary_glob"]], tmp_path / "glob", *LOCAL).code == 0
    assert _train_dpgd(run, [",".join(files), files[0]], tmp_path / "listed", *LOCAL).code == 0
    np.testing.assert_allclose(model_theta(tmp_path / "listed"), model_theta(tmp_path / "glob"),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("layout", ["after_output", "after_seed", "after_beam_flag", "first"])
def test_stray_path_stops_with_a_clear_error_and_writes_nothing(run, tmp_path, shards, layout, monkeypatch):
    from beam_dp import api

    monkeypatch.setattr(api, "train", lambda *a, **k: pytest.fail("trained with a stray path"))
    a, b, c = shards["binary"]
    out = tmp_path / "out"
    base = ["--epsilon", "1", *LOCAL]
    argv = {
        "after_output": ["train", "--input", a, "--output", out, b, c, *base],
        "after_seed": ["train", "--input", a, "--output", out, "--seed", "3", b, *base],
        "after_beam_flag": ["train", "--input", a, "--output", out, "--temp_location",
                            str(tmp_path), b, *base],
        "first": ["train", a, "--input", b, "--output", out, *base],
    }[layout]
    stray = a if layout == "first" else b
    r = run(*argv)
    assert r.code == 2, r
    (line,) = r.error_lines
    assert os.path.basename(stray) in line and "--input" in line
    assert not out.exists()
    _no_temporary_leftovers(tmp_path)


@pytest.mark.parametrize("runner", ["local", "FnApiRunner"])
def test_misspelt_flag_is_refused(run, tmp_path, shards, monkeypatch, runner):
    from beam_dp import api

    monkeypatch.setattr(api, "train", lambda *a, **k: pytest.fail("trained with a misspelt flag"))
    r = run("train", "--input", shards["binary_glob"], "--output", tmp_path / "out", "--epsilon",
            "1", "--clip_norm", "0.5", "--runner", runner)
    assert r.code == 2 and "--clip_norm" in r.error_lines[0], r


def test_stray_argument_refused_by_predict_and_stats(run, tmp_path, shards):
    a, b, _ = shards["binary"]
    r = run("stats", "--input", a, "--output", tmp_path / "s", b, "--epsilon", "1", *LOCAL)
    assert r.code == 2 and r.error_lines, r
    assert not (tmp_path / "s").exists()
    r = run("predict", "--model", tmp_path / "m", "--input", a, "--output", tmp_path / "p.csv", b)
    assert r.code == 2 and r.error_lines, r
    assert not (tmp_path / "p.csv").exists()


# ================================================================ 7. training/serving skew


def _by_hand(artifact: dict, x: np.ndarray) -> np.ndarray:
    """Scores x -> w . map(x) + b from model.json alone, with the recorded map written out in
    numpy (normalize_rows: x C / ||x|| for x != 0; clip_rows: x min(1, C / ||x||))."""
    recorded = artifact.get("feature_transform") or {}
    assert set(recorded) <= {"normalize_rows", "clip_rows"}, recorded
    norms = np.sqrt(np.sum(x ** 2, axis=1))
    safe = np.where(norms > 0, norms, 1.0)
    scale = np.ones(len(x))
    if "normalize_rows" in recorded:
        scale = np.where(norms > 0, recorded["normalize_rows"] / safe, 1.0)
    elif "clip_rows" in recorded:
        scale = np.where(norms > 0, np.minimum(1.0, recorded["clip_rows"] / safe), 1.0)
    z = x * scale[:, None]
    w = np.asarray(artifact["coefficients"], dtype=np.float64)
    return z @ w + float(artifact["intercept"])


def _serving_rows(d: int, seed: int = 99) -> np.ndarray:
    """Rows of very different norms (0, tiny, ordinary, large), so that any map shows."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((300, d)) * np.exp(g.uniform(-3, 3, size=(300, 1)))
    x[0] = 0.0
    return x


# (id, algorithm, model, task, extra flags, the map training applies by the algorithm's definition:
#  None = identity, ("normalize_rows", C), ("clip_rows", None) = clipped to a derived positive R)
SKEW_CASES = [
    ("dpgd", "dpgd", "logistic", "binary", [], None),
    ("dpsgd", "dpsgd", "logistic", "binary", [], None),
    ("dpsgd-feature-norm", "dpsgd", "logistic", "binary", ["--feature-norm", "2"], ("normalize_rows", 2.0)),
    ("dpgd-feature-norm", "dpgd", "hinge", "binary", ["--feature-norm", "3"], ("normalize_rows", 3.0)),
    ("dpsgd-f-practical", "dpsgd-f", "logistic", "binary", [], ("normalize_rows", 1.0)),
    ("dpsgd-f-theory", "dpsgd-f", "logistic", "binary", ["--variant", "theory"], ("clip_rows", None)),
    ("ssp", "ssp", "linear", "regression", [], "unchecked"),
    ("dp-ambssgd", "dp-ambssgd", "linear", "regression", [], None),
    ("mirror-descent-feature-norm", "mirror-descent", "logistic", "binary", ["--feature-norm", "2"],
     ("normalize_rows", 2.0)),
    ("heavy-tailed-md", "heavy-tailed-md", "linear", "regression", [], None),
    ("objective-perturbation", "objective-perturbation", "logistic", "binary", [],
     ("clip_rows", None)),
    ("bias-reduced-sgd", "bias-reduced-sgd", "logistic", "binary", ["--call-epsilon", "0.5"], None),
    # dense rows clipped to F = sqrt(d) (--feature-bound's default), recorded in model.json
    ("output-perturbation", "output-perturbation", "logistic", "binary", [], ("clip_rows", None)),
]
# Per case: the --epsilon of the run and the held-out accuracy it must pass (default 1 and 0.7).
# bias-reduced-sgd is a theory device (paper 001: batches of very uneven sizes, noise-dominated at
# n = 2000): at epsilon 1 it is near chance here; at epsilon 8 it reached 0.66 (seed 3; the
# constant predictor 0.57, non-private 0.85 on these rows).
SKEW_BUDGET = {"bias-reduced-sgd": ("8", 0.6)}


def test_skew_cases_cover_every_registered_algorithm():
    assert {case[1] for case in SKEW_CASES} == set(ALGORITHMS)


@pytest.mark.slow
@pytest.mark.parametrize("case", SKEW_CASES, ids=[c[0] for c in SKEW_CASES])
def test_predict_applies_the_map_training_applied(run, tmp_path, shards, case):
    """Issue 8, item 7: train and predict through the CLI with the algorithm's defaults; model.json
    records the map training applied (never inferred from the flags typed), and `beam-dp predict`
    equals applying that recorded map and the coefficients by hand."""
    _, algorithm, model, task, extra, expected = case
    epsilon, least_accuracy = SKEW_BUDGET.get(algorithm, ("1", 0.7))
    glob = shards["binary_glob"] if task == "binary" else shards["regression_glob"]
    out = tmp_path / "model"
    r = run("train", "--input", glob, "--output", out, "--algorithm", algorithm, "--model", model,
            "--epsilon", epsilon, "--seed", "3", *extra, *LOCAL)
    assert r.code == 0, r
    artifact = read_json(out / "model.json")
    recorded = artifact.get("feature_transform")
    if expected is None:
        assert not recorded
    elif expected != "unchecked":
        name, norm = expected
        assert recorded is not None and list(recorded) == [name], recorded
        assert recorded[name] > 0 if norm is None else recorded[name] == norm

    x = _serving_rows(shards["d"])
    columns = {f"f{j}": x[:, j] for j in range(x.shape[1])}
    data.write_table(str(tmp_path / "serve.parquet"), columns)
    r = run("predict", "--model", out, "--input", tmp_path / "serve.parquet",
            "--output", tmp_path / "predictions.parquet")
    assert r.code == 0, r
    table = pq.read_table(tmp_path / "predictions.parquet")
    scores = _by_hand(artifact, x)
    if model == "linear":
        np.testing.assert_allclose(table["prediction"].to_numpy(), scores, rtol=1e-9, atol=1e-9)
        return
    confident = np.abs(scores) > 1e-9   # a score of exactly 0 may round either way
    assert np.array_equal(table["prediction"].to_numpy()[confident], (scores > 0)[confident].astype(int))
    if model == "logistic":
        np.testing.assert_allclose(table["probability"].to_numpy(), expit(scores), rtol=1e-9, atol=1e-12)
    # The model is a model: on held-out rows of the training distribution it beats chance clearly.
    x_val, y_val = synthetic.make_dataset("binary", 2000, shards["d"], seed=21)
    assert np.mean((_by_hand(artifact, x_val) > 0) == y_val) > least_accuracy


# ======================================================================== 9. dpgd's steps


@pytest.mark.parametrize("n,epsilon", [(300, 0.2), (2000, 1.0)])
def test_dpgd_default_steps_are_what_the_help_says(run, tmp_path, n, epsilon):
    """--steps' help: ceil((n eps)^2 / (2 rank ln(1/delta))), rank d + 1, capped at --max-steps,
    whose default is 300 up to n = 100,000 rows (``noisy_gd.default_max_steps``)."""
    d = 4
    x, y = synthetic.make_dataset("binary", n, d, seed=1)
    path = tmp_path / "train.parquet"
    data.write_table(str(path), {**{f"f{j}": x[:, j] for j in range(d)}, "label": y})
    r = run("train", "--input", path, "--output", tmp_path / "out", "--algorithm", "dpgd",
            "--epsilon", epsilon, "--num-examples", n, "--seed", "1", *LOCAL)
    assert r.code == 0, r
    (entry,) = [v for k, v in _help_entries(_help_text_no_run("train", "--algorithm", "dpgd")).items()
                if k == "--max-steps"]
    assert "default 300 up to n = 100,000 rows" in " ".join(entry.split())
    cap = 300
    expected = min(cap, math.ceil((n * epsilon) ** 2 / (2 * (d + 1) * math.log(1e5))))
    assert read_json(tmp_path / "out" / "privacy_report.json")["steps"] == expected


def _help_text_no_run(*argv) -> str:
    return _subparser(argv[0], list(argv) + ["--help"]).format_help()


# ====================================================================== 10. --overwrite


@pytest.fixture
def trained(run, tmp_path, shards):
    out = tmp_path / "model"
    r = run("train", "--input", shards["binary_glob"], "--output", out, "--algorithm", "dpgd",
            "--noise-multiplier", "2", "--steps", "3", "--num-examples", "2000", *LOCAL)
    assert r.code == 0, r
    return out


def test_predict_refuses_an_existing_output_unless_overwrite(run, tmp_path, shards, trained):
    target = tmp_path / "p.csv"
    argv = ["predict", "--model", trained, "--input", shards["binary_glob"], "--output", target]
    assert run(*argv).code == 0
    before = target.read_bytes()
    r = run(*argv)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and "--overwrite" in r.err, r
    assert target.read_bytes() == before
    assert run(*argv, "--overwrite").code == 0
    _no_temporary_leftovers(tmp_path)


@pytest.mark.parametrize("target", ["training_data", "user_csv", "directory", "fifo"])
def test_predict_overwrite_replaces_only_a_predictions_file(run, tmp_path, shards, trained, target):
    if target == "training_data":
        path = tmp_path / "data.parquet"
        data.write_table(str(path), {"f0": np.arange(3.0), "label": np.arange(3.0)})
    elif target == "user_csv":
        path = tmp_path / "good.csv"
        path.write_text("prediction,notes\n1,mine\n")
    elif target == "directory":
        path = tmp_path / "dir"
        path.mkdir()
        (path / "keep.txt").write_text("precious")
    else:   # a special file (not /dev/null itself: a regression run as root would replace it)
        path = tmp_path / "fifo"
        os.mkfifo(path)
    before = sorted((p, os.path.getsize(p)) for p in map(str, tmp_path.rglob("*")) if os.path.isfile(p))
    r = run("predict", "--model", trained, "--input", shards["binary_glob"], "--output", path,
            "--overwrite")
    assert r.code == 2, r
    (line,) = r.err.strip().splitlines()
    assert line.startswith("beam-dp: error:") and "nothing was replaced or deleted" in line
    after = sorted((p, os.path.getsize(p)) for p in map(str, tmp_path.rglob("*")) if os.path.isfile(p))
    assert after == before
    assert os.path.exists(path) and not os.path.isfile(path) or target != "fifo"


def test_make_data_overwrite_refuses_a_foreign_directory(run, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    r = run("make-data", "--output", out, "--n", "50", "--validation-n", "0", "--overwrite")
    assert r.code == 2 and "nothing was replaced or deleted" in r.err, r
    assert os.listdir(out) == ["keep.txt"]


# ====================================================================== 13. rough edges


def test_ctrl_c_is_one_line_exit_130_and_no_output(run, tmp_path, shards, monkeypatch):
    from beam_dp import local

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(local.LocalAggregator, "run_stages", interrupted)
    out, checkpoints = tmp_path / "out", tmp_path / "ckpt"
    r = run("train", "--input", shards["binary_glob"], "--output", out, "--epsilon", "1", *LOCAL)
    assert r.code == 130, r
    (line,) = r.err.strip().splitlines()
    assert line.startswith("beam-dp: interrupted")
    assert not out.exists()
    _no_temporary_leftovers(tmp_path)
    r = run("train", "--input", shards["binary_glob"], "--output", out, "--epsilon", "1",
            "--checkpoint-dir", checkpoints, *LOCAL)
    assert r.code == 130
    (line,) = r.err.strip().splitlines()
    # Interrupted in the first chunk: the plan (the noisy count, the noise) was saved before it,
    # so the line says how to resume from there.
    assert "rerun the same command to resume from" in line and str(checkpoints) in line


def test_ctrl_c_during_predict(run, tmp_path, shards, trained, monkeypatch):
    from beam_dp import api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api.Model, "block_scores", interrupted)
    r = run("predict", "--model", trained, "--input", shards["binary_glob"], "--output", tmp_path / "p.csv")
    assert r.code == 130 and len(r.err.strip().splitlines()) == 1, r
    assert not (tmp_path / "p.csv").exists()
    _no_temporary_leftovers(tmp_path)


@pytest.mark.parametrize("what", ["missing_model", "not_a_model", "unwritable_output"])
def test_predict_errors_are_one_line(run, tmp_path, shards, trained, what):
    model, output = trained, tmp_path / "p.csv"
    if what == "missing_model":
        model = tmp_path / "missing"
    elif what == "not_a_model":
        model = tmp_path / "junk.json"
        model.write_text("{\"a\": 1}")
    else:
        (tmp_path / "a_file").write_text("x")
        output = tmp_path / "a_file" / "p.csv"
    r = run("predict", "--model", model, "--input", shards["binary_glob"], "--output", output)
    assert r.code == 2, r
    (line,) = r.err.strip().splitlines()
    assert line.startswith("beam-dp: error:")
    assert str(model if what != "unwritable_output" else output) in line
    assert ".tmp-" not in line
    assert "Traceback" not in r.err


def test_unwritable_training_output_is_refused_before_training(run, tmp_path, shards, monkeypatch):
    from beam_dp import api

    monkeypatch.setattr(api, "train", lambda *a, **k: pytest.fail("trained into an unwritable output"))
    (tmp_path / "a_file").write_text("x")
    output = tmp_path / "a_file" / "out"
    r = run("train", "--input", shards["binary_glob"], "--output", output, "--epsilon", "1", *LOCAL)
    assert r.code == 2, r
    (line,) = r.err.strip().splitlines()
    assert line.startswith("beam-dp: error:") and str(output) in line and ".tmp-" not in line


def test_delta_not_small_against_1_over_n_warns(run, tmp_path, shards):
    out = tmp_path / "out"
    r = run("train", "--input", shards["binary_glob"], "--output", out, "--algorithm", "dpgd",
            "--noise-multiplier", "2", "--delta", "0.01", "--num-examples", "2000", "--steps", "3", *LOCAL)
    assert r.code == 0, r
    warnings = [line for line in r.err.splitlines() if line.startswith("beam-dp: warning:")]
    assert len(warnings) == 1 and "delta" in warnings[0] and "1/n" in warnings[0]
    assert len(read_json(out / "privacy_report.json")["warnings"]) == 1
    r = run("train", "--input", shards["binary_glob"], "--output", tmp_path / "ok", "--algorithm",
            "dpgd", "--noise-multiplier", "2", "--num-examples", "2000", "--steps", "3", *LOCAL)
    assert r.code == 0 and "warning" not in r.err
    assert "warnings" not in read_json(tmp_path / "ok" / "privacy_report.json")
