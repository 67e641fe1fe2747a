"""Prompt processing and decoding speed of the served model, beside the references a CPU user
would run instead (`ngrammys speed`).

Prompt processing: prompts of `PROMPT_LENGTHS` tokens, each answered with one token from an
empty cache (the time to the first token, so prefill and one decode pass; nothing is reused
between runs). Decoding: `DECODE_TOKENS` greedy tokens after a `DECODE_PROMPT`-token prompt,
less the time to that prompt's first token. The prompts are cut from one stream of real
token ids (Spec-Bench's questions, chat-templated, one after another), the same ids for every
method. Each figure is the fastest of `repeats` runs: other work on the machine only adds time.
Speculation is off: this measures the passes themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.engine.outputs import Completion
from service.engine.params import GenerationParams

PROMPT_LENGTHS = (256, 1024, 2000)
DECODE_PROMPT = 64
DECODE_TOKENS = 128

Complete = Callable[[Sequence[int], GenerationParams], Completion]  # the engine's `complete`, or a reference's


@dataclass(frozen=True)
class Speed:
    """One method's prompt tokens/s at each prompt length, and its decoding tokens/s."""

    method: str
    prompt: dict[int, float]
    decode: float


def token_stream(prompts: Sequence[Sequence[int]], length: int) -> list[int]:
    """`prompts` one after another, cycled, cut at `length` tokens."""
    stream: list[int] = []
    while len(stream) < length:
        for ids in prompts:
            stream.extend(ids)
    return stream[:length]


def _fastest(complete: Complete, prompt: Sequence[int], tokens: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        completion = complete(prompt, GenerationParams(max_new_tokens=tokens))
        best = min(best, time.perf_counter() - started)
        if len(completion.token_ids) != tokens:
            raise RuntimeError(f"asked for {tokens} tokens, got {len(completion.token_ids)}")
    return best


def measure(method: str, complete: Complete, stream: Sequence[int], lengths: Sequence[int] = PROMPT_LENGTHS,
            repeats: int = 3) -> Speed:
    """`complete`'s speed on prompts cut from `stream` (at least max(lengths) tokens)."""
    prompt = {n: n / _fastest(complete, stream[:n], 1, repeats) for n in lengths}
    short = stream[:DECODE_PROMPT]
    decode_seconds = _fastest(complete, short, DECODE_TOKENS + 1, repeats) - _fastest(complete, short, 1, repeats)
    return Speed(method, prompt, DECODE_TOKENS / decode_seconds)


def format_speeds(speeds: Sequence[Speed]) -> str:
    """A markdown table: prompt tokens/s per length and decode tokens/s, each method's ratio to the first's."""
    lengths = list(speeds[0].prompt)
    first = speeds[0]
    lines = ["| method | " + " | ".join(f"prompt {n} tok/s" for n in lengths) + " | decode tok/s |",
             "|---|" + "---|" * (len(lengths) + 1)]
    for speed in speeds:
        cells = [f"{speed.prompt[n]:.0f}" + ("" if speed is first else f" ({speed.prompt[n] / first.prompt[n]:.2f}×)")
                 for n in lengths]
        cells.append(f"{speed.decode:.1f}" + ("" if speed is first else f" ({speed.decode / first.decode:.2f}×)"))
        lines.append(f"| {speed.method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
