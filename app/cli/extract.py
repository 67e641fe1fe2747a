"""`ngrammys extract`: JSON extraction, structured output vs free text, plain vs speculative
(`service/bench/structured.py`)."""

from __future__ import annotations

import argparse
import logging

from app.cli.flags import engine_config, model_flags
from service.bench import structured


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=30, help="profiles to extract from")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8, help="drafts (auto's maximum)")
    parser.add_argument("--w", type=int, default=8, help="draft depth (auto's maximum)")
    model_flags(parser)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    structured.run_command(
        args.model, engine_config(args), args.documents, args.max_new_tokens, args.k, args.w
    )
