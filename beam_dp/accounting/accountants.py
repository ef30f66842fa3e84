"""The accountants' front door: ``make_accountant`` (PLD or RDP, by name), ``epsilon_of`` an
event, ``ready_epsilon`` if already known, and ``prefetch_epsilon``, which computes one in a
background thread while the job trains (``settle`` waits for those)."""
from __future__ import annotations

import math
import os
import queue
import threading

import dp_accounting
from dp_accounting import dp_event as events

from beam_dp.accounting.pld_accountant import (_CACHE_LOCK, _EPSILON_CACHE, _IN_FLIGHT,
                                               PLD_FALLBACK_NOTE, _event_key,
                                               _log_space_epsilons, _PLDAccountant)
from beam_dp.accounting.rdp_accountant import RDP_EXCLUDED_ORDERS_NOTE, _quiet_rdp, _RdpAccountant
from beam_dp.accounting.relations import _RELATIONS, ACCOUNTANTS, ADD_REMOVE
from beam_dp.accounting.stopwatch import STOPWATCH


def make_accountant(kind: str = "pld", neighbouring: str = ADD_REMOVE) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant. The PLD one chooses its discretization per composed event and
    memoizes its answers (see ``pld_accountant``'s docstring)."""
    relation = _RELATIONS[neighbouring]
    if kind == "pld":
        return _PLDAccountant(neighboring_relation=relation)
    if kind == "rdp":
        return _RdpAccountant(neighboring_relation=relation)
    raise ValueError(f"unknown accountant {kind!r}; choose one of {', '.join(ACCOUNTANTS)}")


@STOPWATCH
def epsilon_of(event: events.DpEvent, delta: float, accountant: str = "pld",
               neighbouring: str = ADD_REMOVE, notes: list | None = None) -> float:
    """Epsilon of ``event`` at ``delta``. ``notes`` (a list), if given, receives a sentence for
    the report when the value needs one: RDP_EXCLUDED_ORDERS_NOTE (RDP accountant, orders left
    out) or PLD_FALLBACK_NOTE (PLD accountant, RDP's bound used beyond PLD's float range)."""
    acc = make_accountant(accountant, neighbouring)
    with _quiet_rdp() as quiet:
        value = float(acc.compose(event).get_epsilon(delta))
    if notes is not None:
        excluded = quiet.dropped or getattr(acc, "excluded_orders", False)
        if accountant == "rdp" and excluded and RDP_EXCLUDED_ORDERS_NOTE not in notes:
            notes.append(RDP_EXCLUDED_ORDERS_NOTE)
        if getattr(acc, "rdp_fallback", False) and PLD_FALLBACK_NOTE not in notes:
            notes.append(PLD_FALLBACK_NOTE)
    return value


def epsilon_curve(event: events.DpEvent, deltas, accountant: str = "pld",
                  neighbouring: str = ADD_REMOVE) -> list[float]:
    """``epsilon_of(event, delta, ...)`` for each of ``deltas``, from one PLD (the run's own if
    it is still built, ``pld_accountant._BUILT``): each by the log-space form of dp_accounting's
    formula on it (~2 ms, where the library's took ~60 ms), or the memoized answer (the run's
    delta: the reported epsilon to the bit); the accountant's own answer where that form has
    none (beyond ~700, a non-private release)."""
    acc = make_accountant(accountant, neighbouring).compose(event)
    if accountant != "pld":
        with _quiet_rdp():
            return [float(acc.get_epsilon(float(d))) for d in deltas]
    eager = acc._eager()
    deltas = [float(d) for d in deltas]
    quick = (_log_space_epsilons(eager._pld, deltas) if eager is not None
             and not eager._contains_non_dp_event else [math.inf] * len(deltas))
    values = []
    for d, value in zip(deltas, quick):
        ready = ready_epsilon(event, d, accountant, neighbouring)
        values.append(ready if ready is not None else value if not math.isinf(value)
                      else float(acc.get_epsilon(d)))
    return values


def ready_epsilon(event: events.DpEvent, delta: float, accountant: str = "pld",
                  neighbouring: str = ADD_REMOVE) -> float | None:
    """``epsilon_of(event, delta, ...)`` if the PLD accountant already knows it (memoized, e.g.
    by ``prefetch_epsilon``), else None without computing anything."""
    if accountant != "pld":
        return None
    acc = make_accountant(accountant, neighbouring).compose(event)
    key = ("epsilon", _event_key(acc.ledger), acc.neighboring_relation, None, delta)
    with _CACHE_LOCK:
        cached = _EPSILON_CACHE.get(key)
    return None if cached is None else cached[0]


def prefetch_epsilon(event: events.DpEvent, delta: float, accountant: str = "pld",
                     neighbouring: str = ADD_REMOVE) -> None:
    """Starts ``epsilon_of(event, delta, accountant, neighbouring)`` in a background thread: the
    report's PLD (~0.2 s for a DP-SGD run, seconds for some) is computed while the job trains,
    off the driver's critical path (issue 10, item 4), and the driver's later question waits for
    it rather than computing it again (``_PLDAccountant._memo``), in ``_background``'s thread.
    Not counted by STOPWATCH; the driver's wait is."""
    if accountant != "pld":
        return

    def work():
        try:
            epsilon_of(event, delta, accountant, neighbouring)
        except Exception:   # the driver's own call computes it again and raises there
            pass

    done = threading.Event()
    with _CACHE_LOCK:
        _QUEUED.add(done)

    def job():
        try:
            if not _CLOSING.is_set():   # (the process is ending: nobody will ask)
                work()
        finally:
            with _CACHE_LOCK:
                _QUEUED.discard(done)
            done.set()

    _background().put(job)


_QUEUED: set = set()   # prefetches not yet finished (queued or running), for ``settle``
_CLOSING = threading.Event()   # set by ``shutdown``: queued prefetches are skipped
_WORKER: tuple[int, queue.SimpleQueue] | None = None   # (process id, its work queue)
_WORKER_LOCK = threading.Lock()


def _background() -> queue.SimpleQueue:
    """The queue of this process's accounting thread, started on first use while it has no work:
    a thread started with its work holds the GIL for a switch interval (5 ms) before
    ``Thread.start`` returns to the driver, and that was a tenth of a calibration. A daemon
    thread: an interrupted run does not wait for it. A forked child starts its own."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER[0] != os.getpid():
            work_queue: queue.SimpleQueue = queue.SimpleQueue()

            def serve():
                STOPWATCH.exclude_this_thread()
                while True:
                    work_queue.get()()

            threading.Thread(target=serve, name="beam-dp-accounting", daemon=True).start()
            _WORKER = (os.getpid(), work_queue)
        return _WORKER[1]


def shutdown(timeout: float = 60.0) -> bool:
    """Before the process exits: skips the queued prefetches and waits for the running one;
    False if it is still running after ``timeout`` seconds. At exit the interpreter ends daemon
    threads by unwinding them where they wait for the GIL; one inside scipy's FFT (a PLD
    convolution, C++) then aborts the whole process (SIGABRT, exit 134, "terminate called
    without an active exception") instead of exiting with the run's code: 3 of 48 refused runs
    racing for a budget did. ``console_main`` waits here, or ends without that unwinding."""
    _CLOSING.set()
    with _CACHE_LOCK:
        running = list(_QUEUED)
    return all(done.wait(timeout) for done in running)


def settle() -> None:
    """Waits for the computations ``prefetch_epsilon`` started."""
    with _CACHE_LOCK:
        running = list(_IN_FLIGHT.values()) + list(_QUEUED)
    for event in running:
        event.wait()
