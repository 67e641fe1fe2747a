"""The batch store's two backends behind one interface: SQLite (one server, a directory) and
PostgreSQL (replicas sharing a database, a real server: tests/helpers/postgres.py). Each keeps
files, batches and a line's first answer only; PostgreSQL's leases let one replica at a time
work a batch, and pass it on once expired; its failures are StoreErrors that name the database
without the password."""

from __future__ import annotations

import time

import psycopg
import pytest

from app.batches.opening import open_store
from app.batches.postgres_store import redacted
from app.batches.store import BatchRecord, BatchStore, LeaseLost, StoreError
from tests.helpers import postgres as helper


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        location = str(tmp_path / "store")
    else:
        location = request.getfixturevalue("postgres").new_database()
    opened = open_store(location)
    yield opened
    opened.close()


@pytest.fixture
def shared(postgres):
    """Two replicas' stores on one PostgreSQL database."""
    url = postgres.new_database()
    first, second = open_store(url), open_store(url)
    yield first, second
    first.close()
    second.close()


def a_batch(store: BatchStore, total: int = 3) -> BatchRecord:
    batch = BatchRecord(
        id=f"batch_{time.monotonic_ns()}",
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        completion_window="24h",
        created_at=int(time.time()),
        expires_at=int(time.time()) + 3600,
        total=total,
    )
    store.add_batch(batch)
    return batch


def test_files_batches_and_lines_are_kept_and_a_line_answered_once(store) -> None:
    first = store.add_file("a.jsonl", "batch", b'{"a": 1}\n', 1)
    second = store.add_file("b.jsonl", "batch_output", bytes(range(256)), 1)
    assert store.read_content(second.id) == bytes(range(256))
    assert [f.id for f in store.list_files(None)] == [first.id, second.id]  # oldest first
    assert [f.id for f in store.list_files("batch")] == [first.id]
    assert store.get_file(first.id) == first and store.count_files() == 2
    assert store.delete_file(first.id) and store.get_file(first.id) is None
    with pytest.raises(StoreError):
        store.read_content(first.id)

    older, newer = a_batch(store), a_batch(store)
    assert [b.id for b in store.list_batches()] == [newer.id, older.id]  # newest first
    assert store.record_line(older.id, 1, True, {"custom_id": "b"})
    assert store.record_line(older.id, 0, False, {"custom_id": "a"})
    assert not store.record_line(older.id, 1, False, {"custom_id": "again"})  # the first stays
    assert store.answered_lines(older.id) == {0, 1}
    assert store.results(older.id) == [(False, '{"custom_id": "a"}'), (True, '{"custom_id": "b"}')]
    kept = store.get_batch(older.id)
    assert (kept.completed, kept.failed) == (1, 1)
    older.status = "completed"
    store.save_batch(older)
    store.ask_cancel(newer.id)
    assert [b.id for b in store.unfinished_batches()] == [newer.id]
    assert store.status_counts() == {"completed": 1, "cancelling": 1}
    assert store.get_batch(newer.id).shown_status == "cancelling"
    assert store.get_batch("batch_none") is None


def test_a_store_one_server_owns_grants_every_lease(tmp_path) -> None:
    store = open_store(str(tmp_path))
    batch = a_batch(store)
    assert store.hold(batch.id, "one", 1) is not None
    assert store.hold(batch.id, "two", 1) is not None
    store.save_batch(batch, "two")
    store.close()


def test_one_replica_holds_a_batch_until_its_lease_expires(shared) -> None:
    first, second = shared
    batch = a_batch(first)
    assert first.hold(batch.id, "first", 0.5) is not None
    assert second.hold(batch.id, "second", 0.5) is None  # held
    assert first.hold(batch.id, "first", 0.5) is not None  # renewed
    first.save_batch(batch, "first")
    with pytest.raises(LeaseLost):
        second.save_batch(batch, "second")
    time.sleep(0.7)  # the first replica died: its lease expires
    second.ask_cancel(batch.id)
    lease = second.hold(batch.id, "second", 5)
    assert lease is not None and lease.cancel_asked  # a cancel asked through any replica
    with pytest.raises(LeaseLost):  # the first cannot write what the second now works
        first.save_batch(batch, "first")
    assert first.hold(batch.id, "first", 5) is None
    second.release(batch.id, "second")  # (the second ended the batch)
    assert first.hold(batch.id, "first", 5, renewing=True) is None  # the first's stays lost
    assert first.hold(batch.id, "first", 5) is not None  # given up: claimed at once
    assert first.hold(batch.id, "first", 5, renewing=True) is not None


def test_two_replicas_racing_for_a_line_keep_one_answer(shared) -> None:
    first, second = shared
    batch = a_batch(first)
    assert first.record_line(batch.id, 0, True, {"by": "first"})
    assert not second.record_line(batch.id, 0, True, {"by": "second"})
    assert second.results(batch.id) == [(True, '{"by": "first"}')]


def test_postgres_failures_are_store_errors_without_the_password(postgres) -> None:
    url = postgres.new_database()
    wrong = url.replace(postgres.password, "not-the-password")
    with pytest.raises(StoreError) as refused:
        open_store(wrong)
    message = str(refused.value)
    assert "cannot be opened" in message and "password authentication failed" in message
    assert "not-the-password" not in message and redacted(url) in message
    store = open_store(url)
    try:
        with psycopg.connect(url, autocommit=True) as db:
            db.execute("DROP TABLE results")
        with pytest.raises(StoreError) as failed:
            store.answered_lines("batch_x")
        assert str(failed.value) == (
            f'the batch store {redacted(url)} failed: relation "results" does not exist'
        )
        postgres.admin(f"DROP DATABASE {url.rsplit('/', 1)[1]} WITH (FORCE)")
        with pytest.raises(StoreError, match="terminating connection"):
            store.count_files()
        with pytest.raises(StoreError) as gone:
            store.count_files()  # the broken connection is opened again, and that fails
        assert "cannot be opened" not in str(gone.value)  # (opening is __init__'s)
        assert "does not exist" in str(gone.value) and postgres.password not in str(gone.value)
    finally:
        store.close()


def test_a_url_is_named_without_its_password() -> None:
    assert (
        redacted("postgresql://user:secret@db.example:5432/batches?password=secret")
        == "postgresql://user@db.example:5432/batches"
    )
    assert redacted("postgres://db/batches") == "postgres://db/batches"


def test_without_postgresql_installed_its_tests_fail_saying_how_to_install_it(
    monkeypatch,
) -> None:
    monkeypatch.setattr(helper.shutil, "which", lambda _: None)
    monkeypatch.setattr(helper.glob, "glob", lambda _: [])
    with pytest.raises(pytest.fail.Exception, match="make test-tools"):
        helper.server_binaries()
