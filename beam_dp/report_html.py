"""report.html: a training run's report for people, made from the run's JSON files alone.

``build(model, privacy, metrics)`` turns model.json, privacy_report.json and (with
``--validation``) metrics.json into one self-contained HTML page: inline SVG plots
(``beam_dp.svg_charts``), no script and no network fetch, so
it opens the same from a laptop, an archive or an auditor's mail. ``write(directory)`` makes it
again from a training output directory (``beam-dp report OUT``).

It shows only what the JSON files hold, and they hold only released (noised) values and public
settings: nothing here reads the data. The epsilon plots are recomputed with the project's
accountant (``beam_dp.accounting``, dp_accounting underneath) from the run's DpEvents, never by
a formula of our own; error bars come from the noise scales the report records. Hashed
categorical columns are shown as "bucket N" (the model holds no value names for them); a
vocabulary's values are public (the vocabulary is in model.json) and shown as "column=value".
"""
from __future__ import annotations

import html
import json
import math

import numpy as np

from beam_dp import svg_charts

REPORT_HTML = "report.html"
INPUTS = ("model.json", "privacy_report.json")   # metrics.json is optional
TOP_COEFFICIENTS = 20
TOP_STATISTICS = 20
# Epsilon is recomputed at this many points of the run at most: each is a PLD built from
# scratch (~0.1-0.7 s for a Poisson-sampled run), and the curve needs no more to be read.
PROGRESS_POINTS = 8
Z95 = 1.959963984540054   # two-sided 95% normal quantile: error bars of Gaussian noise

_ACCOUNTANTS = {"pld": "PLD (privacy loss distributions), dp_accounting",
                "rdp": "RDP (Renyi differential privacy), dp_accounting"}


# ------------------------------------------------------------------------------------- inputs

def read_inputs(directory: str) -> tuple[dict, dict, dict | None]:
    """(model, privacy report, metrics or None) of a training output directory, all of one
    published version, or a one-line ValueError naming what is missing."""
    from beam_dp import report, storage

    if not report.is_output_directory(directory):
        raise ValueError(f"{directory}: not a directory (give a training output directory)")
    try:
        found = report.read_outputs(directory, INPUTS, optional=["metrics.json"])
    except ValueError as e:
        if "no model.json" in str(e) or "no privacy_report.json" in str(e):
            raise ValueError(f"{e} (report.html is made from a training output's model.json and "
                             "privacy_report.json)") from None
        raise
    model = report.check_model(found["model.json"], storage.join(directory, "model.json"))
    privacy = found["privacy_report.json"]
    lacking = [k for k in ("epsilon", "delta", "accountant", "neighbouring", "dp_event")
               if k not in privacy]
    if lacking:
        raise ValueError(f"{storage.join(directory, 'privacy_report.json')}: not a training "
                         f"run's privacy report (missing {', '.join(lacking)})")
    return model, privacy, found.get("metrics.json")


def write(directory: str) -> str:
    """Makes ``directory``/report.html again from the directory's JSON files and publishes the
    output again with it (``beam_dp.publish``: a reader sees the old version or the new one).
    Returns the path."""
    from beam_dp import publish, storage

    model, privacy, metrics = read_inputs(directory)
    manifest = publish.read_manifest(storage.normalize(directory))
    files = publish.read(directory, [n for n in manifest["files"] if n != REPORT_HTML])
    files[REPORT_HTML] = build(model, privacy, metrics).encode("utf-8")
    publish.publish(directory, files, overwrite=True)
    return storage.join(storage.normalize(directory), REPORT_HTML)


# ------------------------------------------------------------------------------ column names

def coefficient_names(model: dict) -> list[str]:
    """The name of each coefficient's column: the feature column, "bucket N" for hashed
    categorical columns (the bucket is all the model knows: no value is named), "column=value"
    for a vocabulary's columns (the vocabulary is public, in model.json)."""
    encoding = model.get("encoding")
    if not encoding:
        return [str(c) for c in model.get("feature_columns", [])]
    # The missing-value indicators follow the numeric columns (``Encoding.dense_names``).
    names = [str(c) for c in encoding.get("numeric_columns", [])]
    names += [str(c) for c in encoding.get("indicator_columns", [])]
    categorical = [str(c) for c in encoding.get("categorical_columns", [])]
    if "hash_buckets" in encoding:
        shared = ", ".join(categorical)
        names += [f"bucket {b} ({shared})" for b in range(int(encoding["hash_buckets"]))]
    else:
        vocabulary = encoding.get("vocabulary", {})
        for column in categorical:
            names += [f"{column}={v}" for v in vocabulary.get(column, [])]
            names.append(f"{column}=(other)")
    return names


