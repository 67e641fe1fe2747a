"""The requests of `ngrammys soak`: what each client sends, in what order, and how each answer is
judged.

Good requests cycle through every kind the API serves (chat and completions, `n` = 3, a JSON
schema, a forced tool call, each streamed and not), all behind one shared system prompt so the
prefix cache has something to keep. Mixed in at fixed places rather than drawn at random, so
that even a short run sends some of each: 1 request in 20 with a wrong API key (401), 1 in 20
with a malformed or ill-typed body (400/422), and 1 streamed request in 5 that the client leaves
after its first chunk. Each outcome records what came back; whether that was what its kind
expects is the report's to count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count, cycle

import httpx

SHARED_PREFIX = (
    "You are the help desk of a small harbour town. Answer in one or two short sentences, "
    "plainly, without lists. The ferry to the island leaves at nine and at three; the market "
    "opens at seven and closes at one; the museum is shut on Mondays; the lighthouse can be "
    "climbed on weekends; the bakery on the square sells bread from six. Visitors pay for "
    "parking by the harbour wall, residents do not. If you do not know, say so."
)
QUESTIONS = (
    "When does the ferry leave?",
    "Can I visit the museum on Monday?",
    "Where do I park?",
    "What time does the market open?",
    "Is the lighthouse open today?",
    "Where can I buy bread early?",
    "How do I get to the island?",
    "What is there to do on a rainy day?",
)
FEATURES = ("chat", "completion", "n=3", "json_schema", "tools")
BAD_KEY, BAD_BODY = "bad key", "bad body"
BAD_BODIES = (
    b'{"messages": [{"role": "user", "content": "hi"}',  # cut short: not JSON
    b'{"messages": "hi", "max_tokens": "ten", "temperature": []}',  # JSON, wrong types
)
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 60},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in the town, some days ahead",
        "parameters": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 0, "maximum": 7}},
            "required": ["days"],
            "additionalProperties": False,
        },
    },
}
BAD_EVERY, BAD_KEY_AT, BAD_BODY_AT = 20, 2, 12  # each 20 requests: a bad key, a bad body
LEAVE_EVERY = 5  # one streamed request in this many is left after its first chunk


@dataclass(frozen=True)
class Planned:
    """One request a client will send: its kind (`FEATURES`, optionally ` stream`, or
    `BAD_KEY` / `BAD_BODY`), the question, and for a stream whether to leave it early."""

    kind: str
    question: str
    variant: int = 0  # which of `BAD_BODIES`
    leave: bool = False

    @property
    def stream(self) -> bool:
        return self.kind.endswith(" stream")

    @property
    def good(self) -> bool:
        return self.kind not in (BAD_KEY, BAD_BODY)

    @property
    def expected(self) -> tuple[int, ...]:
        """The HTTP statuses this request should get."""
        return {BAD_KEY: (401,), BAD_BODY: (400, 422)}.get(self.kind, (200,))


@dataclass(frozen=True)
class Outcome:
    """What one request got: its HTTP status (None: no answer at all, e.g. a refused
    connection or a timeout), its time, whether the client left it on purpose, and whether
    a 200 stream carried an error event."""

    planned: Planned
    status: int | None
    seconds: float
    finished: float  # time.monotonic() at its end
    left: bool = False
    stream_error: bool = False

    @property
    def status_class(self) -> str:
        return "no answer" if self.status is None else f"{self.status // 100}xx"

    @property
    def as_expected(self) -> bool:
        return self.status in self.planned.expected and not self.stream_error

    @property
    def server_error(self) -> bool:
        """A failure of the server: 5xx, no answer, or an error inside a stream."""
        return self.status is None or self.status >= 500 or self.stream_error


GOOD_KINDS = tuple(f"{f}{suffix}" for f in FEATURES for suffix in ("", " stream"))
KINDS = (*GOOD_KINDS, BAD_KEY, BAD_BODY)


def plan(client: int) -> Iterator[Planned]:
    """Client `client`'s requests, without end. Clients start at different places in the
    cycles (client c at good kind 3c and request 5c of each 20), so that four of them send
    every kind within their first four requests each, and not the same kind at once."""
    shift = client * 3 % len(GOOD_KINDS)
    kinds = cycle(GOOD_KINDS[shift:] + GOOD_KINDS[:shift])
    streamed = 0
    for index in count(client * 5):
        question = QUESTIONS[index % len(QUESTIONS)]
        position = index % BAD_EVERY
        if position == BAD_KEY_AT:
            yield Planned(BAD_KEY, question)
        elif position == BAD_BODY_AT:
            yield Planned(BAD_BODY, question, variant=index // BAD_EVERY % len(BAD_BODIES))
        else:
            kind = next(kinds)
            streamed += kind.endswith(" stream")
            leave = kind.endswith(" stream") and streamed % LEAVE_EVERY == 1
            yield Planned(kind, question, leave=leave)


def request(planned: Planned, max_tokens: int) -> tuple[str, dict]:
    """The route and JSON body of a good request (a bad key sends a plain chat's)."""
    feature = planned.kind.removesuffix(" stream")
    body: dict = {"max_tokens": max_tokens, "temperature": 0.7, "stream": planned.stream}
    if feature == "completion":
        return "/v1/completions", {
            **body,
            "prompt": f"{SHARED_PREFIX}\n\nQuestion: {planned.question}\nAnswer:",
        }
    body["messages"] = [
        {"role": "system", "content": SHARED_PREFIX},
        {"role": "user", "content": planned.question},
    ]
    if feature == "n=3":
        body["n"] = 3
    elif feature == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
        }
    elif feature == "tools":
        body["tools"] = [WEATHER_TOOL]
        body["tool_choice"] = "required"
    return "/v1/chat/completions", body


async def send(
    client: httpx.AsyncClient, planned: Planned, api_key: str, max_tokens: int
) -> Outcome:
    """Send `planned` and judge what comes back; a transport failure is an outcome too."""
    key = "not-the-key" if planned.kind == BAD_KEY else api_key
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    route, body = request(planned, max_tokens)
    content = BAD_BODIES[planned.variant] if planned.kind == BAD_BODY else json.dumps(body).encode()
    started = time.perf_counter()
    status, left, stream_error = None, False, False
    try:
        async with client.stream("POST", route, content=content, headers=headers) as response:
            status = response.status_code
            if status != 200 or not planned.stream:
                await response.aread()
            else:
                left, stream_error = await _read_stream(response, planned.leave)
    except httpx.TransportError:
        status = None
    return Outcome(
        planned, status, time.perf_counter() - started, time.monotonic(), left, stream_error
    )


async def _read_stream(response: httpx.Response, leave: bool) -> tuple[bool, bool]:
    """Read an SSE answer to its end, or (`leave`) only to its first chunk; (left, saw an
    error event)."""
    async for line in response.aiter_lines():
        if not line.startswith("data: {"):
            continue
        if "error" in json.loads(line[len("data: ") :]):
            return False, True
        if leave:
            return True, False  # leaving the block closes the connection mid-stream
    return False, False
