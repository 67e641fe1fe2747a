"""`ngrammys synth`: write a GGUF of a real model's shape with random weights, to measure start
time, memory and speed at that size without a download (`service/bench/random_gguf.py`)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from service.bench.random_gguf import K_M_PRESETS, SCALE_FIELDS, SHAPES, write_random_gguf


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", type=Path, help="the .gguf file to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument(
        "--types",
        choices=[*K_M_PRESETS, *(kind.name for kind in SCALE_FIELDS)],
        default="Q4_K_M",
        help="llama.cpp's Q4_K_M or Q5_K_M mix, or every tensor in one block type",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    write_random_gguf(args.output, SHAPES[args.shape], args.types, args.seed)
