"""``beam-dp ledger``: budget, show, explain. ``add_parser(subparsers)`` registers the command
on the CLI's sub-parsers; ``run(args)`` runs it and returns the exit code. Plain text, aligned
columns (the ledger holds no data values, only budgets, events and ids)."""
from __future__ import annotations

import math
import sys
import textwrap

from beam_dp.ledger import core, filter as rdp_filter


def add_parser(subparsers) -> None:
    ledger = subparsers.add_parser(
        "ledger", help="the privacy budget across runs: declare budgets, list charges, explain",
        description=textwrap.fill("The privacy-budget ledger shared by every run: per dataset "
                                  "and partition, a lifetime (epsilon, delta) and the runs "
                                  "charged against it.", 78))
    sub = ledger.add_subparsers(dest="ledger_command", required=True)

    def common(parser, dataset_required: bool) -> None:
        parser.add_argument("--ledger", required=True, metavar="URL",
                            help="a SQLite file (a path; or sqlite:///relative, sqlite:////absolute) or postgresql://...")
        parser.add_argument("--dataset-id", required=dataset_required, default=None,
                            metavar="D", help="the dataset's id, as the runs give it")

    budget = sub.add_parser("budget", help="declare a lifetime budget",
                            description=textwrap.fill(
                                "Declare the lifetime (epsilon, delta) of a dataset (the default "
                                "of each of its partitions) or of one partition.", 78))
    common(budget, True)
    budget.add_argument("--partition", default=None, metavar="P",
                        help="one partition (default: the dataset's default budget)")
    budget.add_argument("--epsilon", type=float, required=True, metavar="E",
                        help="the lifetime epsilon")
    budget.add_argument("--delta", type=float, required=True, metavar="D",
                        help="the lifetime delta")
    budget.add_argument("--replace", action="store_true",
                        help="change a budget already declared (never below what is spent)")

    show = sub.add_parser("show", help="every charge, then spent and remaining per partition")
    common(show, False)

    explain = sub.add_parser("explain", help="the Renyi filter's view of a partition")
    common(explain, True)
    explain.add_argument("--partition", default=None, metavar="P",
                         help="one partition (default: every partition of the dataset)")


def run(args) -> int:
    try:
        with core.open_ledger(args.ledger, create=args.ledger_command == "budget") as ledger:
            command = {"budget": _budget, "show": _show, "explain": _explain}
            print(command[args.ledger_command](ledger, args), end="")
        return 0
    except core.LedgerError as error:
        from beam_dp.cli.exit_codes import EXIT_TRANSIENT, EXIT_USAGE
        print(f"beam-dp ledger: error: {error}", file=sys.stderr)
        return EXIT_TRANSIENT if isinstance(error, core.LedgerUnavailable) else EXIT_USAGE


# --------------------------------------------------------------------------------- commands

def _budget(ledger: core.Ledger, args) -> str:
    budget = ledger.set_budget(args.dataset_id, args.epsilon, args.delta,
                               partition=args.partition, replace=args.replace)
    return (f"{_where(budget.dataset, budget.partition, default=True)}: lifetime "
            f"epsilon={budget.epsilon:g}, delta={budget.delta:g}\n")


def _show(ledger: core.Ledger, args) -> str:
    datasets = [args.dataset_id] if args.dataset_id else ledger.datasets()
    lines = [f"ledger {ledger.url}", ""]
    rows = []
    for dataset in datasets:
        for c in ledger.charges(dataset):
            deltas = [b.delta for b in (ledger.budget(dataset, k) for k in c.keys) if b]
            epsilon = (_num(rdp_filter.epsilon(c.rdp_on(rdp_filter.ORDERS), min(deltas))[0])
                       + f" @{min(deltas):g}") if deltas else "-"
            # A run refused after its first releases is committed with no output: charged.
            status = "refused" if c.status == core.COMMITTED and c.output is None else c.status
            rows.append([c.release_id, c.dataset, _partitions(c.partitions), status, epsilon,
                         ", ".join(f"{k}={v}" for k, v in sorted(c.orchestrator.items())) or "-",
                         c.reserved_at, c.committed_at or c.voided_at or "-"])
    lines.append("charges (epsilon: the run alone, filter reading at the smallest budget delta "
                 "of its partitions)")
    lines += _table(["release id", "dataset", "partitions", "status", "epsilon", "orchestrator",
                     "reserved at", "committed/voided at"], rows) if rows else ["  (none)"]
    lines += ["", "partitions (spent: reserved and committed runs)"]
    rows = []
    for dataset in datasets:
        for key in ledger.partitions(dataset) or [None]:
            x = ledger.explain(dataset, key)
            rows.append([dataset, _partition(key), *(_budget_cells(x)),
                         _num(x.spent_epsilon), _num(x.remaining_epsilon), str(x.committed),
                         str(x.reserved)])
    lines += _table(["dataset", "partition", "epsilon", "delta", "budget of", "spent",
                     "remaining", "committed", "reserved"], rows) if rows else ["  (none)"]
    return "\n".join(lines) + "\n"


