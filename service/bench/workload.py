"""A repetitive multi-request workload: one task over many inputs, one request after another.

What cross-request drafts (the suffix index) gain shows only where requests resemble each
other, as in a deployment that runs the same extraction over many documents. Each method gets
its own engine — its own successor tables and suffix index — so no method drafts from the
outputs another method produced for the same prompt (with greedy decoding those are the same
tokens, and replaying them would flatter the index). Methods are interleaved per prompt, as in
`bench.py`; the first method is the reference every output must equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from drafting import MIXED
from service.bench.command import load
from service.bench.specbench import (
    BenchPrompt,
    MethodTotals,
    Question,
    shares_text,
    specbench_questions,
)
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.model.prompts import chat_prompt_ids


@dataclass(frozen=True)
class WorkloadMethod:
    name: str
    engine: Engine
    params: GenerationParams


@dataclass
class WorkloadResult:
    totals: MethodTotals = field(default_factory=MethodTotals)
    prompts: int = 0
    identical: int = 0  # prompts whose output equals the reference method's


def task_prompts(
    questions: Sequence[Question],
    template: str,
    tokenizer: PreTrainedTokenizerBase,
    max_chars: int = 1500,
) -> list[BenchPrompt]:
    """The task `template` (with a `{text}` field) applied to each question's text — without
    its own short instruction ("Summarize: …") — cut to `max_chars` so prompts stay short
    enough to prefill quickly on a CPU."""
    return [
        BenchPrompt(
            q.question_id,
            q.category,
            chat_prompt_ids(
                tokenizer,
                [{"role": "user", "content": template.format(text=_body(q.text)[:max_chars])}],
            ),
        )
        for q in questions
    ]


def _body(text: str) -> str:
    head, separator, body = text.partition(": ")
    return body if separator and len(head) <= 40 else text


def run_workload(
    methods: Sequence[WorkloadMethod], prompts: Sequence[BenchPrompt]
) -> dict[str, WorkloadResult]:
    """Decode the prompts in order with every method (rotating which goes first)."""
    results = {m.name: WorkloadResult() for m in methods}
    for index, prompt in enumerate(prompts):
        shift = index % len(methods)
        done = {
            m.name: m.engine.complete(prompt.prompt_ids, m.params)
            for m in [*methods[shift:], *methods[:shift]]
        }
        reference = done[methods[0].name].token_ids
        for name, completion in done.items():
            results[name].totals.add(completion)
            results[name].prompts += 1
            results[name].identical += completion.token_ids == reference
    return results


def format_workload(results: dict[str, WorkloadResult]) -> str:
    """One row per method: tokens per pass and tokens/s against the first (reference) method."""
    reference = next(iter(results.values())).totals.tokens_per_second
    header = (
        "| method | tokens | passes | tokens/pass | tok/s | vs first | accepted by strategy "
        "| draft time "
        "| identical |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {name} | {t.tokens} | {t.passes} | {t.tokens_per_pass:.2f} | {t.tokens_per_second:.1f} "
        f"| {t.tokens_per_second / reference:.2f}x | {shares_text(t.strategy_shares())} "
        f"| {t.draft_share:.1%} "
        f"| {r.identical}/{r.prompts} |"
        for name, r in results.items()
        for t in [r.totals]
    ]
    return "\n".join([header, *rows])


def run_command(
    model: str | None,
    config: EngineConfig,
    dataset: Path,
    per_category: int | None,
    categories: list[str] | None,
    task: str,
    repeat: int,
    strategies: list[str],
    k: int,
    w: int,
    suffix_cache_tokens: int,
    max_new_tokens: int,
    sampling: SamplingParams,
) -> None:
    """`ngrammys bench --task`: the task over each question's text, the series `repeat` times,
    requests in order; each strategy with and without the suffix index (each on its own
    engine), against plain decoding; the table."""
    from service.runtime import build_engine_with_tables

    loaded = load(model, config)
    config = replace(config, cost_profile=False)
    prompts = (
        task_prompts(specbench_questions(dataset, per_category, categories), task, loaded.tokenizer)
        * repeat
    )

    def method(name: str, strategy: str, draft_count: int, cache_tokens: int) -> WorkloadMethod:
        params = GenerationParams(
            max_new_tokens,
            speculation=SpeculationParams(draft_count, w),
            strategy=strategy,
            sampling=sampling,
        )
        engine = build_engine_with_tables(loaded, replace(config, suffix_cache_tokens=cache_tokens))
        return WorkloadMethod(name, engine, params)

    methods = [method("plain", MIXED, 0, 0)]
    for strategy in dict.fromkeys(strategies):
        methods.append(method(f"{strategy} k{k}w{w}", strategy, k, suffix_cache_tokens))
        if strategy != "suffix":
            methods.append(method(f"{strategy} k{k}w{w} no suffix", strategy, k, 0))
    print(
        f"{loaded.name}: {len(prompts)} requests of one task, in order; methods: "
        f"{', '.join(m.name for m in methods)}; max_new_tokens={max_new_tokens}",
        flush=True,
    )
    print(format_workload(run_workload(methods, prompts)))
