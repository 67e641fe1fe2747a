"""OpenAI wire format: requests, responses, stream chunks (plus our `speculation` extension)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from app.settings import Strategy
from service.engine.params import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SpeculationMode,
)


def _valid_unicode(text: str) -> str:
    """JSON may escape a lone surrogate ("\\ud800"); such a string is no text and no tokenizer takes
    it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"invalid Unicode: a lone surrogate at character {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def integral(value: Any) -> Any:
    """626.0 is the integer 626 (as JSON Schema reads it; strict validation would refuse it),
    while `"5"` and `true` stay refused. A token-id list's items alike."""
    if isinstance(value, list):
        return [integral(item) for item in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


MAX_REQUEST_SEED = 2**63 - 1  # a signed 64-bit integer, as OpenAI clients send it
MAX_N = 16  # choices per request: each sampled one is an engine request of its own
MAX_COMPLETION_LOGPROBS = 5  # alternatives per token on /v1/completions (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # alternatives per token on /v1/chat/completions (OpenAI's limit)


class StrictRequest(BaseModel):
    """Request parts are validated strictly, as their JSON schema reads: `"5"` is no integer
    and `false` no token id (pydantic's lax mode would take both)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class LenientPart(StrictRequest):
    """A request part of Anthropic's or the Responses API's: strict as the rest, unknown keys
    ignored (`cache_control`, and the fields newer clients send)."""

    model_config = ConfigDict(extra="ignore")


def check_unique_names(names: list[str]) -> None:
    """A request's tools are told apart by their names."""
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"tool names must be unique: {', '.join(twice)} more than once")


class SpeculationOptions(StrictRequest):
    """Extension: per-request speculation; unset fields take the server settings, and k and w
    may not exceed the server's `--spec-k` / `--spec-w`."""

    model_config = ConfigDict(extra="forbid")

    mode: SpeculationMode | None = None
    k: int | None = Field(None, ge=0, le=64)
    w: int | None = Field(None, ge=0, le=64)
    strategy: Strategy | None = None
    trace: bool = Field(
        False,
        description="a `speculation_trace` of each round: on every streamed chunk that carries "
        "one, and as the list of a choice's rounds in a whole response (docs/web-ui.md)",
    )

    _whole_options = field_validator("k", "w", mode="before")(integral)  # 626.0 is 626


class StreamOptions(StrictRequest):
    include_usage: bool = False
    # usage on every chunk (as vLLM), for exact per-token timing
    continuous_usage_stats: bool = False


# OpenAI fields this server does not implement, with the values that ask for nothing: any
# other value is refused with a 400 naming the field, on both routes alike.
UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),  # the legacy form of `tools` (and `tool_choice`), which chat takes
    "function_call": (None, "none"),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (
        None,
        1,
    ),  # candidates ranked by likelihood: not built (vLLM's v1 engine dropped it too)
}
# chat fields that completions refuse likewise, unless asking for nothing (a prompt has no tools)
CHAT_ONLY_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
}


def unsupported(
    name: str,
    defaults: dict[str, tuple[Any, ...]] = UNSUPPORTED_DEFAULTS,
    why: str = "not supported by this server",
) -> WithJsonSchema:
    """The published schema of an unsupported field: only the values that ask for nothing."""
    return WithJsonSchema(
        {
            "enum": list(defaults[name]),
            "description": f"{why}: only this value, which asks for nothing",
        }
    )


def asks_for_nothing(value: Any, harmless: tuple[Any, ...]) -> bool:
    """Whether `value` is one of the `harmless` values (`False == 0` in Python, but `logprobs: 0`
    asks for something and `false` does not)."""
    return any(value == h and isinstance(value, bool) == isinstance(h, bool) for h in harmless)


