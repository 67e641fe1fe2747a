"""Offline benchmark: plain vs speculative decoding on Spec-Bench prompts, same engine.

Methods are interleaved per prompt (and their order alternates) because shared machines
drift; every ratio is measured side by side in one run. Greedy decoding, so the two outputs
must be token-identical, and the table says whether they were — or, in reduced precision,
whether they parted only at a near tie of the two tokens' logits (`service/bench/near_ties.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from service.bench.near_ties import Parting, parting
from service.engine.engine import Engine
from service.engine.outputs import Completion, RoundOutput
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.model.prompts import chat_prompt_ids


class Decoder(Protocol):
    """What the bench runs a method on: an `Engine`, or a reference such as llama.cpp's."""

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> Completion: ...


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
    accepted_by_strategy: dict[str, int] = field(default_factory=dict)  # plain dict: asdict-safe
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    predicted_seconds: float = 0.0  # what the controller forecast for the same tokens (auto)

    def add(self, completion: Completion) -> None:
        self.tokens += len(completion.token_ids)
        self.seconds += completion.seconds
        self.passes += completion.num_passes
        self.draft_tokens += completion.num_draft_tokens
        self.accepted_tokens += completion.num_accepted_tokens
        for strategy, count in completion.accepted_by_strategy.items():
            self.accepted_by_strategy[strategy] = self.accepted_by_strategy.get(strategy, 0) + count
        self.draft_seconds += completion.draft_seconds
        self.forward_seconds += completion.forward_seconds
        self.predicted_seconds += completion.predicted_seconds

    @property
    def draft_share(self) -> float:
        """Time spent drafting relative to the forward passes it fed."""
        return self.draft_seconds / self.forward_seconds if self.forward_seconds else 0.0

    def strategy_shares(self) -> dict[str, float]:
        """Fraction of accepted draft tokens each strategy proposed."""
        total = sum(self.accepted_by_strategy.values())
        ranked = sorted(self.accepted_by_strategy.items(), key=lambda item: -item[1])
        return {name: count / total for name, count in ranked} if total else {}

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Over the rounds' drafting and passes (what the controller forecasts)."""
        busy = self.draft_seconds + self.forward_seconds
        return self.tokens / busy if busy else 0.0

    @property
    def forecast_tokens_per_second(self) -> float:
        return self.tokens / self.predicted_seconds if self.predicted_seconds else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0


@dataclass
class CategoryResult:
    category: str
    prompts: int = 0
    identical: int = 0
    near_ties: int = 0  # greedy answers that differ, first at a near tie of two tokens' logits
    plain: MethodTotals = field(default_factory=MethodTotals)
    speculative: MethodTotals = field(default_factory=MethodTotals)

    @property
    def speedup(self) -> float:
        plain, spec = self.plain.tokens_per_second, self.speculative.tokens_per_second
        return spec / plain if plain else 0.0


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    text: str  # the first turn


# Where the questions file comes from: the bench reads it, it is not shipped here.
SPECBENCH_SOURCE = (
    "the Spec-Bench repository, github.com/hemingkx/Spec-Bench, file data/spec_bench/question.jsonl"
)


class DatasetError(ValueError):
    """The questions file is missing, unreadable or not Spec-Bench's format; the message names
    the file and where to get it, for the command line to print instead of a traceback."""


