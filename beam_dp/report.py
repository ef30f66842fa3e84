"""Artifacts: the model, the privacy report and the metrics, written atomically into one directory."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
import tempfile

import numpy as np

from beam_dp import losses as losses_mod

TRUST_MODEL = (
    "Central differential privacy. The workers and the driver are trusted and see the raw data; "
    "the guarantee covers everything that leaves the job: the model, this report and the "
    "checkpoints, each a post-processing of noised releases. It protects {unit}; it does not "
    "protect a person who contributes several rows beyond what group privacy gives, nor the "
    "validation data, nor hyperparameters chosen by looking at the data, which are treated as "
    "public. A runner's job graphs and staging location are inside the boundary too: a DP-GD "
    "job's graph holds the noise keys of its steps, an objective-perturbation job's the "
    "objective's noise.")


def model_artifact(loss: losses_mod.GlmLoss, theta: np.ndarray, feature_columns, label_column,
                   algorithm: str, fit_intercept: bool, feature_transform: dict | None = None,
                   constraint: dict | None = None, encoding: dict | None = None) -> dict:
    single = loss.outputs() == 1
    artifact = {
        "format_version": 1,
        "model": loss.name,
        "algorithm": algorithm,
        "feature_columns": list(feature_columns),
        "label_column": label_column,
        "fit_intercept": fit_intercept,
        "coefficients": theta[0, :-1].tolist() if single else theta[:, :-1].tolist(),
        "intercept": float(theta[0, -1]) if single else theta[:, -1].tolist(),
    }
    if encoding:   # public: how the raw columns became the coefficients' columns
        artifact["encoding"] = encoding
    if feature_transform:
        artifact["feature_transform"] = feature_transform
    if constraint:   # public: the set the coefficients were constrained to (the intercept is free)
        artifact["constraint"] = constraint
    if loss.name == "softmax":
        artifact["num_classes"] = loss.num_classes
    if loss.name == "huber":
        artifact["huber_delta"] = loss.delta
    return artifact


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({type(e).__name__})") from None


def read_model(path: str) -> dict:
    """The artifact of model.json (or of a directory holding one), with a one-line error when it
    is missing or not a model."""
    if os.path.isdir(path):
        path = os.path.join(path, "model.json")
    artifact = read_json(path)
    missing = [k for k in ("model", "feature_columns", "coefficients", "intercept") if k not in artifact]
    if missing:
        raise ValueError(f"{path}: not a beam-dp model (missing {', '.join(missing)})")
    return artifact


def load_model_dict(artifact: dict) -> tuple[losses_mod.GlmLoss, np.ndarray, dict]:
    loss = losses_mod.make_loss(artifact["model"], artifact.get("num_classes"),
                                artifact.get("huber_delta", 1.0))
    coef = np.atleast_2d(np.asarray(artifact["coefficients"], dtype=np.float64))
    intercept = np.atleast_1d(np.asarray(artifact["intercept"], dtype=np.float64))
    return loss, np.column_stack([coef, intercept]), artifact


def feature_map(artifact: dict):
    """The per-example map the model expects of raw feature blocks (identity when none)."""
    from beam_dp import features
    return features.from_spec(artifact.get("feature_transform"))

# What the guarantee protects, by the ledger's neighbouring relation.
PROTECTED = {
    "add/remove": "the presence or absence of any one example (one row) of the training input",
    "replace-one": ("any one example (one row) of the training input against its replacement by "
                    "any other: the number of rows is treated as public"),
    "add/remove one user (all their rows)": (
        "the presence or absence of any one user (every row holding their value of the privacy "
        "unit column) of the training input"),
}


def release_report(ledger, delta: float, seed_fixed: bool, **fields) -> dict:
    """The privacy report of a job's releases: epsilon from the accountant over the whole ledger,
    the mechanisms, the composed DpEvent, how the seed was chosen and the trust model."""
    from beam_dp import accounting

    return {
        "epsilon": ledger.epsilon(delta),
        "delta": delta,
        "accountant": ledger.accountant,
        "neighbouring": ledger.neighbouring,
        **fields,
        "mechanisms": ledger.mechanisms(),
        "dp_event": accounting.event_to_json(ledger.event()),
        # What the accountant had to approximate (always in the pessimistic direction).
        "accounting_notes": list(ledger.notes),
        "seed": "fixed by --seed (reproducible run, not for production)" if seed_fixed
                else "OS secure randomness",
        "trust_model": TRUST_MODEL.format(unit=PROTECTED[ledger.neighbouring]),
    }


def privacy_report(ledger, privacy, result, algorithm, options, seed_fixed: bool) -> dict:
    """The training run's report, from the ledger and what the algorithm returned."""
    import dataclasses

    variant = getattr(options, "variant", None)
    return release_report(
        ledger, privacy.delta, seed_fixed,
        requested_epsilon=privacy.epsilon,
        algorithm=algorithm.name if variant is None else f"{algorithm.name} ({variant})",
        noise_multiplier=result.noise_multiplier,
        sampling_probability=result.sampling_probability,
        sampling=result.sampling,
        steps=result.steps,
        clip_norm=result.clip_norm,
        expected_batch_size=result.expected_batch_size,
        dataset_size=result.dataset_size,
        **({"privacy_unit": result.privacy_unit}
           if getattr(result, "privacy_unit", None) is not None else {}),
        **{result.details_name: result.preprocessing},
        hyperparameters={"status": "public inputs; not privately tuned",
                         "values": dataclasses.asdict(options)})


