"""The engine behind its worker thread (`service/engine/async_engine.py`), on the tiny model:
rounds stream to the end, aborts free a running row or a queue slot, a full queue and a
deadline answer with their errors, and draining ends whoever is left. Passes are slowed where
a test needs a request still running when it looks, so timing holds on a machine of any speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from service.engine.async_engine import (
    AsyncEngine,
    QueueFull,
    RequestHandle,
    RequestTimeout,
    ShuttingDown,
)
from service.engine.engine import ContextTooLong, Engine
from service.engine.outputs import RoundOutput
from service.engine.params import GenerationParams, SpeculationParams
from tests.helpers.engines import PROMPTS, make_engine, reference_greedy

SLOW_PASS = 0.01  # seconds added to each pass where a test needs a request still running
LONG = GenerationParams(400)  # at SLOW_PASS a pass, four seconds: it runs until the test ends it


@pytest.fixture
def slow_passes(tiny_runner, monkeypatch) -> None:
    forward = tiny_runner.forward

    def slow_forward(*args, **kwargs):
        time.sleep(SLOW_PASS)
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny_runner, "forward", slow_forward)


@contextmanager
def serving(engine: Engine, **options) -> Iterator[AsyncEngine]:
    server = AsyncEngine(engine, **options)
    try:
        yield server
    finally:
        server.shutdown()


async def collect(
    server: AsyncEngine, handle: RequestHandle, timeout: float = 20
) -> list[RoundOutput]:
    """The request's rounds to the end of its stream (a hang fails the test, not the run)."""

    async def read() -> list[RoundOutput]:
        return [round_output async for round_output in server.stream(handle)]

    return await asyncio.wait_for(read(), timeout)


async def until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


async def one_running_one_waiting(server: AsyncEngine) -> tuple[RequestHandle, RequestHandle]:
    """A long request in the batch and a short one in the engine's queue behind it (a batch of
    one)."""
    running = server.submit(PROMPTS[0], LONG)
    await until(lambda: server.num_running == 1)
    waiting = server.submit(PROMPTS[1], GenerationParams(8))
    await until(lambda: waiting.request is not None)
    return running, waiting


def tokens(rounds: list[RoundOutput]) -> list[int]:
    return [token for round_output in rounds for token in round_output.token_ids]


def test_rounds_stream_to_the_end_of_each_request(tiny_model, tiny_runner, tiny_tables) -> None:
    asked = [
        (PROMPTS[0], GenerationParams(20)),
        (PROMPTS[1], GenerationParams(12, speculation=SpeculationParams(4, 4))),
    ]  # rounds of several tokens

    async def scenario() -> list[list[RoundOutput]]:
        with serving(make_engine(tiny_runner, tiny_tables)) as server:
            handles = [server.submit(prompt, params) for prompt, params in asked]
            streams = await asyncio.gather(*(collect(server, handle) for handle in handles))
            assert server.num_waiting == server.num_running == 0
            return streams

    for (prompt, params), rounds in zip(asked, asyncio.run(scenario())):
        assert tokens(rounds) == reference_greedy(tiny_model, prompt, params.max_new_tokens)
        assert [r.finish_reason for r in rounds] == [None] * (len(rounds) - 1) + ["length"]


def test_a_request_the_engine_refuses_ends_with_the_engines_error(tiny_runner, tiny_tables) -> None:
    async def scenario() -> None:
        with serving(make_engine(tiny_runner, tiny_tables)) as server:
            # 564 tokens: over 512
            handle = server.submit(list(range(2, 60)) * 8, GenerationParams(100))
            with pytest.raises(ContextTooLong):
                await collect(server, handle)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "leave",
    [
        False,  # the server aborts it (a stop string reached, a client gone)
        True,  # the consumer stops reading: closing the stream aborts it
    ],
)
def test_aborting_a_running_request_ends_its_stream_and_frees_its_row(
    tiny_model, tiny_runner, tiny_tables, slow_passes, leave: bool
) -> None:
    async def scenario() -> tuple[list[RoundOutput], RequestHandle]:
        with serving(make_engine(tiny_runner, tiny_tables)) as server:
            handle = server.submit(PROMPTS[0], LONG)
            stream = server.stream(handle)
            rounds = [await anext(stream)]
            if leave:
                await stream.aclose()
            else:
                server.abort(handle)
                rounds += [round_output async for round_output in stream]
            await until(lambda: server.num_running == 0)
            assert server.engine.cache.num_rows == 0
            return rounds, handle

    rounds, handle = asyncio.run(scenario())
    assert handle.request is not None and handle.request.finish_reason == "abort"
    assert 0 < len(tokens(rounds)) < LONG.max_new_tokens
    assert tokens(rounds) == reference_greedy(tiny_model, PROMPTS[0], len(tokens(rounds)))


