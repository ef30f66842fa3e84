"""``beam-dp ledger``: budget, show, explain, history, void. ``add_parser(subparsers)``
registers the command on the CLI's sub-parsers; ``run(args)`` runs it and returns the exit
code. Plain text, aligned columns (the ledger holds no data values, only budgets, events and
ids)."""
from __future__ import annotations

import json
import math
import sys
import textwrap

from beam_dp.ledger import core, filter as rdp_filter


def add_parser(subparsers) -> None:
    ledger = subparsers.add_parser(
        "ledger", help="the privacy budget across runs: declare budgets, list charges, "
                       "explain, history, void",
        description=textwrap.fill("The privacy-budget ledger shared by every run: per dataset "
                                  "and partition, a lifetime (epsilon, delta) and the runs "
                                  "charged against it.", 78))
    sub = ledger.add_subparsers(dest="ledger_command", required=True)

    ledger_help = ("a SQLite file (a path; or sqlite:///relative, sqlite:////absolute) or "
                   "postgresql://...")

    def common(parser, dataset_required: bool) -> None:
        parser.add_argument("--ledger", required=True, metavar="URL", help=ledger_help)
        parser.add_argument("--dataset-id", required=dataset_required, default=None,
                            metavar="D", help="the dataset's id, as the runs give it")
        parser.add_argument("--privacy-unit", default=None, metavar="C",
                            help="the budget of user-level runs over column C (the ledger's "
                                 "dataset D@C); default the row-level one")

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

    history = sub.add_parser("history", help="one charge and what happened to it",
                             description=textwrap.fill(
                                 "One charge (its partitions, status and epsilon) and its "
                                 "history: when it was reserved, extended, committed or voided.",
                                 78))
    history.add_argument("--ledger", required=True, metavar="URL", help=ledger_help)
    history.add_argument("--release-id", required=True, metavar="R",
                         help="the charge's release id (beam-dp ledger show lists them)")

    void = sub.add_parser("void", help="give back the budget of a run that released nothing",
                          description=textwrap.fill(
                              "Give back a reserved charge's budget, only when its run provably "
                              "released nothing: it is reserved, not committed; it recorded a "
                              "checkpoint directory and no checkpoint is there (a run saves its "
                              "plan there before any release that depends on the data); no "
                              "attempt of it started over elsewhere; and no process runs it "
                              "now.", 78))
    void.add_argument("--ledger", required=True, metavar="URL", help=ledger_help)
    void.add_argument("--release-id", required=True, metavar="R",
                      help="the charge's release id (beam-dp ledger show lists them)")


def run(args) -> int:
    if getattr(args, "privacy_unit", None) is not None:
        if args.dataset_id is None:
            print("beam-dp ledger: error: --privacy-unit needs --dataset-id", file=sys.stderr)
            return 2
        args.dataset_id = core.budget_dataset(args.dataset_id, args.privacy_unit)
    try:
        with core.open_ledger(args.ledger, create=args.ledger_command == "budget") as ledger:
            command = {"budget": _budget, "show": _show, "explain": _explain,
                       "history": _history, "void": _void}
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
            rows.append([c.release_id, c.dataset, _partitions(c.partitions), _status(c),
                         _charge_epsilon(ledger, c), _orchestrator(c), c.reserved_at,
                         c.committed_at or c.voided_at or "-"])
    lines.append("charges (epsilon: the run alone, filter reading at the smallest budget delta "
                 "of its partitions)")
    lines += _table(["release id", "dataset", "partitions", "status", "epsilon", "orchestrator",
                     "reserved at", "committed/voided at"], rows) if rows else ["  (none)"]
    lines += ["", "partitions (spent: reserved and committed runs)"]
    lines += _partitions_table(ledger, [(dataset, key) for dataset in datasets
                                        for key in ledger.partitions(dataset) or [None]])
    return "\n".join(lines) + "\n"


def _history(ledger: core.Ledger, args) -> str:
    charge = _existing_charge(ledger, args.release_id)
    lines = [f"ledger {ledger.url}", ""] + _charge_lines(ledger, charge) + ["", "history"]
    rows = [[row["at"], row["action"], _detail(row["detail"])]
            for row in ledger.history(charge.release_id)]
    lines += _table(["at", "action", "detail"], rows)
    return "\n".join(lines) + "\n"


def _void(ledger: core.Ledger, args) -> str:
    """Voids the charge if its run provably released nothing (``_refuse_unless_voidable``),
    under the release's lock so that no run of it can start, save a checkpoint or commit
    meanwhile."""
    charge = _existing_charge(ledger, args.release_id)
    if charge.status == core.VOID:
        return f"release {charge.release_id} is already void (voided at {charge.voided_at})\n"
    _refuse_unless_voidable(ledger, charge)   # before the lock: the reason, not "running"
    try:
        with ledger.lock(charge.release_id):
            # Again, as it is now that no run of it can change it.
            charge = _existing_charge(ledger, args.release_id)
            if charge.status == core.VOID:
                return (f"release {charge.release_id} is already void (voided at "
                        f"{charge.voided_at})\n")
            _refuse_unless_voidable(ledger, charge)
            charge = ledger.void(charge.release_id, by="operator")
    except core.ReleaseInProgress:
        raise core.LedgerError(
            f"refused: release {charge.release_id!r} is running in another process (it holds "
            f"the release's lock), which may be making releases now: let it finish (or die: "
            f"its lock is freed with it), then void it if it is still reserved") from None
    lines = [f"voided release {charge.release_id} (its run released nothing): its budget is "
             f"given back", ""] + _charge_lines(ledger, charge)
    lines += ["", "its partitions now (spent: reserved and committed runs)"]
    lines += _partitions_table(ledger, [(charge.dataset, key) for key in charge.keys])
    return "\n".join(lines) + "\n"


