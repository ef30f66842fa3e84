"""dp_accounting's own epsilons, the reference values of the accounting tests, cached on disk.

dp_accounting's PLD accountant on a fine grid is most of the time tests/test_accounting.py and
tests/test_accountant_limits.py spend, and its values are a pure function of dp_accounting's
version, the neighbouring relation, the grid, the event and delta: the same on every run. So they
are kept in ``tests/data/dp_accounting_reference.json``, keyed by exactly those (the event by its
``repr``, which spells every parameter's float in full). A key the file lacks is computed live,
by dp_accounting as before: a test whose event changes (say a calibration that now returns
another noise multiplier) is still checked, only slower. The file is written by

    .venv/bin/python -m pytest --regenerate-reference tests/test_accounting.py tests/test_accountant_limits.py

which computes every value it uses live and stores them (the values, not a verdict: nothing of
this project's code goes into them).
"""
from __future__ import annotations

import fcntl
import json
import os
from importlib import metadata

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                    "dp_accounting_reference.json")
VERSION = metadata.version("dp-accounting")

# Set by conftest for --regenerate-reference: compute every value live and record it.
regenerate = False
_computed: dict[str, float] = {}


def _stored() -> dict[str, float]:
    if not hasattr(_stored, "values"):
        try:
            with open(PATH) as f:
                _stored.values = json.load(f)
        except FileNotFoundError:
            _stored.values = {}
    return _stored.values


def pld_epsilon(event, delta: float, interval: float = 1e-4, relation=ADD_REMOVE) -> float:
    """dp_accounting's ``PLDAccountant(relation, interval).compose(event).get_epsilon(delta)``."""
    key = f"pld|{VERSION}|{relation.name}|{interval!r}|{delta!r}|{event!r}"
    if not regenerate and key in _stored():
        return _stored()[key]
    value = pld_privacy_accountant.PLDAccountant(relation, interval).compose(event).get_epsilon(
        delta)
    _computed[key] = value
    return value


def write_computed() -> int:
    """Merges the values this process computed into the file (under a lock: pytest-xdist's
    workers may write at once); returns how many."""
    if not _computed:
        return 0
    os.makedirs(os.path.dirname(PATH), exist_ok=True)
    with open(PATH + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(PATH) as f:
                values = json.load(f)
        except FileNotFoundError:
            values = {}
        values.update(_computed)
        with open(PATH + ".tmp", "w") as f:
            json.dump(dict(sorted(values.items())), f, indent=0)
            f.write("\n")
        os.replace(PATH + ".tmp", PATH)
    return len(_computed)
