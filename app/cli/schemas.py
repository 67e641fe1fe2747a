"""`ngrammys schemas`: an interactive request alone and while hostile JSON schemas arrive
(`service/bench/hostile_schemas.py`), against a server started here unless `--url` names one."""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from app.background import serving_process
from app.cli.flags import model_flags
from app.cli.serve_flags import model_serve_flags
from service.bench import hostile_schemas


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=8.0, help="hostile requests a second")
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="how long the hostile requests arrive"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interactive requests alone (and at least as many under load)",
    )
    parser.add_argument("--url", default=None, help="a running server (default: start one here)")
    model_flags(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server started here stops too
    flags = ["--no-model-tables", "--no-cost-profile", *model_serve_flags(args)]
    server = nullcontext(args.url) if args.url else serving_process(flags)
    hostile_schemas.run_command(server, args.rate, args.seconds, args.repeats, args.json)