def specbench_questions(
    path: Path, per_category: int | None = None, categories: Sequence[str] | None = None
) -> list[Question]:
    """First turn of each Spec-Bench question (the format: see `load_specbench`); at most
    `per_category` per category, and only the given `categories` if any."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise DatasetError(
            f"cannot read the Spec-Bench questions {path}: {reason}; get question.jsonl from "
            f"{SPECBENCH_SOURCE}"
        ) from error
    questions: list[Question] = []
    taken: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            question = json.loads(line)
            question_id, category, text = (
                str(question["question_id"]),
                question["category"],
                question["turns"][0],
            )
        except (ValueError, TypeError, KeyError, IndexError) as error:
            raise DatasetError(
                f"{path}, line {number}: not a Spec-Bench question ({error!r}): expected "
                f"question.jsonl from {SPECBENCH_SOURCE}"
            ) from error
        if categories and category not in categories:
            continue
        if per_category is not None and taken.get(category, 0) >= per_category:
            continue
        taken[category] = taken.get(category, 0) + 1
        questions.append(Question(question_id, category, text))
    return questions


def load_specbench(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    per_category: int | None = None,
    categories: Sequence[str] | None = None,
) -> list[BenchPrompt]:
    """`specbench_questions`, chat-templated into prompt ids; for a model without a chat
    template (a base model) the question's text as it is (with the tokenizer's special tokens,
    as `/v1/completions` encodes a prompt), so base models are measured on the same questions.

    `path` is Spec-Bench's question.jsonl (SPECBENCH_SOURCE): one JSON object a line, e.g.
    {"question_id": 81, "category": "writing", "turns": ["first user turn", "second user turn"]};
    other keys are ignored, and so is every turn but the first, which becomes the one user
    message of the prompt. Blank lines are skipped. A missing, unreadable or malformed file
    raises `DatasetError`."""

    def prompt_ids(text: str) -> list[int]:
        if not tokenizer.chat_template:
            return list(tokenizer.encode(text))
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])

    return [
        BenchPrompt(q.question_id, q.category, prompt_ids(q.text))
        for q in specbench_questions(path, per_category, categories)
    ]


def bench_methods(
    strategies: Sequence[str],
    k: int,
    w: int,
    grid: Sequence[tuple[int, int]] = (),
    auto: bool = False,
) -> dict[str, tuple[str, SpeculationParams]]:
    """Named methods to compare with plain decoding: each strategy at (k, w); the first
    strategy at each extra grid shape; and the first strategy in auto mode (k, w as maxima)."""
    methods = {f"{s} k{k}w{w}": (s, SpeculationParams(k, w)) for s in strategies}
    methods |= {
        f"{strategies[0]} k{gk}w{gw}": (strategies[0], SpeculationParams(gk, gw)) for gk, gw in grid
    }
    if auto:
        methods[f"{strategies[0]} auto"] = (strategies[0], SpeculationParams(k, w, mode="auto"))
    return methods


def run_bench(
    engine: Engine,
    prompts: Iterable[BenchPrompt],
    methods: dict[str, tuple[str, SpeculationParams]],
    max_new_tokens: int,
    progress: Callable[[BenchPrompt, Completion, dict[str, Completion], dict[str, Parting]], None]
    | None = None,
    sampling: SamplingParams = SamplingParams(),
    new_engine: Callable[[], Engine] | None = None,
    references: dict[str, Decoder] | None = None,
) -> dict[str, list[CategoryResult]]:
    """Decode every prompt plainly and with each method, in a rotating order.

    All runs share `sampling`; with a seed, a lossless method reproduces the plain sample token
    for token, so `identical` checks sampling as strictly as greedy decoding.
    With `new_engine`, each method runs on an engine of its own (plain on `engine`): what a
    method learns across requests (acceptance statistics, successor tables, the suffix index)
    then comes from its own earlier prompts only, never from another method's run of the same
    prompt — with greedy decoding that run is the very answer.
    `references` are other decoders given the plain parameters (e.g. llama.cpp's greedy
    decoding of the same GGUF): their rows compare them with plain decoding, and `identical`
    then counts agreement, not losslessness.
    A greedy answer that differs is looked at where it first does (`near_ties.parting`, one
    more pass over the prompt and the common part): `progress` gets each such parting, and
    `near_ties` counts those at a near tie.
    Returns, per method, its per-category totals (the plain ones shared) and an `overall`.
    """
    params = {"plain": GenerationParams(max_new_tokens=max_new_tokens, sampling=sampling)} | {
        name: GenerationParams(
            max_new_tokens=max_new_tokens, speculation=spec, strategy=strategy, sampling=sampling
        )
        for name, (strategy, spec) in methods.items()
    }
    references = references or {}
    params |= {name: params["plain"] for name in references}
    order = list(params)
    engines: dict[str, Decoder] = {
        name: new_engine() if new_engine and name != "plain" else engine
        for name in order
        if name not in references
    }
    engines |= references
    results: dict[str, dict[str, CategoryResult]] = {name: {} for name in order if name != "plain"}
    for index, prompt in enumerate(prompts):
        shift = index % len(order)
        done = {
            name: engines[name].complete(prompt.prompt_ids, params[name])
            for name in order[shift:] + order[:shift]
        }
        plain = done.pop("plain")
        partings = _partings(engine, prompt, plain, done) if sampling.greedy else {}
        for name, spec in done.items():
            for key in (prompt.category, "overall"):
                result = results[name].setdefault(key, CategoryResult(key))
                result.prompts += 1
                result.identical += plain.token_ids == spec.token_ids
                result.near_ties += name in partings and partings[name].near_tie
                result.plain.add(plain)
                result.speculative.add(spec)
        if progress is not None:
            progress(prompt, plain, done, partings)
    return {name: _overall_last(by_category) for name, by_category in results.items()}


def _partings(
    engine: Engine, prompt: BenchPrompt, plain: Completion, answers: dict[str, Completion]
) -> dict[str, Parting]:
    """Where each greedy answer that differs from plain decoding's first parts from it."""
    found = {
        name: parting(engine.runner.model, prompt.prompt_ids, plain.token_ids, answer.token_ids)
        for name, answer in answers.items()
    }
    return {name: parted for name, parted in found.items() if parted is not None}


def _overall_last(by_category: dict[str, CategoryResult]) -> list[CategoryResult]:
    overall = by_category.pop("overall", None)
    return [*by_category.values(), *([overall] if overall else [])]


def parted_beyond_near_ties(results: dict[str, list[CategoryResult]]) -> list[str]:
    """The methods with an answer that differs from plain decoding other than at a near tie:
    a lossless method has none."""
    return [
        name
        for name, rows in results.items()
        if any(r.identical + r.near_ties != r.prompts for r in rows)
    ]


