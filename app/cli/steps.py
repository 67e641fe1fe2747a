"""`ngrammys steps`: engine steps in process over C requests, off vs auto, and where a step's
time goes (`service/bench/step_bench.py`)."""

from __future__ import annotations

import argparse
import logging

from app.cli.flags import dataset, engine_config, model_flags
from app.settings import Settings
from service.bench import step_bench


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", type=dataset, required=True, help="Spec-Bench question.jsonl")
    parser.add_argument(
        "--per-category", type=int, default=2, help="questions per category to cycle through"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4, 16],
        help="requests decoded together, C",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--k",
        type=int,
        default=Settings.model_fields["spec_k"].default,
        help="auto's maximum drafts",
    )
    parser.add_argument(
        "--w",
        type=int,
        default=Settings.model_fields["spec_w"].default,
        help="auto's maximum depth",
    )
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=step_bench.REQUESTS_PER_SLOT,
        help="requests a run = C x this; C in flight, a new one joining as one ends",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each (C, mode), the order alternating"
    )
    model_flags(parser)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    step_bench.run_command(
        args.model,
        engine_config(args),
        args.dataset,
        args.per_category,
        args.concurrency,
        args.max_new_tokens,
        args.k,
        args.w,
        args.requests_per_slot,
        args.repeats,
    )
