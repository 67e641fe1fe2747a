"""The batch store: files, batches and every finished line, kept so that a server killed at any
point and started again on the same store goes on where it stopped.

`BatchStore` holds what both backends share: the records, and every query (written once, in
the SQL both SQLite and PostgreSQL speak). A backend (`sqlite_store`: one server, a directory;
`postgres_store`: several replicas, one database) supplies the connection, its transactions,
where file contents live, and the leases by which a replica claims a batch.

A finished line is one row keyed by (batch, line number), inserted with `ON CONFLICT DO
NOTHING`: it is answered once, however often a server restarts or two replicas race for it.

Every failure of the disk or the database (a full disk, a corrupt file, a database gone) is a
`StoreError` with what failed and where, for the API to answer and the runner to fail the batch
with; never an exception that ends the server.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, get_args

T = TypeVar("T")
BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
STATUSES: tuple[BatchStatus, ...] = get_args(BatchStatus)
# the statuses a batch still has work in (the runner picks these up, also after a restart)
UNFINISHED: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing")
# the statuses that end a batch, each with its timestamp field
ENDED: tuple[BatchStatus, ...] = ("failed", "completed", "expired", "cancelled")


class StoreError(Exception):
    """The store could not be read or written: what failed, and which store (a directory, or a
    database named without its password)."""


class LeaseLost(Exception):
    """This server no longer holds the batch's lease: another replica took it over (this one
    was too slow to renew it), so this one stops working the batch and writes nothing of it."""


@dataclass
class Lease:
    """A batch held by this server until the lease expires, unless renewed; `cancel_asked`:
    a cancel was asked for, through any replica."""

    cancel_asked: bool


# a file's row as FileRecord has it
FILE_COLUMNS = "id, filename, purpose, bytes, created_at, lines"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


@dataclass
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    lines: int  # JSONL lines (requests of an input file; answered lines of an output file)

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


@dataclass
class BatchRecord:
    """A batch as OpenAI's batch object has it (`as_dict`), with the counts of its lines.

    `status` is the runner's; a cancel is asked for apart (`cancel_asked_at`, written by the
    API while the runner may be writing the rest), and shows as `cancelling` until the runner
    has ended the batch."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    total: int
    status: BatchStatus = "validating"
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # why validation failed, a line each
    times: dict[str, int] = field(default_factory=dict)  # `in_progress_at`, ... by status
    completed: int = 0
    failed: int = 0
    # what speculation did over the lines answered: summed over their stats
    speculation: dict[str, Any] = field(default_factory=dict)
    cancel_asked_at: int | None = None

    @property
    def shown_status(self) -> BatchStatus:
        if self.cancel_asked_at is not None and self.status in UNFINISHED:
            return "cancelling"
        return self.status

    def as_dict(self) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": None if self.errors is None else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.shown_status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            **{
                f"{status}_at": self.times.get(f"{status}_at")
                for status in ("in_progress", "finalizing", "completed", "failed", "expired")
            },
            "cancelling_at": self.cancel_asked_at,
            "cancelled_at": self.times.get("cancelled_at"),
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }
        if self.speculation:
            body["speculative_decoding_stats"] = self.speculation
        return body

    def _stored(self) -> str:
        apart = ("completed", "failed", "cancel_asked_at")
        fields = {k: v for k, v in self.__dict__.items() if k not in apart}
        return json.dumps(fields)


class Connection(Protocol):
    """What the queries need of a database connection: `execute` with `?` placeholders,
    returning a cursor (`fetchone`, `fetchall`, `rowcount`)."""

    def execute(self, sql: str, args: Any = ()) -> Any: ...


