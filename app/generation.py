"""One choice in flight at the edge: rounds from its engine request → text deltas → OpenAI shapes.

Shared by streaming and non-streaming responses of both endpoints, so the text a client
gets is the same whichever way it asks. A request's choices, and its end, are `app/choices.py`'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from app.logprobs import LogprobsFormatter
from app.metrics import Metrics
from app.schemas import Usage, completion_body
from service.engine.async_engine import AsyncEngine, RequestHandle, RequestTimeout
from service.engine.outputs import RoundOutput
from service.engine.detokenizer import TextStream
from service.engine.logprobs import TokenLogprob
from service.engine.stats import SpecDecodingStats

Kind = Literal["text_completion", "chat.completion"]


@dataclass(frozen=True)
class Piece:
    """What one chunk carries: text that can be sent, and the logprobs of the tokens received
    since the previous piece (their text may have been held back until now)."""

    text: str
    logprobs: list[TokenLogprob]
    completion_tokens: int = 0  # the choice's tokens by then (its chunk may be sent after more came)


@dataclass
class Generation:
    """One choice: its engine request, text, logprobs and statistics, each chunk's body."""

    kind: Kind
    model: str
    engine: AsyncEngine
    handle: RequestHandle
    text_stream: TextStream
    metrics: Metrics
    continuous_usage: bool = False  # usage on every chunk (this choice's, as vLLM's)
    logprobs: LogprobsFormatter | None = None  # set when the request asked for logprobs
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    completion_tokens: int = 0
    finish_reason: str | None = None
    _last_output_at: float | None = None
    _sent_text: bool = False
    _unsent_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat.completion" else "cmpl-") + self.request_id

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text deltas, one per round that released text (or, with logprobs, reached a stop);
        ends at a stop or the end."""
        async for output in self.engine.stream(self.handle):
            self._time(output)
            self.stats.observe(output)
            self.completion_tokens += len(output.token_ids)
            self._unsent_logprobs.extend(output.logprobs or [])
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
                yield self._piece(delta.text)
            if delta.stopped:
                break
        else:
            if tail := self.text_stream.finish().text:
                yield self._piece(tail)
        if self._unsent_logprobs:  # tokens whose text was held back, cut by a stop, or empty
            yield self._piece("")

    def _piece(self, text: str) -> Piece:
        piece, self._unsent_logprobs = Piece(text, self._unsent_logprobs, self.completion_tokens), []
        return piece

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

    def response(self, pieces: list[Piece]) -> dict[str, Any]:
        """The whole response object, of all the pieces this choice gave."""
        logprobs = [lp for piece in pieces for lp in piece.logprobs]
        return self._body("".join(p.text for p in pieces), self.finish_reason, self.usage(), chunk=False,
                          logprobs=logprobs)

    def usage(self, completion_tokens: int | None = None) -> Usage:
        """This choice's usage: its tokens so far, or `completion_tokens`."""
        prompt = len(self.handle.prompt_ids)
        completion = self.completion_tokens if completion_tokens is None else completion_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def chunk(self, piece: Piece, role: bool = False) -> dict[str, Any]:
        usage = self.usage(piece.completion_tokens) if self.continuous_usage else None
        body = self._body(piece.text, None, usage, chunk=True, with_stats=False,
                          logprobs=None if role else piece.logprobs)
        if role:
            body["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return body

    def final_chunk(self) -> dict[str, Any]:
        return self._body(None, self.finish_reason, None, chunk=True)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._body(None, None, usage, chunk=True, with_stats=False)
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
              with_stats: bool = True, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        stats = self.stats.as_dict() if with_stats else {}
        formatted = None if self.logprobs is None or logprobs is None else self.logprobs.format(logprobs)
        return completion_body(self.kind, self.response_id, self.created, self.model, text, finish_reason,
                               stats, usage, chunk=chunk, logprobs=formatted)
