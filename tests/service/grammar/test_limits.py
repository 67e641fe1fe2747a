"""The checks made before any compile: a source's bytes and its JSON nesting, and the cache key
that lets equal grammars share one compile."""

from __future__ import annotations

import json

import pytest

from service.grammar import GrammarError, GrammarLimits, GrammarSpec
from service.grammar.limits import cache_key, check_limits, json_depth
from tests.helpers.grammar import nested_schema


@pytest.mark.parametrize(
    "value, depth",
    [(3, 0), ([], 1), ({"a": [1, {"b": 2}]}, 3), ({"s": '{[{[\\"}]'}, 1), ([[[[]]]], 4)],
)
def test_json_depth_counts_brackets_outside_strings(value, depth) -> None:
    assert json_depth(json.dumps(value)) == depth


def test_a_source_over_the_byte_limit_is_refused_naming_the_field() -> None:
    spec = GrammarSpec("regex", "a" * 101, field="response_format")
    with pytest.raises(GrammarError) as refused:
        check_limits(spec, GrammarLimits(max_bytes=100))
    assert refused.value.field == "response_format" and "101 bytes" in str(refused.value)
    check_limits(GrammarSpec("regex", "a" * 100), GrammarLimits(max_bytes=100))


def test_a_schema_nested_past_the_depth_limit_is_refused_naming_the_field() -> None:
    limits = GrammarLimits(max_depth=21)
    check_limits(GrammarSpec("json_schema", json.dumps(nested_schema(10))), limits)
    spec = GrammarSpec("json_schema", json.dumps(nested_schema(11)), field="tools")
    with pytest.raises(GrammarError) as refused:
        check_limits(spec, limits)
    assert refused.value.field == "tools" and "23 levels" in str(refused.value)


def test_equal_grammars_written_apart_share_a_key_and_keep_their_order() -> None:
    spaced = GrammarSpec("json_schema", '{"b": 1,  "a": {"c": 2}}')
    tight = GrammarSpec("json_schema", '{"b":1,"a":{"c":2}}')
    reordered = GrammarSpec("json_schema", '{"a": {"c": 2}, "b": 1}')
    assert cache_key(spaced) == cache_key(tight) != cache_key(reordered)
    assert cache_key(GrammarSpec("regex", "a+")) != cache_key(GrammarSpec("regex", "a+ "))
