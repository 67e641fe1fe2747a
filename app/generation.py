"""One request in flight at the edge: rounds from the engine → text deltas → OpenAI shapes.

Shared by streaming and non-streaming responses of both endpoints, so the text a client
gets is the same whichever way it asks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from app.metrics import Metrics
from app.schemas import Usage, completion_body
from service.async_engine import AsyncEngine, RequestHandle, RequestTimeout
from service.engine import RoundOutput
from service.detokenizer import TextStream
from service.stats import SpecDecodingStats

Kind = Literal["text_completion", "chat.completion"]


@dataclass
class Generation:
    kind: Kind
    model: str
    engine: AsyncEngine
    handle: RequestHandle
    text_stream: TextStream
    metrics: Metrics
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk
    on_finish: Callable[[], None] | None = None  # called once, when the request ends
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    completion_tokens: int = 0
    finish_reason: str | None = None
    _last_output_at: float | None = None
    _sent_text: bool = False

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat.completion" else "cmpl-") + self.request_id

    async def texts(self) -> AsyncIterator[str]:
        """Text deltas, one per round that released text; ends at a stop or the end."""
        async for output in self.engine.stream(self.handle):
            self._time(output)
            self.stats.observe(output)
            self.completion_tokens += len(output.token_ids)
            delta = self.text_stream.push(output.token_ids)
            if delta.stopped:
                self.finish_reason = "stop"
                self.engine.abort(self.handle)
            else:
                self.finish_reason = output.finish_reason
            if delta.text:
                if not self._sent_text:
                    self._sent_text = True
                    self.metrics.ttft.observe(time.monotonic() - self.handle.submitted_at)
                yield delta.text
            if delta.stopped:
                return
        if tail := self.text_stream.finish().text:
            yield tail

    def _time(self, output: RoundOutput) -> None:
        now = time.monotonic()
        if self._last_output_at is None and self.handle.started_at is not None:
            self.metrics.queue_time.observe(self.handle.started_at - self.handle.submitted_at)
        elif self._last_output_at is not None and output.token_ids:
            per_token = (now - self._last_output_at) / len(output.token_ids)
            for _ in output.token_ids:
                self.metrics.itl.observe(per_token)
        self._last_output_at = now
        self.metrics.record_round(output)

    def finish(self, status: str) -> None:
        """Account for the end of the request: outcome and end-to-end latency."""
        if self.on_finish is not None:
            self.on_finish, release = None, self.on_finish
            release()
        self.metrics.requests.labels(status).inc()
        self.metrics.e2e.observe(time.monotonic() - self.handle.submitted_at)
        if status == "aborted":
            self.metrics.disconnects.inc()

    async def collect(self) -> dict[str, Any]:
        """Run to the end; the whole response object."""
        text = "".join([piece async for piece in self.texts()])
        return self._body(text, self.finish_reason, self.usage(), chunk=False)

    def usage(self) -> Usage:
        prompt = len(self.handle.prompt_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                     total_tokens=prompt + self.completion_tokens)

    def chunk(self, text: str, role: bool = False) -> dict[str, Any]:
        body = self._body(text, None, self.usage() if self.continuous_usage else None, chunk=True, with_stats=False)
        if role:
            body["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return body

    def final_chunk(self) -> dict[str, Any]:
        return self._body(None, self.finish_reason, None, chunk=True)

    def usage_chunk(self) -> dict[str, Any]:
        body = self._body(None, None, self.usage(), chunk=True, with_stats=False)
        body["choices"] = []
        return body

    @staticmethod
    def status_of(error: Exception) -> str:
        return "timeout" if isinstance(error, RequestTimeout) else "error"

    @staticmethod
    def error_fields(error: Exception) -> dict[str, Any]:
        if isinstance(error, RequestTimeout):
            return {"message": str(error), "type": "timeout", "param": None, "code": "timeout"}
        return {"message": f"generation failed: {error}", "type": "server_error", "param": None, "code": None}

    def _body(self, text: str | None, finish_reason: str | None, usage: Usage | None, chunk: bool,
              with_stats: bool = True) -> dict[str, Any]:
        stats = self.stats.as_dict() if with_stats else {}
        return completion_body(self.kind, self.response_id, self.created, self.model, text, finish_reason,
                               stats, usage, chunk=chunk)
