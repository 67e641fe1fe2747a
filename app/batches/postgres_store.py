"""The batch store several replicas share: one PostgreSQL database holds the files (their
contents as bytea: the replicas share nothing else), the batches with their leases, and every
finished line.

A replica works a batch only while it holds the batch's lease (`hold`: its owner id and an
expiry, on the database's clock, so the replicas' clocks need not agree), renewing it as it
works; a replica that dies stops renewing, and once the lease has expired another replica
claims the batch and goes on with the lines that have no answer. The batch's own writes are
fenced by the lease (`save_batch` with an owner), so a replica that lost a batch cannot
overwrite it.

Every error of psycopg is a `StoreError` naming the database without its password; a broken
connection (the database restarted) is opened again at the next call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import psycopg

from app.batches.store import BatchStore, Connection, Lease, StoreError, T

CONNECT_TIMEOUT_SECONDS = 10
# held while the schema is made, so that replicas starting together do not race to make it
SCHEMA_LOCK = 0x6E6772616D6D7973  # "ngrammys"
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
        id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL,
        bytes BIGINT NOT NULL, created_at BIGINT NOT NULL, lines INTEGER NOT NULL,
        seq BIGSERIAL
    )""",
    """CREATE TABLE IF NOT EXISTS contents (
        file_id TEXT PRIMARY KEY REFERENCES files (id) ON DELETE CASCADE, data BYTEA NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY, seq BIGINT NOT NULL, body TEXT NOT NULL, cancel_asked_at BIGINT,
        lease_owner TEXT, lease_until TIMESTAMPTZ
    )""",
    """CREATE TABLE IF NOT EXISTS results (
        batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok BOOLEAN NOT NULL, record TEXT NOT NULL,
        PRIMARY KEY (batch_id, line)
    )""",
)


def redacted(url: str) -> str:
    """The URL without its password or query (which may carry one): for messages and logs."""
    parts = urlsplit(url)
    user_info, _, hosts = parts.netloc.rpartition("@")
    user = user_info.partition(":")[0]
    return f"{parts.scheme}://{user + '@' if user else ''}{hosts}{parts.path}"


class _Placeholders:
    """A psycopg connection that takes the store's queries: `?` placeholders become `%s`."""

    def __init__(self, db: psycopg.Connection[Any]) -> None:
        self._db = db

    def execute(self, sql: str, args: Any = ()) -> Any:
        return self._db.execute(sql.replace("%", "%%").replace("?", "%s"), args)  # type: ignore[arg-type]


class PostgresBatchStore(BatchStore):
    """Files, batches and finished lines in the PostgreSQL database at `url` (one connection
    behind a lock, in autocommit: a transaction where a change needs one)."""

    errors = (psycopg.Error, OSError)
    status_sql = "(body::json ->> 'status')"
    file_order_sql = "seq"

    def __init__(self, url: str) -> None:
        self.name = f"the batch store {redacted(url)}"
        self._url = url
        self._password = urlsplit(url).password or ""
        self._lock = threading.Lock()
        self._db: psycopg.Connection[Any] | None = None
        with self._failing_as_store_errors("cannot be opened"), self._lock:
            db = self._connection()
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                for statement in _SCHEMA:
                    db.execute(statement)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._db is not None:
            self._db.close()

    def _connection(self) -> psycopg.Connection[Any]:
        """The open connection, or a new one where it broke (the database restarted)."""
        if self._db is None or self._db.closed or self._db.broken:
            if self._db is not None:
                self._db.close()
            self._db = None
            self._db = psycopg.connect(
                self._url,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_SECONDS,
                application_name="ngrammys",
            )
        return self._db

    def _describe(self, error: BaseException) -> str:
        """psycopg's message, on one line, never with the password."""
        diag = getattr(error, "diag", None)
        message = (diag and diag.message_primary) or " ".join(str(error).split())
        return message.replace(self._password, "***") if self._password else message

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        with self._lock, self._failing_as_store_errors():
            db = self._connection()
            with db.transaction():
                yield _Placeholders(db)

    def _read(self, query: Callable[[Connection], T]) -> T:
        with self._lock, self._failing_as_store_errors():
            return query(_Placeholders(self._connection()))

    # --- leases -----------------------------------------------------------------------------

    def hold(
        self, batch_id: str, owner: str, seconds: float, renewing: bool = False
    ) -> Lease | None:
        """Claim the batch (its lease free, expired, or `owner`'s already) for `seconds` from
        now; None while another replica's lease on it runs. Renewing, only while `owner` holds
        it: a lease another replica took, and gave up when it ended the batch, stays lost."""
        held = (
            "lease_owner = ?"
            if renewing
            else "(lease_owner IS NULL OR lease_owner = ? OR lease_until < now())"
        )
        with self._transaction() as db:
            row = db.execute(
                "UPDATE batches SET lease_owner = ?, "
                "lease_until = now() + ? * interval '1 second' "
                f"WHERE id = ? AND {held} RETURNING cancel_asked_at",
                (owner, float(seconds), batch_id, owner),
            ).fetchone()
        return None if row is None else Lease(cancel_asked=row[0] is not None)

    def release(self, batch_id: str, owner: str) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE batches SET lease_owner = NULL, lease_until = NULL "
                "WHERE id = ? AND lease_owner = ?",
                (batch_id, owner),
            )

    def _held_by(self, owner: str) -> tuple[str, tuple[Any, ...]]:
        return " AND lease_owner = ?", (owner,)

    # --- file contents: in the database -----------------------------------------------------

    def _put_content(self, db: Connection, file_id: str, content: bytes) -> None:
        db.execute("INSERT INTO contents (file_id, data) VALUES (?, ?)", (file_id, content))

    def _drop_content(self, file_id: str) -> None:
        """(Its row went with the file's: ON DELETE CASCADE, or the transaction's rollback.)"""

    def read_content(self, file_id: str) -> bytes:
        row = self._read(
            lambda db: db.execute(
                "SELECT data FROM contents WHERE file_id = ?", (file_id,)
            ).fetchone()
        )
        if row is None:
            raise StoreError(f"{self.name} holds no content for the file {file_id}")
        return bytes(row[0])
