"""The batch store `--batch-store` names: a directory (SQLite, one server) or a PostgreSQL URL
(several replicas sharing it)."""

from __future__ import annotations

from pathlib import Path

from app.batches.sqlite_store import SqliteBatchStore
from app.batches.store import BatchStore, StoreError

DATABASE_SCHEMES = ("postgresql://", "postgres://")


def is_database_url(location: str) -> bool:
    return location.startswith(DATABASE_SCHEMES)


def open_store(location: str) -> BatchStore:
    """The store at `location`, opened (a StoreError says why it cannot be)."""
    if not is_database_url(location):
        return SqliteBatchStore(Path(location))
    try:  # psycopg is loaded only by a server that uses PostgreSQL
        from app.batches.postgres_store import PostgresBatchStore
    except ImportError as error:
        raise StoreError(
            f"the batch store is a PostgreSQL URL, but its driver cannot be loaded: {error}"
        ) from error
    return PostgresBatchStore(location)
