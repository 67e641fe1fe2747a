"""`ngrammys loadtest --workload agent`: an agent loop of several turns with a function tool,
through the Responses API continuing each turn by `previous_response_id`, against the same loop
resending the whole transcript on chat completions.

Each conversation asks one of Spec-Bench's short questions with a `lookup` tool; every turn but
the last must call it (`tool_choice: required`), each call is answered with a passage of
Spec-Bench's rag texts, and the last turn answers in text. On `/v1/responses` a turn sends only
the tool outputs (and the instructions, which are not carried over); on chat completions it
sends everything so far. Each setting runs on a server of its own, started here (so neither
profits from the other's suffix index or prefix cache); the report gives a turn's latency (p50:
the answer of a call turn is held whole, so its first token comes with its last), the run's
time, the prompt tokens sent, the prefix cache's hit rate, and how many answers the settings
share (the tools' results name their call ids, which the server draws at random, so the prompts
differ there).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service.bench.loadtest import quantile, wait_warm
from service.bench.prefix_workloads import prefix_counters
from service.bench.specbench import Question

SETTINGS = ("responses", "chat")
DEFAULT_TURNS = 8
INSTRUCTIONS = (
    "You are a research agent. Look facts up with the `lookup` tool, one query at a time, "
    "then answer the question briefly."
)
LOOKUP = {
    "name": "lookup",
    "description": "Search the reference notes",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 48}},
        "required": ["query"],
    },
}
RESULT_CHARS = 600  # of a rag passage, a tool's result
MAX_TOKENS = 128  # a turn's answer: a call, whole, or the last turn's text


@dataclass
class Turn:
    seconds: float
    input_tokens: int
    answer: str  # the calls' arguments, or the last turn's text


@dataclass
class SettingResult:
    setting: str
    seconds: float
    turns: list[Turn] = field(default_factory=list)
    hit_rate: float | None = None  # prefix cache hits / queries over the run (None: not exported)
    shared_answers: int = 0

    def summary(self) -> dict[str, Any]:
        latency = [t.seconds for t in self.turns]
        return {
            "setting": self.setting,
            "turns": len(self.turns),
            "turn_p50_ms": quantile(latency, 0.5) * 1e3,
            "turn_p99_ms": quantile(latency, 0.99) * 1e3,
            "seconds": self.seconds,
            "input_tokens": sum(t.input_tokens for t in self.turns),
            "hit_rate": self.hit_rate,
            "same_answers": self.shared_answers,
        }


def build(questions: list[Question], conversations: int) -> tuple[list[str], list[str]]:
    """The questions the conversations ask, and the passages the tool answers with."""
    short = [q.text for q in questions if q.category == "qa"] or [q.text for q in questions]
    passages = [q.text[:RESULT_CHARS] for q in questions if q.category == "rag"]
    if not passages:
        raise ValueError("the questions file has no rag questions for the tool's results")
    return list(itertools.islice(itertools.cycle(short), conversations)), passages


async def _responses_loop(
    client: httpx.AsyncClient, question: str, passages: list[str], turns: int, mode: str
) -> list[Turn]:
    fields = {"instructions": INSTRUCTIONS, "tools": [{"type": "function", **LOOKUP}]}
    body: dict[str, Any] = {"input": question}
    done = []
    for turn in range(turns):
        last = turn == turns - 1
        started = time.perf_counter()
        reply = await client.post(
            "/v1/responses",
            json={**body, **fields, **_turn_fields(last, mode), "max_output_tokens": MAX_TOKENS},
        )
        _check(reply)
        response = reply.json()
        calls = [item for item in response["output"] if item["type"] == "function_call"]
        answer = json.dumps([c["arguments"] for c in calls]) if calls else _text(response)
        done.append(Turn(time.perf_counter() - started, response["usage"]["input_tokens"], answer))
        if not calls:  # cut short (or the last turn): the loop ends
            break
        outputs = [
            {
                "type": "function_call_output",
                "call_id": c["call_id"],
                "output": passages[turn % len(passages)],
            }
            for c in calls
        ]
        body = {"previous_response_id": response["id"], "input": outputs}
    return done


async def _chat_loop(
    client: httpx.AsyncClient, question: str, passages: list[str], turns: int, mode: str
) -> list[Turn]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": question},
    ]
    done = []
    for turn in range(turns):
        last = turn == turns - 1
        started = time.perf_counter()
        reply = await client.post(
            "/v1/chat/completions",
            json={
                "messages": messages,
                "tools": [{"type": "function", "function": LOOKUP}],
                **_turn_fields(last, mode),
                "max_tokens": MAX_TOKENS,
            },
        )
        _check(reply)
        message = reply.json()["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        answer = (
            json.dumps([c["function"]["arguments"] for c in calls])
            if calls
            else message["content"] or ""
        )
        prompt_tokens = reply.json()["usage"]["prompt_tokens"]
        done.append(Turn(time.perf_counter() - started, prompt_tokens, answer))
        if not calls:  # cut short (or the last turn): the loop ends
            break
        messages.append(
            {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
        )
        messages += [
            {"role": "tool", "tool_call_id": c["id"], "content": passages[turn % len(passages)]}
            for c in calls
        ]
    return done


def _check(reply: httpx.Response) -> None:
    if reply.is_error:
        raise RuntimeError(f"{reply.request.url.path}: {reply.status_code} {reply.text}")


def _turn_fields(last: bool, mode: str) -> dict[str, Any]:
    return {
        "tool_choice": "none" if last else "required",
        "temperature": 0,
        "speculation": {"mode": mode},
    }


def _text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


async def _run(
    base_url: str, setting: str, questions: list[str], passages: list[str], turns: int, mode: str
) -> SettingResult:
    loop = _responses_loop if setting == "responses" else _chat_loop
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:
        started = time.perf_counter()
        conversations = await asyncio.gather(
            *(loop(client, question, passages, turns, mode) for question in questions)
        )
    result = SettingResult(setting, time.perf_counter() - started)
    result.turns = [turn for conversation in conversations for turn in conversation]
    return result


def run_setting(
    base_url: str, setting: str, questions: list[str], passages: list[str], turns: int, mode: str
) -> SettingResult:
    """The loop once against a server, with the prefix cache's hit rate over it."""
    before = prefix_counters(base_url)
    result = asyncio.run(_run(base_url, setting, questions, passages, turns, mode))
    after = prefix_counters(base_url)
    if before is not None and after is not None and after[0] > before[0]:
        result.hit_rate = (after[1] - before[1]) / (after[0] - before[0])
    return result


