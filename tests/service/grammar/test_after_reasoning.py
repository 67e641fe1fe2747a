"""A grammar behind a reasoning section: the reasoning is free text up to `</think>`, and what
follows it is held to the grammar, whether the output or the prompt opened the reasoning."""

from __future__ import annotations

import json

import pytest
import xgrammar

from service.grammar import GrammarCompiler, GrammarSpec
from service.grammar.limits import cache_key

PIECES = ["<s>", "</s>", "<think>", "</think>", "\n", *(chr(c) for c in range(32, 127))]
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
COMPILER = GrammarCompiler.for_vocabulary(PIECES, stop_ids=[1])


def matches(spec: GrammarSpec, text: str) -> bool:
    """Whether `text` is a whole output `spec` allows."""
    matcher = xgrammar.GrammarMatcher(COMPILER.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(
    "reasoning,text,allowed",
    [
        ("none", '{"a": 1}', True),
        ("none", '<think>hm</think>{"a": 1}', False),
        ("may_open", '<think>x < y, {"a": </think>\n\n{"a": 1}', True),
        ("may_open", '{"a": 1}', True),  # no reasoning at all
        ("may_open", '<think>x</think>{"a": "one"}', False),  # the answer still holds
        ("may_open", 'so {"a": 1}', False),  # text outside a reasoning section
        ("may_open", '<think>x</think>\n\n\n\n\n{"a": 1}', False),  # padding is bounded
        ("opened", 'x < y</think>{"a": 1}', True),
        ("opened", '{"a": 1}', False),  # the prompt opened the reasoning: it must close
    ],
)
def test_the_reasoning_is_free_and_the_answer_after_it_held(reasoning, text, allowed) -> None:
    assert matches(GrammarSpec("json_schema", SCHEMA, reasoning=reasoning), text) is allowed


def test_a_grammar_behind_reasoning_is_kept_apart_from_the_same_grammar_alone() -> None:
    alone, behind = GrammarSpec("json_object"), GrammarSpec("json_object", reasoning="may_open")
    assert cache_key(alone) != cache_key(behind)


def test_tool_call_blocks_follow_the_reasoning_too() -> None:
    block = {
        "type": "tag",
        "begin": "<call>",
        "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
        "end": "</call>",
    }
    source = json.dumps({"type": "structural_tag", "format": block})
    spec = GrammarSpec("structural_tag", source, field="tools", reasoning="may_open")
    assert matches(spec, "<think>which one?</think>\n<call>7</call>")
    assert not matches(spec, "<think>which one?</think>\n<call>seven</call>")
