"""The load test against a real server: counts, per-token latencies, the report and the plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.background import serving
from app.cli import build_parser, loadtest_server_flags, main
from app.main import create_app
from app.settings import Settings
from service.bench import loadtest, prefix_workloads
from service.bench.specbench import Question
from tests.helpers.bench import write_dataset
from tests.helpers.http import wait_ready

QUESTIONS = [
    Question("1", "writing", "Write one sentence about the sea."),
    Question("2", "coding", "Write a Python function that adds two numbers."),
]


def test_loadtest_counts_every_token_and_reports_both_modes(embedded, tmp_path) -> None:
    settings = Settings(model_tables=False, cost_profile=False, max_running_requests=4)
    with serving(create_app(settings, loader=lambda _: embedded)) as base:
        wait_ready(base)
        results = loadtest.run_loadtest(
            base, QUESTIONS, [1, 3], requests_per_client=2, max_tokens=8, progress=lambda row: None
        )
    assert [(r.concurrency, r.mode) for r in results] == [
        (1, "off"),
        (1, "auto"),
        (3, "auto"),
        (3, "off"),
    ]
    for result in results:
        assert len(result.timings) == result.requests == max(result.concurrency * 2, 4)
        for timing in result.timings:
            assert 1 <= timing.tokens <= 8 and len(timing.itl) == timing.tokens - 1
            assert 0 < timing.ttft <= timing.seconds
        summary = result.summary()
        assert (
            summary["output_tokens_per_second"] > 0
            and summary["itl_p99_ms"] >= summary["itl_p50_ms"]
        )
    assert loadtest.format_table(results).count("\n") == len(results) + 1
    loadtest.write_plot(results, tmp_path / "plot.png", "test")
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_repeats_alternate_the_modes_and_the_comparison_averages_them(embedded) -> None:
    settings = Settings(model_tables=False, cost_profile=False, max_running_requests=4)
    with serving(create_app(settings, loader=lambda _: embedded)) as base:
        wait_ready(base)
        results = loadtest.run_loadtest(
            base,
            QUESTIONS[:1],
            [1, 2],
            requests_per_client=2,
            max_tokens=4,
            progress=lambda row: None,
            repeats=2,
        )
    assert [(r.concurrency, r.mode, r.repeat) for r in results] == [
        (1, "off", 0),
        (1, "auto", 0),
        (1, "auto", 1),
        (1, "off", 1),
        (2, "auto", 0),
        (2, "off", 0),
        (2, "off", 1),
        (2, "auto", 1),
    ]
    means = loadtest.mean_tokens_per_second(results)
    for (concurrency, mode), mean in means.items():
        runs = [
            r.output_tokens / r.seconds
            for r in results
            if (r.concurrency, r.mode) == (concurrency, mode)
        ]
        assert len(runs) == 2 and mean == pytest.approx(sum(runs) / 2)
    table = loadtest.format_comparison(results).splitlines()
    assert len(table) == 4 and table[2].startswith("| 1 | ")
    assert table[2].endswith(f"| {means[(1, 'auto')] / means[(1, 'off')]:.2f}x |")


def run_loadtest(
    tiny_served, tmp_path: Path, rows: list[tuple[str, str]], flags: list[str]
) -> dict[str, Any]:
    """`ngrammys loadtest` with `flags` on the questions `rows` (category, text), its server a
    child process serving the tiny model; the JSON report."""
    model_dir = tmp_path / "model"
    tiny_served.model.save_pretrained(model_dir)
    tiny_served.tokenizer.save_pretrained(model_dir)
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text(
        "\n".join(
            json.dumps({"question_id": str(i), "category": category, "turns": [text]})
            for i, (category, text) in enumerate(rows)
        )
    )
    report = tmp_path / "report.json"
    cache = str(tmp_path / "cache")
    main(
        ["loadtest", "--dataset", str(dataset), *flags, "--model", str(model_dir)]
        + ["--cache-dir", cache, "--json", str(report)]
    )
    return json.loads(report.read_text())


def test_the_loadtest_command_runs_its_own_server_process(tiny_served, tmp_path) -> None:
    """`ngrammys loadtest` without --url: a child `ngrammys serve`, warmed up, then stopped."""
    rows = [(q.category, q.text) for q in QUESTIONS]
    flags = ["--concurrency", "1", "2", "--max-tokens", "4"]
    levels = run_loadtest(tiny_served, tmp_path, rows, flags)["levels"]
    assert [(level["concurrency"], level["mode"]) for level in levels] == [
        (1, "off"),
        (1, "auto"),
        (2, "auto"),
        (2, "off"),
    ]
    assert all(level["requests"] == 4 and level["tokens_per_pass"] >= 1 for level in levels)
    assert all(level["drafted_per_pass"] == 0 for level in levels if level["mode"] == "off")


def test_the_loadtest_server_keeps_no_suffix_index_unless_asked(tmp_path) -> None:
    """The load test cycles its questions: a shared suffix index would draft a repeated
    question's earlier greedy answer whole, so by default the server it starts has none."""
    dataset = write_dataset(tmp_path)  # `--dataset` is read as it is parsed

    def flags(*extra: str) -> list[str]:
        return loadtest_server_flags(
            build_parser().parse_args(["loadtest", "--dataset", dataset, *extra])
        )

    default = flags()
    assert default[default.index("--suffix-cache-tokens") + 1] == "0"
    asked = flags("--suffix-cache-tokens", "100000")
    assert asked[asked.index("--suffix-cache-tokens") + 1] == "100000"
    # nor a prefix cache: the mode that runs later would find the earlier one's prompts cached
    assert "--no-prefix-cache" in default
    assert "--no-prefix-cache" not in loadtest_server_flags(
        build_parser().parse_args(["loadtest", "--dataset", dataset, "--workload", "chat"]),
        prefix_cache=True,
    )


