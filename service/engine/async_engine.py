"""Runs the engine's steps on its own thread and streams each request's rounds to asyncio.

`submit()` (event loop) puts a request in a bounded inbox (full → `QueueFull`, answered 429 at
the edge); the worker thread moves it into the engine's scheduler and loops on
`Engine.step()`, one pass over every running request, handing each request's round to its
`asyncio.Queue` through `call_soon_threadsafe` — one call for the whole step's rounds, since
each call is a wake-up write on the worker's path — so the event loop never blocks on a pass.
Between steps the worker applies aborts (client gone, stop string reached) and deadlines, so
a request leaves the batch — and frees its KV row, or its queue slot — within one step. When
there is nothing to run, the worker does warm-up work (cost profile, model tables) one small
increment at a time: never concurrently with a pass, and never delaying a request by more
than one increment. An exception inside one request ends that request only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

from service.engine.engine import Engine
from service.engine.outputs import RoundOutput, StepStats
from service.engine.params import GenerationParams
from service.engine.request import Request, Status

log = logging.getLogger(__name__)
Delivery = RoundOutput | BaseException | None  # what a request's queue carries; None marks the end


class QueueFull(Exception):
    """The waiting queue is at capacity; retry later."""


class RequestTimeout(Exception):
    """The request ran past its deadline."""


class ShuttingDown(Exception):
    """The server is draining: it finishes what runs and admits nothing new."""


@dataclass(eq=False)
class RequestHandle:
    """One submitted request, as both the worker and the event loop see it."""

    request_id: str
    prompt_ids: Sequence[int]
    params: GenerationParams
    deadline: float | None
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[Delivery] = field(default_factory=asyncio.Queue)
    aborted: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.monotonic)
    request: Request | None = None  # set by the worker when the engine takes it

    @property
    def started_at(self) -> float | None:
        """When the request joined the running batch (queue time = the difference)."""
        return None if self.request is None else self.request.started_at

    def deliver(self, item: Delivery) -> None:
        """Called on the worker thread; `None` marks the end."""
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncEngine:
    """The engine behind a bounded queue and a worker thread."""

    def __init__(
        self,
        engine: Engine,
        max_waiting: int = 64,
        request_timeout: float | None = None,
        warm_up: Iterator[bool | None] | None = None,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.on_step = on_step
        self.heartbeat = time.monotonic()  # the worker's last sign of life
        self._warm_up = warm_up
        self._inbox: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        self._live: dict[str, RequestHandle] = {}  # handles the engine holds
        self._pending = 0  # submitted, not yet taken by the worker
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._draining = False
        self._thread = threading.Thread(target=self._work, name="ngrammys-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._pending + len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def alive(self) -> bool:
        """The worker thread runs (a dead worker means a server to restart)."""
        return self._thread.is_alive() and not self._stopped.is_set()

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams) -> RequestHandle:
        """Queue a request (raises `QueueFull` or `ShuttingDown`); then `stream()` its rounds."""
        if self._draining:
            raise ShuttingDown("the server is shutting down")
        with self._lock:
            if self.num_waiting >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting")
            self._pending += 1
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        handle = RequestHandle(
            f"req-{next(self._ids)}", prompt_ids, params, deadline, asyncio.get_running_loop()
        )
        self._inbox.put(handle)
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

    def drain(self, timeout: float) -> None:
        """Admit nothing new; wait up to `timeout` s for the accepted requests to finish, then
        end the rest with a `ShuttingDown` error. Blocking: call it off the event loop."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while (self._live or self._pending) and time.monotonic() < deadline and self.alive:
            time.sleep(0.05)
        for handle in list(self._live.values()):
            handle.deliver(ShuttingDown("the server shut down before this request finished"))
            handle.aborted.set()

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)

    # -- the worker thread --------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stopped.is_set():
            self.heartbeat = time.monotonic()
            self._take_new()
            self._apply_aborts()
            if self.engine.has_work:
                if not self._step():  # nothing may run yet (batch requests held back)
                    self._wait_for_work()
            elif not self._warm_up_once():
                self._wait_for_work()

    def _take_new(self) -> None:
        while True:
            try:
                handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._pending -= 1
            try:
                handle.request = self.engine.add_request(
                    handle.prompt_ids, handle.params, handle.request_id
                )
                self._live[handle.request_id] = handle
            except Exception as error:  # refused by the engine: this request ends
                handle.deliver(error)
                handle.deliver(None)

    def _apply_aborts(self) -> None:
        now = time.monotonic()
        for handle in list(self._live.values()):
            timed_out = handle.deadline is not None and now > handle.deadline
            if timed_out:
                handle.deliver(
                    RequestTimeout(f"the request timed out after {self.request_timeout:g} s")
                )
            if timed_out or handle.aborted.is_set():
                assert handle.request is not None
                self.engine.abort(handle.request)
                self._close(handle)

    def _step(self) -> bool:
        """One engine step, its rounds delivered; whether a pass ran (or failed)."""
        try:
            results, stats = self.engine.step()
        except Exception as error:  # a bug outside any one request: fail the batch, keep serving
            log.exception("engine step failed")
            for handle in list(self._live.values()):
                if handle.request is not None and handle.request.status is Status.RUNNING:
                    assert handle.request is not None
                    self.engine.abort(handle.request)
                    handle.deliver(error)
                    self._close(handle)
            return True
        delivered: list[tuple[RequestHandle, Delivery]] = []
        for request, output in results:
            handle = self._live.get(request.request_id)
            if handle is None:
                continue
            delivered.append((handle, output))
            if (
                request.status is Status.FINISHED
                and self._live.pop(handle.request_id, None) is not None
            ):
                delivered.append((handle, None))
        _deliver_together(delivered)
        if stats is not None and self.on_step is not None:
            self.on_step(stats)
        return bool(results) or stats is not None

    def _close(self, handle: RequestHandle) -> None:
        if self._live.pop(handle.request_id, None) is not None:
            handle.deliver(None)

    def _warm_up_once(self) -> bool:
        """Run one increment of warm-up work; False when there is none (an increment yields
        False to say it had nothing to do)."""
        if self._warm_up is None:
            return False
        try:
            return next(self._warm_up) is not False
        except StopIteration:
            self._warm_up = None
        except Exception:  # serving goes on with what is ready
            log.exception("warm-up failed")
            self._warm_up = None
        return False

    def _wait_for_work(self) -> None:
        time.sleep(0.005)


def _deliver_together(items: Sequence[tuple[RequestHandle, Delivery]]) -> None:
    """Hand `items` to their requests' queues, in order, with one event-loop call per loop
    (called on the worker thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Delivery], Delivery]]] = {}
    for handle, item in items:
        by_loop.setdefault(handle.loop, []).append((handle.outputs, item))
    for loop, puts in by_loop.items():
        loop.call_soon_threadsafe(_put_all, puts)


def _put_all(puts: list[tuple[asyncio.Queue[Delivery], Delivery]]) -> None:
    for outputs, item in puts:
        outputs.put_nowait(item)
