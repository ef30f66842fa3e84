"""End to end through ``beam-dp``: artifacts, the privacy report's accounting, runner equivalence,
bad input, prediction, output safety, checkpoints, seeds, and what may leave the job.

Most runs call ``beam_dp.cli.main`` in-process (the ``cli`` fixture); a few run the installed
console script in a subprocess to see exactly what a user sees on stdout and stderr. Beam runs pin
Beam's in-process runner with ``--runner FnApiRunner``. Runs that are not about calibration pass
``--noise-multiplier`` rather than ``--epsilon``: PLD calibration alone takes seconds.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys

import dp_accounting
import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from dp_accounting import dp_event as ev
from dp_accounting.pld import common, pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.special import expit

from beam_dp import cli as cli_mod
from beam_dp import losses, report, synthetic
from conftest import SMALL_N, checkpoint_state, model_theta, read_json

BEAM_DP = os.path.join(os.path.dirname(sys.executable), "beam-dp")
BEAM = ["--runner", "FnApiRunner"]
LOCAL = ["--runner", "local"]
# Small and fast: 5 steps in chunks of 2, so three chunks (three pipelines on Beam) run.
FAST_ANY = ["--noise-multiplier", "1.2", "--steps", "5", "--steps-per-job", "2",
            "--batch-rows", "400"]
FAST = [*FAST_ANY, "--algorithm", "dpsgd", "--batch-size", "300"]


def train_args(data, output, *extra):
    return ["train", "--input", data["train_glob"], "--output", str(output), *extra]


def _subprocess(*argv, env=None):
    return subprocess.run([BEAM_DP, *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=300)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("beam-dp: error:")]


def _no_temporary_leftovers(parent) -> None:
    leftovers = [n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n]
    assert leftovers == []


# ------------------------------------------------------------------------------ a. artifacts


@pytest.mark.slow
def test_make_data_then_train_local_writes_the_artifacts(tmp_path, cli):
    data_dir = tmp_path / "data"
    r = cli("make-data", "--output", data_dir, "--n", 3000, "--d", 6, "--validation-n", 500,
            "--shards", 3)
    assert r.code == 0, r
    assert sorted(os.listdir(data_dir)) == [
        report.MARKER, "train-00000-of-00003.parquet", "train-00001-of-00003.parquet",
        "train-00002-of-00003.parquet", "validation-00000-of-00001.parquet"]
    assert sum(pq.read_metadata(data_dir / f"train-0000{i}-of-00003.parquet").num_rows
               for i in range(3)) == 3000

    out = tmp_path / "out"
    r = cli("train", "--input", data_dir / "train-*.parquet", "--validation",
            data_dir / "validation-*.parquet", "--output", out, *LOCAL, *FAST, "--seed", 3)
    assert r.code == 0, r
    assert sorted(os.listdir(out)) == [report.MARKER, "metrics.json", "model.json", "privacy_report.json",
                                       "report.html"]

    model = read_json(out / "model.json")
    assert model["model"] == "logistic"
    assert model["feature_columns"] == [f"f{j}" for j in range(6)]
    assert len(model["coefficients"]) == 6 and all(math.isfinite(c) for c in model["coefficients"])
    assert isinstance(model["intercept"], float)

    privacy = read_json(out / "privacy_report.json")
    for key in ["epsilon", "delta", "accountant", "neighbouring", "noise_multiplier",
                "sampling_probability", "steps", "clip_norm", "mechanisms"]:
        assert key in privacy, key
    assert privacy["accountant"] == "pld" and privacy["neighbouring"] == "add/remove"
    assert privacy["noise_multiplier"] == 1.2 and privacy["steps"] == 5
    assert privacy["clip_norm"] == 1.0 and privacy["delta"] == 1e-5
    assert 0 < privacy["epsilon"] < math.inf
    # Secure noise by default: the quality check's sums (reserved first), a discrete Laplace
    # count and discrete Gaussian steps.
    assert [m["name"] for m in privacy["mechanisms"]] == [
        "gaussian_model_quality_sums", "discrete_laplace_count",
        "poisson_sampled_gaussian_clipped_gradient_sum"]
    assert privacy["quality_check"]["status"] in ("better", "worse", "inconclusive")
    assert privacy["mechanisms"][-1]["noise"].startswith("discrete Gaussian on exact integer sums")

    metrics = read_json(out / "metrics.json")
    assert metrics["covered_by_privacy_guarantee"] is False
    assert metrics["validation_examples"] == 500
    assert 0.5 < metrics["accuracy"] <= 1.0
    _no_temporary_leftovers(tmp_path)


@pytest.mark.parametrize("task,model,extra,coef_shape,metric", [
    ("multiclass", "softmax", ["--num-classes", "3"], (3, 5), "accuracy"),
    ("binary", "hinge", [], (5,), "accuracy"),
    ("regression", "linear", ["--no-intercept"], (5,), "rmse"),
    ("regression", "huber", ["--huber-delta", "0.5"], (5,), "rmse"),
])
@pytest.mark.slow
def test_every_model_trains_from_csv(tmp_path, cli, task, model, extra, coef_shape, metric):
    data_dir = tmp_path / "data"
    assert cli("make-data", "--output", data_dir, "--task", task, "--n", 1500, "--d", 5,
               "--validation-n", 300, "--shards", 2, "--format", "csv").code == 0
    out = tmp_path / "out"
    r = cli("train", "--input", data_dir / "train-*.csv", "--validation",
            data_dir / "validation-*.csv", "--output", out, "--model", model, *extra, *LOCAL,
            *FAST, "--seed", 1)
    assert r.code == 0, r
    artifact = read_json(out / "model.json")
    assert artifact["model"] == model
    assert np.shape(artifact["coefficients"]) == coef_shape
    if "--no-intercept" in extra:
        assert artifact["intercept"] == 0.0 and artifact["fit_intercept"] is False
    metrics = read_json(out / "metrics.json")
    assert metric in metrics and metrics["covered_by_privacy_guarantee"] is False


# ----------------------------------------------------------------- b. the report's accounting


def _recompute_epsilon(privacy: dict) -> float:
    """Epsilon from the report's public fields alone, composed directly with dp_accounting."""
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if privacy["accountant"] == "pld":
        accountant = pld_privacy_accountant.PLDAccountant(neighboring_relation=relation)
    else:
        accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    names = [m["name"] for m in privacy["mechanisms"]]
    for m in privacy["mechanisms"]:
        if m["name"] == "gaussian_model_quality_sums":   # the quality check: one Gaussian sum
            assert m["count"] == 1
            accountant.compose(ev.GaussianDpEvent(m["noise_multiplier"]))
        elif m["name"] == "laplace_count":
            assert m["count"] == 1 and m["sensitivity"] == 1
            accountant.compose(ev.LaplaceDpEvent(1.0 / m["epsilon"]))
        elif m["name"] == "discrete_laplace_count":
            # Secure noise: an integer count plus discrete Laplace noise, pure epsilon-DP, and
            # accounted as any pure epsilon-DP release: dp_accounting's worst-case PLD for
            # (epsilon, 0), and for RDP min(eps, a eps^2 / 2) (Bun & Steinke 2016).
            assert m["count"] == 1 and m["sensitivity"] == 1 and m["noise"] == "discrete Laplace"
            if privacy["accountant"] == "pld":
                accountant._pld = accountant._pld.compose(
                    privacy_loss_distribution.from_privacy_parameters(
                        common.DifferentialPrivacyParameters(m["epsilon"], 0.0)))
            else:
                orders = np.asarray(accountant._orders, dtype=float)
                accountant._rdp += np.minimum(m["epsilon"], orders * m["epsilon"] ** 2 / 2)
    assert names[-1] == "poisson_sampled_gaussian_clipped_gradient_sum"
    q, sigma, steps = (privacy["sampling_probability"], privacy["noise_multiplier"],
                       privacy["steps"])
    assert privacy["mechanisms"][-1]["count"] == steps
    assert privacy["mechanisms"][-1]["noise_multiplier"] == sigma
    assert privacy["mechanisms"][-1]["sampling_probability"] == q
    accountant.compose(ev.SelfComposedDpEvent(
        ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(privacy["delta"])


@pytest.mark.parametrize("accountant,num_examples", [
    ("pld", None), ("pld", SMALL_N), ("rdp", None)], ids=["pld-count", "pld-public-n", "rdp-count"])
def test_report_epsilon_recomputed_independently(tmp_path, cli, small_binary, accountant,
                                                 num_examples):
    extra = ["--num-examples", num_examples] if num_examples else []
    out = tmp_path / "out"
    r = cli(*train_args(small_binary, out, *LOCAL, "--epsilon", 1.0, "--delta", 1e-6,
                        "--accountant", accountant, "--steps", 5, "--algorithm", "dpsgd",
                        "--batch-size", 300,
                        "--seed", 2, *extra))
    assert r.code == 0, r
    privacy = read_json(out / "privacy_report.json")
    assert privacy["accountant"] == accountant
    assert privacy["requested_epsilon"] == 1.0 and privacy["delta"] == 1e-6
    names = [m["name"] for m in privacy["mechanisms"]]
    if num_examples:
        assert not {"laplace_count", "discrete_laplace_count"} & set(names)
        assert privacy["dataset_size"] == {"source": "public (--num-examples)", "value": SMALL_N}
        assert privacy["sampling_probability"] == pytest.approx(300 / SMALL_N)
    else:
        assert names[1] == "discrete_laplace_count"   # secure noise, the default
        # The default count budget is 5% of epsilon.
        assert privacy["mechanisms"][1]["epsilon"] == pytest.approx(0.05)
        assert privacy["sampling_probability"] == pytest.approx(
            300 / privacy["dataset_size"]["value"])

    recomputed = _recompute_epsilon(privacy)
    assert privacy["epsilon"] == pytest.approx(recomputed, rel=1e-6)
    assert privacy["epsilon"] <= 1.0
    assert privacy["epsilon"] >= 0.99  # the noise was calibrated to the budget, not overspent


# ------------------------------------------------------------------- c. runner equivalence


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dpsgd", "dpgd"])
def test_local_and_beam_runners_agree(tmp_path, cli, small_binary, algorithm):
    fast = FAST if algorithm == "dpsgd" else [*FAST_ANY, "--algorithm", algorithm]
    common = [*fast, "--seed", 20240601, "--validation",
              small_binary["validation_glob"]]
    assert cli(*train_args(small_binary, tmp_path / "local", *LOCAL, *common)).code == 0
    assert cli(*train_args(small_binary, tmp_path / "beam", *BEAM, *common)).code == 0

    local, beam = model_theta(tmp_path / "local"), model_theta(tmp_path / "beam")
    assert np.linalg.norm(local) > 0
    np.testing.assert_allclose(beam, local, rtol=1e-6, atol=1e-9 * np.abs(local).max())
    # The public plan (noisy n, q, sigma, steps) and hence the accounting agree too.
    reports = [read_json(tmp_path / r / "privacy_report.json") for r in ("local", "beam")]
    for key in ["epsilon", "dataset_size", "sampling_probability", "noise_multiplier", "steps",
                "mechanisms"]:
        assert reports[0][key] == reports[1][key], key


def test_default_runner_is_beams_in_process_runner():
    args, _ = cli_mod.build_parser().parse_known_args(
        ["train", "--input", "x", "--output", "y", "--epsilon", "1"])
    assert args.runner == "FnApiRunner"


# ------------------------------------------------------------------------------ d. bad input


def _corrupt_copy(small_binary, directory, kind):
    """The small dataset's shards with one bad value in the second shard; returns the glob, the
    bad file's path and the 1-based data row of the bad value."""
    os.makedirs(directory)
    for i, path in enumerate(small_binary["train_files"]):
        table = pq.read_table(path).to_pydict()
        if i == 1:
            if kind == "nan":
                table["f2"][736] = float("nan")
            else:
                table["label"][736] = 2
            bad = str(directory / os.path.basename(path))
        pq.write_table(pa.table(table), directory / os.path.basename(path))
    return str(directory / "train-*.parquet"), bad, 737


@pytest.mark.parametrize("runner", ["local", "FnApiRunner"])
@pytest.mark.parametrize("kind", ["nan", "label"])
def test_bad_input_fails_cleanly(tmp_path, cli, small_binary, runner, kind):
    pattern, bad_file, row = _corrupt_copy(small_binary, tmp_path / "data", kind)
    out = tmp_path / "out"
    r = cli("train", "--input", pattern, "--output", out, "--runner", runner, *FAST, "--seed", 1)
    assert r.code == 2
    lines = r.err.splitlines()
    assert len(lines) == 1, r.err
    # Both runners report the same one line: the file and the 1-based data row. (Beam may add
    # the step it was running, "[while running '...']", after it.)
    expected = f"beam-dp: error: {bad_file}, row {row}: "
    assert lines[0].startswith(expected), lines[0]
    assert ("feature 'f2'" if kind == "nan" else "column 'label': label does not fit") in lines[0]
    assert "2.0" not in lines[0]   # never a data value
    assert "beam-dp input error" not in lines[0]
    assert not out.exists()
    _no_temporary_leftovers(tmp_path)


@pytest.mark.slow
def test_bad_input_on_beam_seen_from_a_shell(tmp_path, small_binary):
    pattern, bad_file, row = _corrupt_copy(small_binary, tmp_path / "data", "nan")
    out = tmp_path / "out"
    r = _subprocess("train", "--input", pattern, "--output", out, *BEAM, *FAST, "--seed", 1)
    assert r.returncode == 2, r.stderr
    # Beam logs the worker's traceback on its own; the command's verdict is one line, the last.
    lines = _error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"beam-dp: error: {bad_file}, row {row}: ")
    assert r.stderr.rstrip().splitlines()[-1] == lines[0]
    assert not out.exists()


@pytest.mark.parametrize("problem", ["missing-label", "empty-glob", "missing-feature", "garbage"])
def test_input_errors_found_before_training(tmp_path, cli, small_binary, problem):
    args = ["--input", small_binary["train_glob"]]
    expected = small_binary["train_files"][0]
    if problem == "missing-label":
        args += ["--label-column", "target"]
    elif problem == "missing-feature":
        args += ["--feature-columns", "f0,nope"]
    elif problem == "empty-glob":
        args = ["--input", str(tmp_path / "none-*.parquet")]
        expected = args[1]
    else:
        expected = str(tmp_path / "garbage.parquet")
        with open(expected, "wb") as f:
            f.write(b"PAR1 this is not parquet" * 10)
        args = ["--input", expected]
    out = tmp_path / "out"
    r = cli("train", *args, "--output", out, *LOCAL, *FAST)
    assert r.code == 2
    (line,) = r.err.splitlines()
    assert line.startswith("beam-dp: error: ") and expected in line
    assert not out.exists()


@pytest.mark.parametrize("runner", [LOCAL, BEAM], ids=["local", "beam"])
def test_files_without_rows_are_an_error_on_both_runners(tmp_path, cli, runner):
    path = str(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"f0": pa.array([], pa.float64()),
                             "label": pa.array([], pa.float64())}), path)
    out = tmp_path / "out"
    r = cli("train", "--input", path, "--output", out, *runner, *FAST)
    assert r.code == 2
    (line,) = [l for l in r.err.splitlines() if l.startswith("beam-dp: error:")]
    assert line == f"beam-dp: error: {path}: the input has no rows"
    assert not out.exists()


