"""The batch store: files, batches and every finished line, in SQLite beside a directory of
file contents, so that a server killed at any point and started again on the same store goes on
where it stopped.

Durability: SQLite in WAL mode with `synchronous=FULL` (a committed line survives a power cut),
one transaction per change; a file's content is written, synced and renamed into place before
its row is committed, so a row never names a missing content. A finished line is one row keyed
by (batch, line number): it is answered once, however often the server restarts. One server
owns a store at a time (an exclusive lock on its directory); a second is told so at start.

Every failure of the disk or the database (a full disk, a corrupt file) is a `StoreError` with
what failed and where, for the API to answer and the runner to fail the batch with; never an
exception that ends the server.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

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

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, lines INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, body TEXT NOT NULL, cancel_asked_at INTEGER
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
"""


class StoreError(Exception):
    """The store could not be read or written: what failed, and the store's directory."""


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


class BatchStore:
    """Files, batches and finished lines in `directory` (thread-safe: one connection behind a
    lock; callers on the event loop call in a thread)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        try:
            (self.directory / "files").mkdir(parents=True, exist_ok=True)
            self._owner = open(self.directory / "lock", "w")  # noqa: SIM115 (held while serving)
        except OSError as error:
            raise StoreError(
                f"the batch store {self.directory} cannot be opened: {error}"
            ) from error
        try:
            fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            self._owner.close()
            raise StoreError(
                f"the batch store {self.directory} is in use by another server"
            ) from error
        try:
            self._db = sqlite3.connect(
                self.directory / "store.sqlite3", isolation_level=None, check_same_thread=False
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as error:
            self.close()
            raise StoreError(f"the batch store {self.directory} cannot be read: {error}") from error

    def close(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
        self._owner.close()  # (releases the lock)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._failing_as_store_errors():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, query: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock, self._failing_as_store_errors():
            return query(self._db)

    @contextmanager
    def _failing_as_store_errors(self) -> Iterator[None]:
        try:
            yield
        except (sqlite3.Error, OSError) as error:
            raise StoreError(f"the batch store {self.directory} failed: {error}") from error

    # --- files ----------------------------------------------------------------------------

    def content_path(self, file_id: str) -> Path:
        return self.directory / "files" / file_id

    def add_file(self, filename: str, purpose: str, content: bytes, lines: int) -> FileRecord:
        """Keep `content` as a new file: on disk (synced) before its row."""
        record = FileRecord(
            new_id("file-"), filename, purpose, len(content), int(time.time()), lines
        )
        path = self.content_path(record.id)
        with self._failing_as_store_errors():
            _write_synced(path, content)
        try:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                    (record.id, filename, purpose, record.bytes, record.created_at, lines),
                )
        except StoreError:
            path.unlink(missing_ok=True)
            raise
        return record

    def get_file(self, file_id: str) -> FileRecord | None:
        row = self._read(
            lambda db: db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        )
        return None if row is None else FileRecord(*row)

    def read_content(self, file_id: str) -> bytes:
        with self._failing_as_store_errors():
            return self.content_path(file_id).read_bytes()

    def list_files(self, purpose: str | None) -> list[FileRecord]:
        """Every file (of `purpose`), oldest first."""
        rows = self._read(
            lambda db: db.execute(
                "SELECT * FROM files WHERE ? IS NULL OR purpose = ? ORDER BY created_at, rowid",
                (purpose, purpose),
            ).fetchall()
        )
        return [FileRecord(*row) for row in rows]

    def count_files(self) -> int:
        return self._read(lambda db: db.execute("SELECT COUNT(*) FROM files").fetchone()[0])

    def delete_file(self, file_id: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        with self._failing_as_store_errors():
            self.content_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # --- batches --------------------------------------------------------------------------

    def add_batch(self, batch: BatchRecord) -> None:
        with self._transaction() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, NULL)", (batch.id, seq, batch._stored())
            )

    def save_batch(self, batch: BatchRecord) -> None:
        """Write `batch`'s status, times, files and errors."""
        with self._transaction() as db:
            db.execute("UPDATE batches SET body = ? WHERE id = ?", (batch._stored(), batch.id))

    def ask_cancel(self, batch_id: str) -> None:
        """Record that the batch is to stop (once: the first ask's time is kept)."""
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
        return [b for b in self._batches("ORDER BY seq", ()) if b.status in UNFINISHED]

    def status_counts(self) -> dict[str, int]:
        """Batches by the status they show (`cancelling` while a cancel is under way)."""
        rows = self._read(
            lambda db: db.execute(
                "SELECT CASE WHEN cancel_asked_at IS NOT NULL AND json_extract(body, '$.status') "
                f"IN ({', '.join(repr(s) for s in UNFINISHED)}) THEN 'cancelling' "
                "ELSE json_extract(body, '$.status') END, COUNT(*) FROM batches GROUP BY 1"
            ).fetchall()
        )
        return dict(rows)

    def _batches(self, where: str, args: tuple[Any, ...]) -> list[BatchRecord]:
        def query(db: sqlite3.Connection) -> list[tuple[str, int | None, int, int]]:
            return db.execute(
                "SELECT body, cancel_asked_at, "
                "(SELECT COUNT(*) FROM results r WHERE r.batch_id = b.id AND ok), "
                "(SELECT COUNT(*) FROM results r WHERE r.batch_id = b.id AND NOT ok) "
                f"FROM batches b {where}",
                args,
            ).fetchall()

        batches = []
        for body, cancel_asked_at, completed, failed in self._read(query):
            try:
                batch = BatchRecord(**json.loads(body))
            except (ValueError, TypeError) as error:
                raise StoreError(
                    f"the batch store {self.directory} holds a batch it cannot read: {error}"
                ) from error
            batch.completed, batch.failed = completed, failed
            batch.cancel_asked_at = cancel_asked_at
            batches.append(batch)
        return batches

    # --- finished lines -------------------------------------------------------------------

    def record_line(self, batch_id: str, line: int, ok: bool, record: dict[str, Any]) -> bool:
        """Keep a line's answer (`ok`: for the output file, else the error file); False if the
        line was answered already (its first answer stays)."""
        with self._transaction() as db:
            return bool(
                db.execute(
                    "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                    (batch_id, line, int(ok), json.dumps(record, ensure_ascii=False)),
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


def _write_synced(path: Path, content: bytes) -> None:
    """`content` at `path`, whole or not at all: written beside it, synced, renamed."""
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as out:
        out.write(content)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
