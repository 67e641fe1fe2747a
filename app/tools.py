"""Tool calls on chat: what a request's `tools`, `tool_choice` and `parallel_tool_calls` make
of its prompt, of the grammar its answer is held to, and of the answer's parsing.

A chat template with tool syntax (rendering with `tools=` differs from without) gets the tools
and the conversation's calls and results as they are, and its model is taken to answer in the
Hermes convention (Qwen2.5, Hermes, SmolLM3): `<tool_call>` blocks of JSON in free text. Under
`auto` the answer is free and its blocks are parsed; under `required` or a named function it is
held to a structural tag of one or more blocks (one with `parallel_tool_calls: false`), each a
call of an allowed function whose arguments match its `parameters`.

A template without (the embedded SmolLM2's) gets the *generic format*, as llama.cpp's server
does: a system message describes the tools and the answer's JSON, and a JSON-schema grammar
holds the answer to it, so even a model never trained on tools answers with well-formed calls.
The conversation's calls and results are written in the same convention. docs/architecture.md
("Tool calls") has the exact text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from app.errors import ApiError
from app.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    NamedToolChoice,
    TextFormat,
)
from app.tool_parsing import CALL_CLOSE, CALL_OPEN, ToolCallStream
from service.grammar import GrammarError, GrammarSpec
from service.grammar.compiler import check_schema_value, json_source
from service.model.prompts import chat_prompt_ids, renders_tools

NO_ARGUMENTS = {"type": "object"}  # a function without `parameters` (strict: only `{}`)
GENERIC_INTRO = (
    "You can call the following tools. Each is described by a JSON object: its name, its "
    "description and the JSON schema of its arguments."
)
GENERIC_CALLS = '{{"tool_calls": [{{"name": "{name}", "arguments": {{"<argument>": <value>}}}}]}}'
GENERIC_REPLY = '{"content": "<your reply>"}'
ANSWER_ONLY = "Answer with one JSON object and nothing else"
# whitespace in a Hermes call's JSON, at most, between two tokens: a model cannot pad forever
HERMES_WHITESPACE = 1


@dataclass(frozen=True)
class ToolUse:
    """What the request's tools ask: which the prompt lists, which the answer may call, how."""

    # shown to the model: none with `tool_choice: "none"`
    listed: tuple[FunctionDefinition, ...] = ()
    required: bool = False  # `required` or a named function: at least one call
    named: str | None = None  # the one function the answer may call, if named
    parallel: bool = True  # more than one call per answer
    native: bool = False  # the template renders the tools: Hermes answers (else the generic format)

    @property
    def allowed(self) -> tuple[FunctionDefinition, ...]:
        return tuple(tool for tool in self.listed if self.named in (None, tool.name))

    def grammar(self) -> GrammarSpec | None:
        """What the answer must match: the generic format always, Hermes blocks when a call is
        required; None without tools, or for a Hermes `auto` answer (free text, parsed after)."""
        if not self.listed or (self.native and not self.required):
            return None
        return _hermes_grammar(self) if self.native else _generic_grammar(self)

    def output_parser(self, id_seed: bytes | None = None) -> ToolCallStream | None:
        """A new parser of one choice's answer, or None when the answer is plain text
        (`id_seed`: see `ToolCallStream`)."""
        if not self.listed:
            return None
        return ToolCallStream("hermes" if self.native else "generic", id_seed)


def tool_use(body: ChatCompletionRequest) -> ToolUse:
    """The request's tool use, checked across its fields (each field alone is the schema's):
    400 naming the field for a named function not in `tools`, `required` without tools, a
    `response_format` beside tools, or a function's `parameters` the grammar cannot enforce."""
    tools = tuple(tool.function for tool in body.tools or [])
    choice = body.tool_choice or ("auto" if tools else "none")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in {tool.name for tool in tools}:
        raise ApiError(
            400, f"tool_choice: no function named {named!r} in `tools`", param="tool_choice"
        )
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice: `required` needs `tools`", param="tool_choice")
    if choice == "none" or not tools:
        return ToolUse()
    if body.response_format is not None and not isinstance(body.response_format, TextFormat):
        raise ApiError(
            400,
            "response_format: the answer's format is the tools' (use `tool_choice: \"none\"` to "
            "ask for a response_format)",
            param="response_format",
        )
    use = ToolUse(
        tools,
        required=choice == "required" or named is not None,
        named=named,
        parallel=body.parallel_tool_calls is not False,
    )
    for index, tool in enumerate(tools):
        if named in (None, tool.name):
            try:
                check_schema_value(
                    tool.parameters or NO_ARGUMENTS, f"tools.{index}.function.parameters"
                )
            except GrammarError as error:
                raise ApiError(400, str(error), param=error.field) from error
    return use


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[ChatMessage],
    use: ToolUse,
    add_generation_prompt: bool = True,
) -> tuple[list[int], ToolUse]:
    """The prompt's token ids, and `use` with the template's convention (tokenizer calls: on
    a worker thread, under the tokenizer's lock)."""
    opened = add_generation_prompt
    if not use.listed and not any(m.role == "tool" or m.tool_calls for m in messages):
        plain = [{"role": m.role, "content": m.text()} for m in messages]
        return chat_prompt_ids(tokenizer, plain, add_generation_prompt=opened), use
    use = replace(use, native=renders_tools(tokenizer))
    if use.native:
        tools = [
            {"type": "function", "function": tool.model_dump(exclude_none=True)}
            for tool in use.listed
        ]
        native = [_native(m) for m in messages]
        return chat_prompt_ids(tokenizer, native, tools or None, opened), use
    generic = generic_messages(messages, use)
    return chat_prompt_ids(tokenizer, generic, add_generation_prompt=opened), use


def _native(message: ChatMessage) -> dict[str, Any]:
    """A message as templates with tool syntax take it (a call's arguments as an object, as
    they write them out)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _arguments(text: str) -> Any:
    """A call's arguments: the JSON value of their text, or the text if it is no JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# --- the generic format -------------------------------------------------------------------


def generic_prompt(use: ToolUse) -> str:
    """The system text that describes the tools and the answer's JSON."""
    described = [
        json.dumps(
            {
                "name": tool.name,
                **({"description": tool.description} if tool.description else {}),
                "parameters": tool.parameters or NO_ARGUMENTS,
            },
            ensure_ascii=False,
        )
        for tool in use.listed
    ]
    calls = "one or more tools (one entry per call)" if use.parallel else "one tool"
    if use.named is not None:
        answer = (
            f'{ANSWER_ONLY}, calling the tool "{use.named}": {GENERIC_CALLS.format(name=use.named)}'
        )
    elif use.required:
        answer = f"{ANSWER_ONLY}, calling {calls}: {GENERIC_CALLS.format(name='<tool name>')}"
    else:
        answer = (
            f"{ANSWER_ONLY}: either {GENERIC_CALLS.format(name='<tool name>')} to call {calls}, "
            f"or {GENERIC_REPLY} to reply directly."
        )
    return "\n\n".join([GENERIC_INTRO, "\n".join(described), answer])


def generic_messages(messages: Sequence[ChatMessage], use: ToolUse) -> list[dict[str, str]]:
    """The conversation for a template without tool syntax: an assistant's calls as the JSON
    answer it gave, tools' results as a user message (consecutive ones as one, for templates
    that want the roles to alternate), and, with tools, the generic prompt in the system message."""
    names = {call.id: call.function.name for m in messages for call in m.tool_calls or []}
    rendered: list[dict[str, str]] = []
    for position, message in enumerate(messages):
        if message.role == "tool":
            name = names.get(message.tool_call_id or "", "unknown")
            result = f"Tool result (call id {message.tool_call_id}, tool {name}):\n{message.text()}"
            if position and messages[position - 1].role == "tool":
                rendered[-1]["content"] += "\n\n" + result
            else:
                rendered.append({"role": "user", "content": result})
        elif message.tool_calls:
            answer: dict[str, Any] = {"content": message.text()} if message.text() else {}
            answer["tool_calls"] = [
                {"name": call.function.name, "arguments": _arguments(call.function.arguments)}
                for call in message.tool_calls
            ]
            rendered.append(
                {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)}
            )
        else:
            rendered.append({"role": message.role, "content": message.text()})
    if use.listed:
        if rendered[0]["role"] == "system":
            rendered[0] = {
                "role": "system",
                "content": f"{rendered[0]['content']}\n\n{generic_prompt(use)}",
            }
        else:
            rendered.insert(0, {"role": "system", "content": generic_prompt(use)})
    return rendered


def _generic_grammar(use: ToolUse) -> GrammarSpec:
    """`{"tool_calls": [calls of the allowed functions]}` (at least one; at most one unless
    parallel), or, under `auto`, that or `{"content": string}`."""
    calls: dict[str, Any] = {
        "type": "array",
        "items": _one_of([_call_schema(t) for t in use.allowed]),
        "minItems": 1,
    }
    if not use.parallel:
        calls["maxItems"] = 1
    calling = _object({"tool_calls": calls})
    schema = (
        calling if use.required else {"anyOf": [calling, _object({"content": {"type": "string"}})]}
    )
    schema["$defs"] = _argument_defs(use.allowed)
    return GrammarSpec("json_schema", json_source(schema), field="tools")


# --- Hermes blocks ------------------------------------------------------------------------


def _hermes_grammar(use: ToolUse) -> GrammarSpec:
    """One or more `<tool_call>` blocks (one unless parallel), a newline between two, each a
    call of an allowed function, and nothing else (xgrammar's structural tag)."""
    calls = [
        {
            "type": "json_schema",
            "json_schema": {**_call_schema(tool), "$defs": _argument_defs([tool])},
            "max_whitespace_cnt": HERMES_WHITESPACE,
        }
        for tool in use.allowed
    ]
    block = {
        "type": "tag",
        "begin": CALL_OPEN + "\n",
        "end": "\n" + CALL_CLOSE,
        "content": calls[0] if len(calls) == 1 else {"type": "or", "elements": calls},
    }
    blocks = {
        "type": "tags_with_separator",
        "tags": [block],
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": not use.parallel,
    }
    return GrammarSpec(
        "structural_tag", json_source({"type": "structural_tag", "format": blocks}), field="tools"
    )


# --- a call's schema ----------------------------------------------------------------------


def _call_schema(tool: FunctionDefinition) -> dict[str, Any]:
    """`{"name": <this function>, "arguments": <its parameters>}`, the arguments a reference
    into the `$defs` of `_argument_defs`."""
    return _object({"name": {"const": tool.name}, "arguments": {"$ref": f"#/$defs/{tool.name}"}})


def _argument_defs(tools: Sequence[FunctionDefinition]) -> dict[str, Any]:
    """Each function's parameters under its name, for a schema's root `$defs`: a parameters
    schema's own references (`#/$defs/...` of a pydantic model's) are rewritten to point into
    its place there, as they pointed into its root."""
    return {
        tool.name: _rooted(tool.parameters or NO_ARGUMENTS, f"#/$defs/{tool.name}")
        for tool in tools
    }


def _rooted(schema: Any, root: str) -> Any:
    if isinstance(schema, dict):
        return {
            key: root + value[1:]
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _rooted(value, root)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_rooted(value, root) for value in schema]
    return schema


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