def format_summary(results: dict[str, list[CategoryResult]]) -> str:
    """Tokens per pass (speedup over plain) of every method, one row per category."""
    names = list(results)
    header = "| category | " + " | ".join(names) + " |\n|---|" + "---|" * len(names)
    rows = []
    for row in zip(*results.values()):
        cells = [f"{r.speculative.tokens_per_pass:.2f} ({r.speedup:.2f}x)" for r in row]
        rows.append(f"| {row[0].category} | " + " | ".join(cells) + " |")
    return "\n".join([header, *rows])


def format_table(results: list[CategoryResult]) -> str:
    """A Markdown table, one row per category."""
    header = (
        "| category | prompts | plain tok/s | spec tok/s | speedup | tokens/pass "
        "| accepted/drafted | accepted by strategy | draft time | identical |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {r.category} | {r.prompts} | {r.plain.tokens_per_second:.1f} "
        f"| {r.speculative.tokens_per_second:.1f} | {r.speedup:.2f}x "
        f"| {r.speculative.tokens_per_pass:.2f} "
        f"| {r.speculative.accepted_tokens}/{r.speculative.draft_tokens} "
        f"| {shares_text(r.speculative.strategy_shares())} | {r.speculative.draft_share:.1%} "
        f"| {r.identical}/{r.prompts}{f' (+{r.near_ties} at near ties)' if r.near_ties else ''} |"
        for r in results
    ]
    return "\n".join([header, *rows])


def shares_text(shares: dict[str, float]) -> str:
    return " ".join(f"{name} {share:.0%}" for name, share in shares.items()) or "-"


def results_as_json(results: dict[str, list[CategoryResult]], **run: object) -> str:
    """The numbers of a run, with its settings, as JSON: per method, per category."""
    methods = {
        name: [
            {
                **asdict(r),
                "speedup": r.speedup,
                "plain_tokens_per_second": r.plain.tokens_per_second,
                "speculative_tokens_per_second": r.speculative.tokens_per_second,
                "speculative_tokens_per_pass": r.speculative.tokens_per_pass,
                "speculative_draft_share": r.speculative.draft_share,
                "accepted_share_by_strategy": r.speculative.strategy_shares(),
            }
            for r in by_category
        ]
        for name, by_category in results.items()
    }
    return json.dumps({"run": run, "methods": methods}, indent=2)


def format_auto_report(results: dict[str, list[CategoryResult]]) -> str:
    """Per category: plain, the best fixed method, and auto — tokens/s and ratios."""
    auto_name = next(name for name in results if name.endswith(" auto"))
    fixed_names = [name for name in results if name != auto_name]
    header = (
        "| category | plain tok/s | best fixed | its tok/s | auto tok/s | auto vs plain "
        "| auto vs best fixed | auto forecast tok/s | auto realized tok/s |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for index, auto in enumerate(results[auto_name]):
        best_name = max(fixed_names, key=lambda n: results[n][index].speculative.tokens_per_second)
        best = results[best_name][index].speculative.tokens_per_second
        spec = auto.speculative.tokens_per_second
        rows.append(
            f"| {auto.category} | {auto.plain.tokens_per_second:.1f} | {best_name} | {best:.1f} "
            f"| {spec:.1f} | {auto.speedup:.2f}x | {spec / best:.0%} "
            f"| {auto.speculative.forecast_tokens_per_second:.1f} "
            f"| {auto.speculative.decode_tokens_per_second:.1f} |"
        )
    return "\n".join([header, *rows])


@dataclass(frozen=True)
class SpikeReport:
    """Tokens/s of one prompt in auto mode: fresh, under outside CPU load, and after it; each
    over its rounds' drafting and passes, so the three compare alike."""

    fresh: float
    during: float
    after_first_rounds: float  # the first `rounds` rounds after the load stopped
    after_rest: float  # the rounds after those
    after_drafted_rounds: int  # rounds after the spike that verified drafts
    rounds: int


def spike_recovery(
    engine: Engine,
    prompt_ids: list[int],
    params: GenerationParams,
    busy_processes: int = 3,
    rounds: int = 50,
) -> SpikeReport:
    """The issue's scenario: a request in auto mode on a fresh engine; one while `busy_processes`
    spinning processes load the CPU; then the same request again, timed round by round."""
    fresh = engine.complete(prompt_ids, params)
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_processes)
    ]
    try:
        during = engine.complete(prompt_ids, params)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    after = list(engine.generate(prompt_ids, params))
    first, rest = after[:rounds], after[rounds:]
    return SpikeReport(
        fresh=_completion_rate(fresh),
        during=_completion_rate(during),
        after_first_rounds=_rate(first),
        after_rest=_rate(rest),
        after_drafted_rounds=sum(1 for r in after if r.num_draft_tokens),
        rounds=rounds,
    )


def _completion_rate(completion: Completion) -> float:
    return len(completion.token_ids) / (completion.draft_seconds + completion.forward_seconds)


def _rate(rounds: Sequence[RoundOutput]) -> float:
    seconds = sum(r.draft_seconds + r.forward_seconds for r in rounds)
    return sum(len(r.token_ids) for r in rounds) / seconds if seconds else 0.0
