"""Grammars compiled against the served tokenizer, with the JSON-schema features they cannot
enforce refused up front.

The engine is xgrammar: against llguidance and outlines-core it computed a token's mask
fastest and built nothing slow before the first token (docs/benchmarks.md, "Structured
output"), and it enforced more keywords. Where it does not (`not`,
`if`/`then`/`else`, `uniqueItems`, `allOf` over more than one schema, ...), a schema using them
is refused with the field named, rather than served with output that could break it.

Output format: `strict_mode` (properties and items a schema does not describe are not
generated, as OpenAI's strict schemas ask) and no free whitespace (`{"a": 1, "b": [2, 3]}`:
one space after `:` and `,`), so a small model cannot pad forever and drafts see one spelling.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xgrammar

GrammarKind = Literal["json_object", "json_schema", "structural_tag", "regex"]
# where the output stands to a reasoning section (`<think>...</think>`) before what the grammar
# holds it to: none is allowed; the output may start with one; or the prompt opened one, so
# the output starts inside it
ReasoningStart = Literal["none", "may_open", "opened"]
REASONING_OPEN, REASONING_CLOSE = "<think>", "</think>"
# whitespace the output may put between its reasoning and the held part (Qwen3 writes "\n\n");
# bounded, so a small model cannot pad forever
_AFTER_REASONING = r"[ \t\r\n]{0,4}"

# keywords xgrammar accepts but does not enforce (checked: an instance breaking them passes)
UNENFORCED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "dependentSchemas",
        "unevaluatedProperties",
        "unevaluatedItems",
        "minContains",
        "maxContains",
        "$dynamicRef",
    }
)
# keywords whose value maps names to subschemas, and those whose value is one subschema or a list
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "contains", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


class GrammarError(ValueError):
    """A grammar this server cannot compile or enforce; `field` names the request field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match.

    `json_object`: any JSON object. `json_schema`: `source` is the schema's JSON text.
    `structural_tag`: `source` is an xgrammar structural tag (free text with tagged JSON, as a
    template's tool calls). `regex`: `source` is the pattern. `field` is what an error names.
    `reasoning`: the reasoning section allowed before the held part; the reasoning is free text.
    """

    kind: GrammarKind
    source: str = ""
    field: str = "response_format"
    reasoning: ReasoningStart = "none"


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer (thread-safe). Every call compiles: what is
    kept, and for how long, is `BoundedCompiler`'s cache, bounded in bytes, where xgrammar's own
    would keep every grammar ever compiled."""

    def __init__(
        self, info: xgrammar.TokenizerInfo, encode: Callable[[str], Sequence[int]]
    ) -> None:
        # text -> token ids, as the tokenizer spells it (the forced-text drafts)
        self.encode = encode
        self.info = info  # what a compile worker process rebuilds its compiler from
        self._compiler = new_xgrammar_compiler(info)

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]
    ) -> GrammarCompiler:
        """For a Hugging Face tokenizer; `vocab_size` is the model's (logit rows may be wider
        than the tokenizer), `stop_ids` the tokens that may end a matched output. The engine
        encodes with a copy of its own, behind a lock: a fast tokenizer used from two threads at
        once may fail ("Already borrowed"), and the HTTP edge tokenizes prompts on others."""
        own, lock = copy.deepcopy(tokenizer), threading.Lock()

        @functools.lru_cache(maxsize=4096)  # forced texts recur (a schema's keys): encode each once
        def encode(text: str) -> tuple[int, ...]:
            with lock:
                return tuple(own.encode(text, add_special_tokens=False))

        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        return cls(info, encode)

    @classmethod
    def for_vocabulary(cls, pieces: Sequence[str], stop_ids: Sequence[int]) -> GrammarCompiler:
        """For a vocabulary given as each token's text (the tiny test models), encoding by
        longest match."""
        longest = max(map(len, pieces))

        def encode(text: str) -> tuple[int, ...]:
            ids, at = [], 0
            while at < len(text):
                size = next(
                    (
                        n
                        for n in range(min(longest, len(text) - at), 0, -1)
                        if text[at : at + n] in pieces
                    ),
                    0,
                )
                if not size:
                    break
                ids.append(pieces.index(text[at : at + size]))
                at += size
            return tuple(ids)

        return cls(xgrammar.TokenizerInfo(list(pieces), stop_token_ids=sorted(stop_ids)), encode)

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar, or `GrammarError` naming `spec.field`."""
        return compile_spec(self._compiler, spec)


def new_xgrammar_compiler(info: xgrammar.TokenizerInfo) -> xgrammar.GrammarCompiler:
    """xgrammar's compiler on one thread (a compile never takes more than one core from the
    engine) without its unbounded cache."""
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_spec(compiler: xgrammar.GrammarCompiler, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
    """`spec` compiled by `compiler`, or `GrammarError` naming `spec.field`."""
    try:
        return compiler.compile_grammar(_after_reasoning(_grammar(spec), spec.reasoning))
    except GrammarError:
        raise
    except Exception as error:  # xgrammar's own messages say what it could not take
        raise GrammarError(f"cannot be compiled: {_last_line(error)}", spec.field) from error


def _grammar(spec: GrammarSpec) -> xgrammar.Grammar:
    """What `spec` holds the output to, uncompiled."""
    if spec.kind == "json_object":
        return xgrammar.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    if spec.kind == "json_schema":
        check_schema(spec.source, spec.field)
        return xgrammar.Grammar.from_json_schema(
            spec.source, any_whitespace=False, strict_mode=True
        )
    if spec.kind == "structural_tag":
        return xgrammar.Grammar.from_structural_tag(spec.source)
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.source)
    raise GrammarError(f"unknown kind {spec.kind!r}", spec.field)


def _after_reasoning(held: xgrammar.Grammar, start: ReasoningStart) -> xgrammar.Grammar:
    """`held` behind the reasoning section `start` allows: free text up to `</think>` (after
    `<think>` unless the prompt opened it), a little whitespace, then `held`."""
    if start == "none":
        return held
    section = {
        "type": "tag",
        "begin": "" if start == "opened" else REASONING_OPEN,
        "content": {"type": "any_text"},
        "end": REASONING_CLOSE,
    }
    reasoned = xgrammar.Grammar.concat(
        xgrammar.Grammar.from_structural_tag(
            json_source({"type": "structural_tag", "format": section})
        ),
        xgrammar.Grammar.from_regex(_AFTER_REASONING),
        held,
    )
    return reasoned if start == "opened" else xgrammar.Grammar.union(reasoned, held)


def json_source(value: Any) -> str:
    """`value`'s compact JSON text, a grammar's source. orjson writes it: a request's schema is
    written on the event loop, and json.dumps of a 470 KB one held the interpreter (the engine's
    too) fifteen times as long; json.dumps writes what orjson cannot (integers past 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def check_schema(source: str, field: str) -> None:
    """`GrammarError` for a schema text that is not JSON (see `check_schema_value`)."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as error:
        raise GrammarError(f"not valid JSON ({error})", field) from error
    check_schema_value(schema, field)


def check_schema_value(schema: Any, field: str) -> None:
    """`GrammarError` for a schema that is not a JSON object or uses a keyword the grammar would
    silently ignore (the error names the keyword's place in the schema)."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object", field)
    _check(schema, field)


def _check(schema: Any, at: str) -> None:
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = f"{at}.{key}"
        if key in UNENFORCED_KEYWORDS:
            raise GrammarError("is not supported in structured output", where)
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise GrammarError("is supported with one schema only", where)
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                _check(sub, f"{where}.{name}")
        elif key in _SUBSCHEMA:
            _check(value, where)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _check(sub, f"{where}[{i}]")


def _last_line(error: Exception) -> str:
    """xgrammar's message without the C++ source location it starts with."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[-1] if text.startswith("[") else text