def _coefficients(model: dict) -> list[tuple[str, float]]:
    """(label, coefficient) of every coefficient (softmax: one per class and column)."""
    coef = np.atleast_2d(np.asarray(model.get("coefficients", []), dtype=np.float64))
    names = coefficient_names(model)
    if len(names) != coef.shape[1]:   # an artifact this version does not know: say positions
        names = [f"column {j}" for j in range(coef.shape[1])]
    if coef.shape[0] == 1:
        return list(zip(names, coef[0].tolist()))
    return [(f"{names[j]} (class {k})", float(coef[k, j]))
            for k in range(coef.shape[0]) for j in range(coef.shape[1])]


# --------------------------------------------------------------------------- privacy curves

def _releases(privacy: dict):
    """[(mechanism name, count, composed DpEvent)] in the ledger's order: the report's
    ``mechanisms`` paired with the parts of its composed ``dp_event``."""
    from dp_accounting import dp_event as events

    from beam_dp import accounting

    event = accounting.event_from_json(privacy["dp_event"])
    parts = list(event.events) if isinstance(event, events.ComposedDpEvent) else [event]
    mechanisms = privacy.get("mechanisms") or []
    if len(mechanisms) != len(parts):
        raise ValueError("the report's mechanisms do not match its DpEvent")
    return [(str(m.get("name", "release")), int(m.get("count", 1)), e)
            for m, e in zip(mechanisms, parts)]


def _one_of(event, count: int):
    """One of the ``count`` releases composed in ``event`` (``accounting.self_composed``'s
    inverse), or None when it cannot be split (then only the whole release is plotted)."""
    from dp_accounting import dp_event as events

    if count == 1:
        return event
    if isinstance(event, events.SelfComposedDpEvent) and event.count == count:
        return event.event
    if isinstance(event, events.GaussianDpEvent):   # k Gaussians compose to one, sigma / sqrt(k)
        return events.GaussianDpEvent(event.noise_multiplier * math.sqrt(count))
    return None


def _point_counts(counts: list[int], budget: int) -> list[list[int]]:
    """For each release, the numbers of its repetitions at which epsilon is computed: always
    its last, and points spread evenly over the largest releases while ``budget`` lasts."""
    if len(counts) > budget:   # many kinds of release: the ends of a few of them, and the last
        chosen = set(np.linspace(0, len(counts) - 1, budget).round().astype(int).tolist())
        return [[c] if i in chosen else [] for i, c in enumerate(counts)]
    points = [[c] for c in counts]
    spare = budget - len(counts)
    total = sum(c for c in counts if c > 1)
    for i, c in enumerate(counts):
        if c > 1 and spare > 0 and total:
            k = min(c - 1, max(1, round(spare * c / total)))
            inner = np.unique(np.linspace(0, c, k + 2)[1:-1].round().astype(int))
            points[i] = sorted(set(int(j) for j in inner if 0 < j < c) | {c})
    return points


def epsilon_progress(privacy: dict, points: int = PROGRESS_POINTS) -> list[dict]:
    """Cumulative epsilon (at the run's delta) after the run's releases in order; inside a
    repeated release (the training steps) at a few of its repetitions. [{"release", "name",
    "epsilon"}], the last the whole run: the reported epsilon itself.

    The points before it are the run's accountant over the composition of the releases so far,
    each a valid upper bound: with the PLD accountant on the coarse grid a calibration searches
    on (``calibration._probe_epsilon``: ~0.05 s a point, where the report's grid took ~0.4 s,
    5 s for a report), then capped by the whole run's epsilon (a prefix of the releases never
    costs more than all of them) and made non-decreasing (a larger bound is still a bound)."""
    from dp_accounting import dp_event as events

    from beam_dp import accounting
    from beam_dp.accounting import calibration

    releases = _releases(privacy)
    delta, kind, relation = privacy["delta"], privacy["accountant"], privacy["neighbouring"]
    whole = float(privacy["epsilon"])
    counts = [c if _one_of(e, c) is not None else 1 for _, c, e in releases]
    out, done, position, highest = [], [], 0, 0.0
    for index, ((name, count, event), at) in enumerate(zip(releases, _point_counts(counts, points))):
        single = _one_of(event, count)
        for j in at:
            step = position + (j if single is not None else count)
            if index == len(releases) - 1 and j == counts[index]:
                value = whole
            else:
                part = event if j == counts[index] or single is None else \
                    accounting.self_composed(single, j)
                composed = events.ComposedDpEvent(done + [part])
                value = (calibration._probe_epsilon(composed, delta, relation, whole)[0]
                         if kind == "pld" else accounting.epsilon_of(composed, delta, kind, relation))
            highest = max(highest, min(value, whole))
            out.append({"release": step, "name": name, "epsilon": highest})
        done.append(event)
        position += count
    return out


