"""Runs the engine on its own thread and streams each request's rounds to asyncio.

Requests wait in a bounded queue (full → `QueueFull`, which the edge answers with 429);
the worker thread takes them in arrival order and runs them round by round, handing every
round's output to the request's `asyncio.Queue` through `call_soon_threadsafe`, so the
event loop never blocks on a forward pass. A request can be aborted at any time (client
gone, stop string reached, timeout): the worker checks between rounds, so its state is
freed within one round. An exception inside one request ends that request only.
(Continuous batching of several requests per pass replaces the one-at-a-time worker later.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from service.config import GenerationParams
from service.engine import Engine, RoundOutput

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at capacity; retry later."""


class RequestTimeout(Exception):
    """The request ran past its deadline."""


@dataclass(eq=False)
class RequestHandle:
    """One submitted request, as both the worker and the event loop see it."""

    request_id: str
    prompt_ids: Sequence[int]
    params: GenerationParams
    deadline: float | None
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RoundOutput | BaseException | None] = field(default_factory=asyncio.Queue)
    aborted: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when the engine took it up (queue time = the difference)

    def deliver(self, item: RoundOutput | BaseException | None) -> None:
        """Called on the worker thread; `None` marks the end."""
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncEngine:
    """The engine behind a bounded queue and a worker thread."""

    def __init__(self, engine: Engine, max_waiting: int = 64, request_timeout: float | None = None) -> None:
        self.engine = engine
        self.request_timeout = request_timeout
        self._waiting: queue.Queue[RequestHandle] = queue.Queue(maxsize=max_waiting)
        self._running: RequestHandle | None = None
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._work, name="ngrammys-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._waiting.qsize()

    @property
    def num_running(self) -> int:
        return 0 if self._running is None else 1

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams) -> RequestHandle:
        """Queue a request (raises `QueueFull`); then `stream()` its rounds."""
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        handle = RequestHandle(f"req-{next(self._ids)}", prompt_ids, params, deadline, asyncio.get_running_loop())
        try:
            self._waiting.put_nowait(handle)
        except queue.Full:
            raise QueueFull(f"{self._waiting.maxsize} requests are already waiting") from None
        return handle

    async def stream(self, handle: RequestHandle) -> AsyncIterator[RoundOutput]:
        """The request's rounds as they complete; aborts the request if the consumer leaves."""
        try:
            while (item := await handle.outputs.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            handle.aborted.set()

    def abort(self, handle: RequestHandle) -> None:
        handle.aborted.set()

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)

    def _work(self) -> None:
        while not self._stopped.is_set():
            try:
                handle = self._waiting.get(timeout=0.1)
            except queue.Empty:
                continue
            if handle.deadline is not None and time.monotonic() > handle.deadline:
                self._time_out(handle)
            elif not handle.aborted.is_set():
                handle.started_at = time.monotonic()
                self._running = handle
                self._run(handle)
                self._running = None

    def _run(self, handle: RequestHandle) -> None:
        try:
            for output in self.engine.generate(handle.prompt_ids, handle.params):
                if handle.aborted.is_set():
                    break
                if handle.deadline is not None and time.monotonic() > handle.deadline:
                    self._time_out(handle)
                    return
                handle.deliver(output)
        except Exception as error:  # this request fails; the engine and the others go on
            log.exception("request %s failed", handle.request_id)
            handle.deliver(error)
        handle.deliver(None)

    def _time_out(self, handle: RequestHandle) -> None:
        """Fail a request whose deadline passed, whether it was still waiting or running."""
        handle.deliver(RequestTimeout(f"the request timed out after {self.request_timeout:g} s"))
        handle.deliver(None)
