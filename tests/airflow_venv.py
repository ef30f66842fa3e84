"""The Airflow virtualenv of tests/test_airflow_dag.py: apache-airflow from PyPI in its own
virtualenv (Airflow's dependencies conflict with Beam's, so it cannot share the project's), kept
in .airflow-venv/ (gitignored) and reused while complete.

`.venv/bin/python tests/airflow_venv.py` makes it ahead of the tests: .ci/run does so beside the
project's own install, so that the install is not spent inside the test run. It installs with the
uv beside the running interpreter (the development install's), else with pip.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AIRFLOW = "apache-airflow==3.3.*"
VENV = REPO / ".airflow-venv"


def airflow_python() -> Path:
    """The Airflow virtualenv's Python, made if absent or incomplete (marker written last)."""
    python, marker = VENV / "bin" / "python", VENV / ".complete"
    if marker.exists() and marker.read_text() == AIRFLOW and python.exists():
        return python
    subprocess.run(["rm", "-rf", str(VENV)], check=True)
    # The base interpreter, not a venv's packages: Airflow must not see Beam's.
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    command = ([uv, "pip", "install", "--python", str(python), AIRFLOW]
               if uv else [str(python), "-m", "pip", "install", "--quiet", AIRFLOW])
    install = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if install.returncode != 0:
        raise RuntimeError(install.stdout[-3000:] + install.stderr[-3000:])
    marker.write_text(AIRFLOW)
    return python


if __name__ == "__main__":
    print(airflow_python())
