"""What the ledger needs from a database, and the schema both stores share.

A store gives: transactions (a write transaction excludes every other writer of the same
dataset until it commits: SQLite by ``BEGIN IMMEDIATE``, PostgreSQL by a row lock on the
dataset's row), a per-release lock that a dead process gives up by itself, and the schema,
created on first open and versioned in ``meta``. SQL is written once, with ``?`` placeholders
and types both databases read the same way (DOUBLE PRECISION: PostgreSQL's REAL is 4 bytes).
"""
from __future__ import annotations

import hashlib
import re
import time

SCHEMA_VERSION = 1

SCHEMA = (
    # One row per dataset: its default budget (NULL until declared), and the row that write
    # transactions on the dataset lock (PostgreSQL).
    """CREATE TABLE IF NOT EXISTS datasets (
        dataset TEXT PRIMARY KEY,
        epsilon DOUBLE PRECISION,
        delta DOUBLE PRECISION,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL)""",
    # Budgets declared for one partition.
    """CREATE TABLE IF NOT EXISTS budgets (
        dataset TEXT NOT NULL REFERENCES datasets (dataset),
        partition_id TEXT NOT NULL,
        epsilon DOUBLE PRECISION NOT NULL,
        delta DOUBLE PRECISION NOT NULL,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        PRIMARY KEY (dataset, partition_id))""",
    # One row per run, never deleted. partitions: JSON list of names, or null (unpartitioned).
    # event, orders, rdp, orchestrator, output: JSON text (rdp may hold Infinity).
    """CREATE TABLE IF NOT EXISTS charges (
        release_id TEXT PRIMARY KEY,
        dataset TEXT NOT NULL,
        partitions TEXT NOT NULL,
        event TEXT NOT NULL,
        neighbouring TEXT NOT NULL,
        orders TEXT NOT NULL,
        rdp TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('reserved', 'committed', 'void')),
        orchestrator TEXT NOT NULL,
        output TEXT,
        reserved_at TEXT NOT NULL,
        committed_at TEXT,
        voided_at TEXT)""",
    "CREATE INDEX IF NOT EXISTS charges_by_dataset ON charges (dataset)",
    # What happened to each charge, one row per state change, written in the transaction that
    # made it (``Ledger.history``). action: reserved, re-reserved, extended, committed, voided;
    # detail: JSON text of public facts only (partitions, orchestrator ids, who voided). Added
    # without a new schema version: IF NOT EXISTS gives it to older ledgers on their next open.
    """CREATE TABLE IF NOT EXISTS charge_history (
        release_id TEXT NOT NULL,
        at TEXT NOT NULL,
        action TEXT NOT NULL,
        detail TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS charge_history_by_release ON charge_history (release_id, at)",
)


class LedgerError(Exception):
    """Anything the ledger refuses, with a message that says what and why."""


class LedgerUnavailable(LedgerError):
    """The ledger's database cannot be used now (unreachable, locked past the wait, restarted,
    out of space): the same command later may succeed."""


class ReleaseInProgress(LedgerError):
    """Another process holds this release id's lock: the run is already under way."""


class SchemaTooNew(LedgerError):
    """The database was written by a newer beam-dp."""


class Transaction:
    """A cursor in an open transaction; ``?`` placeholders."""

    def __init__(self, cursor, placeholder: str):
        self._cursor = cursor
        self._placeholder = placeholder

    def execute(self, sql: str, params=()) -> list[tuple]:
        if self._placeholder != "?":
            sql = sql.replace("?", self._placeholder)
        self._cursor.execute(sql, tuple(params))
        return self._cursor.fetchall() if self._cursor.description else []

    def one(self, sql: str, params=()):
        rows = self.execute(sql, params)
        return rows[0] if rows else None


class Store:
    """A ledger database. Subclasses: ``SqliteStore``, ``PostgresStore``."""

    placeholder = "?"
    integrity_errors: tuple = ()   # a unique key inserted by another process meanwhile

    def transaction(self, dataset: str | None = None):
        """A context manager giving a ``Transaction``, committed on exit (rolled back on an
        exception). With ``dataset``: a write transaction that no other write transaction on
        that dataset overlaps."""
        raise NotImplementedError

    def lock_dataset(self, tx: Transaction, dataset: str) -> None:
        """Within a write transaction: wait for, then hold, the dataset's lock (again)."""

    def run_lock(self, release_id: str, wait: float):
        """A context manager holding ``release_id``'s lock: ReleaseInProgress if another
        process keeps it beyond ``wait`` seconds; released on exit or when the process dies."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _create_schema(self, tx: Transaction, where: str) -> None:
        tx.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = tx.one("SELECT value FROM meta WHERE key = 'schema_version'")
        if row is not None and int(row[0]) > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"the ledger at {where} has schema version {row[0]}, newer than this beam-dp "
                f"understands ({SCHEMA_VERSION}): upgrade beam-dp to use it (nothing was changed)")
        for statement in SCHEMA:
            tx.execute(statement)
        if row is None:
            tx.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)",
                       (str(SCHEMA_VERSION),))


def lock_key(release_id: str) -> bytes:
    return hashlib.sha256(release_id.encode("utf-8")).digest()


def wait_for(try_acquire, wait: float, release_id: str) -> None:
    """Calls ``try_acquire()`` (True when the lock is taken) until it succeeds or ``wait``
    seconds have passed (then ReleaseInProgress)."""
    deadline = time.monotonic() + max(0.0, wait)
    while not try_acquire():
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReleaseInProgress(
                f"release {release_id!r} is already running in another process (it holds the "
                f"release's lock{f' after waiting {wait:g} s' if wait > 0 else ''}); not starting "
                f"it twice. Let that run finish (or die: its lock is freed with it), then rerun.")
        time.sleep(min(0.05, left))


def redact(url: str) -> str:
    """``url`` without its password, for messages."""
    url = re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)
    return re.sub(r"(password=)[^&]*", r"\1***", url)
