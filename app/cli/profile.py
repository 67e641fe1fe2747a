"""`ngrammys profile`: the forward pass's cost over tree size and context length
(`service/bench/cost_profile.py`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from app.cli.flags import engine_config, model_flags
from service.bench import cost_profile


def add_flags(parser: argparse.ArgumentParser) -> None:
    model_flags(parser)
    parser.add_argument(
        "--remeasure",
        action="store_true",
        help="ignore the saved profile (the remedy when auto mode misjudges costs: run it on an "
        "idle machine; a profile failing validation is never saved)",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="build --model's architecture (its config.json alone) with random weights: the cost "
        "curves of a model size whose weights are not here (a pass costs the same)",
    )
    parser.add_argument(
        "--png", type=Path, default=None, help="write the (k, w) slowdown heatmap here"
    )
    parser.add_argument(
        "--context-length", type=int, default=256, help="context length of the heatmap"
    )


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.random_weights and not args.model:
        sys.exit(
            "ngrammys profile: --random-weights needs --model, "
            "a directory with the model's config.json"
        )
    cost_profile.run_command(
        args.model,
        engine_config(args),
        args.random_weights,
        args.remeasure,
        args.png,
        args.context_length,
    )
