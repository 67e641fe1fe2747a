"""OpenAI wire format: request and response models."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.settings import Strategy
from service.config import SpeculationMode


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class SpeculationOptions(BaseModel):
    """Extension: per-request speculation shape and draft strategy (server settings otherwise)."""

    model_config = ConfigDict(extra="forbid")

    mode: SpeculationMode | None = None
    k: int | None = Field(None, ge=0, le=64)
    w: int | None = Field(None, ge=0, le=64)
    strategy: Strategy | None = None


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat request served today; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    stream: bool = False
    user: str | None = None
    speculation: SpeculationOptions | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
