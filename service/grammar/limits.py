"""The bounds on a request's grammar work, and the checks made before any compiling.

A grammar's compile time grows with its schema's size and nesting, and xgrammar has no bound of
its own: a 1 MiB body can carry a schema that compiles for minutes. What can be judged from the
text alone (its bytes, how deep its JSON nests) is refused before a compile starts; the rest is
bounded by the compile time limit (`service/grammar/bounded.py`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from service.grammar.compiler import GrammarError, GrammarSpec, json_source

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[][{}]")


@dataclass(frozen=True)
class GrammarLimits:
    """How much grammar work a request may cause."""

    compile_timeout: float = 10.0  # seconds a compile may take; also the most it waits in line
    max_concurrent: int = 1  # compiles at once (each a worker process, then a compiler thread)
    max_bytes: int = 131_072  # a schema's (regex's, structural tag's) source, UTF-8
    # JSON nesting (an object or array inside another counts one): a schema nesting objects 10
    # deep, OpenAI's limit, is about 21; the tools' wrapping adds up to about 10
    max_depth: int = 48
    cache_bytes: int = 512 * 2**20  # compiled grammars kept for their next request


def check_limits(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """`GrammarError` naming `spec.field` for a source over `limits.max_bytes` or a JSON one
    nested deeper than `limits.max_depth` (counted without recursion, so any depth is safe)."""
    size = len(spec.source.encode())
    if size > limits.max_bytes:
        raise GrammarError(
            f"is {size} bytes; at most {limits.max_bytes} are compiled (--grammar-max-bytes)",
            spec.field,
        )
    if spec.kind in ("json_schema", "structural_tag"):
        depth = json_depth(spec.source)
        if depth > limits.max_depth:
            raise GrammarError(
                f"nests {depth} levels deep; at most {limits.max_depth} are compiled "
                "(--grammar-max-depth)",
                spec.field,
            )


def json_depth(text: str) -> int:
    """How deep `text`'s objects and arrays nest (a scalar: 0), read from its brackets outside
    strings (found by regular expressions, so a large text costs little interpreter time); not
    a validation (a malformed text is judged later, by its parser)."""
    depth = deepest = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if bracket in "{[" else -1
        deepest = max(deepest, depth)
    return deepest


def cache_key(spec: GrammarSpec) -> tuple[str, str, str]:
    """The spec's kind, reasoning and source with JSON whitespace removed: equal grammars,
    written apart only by spacing, share one compile. Keys keep their order (a schema's
    properties are generated in it)."""
    if spec.kind in ("json_schema", "structural_tag"):
        try:
            return spec.kind, spec.reasoning, json_source(json.loads(spec.source))
        except (ValueError, RecursionError):
            pass  # not JSON: compiled as it is (and refused by the compile)
    return spec.kind, spec.reasoning, spec.source
