"""The checks made before any compile: a source's bytes and its JSON nesting, the cache key
that lets equal grammars share one compile, and the source text a schema is written to."""

from __future__ import annotations

import json

import pytest

from service.grammar import GrammarError, GrammarLimits, GrammarSpec
from service.grammar.compiler import json_source
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


@pytest.mark.parametrize(
    "value",
    [
        {"b": {"enum": ["é", "雪", "\u2028"]}, "a": [1, 2.5, None, True]},
        {"maximum": 10**30, "minimum": -(2**70), "properties": {"x": {"type": "integer"}}},
    ],
)
def test_a_schema_is_written_compact_in_its_order_and_reads_back_equal(value) -> None:
    """orjson writes it; integers past 64 bits, which orjson refuses, take json.dumps."""
    source = json_source(value)
    assert json.loads(source) == value
    assert list(json.loads(source)) == list(value)
    assert source == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
