"""`ngrammys serve`, `worker`, `prepare`, `bench`, `extract`, `speed`, `profile`, `steps`,
`loadtest`, `neighbour`, `soak`, `schemas` and `synth`.

A module a command (`worker` shares `serve`'s flags): each adds its flags (`add_flags`) and runs
it (`run`); the measurement commands' work is in `service/bench/`. `main` imports only the
module of the command it runs, so `serve` loads no measurement code and no load client.
`serve` flags are generated from the `Settings` fields, so a flag, its `NGRAMMYS_*`
variable and its documentation never drift apart.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from app.cli.serve import serve_settings
from app.cli.serve_flags import loadtest_server_flags

__all__ = ["COMMANDS", "build_parser", "loadtest_server_flags", "main", "serve_settings"]

COMMANDS = {  # name: help
    "serve": "serve the OpenAI-compatible HTTP API",
    "worker": (
        "a tensor-parallel rank other than 0: a pod's first starts the pod's others "
        "(LeaderWorkerSet)"
    ),
    "prepare": "read the model and compute its draft tables into the cache (for images)",
    "bench": "plain vs speculative decoding on Spec-Bench prompts",
    "extract": "JSON extraction: structured output vs free text, plain vs speculative",
    "speed": "prompt processing and decoding tokens/s, beside llama.cpp's and transformers'",
    "profile": "measure forward-pass cost over tree size and context length",
    "steps": "engine steps in process over C requests: off vs auto, where a step's time goes",
    "loadtest": "concurrent streaming clients: throughput and latency, off vs auto",
    "neighbour": "the server beside busy processes: its cost profile, auto vs off before and after",
    "soak": "minutes of mixed traffic: errors, memory and latency window by window, and goals",
    "schemas": "an interactive request alone and while hostile JSON schemas arrive",
    "synth": "a random-weight GGUF of a real model's shape (1B, 7B): measure without a download",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command with its flags; with `only`, that command's flags alone (every command is
    listed, so the help and the errors name them all; no flags for a name no command has)."""
    parser = argparse.ArgumentParser(prog="ngrammys", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS.items():
        command = commands.add_parser(name, help=text)
        if only in (None, name):
            module = import_module(f"app.cli.{name}")
            module.add_flags(command)
            command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(only=argv[0] if argv else "").parse_args(argv)
    args.run(args)
