"""Schemathesis hooks for `test_fuzz.py`: the request rules no JSON schema can state, applied to
the requests it generates as valid, so that "schema-valid request rejected" means a defect.

- A named `tool_choice` names one of `tools` (the schema says it needs tools, not which).
- Tool names are unique (JSON Schema's `uniqueItems` compares whole items, not one field).
- A completion prompt holds a token: the tokenizer drops a few control characters, so a prompt
  of nothing else is refused with 400 (tests/app/test_hardening.py), which a schema cannot know;
  such a prompt gets a letter appended.
- A JSON schema given to the grammar (`response_format`'s or `text.format`'s, a tool's
  `parameters` or `input_schema`) compiles and uses only keywords the grammar enforces: the
  published schema calls it an object, and the grammar's own tests
  (tests/service/engine/test_structured_output.py) generate schemas.
- A Messages request names the served model (Anthropic's `model` is required: another name is
  a 404, which would leave the route's own checks unexercised).
- A Messages request whose last turn is an assistant's text (a prefill) has no tools and some
  turn before it: such a request gets a user turn appended.
Requests generated as invalid are left as they are: they must still be refused.
"""

from __future__ import annotations

import unicodedata
from typing import Any

import schemathesis
from schemathesis.generation import GenerationMode

SERVED_MODEL = "tiny-random-llama"  # test_fuzz.py's
GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {"value": {"type": "integer"}},
    "required": ["value"],
}


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    meta = getattr(case, "meta", None)
    if (
        meta is None
        or meta.generation.mode != GenerationMode.POSITIVE
        or not isinstance(case.body, dict)
    ):
        return case
    body = case.body
    if "prompt" in body:
        body["prompt"] = _tokenizable(body["prompt"])
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    functions = [
        tool["function"] if "function" in tool else tool  # chat's, or Anthropic's
        for tool in tools
        if isinstance(tool, dict) and isinstance(tool.get("function", tool), dict)
    ]
    seen: set[str] = set()
    for index, function in enumerate(functions):
        if isinstance(function.get("name"), str) and function["name"] in seen:
            function["name"] = f"{function['name'][:56]}_{index}"
        seen.add(function.get("name"))
        for schema in ("parameters", "input_schema"):
            if function.get(schema) is not None:
                function[schema] = dict(GRAMMAR_SCHEMA)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) and functions:
        choice["function"]["name"] = functions[0].get("name")
    if isinstance(choice, dict) and choice.get("type") in ("tool", "function") and functions:
        choice["name"] = functions[0].get("name")  # Anthropic's and the Responses API's form
    if case.path.startswith("/v1/messages"):
        body["model"] = SERVED_MODEL
    if _ends_in_prefill(body.get("messages")):
        body["messages"].append({"role": "user", "content": "a"})
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and isinstance(response_format.get("json_schema"), dict):
        response_format["json_schema"]["schema"] = dict(GRAMMAR_SCHEMA)
    text = body.get("text")
    if (
        isinstance(text, dict)
        and isinstance(text.get("format"), dict)
        and "schema" in text["format"]
    ):
        text["format"]["schema"] = dict(GRAMMAR_SCHEMA)  # the Responses API's
    return case


def _tokenizable(prompt: Any) -> Any:
    """A string prompt (or a one-string list) made only of control characters, with a letter
    appended; token ids and anything else as they are."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return [_tokenizable(prompt[0])]
    if isinstance(prompt, str) and prompt and all(unicodedata.category(c) == "Cc" for c in prompt):
        return prompt + "a"
    return prompt


def _ends_in_prefill(messages: Any) -> bool:
    """A Messages conversation whose last turn is an assistant's text only."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return False
    last = messages[-1]
    content = last.get("content")
    blocks = content if isinstance(content, list) else [{"type": "text"}]
    return last.get("role") == "assistant" and all(
        isinstance(b, dict) and b.get("type") == "text" for b in blocks
    )