def refusing(defaults: dict[str, tuple[Any, ...]], why: str) -> Any:
    """A validator of `defaults`' fields that refuses any value but the ones asking for nothing."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if not asks_for_nothing(value, defaults[info.field_name]):  # type: ignore[index]
            raise ValueError(f"`{info.field_name}` {why}")
        return value

    return field_validator(*defaults)(check)


# A logit_bias key: a token id in decimal, as OpenAI's clients write it (at most ten digits,
# beyond any vocabulary); the published schema narrows it to the model's vocabulary once loaded.
TOKEN_ID_KEY = "0|[1-9][0-9]{0,9}"


def logit_bias_schema(token_id_key: str) -> dict[str, Any]:
    """The published schema of `logit_bias`, with keys matching the regex `token_id_key`."""
    bias = {
        "type": "object",
        "propertyNames": {"pattern": f"^({token_id_key})$"},
        "additionalProperties": {
            "type": "number",
            "minimum": -MAX_LOGIT_BIAS,
            "maximum": MAX_LOGIT_BIAS,
        },
    }
    return {
        "anyOf": [bias, {"type": "null"}],
        "description": f"token id (in decimal) -> bias added to its logit, in "
        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
    }


class TextFormat(StrictRequest):
    type: Literal["text"]


class JsonObjectFormat(StrictRequest):
    type: Literal["json_object"]


class JsonSchema(StrictRequest):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(..., max_length=64, pattern="^[a-zA-Z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the output always matches the schema, strict or not


class JsonSchemaFormat(StrictRequest):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class GenerationRequest(StrictRequest):
    """Fields common to both endpoints; unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(
        None,
        ge=0,
        le=2,
        description=f"0 = greedy; below {MIN_TEMPERATURE} also greedy "
        "(no sampling that close to 0)",
    )
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(
        None,
        ge=0,
        le=MAX_REQUEST_SEED,
        description="makes a sample reproducible; with `n` > 1, choice i samples with seed + i "
        "(mod 2^63): the very text a request of n = 1 with that seed gets",
    )
    stop: Text | list[Text] | None = Field(
        None, description="stop strings (count and length capped by the server)"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(
        1,
        ge=1,
        le=MAX_N,
        description=f"choices to generate (at most {MAX_N}; the server may allow fewer), each "
        "sampled on its own: with a `seed`, choice i uses seed + i (mod 2^63); greedy, the n "
        "choices are one text",
    )
    user: str | None = None
    speculation: SpeculationOptions | None = None
    # the logit controls, in the order they apply (service/engine/logits_adjuster.py, sampling.py)
    logit_bias: Annotated[
        dict[str, float] | None, WithJsonSchema(logit_bias_schema(TOKEN_ID_KEY))
    ] = None
    repetition_penalty: float | None = Field(
        None,
        ge=MIN_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description="vLLM's: divides positive (multiplies negative) logits of tokens in the prompt "
        "or the output; 1 = none (any value > 0 beyond these bounds would only saturate)",
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="subtracted from a token's logit per occurrence in the output",
    )
    presence_penalty: float | None = Field(
        None,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="subtracted from a token's logit if it occurs in the output",
    )
    min_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description="keep tokens with probability >= min_p × the largest (after temperature)",
    )
    # not implemented: only the values in UNSUPPORTED_DEFAULTS are accepted
    functions: Annotated[list[dict[str, Any]] | None, unsupported("functions")] = None
    function_call: Annotated[str | dict[str, Any] | None, unsupported("function_call")] = None
    response_format: ResponseFormat | None = Field(
        None,
        discriminator="type",
        description="`json_object`: the output is a JSON object; `json_schema`: it matches the "
        "schema (properties and items the schema does not describe are not generated)",
    )
    echo: Annotated[bool | None, unsupported("echo")] = None
    suffix: Annotated[str | None, unsupported("suffix")] = None
    best_of: Annotated[int | None, unsupported("best_of")] = None

    @field_validator("stop")
    @classmethod
    def _as_list(cls, stop: str | list[str] | None) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    # 626.0 is 626
    _whole_generation = field_validator("max_tokens", "top_k", "seed", "n", mode="before")(integral)

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids in decimal, biases in OpenAI's range (the vocabulary is the route's
        check)."""
        for token, value in (bias or {}).items():
            if not re.fullmatch(TOKEN_ID_KEY, token):
                raise ValueError(f'keys must be token ids in decimal (as "50256"), got {token!r}')
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {value} for {token}"
                )
        return bias

    _unsupported = refusing(UNSUPPORTED_DEFAULTS, "is not supported by this server")


class CompletionRequest(GenerationRequest):
    prompt: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    ) = Field(description="a string, a one-element list of strings, or token ids (never empty)")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | Literal[False] | None = (
        Field(
            None,
            description="each token's logprob and this many likeliest alternatives (raw: "
            "temperature 1); `false` (what some clients send by default) asks for none",
        )
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=0, description="chat only: here `logprobs` is the count (0 or null only)"
    )
    tools: Annotated[
        list[dict[str, Any]] | None, unsupported("tools", CHAT_ONLY_DEFAULTS, "chat only")
    ] = None
    tool_choice: Annotated[
        str | dict[str, Any] | None, unsupported("tool_choice", CHAT_ONLY_DEFAULTS, "chat only")
    ] = None

    _whole_completion = field_validator("prompt", "logprobs", "top_logprobs", mode="before")(
        integral
    )  # 626.0 is 626

    @field_validator("top_logprobs")
    @classmethod
    def _chat_only(cls, top_logprobs: int | None) -> int | None:
        if top_logprobs:  # silently ignoring it would answer without what was asked
            raise ValueError(
                "`top_logprobs` is a chat field; "
                "on completions `logprobs` is the number of alternatives"
            )
        return top_logprobs

    _chat_only_tools = refusing(CHAT_ONLY_DEFAULTS, "is supported on /v1/chat/completions only")

    @property
    def num_logprobs(self) -> int | None:
        """What the engine computes: None, or the number of alternatives per token."""
        return None if self.logprobs is None or self.logprobs is False else self.logprobs

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


class TextPart(StrictRequest):
    type: Literal["text"]
    text: Text


class FunctionCall(StrictRequest):
    name: str
    arguments: Text = Field(description="the arguments, as JSON text (as this server answers them)")


class AssistantToolCall(StrictRequest):
    """A call an assistant message made, as a response's `tool_calls` gave it."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(StrictRequest):
    """One turn; besides text, an assistant's tool calls and a tool's result, so that a client
    can send a conversation with tools back (the roles' rules are in the published schema too)."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"role": {"const": "tool"}}},
                    "then": {
                        "required": ["tool_call_id"],
                        "properties": {"tool_call_id": {"type": "string"}},
                    },
                },
                {
                    "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
                    "then": {
                        "required": ["content"],
                        "properties": {
                            "content": {"not": {"type": "null"}},
                            "tool_calls": {"type": "null"},
                        },
                    },
                },
            ]
        }
    )

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = Field(
        None, validate_default=True, description="null or absent only in an assistant message"
    )
    tool_calls: list[AssistantToolCall] | None = Field(
        None, description="assistant only: the calls it made"
    )
    tool_call_id: str | None = Field(
        None,
        validate_default=True,
        description="tool only, and required there: the call this is the result of",
    )

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(
        cls, content: str | list[TextPart] | None, info: ValidationInfo
    ) -> str | list[TextPart] | None:
        if content is None and info.data.get("role") != "assistant":
            raise ValueError("required (it may be null in an assistant message only)")
        return content

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_assistant(
        cls, calls: list[AssistantToolCall] | None, info: ValidationInfo
    ) -> list[AssistantToolCall] | None:
        if calls is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message makes tool calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if call_id is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs the `tool_call_id` of the call it answers")
        return call_id

    def text(self) -> str:
        if self.content is None:
            return ""
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


# OpenAI's rule for a function's name
FUNCTION_NAME = "^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128  # OpenAI's limit


class FunctionDefinition(StrictRequest):
    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="the JSON schema of the arguments; absent: none (`{}`)"
    )
    strict: bool | None = Field(
        None, description="the arguments always match `parameters`, strict or not"
    )


class ChatTool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: FunctionName


# the published rule that a `tool_choice` asking for a call (`required`, or a named function)
# comes with tools
CALL_NEEDS_TOOLS = {
    "if": {
        "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
        "required": ["tool_choice"],
    },
    "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
}


def tools_own_the_format(field: str, text_only: dict[str, Any]) -> dict[str, Any]:
    """The published rule that with tools shown (`tool_choice` not `none`) the answer's format
    is theirs: `field` asks for text only (`text_only`), or is null."""
    return {
        "if": {
            "properties": {
                "tools": {"type": "array", "minItems": 1},
                "tool_choice": {"not": {"const": "none"}},
            },
            "required": ["tools"],
        },
        "then": {"properties": {field: {"anyOf": [{"type": "null"}, text_only]}}},
    }


class ChatCompletionRequest(GenerationRequest):
    # Rules across fields, in the published schema too, so a client (or a fuzzer) that follows
    # the schema is never refused for them: top_logprobs above 0 needs `logprobs: true` (OpenAI's
    # rule); a `tool_choice` that asks for a call needs tools; with tools shown, the answer's
    # format is theirs (no `response_format`). (That a named function is one of `tools` no JSON
    # schema can say.)
    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                "required": ["top_logprobs"],
            },
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            "allOf": [
                CALL_NEEDS_TOOLS,
                tools_own_the_format(
                    "response_format", {"properties": {"type": {"const": "text"}}}
                ),
            ],
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="each token's logprob (raw: temperature 1)")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="likeliest alternatives per token; needs `logprobs: true`",
    )
    tools: list[ChatTool] | None = Field(
        None,
        max_length=MAX_TOOLS,
        description="functions the model may call (names unique); see `tool_choice`. A template "
        "without tool syntax gets them in a system message, its answer held to JSON (the server's "
        "docs)",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="`auto` (the default with tools): text or calls; `required`: one call or more; "
        "a named function (one of `tools`): calls of it only; `none`: the tools are not shown",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call per answer (default true)"
    )

    # 626.0 is 626
    _whole_chat = field_validator("max_completion_tokens", "top_logprobs", mode="before")(integral)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and info.data.get("logprobs") is not True:
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        return top_logprobs

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        check_unique_names([tool.function.name for tool in tools or []])
        return tools

    @property
    def num_logprobs(self) -> int | None:
        """What the engine computes: None, or the number of alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


