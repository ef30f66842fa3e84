"""Predictions of a released model over files (``beam-dp predict``): one row per input row, the
id columns copied, the prediction, and the probabilities of a logistic or softmax model; written
beside the target and renamed, so that a failed run leaves no partial file."""
from __future__ import annotations

import os
import tempfile
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import scipy.special

from beam_dp import data, storage
from beam_dp.model import Model
from scipy.special import expit


def id_columns_of(id_columns: Sequence[str] | None, schema: str | None) -> list[str]:
    """The id columns given, or else the schema file's ``id_columns``."""
    if id_columns is None and schema is not None:
        from beam_dp import schema as schema_mod
        id_columns = schema_mod.read(schema).get("id_columns")
    return list(id_columns or ())


def check_vocabulary(model: Model, vocabulary: str) -> None:
    """Refuses a vocabulary file that is not the one the model was trained with."""
    from beam_dp import categorical

    encoding = model.encoding
    if encoding is None or encoding.vocabulary is None:
        raise ValueError(f"--vocabulary {vocabulary}: the model has no vocabulary (it was "
                         "trained without one)")
    given = categorical.read_vocabulary(vocabulary, encoding.categorical)
    if categorical.vocabulary_fingerprint(given) != categorical.vocabulary_fingerprint(encoding.vocabulary):
        raise ValueError(f"--vocabulary {vocabulary} is not the vocabulary the model was trained "
                         "with (their SHA-256 differ); the model's own copy is used without "
                         "--vocabulary")


def predict_columns(model: Model, files: Sequence[str], id_columns: Sequence[str],
                    batch_rows: int) -> dict:
    """Column name -> Arrow array: the id columns, ``prediction`` (null where the row was
    dropped), and ``probability`` (logistic) or ``probability_<class>`` (softmax)."""
    encoding = model.encoding
    predictions, probabilities, dropped, ids = [], [], [], {c: [] for c in id_columns}
    for path in files:
        if id_columns:
            ids_of = data.read_columns(path, list(id_columns), batch_rows)
            for c in id_columns:
                ids[c].append(ids_of[c])
        for block in data.blocks_from_file(path, None, model.feature_columns, model.loss,
                                           batch_rows, encoding=encoding):
            s = model.block_scores(block)
            predictions.append(model.loss.predict(s))
            dropped.append(block.dropped if block.dropped is not None
                           else np.zeros(len(block), dtype=bool))
            if model.loss.name == "logistic":
                probabilities.append(expit(s[:, 0]))
            elif model.loss.name == "softmax":
                probabilities.append(scipy.special.softmax(s, axis=1))
    mask = np.concatenate(dropped) if dropped else np.zeros(0, dtype=bool)
    labels = model.labels_of(np.concatenate(predictions), mask)
    columns = {c: _concat_ids([a for part in ids[c] for a in part.chunks]) for c in id_columns}
    columns["prediction"] = (pa.array(labels.tolist()) if labels.dtype == object
                             else pa.array(labels, mask=mask if mask.any() else None))
    if probabilities and model.loss.name == "logistic":
        columns["probability"] = pa.array(np.concatenate(probabilities),
                                          mask=mask if mask.any() else None)
    elif probabilities:   # softmax: one column per class, named by the declared class (or its id)
        stacked = np.concatenate(probabilities)
        for k, name in enumerate(_class_column_names(model, stacked.shape[1])):
            columns[name] = pa.array(stacked[:, k], mask=mask if mask.any() else None)
    return columns


def write_predictions(output: str, columns: dict,
                      before_replace: Callable[[], None] = lambda: None) -> None:
    """Writes ``columns`` to ``output`` (.csv or .parquet) on any file system: made whole in a
    local scratch file first, then written in one piece (``storage.write_bytes``: a reader finds
    the old file or the new one, never a part). ``before_replace`` may raise to abandon the
    write (an interrupt)."""
    name = storage.basename(output)
    fd, scratch = tempfile.mkstemp(prefix="beam-dp-predictions-", suffix=f"-{name}")
    os.close(fd)
    try:
        data.write_table(scratch, columns)
        before_replace()
        with open(scratch, "rb") as f:   # (our scratch file, not a user's path)
            content = f.read()
        storage.write_bytes(storage.normalize(output), content)
    except (OSError, pa.ArrowException) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(f"cannot write {output}: {reason}") from None
    finally:
        os.remove(scratch)


def _class_column_names(model: Model, classes: int) -> list[str]:
    """softmax's probability columns: probability_<class name> in class-id order (the declared
    names are public, in model.json), or probability_<id> without declared names."""
    encoding = model.encoding
    names = encoding.label_classes if encoding is not None and encoding.label_classes else None
    return [f"probability_{names[k] if names is not None else k}" for k in range(classes)]


def _concat_ids(pieces: list):
    """An id column from its pieces: as they are if all have one type, else all as text (a CSV
    file's ids are text, a Parquet file's may be integers)."""
    if not pieces:
        return pa.array([], pa.string())
    if len({p.type for p in pieces}) > 1:
        pieces = [p.cast(pa.large_string()) for p in pieces]
    return pa.concat_arrays(pieces)