def test_the_prefix_workloads_run_with_the_cache_and_without_on_servers_of_their_own(
    tiny_served, tmp_path
) -> None:
    """`ngrammys loadtest --workload chat`: a server with the prefix cache and one without,
    the same conversations (later turns re-send the earlier answers), the cache's hit rate."""
    rows = [
        ("rag", "Passage about rivers and the sea. " * 40),
        ("summarization", "An article on tides. " * 60),
        ("qa", "Why is the sea salty?"),
        ("qa", "What makes waves?"),
        ("stem", "What is a tide?"),
    ]
    flags = ["--workload", "chat", "--conversations", "2", "--turns", "3", "--max-tokens", "4"]
    report = run_loadtest(tiny_served, tmp_path, rows, [*flags, "--modes", "off"])
    cached, uncached = report["results"]
    assert (cached["setting"], uncached["setting"]) == ("cache", "no cache")
    assert cached["requests"] == uncached["requests"] == 6
    assert (
        cached["hit_rate"] > 0.5 and uncached["hit_rate"] is None
    )  # a server without the cache exports none
    assert 0 <= cached["same_answers"] == uncached["same_answers"] <= 6


def test_the_chat_workload_resends_the_conversation_and_the_document_one_the_document() -> None:
    questions = [
        Question("1", "rag", "notes " * 2000),
        Question("2", "summarization", "article " * 2000),
        *(Question(str(i), "qa", f"question {i}?") for i in range(3, 6)),
    ]
    chat = prefix_workloads.build("chat", questions, conversations=2, turns=3)
    assert len(chat.conversations) == chat.clients == 2 and all(
        len(c) == 3 for c in chat.conversations
    )
    assert chat.multi_turn and len(chat.system) <= prefix_workloads.SYSTEM_CHARS + 100
    document = prefix_workloads.build("document", questions, conversations=2, turns=3)
    assert [len(c) for c in document.conversations] == [1] * 6 and not document.multi_turn
    assert document.clients == prefix_workloads.DOCUMENT_CLIENTS and "article" in document.system
    with pytest.raises(ValueError, match="summarization"):
        prefix_workloads.build("document", [questions[0], *questions[2:]], conversations=1, turns=1)
    with pytest.raises(ValueError, match="short questions"):
        prefix_workloads.build("chat", questions[:2], conversations=1, turns=1)


def test_the_agent_workload_runs_the_loop_through_responses_and_through_chat(
    tiny_served, tmp_path
) -> None:
    """`ngrammys loadtest --workload agent`: the same tool-calling loop continued by
    `previous_response_id` and resent whole on chat completions, each on a server of its own."""
    rows = [("rag", "Rivers flow to the sea. " * 3), ("qa", "Why is the sea salty?")]
    flags = ["--workload", "agent", "--conversations", "2", "--turns", "2", "--modes", "off"]
    responses, chat = run_loadtest(tiny_served, tmp_path, rows, flags)["results"]
    assert (responses["setting"], chat["setting"]) == ("responses", "chat")
    assert responses["turns"] == chat["turns"] == 4  # a call, then the answer
    # a later turn's prompt starts as the earlier one did, either way
    assert responses["hit_rate"] > 0 and chat["hit_rate"] > 0
    assert 0 <= responses["same_answers"] == chat["same_answers"] <= 4


def test_the_batch_workload_runs_a_batch_a_client_and_interactive_clients_beside_it(
    tiny_served, tmp_path
) -> None:
    """`ngrammys loadtest --workload batch`: the batch and the same requests from clients, and
    interactive clients with a batch running and without, each on a server of its own."""
    rows = [
        ("extraction", "Extract the names: Ada met Alan in London."),
        ("summarization", "Summarize: the tide rises twice a day. " * 4),
        ("qa", "Why is the sea salty?"),
        ("writing", "Write a line about the sea."),
    ]
    flags = ["--workload", "batch", "--lines", "6", "--interactive-requests", "2"]
    report = run_loadtest(tiny_served, tmp_path, rows, [*flags, "--max-tokens", "4"])
    assert report["batch"]["lines"] == report["client"]["requests"] == 6
    assert (
        report["batch"]["tokens_per_second"] > 0 and report["batch"]["tokens_per_pass_first"] >= 1
    )
    assert report["interactive"]["requests"] == report["interactive_with_batch"]["requests"] == 2
    assert report["interactive_with_batch"]["batch_lines_meanwhile"] >= 0
