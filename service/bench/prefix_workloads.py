"""`ngrammys loadtest --workload chat|document`: traffic that repeats long prefixes, served with
the prefix cache and without it.

- `chat`: conversations of several turns behind one long system prompt; each turn re-sends the
  system prompt, the whole conversation so far (the server's own earlier answers included) and
  one new question, as a chat client does. All conversations run at once.
- `document`: questions about one long document, each sent as the document followed by the
  question, from a few clients one after another.

The texts are Spec-Bench's: the system prompt is made of its rag passages, the document of its
summarization articles, the questions are its short ones (qa, then the other short categories).
Each setting runs on a server of its own, started here, so neither profits from the other's
suffix index or cache; the report gives the time to first token, output tokens/s, the prefix
cache's hit rate (from the server's metrics) and how many answers the two settings share.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.bench.loadtest import RequestTiming, quantile, stream_chat, wait_warm
from service.bench.specbench import Question, specbench_questions

WORKLOADS = ("chat", "document")
SYSTEM_CHARS = 4_200  # about 1,000 tokens of the embedded model's tokenizer
DOCUMENT_CHARS = 6_300  # about 1,500
SHORT_CATEGORIES = (
    "qa",
    "humanities",
    "stem",
    "writing",
    "roleplay",
    "math",
    "reasoning",
    "translation",
)


@dataclass(frozen=True)
class Workload:
    """Conversations run concurrently, `clients` at a time; each is a list of user turns after
    a `system` prompt (chat) or each turn a message of its own after a shared `document`."""

    name: str
    system: str
    conversations: list[list[str]]
    clients: int
    multi_turn: bool


DEFAULT_TURNS = {"chat": 6, "document": 4}  # with 8 conversations: 8 chats of 6 turns; 32 questions
DOCUMENT_CLIENTS = 4


def build(name: str, questions: list[Question], conversations: int, turns: int) -> Workload:
    """The `chat` workload (`conversations` of `turns` turns, all at once) or the `document`
    one (`conversations` × `turns` questions from `DOCUMENT_CLIENTS` clients)."""
    by_category: dict[str, list[str]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question.text)
    short_texts = [text for category in SHORT_CATEGORIES for text in by_category.get(category, [])]
    if not short_texts:
        raise ValueError(
            f"the questions file has none of the short questions ({', '.join(SHORT_CATEGORIES)}) "
            f"these workloads ask"
        )
    short = itertools.cycle(short_texts)
    asked = [[next(short) for _ in range(turns)] for _ in range(conversations)]
    if name == "chat":
        system = "You are a helpful assistant. Reference notes:\n\n" + _joined(
            by_category, "rag", SYSTEM_CHARS
        )
        return Workload(name, system, asked, conversations, multi_turn=True)
    document = "Document:\n\n" + _joined(by_category, "summarization", DOCUMENT_CHARS)
    return Workload(
        name, document, [[q] for q in itertools.chain(*asked)], DOCUMENT_CLIENTS, multi_turn=False
    )


def _joined(by_category: dict[str, list[str]], category: str, chars: int) -> str:
    """Texts of a category, joined up to `chars` characters."""
    texts = by_category.get(category)
    if not texts:
        raise ValueError(f"the questions file has no {category!r} questions for this workload")
    return "\n\n".join(itertools.islice(itertools.cycle(texts), len(texts)))[:chars]


@dataclass
class WorkloadResult:
    setting: str  # "cache" or "no cache"
    seconds: float
    timings: list[RequestTiming]
    answers: list[str]  # in (conversation, turn) order
    hit_rate: float | None = None  # prefix cache hits / queries over the run (None: not exported)
    shared_answers: int = field(default=0)  # answers equal to the other setting's

    def summary(self) -> dict[str, float | int | str | None]:
        ttft = [t.ttft for t in self.timings]
        itl = [x for t in self.timings for x in t.itl] or [0.0]
        return {
            "setting": self.setting,
            "requests": len(self.timings),
            "ttft_p50_ms": quantile(ttft, 0.5) * 1e3,
            "ttft_p99_ms": quantile(ttft, 0.99) * 1e3,
            "itl_p50_ms": quantile(itl, 0.5) * 1e3,
            "itl_p99_ms": quantile(itl, 0.99) * 1e3,
            "output_tokens_per_second": sum(t.tokens for t in self.timings) / self.seconds,
            "seconds": self.seconds,
            "hit_rate": self.hit_rate,
            "same_answers": self.shared_answers,
        }


async def _conversation(
    client: httpx.AsyncClient, workload: Workload, turns: list[str], mode: str, max_tokens: int
) -> list[RequestTiming]:
    """One conversation's turns in order, each after the answers to the turns before."""
    role = "system" if workload.multi_turn else "user"
    messages = [{"role": role, "content": workload.system}]
    timings = []
    for turn in turns:
        if workload.multi_turn:
            messages.append({"role": "user", "content": turn})
            asked = messages
        else:
            asked = [{"role": "user", "content": f"{workload.system}\n\nQuestion: {turn}"}]
        timing = await stream_chat(client, asked, mode, max_tokens)
        messages.append({"role": "assistant", "content": timing.text})
        timings.append(timing)
    return timings


