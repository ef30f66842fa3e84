"""A table's declared schema: which column is the label (and its classes), which are numeric or
categorical features, which are ignored or identify rows, and what a missing cell means.

Declared, never inferred from values (a value must not shape the output): in a JSON file
(``--schema FILE``, ``beam_dp.train(schema=...)``) or by the equivalent flags, a flag winning
over the file. The file:

    {
      "label": "default",                        # the label column
      "label_classes": ["No", "Yes"],            # text labels -> class ids (binary: 2 classes)
      "positive_class": "Yes",                   # class 1 of a binary model (default: the second)
      "label_positive": {"at_least": 4},         # or {"one_of": ["4", "5"]}: a binary label
                                                 # derived from the label column (instead of
                                                 # label_classes), in train and predict alike
      "numeric": ["balance", "income"],          # feature columns (default: every numeric one)
      "categorical": ["student"],                # string/integer columns (sparse features)
      "hash_buckets": 64,                        # or "vocabulary": "vocab.json", or
                                                 # {"student": ["No", "Yes"]} inline
      "ignore": ["row_id"],                      # left out of the default feature columns
      "id_columns": ["row_id"],                  # copied into predict's output
      "privacy_unit": "user_id",                 # user-level privacy: the unit's key column
      "missing": {"income": "indicator", "balance": "constant:0", "label": "drop"},
      "bounds": {"income": [0, 100000], "balance": [0, 3000]}   # public ranges
    }

``missing`` gives each numeric column's policy for a missing cell (null, empty, NaN):
"constant:V" fills V; "indicator" (or "indicator:V") fills 0 (or V) and adds a 0/1 column
"<column>_missing"; "drop" leaves the row out of training; "median" and "mean" fill a private
release from the column's present values (dpgd and dpsgd; "mean" within the column's declared
``bounds``). The label column takes only "drop".
Without a policy a missing cell is an error naming its row and column, as before.

``bounds`` declares a numeric column's public range [low, high] (what the column can hold, known
without reading the data, like diffprivlib's ``bounds=``): dpgd and dpsgd then map it onto
[-1, 1] without spending privacy, and a regression label's range sets the label's scale (the
model is trained on the scaled label and its coefficients mapped back). Columns without declared
bounds are scaled privately (``--scale-features``). A value outside its range is clipped to it.

Everything declared here is public, recorded in model.json (the encoding, the scaling) and
applied again by predict.
"""
from __future__ import annotations

import json
import math
import sys

from beam_dp import storage

# schema key -> beam_dp.train keyword
KEYS = {
    "label": "label_column",
    "label_classes": "label_classes",
    "positive_class": "positive_class",
    "label_positive": "label_positive",
    "numeric": "feature_columns",
    "categorical": "categorical_columns",
    "hash_buckets": "hash_buckets",
    "hash_seed": "hash_seed",
    "vocabulary": "vocabulary",
    "ignore": "ignore_columns",
    "missing": "missing",
    "id_columns": "id_columns",
    "bounds": "bounds",
    "privacy_unit": "privacy_unit_column",
}
LISTS = ("label_classes", "numeric", "categorical", "ignore", "id_columns")


class SchemaError(ValueError):
    """A schema file that cannot be used; names keys, never data values."""


def read(path: str) -> dict:
    """The schema file as ``beam_dp.train`` keywords (``id_columns`` is predict's)."""
    try:
        raw = json.loads(storage.read_text(path))
    except FileNotFoundError:
        raise SchemaError(f"{path}: schema file not found") from None
    except (OSError, ValueError) as e:
        raise SchemaError(f"{path}: cannot read the schema ({type(e).__name__})") from None
    return from_dict(raw, path)


def from_dict(raw, source: str = "schema") -> dict:
    if not isinstance(raw, dict):
        raise SchemaError(f"{source}: a schema is a JSON object (see beam_dp.schema)")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise SchemaError(f"{source}: unknown key(s) {', '.join(unknown)}; the keys: "
                          f"{', '.join(KEYS)}")
    out = {}
    for key, value in raw.items():
        if key in LISTS:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SchemaError(f"{source}: '{key}' must be a list of strings")
            value = list(value)
        elif key == "missing":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise SchemaError(f"{source}: 'missing' must map columns to policies "
                                  "(constant:V, indicator, indicator:V, drop, median, mean)")
        elif key == "vocabulary":
            # a file, or the values themselves (checked against the columns by the encoding)
            if not isinstance(value, (str, dict)):
                raise SchemaError(f"{source}: 'vocabulary' must be a file name or an object "
                                  "mapping each categorical column to its list of values")
        elif key in ("label", "positive_class", "privacy_unit"):
            if not isinstance(value, str):
                raise SchemaError(f"{source}: '{key}' must be a string")
        elif key == "bounds":
            value = check_bounds(value, source)
        elif key in ("hash_buckets", "hash_seed"):
            if not isinstance(value, int) or isinstance(value, bool):
                raise SchemaError(f"{source}: '{key}' must be a whole number")
        out[KEYS[key]] = value
    return out


def check_bounds(value, source: str = "bounds") -> dict:
    """{column: [low, high]} with finite numbers, low < high (names keys, never values' data)."""
    if not isinstance(value, dict):
        raise SchemaError(f"{source}: 'bounds' must map columns to [low, high]")
    out = {}
    for column, pair in value.items():
        ok = (isinstance(pair, (list, tuple)) and len(pair) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair))
        if not ok or not all(math.isfinite(v) for v in pair) or not pair[0] < pair[1]:
            raise SchemaError(f"{source}: the bounds of '{column}' must be two finite numbers "
                              "[low, high] with low < high")
        # Finite ends are not enough: the scaling and the mean fill divide by the half-width
        # (high - low) / 2, which overflows to inf for [-1e308, 1e308] (NaN fills, a crash) or
        # underflows to 0 for [0, 1e-320].
        if not (math.isfinite(pair[1] - pair[0]) and (pair[1] - pair[0]) / 2 >= sys.float_info.min):
            raise SchemaError(f"{source}: the bounds of '{column}' must have a width high - low "
                              "that is a finite, normal float (not above about 1.7e308)")
        out[str(column)] = (float(pair[0]), float(pair[1]))
    return out


def merge(declared: dict, given: dict, defaults: dict) -> dict:
    """``given`` keywords over the schema's ``declared`` ones: a keyword still at its default
    takes the schema's value (so a flag given at its default value cannot override the file);
    ``missing`` maps are merged, a flag's policy winning for its column."""
    out = dict(given)
    for name, value in declared.items():
        if name == "missing" and out.get(name):
            out[name] = {**value, **out[name]}   # a flag's column wins; the file's others stay
            continue
        if name in out and out[name] != defaults.get(name):
            continue
        out[name] = value
    return out


def label_policy(missing: dict | None, label_column: str) -> dict | None:
    """``missing`` with the label column's policy moved to ``categorical.LABEL_KEY`` (only
    "drop" is allowed there)."""
    from beam_dp.categorical import LABEL_KEY, EncodingError
    if not missing or label_column not in missing:
        return missing
    out = dict(missing)
    policy = out.pop(label_column)
    if policy != "drop":
        raise EncodingError(f"the label column '{label_column}' takes only the missing-value "
                            "policy 'drop'")
    out[LABEL_KEY] = "drop"
    return out