def privacy_curve(privacy: dict, deltas) -> list[tuple[float, float]]:
    """(delta, epsilon) of the whole run for each delta: one PLD, the run's if still built."""
    from beam_dp import accounting

    event = accounting.event_from_json(privacy["dp_event"])
    values = accounting.epsilon_curve(event, deltas, privacy["accountant"], privacy["neighbouring"])
    return [(float(d), float(e)) for d, e in zip(deltas, values)]


def curve_deltas(delta: float) -> np.ndarray:
    low = math.log10(delta) - 4
    high = min(-1.0, math.log10(delta) + 3)
    return np.logspace(low, high, 12)


# ------------------------------------------------------------------- released statistics

def released_statistics(model: dict, privacy: dict) -> list[dict]:
    """The statistics the run released before training, each as a panel
    {"title", "labels", "values", "errors" (95% half-widths, or None), "note"}; from the
    report's own values and noise scales only."""
    panels = []
    size = privacy.get("dataset_size")
    if isinstance(size, dict) and isinstance(size.get("value"), (int, float)):
        title = "Dataset size (the count the steps are normalized by)"
        if "private" in str(size.get("source", "")):
            error = size.get("error_bound_95")
            panels.append({
                "title": title, "labels": ["rows"], "values": [float(size["value"])],
                "errors": None if error is None else [float(error)],
                "note": f"{size.get('source')}: Laplace scale {size.get('laplace_scale', 'n/a')}, "
                        f"epsilon {size.get('count_epsilon', 'n/a')}; bar: 95% error bound "
                        "(b ln 20)"})
        else:   # public: nothing was released, nothing to draw
            panels.append({"title": title, "table": {"rows": size["value"]},
                           "note": f"{size.get('source', 'public')}: not a release, no noise"})
    pre = privacy.get("preprocessing")
    if not isinstance(pre, dict):
        return panels
    names = coefficient_names(model)
    n = float(size["value"]) if isinstance(size, dict) and isinstance(size.get("value"), (int, float)) else None
    shown = {"scaling"}   # (at the top of the page)
    counts = pre.get("column_counts")
    if isinstance(counts, dict) and "counts" in counts:
        shown.add("column_counts")
        encoding = model.get("encoding") or {}
        per_row = max(1, len(encoding.get("categorical_columns", [])))
        std = float(counts["noise_multiplier"]) * math.sqrt(per_row)
        first = int(counts.get("first", 0))
        values = np.asarray(counts["counts"], dtype=np.float64)
        columns = np.asarray(counts["columns"], dtype=np.int64) + first
        order = np.argsort(-values, kind="stable")[:TOP_STATISTICS]
        panels.append({
            "title": f"Private column counts (the {len(order)} largest of the {len(values)} "
                     "kept)",
            "labels": [names[c] if c < len(names) else f"column {c}" for c in columns[order]],
            "values": values[order].tolist(), "errors": [Z95 * std] * len(order),
            "note": (f"Gaussian noise, std {std:.4g} (noise multiplier "
                     f"{float(counts['noise_multiplier']):.4g} x sqrt({per_row}) categorical "
                     f"columns), epsilon {counts.get('epsilon')}; bars: 95%. Only counts above "
                     "a public threshold (4 noise std) are in the report.")})
    mean = pre.get("mean")
    if isinstance(mean, list) and mean and not isinstance(mean[0], list):
        shown.update({"mean", "mean_noise_multiplier", "mean_epsilon", "mean_delta"})
        values = np.asarray(mean, dtype=np.float64)
        radius = (model.get("feature_transform") or {}).get("normalize_rows")
        sigma = pre.get("mean_noise_multiplier")
        errors, note = None, ("private mean (adaptive: its noise scale is chosen during the "
                              "release, so no error bar is drawn)")
        if sigma is not None and radius is not None and n:
            std = float(sigma) * float(radius) / max(n, 1.0)
            errors = [Z95 * std] * TOP_STATISTICS
            note = (f"Gaussian noise on the sum of rows clipped to norm {radius:g}, divided by "
                    f"the released count: std about {std:.3g} per column (noise multiplier "
                    f"{float(sigma):.4g}); bars: 95%, before the projection onto the ball, "
                    "which can only shrink the error")
        order = np.argsort(-np.abs(values), kind="stable")[:TOP_STATISTICS]
        feature_names = [str(c) for c in model.get("feature_columns", [])]
        labels = [feature_names[j] if j < len(feature_names) else f"column {j}" for j in order]
        panels.append({"title": f"Private feature mean (the {len(order)} largest in magnitude "
                                f"of {len(values)})",
                       "labels": labels, "values": values[order].tolist(),
                       "errors": None if errors is None else errors[:len(order)], "note": note})
    scalars = {k: v for k, v in pre.items() if k not in shown}
    if scalars:
        panels.append({"title": "Other released preprocessing values", "table": scalars,
                       "note": "as privacy_report.json gives them; their mechanisms are in the "
                               "table of releases"})
    return panels


