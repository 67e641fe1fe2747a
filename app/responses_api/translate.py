"""A Responses request as the chat request it asks for, and the chat answer as output items.

The input maps item by item: a string is a user message; messages keep their role and text;
`function_call` items are the calls of an assistant turn (joined to the assistant text before
them, as one turn made them), `function_call_output` items tool messages; reasoning items are
dropped (chat templates drop earlier reasoning too). `instructions` is a system message for this
turn only. A `previous_response_id` puts the stored conversation (its input and output, not its
instructions) before the new input, so the prompt starts as the last one did and the prefix
cache serves what was computed then.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.errors import ApiError
from app.responses_api.schemas import (
    EasyInputMessage,
    FunctionCallItem,
    FunctionCallOutputItem,
    NamedFunction,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from app.schemas import ChatCompletionRequest
from app.serving import chat_request

Conversation = list[dict[str, Any]]  # chat messages


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ChatForm:
    """What a Responses request asks for, in the chat route's terms."""

    chat: ChatCompletionRequest
    conversation: Conversation  # what a later turn continues: the earlier turns and this input


def chat_form(body: ResponsesRequest, earlier: Conversation, max_tokens: int) -> ChatForm:
    new = _input_messages(body)
    if not new:
        raise ApiError(400, "input: nothing to answer (reasoning items only)", param="input")
    conversation = earlier + new
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "messages": system + conversation,
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "speculation": body.speculation,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = choice
    return ChatForm(chat_request(fields, "input"), conversation)


def _input_messages(body: ResponsesRequest) -> Conversation:
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: Conversation = []
    for item in body.input:
        if isinstance(item, EasyInputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = None if body.text is None else body.text.format
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJsonSchema):
        schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": schema}
    return None


# --- the answer ---------------------------------------------------------------------------


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
    return {
        "type": "message",
        "id": new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    """The answer's reasoning (with a reasoning parser): not shown to the model again."""
    content = [reasoning_part(text)] if text else []
    return {
        "type": "reasoning",
        "id": new_id("rs"),
        "summary": [],
        "content": content,
        "status": status,
    }


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat tool call as a `function_call` item (its call id is the chat call's id)."""
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def answer_messages(output: list[dict[str, Any]]) -> Conversation:
    """The output items as the chat messages of the turn they make (for a later turn)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


@dataclass
class ResponseState:
    """One response as it goes: what the request asked, and what it has become."""

    body: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None

    def finish(
        self,
        output: list[dict[str, Any]],
        finish_reason: str | None,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        stats: dict[str, Any] | None,
    ) -> None:
        """The answer is whole: `incomplete` when it ran out of `max_output_tokens`."""
        self.output, self.stats = output, stats
        if finish_reason == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        self.usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        }

    def fail(self, code: str, message: str) -> None:
        self.status, self.error = "failed", {"code": code, "message": message}

    def as_dict(self) -> dict[str, Any]:
        """The response object (the request's settings echoed, as OpenAI does)."""
        body = self.body
        fmt = {"type": "text"} if body.text is None else body.text.format.model_dump(by_alias=True)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        choice = body.tool_choice
        response: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": body.background,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt},
            "tool_choice": choice.model_dump()
            if isinstance(choice, NamedFunction)
            else choice or "auto",
            "tools": tools,
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }
        if self.stats:
            response["speculative_decoding_stats"] = self.stats
        return response


def whole_output(chat: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a whole chat response."""
    answer = chat["choices"][0]["message"]
    items = [reasoning_item(answer["reasoning_content"])] if answer.get("reasoning_content") else []
    items += [message_item(answer["content"])] if answer.get("content") else []
    return items + [call_item(call) for call in answer.get("tool_calls") or []]


def finish_from_chat(state: ResponseState, chat: dict[str, Any], cached_tokens: int) -> None:
    """`state` made whole by a whole chat response (`cached_tokens`: of its prompt, those the
    prefix cache gave)."""
    choice, usage = chat["choices"][0], chat["usage"]
    state.finish(
        whole_output(chat),
        choice["finish_reason"],
        usage["prompt_tokens"],
        cached_tokens,
        usage["completion_tokens"],
        choice.get("speculative_decoding_stats"),
    )
