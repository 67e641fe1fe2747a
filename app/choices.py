"""A request's `n` choices: one engine request each, their pieces interleaved as they come.

Each choice is a `Generation` of its own (its own text, stop strings, logprobs, statistics, and
the engine's timings: queue time, time to first token, inter-token latency); `Choices` owns what
belongs to the request as a whole: its end (once, whatever its n: the concurrency slot, the
outcome and end-to-end latency metrics, aborting what still runs), its usage (the shared
prompt once) and the order of its chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from app.generation import Generation, Kind, Piece
from app.schemas import MAX_REQUEST_SEED, Usage
from app.tool_parsing import new_call_id
from service.engine.async_engine import AsyncEngine, RequestHandle
from service.engine.params import GenerationParams

T = TypeVar("T")


def choice_params(params: GenerationParams, n: int) -> list[GenerationParams]:
    """The engine requests of `n` choices. Sampled: one each, choice i of a seeded request with
    seed (seed + i) mod 2^63, so that every choice is reproducible alone (it is the request of
    n = 1 with that seed), and without a seed each from a random seed of its own. Greedy: one
    request for all of them, since the n choices could only be the same text n times."""
    sampling = params.sampling
    if sampling.greedy:
        return [params]
    if sampling.seed is None:
        return [params] * n
    return [
        replace(
            params, sampling=replace(sampling, seed=(sampling.seed + i) % (MAX_REQUEST_SEED + 1))
        )
        for i in range(n)
    ]


def submit_all(
    engine: AsyncEngine, prompt_ids: list[int], params: list[GenerationParams]
) -> list[RequestHandle]:
    """Submit one engine request per `params`, or none: if one is refused (a full queue, a
    draining server), those already submitted are aborted and the error raised."""
    handles: list[RequestHandle] = []
    try:
        for choice in params:
            handles.append(engine.submit(prompt_ids, choice))
    except BaseException:
        for handle in handles:
            engine.abort(handle)
        raise
    return handles


async def interleaved(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T | None]]:
    """The items of `streams` as they arrive, as (the stream's position, item), and (position,
    None) when that stream ends. An error in any stream is raised here, and ends the others."""
    if len(streams) == 1:  # no task and no queue between the engine and a single choice
        async for item in streams[0]:
            yield 0, item
        yield 0, None
        return
    arrivals: asyncio.Queue[tuple[int, T | None] | Exception] = asyncio.Queue()

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                arrivals.put_nowait((position, item))
            arrivals.put_nowait((position, None))
        except Exception as error:  # handed to the consumer, which raises it
            arrivals.put_nowait(error)

    tasks = [asyncio.create_task(pump(position, stream)) for position, stream in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            arrival = await arrivals.get()
            if isinstance(arrival, Exception):
                raise arrival
            running -= arrival[1] is None
            yield arrival
    finally:  # the consumer left, or a stream failed: cancelling a stream aborts its request
        for task in tasks:
            task.cancel()


@dataclass
class Choices:
    """The n choices of one request, from `generations` (engine requests) of `copies` choices
    each: choice j * copies + c is copy c of generation j. Sampled, each choice is its own
    generation (copies = 1); greedy, one generation stands for all n (copies = n), its choice
    sent n times, as OpenAI answers (identical choices) for a fraction of the work."""

    generations: list[Generation]
    copies: int = 1
    include_usage: bool = False  # stream: a usage chunk after the choices' last
    on_finish: Callable[[], None] | None = None  # called once, when the request ends
    _finished: bool = False

    @property
    def kind(self) -> Kind:
        return self.generations[0].kind

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks: (chat) every choice's role first, then the choices' pieces as
        they come, and each choice's final chunks (with tools, its calls; then its finish reason)
        as soon as it ends."""
        if self.kind == "chat.completion":
            for position, generation in enumerate(self.generations):
                for chunk in self._copies(position, generation.role_chunk()):
                    yield chunk
        async for position, piece in interleaved([g.pieces() for g in self.generations]):
            generation = self.generations[position]
            bodies = generation.final_chunks() if piece is None else [generation.chunk(piece)]
            for body in filter(
                None, bodies
            ):  # (a piece whose text is held back as a tool call gives none)
                for chunk in self._copies(position, body):
                    yield chunk

    async def collect(self) -> dict[str, Any]:
        """Run every choice to its end; the whole response object."""
        received: list[list[Piece]] = [[] for _ in self.generations]
        async for position, piece in interleaved([g.pieces() for g in self.generations]):
            if piece is not None:
                received[position].append(piece)
        bodies = [g.response(pieces) for g, pieces in zip(self.generations, received)]
        body = bodies[0]
        body["choices"] = [
            copy["choices"][0]
            for position, whole in enumerate(bodies)
            for copy in self._copies(position, whole)
        ]
        body["usage"] = self.usage().model_dump()
        return body

    def _copies(self, position: int, body: dict[str, Any]) -> list[dict[str, Any]]:
        """`body` (one choice's) for each choice that generation `position` stands for, indexed.
        (Copied after it was built, never built again: a completion's logprobs formatter counts
        text offsets as it formats.)"""
        first = position * self.copies
        return [
            {
                **body,
                "choices": [
                    {**(_with_own_call_ids(choice) if copy else choice), "index": first + copy}
                    for choice in body["choices"]
                ],
            }
            for copy in range(self.copies)
        ]

    def usage(self) -> Usage:
        """The prompt once (the choices share it); completion tokens summed over the choices."""
        prompt = len(self.generations[0].handle.prompt_ids)
        completion = self.copies * sum(g.completion_tokens for g in self.generations)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def usage_chunk(self) -> dict[str, Any]:
        return self.generations[0].usage_chunk(self.usage())

    def finish(self, status: str) -> None:
        """End the request (once; later calls do nothing): stop whatever of it still runs (the
        other choices when one failed, all of them when the client left; a no-op for a choice
        that is done), release its concurrency slot and count it, as one request whatever its n."""
        if self._finished:
            return
        self._finished = True
        for generation in self.generations:
            generation.engine.abort(generation.handle)
        if self.on_finish is not None:
            self.on_finish()
        metrics = self.generations[0].metrics
        metrics.requests.labels(status).inc()
        metrics.e2e.observe(time.monotonic() - self.generations[0].handle.submitted_at)
        if status == "aborted":
            metrics.disconnects.inc()


def _with_own_call_ids(choice: dict[str, Any]) -> dict[str, Any]:
    """A copied choice's tool calls with ids of their own: a client answers each call by its id."""
    for part in ("message", "delta"):
        if isinstance(choice.get(part), dict) and choice[part].get("tool_calls"):
            calls = [
                {**call, "id": new_call_id()} if "id" in call else call
                for call in choice[part]["tool_calls"]
            ]
            return {**choice, part: {**choice[part], "tool_calls": calls}}
    return choice