# ------------------------------------------------------------------------------- e. predict


@pytest.mark.slow
def test_predict_logistic_writes_one_prediction_and_probability_per_row(tmp_path, cli, small_binary):
    model_dir = tmp_path / "model"
    assert cli(*train_args(small_binary, model_dir, *LOCAL, *FAST, "--seed", 4)).code == 0
    predictions = tmp_path / "pred.csv"
    r = cli("predict", "--model", model_dir, "--input", small_binary["train_glob"],
            "--output", predictions)
    assert r.code == 0, r
    table = pa_csv.read_csv(predictions)
    assert table.column_names == ["prediction", "probability"]
    assert table.num_rows == SMALL_N

    artifact = read_json(model_dir / "model.json")
    # Rows come out in the order of the sorted input files, which is the order of the source.
    score = small_binary["x"] @ np.array(artifact["coefficients"]) + artifact["intercept"]
    np.testing.assert_allclose(table["probability"].to_numpy(), expit(score), rtol=1e-12)
    np.testing.assert_array_equal(table["prediction"].to_numpy(), (score > 0).astype(int))
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))


@pytest.mark.parametrize("model,num_classes", [("linear", None), ("softmax", 3)])
def test_predict_other_models(tmp_path, cli, model, num_classes):
    g = np.random.default_rng(8)
    x = g.standard_normal((250, 4))
    paths = synthetic.write_shards(str(tmp_path / "data"), "score", x, np.zeros(250), 2)
    loss = losses.make_loss(model, num_classes)
    theta = g.standard_normal((loss.outputs(), 5))
    report.write_json(str(tmp_path), "model.json", report.model_artifact(
        loss, theta, [f"f{j}" for j in range(4)], "label", "dpsgd", True))
    out = tmp_path / "pred.parquet"
    r = cli("predict", "--model", tmp_path / "model.json", "--input",
            tmp_path / "data" / "score-*.parquet", "--output", out)
    assert r.code == 0, r
    table = pq.read_table(out)
    # No probability for a regression; softmax: one per class, named by class id without names.
    assert table.column_names == ["prediction"] + (
        [] if model == "linear" else [f"probability_{k}" for k in range(num_classes)])
    assert table.num_rows == 250 and len(paths) == 2
    scores = x @ theta[:, :-1].T + theta[:, -1]
    expected = scores[:, 0] if model == "linear" else np.argmax(scores, axis=1)
    np.testing.assert_allclose(table["prediction"].to_numpy(), expected, rtol=1e-12)
    if model == "softmax":
        from scipy.special import softmax
        p = np.column_stack([table[f"probability_{k}"].to_numpy() for k in range(num_classes)])
        np.testing.assert_allclose(p, softmax(scores, axis=1), rtol=1e-12)


