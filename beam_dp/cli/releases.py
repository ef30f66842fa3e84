"""A release that is not a training run (``stats``, ``vocabulary``, ``tune``), charged to the
budget ledger with --ledger as ``train`` is (``beam_dp.ledger.charged_run``): its release id from
its flags and inputs, refused before reading data when the budget cannot hold it, committed
before the first output byte, and a rerun of a committed release writes its stored output again
without reading data or charging."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from beam_dp.cli import train
from beam_dp.cli.exit_codes import EXIT_REFUSED
from beam_dp.cli.interrupts import stop_if_interrupted
from beam_dp.cli.parsing import key_values

# produce(release, gate, before_write) -> exit code: makes the release (``release``: its id, for
# its report), its accounting ledger built with ``gate`` (None without --ledger), and calls
# ``before_write(files)`` (file name -> text) before writing a byte of the output.
Produce = Callable[[str, object, Callable[[dict], None]], int]


def run(args, relation: str, input_files: list[str], produce: Produce,
        validation_files: list[str] = ()) -> int:
    """``produce``'s release, charged to --ledger when it is given (pre-checked against the
    budget with its --epsilon and --delta before any data is read). ``relation``: the
    neighbouring relation the release is accounted under."""
    from beam_dp.ledger import charged_run

    charged_run.check_request(args.ledger, args.dataset_id, args.partition)
    chosen = argparse.Namespace(relation=relation)
    release = train.release_id(args, chosen, input_files, list(validation_files))
    if args.ledger is None:
        return produce(release, None, lambda files: stop_if_interrupted())

    def charged(ledger, gate) -> int:
        def commit_then_write(files: dict) -> None:
            stop_if_interrupted()
            ledger.commit(release, {"files": files})   # a rerun writes these, byte for byte
        return produce(release, gate, commit_then_write)

    def write_released(output) -> int:
        if output is None:
            print(f"beam-dp: release {release} was refused for lack of budget after its first "
                  f"releases (they are charged); nothing to write", file=sys.stderr)
            return EXIT_REFUSED
        train.write_outputs(args, dict(output["files"]))
        print(f"release {release} was already committed: wrote its output to {args.output} "
              f"again; nothing was charged or read")
        return 0

    return train.run_charged(args, chosen, release,
                             key_values("--orchestrator-id", args.orchestrator_id),
                             charged, write_released)
