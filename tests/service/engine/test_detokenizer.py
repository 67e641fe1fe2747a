"""Incremental text deltas: multi-byte characters, rounds of several tokens, stop strings."""

from __future__ import annotations

import time

import pytest

from service.engine.detokenizer import TextStream, _longest_stop_prefix_suffix

TEXT = "Hello wörld 🙂 — 3 ≥ 2, 日本語 ok. Done."


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded.tokenizer


@pytest.mark.parametrize("round_size", [1, 2, 3, 7])
def test_deltas_join_to_the_full_decode(tokenizer, round_size: int) -> None:
    ids = tokenizer.encode(TEXT)
    stream = TextStream(tokenizer)
    deltas = [stream.push(ids[i : i + round_size]).text for i in range(0, len(ids), round_size)]
    deltas.append(stream.finish().text)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_a_character_split_across_tokens_waits_for_its_last_byte(tokenizer) -> None:
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1  # byte-level: the emoji spans tokens
    stream = TextStream(tokenizer)
    assert stream.push(ids[:1]).text == ""
    assert stream.push(ids[1:]).text == "🙂"


def test_an_unfinished_character_at_the_end_is_flushed_as_a_replacement(tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂")
    stream = TextStream(tokenizer)
    assert stream.push(ids[:-1]).text == "ok"
    assert stream.finish().text == tokenizer.decode(ids[:-1])[2:]  # " \ufffd"-like remainder


def test_special_tokens_are_not_text(tokenizer) -> None:
    stream = TextStream(tokenizer)
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    assert stream.push(ids).text + stream.finish().text == "Hi"


@pytest.mark.parametrize("round_size", [1, 2, 5])
def test_stop_string_across_rounds_is_cut_and_never_sent(tokenizer, round_size: int) -> None:
    ids = tokenizer.encode("The answer is 42.\nQuestion: next")
    stream = TextStream(tokenizer, stop=["\nQuestion:"])
    sent = ""
    for i in range(0, len(ids), round_size):
        delta = stream.push(ids[i : i + round_size])
        sent += delta.text
        if delta.stopped:
            break
    assert stream.stopped and sent == "The answer is 42."


def test_held_back_text_that_was_not_a_stop_is_released(tokenizer) -> None:
    stream = TextStream(tokenizer, stop=["STOP"])
    first = stream.push(tokenizer.encode("go ST"))
    assert first.text == "go " and not first.stopped  # "ST" might begin "STOP"
    assert stream.push(tokenizer.encode("AY")).text == "STAY"
    assert stream.finish().text == ""


def test_the_earliest_of_several_stops_wins(tokenizer) -> None:
    stream = TextStream(tokenizer, stop=["c", "b"])
    delta = stream.push(tokenizer.encode("a b c"))
    assert delta.stopped and delta.text == "a "


@pytest.mark.parametrize(
    "text,stops,held",
    [
        ("the end is ne", ["near"], 2),  # "ne" may begin "near"
        ("abab", ["ababc"], 4),  # overlapping prefixes: the longest
        ("aab", ["ab", "aab!"], 3),  # "aab" begins the second stop
        ("xyz", ["abc"], 0),
        ("", ["abc"], 0),
        ("aaaa", ["aaaaa"], 4),
    ],
)
def test_held_back_tail_is_the_longest_stop_prefix(text: str, stops: list[str], held: int) -> None:
    assert _longest_stop_prefix_suffix(text, stops) == held


def test_long_stop_strings_are_matched_in_linear_time() -> None:
    # Every candidate length fails only at its last character: checking each with
    # `startswith` was quadratic (5 * 10^11 character comparisons here: minutes; now ~1 s).
    n = 1_000_000
    started = time.perf_counter()
    assert _longest_stop_prefix_suffix("a" * n + "c", ["a" * n + "b"]) == 0
    assert _longest_stop_prefix_suffix("x" + "a" * n, ["a" * n + "b"]) == n
    assert time.perf_counter() - started < 10