# ------------------------------------------------------------------ f. existing --output


@pytest.mark.slow
def test_existing_output_is_left_untouched_without_overwrite(tmp_path, cli, small_binary):
    out = tmp_path / "out"
    r = cli(*train_args(small_binary, out, *LOCAL, *FAST))
    assert r.code == 0, r
    before = (out / "model.json").read_text()
    r = cli(*train_args(small_binary, out, *LOCAL, *FAST))
    assert r.code == 2
    (line,) = r.err.splitlines()
    assert line.startswith("beam-dp: error: ") and str(out) in line and "--overwrite" in line
    assert (out / "model.json").read_text() == before
    _no_temporary_leftovers(tmp_path)

    # A directory beam-dp wrote is replaced with --overwrite.
    r = cli(*train_args(small_binary, out, *LOCAL, *FAST, "--overwrite"))
    assert r.code == 0, r
    assert sorted(os.listdir(out)) == [report.MARKER, "model.json", "privacy_report.json", "report.html"]
    _no_temporary_leftovers(tmp_path)


def _tree(path):
    return sorted((os.path.relpath(os.path.join(d, f), path), open(os.path.join(d, f), "rb").read())
                  for d, _, files in os.walk(path) for f in files)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["foreign_directory", "mixed_directory", "data_file",
                                    "empty_directory", "device", "link"])
