"""Batch jobs through the real `openai` client: upload, create, poll, download; each output
line is what the same body gets from its route, bad lines are refused at upload naming the
line, a line the route refuses lands in the error file, a cancel keeps what was answered, and a
failing store fails the batch with its reason while the server goes on. The tests of the API
run on each backend of the store: SQLite, and a real PostgreSQL (tests/helpers/postgres.py)."""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import psycopg
import pytest

from app.background import serving
from app.batches.sqlite_store import SqliteBatchStore
from app.main import create_app
from app.settings import Settings
from tests.helpers.http import MESSAGES, QUIET, runtime_of, slowed, wait_ready, wait_until

KEY = "batch-key"
MODEL = "tiny-random-llama"
CAP = 64


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict | str]) -> bytes:
    """The lines as JSONL (a string is written as it is: a line that is not JSON)."""
    return "\n".join(item if isinstance(item, str) else json.dumps(item) for item in lines).encode()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def app(tiny_served, tmp_path_factory, backend, request):
    if backend == "sqlite":
        store = tmp_path_factory.mktemp("batches")
    else:
        store = request.getfixturevalue("postgres").new_database()
    settings = Settings(api_keys=KEY, max_tokens=8, max_tokens_cap=CAP, batch_store=store, **QUIET)
    return create_app(settings, loader=lambda _: tiny_served)


@pytest.fixture(scope="module")
def server(app):
    with serving(app) as base:
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def upload(client: openai.OpenAI, lines: list[dict]):
    return client.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    ended = ("completed", "failed", "expired", "cancelled")
    wait_until(lambda: client.batches.retrieve(batch_id).status in ended, timeout)
    return client.batches.retrieve(batch_id)


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(row) for row in client.files.content(file_id).text.splitlines()]


def test_a_batch_answers_each_line_as_its_route_does(server, client) -> None:
    bodies = {
        "primes": {
            "messages": MESSAGES,
            "max_tokens": 8,
            "speculation": {"mode": "fixed", "k": 4, "w": 4},
        },
        "hello": {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6},
        "json": {
            "messages": MESSAGES,
            "max_tokens": 12,
            "response_format": {"type": "json_object"},
        },
        # passes the schema, but the route refuses it: into the error file
        "too-long": {"messages": MESSAGES, "max_tokens": CAP + 1},
    }
    uploaded = upload(client, [line(name, body) for name, body in bodies.items()])
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    assert client.files.retrieve(uploaded.id).filename == "batch.jsonl"
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
    done = finished(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed) == (4, 3)
    assert done.request_counts.failed == 1
    outputs = records(client, done.output_file_id)
    assert [r["custom_id"] for r in outputs] == ["primes", "hello", "json"]  # the input's order
    for record in outputs:
        reference = httpx.post(
            f"{server}/v1/chat/completions",
            json=bodies[record["custom_id"]],
            headers={"Authorization": f"Bearer {KEY}"},
        ).json()
        answer = record["response"]["body"]["choices"][0]["message"]["content"]
        assert record["response"]["status_code"] == 200 and record["error"] is None
        assert answer == reference["choices"][0]["message"]["content"]
    stats = outputs[0]["response"]["body"]["choices"][0]["speculative_decoding_stats"]
    summed = done.model_extra["speculative_decoding_stats"]  # the lines' speculation, summed
    assert summed["num_draft_tokens"] == stats["num_draft_tokens"] > 0
    (failure,) = records(client, done.error_file_id)
    assert failure["custom_id"] == "too-long" and failure["response"]["status_code"] == 400
    assert failure["response"]["body"]["error"]["param"] == "max_tokens"
    assert client.batches.list(limit=1).data[0].id == batch.id  # newest first
    metrics = httpx.get(f"{server}/metrics").text
    assert 'ngrammys_batches{status="completed"} 1.0' in metrics
    assert 'ngrammys_batch_lines_total{outcome="failed"} 1.0' in metrics
    assert batch.id in [b.id for b in client.batches.list()]


@pytest.mark.parametrize(
    "lines,named",
    [
        ([line("a", {"messages": MESSAGES}), "not json"], "line 2: not valid JSON"),
        ([line("a", {"messages": MESSAGES}, url="/v1/embeddings")], "line 1: url"),
        ([line("a", {"messages": MESSAGES})] * 2, "line 2: custom_id 'a'"),
        ([line("a", {"messages": MESSAGES, "stream": True})], "line 1: body.stream"),
        ([line("a", {"messages": MESSAGES, "model": "other"})], "line 1: body.model"),
        ([line("a", {"messages": [{"role": "nobody", "content": "x"}]})], "line 1: body.messages"),
        ([{**line("a", {"messages": MESSAGES}), "method": "GET"}], "line 1: method"),
    ],
)
def test_an_upload_is_checked_line_by_line(client, lines, named) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("bad.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert refused.value.body["message"].startswith(named), refused.value.body


def test_a_cancelled_batch_keeps_what_was_answered(app, client) -> None:
    lines = [line(str(i), {"messages": MESSAGES, "max_tokens": 8}) for i in range(24)]
    uploaded = upload(client, lines)
    with slowed(app, 0.05):
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at is not None
    answered = records(client, done.output_file_id)
    assert 1 <= len(answered) == done.request_counts.completed < 24
    assert len({r["custom_id"] for r in answered}) == len(answered)
    engine = runtime_of(app).async_engine
    wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0)
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)  # ended