def evaluate(loss: losses_mod.GlmLoss, theta: np.ndarray, blocks) -> dict:
    """Accuracy (classification) or RMSE (regression) over validation blocks, next to the best
    constant predictor's on the same rows (the majority class, or the mean label), so that a
    model no better than a constant is flagged (``better_than_constant``)."""
    correct = squared = label_mean = label_m2 = 0.0
    class_counts = np.zeros(max(loss.outputs(), 2))
    n = 0
    for b in blocks:
        s = losses_mod.scores(theta, b.features)
        if loss.is_classifier:
            truth = (b.labels > 0).astype(np.int64) if loss.name in ("logistic", "hinge") else b.labels
            correct += float(np.sum(loss.predict(s) == truth))
            class_counts += np.bincount(np.asarray(truth, dtype=np.int64), minlength=len(class_counts))
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                squared += float(np.sum((s[:, 0] - b.labels) ** 2))
                # The labels' spread merged block by block (Chan, Golub & LeVeque): no
                # E[y^2] - E[y]^2, which cancels to 0 for labels of 1e9 + noise and overflows
                # for labels near 1e200 (inf there, never an exception).
                m = len(b)
                if m:
                    block_mean = float(np.mean(b.labels))
                    block_m2 = float(np.sum((b.labels - block_mean) ** 2))
                    total = n + m
                    delta = block_mean - label_mean
                    label_mean += delta * m / total
                    label_m2 += block_m2 + delta * delta * n * m / total
        n += len(b)
    metrics = {"validation_examples": n}
    if n == 0:
        return metrics
    if loss.is_classifier:
        metrics["accuracy"] = correct / n
        metrics["constant_baseline"] = {"predictor": "the majority class of these rows",
                                        "accuracy": float(class_counts.max() / n)}
        metrics["better_than_constant"] = bool(metrics["accuracy"] > class_counts.max() / n)
    else:
        metrics["rmse"] = float(np.sqrt(squared / n))
        spread = float(np.sqrt(label_m2 / n)) if math.isfinite(label_m2) else math.inf
        metrics["constant_baseline"] = {"predictor": "the mean label of these rows", "rmse": spread}
        metrics["better_than_constant"] = bool(metrics["rmse"] < spread)
    return metrics


MARKER = ".beam-dp-output.json"   # in every directory beam-dp writes: what it wrote there


def _refuse(path: str, why: str) -> FileExistsError:
    return FileExistsError(f"{path} {why}; nothing was replaced or deleted")


def _exists(path: str, overwrite: bool, replaceable: str) -> bool:
    """False when nothing is at ``path`` (whose nearest existing parent must be a writable
    directory); True when something is and ``overwrite`` allows considering it; else refused."""
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path} already exists (pass --overwrite, or overwrite=True in "
                                  f"Python, to replace {replaceable})")
        return True
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: {parent} is not a writable directory")
    return False


