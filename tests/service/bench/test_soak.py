"""The soak against a real server with an API key: every kind of traffic is sent and answered as
it expects, the report has its columns and judges its goals; and the goals' arithmetic."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.background import serving
from app.cli import main
from app.main import create_app
from app.settings import Settings
from service.bench import soak
from service.bench.soak_report import (
    HEADER,
    STATUS_CLASSES,
    ServerSample,
    SoakReport,
    Window,
    format_report,
    goals,
    write_json,
)
from service.bench.soak_traffic import KINDS, Outcome, Planned, plan
from tests.helpers.http import QUIET, wait_ready

KEY = "soak-key"


def test_a_short_soak_sends_every_kind_and_meets_no_server_error(tiny_served, tmp_path) -> None:
    settings = Settings(api_keys=KEY, **QUIET)
    rows: list[str] = []
    with serving(create_app(settings, loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        report = asyncio.run(
            soak.soak(
                base,
                KEY,
                seconds=48,
                window_seconds=12,
                clients=4,
                max_tokens=8,
                progress=rows.append,
            )
        )
    assert len(rows) == len(report.windows) == 4
    assert all(count > 0 for count in report.kinds.values()), report.kinds
    windows = report.windows
    assert sum(w.statuses["5xx"] + w.statuses["no answer"] for w in windows) == 0
    assert sum(w.unexpected for w in windows) == 0 and not report.unexpected, report.unexpected
    assert sum(w.left for w in windows) > 0 and sum(w.statuses["4xx"] for w in windows) > 0
    for window in windows:
        assert window.good_p50_ms is not None and window.good_p99_ms >= window.good_p50_ms
        server = window.server
        assert server.rss_bytes > 0 and server.kv_bytes is not None
        assert server.prefix_cache_bytes is not None and server.suffix_index_bytes > 0
    assert [goal.passed is not None for goal in report.goals] == [True, True, True]
    assert report.goals[0].passed
    text = format_report(report)
    assert text.startswith(HEADER) and text.count("\n| ") == 4 + 1 + 3
    write_json(report, tmp_path / "soak.json", minutes=0.8)
    written = json.loads((tmp_path / "soak.json").read_text())
    assert written["run"] == {"minutes": 0.8} and len(written["windows"]) == 4
    assert written["passed"] == report.passed


def _window(index: int, rss: int | None, p99: float | None, five: int = 0) -> Window:
    statuses = {name: 0 for name in STATUS_CLASSES} | {"2xx": 10, "5xx": five}
    return Window(index, 60.0 * (index + 1), 10, statuses, 0, 0, five, p99, p99, ServerSample(rss))


def test_the_goals_judge_the_second_window_against_the_last() -> None:
    flat = [_window(0, 500, 90.0), _window(1, 1000, 100.0), _window(2, 1040, 119.0)]
    assert [goal.passed for goal in goals(flat)] == [True, True, True]
    grown = [_window(0, 500, 90.0), _window(1, 1000, 100.0), _window(2, 1060, 121.0)]
    assert [goal.passed for goal in goals(grown)] == [True, False, False]
    failing = [_window(0, 500, 90.0), _window(1, 1000, 100.0, five=1), _window(2, 1000, 100.0)]
    assert [goal.passed for goal in goals(failing)] == [False, True, True]
    short = flat[:2]
    assert [goal.passed for goal in goals(short)] == [True, None, None]
    assert SoakReport(short, {}, goals(short)).passed
    assert not SoakReport(grown, {}, goals(grown)).passed
    assert [goal.passed for goal in goals([*flat[:2], _window(2, None, None)])][1:] == [None, None]


def test_the_report_names_what_each_unexpected_answer_got() -> None:
    outcomes = [
        Outcome(Planned("json_schema", "q"), 429, 1.0, 1.0),
        Outcome(Planned("chat stream", "q"), 200, 1.0, 1.0, stream_error=True),
        Outcome(Planned("bad key", "q"), 401, 1.0, 1.0),
        Outcome(Planned("bad body", "q"), 422, 1.0, 1.0),
        Outcome(Planned("chat stream", "q", leave=True), 200, 1.0, 1.0, left=True),
    ]
    window = Window.of(0, 60.0, outcomes, ServerSample())
    assert (window.unexpected, window.left, window.stream_errors) == (2, 1, 1)
    assert window.statuses == {"2xx": 2, "4xx": 3, "5xx": 0, "no answer": 0}
    report = SoakReport.of([window], outcomes)
    assert report.unexpected == {"json_schema: 429": 1, "chat stream: error event": 1}
    assert "Unexpected answers: json_schema: 429 (1), chat stream: error event (1)." in (
        format_report(report)
    )
    assert [goal.passed for goal in report.goals] == [False, None, None]


def test_four_clients_send_every_kind_early_and_each_in_its_shares() -> None:
    first = {planned.kind for client in range(4) for planned, _ in zip(plan(client), range(4))}
    assert first == set(KINDS)
    assert any(planned.leave for client in range(4) for planned, _ in zip(plan(client), range(4)))
    for client in range(4):
        sent = [planned.kind for planned, _ in zip(plan(client), range(40))]
        assert set(sent) == set(KINDS)
        assert sent.count("bad key") == sent.count("bad body") == 2
        streams = [p for p, _ in zip(plan(client), range(200)) if p.stream]
        assert sum(p.leave for p in streams) == len(streams) // 5


def test_a_url_without_a_key_is_refused_before_anything_runs() -> None:
    with pytest.raises(SystemExit, match="--api-key"):
        main(["soak", "--url", "http://127.0.0.1:9"])