def _refuse_unless_voidable(ledger: core.Ledger, charge: core.Charge) -> None:
    """LedgerError with the reason unless the reserved ``charge`` provably covers no release
    anyone could see. The proof is the run's own rule (``runs.RunCharge``): it saves its plan,
    the first state that depends on the data, in its checkpoint directory before it extends
    the charge with anything that depends on the data, and what it reserved before that is
    public. So no checkpoint there: nothing data-dependent left the run. That holds only if
    every attempt charged here saved its state there: an attempt that started over elsewhere
    (another --checkpoint-dir, or none) was charged on top, its state out of sight."""
    # (imported here: every beam-dp command builds this parser, few void a charge)
    from beam_dp.algorithms.base import checkpoint_exists
    from beam_dp.ledger import runs

    release = charge.release_id
    if charge.status == core.COMMITTED:
        raise core.LedgerError(f"refused: release {release!r} is committed; what was released "
                               f"stays spent")
    directory = charge.orchestrator.get(runs.CHECKPOINT_KEY)
    if not directory:
        raise core.LedgerError(
            f"refused: release {release!r} recorded no checkpoint directory (its run had no "
            f"--checkpoint-dir), so the ledger cannot tell whether it released anything; its "
            f"charge stays")
    history = ledger.history(release)
    reservations = [i for i, row in enumerate(history)
                    if row["action"] in ("reserved", "re-reserved")]
    if not reservations or history[reservations[-1]]["detail"] == core.FROM_TIMESTAMPS:
        raise core.LedgerError(
            f"refused: release {release!r} was reserved before the ledger kept charge "
            f"histories, so it cannot tell whether a later attempt started over with its state "
            f"outside {directory}; its charge stays")
    if any(row["action"] == "extended" and row["detail"].get("starts_over")
           for row in history[reservations[-1]:]):
        raise core.LedgerError(
            f"refused: an attempt of release {release!r} started over without the checkpoint "
            f"in {directory} (another --checkpoint-dir, or none) and was charged on top, so "
            f"its state is not where the ledger can look; its charge stays")
    try:
        saved = checkpoint_exists(directory)
    except Exception as error:   # an object store out of reach, no credentials, ...
        raise core.LedgerError(
            f"refused: cannot tell whether release {release!r} saved a checkpoint in "
            f"{directory} ({type(error).__name__}: {' '.join(str(error).split())}); its charge "
            f"stays") from None
    if saved:
        raise core.LedgerError(
            f"refused: release {release!r} saved a checkpoint in {directory}: its run got as "
            f"far as its plan, which depends on the data, and may have released more; its "
            f"charge stays (the same command resumes it from there)")


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
        f"  delta per order   {x.delta_per_order:.3g} ("
        + (f"delta less {x.approx_delta:.3g} of (epsilon, delta) releases, "
           if x.approx_delta else "delta ")
        + f"/ {len(x.orders)} orders: union bound over the grid)",
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

def _existing_charge(ledger: core.Ledger, release_id: str) -> core.Charge:
    charge = ledger.charge(release_id)
    if charge is None:
        raise core.LedgerError(f"no charge with release id {release_id!r} in the ledger "
                               f"{ledger.url}")
    return charge


def _charge_lines(ledger: core.Ledger, c: core.Charge) -> list[str]:
    return [f"release id     {c.release_id}",
            f"dataset        {c.dataset}",
            f"partitions     {_partitions(c.partitions)}",
            f"status         {_status(c)}",
            f"neighbouring   {c.neighbouring}",
            f"epsilon        {_charge_epsilon(ledger, c)} (the run alone, filter reading at the "
            f"smallest budget delta of its partitions)",
            f"orchestrator   {_orchestrator(c)}"]


def _charge_epsilon(ledger: core.Ledger, c: core.Charge) -> str:
    deltas = [b.delta for b in (ledger.budget(c.dataset, k) for k in c.keys) if b]
    if not deltas:
        return "-"
    return _num(rdp_filter.epsilon(c.rdp_on(rdp_filter.ORDERS), min(deltas))[0]) + \
        f" @{min(deltas):g}"


def _status(c: core.Charge) -> str:
    # A run refused after its first releases is committed with no output: charged.
    return "refused" if c.status == core.COMMITTED and c.output is None else c.status


def _orchestrator(c: core.Charge) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(c.orchestrator.items())) or "-"


def _detail(detail: dict) -> str:
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, sort_keys=True)}"
                     for k, v in sorted(detail.items())) or "-"


def _partitions_table(ledger: core.Ledger, keys: list[tuple]) -> list[str]:
    """Budget, spent and remaining of each (dataset, partition) in ``keys``."""
    rows = []
    for dataset, key in keys:
        x = ledger.explain(dataset, key)
        rows.append([dataset, _partition(key), *(_budget_cells(x)), _num(x.spent_epsilon),
                     _num(x.remaining_epsilon), str(x.committed), str(x.reserved)])
    return _table(["dataset", "partition", "epsilon", "delta", "budget of", "spent",
                   "remaining", "committed", "reserved"], rows) if rows else ["  (none)"]


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