def check_output_directory(path: str, overwrite: bool) -> None:
    """Refuses, before any work, an output that exists, unless ``overwrite`` is set and it is a
    directory beam-dp wrote holding only what beam-dp wrote there (its marker lists that). A
    file, a device, a link or a directory with anything else is never replaced."""
    path = os.path.abspath(path)
    _check_not_in_an_output(path)
    if not _exists(path, overwrite, "a directory beam-dp wrote"):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise _refuse(path, "is not a directory beam-dp wrote (--overwrite replaces only those)")
    try:
        with open(os.path.join(path, MARKER)) as f:
            written = dict(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        raise _refuse(path, f"has no {MARKER} marker, so beam-dp did not write it "
                            "(--overwrite replaces only directories beam-dp wrote)") from None
    # Only regular files the marker lists, with the sizes it recorded: a directory, a link, a
    # file added or changed since (or a marker edited to list a user's file) is not ours.
    foreign = [name for name in os.listdir(path) if name != MARKER
               and not _as_written(os.path.join(path, name), written.get(name))]
    if foreign:
        raise _refuse(path, f"holds {len(foreign)} entries beam-dp did not write there or that "
                            "changed since (move them away first)")


def _check_not_in_an_output(path: str) -> None:
    """Refuses an output inside a directory beam-dp wrote: it would become an entry that
    directory's marker does not list, so that output could no longer be replaced (--overwrite)
    and a reader of it would find a foreign directory among the released files."""
    parent = os.path.dirname(path)
    while True:
        if os.path.isfile(os.path.join(parent, MARKER)):
            raise _refuse(path, f"is inside {parent}, an output directory beam-dp wrote: write "
                                "it elsewhere")
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def _as_written(path: str, size) -> bool:
    status = os.lstat(path)
    return stat.S_ISREG(status.st_mode) and status.st_size == size


def _manifest(directory: str) -> dict:
    """What a job wrote: each regular file's size (the marker's content)."""
    return {name: os.lstat(os.path.join(directory, name)).st_size
            for name in sorted(os.listdir(directory))
            if stat.S_ISREG(os.lstat(os.path.join(directory, name)).st_mode)}


def check_not_inside(output: str, inputs) -> None:
    """Refuses an output directory that holds (or is) one of the job's input files: replacing
    it would delete the data the job just read."""
    if "://" in output:
        return
    root = os.path.realpath(output)
    for name in inputs:
        if "://" not in name and os.path.commonpath([root, os.path.realpath(name)]) == root:
            raise _refuse(os.path.abspath(output), "holds this job's own input files")


@contextlib.contextmanager
def atomic_directory(path: str, overwrite: bool = False):
    """Yields a temporary directory beside ``path`` and renames it to ``path`` only when the block
    succeeds, so a failed job leaves no partial output. The directory gets a marker listing what
    was written, which is what ``--overwrite`` later checks (``check_output_directory``)."""
    path = os.path.abspath(path)
    check_output_directory(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        yield tmp
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"written_by": "beam-dp", "files": _manifest(tmp)}, f)
        check_output_directory(path, overwrite)   # again: it may have changed meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
        os.replace(path, os.path.join(old, "previous"))
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


PREDICTION_COLUMNS = ("prediction", "probability")   # softmax: probability_<class> columns


def is_prediction_column(name: str) -> bool:
    return name in PREDICTION_COLUMNS or name.startswith("probability_")


def check_output_file(path: str, overwrite: bool, id_columns=()) -> None:
    """For ``predict --output``: an existing file is replaced only with ``overwrite`` and only if
    it is a predictions file beam-dp wrote (a regular file whose columns are exactly ours: the
    ``id_columns`` asked for now, then "prediction", then probability columns)."""
    from beam_dp import data

    id_columns = list(id_columns)
    if any(is_prediction_column(c) for c in id_columns):
        raise ValueError("an id column may not be named prediction, probability or "
                         "probability_*: predict writes those")
    if len(set(id_columns)) != len(id_columns):
        # (a table cannot hold one name twice: it had failed only when writing, after every
        # prediction was made, as "cannot write ...: ArrowInvalid")
        raise ValueError("--id-columns names a column twice")
    path = os.path.abspath(path)
    # A predictions file inside a model's (or any beam-dp) output directory would be a foreign
    # entry there, as an output directory would: that directory could no longer be replaced.
    _check_not_in_an_output(path)
    if os.path.isdir(path) and not overwrite:
        raise ValueError(f"{path} is a directory: give a predictions file name (.csv or .parquet)")
    if not _exists(path, overwrite, "a predictions file beam-dp wrote"):
        data.file_format(path)   # .csv, .csv.gz or .parquet, before any work
        return
    if os.path.islink(path) or not os.path.isfile(path):
        raise _refuse(path, "is not a regular file")
    try:
        columns = data.read_schema(path).names
    except data.DataError:
        columns = None
    k = len(id_columns)
    if (not columns or columns[:k + 1] != id_columns + ["prediction"]
            or not all(is_prediction_column(c) for c in columns[k + 1:])):
        raise _refuse(path, "is not a predictions file beam-dp wrote"
                      + (" with these --id-columns (give the ones it was written with)"
                         if columns and "prediction" in columns else ""))


def json_text(value: dict) -> str:
    """The text of an output JSON file."""
    return json.dumps(value, indent=2, sort_keys=False) + "\n"


def write_json(directory: str, name: str, value: dict) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(json_text(value))
