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
import importlib

# Where each public name lives, imported on first use (PEP 562): the CLI imports
# ``beam_dp.ledger.store`` for its error types on every command, and the filter's dp_accounting
# (~1.2 s with scipy.signal) is for the commands that charge or read budgets only.
_HOMES = {
    **{name: "core" for name in (
        "COMMITTED", "NEW", "RESERVED", "RESUME", "VOID", "Budget", "BudgetExceeded", "Charge",
        "Explanation", "Ledger", "LedgerError", "NoBudget", "ReleaseIdCollision",
        "ReleaseInProgress", "Reservation", "Run", "SchemaTooNew", "open_ledger")},
    "event_from_json": "events", "event_to_json": "events", "ORDERS": "filter",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