class BatchStore(ABC):
    """Files, batches and finished lines, whichever the backend (thread-safe; callers on the
    event loop call in a thread)."""

    name: str  # the store as messages name it: "the batch store <where>"
    # the errors of the backend's database and disk, each raised as a StoreError
    errors: tuple[type[BaseException], ...]
    # the SQL the backends differ in: a batch's status, read from its JSON body; the order
    # files were added in
    status_sql: str
    file_order_sql: str

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def _transaction(self) -> AbstractContextManager[Connection]:
        """A connection in a transaction: committed when the block ends, rolled back if it
        raises; a failure of the database a StoreError."""

    @abstractmethod
    def _read(self, query: Callable[[Connection], T]) -> T:
        """`query`'s result, read on the connection; a failure a StoreError."""

    @abstractmethod
    def _put_content(self, db: Connection, file_id: str, content: bytes) -> None:
        """Keep a file's content, in the transaction that adds its row."""

    @abstractmethod
    def _drop_content(self, file_id: str) -> None:
        """Forget a file's content, once its row is gone (or was never committed)."""

    @abstractmethod
    def read_content(self, file_id: str) -> bytes: ...

    def _describe(self, error: BaseException) -> str:
        return str(error)

    @contextmanager
    def _failing_as_store_errors(self, what: str = "failed") -> Iterator[None]:
        try:
            yield
        except self.errors as error:
            raise StoreError(f"{self.name} {what}: {self._describe(error)}") from error

    # --- leases: what a store one server owns has (a backend that several replicas share
    # overrides them) ------------------------------------------------------------------------

    def hold(
        self, batch_id: str, owner: str, seconds: float, renewing: bool = False
    ) -> Lease | None:
        """Claim the batch's lease for `owner` (`renewing`: renew the one it holds), for
        `seconds` from now: None if another owner holds it (renewing: if `owner` does not hold
        it any more), or there is no such batch. One server a store: always its own."""
        row = self._read(
            lambda db: db.execute(
                "SELECT cancel_asked_at FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
        )
        return None if row is None else Lease(cancel_asked=row[0] is not None)

    def release(self, batch_id: str, owner: str) -> None:
        """Give the batch's lease up (another replica may take the batch at once)."""

    def _held_by(self, owner: str) -> tuple[str, tuple[Any, ...]]:
        """The condition (SQL and arguments) that `owner` holds a batch's lease."""
        return "", ()

    # --- files ----------------------------------------------------------------------------

    def add_file(self, filename: str, purpose: str, content: bytes, lines: int) -> FileRecord:
        """Keep `content` as a new file: its content durable when its row is committed."""
        record = FileRecord(
            new_id("file-"), filename, purpose, len(content), int(time.time()), lines
        )
        try:
            with self._transaction() as db:
                db.execute(
                    f"INSERT INTO files ({FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                    (record.id, filename, purpose, record.bytes, record.created_at, lines),
                )
                self._put_content(db, record.id, content)
        except StoreError:
            self._drop_content(record.id)
            raise
        return record

    def get_file(self, file_id: str) -> FileRecord | None:
        row = self._read(
            lambda db: db.execute(
                f"SELECT {FILE_COLUMNS} FROM files WHERE id = ?", (file_id,)
            ).fetchone()
        )
        return None if row is None else FileRecord(*row)

    def list_files(self, purpose: str | None) -> list[FileRecord]:
        """Every file (of `purpose`), oldest first."""
        rows = self._read(
            lambda db: db.execute(
                f"SELECT {FILE_COLUMNS} FROM files WHERE CAST(? AS TEXT) IS NULL OR purpose = ? "
                f"ORDER BY {self.file_order_sql}",
                (purpose, purpose),
            ).fetchall()
        )
        return [FileRecord(*row) for row in rows]

    def count_files(self) -> int:
        count: int = self._read(lambda db: db.execute("SELECT COUNT(*) FROM files").fetchone()[0])
        return count

    def delete_file(self, file_id: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        self._drop_content(file_id)
        return bool(deleted)

    # --- batches --------------------------------------------------------------------------

    def add_batch(self, batch: BatchRecord) -> None:
        with self._transaction() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute(
                "INSERT INTO batches (id, seq, body) VALUES (?, ?, ?)",
                (batch.id, seq, batch._stored()),
            )

    def save_batch(self, batch: BatchRecord, owner: str | None = None) -> None:
        """Write `batch`'s status, times, files and errors; with `owner`, only while it holds
        the batch's lease (LeaseLost if it does not), so a replica that lost a batch to
        another cannot overwrite what the other writes."""
        held, args = self._held_by(owner) if owner is not None else ("", ())
        with self._transaction() as db:
            updated = db.execute(
                f"UPDATE batches SET body = ? WHERE id = ?{held}",
                (batch._stored(), batch.id, *args),
            ).rowcount
        if owner is not None and not updated:
            raise LeaseLost(f"batch {batch.id}: its lease is held by another server")

    def ask_cancel(self, batch_id: str) -> None:
        """Record that the batch is to stop (once: the first ask's time is kept); the server
        working it reads this when it renews its lease."""
        with self._transaction() as db:
            db.execute(
                "UPDATE batches SET cancel_asked_at = COALESCE(cancel_asked_at, ?) WHERE id = ?",
                (int(time.time()), batch_id),
            )

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        batches = self._batches("WHERE id = ?", (batch_id,))
        return batches[0] if batches else None

    def list_batches(self) -> list[BatchRecord]:
        """Every batch, newest first."""
        return self._batches("ORDER BY seq DESC", ())

    def unfinished_batches(self) -> list[BatchRecord]:
        """The batches with work left, oldest first."""
        unfinished = ", ".join(repr(s) for s in UNFINISHED)
        return self._batches(f"WHERE {self.status_sql} IN ({unfinished}) ORDER BY seq", ())

    def status_counts(self) -> dict[str, int]:
        """Batches by the status they show (`cancelling` while a cancel is under way)."""
        status = self.status_sql
        rows = self._read(
            lambda db: db.execute(
                f"SELECT CASE WHEN cancel_asked_at IS NOT NULL AND {status} "
                f"IN ({', '.join(repr(s) for s in UNFINISHED)}) THEN 'cancelling' "
                f"ELSE {status} END, COUNT(*) FROM batches GROUP BY 1"
            ).fetchall()
        )
        return dict(rows)

    def _batches(self, where: str, args: tuple[Any, ...]) -> list[BatchRecord]:
        def query(db: Connection) -> list[tuple[str, int | None, int, int]]:
            rows: list[tuple[str, int | None, int, int]] = db.execute(
                "SELECT body, cancel_asked_at, "
                "(SELECT COUNT(*) FROM results r WHERE r.batch_id = b.id AND ok), "
                "(SELECT COUNT(*) FROM results r WHERE r.batch_id = b.id AND NOT ok) "
                f"FROM batches b {where}",
                args,
            ).fetchall()
            return rows

        batches = []
        for body, cancel_asked_at, completed, failed in self._read(query):
            try:
                batch = BatchRecord(**json.loads(body))
            except (ValueError, TypeError) as error:
                raise StoreError(f"{self.name} holds a batch it cannot read: {error}") from error
            batch.completed, batch.failed = completed, failed
            batch.cancel_asked_at = cancel_asked_at
            batches.append(batch)
        return batches

    # --- finished lines -------------------------------------------------------------------

    def record_line(self, batch_id: str, line: int, ok: bool, record: dict[str, Any]) -> bool:
        """Keep a line's answer (`ok`: for the output file, else the error file); False if the
        line was answered already (its first answer stays, also when two replicas race)."""
        with self._transaction() as db:
            return bool(
                db.execute(
                    "INSERT INTO results (batch_id, line, ok, record) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT DO NOTHING",
                    (batch_id, line, ok, json.dumps(record, ensure_ascii=False)),
                ).rowcount
            )

    def answered_lines(self, batch_id: str) -> set[int]:
        rows = self._read(
            lambda db: db.execute(
                "SELECT line FROM results WHERE batch_id = ?", (batch_id,)
            ).fetchall()
        )
        return {line for (line,) in rows}

    def results(self, batch_id: str) -> list[tuple[bool, str]]:
        """Every answered line's (ok, record JSON), in the input's order."""
        rows = self._read(
            lambda db: db.execute(
                "SELECT ok, record FROM results WHERE batch_id = ? ORDER BY line", (batch_id,)
            ).fetchall()
        )
        return [(bool(ok), record) for ok, record in rows]
