"""One function tool in the shape of each API (chat, Responses, Messages), so the tests of every
route call the same function and compare with the chat route's calls."""

from __future__ import annotations

from typing import Any

_NAME, _DESCRIPTION = "get_weather", "The weather in a city"
# a bounded string, so that a random model's call ends within a few tokens
_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": _NAME, "description": _DESCRIPTION, "parameters": _PARAMETERS},
}
RESPONSES_WEATHER = {"type": "function", **CHAT_WEATHER["function"]}
MESSAGES_WEATHER = {"name": _NAME, "description": _DESCRIPTION, "input_schema": _PARAMETERS}
