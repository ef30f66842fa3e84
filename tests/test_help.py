"""``--help`` stays short and factual: ``beam-dp train --help`` fits in 150 lines (whatever the
algorithm), no help text quotes a measurement (those belong to the docs), and ``beam-dp --help``
names every command. Everything runs in-process on the parser: nothing is trained."""
from __future__ import annotations

import argparse
import re

import pytest

from beam_dp import cli
from beam_dp.algorithms import registry, spec

ALGORITHMS = list(registry.algorithms())
MAX_TRAIN_HELP_LINES = 150

# A measured figure: a metric with its value, a percentage, a duration, or the word itself.
# Defaults and rules ("default 1.0", "epsilon / 10", "300 up to n = 100,000 rows", "1e-3 delta")
# are not matched.
MEASURED = re.compile(
    r"\b(?:measured|benchmark(?:ed)?|RMSE|MAE|AUC|R\^2)\b"
    r"|\b(?:accuracy|loss|error)\s*(?:of\s*|=\s*|:\s*)?-?\d*\.\d+"
    r"|\d(?:\.\d+)?\s*%"
    r"|\b\d+(?:\.\d+)?\s*(?:ms|s|sec|secs|seconds?|min|minutes?|h|hours?)\b"
    r"|\b\d+(?:\.\d+)?\s*x\s+(?:faster|slower)\b",
    re.IGNORECASE)


def _help(capsys, monkeypatch, *argv) -> str:
    monkeypatch.setenv("COLUMNS", "80")   # a terminal's width; a pipe's default too
    assert cli.main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _texts(parser: argparse.ArgumentParser, where: str):
    """(where, text) of a parser's description, epilog, group descriptions and every help, its
    sub-commands' included."""
    for text in (parser.description, parser.epilog):
        if text:
            yield where, text
    for group in parser._action_groups:
        if group.description:
            yield f"{where} [{group.title}]", group.description
    for action in parser._actions:
        if action.help and action.help != argparse.SUPPRESS:
            yield f"{where} {'/'.join(action.option_strings) or action.dest}", action.help
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.help:
                    yield f"{where} {choice.dest}", choice.help
    for name, sub in _subparsers(parser).items():
        yield from _texts(sub, f"{where} {name}")


@pytest.mark.parametrize("algorithm", [None, *ALGORITHMS, "auto"])
def test_train_help_fits_in_150_lines(capsys, monkeypatch, algorithm):
    argv = ["train"] + (["--algorithm", algorithm] if algorithm else [])
    lines = _help(capsys, monkeypatch, *argv).splitlines()
    assert len(lines) <= MAX_TRAIN_HELP_LINES, f"{' '.join(argv)} --help: {len(lines)} lines"


@pytest.mark.parametrize("command", ["audit", "tune", "stats"])
def test_other_run_commands_help_fits_too(capsys, monkeypatch, command):
    lines = _help(capsys, monkeypatch, command).splitlines()
    assert len(lines) <= MAX_TRAIN_HELP_LINES, f"{command} --help: {len(lines)} lines"


@pytest.mark.parametrize("argv", [[], *(["--algorithm", name] for name in [*ALGORITHMS, "auto"]),
                                  ["tune", "--algorithm", "dpsgd"]])
def test_no_help_text_quotes_a_measurement(argv):
    """Every text of every command's help (the algorithm's options as each --algorithm adds
    them), and every declared option's: no measured figure."""
    parser = cli.build_parser(["train", *argv] if argv[:1] != ["tune"] else argv)
    found = [(where, text) for where, text in _texts(parser, "beam-dp") if MEASURED.search(text)]
    found += [(f"{name} {flag}", text) for name, algorithm in registry.algorithms().items()
              for flag, _, text in spec.describe(algorithm.options) if MEASURED.search(text)]
    assert found == [], "\n".join(f"{where}: {text}" for where, text in found)


def test_the_measurement_pattern_catches_what_the_help_used_to_quote():
    for text in ("measured on MASS Boston, 404 rows, epsilon 1: RMSE 6.2 at 1/4",
                 "on the click-log benchmark it was 1-2 points below",
                 "accuracy 0.729 averaged, 0.743 last", "R^2 0.91 against -0.09 at 2",
                 "about 40% faster", "each pass takes 3.5 s", "2x faster"):
        assert MEASURED.search(text), text
    for text in ("(default: 1.0)", "default epsilon / 10", "1e-3 delta", "(default: 1e-05)",
                 "default 300 up to n = 100,000 rows", "at most 3e7 rows", "default 0.2",
                 "paper 002", "loss (1 - clipped loss / bound) or accuracy", "the 2nd-98th"):
        assert not MEASURED.search(text), text


def test_top_level_help_names_every_command(capsys, monkeypatch):
    text = _help(capsys, monkeypatch)
    commands = _subparsers(cli.build_parser([]))
    assert len(commands) >= 10
    listed = {line.split()[0] for line in text.splitlines() if line.startswith("    ")}
    assert set(commands) <= listed, sorted(set(commands) - listed)
    # Each with its one line of help.
    top = next(a for a in cli.build_parser([])._actions if isinstance(a, argparse._SubParsersAction))
    assert all(choice.help for choice in top._choices_actions)


def test_ledger_help_names_its_commands_and_their_flags(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, "ledger")
    for command in ("budget", "show", "explain"):
        assert re.search(rf"^\s+{command}\s+\S", text, re.MULTILINE), command
    ledger = _subparsers(cli.build_parser([]))["ledger"]
    for name, sub in _subparsers(ledger).items():
        for action in sub._actions:
            assert action.help, f"ledger {name} {action.option_strings} has no help"
