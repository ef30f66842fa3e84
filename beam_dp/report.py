"""Artifacts: the model, the privacy report and the metrics, written atomically into one directory."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import numpy as np

from beam_dp import losses as losses_mod

TRUST_MODEL = (
    "Central differential privacy. The workers and the driver are trusted and see the raw data; "
    "the guarantee covers everything that leaves the job: the model, this report and the "
    "checkpoints, each a post-processing of noised releases. It protects the presence or absence "
    "of any one example (one row) of the training input; it does not protect a person who "
    "contributes several rows beyond what group privacy gives, nor the validation data, nor "
    "hyperparameters chosen by looking at the data, which are treated as public.")


def model_artifact(loss: losses_mod.GlmLoss, theta: np.ndarray, feature_columns, label_column,
                   algorithm: str, fit_intercept: bool, feature_transform: dict | None = None) -> dict:
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
    if feature_transform:
        artifact["feature_transform"] = feature_transform
    if loss.name == "softmax":
        artifact["num_classes"] = loss.num_classes
    if loss.name == "huber":
        artifact["huber_delta"] = loss.delta
    return artifact


def load_model(path: str) -> tuple[losses_mod.GlmLoss, np.ndarray, dict]:
    """Reads model.json (or a directory holding one); returns the loss, theta (k, d+1), artifact."""
    if os.path.isdir(path):
        path = os.path.join(path, "model.json")
    with open(path) as f:
        return load_model_dict(json.load(f))


def load_model_dict(artifact: dict) -> tuple[losses_mod.GlmLoss, np.ndarray, dict]:
    loss = losses_mod.make_loss(artifact["model"], artifact.get("num_classes"),
                                artifact.get("huber_delta", 1.0))
    coef = np.atleast_2d(np.asarray(artifact["coefficients"], dtype=np.float64))
    intercept = np.atleast_1d(np.asarray(artifact["intercept"], dtype=np.float64))
    return loss, np.column_stack([coef, intercept]), artifact


def feature_map(artifact: dict):
    """The per-example map the model expects of raw feature blocks (identity when none)."""
    from beam_dp import features

    spec = artifact.get("feature_transform") or {}
    if "normalize_rows" in spec:
        return features.NormalizeRows(float(spec["normalize_rows"]))
    if "clip_rows" in spec:
        return features.ClipRows(float(spec["clip_rows"]))
    return lambda block: block


def evaluate(loss: losses_mod.GlmLoss, theta: np.ndarray, blocks) -> dict:
    """Accuracy (classification) or RMSE (regression) over validation blocks."""
    correct = squared = 0.0
    n = 0
    for b in blocks:
        s = losses_mod.scores(theta, b.features)
        if loss.is_classifier:
            truth = (b.labels > 0).astype(np.int64) if loss.name in ("logistic", "hinge") else b.labels
            correct += float(np.sum(loss.predict(s) == truth))
        else:
            squared += float(np.sum((s[:, 0] - b.labels) ** 2))
        n += len(b)
    metrics = {"validation_examples": n}
    if loss.is_classifier:
        metrics["accuracy"] = correct / n
    else:
        metrics["rmse"] = float(np.sqrt(squared / n))
    return metrics


@contextlib.contextmanager
def atomic_directory(path: str, overwrite: bool = False):
    """Yields a temporary directory beside ``path`` and renames it to ``path`` only when the block
    succeeds, so a failed job leaves no partial output."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} already exists (pass --overwrite to replace it)")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        yield tmp
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


def write_json(directory: str, name: str, value: dict) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(value, f, indent=2, sort_keys=False)
        f.write("\n")
