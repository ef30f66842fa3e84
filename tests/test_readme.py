"""The README's instructions hold: its Python examples run, and its test command is CI's."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _section(title: str) -> str:
    text = _readme()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _python_blocks(section: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.slow
def test_python_api_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks(_section("Python API"))
    assert len(blocks) == 3
    namespace: dict = {}
    exec(compile(blocks[0], "README: Python API", "exec"), namespace)
    assert namespace["model"].privacy_report["epsilon"] <= 1.0
    # The first model (dpgd) on held-out rows of the same distribution, as the comment says.
    model = namespace["beam_dp"].Model.load(str(tmp_path / "out" / "notebook-model"))
    assert 0.78 < model.score(namespace["X_test"], namespace["y_test"]) < 0.88
    assert os.path.exists(tmp_path / "out" / "notebook-model" / "model.json")
    # blocks[1] needs files that the example job writes; it is the API over files, tested in
    # tests/test_api.py. blocks[2]: the estimator in an sklearn Pipeline.
    exec(compile(blocks[2], "README: estimators", "exec"), namespace)
    assert 0.5 < namespace["classifier"].score(namespace["frame"], namespace["label"]) <= 1.0


def test_ci_runs_the_readme_test_command():
    section = _section("Run the tests")
    (command,) = re.findall(r"```\n(.*?)\n```", section, flags=re.S)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert command in f.read()


def test_every_registered_algorithm_is_in_the_readme_tables():
    """The guide ("which algorithm") and the "Algorithms" table name every registered algorithm,
    and nothing that is not registered."""
    from beam_dp.algorithms import registry

    registered = set(registry.algorithms())
    table = _section("Algorithms")
    described = set(re.findall(r"^\| `([a-z][\w-]*)` \|", table, flags=re.M))
    assert described == registered, (described ^ registered)
    guide = _readme()
    for name in registered:
        assert re.search(rf"^\|[^\n]*\| `{re.escape(name)}`", guide, flags=re.M), name
