"""Privacy accounting with dp_accounting: one ledger of DpEvents per job, calibration, epsilon.

Epsilon always comes from a dp_accounting accountant (PLD by default, RDP as an option) applied to
the composition of everything the ledger holds; nothing here is a hand formula.

One concept per module, from the bottom up (each imports only those above it):

* ``relations``: the neighbouring relations (add/remove, replace-one, user-level);
* ``stopwatch``: ``STOPWATCH``, the driver's time in accounting, for the benchmark;
* ``dp_events``: this library's DpEvents and their algebra and JSON form;
* ``fast_pld``: dp_accounting's PLD constructions, vectorized (the library's result to the bit);
* ``rdp_accountant``: dp_accounting's RDP accountant, extended and memoized;
* ``pld_accountant``: the PLD accountant: discretization per event (bounded memory at any
  epsilon), memoized answers, the log-space fallback beyond epsilon ~700;
* ``accountants``: ``make_accountant``, ``epsilon_of``, and its computation in the background;
* ``calibration``: the noise multiplier that meets a target (epsilon, delta);
* ``job_ledger``: ``Ledger``, every release of a job.

Why a package whose ``__init__`` names the public API: the rest of beam-dp (the algorithms, the
report, the budget ledger, the CLI, the pipelines) reads these names as ``accounting.X``, one
obvious place, whichever module defines them; the submodules are how the code is organized,
not something a caller must know. Private helpers (``_RdpAccountant``, ``_search``, ...) are
imported from their submodule, and tests that monkeypatch a name patch the submodule that looks
it up (e.g. ``calibration._search``).
"""
from beam_dp.accounting.accountants import (epsilon_curve, epsilon_of, make_accountant,
                                            prefetch_epsilon, ready_epsilon, settle)
from beam_dp.accounting.calibration import (CALIBRATION_TOLERANCE, MIN_PARAMETER, PROBE_FACTOR,
                                            calibrate_noise_multiplier, clear_caches,
                                            noise_multiplier_guess)
from beam_dp.accounting.dp_events import (ApproxDpEvent, PureDpEvent, event_from_json,
                                          event_to_json, gaussian_steps_event,
                                          generalized_gaussian_epsilon,
                                          generalized_gaussian_event, laplace_count_event,
                                          merged_gaussians, self_composed)
from beam_dp.accounting.job_ledger import Ledger, Release, after, prior_event
from beam_dp.accounting.pld_accountant import (DEFAULT_DISCRETIZATION, MAX_DISCRETIZATION,
                                               MAX_PURE_PLD_EPSILON, PLD_FALLBACK_NOTE,
                                               PLD_POINTS, pld_discretization_interval)
from beam_dp.accounting.rdp_accountant import RDP_EXCLUDED_ORDERS_NOTE
from beam_dp.accounting.relations import ACCOUNTANTS, ADD_REMOVE, REPLACE_ONE, USER_ADD_REMOVE
from beam_dp.accounting.stopwatch import STOPWATCH

__all__ = [
    "ACCOUNTANTS", "ADD_REMOVE", "REPLACE_ONE", "USER_ADD_REMOVE",
    "STOPWATCH",
    "ApproxDpEvent", "PureDpEvent", "event_from_json", "event_to_json", "gaussian_steps_event",
    "generalized_gaussian_epsilon", "generalized_gaussian_event", "laplace_count_event",
    "merged_gaussians", "self_composed",
    "DEFAULT_DISCRETIZATION", "MAX_DISCRETIZATION", "MAX_PURE_PLD_EPSILON", "PLD_FALLBACK_NOTE",
    "PLD_POINTS", "pld_discretization_interval",
    "RDP_EXCLUDED_ORDERS_NOTE",
    "epsilon_curve", "epsilon_of", "make_accountant", "prefetch_epsilon", "ready_epsilon", "settle",
    "CALIBRATION_TOLERANCE", "MIN_PARAMETER", "PROBE_FACTOR", "calibrate_noise_multiplier",
    "clear_caches", "noise_multiplier_guess",
    "Ledger", "Release", "after", "prior_event",
]
