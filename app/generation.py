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
from app.reasoning import ReasoningStream
from app.schemas import Usage, completion_body
from app.tool_parsing import ToolCall, ToolCallStream
from app.trace import RoundTracer
from service.engine.async_engine import AsyncEngine, RequestHandle, RequestTimeout
from service.engine.detokenizer import TextStream
from service.engine.logprobs import TokenLogprob
from service.engine.outputs import RoundOutput
from service.engine.stats import SpecDecodingStats

Kind = Literal["text_completion", "chat.completion"]


@dataclass(frozen=True)
class Piece:
    """What one chunk carries: text that can be sent, and the logprobs of the tokens received
    since the previous piece (their text may have been held back until now)."""

    text: str
    logprobs: list[TokenLogprob]
    # the choice's tokens by then (its chunk may be sent after more came)
    completion_tokens: int = 0
    # the round's `speculation_trace` (app/trace.py), when the request asked for it
    trace: dict[str, Any] | None = None


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
    # set when the answer may hold tool calls (chat with tools)
    tool_calls: ToolCallStream | None = None
    # set when the server parses reasoning (chat with `--reasoning-parser`)
    reasoning: ReasoningStream | None = None
    # set when the request asked for `speculation.trace`: then every round gives a piece
    tracer: RoundTracer | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # of the prompt, the tokens the prefix cache gave
    finish_reason: str | None = None
    _last_output_at: float | None = None
    _sent_text: bool = False
    _unsent_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat.completion" else "cmpl-") + self.request_id

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text deltas, one per round that released text (or, with logprobs, reached a stop;
        traced, one per round); ends at a stop or the end."""
        async for output in self.engine.stream(self.handle):
            self._time(output)
            self.stats.observe(output)
            self.completion_tokens += len(output.token_ids)
            self.cached_prompt_tokens = output.cached_prompt_tokens
            self._unsent_logprobs.extend(output.logprobs or [])
            delta = self.text_stream.push(output.token_ids)
            if delta.stopped:
                self.finish_reason = "stop"
                self.engine.abort(self.handle)
            else:
                self.finish_reason = output.finish_reason
            trace = None if self.tracer is None else self.tracer.trace(output)
            if delta.text or trace is not None:
                if delta.text and not self._sent_text:
                    self._sent_text = True
                    self.metrics.ttft.observe(time.monotonic() - self.handle.submitted_at)
                yield self._piece(delta.text, trace)
            if delta.stopped:
                break
        else:
            if tail := self.text_stream.finish().text:
                yield self._piece(tail)
        if self._unsent_logprobs:  # tokens whose text was held back, cut by a stop, or empty
            yield self._piece("")

    def _piece(self, text: str, trace: dict[str, Any] | None = None) -> Piece:
        piece, self._unsent_logprobs = (
            Piece(text, self._unsent_logprobs, self.completion_tokens, trace),
            [],
        )
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
        return self._with_traces(self._response(pieces), pieces)

    def _with_traces(self, body: dict[str, Any], pieces: list[Piece]) -> dict[str, Any]:
        """`body` with the choice's rounds, when the request asked for `speculation.trace`."""
        if self.tracer is not None:
            body["choices"][0]["speculation_trace"] = [p.trace for p in pieces if p.trace]
        return body

    def _response(self, pieces: list[Piece]) -> dict[str, Any]:
        logprobs = [lp for piece in pieces for lp in piece.logprobs]
        reasoning, text = self._split("".join(p.text for p in pieces), final=True)
        if self.tool_calls is None:
            body = self._body(
                text, self.finish_reason, self.usage(), chunk=False, logprobs=logprobs
            )
            return self._with_reasoning(body, "message", reasoning)
        content = self.tool_calls.push(text)  # the stream's split, so both ways answer alike
        rest = self.tool_calls.finish()
        content += rest.content
        body = self._body(
            None if rest.calls and not content else content,
            self._finish_reason(rest.calls),
            self.usage(),
            chunk=False,
            logprobs=logprobs,
            tool_calls=[call.as_openai() for call in rest.calls],
        )
        return self._with_reasoning(body, "message", reasoning)

    def _split(self, text: str, final: bool = False) -> tuple[str, str]:
        """`text` as (reasoning, answer); all answer without a reasoning parser."""
        if self.reasoning is None:
            return "", text
        split = self.reasoning.push(text)
        reasoning, answer = split.reasoning, split.answer
        if final:
            rest = self.reasoning.finish()
            reasoning, answer = reasoning + rest.reasoning, answer + rest.answer
        return reasoning, answer

    def _with_reasoning(self, body: dict[str, Any], part: str, reasoning: str) -> dict[str, Any]:
        """`body` with the choice's `reasoning_content` (vLLM's name), where reasoning is parsed:
        a response's message always, a chunk's delta when it carries some."""
        if self.reasoning is not None and (reasoning or part == "message"):
            body["choices"][0][part]["reasoning_content"] = reasoning or None
        return body

    def _finish_reason(self, calls: list[ToolCall]) -> str | None:
        """`tool_calls` for an answer that made calls, unless it was cut short."""
        return "tool_calls" if calls and self.finish_reason != "length" else self.finish_reason

    def usage(self, completion_tokens: int | None = None) -> Usage:
        """This choice's usage: its tokens so far, or `completion_tokens`."""
        prompt = len(self.handle.prompt_ids)
        completion = self.completion_tokens if completion_tokens is None else completion_tokens
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def role_chunk(self) -> dict[str, Any]:
        """The stream's first chunk for this choice: its role (content null where the answer may
        be calls only, as the whole response's is then, and as OpenAI streams it)."""
        body = self._body("", None, self._chunk_usage(0), chunk=True, with_stats=False)
        body["choices"][0]["delta"] = {
            "role": "assistant",
            "content": "" if self.tool_calls is None else None,
        }
        return body

    def chunk(self, piece: Piece) -> dict[str, Any] | None:
        """The chunk of `piece`; None when it carries nothing (its text held back as a possible
        tool call or tag, and no logprobs or trace)."""
        reasoning, answer = self._split(piece.text)
        text: str | None = answer
        if self.tool_calls is not None:
            text = self.tool_calls.push(answer) or None
        elif self.reasoning is not None:
            text = answer or None
        if (
            text is None
            and not reasoning
            and not (self.logprobs and piece.logprobs)
            and piece.trace is None
        ):
            return None
        body = self._body(
            text,
            None,
            self._chunk_usage(piece.completion_tokens),
            chunk=True,
            with_stats=False,
            logprobs=piece.logprobs,
        )
        if piece.trace is not None:
            body["speculation_trace"] = piece.trace
        return self._with_reasoning(body, "delta", reasoning)

    def final_chunks(self) -> list[dict[str, Any]]:
        """The choice's last chunks: with tools, the content held back and each call (whole,
        in one part), then the one with the finish reason and statistics. (Before them, what
        the reasoning parser held back.)"""
        usage = self._chunk_usage(self.completion_tokens)
        chunks, answer = [], ""
        if self.reasoning is not None:
            held = self.reasoning.finish()
            if held.reasoning:
                body = self._body(None, None, usage, chunk=True, with_stats=False)
                chunks.append(self._with_reasoning(body, "delta", held.reasoning))
            answer = held.answer
        if self.tool_calls is None:
            if answer:
                chunks.append(self._body(answer, None, usage, chunk=True, with_stats=False))
            return [*chunks, self._body(None, self.finish_reason, None, chunk=True)]
        content = self.tool_calls.push(answer) if answer else ""
        rest = self.tool_calls.finish()
        content += rest.content
        if content:
            chunks.append(self._body(content, None, usage, chunk=True, with_stats=False))
        chunks += [
            self._body(
                None, None, usage, chunk=True, with_stats=False, tool_calls=[call.as_delta(index)]
            )
            for index, call in enumerate(rest.calls)
        ]
        return [*chunks, self._body(None, self._finish_reason(rest.calls), None, chunk=True)]

    def _chunk_usage(self, completion_tokens: int) -> Usage | None:
        return self.usage(completion_tokens) if self.continuous_usage else None

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
        return {
            "message": f"generation failed: {error}",
            "type": "server_error",
            "param": None,
            "code": None,
        }

    def _body(
        self,
        text: str | None,
        finish_reason: str | None,
        usage: Usage | None,
        chunk: bool,
        with_stats: bool = True,
        logprobs: list[TokenLogprob] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        stats = self.stats.as_dict() if with_stats else {}
        formatted = (
            None if self.logprobs is None or logprobs is None else self.logprobs.format(logprobs)
        )
        return completion_body(
            self.kind,
            self.response_id,
            self.created,
            self.model,
            text,
            finish_reason,
            stats,
            usage,
            chunk=chunk,
            logprobs=formatted,
            tool_calls=tool_calls,
        )