def test_overwrite_replaces_only_what_beam_dp_wrote(tmp_path, cli, small_binary, target):
    """--overwrite on a user's file, a directory holding a user's file, or a device is refused
    and nothing is deleted (issue 8, item 10)."""
    out = tmp_path / "out"
    if target == "foreign_directory":
        out.mkdir()
        (out / "keep.txt").write_text("precious")
    elif target == "mixed_directory":   # beam-dp's output plus a file the user put there
        assert cli(*train_args(small_binary, out, *LOCAL, *FAST)).code == 0
        (out / "notes.txt").write_text("mine")
    elif target == "data_file":
        out = tmp_path / "good.csv"
        out.write_text("a,b\n1,2\n")
    elif target == "empty_directory":
        out.mkdir()
    elif target == "link":
        (tmp_path / "real").mkdir()
        (tmp_path / "real" / "keep.txt").write_text("precious")
        out.symlink_to(tmp_path / "real")
    else:
        out = "/dev/null"
    before = _tree(tmp_path)
    r = cli(*train_args(small_binary, out, *LOCAL, *FAST, "--overwrite"))
    assert r.code == 2, r
    (line,) = r.err.splitlines()
    assert line.startswith("beam-dp: error: ") and "nothing was replaced or deleted" in line
    assert _tree(tmp_path) == before
    assert os.path.exists("/dev/null") and not os.path.isdir("/dev/null")


