"""The README's instructions hold on a fresh clone: its quick start's shell commands (write a CSV
and a schema, train, predict) run with this venv's ``beam-dp`` and write what the text says, its
Python and scikit-learn blocks run on that CSV, its install command names real extras, and its
test commands are the ones ``.ci/run`` runs. Every code block of the README is claimed by a test
here or in tests/test_deploy.py (the cluster block's ``beam-dp train``)."""
from __future__ import annotations

import csv
import inspect
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent     # this venv's bin: its beam-dp and python3


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    text = _readme()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _blocks(section: str, language: str = r"\w*") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


QUICK_START = "Quick start: your own CSV"


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory) -> Path:
    """The quick start's shell blocks, run in order in an empty directory."""
    directory = tmp_path_factory.mktemp("quick-start")
    environment = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for block in _blocks(_section(QUICK_START), "sh"):
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=directory,
                              env=environment, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (block, done.stdout, done.stderr)
    return directory


def test_the_quick_start_is_near_the_top_and_the_readme_short():
    lines = _readme().splitlines()
    assert len(lines) <= 220
    top = "\n".join(lines[:60])
    assert "beam-dp train" in top and "beam-dp predict" in top


@pytest.mark.slow
def test_quick_start_writes_a_model_a_report_and_predictions(quick_start):
    with open(quick_start / "customers.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5000
    assert {r["plan"] for r in rows} == {"basic", "plus", "pro"}
    assert {r["churned"] for r in rows} == {"no", "yes"}
    assert 300 < sum(r["monthly_spend"] == "" for r in rows) < 700     # missing cells

    model = quick_start / "model"
    assert {"model.json", "privacy_report.json", "report.html"} <= {p.name for p in model.iterdir()}
    report = json.loads((model / "privacy_report.json").read_text())
    assert report["epsilon"] <= 1.0
    # What the README says report.html tells: the quality check's verdict on this table.
    assert report["quality_check"]["status"] == "better"
    page = (model / "report.html").read_text()
    assert "Private quality check" in page and "Largest coefficients" in page

    with open(quick_start / "predictions.csv", newline="") as f:
        reader = csv.DictReader(f)
        predictions = list(reader)
    assert reader.fieldnames == ["customer_id", "prediction", "probability"]
    assert [p["customer_id"] for p in predictions] == [r["customer_id"] for r in rows]
    assert {p["prediction"] for p in predictions} <= {"no", "yes"}
    assert all(0.0 <= float(p["probability"]) <= 1.0 for p in predictions)
    right = sum(p["prediction"] == r["churned"] for p, r in zip(predictions, rows))
    assert right / len(rows) > 0.7     # the majority class is about 0.52


def test_the_python_and_scikit_learn_blocks_run(quick_start, monkeypatch):
    monkeypatch.chdir(quick_start)
    (api_block,) = _blocks(_section("From Python"), "python")
    namespace: dict = {}
    exec(compile(api_block, "README: From Python", "exec"), namespace)
    model, customers = namespace["model"], namespace["customers"]
    assert model.privacy_report["epsilon"] <= 1.0
    assert set(model.predict(customers)) <= {"no", "yes"}
    assert model.score(customers, customers["churned"]) > 0.7

    (pipeline_block,) = _blocks(_section("In a scikit-learn Pipeline"), "python")
    namespace = {}
    exec(compile(pipeline_block, "README: scikit-learn", "exec"), namespace)
    classifier, customers = namespace["classifier"], namespace["customers"]
    assert classifier[-1].privacy_report_["epsilon"] <= 1.0
    assert 0.6 < classifier.score(customers, customers["churned"]) <= 1.0


def test_the_install_command_names_this_package_and_its_extras():
    (block,) = _blocks(_section("Install"))
    (name, extra) = re.fullmatch(r"pip install '([\w-]+)\[(\w+)\]'\n", block).groups()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert name == project["name"]
    needs = " ".join(project["optional-dependencies"][extra])
    assert "scikit-learn" in needs and "pandas" in needs


def test_ci_runs_the_readme_test_commands():
    """The development install and the everything-as-CI commands are lines of .ci/run."""
    ci = (ROOT / ".ci" / "run").read_text()
    install, everything = _blocks(_section("Run the tests"))
    for line in (install + everything).splitlines():
        assert line in ci, line
    assert "`.venv/bin/python -m pytest`" in _section("Run the tests")   # the fast default


def test_every_readme_block_is_tested():
    """The blocks the tests above (and tests/test_deploy.py) run, and no others."""
    counts = {title: len(_blocks(_section(title))) for title in (
        "Install", QUICK_START, "From Python", "In a scikit-learn Pipeline",
        "On a cluster and on a schedule", "Run the tests")}
    assert counts == {"Install": 1, QUICK_START: 3, "From Python": 1,
                      "In a scikit-learn Pipeline": 1, "On a cluster and on a schedule": 1,
                      "Run the tests": 2}
    assert len(_blocks(_readme())) == sum(counts.values())


def test_readme_links_point_at_files():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", _readme()):
        assert (ROOT / target).is_file(), target


def test_every_registered_algorithm_is_in_the_docs_tables():
    """The docs' algorithms page names every registered algorithm in both its tables (the guide
    and the details), and nothing that is not registered; the README's short table names the
    default algorithm as the default, and dpsgd, which auto picks for large tables."""
    from beam_dp import api
    from beam_dp.algorithms import registry

    registered = set(registry.algorithms())
    page = (ROOT / "docs" / "guide" / "algorithms.md").read_text()
    details = page[page.index("\n## The algorithms in detail\n"):]
    details = details[:details.find("\n## ", 5)]
    described = set(re.findall(r"^\| `([a-z][\w-]*)` \|", details, flags=re.M))
    assert described == registered, described ^ registered
    guide = page[:page.index("\n## The algorithms in detail\n")]
    for name in registered:
        assert re.search(rf"^\|[^\n]*\| `{re.escape(name)}`", guide, flags=re.M), name

    default = inspect.signature(api.train).parameters["algorithm"].default
    rows = re.findall(r"^\| [^\n]*\| `([a-z][\w-]*)`([^\n]*)\|$", _section("Which algorithm"),
                      flags=re.M)
    assert len(rows) == 3 and {name for name, _ in rows} <= registered
    assert dict(rows)[default].startswith(", the default")
    assert "dpsgd" in dict(rows)