def test_aborting_a_waiting_request_ends_it_without_a_round(
    tiny_runner, tiny_tables, slow_passes
) -> None:
    async def scenario() -> None:
        with serving(make_engine(tiny_runner, tiny_tables, max_running_requests=1)) as server:
            running, waiting = await one_running_one_waiting(server)
            assert server.num_waiting == 1
            server.abort(waiting)
            assert await collect(server, waiting) == []
            await until(lambda: server.num_waiting == 0)  # its queue slot is free
            assert waiting.started_at is None and server.num_running == 1
            server.abort(running)

    asyncio.run(scenario())


def test_a_full_queue_refuses_a_request_until_a_slot_frees(
    tiny_runner, tiny_tables, slow_passes
) -> None:
    async def scenario() -> None:
        engine = make_engine(tiny_runner, tiny_tables, max_running_requests=1)
        with serving(engine, max_waiting=1) as server:
            running = server.submit(PROMPTS[0], LONG)
            await until(lambda: server.num_running == 1)  # no longer waiting: the queue is empty
            queued = server.submit(PROMPTS[1], GenerationParams(8))
            with pytest.raises(QueueFull, match="1 requests are already waiting"):
                server.submit(PROMPTS[2], GenerationParams(8))
            server.abort(running)
            assert len(tokens(await collect(server, queued))) == 8  # it ran once the row was free
            assert (
                len(tokens(await collect(server, server.submit(PROMPTS[2], GenerationParams(4)))))
                == 4
            )

    asyncio.run(scenario())


def test_a_request_past_its_deadline_ends_with_a_timeout(
    tiny_runner, tiny_tables, slow_passes
) -> None:
    async def scenario() -> RequestHandle:
        with serving(make_engine(tiny_runner, tiny_tables), request_timeout=0.2) as server:
            handle = server.submit(PROMPTS[0], LONG)
            started = time.monotonic()
            with pytest.raises(RequestTimeout, match="timed out after 0.2 s"):
                await collect(server, handle)
            assert time.monotonic() - started < 0.2 + 2.0  # within a few passes of the deadline
            await until(lambda: server.num_running == 0)
            return handle

    handle = asyncio.run(scenario())
    assert handle.request is not None and handle.request.finish_reason == "abort"


def test_draining_lets_requests_finish_within_the_timeout(
    tiny_runner, tiny_tables, slow_passes
) -> None:
    async def scenario() -> list[RoundOutput]:
        with serving(make_engine(tiny_runner, tiny_tables)) as server:
            handle = server.submit(PROMPTS[1], GenerationParams(8))
            rounds = asyncio.ensure_future(collect(server, handle))
            await asyncio.to_thread(server.drain, 10.0)
            return await rounds

    assert len(tokens(asyncio.run(scenario()))) == 8


def test_draining_past_its_timeout_ends_running_and_waiting_requests(
    tiny_runner, tiny_tables, slow_passes
) -> None:
    async def scenario() -> None:
        with serving(make_engine(tiny_runner, tiny_tables, max_running_requests=1)) as server:
            running, waiting = await one_running_one_waiting(server)
            await asyncio.to_thread(server.drain, 0.0)
            for handle in (running, waiting):
                with pytest.raises(ShuttingDown, match="shut down before this request finished"):
                    await collect(server, handle)
            with pytest.raises(ShuttingDown, match="shutting down"):
                server.submit(PROMPTS[2], GenerationParams(8))  # nothing new is admitted
            await until(lambda: server.num_running == server.num_waiting == 0)
            server.shutdown()
            assert not server.alive

    asyncio.run(scenario())


def test_a_failing_step_fails_its_requests_and_the_worker_serves_on(
    tiny_runner, tiny_tables, monkeypatch
) -> None:
    async def scenario() -> None:
        engine = make_engine(tiny_runner, tiny_tables)
        with serving(engine) as server:
            step = engine.step

            def failing_step():
                step()  # the request is admitted and running: the failure is its batch's
                raise RuntimeError("a bug in the step")

            monkeypatch.setattr(engine, "step", failing_step)
            with pytest.raises(RuntimeError, match="a bug in the step"):
                await collect(server, server.submit(PROMPTS[0], GenerationParams(8)))
            monkeypatch.setattr(engine, "step", step)
            assert server.alive
            assert (
                len(tokens(await collect(server, server.submit(PROMPTS[0], GenerationParams(8)))))
                == 8
            )

    asyncio.run(scenario())
