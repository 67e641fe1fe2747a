"""The report of `ngrammys soak`: per window of time, the requests that ended in it and the
server's memory at its end; then the goals a long run must meet, and their verdict.

The goals: no server error at all (a 5xx, a request with no answer, an error event inside a
stream); memory flat after warm-up (the last window's RSS at most `MEMORY_GROWTH` above the
second's: the first window holds the warm-up's allocations); latency steady (the last window's
p99 of the good requests at most `LATENCY_GROWTH` times the second's). Wrong keys, bad bodies
and clients leaving are counted, not failures. With fewer than three windows the last is the
second, and the memory and latency goals cannot be judged.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from service.bench.loadtest import quantile
from service.bench.soak_traffic import KINDS, Outcome

MEMORY_GROWTH = 0.05
LATENCY_GROWTH = 1.2
STATUS_CLASSES = ("2xx", "4xx", "5xx", "no answer")


@dataclass(frozen=True)
class ServerSample:
    """The server's memory at a window's end (None: not available there)."""

    rss_bytes: float | None = None
    kv_usage: float | None = None  # share of the KV budget the running requests may reach
    kv_bytes: float | None = None  # the running requests' KV buffers
    prefix_cache_bytes: float | None = None
    suffix_index_bytes: float | None = None


@dataclass(frozen=True)
class Window:
    """The requests that ended in one window of the run, and the server at its end."""

    index: int
    end_seconds: float
    requests: int
    statuses: dict[str, int]  # by `STATUS_CLASSES`
    left: int  # streams the client left on purpose
    stream_errors: int
    unexpected: int  # answers other than their kind expects (server errors included)
    good_p50_ms: float | None
    good_p99_ms: float | None
    server: ServerSample

    @classmethod
    def of(
        cls, index: int, end_seconds: float, outcomes: list[Outcome], server: ServerSample
    ) -> Window:
        statuses = Counter(o.status_class for o in outcomes)
        good = [
            o.seconds for o in outcomes if o.planned.good and o.as_expected and not o.planned.leave
        ]
        return cls(
            index,
            end_seconds,
            len(outcomes),
            {name: statuses[name] for name in STATUS_CLASSES},
            sum(o.left for o in outcomes),
            sum(o.stream_error for o in outcomes),
            sum(not o.as_expected for o in outcomes),
            quantile(good, 0.5) * 1e3 if good else None,
            quantile(good, 0.99) * 1e3 if good else None,
            server,
        )


@dataclass(frozen=True)
class Goal:
    name: str
    passed: bool | None  # None: the run was too short to judge it
    detail: str


@dataclass
class SoakReport:
    windows: list[Window]
    kinds: dict[str, int]  # requests sent by kind
    goals: list[Goal] = field(default_factory=list)
    unexpected: dict[str, int] = field(default_factory=dict)  # by kind and what it got

    @classmethod
    def of(cls, windows: list[Window], outcomes: list[Outcome]) -> SoakReport:
        kinds = Counter(o.planned.kind for o in outcomes)
        unexpected = Counter(
            f"{o.planned.kind}: {'error event' if o.stream_error else o.status or 'no answer'}"
            for o in outcomes
            if not o.as_expected
        )
        return cls(windows, {kind: kinds[kind] for kind in KINDS}, goals(windows), dict(unexpected))

    @property
    def passed(self) -> bool:
        return all(goal.passed is not False for goal in self.goals)


def goals(windows: list[Window]) -> list[Goal]:
    """The three goals, judged over `windows`."""
    errors = sum(w.statuses["5xx"] + w.statuses["no answer"] + w.stream_errors for w in windows)
    judged = [
        Goal(
            "no server errors",
            errors == 0,
            f"{errors} (5xx, no answer or an error event in a stream)",
        )
    ]
    second, last = (windows[1], windows[-1]) if len(windows) >= 3 else (None, None)
    judged.append(
        _growth(
            "memory flat after warm-up",
            second and second.server.rss_bytes,
            last and last.server.rss_bytes,
            1 + MEMORY_GROWTH,
            lambda rss: f"{rss / 2**20:.0f} MiB",
        )
    )
    judged.append(
        _growth(
            "p99 latency steady",
            second and second.good_p99_ms,
            last and last.good_p99_ms,
            LATENCY_GROWTH,
            lambda ms: f"{ms:.0f} ms",
        )
    )
    return judged


def _growth(name: str, second, last, limit: float, show) -> Goal:  # type: ignore[no-untyped-def]
    """`last` at most `limit` times `second` (None where either is missing)."""
    if not second or last is None:
        return Goal(name, None, "not judged: needs 3 windows and the figure in the 2nd and last")
    ratio = last / second
    return Goal(
        name,
        ratio <= limit,
        f"last {show(last)} / 2nd {show(second)} = {ratio:.3f} (at most {limit:.2f})",
    )


HEADER = (
    "| window | end (s) | requests | 2xx | 4xx | 5xx | no answer | left mid-stream "
    "| unexpected | good p50 (ms) | good p99 (ms) | RSS (MiB) | KV use (%) | KV (MiB) "
    "| prefix cache (MiB) | suffix index (MiB) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _cell(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def window_row(w: Window) -> str:
    s = w.server
    return (
        f"| {w.index + 1} | {w.end_seconds:.0f} | {w.requests} "
        f"| {' | '.join(str(w.statuses[name]) for name in STATUS_CLASSES)} | {w.left} "
        f"| {w.unexpected} | {_cell(w.good_p50_ms)} | {_cell(w.good_p99_ms)} "
        f"| {_cell(s.rss_bytes, 2**20)} | {_cell(s.kv_usage, 0.01, 1)} "
        f"| {_cell(s.kv_bytes, 2**20, 1)} | {_cell(s.prefix_cache_bytes, 2**20, 1)} "
        f"| {_cell(s.suffix_index_bytes, 2**20, 1)} |"
    )


def format_report(report: SoakReport) -> str:
    """The windows' table, the requests by kind, and the goals with the verdict (markdown)."""
    kinds = ", ".join(f"{kind} {number}" for kind, number in report.kinds.items())
    unexpected = ", ".join(f"{what} ({number})" for what, number in report.unexpected.items())
    lines = [
        HEADER,
        *(window_row(w) for w in report.windows),
        "",
        f"Requests by kind: {kinds}.",
        f"Unexpected answers: {unexpected or 'none'}.",
        "",
        "| goal | verdict | figures |",
        "|---|---|---|",
        *(
            f"| {g.name} | {({True: 'pass', False: 'FAIL', None: 'n/a'})[g.passed]} | {g.detail} |"
            for g in report.goals
        ),
        "",
        f"Verdict: {'pass' if report.passed else 'FAIL'}",
    ]
    return "\n".join(lines)


def write_json(report: SoakReport, path: Path, **run: object) -> None:
    path.write_text(json.dumps({"run": run, **asdict(report), "passed": report.passed}, indent=2))