# ------------------------------------------------------------------------------- the plots

def _progress_svg(progress: list[dict], privacy: dict) -> str:
    ends = [p["release"] for p, after in zip(progress, progress[1:] + [None])   # where each
            if after is None or after["name"] != p["name"]]                      # release ends
    requested = privacy.get("requested_epsilon")
    hline = ((requested, f"requested epsilon {requested:g}")
             if isinstance(requested, (int, float)) and not isinstance(requested, bool) else None)
    return svg_charts.line_chart(
        [0] + [p["release"] for p in progress], [0.0] + [p["epsilon"] for p in progress],
        title="Epsilon as training progresses", vlines=ends, hline=hline,
        x_label="releases so far, in the order the run made them",
        y_label=f"epsilon at delta = {privacy['delta']:g}")


def _curve_svg(curve: list[tuple[float, float]], privacy: dict) -> str:
    return svg_charts.line_chart(
        [d for d, _ in curve], [e for _, e in curve], title="Privacy curve", markers=False,
        x_log=True, x_label="delta", y_label="epsilon", legend_corner="upper",
        point=(privacy["delta"], privacy["epsilon"],
               f"this run: epsilon {privacy['epsilon']:.4g} at delta {privacy['delta']:g}"))


def _statistic_svg(panel: dict, index: int) -> str:
    return svg_charts.dot_chart(panel["labels"], panel["values"], panel.get("errors"),
                                title=panel.get("title", f"statistic {index}"))


def _coefficients_svg(top: list[tuple[str, float]]) -> str:
    return svg_charts.bar_chart([name for name, _ in top], [v for _, v in top],
                                title="Largest coefficients",
                                x_label="coefficient (blue: positive, red: negative)")


# -------------------------------------------------------------------------------- the page

_CSS = """
body { font-family: "DejaVu Sans", Arial, sans-serif; margin: 24px auto; max-width: 1040px;
       color: #222; line-height: 1.4; }
h1 { font-size: 26px; margin-bottom: 4px; }
h3 { font-size: 16px; }
h2 { font-size: 19px; margin-top: 30px; border-bottom: 1px solid #ccc; padding-bottom: 3px; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top;
         font-size: 14px; }
th { background: #f3f5f8; }
.headline { font-size: 20px; background: #eef4fb; border-left: 6px solid #1f5fa8;
            padding: 10px 14px; margin: 12px 0; }
.not-covered { border: 3px dashed #c0392b; background: #fdf2f0; padding: 10px 16px;
               margin: 12px 0; }
.not-covered h3 { color: #c0392b; margin: 4px 0 8px 0; }
.warning { border-left: 6px solid #d68910; background: #fef5e7; padding: 8px 12px; margin: 8px 0; }
.note { color: #555; font-size: 13px; }
svg { max-width: 100%; height: auto; }
"""


def _e(value) -> str:
    return html.escape(str(value))


