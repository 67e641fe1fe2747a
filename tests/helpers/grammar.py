"""A character-level vocabulary for the tiny models (64 tokens, id 1 the end of text) so their
random outputs can be held to a grammar, and the plain constrained decoding the engine must
equal."""

from __future__ import annotations

import json
from typing import Any

import torch

from service.engine.params import SamplingParams
from service.engine.sampling import PositionUniforms, choose_tokens
from service.grammar import Constraint, GrammarCompiler, GrammarSpec

EOS = 1
PIECES = [
    "<s>",
    "</s>",
    "{",
    "}",
    "[",
    "]",
    '"',
    ":",
    ",",
    " ",
    '{"',
    '": ',
    ', "',
    '"}',
    "true",
    "false",
    "null",
    "-",
    ".",
    *"0123456789",
    *(chr(c) for c in range(ord("a"), ord("z") + 1)),
    "name",
    "age",
    "id",
    "tags",
    '": "',
    '", "',
    '"]',
    '["',
    "10",
]
assert len(PIECES) == 64


def tiny_compiler() -> GrammarCompiler:
    return GrammarCompiler.for_vocabulary(PIECES, [EOS])


def text_of(token_ids: list[int]) -> str:
    """The text of a tiny-vocabulary output, its end-of-text token left out."""
    return "".join(PIECES[t] for t in token_ids if t != EOS)


def schema_spec(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def reference_constrained(
    model,
    compiler: GrammarCompiler,
    spec: GrammarSpec,
    prompt: list[int],
    num_tokens: int,
    sampling: SamplingParams,
) -> list[int]:
    """Plain decoding under the grammar with a full recompute per token: each token chosen from
    the masked logits (greedy: their argmax, no shortcut), up to the end-of-text token."""
    constraint = Constraint(compiler.compile(spec), [EOS])
    uniforms = None if sampling.greedy else PositionUniforms(sampling.seed)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
            masked = constraint.masked(logits)[None]  # [1, vocab]
            token = choose_tokens(
                masked, sampling, None if uniforms is None else uniforms.at([len(ids)])
            )[0]
            assert constraint.accept(token)
            ids.append(token)
            if token == EOS:
                break
    return ids[len(prompt) :]


def slow_schema(depth: int, salt: int = 0) -> dict[str, Any]:
    """A schema whose compile time grows about threefold a level (objects of three patterned
    strings, two of them objects again), while its text stays small: the hostile kind the
    compile time limit is for."""
    if depth == 0:
        return {"type": "string", "pattern": f"[a-z]{{1,{8 + salt % 5}}}"}
    properties = {
        f"k{salt}_{depth}_{i}": slow_schema(depth - 1 if i < 2 else 0, salt + i) for i in range(3)
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def nested_schema(depth: int) -> dict[str, Any]:
    """Objects nested `depth` deep, one property each."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema
