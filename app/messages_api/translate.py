"""A Messages request as the chat request it asks for, and the chat answer as a message.

The conversation maps turn by turn: `system` becomes a system message; a user turn's
`tool_result` blocks become tool messages (before its text, where Anthropic puts them); an
assistant turn's `tool_use` blocks become its tool calls, its thinking blocks are dropped (chat
templates drop earlier reasoning too); text blocks of one turn are joined by blank lines. Tools
and `tool_choice` map to chat's (`any` is `required`, `disable_parallel_tool_use` is
`parallel_tool_calls: false`), so tool calls use the chat route's machinery unchanged. A final
assistant turn of text is a prefill: the answer continues it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.errors import ApiError
from app.messages_api.schemas import (
    AnyToolChoice,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    NoToolChoice,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from app.schemas import ChatCompletionRequest
from app.serving import chat_request

ERROR_RESULT = "Error: "  # how a tool_result with `is_error` reads to the model
BLOCK_SEPARATOR = "\n\n"  # between text blocks of one turn


@dataclass(frozen=True)
class ChatForm:
    """What a Messages request asks for, in the chat route's terms."""

    chat: ChatCompletionRequest
    prefill: str | None  # a final assistant turn's text, which the answer continues


def chat_form(body: CountTokensRequest) -> ChatForm:
    """The chat request of `body` (its sampling and limits too, for a MessagesRequest)."""
    turns = list(body.messages)
    prefill = _prefill(turns[-1])
    if prefill is not None:
        turns.pop()
        if body.tools:
            raise ApiError(
                400,
                "messages: a final assistant turn (a prefill) cannot be continued with tools",
                param="messages",
            )
    messages: list[dict[str, Any]] = []
    if system := body.system_text():
        messages.append({"role": "system", "content": system})
    for turn in turns:
        messages.extend(_chat_messages(turn))
    if not messages:
        raise ApiError(400, "messages: nothing to answer but a prefill", param="messages")
    fields: dict[str, Any] = {"messages": messages, **_tools(body)}
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "stream": body.stream,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "speculation": body.speculation,
        }
    return ChatForm(chat_request(fields, "messages"), prefill)


def _prefill(turn: MessageParam) -> str | None:
    blocks = turn.blocks()
    if turn.role != "assistant" or not all(isinstance(b, TextBlock) for b in blocks):
        return None
    return BLOCK_SEPARATOR.join(b.text for b in blocks)


def _chat_messages(turn: MessageParam) -> list[dict[str, Any]]:
    blocks = turn.blocks()
    text = BLOCK_SEPARATOR.join(b.text for b in blocks if isinstance(b, TextBlock))
    if turn.role == "assistant":
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
            }
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        elif not text and any(isinstance(b, ThinkingBlock) for b in blocks):
            message["content"] = ""  # a turn of reasoning only: an empty answer
        return [message]
    results = [
        {
            "role": "tool",
            "tool_call_id": b.tool_use_id,
            "content": (ERROR_RESULT if b.is_error else "") + b.text(),
        }
        for b in blocks
        if isinstance(b, ToolResultBlock)
    ]
    has_text = any(isinstance(b, TextBlock) for b in blocks)
    return results + ([{"role": "user", "content": text}] if has_text or not results else [])


def _tools(body: CountTokensRequest) -> dict[str, Any]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.input_schema,
            },
        }
        for tool in body.tools or []
    ]
    choice = body.tool_choice
    if choice is None:
        return {"tools": tools or None}
    if isinstance(choice, NoToolChoice):
        return {"tools": tools or None, "tool_choice": "none"}
    chat_choice: Any = "auto"
    if isinstance(choice, AnyToolChoice):
        chat_choice = "required"
    elif isinstance(choice, ToolChoiceTool):
        chat_choice = {"type": "function", "function": {"name": choice.name}}
    return {
        "tools": tools or None,
        "tool_choice": chat_choice,
        "parallel_tool_calls": not choice.disable_parallel_tool_use,
    }


# chat's names of the fields the Messages API names otherwise
FIELD_NAMES = {".function.parameters": ".input_schema", "`tools`": "`tools` (by name)"}


# --- the answer ---------------------------------------------------------------------------


def stop_reason(finish_reason: str | None, stop_string: str | None) -> StopReason:
    """Anthropic's reason for chat's finish reason (a stop string: `stop_sequence`)."""
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a `tool_use` block; arguments that are no JSON object (a free
    answer's call, unconstrained) come as `{"arguments": value}`."""
    arguments = json.loads(call["function"]["arguments"])
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": arguments if isinstance(arguments, dict) else {"arguments": arguments},
    }


def message_body(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: StopReason | None,
    stop_sequence: str | None,
    usage: dict[str, int | None],
    stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }
    if stats:
        body["speculative_decoding_stats"] = stats
    return body


def message_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` those of the prompt computed, `cache_read_input_tokens`
    those the prefix cache gave (their sum is the prompt); caching is automatic, so none are
    counted as `cache_creation_input_tokens`."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def whole_message(
    message_id: str, model: str, chat: dict[str, Any], stop_string: str | None, cached_tokens: int
) -> dict[str, Any]:
    """The message of a whole chat response (`cached_tokens`: of its prompt, those the prefix
    cache gave)."""
    choice = chat["choices"][0]
    answer = choice["message"]
    content = []
    if answer.get("reasoning_content"):
        thinking = answer["reasoning_content"]
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if answer.get("content"):
        content.append({"type": "text", "text": answer["content"]})
    content += [tool_use_block(call) for call in answer.get("tool_calls") or []]
    reason = stop_reason(choice["finish_reason"], stop_string)
    return message_body(
        message_id,
        model,
        content,
        reason,
        stop_string if reason == "stop_sequence" else None,
        message_usage(
            chat["usage"]["prompt_tokens"], cached_tokens, chat["usage"]["completion_tokens"]
        ),
        choice.get("speculative_decoding_stats"),
    )