def _number(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _e(value)
    return _e(f"{value:.6g}")


def _table(rows) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _value_cell(value) -> str:
    if isinstance(value, (dict, list)):
        text = json.dumps(value)
        if len(text) > 300:
            text = text[:300] + " ..."
        return f"<code>{_e(text)}</code>"
    return _number(value)


def relation_in_words(relation: str) -> str:
    from beam_dp import report

    protects = report.PROTECTED.get(relation)
    return f"{relation}: protects {protects}" if protects else str(relation)


def build(model: dict, privacy: dict, metrics: dict | None = None) -> str:
    """The report.html text of a run (see the module docstring)."""
    return _build(model, privacy, metrics)


def _build(model: dict, privacy: dict, metrics: dict | None) -> str:
    epsilon, delta = privacy["epsilon"], privacy["delta"]
    relation = privacy["neighbouring"]
    accountant = privacy["accountant"]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>beam-dp training report</title><style>{_CSS}</style></head><body>",
             "<h1>beam-dp training report</h1>",
             f"<p class='note'>Made from this directory's model.json, privacy_report.json"
             f"{' and metrics.json' if metrics is not None else ''} only (regenerate with "
             "<code>beam-dp report OUT</code>). They hold released, noised values and public "
             "settings; no data value appears here.</p>",
             f"<div class='headline'>(epsilon = {_e(f'{epsilon:.4g}')}, delta = "
             f"{_e(f'{delta:g}')})-differential privacy, {_e(relation)} neighbouring</div>"]

    scaling = (privacy.get("preprocessing") or {}).get("scaling")
    if scaling:   # what the model's columns were, before anything else is read into it
        parts.append("<div class='note'><b>Column scaling</b><ul>"
                     + "".join(f"<li>{_e(line)}</li>" for line in scaling) + "</ul></div>")
    summary = [
        ("algorithm", _e(privacy.get("algorithm", model.get("algorithm")))),
    ]
    chose = privacy.get("algorithm_choice")
    if isinstance(chose, dict):   # --algorithm auto: public inputs and the rule's answer
        summary.append(("algorithm choice", f"--algorithm auto chose {_e(chose.get('chosen'))}: "
                                            f"{_e(chose.get('reason'))}"))
    summary += [
        ("model", _e(model.get("model"))),
        ("epsilon", _number(epsilon)),
        ("requested epsilon", _number(privacy.get("requested_epsilon"))),
        ("delta", _number(delta)),
        ("neighbouring relation", _e(relation_in_words(relation))),
        ("accountant", _e(_ACCOUNTANTS.get(accountant, accountant))),
    ]
    cap = (privacy.get("privacy_unit") or {}).get("cap")
    if isinstance(cap, dict):   # user-level: what the cap on rows per user cost (noisy)
        from beam_dp import user_rows
        summary.append(("rows per user", f"{_e(user_rows.line(cap))}<br>{_e(cap.get('note', ''))}"))
    if isinstance(privacy.get("step_sums"), dict):   # Beam, sampled batches: who summed them
        from beam_dp import step_costs
        summary.append(("step sums", _e(step_costs.Choice(**privacy["step_sums"]).line())))
    for key, label in (("steps", "steps"), ("noise_multiplier", "noise multiplier"),
                       ("clip_norm", "clip norm"), ("sampling", "sampling"),
                       ("sampling_probability", "sampling probability"),
                       ("expected_batch_size", "expected batch size (public normalizer)"),
                       ("seed", "seed"), ("release_id", "release id")):
        if privacy.get(key) is not None:
            summary.append((label, _number(privacy[key])))
    hyper = privacy.get("hyperparameters")
    if isinstance(hyper, dict):
        summary.append(("hyperparameters", f"{_e(hyper.get('status', ''))}<br>"
                                           f"{_value_cell(hyper.get('values', {}))}"))
    if privacy.get("algorithm_parameters") is not None:   # public, as the algorithm chose them
        summary.append(("algorithm parameters", _value_cell(privacy["algorithm_parameters"])))
    parts += ["<h2>Summary</h2>", _table(summary)]
    for warning in privacy.get("warnings", []):
        parts.append(f"<div class='warning'>Warning: {_e(warning)}</div>")

    releases = [("release", "count", "parameters")]
    for m in privacy.get("mechanisms", []):
        params = {k: v for k, v in m.items() if k not in ("name", "count")}
        releases.append((m.get("name"), m.get("count"),
                         "; ".join(f"{k}: {v}" for k, v in params.items())))
    parts.append("<h3>Releases, in order (each a DpEvent in the accountant's composition)</h3>")
    parts.append("<table>" + "".join(
        "<tr>" + "".join(f"<{'th' if i == 0 else 'td'}>{_e(c)}</{'th' if i == 0 else 'td'}>"
                         for c in row) + "</tr>" for i, row in enumerate(releases)) + "</table>")

    parts.append("<h2>Epsilon as training progresses</h2>")
    try:
        progress = epsilon_progress(privacy)
        parts.append(_progress_svg(progress, privacy))
        parts.append(f"<p class='note'>The epsilon of the releases made so far, recomputed by "
                     f"the {_e(_ACCOUNTANTS.get(accountant, accountant))} accountant over their "
                     f"composition (before the end on a coarser grid: upper bounds); the last "
                     f"point is the whole run "
                     f"({_e(format(progress[-1]['epsilon'], '.4g'))}).</p>")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        parts.append(f"<p class='warning'>Not recomputed: {_e(type(e).__name__)}: {_e(e)}</p>")

    parts.append("<h2>Privacy curve: epsilon(delta)</h2>")
    try:
        parts.append(_curve_svg(privacy_curve(privacy, curve_deltas(delta)), privacy))
        parts.append("<p class='note'>The same run's guarantee at other deltas: every point is "
                     "a valid (epsilon, delta) pair for it.</p>")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        parts.append(f"<p class='warning'>Not recomputed: {_e(type(e).__name__)}: {_e(e)}</p>")

    parts.append("<h2>Released preprocessing statistics</h2>")
    for i, panel in enumerate(released_statistics(model, privacy)):
        parts.append(f"<h3>{_e(panel['title'])}</h3>")
        if "table" in panel:
            parts.append(_table((k, _value_cell(v)) for k, v in panel["table"].items()))
        else:
            parts.append(_statistic_svg(panel, i))
        parts.append(f"<p class='note'>{_e(panel['note'])}</p>")

    parts.append("<h2>Validation metrics</h2>")
    if metrics is None:
        parts.append("<p>None: the run had no --validation data.</p>")
    else:
        shown = []
        for k, v in metrics.items():
            if k in ("covered_by_privacy_guarantee", "note"):
                continue
            # (one level of nesting: the constant predictor's figures under its own name)
            items = [(f"{k}: {sub}", x) for sub, x in v.items()] if isinstance(v, dict) else [(k, v)]
            shown.extend((name, _number(x)) for name, x in items)
        parts.append("<div class='not-covered'><h3>Not covered by the privacy guarantee</h3>"
                     "<p>These metrics were computed on the validation data without noise: they "
                     "are not differentially private and are not covered by the privacy "
                     "guarantee above.</p>" + _table(shown) +
                     (f"<p class='note'>{_e(metrics['note'])}</p>" if metrics.get("note") else "")
                     + "</div>")

    check = privacy.get("quality_check")
    if isinstance(check, dict):   # DP releases (noisy sums in the ledger), unlike the metrics above
        parts.append("<h2>Private quality check (training data)</h2>")
        rows = [("status", _e(check.get("status", "")))]
        for key in ("summary", "metric", "reason", "rule", "noise"):
            if check.get(key) is not None:
                rows.append((key, _e(check[key])))
        for key in ("model", "constant", "constant_minus_model"):
            figure = check.get(key)
            if isinstance(figure, dict) and figure.get("value") is not None:
                rows.append((f"{key} (noisy)", f"{_number(figure['value'])} &plusmn; "
                                               f"{_number(figure.get('noise_std'))} (noise std)"))
        parts.append(_table(rows))
        if check.get("note"):
            parts.append(f"<p class='note'>{_e(check['note'])}</p>")

    parts.append("<h2>Largest coefficients</h2>")
    coefficients = _coefficients(model)
    top = sorted(coefficients, key=lambda c: -abs(c[1]))[:TOP_COEFFICIENTS]
    if top:
        parts.append(_coefficients_svg(top))
    intercept = model.get("intercept")
    parts.append(f"<p class='note'>The {len(top)} largest in magnitude of {len(coefficients)} "
                 f"coefficients; intercept {_value_cell(intercept)}."
                 + (" Hashed categorical columns are named by bucket: the model does not know "
                    "which values share one." if "hash_buckets" in (model.get("encoding") or {})
                    else "")
                 + (" Coefficients apply to the features after the model's feature transform "
                    f"({_e(json.dumps(model['feature_transform']))})."
                    if model.get("feature_transform") else "") + "</p>")

    parts.append("<h2>What the guarantee covers</h2>")
    if privacy.get("trust_model"):
        parts.append(f"<p>{_e(privacy['trust_model'])}</p>")
    notes = privacy.get("accounting_notes") or []
    if notes:
        parts.append("<details><summary>Accounting notes</summary>"
                     + "".join(f"<p class='note'>{_e(n)}</p>" for n in notes) + "</details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