def _explain(ledger: core.Ledger, args) -> str:
    if args.dataset_id not in ledger.datasets():
        raise core.LedgerError(f"no dataset {args.dataset_id!r} in the ledger {ledger.url}")
    keys = [args.partition] if args.partition else (ledger.partitions(args.dataset_id) or [None])
    blocks = [_explanation(ledger.explain(args.dataset_id, key)) for key in keys]
    paragraph = textwrap.fill("Why this is valid. " + rdp_filter.VALIDITY, width=96)
    return "\n\n".join(blocks + [paragraph]) + "\n"


def _explanation(x: core.Explanation) -> str:
    lines = [_where(x.dataset, x.partition)]
    if x.budget is None:
        lines.append("  no budget declared (nothing can run on it): beam-dp ledger budget ...")
        return "\n".join(lines)
    b = x.budget
    source = "its own" if b.partition is not None else "the dataset's default"
    lines += [
        f"  lifetime budget   epsilon={b.epsilon:g}, delta={b.delta:g} ({source})",
        f"  runs              {x.committed} committed, {x.reserved} reserved"
        + (f", neighbouring relation {x.neighbouring}" if x.neighbouring else ""),
        f"  delta per order   {x.delta_per_order:.3g} (delta / {len(x.orders)} orders: union "
        f"bound over the grid)",
        "",
    ]
    rows = [[("* " if order == x.best_order else "  ") + f"{order:g}", _num(r), _num(e)]
            for order, r, e in zip(x.orders, x.spent_rdp, x.order_epsilons)]
    lines += ["  " + line for line in
              _table(["order", "spent RDP", "epsilon certified by this order"], rows)]
    lines += [
        "",
        f"  best order        {'-' if x.best_order is None else f'{x.best_order:g}'}",
        f"  spent             epsilon={_num(x.spent_epsilon)} at delta={b.delta:g} "
        f"(reserved and committed runs: what admission counts)",
        f"  committed         epsilon={_num(x.committed_epsilon)} at delta={b.delta:g} (the "
        f"filter's reading of what is released so far; with runs chosen adaptively the "
        f"guarantee of everything released is the lifetime budget)",
        f"  remaining         {_num(x.remaining_epsilon)} of epsilon={b.epsilon:g} (lifetime "
        f"minus spent, a reading: a further run is admitted iff, with its RDP added, some order "
        f"still certifies at most {b.epsilon:g})",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- format

def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(v)) for v in column) for column in zip(headers, *rows)]
    return ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip()
            for row in [headers, *rows]]


def _num(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return "inf" if math.isinf(x) else f"{x:.4g}"


def _budget_cells(x: core.Explanation) -> list[str]:
    if x.budget is None:
        return ["-", "-", "none declared"]
    return [f"{x.budget.epsilon:g}", f"{x.budget.delta:g}",
            "partition" if x.budget.partition is not None else "dataset default"]


def _partition(key) -> str:
    return "(whole dataset)" if key is None else key


def _partitions(keys) -> str:
    return "(whole dataset)" if keys is None else ",".join(keys)


def _where(dataset: str, partition, default: bool = False) -> str:
    if partition is not None:
        return f"dataset {dataset!r}, partition {partition!r}"
    return f"dataset {dataset!r}" + (" (default of its partitions)" if default else "")
