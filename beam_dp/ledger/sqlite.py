"""The embedded store: one SQLite file, shared by the processes of one machine.

Every write transaction starts with ``BEGIN IMMEDIATE``, which takes the database's write lock
before the first read: an admission reads what is spent and writes the charge with no other
writer in between, in any process. Waiting writers retry for ``BUSY_TIMEOUT`` seconds (sqlite's
busy handler). WAL journal: readers (``show``, ``explain``) do not wait for writers. The file
must be on a local disk: SQLite's locks are not reliable on network file systems.

Per-release locks are ``fcntl.flock`` locks on ``<db>.locks/<sha256(release id)>.lock``: the
kernel drops them when the process ends, however it ends. The lock files are kept (removing a
file another process may be locking would let two processes lock two different files).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3

from beam_dp.ledger import store

BUSY_TIMEOUT = 60.0


class SqliteStore(store.Store):
    integrity_errors = (sqlite3.IntegrityError,)

    def __init__(self, path: str):
        if path in ("", ":memory:") or path.startswith("file:"):
            raise store.LedgerError(
                f"a SQLite ledger needs a file path (several processes share it), got {path!r}")
        self.path = os.path.abspath(path)
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            raise store.LedgerError(f"no directory {directory!r} for the ledger {self.path!r}")
        # isolation_level=None: transactions are begun here, explicitly, never by the module.
        self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        with self.transaction(dataset="") as tx:
            self._create_schema(tx, self.path)

    @contextlib.contextmanager
    def transaction(self, dataset: str | None = None):
        # BEGIN IMMEDIATE locks the whole database, which covers "this dataset" (dataset is
        # only a flag here); a plain BEGIN reads one consistent snapshot.
        try:
            self._conn.execute("BEGIN IMMEDIATE" if dataset is not None else "BEGIN")
        except sqlite3.OperationalError as error:   # locked past BUSY_TIMEOUT, ...
            raise store.LedgerUnavailable(f"the ledger {self.path}: {error}") from None
        try:
            yield store.Transaction(self._conn.cursor(), "?")
            self._conn.execute("COMMIT")
        except BaseException as error:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            if isinstance(error, sqlite3.OperationalError):   # read-only, disk full, ...
                raise store.LedgerUnavailable(f"the ledger {self.path}: {error}") from None
            raise

    @contextlib.contextmanager
    def run_lock(self, release_id: str, wait: float):
        directory = self.path + ".locks"
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, store.lock_key(release_id).hex() + ".lock")
        # A new open file description per lock: two runs in one process exclude each other too.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            def try_acquire() -> bool:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    return False

            store.wait_for(try_acquire, wait, release_id)
            yield
        finally:
            os.close(fd)   # releases the lock

    def close(self) -> None:
        self._conn.close()