def test_files_are_listed_read_and_deleted_and_lines_of_another_endpoint_fail(client) -> None:
    uploaded = upload(client, [line("x", {"messages": MESSAGES})])
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert (
        client.files.content(uploaded.id).text
        == jsonl([line("x", {"messages": MESSAGES})]).decode()
    )
    mismatched = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    failed = finished(client, mismatched.id)
    assert failed.status == "failed" and failed.errors.data[0].code == "mismatched_endpoint"
    assert failed.errors.data[0].line == 1
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_unknown")
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id="file-unknown", endpoint="/v1/chat/completions", completion_window="24h"
        )


class FullDisk:
    """A database connection whose writes of lines and files fail as SQLite's do on a full
    disk (a batch's own row is written)."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection

    def execute(self, sql: str, *args):
        if "INTO results" in sql or "INTO files" in sql:
            raise sqlite3.OperationalError("database or disk is full")
        return self.connection.execute(sql, *args)


# what each backend says of a full disk
FULL_DISK = {
    "sqlite": "database or disk is full",
    "postgresql": 'could not extend file "base/1/2": No space left on device',
}


@contextmanager
def full_disk(app, backend: str, monkeypatch) -> Iterator[None]:
    """The store's writes of lines and files fail as on a full disk: SQLite's connection
    answering so, or PostgreSQL itself raising the error its full disk gives (a trigger)."""
    store = app.state.batch_store
    if backend == "sqlite":
        monkeypatch.setattr(store, "_db", FullDisk(store._db))
        yield
        return
    url = app.state.settings.batch_store
    with psycopg.connect(url, autocommit=True) as db:
        db.execute(
            "CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"RAISE EXCEPTION '{FULL_DISK[backend]}' USING ERRCODE = 'disk_full'; END $$"
        )
        for table in ("results", "files"):
            db.execute(
                f"CREATE TRIGGER disk_full BEFORE INSERT ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION disk_full()"
            )
        try:
            yield
        finally:
            db.execute("DROP FUNCTION disk_full CASCADE")


def test_a_failing_store_fails_the_batch_and_the_server_goes_on(
    app, server, client, backend, monkeypatch
) -> None:
    uploaded = upload(client, [line("x", {"messages": MESSAGES})])
    with full_disk(app, backend, monkeypatch):
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = finished(client, batch.id)
        assert done.status == "failed"
        assert FULL_DISK[backend] in done.errors.data[0].message
        with pytest.raises(openai.InternalServerError) as refused:
            upload(client, [line("y", {"messages": MESSAGES})])
        assert FULL_DISK[backend] in refused.value.body["message"]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.choices[0].message.content is not None


def test_without_a_store_batch_jobs_are_off(tiny_served) -> None:
    with serving(create_app(Settings(**QUIET), loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        reply = httpx.get(f"{base}/v1/batches")
    assert reply.status_code == 404 and "--batch-store" in reply.json()["error"]["message"]


def test_a_store_another_server_holds_is_a_clear_503_until_it_is_free(
    tiny_served, tmp_path
) -> None:
    """As in a rolling restart: the old server holds the store; the new one serves everything
    else, answers 503 on batch jobs, and takes the store once the old one lets go."""
    held = SqliteBatchStore(tmp_path)
    settings = Settings(batch_store=tmp_path, **QUIET)
    with serving(create_app(settings, loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        try:
            reply = httpx.get(f"{base}/v1/files")
            chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES})
        finally:
            held.close()
        assert reply.status_code == 503
        assert "in use by another server" in reply.json()["error"]["message"]
        assert chat.status_code == 200
        wait_until(lambda: httpx.get(f"{base}/v1/files").status_code == 200, timeout=30)


def test_a_corrupt_store_is_a_clear_503(tiny_served, tmp_path) -> None:
    (tmp_path / "store.sqlite3").write_bytes(b"not a database" * 100)
    settings = Settings(batch_store=tmp_path, **QUIET)
    with serving(create_app(settings, loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        wait_until(lambda: "cannot be read" in httpx.get(f"{base}/v1/files").text)
        reply = httpx.get(f"{base}/v1/batches")
    assert reply.status_code == 503
    assert "cannot be read: file is not a database" in reply.json()["error"]["message"]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True, scope="module")  # (no store)
def test_a_batch_priority_request_waits_while_an_interactive_one_runs(app, server) -> None:
    """Without a cost profile no batch row runs beside an interactive one: a request with the
    batch priority header waits for the interactive request to end."""
    health = f"{server}/health"
    interactive = {
        "messages": MESSAGES,
        "max_tokens": 40,
        "stream": True,
        "speculation": {"mode": "off"},  # a token a pass: it runs for 40 slowed passes
    }
    batch = {"messages": MESSAGES, "max_tokens": 4}
    headers = {"Authorization": f"Bearer {KEY}"}
    with slowed(app, 0.1), httpx.Client(timeout=60, headers=headers) as http:
        with http.stream("POST", f"{server}/v1/chat/completions", json=interactive) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if '"content"' in line)  # it runs
            with ThreadPoolExecutor(1) as pool:
                queued = pool.submit(
                    http.post,
                    f"{server}/v1/chat/completions",
                    json=batch,
                    headers={"x-ngrammys-priority": "batch"},
                )

                def held_back() -> bool:
                    state = http.get(health).json()
                    return (state["requests_waiting"], state["requests_running"]) == (1, 1)

                wait_until(held_back)
                for _ in lines:  # the interactive request to its end
                    pass
                assert queued.result().status_code == 200