# --- responses (documented in the OpenAPI schema; the routes build them as dicts) ---------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeDecodingStats(BaseModel):
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    k: int
    w: int
    accepted_by_strategy: dict[str, int]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TraceToken(BaseModel):
    """One committed token of a traced round."""

    text: str = Field(description="its text (a character split across tokens: the last one's)")
    source: str = Field(
        description="the strategy that drafted it, or `model` for the model's own token"
    )


class RoundTrace(BaseModel):
    """Extension (`speculation.trace`): what one round of speculative decoding did."""

    round: int = Field(description="the round's index in the choice, from 0")
    k: int = Field(description="speculations the round drafted (0: plain decoding)")
    w: int = Field(description="tokens per speculation")
    tree_size: int = Field(description="drafted tree nodes (the root excluded)")
    committed: int = Field(description="tokens the round committed")
    accepted: int = Field(description="drafted tokens the model agreed with")
    forecast_tokens_per_second: float | None = Field(
        description="the controller's forecast (auto mode; null otherwise)"
    )
    realized_tokens_per_second: float
    tokens: list[TraceToken]


class CompletionLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatTopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Open):
    content: list[ChatTokenLogprob] | None


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    speculative_decoding_stats: SpeculativeDecodingStats | None = None
    # a whole response's rounds, when the request asked for `speculation.trace`
    speculation_trace: list[RoundTrace] | None = None


