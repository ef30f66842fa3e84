"""The team store: a PostgreSQL database (psycopg 3; ``pip install 'beam-dp[postgres]'``).

Write transactions on a dataset first lock the dataset's row (``SELECT ... FOR UPDATE``): an
admission, a budget change, a commit or a void on one dataset never overlap, while datasets stay
independent. READ COMMITTED isolation: once the lock is held, every later read in the
transaction sees what the previous lock holder committed. Schema creation is serialized by a
transaction-level advisory lock (concurrent ``CREATE TABLE IF NOT EXISTS`` can collide).

Per-release locks are session-level advisory locks (``pg_try_advisory_lock``) on the first 8
bytes of sha256(release id), held on a connection of their own, opened for the run and closed
after it: the server frees the lock when that session ends, including when the process dies.
"""
from __future__ import annotations

import contextlib

from beam_dp.ledger import store

# The advisory lock serializing schema creation: "beam_dp!" as a 64-bit integer.
_SCHEMA_LOCK = int.from_bytes(b"beam_dp!", "big", signed=True)


def _psycopg():
    try:
        import psycopg
    except ImportError:
        raise store.LedgerError(
            "a PostgreSQL ledger needs psycopg 3: pip install 'beam-dp[postgres]'") from None
    return psycopg


class PostgresStore(store.Store):
    placeholder = "%s"

    def __init__(self, url: str):
        psycopg = _psycopg()
        self.url = url
        self.integrity_errors = (psycopg.errors.UniqueViolation,)
        try:
            self._conn = psycopg.connect(url, autocommit=True)
        except psycopg.OperationalError as error:
            raise store.LedgerUnavailable(
                f"cannot connect to the ledger at {store.redact(url)}: {_first_line(error)}"
            ) from None
        with self._conn.transaction():
            cursor = self._conn.cursor()
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            self._create_schema(store.Transaction(cursor, self.placeholder), store.redact(url))

    @contextlib.contextmanager
    def transaction(self, dataset: str | None = None):
        psycopg = _psycopg()
        try:
            with self._conn.transaction():
                tx = store.Transaction(self._conn.cursor(), self.placeholder)
                if dataset is not None:
                    self.lock_dataset(tx, dataset)
                yield tx
        except psycopg.OperationalError as error:   # the server went away, restarted, ...
            raise store.LedgerUnavailable(
                f"the ledger at {store.redact(self.url)}: {_first_line(error)}") from None

    def lock_dataset(self, tx: store.Transaction, dataset: str) -> None:
        # The lock every writer of this dataset takes first. No row yet: nothing to admit
        # against (no budget); set_budget creates the row, then locks it again.
        tx.execute("SELECT 1 FROM datasets WHERE dataset = ? FOR UPDATE", (dataset,))

    @contextlib.contextmanager
    def run_lock(self, release_id: str, wait: float):
        psycopg = _psycopg()
        key = int.from_bytes(store.lock_key(release_id)[:8], "big", signed=True)
        try:
            conn = psycopg.connect(self.url, autocommit=True)
        except psycopg.OperationalError as error:
            raise store.LedgerUnavailable(
                f"cannot connect to the ledger at {store.redact(self.url)}: "
                f"{_first_line(error)}") from None
        try:
            def try_acquire() -> bool:
                return bool(conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0])

            store.wait_for(try_acquire, wait, release_id)
            yield
        finally:
            conn.close()   # ends the session, which releases the lock

    def close(self) -> None:
        self._conn.close()


def _first_line(error: BaseException) -> str:
    """psycopg's message without its hint lines (one line for the user's log)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