def compare(
    servers: Callable[[], AbstractContextManager[str]],
    questions: list[str],
    passages: list[str],
    turns: int,
    mode: str,
    progress: Callable[[str], None] = print,
) -> list[SettingResult]:
    """The loop through each setting, on a server of its own (`servers()` starts one)."""
    results = []
    for setting in SETTINGS:
        with servers() as base:
            result = run_setting(base, setting, questions, passages, turns, mode)
        progress(row(result.summary()))
        results.append(result)
    responses, chat = results
    same = sum(a.answer == b.answer for a, b in zip(responses.turns, chat.turns))
    responses.shared_answers = chat.shared_answers = same
    return results


HEADER = (
    "| setting | turns | turn p50 (ms) | turn p99 (ms) | seconds | prompt tokens "
    "| prefix hit rate |\n|---|---|---|---|---|---|---|"
)


def row(s: dict[str, Any]) -> str:
    hit = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.0%}"
    return (
        f"| {s['setting']} | {s['turns']} | {s['turn_p50_ms']:.0f} | {s['turn_p99_ms']:.0f} "
        f"| {s['seconds']:.1f} | {s['input_tokens']:,} | {hit} |"
    )


def format_comparison(results: list[SettingResult]) -> str:
    responses, chat = results
    p50 = quantile([t.seconds for t in responses.turns], 0.5) / quantile(
        [t.seconds for t in chat.turns], 0.5
    )
    return (
        f"responses/chat: turn p50 {p50:.2f}x, run time {responses.seconds / chat.seconds:.2f}x; "
        f"same answers: {responses.shared_answers} of {len(responses.turns)}"
    )


def run_command(
    servers: Callable[[], AbstractContextManager[str]],
    questions: list[Question],
    conversations: int,
    turns: int,
    mode: str,
    json_path: Path | None,
) -> None:
    """`ngrammys loadtest --workload agent`: a row a setting, then the comparison."""
    asked, passages = build(questions, conversations)

    @contextmanager
    def warm() -> Iterator[str]:
        with servers() as base:
            wait_warm(base, True)
            yield base

    print(
        f"workload agent: {conversations} conversations x {turns} turns at once, greedy, "
        f"speculation {mode}\n\n{HEADER}",
        flush=True,
    )
    results = compare(warm, asked, passages, turns, mode, lambda line: print(line, flush=True))
    print(f"\n{format_comparison(results)}", flush=True)
    if json_path:
        summary = {"workload": "agent", "turns": turns, "results": [r.summary() for r in results]}
        json_path.write_text(json.dumps(summary, indent=2))
        print(f"wrote {json_path}")