class CompletionResponse(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # a streamed chunk's round, when the request asked for `speculation.trace`
    speculation_trace: RoundTrace | None = None


class MessageToolCall(_Open):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls only")
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    speculative_decoding_stats: SpeculativeDecodingStats | None = None
    # the rounds, when the request asked for `speculation.trace`
    speculation_trace: list[RoundTrace] | None = None


class ChatCompletionResponse(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class FunctionCallDelta(_Open):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Open):
    """A part of a streamed tool call: `id`, `type` and `function.name` come in its first part,
    `function.arguments` in fragments to be joined (this server sends each call whole, in one)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Open):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Open):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    speculative_decoding_stats: SpeculativeDecodingStats | None = None


class ChatCompletionChunk(_Open):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # the chunk's round, when the request asked for `speculation.trace`
    speculation_trace: RoundTrace | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, as OpenAI sends it."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(
        None, description="the context a request's prompt and answer share (once loaded)"
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizePromptRequest(StrictRequest):
    """vLLM's /tokenize of a prompt: its ids as /v1/completions encodes it."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="the tokenizer's BOS and the like")
    return_token_strs: bool = Field(
        False, description="also each token as the vocabulary spells it"
    )


class TokenizeChatRequest(StrictRequest):
    """vLLM's /tokenize of chat messages: the ids /v1/chat/completions prompts the model with
    (the chat template, and the tools as that route shows them)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(
        True, description="end with the opening of the assistant's turn, as a chat request does"
    )
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool = Field(
        False, description="also each token as the vocabulary spells it"
    )


TokenizeRequest = TokenizePromptRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    """vLLM's /detokenize: token ids (of the model's vocabulary) back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

    _whole_ids = field_validator("tokens", mode="before")(integral)


