"""Categorical columns as sparse features: a public encoding from raw values to column ids.

A categorical column (string or integer, declared by ``--categorical-columns``: never inferred
from the cells) becomes one nonzero (a 1) per row, in a column chosen by a public map:

* **feature hashing** (``--hash-buckets B``): the value's text, hashed with a public seed (the
  column's name mixed in), modulo B; all categorical columns share the B buckets. Nothing about
  the data is in the map, so it costs no privacy, and any value, seen in training or not, has a
  bucket.
* **a vocabulary** (``--vocabulary FILE``, JSON ``{"column": ["value", ...], ...}``): each
  listed value gets its own column, and every other value (and a missing cell) of that column
  shares one "other" column. The file is public (written by the user, or released privately by
  ``beam-dp vocabulary``, whose partition selection is pipeline-dp's:
  ``beam_dp.vocabulary_release``); it is stored in model.json with its SHA-256, and
  ``predict --vocabulary`` checks a file against it.

The model's features are the numeric columns first (as read), then the categorical columns'
ids: ``Encoding.dim`` of them, in a scipy CSR matrix per block, so a row costs its nonzeros
(numeric columns + one per categorical column), never d. A missing (null or empty) categorical
cell is a value of its own: a reserved hash bucket, or the column's "other" id.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp

from beam_dp import storage

HASH_NAME = "beam-dp-poly64-v1"   # recorded in model.json: predict refuses a hash it lacks
MAX_HASH_BUCKETS = 1 << 28
# Multiplier of the polynomial string hash, and splitmix64's constants (Steele, Lea & Flood,
# "Fast splittable pseudorandom number generators", 2014), finishing it into well-mixed bits.
_POLY = np.uint64(0x100000001B3)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class EncodingError(ValueError):
    """A bad encoding request or a vocabulary that does not fit; names columns, never values."""


def _splitmix(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):   # uint64 arithmetic wraps, as intended
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def column_seed(name: str, seed: int) -> np.uint64:
    """The hash key of one column: its name and the public seed."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def as_text(values: pa.Array) -> pa.Array:
    """A categorical column as UTF-8 text (integers by their decimal form), nulls kept."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
            or pa.types.is_integer(values.type) or pa.types.is_boolean(values.type)
            or pa.types.is_null(values.type)):
        text = values.cast(pa.large_string())
    elif pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        text = values.cast(pa.large_binary()).view(pa.large_string())
    else:
        raise EncodingError(f"its type {values.type} cannot be categorical (string or integer)")
    # An empty text is a missing value, as an empty CSV cell is, in every input format.
    return pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.large_string()), text)


def hash_text(values: pa.Array, key: np.uint64) -> np.ndarray:
    """uint64 hashes of text values (nulls hash as a reserved value), vectorized over the bytes:
    a polynomial hash of each value's bytes, then its length and ``key``, through splitmix64.

    Written here rather than taken from a library: pyarrow's compute functions have no stable,
    seeded hash, and hashing value by value in Python would be a per-example loop."""
    values = as_text(values)
    n = len(values)
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int64)[values.offset:values.offset + n + 1]
    data = values.buffers()[2]
    raw = (np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8))
    lengths = np.diff(offsets)
    first = int(offsets[0]) if n else 0
    body = raw[first:int(offsets[-1])] if n else raw[:0]
    # position of each byte within its value, and POLY^position (wrapping uint64 powers)
    starts = np.repeat(offsets[:-1] - first, lengths)
    position = np.arange(body.size, dtype=np.int64) - starts
    longest = int(lengths.max()) if n and lengths.size else 0
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(max(longest, 1), _POLY, dtype=np.uint64), dtype=np.uint64)
        terms = (body.astype(np.uint64) + np.uint64(1)) * powers[position] if body.size else body.astype(np.uint64)
        cumulative = np.concatenate([[np.uint64(0)], np.cumsum(terms, dtype=np.uint64)])
        sums = cumulative[offsets[1:] - first] - cumulative[offsets[:-1] - first]
        h = _splitmix(sums ^ _splitmix(lengths.astype(np.uint64) ^ np.uint64(key)))
    if values.null_count:
        missing = ~np.asarray(values.is_valid(), dtype=bool)
        h[missing] = _splitmix(np.array([np.uint64(key) ^ np.uint64(0xFFFFFFFFFFFFFFFF)]))[0]
    return h


MISSING_POLICIES = ("constant", "indicator", "drop", "median", "mean")
# Policies whose fill is a DP release from the column's present values (dpgd/dpsgd's private
# ranges stage, ``column_scaling.prepare``): until it is released the fill is NaN and the
# column's missing cells stay NaN; the released value is recorded here (model.json) after.
IMPUTED_POLICIES = ("median", "mean")


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How raw columns become the model's features (and, with declared classes, its labels):
    ``numeric`` columns as they are (a missing cell by its column's ``missing`` policy), one
    0/1 indicator column per numeric column whose policy is "indicator", then the
    ``categorical`` ones through hashing (``hash_buckets``) or a ``vocabulary`` (per column, a
    tuple of its values; id = position, ``len`` = the column's "other").

    Missing numeric cells (null, an empty CSV cell, or NaN): with no policy they stop the job (a
    DataError naming the row and column); "constant" fills the declared value; "indicator" fills
    it and sets the column's indicator to 1; "drop" leaves the row out of training (predict gives
    it no prediction). All of it is declared, public, and stored in model.json, so ``predict``
    applies it again; none of it is learnt from the data, except the fill of "median" and
    "mean": a DP release by dpgd/dpsgd (NaN here until released, and the cells NaN meanwhile:
    ``pending``), then recorded like any other fill (``with_fills``).

    ``label_classes``: the label's values as text, in the order of their class ids (softmax), or
    the two classes of a binary model, ``positive_class`` being class 1. ``label_rule``: a
    binary label derived from the label column (``label_rule_of``: ("at_least", t), class 1
    where the value is at least t; or ("one_of", values as text), class 1 for those values),
    its classes then named by the rule. ``label_missing`` "drop" leaves rows with a missing
    label out (else they are an error)."""

    numeric: tuple
    categorical: tuple
    hash_buckets: int | None = None
    hash_seed: int = 0
    vocabulary: tuple | None = None     # ((column, (value, ...)), ...) in categorical order
    missing: tuple = ()                 # ((numeric column, policy, fill value), ...)
    label_classes: tuple | None = None
    positive_class: str | None = None
    label_missing: str = "error"
    label_rule: tuple | None = None

    def __post_init__(self):
        if not (self.categorical or self.missing or self.label_classes
                or self.label_missing != "error"):
            raise EncodingError("an encoding needs a categorical column, a missing-value policy "
                                "or label classes")
        overlap = sorted(set(self.numeric) & set(self.categorical))
        if overlap:
            raise EncodingError(f"column(s) {', '.join(overlap)} are listed as both numeric and categorical")
        if self.categorical and (self.hash_buckets is None) == (self.vocabulary is None):
            raise EncodingError("categorical columns need exactly one of --hash-buckets or "
                                "--vocabulary (in a schema: \"hash_buckets\": N, or "
                                "\"vocabulary\": a file or {column: [values]})")
        if not self.categorical and (self.hash_buckets is not None or self.vocabulary is not None):
            raise EncodingError("--hash-buckets and --vocabulary need --categorical-columns")
        if self.hash_buckets is not None and not 1 <= self.hash_buckets <= MAX_HASH_BUCKETS:
            raise EncodingError(f"--hash-buckets must be between 1 and {MAX_HASH_BUCKETS}")
        if self.vocabulary is not None:
            if tuple(c for c, _ in self.vocabulary) != tuple(self.categorical):
                raise EncodingError("the vocabulary's columns are not the categorical columns "
                                    f"({', '.join(self.categorical)})")
        for column, policy, fill in self.missing:
            if column not in self.numeric:
                raise EncodingError(f"a missing-value policy for '{column}', which is not a numeric "
                                    "feature column (categorical columns have their own missing value)")
            if policy not in MISSING_POLICIES:
                raise EncodingError(f"column '{column}': the missing-value policy must be one of "
                                    f"{', '.join(MISSING_POLICIES)}")
            unreleased = policy in IMPUTED_POLICIES and isinstance(fill, float) and np.isnan(fill)
            if not (isinstance(fill, (int, float)) and (np.isfinite(fill) or unreleased)):
                raise EncodingError(f"column '{column}': the fill value must be a finite number")
        repeated = sorted({c for c, _, _ in self.missing if [m[0] for m in self.missing].count(c) > 1})
        if repeated:
            raise EncodingError(f"more than one missing-value policy for {', '.join(repeated)}")
        # An indicator is named "<column>_missing": it must not take an input column's name
        # (two features of one name: the report and predict could not tell them apart).
        clash = sorted(f"{c}_missing" for c in self.indicators
                       if f"{c}_missing" in set(self.numeric) | set(self.categorical))
        if clash:
            raise EncodingError(f"the missing-value indicator(s) {', '.join(clash)} would take the "
                                "name of an input column: rename that column or use another "
                                "policy")
        if self.label_missing not in ("error", "drop"):
            raise EncodingError("the label's missing-value policy must be 'error' or 'drop'")
        if self.label_classes is not None:
            if len(self.label_classes) < 2 or len(set(self.label_classes)) != len(self.label_classes):
                raise EncodingError("--label-classes needs at least two distinct classes")
            if self.positive_class is not None and self.positive_class not in self.label_classes:
                raise EncodingError("--positive-class must be one of --label-classes")
            if self.positive_class is not None and len(self.label_classes) > 2:
                raise EncodingError("--positive-class is for two classes; with more, the "
                                    "classes' order gives their ids")
        elif self.positive_class is not None:
            raise EncodingError("--positive-class needs --label-classes")

    # -- shape
    @property
    def sparse(self) -> bool:
        """Whether blocks are CSR (categorical columns) rather than dense."""
        return bool(self.categorical)

    @property
    def columns(self) -> list[str]:
        """The raw input columns, numeric first."""
        return list(self.numeric) + list(self.categorical)

    @property
    def indicators(self) -> list[str]:
        """The numeric columns with a missing indicator, in numeric order."""
        policy = {c: p for c, p, _ in self.missing}
        return [c for c in self.numeric if policy.get(c) == "indicator"]

    @property
    def dense_names(self) -> list[str]:
        """The model's dense columns: the numeric ones, then each indicator ("x_missing")."""
        return list(self.numeric) + [f"{c}_missing" for c in self.indicators]

    @property
    def first_categorical(self) -> int:
        """The model column of the first categorical id."""
        return len(self.dense_names)

    def widths(self) -> list[int]:
        """Model columns per categorical column (vocabulary: values + "other")."""
        if self.vocabulary is None:
            return []
        return [len(values) + 1 for _, values in self.vocabulary]

    @property
    def dim(self) -> int:
        if self.hash_buckets is not None:
            return self.first_categorical + self.hash_buckets
        return self.first_categorical + sum(self.widths())

    @property
    def nonzeros_per_row(self) -> int:
        """At most this many nonzeros in a row (the sparsity s of paper 001)."""
        return self.first_categorical + len(self.categorical)

    @property
    def imputed(self) -> list[tuple[str, str]]:
        """(column, "median" or "mean") of the numeric columns whose fill is a private release,
        in numeric order."""
        policy = {c: p for c, p, _ in self.missing}
        return [(c, policy[c]) for c in self.numeric if policy.get(c) in IMPUTED_POLICIES]

    @property
    def pending(self) -> np.ndarray:
        """Per dense column: True where the column's fill is still to be released (its missing
        cells are NaN until then, and only training's transform fills them)."""
        unreleased = {c for c, p, f in self.missing if p in IMPUTED_POLICIES and np.isnan(f)}
        return np.array([c in unreleased for c in self.dense_names], dtype=bool)

    def with_fills(self, fills: Mapping[str, float]) -> "Encoding":
        """This encoding with the released fills of its "median"/"mean" columns."""
        return dataclasses.replace(self, missing=tuple(
            (c, p, float(fills[c]) if p in IMPUTED_POLICIES and c in fills else f)
            for c, p, f in self.missing))

    @property
    def drops_rows(self) -> bool:
        return self.label_missing == "drop" or any(p == "drop" for _, p, _ in self.missing)

    # -- missing values and labels
    def fill(self, numeric: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the dense columns, rows to keep): ``numeric`` (m, len(numeric)) with each missing
        (NaN) cell filled by its policy (a dropped row's cells by 0, never used), the indicator
        columns appended. Cells without a policy are left as they are, for the finiteness check
        to report."""
        numeric = np.array(numeric, dtype=np.float64)
        keep = np.ones(numeric.shape[0], dtype=bool)
        indicators = []
        for j, column in enumerate(self.numeric):
            policy = self._policies().get(column)
            if policy is None:
                continue
            absent = np.isnan(numeric[:, j])
            kind, value = policy
            if kind == "drop":
                keep &= ~absent
            numeric[absent, j] = 0.0 if kind == "drop" else value
            if kind == "indicator":
                indicators.append(absent.astype(np.float64))
        if indicators:
            numeric = np.column_stack([numeric, *indicators])
        return numeric, keep

    def _policies(self) -> dict:
        return {c: (p, float(f)) for c, p, f in self.missing}

    def label_ids(self, values: pa.Array) -> tuple[np.ndarray, int | None]:
        """(labels as float: class ids, or 0/1 for a binary model's positive class; NaN where
        missing, the first row whose value is not a declared class, or None)."""
        if self.label_rule is not None:
            return _derived_label(self.label_rule, values)
        text = as_text(values)
        index = pc.index_in(text, value_set=_value_set(self.label_classes))
        ids = np.asarray(index.cast(pa.float64()).fill_null(np.nan), dtype=np.float64)
        unknown = np.flatnonzero(np.isnan(ids) & np.asarray(text.is_valid(), dtype=bool))
        if len(self.label_classes) == 2 and self.positive_class is not None:
            positive = float(self.label_classes.index(self.positive_class))
            ids = np.where(np.isnan(ids), np.nan, (ids == positive).astype(np.float64))
        return ids, (int(unknown[0]) if unknown.size else None)

    # -- encoding
    def column_ids(self, name: str, values: pa.Array) -> np.ndarray:
        """The model column (int64, within ``dim``) of each value of categorical column ``name``."""
        try:
            if self.hash_buckets is not None:
                h = hash_text(values, column_seed(name, self.hash_seed))
                return self.first_categorical + (h % np.uint64(self.hash_buckets)).astype(np.int64)
            j = self.categorical.index(name)
            base = self.first_categorical + sum(self.widths()[:j])
            known = _value_set(self.vocabulary[j][1])
            index = pc.index_in(as_text(values), value_set=known)
            other = len(self.vocabulary[j][1])
            return base + np.asarray(index.fill_null(other), dtype=np.int64)
        except EncodingError as e:
            raise EncodingError(f"column '{name}': {e}") from None

    def encode(self, dense: np.ndarray, categorical: Mapping[str, pa.Array]):
        """The (m, dim) rows from ``dense`` (m, ``first_categorical``): the numeric columns as
        ``fill`` returns them, indicators included) and the categorical columns: a numpy array
        without categorical columns, else CSR rows with one 1 per categorical column at its id,
        built from index arrays, never a dense (m, dim) matrix."""
        if not self.sparse:
            return np.asarray(dense, dtype=np.float64)
        m = dense.shape[0]
        k_num, k_cat = self.first_categorical, len(self.categorical)
        width = k_num + k_cat
        indices = np.empty((m, width), dtype=np.int64)
        values = np.ones((m, width), dtype=np.float64)
        indices[:, :k_num] = np.arange(k_num)
        values[:, :k_num] = dense
        for j, name in enumerate(self.categorical):
            indices[:, k_num + j] = self.column_ids(name, categorical[name])
        # Columns ids within a row are distinct unless two categorical columns hash to the same
        # bucket; the CSR constructor keeps duplicates and every product sums them (a 2 there).
        matrix = sp.csr_matrix((values.ravel(), indices.ravel(), np.arange(0, m * width + 1, width)),
                               shape=(m, self.dim))
        matrix.sum_duplicates()
        return matrix

    # -- model.json
    def spec(self) -> dict:
        out = {"numeric_columns": list(self.numeric), "categorical_columns": list(self.categorical),
               "dim": self.dim}
        if self.hash_buckets is not None:
            out.update(hash=HASH_NAME, hash_buckets=self.hash_buckets, hash_seed=self.hash_seed)
        elif self.vocabulary is not None:
            out.update(vocabulary={c: list(v) for c, v in self.vocabulary},
                       vocabulary_sha256=vocabulary_fingerprint(self.vocabulary))
        if self.missing:
            # (None: a "median"/"mean" fill not released yet; JSON has no NaN)
            out["missing"] = {c: {"policy": p, "fill": None if np.isnan(f) else float(f)}
                              for c, p, f in self.missing}
            out["indicator_columns"] = [f"{c}_missing" for c in self.indicators]
        if self.label_rule is not None:   # (its classes follow from it)
            kind, value = self.label_rule
            out["label_positive"] = {kind: list(value) if kind == "one_of" else value}
        elif self.label_classes is not None:
            out["label_classes"] = list(self.label_classes)
            if self.positive_class is not None:
                out["positive_class"] = self.positive_class
        if self.label_missing != "error":
            out["label_missing"] = self.label_missing
        return out

    @classmethod
    def from_spec(cls, spec: dict) -> "Encoding":
        try:
            declared = dict(
                missing=tuple((c, m["policy"], np.nan if m["fill"] is None else float(m["fill"]))
                              for c, m in spec.get("missing", {}).items()),
                label_classes=(tuple(spec["label_classes"]) if "label_classes" in spec else None),
                positive_class=spec.get("positive_class"),
                label_missing=spec.get("label_missing", "error"))
            if "label_positive" in spec:
                rule = label_rule_of(spec["label_positive"])
                declared.update(label_rule=rule, label_classes=rule_classes(rule),
                                positive_class=rule_classes(rule)[1])
            if "hash_buckets" in spec:
                if spec.get("hash") != HASH_NAME:
                    raise EncodingError(f"the model's hash {spec.get('hash')!r} is not this "
                                        f"version's ({HASH_NAME})")
                encoding = cls(tuple(spec["numeric_columns"]), tuple(spec["categorical_columns"]),
                               hash_buckets=int(spec["hash_buckets"]), hash_seed=int(spec["hash_seed"]),
                               **declared)
            elif "vocabulary" in spec:
                vocabulary = tuple((c, tuple(spec["vocabulary"][c])) for c in spec["categorical_columns"])
                encoding = cls(tuple(spec["numeric_columns"]), tuple(spec["categorical_columns"]),
                               vocabulary=vocabulary, **declared)
                if spec.get("vocabulary_sha256") != vocabulary_fingerprint(vocabulary):
                    raise EncodingError("the model's vocabulary does not match its recorded SHA-256")
            else:
                encoding = cls(tuple(spec["numeric_columns"]), tuple(spec["categorical_columns"]),
                               **declared)
        except (KeyError, TypeError, AttributeError) as e:
            raise EncodingError(f"the model's encoding is incomplete ({type(e).__name__})") from None
        if encoding.dim != spec.get("dim", encoding.dim):
            raise EncodingError("the model's encoding does not give its recorded dimension")
        return encoding


def _value_set(values: tuple) -> pa.Array:
    return pa.array(values, type=pa.large_string())


def vocabulary_fingerprint(vocabulary) -> str:
    canonical = json.dumps([[c, list(v)] for c, v in vocabulary], ensure_ascii=False,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_vocabulary(path, columns: Sequence[str]) -> tuple:
    """A vocabulary file (JSON: column -> list of values), or that object itself (a schema's
    inline ``vocabulary``: a column's few known values, e.g. {"student": ["No", "Yes"]}), for
    exactly ``columns``, as the ``Encoding.vocabulary`` tuple. Errors name the file and columns,
    never a value."""
    if isinstance(path, dict):
        raw, path = path, "the schema's vocabulary"
    else:
        try:
            raw = json.loads(storage.read_text(path))
        except FileNotFoundError:
            raise EncodingError(f"{path}: vocabulary file not found") from None
        except (OSError, ValueError) as e:
            raise EncodingError(f"{path}: cannot read the vocabulary ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise EncodingError(f"{path}: a vocabulary is a JSON object: column -> list of values")
    if set(raw) != set(columns):
        missing, extra = sorted(set(columns) - set(raw)), sorted(set(raw) - set(columns))
        raise EncodingError(f"{path}: the vocabulary's columns do not match the categorical "
                            f"columns (missing: {', '.join(missing) or 'none'}; not categorical: "
                            f"{', '.join(extra) or 'none'})")
    out = []
    for name in columns:
        values = raw[name]
        if not isinstance(values, list) or not all(isinstance(v, (str, int)) and not isinstance(v, bool)
                                                   for v in values):
            raise EncodingError(f"{path}: column '{name}': a list of strings (or integers) is expected")
        values = tuple(str(v) for v in values)
        if len(set(values)) != len(values):
            raise EncodingError(f"{path}: column '{name}' lists a value more than once")
        if not values:   # every value would be "other": a column that says nothing
            raise EncodingError(f"{path}: column '{name}' lists no values")
        out.append((name, values))
    return tuple(out)


def label_rule_of(declared: dict) -> tuple:
    """A schema's ``label_positive`` ({"at_least": t} or {"one_of": [values]}) as a rule."""
    if not isinstance(declared, dict) or len(declared) != 1:
        raise EncodingError('label_positive takes one of {"at_least": number} or {"one_of": '
                            '[values]}')
    (kind, value), = declared.items()
    if kind == "at_least":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise EncodingError("label_positive's at_least must be a finite number")
        return ("at_least", float(value))
    if kind == "one_of":
        if not isinstance(value, (list, tuple)) or not value:
            raise EncodingError("label_positive's one_of must list at least one value")
        values = tuple(str(v) for v in value)
        if len(set(values)) != len(values):
            raise EncodingError("label_positive's one_of lists a value twice")
        return ("one_of", values)
    raise EncodingError(f"label_positive takes at_least or one_of, not {kind!r}")


def rule_classes(rule: tuple) -> tuple:
    """The two classes' names of a derived label (class 0, class 1): what predict outputs."""
    kind, value = rule
    if kind == "at_least":
        return (f"below {value:g}", f"at least {value:g}")
    return ("not listed", "listed")


def _derived_label(rule: tuple, values) -> tuple[np.ndarray, int | None]:
    """``label_ids`` under a rule: 1.0 / 0.0, NaN where missing (null, or a float NaN); a value
    that is not a finite number (at_least: text, or +-inf, 1e400 included) is the first unknown
    row, whatever its side of the threshold."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    kind, value = rule
    if kind == "one_of":
        text = as_text(values)
        hit = np.asarray(pc.is_in(text, value_set=_value_set(value)), dtype=np.float64)
        return np.where(np.asarray(text.is_valid(), dtype=bool), hit, np.nan), None
    if pa.types.is_integer(values.type) or pa.types.is_floating(values.type):
        numbers = np.asarray(values.cast(pa.float64()).to_numpy(zero_copy_only=False), np.float64)
        unknown = np.zeros(len(numbers), dtype=bool)
    else:
        text = as_text(values)
        pattern = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$"
        valid = np.asarray(text.is_valid(), dtype=bool)
        parsed = np.asarray(pc.fill_null(pc.match_substring_regex(text, pattern), False), bool)
        unknown = valid & ~parsed
        numbers = np.full(len(text), np.nan)
        if parsed.any():
            numbers[parsed] = np.asarray(pc.cast(pc.filter(text, pa.array(parsed)),
                                                 pa.float64()), np.float64)
    unknown = unknown | np.isinf(numbers)
    ids = np.where(np.isfinite(numbers), (numbers >= value).astype(np.float64), np.nan)
    found = np.flatnonzero(unknown)
    return ids, (int(found[0]) if found.size else None)


def make_encoding(numeric: Sequence[str], categorical: Sequence[str], hash_buckets: int | None = None,
                  hash_seed: int | None = 0, vocabulary: str | None = None,
                  missing: Mapping[str, str] | None = None, label_classes: Sequence[str] | None = None,
                  positive_class: str | None = None,
                  label_positive: dict | None = None) -> Encoding | None:
    """The encoding a run asked for (None: numeric columns as they are, labels as numbers).
    ``missing``: column -> "constant:V", "indicator" (fill 0), "indicator:V", "drop", "median"
    or "mean" (the last two: a private fill, released by dpgd/dpsgd); the label
    column's own policy ("drop") is under the key ``LABEL_KEY``."""
    repeated = sorted({c for c in categorical if list(categorical).count(c) > 1})
    if repeated:
        raise EncodingError(f"categorical column(s) listed twice: {', '.join(repeated)}")
    missing = dict(missing or {})
    label_missing = missing.pop(LABEL_KEY, "error")
    policies = tuple(parse_policy(c, text) for c, text in missing.items())
    rule = None
    if label_positive is not None:
        if label_classes or positive_class is not None:
            raise EncodingError("label_positive derives a binary label: leave label_classes and "
                                "positive_class out")
        rule = label_rule_of(label_positive)
        label_classes, positive_class = rule_classes(rule), rule_classes(rule)[1]
    if not (categorical or policies or label_classes or label_missing != "error"):
        if hash_buckets is not None or vocabulary is not None:
            raise EncodingError("--hash-buckets and --vocabulary need --categorical-columns")
        if positive_class is not None:
            raise EncodingError("--positive-class needs --label-classes")
        return None
    vocab = read_vocabulary(vocabulary, categorical) if vocabulary is not None else None
    classes = tuple(str(c) for c in label_classes) if label_classes else None
    if classes is not None and len(classes) == 2 and positive_class is None:
        positive_class = classes[1]
    return Encoding(tuple(numeric), tuple(categorical), hash_buckets=hash_buckets,
                    hash_seed=int(hash_seed or 0), vocabulary=vocab, missing=policies,
                    label_classes=classes,
                    positive_class=None if positive_class is None else str(positive_class),
                    label_missing=label_missing, label_rule=rule)


LABEL_KEY = "@label"   # ``make_encoding``'s key for the label column's missing policy


def parse_policy(column: str, text: str) -> tuple:
    """(column, policy, fill) from "constant:V", "indicator", "indicator:V", "drop", "median" or
    "mean" (a median/mean fill is NaN until dpgd/dpsgd release it)."""
    kind, _, value = str(text).partition(":")
    if kind not in MISSING_POLICIES:
        raise EncodingError(f"column '{column}': the missing-value policy must be constant:VALUE, "
                            "indicator, indicator:VALUE, drop, median or mean")
    if kind in ("drop",) + IMPUTED_POLICIES and value:
        raise EncodingError(f"column '{column}': '{kind}' takes no value")
    if kind in IMPUTED_POLICIES:
        return (column, kind, float("nan"))
    if kind == "constant" and not value:
        raise EncodingError(f"column '{column}': 'constant' needs a value (constant:0)")
    try:
        fill = float(value) if value else 0.0
    except ValueError:
        raise EncodingError(f"column '{column}': the fill value must be a number") from None
    if not np.isfinite(fill):
        raise EncodingError(f"column '{column}': the fill value must be a finite number")
    return (column, kind, fill)
