"""beam-dp: differentially private training of linear and generalized linear models on Apache Beam.

The command line over the Python API (``beam_dp.train``, ``beam_dp.tune``, ``beam_dp.Model``):
this package parses flags and prints; the work is the library's. One module per group of
subcommands (``train``, ``audit``, ``tune``, ``datasets``: make-data, stats and vocabulary,
``predict``: predict and report, ``listing``: algorithms; the ledger's are
``beam_dp.ledger.commands``). Algorithm flags are generated from the algorithm registry, so
``beam-dp train --algorithm X --help`` lists X's own options with their defaults. Flags this
command does not know are handed to Beam's PipelineOptions unchanged (``--runner DataflowRunner
--project ... --temp_location ...``); ``--runner local`` runs the same kernels in-process without
Beam, and with no ``--runner`` Beam's in-process FnApiRunner is used.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading


class _WithoutApitoolsNotice(logging.Filter):
    """Beam logs "apitools not found, and bigquery client libraries are not available..." on the
    root logger when it imports its BigQuery client without apache-beam[gcp] (every command
    imports Beam's I/O): it concerns BigQuery, which beam-dp does not use, and the user can do
    nothing about it. Exactly that notice is dropped; every other log record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and isinstance(record.msg, str)
                    and record.msg.startswith("apitools not found"))


logging.getLogger().addFilter(_WithoutApitoolsNotice())

from beam_dp import storage  # noqa: E402
from beam_dp.cli import audit, datasets, latest, listing, predict, train, tune  # noqa: E402
from beam_dp.cli.exit_codes import (EXIT_CORRUPT_CHECKPOINT, EXIT_INTERRUPTED,  # noqa: E402
                                    EXIT_QUALITY, EXIT_TRANSIENT, EXIT_USAGE, TRANSIENT_ERRNOS)
from beam_dp.cli.interrupts import INTERRUPTED, on_interrupt  # noqa: E402
from beam_dp.cli.parsing import (Parser, refuse_other_algorithms_flags,  # noqa: E402
                                 refuse_unknown_flags, stray_arguments)

DESCRIPTION = ("Differentially private training of linear and generalized linear models\n"
               "on Apache Beam. `beam-dp COMMAND --help` describes a command's flags.")


def build_parser(argv: list[str] | None = None):
    """The CLI's parser. With ``argv`` naming a command, that command's sub-parser only: the
    others' flags come from the algorithm registry, the quality check and dp_accounting, whose
    imports cost ~2 s that a `beam-dp latest-model` or a `beam-dp ledger show` would pay for
    nothing. Without one (``beam-dp --help``, a mistyped command), every command's."""
    def ledger(sub):
        from beam_dp.ledger import commands
        return commands.add_parser(sub)

    def algorithms():
        from beam_dp.algorithms import registry
        return registry.algorithms()

    adders = {
        "make-data": datasets.add_make_data_parser,
        "train": lambda sub: train.add_parser(sub, argv, algorithms()),
        "audit": lambda sub: audit.add_parser(sub, argv, algorithms()),
        "tune": lambda sub: tune.add_parser(sub, argv),
        "algorithms": listing.add_parser,
        "ledger": ledger,
        "stats": datasets.add_stats_parser,
        "predict": predict.add_predict_parser,
        "vocabulary": datasets.add_vocabulary_parser,
        "report": predict.add_report_parser,
        "latest-model": latest.add_parser,
    }
    chosen = argv[0] if argv and argv[0] in adders else None
    parser = Parser(prog="beam-dp", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, title="commands",
                                metavar="COMMAND")
    parser.command_parsers = {name: add(sub) for name, add in adders.items()
                              if chosen is None or name == chosen}
    return parser


