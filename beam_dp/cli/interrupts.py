"""Ctrl-C and SIGTERM: a run that is interrupted writes no output.

Beam's runner threads may swallow the KeyboardInterrupt (an "Exception ignored" in a weakref
callback) or wrap it in another error, so a flag, checked before any output is written, is what
decides that an interrupted job writes nothing."""
from __future__ import annotations

import threading

INTERRUPTED = threading.Event()


def on_interrupt(signum, frame):
    INTERRUPTED.set()
    raise KeyboardInterrupt


def stop_if_interrupted() -> None:
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt
