"""`ngrammys soak`: minutes of mixed traffic (good requests of every kind, wrong keys, bad bodies,
clients leaving mid-stream) against a server with an API key, started here unless `--url` names
one; a row per window, then the goals and their verdict (`service/bench/soak.py`). Exits 1 when
a goal fails."""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from app.background import serving_process
from app.cli.flags import model_flags
from app.cli.serve_flags import model_serve_flags
from service.bench import soak


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the run")
    parser.add_argument(
        "--window-seconds", type=float, default=300.0, help="one row of the report per window"
    )
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=32, help="per request (and choice)")
    parser.add_argument(
        "--url",
        default=None,
        help="a running server, started with --api-keys (default: "
        "start one here, with a key of its own)",
    )
    parser.add_argument("--api-key", default=None, help="a key of the --url server")
    model_flags(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the table
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server started here stops too
    if args.url and not args.api_key:
        sys.exit("ngrammys soak: --url needs --api-key (the soak sends wrong keys too)")
    key = args.api_key or secrets.token_urlsafe(16)
    server = (
        nullcontext(args.url)
        if args.url
        else serving_process(["--api-keys", key, *model_serve_flags(args)])
    )
    passed = soak.run_command(
        server,
        key,
        args.minutes,
        args.window_seconds,
        args.clients,
        args.max_tokens,
        args.json,
    )
    if not passed:
        sys.exit(1)
