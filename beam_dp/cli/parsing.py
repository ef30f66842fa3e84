"""The command line's parser classes and flag checks, shared by every subcommand: no abbreviated
flags, single-valued flags given once, one-line usage errors, every default shown, and the
refusal of flags that neither beam-dp nor Beam knows."""
from __future__ import annotations

import argparse
import logging
import textwrap

DEFAULT_ALGORITHM = "dpgd"
RENAMED_FLAGS = {"--steps-per-pipeline": "--steps-per-job"}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:   # (argparse would name this function: "invalid positive_int value")
        raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def rows_per_user(text: str):
    """--max-rows-per-user: a whole number, or auto (chosen from a private histogram)."""
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def columns(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]


class _StoreOnce(argparse.Action):
    """A flag that takes one value and may be given once: argparse would keep the last of
    ``--epsilon 0.5 --epsilon 8`` (or of two --feature-columns) without a word."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_flags", set())
        if self.dest in given:
            parser.error(f"{option_string} given twice")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--steps`` must not silently mean ``--steps-per-job``), a
    single-valued flag given once, and a usage error is one line, like every other error."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message):
        self.exit(2, f"beam-dp: error: {message} (see `{self.prog} --help`)\n")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows every flag's default (a None default is described in the help text itself), the
    help text from column 27, so that ``--feature-columns COLS`` and its text share a line."""

    def __init__(self, prog, indent_increment=2, max_help_position=26, width=None):
        super().__init__(prog, indent_increment, max_help_position, width)

    def _split_lines(self, text, width):
        # Never inside a flag or a hyphenated word ("--adaptive-clip- quantile").
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is not None and action.default is not False \
                and action.default is not argparse.SUPPRESS and "%(default)" not in text \
                and action.option_strings and action.nargs != 0:
            text += " (default: %(default)s)"
        elif isinstance(action, argparse.BooleanOptionalAction) and action.default is not None \
                and action.default is not argparse.SUPPRESS:
            # (a None default depends on other options, as dpgd's --average-iterates: its help
            # says how, and "off" here had contradicted it; SUPPRESS, under --algorithm auto and
            # tune's fixed options, is the chosen algorithm's default, and had shown as "on")
            text += f" (default: {'on' if action.default else 'off'})"
        return text


def requested_algorithm(argv: list[str]) -> str:
    """The --algorithm value, read before the full parse so that its own flags can be added."""
    name = DEFAULT_ALGORITHM
    for i, token in enumerate(argv):   # the last one wins, as in argparse
        if token == "--algorithm" and i + 1 < len(argv):
            name = argv[i + 1]
        elif token.startswith("--algorithm="):
            name = token.split("=", 1)[1]
    return name


def stray_arguments(extra: list[str]) -> list[str]:
    """Arguments left over by the parser that are neither Beam flags nor their values: e.g. the
    2nd..kth file of an unquoted glob that the shell expanded after an option other than --input."""
    stray = []
    for i, token in enumerate(extra):
        if token.startswith("-"):
            continue
        previous = extra[i - 1] if i > 0 else ""
        if not (previous.startswith("--") and "=" not in previous):
            stray.append(token)
    return stray


def refuse_other_algorithms_flags(parser, algorithm: str, extra: list[str]) -> None:
    """A flag of another algorithm would otherwise pass silently to Beam's options."""
    from beam_dp.algorithms import registry, spec

    owners: dict[str, list[str]] = {}
    for other in registry.algorithms().values():
        for flag, _, _ in spec.describe(other.options):
            owners.setdefault(flag, []).append(other.name)
            owners.setdefault("--no-" + flag[2:], []).append(other.name)
    for token in extra:
        flag = token.split("=", 1)[0]
        if flag in owners:
            parser.error(f"{flag} is an option of {', '.join(owners[flag])}, not of {algorithm} "
                         f"(choose the algorithm with --algorithm)")


def refuse_unknown_flags(parser, runner: str | None, extra: list[str]) -> None:
    """Flags beam-dp does not know go to Beam, which would drop a misspelt one (--clip_norm) with
    at most a log line: refuse those neither knows, and any with the local runner (no Beam)."""
    flags = [t.split("=", 1)[0] for t in extra if t.startswith("-")]
    if not flags:
        return
    if runner == "local":
        parser.error(f"unknown flag(s) {', '.join(flags)} (--runner local takes no Beam flags)")
    from apache_beam.options.pipeline_options import PipelineOptions

    import beam_dp.beam.options   # noqa: F401  (beam-dp's own Beam flags, e.g. --step_sums)
    options = PipelineOptions(extra)
    beam_log = logging.getLogger("apache_beam.options.pipeline_options")
    level = beam_log.level
    beam_log.setLevel(logging.ERROR)   # it would log "Discarding unparseable args": we say it once
    try:
        unknown = (set(options.get_all_options(retain_unknown_options=True))
                   - set(options.get_all_options()))
    finally:
        beam_log.setLevel(level)
    named = [f for f in flags if f.lstrip("-").replace("-", "_") in unknown]
    if named:
        renamed = [f"{f} is now {RENAMED_FLAGS[f]}" for f in named if f in RENAMED_FLAGS]
        parser.error(f"unknown flag(s) {', '.join(named)}: neither beam-dp nor Beam knows them"
                     + (f" ({'; '.join(renamed)})" if renamed else ""))


def key_values(flag: str, values) -> dict:
    """Repeated KEY=VALUE flags (--orchestrator-id) as a dict."""
    ids = {}
    for value in values or []:
        key, sep, text = value.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE, got {value!r}")
        ids[key] = text
    return ids


def missing_policies(given: list[str] | None) -> dict | None:
    """--missing COLUMN=POLICY flags as a dict (a column given twice is an error)."""
    if not given:
        return None
    out = {}
    for item in given:
        column, sep, policy = item.partition("=")
        if not sep or not column.strip():
            raise ValueError("--missing takes COLUMN=POLICY (e.g. income=indicator)")
        if column.strip() in out:
            raise ValueError(f"--missing gives column '{column.strip()}' twice")
        out[column.strip()] = policy.strip()
    return out