def _parse(top, argv: list[str]):
    args, extra = top.parse_known_args(argv)
    parser = top.command_parsers.get(args.command) or top   # its errors point at its own --help
    # Beam's file-system flags (S3's endpoint, region, keys) are every command's.
    args._file_system_flags, extra = storage.split_file_system_flags(extra)
    if args.command in ("train", "audit"):
        refuse_other_algorithms_flags(parser, args.algorithm, extra)
    if extra and args.command not in ("train", "stats"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    stray = stray_arguments(extra)
    if stray:
        parser.error(f"unexpected argument(s) {' '.join(stray)}: if the shell expanded a glob, "
                     "quote it (--input 'data/train-*.parquet') or list every file after --input")
    refuse_unknown_flags(parser, args.runner if extra else None, extra)
    if args.command in ("train", "audit") and args.epsilon is None and args.noise_multiplier is None:
        parser.error("give --epsilon (the target) or --noise-multiplier")
    if args.command == "tune" and args.epsilon is None:
        parser.error("give --epsilon: the target of the whole tuning, selection included")
    if args.command in ("train", "stats"):   # a job's workers read and write the files too
        extra = args._file_system_flags + extra
    return args, extra


def console_main() -> None:
    """The ``beam-dp`` command. After an interrupt it exits at once: Beam's non-daemon threads
    could otherwise keep the process waiting after the message."""
    code = main()
    # The run is over (its output complete, or none written): a late Ctrl-C while Beam's threads
    # wind down must not turn its exit code into 130.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # The accounting thread must not be inside a C++ computation when the interpreter ends its
    # daemon threads: that aborts the process (``accountants.shutdown``).
    accountants = sys.modules.get("beam_dp.accounting.accountants")
    idle = accountants is None or accountants.shutdown()
    if INTERRUPTED.is_set() or not idle:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    INTERRUPTED.clear()
    in_main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM (what Kubernetes, Airflow and most schedulers send) stops a run as Ctrl-C does, so
    # that it too deletes its mini-batches and leaves no half-written output.
    previous = ({sig: signal.signal(sig, on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
                if in_main_thread else {})
    try:
        return _main(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args, extra: list[str]) -> int:
    def ledger() -> int:
        from beam_dp.ledger import commands
        return commands.run(args)

    command = {
        "make-data": lambda: datasets.make_data(args),
        "train": lambda: train.run(args, extra),
        "tune": lambda: tune.run(args),
        "algorithms": lambda: listing.run(args),
        "audit": lambda: audit.run(args),
        "stats": lambda: datasets.stats(args, extra),
        "ledger": ledger,
        "vocabulary": lambda: datasets.vocabulary(args),
        "report": lambda: predict.report(args),
        "predict": lambda: predict.predict(args),
        "latest-model": lambda: latest.run(args),
    }
    return command[args.command]()


def _main(argv: list[str]) -> int:
    try:   # usage errors (and --help) exit through argparse: return their code instead
        args, extra = _parse(build_parser(argv), argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        storage.configure(args._file_system_flags)
        return _run(args, extra)
    except KeyboardInterrupt:
        return _interrupted(args)
    except Exception as e:  # noqa: BLE001 - each kind its exit code; the rest re-raised
        return _failed(e, args)


def _raised(e: BaseException, module: str, name: str) -> bool:
    """Whether ``e`` is ``module.name``: looked up only if the module was imported (an error of
    its own cannot be raised otherwise), so that a command does not import the quality check's
    or the ledger's dp_accounting just to name their errors."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(e, getattr(loaded, name))


def _failed(e: Exception, args) -> int:
    """The exit code of a command that raised ``e``, its one line printed (or ``e`` re-raised
    when it is none of ours)."""
    if _raised(e, "beam_dp.quality", "ModelQualityError"):
        # (its text: public settings and noisy (DP) figures only)
        print(f"beam-dp: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_QUALITY
    if _raised(e, "beam_dp.algorithms.base", "CorruptCheckpoint"):
        print(f"beam-dp: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_CORRUPT_CHECKPOINT
    if _raised(e, "beam_dp.ledger.store", "LedgerUnavailable"):
        print(f"beam-dp: error: {e} (temporary: run the same command again later)",
              file=sys.stderr)
        return EXIT_TRANSIENT
    if _raised(e, "beam_dp.ledger.store", "LedgerError"):
        print(f"beam-dp: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, OSError):
        print(f"beam-dp: error: {_one_line(e)}", file=sys.stderr)
        if e.errno in TRANSIENT_ERRNOS:   # another attempt may succeed, and resumes
            print("beam-dp: (temporary: run the same command again later)", file=sys.stderr)
            return EXIT_TRANSIENT
        return EXIT_USAGE
    if isinstance(e, (ValueError, TypeError)) or _raised(e, "beam_dp.data", "DataError"):
        print(f"beam-dp: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    # A Beam runner wraps worker errors; show our one line if it is there.
    if INTERRUPTED.is_set():   # Beam wrapped the KeyboardInterrupt
        return _interrupted(args)
    from beam_dp.data import DataError
    text = str(e)
    if DataError.MARKER in text:
        line = text[text.index(DataError.MARKER) + len(DataError.MARKER):].splitlines()[0]
        line = line.split(" [while running")[0]  # Beam appends the step's name
        print(f"beam-dp: error: {line.strip()}", file=sys.stderr)
        return EXIT_USAGE
    raise e


def _interrupted(args) -> int:
    INTERRUPTED.set()
    checkpoint = getattr(args, "checkpoint_dir", None)
    resume = (f"; rerun the same command to resume from {checkpoint}"
              if checkpoint and _checkpoint_exists(checkpoint) else "")
    if resume:
        from beam_dp.beam.aggregator import kept_batch_files
        kept = kept_batch_files(checkpoint)
        if kept:   # raw rows: the user must know they are there if no rerun comes
            resume += (f" (the run's mini-batches stay in {kept} until then; delete that directory "
                       "if you will not resume)")
    print(f"beam-dp: interrupted; no output was written{resume}", file=sys.stderr)
    return EXIT_INTERRUPTED


def _checkpoint_exists(directory: str) -> bool:
    from beam_dp.algorithms.base import checkpoint_exists
    try:
        return checkpoint_exists(directory)
    except Exception:   # an unreachable remote location: no resume is promised
        return False


def _one_line(e: BaseException) -> str:
    from beam_dp.data import DataError

    if isinstance(e, DataError):
        return e.detail.split(" [while running")[0]   # Beam appends the failing step's name
    if isinstance(e, OSError) and e.strerror:
        # The path and the system's reason only (an OSError's text has no data values).
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return " ".join(str(e).split())
