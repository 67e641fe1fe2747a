"""Offline benchmark: plain vs speculative decoding on Spec-Bench prompts, same engine.

Methods are interleaved per prompt (and their order alternates) because shared machines
drift; every ratio is measured side by side in one run. Greedy decoding, so the two outputs
must be token-identical, and the table says whether they were.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from service.config import GenerationParams, SpeculationParams
from service.engine import Completion, Engine
from service.prompts import chat_prompt_ids


@dataclass(frozen=True)
class BenchPrompt:
    question_id: str
    category: str
    prompt_ids: list[int]


@dataclass
class MethodTotals:
    """Sums over the prompts of one category for one method."""

    tokens: int = 0
    seconds: float = 0.0
    passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, completion: Completion) -> None:
        self.tokens += len(completion.token_ids)
        self.seconds += completion.seconds
        self.passes += completion.num_passes
        self.draft_tokens += completion.num_draft_tokens
        self.accepted_tokens += completion.num_accepted_tokens

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0


@dataclass
class CategoryResult:
    category: str
    prompts: int = 0
    identical: int = 0
    plain: MethodTotals = field(default_factory=MethodTotals)
    speculative: MethodTotals = field(default_factory=MethodTotals)

    @property
    def speedup(self) -> float:
        plain, spec = self.plain.tokens_per_second, self.speculative.tokens_per_second
        return spec / plain if plain else 0.0


def load_specbench(
    path: Path, tokenizer: PreTrainedTokenizerBase, per_category: int | None = None
) -> list[BenchPrompt]:
    """First turn of each question, chat-templated; at most `per_category` per category."""
    prompts: list[BenchPrompt] = []
    taken: dict[str, int] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        question = json.loads(line)
        category = question["category"]
        if per_category is not None and taken.get(category, 0) >= per_category:
            continue
        taken[category] = taken.get(category, 0) + 1
        messages = [{"role": "user", "content": question["turns"][0]}]
        ids = chat_prompt_ids(tokenizer, messages)
        prompts.append(BenchPrompt(str(question["question_id"]), category, ids))
    return prompts


def run_bench(
    engine: Engine,
    prompts: Iterable[BenchPrompt],
    speculation: SpeculationParams,
    max_new_tokens: int,
    progress: Callable[[BenchPrompt, Completion, Completion], None] | None = None,
) -> list[CategoryResult]:
    """Decode every prompt plainly and speculatively; return per-category totals + overall."""
    plain_params = GenerationParams(max_new_tokens=max_new_tokens)
    spec_params = GenerationParams(max_new_tokens=max_new_tokens, speculation=speculation)
    results: dict[str, CategoryResult] = {}
    for index, prompt in enumerate(prompts):
        if index % 2 == 0:
            plain = engine.complete(prompt.prompt_ids, plain_params)
            spec = engine.complete(prompt.prompt_ids, spec_params)
        else:
            spec = engine.complete(prompt.prompt_ids, spec_params)
            plain = engine.complete(prompt.prompt_ids, plain_params)
        for key in (prompt.category, "overall"):
            result = results.setdefault(key, CategoryResult(key))
            result.prompts += 1
            result.identical += plain.token_ids == spec.token_ids
            result.plain.add(plain)
            result.speculative.add(spec)
        if progress is not None:
            progress(prompt, plain, spec)
    overall = results.pop("overall", None)
    return [*results.values(), *([overall] if overall else [])]


def format_table(results: list[CategoryResult]) -> str:
    """A Markdown table, one row per category."""
    header = (
        "| category | prompts | plain tok/s | spec tok/s | speedup | tokens/pass "
        "| accepted/drafted | identical |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {r.category} | {r.prompts} | {r.plain.tokens_per_second:.1f} "
        f"| {r.speculative.tokens_per_second:.1f} | {r.speedup:.2f}x "
        f"| {r.speculative.tokens_per_pass:.2f} "
        f"| {r.speculative.accepted_tokens}/{r.speculative.draft_tokens} "
        f"| {r.identical}/{r.prompts} |"
        for r in results
    ]
    return "\n".join([header, *rows])


def results_as_json(results: list[CategoryResult], **run: object) -> str:
    """The numbers of a run, with its settings, as JSON."""
    categories = [
        {
            **asdict(r),
            "speedup": r.speedup,
            "plain_tokens_per_second": r.plain.tokens_per_second,
            "speculative_tokens_per_second": r.speculative.tokens_per_second,
            "speculative_tokens_per_pass": r.speculative.tokens_per_pass,
        }
        for r in results
    ]
    return json.dumps({"run": run, "categories": categories}, indent=2)
