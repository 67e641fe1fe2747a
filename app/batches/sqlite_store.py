"""The batch store of one server: SQLite beside a directory of file contents.

Durability: SQLite in WAL mode with `synchronous=FULL` (a committed line survives a power cut),
one transaction per change; a file's content is written, synced and renamed into place before
its row is committed, so a row never names a missing content. One server owns a store at a time
(an exclusive lock on its directory; a second is told so at start), so its leases are always
its own (`BatchStore`'s defaults).
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from app.batches.store import BatchStore, Connection, StoreError, T

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


class SqliteBatchStore(BatchStore):
    """Files, batches and finished lines in `directory` (one connection behind a lock)."""

    errors = (sqlite3.Error, OSError)
    status_sql = "json_extract(body, '$.status')"
    file_order_sql = "created_at, rowid"

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.name = f"the batch store {self.directory}"
        self._lock = threading.Lock()
        with self._failing_as_store_errors("cannot be opened"):
            (self.directory / "files").mkdir(parents=True, exist_ok=True)
            self._owner = open(self.directory / "lock", "w")  # noqa: SIM115 (held while serving)
        try:
            fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            self._owner.close()
            raise StoreError(f"{self.name} is in use by another server") from error
        try:
            with self._failing_as_store_errors("cannot be read"):
                self._db = sqlite3.connect(
                    self.directory / "store.sqlite3", isolation_level=None, check_same_thread=False
                )
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
        except StoreError:
            self.close()
            raise

    def close(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
        self._owner.close()  # (releases the lock)

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        with self._lock, self._failing_as_store_errors():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, query: Callable[[Connection], T]) -> T:
        with self._lock, self._failing_as_store_errors():
            return query(self._db)

    # --- file contents: files beside the database -------------------------------------------

    def content_path(self, file_id: str) -> Path:
        return self.directory / "files" / file_id

    def _put_content(self, db: Connection, file_id: str, content: bytes) -> None:
        _write_synced(self.content_path(file_id), content)

    def _drop_content(self, file_id: str) -> None:
        with self._failing_as_store_errors():
            self.content_path(file_id).unlink(missing_ok=True)

    def read_content(self, file_id: str) -> bytes:
        with self._failing_as_store_errors():
            return self.content_path(file_id).read_bytes()


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
