"""Artifacts: the model, the privacy report and the metrics, written atomically into one directory."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile

import numpy as np

from beam_dp import losses as losses_mod
from beam_dp import publish, storage

TRUST_MODEL = (
    "Central differential privacy. The workers and the driver are trusted and see the raw data; "
    "the guarantee covers everything that leaves the job: the model, this report and the "
    "checkpoints, each a post-processing of noised releases. It protects {unit}; it does not "
    "protect {beyond} beyond what group privacy gives, nor the "
    "validation data, nor hyperparameters chosen by looking at the data, which are treated as "
    "public. A runner's job graphs and staging location are inside the boundary too: a DP-GD "
    "job's graph (and a DP-SGD step job's) holds the noise keys of its steps, an "
    "objective-perturbation job's the objective's noise.")


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
        return _parse(path, storage.read_bytes(path))
    except FileNotFoundError:
        raise ValueError(f"{path}: not found") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({type(e).__name__})") from None


def _parse(path: str, content: bytes) -> dict:
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({type(e).__name__})") from None


def is_output_directory(path: str) -> bool:
    """Whether ``path`` names an output directory rather than a file: a local directory, or on
    an object store (which has no directories) any path not ending in .json."""
    return storage.is_local_dir(path) if not storage.is_remote(path) else \
        not path.rstrip("/").endswith(".json")


def read_outputs(directory: str, required, optional=()) -> dict[str, dict]:
    """JSON files of the output directory ``directory``, all of the version its manifest names
    (``beam_dp.publish``): a reader never mixes a replaced model with the new report. ``optional``
    names are read when the output has them. One-line ValueError otherwise."""
    manifest = publish.read_manifest(storage.normalize(directory))
    if manifest is None:
        raise ValueError(f"{directory}: not a complete beam-dp output directory (no "
                         f"{publish.MANIFEST}: not written by beam-dp, or its run did not finish)")
    missing = [name for name in required if name not in manifest["files"]]
    if missing:
        raise ValueError(f"{directory}: no {' or '.join(missing)}")
    names = list(required) + [name for name in optional if name in manifest["files"]]
    raw = publish.read(directory, names)
    return {name: _parse(storage.join(directory, name), raw[name]) for name in names}


def read_model(path: str) -> dict:
    """The artifact of model.json (or of an output directory holding one), with a one-line error
    when it is missing or not a model."""
    if is_output_directory(path):
        artifact = read_outputs(path, ["model.json"])["model.json"]
        path = storage.join(path, "model.json")
    else:
        artifact = read_json(path)
    return check_model(artifact, path)


def check_model(artifact: dict, path: str) -> dict:
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

# Who the unit leaves out (the trust model's "does not protect ... beyond group privacy").
NOT_PROTECTED = {
    "add/remove": "a person who contributes several rows",
    "replace-one": "a person who contributes several rows",
    "add/remove one user (all their rows)": (
        "a person whose rows carry several values of the privacy unit column (each value is a "
        "user)"),
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
        "trust_model": TRUST_MODEL.format(unit=PROTECTED[ledger.neighbouring],
                                          beyond=NOT_PROTECTED[ledger.neighbouring]),
    }


def compose_with_inputs(privacy_report: dict, vocabulary) -> None:
    """Adds to a model's ``privacy_report`` what it was trained on that was itself released from
    the data: a ``vocabulary`` file written by ``beam-dp vocabulary`` (its privacy_report.json
    beside it), as ``inputs_released`` (path, release id, epsilon, delta) and ``composed``: the
    epsilon of the model and those releases together at the sum of their deltas (dp_accounting's
    PLD accountant on the composed DpEvents; where it cannot account for one, basic composition,
    the sum of the epsilons). A vocabulary without a report beside it (a dict, or a file written
    by hand) is public input: nothing to compose, and said so. A release under another
    neighbouring relation is listed but not composed (another unit of privacy)."""
    if not isinstance(vocabulary, str):
        return
    from dp_accounting import dp_event

    from beam_dp import accounting

    beside = storage.join(os.path.dirname(vocabulary) or ".", "privacy_report.json")
    if not storage.exists(beside):
        privacy_report["inputs_released"] = [{
            "path": vocabulary, "kind": "vocabulary",
            "privacy": "no privacy_report.json beside it: treated as public input"}]
        return
    released = read_json(beside)
    from beam_dp.vocabulary_release import VOCABULARY_RELEASE
    if [m.get("name") for m in released.get("mechanisms", [])] != [VOCABULARY_RELEASE]:
        # (a file put beside another release's report, a model's say: not its privacy)
        privacy_report["inputs_released"] = [{
            "path": vocabulary, "kind": "vocabulary",
            "privacy": "the privacy_report.json beside it is not a vocabulary release's: "
                       "treated as public input, not composed"}]
        return
    entry = {"path": vocabulary, "kind": "vocabulary", "release_id": released.get("release_id"),
             "epsilon": released["epsilon"], "delta": released["delta"],
             "neighbouring": released["neighbouring"]}
    privacy_report["inputs_released"] = [entry]
    if released["neighbouring"] != privacy_report["neighbouring"]:
        privacy_report["composed"] = {
            "epsilon": None, "reason": "the vocabulary is accounted under another neighbouring "
                                       "relation (another unit of privacy): not composed"}
        return
    delta = privacy_report["delta"] + released["delta"]
    event = dp_event.ComposedDpEvent([
        accounting.event_from_json(privacy_report["dp_event"]),
        accounting.event_from_json(released["dp_event"])])
    try:
        epsilon, method = accounting.epsilon_of(event, delta, "pld",
                                                privacy_report["neighbouring"]), "PLD"
    except Exception:   # noqa: BLE001 - an event PLD cannot account (tune's random stopping)
        epsilon, method = privacy_report["epsilon"] + released["epsilon"], "basic composition"
    privacy_report["composed"] = {
        "epsilon": epsilon, "delta": delta,
        "of": "the model and the released inputs it was trained on",
        "method": f"{method} over the model's and the inputs' DpEvents"}


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


MARKER = publish.MANIFEST   # in every directory beam-dp writes: what it wrote there


_refuse = publish.refusal   # (one wording for every refusal to replace an output)


def check_output_directory(path: str, overwrite: bool) -> None:
    """Refuses, before any work, an output that exists unless ``overwrite`` is set and it is a
    directory beam-dp wrote (``beam_dp.publish.check_output_directory``)."""
    publish.check_output_directory(path, overwrite)


def check_not_inside(output: str, inputs) -> None:
    """Refuses an output directory that holds (or is) one of the job's input files: replacing
    it would delete the data the job just read."""
    if storage.is_remote(output):
        root = storage.normalize(output) + "/"
        if any(storage.normalize(name).startswith(root) for name in inputs):
            raise _refuse(output, "holds this job's own input files")
        return
    root = os.path.realpath(output)
    for name in inputs:
        if "://" not in name and os.path.commonpath([root, os.path.realpath(name)]) == root:
            raise _refuse(os.path.abspath(output), "holds this job's own input files")


@contextlib.contextmanager
def atomic_directory(path: str, overwrite: bool = False):
    """Yields a local scratch directory; when the block succeeds, the files written there are
    published as the output directory ``path`` on any file system (``beam_dp.publish``: the old
    version or the new one, never a part), so a failed job leaves no partial output."""
    check_output_directory(path, overwrite)
    scratch = tempfile.mkdtemp(prefix="beam-dp-output-")   # scratch space, not a user's path
    try:
        yield scratch
        files = {}
        for name in sorted(os.listdir(scratch)):
            with open(os.path.join(scratch, name), "rb") as f:
                files[name] = f.read()
        publish.publish(path, files, overwrite)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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
    path = storage.normalize(path)
    # A predictions file inside a model's (or any beam-dp) output directory would be a foreign
    # entry there, as an output directory would: that directory could no longer be replaced.
    publish.check_not_in_an_output(path)
    if storage.is_local_dir(path) and not overwrite:
        raise ValueError(f"{path} is a directory: give a predictions file name (.csv or .parquet)")
    if not storage.exists(path):
        storage.check_writable_parent(path)
        data.file_format(path)   # .csv, .csv.gz or .parquet, before any work
        return
    if not overwrite:
        raise FileExistsError(f"{path} already exists (pass --overwrite, or overwrite=True in "
                              "Python, to replace a predictions file beam-dp wrote)")
    if not storage.is_remote(path) and (os.path.islink(path) or not os.path.isfile(path)):
        raise _refuse(path, "is not a regular file")
    try:
        columns = data.read_schema(path, storage.open_read).names
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
    write_texts(directory, {name: json_text(value)})


def write_texts(directory: str, files: dict) -> None:
    """Each file's text (name -> text) into ``directory``: ``atomic_directory``'s scratch
    space, which it then publishes."""
    for name, text in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
