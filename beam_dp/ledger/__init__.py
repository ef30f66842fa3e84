"""The privacy budget across runs: a persistent ledger of charges, admitted by a Renyi filter.

Per dataset and data partition, a lifetime budget (epsilon, delta); every run is a charge (its
release id, the partitions it reads, its composed DpEvent and RDP curve, reserved ->
committed, or void). A run is admitted only if every partition it reads stays within its budget
under the Renyi filter (``filter``: the theorem, and why it holds for adaptively chosen runs).
SQLite (a file) or PostgreSQL (a team) hold it; ``open_ledger(url)`` picks one::

    ledger = open_ledger("budget.db")
    ledger.set_budget("clicks", epsilon=8.0, delta=1e-6)          # default of every partition
    with ledger.run(release_id, "clicks", ["2026-11-23"], event) as run:
        if run.status == "committed":
            model = run.output                                    # released before
        else:                                                     # "new" or "resume"
            model = train(...)
            run.commit(model)
"""
from beam_dp.ledger.core import (
    COMMITTED, NEW, RESERVED, RESUME, VOID, Budget, BudgetExceeded, Charge, Explanation, Ledger,
    LedgerError, NoBudget, ReleaseIdCollision, ReleaseInProgress, Reservation, Run, SchemaTooNew,
    open_ledger)
from beam_dp.ledger.events import event_from_json, event_to_json
from beam_dp.ledger.filter import ORDERS

__all__ = [
    "COMMITTED", "NEW", "RESERVED", "RESUME", "VOID", "Budget", "BudgetExceeded", "Charge",
    "Explanation", "Ledger", "LedgerError", "NoBudget", "ORDERS", "ReleaseIdCollision",
    "ReleaseInProgress", "Reservation", "Run", "SchemaTooNew", "event_from_json", "event_to_json",
    "open_ledger",
]
