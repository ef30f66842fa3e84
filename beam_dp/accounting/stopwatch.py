"""``STOPWATCH``: the wall time the driver spends in accounting, for the benchmark."""
from __future__ import annotations

import contextlib
import functools
import threading
import time


class _Stopwatch:
    """Cumulative wall seconds spent in this module's accounting: calibrations and epsilon (or
    delta) computations, for the benchmark to print next to a run's wall time. A call made
    inside another timed call (an epsilon inside a calibration) is counted once, with its
    caller; per thread, so concurrent callers each count their own time."""

    def __init__(self):
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()

    def exclude_this_thread(self) -> None:
        """Work in this thread is off the driver's critical path (``prefetch_epsilon``'s
        background thread): not counted. A driver's wait for its result is counted."""
        self._local.depth = 1   # as if inside a timed call that never ends

    def reset(self) -> None:
        with self._lock:
            self.seconds = 0.0

    @contextlib.contextmanager
    def running(self):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                elapsed = time.perf_counter() - start
                with self._lock:
                    self.seconds += elapsed

    def __call__(self, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            with self.running():
                return function(*args, **kwargs)
        return timed


STOPWATCH = _Stopwatch()
