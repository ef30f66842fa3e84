"""report.html: what `beam-dp train` writes beside its JSON files and `beam-dp report OUT` makes
again, checked as a person sees it (headless Chromium: a screenshot and the page's text) and
for what it must never show (a data value)."""
from __future__ import annotations

import html.parser
import json
import math
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from beam_dp import cli, report, report_html
from conftest import read_json

# A categorical value in most training rows, hashed: it must appear nowhere in the report.
PLANTED = "PLANTED-city-Zx81q"
N_TRAIN = 2000


def _write_csv(path, rows) -> None:
    with open(path, "w") as f:
        f.write("x1,x2,city,label\n")
        for r in rows:
            f.write(",".join(str(v) for v in r) + "\n")


def _rows(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2)) * 0.5
    cities = np.where(rng.random(n) < 0.6, PLANTED, np.char.add("c", rng.integers(0, 5, n).astype(str)))
    logits = 2.0 * x[:, 0] - x[:, 1] + np.where(cities == PLANTED, 1.0, -1.0)
    y = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(int)
    return [(f"{a:.4f}", f"{b:.4f}", c, int(t)) for (a, b), c, t in zip(x, cities, y)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A seeded categorical (hashed) run with validation data, on the in-process runner."""
    directory = tmp_path_factory.mktemp("report-run")
    _write_csv(directory / "train.csv", _rows(N_TRAIN, 1))
    _write_csv(directory / "validation.csv", _rows(500, 2))
    out = directory / "out"
    code = cli.main(["train", "--input", str(directory / "train.csv"),
                     "--validation", str(directory / "validation.csv"),
                     "--categorical-columns", "city", "--hash-buckets", "16",
                     "--epsilon", "1", "--delta", "1e-6", "--runner", "local", "--seed", "5",
                     "--output", str(out)])
    assert code == 0
    return out


def test_train_writes_report_html_beside_the_json_files(trained):
    names = set(os.listdir(trained))
    assert {"model.json", "privacy_report.json", "metrics.json", "report.html"} <= names
    marker = read_json(trained / report.MARKER)
    assert marker["files"]["report.html"] == os.path.getsize(trained / "report.html")


def test_report_is_self_contained_and_value_free(trained):
    text = (trained / "report.html").read_text()
    assert text.count("<svg") == 5   # progress, privacy curve, count, column counts, coefficients
    lowered = text.lower()
    for fetch in ("<script", "<link", "<img", " src=", "@import", "url(http", "href=\"http"):
        assert fetch not in lowered, fetch
    assert PLANTED not in text and PLANTED.lower() not in lowered
    assert "bucket " in text and "(city)" in text


def test_epsilon_progress_ends_at_the_reported_epsilon(trained):
    privacy = read_json(trained / "privacy_report.json")
    progress = report_html.epsilon_progress(privacy)
    epsilons = [p["epsilon"] for p in progress]
    assert math.isclose(epsilons[-1], privacy["epsilon"], rel_tol=1e-9)
    # Composition never lowers epsilon (PLD is pessimistic at every point: tiny slack only).
    assert all(b >= a - 1e-9 for a, b in zip(epsilons, epsilons[1:]))
    assert 0 < epsilons[0] < epsilons[-1]
    assert progress[-1]["release"] == sum(m["count"] for m in privacy["mechanisms"])
    assert 3 < len(progress) <= report_html.PROGRESS_POINTS


def test_privacy_curve_falls_with_delta_and_passes_through_the_run(trained):
    privacy = read_json(trained / "privacy_report.json")
    curve = report_html.privacy_curve(privacy, [privacy["delta"] / 100, privacy["delta"],
                                                privacy["delta"] * 100])
    (_, high), (_, here), (_, low) = curve
    assert high > here > low
    assert math.isclose(here, privacy["epsilon"], rel_tol=1e-9)


def test_report_command_makes_the_same_page_again(trained, tmp_path, cli):
    out = tmp_path / "copy"
    shutil.copytree(trained, out)
    written = (out / "report.html").read_text()
    os.remove(out / "report.html")
    result = cli("report", out)
    assert result.code == 0, result.err
    assert (out / "report.html").read_text() == written
    assert not [n for n in os.listdir(out) if n.startswith(".report.html.tmp")]
    # The marker lists the rewritten file: --overwrite still knows the directory as beam-dp's.
    report.check_output_directory(str(out), overwrite=True)


def test_report_command_on_an_output_written_before_report_html(trained, tmp_path, cli):
    """An output directory from before report.html (its marker does not list one): the report
    is added to the marker, so --overwrite still replaces the directory."""
    out = tmp_path / "older"
    shutil.copytree(trained, out)
    os.remove(out / "report.html")
    marker = read_json(out / report.MARKER)
    del marker["files"]["report.html"]
    (out / report.MARKER).write_text(json.dumps(marker))
    assert cli("report", out).code == 0
    assert read_json(out / report.MARKER)["files"]["report.html"] == os.path.getsize(out / "report.html")
    report.check_output_directory(str(out), overwrite=True)


def test_report_command_refuses_a_directory_without_a_run(tmp_path, cli):
    result = cli("report", tmp_path / "missing")
    assert result.code == 2 and "not a directory" in result.err
    (tmp_path / "empty").mkdir()
    result = cli("report", tmp_path / "empty")
    assert result.code == 2
    assert "not a complete beam-dp output directory" in result.err
    assert len(result.err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "empty" / "report.html")


def test_column_names_never_invent_values():
    hashed = {"feature_columns": ["n", "a", "b"], "coefficients": [0.0] * 5,
              "encoding": {"numeric_columns": ["n"], "categorical_columns": ["a", "b"],
                           "hash_buckets": 4, "hash_seed": 0, "dim": 5}}
    assert report_html.coefficient_names(hashed) == ["n"] + [f"bucket {b} (a, b)" for b in range(4)]
    vocabulary = {"feature_columns": ["n", "a"], "coefficients": [0.0] * 4,
                  "encoding": {"numeric_columns": ["n"], "categorical_columns": ["a"],
                               "vocabulary": {"a": ["x", "y"]}, "dim": 4}}
    assert report_html.coefficient_names(vocabulary) == ["n", "a=x", "a=y", "a=(other)"]


def test_released_statistics_error_bars_come_from_the_noise_scales(trained):
    model, privacy = read_json(trained / "model.json"), read_json(trained / "privacy_report.json")
    panels = report_html.released_statistics(model, privacy)
    size, counts = panels[0], panels[1]
    assert size["values"] == [privacy["dataset_size"]["value"]]
    assert size["errors"] == [privacy["dataset_size"]["error_bound_95"]]
    released = privacy["preprocessing"]["column_counts"]
    # one categorical column: l2 sensitivity 1, std = the noise multiplier
    assert counts["errors"][0] == pytest.approx(report_html.Z95 * released["noise_multiplier"])
    assert sorted(counts["values"]) == sorted(released["counts"])[-len(counts["values"]):]


# ------------------------------------------------------------------------ as a person sees it

def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class _Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("style", "script")

    def handle_endtag(self, tag):
        self._skip -= tag in ("style", "script")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


@pytest.fixture
def short_tmp():
    """A directory with a short path for Chromium's profile and TMPDIR: its singleton socket's
    path must fit a Unix socket address (108 bytes), which pytest's tmp_path can exceed."""
    directory = tempfile.mkdtemp(prefix="beam-dp-chromium-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _browser(binary: str, profile: str, *flags) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", f"--user-data-dir={profile}/profile", *flags],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "TMPDIR": profile})


