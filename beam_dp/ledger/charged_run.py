"""A run charged to the budget ledger as one release (``beam-dp train --ledger``, ``audit``).

Under the release's lock: a release already committed is written again from its stored output,
without running or charging; otherwise the run goes on (resuming a reserved charge where its
checkpoint is here), each of its releases charged through a ``runs.RunCharge`` gate, and a run
the budget refuses keeps charged what it released before the refusal."""
from __future__ import annotations

import contextlib
from typing import Callable

from beam_dp.ledger import core, filter as rdp_filter, runs


class RunRefused(Exception):
    """The budget refused the run (its message says why, and what stays charged)."""


def check_request(ledger: str | None, dataset_id: str | None, partitions) -> None:
    """Refuses ledger flags that do not go together, before any work."""
    if (ledger is None) != (dataset_id is None):
        raise ValueError("--ledger and --dataset-id go together: the ledger charges the run to "
                         "the dataset's budget")
    if partitions and ledger is None:
        raise ValueError("--partition needs --ledger (partitions are budgets in the ledger)")


def run_charged(url: str, release: str, dataset_id: str, partitions, relation: str,
                orchestrator: dict, epsilon: float | None,
                run: Callable[[core.Ledger, runs.RunCharge], object],
                write_released: Callable[[dict | None], object], from_checkpoint: bool = False,
                notify: Callable[[str], None] = lambda message: None,
                checkpoint_dir: str | None = None, delta: float | None = None):
    """``run(ledger, gate)``'s result, charged to the ledger at ``url`` as ``release``; or, for a
    release already committed, ``write_released(its stored output)`` (None: it was refused
    after its first releases). Raises RunRefused when the budget refuses the run,
    ``core.ReleaseInProgress`` when the release runs elsewhere. ``notify`` hears of a reserved
    charge taken over from an attempt whose checkpoint is not here."""
    with core.open_ledger(url, create=False) as ledger:
        with ledger.lock(release):
            charge = ledger.charge(release)
            if charge is not None and charge.status == core.COMMITTED:
                return write_released(charge.output)
            earlier = charge if charge is not None and charge.status == core.RESERVED else None
            gate = runs.RunCharge(ledger, release, dataset_id, partitions, relation,
                                  orchestrator, earlier, from_checkpoint=from_checkpoint,
                                  checkpoint_dir=checkpoint_dir)
            if earlier is not None and gate.base is not None:
                notify(f"release {release} has a reserved charge from an attempt whose "
                       f"checkpoint is not here: starting over, and charging this attempt's "
                       f"releases on top of it")
            try:
                with contextlib.ExitStack() as admission:
                    if not gate.reserved:
                        # One new run of these partitions at a time from its pre-check until
                        # its whole plan is charged (the gate lets go then): each is refused
                        # before reading data if the runs admitted before it leave too little.
                        admission.enter_context(ledger.admission(dataset_id, partitions))
                        gate.admission = admission
                        gate.precheck(epsilon, delta)
                    return run(ledger, gate)
            except core.BudgetExceeded as e:
                kept = ""
                if gate.reserved:   # what the run released before the refusal stays charged
                    ledger.commit(release, None)
                    kept = (" (the releases it made before this refusal, its dataset-size "
                            "count, stay charged: the refusal depends on them)")
                raise RunRefused(f"{e}{kept}") from None
            except Exception:
                # A run that failed before any release could be seen (bad data found by a
                # worker, say) gives its reservation back: a fixed input is a new release.
                if gate.reserved and gate.released_nothing():
                    ledger.void(release)
                raise


def charge_summary(ledger: core.Ledger, release: str, dataset_id: str) -> str:
    """What the release was charged and what each partition it read has left (filter
    readings)."""
    charge = ledger.charge(release)
    parts = []
    for key in charge.keys:
        view = ledger.explain(dataset_id, key)
        alone, _ = rdp_filter.epsilon(charge.rdp_on(rdp_filter.ORDERS), view.budget.delta)
        where = "the dataset" if key is None else f"partition {key}"
        parts.append(f"{where}: charged epsilon={alone:.4g}, {max(0.0, view.remaining_epsilon):.4g} "
                     f"of {view.budget.epsilon:g} remaining at delta={view.budget.delta:g}")
    return f"release {release} committed to dataset {dataset_id} (" + "; ".join(parts) + ")"