async def _run(
    base_url: str, workload: Workload, mode: str, max_tokens: int
) -> tuple[float, list[list[RequestTiming]]]:
    pending = list(enumerate(workload.conversations))
    done: dict[int, list[RequestTiming]] = {}
    async with httpx.AsyncClient(
        base_url=base_url, timeout=3600, limits=httpx.Limits(max_connections=workload.clients + 4)
    ) as client:

        async def client_loop() -> None:
            while pending:
                index, turns = pending.pop(0)
                done[index] = await _conversation(client, workload, turns, mode, max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(workload.clients)))
        return time.perf_counter() - started, [done[i] for i in range(len(workload.conversations))]


def prefix_counters(base_url: str) -> tuple[float, float] | None:
    """The server's prefix cache queries and hits so far (None: it exports none)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    found = dict(
        re.findall(r"^ngrammys_prefix_cache_(queries|hits)_total (\S+)$", text, flags=re.M)
    )
    return (float(found["queries"]), float(found["hits"])) if len(found) == 2 else None


def run_setting(
    base_url: str, workload: Workload, setting: str, mode: str, max_tokens: int
) -> WorkloadResult:
    """The whole workload once against a server."""
    before = prefix_counters(base_url)
    seconds, conversations = asyncio.run(_run(base_url, workload, mode, max_tokens))
    after = prefix_counters(base_url)
    timings = [t for conversation in conversations for t in conversation]
    result = WorkloadResult(setting, seconds, timings, [t.text for t in timings])
    if before is not None and after is not None and after[0] > before[0]:
        result.hit_rate = (after[1] - before[1]) / (after[0] - before[0])
    return result


def compare(
    servers: Callable[[bool], AbstractContextManager[str]],
    workload: Workload,
    mode: str,
    max_tokens: int,
    progress: Callable[[str], None] = print,
) -> list[WorkloadResult]:
    """The workload with the prefix cache and without it, each on a server of its own
    (`servers(prefix_cache)` starts one and yields its URL)."""
    results = []
    for prefix_cache in (True, False):
        with servers(prefix_cache) as base:
            result = run_setting(
                base, workload, "cache" if prefix_cache else "no cache", mode, max_tokens
            )
        progress(_row(result.summary()))
        results.append(result)
    cached, uncached = results
    same = sum(a == b for a, b in zip(cached.answers, uncached.answers))
    cached.shared_answers = uncached.shared_answers = same
    return results


HEADER = (
    "| setting | requests | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) "
    "| output tok/s | seconds "
    "| prefix hit rate |\n|---|---|---|---|---|---|---|---|---|"
)


def _row(s: dict[str, float | int | str | None]) -> str:
    hit = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.0%}"
    return (
        f"| {s['setting']} | {s['requests']} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} "
        f"| {s['itl_p50_ms']:.0f} | {s['itl_p99_ms']:.0f} | {s['output_tokens_per_second']:.1f} "
        f"| {s['seconds']:.1f} | {hit} |"
    )


def format_comparison(results: list[WorkloadResult]) -> str:
    """The cache/no-cache ratios of TTFT p50 and of throughput, and the answers both gave alike."""
    cached, uncached = results
    ttft = quantile([t.ttft for t in cached.timings], 0.5) / quantile(
        [t.ttft for t in uncached.timings], 0.5
    )
    rate = (sum(t.tokens for t in cached.timings) / cached.seconds) / (
        sum(t.tokens for t in uncached.timings) / uncached.seconds
    )
    return (
        f"with/without the cache: TTFT p50 {ttft:.2f}x, output tokens/s {rate:.2f}x; "
        f"same answers: {cached.shared_answers} of {len(cached.answers)}"
    )


def run_command(
    servers: Callable[[bool], AbstractContextManager[str]],
    name: str,
    dataset: Path,
    conversations: int,
    turns: int | None,
    mode: str,
    max_tokens: int,
    json_path: Path | None,
) -> None:
    """`ngrammys loadtest --workload chat|document`: the workload `name` (`turns`: None for its
    default) with the prefix cache and without, on a server each (`servers(prefix_cache)` starts
    one and yields its URL; it is warmed up here), a row a setting, then the comparison."""
    workload = build(
        name, specbench_questions(dataset), conversations, turns or DEFAULT_TURNS[name]
    )

    @contextmanager
    def warm(prefix_cache: bool) -> Iterator[str]:
        with servers(prefix_cache) as base:
            wait_warm(base, True)  # (the profile prices the prompt chunks in every mode)
            yield base

    print(
        f"workload {name}: {len(workload.conversations)} conversations x "
        f"{len(workload.conversations[0])} turns, {workload.clients} at a time, "
        f"{max_tokens} tokens each, "
        f"greedy, speculation {mode}\n\n{HEADER}",
        flush=True,
    )
    results = compare(warm, workload, mode, max_tokens, progress=lambda row: print(row, flush=True))
    print(f"\n{format_comparison(results)}", flush=True)
    if json_path:
        json_path.write_text(
            json.dumps(
                {
                    "workload": name,
                    "max_tokens": max_tokens,
                    "results": [r.summary() for r in results],
                },
                indent=2,
            )
        )
        print(f"wrote {json_path}")