@pytest.mark.slow
def test_report_renders_in_a_browser_as_a_reader_sees_it(trained, tmp_path, short_tmp):
    binary = _chromium()
    if binary is None:
        pytest.skip("no chromium binary on PATH (.ci/run installs Debian's chromium package)")
    from PIL import Image

    url = "file://" + str(trained / "report.html")
    png = tmp_path / "report.png"
    shot = _browser(binary, short_tmp, f"--screenshot={png}",
                    "--window-size=1200,3000", url)
    assert png.exists(), shot.stderr[-2000:]
    image = Image.open(png)
    assert image.format == "PNG" and image.size == (1200, 3000)
    colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colors) > 50   # text, plots and boxes: not a blank or one-colour page
    # The not-covered box's red border is drawn (its colour, #c0392b, in some pixels).
    assert any(c == (0xc0, 0x39, 0x2b) for _, c in colors)

    dom = _browser(binary, short_tmp, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parser = _Text()
    parser.feed(dom.stdout)
    text = " ".join(" ".join(parser.parts).split())
    privacy = read_json(trained / "privacy_report.json")
    assert f"epsilon = {privacy['epsilon']:.4g}" in text
    assert "add/remove: protects the presence or absence of any one example" in text
    assert "Not covered by the privacy guarantee" in text
    metrics = read_json(trained / "metrics.json")
    assert f"{metrics['accuracy']:.6g}" in text
    assert "Largest coefficients" in text and "bucket " in text
    assert PLANTED not in dom.stdout


def test_progress_points_are_bounded_and_end_each_run():
    for counts in ([1, 1, 100], [1, 20], [1] * 40, [5000], [1, 1, 3, 1]):
        points = report_html._point_counts(counts, 12)
        assert sum(len(p) for p in points) <= max(12, len(counts) if len(counts) <= 12 else 12)
        assert points[-1][-1] == counts[-1]                # the whole run is always a point
        assert all(0 < j <= c for p, c in zip(points, counts) for j in p)


def test_column_names_follow_the_encodings_layout_with_missing_indicators():
    """An encoding with a missing-value indicator: one name per coefficient, in the model's
    column order (numeric, indicators, then the vocabulary's columns), so report.html names them
    instead of falling back to positions."""
    from beam_dp.categorical import Encoding

    encoding = Encoding(("age", "spend"), ("plan",), vocabulary=(("plan", ("basic", "pro")),),
                        missing=(("spend", "indicator", 0.0),))
    model = {"coefficients": [0.0] * encoding.dim, "encoding": encoding.spec()}
    names = report_html.coefficient_names(model)
    assert names == ["age", "spend", "spend_missing", "plan=basic", "plan=pro", "plan=(other)"]
    assert len(names) == encoding.dim


def test_charts_are_well_formed_svg_with_their_labels_escaped():
    import xml.etree.ElementTree as ET

    from beam_dp import svg_charts

    charts = [
        svg_charts.line_chart([0, 10, 250], [0.0, 0.2, 0.9], title="t", x_label="x <&>",
                              y_label="y", vlines=[10], hline=(1.0, "requested 1")),
        svg_charts.line_chart([1e-9, 1e-5, 1e-2], [3.0, 1.0, float("inf")], title="c",
                              x_label="delta", y_label="epsilon", x_log=True, markers=False,
                              point=(1e-5, 1.0, "this run"), legend_corner="upper"),
        svg_charts.dot_chart(["a<b", "c&d"], [1.0, -2.5], [0.1, 0.3], title="s"),
        svg_charts.bar_chart(["x=\"1\"", "y"], [0.5, -0.25], title="b", x_label="coefficient"),
    ]
    for svg in charts:
        root = ET.fromstring(svg)   # raises on a stray <, & or quote
        texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
        assert texts
    assert "x <&>" in [t.text for t in ET.fromstring(charts[0]).iter("{http://www.w3.org/2000/svg}text")]
    # Ticks cover the data's range with round steps.
    ticks = svg_charts.nice_ticks(0.0, 0.9989)
    assert ticks[0] <= 0.0 and ticks[-1] >= 0.9989 and 4 <= len(ticks) <= 8
    ticks = svg_charts.nice_ticks(-3.2, 7.7)
    assert ticks[0] <= -3.2 and ticks[-1] >= 7.7 and 0.0 in ticks and len(ticks) <= 8
