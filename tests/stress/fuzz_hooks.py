"""Schemathesis hooks for `test_fuzz.py`: the request rules no JSON schema can state, applied to
the requests it generates as valid, so that "schema-valid request rejected" means a defect.

- A named `tool_choice` names one of `tools` (the schema says it needs tools, not which).
- Tool names are unique (JSON Schema's `uniqueItems` compares whole items, not one field).
- A completion prompt holds a token: the tokenizer drops a few control characters, so a prompt
  of nothing else is refused with 400 (tests/app/test_hardening.py), which a schema cannot know;
  such a prompt gets a letter appended.
- A JSON schema given to the grammar (`response_format`'s, a tool's `parameters`) compiles and
  uses only keywords the grammar enforces: the published schema calls it an object, and the
  grammar's own tests (tests/service/engine/test_structured_output.py) generate schemas.
Requests generated as invalid are left as they are: they must still be refused.
"""

from __future__ import annotations

import unicodedata
from typing import Any

import schemathesis
from schemathesis.generation import GenerationMode

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
        tool["function"]
        for tool in tools
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
    ]
    seen: set[str] = set()
    for index, function in enumerate(functions):
        if isinstance(function.get("name"), str) and function["name"] in seen:
            function["name"] = f"{function['name'][:56]}_{index}"
        seen.add(function.get("name"))
        if function.get("parameters") is not None:
            function["parameters"] = dict(GRAMMAR_SCHEMA)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) and functions:
        choice["function"]["name"] = functions[0].get("name")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and isinstance(response_format.get("json_schema"), dict):
        response_format["json_schema"]["schema"] = dict(GRAMMAR_SCHEMA)
    return case


def _tokenizable(prompt: Any) -> Any:
    """A string prompt (or a one-string list) made only of control characters, with a letter
    appended; token ids and anything else as they are."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return [_tokenizable(prompt[0])]
    if isinstance(prompt, str) and prompt and all(unicodedata.category(c) == "Cc" for c in prompt):
        return prompt + "a"
    return prompt
