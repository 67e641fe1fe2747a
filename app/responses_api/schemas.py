"""OpenAI's Responses wire format: the request, its input items, and the response object.

Accepted and ignored, as a server without them answers: `include`, `metadata` (echoed back),
`reasoning` (the server's `--reasoning-parser` decides whether answers carry reasoning items),
`truncation` `"disabled"`, `user`. Input this server cannot read (images, files, item
references, hosted tools such as web search) is refused by its `type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from app.schemas import (
    CALL_NEEDS_TOOLS,
    FUNCTION_NAME,
    MAX_TOOLS,
    LenientPart,
    SpeculationOptions,
    SpeculativeDecodingStats,
    Text,
    check_unique_names,
    integral,
    tools_own_the_format,
)


class InputText(LenientPart):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back
    text: Text


class EasyInputMessage(LenientPart):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(LenientPart):
    """A call an earlier answer made, sent back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: Text = Field(description="the arguments, as JSON text")
    id: str | None = None


class FunctionCallOutputItem(LenientPart):
    type: Literal["function_call_output"]
    call_id: str
    output: Text | list[InputText]

    def text(self) -> str:
        return _text(self.output)


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class ReasoningItem(LenientPart):
    """An earlier answer's reasoning: not shown to the model again (chat templates drop it)."""

    type: Literal["reasoning"]
    id: str | None = None


def _item_type(item: Any) -> str:
    """An input item's tag: its `type`, or `message` for a bare `{role, content}`."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")


InputItem = Annotated[
    Annotated[EasyInputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


# the published rule that an input list holds more than reasoning items
SOME_TO_ANSWER: dict[str, Any] = {
    "contains": {"not": {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]}}
}


class FunctionTool(LenientPart):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="the arguments always match, strict or not")


class NamedFunction(LenientPart):
    type: Literal["function"]
    name: str


class TextFormatText(LenientPart):
    type: Literal["text"]


class TextFormatJsonObject(LenientPart):
    type: Literal["json_object"]


class TextFormatJsonSchema(LenientPart):
    type: Literal["json_schema"]
    name: str = Field(max_length=64, pattern="^[a-zA-Z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(LenientPart):
    format: Annotated[
        TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
    ] = TextFormatText(type="text")


class ResponsesRequest(LenientPart):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "allOf": [
                CALL_NEEDS_TOOLS,
                tools_own_the_format(
                    "text", {"properties": {"format": {"properties": {"type": {"const": "text"}}}}}
                ),
                {  # a background response is stored, and not streamed
                    "if": {
                        "properties": {"background": {"const": True}},
                        "required": ["background"],
                    },
                    "then": {"properties": {"store": {"const": True}, "stream": {"const": False}}},
                },
            ]
        },
    )

    model: str | None = None
    input: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[InputItem], Field(min_length=1, json_schema_extra=SOME_TO_ANSWER)]
    )
    instructions: Text | None = Field(None, description="a system message, this turn's only")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool = False
    store: bool = Field(True, description="kept for retrieval and `previous_response_id`")
    background: bool = Field(False, description="answer at once; the response runs stored")
    previous_response_id: str | None = Field(
        None, description="continue a stored response's conversation (not its instructions)"
    )
    metadata: dict[str, str] | None = None
    user: str | None = None
    speculation: SpeculationOptions | None = None

    _whole = field_validator("max_output_tokens", mode="before")(integral)  # 626.0 is 626

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[FunctionTool] | None) -> list[FunctionTool] | None:
        check_unique_names([tool.name for tool in tools or []])
        return tools

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponsesRequest:
        if self.background and (self.stream or not self.store):
            raise ValueError("a background response is stored (`store: true`) and not streamed")
        return self


# --- responses (documented in the OpenAPI schema; the routes build them as dicts) ---------


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[dict[str, Any]]
    status: str


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A response, as created, retrieved, cancelled, or at a stream's end."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    model: str
    output: list[
        Annotated[OutputReasoning | OutputMessage | OutputFunctionCall, Field(discriminator="type")]
    ]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    usage: ResponseUsage | None
    previous_response_id: str | None
    speculative_decoding_stats: SpeculativeDecodingStats | None = None


class InputItemList(BaseModel):
    """A page of a response's input items (messages, function calls and their outputs,
    reasoning), each with its `id`."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool
