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

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from service.bench.command import load
from service.engine.config import EngineConfig
from service.engine.outputs import Completion
from service.engine.params import GenerationParams

PROMPT_LENGTHS = (256, 1024, 2000)
DECODE_PROMPT = 64
DECODE_TOKENS = 128

# the engine's `complete`, or a reference's
Complete = Callable[[Sequence[int], GenerationParams], Completion]


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


def measure(
    method: str,
    complete: Complete,
    stream: Sequence[int],
    lengths: Sequence[int] = PROMPT_LENGTHS,
    repeats: int = 3,
) -> Speed:
    """`complete`'s speed on prompts cut from `stream` (at least max(lengths) tokens)."""
    prompt = {n: n / _fastest(complete, stream[:n], 1, repeats) for n in lengths}
    short = stream[:DECODE_PROMPT]
    decode_seconds = _fastest(complete, short, DECODE_TOKENS + 1, repeats) - _fastest(
        complete, short, 1, repeats
    )
    return Speed(method, prompt, DECODE_TOKENS / decode_seconds)


def format_speeds(speeds: Sequence[Speed]) -> str:
    """A markdown table: prompt tokens/s per length and decode tokens/s, each method's ratio to the
    first's."""
    lengths = list(speeds[0].prompt)
    first = speeds[0]
    lines = [
        "| method | " + " | ".join(f"prompt {n} tok/s" for n in lengths) + " | decode tok/s |",
        "|---|" + "---|" * (len(lengths) + 1),
    ]
    for speed in speeds:
        cells = [
            f"{speed.prompt[n]:.0f}"
            + ("" if speed is first else f" ({speed.prompt[n] / first.prompt[n]:.2f}×)")
            for n in lengths
        ]
        cells.append(
            f"{speed.decode:.1f}"
            + ("" if speed is first else f" ({speed.decode / first.decode:.2f}×)")
        )
        lines.append(f"| {speed.method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_command(
    model: str | None,
    config: EngineConfig,
    dataset: Path,
    lengths: list[int],
    repeats: int,
    llama_cpp: Path | None,
    transformers: bool,
    json_path: Path | None,
) -> None:
    """`ngrammys speed`: the engine's prompt processing and decoding tokens/s, and the references'
    (`llama_cpp`: the GGUF llama.cpp decodes; `transformers`: the library's own float32 forward
    of the same model, unpacked), a row a method as it is measured, then the table."""
    from drafting import TableSlot
    from service.bench.hf_generate_reference import HF_GENERATE, HfGenerate
    from service.bench.specbench import load_specbench
    from service.engine.scheduler import SchedulerConfig
    from service.model.loader import load_model
    from service.runtime import build_engine

    loaded = load(model, config)
    prompts = [p.prompt_ids for p in load_specbench(dataset, loaded.tokenizer)]
    stream = token_stream(prompts, max([*lengths, DECODE_PROMPT]))
    # no prefix cache: each length runs several times, and a repeat would find its prompt cached
    engine = build_engine(
        loaded, TableSlot(), replace(config, scheduler=SchedulerConfig(prefix_cache=False))
    )
    # every method decodes its whole budget: no stop token ends a run
    engine.eos_token_ids = frozenset()
    methods: dict[str, Complete] = {f"ngrammys ({loaded.quantization})": engine.complete}
    if transformers:  # the library's own float32 forward of the same model, unpacked
        floats = load_model(model, config.device, "float32", config.cache_dir, "none")
        methods[f"{HF_GENERATE} (float32)"] = HfGenerate(floats.model, ()).complete
    if llama_cpp:
        from service.bench.llama_cpp_reference import llama_cpp_references

        methods |= {
            name: reference.complete
            for name, reference in llama_cpp_references(llama_cpp, ()).items()
        }
    print(
        f"{loaded.name} on {loaded.model.device}: "
        f"prompts of {', '.join(map(str, lengths))} tokens cut from "
        f"Spec-Bench's questions, fastest of {repeats} runs each",
        flush=True,
    )
    speeds = []
    for name, complete in methods.items():
        speeds.append(measure(name, complete, stream, lengths, repeats))
        print(format_speeds(speeds).splitlines()[-1], flush=True)
    print(f"\n{format_speeds(speeds)}")
    if json_path:
        json_path.write_text(json.dumps([asdict(s) for s in speeds], indent=2))
