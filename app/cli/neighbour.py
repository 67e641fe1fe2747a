"""`ngrammys neighbour`: the server beside busy processes, its cost profile and auto vs off
before and after (`service/bench/neighbour.py`), against a server started here unless `--url`
and `--pid` name one."""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from app.background import serving_process
from app.cli.flags import model_flags
from app.cli.serve_flags import model_serve_flags
from service.bench import neighbour


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--neighbours", type=int, default=2, help="busy processes")
    parser.add_argument(
        "--seconds",
        type=float,
        default=120.0,
        help="the neighbours run this long while the server serves, then as long while it is idle",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--url", default=None, help="a running server (default: start one here); needs --pid"
    )
    parser.add_argument(
        "--pid", type=int, default=None, help="the process id of the server at --url"
    )
    model_flags(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> None:
    if args.url and args.pid is None:
        sys.exit(
            "ngrammys neighbour: --url needs --pid, the server's process id (its CPU time is read)"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server started here stops too
    pids = [args.pid]
    # its prompt repeats
    flags = ["--suffix-cache-tokens", "0", "--no-prefix-cache", *model_serve_flags(args)]
    server = nullcontext(args.url) if args.url else serving_process(flags, started=pids.append)
    neighbour.run_command(
        server, lambda: pids[-1], args.neighbours, args.seconds, args.max_tokens, args.json
    )
