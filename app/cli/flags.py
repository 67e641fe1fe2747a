"""What the measurement commands share: the flags naming the model and how it runs, the engine
settings built from them, and `--dataset`, read as it is parsed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.settings import DEVICE_ROUND_SWITCH, Settings
from service.engine.config import EngineConfig
from service.kernels.packed_linear import QUANTIZATIONS
from service.model.loader import DEFAULT_CACHE_DIR


def model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model directory or .gguf (default: embedded)"
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help=Settings.model_fields["dtype"].description)
    parser.add_argument(
        "--quantization",
        choices=("auto", *QUANTIZATIONS),
        default=Settings.model_fields["quantization"].default,
        help=Settings.model_fields["quantization"].description,
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help=Settings.model_fields["enforce_eager"].description,
    )
    parser.add_argument(
        "--device-round",
        choices=tuple(DEVICE_ROUND_SWITCH),
        default="auto",
        help=Settings.model_fields["device_round"].description,
    )


def engine_config(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """The engine settings of a measurement command, from the flags `model_flags` adds and
    `fields` (what the command decides itself); the queue's fields are the server's alone."""
    return EngineConfig(
        cache_dir=args.cache_dir,
        enforce_eager=args.enforce_eager,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        device_round=DEVICE_ROUND_SWITCH[args.device_round],
        **fields,
    )


def dataset(text: str) -> Path:
    """`--dataset`, read as it is parsed: a missing, unreadable or malformed questions file stops
    the command with a message saying where to get it, before a model loads, not with a
    traceback."""
    from service.bench.specbench import DatasetError, specbench_questions

    path = Path(text)
    try:
        specbench_questions(path)
    except DatasetError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return path


def llama_cpp_model(args: argparse.Namespace) -> Path:
    """`--llama-cpp`: the GGUF llama.cpp decodes, the one the command measures; it compares
    greedy decoding of a GGUF model only."""
    from service.model.loader import embedded_gguf_path

    path = Path(args.model) if args.model else embedded_gguf_path()
    if path.suffix != ".gguf" or getattr(args, "temperature", 0) > 0:
        sys.exit(f"ngrammys {args.command}: --llama-cpp compares greedy decoding of a GGUF model")
    return path
