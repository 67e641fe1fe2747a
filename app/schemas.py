"""OpenAI wire format: requests, responses, stream chunks (plus our `speculation` extension)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.settings import Strategy
from service.config import SpeculationMode


class SpeculationOptions(BaseModel):
    """Extension: per-request speculation; unset fields take the server settings."""

    model_config = ConfigDict(extra="forbid")

    mode: SpeculationMode | None = None
    k: int | None = Field(None, ge=0, le=64)
    w: int | None = Field(None, ge=0, le=64)
    strategy: Strategy | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (as vLLM), for exact per-token timing


class GenerationRequest(BaseModel):
    """Fields common to both endpoints; unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    speculation: SpeculationOptions | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ValueError("one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def completion_body(
    kind: Literal["text_completion", "chat.completion"], request_id: str, created: int, model: str,
    text: str | None, finish_reason: str | None, stats: dict[str, Any], usage: Usage | None,
    chunk: bool = False,
) -> dict[str, Any]:
    """One response object or stream chunk, in either endpoint's shape."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if kind == "text_completion":
        choice["text"] = text or ""
        choice["logprobs"] = None
    elif chunk:
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["message"] = {"role": "assistant", "content": text}
    if stats:
        choice["speculative_decoding_stats"] = stats
    body: dict[str, Any] = {
        "id": request_id,
        "object": kind + (".chunk" if chunk and kind == "chat.completion" else ""),
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body
