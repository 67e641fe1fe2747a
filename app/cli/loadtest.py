"""`ngrammys loadtest`: concurrent streaming clients against a server, started here unless `--url`
names one: off vs auto on Spec-Bench questions (`service/bench/loadtest.py`), a workload of
long shared prefixes with the prefix cache and without (`service/bench/prefix_workloads.py`), an
agent loop (`service/bench/agent_loop.py`), or a batch job (`service/bench/batch_workload.py`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from app.background import serving_process
from app.cli.flags import dataset, model_flags
from app.cli.serve_flags import loadtest_server_flags
from drafting.suffix import DEFAULT_CAPACITY
from service.bench import agent_loop, batch_workload, loadtest, prefix_workloads
from service.bench.specbench import specbench_questions


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", type=dataset, required=True, help="Spec-Bench question.jsonl")
    parser.add_argument(
        "--per-category", type=int, default=2, help="questions per category to cycle through"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="client counts C"
    )
    parser.add_argument(
        "--requests-per-client", type=int, default=2, help="requests = C x this (at least 4)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each (C, mode), order alternating (off-auto-auto-off); "
        "ratios from their means",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--url", default=None, help="a running server (default: start one here)")
    parser.add_argument(
        "--max-running-requests", type=int, default=64, help="for the server started here"
    )
    parser.add_argument(
        "--max-tokens-per-pass", type=int, default=512, help="for the server started here"
    )
    parser.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        help="for the server started here (default: the server's)",
    )
    parser.add_argument(
        "--prefill-pass-ms",
        type=float,
        default=None,
        help="for the server started here (default: the server's)",
    )
    parser.add_argument(
        "--suffix-cache-tokens",
        type=int,
        default=0,
        help="for the server started here (default 0, off: the load test cycles its questions, and "
        "the shared suffix index would draft a repeated question's earlier greedy answer whole, "
        "favouring whichever mode runs later; give a size to measure that effect)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=loadtest.MODES,
        default=list(loadtest.MODES),
        help="speculation modes to compare (a prefix workload runs the last one)",
    )
    parser.add_argument(
        "--workload",
        choices=("specbench", *prefix_workloads.WORKLOADS, "agent", "batch"),
        default="specbench",
        help="specbench: its questions, off vs auto; chat: conversations behind a long system "
        "prompt, document: questions about one long document, each with the prefix cache and "
        "without; agent: a loop of tool calls through /v1/responses (previous_response_id) and "
        "through chat completions (the whole transcript each turn); batch: a batch job against "
        "the same requests from 16 clients, and 2 interactive clients with a batch running and "
        "without",
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=8,
        help="chat/document: conversations (or clients' question lists)",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=None,
        help="chat/document/agent: turns per conversation (default: 6 "
        "for chat, 4 for document: 32 questions; 8 for agent)",
    )
    parser.add_argument(
        "--lines", type=int, default=500, help="batch: the batch's lines (requests)"
    )
    parser.add_argument(
        "--interactive-requests",
        type=int,
        default=16,
        help="batch: the interactive clients' requests, with the batch running and without",
    )
    model_flags(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument(
        "--png", type=Path, default=None, help="plot tokens/s and p99 ITL against C"
    )


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the table
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server started here stops too
    if args.workload == "batch":
        if args.url:
            sys.exit("ngrammys loadtest: --workload batch starts its own servers; leave out --url")
        batch_workload.run_command(
            lambda: _batch_server(args),
            specbench_questions(args.dataset),
            args.lines,
            args.interactive_requests,
            args.max_tokens,
            args.modes[-1],
            args.json,
        )
        return
    if args.workload == "agent":
        if args.url:
            sys.exit("ngrammys loadtest: --workload agent starts its own servers; leave out --url")
        agent_loop.run_command(
            lambda: serving_process(loadtest_server_flags(args, prefix_cache=True)),
            specbench_questions(args.dataset),
            args.conversations,
            args.turns or agent_loop.DEFAULT_TURNS,
            args.modes[-1],
            args.json,
        )
        return
    if args.workload != "specbench":
        if args.url:
            sys.exit(
                "ngrammys loadtest: --workload chat|document starts its own servers (one with the "
                "prefix cache, one without); leave out --url"
            )
        prefix_workloads.run_command(
            lambda prefix_cache: serving_process(loadtest_server_flags(args, prefix_cache)),
            args.workload,
            args.dataset,
            args.conversations,
            args.turns,
            args.modes[-1],
            args.max_tokens,
            args.json,
        )
        return
    server = nullcontext(args.url) if args.url else serving_process(loadtest_server_flags(args))
    loadtest.run_command(
        server,
        args.url is None,
        args.dataset,
        args.per_category,
        args.concurrency,
        args.requests_per_client,
        args.max_tokens,
        tuple(args.modes),
        args.repeats,
        args.max_running_requests,
        args.json,
        args.png,
    )


@contextmanager
def _batch_server(args: argparse.Namespace) -> Iterator[str]:
    """A server of the batch workload: a store of its own, the prefix cache, and the suffix
    index at its default size (the batch's lines teach it what their answers look like)."""
    with tempfile.TemporaryDirectory(prefix="ngrammys-batches-") as store:
        flags = loadtest_server_flags(args, prefix_cache=True) + [
            "--suffix-cache-tokens",
            str(DEFAULT_CAPACITY),
            "--batch-store",
            store,
            "--max-waiting",
            str(max(64, batch_workload.CLIENT_CONCURRENCY * 2)),
        ]
        with serving_process(flags) as base:
            yield base
