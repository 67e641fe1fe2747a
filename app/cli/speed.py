"""`ngrammys speed`: prompt processing and decoding tokens/s, beside llama.cpp's and
transformers' (`service/bench/speed.py`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from app.cli.flags import dataset, engine_config, llama_cpp_model, model_flags
from service.bench import speed
from service.bench.command import UsageError


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        type=dataset,
        required=True,
        help="Spec-Bench question.jsonl (the prompts' text)",
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=list(speed.PROMPT_LENGTHS),
        help="prompt lengths, tokens",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each measurement; the fastest counts"
    )
    model_flags(parser)
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also llama.cpp on the same GGUF and token ids (needs the llama-cpp extra)",
    )
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="also transformers' own float32 forward of the same model (unpacked: its memory too)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        speed.run_command(
            args.model,
            engine_config(args),
            args.dataset,
            args.lengths,
            args.repeats,
            llama_cpp_model(args) if args.llama_cpp else None,
            args.transformers,
            args.json,
        )
    except UsageError as error:
        sys.exit(f"ngrammys speed: {error}")