class DetokenizeResponse(BaseModel):
    prompt: str


# CompletionResponse doubles as its own chunk
STREAM_MODELS = (ChatCompletionChunk, CompletionResponse)


def named_event_stream_schema(events: str) -> dict[str, Any]:
    """One server-sent event of a stream that names its events (`event:` then `data:`)."""
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
        "description": events,
    }


def event_stream_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event: `data` is `[DONE]`, or JSON of a chunk or of an error.

    (`$ref`s point into the schema's components, where `app.main` puts `STREAM_MODELS`.)"""
    payload = {
        "anyOf": [
            {"$ref": f"#/components/schemas/{chunk.__name__}"},
            {"$ref": "#/components/schemas/ErrorResponse"},
        ]
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string"}},
        "if": {"properties": {"data": {"const": "[DONE]"}}},
        "else": {
            "properties": {
                "data": {"contentMediaType": "application/json", "contentSchema": payload}
            }
        },
    }


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries: each status answers with an `ErrorResponse`."""
    return {
        status: {"model": ErrorResponse, "description": ERROR_MEANINGS[status]}
        for status in statuses
    }


ERROR_MEANINGS = {
    400: "Invalid request (the field is named in `param`)",
    401: "Missing or wrong API key",
    404: "Unknown model, or no such stored response, file or batch (or batch jobs are off)",
    413: "Request body too large",
    429: "Queue full, or too many concurrent requests for this API key (see Retry-After)",
    500: "The engine failed on this request",
    503: "The model is not loaded yet",
    504: "The request timed out",
}


def completion_body(
    kind: Literal["text_completion", "chat.completion"],
    request_id: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: str | None,
    stats: dict[str, Any],
    usage: Usage | None,
    chunk: bool = False,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One response object or stream chunk, in either endpoint's shape (`tool_calls`: chat's
    `message.tool_calls`, or a chunk's `delta.tool_calls`)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if kind == "text_completion":
        choice["text"] = text or ""
    else:
        message = {} if chunk and text is None else {"content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice["delta" if chunk else "message"] = (
            message if chunk else {"role": "assistant", **message}
        )
    choice["logprobs"] = logprobs
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
