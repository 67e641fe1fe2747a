"""Anthropic's Messages wire format: requests, the message, stream events and errors.

Fields the server has no use for but clients send as a matter of course are accepted and
ignored: `cache_control` on blocks and tools (the prefix cache reuses every shared prefix
anyway), `metadata`, `service_tier`, a block's `citations`. `thinking` is accepted too; a model
without a reasoning parser answers without thinking blocks, as a model that does not think.
Blocks this server cannot read (images, documents, server tools) are refused by their `type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.schemas import (
    FUNCTION_NAME,
    MAX_TOOLS,
    LenientPart,
    SpeculationOptions,
    SpeculativeDecodingStats,
    Text,
    check_unique_names,
    integral,
)


class TextBlock(LenientPart):
    type: Literal["text"]
    text: Text


class ToolUseBlock(LenientPart):
    """A call the assistant made (sent back in the conversation)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(LenientPart):
    """A call's result, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Text | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "".join(b.text for b in content)


class ThinkingBlock(LenientPart):
    """An earlier answer's reasoning: not shown to the model again (as chat templates drop it)."""

    type: Literal["thinking"]
    thinking: Text
    signature: str | None = None


class RedactedThinkingBlock(LenientPart):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


def _blocks_of(role: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The published rule: a `role` turn's blocks are of `kinds`."""
    blocks = {"type": "array", "items": {"properties": {"type": {"enum": list(kinds)}}}}
    return {
        "if": {"properties": {"role": {"const": role}}},
        "then": {"properties": {"content": {"anyOf": [{"type": "string"}, blocks]}}},
    }


class MessageParam(LenientPart):
    """One turn: a user's text and tool results, or an assistant's text, calls and thinking."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [_blocks_of("user", USER_BLOCKS), _blocks_of("assistant", ASSISTANT_BLOCKS)]
        }
    )

    role: Literal["user", "assistant"]
    content: Text | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> MessageParam:
        allowed = USER_BLOCKS if self.role == "user" else ASSISTANT_BLOCKS
        if wrong := sorted({b.type for b in self.blocks() if b.type not in allowed}):
            raise ValueError(f"a {self.role} turn has no {', '.join(wrong)} blocks")
        return self

    def blocks(self) -> list[Any]:
        content = self.content
        return [TextBlock(type="text", text=content)] if isinstance(content, str) else content


class Tool(LenientPart):
    """A client tool (Anthropic's server tools, such as web search, are not served)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    input_schema: dict[str, Any] = Field(description="the JSON schema of the tool's input")


class _ToolChoice(LenientPart):
    disable_parallel_tool_use: bool = Field(False, description="at most one tool_use block")


class AutoToolChoice(_ToolChoice):
    type: Literal["auto"]


class AnyToolChoice(_ToolChoice):
    type: Literal["any"]


class ToolChoiceTool(_ToolChoice):
    type: Literal["tool"]
    name: str


class NoToolChoice(LenientPart):
    type: Literal["none"]


ToolChoice = Annotated[
    AutoToolChoice | AnyToolChoice | ToolChoiceTool | NoToolChoice, Field(discriminator="type")
]


class ThinkingEnabled(LenientPart):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)

    _whole = field_validator("budget_tokens", mode="before")(integral)  # 626.0 is 626


class ThinkingDisabled(LenientPart):
    type: Literal["disabled"]


class CountTokensRequest(LenientPart):
    """What `/v1/messages/count_tokens` reads: the prompt's parts of a message request."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            # a tool choice that asks for a call needs tools (which tool, no schema can say)
            "if": {
                "properties": {"tool_choice": {"properties": {"type": {"enum": ["any", "tool"]}}}},
                "required": ["tool_choice"],
            },
            "then": {
                "properties": {"tools": {"type": "array", "minItems": 1}},
                "required": ["tools"],
            },
        },
    )

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")] | None = (
        None
    )

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        check_unique_names([tool.name for tool in tools or []])
        return tools

    def system_text(self) -> str:
        system = self.system or ""
        return system if isinstance(system, str) else "".join(b.text for b in system)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = Field(None, description="stop strings (server-capped)")
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1, description="0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0 = all tokens")
    speculation: SpeculationOptions | None = None

    _whole = field_validator("max_tokens", "top_k", mode="before")(integral)  # 626.0 is 626


# --- responses (documented in the OpenAPI schema; the route builds them as dicts) ---------


class MessageTextBlock(BaseModel):
    type: Literal["text"]
    text: str


class MessageToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int = Field(description="the prompt's tokens computed")
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = Field(
        None, description="the prompt's tokens the prefix cache gave"
    )
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Annotated[MessageTextBlock | MessageToolUseBlock, Field(discriminator="type")]]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    speculative_decoding_stats: SpeculativeDecodingStats | None = Field(
        None, description="extension: what speculation did for this message"
    )


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error of these routes, as Anthropic sends it."""

    type: Literal["error"]
    error: AnthropicErrorDetail