@pytest.mark.slow
def test_output_inside_another_output_is_refused_before_training(tmp_path, cli, small_binary,
                                                                 monkeypatch):
    """An output nested in a directory beam-dp wrote would be a foreign entry there (its marker
    does not list it), so that run could never be replaced: refused before any data is read,
    and nothing written."""
    from beam_dp import local

    first = tmp_path / "out"
    assert cli(*train_args(small_binary, first, *LOCAL, *FAST)).code == 0
    before = _tree(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("training ran although the output is refused")

    monkeypatch.setattr(local.LocalAggregator, "run_stages", refuse)
    for nested in (first / "again", first / "deeper" / "again"):
        r = cli(*train_args(small_binary, nested, *LOCAL, *FAST))
        assert r.code == 2, r
        (line,) = r.err.splitlines()
        assert "an output directory beam-dp wrote" in line and str(first) in line
        assert _tree(tmp_path) == before


@pytest.mark.slow
def test_predictions_inside_an_output_and_repeated_id_columns_refused_first(tmp_path, cli,
                                                                             small_binary,
                                                                             monkeypatch):
    """A predictions file inside a model's output directory would be a foreign entry there (that
    run could then never be replaced: it had been written, and the next --overwrite of the
    model refused); a column named twice in --id-columns had failed only when the file was
    written, after every prediction ("ArrowInvalid"). Both refused before any row is read."""
    from beam_dp import data

    model_dir = tmp_path / "model"
    assert cli(*train_args(small_binary, model_dir, *LOCAL, *FAST)).code == 0
    before = _tree(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("rows were read although the output is refused")

    monkeypatch.setattr(data, "list_files", refuse)
    for output, extra, why in (
            (model_dir / "pred.csv", (), "an output directory beam-dp wrote"),
            (tmp_path / "pred.csv", ("--id-columns", "x0,x0"), "names a column twice")):
        r = cli("predict", "--model", model_dir, "--input", small_binary["train_glob"],
                "--output", output, *extra)
        assert r.code == 2, r
        (line,) = r.err.splitlines()
        assert why in line, line
        assert _tree(tmp_path) == before
    monkeypatch.undo()
    # the model's directory is still replaceable
    assert cli(*train_args(small_binary, model_dir, *LOCAL, *FAST, "--overwrite")).code == 0


def test_overwrite_refused_before_training(tmp_path, cli, small_binary, monkeypatch):
    """The output is checked before any data is read."""
    from beam_dp import local

    def refuse(*args, **kwargs):
        raise AssertionError("training ran although the output is refused")

    monkeypatch.setattr(local.LocalAggregator, "run_stages", refuse)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert cli(*train_args(small_binary, out, *LOCAL, *FAST, "--overwrite")).code == 2


# ---------------------------------------------------------------------------- g. checkpoints


def _forbid_data_access(monkeypatch):
    """Makes any aggregation on the data fail: a resumed, finished run must not need it."""
    from beam_dp import local

    def refuse(*args, **kwargs):
        raise AssertionError("the resumed run touched the data")

    for name in ("count", "run_stages", "run_steps"):
        if hasattr(local.LocalAggregator, name):
            monkeypatch.setattr(local.LocalAggregator, name, refuse)


@pytest.mark.slow
def test_checkpoint_resume_of_a_finished_run(tmp_path, cli, small_binary, monkeypatch):
    ckpt = tmp_path / "ckpt"
    args = [*LOCAL, *FAST, "--seed", 5, "--checkpoint-dir", ckpt]
    assert cli(*train_args(small_binary, tmp_path / "first", *args)).code == 0
    with np.load(checkpoint_state(ckpt)) as z:
        assert int(z["step"]) == 5
        plan = json.loads(str(z["plan"]))
    first_report = read_json(tmp_path / "first" / "privacy_report.json")
    # The checkpoint holds the noisy dataset size, the one the report shows, not the exact count.
    assert plan["dataset_size"] == first_report["dataset_size"]

    _forbid_data_access(monkeypatch)
    r = cli(*train_args(small_binary, tmp_path / "second", *args))
    assert r.code == 0, r
    np.testing.assert_array_equal(model_theta(tmp_path / "second"), model_theta(tmp_path / "first"))
    second_report = read_json(tmp_path / "second" / "privacy_report.json")
    for key in ["epsilon", "mechanisms", "dataset_size", "noise_multiplier", "steps"]:
        assert second_report[key] == first_report[key], key


@pytest.mark.slow
def test_checkpoint_resume_after_an_interruption(tmp_path, cli, small_binary, monkeypatch):
    from beam_dp import batches

    args = [*LOCAL, *FAST, "--seed", 6]
    assert cli(*train_args(small_binary, tmp_path / "uninterrupted", *args)).code == 0

    ckpt = tmp_path / "ckpt"
    original = batches.LocalBatches.get

    def fail_in_the_second_chunk(self, step):   # chunks of 2 steps (--steps-per-job 2)
        if step == 2:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(batches.LocalBatches, "get", fail_in_the_second_chunk)
    r = cli(*train_args(small_binary, tmp_path / "out", *args, "--checkpoint-dir", ckpt))
    assert r.code == 130
    (line,) = r.err.splitlines()   # one line, no traceback
    assert "interrupted" in line and "rerun the same command to resume" in line and str(ckpt) in line
    assert not (tmp_path / "out").exists()
    with np.load(checkpoint_state(ckpt)) as z:
        assert int(z["step"]) == 2
    monkeypatch.undo()

    assert cli(*train_args(small_binary, tmp_path / "out", *args, "--checkpoint-dir", ckpt)).code == 0
    np.testing.assert_allclose(model_theta(tmp_path / "out"),
                               model_theta(tmp_path / "uninterrupted"), rtol=1e-12, atol=0)
    resumed = read_json(tmp_path / "out" / "privacy_report.json")
    clean = read_json(tmp_path / "uninterrupted" / "privacy_report.json")
    # Steps before and after the interruption are all accounted for, the count once.
    assert resumed["mechanisms"] == clean["mechanisms"]
    assert resumed["epsilon"] == pytest.approx(clean["epsilon"], rel=1e-12)


@pytest.mark.slow
def test_checkpoint_of_another_configuration_starts_afresh(tmp_path, cli, small_binary):
    """Checkpoints are kept per release (settings, input snapshot, code): other settings in the
    same --checkpoint-dir are another run, trained from scratch, not the old one resumed."""
    ckpt = tmp_path / "ckpt"
    base = [*LOCAL, "--noise-multiplier", "1.2", "--steps-per-job", "2", "--algorithm",
            "dpsgd", "--batch-size", "300", "--seed", "5", "--checkpoint-dir", ckpt]
    assert cli(*train_args(small_binary, tmp_path / "a", *base, "--steps", 2)).code == 0
    r = cli(*train_args(small_binary, tmp_path / "b", *base, "--steps", 3))
    assert r.code == 0 and "resuming" not in r.err
    assert len(os.listdir(ckpt)) == 2
    assert read_json(tmp_path / "b" / "privacy_report.json")["steps"] == 3


# -------------------------------------------------------------------------------- h. seeds


@pytest.mark.slow
def test_seed_is_reported(tmp_path, cli, small_binary):
    assert cli(*train_args(small_binary, tmp_path / "fixed", *LOCAL, *FAST, "--seed", 9)).code == 0
    assert read_json(tmp_path / "fixed" / "privacy_report.json")["seed"].startswith("fixed by --seed")

    for name in ("secure1", "secure2"):
        assert cli(*train_args(small_binary, tmp_path / name, *LOCAL, *FAST)).code == 0
        assert read_json(tmp_path / name / "privacy_report.json")["seed"] == "OS secure randomness"
    # And the secure seed really is fresh: two runs draw different noise.
    assert not np.allclose(model_theta(tmp_path / "secure1"), model_theta(tmp_path / "secure2"))


# --------------------------------------------------------------- i. nothing un-noised leaves


def _assert_nothing_unnoised(out, stdout, stderr):
    privacy = read_json(out / "privacy_report.json")
    assert privacy["dataset_size"]["source"].startswith("private estimate")
    assert privacy["seed"] == "OS secure randomness"
    assert "loss" not in (stdout + stderr).lower()
    metrics = read_json(out / "metrics.json")
    assert metrics["covered_by_privacy_guarantee"] is False
    assert set(metrics) == {"validation_examples", "accuracy", "covered_by_privacy_guarantee", "note",
                            "constant_baseline", "better_than_constant"}


@pytest.mark.slow
def test_nothing_unnoised_leaves_a_local_run(tmp_path, small_binary):
    out = tmp_path / "out"
    r = _subprocess(*train_args(small_binary, out, *LOCAL, *FAST, "--validation",
                                small_binary["validation_glob"]))
    assert r.returncode == 0, r.stderr
    _assert_nothing_unnoised(out, r.stdout, r.stderr)


@pytest.mark.slow
def test_nothing_unnoised_leaves_a_beam_run(tmp_path, small_binary):
    # Beam's work directory goes under TMPDIR: after the job, no file there may hold the exact
    # number of training examples (the driver adds the noise to it; only the noisy value leaves).
    work = tmp_path / "tmp"
    work.mkdir()
    env = dict(os.environ, TMPDIR=str(work))
    out = tmp_path / "out"
    r = _subprocess(*train_args(small_binary, out, *BEAM, *FAST, "--validation",
                                small_binary["validation_glob"]), env=env)
    assert r.returncode == 0, r.stderr
    _assert_nothing_unnoised(out, r.stdout, r.stderr)
    for root, _, files in os.walk(work):
        for name in files:
            if name.endswith(".pkl"):
                with open(os.path.join(root, name), "rb") as f:
                    value = pickle.load(f)
                assert not (isinstance(value, int) and value == SMALL_N), name


@pytest.mark.slow
def test_local_and_beam_runners_agree_on_gzipped_csv_softmax(tmp_path, cli):
    """The other reader path (gzipped CSV, decompressed by pyarrow locally and by Beam's
    FileSystems on Beam), a multi-output model without intercept, and a calibrated RDP budget."""
    import gzip
    import shutil

    data_dir = tmp_path / "data"
    assert cli("make-data", "--output", data_dir, "--task", "multiclass", "--num-classes", 4,
               "--n", 2400, "--d", 5, "--validation-n", 0, "--shards", 2, "--format", "csv").code == 0
    for name in [n for n in os.listdir(data_dir) if n.endswith(".csv")]:
        with open(data_dir / name, "rb") as src, gzip.open(data_dir / f"{name}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(data_dir / name)
    common = ["--input", data_dir / "train-*.csv.gz", "--model", "softmax", "--num-classes", 4,
              "--no-intercept", "--accountant", "rdp", "--epsilon", 2, "--steps", 7,
              "--steps-per-job", 3, "--algorithm", "dpsgd", "--batch-size", 200,
              "--batch-rows", 250, "--seed", 77]
    assert cli("train", "--output", tmp_path / "local", *LOCAL, *common).code == 0
    assert cli("train", "--output", tmp_path / "beam", *BEAM, *common).code == 0
    local, beam = model_theta(tmp_path / "local"), model_theta(tmp_path / "beam")
    assert local.shape == (4 * 5 + 4,) and np.all(local[-4:] == 0)
    assert np.linalg.norm(local) > 0
    np.testing.assert_allclose(beam, local, rtol=1e-6, atol=1e-9 * np.abs(local).max())


# ------------------------------------------------------------- review findings (issue 8, 10/12)


def test_overwrite_never_replaces_the_jobs_own_input(tmp_path, cli):
    """make-data's directory carries a marker; training into it with --overwrite would delete
    the shards the job just read."""
    data_dir = tmp_path / "data"
    assert cli("make-data", "--output", data_dir, "--n", 600, "--d", 3, "--validation-n", 0).code == 0
    before = sorted(os.listdir(data_dir))
    for command in (["train", *FAST], ["stats", "--epsilon", 1]):
        r = cli(*command, "--input", data_dir / "train-*.parquet", "--output", data_dir,
                "--overwrite", *LOCAL)
        assert r.code == 2 and "own input" in r.err, r
        assert sorted(os.listdir(data_dir)) == before


@pytest.mark.slow
@pytest.mark.parametrize("change", ["edited_marker", "subdirectory", "changed_file"])
def test_overwrite_checks_what_the_marker_recorded(tmp_path, cli, small_binary, change):
    out = tmp_path / "out"
    assert cli(*train_args(small_binary, out, *LOCAL, *FAST)).code == 0
    if change == "edited_marker":   # a user's file listed in the marker by hand
        (out / "precious.txt").write_text("mine")
        marker = json.loads((out / report.MARKER).read_text())
        marker["files"]["precious.txt"] = 1
        (out / report.MARKER).write_text(json.dumps(marker))
    elif change == "subdirectory":
        (out / "sub").mkdir()
        (out / "sub" / "keep.txt").write_text("mine")
    else:                           # a file beam-dp wrote, edited since
        (out / "model.json").write_text("{}")
    r = cli(*train_args(small_binary, out, *LOCAL, *FAST, "--overwrite"))
    assert r.code == 2 and "nothing was replaced or deleted" in r.err, r
    assert os.path.exists(out / report.MARKER)


@pytest.mark.slow
def test_repeated_single_valued_flags_are_refused_and_inputs_accumulate(tmp_path, cli, small_binary):
    first, second, third = small_binary["train_files"]
    r = cli(*train_args(small_binary, tmp_path / "a", *LOCAL, "--steps", 2, "--epsilon", 0.5,
                        "--epsilon", 8))
    assert r.code == 2 and "--epsilon given twice" in r.err, r
    assert not (tmp_path / "a").exists()
    r = cli("train", "--input", first, "--output", tmp_path / "b", *LOCAL, *FAST,
            "--feature-columns", "f0,f1", "--feature-columns", "f2")
    assert r.code == 2 and "--feature-columns given twice" in r.err, r
    # --input given twice reads both (argparse alone would keep only the last).
    common = [*LOCAL, *FAST, "--seed", 4, "--num-examples", SMALL_N]
    assert cli("train", "--input", first, "--input", second, third, "--output", tmp_path / "c",
               *common).code == 0
    assert cli("train", "--input", small_binary["train_glob"], "--output", tmp_path / "d",
               *common).code == 0
    np.testing.assert_array_equal(model_theta(tmp_path / "c"), model_theta(tmp_path / "d"))


def test_a_file_reached_twice_is_read_once(tmp_path, small_binary):
    from beam_dp import data

    link = tmp_path / "again"
    link.symlink_to(small_binary["dir"])
    files = data.list_files(f"{small_binary['train_glob']},{link}/train-*.parquet")
    assert files == sorted(os.path.realpath(f) for f in small_binary["train_files"])


@pytest.mark.slow
def test_checkpoint_of_another_input_starts_afresh(tmp_path, cli, small_binary):
    """A checkpoint belongs to the release of its input snapshot: the same --checkpoint-dir over
    other files trains them, rather than return the old model and its old noisy count
    (new-user trial)."""
    ckpt = tmp_path / "ckpt"
    args = [*LOCAL, *FAST, "--seed", 5, "--checkpoint-dir", ckpt]
    assert cli(*train_args(small_binary, tmp_path / "a", *args)).code == 0
    r = cli("train", "--input", small_binary["validation_glob"], "--output", tmp_path / "b", *args)
    assert r.code == 0 and "resuming" not in r.err, r
    assert len(os.listdir(ckpt)) == 2
    assert not np.array_equal(model_theta(tmp_path / "a"), model_theta(tmp_path / "b"))
