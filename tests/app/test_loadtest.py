"""The load test against a real server: counts, per-token latencies, the report and the plot."""

from __future__ import annotations

from app import loadtest
from app.background import serving
from app.main import create_app
from app.settings import Settings
from service.bench import Question
from tests.app.test_http import wait_ready

QUESTIONS = [Question("1", "writing", "Write one sentence about the sea."),
             Question("2", "coding", "Write a Python function that adds two numbers.")]


def test_loadtest_counts_every_token_and_reports_both_modes(embedded, tmp_path) -> None:
    settings = Settings(model_tables=False, cost_profile=False, max_running_requests=4)
    with serving(create_app(settings, loader=lambda _: embedded)) as base:
        wait_ready(base)
        results = loadtest.run_loadtest(base, QUESTIONS, [1, 3], requests_per_client=2, max_tokens=8,
                                        progress=lambda row: None)
    assert [(r.concurrency, r.mode) for r in results] == [(1, "off"), (1, "auto"), (3, "auto"), (3, "off")]
    for result in results:
        assert len(result.timings) == result.requests == max(result.concurrency * 2, 4)
        for timing in result.timings:
            assert 1 <= timing.tokens <= 8 and len(timing.itl) == timing.tokens - 1
            assert 0 < timing.ttft <= timing.seconds
        summary = result.summary()
        assert summary["output_tokens_per_second"] > 0 and summary["itl_p99_ms"] >= summary["itl_p50_ms"]
    assert loadtest.format_table(results).count("\n") == len(results) + 1
    loadtest.write_plot(results, tmp_path / "plot.png", "test")
    assert (tmp_path / "plot.png").stat().st_size > 1000
